"""vLLM's real Scheduler (and AsyncScheduler) with R-SWA (``RSWASpec``, Unlimited-OCR's
DeepSeek-V2 decoder with ``rswa_window`` 128), run once with vLLM's KVCacheManager and once
with ours on the same seeded workload (shared prefixes, chunked prefill, long decodes past the
window, preemption, aborts): every decoder layer R-SWA with prefix caching off (as vLLM runs
Unlimited-OCR) and on, and R-SWA layers mixed with full-attention ones (one group, see
below). The SchedulerOutputs, KV events, usage and hits must be identical at every step; the
decode steps go through the native plain-step path, whose no-op limit follows the freed gap."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

CASES = [
    "unlimited_ocr_nocache_sync",
    "unlimited_ocr_nocache_async",
    "unlimited_ocr_cached_sync",
    "full_rswa_one_group_sync",
]


def _setup(case: str) -> Any:
    from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup

    def shape(name: str, layers: tuple[LayerKind, ...]) -> ModelShape:
        return ModelShape(name, layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048)

    ocr = shape("tiny-unlimited-ocr", tuple(LayerKind("rswa", 128) for _ in range(4)))
    # Full and R-SWA layers of one page size: vLLM's planner makes one group, which the
    # scheduler's manager serves as full attention when a full layer comes first (no gap is
    # ever freed; with an R-SWA layer first the group's spec is a UniformTypeKVCacheSpecs and
    # vLLM's own manager cannot be built). Ours gets the same spec and does the same.
    mixed = shape("tiny-full-rswa", tuple(LayerKind("rswa", 64) if i % 2 else LayerKind("full") for i in range(4)))
    cases = {
        "unlimited_ocr_nocache_sync": dict(shape=ocr, num_blocks=220, enable_prefix_caching=False),
        "unlimited_ocr_nocache_async": dict(
            shape=ocr, num_blocks=240, enable_prefix_caching=False, async_scheduling=True
        ),
        "unlimited_ocr_cached_sync": dict(shape=ocr, num_blocks=220),
        "full_rswa_one_group_sync": dict(shape=mixed, num_blocks=440),
    }
    kw = cases[case]
    return SchedulerSetup(
        max_num_seqs=24, max_num_batched_tokens=512, kv_events=kw.get("enable_prefix_caching", True), **kw
    )


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical_with_rswa(case: str) -> None:
    from sched_driver import assert_same_run, run_workload

    base = _setup(case)
    batch_queue = 2 if base.async_scheduling else 1
    ref = run_workload(
        dataclasses.replace(base, manager="vllm"), seed=7, num_requests=40, max_tokens_hi=1000, batch_queue=batch_queue
    )
    ours = run_workload(
        dataclasses.replace(base, manager="hybrid_alloc"),
        seed=7,
        num_requests=40,
        max_tokens_hi=1000,
        batch_queue=batch_queue,
    )
    assert_same_run(case, ref, ours)
    assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
