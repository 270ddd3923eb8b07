"""The hits bench's issue 30 rows: state-space shapes at the block sizes vLLM gives them on a
Hopper GPU (576, 1088, 2096 tokens), the shared-system-prompt workload, and vLLM's
``prefix_match_unit`` (0.32+): set on vLLM's real Scheduler it takes effect (hash block, partial
hits, partial-tail blocks in the pool) and lifts vLLM's hits on a multi-turn chat; hit-aware
serves it natively and computes less prefill than vLLM with it; a hit-aware row that our plugin
would serve with vLLM's manager is marked as a fallback, not passed off as ours.
CI size (a few seconds a run)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_issue30_shapes_take_the_hopper_block_sizes() -> None:
    """Derived as vLLM 0.34's ``_align_hybrid_block_size`` does (FlashInfer's GDN checkpoints
    align the Qwen blocks to 64), and equal to the sizes issue 30 measured; the offline
    scheduler builds every group at that size."""
    from hybrid_alloc.bench.hits_workloads import shapes
    from hybrid_alloc.bench.offline import SchedulerSetup
    from hybrid_alloc.bench.shapes import hopper_block_size

    sh = shapes()
    for name, bs in (("qwen3next", 576), ("qwen36", 1088), ("nemotron3nano", 2096)):
        assert hopper_block_size(sh[name]) == bs, name
        kvc = SchedulerSetup(sh[name], num_blocks=64).build().kv_cache_manager.kv_cache_config
        assert {g.kv_cache_spec.block_size for g in kvc.kv_cache_groups} == {bs}, name
    # The issue 18 shapes keep theirs (no checkpoint alignment).
    assert hopper_block_size(sh["qwen35"]) == 544 and hopper_block_size(sh["nemotronh"]) == 1040


def test_sysprompt_workload_prompts_are_shared_and_not_block_multiples() -> None:
    from hybrid_alloc.bench.hits_workloads import workloads

    for size in ("small", "full"):
        wl = next(w for w in workloads(size) if w.name == "sysprompt")
        lens = {j.shared_key: j.shared_len for j in wl.jobs}
        assert len(lens) >= 3 and all(300 <= n <= 2001 and n % 16 for n in lens.values()), lens
        for j in wl.jobs:
            assert len(j.parts[0]) == j.shared_len
        suffixes = [tuple(j.parts[1]) for j in wl.jobs]
        assert len(set(suffixes)) == len(suffixes)


def test_unit_takes_effect_on_vllm_and_lifts_its_chat_hits() -> None:
    """vLLM's exact retention on the CI-size chat at 576-token blocks: with the unit set the
    scheduler hashes every 64 tokens with partial hits on (``run`` raises otherwise), the
    pool holds partial-tail keys, and each turn hits the previous turn's prompt past its last
    block boundary: a higher hit rate and less prefill than without the unit."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads

    shape = shapes()["qwen3next"]
    chat = next(w for w in workloads("small") if w.name == "chat")
    nb = budget_blocks(shape, chat, "ample", 3.0)
    plain = run(shape, chat, "exact", nb)
    unit = run(shape, chat, "exact", nb, prefix_match_unit=64)
    assert plain.finished and unit.finished
    assert plain.extra["hash_block_size"] == 576 and unit.extra["hash_block_size"] == 64
    assert plain.extra["partial_tail_blocks_peak"] == 0
    assert unit.extra["partial_tail_blocks_peak"] > 0
    assert unit.hit_rate > plain.hit_rate and unit.prefill_tokens < plain.prefill_tokens


@pytest.mark.parametrize("workload", ["sysprompt", "chat"])
def test_hit_aware_with_a_unit_is_native_and_computes_less_prefill_than_vllm_with_it(workload: str) -> None:
    """Hit-aware with the unit runs natively (no fallback) and, under memory pressure, computes
    less prefill than vLLM's own manager with the same unit: on the shared system prompts
    (the sibling junctions inside a block: a larger share hits from the 2nd sighting), and on
    the round-robin chat, whose sessions share a system prompt (the junction a hit passes is
    kept: without it the chat's 3rd turns hit nothing, 13568 prefill tokens against vLLM's
    6208). Our pool's partial-tail blocks are counted, and stay within it."""
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import DEFAULT_PRESSURE, budget_blocks, shapes, workloads

    shape = shapes()["qwen3next"]
    wl = next(w for w in workloads("small") if w.name == workload)
    nb = budget_blocks(shape, wl, "pressure", DEFAULT_PRESSURE["small"]["qwen3next"])
    exact = run(shape, wl, "exact", nb, prefix_match_unit=64)
    aware = run(shape, wl, "hit-aware", nb, prefix_match_unit=64)
    assert exact.finished and aware.finished and not exact.fallback and not aware.fallback
    assert aware.extra["hash_block_size"] == 64
    assert aware.prefill_tokens < exact.prefill_tokens and aware.hit_rate > exact.hit_rate
    if workload == "sysprompt":
        assert aware.extra["second_sighting_share"] > exact.extra["second_sighting_share"]
    peak = aware.extra["partial_tail_blocks_peak"]
    assert peak is not None and 0 < peak < nb


def test_a_unit_the_block_does_not_take_runs_at_their_gcd() -> None:
    """2096 = 16 x 131: vLLM refuses a unit of 64 on Nemotron-3-Nano's block (and does not
    grow the block for it); the bench runs that shape's rows at 16 and says so."""
    from hybrid_alloc.bench.hits import cell_unit
    from hybrid_alloc.bench.hits_workloads import shapes

    sh = shapes()
    assert cell_unit(sh["nemotron3nano"], 64) == 16
    assert cell_unit(sh["qwen3next"], 64) == 64 and cell_unit(sh["qwen36"], 64) == 64
    assert cell_unit(sh["qwen3next"], 0) == 0


def test_unit_table_marks_fallback_and_compares_against_vllm_with_the_unit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybrid_alloc.bench.hits_report import print_unit_table

    base = {"shape": "s", "block_size": 576, "workload": "sysprompt", "budget": "ample", "hit_rate": 0.5}
    rows = [
        {**base, "policy": "exact", "prefix_match_unit": 64, "prefill_tokens": 1000},
        {**base, "policy": "hit-aware", "prefix_match_unit": 64, "fallback": True, "prefill_tokens": 1000},
        {**base, "policy": "hit-aware", "prefill_tokens": 900, "second_sighting_share": 0.75},
    ]
    print_unit_table(rows)
    out = capsys.readouterr().out
    assert "| vLLM exact | 64 |" in out
    assert "| hit-aware (fallback) | 64 |" in out
    assert "| hit-aware | - | 50.0% | 900 | 0.900x | 75.0% | - |" in out
