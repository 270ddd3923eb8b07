"""Differential tests for R-SWA (``RSWASpec``, vLLM's ``RSWAManager``; DeepSeek-V2
"Unlimited-OCR"): vLLM's own KVCacheManager against ours on seeded random traces whose decodes
run past the window, so the gap between the prompt and the window is freed (null blocks in the
middle of the table) step after step; prefix caching on and off, R-SWA alone, next to full
attention, and next to full attention and a sliding window. Block ids, hits, free counts, usage,
events, the free queue's order and ``pop_blocks_for_free`` must be identical after every call.

``HYBRID_ALLOC_PARITY_OPS`` sets the operations per configuration (default 100000)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

NUM_OPS = int(os.environ.get("HYBRID_ALLOC_PARITY_OPS", "100000"))


def _names() -> list[str]:
    try:
        from rswa_harness import RSWA_SETUPS
    except ImportError:
        return ["(vllm missing)"]
    return [s.name for s in RSWA_SETUPS]


@pytest.mark.parametrize("name", _names())
def test_rswa_parity_random_trace(name: str) -> None:
    from parity_driver import run_seeds
    from rswa_harness import RSWA_SETUPS, RswaParityRun

    setup = next(s for s in RSWA_SETUPS if s.name == name)
    total = run_seeds(RswaParityRun, setup, 3000, NUM_OPS)
    assert total["finish"] > 0
    assert total["reset_ok"] > 0
    assert total["preempt"] > 0, f"{name}: no preemption happened; the pool is too large"
    assert total["gapped"] > 0, f"{name}: no R-SWA gap was freed"
    assert total["popped"] > 0
    if setup.enable_caching:
        assert total["hits"] > 0, f"{name}: no prefix-cache hit happened"
        assert total["resends"] > 0


def test_rswa_groups_are_served_natively() -> None:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from rswa_harness import RSWA_SETUPS

    for s in RSWA_SETUPS:
        m = HybridKVCacheManager(**s.manager_kwargs(events=False))
        assert type(m) is HybridKVCacheManager, s.name
