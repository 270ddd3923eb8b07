"""The ``KVCacheBlocks`` the adapter hands to vLLM, and the block views behind them.

- :class:`NativeBlock`: one block as ``KVCacheBlocks.blocks`` shows it (``block_id``,
  ``is_null``, ``ref_cnt``, ``block_hash``, ``next_free_block``), made on demand, never on
  the hot path; :class:`FreeListEnd`: the free queue's fake head and tail (their links only);
- :class:`BlockViews`: one manager's views, one per block id, made on first read and then
  the same object wherever a block is handed out (``KVCacheBlocks.blocks``,
  ``block_pool.blocks[i]``, ``pop_blocks_for_free``, ``req_to_blocks``...), as vLLM hands out
  its one ``KVCacheBlock`` per id: ``old is new`` holds;
- :class:`EmptyKVCacheBlocks`: the manager's shared "no block" result;
- :class:`NativeKVCacheBlocks`: block ids per group in the core's flat ``BlockIds`` buffer,
  turned into Python ints only when a caller reads them;
- :class:`HitBlocks`: a ``get_computed_blocks`` result, which ``allocate_slots`` recognises
  to reuse the hit the core stored instead of sending its ids back.

Cost: building any of these is O(1) (O(ids) from lists); ``get_block_ids`` is one crossing
(a builtin method, no Python frame) making fresh lists; ``blocks`` looks each block's view up
(a dict read, a view made on a block's first read), once per instance. Nothing here runs on
the scheduler's hot path, which reads block ids only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from hybrid_alloc._core import Allocator, BlockIds, EmptyBlockIds, GetBlockIds

__all__ = [
    "BlockViews",
    "EmptyKVCacheBlocks",
    "FreeListEnd",
    "HitBlocks",
    "NativeBlock",
    "NativeKVCacheBlocks",
    "views_of",
]


class NativeBlock:
    """A block handed to a caller that reads ``KVCacheBlocks.blocks``: an id-backed view
    of the pool, made on demand (never on the hot path). ``block_id`` is the id its group's
    table holds; ``_key`` the pool-wide id the core reads it by (the same, except a state
    page under two-level pages: ``num_slots + page``, see :class:`BlockViews`)."""

    __slots__ = ("_alloc", "_key", "block_id")

    def __init__(self, alloc: Allocator, block_id: int, key: int | None = None) -> None:
        self._alloc = alloc
        self.block_id = block_id
        self._key = block_id if key is None else key

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def ref_cnt(self) -> int:
        return self._alloc.ref_cnt(self._key)

    @property
    def block_hash(self) -> bytes | None:
        h = self._alloc.block_hash(self._key)
        return None if h is None else make_block_hash_with_group_id(h[0], h[1])

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._alloc.block_hash_num_tokens(self._key)

    @property
    def next_free_block(self) -> NativeBlock | FreeListEnd | None:
        """vLLM's link in the free queue (``KVCacheBlock.next_free_block``; LMCacheMP's lazy
        offload walks the queue's front through it): the free block after this one, the
        queue's tail sentinel after the last, ``None`` for a block not in the queue. One
        crossing (two after the queue's last block). Read-only."""
        ids = self._alloc.free_queue_after(self._key, 1)
        if ids:
            return views_of(self._alloc)[ids[0]]
        if self.block_id != 0 and self._alloc.ref_cnt(self._key) == 0:
            return FreeListEnd.TAIL
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NativeBlock) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"NativeBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeListEnd:
    """vLLM's free queue's fake head or tail (``free_block_queue.fake_free_list_head`` /
    ``fake_free_list_tail``, ``KVCacheBlock`` with ``block_id`` -1): the head's
    ``next_free_block`` is the queue's first block (the tail when it is empty), the tail's is
    ``None``. Only the links are served."""

    __slots__ = ("_alloc",)
    TAIL: FreeListEnd
    block_id = -1
    block_hash = None

    def __init__(self, alloc: Allocator | None) -> None:
        self._alloc = alloc  # the head's allocator; None for the tail

    @property
    def next_free_block(self) -> NativeBlock | FreeListEnd | None:
        if self._alloc is None:
            return None
        ids = self._alloc.free_queue_after(None, 1)
        return views_of(self._alloc)[ids[0]] if ids else FreeListEnd.TAIL


FreeListEnd.TAIL = FreeListEnd(None)


