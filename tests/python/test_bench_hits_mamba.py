"""The hits bench's state-space hybrid shapes (issue 18, item 4): vLLM's Hopper block sizes
for the Qwen3.5-like and Nemotron-H-like shapes, and the sightings workload on vLLM's real
Scheduler at the CI size, where vLLM's own manager serves a shared system prompt only from
its 3rd sighting (align mode has no state at the junction before then)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_mamba_shapes_take_vllms_hopper_block_sizes() -> None:
    from hybrid_alloc.bench_hits import hopper_block_size, shapes

    sh = shapes()
    assert hopper_block_size(sh["qwen35"]) == 544
    assert hopper_block_size(sh["nemotronh"]) == 1040
    assert hopper_block_size(sh["gemma3"]) == 16


def test_sightings_exact_hits_a_shared_prompt_only_from_its_third_sighting() -> None:
    from hybrid_alloc.bench_hits import budget_blocks, run, shapes, workloads

    shape = shapes()["qwen35"]
    wl = next(w for w in workloads("small") if w.name == "sightings")
    r = run(shape, wl, "exact", budget_blocks(shape, wl, "ample", 3.0))
    assert r.finished and r.extra["block_size"] == 544
    junction = len(wl.pins[0]) // 544 * 544
    assert r.extra["hits"] == [0, 0] + [junction] * (len(wl.jobs) - 2)
