"""The typed Python API over the compiled core: results, bad input (a clear exception
under HybridAllocError, state unchanged), the regression tests of issue 8's reproducers
(P1-P6, A1, C1, C3-C7), the reference cycle through FastAllocate, re-entrancy, cross
attention, and that ``import hybrid_alloc`` needs no vLLM."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

import hybrid_alloc as ha
from api_helpers import EMPTY, FakeRequest, H, alloc, allocate, hashes
from hybrid_alloc import Allocator, Hit
from hybrid_alloc._core import FastAllocate


def snapshot(a: Allocator, handles: list[int]) -> tuple:  # type: ignore[type-arg]
    """Everything a failed call must leave as it was."""
    return (
        a.num_free_blocks,
        a.usage,
        a.free_queue_order(),
        [a.block_ids(h) for h in handles],
        [a.num_hashes(h) for h in handles],
        [a.noop_limits(h) for h in handles],
        a.num_requests,
        [(a.ref_cnt(b), a.block_hash(b)) for b in range(a.num_blocks)],
        a.has_events,
    )


def unchanged(a: Allocator, handles: list[int], snap: tuple) -> None:  # type: ignore[type-arg]
    assert snapshot(a, handles) == snap
    a.check_invariants()


def test_allocate_prefix_hit_and_free_order() -> None:
    a = alloc()
    r1 = a.add_request()
    assert allocate(a, r1, 40, new=hashes(1, 2), prompt=40, tokens=40) == ([1, 2, 3],)
    assert a.num_free_blocks == 12
    r2 = a.add_request()
    hit, uncached, groups = a.get_computed_blocks(r2, 39, block_hashes=hashes(1, 2))
    assert (hit, uncached, groups) == (32, 0, ([1, 2],))
    assert allocate(a, r2, 8, hit=Hit.STORED, hit_tokens=32, prompt=40, tokens=40) == ([4],)
    assert a.ref_cnt(1) == 2 and a.block_ids(r2) == ([1, 2, 4],)
    a.free(r1)
    a.free(r2)
    # Unhashed tails first (r2's then r1's), then cached blocks, tail first.
    assert a.free_queue_order()[:2] == [4, 3]
    assert a.block_hash(1) == ((1).to_bytes(H, "big"), 0)
    a.check_invariants()


def test_as_buffer_results_hold_the_same_ids_as_lists() -> None:
    a = alloc("swa", window=32, num_blocks=32)
    r1 = a.add_request()
    buf = allocate(a, r1, 40, new=hashes(1, 2), prompt=40, tokens=40, as_buffer=True)
    assert isinstance(buf, ha._core.BlockIds)
    assert buf.lists() == a.block_ids(r1) == ([1, 2, 3], [4, 5, 6])
    assert buf.lists() is not buf.lists() and buf.lists()[0] is not buf.lists()[0]  # fresh lists each time
    assert (len(buf), buf.counts(), buf.is_empty()) == (2, [3, 3], False)
    assert a.block_ids(r1, as_buffer=True).lists() == a.block_ids(r1)
    r2 = a.add_request()
    hit, uncached, groups = a.get_computed_blocks(r2, 39, block_hashes=hashes(1, 2), as_buffer=True)
    assert (hit, uncached, groups.lists(), groups.counts()) == (32, 0, ([1, 2], [4, 5]), [2, 2])
    assert a.get_computed_blocks(r2, 39, block_hashes=hashes(1, 2))[2] == ([1, 2], [4, 5])
    # A step that needs no new block: every group empty.
    r3 = a.add_request()
    allocate(a, r3, 8, new=[], prompt=8, tokens=8)
    empty = allocate(a, r3, 1, computed=8, prompt=8, tokens=9, as_buffer=True)
    assert empty.is_empty() and empty.lists() == ([], []) and empty.counts() == [0, 0]
    # Too many blocks: None, as with lists.
    assert allocate(a, a.add_request(), 4096, new=[], prompt=4096, tokens=4096, as_buffer=True) is None
    a.check_invariants()


def test_explicit_hit_with_the_right_blocks_is_adopted() -> None:
    a = alloc()
    r1 = a.add_request()
    allocate(a, r1, 40, new=hashes(1, 2), prompt=40, tokens=40)
    r2 = a.add_request()
    assert allocate(a, r2, 8, new=hashes(1, 2), hit=[[1, 2]], hit_tokens=32, tokens=40) == ([4],)
    assert a.block_ids(r2) == ([1, 2, 4],)
    a.check_invariants()


def test_sliding_window_recycles_and_keeps_positions() -> None:
    a = alloc("swa", window=32, num_blocks=32)
    r = a.add_request()
    allocate(a, r, 64, new=hashes(1, 2, 3, 4), prompt=64, tokens=64)
    before = a.num_free_blocks
    allocate(a, r, 1, computed=64, prompt=64, tokens=65)
    full, swa = a.block_ids(r)
    assert len(full) == 5 and len(swa) == 5
    assert swa[:2] == [0, 0]  # out-of-window blocks became the null block
    assert a.num_free_blocks == before - 2 + 2
    a.check_invariants()


def test_unknown_request_and_double_free_raise() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20)
    a.free(r)
    snap = snapshot(a, [])
    with pytest.raises(ha.UnknownRequestError):
        a.free(r)
    with pytest.raises(ha.UnknownRequestError):
        a.block_ids(12345)
    with pytest.raises(ha.UnknownRequestError):
        a.free(-1)
    with pytest.raises(ha.UnknownRequestError):
        a.finalize_partial_tail_offloads(r, 16, 0)
    unchanged(a, [], snap)


def test_finalize_partial_tail_offloads_without_a_tail_is_empty() -> None:
    """No Mamba "align" group keyed a partial tail: nothing, whatever the counts (vLLM compares
    them, it does not check them), and nothing changes."""
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20)
    snap = snapshot(a, [r])
    for computed, in_flight in ((20, 0), (0, 0), (-1, -1), (2**62, 3)):
        assert a.finalize_partial_tail_offloads(r, computed, in_flight) == []
    unchanged(a, [r], snap)


def test_c7_stale_handle_is_refused_not_aliased() -> None:
    """C7: a handle whose request was freed no longer reaches its slot's next owner."""
    a = alloc()
    old = a.add_request()
    allocate(a, old, 20)
    a.free(old)
    new = a.add_request()  # reuses the slot
    allocate(a, new, 20)
    snap = snapshot(a, [new])
    for call in (
        lambda: a.free(old),
        lambda: a.block_ids(old),
        lambda: allocate(a, old, 1, computed=20),
        lambda: a.cache_blocks(old, 16),
        lambda: a.pop_blocks_for_free(old),
    ):
        with pytest.raises(ha.UnknownRequestError):
            call()
    unchanged(a, [new], snap)
    other = alloc()
    with pytest.raises(ha.UnknownRequestError):
        other.free(new)  # another allocator's handle


