"""The hits and serve benches' KV hints (issue 38), at the CI size: the agent workload (tool
pauses of simulated time, other traffic churning the cache) and the short-system-prompt workload
are what they say; on vLLM's real scheduler, hit-aware with retain or pin hits at least as much
of each resumed turn's previous context as hit-aware without hints, with no admission delayed by
pins; with a checkpoint at the system prompt's end every prompt of at least one unit (or block)
hits whole from its 2nd sighting; the hint counters reach hits.json and the serve rows. The
directions of the targets, not their full-size figures (docs/benchmarks.md), and no timings."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from hybrid_alloc.bench.hits_measure import SimClock, resumed_share, whole_sightings
from hybrid_alloc.bench.hits_workloads import Job, Workload, workloads


def _agent(size: str) -> Workload:
    return next(w for w in workloads(size) if w.name == "agent")


def _shortsys(size: str) -> Workload:
    return next(w for w in workloads(size) if w.name == "shortsys")


@pytest.mark.parametrize("size", ["small", "full"])
def test_agent_turns_resume_their_session_after_a_tool_pause_and_carry_hints(size: str) -> None:
    wl = _agent(size)
    lo, hi = (5.0, 30.0) if size == "small" else (5.0, 120.0)
    assert wl.step_s is not None and wl.budgets == ("pressure",) and wl.pressure == 3.0
    assert set(wl.hint_policies) == {"retain", "pin"}
    for i, job in enumerate(wl.jobs):
        if job.after < 0:
            assert not job.resumes and 0.0 <= job.pause_s <= hi
            continue
        prev = wl.jobs[job.after]
        assert job.resumes and lo <= job.pause_s <= hi and job.after < i
        # The next turn re-sends the previous one's prompt and its reply, then a tool output.
        assert job.parts[: len(prev.parts)] == prev.parts and job.parts[len(prev.parts)] == ("reply", job.after)
        assert prev.rid.split("-t")[0] == job.rid.split("-t")[0]
    last = {j.rid.split("-t")[0]: j for j in wl.jobs}
    for job in wl.jobs:
        actions = {p: [a for a, _ in job.hints[p]] for p in ("retain", "pin")}
        if job is last[job.rid.split("-t")[0]]:
            assert actions == {"retain": ["kv.release"], "pin": ["kv.release"]}
        else:
            assert actions == {"retain": ["kv.retain"], "pin": ["kv.pin"]}
    # Every turn fits the shortest context of the hits shapes (8192: vLLM refuses longer prompts).
    assert (
        max(
            sum(len(p) if isinstance(p, list) else wl.jobs[p[1]].max_tokens for p in j.parts) + j.max_tokens
            for j in wl.jobs
        )
        <= 8192
    )
    # The other traffic: unique, the same for every run, arriving at 3x the live working set
    # per mean pause.
    assert wl.churn is not None and wl.live is not None
    a, b = wl.churn(3), wl.churn(3)
    assert a.parts == b.parts and a.parts != wl.churn(4).parts
    mean_pause = statistics.fmean(j.pause_s for j in wl.jobs if j.resumes)
    assert wl.churn_rate * mean_pause == pytest.approx(3.0 * sum(wl.live))


@pytest.mark.parametrize("size", ["small", "full"])
def test_short_system_prompts_are_off_the_grid_each_sighting_after_the_last_with_a_checkpoint_at_its_end(
    size: str,
) -> None:
    wl = _shortsys(size)
    lens = sorted({j.shared_len for j in wl.jobs})
    assert lens[0] == 100 and lens[-1] == 1999 and all(n % 16 for n in lens)
    assert wl.hint_policies == ("checkpoint",) and wl.budgets == ("ample",)
    seen: dict[int, int] = {}
    for i, job in enumerate(wl.jobs):
        assert len(job.parts[0]) == job.shared_len
        assert job.hints == {"checkpoint": [("kv.checkpoint", {"positions": [job.shared_len]})]}
        assert job.after == seen.get(job.shared_key, -1)
        seen[job.shared_key] = i


def test_measures_whole_sightings_and_resumed_share() -> None:
    jobs = [Job(f"j{i}", [], 1, shared_key=k, shared_len=n) for i, (k, n) in enumerate([(0, 100), (1, 40), (0, 100)])]
    jobs += [Job("j3", [], 1, shared_key=0, shared_len=100), Job("j4", [], 1, shared_key=1, shared_len=40)]
    wl = Workload("w", jobs, 1)
    got = whole_sightings(wl, [0, 0, 64, 64, 0], 64)
    # The 40-token prompt is shorter than the grid: left out. The 100-token one hits 64 from its 2nd.
    assert got == {"whole": 2, "sightings": 2, "first_whole": {100: 2}}
    assert whole_sightings(wl, [0, 0, 0, 64, 0], 64) == {"whole": 1, "sightings": 2, "first_whole": {100: 3}}
    assert whole_sightings(Workload("w", [Job("a", [], 1)], 1), [0], 64) is None
    share = resumed_share([(100, 100), (45, 90), (0, 0)])
    assert share == {"share": pytest.approx(145 / 190), "least": 0.5, "turns": 2, "turns_90": 1}
    assert resumed_share([]) is None
    clock = SimClock()
    clock.advance(2.5)
    assert clock() == 2.5


def _run(shape: str, wl: Workload, policy: str, unit: int | None = None, pressure: float | None = None) -> Any:
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes

    sh = shapes()[shape]
    nb = budget_blocks(sh, wl, wl.budgets[0], pressure or wl.pressure or 3.0)
    return run(sh, wl, policy, nb, prefix_match_unit=unit)


@pytest.mark.vllm
def test_agent_with_retain_or_pin_resumed_turns_hit_at_least_as_much_as_without_hints() -> None:
    """Qwen3-Next-like shape with the 64-token unit, 3x the live working set, the other traffic
    at 3x the live working set per mean pause: each resumed turn's previous context hits at
    least as much with retain or pin as without hints, and at least 90% in all with retain
    (docs/benchmarks.md has the full size, where pins over the pinned share are refused); the
    manager's clock is the bench's (the TTLs run in simulated seconds, some expire); no
    allocation is refused while the pool counts fewer free blocks than no running request
    holds."""
    wl = _agent("small")
    res = {p: _run("qwen3next", wl, p, unit=64) for p in ("exact", "hit-aware", "retain", "pin")}
    for p, r in res.items():
        assert r.finished, p
        assert r.extra["sim_seconds"] > 30 and r.extra["churn_per_pause"] > 2.5, p
        assert r.extra["refused_withheld"] == 0 and r.extra["pin_delayed"] == 0, (p, r.extra)
    plain = res["hit-aware"].extra["resumed"]["share"]
    assert res["retain"].extra["resumed"]["share"] >= max(plain, 0.9)
    assert res["pin"].extra["resumed"]["share"] >= plain
    for p in ("retain", "pin"):
        c = res[p].extra["hint_counters"]
        assert c["received"] == c["applied"] == len(wl.jobs) and c["refused"] == 0, (p, c)
        assert c["sessions_released"] == 4 and res[p].extra["hint_held_peak"] > 0, (p, c)
    assert res["retain"].extra["hint_counters"]["retains_applied"] > 0
    assert res["pin"].extra["hint_counters"]["leases_applied"] > 0
    assert "hint_counters" not in res["exact"].extra  # vLLM's manager has none


@pytest.mark.vllm
def test_agent_pins_never_delay_an_admission_in_a_pool_where_admissions_wait() -> None:
    """At half the live working set admissions wait for room, while pins and retains hold
    blocks: at every refused allocation the pool counts every block no running request holds
    as free (pinned blocks are free blocks, evicted last), so none is pin-delayed."""
    wl = _agent("small")
    for shape in ("gemma3", "qwen35"):
        r = _run(shape, wl, "pin", pressure=0.5)
        e = r.extra
        assert r.finished and e["refused_admissions"] > 0 and e["refused_with_pins"] > 0, (shape, e)
        assert e["refused_withheld"] == 0 and e["pin_delayed"] == 0, (shape, e)


@pytest.mark.vllm
def test_short_prompts_with_a_checkpoint_hit_whole_from_their_second_sighting() -> None:
    """Every prompt of at least one unit (64; Nemotron's 2096-token block takes 16) hits whole,
    on the unit grid, from its 2nd sighting with a checkpoint at its end; without hints hit-aware
    first hits them whole later. Without the unit, on the block grid, the prompts of at least
    one block do the same."""
    from hybrid_alloc.bench.hits import cell_unit
    from hybrid_alloc.bench.hits_workloads import shapes

    wl = _shortsys("small")
    for name in ("qwen3next", "qwen36", "nemotron3nano"):
        unit = cell_unit(shapes()[name], 64)
        ck = _run(name, wl, "checkpoint", unit=unit)
        plain = _run(name, wl, "hit-aware", unit=unit)
        w = ck.extra["whole_sightings"]
        assert ck.finished and w["sightings"] > 0 and w["whole"] == w["sightings"], (name, w)
        assert set(w["first_whole"].values()) == {2}, (name, w)
        assert plain.extra["whole_sightings"]["whole"] <= w["whole"], name
        assert ck.prefill_tokens <= plain.prefill_tokens, name
    for name in ("qwen3next", "qwen36"):
        w = _run(name, wl, "checkpoint").extra["whole_sightings"]
        assert w["sightings"] > 0 and w["whole"] == w["sightings"], (name, w)


@pytest.mark.vllm
def test_hits_command_writes_the_short_prompt_table_and_hint_counters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybrid_alloc.bench.hits import main

    argv = ["--shape", "qwen3next", "--workload", "shortsys", "--prefix-match-unit", "64"]
    assert (
        main([*argv, "--policy", "hit-aware", "--policy", "checkpoint", "--no-plot", "--out-dir", str(tmp_path)]) == 0
    )
    out = capsys.readouterr().out
    assert "| whole from 2nd |" in out and "hit-aware + checkpoint" in out
    rows = json.loads((tmp_path / "hits.json").read_text())["results"]
    assert [(r["policy"], r["prefix_match_unit"]) for r in rows] == [
        ("exact", 64),
        ("hit-aware", 64),
        ("checkpoint", 64),
    ]
    ck = rows[-1]
    assert ck["hint_counters"]["received"] > 0 and ck["whole_sightings"]["whole"] > 0
    assert "hint_counters" not in rows[0]


def test_agent_table_reads_each_rows_figures(capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_alloc.bench.hits_report import print_agent_table

    row = {
        "shape": "s",
        "block_size": 576,
        "workload": "agent",
        "budget": "pressure",
        "policy": "retain",
        "prefix_match_unit": 64,
        "hit_rate": 0.25,
        "prefill_tokens": 1000,
        "resumed": {"share": 0.95, "least": 0.8, "turns": 8, "turns_90": 7},
        "refused_admissions": 3,
        "pin_delayed": 0,
        "hint_counters": {"received": 12, "applied": 11, "refused": 1, "expired": 2},
        "hint_held_peak": 40,
        "churn_per_pause": 3.04,
    }
    print_agent_table([row, {**row, "policy": "exact", "hint_counters": None, "hint_held_peak": None}])
    out = capsys.readouterr().out
    assert (
        "| s | 576 | 64 | hit-aware + retain | 95.0% | 80% | 7/8 | 25.0% | 1000 | 3 (0) | 12 / 11 / 1 / 2 | 40 | 3.0x |"
        in out
    )
    assert "| vLLM exact | 95.0% |" in out and "| 3 (0) | - | - | 3.0x |" in out


@pytest.mark.vllm
@pytest.mark.parametrize("via", ["envelope", "xargs"])
def test_serve_rows_with_hints_carry_them_and_report_what_they_add(via: str, tmp_path: Path) -> None:
    """The serve workload's ``+hints`` managers: every request carries the hints (the counters
    say so), and the row reports its KV time per request against the same manager without
    them; the bench's plot draws such rows (without a vLLM row beside them it raised). A
    timing is not asserted."""
    from hybrid_alloc.bench import serve
    from hybrid_alloc.bench.offline import SHAPES

    args = argparse.Namespace(
        serve_clients=8,
        serve_prompt_len=2400,
        serve_output_len=16,
        serve_output_spread=4,
        serve_prefix_share=0.5,  # 1200 tokens: past qwen3.5-style's 1048-token block, so the checkpoint is kept
        serve_steps=12,
        max_num_batched_tokens=4096,
        serve_hints_ttl=5.0,
        serve_hints_via=via,
    )
    runs = [serve.run_serve(SHAPES["qwen3.5-style"], m, args) for m in ("hit_aware", "hit_aware+hints")]
    rows = [r.summary() for r in runs]
    serve.serve_ratios(rows)
    plain, hinted = rows
    assert plain["manager"] == "hit_aware" and hinted["manager"] == "hit_aware+hints"
    assert plain["hint_counters"]["received"] == 0
    c = hinted["hint_counters"]
    assert c["received"] >= args.serve_clients and c["applied"] == c["received"] and c["refused"] == 0, c
    assert c["leases_applied"] > 0 and c["checkpoints_applied"] > 0, c
    assert hinted["hints_kv_us_per_request_delta"] == pytest.approx(
        hinted["kv_us_per_running_request_mean"] - plain["kv_us_per_running_request_mean"]
    )
    from hybrid_alloc.bench import main as bench_main

    png = tmp_path / "bench.png"
    assert bench_main.plot(runs, rows, str(png)) and png.stat().st_size > 10_000
