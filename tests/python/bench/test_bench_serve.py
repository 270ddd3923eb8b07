"""The bench's ``serve`` workload is a closed loop: finished requests are replaced at once,
vLLM's manager and ours schedule it identically, and its per-call figures tell admissions,
block-crossing and no-op decode calls apart, for both managers alike."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from hybrid_alloc.bench import floor as floor_probe  # noqa: E402
from hybrid_alloc.bench import main, serve  # noqa: E402
from hybrid_alloc.bench.offline import SHAPES  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)

ARGS = argparse.Namespace(
    serve_clients=12,
    serve_prompt_len=80,
    serve_output_len=24,
    serve_output_spread=8,
    serve_prefix_share=0.4,
    serve_steps=24,
    max_num_batched_tokens=256,
)


def test_request_stream_is_deterministic_and_shares_its_prefix() -> None:
    s = serve.ServeRequests(2048, 256, 128, 0.25)
    a, b = s(5), serve.ServeRequests(2048, 256, 128, 0.25)(5)
    assert a == b and a[0] == "sv5" and len(a[1]) == 2048
    assert a[1][:512] == s(6)[1][:512] and a[1][512:] != s(6)[1][512:]
    assert {s(k)[2] for k in range(200)} <= set(range(128, 385)) and len({s(k)[2] for k in range(200)}) > 50
    with pytest.raises(SystemExit):
        serve.ServeRequests(100, 10, 10, 0.5)


def test_serve_closed_loop_schedules_like_vllm_and_classifies_calls() -> None:
    runs = {m: serve.run_serve(SHAPES["gpt-oss-120b"], m, ARGS) for m in ("vllm", "hybrid_alloc")}
    ours, ref = runs["hybrid_alloc"], runs["vllm"]
    assert ours.extra["native"] and not ref.extra["native"]
    assert ours.running == ref.running and ours.usage == ref.usage and ours.hit_rate == ref.hit_rate
    assert ref.hit_rate > 0  # the shared system prompt hits
    assert ref.extra["replaced"] == ours.extra["replaced"] > ARGS.serve_clients // 2
    assert len(ref.kv_ns) == len(ref.step_ns) == ARGS.serve_steps // 2
    for r in runs.values():
        pc = r.extra["per_call"]
        for kind in ("allocate_slots/no-op", "allocate_slots/crossing", "allocate_slots/admission"):
            assert pc[kind]["calls_per_step"] > 0, kind
        assert pc["blocks.get_block_ids/empty"]["calls_per_step"] == pc["allocate_slots/no-op"]["calls_per_step"]
        # The per-call classes of allocate_slots add up to all its calls.
        n = sum(v["calls_per_step"] for k, v in pc.items() if k.startswith("allocate_slots/"))
        assert n == pytest.approx(r.extra["kv_breakdown"]["allocate_slots"]["calls_per_step"])
        # The breakdown's parts (means per step) add up to the mean KV time per step.
        total = sum(v["us_per_step"] for v in r.extra["kv_breakdown"].values())
        assert total == pytest.approx(r.extra["kv_us_mean"], rel=1e-9)
    rows = [r.summary() for r in (ref, ours)]
    serve.serve_ratios(rows)
    assert rows[1]["serve_kv_x"] == pytest.approx(rows[0]["kv_us_mean"] / rows[1]["kv_us_mean"])
    assert rows[1]["zero_kv_bound_us"] == pytest.approx(rows[0]["step_us_mean"] - rows[0]["kv_us_mean"])


def test_breakdown_line_is_means_that_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    row = {
        "model": "m",
        "scenario": "decode-4",
        "manager": "vllm",
        "running_requests": 4,
        "kv_us_mean": 10.0,
        "kv_breakdown": {f"c{i}": {"us_per_step": 10.0 / 8, "calls_per_step": 1.0} for i in range(8)},
    }
    main.print_breakdown([row])
    out = capsys.readouterr().out
    assert "means per timed step" in out
    assert "KV 10.0 us/step = c0 1.2 us (1.0 calls)" in out and "2 other calls 2.5 us" in out


def test_memory_counts_vllms_block_objects_and_none_of_ours() -> None:
    """vLLM's manager makes at least one Python object per block (its ``KVCacheBlock``), ours
    none; both report a construction time and bytes. (In this process: the bench measures
    each in a fresh interpreter, ``run_memory``, which costs a vLLM import each.)"""
    from hybrid_alloc.bench import memory

    rows = {m: memory.measure("gpt-oss-120b", m, 8192) for m in ("vllm", "hybrid_alloc")}
    ours, ref = rows["hybrid_alloc"], rows["vllm"]
    assert ours["native"] and not ref["native"]
    assert ours["num_blocks"] == ref["num_blocks"] == 8192
    assert ref["python_objects_per_block"] >= 1.0 and ours["python_objects_per_block"] < 0.01
    # Construction time is reported (a figure, not checked against the clock).
    assert all(isinstance(r["construction_s"], float) and math.isfinite(r["construction_s"]) for r in (ours, ref))
    assert ours["malloc_bytes_per_block"] > 0


def test_kv_from_medians_sums_call_medians_and_the_rest() -> None:
    row = {
        "per_call": {
            "allocate_slots/no-op": {"median_us": 1.0, "calls_per_step": 10.0},
            "allocate_slots/crossing": {"median_us": 5.0, "calls_per_step": 2.0},
        },
        "kv_breakdown": {"allocate_slots": {"us_per_step": 99.0}, "free": {"us_per_step": 3.0}},
    }
    assert serve.kv_from_medians(row) == 10.0 + 10.0 + 3.0


def test_decode_floor_answers_only_the_decode_call() -> None:
    """``DecodeFloor`` returns its constant for the scheduler's decode call and forwards
    every other form, with its arguments as given, to the manager's ``allocate_slots``."""
    from hybrid_alloc._core import DecodeFloor

    empty, seen = object(), []

    def slow(*a: object, **k: object) -> object:
        seen.append((a, k))
        return "slow"

    floor = DecodeFloor(empty, slow)
    req = object()
    assert floor(req, 1) is empty and floor(req, 1, num_lookahead_tokens=3) is empty
    assert seen == []
    assert floor(req, 2) == "slow"  # a prefill chunk
    assert floor(req, 1, 0) == "slow"  # a third positional
    assert floor(req, 1, new_computed_blocks=None, num_lookahead_tokens=0) == "slow"  # an admission's form
    assert seen == [
        ((req, 2), {}),
        ((req, 1, 0), {}),
        ((req, 1), {"new_computed_blocks": None, "num_lookahead_tokens": 0}),
    ]