def test_bad_counts_raise_and_leave_state() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(9))
    snap = snapshot(a, [r])
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 0, computed=20, new=hashes(9, 10))  # nothing to compute or adopt
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, -5)
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 1, computed=20, new=hashes(9, 10) + ["not bytes"])  # type: ignore[list-item]
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 1, computed=20, new=[b"x" * 33])
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 1, computed=20, hit_tokens=16)  # computed tokens without hit blocks
    with pytest.raises(TypeError):
        allocate(a, r, 1, computed=20, hit="stored")
    unchanged(a, [r], snap)


def test_invalid_blocks_raise_and_leave_state() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20)
    snap = snapshot(a, [r])
    with pytest.raises(ha.InvalidBlockError):
        a.evict_blocks([1, 99])
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([1, 1])
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([5])  # a free block
    with pytest.raises(ha.InvalidBlockError):
        a.ref_cnt(16)
    unchanged(a, [r], snap)


def test_p1_huge_hit_ids_raise() -> None:
    """P1: hit ids whose sizes wrap (the old concatenated ids + counts) cannot panic."""
    a = alloc()
    r = a.add_request()
    snap = snapshot(a, [r])
    with pytest.raises(ha.InvalidBlockError):
        allocate(a, r, 16, hit=[[2**62] * 4], hit_tokens=64, new=hashes(1, 2, 3, 4))
    with pytest.raises(ha.InvalidBlockError):
        allocate(a, r, 16, hit=[[-1]], hit_tokens=16, new=hashes(1))
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 16, hit=[[1], [2]], hit_tokens=16, new=hashes(1))  # two groups for one
    unchanged(a, [r], snap)


def test_p2_p3_caching_more_blocks_than_held_is_refused_then_caching_works() -> None:
    """P2: caching past the table (hashes for 2 blocks, none held) raises; P3: the request
    can still be cached normally afterwards."""
    a = alloc()
    r = a.add_request()
    snap = snapshot(a, [r])
    with pytest.raises(ha.OutOfRangeError):
        a.cache_blocks(r, 32, block_hashes=hashes(1, 2), num_prompt_tokens=32)
    unchanged(a, [r], snap)
    assert allocate(a, r, 32, delay_cache_blocks=True) == ([1, 2],)
    a.cache_blocks(r, 32, block_hashes=hashes(1, 2), num_prompt_tokens=32)
    a.cache_blocks(r, 32, block_hashes=hashes(1, 2), num_prompt_tokens=32)
    assert a.block_hash(2) == ((2).to_bytes(H, "big"), 0)
    a.check_invariants()


