"""vLLM's real Scheduler (and AsyncScheduler) with Mamba hybrids, run once with vLLM's
KVCacheManager and once with ours on the same seeded workload (shared prefixes, chunked
prefill, preemption, aborts): Qwen3.5-style GDN + full attention (3:1) and Nemotron-H-style
Mamba2 + attention, with prefix caching on (cache mode "align", where the scheduler splits
prefill chunks at Mamba block boundaries) and off (mode "none", one state block per request
of ``max_model_len`` tokens). The SchedulerOutputs, KV events, usage, hits and the block ids
handed to the model runner for zeroing must be identical at every step.

The model folders are config-only (vLLM's planner groups and sizes the specs built here);
the Mamba state page is padded to the attention page as vLLM's hybrid config does."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

CASES = ["qwen35_gdn_align_sync", "qwen35_gdn_align_async", "qwen35_gdn_nocache", "nemotron_h_align_sync"]


def _setup(case: str) -> Any:
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec

    from hybrid_alloc.vllm.offline import LayerKind, ModelShape, SchedulerSetup

    @dataclasses.dataclass(frozen=True)
    class MambaShape(ModelShape):
        mamba_type: Any = MambaAttentionBackendEnum.GDN_ATTN

        def kv_cache_specs(self, block_size: int, no_hybrid: bool = False) -> dict[str, KVCacheSpec]:
            specs: dict[str, KVCacheSpec] = {}
            attn = FullAttentionSpec(
                block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=self.dtype
            )
            page = attn.page_size_bytes
            for i, layer in enumerate(self.layers):
                if layer.kind == "full":
                    specs[f"model.layers.{i}.self_attn.attn"] = attn
                else:
                    align = layer.window == 1
                    specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                        block_size=block_size if align else self.max_model_len,
                        shapes=((3, 256), (4, 16, 16)),
                        dtypes=(torch.bfloat16, torch.float32),
                        page_size_padded=page,
                        mamba_type=self.mamba_type,
                        mamba_cache_mode="align" if align else "none",
                    )
            return specs

    @dataclasses.dataclass
    class MambaSchedulerSetup(SchedulerSetup):
        def vllm_config(self) -> Any:
            vc = super().vllm_config()
            cc = vc.cache_config
            cc.mamba_cache_mode = "align" if self.enable_prefix_caching else "none"
            cc.mamba_block_size = self.block_size if self.enable_prefix_caching else self.shape.max_model_len
            return vc

    def shape(name: str, every: int, n: int, align: bool, mamba_type: Any) -> MambaShape:
        layers = tuple(LayerKind("full") if i % every == every - 1 else LayerKind("mamba", int(align)) for i in range(n))
        return MambaShape(name, layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048,
                          mamba_type=mamba_type)

    gdn = MambaAttentionBackendEnum.GDN_ATTN
    m2 = MambaAttentionBackendEnum.MAMBA2
    cases = {
        "qwen35_gdn_align_sync": dict(shape=shape("tiny-qwen3.5", 4, 8, True, gdn), num_blocks=260),
        "qwen35_gdn_align_async": dict(shape=shape("tiny-qwen3.5", 4, 8, True, gdn), num_blocks=300,
                                       async_scheduling=True),
        "qwen35_gdn_nocache": dict(shape=shape("tiny-qwen3.5", 4, 8, False, gdn), num_blocks=260,
                                   enable_prefix_caching=False),
        "nemotron_h_align_sync": dict(shape=shape("tiny-nemotron-h", 7, 14, True, m2), num_blocks=300),
    }
    kw = cases[case]
    return MambaSchedulerSetup(max_num_seqs=24, max_num_batched_tokens=512,
                               kv_events=kw.get("enable_prefix_caching", True), **kw)


def _run(setup: Any) -> dict[str, Any]:
    from sched_driver import run_workload

    zeroed: list[list[int]] = []
    orig = type(setup).build

    def build(self: Any) -> Any:
        sched = orig(self)
        mgr = sched.kv_cache_manager
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
    return out


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical_with_mamba(case: str) -> None:
    base = _setup(case)
    ref = _run(dataclasses.replace(base, manager="vllm"))
    ours = _run(dataclasses.replace(base, manager="hybrid_alloc"))
    assert ref["native"] == "KVCacheManager"
    assert ours["native"] == "HybridKVCacheManager"
    assert ref["finished"] and ours["finished"]
    assert len(ref["steps"]) == len(ours["steps"])
    for i, (a, b) in enumerate(zip(ref["steps"], ours["steps"])):
        assert a == b, f"{case}: SchedulerOutput differs at step {i}"
    assert ref["events"] == ours["events"], f"{case}: KV events differ"
    assert ref["usage"] == ours["usage"]
    assert ref["zeroed"] == ours["zeroed"], f"{case}: blocks to zero differ"
    assert (ref["hits"], ref["queries"]) == (ours["hits"], ours["queries"])
    assert any(ref["zeroed"]), f"{case}: no block was handed out for zeroing"
    assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
        assert ref["events"]
