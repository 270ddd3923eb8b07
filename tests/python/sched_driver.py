"""Drives vLLM 0.32.0's real Scheduler (sync or async) through a seeded synthetic workload
and records, per step, a digest of the SchedulerOutput and the KV cache events, so two runs
(vLLM's manager and ours) can be compared step by step."""

from __future__ import annotations

import random
from typing import Any

from vllm.v1.request import RequestStatus

from hybrid_alloc.vllm.offline import SchedulerSetup, fabricate_output, make_request


def digest(so: Any) -> dict[str, Any]:
    cached = so.scheduled_cached_reqs
    return {
        "new": [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs],
        "cached": list(
            zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_output_tokens)
        ),
        "resumed": sorted(cached.resumed_req_ids),
        "num_scheduled": dict(so.num_scheduled_tokens),
        "total": so.total_num_scheduled_tokens,
        "finished": sorted(so.finished_req_ids),
        "preempted": sorted(so.preempted_req_ids or ()),
    }


def run_workload(setup: SchedulerSetup, seed: int, num_requests: int, max_steps: int = 5000, max_tokens_hi: int = 400) -> dict[str, Any]:
    """Returns the per-step digests, events and counters of one run."""
    rng = random.Random(seed)
    sched = setup.build()
    events: list[Any] = []
    mgr = sched.kv_cache_manager
    orig_take = mgr.take_events

    def take_events() -> list[Any]:
        evs = orig_take()
        events.extend(evs)
        return evs

    mgr.take_events = take_events  # type: ignore[method-assign]
    lookups = {"hits": 0, "queries": 0}
    orig_record = mgr.record_prefix_cache_stats

    def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
        lookups["hits"] += num_hits
        lookups["queries"] += request.num_tokens
        orig_record(request, num_hits)

    mgr.record_prefix_cache_stats = record_prefix_cache_stats  # type: ignore[method-assign]
    mml = setup.shape.max_model_len
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.randrange(100, 600))] for _ in range(4)]
    pending = []
    for i in range(num_requests):
        toks = list(prefixes[rng.randrange(4)]) if rng.random() < 0.7 else []
        toks += [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 900))]
        toks = toks[: mml - 200]
        pending.append((rng.randrange(0, 40), f"req{i}", toks, rng.randrange(1, max_tokens_hi)))
    pending.sort(key=lambda p: p[0])
    steps: list[dict[str, Any]] = []
    usage: list[float] = []
    preemptions = 0
    aborted: list[str] = []
    step = 0
    while (pending or sched.get_num_unfinished_requests()) and step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, toks, mt = pending.pop(0)
            sched.add_request(make_request(sched, rid, toks, mt))
        if step % 17 == 5 and sched.requests and rng.random() < 0.5:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)
        so = sched.schedule()
        d = digest(so)
        preemptions += len(d["preempted"])
        steps.append(d)
        out = fabricate_output(sched, so)
        sched.update_from_output(so, out)
        usage.append(sched.kv_cache_manager.usage)
        step += 1
    return {
        "steps": steps,
        "events": events,
        "usage": usage,
        "hits": lookups["hits"],
        "queries": lookups["queries"],
        "preemptions": preemptions,
        "aborted": aborted,
        "native": type(sched.kv_cache_manager).__name__,
        "finished": step < max_steps,
    }