def test_p2_step_past_max_model_len_caches_only_what_it_holds() -> None:
    """P2 through allocate_slots: a step reaching past max_model_len with hashes for it."""
    a = alloc(mml=32)
    r = a.add_request()
    assert allocate(a, r, 48, new=hashes(1, 2, 3), tokens=48) == ([1, 2],)
    assert a.block_hash(1) is not None and a.block_hash(2) is not None
    a.check_invariants()


def test_p4_external_tokens_past_max_model_len_raise() -> None:
    for num_blocks in (8, 600):
        a = alloc(num_blocks=num_blocks, mml=64)
        r = a.add_request()
        snap = snapshot(a, [r])
        with pytest.raises(ha.OutOfRangeError):
            allocate(a, r, 1, num_external_computed_tokens=1000, tokens=64)
        unchanged(a, [r], snap)
        assert allocate(a, r, 1, num_external_computed_tokens=48, tokens=64) == ([4],)  # as vLLM: external
        assert a.block_ids(r) == ([1, 2, 3, 4],)  # blocks are not reported as new
        a.check_invariants()


def test_p5_computed_tokens_ahead_of_the_table_are_counted_exactly() -> None:
    """P5: a sliding-window request with nothing cached, its computed tokens ahead of its
    table: the capacity check counts what the allocation takes (14 blocks per group)."""
    a = alloc("swa", window=32, num_blocks=21)
    r = a.add_request()
    snap = snapshot(a, [r])
    assert allocate(a, r, 16, computed=200) is None
    unchanged(a, [r], snap)
    big = alloc("swa", window=32, num_blocks=40)
    r = big.add_request()
    res = allocate(big, r, 16, computed=200)
    assert res is not None and [len(g) for g in res] == [14, 14]
    big.check_invariants()


def test_p6_free_block_ids_refuses_a_block_a_table_holds() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 40)
    snap = snapshot(a, [r])
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([1])
    unchanged(a, [r], snap)
    a.free(r)  # the block had one owner all along
    a.check_invariants()
    assert a.num_free_blocks == 15


def test_a1_huge_pool_raises_memory_error() -> None:
    for caching in (True, False):
        with pytest.raises(MemoryError):
            Allocator(2**32 - 3, [("full", 16, 0, 0, 0)], 16, 16, 4096, enable_caching=caching)
    with pytest.raises(ha.InvalidConfigError):
        Allocator(2**32 - 1, [("full", 16, 0, 0, 0)], 16, 16, 4096)


def test_c1_empty_hash_is_refused_not_dropped() -> None:
    a = alloc()
    r1 = a.add_request()
    allocate(a, r1, 48, new=hashes(1, 2, 3), tokens=48)
    r2 = a.add_request()
    snap = snapshot(a, [r1, r2])
    with pytest.raises(ha.OutOfRangeError):
        a.get_computed_blocks(r2, 47, block_hashes=[b""] + hashes(1, 2))
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r2, 48, new=[b""] + hashes(1, 2))
    with pytest.raises(ha.OutOfRangeError):
        a.set_block_hashes(r2, hashes(7) + [b""])
    unchanged(a, [r1, r2], snap)
    assert a.get_computed_blocks(r2, 47, block_hashes=hashes(5, 1, 2))[0] == 0  # no false hit


def test_c3_token_sums_do_not_wrap() -> None:
    a = alloc()
    r = a.add_request()
    snap = snapshot(a, [r])
    assert allocate(a, r, 2**32 - 1) is None  # clamped to max_model_len: 256 blocks, 15 free
    unchanged(a, [r], snap)
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 2**32 - 1, computed=1)
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 2**31, num_lookahead_tokens=2**31)
    unchanged(a, [r], snap)


def test_c4_failed_call_keeps_the_stored_hashes() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 40, new=hashes(1, 2))
    snap = snapshot(a, [r])
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 0, computed=40, new=[])  # nothing to do: refused before the sync
    with pytest.raises(ha.InvalidBlockError):
        allocate(a, r, 8, computed=40, new=hashes(1, 2, 3), hit=[[99]], hit_tokens=16)  # after the sync
    unchanged(a, [r], snap)


