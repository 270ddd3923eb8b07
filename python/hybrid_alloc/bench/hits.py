"""``hybrid-alloc bench --suite hits`` (or ``hybrid-alloc hits``): prefix-cache hits on hybrid
models, on vLLM's real ``Scheduler`` (offline, fabricated model outputs), under three
retention policies:

- ``exact``: vLLM's own manager, default retention (``prefix_cache_retention_interval=0``);
- ``dense``: vLLM's own manager with dense retention (``prefix_cache_retention_interval=None``);
- ``hit-aware``: hybrid_alloc with ``HYBRID_ALLOC_POLICY=hit-aware``.

Workloads (each at ``ample`` memory, where nothing is ever evicted, and under ``pressure``,
a pool of ``--pressure`` times the live working set of the requests in flight; by default 3
at ``--size full`` and, at ``--size small``, each shape's multiple in :data:`DEFAULT_PRESSURE`,
where the pool evicts):

- ``chat``: sessions share a system prompt and take turns; every turn re-sends the whole
  conversation (the earlier replies included) plus a new message; a fixed number of turns
  are in flight, round-robin over the sessions.
- ``shared``: a few long system prompts serve many requests, each with a unique suffix.
- ``resend``: distinct long contexts re-sent round-robin with short new suffixes (the shape
  of vLLM issue #48435).
- ``sightings``: one system prompt with unique suffixes, strictly one request after another
  (nothing else in flight), reporting the hit of each sighting (``extra["hits"]``); ample
  memory only. Policy ``pinned`` (this workload only) is hit-aware with the system prompt in
  ``HYBRID_ALLOC_PIN_PREFIXES``.

Shapes: ``gemma3`` (sliding window 1024, five window layers per full one) and ``gptoss``
(window 128, alternating), block size 16; ``qwen35`` (Qwen3-Next / 3.5 / 3.6: three Gated
DeltaNet layers per full-attention one) and ``nemotronh`` (Nemotron-H 8B: Mamba2 with its
prefill checkpoint block), both Mamba "align" at the attention block size vLLM picks for them
on a Hopper GPU (544 and 1040 tokens: :func:`hybrid_alloc.bench.shapes.hopper_block_size`;
the shapes live in the one registry, :mod:`hybrid_alloc.bench.shapes`).

Issue 30 (asked for by name; not in the default run): shapes ``qwen3next`` (576-token
blocks), ``qwen36`` (1088) and ``nemotron3nano`` (2096), vLLM 0.34's Hopper block sizes for
Qwen3-Next-80B-A3B, Qwen3.6-35B-A3B and Nemotron-3-Nano-30B-A3B; workload ``sysprompt`` (a few
shared system prompts of 300-2000 tokens, many requests each with a unique suffix, arrivals
replacing finished requests); ``--prefix-match-unit N`` (repeatable, 0: unset) sets vLLM's
``CacheConfig.prefix_match_unit`` before the scheduler is built (checked: the scheduler's
``hash_block_size`` and ``coordinator.enable_partial_hash_hits``). With a unit, vLLM's exact
retention runs beside every policy, a hit-aware row whose manager fell back to vLLM's is
marked "(fallback)", and a unit the shape's block is not a multiple of runs at their GCD
(:func:`cell_unit`). Each row also reports the share of shared-prompt tokens hit from each
prompt's 2nd sighting on, and the blocks of the pool (vLLM's or ours) keyed inside a block (a
partial tail, or a hit-aware junction) at the end and at the peak (:class:`PartialTails`); a
second table holds them, with each row's prefill over vLLM's with the unit. The ideal is taken at the hash block (the unit when one is set).

Measured per run: the hit rate vLLM's own ``PrefixCacheStats`` reports (hits / queried
tokens of requests scheduled from the waiting queue, preempted ones excluded, as vLLM's
metric), prefill tokens computed (every scheduled token that is not a decode token, so
recomputation after preemption counts), scheduler steps, and the ideal hit rate and prefill
(every block-aligned prefix some earlier request computed, capped at ``num_tokens - 1`` as
vLLM's lookup is). ``--size small`` is the CI size; ``--size full`` the issue's.

Cache-aware admission (vLLM 0.34's ``--cache-aware-admission-window`` /
``--cache-aware-admission-threshold``): ``--admission-window N`` (repeatable; 0 is off, the
default) runs every cell once per window, each policy with the scheduler reordering the first
N waiting requests by their cached prefix (``get_num_cached_tokens``) once usage reaches
``--admission-threshold`` (vLLM's default 0.5 when not given). On a release without the
option, asking for a window is an error. The table then gains a ``window`` column, and
``extra["admission_probes"]`` counts the scheduler's probes. The window reorders only
requests that wait: with the default ``max_num_seqs`` (each workload's in-flight count) a
request waits only in the step it arrives; ``--max-num-seqs N`` (below the in-flight count)
makes the rest of the in-flight requests queue for a batch slot, as clients beyond the batch
size do in a server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hybrid_alloc.bench.common import pyplot, render_table, vllm_ready

POLICIES = ("exact", "dense", "hit-aware")
#: ``pinned``: hit-aware with the workload's ``pins`` (the sightings workload's system prompt).
ALL_POLICIES = (*POLICIES, "pinned")
WORKLOADS = ("chat", "shared", "resend", "sightings", "sysprompt")
#: The workloads and shapes a run without ``--workload`` / ``--shape`` takes (issue 30's
#: ``sysprompt`` workload and Hopper shapes are asked for by name).
DEFAULT_WORKLOADS = ("chat", "shared", "resend", "sightings")
BUDGETS = ("ample", "pressure")
SHAPE_NAMES = ("gemma3", "gptoss", "qwen35", "nemotronh", "qwen3next", "qwen36", "nemotron3nano")
DEFAULT_SHAPES = ("gemma3", "gptoss", "qwen35", "nemotronh")
#: ``--pressure`` when not given: the pressure pool is this times the live working set. The
#: full workloads evict at 3x. The small ones (CI size: 8 chat sessions of 3 turns, 4 in
#: flight) fit whole in a pool of 3x, where every pressure row equalled its ample row
#: (vLLM 0.34.0, 2026-12-03); the first multiple at which each shape's small rows differ from
#: the ample ones, with hit-aware ahead of vLLM's exact retention on chat as at the full size:
#: 0.85 for the window shapes (below the mean-length estimate: a chat's later turns are longer)
#: and 2 for the Mamba shapes (whose pool counts one state per group and request).
DEFAULT_PRESSURE: dict[str, dict[str, float]] = {
    "small": {
        "gemma3": 0.85,
        "gptoss": 0.85,
        "qwen35": 2.0,
        "nemotronh": 2.0,
        "qwen3next": 2.0,
        "qwen36": 2.0,
        "nemotron3nano": 2.0,
    },
    "full": dict.fromkeys(SHAPE_NAMES, 3.0),
}


@dataclass
class Job:
    """One request of a workload. ``parts`` builds its prompt: token lists and references
    ``("reply", job_index)`` to an earlier job's output (resolved when it is submitted)."""

    rid: str
    parts: list[Any]
    max_tokens: int
    after: int = -1  # index of a job that must have finished first (-1: none)
    #: Which shared prompt the job's prompt opens with (-1: none) and its length in tokens:
    #: the "2nd sighting" share counts the hits on them from each prompt's 2nd job on.
    shared_key: int = -1
    shared_len: int = 0


