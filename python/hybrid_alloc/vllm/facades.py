"""The parts of vLLM's manager that callers reach through it: ``block_pool``,
``coordinator`` and ``coordinator.single_type_managers[g]``, each with the attributes and
methods vLLM's scheduler, connectors and stats, vLLM's own tests of the manager
(``scripts/vllm-tests.sh``) and out-of-tree schedulers (Dynamo's instrumented scheduler) read,
in vLLM's shapes, served by the manager's native core.

- ``block_pool.blocks[i]``: the block's one view (:class:`~hybrid_alloc.vllm.blocks.BlockViews`);
  ``block_pool.free_block_queue``: the free queue, read-only (:class:`NativeFreeBlockQueue`),
  walked in chunks, or link by link from ``fake_free_list_head`` (``next_free_block``); ``block_pool.touch`` / ``free_blocks`` (a connector's pins, given back);
  ``block_pool.cached_block_hashes_by_block``: a block's second keys (:class:`CachedBlockHashesByBlock`);
- ``single_type_managers[g]``: an instance of a class registered as a virtual subclass of the
  vLLM manager class vLLM would build for the group (``isinstance(m, MambaManager)`` and
  ``isinstance(m, CrossAttentionManager)`` hold as with vLLM's), with ``block_size``,
  ``kv_cache_spec``, ``req_to_blocks`` (:class:`ReqToBlocks`), ``cache_hit_alignment_tokens``,
  the Mamba ``mamba_cache_mode`` / ``num_speculative_blocks`` and the recycling kinds'
  ``max_admission_blocks_per_request``;
- ``coordinator``: likewise registered under vLLM's coordinator class for the configuration,
  with ``scheduler_block_size``, ``hash_block_size``, ``retention_interval`` and
  ``find_longest_cache_hit(_per_group)``.

Cost: nothing on the scheduler's hot path. Construction is O(groups); attributes are fixed
values or properties read on access; ``req_to_blocks`` and the free queue are built when read
(one crossing, O(blocks) for what is read; ``iter_blocks_after`` one per chunk, O(blocks
walked)); ``touch`` one crossing, O(blocks); each lookup method is one crossing into the core
(`find_longest_cache_hit(_per_group)`, off the scheduler's path, three).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core import kv_cache_coordinator as _vllm_kvc
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from hybrid_alloc.vllm.blocks import BlockViews, FreeListEnd, NativeBlock
from hybrid_alloc.vllm.state import LiveBlocks

if TYPE_CHECKING:
    from hybrid_alloc.vllm.state import ManagerView

__all__ = [
    "CachedBlockHashesByBlock",
    "NativeBlockPool",
    "NativeCoordinator",
    "NativeFreeBlockQueue",
    "NativeSingleTypeManager",
    "ReqToBlocks",
]


class NativeFreeBlockQueue:
    """``block_pool.free_block_queue`` as callers read it (vLLM's ``FreeKVCacheBlockQueue``;
    the SimpleCPUOffload connector's lazy mode walks it from the front each step and stops
    early): the free blocks' views in eviction order (front first), read from the core's
    queue. Read-only.

    ``iter_blocks_after`` reads the queue in chunks (one crossing each: 16 blocks, then twice
    as many each time, up to 1024), so walking the first k blocks costs O(k) and O(log k)
    crossings, not O(free blocks). Each chunk is read when the walk reaches it: a block that
    leaves the queue while the walk is inside a chunk already read is still yielded (vLLM's
    linked walk would skip it); no caller changes the queue mid-walk."""

    #: The first chunk's size; each later chunk doubles, up to ``_MAX_CHUNK``.
    _FIRST_CHUNK = 16
    _MAX_CHUNK = 1024

    def __init__(self, views: BlockViews) -> None:
        self._views = views

    @property
    def num_free_blocks(self) -> int:
        return self._views._alloc.num_free_blocks

    @property
    def fake_free_list_head(self) -> FreeListEnd:
        """vLLM's sentinel before the queue's first block: walked through ``next_free_block``
        (one crossing per link; LMCacheMP's lazy offload reads a bounded prefix each step)."""
        return FreeListEnd(self._views._alloc)

    @property
    def fake_free_list_tail(self) -> FreeListEnd:
        return FreeListEnd.TAIL

    def get_all_free_blocks(self) -> list[NativeBlock]:
        """The free blocks, front (evicted first) to back. One crossing, O(free blocks)."""
        return self._views.many(self._views._alloc.free_queue_order())

    def iter_blocks_after(self, block: NativeBlock | None) -> Iterator[NativeBlock]:
        """The free blocks after ``block`` (from the front when ``None``), front to back;
        nothing when ``block`` is not free (as vLLM's, whose removed block has no next)."""
        views = self._views
        alloc = views._alloc
        cursor = None if block is None else block._key
        n = self._FIRST_CHUNK
        while True:
            ids = alloc.free_queue_after(cursor, n)
            yield from views.many(ids)
            if len(ids) < n:
                return
            cursor = ids[-1]
            n = min(2 * n, self._MAX_CHUNK)


class CachedBlockHashesByBlock:
    """``block_pool.cached_block_hashes_by_block`` as callers read it (vLLM's
    ``dict[block_id, set[BlockHashWithGroupId]]``: the keys a block holds besides its own,
    which only partial hash hits add; the SimpleCPUOffload connector reads ``.get(id, ())``):
    a block's second keys read from the core when asked (one crossing, O(its keys)), as a
    fresh set in the order they were added. A block without any is absent, as in vLLM.
    Read-only; only lookups by block id are served (no iteration: that would be O(blocks))."""

    def __init__(self, views: BlockViews) -> None:
        self._views = views

    def _keys(self, block_id: object) -> set[bytes] | None:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            return None
        if not 0 <= block_id < len(self._views):
            return None
        keys = self._views._alloc.second_keys(block_id)
        return {make_block_hash_with_group_id(h, g) for h, g in keys} if keys else None

    def get(self, block_id: int, default: Any = None) -> Any:
        keys = self._keys(block_id)
        return default if keys is None else keys

    def __getitem__(self, block_id: int) -> set[bytes]:
        keys = self._keys(block_id)
        if keys is None:
            raise KeyError(block_id)
        return keys

    def __contains__(self, block_id: object) -> bool:
        return self._keys(block_id) is not None


class NativeBlockPool:
    """The ``block_pool`` attributes and methods the scheduler and connectors reach through."""

    def __init__(self, mgr: ManagerView, views: BlockViews, hash_block_size: int, num_blocks: int) -> None:
        self._mgr = mgr
        self._alloc = mgr._alloc
        self.hash_block_size = hash_block_size
        self.num_gpu_blocks = num_blocks
        self.enable_caching = mgr.enable_caching
        self.num_hash_lookahead_tokens = mgr.num_hash_lookahead_tokens
        #: vLLM's ``BlockPool.blocks``: ``blocks[i]`` is block ``i``'s one view.
        self.blocks = views
        self.null_block = views[0]

    @property
    def free_block_queue(self) -> NativeFreeBlockQueue:
        return NativeFreeBlockQueue(self.blocks)

    @property
    def cached_block_hashes_by_block(self) -> CachedBlockHashesByBlock:
        return CachedBlockHashesByBlock(self.blocks)

    def touch(self, blocks: Iterable[Any]) -> None:
        """vLLM's ``BlockPool.touch`` (the SimpleCPUOffload connector pins the blocks it copies
        with it): one reference more on each block, a free one leaving the free queue; the null
        block is skipped. ``free_blocks`` gives the references back. One crossing, O(blocks);
        an id outside the pool raises ``InvalidBlockError`` and changes nothing."""
        self._alloc.touch_block_ids([b._key for b in blocks])

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """vLLM's ``BlockPool.free_blocks``: gives back references that ``pop_blocks_for_free``
        handed out or ``touch`` took. ``evict_first`` (0.34; the SimpleCPUOffload connector's
        lazy mode) queues the freed blocks at the front of the free queue instead of the back,
        as vLLM's."""
        ids = [b._key for b in ordered_blocks]
        if evict_first:
            self._alloc.free_block_ids(ids, evict_first=True)
        else:
            self._alloc.free_block_ids(ids)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[NativeBlock] | None:
        """vLLM's ``BlockPool.get_cached_block`` (the routed-experts auxiliary-output
        connector asks it): the first cached block for ``block_hash`` in each group, or
        ``None`` on a miss in any group."""
        ids = self._alloc.get_cached_block(block_hash, list(kv_cache_group_ids))
        return None if ids is None else self.blocks.many(ids)

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


class ReqToBlocks(Mapping[str, Sequence[NativeBlock]]):
    """A group's ``req_to_blocks`` (vLLM's ``dict[request_id, list[KVCacheBlock]]``; HiSparse's
    coordinator and Dynamo-style tools read it): each request's blocks in the group
    (:class:`LiveBlocks`, read from the core's table when read; the same object at each read
    while the request lives). Keys: the requests holding blocks in the group (vLLM adds a
    request at its first allocation; a request only looked up is not there). A missing key
    reads as an empty list (vLLM's is a ``defaultdict(list)``), without being added. Read-only;
    O(1) to build, nothing kept in sync; membership is one crossing, the keys one per request."""

    def __init__(self, mgr: ManagerView, views: BlockViews, group: int) -> None:
        self._mgr = mgr
        self._views = views
        self._group = group

    def _holds(self, request_id: object) -> bool:
        st = self._mgr._reqs.get(request_id) if isinstance(request_id, str) else None
        return st is not None and bool(self._mgr._alloc.block_ids(st.handle)[self._group])

    def __getitem__(self, request_id: str) -> Sequence[NativeBlock]:
        if request_id not in self._mgr._reqs:
            return []
        groups = self._mgr._live_blocks.setdefault(request_id, {})
        lb = groups.get(self._group)
        if lb is None:
            lb = groups[self._group] = LiveBlocks(self._mgr, self._views, self._group, request_id)
        return lb

    def get(self, request_id: str, default: Any = None) -> Any:
        """As a dict's (vLLM's ``defaultdict``'s ``get`` does not add the key either)."""
        return self[request_id] if self._holds(request_id) else default

    def __contains__(self, request_id: object) -> bool:
        return self._holds(request_id)

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in list(self._mgr._reqs) if self._holds(r)])

    def __len__(self) -> int:
        return sum(1 for r in list(self._mgr._reqs) if self._holds(r))


