"""What the adapter's rooms share with it, without importing it: :class:`RequestState`, the
adapter's per-request state, :class:`LiveBlocks`, a request's blocks in a group as vLLM's
``req_to_blocks`` shows them (the facades hand them out, the adapter's free freezes them), and
:class:`ManagerView`, the part of
:class:`~hybrid_alloc.vllm.manager.HybridKVCacheManager` that :mod:`.facades` (``block_pool``,
``coordinator``) and :mod:`.connector_hits` (the connector's local hit) work through. The
adapter imports those rooms; they import this module, not the adapter, so the imports run one
way (mypy checks that the adapter is a ``ManagerView`` where it hands itself over).

Cost: nothing at run time on the scheduler's path (a dataclass with slots, a typing protocol,
and ``LiveBlocks``, built only when someone reads ``req_to_blocks``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from hybrid_alloc._core import Allocator, BlockIds
    from hybrid_alloc.vllm.blocks import BlockViews, NativeBlock

__all__ = ["LiveBlocks", "ManagerView", "RequestState", "freeze_live_blocks"]


@dataclass(slots=True)
class RequestState:
    """What the manager keeps per request: the core's ``handle`` (the request also carries it
    as ``_hybrid_alloc_handle`` for ``FastAllocate``, -1 once freed) and the generation of the
    cache hit stored in Rust for it (``hit_gen``; -1: none). ``st[0]`` / ``st[1]`` read the
    two, as the list entries this replaced did."""

    handle: int
    hit_gen: int = -1
    #: The request carries KV hints the core took (its free applies them; see
    #: :meth:`~hybrid_alloc.vllm.manager.HybridKVCacheManager._apply_hints`).
    hinted: bool = False

    def __getitem__(self, index: int) -> int:
        return (self.handle, self.hit_gen)[index]


class ManagerView(Protocol):
    """The adapter as its rooms see it: the core, the per-request states, and the few
    operations they delegate back (each documented on the adapter)."""

    @property
    def _alloc(self) -> Allocator: ...
    @property
    def _reqs(self) -> dict[str, RequestState]: ...
    @property
    def _pending_pins(self) -> list[list[int]]: ...
    @property
    def _live_blocks(self) -> dict[str, dict[int, LiveBlocks]]: ...
    @property
    def enable_caching(self) -> bool: ...
    @property
    def num_hash_lookahead_tokens(self) -> int: ...
    @property
    def empty_kv_cache_blocks(self) -> KVCacheBlocks: ...

    def prefix_cache_lookup_enabled(self, request: Request) -> bool: ...
    def _state(self, request: Request) -> RequestState: ...
    def _lookup_state(self, request: Request) -> RequestState: ...
    def _pin_from(self, request: Request) -> None: ...
    def _reconciled_hit(
        self, request: Request, st: RequestState, hit: int, uncached: int, groups: BlockIds
    ) -> tuple[KVCacheBlocks, int, int]: ...
    def _hit_blocks(self, st: RequestState, groups: BlockIds) -> KVCacheBlocks: ...
    def evict_blocks(self, block_ids: set[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[KVCacheEvent]: ...
    def get_blocks(self, request_id: str) -> KVCacheBlocks: ...


class LiveBlocks(Sequence["NativeBlock"]):
    """One request's blocks in one group, as vLLM's ``req_to_blocks[request_id]`` list shows
    them: live while the request holds them (vLLM grows that list in place; each read here
    asks the core's table, one crossing, O(the request's blocks)), then, once the request's
    blocks are freed, the blocks it held then (vLLM's list, popped from ``req_to_blocks``,
    keeps them). As views; compares equal to a list of the same blocks. Read-only.

    One instance per request and group while the request lives (``ReqToBlocks`` keeps them in
    the manager's ``_live_blocks``, which the manager's free empties: an empty-dict test when
    nobody read ``req_to_blocks``)."""

    __slots__ = ("_frozen", "_group", "_mgr", "_request_id", "_views")

    def __init__(self, mgr: ManagerView, views: BlockViews, group: int, request_id: str) -> None:
        self._mgr = mgr
        self._views = views
        self._group = group
        self._request_id = request_id
        #: The block ids once the request's blocks were freed (``None`` while it holds them).
        self._frozen: list[int] | None = None

    def _ids(self) -> list[int]:
        if self._frozen is not None:
            return self._frozen
        st = self._mgr._reqs.get(self._request_id)
        return [] if st is None else self._mgr._alloc.block_ids(st.handle)[self._group]

    def __len__(self) -> int:
        return len(self._ids())

    def __getitem__(self, index: Any) -> Any:
        ids = self._ids()[index]
        if isinstance(index, slice):
            return self._views.many_in_group(ids, self._group)
        return self._views.many_in_group([ids], self._group)[0]

    def __iter__(self) -> Iterator[NativeBlock]:
        return iter(self._views.many_in_group(self._ids(), self._group))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, LiveBlocks)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a mutable sequence, as vLLM's list

    def __repr__(self) -> str:
        return repr(list(self))


def freeze_live_blocks(live: dict[str, dict[int, LiveBlocks]], request_id: str, groups: tuple[list[int], ...]) -> None:
    """Called by the manager as ``request_id``'s blocks go back to the pool (``groups``: its
    table then): the request's :class:`LiveBlocks` keep those blocks from now on."""
    for g, lb in live.pop(request_id, {}).items():
        lb._frozen = groups[g]
