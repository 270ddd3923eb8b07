"""The parts of vLLM's manager that callers reach through it: ``block_pool``,
``coordinator`` and ``coordinator.single_type_managers[g]``, each with the attributes and
methods vLLM's scheduler, connectors and stats read, served by the manager's native core.

Cost: each method is one crossing into the core (`find_longest_cache_hit_per_group`, off the
scheduler's path, three); construction is O(groups).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec

from hybrid_alloc.vllm.blocks import NativeBlock

if TYPE_CHECKING:
    from hybrid_alloc.vllm.state import ManagerView

__all__ = ["NativeBlockPool", "NativeCoordinator", "NativeSingleTypeManager"]


class NativeBlockPool:
    """The ``block_pool`` attributes and methods the scheduler reaches through."""

    def __init__(self, mgr: ManagerView, hash_block_size: int, num_blocks: int) -> None:
        self._mgr = mgr
        self._alloc = mgr._alloc
        self.hash_block_size = hash_block_size
        self.num_gpu_blocks = num_blocks
        self.enable_caching = mgr.enable_caching
        self.num_hash_lookahead_tokens = mgr.num_hash_lookahead_tokens
        self.null_block = NativeBlock(self._alloc, 0)

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """vLLM's ``BlockPool.free_blocks``. ``evict_first`` (0.34; its only caller is the
        SimpleCPUOffload connector's manager, which falls back) queues the freed blocks at the
        front of the free queue instead of the back, as vLLM's."""
        ids = [b.block_id for b in ordered_blocks]
        if evict_first:
            self._alloc.free_block_ids(ids, evict_first=True)
        else:
            self._alloc.free_block_ids(ids)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[NativeBlock] | None:
        """vLLM's ``BlockPool.get_cached_block`` (the routed-experts auxiliary-output
        connector asks it): the first cached block for ``block_hash`` in each group, or
        ``None`` on a miss in any group."""
        ids = self._alloc.get_cached_block(block_hash, list(kv_cache_group_ids))
        return None if ids is None else [NativeBlock(self._alloc, b) for b in ids]

    def get_num_free_blocks(self) -> int:
        return self._alloc.num_free_blocks

    def get_usage(self) -> float:
        return self._alloc.usage

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._mgr.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self._mgr.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self._mgr.take_events()


class NativeSingleTypeManager:
    """What callers read from ``coordinator.single_type_managers[g]``."""

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: NativeBlockPool, block_size: int, dcp: int) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        # vLLM's: ``spec.block_size * dcp_world_size`` for a DCP-sharded group (see ``.dcp``).
        self.block_size = block_size
        self.block_pool = pool
        self.dcp_world_size = dcp if spec.dcp_sharded else 1
        self.pcp_world_size = 1
        self.use_eagle = False
        self.retains_longer_hit = False


class NativeCoordinator:
    """The ``coordinator`` attributes and methods the scheduler reaches through."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0

    def __init__(
        self,
        mgr: ManagerView,
        block_pool: NativeBlockPool,
        kv_cache_config: KVCacheConfig,
        block_sizes: list[int],
        dcp_world_size: int,
    ) -> None:
        self._mgr = mgr
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = 1
        self.single_type_managers = tuple(
            NativeSingleTypeManager(i, g.kv_cache_spec, block_pool, bs, dcp_world_size)
            for i, (g, bs) in enumerate(zip(kv_cache_config.kv_cache_groups, block_sizes, strict=True))
        )
        # Groups holding EAGLE/MTP draft layers; none drops its last block (a drop falls
        # back), so ``drop_eagle_group_ids`` (vLLM 0.33) is empty.
        self.eagle_group_ids: set[int] = {i for i, g in enumerate(kv_cache_config.kv_cache_groups) if g.is_eagle_group}
        self.drop_eagle_group_ids: set[int] = set()
        self.full_attention_group_id = next(
            (
                i
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
                if isinstance(g.kv_cache_spec, FullAttentionSpec)
            ),
            None,
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        assert not any(new_computed_blocks), "the scheduler only asks this without a new hit"
        st = self._mgr._reqs.get(request_id)
        alloc = self._mgr._alloc
        if st is None:
            # An unknown request holds nothing: the count for an empty table.
            h = alloc.add_request()
            try:
                return alloc.get_num_blocks_to_allocate(
                    h,
                    num_tokens,
                    num_encoder_tokens=num_encoder_tokens,
                    total_computed_tokens=total_computed_tokens,
                    apply_admission_cap=apply_admission_cap,
                    num_tokens_main_model=num_tokens_main_model,
                    prefill_end=prefill_end,
                )
            finally:
                alloc.free(h)
        return alloc.get_num_blocks_to_allocate(
            st.handle,
            num_tokens,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=total_computed_tokens,
            apply_admission_cap=apply_admission_cap,
            num_tokens_main_model=num_tokens_main_model,
            prefill_end=prefill_end,
        )

    def get_blocks(self, request_id: str) -> tuple[list[Any], ...]:
        return self._mgr.get_blocks(request_id).blocks

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[NativeBlock], ...], tuple[int, ...]]:
        """vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``: each group's
        own longest hit (blocks, tokens) within ``max_cache_hit_length``, not reconciled
        across groups; touches nothing. Off the scheduler's path (the OffloadingConnector
        asks it only for groups it does not offload, which is HiSparse's layout, and only of
        a ``HybridKVCacheCoordinator``): three crossings, through a handle made for the call."""
        alloc = self._mgr._alloc
        h = alloc.add_request()
        try:
            _, _, hits, ids = alloc.get_computed_blocks_for_connector(
                h, max_cache_hit_length, block_hashes=list(block_hashes), reconcile=False
            )
        finally:
            alloc.free(h)
        assert hits is not None
        return tuple([NativeBlock(alloc, b) for b in g] for g in ids), tuple(hits)
