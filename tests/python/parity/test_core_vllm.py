"""The core's boundary as vLLM reaches it through the adapter: managers built and dropped
in a loop are freed (the FastAllocate cycle is collectable), a request whose
``block_hashes`` list is cleared and regrown (vLLM 0.33, resumable requests with
lookahead) or truncated (streaming input) between two calls gets the same hits as from
vLLM's own manager, and ``block_pool.free_blocks(..., evict_first=True)`` (vLLM 0.34) leaves
the free queue in vLLM's order."""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

from hybrid_alloc.vllm.manager import HybridKVCacheManager
from vllm_harness import SETUPS, Setup, full, swa


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_managers_built_and_dropped_are_freed() -> None:
    setup = Setup("leak", [full(16), swa(64, 16)], num_blocks=400_000)
    m = HybridKVCacheManager(**setup.manager_kwargs())
    assert type(m) is HybridKVCacheManager
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None, "a dropped manager was not collected"
    for _ in range(3):
        HybridKVCacheManager(**setup.manager_kwargs())
        gc.collect()
    start = rss_mib()
    for _ in range(15):
        HybridKVCacheManager(**setup.manager_kwargs())  # ~30 MiB of pool metadata each
        gc.collect()
    grown = rss_mib() - start
    assert grown < 100, f"RSS grew by {grown:.0f} MiB over 15 dropped managers"


def lookup(mgr, req):  # type: ignore[no-untyped-def]
    blocks, hit, _ = mgr.get_computed_blocks(req)
    return hit, blocks.get_block_ids()


def test_block_hashes_cleared_regrown_and_truncated_match_vllm() -> None:
    setup = next(s for s in SETUPS if s.name == "full_swa_bs16")
    ref, ours = setup.build(events=False)
    prompt = list(range(1000, 1200))
    for mgr in (ref, ours):
        r1 = setup.make_request("r1", prompt)
        blocks, hit, _ = mgr.get_computed_blocks(r1)
        assert mgr.allocate_slots(r1, len(prompt) - hit, hit, blocks) is not None
    r_ref, r_ours = (setup.make_request("r2", prompt[:120] + [7] * 80) for _ in range(2))
    assert lookup(ref, r_ref) == lookup(ours, r_ours)
    for r in (r_ref, r_ours):
        # What vLLM 0.33's scheduler does for a resumable request with lookahead hashes.
        r.block_hashes.clear()
        r.update_block_hashes()
    assert lookup(ref, r_ref) == lookup(ours, r_ours)
    for r in (r_ref, r_ours):
        # Rewritten from the start: another prompt of the same length.
        # (In place: a list before 0.34, a ``TokenBuffer``, an ``array('i')``, from 0.34.)
        del r._all_token_ids[:]
        r._all_token_ids.extend(prompt[:200])
        r.block_hashes.clear()
        r.update_block_hashes()
    hit_ref = lookup(ref, r_ref)
    assert hit_ref[0] > 112 and hit_ref == lookup(ours, r_ours)
    for r in (r_ref, r_ours):
        del r.block_hashes[3:]  # streaming input truncates the list
    assert lookup(ref, r_ref) == lookup(ours, r_ours)
    assert ours._alloc.num_hashes(ours._reqs["r2"][0]) == 3  # the core followed the truncation
    ours.check_invariants()


def test_cross_attention_with_prefix_caching_off_matches_vllm() -> None:
    """The README serves cross attention (encoder-decoder) with prefix caching off: the
    static encoder allocation and the decoder's blocks match vLLM's manager."""
    import torch
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    setup = Setup("full_cross_nocache", [full(16), cross], num_blocks=64, enable_caching=False)
    ref, ours = setup.build(events=False)
    for mgr in (ref, ours):
        r = setup.make_request("enc", list(range(40)))
        assert mgr.allocate_slots(r, 40, num_encoder_tokens=100) is not None
        r.num_computed_tokens = 40
        r.append_output_token_ids(7)
        assert mgr.allocate_slots(r, 1, num_encoder_tokens=100) is not None
    assert ref.get_block_ids("enc") == ours.get_block_ids("enc")
    assert [len(g) for g in ours.get_block_ids("enc")] == [3, 7]
    assert ref.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
    ours.check_invariants()


