"""Without matplotlib (a plain ``pip install .``, no ``[bench]`` extra) the benches still
print their table and write their JSON; the plot is skipped with one line naming the extra.
matplotlib's absence is simulated (``sys.modules["matplotlib"] = None`` makes its import
raise ImportError), so these run whether it is installed or not, and without vLLM."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_alloc.bench import common, hits_report, main

HINT = "pip install '.[bench]'"  # from the checkout: the package is not on PyPI


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _one_hit_row() -> dict[str, object]:
    return {
        "shape": "gemma3",
        "workload": "chat",
        "budget": "ample",
        "num_blocks": 100,
        "policy": "exact",
        "hit_rate": 0.5,
        "ideal_hit_rate": 0.75,
        "prefill_tokens": 300,
        "ideal_prefill_tokens": 200,
        "steps": 7,
    }


@pytest.mark.usefixtures("no_matplotlib")
def test_pyplot_is_none_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert common.pyplot() is None
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [common.PLOT_SKIPPED] and HINT in err[0]


@pytest.mark.usefixtures("no_matplotlib")
def test_bench_plot_skips_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.png"
    assert main.plot([], [], str(path)) is False
    assert not path.exists()
    assert capsys.readouterr().err.count("plot skipped") == 1


@pytest.mark.usefixtures("no_matplotlib")
def test_hits_report_prints_table_and_json_then_skips_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What ``hybrid-alloc hits`` does after its runs: the table, the JSON, then one line for the plot."""
    # --wide: the full table, as markdown (the default is the main columns, fitted to the terminal).
    args = argparse.Namespace(out_dir=str(tmp_path), size="small", pressure=3.0, no_plot=False, wide=True)
    monkey_rows = [_one_hit_row()]
    # report() takes Result objects; rows_of() turns them into these dicts with vars().
    results = [argparse.Namespace(**r) for r in monkey_rows]
    hits_report.report(results, args)  # type: ignore[arg-type]
    out = capsys.readouterr()
    assert "| gemma3 | chat | ample | 100 | exact | 50.0% | 75.0% | 300 | 1.50x | 7 |" in out.out
    assert "plot:" not in out.out
    assert [ln for ln in out.err.splitlines() if ln.strip()] == [common.PLOT_SKIPPED]
    assert json.loads((tmp_path / "hits.json").read_text())["results"] == monkey_rows
    assert not (tmp_path / "hits.png").exists()


def test_the_cli_runs_without_matplotlib() -> None:
    """The whole command in a fresh interpreter: no matplotlib import at start-up."""
    code = "import sys; sys.modules['matplotlib'] = None\nfrom hybrid_alloc.cli import main\nraise SystemExit(main(['hits', '--help']))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--no-plot" in out.stdout
