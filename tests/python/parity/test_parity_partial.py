"""Differential tests for vLLM's sub-block "partial hash hits" (``cache_config.prefix_match_unit``
below the Mamba block size, cache mode "align"): Qwen3.5-style GDN, Nemotron-H-style Mamba2
(with MambaMixer2's prefill checkpoint block) and LFM2-style short-convolution hybrids, every
group's block 64 or 128 tokens, requests hashed every 16, 32 or 64 tokens, pools small enough
that allocations fail and requests are preempted. vLLM's own KVCacheManager against ours on
seeded random traces (``partial_harness.PartialParityRun``): beside everything
``test_parity_mamba`` compares, the copy-on-write copies and retained blocks
``take_kv_cache_block_copies`` hands out after every allocation (the retained blocks then
freed, as vLLM's scheduler frees them once the copy ran), and
``coordinator.enable_partial_hash_hits``. Ours is built with a KV connector (an
OffloadingConnector ``kv_transfer_config``), so the boundary states a connector is handed
(``take_boundary_state_offloads``, after every operation: the copy-on-write copies of producer
partial tails among them) and the producer partial tails ``finalize_partial_tail_offloads``
hands it at every finish and abort are compared too. Each trace must reach hits that end inside
a block, copies, partial-block prefix entries, copy-on-write boundary offloads and finalized
partial tails. The ``spc`` setups turn vLLM's shared-prefix checkpoint on
(``enable_mamba_shared_prefix_checkpoint`` with EAGLE/MTP groups: the split ends chunks at the
junction, the Mamba state is keyed there; ``mamba_shared_prefix_checkpoint`` compared), and
must end chunks at junctions inside a block.

``HYBRID_ALLOC_PARITY_OPS`` sets the operations per configuration (default 100000);
``HYBRID_ALLOC_PARTIAL_VLLM_TWICE=1`` runs vLLM's manager on both sides (a check of the traces
themselves)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

NUM_OPS = int(os.environ.get("HYBRID_ALLOC_PARITY_OPS", "100000"))


def _names() -> list[str]:
    try:
        from partial_harness import PARTIAL_SETUPS
    except ImportError:
        return ["(vllm missing)"]
    return [s.name for s in PARTIAL_SETUPS]


@pytest.mark.parametrize("name", _names())
def test_partial_hit_parity_random_trace(name: str) -> None:
    from parity_driver import run_seeds
    from partial_harness import PARTIAL_SETUPS, PartialParityRun

    setup = next(s for s in PARTIAL_SETUPS if s.name == name)
    if not setup.available:
        pytest.skip("lookahead block hashes are vLLM 0.33's")
    total = run_seeds(PartialParityRun, setup, 3000, NUM_OPS)
    print(f"{name}: {total}")
    assert total["finish"] > 0
    assert total["reset_ok"] > 0
    assert total["preempt"] > 0, f"{name}: no preemption happened; the pool is too large"
    assert total["none"] > 0
    assert total["hits"] > 0
    # Hits whose length is not a multiple of the Mamba block (a sub-block partial hit).
    assert total["partial_hits"] > 0, f"{name}: no hit ended inside a block"
    # Copy-on-write: the shared state block of a partial hit (or of a producer's own partial
    # tail) redirected to a private block, the copy handed out with both ends retained.
    assert total["cow_copies"] > 0, f"{name}: no copy-on-write copy"
    assert total["cow_retained"] == 2 * total["cow_copies"]
    # Partial-block prefix entries: BlockStored events shorter than their group's block.
    assert total["partial_tails"] > 0, f"{name}: no partial tail was cached"
    assert total["partial_tails_mamba"] > 0, f"{name}: no Mamba partial tail was cached"
    assert total.get("zeroed", 0) > 0
    # A KV connector's hand-offs: boundary states (some of them producer partial tails a
    # copy-on-write preserved, at a boundary inside the block) and, at a finish, the partial
    # tails still holding the request's last state.
    assert total["boundary_states"] > 0, f"{name}: no boundary-state offload"
    assert total["boundary_partial"] > 0, f"{name}: no copy-on-write partial-tail offload"
    assert total["finalize_calls"] > 0
    assert total["partial_tail_offloads"] > 0, f"{name}: no finalized partial tail"
    from vllm.v1.kv_cache_interface import MambaSpec

    # vLLM's shared-prefix checkpoint: chunks ended at a junction inside a block.
    spc = bool(setup.extra.get("shared_prefix_checkpoint"))
    assert total["junction_stops"] > 0 or not spc, f"{name}: no chunk ended at a junction inside a block"
    checkpoints = any(isinstance(s, MambaSpec) and s.num_prefill_checkpoint_blocks > 0 for s in setup.specs)
    assert (total.get("checkpoints", 0) > 0) == checkpoints, f"{name}: checkpoints {total.get('checkpoints', 0)}"


def test_partial_hit_setups_are_served_natively() -> None:
    """Ours serves every partial-hit configuration (no fallback to vLLM's manager), with and
    without a KV connector, and turns partial hits on exactly where vLLM's coordinator does."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from partial_harness import PARTIAL_SETUPS

    for s in PARTIAL_SETUPS:
        if not s.available:
            continue
        ours = HybridKVCacheManager(**s.manager_kwargs(events=False))
        assert type(ours) is HybridKVCacheManager, s.name
        ref = KVCacheManager(**s.manager_kwargs(events=False))
        assert ref.coordinator.enable_partial_hash_hits, s.name
        assert ours.coordinator.enable_partial_hash_hits, s.name
        # vLLM's shared-prefix checkpoint: on where vLLM's manager turns it on (the scheduler
        # reads the attribute to end chunks at junctions).
        assert ours.mamba_shared_prefix_checkpoint == ref.mamba_shared_prefix_checkpoint, s.name
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
        ours = HybridKVCacheManager(
            **s.manager_kwargs(events=False), vllm_config=SimpleNamespace(kv_transfer_config=ktc)
        )
        assert type(ours) is HybridKVCacheManager, f"{s.name} with a connector"
