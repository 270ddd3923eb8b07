"""Router fidelity at the scheduler level (every supported vLLM release): the example router's prefix
index (``examples/kv_router.py``), fed the KV cache events of vLLM's real Scheduler, predicts
each request's hit before the manager looks it up, over thousands of events with preemption,
aborts and eviction, on a full-attention shape and a hybrid (sliding window 64 + full).

- ``exact``: the predictions from our events equal those from vLLM's own manager's (the runs
  are step-by-step identical), and both equal the hit served when the index holds every event
  so far ("complete": the events still queued in the step are applied before the lookup); the
  index as of the last published step ("published", what a real router holds) is counted.
- ``hit-aware`` with pinned prefixes (``HYBRID_ALLOC_PIN_PREFIXES``) under memory pressure:
  a block the events say is stored is findable (on the full-attention shape the hit served is
  never shorter than the prediction), and every hit served was announced and not withdrawn
  (every group holds what the hit needs, as the events tell it).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

SEED = 11
BLOCK = 16


def _shapes() -> dict[str, tuple[Any, list[str], dict[str, Any]]]:
    from hybrid_alloc.bench.offline import LayerKind, ModelShape

    llama = ModelShape("tiny-llama", tuple(LayerKind("full") for _ in range(4)), 2, 64, 0, max_model_len=2048)
    gemma = ModelShape(
        "tiny-gemma2",
        tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4)),
        2,
        64,
        0,
        max_model_len=2048,
    )
    return {
        "llama": (llama, ["full_attention"], dict(num_blocks=150, max_num_batched_tokens=384)),
        "gemma2": (gemma, ["full_attention", "sliding_window"], dict(num_blocks=400, max_num_batched_tokens=512)),
    }


def _observe(sched: Any, kinds: list[str], log: list[dict[str, Any]]) -> None:
    """Feeds ``sched``'s KV events to two prefix indexes and records, for every lookup the
    scheduler makes, the hits they predict and the hit the manager serves."""
    from kv_router import GroupSpec, PrefixIndex

    groups = GroupSpec.from_kv_cache_config(sched.kv_cache_manager.kv_cache_config)
    assert sorted(g.kind for g in groups) == kinds
    # "learnt" is told nothing: it learns the groups from the events' annotations.
    complete, published, learnt = PrefixIndex(groups), PrefixIndex(groups), PrefixIndex()
    mgr = sched.kv_cache_manager
    take, lookup = mgr.take_events, mgr.get_computed_blocks
    queued: list[Any] = []

    def drain() -> None:
        evs = take()
        queued.extend(evs)
        for e in evs:
            complete.apply(e)
            learnt.apply(e)

    def take_events() -> list[Any]:
        drain()
        evs = list(queued)
        queued.clear()
        for e in evs:
            published.apply(e)
        return evs

    def get_computed_blocks(request: Any, *args: Any, **kw: Any) -> Any:
        drain()
        cap = kw.get("max_cache_hit_length", args[0] if args else None)
        toks = list(request.all_token_ids)
        pred, lag = complete.hit(toks, cap), published.hit(toks, cap)
        assert learnt.hit(toks, cap) == pred
        res = lookup(request, *args, **kw)
        served = res[1]
        log.append(
            dict(
                pred=pred,
                lag=lag,
                served=served,
                announced=complete.servable_at(toks, served),
                capped=(len(toks) - 1) // BLOCK * BLOCK,
            )
        )
        return res

    mgr.take_events = take_events
    mgr.get_computed_blocks = get_computed_blocks


def _run(shape_name: str, manager: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from hybrid_alloc.bench.offline import SchedulerSetup
    from sched_driver import run_workload

    shape, kinds, kw = _shapes()[shape_name]
    log: list[dict[str, Any]] = []

    @dataclasses.dataclass
    class Observed(SchedulerSetup):
        def build(self) -> Any:
            sched = super().build()
            _observe(sched, kinds, log)
            return sched

    setup = Observed(shape, manager=manager, max_num_seqs=24, kv_events=True, **kw)  # type: ignore[arg-type]
    res = run_workload(setup, seed=SEED, num_requests=60, max_tokens_hi=1000)
    assert res["finished"] and res["native"] == ("KVCacheManager" if manager == "vllm" else "HybridKVCacheManager")
    return res, log


def _counts(res: dict[str, Any], log: list[dict[str, Any]]) -> dict[str, int]:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    return dict(
        steps=len(res["steps"]),
        events=len(res["events"]),
        stored=sum(isinstance(e, BlockStored) for e in res["events"]),
        removed=sum(isinstance(e, BlockRemoved) for e in res["events"]),
        lookups=len(log),
        hits=sum(r["served"] > 0 for r in log),
        stale=sum(r["lag"] != r["served"] for r in log),
        preemptions=res["preemptions"],
    )


@pytest.mark.parametrize("shape", ["llama", "gemma2"])
def test_exact_router_prediction_is_vllms_and_the_hit_served(shape: str) -> None:
    ref, ref_log = _run(shape, "vllm")
    ours, our_log = _run(shape, "hybrid_alloc")
    assert ref["events"] == ours["events"]
    assert ref_log == our_log, "the predictions from our events differ from vLLM's"
    for i, r in enumerate(ref_log):
        assert r["pred"] == r["served"], (i, r)
        assert r["announced"]
    c = _counts(ref, ref_log)
    print(shape, "exact", c)
    assert c["events"] > 1000 and c["removed"] > 0 and c["preemptions"] > 0
    assert c["hits"] > 20


@pytest.mark.parametrize("shape", ["llama", "gemma2"])
def test_hit_aware_pinned_under_pressure_events_tell_the_truth(
    shape: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sched_driver import shared_prefixes

    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps(shared_prefixes(random.Random(SEED))[:2]))
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    monkeypatch.setenv("HYBRID_ALLOC_PIN_PREFIXES", str(pins))
    monkeypatch.setenv("HYBRID_ALLOC_PIN_SHARE", "0.3")
    res, log = _run(shape, "hybrid_alloc")
    for i, r in enumerate(log):
        assert r["announced"], (i, r)  # served, so announced and not withdrawn
        assert r["served"] >= r["pred"], (i, r)  # announced, so findable
    c = _counts(res, log)
    print(shape, "hit-aware", c, "longer than predicted:", sum(r["served"] > r["pred"] for r in log))
    assert c["events"] > 1000 and c["removed"] > 0 and c["preemptions"] > 0
    assert c["hits"] > 20


def test_example_router_over_vllms_zmq_publishers() -> None:
    """The example's transport against vLLM's own ``ZmqEventPublisher`` (two ranks, loopback):
    a batch published before the router subscribed comes from the replay endpoint, a batch
    seen both live and replayed counts once, and the answer follows the events."""
    import time

    from kv_router import Router
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    from engine_run import free_base_port

    def stored(hashes: list[int], tokens: list[int]) -> BlockStored:
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BLOCK,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def publish(pub: ZmqEventPublisher, *events: Any) -> None:
        pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    base = free_base_port()
    pubs = [
        ZmqEventPublisher(r, endpoint=f"tcp://*:{base}", replay_endpoint=f"tcp://*:{base + 100}", topic="kv")
        for r in range(2)
    ]
    router = None
    try:
        prefix = list(range(1, 2 * BLOCK + 1))
        query = prefix + [7, 7, 7]
        publish(pubs[0], stored([11, 12], prefix))  # before the router subscribes
        time.sleep(0.3)
        router = Router(
            [f"tcp://127.0.0.1:{base + r}" for r in range(2)],
            topic="kv",
            replay_endpoints=[f"tcp://127.0.0.1:{base + 100 + r}" for r in range(2)],
        )
        time.sleep(0.5)  # the SUB sockets join
        publish(pubs[1], stored([11], prefix[:BLOCK]))  # live, and in rank 1's replay buffer
        time.sleep(0.3)
        router.catch_up()
        router.poll(timeout_ms=500)
        assert router.num_events == [1, 1]
        assert router.best_rank(query) == (0, 2 * BLOCK)
        assert [ix.hit(query) for ix in router.indexes] == [2 * BLOCK, BLOCK]
        publish(pubs[0], BlockRemoved(block_hashes=[12], medium="GPU", group_idx=0))
        time.sleep(0.3)
        router.poll(timeout_ms=500)
        assert router.best_rank(query) == (0, BLOCK)  # a tie: the lowest rank
        publish(pubs[0], AllBlocksCleared())
        time.sleep(0.3)
        router.poll(timeout_ms=500)
        assert router.best_rank(query) == (1, BLOCK)
        assert router.num_events == [3, 1] and router.gaps == 0
    finally:
        if router is not None:
            router.close()
        for p in pubs:
            p.shutdown()
