"""Defects of the direct API found on the way to issue 15, each run through
``hybrid_alloc.Allocator`` as a user would.

8a: ``allocate_slots`` accepted a computed-token count ahead of what the request's table
was given, then cached never-written blocks under the request's real hashes, so a second
request with the same prompt got a hit on them. The direct API now refuses it with
``OutOfRangeError`` and changes nothing when the call would cache those blocks; when it
would not (their hashes are not known yet), it allocates as vLLM's does, and no later call
ever caches the request's blocks from the first never-written token on. The vLLM adapter stays exact to vLLM's manager,
which takes a ``Request``'s count as it comes: an allocator a ``FastAllocate`` serves
trusts the count.

Issue 28 item 7 (a regression of 816af77): ``allocate_slots`` accepted a hit list shorter
than ``num_new_computed_tokens`` in a sliding-window group (full attention + a sliding window,
no Mamba, no external tokens), and cached the fresh block after it under the request's hash
for a position it never wrote, so a later request would hit it once the real block was
evicted. Refused again with ``OutOfRangeError``, nothing changed; a shorter group is only a
KV connector's per-group hit (Mamba layers and full attention), adopted with external
tokens."""

from __future__ import annotations

from typing import Any

import pytest

import hybrid_alloc as ha
from hybrid_alloc import Allocator
from hybrid_alloc._core import FastAllocate

H = 32  # hash length (sha256)
PROMPT = 100


def hashes(n: int) -> list[bytes]:
    """Chained-looking hashes of the prompt's full blocks (any distinct bytes do)."""
    return [(1000 + i).to_bytes(H, "big") for i in range(n)]


def allocator() -> Allocator:
    return Allocator(64, [("full", 16, 0, 0, 0)], 16, 16, 4096, 4096, True, True, 0, 0)


def snapshot(a: Allocator, h: int) -> tuple[Any, ...]:
    return (
        a.num_free_blocks,
        a.free_queue_order(),
        a.block_ids(h),
        a.num_hashes(h),
        a.noop_limits(h),
        [(a.ref_cnt(b), a.block_hash(b)) for b in range(a.num_blocks)],
    )


