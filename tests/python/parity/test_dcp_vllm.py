"""Decode context parallelism (DCP 2 and 4), against the installed vLLM (a supported release):

- the manager: vLLM's own ``KVCacheManager`` built with ``dcp_world_size`` 2 and 4 and ours,
  on full-attention and MLA groups and on a sharded group beside a replicated one, driven by
  the seeded random traces of ``parity_driver`` (prefix hits, evictions, preemption, resets):
  every call's block ids, hits, free counts, usage and events identical;
- the scheduler: vLLM's real ``Scheduler`` built offline with
  ``decode_context_parallel_size`` 2 and 4 (its ``resolve_kv_cache_block_sizes`` gives the
  scaled block sizes), the same workload with vLLM's manager and ours, step by step;
- a replicated Mamba "align" group beside sharded full attention (Qwen3.5-like GDN): vLLM turns
  partial hash hits on there (its Mamba block equals the hash block, the scaled full-attention
  block exceeds it), so hits end inside full-attention blocks, which are copied on write: the
  partial-hit traces (``partial_harness``, with the copies, partial tails and a connector's
  hand-offs compared too), and vLLM's real ``Scheduler`` on a Qwen3.5-like shape;
- what vLLM asserts against falls back with one line naming why (a sharded sliding-window
  group, prefill context parallelism), and the one per-request case where
  vLLM's own code asserts under DCP (a ``kv_cache_report_mode="full"`` hit) asserts alike."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

NUM_OPS = 8000


def _replicated(spec: Any) -> Any:
    """``spec`` with ``dcp_sharded=False``: every rank holds the whole group (vLLM's
    replicated draft groups), so vLLM's manager keeps the spec's block size."""
    return dataclasses.replace(spec, dcp_sharded=False)


def _setups() -> dict[str, Any]:
    from vllm_harness import Setup, full, mla, swa

    def dcp(name: str, specs: list[Any], d: int, hbs: int, num_blocks: int, sbs: int | None = None) -> Any:
        # hash / scheduler block sizes as resolve_kv_cache_block_sizes gives them under DCP.
        return Setup(
            name,
            specs,
            num_blocks=num_blocks,
            hash_block_size=hbs,
            scheduler_block_size=sbs or hbs,
            dcp=d,
            report_full=False,
        )

    return {
        s.name: s
        for s in [
            dcp("dcp2_full_bs16", [full(16)], 2, 32, 150),
            dcp("dcp4_full_bs16", [full(16)], 4, 64, 80),
            dcp("dcp2_mla_bs16", [mla(16)], 2, 32, 150),
            dcp("dcp4_mla_bs16", [mla(16)], 4, 64, 80),
            # A sharded group (block 16 x 2) beside a replicated sliding-window one (block 32).
            dcp("dcp2_full_replicated_swa", [full(16), _replicated(swa(64, 32))], 2, 32, 250),
            # Sharded MLA (16 x 4) beside a replicated full-attention group (block 64).
            dcp("dcp4_mla_replicated_full", [mla(16), _replicated(full(64))], 4, 64, 160),
            # A replicated group below the sharded one's block: hash block 16, the sharded
            # group's block (16 x 2, and MLA's 16 x 4 beside a replicated draft) exceeds it, so
            # vLLM keys its prompts' partial-block prefix entries.
            dcp("dcp2_full_replicated_full_below", [full(16), _replicated(full(16))], 2, 16, 250, sbs=32),
            dcp("dcp4_mla_replicated_draft_below", [mla(16), _replicated(full(16))], 4, 16, 250, sbs=64),
            # Prefix caching off (vLLM's no-prefix-cache coordinator).
            dataclasses.replace(
                dcp("dcp2_full_swa_nocache", [full(16), _replicated(swa(64, 32))], 2, 32, 250), enable_caching=False
            ),
        ]
    }


def _names() -> list[str]:
    try:
        return list(_setups())
    except ImportError:
        return ["(vllm missing)"]


@pytest.mark.parametrize("name", _names())
def test_dcp_parity_random_trace(name: str) -> None:
    from parity_driver import ParityRun, run_seeds

    setup = _setups()[name]
    ref, ours = setup.build(events=False)
    # vLLM scales the sharded groups' manager block size; ours reports the same.
    want = [m.block_size for m in ref.coordinator.single_type_managers]
    assert [m.block_size for m in ours.coordinator.single_type_managers] == want
    assert want[0] == setup.specs[0].block_size * setup.dcp
    total = run_seeds(ParityRun, setup, 1000, NUM_OPS)
    if setup.enable_caching:
        assert total["hits"] > 0 and total["cached_block_hits"] > 0, total
        assert total["removed_events"] > 0, f"{name}: no cached block was evicted; the pool is too large"
        if max(want) > setup.hash_block_size:
            assert total["partial_entries"] > 0, f"{name}: no partial-block prefix entry was stored"
    assert total["preempt"] > 0 and total["finish"] > 0 and total["reset_ok"] > 0, total


def test_dcp_report_full_hit_asserts_as_vllm() -> None:
    """vLLM's ``emit_cached_block_events`` reads the spec's unscaled block size, which is below
    the hash block size under DCP: a ``kv_cache_report_mode="full"`` request's hit raises
    ``AssertionError`` there. Ours raises it too, at the same call; a plain request's hit
    on the same blocks is served identically."""
    from vllm.v1.request import RequestStatus

    setup = dataclasses.replace(_setups()["dcp2_full_bs16"], report_full=True)
    ref, ours = setup.build(events=True)
    prompt = list(range(1, 200))
    first = setup.make_request("a", prompt)
    for m in (ref, ours):
        assert m.allocate_slots(first, len(prompt)).get_block_ids() is not None
    first.num_computed_tokens = len(prompt)
    first.status = RequestStatus.RUNNING
    for m in (ref, ours):
        m.free(first)
    assert ref.take_events() == ours.take_events()
    plain = setup.make_request("b", prompt)
    (a, na), (b, nb) = (m.get_computed_blocks(plain)[:2] for m in (ref, ours))
    assert na == nb == 192 and a.get_block_ids() == b.get_block_ids()
    full = setup.make_request("c", prompt, report_full=True)
    for m in (ref, ours):
        with pytest.raises(AssertionError):
            m.get_computed_blocks(full)
    assert ref.take_events() == ours.take_events()


@pytest.mark.parametrize("name", ["dcp4_full_bs16", "dcp2_full_replicated_swa"])
def test_dcp_truncate_and_computed_token_block_ids_match_vllm(name: str) -> None:
    """What connectors call, under DCP: ``truncate_computed_blocks`` at every multiple of the
    scheduler block (vLLM divides by the scaled manager block size) and
    ``get_block_ids_for_computed_tokens`` at every token count (vLLM divides by the
    unscaled spec block size there): the same ids as vLLM's."""
    from vllm.v1.request import RequestStatus

    setup = _setups()[name]
    ref, ours = setup.build(events=False)
    prompt = list(range(1, 400))
    out: dict[str, list[Any]] = {"ref": [], "ours": []}
    for key, m in (("ref", ref), ("ours", ours)):
        first = setup.make_request(f"a{key}", prompt)
        m.allocate_slots(first, len(prompt))
        first.num_computed_tokens = len(prompt)
        first.status = RequestStatus.RUNNING
        out[key] += [m.get_block_ids_for_computed_tokens(first.request_id, n) for n in range(0, len(prompt) + 1)]
        m.free(first)
        probe = setup.make_request(f"b{key}", prompt)
        blocks, hit = m.get_computed_blocks(probe)[:2]
        out[key].append(hit)
        for n in range(0, hit + 1, setup.scheduler_block_size):
            out[key].append(m.truncate_computed_blocks(blocks, n).get_block_ids())
    assert out["ref"][len(prompt) + 1] >= 2 * setup.scheduler_block_size
    assert out["ref"] == out["ours"]