def test_c5_explicit_hits_are_validated() -> None:
    a = alloc("swa", window=32, num_blocks=32)
    r1 = a.add_request()
    allocate(a, r1, 64, new=hashes(1, 2, 3, 4), tokens=64)
    full, swa = a.block_ids(r1)
    other = a.add_request()
    allocate(a, other, 32, new=hashes(7, 8), tokens=32)
    ofull, oswa = a.block_ids(other)
    r2 = a.add_request()
    a.set_block_hashes(r2, hashes(1, 2, 3, 4))
    snap = snapshot(a, [r1, other, r2])
    bad = {
        "null in a full-attention hit": ([[0, full[1]], [0, swa[1]]], ha.InvalidBlockError),
        "null after a real block": ([full[:2], [swa[0], 0]], ha.InvalidBlockError),
        "duplicated": ([[full[0], full[0]], swa[:2]], ha.InvalidBlockError),
        "uncached block": ([[full[0], 30], swa[:2]], ha.InvalidBlockError),
        "another request's block": ([ofull[:2], oswa[:2]], ha.InvalidBlockError),
        "the other group's block": ([swa[:2], full[:2]], ha.InvalidBlockError),
        "shifted positions": ([full[1:3], swa[1:3]], ha.InvalidBlockError),
        "out of range": ([[full[0], 32], swa[:2]], ha.InvalidBlockError),
        "wrong length": ([full[:1], swa[:2]], ha.OutOfRangeError),
        "past the hashes": ([full[:4], swa[:4]], ha.OutOfRangeError),
    }
    for name, (hit, err) in bad.items():
        n = len(hit[1]) * 16
        with pytest.raises(err):
            allocate(
                a,
                r2,
                8,
                hit=hit,
                hit_tokens=n if name != "past the hashes" else 64,
                new=hashes(1, 2, 3) if name == "past the hashes" else None,
                tokens=72,
            )
        unchanged(a, [r1, other, r2], snap)
    # The valid hit (SWA blocks before the window may be null) is adopted.
    assert allocate(a, r2, 8, hit=[full[:2], [0, swa[1]]], hit_tokens=32, tokens=40) is not None
    a.check_invariants()


def test_c6_stored_hit_whose_blocks_were_reused_is_refused() -> None:
    a = alloc(num_blocks=5)
    r1 = a.add_request()
    allocate(a, r1, 32, new=hashes(1, 2), tokens=33)
    a.free(r1)
    r2 = a.add_request()
    assert a.get_computed_blocks(r2, 32, block_hashes=hashes(1, 2))[2] == ([1, 2],)
    thief = a.add_request()
    allocate(a, thief, 64, new=hashes(5, 6, 7, 8))  # takes every free block, evicting 1 and 2
    a.free(thief)
    snap = snapshot(a, [r2])
    with pytest.raises(ha.InvalidBlockError, match="reused"):
        allocate(a, r2, 1, hit=Hit.STORED, hit_tokens=32, tokens=33)
    unchanged(a, [r2], snap)
    assert a.get_computed_blocks(r2, 32)[0] == 0  # a fresh lookup finds nothing


def test_block_hashes_cleared_and_regrown_or_truncated_are_followed() -> None:
    """vLLM 0.33 clears and regrows ``request.block_hashes`` (resumable requests with
    lookahead) and truncates it (streaming input): the core follows the list it is given."""
    a = alloc(num_blocks=32)
    r1 = a.add_request()
    allocate(a, r1, 64, new=hashes(1, 2, 3, 4), tokens=64)
    r2 = a.add_request()
    a.set_block_hashes(r2, hashes(9, 9, 9))
    assert a.get_computed_blocks(r2, 63, block_hashes=hashes(1, 2, 3, 4))[:2] == (48, 0)  # rewritten from 0
    assert a.num_hashes(r2) == 4
    assert a.get_computed_blocks(r2, 63, block_hashes=hashes(1, 2))[0] == 32  # truncated
    assert a.num_hashes(r2) == 2
    assert a.get_computed_blocks(r2, 63, block_hashes=hashes(1, 5, 6))[0] == 16  # rewritten from 1
    assert a.num_hashes(r2) == 3
    a.set_block_hashes(r2, [])
    assert a.num_hashes(r2) == 0


def test_pop_blocks_for_free_then_free_block_ids() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 40)
    blocks = a.pop_blocks_for_free(r)
    assert blocks == [1, 2, 3] and a.num_requests == 0
    a.check_invariants()
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([1, 1])
    a.free_block_ids(list(reversed(blocks)))
    assert a.num_free_blocks == 15
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([1])  # freed already
    a.check_invariants()


