"""``FastAllocate.track``: the request-address table the decode call finds a request's
handle in without reading its ``_hybrid_alloc_handle`` attribute (issue 19, item 3): a
tracked request is served by the fast path, an untracked one falls back to the attribute, a
stale handle goes to ``slow``, and the table's references are visible to the collector."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from api_helpers import EMPTY, FakeRequest, alloc, allocate, hashes
from hybrid_alloc import Allocator
from hybrid_alloc._core import FastAllocate


class Bare(FakeRequest):
    """A request with the counts FastAllocate reads and no ``_hybrid_alloc_handle``."""

    def __init__(self, num_computed_tokens: int, num_tokens: int, block_hashes: list[bytes]) -> None:
        super().__init__(-1, num_computed_tokens, num_tokens, block_hashes)
        del self._hybrid_alloc_handle


def test_tracked_request_is_served_without_its_attribute_and_untracked_goes_slow() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(1), tokens=20)
    calls: list[Any] = []
    fa: FastAllocate[Any] = FastAllocate(a, EMPTY, lambda *x, **k: calls.append(x) or "slow", lambda g: g, None)
    req = Bare(20, 21, hashes(1))
    assert fa(req, 1) == "slow" and len(calls) == 1  # neither tracked nor tagged
    fa.track(req, r)
    assert fa.num_tracked() == 1
    assert fa(req, 1, num_lookahead_tokens=0) is EMPTY  # found by address: the no-op limits answer
    req.num_computed_tokens, req.num_tokens = 32, 33
    assert fa(req, 1) == ([3],)  # the crossing is served too
    fa.track(req, -1)
    assert fa.num_tracked() == 0
    assert fa(req, 1) == "slow" and len(calls) == 2
    a.check_invariants()


def test_tracked_handle_wins_over_the_attribute_and_a_stale_one_goes_slow() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(1), tokens=20)
    fa: FastAllocate[Any] = FastAllocate(a, EMPTY, lambda *x, **k: "slow", lambda g: g, None)
    req = FakeRequest(-1, 20, 21, hashes(1))  # the attribute says freed
    fa.track(req, r)
    assert fa(req, 1) is EMPTY
    a.free(r)  # freed in the core, still tracked: the handle's generation is stale
    r2 = a.add_request()
    allocate(a, r2, 20, new=hashes(1), tokens=20)
    assert fa(req, 1) == "slow"
    fa.track(req, r2)  # tracked again (a preempted request re-admitted): the new handle
    assert fa.num_tracked() == 1 and fa(req, 1) is EMPTY


def test_tracked_requests_are_released_with_the_fast_allocate() -> None:
    a = Allocator(64, [("full", 16, 0, 0, 0)], 16, 16, 4096)

    class Manager:
        def __init__(self) -> None:
            self.allocate_slots = FastAllocate(a, EMPTY, self.slow, lambda g: g, None)

        def slow(self, *x: Any, **k: Any) -> None:
            return None

    m = Manager()
    req = Bare(0, 5, [])
    req.manager = m  # a cycle through the table: request -> manager -> FastAllocate -> request
    m.allocate_slots.track(req, 0)
    refs = weakref.ref(m), weakref.ref(req)
    del m, req
    gc.collect()
    assert refs[0]() is None and refs[1]() is None, "the cycle through the request table was not collected"