class NativeSingleTypeManager:
    """What callers read from ``coordinator.single_type_managers[g]``. Instances are of a
    subclass per vLLM manager class (:func:`_facade_class`), registered as its virtual
    subclass."""

    #: The vLLM manager class this facade stands for (set on each subclass).
    vllm_class: type[Any] | None = None

    def __init__(
        self,
        coordinator: NativeCoordinator,
        group_id: int,
        spec: KVCacheSpec,
        pool: NativeBlockPool,
        block_size: int,
        dcp: int,
        max_in_flight_tokens: int,
        max_model_len: int,
    ) -> None:
        self._coordinator = coordinator
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        # vLLM's: ``spec.block_size * dcp_world_size`` for a DCP-sharded group (see ``.dcp``).
        self.block_size = block_size
        self.block_pool = pool
        self._null_block = pool.null_block
        self.enable_caching = pool.enable_caching
        self.scheduler_block_size = coordinator.scheduler_block_size
        self.dcp_world_size = dcp if spec.dcp_sharded else 1
        self.pcp_world_size = 1
        self.use_eagle = False
        self.retains_longer_hit = False
        #: Sliding-window and chunked-local groups: the recycling-aware cap of a request's
        #: blocks at admission (vLLM's manager is built with it); ``None`` for other kinds.
        self.max_admission_blocks_per_request: int | None = None
        cap = getattr(spec, "max_admission_blocks_per_request", None)
        if callable(cap):
            self.max_admission_blocks_per_request = cap(
                max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
            )
        if isinstance(spec, MambaSpec):
            self.mamba_cache_mode = spec.mamba_cache_mode
            self.num_speculative_blocks: int = spec.num_speculative_blocks
        self.req_to_blocks = ReqToBlocks(coordinator._mgr, pool.blocks, group_id)

    @property
    def cache_hit_alignment_tokens(self) -> int:
        """vLLM's: where a cache hit may end (the coordinator's, shared by every group)."""
        return self._coordinator._cache_hit_alignment_tokens