class BlockViews(Sequence[NativeBlock]):
    """The views of one allocator's blocks (vLLM's ``BlockPool.blocks``): ``views[i]`` is the
    same :class:`NativeBlock` at every read. A view is made on its block's first read (the
    dict holds at most one per pool-wide id); nothing is made up front.

    Ids are pool-wide, as the core's flat id lists (``pop_blocks_for_free``,
    ``free_block_ids``, the residency log) write them. Under two-level pages
    (``slots_per_page`` k > 1) a slot is its own id and page ``p`` of a state group is
    ``num_slots + p`` (``num_slots`` = pages x k): ``views[num_slots + p].block_id == p``, as
    the state group's table holds it. A group's own ids become pool-wide through
    :meth:`many_in_group`.

    Invariant: ``_views[key]._key == key``, and every view of this allocator handed out by the
    adapter comes from here (while its manager lives: see :func:`views_of`)."""

    __slots__ = ("_alloc", "_num_blocks", "_num_slots", "_offsets", "_paged", "_views")

    def __init__(self, alloc: Allocator, state_groups: Sequence[int] = ()) -> None:
        self._alloc = alloc
        k = alloc.slots_per_page
        self._paged = k > 1
        # Ids below ``_num_slots`` are the pool's own (slots under two-level pages).
        self._num_slots = alloc.num_blocks * k if k > 1 else alloc.num_blocks
        self._num_blocks = self._num_slots + (alloc.num_blocks if k > 1 else 0)
        # Each group's offset from its table's ids to pool-wide ones (``None``: all 0).
        self._offsets: tuple[int, ...] | None = None
        if k > 1 and state_groups:
            n = max(state_groups) + 1
            self._offsets = tuple(self._num_slots if g in state_groups else 0 for g in range(n))
        self._views: dict[int, NativeBlock] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def _view(self, key: int) -> NativeBlock:
        # Past the slots, under two-level pages: a state page. (With one page size an id past
        # the pool, which ``many`` does not check, stays itself.)
        page = self._paged and key >= self._num_slots
        view = self._views[key] = NativeBlock(self._alloc, key - self._num_slots if page else key, key)
        return view

    def __getitem__(self, block_id: Any) -> Any:
        if isinstance(block_id, slice):
            return [self[i] for i in range(*block_id.indices(self._num_blocks))]
        view = self._views.get(block_id)
        if view is None:
            i = block_id.__index__()
            if i < 0:
                i += self._num_blocks
            if not 0 <= i < self._num_blocks:
                raise IndexError(f"block id {block_id} out of range (num_blocks={self._num_blocks})")
            view = self._views.get(i)
            if view is None:
                view = self._view(i)
        return view

    def __iter__(self) -> Iterator[NativeBlock]:
        return (self[i] for i in range(self._num_blocks))

    def many(self, ids: Sequence[int]) -> list[NativeBlock]:
        """The views of ``ids`` (pool-wide block ids the core handed out: not range-checked),
        in order."""
        views = self._views
        out = []
        for b in ids:
            view = views.get(b)
            if view is None:
                view = self._view(b)
            out.append(view)
        return out

    def offset(self, group: int) -> int:
        """What group ``group``'s table ids add to become pool-wide (0 but for a state group
        under two-level pages)."""
        offsets = self._offsets
        return 0 if offsets is None or group >= len(offsets) else offsets[group]

    def many_in_group(self, ids: Sequence[int], group: int) -> list[NativeBlock]:
        """The views of group ``group``'s table ids ``ids``, in order (the null block stays
        the null block)."""
        off = self.offset(group)
        if off == 0:
            return self.many(ids)
        return self.many([b + off if b else 0 for b in ids])


# The views of each live manager's allocator, by ``id(allocator)``: ``NativeKVCacheBlocks``
# instances carry the allocator only (``FastAllocate`` builds them from Rust), and reach the
# views through it. An entry goes when its manager is collected (``weakref.finalize``); the
# allocator outlives the entry (the manager and every view hold it), so its id is not reused
# while the entry is there.
_VIEWS: dict[int, BlockViews] = {}


def register_views(owner: object, alloc: Allocator, state_groups: Sequence[int] = ()) -> BlockViews:
    """The views of ``alloc``'s blocks for the manager ``owner`` (``state_groups``: the groups
    whose blocks are pages under two-level pages), found by :func:`views_of` until ``owner``
    is collected."""
    views = BlockViews(alloc, state_groups)
    key = id(alloc)
    _VIEWS[key] = views
    weakref.finalize(owner, _VIEWS.pop, key, None)
    return views


