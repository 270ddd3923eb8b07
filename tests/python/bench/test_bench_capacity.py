"""The capacity bench (``hybrid-alloc capacity``, issue 37) at a tiny size on vLLM's real
Scheduler: ours schedules a trace exactly as vLLM's manager does; a trace that fits computes
every prompt once (under two-level pages too); where the pool binds, two-level pages hold a
request in fewer pages than vLLM's layout and run more requests; the command writes its table,
JSON and plot. A few seconds a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

GiB = 1 << 30


def _two_level_available() -> bool:
    import inspect

    from hybrid_alloc import Allocator

    try:
        return "slots_per_page" in inspect.signature(Allocator).parameters
    except (TypeError, ValueError):
        return "slots_per_page" in (Allocator.__text_signature__ or "")


def test_traces_are_the_issues_ranges_and_the_same_for_every_manager() -> None:
    from hybrid_alloc.bench.capacity import SIZES
    from hybrid_alloc.bench.capacity_run import trace_requests

    pool, (chat, long) = SIZES["full"]
    assert pool == 40 * GiB and (chat.clients, long.clients) == (512, 256)
    reqs = trace_requests(chat)
    assert reqs == trace_requests(chat)  # seeded
    lens = [len(p) for c in reqs for p, _ in c]
    outs = [o for c in reqs for _, o in c]
    assert 100 <= min(lens) and max(lens) <= 1500 and 50 <= min(outs) and max(outs) <= 400
    assert sorted(lens)[len(lens) // 2] < 500  # log-uniform: the median near sqrt(100 * 1500) = 387
    assert all(4000 <= len(p) <= 16000 for c in trace_requests(long) for p, _ in c)


def test_ours_schedules_a_binding_trace_as_vllm_does() -> None:
    """A pool that binds (preemptions): the same figures, step for step."""
    from hybrid_alloc.bench.capacity_run import Trace, run
    from hybrid_alloc.bench.shapes import SHAPES

    t = Trace("chat", clients=24, per_client=3, prompt=(100, 1500), output=(50, 400))
    ref, ours = (run(SHAPES["qwen36"], t, m, GiB) for m in ("vllm", "ours"))
    assert ref.preemptions > 0 and ref.mean_waiting > 0, "the pool should bind"
    assert ours.running == ref.running and ours.preemptions == ref.preemptions
    assert ours.prefill_tokens == ref.prefill_tokens and ours.pages_per_request == ref.pages_per_request


def test_a_trace_that_fits_computes_every_prompt_once() -> None:
    from hybrid_alloc.bench.capacity_run import Trace, run, trace_requests
    from hybrid_alloc.bench.shapes import SHAPES

    t = Trace("chat", clients=8, per_client=2, prompt=(100, 1500), output=(50, 100), seed=3)
    r = run(SHAPES["nemotron3nano"], t, "vllm", 4 * GiB)
    assert r.finished and r.preemptions == 0
    assert r.prefill_tokens == sum(len(p) for c in trace_requests(t) for p, _ in c)
    assert r.pages_per_request >= 5  # 4 Mamba2 groups and one attention group: one page each at least


@pytest.mark.skipif(not _two_level_available(), reason="the core has no slots_per_page (two-level pages) yet")
@pytest.mark.parametrize("shape", ["falconh1", "qwen36"])
def test_two_level_holds_a_request_in_fewer_pages_and_runs_more(shape: str) -> None:
    """A pool that binds: fewer pages per running request, more running requests."""
    from hybrid_alloc.bench.capacity_run import Trace, run
    from hybrid_alloc.bench.shapes import SHAPES

    t = Trace("chat", clients=24, per_client=3, prompt=(100, 1500), output=(50, 400))
    ref, two = (run(SHAPES[shape], t, m, GiB) for m in ("vllm", "two-level"))
    assert two.slots_per_page > 1 and two.block_size == 64 and two.finished
    assert two.extra["hash_block_size"] == 64 and two.pool_pages <= ref.pool_pages
    assert two.extra["cache_hit_alignment_tokens"] == two.extra["scheduler_block_size"] > 64
    assert two.pages_per_request < ref.pages_per_request
    assert two.mean_running > ref.mean_running
    assert 0 <= two.trapped_pages < two.pool_pages


@pytest.mark.skipif(not _two_level_available(), reason="the core has no slots_per_page (two-level pages) yet")
def test_two_level_computes_the_same_prefill_as_vllm_without_preemption() -> None:
    from hybrid_alloc.bench.capacity_run import Trace, run, trace_requests
    from hybrid_alloc.bench.shapes import SHAPES

    t = Trace("chat", clients=8, per_client=2, prompt=(100, 1500), output=(50, 100), seed=3)
    ref, two = (run(SHAPES["falconh1"], t, m, 4 * GiB) for m in ("vllm", "two-level"))
    assert ref.preemptions == two.preemptions == 0
    assert two.prefill_tokens == ref.prefill_tokens == sum(len(p) for c in trace_requests(t) for p, _ in c)


@pytest.mark.skipif(not _two_level_available(), reason="the core has no slots_per_page (two-level pages) yet")
def test_two_level_headroom_preempts_less_and_computes_no_more_prefill_than_vllm() -> None:
    """A pool that binds: without the admission headroom two-level pages admit to the last page
    and the running requests' next slots preempt; with the default (1 slot per running
    request) fewer preemptions, prefill no more than vLLM's, and still more running."""
    from hybrid_alloc.bench.capacity_run import Trace, run
    from hybrid_alloc.bench.shapes import SHAPES

    t = Trace("chat", clients=24, per_client=3, prompt=(100, 1500), output=(50, 400))
    ref = run(SHAPES["falconh1"], t, "vllm", GiB)
    bare = run(SHAPES["falconh1"], t, "two-level", GiB, headroom=0)
    two = run(SHAPES["falconh1"], t, "two-level", GiB)
    assert two.finished and bare.finished
    assert two.preemptions <= bare.preemptions and two.preemptions <= ref.preemptions
    assert two.prefill_tokens <= ref.prefill_tokens
    assert two.mean_running > ref.mean_running