_FACADE_CLASSES: dict[type[Any] | None, type[NativeSingleTypeManager]] = {None: NativeSingleTypeManager}


def _facade_class(vllm_class: type[Any] | None) -> type[NativeSingleTypeManager]:
    """The facade class standing for ``vllm_class`` (made once, and registered as its virtual
    subclass, so ``isinstance`` checks against vLLM's manager classes answer as for vLLM's
    own managers; no method of vLLM's class is inherited)."""
    cls = _FACADE_CLASSES.get(vllm_class)
    if cls is None:
        assert vllm_class is not None
        cls = type(f"Native{vllm_class.__name__}", (NativeSingleTypeManager,), {"vllm_class": vllm_class})
        vllm_class.register(cls)
        _FACADE_CLASSES[vllm_class] = cls
    return cls


def _manager_class(spec: KVCacheSpec, role: Any) -> type[Any] | None:
    try:
        return KVCacheSpecRegistry.get_manager_class(spec, role)
    except Exception:  # noqa: BLE001 - a facade without the isinstance answer still serves
        return None


def _coordinator_class(kvc: KVCacheConfig, enable_caching: bool) -> type[Any]:
    """The vLLM coordinator class ``get_kv_cache_coordinator`` builds for ``kvc``."""
    if not enable_caching:
        return _vllm_kvc.KVCacheCoordinatorNoPrefixCache
    if len(kvc.kv_cache_groups) == 1:
        return _vllm_kvc.UnitaryKVCacheCoordinator
    return _vllm_kvc.HybridKVCacheCoordinator


