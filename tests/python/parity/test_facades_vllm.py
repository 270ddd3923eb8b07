"""The facades callers read through the manager (``block_pool``, ``coordinator``,
``coordinator.single_type_managers[g]``) against vLLM's own manager fed the same calls: what
vLLM's tests of the manager (``scripts/vllm-tests.sh``), vLLM's connectors and out-of-tree
schedulers (Dynamo's instrumented scheduler) read. The kinds (``isinstance`` against vLLM's
manager and coordinator classes), the fixed attributes (block sizes, alignment, retention,
Mamba cache mode, admission caps), ``req_to_blocks`` (live while the request holds blocks, the
blocks it held after its free), the pool's ``blocks[i]`` and free queue, one view per block
(``old is new`` where vLLM hands out the same object), ``find_longest_cache_hit(_per_group)``;
and the ``allocate_slots`` strictness decision (computed tokens without their hit blocks are
refused, state unchanged)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core import kv_cache_coordinator as vkc  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as vstm  # noqa: E402

import hybrid_alloc as ha  # noqa: E402
from mamba_harness import MAMBA_SETUPS  # noqa: E402
from vllm_harness import SETUPS, Setup  # noqa: E402

ATTENTION = {s.name: s for s in SETUPS if s.available}
MAMBA = {s.name: s for s in MAMBA_SETUPS if s.available}
NAMES = ["full_bs16", "full_swa_bs16", "swa_only_bs16", "full_chunked_bs16", "full_swa_nocache_bs16"]
MAMBA_NAMES = [
    "qwen35_gdn_3to1_align",
    "mamba2_only_align",
    "nemotron_h_mamba2_nocache",
    "deepseek_v41_swa_replay_ring",
]
KINDS = [
    vstm.FullAttentionManager,
    vstm.SlidingWindowManager,
    vstm.ChunkedLocalAttentionManager,
    vstm.MambaManager,
    vstm.CrossAttentionManager,
    vkc.UnitaryKVCacheCoordinator,
    vkc.HybridKVCacheCoordinator,
    vkc.KVCacheCoordinatorNoPrefixCache,
]


def setup_named(name: str) -> Setup:
    return ATTENTION.get(name) or MAMBA[name]


def ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def run_prefix_trace(setup: Setup, ref: Any, ours: Any) -> list[Any]:
    """Two requests sharing a prefix, the first finished, on both managers; returns the
    requests (ref's, ours') still running."""
    bs = setup.scheduler_block_size
    prefix = list(range(3 * bs))
    out = []
    for m in (ref, ours):
        a = setup.make_request("a", prefix + [7] * (bs + 3))
        hit, n, _ = m.get_computed_blocks(a)
        assert m.allocate_slots(a, a.num_tokens - n, n, hit) is not None
        a.num_computed_tokens = a.num_tokens
        m.free(a)
        b = setup.make_request("b", prefix + [9] * (2 * bs))
        hit, n, _ = m.get_computed_blocks(b)
        assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
        out.append(b)
    return out


@pytest.mark.parametrize("name", NAMES + MAMBA_NAMES)
def test_kinds_and_fixed_attributes_answer_as_vllms(name: str) -> None:
    setup = setup_named(name)
    ref, ours = setup.build()
    for cls in KINDS:
        assert isinstance(ours.coordinator, cls) == isinstance(ref.coordinator, cls), cls
    rc, oc = ref.coordinator, ours.coordinator
    for attr in ("scheduler_block_size", "hash_block_size", "retention_interval", "enable_partial_hash_hits"):
        if hasattr(rc, attr):
            assert getattr(oc, attr) == getattr(rc, attr), attr
    if hasattr(rc, "_cache_hit_alignment_tokens"):
        assert oc._cache_hit_alignment_tokens == rc._cache_hit_alignment_tokens
    # The hybrid coordinator's spec groups (vLLM's own tests read them; groups kept out of
    # prefix caching, a compressor ring or a bounded-replay window, are left out).
    assert hasattr(oc, "attention_groups") == hasattr(rc, "attention_groups")
    if hasattr(rc, "attention_groups"):
        assert oc.attention_groups == rc.attention_groups
        assert all(type(g) is vkc.SpecGroup for g in oc.attention_groups)
    assert len(oc.single_type_managers) == len(rc.single_type_managers) == ours.num_kv_cache_groups
    for r, o in zip(rc.single_type_managers, oc.single_type_managers, strict=True):
        for cls in KINDS:
            assert isinstance(o, cls) == isinstance(r, cls), (type(r), cls)
        for attr in (
            "block_size",
            "kv_cache_spec",
            "kv_cache_group_id",
            "cache_hit_alignment_tokens",
            "max_admission_blocks_per_request",
            "mamba_cache_mode",
            "num_speculative_blocks",
        ):
            assert getattr(o, attr, None) == getattr(r, attr, None), (type(r).__name__, attr)
        assert o._null_block is ours.block_pool.null_block
    # Fixed at construction: rewriting the value raises; writing the same one is allowed.
    oc.retention_interval = rc.retention_interval
    with pytest.raises(AttributeError, match="fixed at construction"):
        oc.retention_interval = 1024


@pytest.mark.parametrize("name", NAMES + MAMBA_NAMES)
def test_req_to_blocks_and_views_answer_as_vllms(name: str) -> None:
    setup = setup_named(name)
    ref, ours = setup.build()
    rb, ob = run_prefix_trace(setup, ref, ours)
    pairs = list(zip(ref.coordinator.single_type_managers, ours.coordinator.single_type_managers, strict=True))
    for r, o in pairs:
        assert ("b" in o.req_to_blocks) == ("b" in r.req_to_blocks)
        assert ("a" in o.req_to_blocks) == ("a" in r.req_to_blocks) is False
        assert len(o.req_to_blocks) == len(r.req_to_blocks)
        assert o.req_to_blocks.get("a") is None and o.req_to_blocks["a"] == []
        assert ids(o.req_to_blocks["b"]) == ids(r.req_to_blocks["b"])
        assert o.req_to_blocks["b"] is o.req_to_blocks["b"]
    held = [o.req_to_blocks["b"] for _, o in pairs]
    # One view per block: the pool's, the request's table and req_to_blocks' are the same.
    pool = ours.block_pool
    for g, lb in enumerate(held):
        table = ours.get_blocks("b").blocks[g]
        for i, block in enumerate(lb):
            assert block is pool.blocks[block.block_id] is table[i]
            if not block.is_null:  # vLLM does not keep the null block's count (0.32's drifts)
                assert block.ref_cnt == ref.block_pool.blocks[block.block_id].ref_cnt
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    # Live: the lists grow with the request, as vLLM's grows in place.
    before = [len(lb) for lb in held]
    for m, req in ((ref, rb), (ours, ob)):
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids([5] * (2 * setup.scheduler_block_size))
        assert m.allocate_slots(req, 2 * setup.scheduler_block_size) is not None
    for (r, _), lb in zip(pairs, held, strict=True):
        assert ids(lb) == ids(r.req_to_blocks["b"])
    assert [len(lb) for lb in held] >= before
    # After the free, vLLM's popped list keeps the blocks it held; so does ours.
    want = [ids(r.req_to_blocks["b"]) for r, _ in pairs]
    ref.free(rb)
    ours.free(ob)
    assert [ids(lb) for lb in held] == want
    for r, o in pairs:
        assert "b" not in o.req_to_blocks and len(o.req_to_blocks) == len(r.req_to_blocks) == 0
    # The free queue, front (evicted first) to back.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == ids(
        ref.block_pool.free_block_queue.get_all_free_blocks()
    )
    assert pool.free_block_queue.num_free_blocks == ref.block_pool.free_block_queue.num_free_blocks

    # Linked walk (LMCacheMP's lazy offload): from the fake head through ``next_free_block`` to
    # the fake tail, whose successor is None; a block in use has none either.
    def walk(queue: Any) -> list[int]:
        out, block = [], queue.fake_free_list_head.next_free_block
        while block.next_free_block is not None:
            out.append(block.block_id)
            block = block.next_free_block
        assert block.block_id == -1 and block.next_free_block is None
        return out

    assert walk(pool.free_block_queue) == walk(ref.block_pool.free_block_queue)
    assert walk(pool.free_block_queue) == ids(pool.free_block_queue.get_all_free_blocks())
    for m in (ref, ours):  # a request holding blocks again: their links are None in both
        c = setup.make_request("c", [11] * (2 * setup.scheduler_block_size))
        hit, n, _ = m.get_computed_blocks(c)
        assert m.allocate_slots(c, c.num_tokens - n, n, hit) is not None
    held_r = ref.coordinator.single_type_managers[0].req_to_blocks["c"]
    held_o = ours.coordinator.single_type_managers[0].req_to_blocks["c"]
    assert held_r and ids(held_o) == ids(held_r)
    assert [b.next_free_block for b in held_o] == [b.next_free_block for b in held_r] == [None] * len(held_r)


@pytest.mark.parametrize("name", NAMES + MAMBA_NAMES)
def test_find_longest_cache_hit_answers_as_vllms(name: str) -> None:
    setup = setup_named(name)
    ref, ours = setup.build()
    run_prefix_trace(setup, ref, ours)
    bs = setup.scheduler_block_size
    probe = setup.make_request("probe", list(range(3 * bs)) + [9] * (2 * bs) + [1])
    free_before = ours.block_pool.get_num_free_blocks()
    for bound in (probe.num_tokens - 1, 2 * bs, bs - 1, 0):
        r = ref.coordinator.find_longest_cache_hit(probe.block_hashes, bound)
        o = ours.coordinator.find_longest_cache_hit(probe.block_hashes, bound)
        assert len(o) == 3
        assert [ids(g) for g in o[0]] == [ids(g) for g in r[0]], bound
        assert o[1:] == r[1:], bound
        if hasattr(ref.coordinator, "find_longest_cache_hit_per_group"):
            rp = ref.coordinator.find_longest_cache_hit_per_group(probe.block_hashes, bound)
            op = ours.coordinator.find_longest_cache_hit_per_group(probe.block_hashes, bound)
            assert [ids(g) for g in op[0]] == [ids(g) for g in rp[0]] and op[1] == rp[1], bound
    # A probe: nothing touched, nothing stored.
    assert ours.block_pool.get_num_free_blocks() == free_before
    ours.check_invariants()


def test_blocks_handed_out_are_the_pools_views() -> None:
    """``pop_blocks_for_free`` and a hit's ``blocks`` hand out the pool's one view per id (vLLM
    hands out its one ``KVCacheBlock`` per id)."""
    setup = ATTENTION["full_swa_bs16"]
    _, ours = setup.build()
    bs = setup.scheduler_block_size
    a = setup.make_request("a", list(range(4 * bs)) + [1])
    assert ours.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    table = ours.get_blocks("a").blocks
    b = setup.make_request("b", list(range(4 * bs)) + [2])
    hit, n, _ = ours.get_computed_blocks(b)
    assert n > 0
    for g, blocks in enumerate(hit.blocks):
        for block in blocks:
            assert block.is_null or block is table[g][table[g].index(block)]
    popped = ours.pop_blocks_for_free(a)
    assert popped and all(block is ours.block_pool.blocks[block.block_id] for block in popped)
    ours.block_pool.free_blocks(popped)
    ours.check_invariants()


@pytest.mark.parametrize("name", ["full_bs16", "full_swa_bs16"])
def test_allocate_slots_refuses_computed_tokens_without_their_blocks(name: str) -> None:
    """The strictness decision: ``num_new_computed_tokens`` > 0 without the hit's blocks (a
    call vLLM's scheduler never makes; vLLM's manager would allocate fresh blocks for those
    tokens and cache them under the request's hashes, though nobody wrote their KV) raises
    ``OutOfRangeError`` and changes nothing."""
    setup = ATTENTION[name]
    _, ours = setup.build()
    bs = setup.scheduler_block_size
    a = setup.make_request("a", list(range(3 * bs)) + [1])
    free = ours.block_pool.get_num_free_blocks()
    with pytest.raises(ha.OutOfRangeError, match="without cache-hit blocks"):
        ours.allocate_slots(a, a.num_tokens - bs, bs)
    assert ours.block_pool.get_num_free_blocks() == free
    assert ours.get_block_ids("a") == tuple([] for _ in range(ours.num_kv_cache_groups))
    assert ours.allocate_slots(a, a.num_tokens) is not None  # the request is still usable
    ours.check_invariants()
