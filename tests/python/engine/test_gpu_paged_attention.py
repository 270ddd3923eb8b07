"""benches/gpu/paged_attention.py on the CPU with a tiny batch: paged attention through
hybrid_alloc's block tables equals dense attention (with sliding-window blocks recycled
between requests), a corrupted block id or a recycled window block shows as a mismatch, and
the script never imports vLLM (the GPU machine has none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[3] / "benches" / "gpu" / "paged_attention.py"

RUN = """
import runpy, sys
sys.argv = [{script!r}] + {args!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "the GPU script imported vLLM"
raise SystemExit(code)
"""


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", *args, "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", RUN.format(script=str(SCRIPT), args=argv)], capture_output=True, text=True, timeout=600
    )
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc, data


def test_paged_attention_matches_dense_and_self_test_catches_corruption(tmp_path: Path) -> None:
    proc, data = _run(
        tmp_path,
        "--running",
        "3",
        "--context",
        "64",
        "--window",
        "32",
        "--steps",
        "20",
        "--self-test",
        "--check",
        "3",
        "--check-every",
        "4",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = data["rows"]
    tol = data["args"]["tolerance"]
    assert row["check_ok"] and row["max_abs_error"] <= tol
    # The window (32 tokens) is far shorter than the context: its blocks went back to the pool
    # and other requests got them.
    assert row["recycled_window_blocks"] > 0
    assert row["selftest_wrong_full_block_error"] > 100 * tol
    assert row["selftest_recycled_window_block_error"] is not None
    assert row["selftest_recycled_window_block_error"] > 100 * tol
    assert row["selftest_restored_error"] <= tol
    assert row["selftest_ok"]
    # Only the steps that need a block cross into the allocator (about 1 in 16 per request).
    assert 0 < row["allocator_calls_per_step"] < 3


def test_wrong_window_fails_the_check(tmp_path: Path) -> None:
    """Attention over a window wider than the allocator's reads blocks it already released
    (recycled since): the check must fail and the script exit non-zero."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(SCRIPT)!r}]\n"
        f"m = runpy.run_path({str(SCRIPT)!r})\n"
        "args = m['parse_args'](['--device', 'cpu', '--running', '3', '--context', '64', '--window', '32',"
        " '--steps', '6', '--check', '3'])\n"
        "r = m['Runner'](args, 3)\n"
        "for _ in range(6): r.step(False)\n"
        "assert r.recheck() <= args.tolerance\n"
        "args.window = 64\n"
        "err = r.recheck()\n"
        "assert err > 100 * args.tolerance, err\n"
        "print('ok', err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
