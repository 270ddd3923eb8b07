"""What the adapter's rooms share with it, without importing it: :class:`RequestState`, the
adapter's per-request state, and :class:`ManagerView`, the part of
:class:`~hybrid_alloc.vllm.manager.HybridKVCacheManager` that :mod:`.facades` (``block_pool``,
``coordinator``) and :mod:`.connector_hits` (the connector's local hit) work through. The
adapter imports those rooms; they import this module, not the adapter, so the imports run one
way (mypy checks that the adapter is a ``ManagerView`` where it hands itself over).

Cost: nothing at run time (a dataclass with slots, and a typing protocol).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from hybrid_alloc._core import Allocator, BlockIds

__all__ = ["ManagerView", "RequestState"]


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
