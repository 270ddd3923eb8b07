"""What the installed vLLM offers, read once at import: the one place the adapter tells the
supported releases (0.32.0, 0.33.0) apart.

Each capability has one feature probe (an import, an attribute, a signature, the names a
vLLM function's code reads, or what a two-block ``BlockPool`` does); nothing compares a
version string. The rest of
``hybrid_alloc.vllm`` reads the constants below and never probes vLLM itself.

Cost: a few ``inspect.signature`` calls at import; nothing afterwards.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1 import kv_cache_interface as _vllm_kvi
from vllm.v1.core import kv_cache_coordinator as _vllm_kvc
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.core import kv_cache_utils as _vllm_kvu

__all__ = [
    "EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE",
    "LOOKAHEAD_HASHES",
    "MAMBA_ALIGN_REKEYS_CACHED_TAIL",
    "TOUCH_REPORTS_NULL",
    "TRIM_NULL_HEAD",
    "VllmKVCacheManager",
    "config_hash_lookahead_tokens",
    "generate_lookahead_extra_keys",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
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