def views_of(alloc: Allocator) -> BlockViews:
    """The registered views of ``alloc``'s blocks; an allocator no manager registered (a test
    driving the core directly) gets views of its own, for that caller only."""
    views = _VIEWS.get(id(alloc))
    if views is None or views._alloc is not alloc:
        return BlockViews(alloc)
    return views


class EmptyKVCacheBlocks(KVCacheBlocks):
    """The manager's shared "no block" result (``empty_kv_cache_blocks``): vLLM's empty
    ``KVCacheBlocks`` (``blocks`` is one empty tuple per group, so ``+``, ``.blocks``,
    ``new_empty`` and the connectors see exactly vLLM's object), whose ``get_block_ids``
    answers without scanning the groups. The scheduler calls ``get_block_ids(allow_none=True)``
    on it for every running request that got no new block (15 of 16 decode steps at block
    size 16): vLLM's method costs about 0.4-0.6 us there. The instance's ``get_block_ids``
    is the core's ``EmptyBlockIds.get_block_ids``, a builtin method (no Python frame); the
    method below, which answers the same, serves the class."""

    def __init__(self, num_groups: int) -> None:
        super().__init__(tuple(() for _ in range(num_groups)))
        self.get_block_ids = EmptyBlockIds(num_groups).get_block_ids  # type: ignore[method-assign]

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None) -> Any:
        if allow_none and group_ids is None:
            return None
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none:
            return None
        return tuple([] for _ in groups)


class NativeKVCacheBlocks(KVCacheBlocks):
    """``KVCacheBlocks`` whose content is block ids, held as the core's flat ``BlockIds``
    buffer (``_src``): no Python int is made for an id until a caller reads the ids (the
    scheduler does not read an admission's new blocks, nor a hit's); ``blocks`` makes block
    views lazily.

    ``FastAllocate`` builds the instances of a decode step that crossed a block without
    running ``__init__`` (``object.__new__`` and the attributes ``_alloc`` and ``_src`` set
    from Rust), so an instance's state is exactly those two (``_blocks`` is set on first
    read of ``blocks``). ``get_block_ids`` is the core's ``GetBlockIds``: read on an
    instance, it is ``_src.get_block_ids``, a builtin method answering as vLLM's (fresh lists,
    ``allow_none``, ``group_ids``), so the scheduler's ``get_block_ids(allow_none=True)``
    runs no Python frame."""

    __slots__ = ("_alloc", "_src", "_blocks")

    get_block_ids = GetBlockIds()

    def __init__(self, alloc: Allocator, ids: tuple[list[int], ...] | BlockIds) -> None:
        # Deliberately not calling the dataclass __init__: ``blocks`` is lazy.
        self._alloc = alloc
        self._src: BlockIds = ids if type(ids) is BlockIds else BlockIds(ids)

    @property
    def _ids(self) -> tuple[list[int], ...]:
        return self._src.lists()

    @property
    def blocks(self) -> tuple[Sequence[Any], ...]:
        try:
            return self._blocks
        except AttributeError:
            views = views_of(self._alloc)
            self._blocks: tuple[list[NativeBlock], ...] = tuple(
                views.many_in_group(g, i) for i, g in enumerate(self._ids)
            )
            return self._blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        other_ids = other.get_block_ids()
        return NativeKVCacheBlocks(self._alloc, tuple(a + b for a, b in zip(self._ids, other_ids)))

    def get_unhashed_block_ids(self) -> list[int]:
        ids = self._ids
        assert len(ids) == 1, "Only one group is supported"
        a = self._alloc
        return [b for b in ids[0] if a.block_hash(b) is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        a = self._alloc
        views = views_of(a)
        out = []
        for i, g in enumerate(self._ids):
            off = views.offset(i)
            out.append([b for b in g if b != 0 and a.block_hash(b + off) is None])
        return out

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in range(len(self._src))))

    def __repr__(self) -> str:
        return f"NativeKVCacheBlocks({self._ids})"


class HitBlocks(NativeKVCacheBlocks):
    """The result of ``get_computed_blocks``: carries the generation of the hit stored in
    Rust, so ``allocate_slots`` can reuse that hit instead of sending the ids back when it is
    handed the latest lookup of the same request."""

    __slots__ = ("_gen",)

    def __init__(self, alloc: Allocator, ids: tuple[list[int], ...] | BlockIds, gen: int) -> None:
        super().__init__(alloc, ids)
        self._gen = gen