@dataclass
class Workload:
    name: str
    jobs: list[Job]
    in_flight: int
    #: Token-id prefixes policy ``pinned`` pins (``HYBRID_ALLOC_PIN_PREFIXES``).
    pins: list[list[int]] = field(default_factory=list)


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(n)]


def chat_workload(
    sessions: int,
    turns: int,
    sys_len: int,
    in_flight: int,
    seed: int = 7,
    user: tuple[int, int] = (64, 256),
    reply: tuple[int, int] = (96, 256),
) -> Workload:
    rng = random.Random(seed)
    system = _toks(rng, sys_len)
    jobs: list[Job] = []
    history: dict[int, list[Any]] = {s: [system] for s in range(sessions)}
    last: dict[int, int] = {}
    for t in range(turns):
        for s in range(sessions):
            msg = _toks(rng, rng.randint(*user))
            parts = history[s] + [msg]
            idx = len(jobs)
            jobs.append(Job(f"chat-s{s}-t{t}", parts, rng.randint(*reply), after=last.get(s, -1)))
            history[s] = parts + [("reply", idx)]
            last[s] = idx
    return Workload("chat", jobs, in_flight)


def shared_workload(
    num_prompts: int,
    prompt_len: int,
    requests: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 128,
    seed: int = 11,
) -> Workload:
    rng = random.Random(seed)
    prompts = [_toks(rng, prompt_len) for _ in range(num_prompts)]
    jobs = [
        Job(f"shared-{i}", [prompts[rng.randrange(num_prompts)], _toks(rng, rng.randint(*suffix))], out_len)
        for i in range(requests)
    ]
    return Workload("shared", jobs, in_flight)