def first_chunk(a: Allocator) -> int:
    """A 100-token request that has computed its first 16 tokens."""
    h = a.add_request()
    got = a.allocate_slots(
        h, 16, block_hashes=hashes(PROMPT // 16), num_computed_tokens=0, num_prompt_tokens=PROMPT, num_tokens=PROMPT
    )
    assert got is not None and [len(g) for g in got] == [1]
    return h


def test_computed_tokens_ahead_of_the_table_are_refused_and_change_nothing() -> None:
    a = allocator()
    h = first_chunk(a)
    a.take_events()
    before = snapshot(a, h)
    with pytest.raises(ha.OutOfRangeError, match="num_computed_tokens=96"):
        a.allocate_slots(h, 1, num_computed_tokens=96, num_tokens=PROMPT)
    assert snapshot(a, h) == before
    assert not a.has_events
    a.check_invariants()
    # A second request with the same prompt hits only the block that was written.
    second = a.add_request()
    hit_tokens, _, _ = a.get_computed_blocks(second, PROMPT - 1, block_hashes=hashes(PROMPT // 16))
    assert hit_tokens == 16
    # The count the table was given is accepted: the next chunk goes on as before.
    assert a.allocate_slots(h, 16, num_computed_tokens=16, num_tokens=PROMPT) is not None
    a.check_invariants()


def test_blocks_never_written_are_never_cached_by_a_later_call() -> None:
    """The same count in two calls: ahead of the table while the request's hashes cover only
    its first block, so this call caches nothing and allocates as vLLM's does (P5 in
    test_api); then the hashes arrive. Neither ``cache_blocks`` nor a later allocation caches
    the never-written blocks: a second request with the same prompt hits only the block that
    was written."""
    a = allocator()
    h = a.add_request()
    assert a.allocate_slots(h, 16, block_hashes=hashes(1), num_prompt_tokens=PROMPT, num_tokens=PROMPT) is not None
    got = a.allocate_slots(h, 1, block_hashes=hashes(1), num_computed_tokens=96, num_tokens=PROMPT)
    assert got is not None and [len(g) for g in got] == [6]
    a.cache_blocks(h, 97, block_hashes=hashes(PROMPT // 16))
    assert a.allocate_slots(h, 3, num_computed_tokens=97, num_tokens=PROMPT) is not None
    second = a.add_request()
    hit_tokens, _, _ = a.get_computed_blocks(second, PROMPT - 1, block_hashes=hashes(PROMPT // 16))
    assert hit_tokens == 16
    a.check_invariants()
    # A request that wrote every block caches them all (the mark is the request's own).
    third = a.add_request()
    assert a.allocate_slots(third, PROMPT, block_hashes=hashes(PROMPT // 16), num_tokens=PROMPT) is not None
    fourth = a.add_request()
    hit_tokens, _, _ = a.get_computed_blocks(fourth, PROMPT - 1, block_hashes=hashes(PROMPT // 16))
    assert hit_tokens == 96


def test_allocator_served_by_fast_allocate_stays_exact_to_vllm() -> None:
    """vLLM's manager allocates and caches the blocks for such a count; an allocator the
    vLLM adapter's ``FastAllocate`` serves does the same (its slow path included)."""
    a = allocator()
    h = first_chunk(a)
    FastAllocate(a, None, lambda *args, **kw: None, lambda t: t, None)
    got = a.allocate_slots(h, 1, num_computed_tokens=96, num_tokens=PROMPT)
    assert got is not None and [len(g) for g in got] == [6]
    second = a.add_request()
    hit_tokens, _, _ = a.get_computed_blocks(second, PROMPT - 1, block_hashes=hashes(PROMPT // 16))
    assert hit_tokens == 96
    a.check_invariants()


def test_hit_list_short_in_a_sliding_window_group_is_refused_and_changes_nothing() -> None:
    a = Allocator(
        32, [("full", 16, 0, 0, 0), ("sliding_window", 16, 1, 32, 0)], 16, 16, 4096, 4096, True, True, 0, None
    )
    s1 = a.add_request()
    assert a.allocate_slots(s1, 40, block_hashes=hashes(2), num_tokens=40) == ([1, 2, 3], [4, 5, 6])
    s2 = a.add_request()
    hit_tokens, uncached, hit = a.get_computed_blocks(s2, 39, block_hashes=hashes(2))
    assert (hit_tokens, uncached, hit) == (32, 0, ([1, 2], [4, 5]))
    a.take_events()
    before = [snapshot(a, h) for h in (s1, s2)]
    with pytest.raises(ha.OutOfRangeError, match="group 1: a hit of 1 blocks of 16 tokens"):
        a.allocate_slots(s2, 8, hit=[[1, 2], [4]], num_new_computed_tokens=32)
    # A block too many, and the short list with external tokens (no Mamba group: no
    # connector's per-group hit), are refused the same way.
    with pytest.raises(ha.OutOfRangeError, match="group 1: a hit of 3 blocks"):
        a.allocate_slots(s2, 8, hit=[[1, 2], [4, 5, 6]], num_new_computed_tokens=32)
    with pytest.raises(ha.OutOfRangeError, match="group 1: a hit of 1 blocks"):
        a.allocate_slots(s2, 4, hit=[[1, 2], [4]], num_new_computed_tokens=32, num_external_computed_tokens=4)
    assert [snapshot(a, h) for h in (s1, s2)] == before
    assert a.block_ids(s2) == ([], [])
    assert not a.has_events
    a.check_invariants()
    # The stored hit is still there, and adopted: no block of the sliding window is cached
    # under a hash its request did not write.
    assert a.allocate_slots(s2, 8, hit=ha.Hit.STORED, num_new_computed_tokens=32, num_tokens=40) == ([7], [8])
    assert a.block_ids(s2) == ([1, 2, 7], [4, 5, 8])
    assert a.block_hash(8) is None
    a.check_invariants()