def test_free_blocks_evict_first_matches_vllm() -> None:
    """``block_pool.free_blocks(blocks, evict_first=True)`` (vLLM 0.34; its caller is the
    SimpleCPUOffload connector's manager) against vLLM's real ``BlockPool``: freed blocks,
    cached ones too, go to the front of the free queue, a block another request still holds
    stays out of it. A mix of cached, uncached and shared blocks in two groups (full
    attention and a sliding window with dense retention, whose skipped blocks in a hit are
    the null block), freed with and without ``evict_first``: the same free queue order after
    every free, then the same hit, the same blocks for a new request and the same events."""
    import inspect

    import pytest
    from vllm.v1.core.block_pool import BlockPool

    if "evict_first" not in inspect.signature(BlockPool.free_blocks).parameters:
        pytest.skip("this vLLM's BlockPool.free_blocks has no evict_first (0.34 has)")
    setup = Setup("evict_first", [full(16), swa(32, 16)], num_blocks=48, retention_interval=None)
    out = {}
    for name, mgr in zip(("vllm", "ours"), setup.build(events=True)):
        orders: list[Any] = []

        def order(name: str = name, mgr: Any = mgr) -> list[int]:
            if name == "vllm":
                return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
            return list(mgr._alloc.free_queue_order())

        shared = list(range(1, 65))
        r1 = setup.make_request("r1", shared + list(range(500, 536)))  # 100 tokens: 6 full blocks cached
        assert mgr.allocate_slots(r1, 100) is not None
        r2 = setup.make_request("r2", shared + list(range(700, 740)))
        blocks, hit, _ = mgr.get_computed_blocks(r2)
        assert hit == 64
        assert mgr.allocate_slots(r2, 40, hit, blocks) is not None
        r3 = setup.make_request("r3", list(range(900, 950)))
        assert mgr.allocate_slots(r3, 50, delay_cache_blocks=True) is not None  # nothing cached
        orders.append(order())
        # r1: its own cached and uncached blocks to the front; the 4 shared ones stay held.
        mgr.block_pool.free_blocks(mgr.pop_blocks_for_free(r1), evict_first=True)
        orders.append(order())
        if name == "vllm":
            # The cached blocks among those just freed (ahead of every block free before).
            queue = mgr.block_pool.free_block_queue.get_all_free_blocks()
            front = queue[: len(orders[1]) - len(orders[0])]
            cached_in_front = [b.block_id for b in front if b.block_hash is not None]
        # r3 (uncached) without evict_first: to the front as well, as vLLM's.
        mgr.block_pool.free_blocks(mgr.pop_blocks_for_free(r3))
        orders.append(order())
        # r2 in reverse (the scheduler's deferred free): the shared blocks reach the queue.
        mgr.block_pool.free_blocks(reversed(mgr.pop_blocks_for_free(r2)), evict_first=True)
        orders.append(order())
        again = setup.make_request("again", shared + list(range(500, 536)))
        _, hit_again, _ = mgr.get_computed_blocks(again)
        r4 = setup.make_request("r4", list(range(2000, 2300)))
        new = mgr.allocate_slots(r4, 300)
        assert new is not None
        out[name] = (orders, hit_again, new.get_block_ids(), [repr(e) for e in mgr.take_events()])
        if name == "ours":
            mgr.check_invariants()
    orders = out["vllm"][0]
    # Not vacuous: evict_first put r1's cached blocks ahead of the blocks free before them
    # (without it they would go behind), and they stayed cached: a later lookup hits them.
    assert orders[1][-len(orders[0]) :] == orders[0]
    assert len(cached_in_front) >= 2, cached_in_front
    assert out["vllm"][1] > 64
    assert out["ours"] == out["vllm"]


