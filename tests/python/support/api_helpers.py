"""What the tests of the compiled core's API share (``test_api``, ``test_fast_track``,
``test_blocks_native``): hashes, a small allocator (full attention, optionally a sliding window),
``allocate`` with the adapter's keywords, and the request ``FastAllocate`` reads."""

from __future__ import annotations

from typing import Any

from hybrid_alloc import Allocator

H = 32  # hash length (sha256)


def hashes(*xs: int) -> list[bytes]:
    return [x.to_bytes(H, "big") for x in xs]


def alloc(
    kind: str = "full", window: int = 0, num_blocks: int = 16, caching: bool = True, mml: int = 4096
) -> Allocator:
    groups = [("full", 16, 0, 0, 0)]
    if kind == "swa":
        groups.append(("sliding_window", 16, 1, window, 0))
    if kind == "swa_only":
        groups = [("sliding_window", 16, 0, window, 0)]
    return Allocator(num_blocks, groups, 16, 16, mml, mml, caching, True, 0, 0)


def allocate(
    a: Allocator,
    h: int,
    n: int,
    *,
    computed: int = 0,
    hit: Any = None,
    hit_tokens: int = 0,
    new: list[bytes] | None = None,
    prompt: int | None = None,
    tokens: int | None = None,
    **kw: Any,
) -> Any:
    tokens = tokens if tokens is not None else computed + hit_tokens + n
    return a.allocate_slots(
        h,
        n,
        block_hashes=new,
        hit=hit,
        num_new_computed_tokens=hit_tokens,
        num_computed_tokens=computed,
        num_prompt_tokens=prompt if prompt is not None else tokens,
        num_tokens=tokens,
        **kw,
    )


class FakeRequest:
    """The attributes of vLLM's Request that FastAllocate reads."""

    def __init__(self, handle: int, num_computed_tokens: int, num_tokens: int, block_hashes: list[bytes]) -> None:
        self._hybrid_alloc_handle = handle
        self.num_computed_tokens = num_computed_tokens
        self.num_in_flight_tokens = 0
        self.num_prompt_tokens = num_tokens
        self.num_tokens = num_tokens
        self.shared_prefix_boundary = 0
        self.block_hashes = block_hashes


EMPTY = ("empty",)
