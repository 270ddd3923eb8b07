"""vLLM's real Scheduler (and AsyncScheduler) with Mamba hybrids, run once with vLLM's
KVCacheManager and once with ours on the same seeded workload (shared prefixes, chunked
prefill, preemption, aborts): Qwen3.5-style GDN + full attention (3:1) and Nemotron-H-style
Mamba2 + attention, with prefix caching on (cache mode "align", where the scheduler splits
prefill chunks at Mamba block boundaries) and off (mode "none", one state block per request
of ``max_model_len`` tokens). Nemotron-H's Mamba2 layers carry MambaMixer2's prefill
checkpoint block (alignment 1): the scheduler then does not split a prefill at block
boundaries, and the manager reserves a block for the state at the chunk's last boundary (with
0.33's lookahead block hashes over three tokens, multi-module MTP, sometimes one block past that
boundary, keyed at it as vLLM keys it). The SchedulerOutputs, KV events, usage, hits and the block ids
handed to the model runner for zeroing must be identical at every step.

The model folders are config-only (vLLM's planner groups and sizes the specs that
``hybrid_alloc.bench.offline`` builds; the Mamba state page is padded to the attention page
as vLLM's hybrid config does)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

CASES = [
    "qwen35_gdn_align_sync",
    "qwen35_gdn_align_async",
    "qwen35_gdn_nocache",
    "nemotron_h_align_sync",
    "nemotron_h_align_async",
    "nemotron_h_nocache",
    "qwen35_gdn_align_ngram_sync",
    "nemotron_h_align_ngram_async",
    "qwen35_gdn_align_mtp3_sync",
    "qwen35_gdn_align_mtp3_async",
    "qwen35_gdn_mtp3_nocache",
    "qwen35_gdn_align_eagle_drop_sync",
    "qwen35_gdn_align_eagle_drop_async",
    "nemotron_h_align_eagle_drop_sync",
    "qwen35_gdn_eagle_nocache",
    "nemotron_h_align_mtp3_sync",
    "nemotron_h_align_mtp3_async",
]
# Cases about 0.33's lookahead block hashes: skipped on 0.32.
LOOKAHEAD_HASHES_ONLY = {"nemotron_h_align_mtp3_sync", "nemotron_h_align_mtp3_async"}


def _setup(case: str) -> Any:
    import torch

    from hybrid_alloc.bench.offline import LayerKind, MambaState, ModelShape, SchedulerSetup

    def shape(name: str, every: int, n: int, mamba_type: str) -> ModelShape:
        # A state small enough for a 16-token attention page (vLLM pads it to that page).
        layers = tuple(LayerKind("full") if i % every == every - 1 else LayerKind("mamba") for i in range(n))
        state = MambaState(
            shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type=mamba_type
        )
        return ModelShape(
            name, layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048, mamba_state=state
        )

    cases = {
        "qwen35_gdn_align_sync": dict(shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=260),
        "qwen35_gdn_align_async": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=300, async_scheduling=True
        ),
        "qwen35_gdn_nocache": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=260, enable_prefix_caching=False
        ),
        "nemotron_h_align_sync": dict(shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=300),
        "nemotron_h_align_async": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=300, async_scheduling=True
        ),
        "nemotron_h_nocache": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=300, enable_prefix_caching=False
        ),
        # n-gram speculative decoding: drafts partly accepted, and one speculative Mamba state
        # block per draft token (cache mode "align": scratch blocks relocated as tables grow).
        "qwen35_gdn_align_ngram_sync": dict(shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=320, spec=3),
        "nemotron_h_align_ngram_async": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=340, spec=2, async_scheduling=True
        ),
        # Multi-module MTP (three tokens of prefill lookahead; the EAGLE stub stands in, see
        # ``SpecSchedulerSetup.prefill_lookahead``): lookahead block hashes over three tokens
        # with prefix caching (0.33 on; 0.32 drops the block, the Mamba checkpoints one block
        # back, with the re-prefillable tokens), the drop with caching off (every release).
        "qwen35_gdn_align_mtp3_sync": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=320, spec=3, method="eagle", prefill_lookahead=3
        ),
        "qwen35_gdn_align_mtp3_async": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"),
            num_blocks=340,
            spec=3,
            method="eagle",
            prefill_lookahead=3,
            async_scheduling=True,
        ),
        "qwen35_gdn_mtp3_nocache": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"),
            num_blocks=320,
            spec=3,
            method="eagle",
            prefill_lookahead=3,
            enable_prefix_caching=False,
        ),
        # EAGLE with the prefix-cache block drop (``use_eagle``: 0.32 with prefix caching,
        # 0.33 on with ``disable_lookahead_block_hashes``): no group is flagged (the stub draft
        # adds no layers), so every group drops, the Mamba ones included; the scheduler and
        # the managers move the Mamba checkpoints one block back. Prefix caching off: the
        # managers get ``use_eagle`` and read none of it.
        "qwen35_gdn_align_eagle_drop_sync": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"), num_blocks=320, spec=3, method="eagle", drop=True
        ),
        "qwen35_gdn_align_eagle_drop_async": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"),
            num_blocks=320,
            spec=3,
            method="eagle",
            drop=True,
            async_scheduling=True,
        ),
        "nemotron_h_align_eagle_drop_sync": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=340, spec=2, method="eagle", drop=True
        ),
        # Multi-module MTP on Nemotron-H (MambaMixer2's prefill checkpoint blocks): with 0.33's
        # lookahead block hashes over three tokens every checkpoint moves three tokens back, so
        # a chunk ending one or two tokens past a block boundary reserves its checkpoint block
        # one block past the position (0.33 on only: 0.32 drops the block instead).
        "nemotron_h_align_mtp3_sync": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"), num_blocks=340, spec=3, method="eagle", prefill_lookahead=3
        ),
        "nemotron_h_align_mtp3_async": dict(
            shape=shape("tiny-nemotron-h", 7, 14, "MAMBA2"),
            num_blocks=360,
            spec=3,
            method="eagle",
            prefill_lookahead=3,
            async_scheduling=True,
        ),
        "qwen35_gdn_eagle_nocache": dict(
            shape=shape("tiny-qwen3.5", 4, 8, "GDN_ATTN"),
            num_blocks=320,
            spec=3,
            method="eagle",
            enable_prefix_caching=False,
        ),
    }
    kw = dict(cases[case])
    spec = kw.pop("spec", 0)
    if spec:
        from sched_driver import SpecSchedulerSetup
        from vllm_harness import HAVE_LOOKAHEAD_HASHES

        # The drop cases: 0.33 on needs lookahead block hashes off for vLLM's last-block drop.
        if kw.pop("drop", False) and HAVE_LOOKAHEAD_HASHES:
            kw["disable_lookahead_block_hashes"] = True
        return SpecSchedulerSetup(
            max_num_seqs=24, max_num_batched_tokens=512, kv_events=True, num_spec_tokens=spec, **kw
        )
    return SchedulerSetup(
        max_num_seqs=24, max_num_batched_tokens=512, kv_events=kw.get("enable_prefix_caching", True), **kw
    )


def _run(setup: Any) -> dict[str, Any]:
    from sched_driver import run_workload

    zeroed: list[list[int]] = []
    # vLLM's managers only: how many caching calls found a prefill checkpoint reserved, and
    # how many of those where the position does not end the reserved block.
    checkpoints = [0]
    off_end = [0]
    split_free = [False]
    orig = type(setup).build

    def build(self: Any) -> Any:
        sched = orig(self)
        split_free[0] = sched.mamba_has_prefill_checkpoint_blocks
        mgr = sched.kv_cache_manager
        for m in getattr(getattr(mgr, "coordinator", None), "single_type_managers", ()):
            if hasattr(m, "_checkpoints"):
                cache = m.cache_blocks

                def cache_blocks(request: Any, *a: Any, _m: Any = m, _cache: Any = cache, **k: Any) -> Any:
                    ckpt = _m._checkpoints.get(request.request_id)
                    checkpoints[0] += ckpt is not None
                    off_end[0] += ckpt is not None and ckpt[0] != (ckpt[1] + 1) * _m.block_size
                    return _cache(request, *a, **k)

                m.cache_blocks = cache_blocks
        take = mgr.take_new_block_ids

        def take_new_block_ids() -> list[int]:
            ids = take()
            zeroed.append(list(ids))
            return ids

        mgr.take_new_block_ids = take_new_block_ids
        return sched

    setup.build = build.__get__(setup)
    out = run_workload(setup, seed=11, num_requests=40, max_tokens_hi=1000)
    out["zeroed"] = zeroed
    out["checkpoints"] = checkpoints[0]
    out["checkpoints_off_end"] = off_end[0]
    out["split_free"] = split_free[0]
    return out


def _sync_mamba_cache_blocks() -> bool:
    """Whether this vLLM's ``update_from_output`` caches a Mamba hybrid's blocks after each
    output in sync scheduling (0.34: ``self.has_mamba_layers and not ...async_scheduling``)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    return "self.has_mamba_layers" in inspect.getsource(Scheduler.update_from_output)


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical_with_mamba(case: str) -> None:
    from sched_driver import assert_same_run
    from vllm_harness import HAVE_LOOKAHEAD_HASHES

    if case in LOOKAHEAD_HASHES_ONLY and not HAVE_LOOKAHEAD_HASHES:
        pytest.skip(
            f"{case}: lookahead block hashes exist from vLLM 0.33 on (0.32's drop on Mamba2 is "
            "nemotron_h_align_eagle_drop_sync; with MTP-3 its hits depend on PYTHONHASHSEED, none for some)"
        )
    base = _setup(case)
    spec = getattr(base, "num_spec_tokens", 0)
    ref = _run(dataclasses.replace(base, manager="vllm"))
    ours = _run(dataclasses.replace(base, manager="hybrid_alloc"))
    assert_same_run(case, ref, ours)
    assert ref["zeroed"] == ours["zeroed"], f"{case}: blocks to zero differ"
    assert any(ref["zeroed"]), f"{case}: no block was handed out for zeroing"
    assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
        assert ref["events"]
    mixer2 = case.startswith("nemotron_h")
    assert ref["split_free"] == ours["split_free"] == mixer2
    # The scheduler's cache_blocks calls (compared call by call in ``assert_same_run``). vLLM
    # 0.34 also publishes a Mamba hybrid's finalized states after each output under sync
    # scheduling with prefix caching (``update_from_output``), where 0.32 and 0.33 call it only
    # with output placeholders (async) or (0.33) drafts.
    if base.enable_prefix_caching and (base.async_scheduling or _sync_mamba_cache_blocks()):
        assert ref["cache_blocks"] > 0, f"{case}: the scheduler never called cache_blocks"
    elif not spec:
        assert ref["cache_blocks"] == 0, f"{case}: cache_blocks called by a release that should not"

    # Lookahead block hashes: 0.33 on with prefix caching, unless the case asks for the drop.
    hashes = (
        HAVE_LOOKAHEAD_HASHES
        and base.enable_prefix_caching
        and not getattr(base, "disable_lookahead_block_hashes", False)
    )
    if getattr(base, "prefill_lookahead", 0):
        assert ref["prefill_lookahead"] == 3
        assert ref["lookahead"] == (3 if hashes else 0)

    if mixer2 and base.enable_prefix_caching:
        assert ref["checkpoints"] > 0, f"{case}: no prefill checkpoint was reserved"
        if hashes and getattr(base, "prefill_lookahead", 0) > 1:
            # Lookahead hashes over several tokens: some checkpoint is keyed one block back
            # from the end of the block reserved for it.
            assert ref["checkpoints_off_end"] > 0, f"{case}: every checkpoint ended its block"
        elif not ref["use_eagle"]:
            # One token at most (no block drop): the position ends the reserved block.
            assert ref["checkpoints_off_end"] == 0, f"{case}: {ref['checkpoints_off_end']}"
    if getattr(base, "method", None) == "eagle" and not hashes:
        # The block drop: no lookahead hashes, the managers built with ``use_eagle`` (vLLM's
        # Mamba managers then move their checkpoints: ``drop_eagle_checkpoint_block``).
        assert ref["lookahead"] == 0 and ref["use_eagle"] is True, f"{case}: {ref['lookahead']} {ref['use_eagle']}"
        assert 0 < ref["accepted"] < ref["drafts"]
