"""Differential tests for the hybrid families vLLM serves through ``MambaSpec`` (Qwen3.5 /
Qwen3-Next GDN, Nemotron-H and Jamba Mamba2, LFM2 short convolution), for DeepSeek-V4's
sliding-window MLA with its compressor ring (``SlidingWindowMLASpec`` + ``CircularBufferSpec``)
and for KV cache zeroing: vLLM's own KVCacheManager against ours on seeded random traces (shared prefixes,
chunked prefill, decode with lookahead, preemption, aborts, resets, explicit
``cache_blocks`` / ``remove_skipped_blocks`` / ``record_blocks_for_zeroing``). Block ids,
hits, free counts, usage, events, the blocks reported for zeroing and, with Mamba "align"
groups, the boundary states ``take_boundary_state_offloads`` hands over (every 16 calls; no
connector needed, as with vLLM's) must be identical.

``HYBRID_ALLOC_PARITY_OPS`` sets the operations per configuration (default 100000)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

NEVER_PREEMPTS = {"mamba_only_nocache"}

NUM_OPS = int(os.environ.get("HYBRID_ALLOC_PARITY_OPS", "100000"))


def _names() -> list[str]:
    try:
        from mamba_harness import MAMBA_SETUPS
    except ImportError:
        return ["(vllm missing)"]
    return [s.name for s in MAMBA_SETUPS]


@pytest.mark.parametrize("name", _names())
def test_mamba_parity_random_trace(name: str) -> None:
    from mamba_harness import MAMBA_SETUPS, ZeroingParityRun
    from parity_driver import run_seeds

    setup = next(s for s in MAMBA_SETUPS if s.name == name)
    if not setup.available:
        pytest.skip(f"{name} is served natively only from vLLM 0.33 on (lookahead hashes / no drop for flagged groups)")
    total = run_seeds(ZeroingParityRun, setup, 2000, NUM_OPS)
    assert total["finish"] > 0
    assert total["reset_ok"] > 0
    if name in NEVER_PREEMPTS:
        # One state block per request for its whole life: a running request never needs a
        # new block, so only admissions run out (and must).
        assert total["none"] > 0, f"{name}: no admission ran out of blocks; the pool is too large"
    else:
        assert total["preempt"] > 0, f"{name}: no preemption happened; the pool is too large"
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

    zeroing = setup.kv_cache_config().needs_kv_cache_zeroing
    if zeroing and any(isinstance(s, AttentionSpec) and not isinstance(s, CircularBufferSpec) for s in setup.specs):
        # Only attention blocks are zeroed (a Mamba state block is written before it is read).
        assert total.get("zeroed", 0) > 0, f"{name}: no block was reported for zeroing"
    elif not zeroing:
        assert total.get("zeroed", 0) == 0
    assert total.get("rerecorded", 0) > 0
    if setup.enable_caching:
        assert total["hits"] > 0, f"{name}: no prefix-cache hit happened"
    if setup.enable_caching and any(getattr(s, "mamba_cache_mode", None) == "align" for s in setup.specs):
        # The boundary states a KV connector is handed, compared every 16 operations.
        assert total.get("boundary_states", 0) > 0, f"{name}: no boundary state was handed over"
    from vllm.v1.kv_cache_interface import MambaSpec

    checkpoints = setup.enable_caching and any(
        isinstance(s, MambaSpec) and s.num_prefill_checkpoint_blocks > 0 and s.prefill_checkpoint_alignment
        for s in setup.specs
    )
    # Mamba2 in "align" reserves prefill checkpoint blocks (and only it).
    assert (total.get("checkpoints", 0) > 0) == checkpoints, f"{name}: checkpoints {total.get('checkpoints', 0)}"
    off_end = total.get("checkpoints_off_block_end", 0)
    if checkpoints and setup.lookahead > 1:
        # Lookahead hashes over several tokens: a chunk ending less than that past a block
        # boundary reserves its checkpoint block one block past the position, keyed there
        # (its full-block key of that step replaced), and later requests hit that state.
        assert off_end > 0, f"{name}: every checkpoint ended its block"
        assert total.get("checkpoints_off_block_end_keyed", 0) > 0, f"{name}: no such checkpoint was keyed"
        assert total.get("off_block_end_checkpoint_hits", 0) > 0, f"{name}: no hit on such a checkpoint"
    elif checkpoints and not setup.use_eagle:
        # One lookahead token at most and no block drop: the position ends the reserved block.
        assert off_end == 0, f"{name}: {off_end} checkpoints off their block's end"


def test_mamba_groups_are_served_natively() -> None:
    """A Mamba hybrid with prefix caching off no longer falls back."""
    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from mamba_harness import MAMBA_SETUPS

    for s in MAMBA_SETUPS:
        if not s.available:
            continue
        m = HybridKVCacheManager(**s.manager_kwargs(events=False))
        assert type(m) is HybridKVCacheManager, s.name
