"""``hybrid-alloc hits --admission-window N [--admission-threshold T] [--max-num-seqs M]``:
the window and threshold reach vLLM's real scheduler (vLLM's own manager's
``get_num_cached_tokens`` is called, only with a window, only above the threshold, and the
admission order changes, on the small chat workload with a running batch below its in-flight
count), the table and JSON carry them; on a release without cache-aware
admission the command refuses them with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of vLLM's own ``KVCacheManager.get_num_cached_tokens``."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    calls = [0]
    probe = KVCacheManager.get_num_cached_tokens

    def get_num_cached_tokens(self: Any, request: Any) -> int:
        calls[0] += 1
        return int(probe(self, request))

    monkeypatch.setattr(KVCacheManager, "get_num_cached_tokens", get_num_cached_tokens)
    return calls


def _admission_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids in the order the scheduler first schedules them."""
    from vllm.v1.core.sched.scheduler import Scheduler

    order: list[str] = []
    schedule = Scheduler.schedule

    def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        so = schedule(self, *a, **k)
        order.extend(r.req_id for r in so.scheduled_new_reqs if r.req_id not in order)
        return so

    monkeypatch.setattr(Scheduler, "schedule", wrapped)
    return order


def test_admission_window_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes, workloads
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION

    if not CACHE_AWARE_ADMISSION:
        pytest.skip("this vLLM's SchedulerConfig has no cache_aware_admission_window (vLLM 0.34 added it)")
    shape = shapes()["gptoss"]
    wl = next(w for w in workloads("small") if w.name == "chat")
    nb = budget_blocks(shape, wl, "ample", 3.0)
    results = {}
    for window, threshold in [(0, None), (8, 0.0), (8, None)]:
        with monkeypatch.context() as m:
            calls, order = _count_probes(m), _admission_order(m)
            r = run(shape, wl, "exact", nb, admission_window=window, admission_threshold=threshold, max_num_seqs=2)
            results[window, threshold] = (r, calls[0], list(order))
    off, on, default = results[0, None], results[8, 0.0], results[8, None]
    for r, _, order in (off, on, default):
        assert r.finished and sorted(order) == sorted(j.rid for j in wl.jobs)
    # No window: no probe, requests admitted in arrival order.
    assert off[1] == 0 and off[0].extra["admission_probes"] == 0
    assert off[2] == [j.rid for j in wl.jobs]
    # Window 8 from usage 0: vLLM's probe asked for the waiting requests, and requests with
    # a cached prefix admitted ahead of earlier arrivals.
    assert on[1] > 0 and on[0].extra["admission_probes"] == on[1]
    assert on[2] != off[2]
    assert on[0].admission_window == 8 and on[0].admission_threshold == 0.0
    assert on[0].extra["max_num_seqs"] == 2
    # Window 8 from vLLM's default threshold (0.5): this ample pool stays below it.
    assert default[1] == 0 and default[2] == off[2]


def test_hits_cli_window_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION
    from hybrid_alloc.cli import main

    argv = ["hits", "--shape", "gptoss", "--workload", "shared", "--budget", "ample", "--policy", "exact"]
    argv += ["--admission-window", "0", "--admission-window", "8", "--admission-threshold", "0"]
    # --wide: the full table, as markdown (the default is the main columns, fitted to the terminal).
    argv += ["--max-num-seqs", "2", "--no-plot", "--wide", "--out-dir", str(tmp_path)]
    code = main(argv)
    out = capsys.readouterr()
    if not CACHE_AWARE_ADMISSION:
        assert code == 2
        assert "no cache-aware admission" in out.err and not (tmp_path / "hits.json").exists()
        return
    assert code == 0, out.err
    data = json.loads((tmp_path / "hits.json").read_text())
    assert data["max_num_seqs"] == 2
    rows = data["results"]
    assert [(r["admission_window"], r["admission_threshold"]) for r in rows] == [(0, None), (8, 0.0)]
    assert rows[0]["admission_probes"] == 0 < rows[1]["admission_probes"]
    assert [r["max_num_seqs"] for r in rows] == [2, 2]
    assert "| policy | window | hit rate |" in out.out
    assert "| exact | off |" in out.out and "| exact | 8@0 |" in out.out
