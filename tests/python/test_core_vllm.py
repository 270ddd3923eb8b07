"""The core's boundary as vLLM reaches it through the adapter: managers built and dropped
in a loop are freed (the FastAllocate cycle is collectable), and a request whose
``block_hashes`` list is cleared and regrown (vLLM 0.33, resumable requests with
lookahead) or truncated (streaming input) between two calls gets the same hits as from
vLLM's own manager."""

from __future__ import annotations

import gc
import os
import weakref

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
        r._all_token_ids[:] = prompt[:200]
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