def test_cross_attention_served_with_prefix_caching_off() -> None:
    a = Allocator(32, [("full", 16, 0, 0, 0), ("cross", 16, 1, 0, 0)], 16, 16, 4096, enable_caching=False)
    r = a.add_request()
    first = a.allocate_slots(r, 10, num_encoder_tokens=100, num_tokens=10)
    assert first is not None and [len(g) for g in first] == [1, 7]
    second = a.allocate_slots(r, 16, num_computed_tokens=10, num_encoder_tokens=100)
    assert second is not None and [len(g) for g in second] == [1, 0]
    assert [len(g) for g in a.block_ids(r)] == [2, 7]
    a.check_invariants()
    a.free(r)
    assert a.num_free_blocks == 31
    with pytest.raises(ha.UnsupportedConfigError):
        Allocator(32, [("full", 16, 0, 0, 0), ("cross", 16, 1, 0, 0)], 16, 16, 4096, enable_caching=True)


@pytest.mark.parametrize(
    "groups, err",
    [
        ([], ha.InvalidConfigError),
        ([("full", 0, 0, 0, 0)], ha.InvalidConfigError),
        ([("mamba", 16, 0, 0, 0)], ha.UnsupportedConfigError),
        ([("full", 16, 0, 0, 0), ("cross", 16, 1, 0, 0)], ha.UnsupportedConfigError),
        ([("sliding_window", 16, 0, 0, 0)], ha.InvalidConfigError),
        ([("full", 16, 0, 0, 0), ("sliding_window", 48, 1, 64, 0)], ha.InvalidConfigError),
    ],
)
def test_invalid_config_raises(groups: list, err: type) -> None:  # type: ignore[type-arg]
    with pytest.raises(err):
        Allocator(16, groups, 16, 16, 4096)


def test_full_attention_over_a_smaller_hash_block_is_served_in_a_hybrid_only() -> None:
    # A hybrid keys vLLM's partial-block prefix entries (served); one group of that shape, or
    # R-SWA over the hash block, is refused by the core (vLLM's unitary coordinator asserts).
    Allocator(16, [("full", 32, 0, 0, 0), ("sliding_window", 32, 1, 64, 0)], 16, 32, 4096)
    with pytest.raises(ha.UnsupportedConfigError, match="full attention with block size 32"):
        Allocator(16, [("full", 32, 0, 0, 0)], 16, 32, 4096)
    with pytest.raises(ha.UnsupportedConfigError, match="block size 32 over hash block size 16"):
        Allocator(16, [("rswa", 32, 0, 64, 0), ("sliding_window", 32, 1, 64, 0)], 16, 32, 4096)
    Allocator(16, [("full", 32, 0, 0, 0)], 16, 32, 4096, enable_caching=False)  # served without caching


def test_out_of_range_config_values_raise() -> None:
    with pytest.raises(ha.OutOfRangeError):
        Allocator(-1, [("full", 16, 0, 0, 0)], 16, 16, 4096)
    with pytest.raises(ha.InvalidConfigError):
        Allocator(0, [("full", 16, 0, 0, 0)], 16, 16, 4096)


def test_errors_share_one_base() -> None:
    for cls in (
        ha.InvalidConfigError,
        ha.UnsupportedConfigError,
        ha.UnknownRequestError,
        ha.OutOfRangeError,
        ha.InvalidBlockError,
        ha.InvariantError,
        ha.ConcurrentUseError,
    ):
        assert issubclass(cls, ha.HybridAllocError)


def test_events_stored_removed_cleared() -> None:
    a = alloc(num_blocks=3)
    r = a.add_request()
    allocate(a, r, 32, new=hashes(1, 2), prompt=33, tokens=33)
    ev = a.take_events()
    assert ev == [("stored", r, 0, 16, 0, 32, None, [(1).to_bytes(H, "big"), (2).to_bytes(H, "big")], [0, 1])]
    a.free(r)
    r2 = a.add_request()
    allocate(a, r2, 16)  # evicts the tail block's hash (block 2)
    assert a.take_events() == [("removed", (2).to_bytes(H, "big"), 0)]
    a.free(r2)
    assert a.reset_prefix_cache()
    assert a.take_events() == [("cleared",)]


