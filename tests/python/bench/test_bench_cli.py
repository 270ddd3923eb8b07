"""The main job's command line: help, the one-line install hint without vLLM, and a small
end-to-end run that writes the table, JSON and PNG with identical scheduling under vLLM's
manager and ours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_alloc.vllm.releases import vllm_requirement


def test_help_lists_options() -> None:
    out = subprocess.run([sys.executable, "-m", "hybrid_alloc.cli", "bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for opt in ("--model", "--workload", "--gpu-memory-gib", "--max-num-seqs", "--decode-concurrency"):
        assert opt in out.stdout


def test_without_vllm_says_how_to_install_in_one_line() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\nfrom hybrid_alloc.cli import main\nraise SystemExit(main(['bench']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"pip install '{vllm_requirement()}'" in lines[0]


@pytest.mark.vllm
def test_small_bench_run_writes_outputs(tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "hybrid_alloc.cli",
        "bench",
        "--model",
        "gpt-oss-120b",
        "--workload",
        "throughput",
        "--workload",
        "decode",
        "--num-prompts",
        "6",
        "--input-len",
        "700",
        "--output-len",
        "40",
        "--decode-concurrency",
        "16",
        "--decode-steps",
        "4",
        "--out-dir",
        str(tmp_path),
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KV x vs vLLM" in out.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    from hybrid_alloc.vllm.plugin import vllm_release

    assert data["vllm_release"] == vllm_release() and f"vLLM {vllm_release()} scheduler" in out.stdout
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    rows = {(r["scenario"], r["manager"]): r for r in data["results"]}
    assert {m for _, m in rows} == {"vllm", "hybrid_alloc", "no_hybrid"}
    for scen in ("throughput", "decode-16"):
        a, b = rows[(scen, "vllm")], rows[(scen, "hybrid_alloc")]
        assert (a["steps"], a["peak_running"], a["num_blocks"]) == (b["steps"], b["peak_running"], b["num_blocks"])
        assert b["native"] and not a["native"]
        assert a["finished"] and b["finished"]
    # gpt-oss's 128-token windows: hybrid allocation fits more than all-full-attention.
    assert rows[("throughput", "vllm")]["num_blocks"] > rows[("throughput", "no_hybrid")]["num_blocks"]


def test_floor_needs_the_probe_build(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a build without the probe (the release wheel: no cargo feature bench-probe), asking
    for the ``floor`` manager stops the bench with one line saying what it needs, before it
    imports vLLM."""
    from hybrid_alloc import _core
    from hybrid_alloc.bench import floor
    from hybrid_alloc.bench.main import main

    monkeypatch.delattr(_core, "DecodeFloor", raising=False)
    assert not floor.available()
    assert main(["--workload", "serve", "--managers", "vllm,hybrid_alloc,floor", "--no-plot"]) == 2
    assert capsys.readouterr().err.strip() == floor.MISSING
    assert "probe build" in floor.MISSING and "bench-probe" in floor.MISSING
