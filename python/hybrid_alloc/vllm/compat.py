"""What the installed vLLM offers, read once at import: the one place the adapter tells the
supported releases (:mod:`hybrid_alloc.vllm.releases`) apart.

Each capability has one feature probe (an import, an attribute, a signature, the names a
vLLM function's code reads, or what a two-block ``BlockPool`` does); nothing compares a
version string. The rest of
``hybrid_alloc.vllm`` reads the constants below and never probes vLLM itself.

Cost: a few ``inspect.signature`` calls at import; :func:`missing_reads` reads three classes'
attributes (and their ``__init__``'s bytecode) at each manager construction, never on a call.
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1 import kv_cache_interface as _vllm_kvi
from vllm.v1 import request as _vllm_request
from vllm.v1.core import block_pool as _vllm_bp
from vllm.v1.core import kv_cache_coordinator as _vllm_kvc
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.core import kv_cache_utils as _vllm_kvu

__all__ = [
    "EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE",
    "FREE_BLOCKS_EVICT_FIRST",
    "LOOKAHEAD_HASHES",
    "NUM_CACHED_TOKENS",
    "PREFIX_CACHE_HIT_LIMIT",
    "MAMBA_ALIGN_REKEYS_CACHED_TAIL",
    "TOUCH_REPORTS_NULL",
    "TRIM_NULL_HEAD",
    "VllmKVCacheManager",
    "config_hash_lookahead_tokens",
    "generate_lookahead_extra_keys",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "KV_CACHE_CONFIG_READS",
    "REQUEST_READS",
    "VLLM_CONFIG_READS",
    "max_cache_hit_length",
    "missing_reads",
    "prefix_cache_lookup_enabled",
]

# The vLLM class the adapter replaces, captured before the plugin patches anything: the
# fallback builds it, and its signature says which constructor arguments exist.
VllmKVCacheManager: type[Any] = _vllm_kvm.KVCacheManager


def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


# Lookahead block hashes (0.33): with EAGLE/MTP and prefix caching each block is hashed
# together with the next L tokens instead of dropping the last block; ``BlockStored`` then
# carries ``lookahead_token_ids``. Probe: the manager's ``num_hash_lookahead_tokens`` argument.
LOOKAHEAD_HASHES: bool = "num_hash_lookahead_tokens" in _parameters(VllmKVCacheManager)

# The extra keys of a block hashed with lookahead tokens (0.33; None without).
generate_lookahead_extra_keys: Callable[..., Any] | None = getattr(
    _vllm_kvu, "generate_lookahead_block_hash_extra_keys", None
)

# 0.33: a group flagged ``is_eagle_group`` drops its last hit block only with ``use_eagle``
# (the coordinator keeps those groups apart as ``drop_eagle_group_ids``); on 0.32 a flagged
# group always drops. Probe: the names the coordinator's constructor assigns.
EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE: bool = "drop_eagle_group_ids" in getattr(
    getattr(_vllm_kvc.KVCacheCoordinator.__init__, "__code__", None), "co_names", ()
)

# 0.33: ``pop_blocks_for_free`` returns each group's blocks without its leading nulls.
TRIM_NULL_HEAD: bool = hasattr(_vllm_kvu, "trim_null_head")

# Mamba "align": 0.32 keys the prompt's checkpoint state block again even when it is keyed
# already (and counts it cached this step); 0.33 skips such a block. The rule has no name
# of its own to probe: the same 0.33 change made the prompt's checkpoint position take the
# lookahead tokens, so the probe is ``get_mamba_prefill_checkpoint_position``'s signature.
MAMBA_ALIGN_REKEYS_CACHED_TAIL: bool = "num_hash_lookahead_tokens" not in _parameters(
    getattr(_vllm_kvi, "get_mamba_prefill_checkpoint_position", lambda: None)
)


def _touch_reports_null() -> bool:
    """Whether ``BlockPool.touch`` reports a hit's null block to the metrics collector."""
    from vllm.v1.core.block_pool import BlockPool

    seen: list[int] = []

    class _Collector:
        def on_block_accessed(self, block: Any) -> None:
            seen.append(block.block_id)

    try:
        pool = BlockPool(2, True, 16, metrics_collector=_Collector())
        pool.touch([pool.null_block])
    except Exception:  # noqa: BLE001 - a guess costs nothing: the collector ignores the null block
        return False
    return bool(seen)


# Residency metrics: 0.32's ``BlockPool.touch`` calls ``on_block_accessed`` on each block of
# a hit, the null block included; 0.33 skips the null block. The collector never samples the
# null block, so only the call sequence differs. Probe: a two-block pool touching it.
TOUCH_REPORTS_NULL: bool = _touch_reports_null()

# KV cache planning moved to its own module in 0.33.
try:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

_CONFIG_HASH_LOOKAHEAD: bool = hasattr(VllmConfig, "num_hash_lookahead_tokens")


def config_hash_lookahead_tokens(vllm_config: Any) -> int:
    """The lookahead tokens each block hash covers for ``vllm_config`` (0.33; 0 on 0.32)."""
    return int(vllm_config.num_hash_lookahead_tokens) if _CONFIG_HASH_LOOKAHEAD else 0


