"""Drives the installed vLLM's (a supported release's) real Scheduler (sync or async) through a
seeded synthetic workload and records, per step, a digest of the SchedulerOutput and the KV
cache events, so two runs (vLLM's manager and ours) can be compared step by step."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from hybrid_alloc.bench.offline import (
    SchedulerSetup,
    fabricate_output,
    fake_token,
    make_request,
    stub_model_dir,
)

_EAGLE_DRAFT_DIR: str | None = None


def eagle_draft_dir() -> str:
    """A folder holding only an EAGLE draft's ``config.json`` (the scheduler reads nothing
    else from it)."""
    global _EAGLE_DRAFT_DIR
    if _EAGLE_DRAFT_DIR is None:
        d = tempfile.mkdtemp(prefix="hybrid_alloc_eagle_stub_")
        cfg = {
            "architectures": ["EagleLlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16",
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _EAGLE_DRAFT_DIR = d
    return _EAGLE_DRAFT_DIR


@dataclass
class SpecSchedulerSetup(SchedulerSetup):
    """A ``SchedulerSetup`` with speculative decoding (``num_spec_tokens`` drafts a step).

    ``method="ngram"``: vLLM's ``"ngram"`` in sync scheduling, ``"ngram_gpu"`` (the n-gram
    method vLLM allows with async scheduling) in async; the scheduler and the KV cache
    manager see the same from both (drafts, no draft model, no lookahead).
    ``method="eagle"``: an EAGLE drafter (a stub draft config); with prefix caching, vLLM
    0.33 hashes blocks with one lookahead token instead of dropping the last block, unless
    ``disable_lookahead_block_hashes`` (0.33 on; vLLM 0.32 has no such option, and drops)."""

    num_spec_tokens: int = 3
    method: str = "ngram"
    disable_lookahead_block_hashes: bool = False
    # Multi-module MTP's prefill lookahead (``VllmConfig.num_prefill_lookahead_tokens``, its
    # ``num_speculative_tokens``): 0 keeps the method's own. A multi-module MTP drafter needs
    # a DeepSeek-style checkpoint to configure, so the EAGLE stub stands in, with the property
    # answering this while the scheduler is built (the scheduler, the manager's arguments and
    # the lookahead hashes read it then, and only then).
    prefill_lookahead: int = 0

    def build(self) -> Any:
        if not self.prefill_lookahead:
            return super().build()
        prop = VllmConfig.__dict__["num_prefill_lookahead_tokens"]
        la = self.prefill_lookahead
        VllmConfig.num_prefill_lookahead_tokens = property(lambda vc: la)  # type: ignore[method-assign,assignment]
        try:
            sched = super().build()
        finally:
            VllmConfig.num_prefill_lookahead_tokens = prop  # type: ignore[method-assign]
        assert sched.num_prefill_lookahead == la
        return sched

    def vllm_config(self) -> VllmConfig:
        mml = self.shape.max_model_len
        # The target model as SchedulerSetup builds it (the drafter checks against it).
        target = ModelConfig(
            model=stub_model_dir(mml),
            tokenizer=None,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            max_model_len=mml,
        )
        pc = ParallelConfig()
        if self.method == "eagle":
            method: dict[str, Any] = dict(method="eagle", model=eagle_draft_dir())
            if self.disable_lookahead_block_hashes:
                method["disable_lookahead_block_hashes"] = True
        else:
            method = dict(
                method="ngram_gpu" if self.async_scheduling else "ngram", prompt_lookup_max=3, prompt_lookup_min=2
            )
        spec = SpeculativeConfig(
            **method,
            num_speculative_tokens=self.num_spec_tokens,
            target_model_config=target,
            target_parallel_config=pc,
        )
        extra = {**self.extra, "speculative_config": spec, "parallel_config": pc}
        return SchedulerSetup.vllm_config(dataclasses.replace(self, extra=extra))


def digest(so: Any) -> dict[str, Any]:
    cached = so.scheduled_cached_reqs
    return {
        "new": [(r.req_id, r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs],
        "cached": list(zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_output_tokens)),
        # vLLM 0.34 sends resumed requests as new ones and dropped ``resumed_req_ids``.
        "resumed": sorted(getattr(cached, "resumed_req_ids", ())),
        "num_scheduled": dict(so.num_scheduled_tokens),
        "total": so.total_num_scheduled_tokens,
        "finished": sorted(so.finished_req_ids),
        "preempted": sorted(so.preempted_req_ids or ()),
        # Copy-on-write copies of sub-block partial hits (src, dst), in the manager's order.
        "copies": [(c.src_block_id, c.dst_block_id) for c in getattr(so, "kv_cache_block_copies", None) or ()],
    }


def _accepted(req_id: str, position: int, num_drafts: int) -> int:
    """How many of ``num_drafts`` draft tokens the fabricated verifier accepts (the same in
    both runs of a comparison)."""
    return (hash((req_id, position, "accept")) & 0x7FFFFFFF) % (num_drafts + 1)


def fabricate_spec_output(sched: Any, so: Any) -> ModelRunnerOutput:
    """The model output of a step with speculative decoding: for each request whose prompt is
    done, one sampled token plus the accepted share of its scheduled drafts."""
    out = fabricate_output(sched, so)
    spec = so.scheduled_spec_decode_tokens
    for i, rid in enumerate(out.req_ids):
        sampled = out.sampled_token_ids[i]
        drafts = spec.get(rid)
        if sampled and drafts:
            req = sched.requests[rid]
            n = _accepted(rid, req.num_tokens, len(drafts))
            sampled.extend(fake_token(rid, req.num_tokens + 1 + j) for j in range(n))
    return out


def fabricate_drafts(sched: Any, so: Any, k: int) -> DraftTokenIds:
    """The n-gram proposer's drafts after a sync step: 0..k tokens for each scheduled
    request still running."""
    ids: list[str] = []
    drafts: list[list[int]] = []
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is None or req.is_finished():
            continue
        n = (hash((rid, req.num_tokens, "draft")) & 0x7FFFFFFF) % (k + 1)
        ids.append(rid)
        drafts.append([fake_token(rid, req.num_tokens + 100 + j) for j in range(n)])
    return DraftTokenIds(ids, drafts)


def drive_to_end(sched: Any, reqs: list[Any], trace: list[Any] | None = None, check_invariants: bool = False) -> None:
    """Adds ``reqs`` to ``sched`` and steps it (the worker faked by ``fabricate_output``) until
    no request is unfinished; ``trace`` gets each step's scheduled ``(request, tokens)``,
    sorted; ``check_invariants``: our manager's invariants after every step. Raises when
    10,000 steps did not finish."""
    for r in reqs:
        sched.add_request(r)
    for _ in range(10_000):
        if not sched.get_num_unfinished_requests():
            return
        so = sched.schedule()
        if trace is not None:
            trace.append(sorted(so.num_scheduled_tokens.items()))
        sched.update_from_output(so, fabricate_output(sched, so))
        if check_invariants:
            sched.kv_cache_manager.check_invariants()
    raise AssertionError("the scheduler did not finish")


def shared_prefixes(rng: random.Random) -> list[list[int]]:
    """The 4 prefixes ``run_workload`` shares among its requests: its first draws from
    ``random.Random(seed)``, so a test can pin them before the run."""
    return [[rng.randrange(1, 30000) for _ in range(rng.randrange(100, 600))] for _ in range(4)]


def run_workload(
    setup: SchedulerSetup,
    seed: int,
    num_requests: int,
    max_steps: int = 5000,
    max_tokens_hi: int = 400,
    batch_queue: int = 1,
    prompt_fn: Callable[[random.Random, list[list[int]], list[list[int]]], list[int]] | None = None,
) -> dict[str, Any]:
    """Returns the per-step digests, events and counters of one run.

    ``batch_queue`` > 1 overlaps steps as vLLM's engine core does with async scheduling
    (``step_with_batch_queue``): the next step is scheduled before the previous step's
    output is processed, so outputs arrive with tokens still in flight. Each step's model
    output is made when it is scheduled. With speculative decoding (``SpecSchedulerSetup``)
    outputs carry accepted drafts, and in sync scheduling the proposer's drafts are handed
    to the scheduler after each step (``update_draft_token_ids``), as the engine core does.

    ``prompt_fn(rng, prefixes, earlier_prompts)`` draws each prompt instead of the default
    (a shared prefix plus unique tokens, or unique tokens)."""
    spec_k = getattr(setup, "num_spec_tokens", 0)
    assert batch_queue == 1 or setup.async_scheduling
    rng = random.Random(seed)
    sched = setup.build()
    lookahead = getattr(sched, "num_hash_lookahead_tokens", 0)
    if lookahead:
        # The engine core hashes requests with the lookahead (vLLM 0.33).
        vc = sched.vllm_config
        sched._hybrid_alloc_block_hasher = get_request_block_hasher(  # type: ignore[attr-defined]
            sched.hash_block_size, get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo), lookahead
        )
    mgr = sched.kv_cache_manager
    events = capture_events(mgr)
    lookups = count_lookups(mgr)
    cache_calls, cache_args = record_cache_blocks(mgr)
    mml = setup.shape.max_model_len
    prefixes = shared_prefixes(rng)
    pending = []
    prompts: list[list[int]] = []
    for i in range(num_requests):
        if prompt_fn is not None:
            toks = prompt_fn(rng, prefixes, prompts)
        else:
            toks = list(prefixes[rng.randrange(4)]) if rng.random() < 0.7 else []
            toks += [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 900))]
        toks = toks[: mml - 200]
        prompts.append(toks)
        pending.append((rng.randrange(0, 40), f"req{i}", toks, rng.randrange(1, max_tokens_hi)))
    pending.sort(key=lambda p: p[0])
    steps: list[dict[str, Any]] = []
    usage: list[float] = []
    preemptions = 0
    aborted: list[str] = []
    counters = {"drafts": 0, "accepted": 0, "overlapped": 0}
    in_flight: deque[tuple[Any, Any]] = deque()
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
        d["spec"] = {r: len(t) for r, t in so.scheduled_spec_decode_tokens.items()}
        preemptions += len(d["preempted"])
        steps.append(d)
        out = fabricate_spec_output(sched, so) if spec_k else fabricate_output(sched, so)
        for rid, t in so.scheduled_spec_decode_tokens.items():
            counters["drafts"] += len(t)
            i = out.req_ids.index(rid)
            counters["accepted"] += max(len(out.sampled_token_ids[i]) - 1, 0)
        in_flight.appendleft((so, out))
        step += 1
        executed = so.total_num_scheduled_tokens > 0
        if len(in_flight) < batch_queue and (executed or sched.has_requests()):
            continue
        if len(in_flight) > 1:
            counters["overlapped"] += 1
        done_so, done_out = in_flight.pop()
        sched.update_from_output(done_so, done_out)
        if spec_k and not setup.async_scheduling:
            sched.update_draft_token_ids(fabricate_drafts(sched, done_so, spec_k))
        usage.append(sched.kv_cache_manager.usage)
    while in_flight:  # outputs of steps that scheduled nothing
        done_so, done_out = in_flight.pop()
        sched.update_from_output(done_so, done_out)
        usage.append(sched.kv_cache_manager.usage)
    return {
        **counters,
        **cache_calls,
        "cache_blocks_calls": cache_args,
        "lookahead": lookahead,
        "prefill_lookahead": getattr(sched, "num_prefill_lookahead", 0),
        "use_eagle": getattr(sched.kv_cache_manager, "use_eagle", None),
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


def assert_same_run(case: str, ref: dict[str, Any], ours: dict[str, Any]) -> None:
    """vLLM's own manager (``ref``) and ours ran the same workload identically: ours served
    it natively, both finished, and every step's SchedulerOutput, the KV events, the usage
    and the prefix-cache counters are the same."""
    assert ref["native"] == "KVCacheManager"
    assert ours["native"] == "HybridKVCacheManager"
    assert ref["finished"] and ours["finished"]
    assert len(ref["steps"]) == len(ours["steps"])
    for i, (a, b) in enumerate(zip(ref["steps"], ours["steps"])):
        assert a == b, f"{case}: SchedulerOutput differs at step {i}"
    assert ref["events"] == ours["events"], f"{case}: KV events differ"
    assert ref["usage"] == ours["usage"]
    assert (ref["hits"], ref["queries"]) == (ours["hits"], ours["queries"])
    assert ref["cache_blocks_calls"] == ours["cache_blocks_calls"], f"{case}: the scheduler's cache_blocks calls differ"


def capture_events(mgr: Any) -> list[Any]:
    """Wraps ``mgr.take_events`` so that every event it hands the scheduler is also appended to
    the list returned (the run's whole event stream, in order)."""
    events: list[Any] = []
    orig_take = mgr.take_events

    def take_events() -> list[Any]:
        evs = orig_take()
        events.extend(evs)
        return evs

    mgr.take_events = take_events
    return events


def record_cache_blocks(mgr: Any) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """Wraps ``mgr.cache_blocks`` to record the scheduler's calls (``update_from_output`` with
    speculative decoding, async scheduling, or, on vLLM 0.34, Mamba hybrids in sync
    scheduling): how many, how many while a later step's tokens were in flight, and each call
    as (request, tokens), in order."""
    cache_calls = {"cache_blocks": 0, "cache_blocks_in_flight": 0}
    cache_args: list[tuple[str, int]] = []
    orig_cache_blocks = mgr.cache_blocks

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        cache_calls["cache_blocks"] += 1
        cache_calls["cache_blocks_in_flight"] += request.num_in_flight_tokens > 0
        cache_args.append((request.request_id, num_computed_tokens))
        orig_cache_blocks(request, num_computed_tokens)

    mgr.cache_blocks = cache_blocks
    return cache_calls, cache_args


def count_lookups(mgr: Any) -> dict[str, int]:
    """Wraps ``mgr.record_prefix_cache_stats`` to add up the hits and the tokens looked up (the
    scheduler records each lookup there); returns the counters it updates."""
    lookups = {"hits": 0, "queries": 0}
    orig_record = mgr.record_prefix_cache_stats

    def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
        lookups["hits"] += num_hits
        lookups["queries"] += request.num_tokens
        orig_record(request, num_hits)

    mgr.record_prefix_cache_stats = record_prefix_cache_stats
    return lookups


def run_serving_workload(
    setup: SchedulerSetup,
    seed: int,
    num_requests: int,
    concurrency: int,
    max_steps: int = 5000,
    after_step: Any = None,
) -> dict[str, Any]:
    """A serving-shaped run: ``concurrency`` requests are in the system (waiting or running)
    from the start, and each one that finishes or is aborted is replaced by the next arrival,
    until ``num_requests`` have arrived. Most prompts start with one of a few shared prefixes
    (so some waiting requests have a cached prefix and others do not), the rest are unique.
    With more requests in the system than ``max_num_seqs`` (or than the pool holds), the
    waiting queue stays deep, which is what cache-aware admission (vLLM 0.34) reorders.

    Records per step, beside :func:`run_workload`'s digest: the waiting queue's order after
    the step was scheduled, every ``get_num_cached_tokens`` answer the scheduler asked for
    (request, tokens), the free block count, and whether the admission pass reordered the
    queue. ``after_step(sched)`` runs after each step's output was processed."""
    rng = random.Random(seed)
    sched = setup.build()
    mgr = sched.kv_cache_manager
    events = capture_events(mgr)
    lookups = count_lookups(mgr)
    _, cache_args = record_cache_blocks(mgr)
    probes: list[tuple[str, int]] = []
    probe = getattr(mgr, "get_num_cached_tokens", None)
    if probe is not None:

        def get_num_cached_tokens(request: Any) -> int:
            n = probe(request)
            probes.append((request.request_id, n))
            return int(n)

        mgr.get_num_cached_tokens = get_num_cached_tokens  # type: ignore[method-assign]
    reorders = [0]
    reorder = getattr(sched, "_reorder_waiting_by_cached_prefix", None)
    if reorder is not None:

        def reorder_waiting() -> None:
            before = [r.request_id for r in sched.waiting]
            reorder()
            reorders[0] += before != [r.request_id for r in sched.waiting]

        sched._reorder_waiting_by_cached_prefix = reorder_waiting  # type: ignore[method-assign]
    mml = setup.shape.max_model_len
    prefixes = shared_prefixes(rng)
    arrivals: deque[tuple[str, list[int], int]] = deque()
    for i in range(num_requests):
        if rng.random() < 0.65:
            toks = list(prefixes[rng.randrange(4)]) + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 300))]
        else:
            toks = [rng.randrange(1, 30000) for _ in range(rng.randrange(100, 800))]
        arrivals.append((f"req{i}", toks[: mml - 400], rng.randrange(1, 300)))

    def arrive(n: int) -> None:
        for _ in range(min(n, len(arrivals))):
            rid, toks, mt = arrivals.popleft()
            sched.add_request(make_request(sched, rid, toks, mt))

    arrive(concurrency)
    steps: list[dict[str, Any]] = []
    usage: list[float] = []
    free: list[int] = []
    waiting: list[list[str]] = []
    probes_per_step: list[list[tuple[str, int]]] = []
    reordered_steps: list[int] = []
    preemptions = 0
    aborted: list[str] = []
    step = 0
    while (arrivals or sched.get_num_unfinished_requests()) and step < max_steps:
        if step % 13 == 7 and sched.requests and rng.random() < 0.5:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)
        probes.clear()
        before = reorders[0]
        so = sched.schedule()
        if reorders[0] != before:
            reordered_steps.append(step)
        probes_per_step.append(list(probes))
        waiting.append([r.request_id for r in sched.waiting])
        d = digest(so)
        preemptions += len(d["preempted"])
        steps.append(d)
        sched.update_from_output(so, fabricate_output(sched, so))
        usage.append(sched.kv_cache_manager.usage)
        free.append(sched.kv_cache_manager.block_pool.get_num_free_blocks())
        if after_step is not None:
            after_step(sched)
        arrive(concurrency - sched.get_num_unfinished_requests())
        step += 1
    return {
        "steps": steps,
        "events": events,
        "usage": usage,
        "free": free,
        "waiting": waiting,
        "probes": probes_per_step,
        "reordered_steps": reordered_steps,
        "cache_blocks_calls": cache_args,
        "hits": lookups["hits"],
        "queries": lookups["queries"],
        "preemptions": preemptions,
        "aborted": aborted,
        "native": type(sched.kv_cache_manager).__name__,
        "finished": not arrivals and not sched.get_num_unfinished_requests(),
        "num_steps": step,
    }
