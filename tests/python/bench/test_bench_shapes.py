"""Every model shape ``hybrid-alloc bench`` ships runs on our manager natively (no fallback)
under vLLM's real Scheduler, and schedules exactly as vLLM's own manager does: the same
steps, running requests, KV cache usage and prefix-cache hits on a shared-prefix workload
sized in blocks of the shape's own block size (a Mamba hybrid's attention block grows to
hold a state page: about a thousand tokens), with a pool of five requests' blocks."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from hybrid_alloc.bench import main, runner  # noqa: E402
from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bench_shape_is_native_and_schedules_like_vllm(name: str) -> None:
    shape = SHAPES[name]
    kvc = SchedulerSetup(shape, num_blocks=64).build().kv_cache_manager.kv_cache_config
    bs = max(g.kv_cache_spec.block_size for g in kvc.kv_cache_groups)
    prefix_len = 3 * bs + bs // 2
    reqs = main.shared_prefix_requests(16, num_prefixes=2, prefix_len=prefix_len, suffix_len=bs, output_len=8, seed=3)
    blocks_per_request = -(-(prefix_len + bs + 8) // bs) * len(kvc.kv_cache_groups)
    runs = {
        m: runner.run_scenario(
            shape,
            m,
            "shared-prefix",
            reqs,
            num_blocks=5 * blocks_per_request,
            kv_budget=None,
            max_num_seqs=4,
            max_num_batched_tokens=max(1024, 2 * bs),
        )
        for m in ("vllm", "hybrid_alloc")
    }
    ours, ref = runs["hybrid_alloc"], runs["vllm"]
    assert ours.extra["native"], f"{name}: hybrid_alloc fell back to vLLM's manager"
    assert not ref.extra["native"]
    assert ref.finished and ours.finished
    assert ours.steps == ref.steps
    assert ours.running == ref.running
    assert ours.usage == ref.usage
    assert ours.hit_rate == ref.hit_rate
    assert ref.hit_rate > 0, f"{name}: the workload should hit the prefix cache"
