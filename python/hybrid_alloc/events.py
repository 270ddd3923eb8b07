"""The core's KV cache events, as :meth:`hybrid_alloc.Allocator.take_events` returns them.

Each event is a :class:`typing.NamedTuple` whose first field ``kind`` names it, so it reads
by field name and still equals (and unpacks as) the plain tuple it used to be:
``BlockRemoved("removed", h, 0) == ("removed", h, 0)``. The native extension builds them
from these classes directly (``tuple.__new__``), one object per event.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, TypeAlias

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "CoreEvent"]


class BlockStored(NamedTuple):
    """Blocks of one request and group became cached (vLLM's ``BlockStored``)."""

    kind: Literal["stored"]
    #: The handle of the request whose blocks were cached.
    handle: int
    #: The KV cache group.
    group: int
    #: Tokens per block of the group.
    block_size: int
    #: The first token the stored blocks cover.
    start_token: int
    #: One past the last token they cover.
    end_token: int
    #: The hash of the block before the first stored one, or None at the start.
    parent_hash: bytes | None
    #: The stored blocks' hashes, in token order.
    block_hashes: list[bytes]
    #: The stored blocks' indices in the request's block table.
    block_indices: list[int]


class BlockRemoved(NamedTuple):
    """A cached block lost its hash (evicted or dropped; vLLM's ``BlockRemoved``)."""

    kind: Literal["removed"]
    #: The hash the block had.
    block_hash: bytes
    #: The KV cache group.
    group: int


class AllBlocksCleared(NamedTuple):
    """The prefix cache was reset (vLLM's ``AllBlocksCleared``)."""

    kind: Literal["cleared"]


CoreEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
