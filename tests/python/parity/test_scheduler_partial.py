"""vLLM's real Scheduler (and AsyncScheduler) with sub-block "partial hash hits": Mamba hybrids
(Qwen3.5-style GDN, Nemotron-H-style Mamba2 with MambaMixer2's prefill checkpoint block,
LFM2-style short convolution) in cache mode "align" with ``cache_config.prefix_match_unit``
below the block size, so vLLM hashes requests at the unit
(``resolve_kv_cache_block_sizes``), its coordinator enables partial hits and the scheduler
splits prefills at the prompt's last hash boundary (``mamba_partial_cache_hit``). Run once with
vLLM's KVCacheManager and once with ours on the same seeded workload, whose prompts repeat or
extend earlier ones (so hits end inside a block): the SchedulerOutputs (the copy-on-write
``kv_cache_block_copies`` too), KV events, usage, every lookup's hit, the scheduler's
``cache_blocks`` calls and the block ids handed out for zeroing must be identical at every step.
The ``spc`` cases turn vLLM's shared-prefix checkpoint on (the scheduler ends a prefill chunk at
the junction inside a block, the Mamba state is keyed there): every lookup's junction and the
scheduler's ``mamba_shared_prefix_checkpoint`` are compared too.

``HYBRID_ALLOC_PARTIAL_VLLM_TWICE=1`` runs vLLM's manager in both runs (a check of the
workload itself)."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

VLLM_TWICE = os.environ.get("HYBRID_ALLOC_PARTIAL_VLLM_TWICE", "") not in ("", "0")

# case: (family, block size, prefix_match_unit, async scheduling, pool blocks)
CASES: dict[str, tuple[str, int, int, bool, int]] = {
    "qwen35_gdn_b64_u16_sync": ("gdn", 64, 16, False, 300),
    "qwen35_gdn_b64_u16_async": ("gdn", 64, 16, True, 300),
    "qwen35_gdn_b128_u32_async": ("gdn", 128, 32, True, 180),
    "nemotron_h_b64_u32_sync": ("mamba2", 64, 32, False, 360),
    "nemotron_h_b128_u16_async": ("mamba2", 128, 16, True, 220),
    "nemotron_h_b128_u64_sync": ("mamba2", 128, 64, False, 220),
    "lfm2_short_conv_b64_u16_sync": ("short_conv", 64, 16, False, 300),
    # EAGLE with the prefix-cache block drop (0.32 with prefix caching, 0.33 on with
    # ``disable_lookahead_block_hashes``): every group drops, the Mamba checkpoints and the
    # scheduler's split positions move one unit back.
    "qwen35_gdn_b64_u16_eagle_drop_sync": ("gdn", 64, 16, False, 320),
    "nemotron_h_b64_u32_eagle_drop_async": ("mamba2", 64, 32, True, 380),
    # The same with vLLM's shared-prefix checkpoint (``enable_mamba_shared_prefix_checkpoint``):
    # the scheduler ends a prefill chunk at the junction inside a block, where the Mamba
    # state is keyed.
    "qwen35_gdn_b64_u16_eagle_drop_spc_sync": ("gdn", 64, 16, False, 320),
    "nemotron_h_b64_u16_eagle_drop_spc_async": ("mamba2", 64, 16, True, 380),
}

# The cases with vLLM's shared-prefix checkpoint on.
SPC = {"qwen35_gdn_b64_u16_eagle_drop_spc_sync", "nemotron_h_b64_u16_eagle_drop_spc_async"}
# The cases with an EAGLE drafter (two drafts a step) and the block drop.
EAGLE_DROP = {"qwen35_gdn_b64_u16_eagle_drop_sync", "nemotron_h_b64_u32_eagle_drop_async"} | SPC


def _setup(case: str) -> Any:
    import torch

    from hybrid_alloc.bench.offline import LayerKind, MambaState, ModelShape, SchedulerSetup
    from sched_driver import SpecSchedulerSetup
    from vllm_harness import HAVE_LOOKAHEAD_HASHES

    family, block, unit, async_scheduling, num_blocks = CASES[case]

    # The scheduler setup (with an EAGLE drafter for the drop cases) with the unit set.
    base = SpecSchedulerSetup if case in EAGLE_DROP else SchedulerSetup

    @dataclasses.dataclass
    class PartialSchedulerSetup(base):  # type: ignore[misc, valid-type]
        prefix_match_unit: int = 16
        shared_prefix_checkpoint: bool = False

        def vllm_config(self) -> Any:
            vc = base.vllm_config(self)
            vc.cache_config.prefix_match_unit = self.prefix_match_unit
            vc.cache_config.enable_mamba_shared_prefix_checkpoint = self.shared_prefix_checkpoint
            return vc

    every, n, mamba_type = {"gdn": (4, 8, "GDN_ATTN"), "mamba2": (7, 14, "MAMBA2"), "short_conv": (3, 9, "SHORT_CONV")}[
        family
    ]
    if family == "short_conv":
        state = MambaState(shapes=((2, 256),), dtypes=(torch.bfloat16,), mamba_type=mamba_type)
    else:
        state = MambaState(
            shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type=mamba_type
        )
    layers = tuple(LayerKind("full") if i % every == every - 1 else LayerKind("mamba") for i in range(n))
    # A state that fits one attention page of ``block`` tokens: the attention block, the Mamba
    # block and the scheduler block are all ``block``.
    shape = ModelShape(
        f"tiny-{family}", layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048, mamba_state=state
    )
    assert shape.attention_block_size(block) == block
    eagle: dict[str, Any] = {}
    if case in EAGLE_DROP:
        eagle = dict(num_spec_tokens=2, method="eagle", disable_lookahead_block_hashes=HAVE_LOOKAHEAD_HASHES)
    return PartialSchedulerSetup(
        shape=shape,
        block_size=block,
        num_blocks=num_blocks,
        async_scheduling=async_scheduling,
        max_num_seqs=24,
        max_num_batched_tokens=512,
        kv_events=True,
        prefix_match_unit=unit,
        shared_prefix_checkpoint=case in SPC,
        **eagle,
    )


def _prompt(rng: random.Random, prefixes: list[list[int]], earlier: list[list[int]]) -> list[int]:
    """A prompt that repeats an earlier one, extends one (a conversation's next turn), or
    starts with a shared prefix; the rest unique."""
    x = rng.random()
    if earlier and x < 0.3:
        return list(rng.choice(earlier))
    if earlier and x < 0.65:
        return list(rng.choice(earlier)) + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 300))]
    toks = list(prefixes[rng.randrange(4)]) if x < 0.85 else []
    return toks + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 700))]


def _run(setup: Any) -> dict[str, Any]:
    from sched_driver import run_workload

    zeroed: list[list[int]] = []
    lookups: list[tuple[str, int]] = []
    junctions: list[int] = []
    flags: dict[str, Any] = {}
    orig = type(setup).build

    def build(self: Any) -> Any:
        sched = orig(self)
        mgr = sched.kv_cache_manager
        flags["hash_block_size"] = sched.hash_block_size
        flags["mamba_partial_cache_hit"] = sched.mamba_partial_cache_hit
        flags["enable_partial_hash_hits"] = mgr.coordinator.enable_partial_hash_hits
        flags["use_eagle_block_drop"] = sched.use_eagle_block_drop
        flags["mamba_shared_prefix_checkpoint"] = sched.mamba_shared_prefix_checkpoint
        get_computed_blocks = mgr.get_computed_blocks

        def computed_blocks(request: Any, *args: Any) -> Any:
            out = get_computed_blocks(request, *args)
            junctions.append(out[2])
            return out

        mgr.get_computed_blocks = computed_blocks
        take = mgr.take_new_block_ids

        def take_new_block_ids() -> list[int]:
            ids = take()
            zeroed.append(list(ids))
            return ids

        mgr.take_new_block_ids = take_new_block_ids
        record = mgr.record_prefix_cache_stats

        def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
            lookups.append((request.request_id, num_hits))
            record(request, num_hits)

        mgr.record_prefix_cache_stats = record_prefix_cache_stats
        return sched

    setup.build = build.__get__(setup)
    # Async scheduling overlaps two steps as the engine core's batch queue does (outputs
    # arrive with tokens in flight; the copies' retained blocks are freed behind a fence).
    out = run_workload(
        setup,
        seed=17,
        num_requests=150,
        max_tokens_hi=100,
        batch_queue=2 if setup.async_scheduling else 1,
        prompt_fn=_prompt,
    )
    out["zeroed"] = zeroed
    out["lookups"] = lookups
    out["junctions"] = junctions
    out.update(flags)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_real_scheduler_identical_with_partial_hits(case: str) -> None:
    from sched_driver import assert_same_run

    base = _setup(case)
    _, block, unit, _, _ = CASES[case]
    ref = _run(dataclasses.replace(base, manager="vllm"))
    ours = _run(dataclasses.replace(base, manager="vllm" if VLLM_TWICE else "hybrid_alloc"))
    if VLLM_TWICE:
        ours["native"] = "HybridKVCacheManager"
    assert_same_run(case, ref, ours)
    assert ref["zeroed"] == ours["zeroed"], f"{case}: blocks to zero differ"
    assert ref["lookups"] == ours["lookups"], f"{case}: a lookup's hit differs"
    for k in (
        "hash_block_size",
        "mamba_partial_cache_hit",
        "enable_partial_hash_hits",
        "use_eagle_block_drop",
        "mamba_shared_prefix_checkpoint",
        "junctions",
    ):
        assert ref[k] == ours[k], k
    assert ref["use_eagle_block_drop"] == (case in EAGLE_DROP)
    assert ref["mamba_shared_prefix_checkpoint"] == (case in SPC)
    if case in SPC:
        # Junctions inside a block, where the scheduler ends a chunk and the state is keyed.
        assert any(j % block for j in ref["junctions"]), f"{case}: no junction inside a block"
    if case in EAGLE_DROP:
        assert ref["use_eagle"] is True and ref["lookahead"] == 0
        assert 0 < ref["accepted"] < ref["drafts"]
    assert ref["hash_block_size"] == unit
    assert ref["mamba_partial_cache_hit"] and ref["enable_partial_hash_hits"]
    assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    assert ref["hits"] > 0
    partial_hits = sum(1 for _, n in ref["lookups"] if n % block)
    copies = sum(len(s["copies"]) for s in ref["steps"])
    partial_tails = sum(
        1
        for e in ref["events"]
        for ev in getattr(e, "events", [e])
        if type(ev).__name__ == "BlockStored" and ev.block_size < block
    )
    print(f"{case}: partial hits {partial_hits}, copies {copies}, partial tails {partial_tails}")
    assert partial_hits > 0, f"{case}: no hit ended inside a block"
    assert copies > 0, f"{case}: no copy-on-write copy"
    assert partial_tails > 0, f"{case}: no partial tail was cached"


@pytest.mark.parametrize("case", ["qwen35_gdn_b64_u16_sync", "nemotron_h_b128_u16_async"])
def test_hit_aware_with_partial_hits_on_the_real_scheduler_keeps_every_invariant(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HYBRID_ALLOC_POLICY=hit-aware`` with the unit: the same workload (repeats, extensions,
    shared prefixes, aborts, preemptions) on vLLM's real scheduler, sync and async, with the
    core's invariants (free queue and levels, reference counts, the index and its second keys,
    tables, hit units) checked after every step; hits end inside a block, and there are at
    least as many as exact's on this workload."""
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    base = _setup(case)
    _, block, _, _, _ = CASES[case]
    cls = type(base)
    checked = [0]

    class Checked(cls):  # type: ignore[misc, valid-type]
        def build(self) -> Any:
            sched = cls.build(self)
            mgr = sched.kv_cache_manager
            schedule = sched.schedule

            def checked_schedule() -> Any:
                so = schedule()
                mgr._alloc.check_invariants()
                checked[0] += 1
                return so

            sched.schedule = checked_schedule
            return sched

    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    aware = _run(Checked(**{**fields, "manager": "hybrid_alloc"}))
    assert aware["native"] == "HybridKVCacheManager" and aware["finished"]
    assert checked[0] == len(aware["steps"]) > 0
    assert aware["preemptions"] > 0 and aware["aborted"]
    partial_hits = sum(1 for _, n in aware["lookups"] if n % block)
    assert partial_hits > 0, f"{case}: no hit ended inside a block"
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "exact")
    exact = _run(dataclasses.replace(base, manager="hybrid_alloc"))
    print(f"{case}: hit-aware hits {aware['hits']} ({partial_hits} inside a block), exact {exact['hits']}")
    assert aware["hits"] >= exact["hits"]
