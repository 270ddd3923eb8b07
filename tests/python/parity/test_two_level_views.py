"""Two-level pages: the block views our manager hands vLLM's callers (``KVCacheBlocks.blocks``,
``block_pool.blocks``, ``req_to_blocks``, ``pop_blocks_for_free``) tell a slot from a state page
of the same number. A state group's table holds page ids and the attention group's slot ids, and
the two overlap; every view reads the core by its pool-wide id (``num_slots + page`` for a page)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

GiB = 1 << 30


def _scheduler_with_a_running_request() -> tuple[Any, Any, Any]:
    from hybrid_alloc.bench import capacity_run
    from hybrid_alloc.bench.offline import SHAPES, make_request

    sched = capacity_run.build(SHAPES["qwen36"], "two-level", GiB, 8, 64)
    req = make_request(sched, "r0", list(range(1, 3000)), 4)
    sched.add_request(req)
    sched.schedule()
    return sched, sched.kv_cache_manager, req


def test_views_of_state_pages_and_slots_read_their_own_pool() -> None:
    sched, mgr, req = _scheduler_with_a_running_request()
    alloc = mgr._alloc
    k, pages = alloc.slots_per_page, alloc.num_blocks
    assert k > 1
    num_slots = pages * k
    blocks = mgr.get_blocks(req.request_id)
    ids = blocks.get_block_ids()
    state = [
        g
        for g, grp in enumerate(mgr.kv_cache_config.kv_cache_groups)
        if type(grp.kv_cache_spec).__name__ == "MambaSpec"
    ]
    assert state and len(state) < len(ids)
    for g, (views, table) in enumerate(zip(blocks.blocks, ids)):
        assert [v.block_id for v in views] == table
        for v in views:
            if v.is_null:
                continue
            # Held by this request in its own pool: a reference, whatever the other pool's
            # block of the same number holds.
            assert v.ref_cnt >= 1, (g, v)
            assert v._key == (v.block_id + num_slots if g in state else v.block_id)
            assert mgr.block_pool.blocks[v._key] is v
    # A state page's number is also a slot's: their views differ.
    page = next(b for b in ids[state[0]] if b)
    assert mgr.block_pool.blocks[page] is not mgr.block_pool.blocks[num_slots + page]
    assert mgr.block_pool.blocks[num_slots + page].block_id == page
    assert len(mgr.block_pool.blocks) == num_slots + pages
    # req_to_blocks: the group's own ids, its pool's views.
    stm = mgr.coordinator.single_type_managers[state[0]]
    assert [v.block_id for v in stm.req_to_blocks[req.request_id]] == ids[state[0]]
    assert all(v.ref_cnt >= 1 for v in stm.req_to_blocks[req.request_id] if not v.is_null)
    sched.shutdown()


def test_pop_blocks_for_free_hands_back_ids_free_blocks_takes() -> None:
    sched, mgr, req = _scheduler_with_a_running_request()
    free_before = mgr.block_pool.get_num_free_blocks()
    popped = mgr.pop_blocks_for_free(req)
    assert popped and all(b.ref_cnt >= 1 for b in popped if not b.is_null)
    mgr.block_pool.free_blocks(popped)
    # Every page and slot the request held is back: the pool is whole again.
    assert mgr.block_pool.get_num_free_blocks() > free_before
    assert mgr.block_pool.get_num_free_blocks() == mgr._alloc.num_blocks - 1
    assert mgr.usage == 0.0
    sched.shutdown()
