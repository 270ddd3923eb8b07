"""vLLM's real Scheduler with DeepSeek-V4.1's sliding window kept out of prefix caching
(``SlidingWindowMLASpec`` with ``bounded_replay``, ``--swa-bounded-replay``, vLLM's default
for that model): run once with vLLM's KVCacheManager and once with ours on the same seeded
workload (shared prefixes, chunked prefill, long decodes past the window, preemption, aborts).
The scheduler rewinds each hit by the window (``Request.replay_start``) and recomputes it; the
sliding-window group takes no hit and caches nothing. The SchedulerOutputs, KV events, usage
and hits must be identical at every step."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

CASES = ["v41_replay_sync", "v41_replay_async", "v41_replay_nocache"]


def _setup(case: str) -> Any:
    from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup

    layers = tuple(
        LayerKind(k, 128 if k == "swa_mla" else 0, bounded_replay=k == "swa_mla")
        for _ in range(2)
        for k in ("mla", "swa_mla", "ring")
    )
    shape = ModelShape("tiny-deepseek-v41", layers, num_kv_heads=1, head_size=576, weight_bytes=0, max_model_len=2048)
    kw: dict[str, Any] = {
        "v41_replay_sync": dict(num_blocks=400),
        "v41_replay_async": dict(num_blocks=420, async_scheduling=True),
        "v41_replay_nocache": dict(num_blocks=400, enable_prefix_caching=False),
    }[case]
    return SchedulerSetup(
        shape=shape,
        max_num_seqs=24,
        max_num_batched_tokens=512,
        kv_events=kw.get("enable_prefix_caching", True),
        **kw,
    )


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical_with_swa_bounded_replay(case: str) -> None:
    from sched_driver import assert_same_run, run_workload

    base = _setup(case)
    # The scheduler sees the replay window (vLLM's ``prefix_replay_tokens``), and ours serves it.
    sched = dataclasses.replace(base, manager="hybrid_alloc").build()
    assert type(sched.kv_cache_manager).__name__ == "HybridKVCacheManager"
    assert sched.prefix_replay_tokens == 128
    batch_queue = 2 if base.async_scheduling else 1
    runs = [
        run_workload(
            dataclasses.replace(base, manager=m), seed=11, num_requests=40, max_tokens_hi=600, batch_queue=batch_queue
        )
        for m in ("vllm", "hybrid_alloc")
    ]
    ref, ours = runs
    assert_same_run(case, ref, ours)
    assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
