"""The vLLM V1 integration, for the supported vLLM releases (:mod:`hybrid_alloc.vllm.releases`).

- :mod:`hybrid_alloc.vllm.releases`: the one list of supported releases (the plugin, the
  scripts, the docs and the tests read it, or a test checks their copy).
- :mod:`hybrid_alloc.vllm.plugin`: the ``vllm.general_plugins`` entry point; with
  ``HYBRID_ALLOC=1`` it makes vLLM's scheduler build :class:`HybridKVCacheManager`.
- :mod:`hybrid_alloc.vllm.manager`: the ``KVCacheManager``-compatible adapter over the
  native core, and the fallback to vLLM's own manager for configurations the core does
  not serve.
- :mod:`hybrid_alloc.vllm.pages`: two-level pages for state-space hybrids
  (``HYBRID_ALLOC_PAGES=two-level``): the switch, and the KV cache configuration it schedules.

vLLM's real ``Scheduler`` built without a GPU, for the bench and the tests, is
:mod:`hybrid_alloc.bench.offline`.

Importing this package imports nothing else: vLLM's entry point loads
``hybrid_alloc.vllm.plugin`` in every process, also with the plugin off. The names below
import the adapter (and vLLM) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager, native_config_or_reason

__all__ = ["HybridKVCacheManager", "native_config_or_reason"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hybrid_alloc.vllm import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