def _fallback_cases() -> list[tuple[str, Any, dict[str, Any], str]]:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_harness import full, swa

    # A Mamba group sharded (vLLM's default keeps it replicated): vLLM's coordinator asserts.
    mamba = MambaSpec(
        block_size=32, shapes=((16, 16),), dtypes=(torch.float32,), mamba_cache_mode="align", dcp_sharded=True
    )
    return [
        ("sharded_swa_hybrid", [full(16), swa(64, 16)], dict(dcp_world_size=2), "sharded SlidingWindowSpec"),
        ("sharded_swa_alone", [swa(64, 16)], dict(dcp_world_size=2), "sharded SlidingWindowSpec"),
        ("sharded_mamba", [full(16), mamba], dict(dcp_world_size=2), "sharded MambaSpec"),
        ("pcp", [full(16)], dict(pcp_world_size=2), "prefill context parallelism"),
    ]


@pytest.mark.parametrize("case", ["sharded_swa_hybrid", "sharded_swa_alone", "sharded_mamba", "pcp"])
def test_dcp_fallback_names_why(case: str, plugin_lines: list[str]) -> None:
    """Configurations DCP is not served natively with: the adapter's decision names why, and
    the constructor logs exactly one line with that reason and hands over to vLLM's own
    manager (which, where it asserts against the layout, raises its own error unchanged)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm import manager
    from vllm_harness import Setup

    _, specs, over, fragment = next(c for c in _fallback_cases() if c[0] == case)
    d = over.get("dcp_world_size", 1)
    sizes = [s.block_size * (d if s.dcp_sharded else 1) for s in specs]  # as vLLM resolves them
    hbs, sbs = math.gcd(*sizes), math.lcm(*sizes)
    kw = Setup(case, specs, num_blocks=300, hash_block_size=hbs, scheduler_block_size=sbs).manager_kwargs(events=False)
    kw.update(over)
    native, reason = manager.native_config_or_reason(**kw)
    assert native is None and fragment in reason, reason
    try:
        m = manager.HybridKVCacheManager(**kw)
        assert type(m) is KVCacheManager
    except AssertionError as e:  # vLLM's own manager refuses the layout
        assert manager.raised_by_vllm(e)
    lines = [ln for ln in plugin_lines if "falling back" in ln]
    assert len(lines) == 1 and fragment in lines[0], lines


# ---- a replicated Mamba group: partial hash hits inside the scaled full-attention block ---


def _mamba_setups() -> list[Any]:
    from mamba_harness import gdn
    from partial_harness import PartialSetup
    from vllm_harness import full

    def qwen(d: int, num_blocks: int) -> Any:
        # Qwen3.5 / Qwen3-Next: one full-attention group (16-token spec block, 16 x d under DCP),
        # three GDN groups, replicated (the Mamba block is the hash block, 16).
        return PartialSetup(
            f"dcp{d}_qwen35_gdn_b16",
            [full(16)] + [gdn(16, "align") for _ in range(3)],
            num_blocks=num_blocks,
            hash_block_size=16,
            scheduler_block_size=16 * d,
            dcp=d,
            report_full=False,
            extra={"block": 16, "unit": 16},
        )

    return [qwen(2, 160), qwen(4, 160)]


def _mamba_names() -> list[str]:
    try:
        return [s.name for s in _mamba_setups()]
    except ImportError:
        return ["(vllm missing)"]


@pytest.mark.parametrize("name", _mamba_names())
def test_dcp_mamba_partial_hit_parity(name: str) -> None:
    from parity_driver import run_seeds
    from partial_harness import PartialParityRun

    setup = next(s for s in _mamba_setups() if s.name == name)
    ref, ours = setup.build(events=False)
    assert type(ours).__name__ == "HybridKVCacheManager", name
    assert [m.block_size for m in ours.coordinator.single_type_managers] == [
        m.block_size for m in ref.coordinator.single_type_managers
    ]
    assert ref.coordinator.enable_partial_hash_hits and ours.coordinator.enable_partial_hash_hits
    total = run_seeds(PartialParityRun, setup, 3000, NUM_OPS)
    print(f"{name}: {total}")
    assert total["hits"] > 0 and total["preempt"] > 0 and total["finish"] > 0, total
    # Hits ending inside a full-attention block (16 x dcp): its copy-on-write copy.
    assert total["cow_copies"] > 0 and total["cow_retained"] == 2 * total["cow_copies"], total
    # The prompt's last hash boundary keyed inside its full-attention block.
    assert total["partial_entries"] > 0, total
    assert total["boundary_states"] > 0, total


# ---- the real Scheduler ----------------------------------------------------------------


def _dcp_scheduler_setup(shape: Any, dcp: int, num_blocks: int) -> Any:
    from vllm.config import ParallelConfig

    from hybrid_alloc.bench import offline

    pc = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=dcp)
    # One KV head: 0.32 wants TP above the KV heads, 0.33 DCP at most TP / KV heads.
    return offline.SchedulerSetup(
        shape=shape,
        stub_kv_heads=1,
        num_blocks=num_blocks,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        kv_events=True,
        extra=dict(parallel_config=pc),
    )


def _shape(name: str) -> Any:
    from hybrid_alloc.bench.offline import SHAPES, LayerKind, ModelShape

    if name == "llama":
        return SHAPES["llama-3.1-8b"]
    if name == "qwen35":
        import torch

        from hybrid_alloc.bench.offline import MambaState

        # Qwen3.5-like, tiny: GDN and full attention 3:1, a state that fits a 16-token page.
        state = MambaState(
            shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="GDN_ATTN"
        )
        layers = tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(8))
        return ModelShape(
            "tiny-qwen3.5", layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048, mamba_state=state
        )
    return ModelShape(
        "mla-only", tuple(LayerKind("mla") for _ in range(8)), num_kv_heads=1, head_size=576, weight_bytes=1 << 30
    )


def _engine_core_view(sched: Any) -> tuple[Any, Any]:
    """What vLLM's ``EngineCore`` derives from the managers: the effective attention block
    size and the KV cache group metadata (external event consumers), by its own methods."""
    import types

    from vllm.v1.engine.core import EngineCore

    core = types.SimpleNamespace(vllm_config=sched.vllm_config, scheduler=sched)
    EngineCore._initialize_effective_attention_block_size(core)  # type: ignore[arg-type]
    meta = EngineCore.get_kv_cache_group_metadata(core)  # type: ignore[arg-type]
    return sched.vllm_config.cache_config.effective_attention_block_size, meta


@pytest.mark.parametrize(
    "shape, dcp, num_blocks",
    [("llama", 2, 120), ("llama", 4, 60), ("mla", 2, 120), ("mla", 4, 60), ("qwen35", 2, 160), ("qwen35", 4, 160)],
)
def test_dcp_real_scheduler_identical(shape: str, dcp: int, num_blocks: int) -> None:
    from sched_driver import assert_same_run, run_workload

    base = _dcp_scheduler_setup(_shape(shape), dcp, num_blocks)
    sched = dataclasses.replace(base, manager="hybrid_alloc").build()
    spec_bs = sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    assert sched.dcp_world_size == dcp and sched.block_size == spec_bs * dcp
    # The hash block: the scaled block, or with a (replicated) Mamba group its unscaled block.
    assert sched.hash_block_size == (spec_bs if shape == "qwen35" else spec_bs * dcp)
    assert type(sched.kv_cache_manager).__name__ == "HybridKVCacheManager"
    # vLLM's engine core reads the managers' (scaled) block sizes: the same from both.
    ref_sched = dataclasses.replace(base, manager="vllm").build()
    assert _engine_core_view(ref_sched) == _engine_core_view(sched)
    assert _engine_core_view(ref_sched)[0] == spec_bs * dcp
    run = dict(seed=11, num_requests=30, max_tokens_hi=600)
    ref = run_workload(dataclasses.replace(base, manager="vllm"), **run)
    ours = run_workload(dataclasses.replace(base, manager="hybrid_alloc"), **run)
    assert_same_run(f"{shape}_dcp{dcp}", ref, ours)
    assert ref["preemptions"] > 0 and ref["aborted"] and ref["hits"] > 0 and ref["events"]
