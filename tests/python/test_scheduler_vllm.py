"""vLLM 0.32.0's real Scheduler (and AsyncScheduler), run once with vLLM's KVCacheManager
and once with ours on the same seeded workload: shared prefixes, chunked prefill,
preemption under memory pressure, aborts, requests that slide past the window. The
SchedulerOutputs (scheduled requests, token counts, new block ids per group) and the KV
events must be identical at every step."""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.vllm


def _cases():
    from hybrid_alloc.vllm.offline import LayerKind, ModelShape

    gemma = ModelShape(
        "tiny-gemma2", tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4)),
        num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048,
    )
    llama = ModelShape("tiny-llama", tuple(LayerKind("full") for _ in range(4)), num_kv_heads=2, head_size=64,
                       weight_bytes=0, max_model_len=2048)
    scout = ModelShape(
        "tiny-scout", tuple(LayerKind("chunked_local", 128) if i % 4 != 3 else LayerKind("full") for i in range(8)),
        num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048,
    )
    swa_only = ModelShape("tiny-swa", tuple(LayerKind("sliding_window", 96) for _ in range(4)), num_kv_heads=2,
                          head_size=64, weight_bytes=0, max_model_len=2048)
    return {
        "gemma2_sync": dict(shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512),
        "gemma2_async": dict(shape=gemma, num_blocks=300, max_num_seqs=24, max_num_batched_tokens=512, async_scheduling=True),
        "gemma2_nocache": dict(shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512,
                               enable_prefix_caching=False),
        "llama_sync": dict(shape=llama, num_blocks=150, max_num_seqs=16, max_num_batched_tokens=384),
        "scout_sync": dict(shape=scout, num_blocks=300, max_num_seqs=16, max_num_batched_tokens=512),
        # Sliding window only: memory per request is bounded by the window, so the
        # workload does not preempt; it exercises recycling and hits instead.
        "swa_only_bs32": dict(shape=swa_only, num_blocks=150, max_num_seqs=16, max_num_batched_tokens=256, block_size=32),
    }


EXPECT_PREEMPTION = {"swa_only_bs32": False}


CASES = ["gemma2_sync", "gemma2_async", "gemma2_nocache", "llama_sync", "scout_sync", "swa_only_bs32"]


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical(case: str) -> None:
    from hybrid_alloc.vllm.offline import SchedulerSetup
    from sched_driver import run_workload

    kw = _cases()[case]
    base = SchedulerSetup(kv_events=kw.get("enable_prefix_caching", True), **kw)
    ref = run_workload(dataclasses.replace(base, manager="vllm"), seed=11, num_requests=40, max_tokens_hi=1000)
    ours = run_workload(dataclasses.replace(base, manager="hybrid_alloc"), seed=11, num_requests=40, max_tokens_hi=1000)
    assert ref["native"] == "KVCacheManager"
    assert ours["native"] == "HybridKVCacheManager"
    assert ref["finished"] and ours["finished"]
    assert len(ref["steps"]) == len(ours["steps"])
    for i, (a, b) in enumerate(zip(ref["steps"], ours["steps"])):
        assert a == b, f"{case}: SchedulerOutput differs at step {i}"
    assert ref["events"] == ours["events"], f"{case}: KV events differ"
    assert ref["usage"] == ours["usage"]
    assert (ref["hits"], ref["queries"]) == (ours["hits"], ours["queries"])
    # The workload must exercise what it claims.
    if EXPECT_PREEMPTION.get(case, True):
        assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
        assert ref["events"]
