"""One cell of the hits bench: a workload on a shape under one retention policy, on vLLM's
real ``Scheduler`` (offline, fabricated model outputs: :mod:`hybrid_alloc.bench.offline`,
imported when a cell runs), and what it measured.

| name | holds |
|---|---|
| ``POLICIES``, ``ALL_POLICIES`` | the retention policies a cell runs under |
| ``Result`` | one cell's figures (``extra``: the per-sighting hits, the block size, the peak held, ...) |
| ``run`` | runs one cell |
| ``second_sighting_share`` | the share of shared-prompt tokens hit from each prompt's 2nd sighting on |
| ``PartialTails`` | counts the pool's blocks keyed inside a block, after each step |

Policies:

- ``exact``: vLLM's own manager, default retention (``prefix_cache_retention_interval=0``);
- ``dense``: vLLM's own manager with dense retention (``prefix_cache_retention_interval=None``);
- ``hit-aware``: hybrid_alloc with ``HYBRID_ALLOC_POLICY=hit-aware``;
- ``pinned`` (workloads with ``pins`` only): hit-aware with the pins in ``HYBRID_ALLOC_PIN_PREFIXES``.

Measured per run: the hit rate vLLM's own ``PrefixCacheStats`` reports (hits / queried
tokens of requests scheduled from the waiting queue, preempted ones excluded, as vLLM's
metric), prefill tokens computed (every scheduled token that is not a decode token, so
recomputation after preemption counts), scheduler steps, and the ideal hit rate and prefill
(every block-aligned prefix some earlier request computed, capped at ``num_tokens - 1`` as
vLLM's lookup is). The ideal is taken at the hash block (the unit when one is set). Each run
also reports the share of shared-prompt tokens hit from each prompt's 2nd sighting on, and the
blocks of the pool (vLLM's or ours) keyed inside a block (a partial tail, or a hit-aware
junction) at the end and at the peak (:class:`PartialTails`).

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

from hybrid_alloc.bench.hits_workloads import Workload

POLICIES = ("exact", "dense", "hit-aware")
#: ``pinned``: hit-aware with the workload's ``pins`` (the sightings workload's system prompt).
ALL_POLICIES = (*POLICIES, "pinned")


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
    vLLM's exact retention, not ours."""
    from hybrid_alloc.bench.offline import SchedulerSetup, fabricate_output, make_request

    class Setup(SchedulerSetup):
        def vllm_config(self) -> Any:
            vc = super().vllm_config()
            if policy == "dense":
                vc.cache_config.prefix_cache_retention_interval = None
            return vc

    aware = policy in ("hit-aware", "pinned")
    if policy == "pinned" and not wl.pins:
        raise ValueError(f"policy 'pinned' needs a workload with prefixes to pin ({wl.name} has none)")
    manager = "hybrid_alloc" if aware else "vllm"
    env = {"HYBRID_ALLOC_POLICY": "hit-aware" if aware else "exact", "HYBRID_ALLOC_PIN_PREFIXES": None}
    tmp = None
    if policy == "pinned":
        import tempfile

        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(wl.pins, tmp)
        tmp.close()
        env["HYBRID_ALLOC_PIN_PREFIXES"] = tmp.name
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        setup = Setup(
            shape,
            manager=manager,  # type: ignore[arg-type]
            num_blocks=num_blocks,
            max_num_seqs=max(min(wl.in_flight, max_num_seqs or wl.in_flight), 1),
            max_num_batched_tokens=8192,
            admission_window=admission_window,
            admission_threshold=admission_threshold,
            prefix_match_unit=prefix_match_unit,
        )
        sched = setup.build()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
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
    ideal_hits = ideal_queries = prompt_total = 0
    scheduled = 0
    decode_tokens = 0
    steps = 0
    peak_held = 0  # blocks held by running requests (vLLM's usage), at its peak
    t0 = time.perf_counter()

    def submit() -> None:
        nonlocal nxt, ideal_hits, ideal_queries, prompt_total
        while len(running) < wl.in_flight and nxt < len(wl.jobs):
            job = wl.jobs[nxt]
            if job.after >= 0 and job.after not in done:
                return
            toks: list[int] = []
            for p in job.parts:
                toks += list(reqs[p[1]].output_token_ids) if isinstance(p, tuple) else p
            r = make_request(sched, job.rid, toks, job.max_tokens)
            ideal_hits += ideal_hit(toks)
            ideal_queries += len(toks)
            prompt_total += len(toks)
            add_known(toks, len(toks))  # its prompt is computed from now on (in flight)
            reqs[nxt] = r
            running.add(nxt)
            sched.add_request(r)
            nxt += 1

    submit()
    while (running or nxt < len(wl.jobs)) and steps < max_steps:
        so = sched.schedule()
        scheduled += sum(so.num_scheduled_tokens.values())
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
        peak_held = max(peak_held, round(mgr.usage * (num_blocks - 1)))
        tails.count()
        for i in list(running):
            r = reqs[i]
            if r.is_finished():
                running.discard(i)
                done.add(i)
                decode_tokens += max(len(r.output_token_ids) - 1, 0)
                # Everything but the last sampled token was computed.
                add_known(list(r.all_token_ids), r.num_tokens - 1)
        submit()
    prefill = scheduled - decode_tokens
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
        finished=not running and nxt == len(wl.jobs),
        seconds=time.perf_counter() - t0,
        extra={
            "hits": job_hits,
            "block_size": bs,
            "peak_held_blocks": peak_held,
            "admission_probes": probes[0],
            "max_num_seqs": sched.max_num_running_reqs,
            "hash_block_size": hbs,
            "second_sighting_share": second_sighting_share(wl, job_hits),
            "partial_tail_blocks": tails.last,
            "partial_tail_blocks_peak": tails.peak,
        },
        admission_window=admission_window,
        admission_threshold=admission_threshold,
        prefix_match_unit=prefix_match_unit,
        fallback=fallback,
    )


