"""Type stubs of the compiled module (checked with ``mypy.stubtest``)."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeAlias, TypeVar, final, overload

from typing_extensions import disjoint_base

from hybrid_alloc.events import CoreEvent

__all__ = [
    "Allocator",
    "AllocatorBase",
    "BlockIds",
    "ConcurrentUseError",
    "DecodeFloor",
    "EmptyBlockIds",
    "FastAllocate",
    "GetBlockIds",
    "Hit",
    "HybridAllocError",
    "InvalidBlockError",
    "InvalidConfigError",
    "InvalidStateError",
    "InvariantError",
    "NoopLimits",
    "OutOfRangeError",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "__version__",
]
__version__: str

class HybridAllocError(Exception): ...
class InvalidConfigError(HybridAllocError): ...
class UnsupportedConfigError(HybridAllocError): ...
class UnknownRequestError(HybridAllocError): ...
class OutOfRangeError(HybridAllocError): ...
class InvalidStateError(OutOfRangeError): ...
class InvalidBlockError(HybridAllocError): ...
class InvariantError(HybridAllocError): ...
class ConcurrentUseError(HybridAllocError): ...

class _GroupSpec(Protocol):
    """A named group spec (``hybrid_alloc.specs``), read by attribute: ``kind``,
    ``block_size``, ``spec_key`` and the kind's own fields."""

    @property
    def kind(self) -> str: ...
    @property
    def block_size(self) -> int: ...

_GroupTuple: TypeAlias = tuple[str, int, int, int, int] | tuple[str, int, int, int, int, int]
_B = TypeVar("_B")

class _Request(Protocol):
    """What ``FastAllocate`` reads from a request (vLLM's ``Request``), see ``rust/py/fast.rs``;
    it also reads ``_hybrid_alloc_handle: int`` when present (the adapter sets it)."""

    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_in_flight_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def shared_prefix_boundary(self) -> int: ...
    @property
    def block_hashes(self) -> list[bytes]: ...

@final
class Hit:
    """Where ``allocate_slots`` takes a cache hit from (explicit ids are passed as lists)."""

    NONE: ClassVar[Hit]
    STORED: ClassVar[Hit]
    def __int__(self) -> int: ...

@final
class NoopLimits:
    """``noop_limits``' result: reads by name, unpacks as ``(slots, processed, cached, new_tokens)``."""

    @property
    def slots(self) -> int: ...
    @property
    def processed(self) -> int: ...
    @property
    def cached(self) -> int: ...
    @property
    def new_tokens(self) -> int: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, key: int, /) -> int: ...
    @overload
    def __getitem__(self, key: slice, /) -> tuple[int, ...]: ...
    def __iter__(self) -> Iterator[int]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class EmptyBlockIds:
    """``get_block_ids`` of the empty ``KVCacheBlocks``: ``None`` with ``allow_none``, else
    one empty list per group (per ``group_ids``)."""

    def __new__(cls, num_groups: int) -> EmptyBlockIds: ...
    def get_block_ids(self, allow_none: object = False, *, group_ids: Sequence[int] | None = None) -> Any: ...

@final
class BlockIds:
    """Block ids of several groups in one flat buffer (``as_buffer=True`` results), or made
    from one sequence of ints per group."""

    def __new__(cls, groups: Sequence[Sequence[int]]) -> BlockIds: ...
    def get_block_ids(self, allow_none: object = False, *, group_ids: Sequence[int] | None = None) -> Any:
        """vLLM's ``KVCacheBlocks.get_block_ids``: fresh lists, one per group (per
        ``group_ids``), or ``None`` when ``allow_none`` and every selected group is empty."""
    def lists(self) -> tuple[list[int], ...]: ...
    def is_empty(self) -> bool: ...
    def counts(self) -> list[int]: ...
    def __len__(self) -> int: ...

@final
class GetBlockIds:
    """``get_block_ids`` of a ``KVCacheBlocks`` class whose instances hold a ``BlockIds`` as
    ``_src``: on an instance it is ``_src.get_block_ids``; on the class, called with the
    instance first, it answers the same."""

    def __new__(cls) -> GetBlockIds: ...
    @overload
    def __get__(self, instance: None, owner: type | None = None, /) -> GetBlockIds: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None, /) -> Callable[..., Any]: ...
    def __call__(
        self, blocks: object, allow_none: object = False, *, group_ids: Sequence[int] | None = None
    ) -> Any: ...