# The prefix-cache hit limit (0.34): ``Request.prefix_cache_hit_limit`` (0: no lookup, N: a hit
# of at most N tokens, None: unbounded) replaces ``Request.skip_reading_prefix_cache``, and
# both lookups bound the hit by ``request.get_max_cache_hit_length(bound)``. Probe: that method.
PREFIX_CACHE_HIT_LIMIT: bool = callable(getattr(_vllm_request.Request, "get_max_cache_hit_length", None))

if PREFIX_CACHE_HIT_LIMIT:

    def prefix_cache_lookup_enabled(request: Any) -> bool:
        """Whether ``request`` may read the prefix cache (prefix caching itself aside)."""
        return request.prefix_cache_hit_limit != 0

    def max_cache_hit_length(request: Any, bound: int | None) -> int:
        """The longest hit ``request`` may take within ``bound`` (``None``: no bound but the
        request's own): 0.34's ``request.get_max_cache_hit_length(bound)``."""
        return request.get_max_cache_hit_length(bound)

else:

    def prefix_cache_lookup_enabled(request: Any) -> bool:
        """Whether ``request`` may read the prefix cache (prefix caching itself aside)."""
        return not request.skip_reading_prefix_cache

    def max_cache_hit_length(request: Any, bound: int | None) -> int:
        """The longest hit ``request`` may take within ``bound``: ``bound``, or
        ``request.num_tokens - 1`` without one (0.32, 0.33)."""
        return request.num_tokens - 1 if bound is None else bound


# ``KVCacheManager.get_num_cached_tokens(request)`` (0.34): the pure probe cache-aware
# admission (``--cache-aware-admission-window``) asks of waiting requests. Probe: the method.
NUM_CACHED_TOKENS: bool = hasattr(VllmKVCacheManager, "get_num_cached_tokens")

# ``BlockPool.free_blocks(ordered_blocks, evict_first=False)`` (0.34). Probe: its signature.
FREE_BLOCKS_EVICT_FIRST: bool = "evict_first" in _parameters(_vllm_bp.BlockPool.free_blocks)


# Every attribute and method the adapter (and the binding's ``FastAllocate``) reads on vLLM's
# objects. A release that lacks one would fail inside ``Scheduler.schedule()``, after
# construction; :func:`missing_reads` finds it at construction, and the adapter falls back.
REQUEST_READS: tuple[str, ...] = (
    "request_id",
    "block_hashes",
    "num_tokens",
    "num_computed_tokens",
    "num_in_flight_tokens",
    "num_prompt_tokens",
    "num_preemptions",
    "priority",
    "status",
    "shared_prefix_boundary",
    "prompt_token_ids",
    "all_token_ids",
    "lora_request",
    "session_id",
) + (
    ("prefix_cache_hit_limit", "get_max_cache_hit_length") if PREFIX_CACHE_HIT_LIMIT else ("skip_reading_prefix_cache",)
)
KV_CACHE_CONFIG_READS: tuple[str, ...] = (
    "num_blocks",
    "kv_cache_groups",
    "needs_kv_cache_zeroing",
    "prefix_cache_retention_interval",
)
# The scheduler's ``VllmConfig`` (read with a default where an older release lacks it:
# ``num_hash_lookahead_tokens``); the adapter reads nothing of ``SchedulerConfig``.
VLLM_CONFIG_READS: tuple[str, ...] = ("kv_transfer_config",)


def _names(cls: type) -> frozenset[str]:
    """What an instance of ``cls`` has: its class attributes (methods, properties, slots),
    its dataclass fields, and the attributes its ``__init__`` (and a dataclass's
    ``__post_init__``) assign."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    for init in ("__init__", "__post_init__"):
        fn = getattr(cls, init, None)
        if fn is None or getattr(fn, "__code__", None) is None:
            continue
        try:
            names.update(i.argval for i in dis.get_instructions(fn) if i.opname == "STORE_ATTR")
        except Exception:  # noqa: BLE001 - an unreadable __init__ adds no names
            pass
    return frozenset(names)


def missing_reads(
    request_cls: type | None = None, kv_cache_config_cls: type | None = None, vllm_config_cls: type | None = None
) -> list[str]:
    """The attributes the adapter reads that the installed vLLM's ``Request``,
    ``KVCacheConfig`` or ``VllmConfig`` do not have (``Class.name`` each; empty when all are
    there). The classes default to the installed vLLM's; tests pass stand-ins."""
    missing: list[str] = []
    checks: Iterable[tuple[type, tuple[str, ...]]] = (
        (request_cls or _vllm_request.Request, REQUEST_READS),
        (kv_cache_config_cls or _vllm_kvi.KVCacheConfig, KV_CACHE_CONFIG_READS),
        (vllm_config_cls or VllmConfig, VLLM_CONFIG_READS),
    )
    for cls, reads in checks:
        have = _names(cls)
        missing.extend(f"{cls.__name__}.{n}" for n in reads if n not in have)
    return missing