def test_capacity_command_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from hybrid_alloc.cli import main

    rc = main(
        ["capacity", "--shape", "qwen36", "--trace", "chat", "--manager", "vllm", "--manager", "ours"]
        + ["--pool-gib", "1", "--clients", "0.25", "--out-dir", str(tmp_path)]
    )
    assert rc == 0
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert [(r["manager"], r["mean_running_vs_vllm"]) for r in data["rows"]] == [("vllm", 0.0), ("ours", 0.0)]
    assert (tmp_path / "capacity.png").stat().st_size > 0
    assert "Capacity at equal memory" in capsys.readouterr().out


def test_capacity_report_without_matplotlib_writes_json_and_skips_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from hybrid_alloc.bench import capacity
    from hybrid_alloc.bench.capacity_run import Result, Trace

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    row = dict(pool_pages=10, block_size=64, slots_per_page=4, mean_running=3.0, mean_waiting=0.0, preemptions=0)
    row |= dict(prefill_tokens=100, pages_per_request=2.0, capacity=4.5, trapped_pages=0.5, steps=5)
    r = Result("falconh1", "chat", "vllm", window=(1, 4), finished=True, seconds=0.1, running=[1, 3, 3, 3, 1], **row)
    args = capacity.parse_args(["--out-dir", str(tmp_path)])
    capacity.report([r], args, 1 << 30, (Trace("chat", 2, 1, (100, 200), (50, 60)),))
    assert json.loads((tmp_path / "capacity.json").read_text())["rows"][0]["mean_running"] == 3.0
    assert not (tmp_path / "capacity.png").exists()
    assert "pip install '.[bench]'" in capsys.readouterr().err
