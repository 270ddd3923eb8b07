"""The hits bench's state-space hybrid shapes (issue 18, item 4): vLLM's Hopper block sizes
for the Qwen3.5-like and Nemotron-H-like shapes, and the sightings workload on vLLM's real
Scheduler at the CI size, where vLLM's own manager serves a shared system prompt only from
its 3rd sighting (align mode has no state at the junction before then) and hit-aware from
its 2nd, pinned or not."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_mamba_shapes_take_vllms_hopper_block_sizes() -> None:
    from hybrid_alloc.bench.hits_workloads import shapes
    from hybrid_alloc.bench.shapes import hopper_block_size

    sh = shapes()
    assert hopper_block_size(sh["qwen35"]) == 544
    assert hopper_block_size(sh["nemotronh"]) == 1040
    assert hopper_block_size(sh["gemma3"]) == 16


def test_sightings_exact_hits_a_shared_prompt_only_from_its_third_sighting() -> None:
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    shape = shapes()["qwen35"]
    wl = next(w for w in workloads("small") if w.name == "sightings")
    r = run(shape, wl, "exact", budget_blocks(shape, wl, "ample", 3.0))
    assert r.finished and r.extra["block_size"] == 544
    junction = len(wl.pins[0]) // 544 * 544
    assert r.extra["hits"] == [0, 0] + [junction] * (len(wl.jobs) - 2)


def test_sightings_hit_aware_pinned_prompt_hits_from_its_second_sighting() -> None:
    """Hit-aware with the prompt pinned: the junction is known on the 1st sighting (the
    scheduler ends a chunk there and its state is cached), so the 2nd one hits all of it,
    with no more scheduler steps than exact."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    shape = shapes()["qwen35"]
    wl = next(w for w in workloads("small") if w.name == "sightings")
    nb = budget_blocks(shape, wl, "ample", 3.0)
    exact = run(shape, wl, "exact", nb)
    pinned = run(shape, wl, "pinned", nb)
    junction = len(wl.pins[0]) // 544 * 544
    assert pinned.finished and pinned.extra["hits"] == [0] + [junction] * (len(wl.jobs) - 1)
    assert pinned.steps <= exact.steps and pinned.prefill_tokens < exact.prefill_tokens


def test_sightings_hit_aware_unpinned_prompt_hits_from_its_second_sighting() -> None:
    """Hit-aware, nothing pinned: the 1st sighting's lookup reports the first first-sighting
    stop (1 block), and each chunk reaching a stop moves ``request.shared_prefix_boundary`` to
    the next (1, 2, 4, ... blocks within the prompt); the scheduler ends a chunk at each and
    each state is cached, so the 2nd sighting hits the largest stop inside the 2500-token
    system prompt (4 blocks of 544, 2 of 1040: the whole block-aligned prompt), on both
    state-space shapes. It costs one more scheduler step per stop at most (the full-size
    cost is in docs/hit-aware.md)."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    wl = next(w for w in workloads("small") if w.name == "sightings")
    first_prompt = sum(len(p) for p in wl.jobs[0].parts)
    for name, bs in (("qwen35", 544), ("nemotronh", 1040)):
        shape = shapes()[name]
        nb = budget_blocks(shape, wl, "ample", 3.0)
        exact = run(shape, wl, "exact", nb)
        aware = run(shape, wl, "hit-aware", nb)
        junction = len(wl.pins[0]) // bs * bs
        assert aware.finished and aware.extra["hits"] == [0] + [junction] * (len(wl.jobs) - 1), name
        stops = ((first_prompt - 1) // bs).bit_length()  # 1, 2, 4, ... blocks within the lookup
        assert aware.steps <= exact.steps + stops and aware.prefill_tokens < exact.prefill_tokens, name


def test_shared_prompts_with_spare_memory_hit_aware_within_a_point_of_the_ideal() -> None:
    """Issue 18's "with spare memory, within 1 point of the ideal" on the shared-prompt rows
    at the full size (8 prompts of 2048 tokens, 256 requests, 16 in flight): the 2nd sighting
    of each prompt hits the state at the largest first-sighting stop inside it (2 of its 3
    blocks of 544, its 1 block of 1040). Before the stops moved (one guessed junction, 4
    blocks of 544 and 2 of 1040, both past the 2048-token prompts) it was 58.7% against an
    ideal of 60.7% and 37.6% against 38.7% (2026-12-02). No more prefill than vLLM's manager,
    in at most 2% more scheduler steps. Deterministic."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    wl = next(w for w in workloads("full") if w.name == "shared")
    for name in ("qwen35", "nemotronh"):
        shape = shapes()[name]
        nb = budget_blocks(shape, wl, "ample", 3.0)
        exact = run(shape, wl, "exact", nb)
        aware = run(shape, wl, "hit-aware", nb)
        assert exact.finished and aware.finished, name
        assert aware.hit_rate >= aware.ideal_hit_rate - 0.01, (name, aware.hit_rate, aware.ideal_hit_rate)
        assert aware.hit_rate > exact.hit_rate and aware.prefill_tokens < exact.prefill_tokens, name
        assert aware.steps <= exact.steps * 1.02, (name, aware.steps, exact.steps)


def test_chat_under_pressure_hit_aware_at_least_the_better_of_exact_and_dense_on_both_mamba_shapes() -> None:
    """Chat at 3x the live working set (CI size): hit-aware computes no more prefill than the
    better of vLLM's default and dense retention, and less than the default on the Qwen-like
    shape, in no more
    scheduler steps (the full size, where vLLM's single LRU evicts each session just before
    its next turn, is in docs/hit-aware.md)."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    chat = next(w for w in workloads("small") if w.name == "chat")
    for name in ("qwen35", "nemotronh"):
        shape = shapes()[name]
        nb = budget_blocks(shape, chat, "pressure", 3.0)
        res = {p: run(shape, chat, p, nb) for p in ("exact", "dense", "hit-aware")}
        assert all(r.finished for r in res.values()), name
        best = min(res["exact"].prefill_tokens, res["dense"].prefill_tokens)
        assert res["hit-aware"].prefill_tokens <= best, (name, {p: r.prefill_tokens for p, r in res.items()})
        if name == "qwen35":  # at 1040-token blocks the CI-size chat hits the same under all three
            assert res["hit-aware"].prefill_tokens < res["exact"].prefill_tokens, name
        assert res["hit-aware"].steps <= res["exact"].steps * 1.02, name


def test_nemotronh_chat_under_pressure_reaches_the_issue_target() -> None:
    """Issue 18's Nemotron-H-like chat target at the full size: at 3x the live working set
    hit-aware serves at least 50% of the queried tokens from the cache (38.9% before the hit
    units and the resumed level, 2026-12-02; vLLM's own manager 0%), computing less prefill
    than vLLM's manager, in at most 2% more scheduler steps. The hit counts are deterministic."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    shape = shapes()["nemotronh"]
    wl = next(w for w in workloads("full") if w.name == "chat")
    nb = budget_blocks(shape, wl, "pressure", 3.0)
    exact = run(shape, wl, "exact", nb)
    aware = run(shape, wl, "hit-aware", nb)
    assert exact.finished and aware.finished
    assert aware.hit_rate >= 0.50, aware.hit_rate
    assert aware.prefill_tokens < exact.prefill_tokens
    assert aware.steps <= exact.steps * 1.02
