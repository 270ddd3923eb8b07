"""One cell of the hits bench: a workload on a shape under one retention policy, on vLLM's
real ``Scheduler`` (offline, fabricated model outputs: :mod:`hybrid_alloc.bench.offline`,
imported when a cell runs), and what it measured.

| name | holds |
|---|---|
| ``POLICIES``, ``ALL_POLICIES`` | the retention policies a cell runs under |
| ``Result`` | one cell's figures (``extra``: the per-sighting hits, the block size, the peak held, ...) |
| ``run`` | runs one cell |

What it measures beyond vLLM's stats, and the simulated clock, are in
:mod:`hybrid_alloc.bench.hits_measure`.

Policies:

- ``exact``: vLLM's own manager, default retention (``prefix_cache_retention_interval=0``);
- ``dense``: vLLM's own manager with dense retention (``prefix_cache_retention_interval=None``);
- ``hit-aware``: hybrid_alloc with ``HYBRID_ALLOC_POLICY=hit-aware``;
- ``pinned`` (workloads with ``pins`` only): hit-aware with the pins in ``HYBRID_ALLOC_PIN_PREFIXES``;
- ``retain``, ``pin``, ``checkpoint`` (workloads whose jobs carry those hints only,
  ``Workload.hint_policies``): hit-aware with each job's hints for that policy attached to its
  request as vLLM's ``KvHintsEnvelope`` (``Request.kv_hints``).

Measured per run: the hit rate vLLM's own ``PrefixCacheStats`` reports (hits / queried
tokens of requests scheduled from the waiting queue, preempted ones excluded, as vLLM's
metric), prefill tokens computed (every scheduled token that is not a decode token, so
recomputation after preemption counts), scheduler steps, and the ideal hit rate and prefill
(every block-aligned prefix some earlier request computed, capped at ``num_tokens - 1`` as
vLLM's lookup is). The ideal is taken at the hash block (the unit when one is set). Each run
also reports the share of shared-prompt tokens hit from each prompt's 2nd sighting on, and the
blocks of the pool (vLLM's or ours) keyed inside a block (a partial tail, or a hit-aware
junction) at the end and at the peak (``PartialTails``), the allocations refused and those
pins may have delayed (``Refusals``), and our manager's hint counters (received, applied,
refused, expired; the blocks pins and retains hold at the end and at the peak).

A workload with simulated time (``Workload.step_s``: the agent workload) runs on a
``SimClock``: each step lasts ``step_s[0] + step_s[1]`` per scheduled token, a job arrives
``Job.pause_s`` after the job it follows finished, the clock jumps over a wait with nothing to
schedule, and our manager reads it as its clock (``manager._clock``), so its hints' TTLs run in
simulated seconds. Its other traffic (``Workload.churn``) keeps ``churn_in_flight`` requests in
flight until the workload's own jobs are done; it counts in the hit rate, the prefill and the
ideal, not in the per-job figures. Each resumed turn's hit is reported as a share of its
previous context (``extra["resumed"]``).

Cost: a run is one scheduler build and one pass over the workload, a step at a time; the ideal
is O(prompt tokens) per request; :class:`PartialTails` is O(candidates) per step (O(pool) in
Rust for our manager).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from hybrid_alloc.bench.common import env_set
from hybrid_alloc.bench.hits_measure import (
    PartialTails,
    Refusals,
    SimClock,
    resumed_share,
    second_sighting_share,
    whole_sightings,
)
from hybrid_alloc.bench.hits_workloads import HINT_POLICIES, Job, Workload

POLICIES = ("exact", "dense", "hit-aware")
#: ``pinned``: hit-aware with the workload's ``pins`` (the sightings workload's system prompt);
#: the hint policies: hit-aware with the hints the workload's jobs carry for them.
ALL_POLICIES = (*POLICIES, "pinned", *HINT_POLICIES)


@dataclass
class Result:
    shape: str
    workload: str
    budget: str
    policy: str
    num_blocks: int
    hit_rate: float
    ideal_hit_rate: float
    prefill_tokens: int
    ideal_prefill_tokens: int
    steps: int
    preemptions: int
    finished: bool
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: The scheduler's cache-aware admission window (0: off) and threshold (None: vLLM's).
    admission_window: int = 0
    admission_threshold: float | None = None
    #: vLLM's ``prefix_match_unit`` the run set (None: unset), and whether our plugin fell
    #: back to vLLM's manager (then the row's figures are vLLM's, not ours).
    prefix_match_unit: int | None = None
    fallback: bool = False
    #: The pinned share a hit-aware row set (``HYBRID_ALLOC_PIN_SHARE``; None: the manager's, 0.25).
    pin_share: float | None = None


def run(
    shape: Any,
    wl: Workload,
    policy: str,
    num_blocks: int,
    *,
    max_steps: int = 400000,
    admission_window: int = 0,
    admission_threshold: float | None = None,
    max_num_seqs: int | None = None,
    prefix_match_unit: int | None = None,
    pin_share: float | None = None,
) -> Result:
    """One cell: ``wl`` on ``shape`` under ``policy`` with a pool of ``num_blocks``;
    ``admission_window`` / ``admission_threshold``: the scheduler's cache-aware admission
    (vLLM 0.34; ``ValueError`` on a release without it); ``max_num_seqs``: the scheduler's
    running batch (default and at most: the workload's in-flight count).

    ``prefix_match_unit``: vLLM's ``CacheConfig.prefix_match_unit``, set before the scheduler
    is built; ``RuntimeError`` unless the scheduler's ``hash_block_size`` is the unit and its
    manager's coordinator has ``enable_partial_hash_hits``. A hit-aware policy whose manager
    fell back to vLLM's (our core refuses a unit it does not serve) raises ``RuntimeError``
    without a unit and, with one, runs on and is marked ``fallback``: its figures are then
    vLLM's exact retention, not ours.

    ``pin_share``: the pinned share of the pool under a hit-aware policy
    (``HYBRID_ALLOC_PIN_SHARE``; None: the manager's default)."""
    from hybrid_alloc.bench.offline import (
        SchedulerSetup,
        fabricate_output,
        hint_counters,
        hints_envelope,
        make_request,
        pins_held,
    )

    class Setup(SchedulerSetup):
        def vllm_config(self) -> Any:
            vc = super().vllm_config()
            if policy == "dense":
                vc.cache_config.prefix_cache_retention_interval = None
            return vc

    aware = policy in ("hit-aware", "pinned", *HINT_POLICIES)
    if policy == "pinned" and not wl.pins:
        raise ValueError(f"policy 'pinned' needs a workload with prefixes to pin ({wl.name} has none)")
    if policy in HINT_POLICIES and policy not in wl.hint_policies:
        raise ValueError(f"policy {policy!r} needs a workload whose requests carry its hints ({wl.name}'s do not)")
    manager = "hybrid_alloc" if aware else "vllm"
    share = pin_share if aware else None
    env = {
        "HYBRID_ALLOC_POLICY": "hit-aware" if aware else "exact",
        "HYBRID_ALLOC_PIN_PREFIXES": None,
        "HYBRID_ALLOC_PIN_SHARE": None if share is None else repr(share),
    }
    tmp = None
    if policy == "pinned":
        import tempfile

        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(wl.pins, tmp)
        tmp.close()
        env["HYBRID_ALLOC_PIN_PREFIXES"] = tmp.name
    try:
        with env_set(env):
            setup = Setup(
                shape,
                manager=manager,  # type: ignore[arg-type]
                num_blocks=num_blocks,
                max_num_seqs=max(min(wl.in_flight, max_num_seqs or wl.in_flight), 1) + wl.churn_in_flight,
                max_num_batched_tokens=8192,
                admission_window=admission_window,
                admission_threshold=admission_threshold,
                prefix_match_unit=prefix_match_unit,
            )
            sched = setup.build()
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    mgr = sched.kv_cache_manager
    native = getattr(mgr, "_alloc", None) is not None
    fallback = False
    if aware and (not native or mgr._alloc.policy != "hit-aware"):
        if prefix_match_unit is None:
            raise RuntimeError("hit-aware is not active: the plugin fell back to vLLM's manager (see its log line)")
        fallback = True
    if prefix_match_unit is not None:
        partial = getattr(getattr(mgr, "coordinator", None), "enable_partial_hash_hits", False)
        if sched.hash_block_size != prefix_match_unit or not partial:
            raise RuntimeError(
                f"prefix_match_unit={prefix_match_unit} did not take effect: the scheduler hashes every "
                f"{sched.hash_block_size} tokens, enable_partial_hash_hits={partial}"
            )
    bs = mgr.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    # The granularity of hits (and of the ideal): the hash block, the unit when one is set.
    hbs = sched.hash_block_size
    tails = PartialTails(mgr)
    probes = [0]  # get_num_cached_tokens calls (cache-aware admission's probe)
    if admission_window:
        probe = mgr.get_num_cached_tokens

        def get_num_cached_tokens(request: Any) -> int:
            probes[0] += 1
            return int(probe(request))

        mgr.get_num_cached_tokens = get_num_cached_tokens
    sim = SimClock() if wl.step_s is not None else None
    if sim is not None and native:
        mgr._clock = sim  # the manager's TTLs run in simulated seconds
    counters_now = hint_counters(mgr)
    held_peak = pins_held(counters_now)
    refusals = Refusals(sched, mgr, lambda: pins_held(hint_counters(mgr)))
    hits = queries = 0
    known: set[int] = set()  # chained block-prefix keys some request computed

    def add_known(tokens: list[int], n: int) -> None:
        h = 0
        for i in range(n // hbs):
            h = hash((h, tuple(tokens[i * hbs : (i + 1) * hbs])))
            known.add(h)

    def ideal_hit(tokens: list[int]) -> int:
        h = 0
        best = 0
        for i in range((len(tokens) - 1) // hbs):
            h = hash((h, tuple(tokens[i * hbs : (i + 1) * hbs])))
            if h not in known:
                break
            best = (i + 1) * hbs
        return best

    reqs: dict[int, Any] = {}
    index_of: dict[str, int] = {j.rid: i for i, j in enumerate(wl.jobs)}
    job_hits = [0] * len(wl.jobs)  # tokens each job got from the cache when first scheduled
    done: set[int] = set()
    running: set[int] = set()
    nxt = 0
    pending = list(range(len(wl.jobs)))  # with simulated time: the jobs not yet arrived, in order
    finished_at: dict[int, float] = {}  # with simulated time: when each job finished
    resumed: dict[int, int] = {}  # a resumed turn -> its previous context on the hash grid
    churn: dict[str, Any] = {}  # the other traffic in flight
    churn_next = churn_prompt = 0
    churn_due = [0.0]  # when the next request of the other traffic arrives
    ideal_hits = ideal_queries = prompt_total = 0
    scheduled = 0
    decode_tokens = 0
    steps = 0
    peak_held = 0  # blocks held by running requests (vLLM's usage), at its peak
    t0 = time.perf_counter()

    def add(job: Job, known_too: bool = True) -> Any:
        nonlocal ideal_hits, ideal_queries, prompt_total
        toks: list[int] = []
        for p in job.parts:
            toks += list(reqs[p[1]].output_token_ids) if isinstance(p, tuple) else p
        actions = job.hints.get(policy)
        r = make_request(
            sched, job.rid, toks, job.max_tokens, kv_hints=hints_envelope(job.rid, actions) if actions else None
        )
        ideal_hits += ideal_hit(toks)
        ideal_queries += len(toks)
        prompt_total += len(toks)
        if known_too:
            add_known(toks, len(toks))  # its prompt is computed from now on (in flight)
        sched.add_request(r)
        return r

    def submit_job(i: int) -> None:
        job = wl.jobs[i]
        if job.resumes:  # what the previous turn computed (all but its last token), on the grid
            resumed[i] = (reqs[job.after].num_tokens - 1) // hbs * hbs
        reqs[i] = add(job)
        running.add(i)

    def arrival(i: int) -> float | None:
        """With simulated time: when job ``i`` arrives (None: the job it follows runs yet)."""
        job = wl.jobs[i]
        if job.after < 0:
            return job.pause_s
        t = finished_at.get(job.after)
        return None if t is None else t + job.pause_s

    def submit() -> None:
        nonlocal nxt, churn_next, churn_prompt
        if sim is None:  # in order: a job waits for the one it follows, and so do those behind it
            while len(running) < wl.in_flight and nxt < len(wl.jobs):
                job = wl.jobs[nxt]
                if job.after >= 0 and job.after not in done:
                    return
                submit_job(nxt)
                nxt += 1
            return
        for i in list(pending):  # in any order their arrivals allow
            if len(running) >= wl.in_flight:
                break
            t = arrival(i)
            if t is not None and t <= sim.now:
                pending.remove(i)
                submit_job(i)
        while wl.churn is not None and len(churn) < wl.churn_in_flight and (pending or running):
            if churn_due[0] > sim.now:
                break
            job = wl.churn(churn_next)
            churn_next += 1
            r = churn[job.rid] = add(job, known_too=False)  # unique: never seen again
            churn_prompt += r.num_prompt_tokens
            # The next arrives this prompt's length later at the rate (a closed loop without one).
            churn_due[0] += r.num_prompt_tokens / wl.churn_rate if wl.churn_rate else 0.0

    def left() -> bool:
        return bool(running or pending) if sim is not None else bool(running or nxt < len(wl.jobs))

    submit()
    while left() and steps < max_steps:
        if sim is not None and not sched.get_num_unfinished_requests():
            # Nothing to schedule: the clock jumps to the next arrival.
            due = [t for i in pending if (t := arrival(i)) is not None]
            due += [churn_due[0]] if wl.churn is not None else []
            if not due:
                break
            sim.now = max(sim.now, min(due))
            submit()
            continue
        so = sched.schedule()
        step_tokens = sum(so.num_scheduled_tokens.values())
        scheduled += step_tokens
        for nr in so.scheduled_new_reqs:
            if nr.req_id in index_of and reqs[index_of[nr.req_id]].num_preemptions == 0:
                job_hits[index_of[nr.req_id]] = nr.num_computed_tokens
        out = fabricate_output(sched, so)
        eco = sched.update_from_output(so, out)
        for o in eco.values():
            st = getattr(o, "scheduler_stats", None)
            pcs = getattr(st, "prefix_cache_stats", None) if st is not None else None
            if pcs is not None:
                hits += pcs.hits
                queries += pcs.queries
        steps += 1
        if sim is not None and wl.step_s is not None:
            sim.advance(wl.step_s[0] + wl.step_s[1] * step_tokens)
        peak_held = max(peak_held, round(mgr.usage * (num_blocks - 1)))
        tails.count()
        if counters_now is not None:
            counters_now = hint_counters(mgr)
            held_peak = max(held_peak, pins_held(counters_now))
        for i in list(running):
            r = reqs[i]
            if r.is_finished():
                running.discard(i)
                done.add(i)
                if sim is not None:
                    finished_at[i] = sim.now
                decode_tokens += max(len(r.output_token_ids) - 1, 0)
                # Everything but the last sampled token was computed.
                add_known(list(r.all_token_ids), r.num_tokens - 1)
        for rid, r in list(churn.items()):
            if r.is_finished():
                del churn[rid]
                decode_tokens += max(len(r.output_token_ids) - 1, 0)
        submit()
    for r in churn.values():  # the other traffic still in flight when the jobs were done
        decode_tokens += max(len(r.output_token_ids) - 1, 0)
    prefill = scheduled - decode_tokens
    extra: dict[str, Any] = {
        "hits": job_hits,
        "block_size": bs,
        "peak_held_blocks": peak_held,
        "admission_probes": probes[0],
        "max_num_seqs": sched.max_num_running_reqs,
        "hash_block_size": hbs,
        "second_sighting_share": second_sighting_share(wl, job_hits),
        "whole_sightings": whole_sightings(wl, job_hits, hbs),
        "partial_tail_blocks": tails.last,
        "partial_tail_blocks_peak": tails.peak,
        **refusals.as_dict(),
    }
    if counters_now is not None:
        extra["hint_counters"] = counters_now
        extra["hint_held_peak"] = held_peak
    if resumed:
        extra["resumed"] = resumed_share([(job_hits[i], c) for i, c in sorted(resumed.items())])
    if sim is not None:
        extra["sim_seconds"] = sim.now
        pauses = [j.pause_s for j in wl.jobs if j.resumes]
        live = sum(wl.live or [])
        if pauses and live and sim.now:
            # The other traffic's prompt tokens in a mean pause, over the live working set.
            extra["churn_per_pause"] = churn_prompt / sim.now * (sum(pauses) / len(pauses)) / live
    return Result(
        shape=shape.name,
        workload=wl.name,
        budget="",
        policy=policy,
        num_blocks=num_blocks,
        hit_rate=hits / queries if queries else 0.0,
        ideal_hit_rate=ideal_hits / ideal_queries if ideal_queries else 0.0,
        prefill_tokens=prefill,
        ideal_prefill_tokens=prompt_total - ideal_hits,
        steps=steps,
        preemptions=sum(getattr(r, "num_preemptions", 0) for r in reqs.values()),
        finished=not left(),
        seconds=time.perf_counter() - t0,
        extra=extra,
        admission_window=admission_window,
        admission_threshold=admission_threshold,
        prefix_match_unit=prefix_match_unit,
        fallback=fallback,
        pin_share=share,
    )