def test_import_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import hybrid_alloc\n"
        "a = hybrid_alloc.Allocator(8, [('full', 16, 0, 0, 0)], 16, 16, 128)\n"
        "assert 'vllm' not in [m for m in sys.modules if sys.modules[m] is not None and m.startswith('vllm')]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_allocate_slots_takes_its_arguments_as_its_signature_says() -> None:
    """``Allocator.allocate_slots`` reads its arguments itself (``*args, **kwargs``, no
    pyo3 parser): ``handle`` and ``num_new_tokens`` positionally or by keyword, the rest by
    keyword only, with Python's errors for everything else, and nothing changed by a refused
    call."""
    a = alloc()
    r1, r2, r3 = a.add_request(), a.add_request(), a.add_request()
    assert a.allocate_slots(r1, 16, num_tokens=16) == ([1],)
    assert a.allocate_slots(handle=r2, num_new_tokens=16, num_tokens=16) == ([2],)
    buf = a.allocate_slots(r3, num_new_tokens=16, num_tokens=16, as_buffer=True)
    assert buf is not None and buf.lists() == ([3],)
    free = a.num_free_blocks
    bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        ((r1, 16, None), {}, "takes 2 positional arguments but 3 were given"),
        ((r1,), {}, "missing required argument 'num_new_tokens'"),
        ((), {"num_new_tokens": 16}, "missing required argument 'handle'"),
        ((r1, 16), {"handle": r1}, "multiple values for argument 'handle'"),
        ((r1, 16), {"num_new_token": 1}, "unexpected keyword argument 'num_new_token'"),
        ((None, 16), {}, "argument 'handle'"),
        ((r1, "16"), {}, "argument 'num_new_tokens'"),
        ((r1, 16), {"num_tokens": "x"}, "argument 'num_tokens'"),
    ]
    for args, kw, msg in bad:
        with pytest.raises(TypeError, match=re.escape(msg)):
            a.allocate_slots(*args, **kw)
    with pytest.raises(ha.UnknownRequestError):
        a.allocate_slots(-1, 16)
    assert a.num_free_blocks == free and a.block_ids(r1) == ([1],)
    a.check_invariants()


# ---- FastAllocate: the scheduler's hot call ------------------------------------------------


def fast(a: Allocator, slow_calls: list[Any] | None = None) -> FastAllocate:
    def slow(*args: Any, **kw: Any) -> str:
        if slow_calls is not None:
            slow_calls.append(args)
        return "slow"

    return FastAllocate(a, EMPTY, slow, lambda groups: ("blocks", groups), None)


def test_fast_allocate_noop_crossing_and_fallback() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(1), tokens=20)
    calls: list[Any] = []
    fa = fast(a, calls)
    req = FakeRequest(r, 20, 21, hashes(1))
    assert fa(req, 1) is EMPTY  # block 2 has room: answered from the no-op limits
    req.num_computed_tokens = 32
    req.num_tokens = 33
    assert fa(req, 1) == ("blocks", ([3],))  # opens block 3 and caches block 2
    assert a.num_hashes(r) == 1
    assert fa(FakeRequest(r + 1, 0, 5, []), 5) == "slow"  # not a live handle here
    assert fa(req, 1, num_external_computed_tokens=3) == "slow"  # not a plain step
    assert len(calls) == 2
    a.check_invariants()


def test_first_sighting_stops_move_the_junction_on_every_path() -> None:
    """Hit-aware with a Mamba "align" group: the lookup of a request nothing is shared with
    reports its first first-sighting stop (1 block) as the shared prefix's end, and each
    allocation reaching the reported stop moves it to the next power-of-two number of blocks
    within the lookup (2, 4, 8). ``allocate_slots(request=...)`` sets the moved junction on
    the request; without it ``take_moved_junction`` gives it, once; ``FastAllocate`` sets it
    on a plain step. Exact reports no junction and moves none."""
    from hybrid_alloc.specs import FullAttention, MambaAlign

    groups: list[FullAttention | MambaAlign] = [FullAttention(block_size=16), MambaAlign(block_size=16, spec_key=1)]
    prompt, keys = 10 * 16 + 2, hashes(*range(1, 11))
    m = Allocator(64, groups, 16, 16, 4096, policy="hit-aware")
    r = m.add_request()
    hit, uncached, _ = m.get_computed_blocks(r, prompt - 1, block_hashes=keys)
    assert (hit, uncached) == (0, 16)
    req = FakeRequest(r, 0, prompt, keys)
    req.shared_prefix_boundary = 16
    assert allocate(m, r, 16, prompt=prompt, tokens=prompt, shared_prefix_boundary=16, request=req) is not None
    assert req.shared_prefix_boundary == 32 and m.take_moved_junction(r) == 0  # taken by the call
    assert allocate(m, r, 16, computed=16, prompt=prompt, tokens=prompt, shared_prefix_boundary=32) is not None
    assert m.take_moved_junction(r) == 64 and m.take_moved_junction(r) == 0
    step = fast(m)
    req.num_computed_tokens, req.shared_prefix_boundary = 32, 64
    out = step(req, 32)  # served by the fast path: its result, not the slow path's
    assert out is not None and out[0] == "blocks" and req.shared_prefix_boundary == 128
    # A chunk short of the stop moves nothing; the last stop within the lookup ends it.
    req.num_computed_tokens = 64
    assert step(req, 16) is not None and req.shared_prefix_boundary == 128
    req.num_computed_tokens = 80
    assert step(req, 48) is not None and req.shared_prefix_boundary == 128
    assert m.take_moved_junction(r) == 0 and not m.may_move_junction(r)
    m.check_invariants()
    # An object whose junction cannot be written raises before anything changes, on both
    # paths, while a move is possible.
    r2 = m.add_request()
    m.get_computed_blocks(r2, prompt - 1, block_hashes=hashes(*range(20, 30)))
    assert m.may_move_junction(r2)

    class ReadOnly(FakeRequest):
        locked = False

        @property
        def shared_prefix_boundary(self) -> int:
            return 16

        @shared_prefix_boundary.setter
        def shared_prefix_boundary(self, v: int) -> None:
            if self.locked:
                raise AttributeError("read-only")

    ro = ReadOnly(r2, 0, prompt, hashes(*range(20, 30)))
    ro.locked = True
    snap = snapshot(m, [r, r2])
    with pytest.raises(AttributeError, match="read-only"):
        allocate(m, r2, 16, prompt=prompt, tokens=prompt, shared_prefix_boundary=16, request=ro)
    with pytest.raises(AttributeError):
        allocate(m, r2, 16, prompt=prompt, tokens=prompt, shared_prefix_boundary=16, request=object())
    unchanged(m, [r, r2], snap)
    assert allocate(m, r2, 16, prompt=prompt, tokens=prompt, shared_prefix_boundary=16) is not None
    assert m.take_moved_junction(r2) == 32
    ro.num_computed_tokens = 16
    snap = snapshot(m, [r, r2])
    with pytest.raises(AttributeError, match="read-only"):
        step(ro, 16)
    unchanged(m, [r, r2], snap)
    e = Allocator(64, groups, 16, 16, 4096, policy="exact")
    r = e.add_request()
    assert e.get_computed_blocks(r, prompt - 1, block_hashes=keys)[:2] == (0, 0)
    req = FakeRequest(r, 0, prompt, keys)
    assert allocate(e, r, 16, prompt=prompt, tokens=prompt, request=req) is not None
    assert req.shared_prefix_boundary == 0 and e.take_moved_junction(r) == 0
    with pytest.raises(ha.UnknownRequestError):
        e.take_moved_junction(12345)


