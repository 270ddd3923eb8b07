"""The local hit a KV connector's scheduler takes (every supported vLLM release's
``KVCacheManager.get_computed_blocks_for_connector``), served by the core in one crossing.

vLLM's scheduler asks it instead of ``get_computed_blocks`` when the connector sets
``supports_divergent_local_hybrid_hits`` (NixlConnector and its variants, a MultiConnector
whose children all do). With Mamba layers, several KV cache groups and a full-attention group,
vLLM's manager looks each group up on its own (``find_longest_cache_hit_per_group``): under
block pressure the groups' hits may differ, full attention holding a deeper prefix than a
lagging Mamba group. The hit reported is full attention's, with each group's own blocks (so
their lengths may differ), no shared-prefix boundary, and ``hit_diverged`` when some group
lags; the scheduler then adopts it only when the connector loads the rest, and otherwise asks
``get_computed_blocks`` again. When some group hits deeper than full attention (its
full-attention blocks were evicted), or without Mamba layers, the result is
``get_computed_blocks``' (its "full" report-mode events included) and ``hit_diverged`` is
False. Like ``get_computed_blocks``, the lookup touches nothing and records no statistics:
the hit's touch (and its residency-metrics calls) is ``allocate_slots``', the prefix-cache
stats the scheduler's.

Cost: one crossing (the core's search, O(blocks scanned)), the same as ``get_computed_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from hybrid_alloc.vllm import compat

if TYPE_CHECKING:
    from hybrid_alloc.vllm.state import ManagerView

__all__ = ["local_hit_for_connector"]


def local_hit_for_connector(
    mgr: ManagerView, request: Request, max_cache_hit_length: int | None
) -> tuple[KVCacheBlocks, int, int, bool]:
    """``mgr.get_computed_blocks_for_connector(request, max_cache_hit_length)``: ``(blocks,
    local computed tokens, shared-prefix boundary, hit_diverged)`` (see the module)."""
    if not mgr.prefix_cache_lookup_enabled(request):
        return mgr.empty_kv_cache_blocks, 0, 0, False
    max_cache_hit_length = compat.max_cache_hit_length(request, max_cache_hit_length)
    st = mgr._lookup_state(request)
    if mgr._pending_pins:
        mgr._pin_from(request)
    hit, uncached, per_group, groups = mgr._alloc.get_computed_blocks_for_connector(
        st.handle, max_cache_hit_length, block_hashes=request.block_hashes, as_buffer=True
    )
    if per_group is None:
        return *mgr._reconciled_hit(request, st, hit, uncached, groups), False
    return mgr._hit_blocks(st, groups), hit, 0, min(per_group) < hit