class NativeCoordinator:
    """The ``coordinator`` attributes and methods the scheduler, connectors and tools reach
    through. Instances are of a subclass per vLLM coordinator class, registered as its
    virtual subclass (as :func:`_facade_class`)."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0

    def __new__(
        cls, mgr: ManagerView, block_pool: NativeBlockPool, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any
    ) -> Any:
        vllm_class = _coordinator_class(kv_cache_config, mgr.enable_caching)
        sub = _COORDINATOR_CLASSES.get(vllm_class)
        if sub is None:
            sub = type(f"Native{vllm_class.__name__}", (cls,), {})
            vllm_class.register(sub)
            _COORDINATOR_CLASSES[vllm_class] = sub
        return super().__new__(sub)

    def __init__(
        self,
        mgr: ManagerView,
        block_pool: NativeBlockPool,
        kv_cache_config: KVCacheConfig,
        block_sizes: list[int],
        dcp_world_size: int,
        *,
        scheduler_block_size: int,
        max_in_flight_tokens: int,
        max_model_len: int,
    ) -> None:
        self._mgr = mgr
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.enable_caching = mgr.enable_caching
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = 1
        self.use_eagle = False
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = block_pool.hash_block_size
        self._retention_interval = kv_cache_config.prefix_cache_retention_interval
        groups = kv_cache_config.kv_cache_groups
        self.single_type_managers = tuple(
            _facade_class(_manager_class(g.kv_cache_spec, getattr(g, "role", None)))(
                self, i, g.kv_cache_spec, block_pool, bs, dcp_world_size, max_in_flight_tokens, max_model_len
            )
            for i, (g, bs) in enumerate(zip(groups, block_sizes, strict=True))
        )
        self.num_single_type_manager = len(self.single_type_managers)
        # vLLM's: each group's block size as its manager sees it (DCP-scaled where sharded).
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        # Groups holding EAGLE/MTP draft layers, and those whose hits drop the EAGLE block
        # (vLLM 0.33's ``drop_eagle_group_ids``): set by ``set_eagle``.
        self.eagle_group_ids: set[int] = {i for i, g in enumerate(groups) if g.is_eagle_group}
        self.drop_eagle_group_ids: set[int] = set()
        self.full_attention_group_id = next(
            (i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)), None
        )

    def set_eagle(self, use_eagle: bool, drop_groups: Any, groups: list[Any]) -> None:
        """vLLM's EAGLE/MTP sets: ``eagle_group_ids`` (the flagged groups, or every group
        when ``use_eagle`` flags none), ``drop_eagle_group_ids`` (vLLM 0.33's: those with
        ``use_eagle``; ``drop_groups`` is the core's drop set, empty with prefix caching off)
        and each single-type manager's ``use_eagle`` (a group that takes hits dropping with
        an equal spec's group, as vLLM decides it per spec group; with one group, group 0)."""
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(self.single_type_managers)))
        self.drop_eagle_group_ids = set(self.eagle_group_ids) if use_eagle else set()
        drop = [groups[j] for j in drop_groups]
        for g, m in zip(groups, self.single_type_managers, strict=True):
            m.use_eagle = g.kind not in ("cross", "circular_buffer") and any(o == g for o in drop)

    @property
    def attention_groups(self) -> list[Any]:
        """vLLM's ``HybridKVCacheCoordinator.attention_groups``: the prefix-cacheable groups
        batched by equal spec and manager class (``SpecGroup(spec, group_ids, manager_cls,
        use_eagle)``, vLLM's own named tuple), full attention first. Built on access (nothing
        on the hot path reads it); only a hybrid coordinator has it, as in vLLM."""
        if not isinstance(self, _vllm_kvc.HybridKVCacheCoordinator):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'attention_groups'")
        out: list[Any] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            if not spec.prefix_cacheable:
                continue
            cls = _manager_class(spec, getattr(g, "role", None))
            use_eagle = i in self.drop_eagle_group_ids
            for idx, sg in enumerate(out):
                if sg.spec == spec and sg.manager_cls is cls:
                    sg.group_ids.append(i)
                    if use_eagle and not sg.use_eagle:
                        out[idx] = sg._replace(use_eagle=True)
                    break
            else:
                out.append(_vllm_kvc.SpecGroup(spec, [i], cls, use_eagle))
        out.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        return out

    @property
    def retention_interval(self) -> int | None:
        """vLLM's: ``KVCacheConfig.prefix_cache_retention_interval``, which the core is built
        with. Fixed at construction: writing another value raises (vLLM's coordinator reads the
        attribute at each call; writing it is no API, and no caller does but a test)."""
        return self._retention_interval

    @retention_interval.setter
    def retention_interval(self, value: int | None) -> None:
        if value != self._retention_interval:
            raise AttributeError(
                f"retention_interval is fixed at construction ({self._retention_interval!r}; "
                "KVCacheConfig.prefix_cache_retention_interval)"
            )

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """vLLM's: hits end on a hash block with partial hash hits, else on a scheduler block."""
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

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

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[NativeBlock], ...], int, int]:
        """vLLM's ``KVCacheCoordinator.find_longest_cache_hit``: the longest hit within
        ``max_cache_hit_length`` reconciled across groups, as ``(each group's blocks, hit
        tokens, uncached shared-prefix tokens)``; touches nothing, stores nothing. Off the
        scheduler's path (``get_computed_blocks`` serves the scheduler; out-of-tree schedulers
        ask it to probe): three crossings, through a handle made for the call."""
        alloc = self._mgr._alloc
        if not self.enable_caching:
            return tuple([] for _ in self.single_type_managers), 0, 0
        h = alloc.add_request()
        try:
            hit, uncached, ids = alloc.get_computed_blocks(h, max_cache_hit_length, block_hashes=list(block_hashes))
        finally:
            alloc.free(h)
        views = self.block_pool.blocks
        return tuple(views.many_in_group(g, i) for i, g in enumerate(ids)), hit, uncached

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
        views = self.block_pool.blocks
        return tuple(views.many_in_group(g, i) for i, g in enumerate(ids)), tuple(hits)


_COORDINATOR_CLASSES: dict[type[Any], type[NativeCoordinator]] = {}