def test_fast_allocate_serves_only_the_decode_call_form_and_forwards_the_rest_as_given() -> None:
    """The fast path reads ``*args, **kwargs`` itself: it serves ``(request, n)`` and
    ``(request, n, num_lookahead_tokens=k)`` (the scheduler's decode call); any other form,
    explicit defaults included, or a value of the wrong type, reaches ``slow`` with the
    positionals and keywords exactly as given (so its own checks and errors apply)."""
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(1), tokens=20)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def slow(*args: Any, **kw: Any) -> str:
        seen.append((args, kw))
        return "slow"

    fa: FastAllocate[Any] = FastAllocate(a, EMPTY, slow, lambda groups: ("blocks", groups), None)
    req = FakeRequest(r, 20, 21, hashes(1))
    assert fa(req, 1) is EMPTY
    assert fa(req, 1, num_lookahead_tokens=0) is EMPTY
    assert fa(req, 1, num_lookahead_tokens=11) is EMPTY  # 20 + 1 + 11 slots: block 2 holds them
    assert fa(req, 1, **{"".join(["num_look", "ahead_tokens"]): 0}) is EMPTY  # a key equal, not interned
    assert seen == []
    forms: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((req, 1, 0), {}),
        ((req, 1), {"num_new_computed_tokens": 0}),
        ((req, 1), {"num_lookahead_tokens": 0, "new_computed_blocks": None}),
        ((req,), {"num_new_tokens": 1}),
        ((req, 0), {}),
        ((req, "1"), {}),
        ((req, 1), {"num_lookahead_tokens": "0"}),
        ((req, 1), {"delay_cache_blocks": True}),
    ]
    for args, kw in forms:
        assert fa(*args, **kw) == "slow"
    assert seen == forms
    with pytest.raises(ha.OutOfRangeError):
        fa(req, 1, num_lookahead_tokens=-1)  # the fast path's own check, as before
    assert a.num_hashes(r) == 1
    a.check_invariants()


def test_reentrant_call_raises_concurrent_use_error_and_changes_nothing() -> None:
    """A Request property that calls back into the allocator while FastAllocate holds it
    (the deterministic form of two threads sharing one allocator) gets ConcurrentUseError,
    not ``RuntimeError: Already mutably borrowed``, and nothing changes."""
    a = alloc()
    r = a.add_request()
    allocate(a, r, 16, tokens=16)
    seen: list[BaseException] = []

    class Reentrant(FakeRequest):
        @property  # type: ignore[override]
        def num_in_flight_tokens(self) -> int:
            try:
                a.free(r)
            except BaseException as e:
                seen.append(e)
                raise
            return 0

        @num_in_flight_tokens.setter
        def num_in_flight_tokens(self, v: int) -> None:
            pass

    snap = snapshot(a, [r])
    with pytest.raises(ha.ConcurrentUseError):
        fast(a)(Reentrant(r, 16, 17, []), 1)
    assert len(seen) == 1 and type(seen[0]) is ha.ConcurrentUseError
    unchanged(a, [r], snap)
    a.free(r)  # usable again afterwards


