"""The vLLM general plugin (entry point ``hybrid_alloc`` in ``vllm.general_plugins``).

vLLM calls :func:`register` once in every process it starts (API server, engine core,
workers), under fork and spawn. With ``HYBRID_ALLOC`` unset or ``0`` it returns at once
and imports nothing. With ``HYBRID_ALLOC=1`` it makes vLLM's scheduler build
:class:`hybrid_alloc.vllm.manager.HybridKVCacheManager`:

- it assigns ``vllm.v1.core.sched.scheduler.KVCacheManager``: the scheduler module bound
  that name at import (``from vllm.v1.core.kv_cache_manager import KVCacheManager``), so
  patching ``vllm.v1.core.kv_cache_manager.KVCacheManager`` alone would change nothing;
- it wraps ``Scheduler.__init__`` to let the manager see the ``VllmConfig`` (a KV
  connector there means falling back to vLLM's own manager).

The patch is applied in process 0 too, so an engine core forked from it inherits it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

ENV_FLAG = "HYBRID_ALLOC"
_applied = False


def enabled() -> bool:
    """Whether ``HYBRID_ALLOC`` asks for the native manager."""
    return os.environ.get(ENV_FLAG, "0").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    """The plugin entry point: cheap and side-effect free unless the flag is set."""
    if enabled():
        apply()


def apply() -> None:
    """Installs the native manager into vLLM's scheduler (idempotent)."""
    global _applied
    if _applied:
        return
    from vllm.v1.core.sched import scheduler as sched_mod

    from hybrid_alloc.vllm import manager

    sched_mod.KVCacheManager = manager.HybridKVCacheManager  # type: ignore[misc,assignment]
    original = sched_mod.Scheduler.__init__
    if not getattr(original, "_hybrid_alloc_wrapped", False):

        @functools.wraps(original)
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            previous = manager.current_vllm_config
            manager.current_vllm_config = vllm_config
            try:
                original(self, vllm_config, *args, **kwargs)
            finally:
                manager.current_vllm_config = previous

        __init__._hybrid_alloc_wrapped = True  # type: ignore[attr-defined]
        sched_mod.Scheduler.__init__ = __init__  # type: ignore[method-assign]
    _applied = True


def remove() -> None:
    """Undoes :func:`apply` (tests)."""
    global _applied
    from vllm.v1.core.sched import scheduler as sched_mod

    from hybrid_alloc.vllm import manager

    sched_mod.KVCacheManager = manager.VllmKVCacheManager  # type: ignore[misc]
    init = sched_mod.Scheduler.__init__
    if getattr(init, "_hybrid_alloc_wrapped", False):
        sched_mod.Scheduler.__init__ = init.__wrapped__  # type: ignore[attr-defined,method-assign]
    _applied = False