def resend_workload(
    contexts: int,
    ctx_len: tuple[int, int],
    rounds: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 64,
    seed: int = 13,
) -> Workload:
    rng = random.Random(seed)
    ctxs = [_toks(rng, rng.randint(*ctx_len)) for _ in range(contexts)]
    jobs = [
        Job(f"resend-r{r}-c{c}", [ctxs[c], _toks(rng, rng.randint(*suffix))], out_len)
        for r in range(rounds)
        for c in range(contexts)
    ]
    return Workload("resend", jobs, in_flight)


def sightings_workload(
    sightings: int, sys_len: int, suffix: tuple[int, int], out_len: int = 32, seed: int = 17
) -> Workload:
    """One system prompt, ``sightings`` requests each with a unique suffix, one at a time."""
    rng = random.Random(seed)
    system = _toks(rng, sys_len)
    jobs = [
        Job(f"sighting-{i}", [system, _toks(rng, rng.randint(*suffix))], out_len, after=i - 1) for i in range(sightings)
    ]
    return Workload("sightings", jobs, 1, pins=[system])


def sysprompt_workload(
    num_prompts: int,
    prompt_len: tuple[int, int],
    requests: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 64,
    seed: int = 19,
) -> Workload:
    """A few shared system prompts of lengths drawn in ``prompt_len`` (none a multiple of 16,
    so none a multiple of a block or of a 64-token prefix match unit), ``requests`` requests
    each opening with one of them (drawn at random) and a unique suffix; ``in_flight`` at a
    time, each arrival replacing a finished request. The shape of issue 30: on vLLM's Hopper
    blocks of 528-2096 tokens, a system prompt shorter than a block never hits."""
    rng = random.Random(seed)
    lens = []
    for _ in range(num_prompts):
        n = rng.randint(*prompt_len)
        lens.append(n + 1 if n % 16 == 0 else n)
    prompts = [_toks(rng, n) for n in lens]
    jobs = []
    for i in range(requests):
        k = rng.randrange(num_prompts)
        jobs.append(
            Job(
                f"sysprompt-{i}",
                [prompts[k], _toks(rng, rng.randint(*suffix))],
                out_len,
                shared_key=k,
                shared_len=lens[k],
            )
        )
    return Workload("sysprompt", jobs, in_flight)


def workloads(size: str) -> list[Workload]:
    if size == "full":
        return [
            chat_workload(48, 6, 1024, 16),
            shared_workload(8, 2048, 256, (300, 800), 16),
            resend_workload(16, (5000, 6000), 4, (16, 64), 16),
            sightings_workload(6, 2500, (300, 800), out_len=64),
            sysprompt_workload(6, (300, 2000), 256, (50, 400), 16),
        ]
    return [
        chat_workload(8, 3, 1024, 4, user=(32, 96), reply=(48, 96)),
        shared_workload(2, 1024, 12, (100, 300), 4, out_len=32),
        resend_workload(4, (1500, 2000), 3, (16, 48), 4, out_len=16),
        sightings_workload(4, 2500, (300, 800), out_len=8),
        sysprompt_workload(3, (300, 2000), 16, (50, 200), 4, out_len=16),
    ]


def shapes() -> dict[str, Any]:
    """The shapes ``--shape`` takes, by those names (:data:`SHAPE_NAMES`), from the one registry
    (``gptoss`` through its alias: :data:`hybrid_alloc.bench.shapes.ALIASES`).

    # Errors
    ``KeyError`` if the registry lost a name this bench takes."""
    from hybrid_alloc.bench.shapes import by_name

    return {name: by_name(name) for name in SHAPE_NAMES}