def second_sighting_share(wl: Workload, job_hits: list[int]) -> float | None:
    """Of the shared-prompt tokens of every job that is not its prompt's first (in arrival
    order), the share served from the cache (each job's hit capped at its shared prompt);
    None for a workload without shared prompts (``Job.shared_key``)."""
    seen: set[int] = set()
    shared = hit = 0
    for job, h in zip(wl.jobs, job_hits):
        if job.shared_key < 0:
            continue
        if job.shared_key in seen:
            shared += job.shared_len
            hit += min(h, job.shared_len)
        seen.add(job.shared_key)
    return hit / shared if shared else None


class PartialTails:
    """Blocks of vLLM's block pool that hold a partial-tail prefix-cache key (a block whose
    ``block_hash_num_tokens`` is not a multiple of its group's block size: vLLM's sub-block
    entries with ``prefix_match_unit`` set), counted after each step (:meth:`count`): the
    last count and the peak. Watches the pool's ``_insert_block_hash`` (every key passes
    through it, all three releases) for candidates, so a count costs O(candidates), not
    O(pool). A native manager's pool is counted by the core
    (``Allocator.num_partial_tail_blocks``, O(pool) in Rust)."""

    def __init__(self, mgr: Any) -> None:
        self.last: int | None = None
        self.peak: int | None = None
        pool: Any = getattr(mgr, "block_pool", None)
        insert = getattr(pool, "_insert_block_hash", None)
        self._native = getattr(getattr(mgr, "_alloc", None), "num_partial_tail_blocks", None)
        if self._native is not None:
            self.last = self.peak = 0
            return
        if insert is None:
            return
        from vllm.v1.core.kv_cache_utils import get_group_id

        self._group_id = get_group_id
        self._sizes = [g.kv_cache_spec.block_size for g in mgr.kv_cache_config.kv_cache_groups]
        self._candidates: dict[int, Any] = {}
        self.last = self.peak = 0

        def watched(key: Any, block: Any, num_tokens: int | None) -> None:
            insert(key, block, num_tokens)
            if num_tokens is not None and num_tokens % self._sizes[get_group_id(key)]:
                self._candidates[block.block_id] = block

        pool._insert_block_hash = watched

    def _partial(self, block: Any) -> bool:
        n = block.block_hash_num_tokens
        return block.block_hash is not None and n is not None and n % self._sizes[self._group_id(block.block_hash)] != 0

    def count(self) -> None:
        if self.last is None or self.peak is None:
            return
        if self._native is not None:
            self.last = self._native()
            self.peak = max(self.peak, self.last)
            return
        for bid in [b for b, blk in self._candidates.items() if not self._partial(blk)]:
            del self._candidates[bid]
        self.last = len(self._candidates)
        self.peak = max(self.peak, self.last)
