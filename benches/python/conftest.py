import sys
from pathlib import Path
from typing import Any

# The vLLM harness of the tests builds both managers from one KVCacheConfig.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Pairs each of hybrid_alloc's medians with vLLM's from the same run."""
    mod = sys.modules.get("test_bench_manager")
    results = getattr(mod, "RESULTS", None)
    if not results:
        return
    w = terminalreporter.write_line
    w("")
    w("hybrid_alloc against vLLM's KVCacheManager (medians of this run)")
    w(f"{'benchmark':<44} {'vLLM':>12} {'hybrid_alloc':>13} {'x':>8}")
    admission: dict[str, dict[str, float]] = {}
    for (test, params), by in results.items():
        ref, ours = by.get("vllm"), by.get("hybrid_alloc")
        if ref is None or ours is None:
            continue
        extra = ""
        if test == "decode_step":
            n = int(params.split("=")[1])
            extra = f"   per running request: {ref / n * 1e6:.3f} us vs {ours / n * 1e6:.3f} us"
        else:
            shape, case, phase = params.split()
            if phase in ("lookup", "allocate", "block_table"):
                tot = admission.setdefault(f"{shape} {case}", {"vllm": 0.0, "hybrid_alloc": 0.0})
                tot["vllm"] += ref
                tot["hybrid_alloc"] += ours
        w(f"{test + ' ' + params:<44} {ref * 1e6:>9.1f} us {ours * 1e6:>10.1f} us {ref / ours:>7.1f}x{extra}")
    for key, tot in admission.items():
        ref, ours = tot["vllm"], tot["hybrid_alloc"]
        w(
            f"{'admission ' + key + ' (lookup+allocate+table)':<44} {ref * 1e6:>9.1f} us {ours * 1e6:>10.1f} us {ref / ours:>7.1f}x"
        )