def test_block_pool_touch_and_free_queue_walk_match_vllm() -> None:
    """``block_pool.touch`` (the SimpleCPUOffload connector pins the blocks it copies), the
    free queue walked with ``iter_blocks_after`` (its lazy mode, from the front, stopping
    early) and ``free_blocks`` of the pins (then with ``evict_first`` where vLLM has it) against vLLM's
    real ``BlockPool``: touched free blocks leave the queue (cached ones from its back, a block
    a request holds gains a reference), the null block is skipped; after every call the same
    free queue, the same ref counts, the same walk from the front and from a cursor; then the
    same hit, the same new blocks and the same events."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    evict_first = "evict_first" in inspect.signature(BlockPool.free_blocks).parameters
    setup = Setup("touch", [full(16), swa(32, 16)], num_blocks=48, retention_interval=None)
    out = {}
    for name, mgr in zip(("vllm", "ours"), setup.build(events=True)):
        pool = mgr.block_pool
        snaps: list[Any] = []

        def snap(pool: Any = pool, snaps: list[Any] = snaps) -> None:
            q = pool.free_block_queue
            walk = [b.block_id for b in q.iter_blocks_after(None)]
            first = [b.block_id for _, b in zip(range(5), q.iter_blocks_after(None))]
            after = [b.block_id for b in q.iter_blocks_after(pool.blocks[walk[3]])] if len(walk) > 3 else []
            refs = [pool.blocks[i].ref_cnt for i in range(1, 48)]
            snaps.append((walk, first, after, refs, pool.get_num_free_blocks()))

        shared = list(range(1, 65))
        r1 = setup.make_request("r1", shared + list(range(500, 536)))
        assert mgr.allocate_slots(r1, 100) is not None
        r2 = setup.make_request("r2", list(range(900, 950)))
        assert mgr.allocate_slots(r2, 50) is not None
        held = mgr.get_block_ids("r2")[0][:2]
        mgr.free(r1)  # its cached blocks at the back of the queue
        snap()
        cached = [b for b in pool.free_block_queue.iter_blocks_after(None) if b.block_hash is not None]
        pinned = [pool.null_block, cached[-1], cached[0], pool.blocks[held[0]], cached[-1]]
        pool.touch(pinned)
        snap()
        # A walk from a block no longer free yields nothing, as vLLM's removed block's.
        assert list(pool.free_block_queue.iter_blocks_after(cached[0])) == []
        pool.free_blocks([pool.blocks[held[0]], cached[-1]])
        snap()
        if evict_first:
            pool.free_blocks([cached[0], cached[-1]], evict_first=True)
        else:
            pool.free_blocks([cached[0], cached[-1]])
        snap()
        again = setup.make_request("again", shared + list(range(500, 536)))
        _, hit, _ = mgr.get_computed_blocks(again)
        r3 = setup.make_request("r3", list(range(2000, 2300)))
        new = mgr.allocate_slots(r3, 300)
        assert new is not None
        pins = [cached[0].block_id, cached[-1].block_id]
        out[name] = (snaps, hit, pins, new.get_block_ids(), [repr(e) for e in mgr.take_events()])
        if name == "ours":
            mgr.check_invariants()
    snaps, hit, pins = out["vllm"][:3]
    # Not vacuous: the touch took two free blocks out of the queue (the held one gained a
    # reference), and the last free put them at its front (evict_first, 0.34) or back, still
    # cached: a hit.
    assert snaps[1][4] == snaps[0][4] - 2 and not set(pins) & set(snaps[1][0])
    assert (snaps[3][0][:2] if evict_first else snaps[3][0][-2:]) == pins and snaps[0][0][-1] == pins[1]
    assert hit > 0
    assert out["ours"] == out["vllm"]


def test_block_pool_touch_refuses_bad_ids_and_changes_nothing() -> None:
    """An id outside the pool raises the core's ``InvalidBlockError`` and changes nothing (no
    ref count, no free queue change), also when valid ids come first; a view of another
    pool's block is refused the same way."""
    import pytest

    from hybrid_alloc.errors import InvalidBlockError

    setup = Setup("touch_bad", [full(16)], num_blocks=32, retention_interval=None)
    _, ours = setup.build(events=False)
    pool = ours.block_pool
    r1 = setup.make_request("r1", list(range(1, 65)))
    assert ours.allocate_slots(r1, 64) is not None
    ours.free(r1)
    before = (list(ours._alloc.free_queue_order()), [pool.blocks[i].ref_cnt for i in range(1, 32)])
    big = HybridKVCacheManager(**Setup("big", [full(16)], num_blocks=64).manager_kwargs()).block_pool.blocks[40]
    for bad in ([pool.blocks[3], big], [big]):
        with pytest.raises(InvalidBlockError, match="block id 40"):
            pool.touch(bad)
        assert (list(ours._alloc.free_queue_order()), [pool.blocks[i].ref_cnt for i in range(1, 32)]) == before
    with pytest.raises(InvalidBlockError):
        ours._alloc.touch_block_ids([-1])
    with pytest.raises(InvalidBlockError):
        pool.free_blocks([pool.blocks[3]])  # never touched: no reference to give back
    ours.check_invariants()


def test_free_queue_walk_reads_in_chunks() -> None:
    """``iter_blocks_after`` reads the core's queue one chunk per crossing (16 blocks, then
    32, ...): walking k blocks crosses O(log k) times and reads O(k) blocks, not the whole
    queue; the chunks join into the whole order."""
    import types

    from hybrid_alloc.vllm.facades import NativeFreeBlockQueue

    setup = Setup("walk", [full(16)], num_blocks=400, retention_interval=None)
    _, ours = setup.build(events=False)
    views = ours.block_pool.blocks
    reads: list[int] = []

    class Counting:
        def free_queue_after(self, after: int | None, n: int) -> list[int]:
            ids = ours._alloc.free_queue_after(after, n)
            reads.append(len(ids))
            return ids

    q = NativeFreeBlockQueue(types.SimpleNamespace(_alloc=Counting(), many=views.many))  # type: ignore[arg-type]
    assert [b for _, b in zip(range(5), q.iter_blocks_after(None))] == views.many(range(1, 6))
    assert reads == [16]
    reads.clear()
    assert len([b for _, b in zip(range(40), q.iter_blocks_after(None))]) == 40
    assert reads == [16, 32]
    reads.clear()
    whole = [b.block_id for b in q.iter_blocks_after(None)]
    assert whole == list(ours._alloc.free_queue_order()) and len(whole) == 399
    assert reads == [16, 32, 64, 128, 159]