def _window_blocks(shape: Any, bs: int) -> tuple[int, int, int]:
    """(full-attention groups, window groups, blocks a window group holds per request; one
    state for a Mamba group: the budget then comes within 4-12% of vLLM's own peak of blocks
    held by running requests, ``extra["peak_held_blocks"]``, on the Mamba shapes' chat). The
    groups as vLLM's planner makes them (``_get_kv_cache_groups_uniform_page_size``): groups
    of the smaller layer count, or of the larger one when it is under 1.5 times the smaller
    (23 Mamba2 and 6 attention layers: groups of 6, 4 Mamba groups and 1 attention group)."""
    full = sum(1 for x in shape.layers if x.kind == "full")
    local = len(shape.layers) - full
    window = max((x.window for x in shape.layers if x.kind != "full"), default=0)
    if not full or not local:
        return (1 if full else 0), (1 if local else 0), -(-window // bs) + 1
    size = max(full, local) if max(full, local) < 1.5 * min(full, local) else min(full, local)
    return -(-full // size), -(-local // size), -(-window // bs) + 1


def budget_blocks(shape: Any, wl: Workload, budget: str, pressure: float, bs: int | None = None) -> int:
    """Pool size in blocks (of the shape's block size, :func:`hybrid_alloc.bench.shapes.hopper_block_size`): ``ample``
    holds every token of every request in every group; ``pressure`` is ``pressure`` times the
    live working set (``in_flight`` requests of the mean length, window groups capped at
    their window, Mamba groups at one state)."""
    from hybrid_alloc.bench.shapes import hopper_block_size

    bs = bs or hopper_block_size(shape)
    nf, nw, wblocks = _window_blocks(shape, bs)
    lens = [sum(len(p) if isinstance(p, list) else 0 for p in j.parts) + j.max_tokens for j in wl.jobs]
    # Replies re-sent in a later prompt are not counted in ``parts``: add them.
    reply_toks = {i: wl.jobs[i].max_tokens for j in wl.jobs for p in j.parts if isinstance(p, tuple) for i in [p[1]]}
    lens = [n + sum(reply_toks[p[1]] for p in j.parts if isinstance(p, tuple)) for n, j in zip(lens, wl.jobs)]
    if budget == "ample":
        total = sum(-(-n // bs) for n in lens)
        return total * (nf + nw) + 64
    mean = sum(lens) / len(lens)
    per_req = -(-int(mean) // bs) * nf + min(-(-int(mean) // bs), wblocks) * nw
    return int(pressure * wl.in_flight * per_req) + 1


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hybrid-alloc hits",
        description="Prefix-cache hits on hybrid models under vLLM's retention (exact, dense) and hybrid_alloc's "
        "hit-aware policy, on vLLM's real scheduler; prints a table, writes JSON and a PNG plot.",
    )
    p.add_argument("--size", choices=["small", "full"], default="small", help="small (CI) or full (the issue's sizes)")
    p.add_argument(
        "--shape",
        action="append",
        choices=SHAPE_NAMES,
        help=f"repeatable; default {', '.join(DEFAULT_SHAPES)} (qwen3next, qwen36, nemotron3nano: issue 30's "
        "Hopper blocks of 576, 1088 and 2096 tokens)",
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        help=f"repeatable; default {', '.join(DEFAULT_WORKLOADS)} (sysprompt: a few shared system prompts of "
        "300-2000 tokens)",
    )
    p.add_argument(
        "--prefix-match-unit",
        action="append",
        type=int,
        metavar="N",
        help="repeatable: run each cell with vLLM's prefix_match_unit N (0: unset, the default); with a unit, "
        "exact (vLLM's manager) runs too, and a hit-aware row our plugin serves with vLLM's manager is marked "
        "(fallback)",
    )
    p.add_argument("--budget", action="append", choices=BUDGETS, help="repeatable; default both (ample, pressure)")
    p.add_argument(
        "--policy",
        action="append",
        choices=ALL_POLICIES,
        help="repeatable; default exact, dense, hit-aware (and pinned on sightings)",
    )
    p.add_argument(
        "--pressure",
        type=float,
        help="pressure pool = this times the live working set, every shape (default: 3 at --size full; at --size "
        "small, where a pool of 3x holds everything, "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_PRESSURE["small"].items())
        + ", so that the pool evicts)",
    )
    p.add_argument(
        "--admission-window",
        action="append",
        type=int,
        metavar="N",
        help="repeatable: run each cell with vLLM's cache-aware admission window N (0: off; vLLM 0.34+); default 0",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="the scheduler's running batch, below each workload's in-flight count so the rest queue "
        "(default: the in-flight count)",
    )
    p.add_argument(
        "--admission-threshold",
        type=float,
        metavar="T",
        help="the usage from which the admission window applies (vLLM's cache_aware_admission_threshold; default 0.5)",
    )
    p.add_argument("--out-dir", default=os.environ.get("HYBRID_ALLOC_BENCH_OUT", "bench-out"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--wide",
        action="store_true",
        help="print the full table (blocks, prefill tokens) as markdown, and every figure of each run as it ends "
        "(default: the main columns, fitted to the terminal, COLUMNS or 80; hits.json holds every figure either way)",
    )
    return p.parse_args(argv)


def cell_unit(shape: Any, unit: int) -> int:
    """The prefix match unit a shape's rows run with when ``unit`` is asked for (0: unset): the
    unit, or, where the shape's block is not a multiple of it (vLLM's
    ``resolve_kv_cache_block_sizes`` refuses that, and does not grow the block to fit: 2096 =
    16 x 131 takes no unit of 32 or 64), the largest unit that divides both."""
    from hybrid_alloc.bench.shapes import hopper_block_size

    return math.gcd(unit, hopper_block_size(shape)) if unit else 0


def pressure_of(args: argparse.Namespace, shape: str) -> float:
    """The pressure multiple for ``shape``: ``--pressure`` if given, else :data:`DEFAULT_PRESSURE`."""
    given = getattr(args, "pressure", None)
    return float(given) if given is not None else DEFAULT_PRESSURE[args.size][shape]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not vllm_ready():
        return 2
    windows = args.admission_window or [0]
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        print("hybrid-alloc hits: --max-num-seqs takes 1 or more", file=sys.stderr)
        return 2
    if any(w < 0 for w in windows):
        print("hybrid-alloc hits: --admission-window takes a window of 0 or more requests", file=sys.stderr)
        return 2
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION

    if (any(windows) or args.admission_threshold is not None) and not CACHE_AWARE_ADMISSION:
        print(
            "hybrid-alloc hits: this vLLM has no cache-aware admission "
            "(SchedulerConfig.cache_aware_admission_window, vLLM 0.34); drop --admission-window/--admission-threshold",
            file=sys.stderr,
        )
        return 2
    units = args.prefix_match_unit or [0]
    if any(u < 0 for u in units):
        print("hybrid-alloc hits: --prefix-match-unit takes 0 (unset) or a unit of tokens", file=sys.stderr)
        return 2
    all_shapes = shapes()
    wls = {w.name: w for w in workloads(args.size)}
    results: list[Result] = []
    for sn in args.shape or DEFAULT_SHAPES:
        for wn in args.workload or DEFAULT_WORKLOADS:
            for b in args.budget or BUDGETS:
                if wn == "sightings" and b != "ample":
                    continue  # one request at a time: nothing to pressure
                pressure = pressure_of(args, sn)
                nb = budget_blocks(all_shapes[sn], wls[wn], b, pressure)
                default = (*POLICIES, "pinned") if wls[wn].pins else POLICIES
                for asked in units:
                    unit = cell_unit(all_shapes[sn], asked)
                    if unit != asked:
                        from hybrid_alloc.bench.shapes import hopper_block_size

                        print(
                            f"hybrid-alloc hits: {sn}'s {hopper_block_size(all_shapes[sn])}-token block is not a "
                            f"multiple of prefix_match_unit {asked} (vLLM refuses it); its rows take {unit}",
                            file=sys.stderr,
                        )
                    pols = list(args.policy or default)
                    if unit and "exact" not in pols:
                        pols.insert(0, "exact")  # every row with a unit is held against vLLM's with it
                    for pol in pols:
                        if pol == "pinned" and not wls[wn].pins:
                            continue
                        for w in windows:
                            threshold = args.admission_threshold if w else None
                            r = run(
                                all_shapes[sn],
                                wls[wn],
                                pol,
                                nb,
                                admission_window=w,
                                admission_threshold=threshold,
                                max_num_seqs=args.max_num_seqs,
                                prefix_match_unit=unit or None,
                            )
                            r.budget = b
                            if b == "pressure":
                                r.extra["pressure"] = pressure
                            results.append(r)
                            progress(sn, wn, b, pol, nb, r, getattr(args, "wide", False))
    report(results, args)
    return 0


def progress(shape: str, workload: str, budget: str, policy: str, blocks: int, r: Result, wide: bool) -> None:
    """One line on stderr as each run ends: its cell and main figures, within 80 columns; with
    ``wide`` every figure (all of them are in hits.json either way)."""
    if wide:
        print(
            f"{shape:7} {workload:7} {budget:8} {policy:9} {window_label(vars(r)):10} blocks={blocks:6} "
            f"hit={r.hit_rate:.3f} ideal={r.ideal_hit_rate:.3f} prefill={r.prefill_tokens} "
            f"steps={r.steps} preempt={r.preemptions} peak_held={r.extra['peak_held_blocks']} "
            f"probes={r.extra['admission_probes']} unit={r.prefix_match_unit or '-'} fallback={r.fallback} "
            f"second={r.extra['second_sighting_share']} tails={r.extra['partial_tail_blocks']}/"
            f"{r.extra['partial_tail_blocks_peak']} ({r.seconds:.1f}s)",
            file=sys.stderr,
        )
        return
    window = f" w={window_label(vars(r))}" if r.admission_window else ""
    unit = f" unit={r.prefix_match_unit}" if r.prefix_match_unit else ""
    print(
        f"{shape:9} {workload:9} {budget:8} {policy_label(vars(r), False)}{window}{unit} hit={r.hit_rate:.3f} "
        f"ideal={r.ideal_hit_rate:.3f} ({r.seconds:.1f}s)",
        file=sys.stderr,
    )


def rows_of(results: list[Result]) -> list[dict[str, Any]]:
    rows = [dict(vars(r)) for r in results]
    for r in rows:
        extra = r.pop("extra", None) or {}
        for key in (
            "block_size",
            "admission_probes",
            "max_num_seqs",
            "peak_held_blocks",
            "pressure",
            "hash_block_size",
            "second_sighting_share",
            "partial_tail_blocks",
            "partial_tail_blocks_peak",
        ):
            if key in extra:  # every run's result has them (a row built by hand may not)
                r[key] = extra[key]
        if r["workload"] == "sightings":
            r["sighting_hits"] = extra.get("hits", [])
    return rows


def policy_label(row: dict[str, Any], units: bool) -> str:
    """A row's policy as the table shows it: "(fallback)" after a policy our plugin served with
    vLLM's manager; with ``units`` (some row set a prefix match unit) vLLM's own retentions
    named "vLLM exact" / "vLLM dense"."""
    pol = str(row["policy"])
    if row.get("fallback"):
        return f"{pol} (fallback)"
    return f"vLLM {pol}" if units and pol in ("exact", "dense") else pol


def unit_label(row: dict[str, Any]) -> str:
    return str(row.get("prefix_match_unit") or "-")


def versus_vllm_unit(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Each row's prefill over that of vLLM's exact retention with the largest prefix match
    unit of the row's cell (shape, workload, budget, window), by row index; rows of a cell
    without such a run are left out."""
    ref: dict[tuple[Any, ...], tuple[int, int]] = {}
    for r in rows:
        if r["policy"] == "exact" and r.get("prefix_match_unit") and not r.get("fallback"):
            key = (r["shape"], r["workload"], r["budget"], r.get("admission_window") or 0)
            if key not in ref or r["prefix_match_unit"] > ref[key][0]:
                ref[key] = (r["prefix_match_unit"], r["prefill_tokens"])
    out: dict[int, float] = {}
    for i, r in enumerate(rows):
        got = ref.get((r["shape"], r["workload"], r["budget"], r.get("admission_window") or 0))
        if got is not None and got[1]:
            out[i] = r["prefill_tokens"] / got[1]
    return out


def share_label(row: dict[str, Any]) -> str:
    v = row.get("second_sighting_share")
    return "-" if v is None else f"{100 * v:.1f}%"


def tails_label(row: dict[str, Any]) -> str:
    last, peak = row.get("partial_tail_blocks"), row.get("partial_tail_blocks_peak")
    return "-" if last is None else f"{last}/{peak}"


def window_label(row: dict[str, Any]) -> str:
    """A row's cache-aware admission: "off", or "N" / "N@T" (window N from usage T)."""
    w = row.get("admission_window") or 0
    if not w:
        return "off"
    t = row.get("admission_threshold")
    return str(w) if t is None else f"{w}@{t:g}"


def print_table(rows: list[dict[str, Any]], wide: bool = False) -> None:
    """The table. By default the main columns, fitted to the terminal (80 columns): the cell,
    the policy, a ``window`` column when some row ran with a cache-aware admission window, the
    hit rate, the ideal one, prefill against the ideal and the steps. With ``wide``
    (``--wide``) the full table as markdown, the pool's blocks and the prefill tokens too."""
    windows = any(r.get("admission_window") for r in rows)
    units = any(r.get("prefix_match_unit") for r in rows)
    if not wide:
        shown = [
            {
                **r,
                "policy": policy_label(r, units),
                "window": window_label(r),
                "hit": f"{100 * r['hit_rate']:.1f}%",
                "ideal": f"{100 * r['ideal_hit_rate']:.1f}%",
                "vs_ideal": f"{r['prefill_tokens'] / r['ideal_prefill_tokens']:.2f}x"
                if r["ideal_prefill_tokens"]
                else "nan",
            }
            for r in rows
        ]
        cols = [("shape", "shape", "{}"), ("workload", "workload", "{}"), ("budget", "budget", "{}")]
        cols += [("policy", "policy", "{}")] + ([("window", "window", "{}")] if windows else [])
        cols += [
            ("hit", "hit rate", "{}"),
            ("ideal", "ideal", "{}"),
            ("vs_ideal", "prefill", "{}"),
            ("steps", "steps", "{}"),
        ]
        render_table(
            "prefix-cache hits (prefill: tokens computed over the ideal's)",
            cols,
            shown,
            "pool blocks and prefill tokens: --wide, or hits.json",
        )
    else:
        head = "| shape | workload | budget | blocks | policy |" + (" window |" if windows else "")
        head += " hit rate | ideal | prefill tokens | vs ideal | steps |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for r in rows:
            ratio = r["prefill_tokens"] / r["ideal_prefill_tokens"] if r["ideal_prefill_tokens"] else float("nan")
            window = f" {window_label(r)} |" if windows else ""
            print(
                f"| {r['shape']} | {r['workload']} | {r['budget']} | {r['num_blocks']} | {policy_label(r, units)} |{window} "
                f"{100 * r['hit_rate']:.1f}% | {100 * r['ideal_hit_rate']:.1f}% | {r['prefill_tokens']} | {ratio:.2f}x | "
                f"{r['steps']} |"
            )
    sight = [r for r in rows if r.get("sighting_hits")]
    if sight:
        print("\n| shape | block | policy | hit tokens per sighting (1st, 2nd, ...) |")
        print("|---|---|---|---|")
        for r in sight:
            print(f"| {r['shape']} | {r['block_size']} | {r['policy']} | {' / '.join(map(str, r['sighting_hits']))} |")
    if units or any(r.get("second_sighting_share") is not None for r in rows):
        print_unit_table(rows)


def print_unit_table(rows: list[dict[str, Any]]) -> None:
    """Issue 30's table (markdown): each row with its prefix match unit ("-": unset), hit rate
    and prefill tokens, its prefill over vLLM's exact retention with the unit set in the same
    cell ("vs vLLM+unit"), the share of shared-prompt tokens hit from each prompt's 2nd
    sighting on, and the blocks holding a partial-tail key at the end / at the peak ("-" for
    our native pool, which holds none)."""
    units = any(r.get("prefix_match_unit") for r in rows)
    versus = versus_vllm_unit(rows)
    windows = any(r.get("admission_window") for r in rows)
    print("\n| shape | block | workload | budget | policy |" + (" window |" if windows else ""), end="")
    print(" unit | hit rate | prefill tokens | vs vLLM+unit | 2nd-sighting share | partial tails end/peak |")
    print("|---|---|---|---|---|" + ("---|" if windows else "") + "---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        window = f" {window_label(r)} |" if windows else ""
        vs = f"{versus[i]:.3f}x" if i in versus else "-"
        print(
            f"| {r['shape']} | {r.get('block_size', '')} | {r['workload']} | {r['budget']} | "
            f"{policy_label(r, units)} |{window} {unit_label(r)} | {100 * r['hit_rate']:.1f}% | "
            f"{r['prefill_tokens']} | {vs} | {share_label(r)} | {tails_label(r)} |"
        )


def report(results: list[Result], args: argparse.Namespace) -> None:
    rows = rows_of(results)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "hits.json")
    with open(path, "w") as f:
        given = getattr(args, "pressure", None)
        head = {"size": args.size, "pressure": given if given is not None else DEFAULT_PRESSURE[args.size]}
        if getattr(args, "max_num_seqs", None) is not None:
            head["max_num_seqs"] = args.max_num_seqs
        json.dump({**head, "results": rows}, f, indent=1)
    print_table(rows, getattr(args, "wide", False))
    print(f"\nJSON: {path}")
    if not args.no_plot:
        ppath = os.path.join(args.out_dir, "hits.png")
        if plot(rows, ppath):
            print(f"plot: {ppath}")


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Writes the PNG to ``path``; False (nothing written, one line on stderr) when matplotlib
    is not installed. A grid of small panels, one per shape (rows) and workload (columns): in
    each, the budgets side by side, a bar per policy (and admission window) and a black tick
    at the ideal hit rate; one legend for the whole figure."""
    plt = pyplot()
    if plt is None:
        return False
    windows = any(r.get("admission_window") for r in rows)

    def series(r: dict[str, Any]) -> str:
        return f"{r['policy']} window {window_label(r)}" if windows else str(r["policy"])

    order = {p: i for i, p in enumerate(ALL_POLICIES)}
    pols = sorted({series(r) for r in rows}, key=lambda s: (order.get(s.split()[0], len(order)), s))
    shape_order = {n: i for i, n in enumerate(SHAPE_NAMES)}
    workload_order = {n: i for i, n in enumerate(WORKLOADS)}
    shapes_ = sorted({r["shape"] for r in rows}, key=lambda n: (shape_order.get(n, len(shape_order)), n))
    workloads_ = sorted({r["workload"] for r in rows}, key=lambda n: (workload_order.get(n, len(workload_order)), n))
    nrows, ncols = max(len(shapes_), 1), max(len(workloads_), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols + 0.6, 2.8 * nrows + 1.0), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, Any] = {}
    for a, shape in enumerate(shapes_):
        for b, workload in enumerate(workloads_):
            ax = axes[a][b]
            cell = [r for r in rows if r["shape"] == shape and r["workload"] == workload]
            budgets = [x for x in BUDGETS if any(r["budget"] == x for r in cell)]
            if not cell:
                ax.set_axis_off()
                continue
            width = 0.8 / max(len(pols), 1)
            for k, pol in enumerate(pols):
                ys = []
                for budget in budgets:
                    r = next((r for r in cell if r["budget"] == budget and series(r) == pol), None)
                    ys.append(100 * r["hit_rate"] if r else 0)
                bars = ax.bar(
                    [i - 0.4 + (k + 0.5) * width for i in range(len(budgets))],
                    ys,
                    width,
                    color=colors[k % len(colors)],
                    label=pol,
                )
                handles.setdefault(pol, bars)
            for i, budget in enumerate(budgets):
                r = next(r for r in cell if r["budget"] == budget)
                tick = ax.hlines(100 * r["ideal_hit_rate"], i - 0.45, i + 0.45, color="black", linewidth=2)
                handles.setdefault("ideal", tick)
            ax.set_xticks(range(len(budgets)))
            ax.set_xticklabels(budgets, fontsize=9)
            ax.set_ylim(0, 100)
            ax.grid(True, axis="y", alpha=0.3)
            ax.set_title(f"{shape} / {workload}", fontsize=10)
            if b == 0:
                ax.set_ylabel("hit rate (%)", fontsize=9)
    fig.suptitle("Prefix-cache hits on hybrid models: vLLM exact / dense retention vs hybrid_alloc hit-aware")
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="upper center",
        ncol=len(handles),
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.965),
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=90)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