def test_threads_share_one_allocator_without_corruption() -> None:
    """Four threads on one allocator: every call either completes or raises
    ConcurrentUseError (never another error, never a corrupt state)."""
    import threading

    a = alloc(num_blocks=64)
    errors: list[BaseException] = []

    def work() -> None:
        for _ in range(300):
            try:
                h = a.add_request()
            except ha.ConcurrentUseError:
                continue
            try:
                allocate(a, h, 17)
            except ha.ConcurrentUseError:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            while True:
                try:
                    a.free(h)
                    break
                except ha.ConcurrentUseError:
                    continue

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    a.check_invariants()
    assert a.num_free_blocks == 63 and a.num_requests == 0


# ---- the reference cycle through FastAllocate ---------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class CycleManager:
    """What the vLLM adapter builds: the manager holds a FastAllocate that holds the
    manager's bound methods."""

    def __init__(self, num_blocks: int) -> None:
        self.alloc = Allocator(num_blocks, [("full", 16, 0, 0, 0)], 16, 16, 4096)
        self.allocate_slots = FastAllocate(self.alloc, EMPTY, self.slow, self.make, self.on_events)

    def slow(self, *args: Any, **kw: Any) -> None:
        return None

    def make(self, groups: Any) -> Any:
        return groups

    def on_events(self, request: Any) -> None:
        return None


def test_fast_allocate_cycle_is_collected_and_rss_stays_flat() -> None:
    m = CycleManager(1000)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None, "the manager <-> FastAllocate cycle was not collected"
    for _ in range(3):  # warm up the allocator's arenas
        CycleManager(500_000)
        gc.collect()
    start = rss_mib()
    for _ in range(20):
        CycleManager(500_000)  # ~40 MiB of pool metadata each
        gc.collect()
    grown = rss_mib() - start
    assert grown < 100, f"RSS grew by {grown:.0f} MiB over 20 dropped managers"


# ---- the direct API's example runs (docs/direct-api.md; the README links it) ---------------


def test_direct_api_example_runs() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "direct-api.md").read_text()
    section = doc.split("## A whole round", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    exec(compile(code.group(1), "docs/direct-api.md", "exec"), {})  # noqa: S102 (the docs' own example)


def test_connector_hit_per_group_and_bad_input() -> None:
    """``get_computed_blocks_for_connector``: without Mamba groups the reconciled hit (no
    per-group lengths); with ``reconcile=False`` each group's own hit; a GDN-like Mamba group
    lagging behind full attention gives the per-group hit. Bad input raises, state unchanged."""
    a = alloc("swa", window=32)
    r1 = a.add_request()
    allocate(a, r1, 64, new=hashes(1, 2, 3, 4), prompt=64, tokens=64)
    r2 = a.add_request()
    assert a.get_computed_blocks_for_connector(r2, 63, block_hashes=hashes(1, 2, 3, 4)) == (
        48,
        0,
        None,
        ([1, 2, 3], [0, 6, 7]),
    )
    _, _, lens, _ = a.get_computed_blocks_for_connector(r2, 63, reconcile=False)
    assert lens == [48, 48]
    from hybrid_alloc.specs import FullAttention, MambaAlign

    m = Allocator(16, [FullAttention(block_size=16), MambaAlign(block_size=16, spec_key=1)], 16, 16, 4096)
    r1 = m.add_request()
    assert allocate(m, r1, 64, new=hashes(1, 2, 3, 4, 5), prompt=80, tokens=80) is not None
    r2 = m.add_request()
    # Full attention hits 3 blocks within 63 tokens; the Mamba state is only at 64.
    hit, uncached, lens, groups = m.get_computed_blocks_for_connector(r2, 63, block_hashes=hashes(1, 2, 3, 4))
    assert (hit, uncached, lens, groups[1]) == (48, 0, [48, 0], [])
    snap = snapshot(m, [r1, r2])
    with pytest.raises(ha.UnknownRequestError):
        m.get_computed_blocks_for_connector(12345, 63)
    with pytest.raises(ha.OutOfRangeError):
        m.get_computed_blocks_for_connector(r2, -1)
    unchanged(m, [r1, r2], snap)