@disjoint_base
class AllocatorBase:
    """The pool-wide half of :class:`Allocator` (its base class): calls that take no
    request handle. Not constructed directly."""

    def take_new_block_ids(self) -> list[int]: ...
    def new_step_starts(self) -> None: ...
    @property
    def policy(self) -> str: ...
    @property
    def partial_hash_hits(self) -> bool: ...
    @property
    def shared_prefix_checkpoint(self) -> bool: ...
    def pin_prefix(self, block_hashes: list[bytes]) -> int: ...
    def set_pinned_share(self, share: float) -> None: ...
    def advance_clock(self, now_ms: int) -> tuple[int, int | None]: ...
    def release_session(self, session: int) -> int: ...
    def hint_stats(self) -> dict[str, int]: ...
    def free_block_ids(self, ids: list[int], *, evict_first: bool = False) -> None: ...
    def touch_block_ids(self, ids: list[int]) -> None: ...
    def evict_blocks(self, ids: list[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def slots_per_page(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def has_events(self) -> bool: ...
    def ref_cnt(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> tuple[bytes, int] | None: ...
    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[int] | None: ...
    def block_hash_num_tokens(self, block_id: int) -> int | None: ...
    def num_partial_tail_blocks(self) -> int: ...
    def free_queue_order(self) -> list[int]: ...
    def free_queue_after(self, after: int | None, max_blocks: int) -> list[int]: ...
    def second_keys(self, block_id: int) -> list[tuple[bytes, int]]: ...
    def take_events(self) -> list[CoreEvent]: ...
    def take_residency_log(self) -> list[int]: ...
    def take_boundary_state_offloads(self) -> list[int]: ...
    def take_kv_cache_block_copies(self) -> list[int]: ...
    def check_invariants(self) -> None: ...

@final
class Allocator(AllocatorBase):
    def __new__(
        cls,
        num_blocks: int,
        groups: Sequence[_GroupSpec | _GroupTuple],
        hash_block_size: int,
        scheduler_block_size: int,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        enable_events: bool = False,
        watermark_blocks: int = 0,
        retention_interval: int | None = ...,
        policy: str = "exact",
        zero_new_blocks: bool = False,
        hash_lookahead_tokens: int = 0,
        residency_log: bool = False,
        boundary_offloads: bool = False,
        *,
        slots_per_page: int = 1,
        prefix_match_unit: int | None = None,
        eagle_drop_groups: Sequence[int] = (),
        eagle_junction_tail: bool = False,
        dcp_world_size: int = 1,
        admission_headroom_slots: int = 0,
        reprefillable_tokens: int = 0,
        eagle_checkpoints: bool = False,
        mamba_shared_prefix_checkpoint: bool = False,
    ) -> Allocator: ...
    def add_request(self) -> int: ...
    def set_block_hashes(self, handle: int, block_hashes: list[bytes]) -> None: ...
    def num_hashes(self, handle: int) -> int: ...
    def num_cached_tokens(self, block_hashes: list[bytes], max_length: int) -> int: ...
    @overload
    def get_computed_blocks(
        self,
        handle: int,
        max_length: int,
        *,
        block_hashes: list[bytes] | None = None,
        as_buffer: Literal[False] = False,
    ) -> tuple[int, int, tuple[list[int], ...]]: ...
    @overload
    def get_computed_blocks(
        self, handle: int, max_length: int, *, block_hashes: list[bytes] | None = None, as_buffer: Literal[True]
    ) -> tuple[int, int, BlockIds]: ...
    @overload
    def get_computed_blocks_for_connector(
        self,
        handle: int,
        max_length: int,
        *,
        block_hashes: list[bytes] | None = None,
        reconcile: bool = True,
        as_buffer: Literal[False] = False,
    ) -> tuple[int, int, list[int] | None, tuple[list[int], ...]]: ...
    @overload
    def get_computed_blocks_for_connector(
        self,
        handle: int,
        max_length: int,
        *,
        block_hashes: list[bytes] | None = None,
        reconcile: bool = True,
        as_buffer: Literal[True],
    ) -> tuple[int, int, list[int] | None, BlockIds]: ...
    @overload
    def allocate_slots(
        self,
        handle: int,
        num_new_tokens: int,
        *,
        block_hashes: list[bytes] | None = None,
        hit: Hit | Sequence[Sequence[int]] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        apply_watermark: bool = False,
        num_computed_tokens: int = 0,
        num_in_flight_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        num_tokens: int | None = None,
        shared_prefix_boundary: int = 0,
        skip_zeroing_group_ids: Sequence[int] = ...,
        as_buffer: Literal[True],
        request: object | None = None,
    ) -> BlockIds | None: ...
    @overload
    def allocate_slots(
        self,
        handle: int,
        num_new_tokens: int,
        *,
        block_hashes: list[bytes] | None = None,
        hit: Hit | Sequence[Sequence[int]] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        apply_watermark: bool = False,
        num_computed_tokens: int = 0,
        num_in_flight_tokens: int = 0,
        num_prompt_tokens: int | None = None,
        num_tokens: int | None = None,
        shared_prefix_boundary: int = 0,
        skip_zeroing_group_ids: Sequence[int] = ...,
        as_buffer: Literal[False] = False,
        request: object | None = None,
    ) -> tuple[list[int], ...] | None: ...
    def set_hints(
        self,
        handle: int,
        block_hashes: list[bytes] | None = None,
        session: int = 0,
        retain: int = 0,
        retain_ttl_ms: int = 0,
        retain_tokens: int = 0,
        pin_ttl_ms: int = 0,
        pin_tokens: int = 0,
        release_session: int = 0,
        checkpoints: Sequence[int] = ...,
    ) -> tuple[int, int, int]: ...
    def clear_hints(self, handle: int) -> None: ...
    def may_move_junction(self, handle: int) -> bool: ...
    def take_moved_junction(self, handle: int) -> int: ...
    def finalize_partial_tail_offloads(
        self, handle: int, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> list[int]: ...
    def record_blocks_for_zeroing(self, handle: int, start_token: int) -> None: ...
    def noop_limits(self, handle: int) -> NoopLimits: ...
    def cache_blocks(
        self,
        handle: int,
        num_computed_tokens: int,
        *,
        block_hashes: list[bytes] | None = None,
        num_prompt_tokens: int | None = None,
        shared_prefix_boundary: int = 0,
        request_computed_tokens: int = 0,
    ) -> None: ...
    def remove_skipped_blocks(
        self, handle: int, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None: ...
    def get_num_blocks_to_allocate(
        self,
        handle: int,
        num_tokens: int,
        *,
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        apply_admission_cap: bool = False,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
    ) -> int: ...
    def free(self, handle: int, *, retain: bool = False) -> None: ...
    def pop_blocks_for_free(self, handle: int) -> list[int]: ...
    @overload
    def block_ids(self, handle: int, *, as_buffer: Literal[False] = False) -> tuple[list[int], ...]: ...
    @overload
    def block_ids(self, handle: int, *, as_buffer: Literal[True]) -> BlockIds: ...
    def estimate_cached_tokens(self, handle: int) -> int: ...

@final
class FastAllocate(Generic[_B]):
    """The vLLM adapter's ``allocate_slots`` fast path; ``_B`` is the adapter's blocks type.

    ``empty`` is returned for a step with no new block; ``make_blocks`` wraps new block ids:
    a class (the adapter's ``NativeKVCacheBlocks``) is instantiated without ``__init__``
    (``object.__new__``, then ``_alloc`` set to ``alloc`` and ``_src`` to a ``BlockIds``),
    any other callable is called with one list per group; ``slow`` serves every other call (the adapter's Python
    ``allocate_slots``, called with the same arguments), and ``on_events(request)`` runs
    after a step that queued events."""

    def __new__(
        cls,
        alloc: Allocator,
        empty: _B,
        slow: Callable[..., _B | None],
        make_blocks: type[_B] | Callable[[tuple[list[int], ...]], _B],
        on_events: Callable[[_Request], object] | None,
    ) -> FastAllocate[_B]: ...
    def track(self, request: object, handle: int) -> None:
        """Records ``handle`` as ``request``'s, found by the object's address (no attribute
        read; the table holds a reference to the request), or forgets it when ``handle`` is
        negative. An untracked request's handle is read from ``_hybrid_alloc_handle``."""
    def num_tracked(self) -> int: ...
    def __call__(
        self,
        request: _Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: object | None = None,
        num_lookahead_tokens: int = 0,
        **rest: object,
    ) -> _B | None: ...

@final
class DecodeFloor(Generic[_B]):
    """The bench's probe of the decode call's least cost (``rust/py/floor.rs``; not a mode
    of the plugin): ``empty`` for ``(request, 1)`` with at most one keyword, reading nothing
    of the request; every other call goes to ``slow`` with the same arguments. Present only
    in the probe build (the cargo feature ``bench-probe``: ``scripts/install-local.sh``); the
    release wheel has no ``DecodeFloor`` (``hybrid_alloc.bench.floor.available()``)."""

    def __new__(cls, empty: _B, slow: Callable[..., _B | None]) -> DecodeFloor[_B]: ...
    def __call__(self, request: object, num_new_tokens: int, **rest: object) -> _B | None: ...