def _is_decode_call(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
    """The scheduler's decode call, ``(request, 1, num_lookahead_tokens=n)``."""
    return len(a) == 2 and a[1] == 1 and set(k) <= {"num_lookahead_tokens"}


def test_serve_floor_probe_answers_decode_calls_with_the_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``floor`` probe in the closed loop: the same admissions as ours (the waiting
    queue and the hits do not depend on decode blocks), every decode call a no-op (none
    crosses), each answered by the probe's constant (the shared empty result) without
    reaching our ``allocate_slots``, which gets the admissions and prefill chunks only. What
    the probe saves is shown by which path answered, counted, not by a clock (a timed
    comparison fails on a busy machine)."""
    seen: dict[str, Any] = {"answered": 0, "not_empty": 0, "forwarded": []}
    install_floor = floor_probe.install_floor

    def counting_install(mgr: Any) -> None:
        ours = mgr.allocate_slots

        def forwarded(*a: Any, **k: Any) -> Any:
            seen["forwarded"].append((a, k))
            return ours(*a, **k)

        mgr.allocate_slots = forwarded
        install_floor(mgr)
        floor = mgr.allocate_slots
        assert type(floor).__name__ == "DecodeFloor"

        def counted(*a: Any, **k: Any) -> Any:
            n = len(seen["forwarded"])
            r = floor(*a, **k)
            if len(seen["forwarded"]) == n:
                seen["answered"] += 1
                seen["not_empty"] += r is not mgr.empty_kv_cache_blocks
            return r

        mgr.allocate_slots = counted

    monkeypatch.setattr(floor_probe, "install_floor", counting_install)
    runs = {m: serve.run_serve(SHAPES["gpt-oss-120b"], m, ARGS) for m in ("hybrid_alloc", "floor")}
    ours, floor = runs["hybrid_alloc"].extra["per_call"], runs["floor"].extra["per_call"]
    assert runs["floor"].extra["native"] and runs["floor"].hit_rate == runs["hybrid_alloc"].hit_rate
    assert "allocate_slots/crossing" not in floor and floor["allocate_slots/admission"]["calls_per_step"] > 0
    decode = ours["allocate_slots/no-op"]["calls_per_step"] + ours["allocate_slots/crossing"]["calls_per_step"]
    assert floor["allocate_slots/no-op"]["calls_per_step"] == pytest.approx(decode)
    # Which path answered: the constant, every decode call; ours, every other call and no
    # decode call.
    assert seen["answered"] > 0 and seen["not_empty"] == 0
    assert seen["forwarded"] and not any(_is_decode_call(a, k) for a, k in seen["forwarded"])


def test_serve_admission_window_probes_under_both_managers() -> None:
    """``--admission-window`` on the closed loop (vLLM 0.34's cache-aware admission): the
    scheduler applies the window (its ``cache_aware_window``), and vLLM's scheduler probes each
    manager's ``get_num_cached_tokens``, which the clock times per call; the arrivals share one
    prefix, so the order and the scheduling stay the same as without the window, under both
    managers. Counted, not timed."""
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION

    if not CACHE_AWARE_ADMISSION:
        pytest.skip("this vLLM's SchedulerConfig has no cache_aware_admission_window (vLLM 0.34 added it)")
    # From usage 0: this small pool stays below vLLM's default threshold (0.5).
    args = argparse.Namespace(**vars(ARGS), admission_threshold=0.0)
    runs = {
        (m, w): serve.run_serve(SHAPES["gpt-oss-120b"], m, args, window=w)
        for m in ("vllm", "hybrid_alloc")
        for w in (0, 8)
    }
    for (m, w), r in runs.items():
        assert r.extra["native"] == (m == "hybrid_alloc")
        assert r.scenario == ("serve-12-window8" if w else "serve-12")
        assert r.extra["admission_window"] == w and r.extra["admission_threshold"] == (0.0 if w else None)
        probe = r.extra["per_call"].get("get_num_cached_tokens/all")
        if not w:
            assert probe is None and r.extra["probe_steps"] == 0
            continue
        # The window is on: the scheduler probed, in some timed steps, at most 8 requests a step.
        assert probe is not None and probe["calls_per_step"] > 0 and 0 < r.extra["probe_steps"] <= 1
        assert probe["calls_per_step"] <= 8 * r.extra["probe_steps"]
        assert r.extra["kv_breakdown"]["get_num_cached_tokens"]["calls_per_step"] == probe["calls_per_step"]
        off = runs[m, 0]
        assert (r.running, r.usage, r.hit_rate) == (off.running, off.usage, off.hit_rate)
    ours, ref = runs["hybrid_alloc", 8], runs["vllm", 8]
    assert (
        ours.extra["per_call"]["get_num_cached_tokens/all"]["calls_per_step"]
        == (ref.extra["per_call"]["get_num_cached_tokens/all"]["calls_per_step"])
    )
    rows = [r.summary() for r in runs.values()]
    serve.serve_ratios(rows)
    by = {(r["manager"], r["scenario"]): r for r in rows}
    # Each window's row of ours is paired with vLLM's row under the same window.
    for scen in ("serve-12", "serve-12-window8"):
        mine, base = by["hybrid_alloc", scen], by["vllm", scen]
        assert mine["serve_step_x"] == pytest.approx(base["step_us_mean"] / mine["step_us_mean"])


def test_serve_cli_admission_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hybrid-alloc bench --workload serve --admission-window 0 --admission-window 8``: one
    paired scenario per window in bench.json and a ``window`` column in the table; on a
    release without cache-aware admission, one line on stderr, exit 2, nothing written."""
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION
    from hybrid_alloc.cli import main as cli

    argv = ["bench", "--workload", "serve", "--model", "gpt-oss-120b", "--managers", "vllm,hybrid_alloc"]
    argv += ["--serve-clients", "12", "--serve-prompt-len", "80", "--serve-output-len", "24"]
    argv += ["--serve-output-spread", "8", "--serve-prefix-share", "0.4", "--serve-steps", "24"]
    argv += ["--max-num-batched-tokens", "256", "--admission-window", "0", "--admission-window", "8"]
    argv += ["--admission-threshold", "0", "--no-plot", "--out-dir", str(tmp_path)]
    code = cli(argv)
    out = capsys.readouterr()
    if not CACHE_AWARE_ADMISSION:
        assert code == 2 and not (tmp_path / "bench.json").exists()
        lines = [ln for ln in out.err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "no cache-aware admission" in lines[0]
        return
    assert code == 0, out.err
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["assumptions"]["serve"]["admission_windows"] == [0, 8]
    rows = {(r["scenario"], r["manager"]): r for r in data["results"]}
    assert set(rows) == {(s, m) for s in ("serve-12", "serve-12-window8") for m in ("vllm", "hybrid_alloc")}
    assert rows["serve-12-window8", "hybrid_alloc"]["per_call"]["get_num_cached_tokens/all"]["calls_per_step"] > 0
    assert "window" in out.out and "8@0" in out.out and "off" in out.out


def test_serve_two_level_row_runs_and_reports_its_ratio_to_ours(capsys: pytest.CaptureFixture[str]) -> None:
    """The ``two_level`` row (issue 37): ours over two-level pages of the same pool on a
    state-space shape (17 slots of 64 tokens a page on qwen3.5-style), paired with ours on
    today's layout; its KV time per running request over ours, from the means and from the call
    medians, and the line that prints them. No timed assertion: only that the figures exist."""
    shape = SHAPES["qwen3.5-style"]
    ours, two = (serve.run_serve(shape, m, ARGS) for m in ("hybrid_alloc", "two_level"))
    assert two.extra["native"] and two.manager == "two_level"
    assert ours.extra["slots_per_page"] == 1 and ours.extra["hash_block_size"] == ours.block_size
    assert two.extra["slots_per_page"] == 17 and two.extra["small_block"] == serve.SERVE_SMALL_BLOCK
    assert two.extra["hash_block_size"] == serve.SERVE_SMALL_BLOCK
    # The same pool in bytes: vLLM's 1056-token pages, one state page padded to 17 x 64 tokens.
    assert two.num_blocks == ours.num_blocks * 1056 // 1088
    assert two.running == ours.running  # the pool holds every client either way
    assert len(two.kv_ns) == ARGS.serve_steps // 2 and two.extra["replaced"] > ARGS.serve_clients // 2
    assert two.extra["per_call"]["allocate_slots/admission"]["calls_per_step"] > 0
    rows = [r.summary() for r in (ours, two)]
    serve.serve_ratios(rows)
    assert rows[1]["two_level_kv_per_request_x"] == pytest.approx(
        rows[1]["kv_us_per_running_request_mean"] / rows[0]["kv_us_per_running_request_mean"]
    )
    assert rows[1]["two_level_kv_per_request_x_from_medians"] > 0
    serve.print_serve_table(rows, "test")
    out = " ".join(capsys.readouterr().out.split())  # the lines wrap at 80 columns
    assert "two-level pages, qwen3.5-style" in out and "17 small blocks of 64 tokens" in out
    with pytest.raises(ValueError, match="no state"):
        serve.run_serve(SHAPES["gpt-oss-120b"], "two_level", ARGS)
