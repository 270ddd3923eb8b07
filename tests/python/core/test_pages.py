"""Two-level pages through the binding (``Allocator(..., slots_per_page=k)``): slot ids for
the attention group, page ids for the state group, free pages and usage, page ids written
after the slots in the flat id lists, and the refusals (a config error, never a panic)."""

from __future__ import annotations

import inspect

import pytest

from api_helpers import allocate, hashes
from hybrid_alloc import Allocator
from hybrid_alloc.errors import InvalidBlockError, InvalidConfigError, OutOfRangeError, UnsupportedConfigError
from hybrid_alloc.specs import FullAttention, MambaAlign, SlidingWindow

PAGES, K = 8, 4


def paged(**kw: object) -> Allocator:
    groups = [FullAttention(block_size=16, spec_key=0), MambaAlign(block_size=32, spec_key=1)]
    return Allocator(PAGES, groups, 16, 32, 4096, slots_per_page=K, enable_events=True, **kw)


def test_slots_per_page_ids_free_pages_and_usage() -> None:
    a = paged()
    assert (a.slots_per_page, a.num_blocks, a.num_free_blocks, a.usage) == (K, PAGES, PAGES - 1, 0.0)
    r = a.add_request()
    allocate(a, r, 64, new=hashes(1, 2, 3, 4, 5), prompt=80, tokens=80)
    slots, states = a.block_ids(r)
    # Four 16-token slots in one page (slot s is slot s % K of page s // K), one state page
    # (the state after 64 tokens, at index 1 of the Mamba table).
    assert len(slots) == 4 and len({s // K for s in slots}) == 1 and all(K <= s < PAGES * K for s in slots)
    assert states[0] == 0 and 0 < states[1] < PAGES and states[1] != slots[0] // K
    assert (a.num_free_blocks, a.usage) == (PAGES - 3, pytest.approx(2 / (PAGES - 1)))
    # Another request's 16 tokens open a page: usage counts its free slots as 3/K of a page.
    r2 = a.add_request()
    (s2,), _ = allocate(a, r2, 16, new=hashes(9), prompt=16, tokens=16)
    assert s2 // K not in {slots[0] // K, states[1]}
    assert a.num_free_blocks == PAGES - 5
    assert a.usage == pytest.approx(1 - (PAGES - 5 + (K - 1) / K) / (PAGES - 1))
    a.free(r2)
    a.check_invariants()
    # The flat id list of pop_blocks_for_free writes the page after every slot id.
    out = a.pop_blocks_for_free(r)
    assert out == [*slots, 0, PAGES * K + states[1]]
    assert a.ref_cnt(PAGES * K + states[1]) == 1 and a.ref_cnt(slots[0]) == 1
    with pytest.raises(InvalidBlockError):
        a.free_block_ids([PAGES * K + PAGES])
    a.free_block_ids(out)
    assert a.num_free_blocks == PAGES - 1
    # The slots stay cached in their free page; the state page too.
    assert a.block_hash(slots[0]) is not None and a.block_hash(PAGES * K + states[1]) is not None
    a.check_invariants()
    assert a.reset_prefix_cache()


@pytest.mark.parametrize(
    ("groups", "kw", "error"),
    [
        ([FullAttention(block_size=16)], {}, InvalidConfigError),
        ([MambaAlign(block_size=32)], {}, InvalidConfigError),
        (
            [
                FullAttention(block_size=16),
                MambaAlign(block_size=32, spec_key=1),
                SlidingWindow(block_size=16, spec_key=2, window=64),
            ],
            {},
            UnsupportedConfigError,
        ),
        (
            [FullAttention(block_size=16), MambaAlign(block_size=32, spec_key=1)],
            {"slots_per_page": 0},
            InvalidConfigError,
        ),
    ],
)
def test_slots_per_page_refusals(groups: list[object], kw: dict[str, object], error: type[Exception]) -> None:
    kw = {"slots_per_page": K, **kw}
    with pytest.raises(error):
        Allocator(PAGES, groups, 16, 32, 4096, **kw)  # type: ignore[arg-type]


def test_slots_per_page_serves_hit_aware_and_refuses_its_pins() -> None:
    """Hit-aware with prefix caching over two-level pages: each pool with its own levels; a
    freed request's slots and state stay cached; the user's pins are refused (a config error,
    nothing changed)."""
    a = paged(policy="hit-aware")
    assert a.policy == "hit-aware"
    r = a.add_request()
    allocate(a, r, 64, new=hashes(1, 2, 3, 4), prompt=64, tokens=64)
    slots, states = a.block_ids(r)
    a.free(r, retain=True)  # a retention priority: freed at the normal level here
    assert a.num_free_blocks == PAGES - 1 and a.block_hash(slots[0]) is not None
    with pytest.raises(UnsupportedConfigError, match="not served with slots_per_page=4"):
        a.pin_prefix(hashes(1, 2))
    a.check_invariants()


def test_slots_per_page_one_is_todays_layout() -> None:
    groups = [FullAttention(block_size=16, spec_key=0), MambaAlign(block_size=16, spec_key=1)]
    a = Allocator(PAGES, groups, 16, 16, 4096, slots_per_page=1)
    assert (a.slots_per_page, a.num_blocks, a.num_free_blocks) == (1, PAGES, PAGES - 1)
    with pytest.raises(OutOfRangeError):
        Allocator(PAGES, groups, 16, 16, 4096, slots_per_page=-1)
    with pytest.raises(TypeError, match="argument 'slots_per_page'"):
        Allocator(PAGES, groups, 16, 16, 4096, slots_per_page=None)  # type: ignore[arg-type]
    sig = inspect.signature(Allocator)
    assert sig.parameters["slots_per_page"].kind is inspect.Parameter.KEYWORD_ONLY
