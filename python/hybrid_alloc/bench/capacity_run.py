"""One run of the capacity bench (issue 37): a closed-loop trace on one model shape under one
KV cache manager, on vLLM's real ``Scheduler`` (offline, fabricated model outputs:
:mod:`hybrid_alloc.bench.offline`, imported when a run starts), and what it measured.

| name | holds |
|---|---|
| ``MANAGERS`` | the columns: ``vllm`` (vLLM's manager), ``ours`` (hybrid_alloc, exact), ``two-level`` (ours with two-level pages) |
| ``Trace``, ``trace_requests`` | a closed-loop trace (clients, prompt and output ranges) and its requests, the same for every manager |
| ``Result`` | one run's figures and its per-step series |
| ``run`` | runs one trace on one shape under one manager |

Equal memory: vLLM's own planner sizes the pool from the same byte budget for every column;
the ``two-level`` column reshapes that plan (:func:`hybrid_alloc.vllm.pages.two_level_kv_cache_config`:
the same tensors, the same pages, fewer where the state page is padded). That column turns
the recording of new blocks for the workers' zeroing off (:func:`without_zeroing`: every
release marks Mamba hybrids for it; the core does not serve it with two-level pages yet, and
nothing the scheduler decides reads it).

What a run measures (the window: from the step at which half as many requests have finished
as there are clients to the step at which the first client has none left to send, so neither
the synchronized first wave nor the drain counts; a trace too short for one is measured over
every step with requests running):

- ``mean_running``, ``mean_waiting``: the scheduler's running and waiting requests, per step;
- ``preemptions``: every preemption of the run;
- ``prefill_tokens``: the tokens scheduled over the whole run minus the decode tokens (each
  request's outputs but the first): prompts, recomputation after preemption, less hits;
- ``pages_per_request``: used pages (the pool less its free pages: vLLM's usage) over running
  requests, per step; ``capacity``: the pool's pages over that;
- ``trapped_pages``: free attention slots inside pages in use (two-level only), as pages:
  ``(P - 1) * (page usage - usage)``, the fragmentation; 0 for the other columns.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from hybrid_alloc.bench.common import env_set

MANAGERS = ("vllm", "ours", "two-level")


@dataclass(frozen=True)
class Trace:
    """A closed-loop trace: ``clients`` each send ``per_client`` requests one after another
    (the next when the last finishes); prompts log-uniform in ``prompt`` tokens, outputs
    uniform in ``output`` tokens, random token ids (no shared prefix)."""

    name: str
    clients: int
    per_client: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    seed: int = 0


def trace_requests(t: Trace) -> list[list[tuple[list[int], int]]]:
    """Each client's requests in order: (prompt tokens, max tokens)."""
    rng = random.Random(t.seed)
    lo, hi = math.log(t.prompt[0]), math.log(t.prompt[1])
    out: list[list[tuple[list[int], int]]] = []
    for _ in range(t.clients):
        reqs = []
        for _ in range(t.per_client):
            n = round(math.exp(rng.uniform(lo, hi)))
            reqs.append(([rng.randrange(1, 30000) for _ in range(n)], rng.randint(*t.output)))
        out.append(reqs)
    return out


@dataclass
class Result:
    shape: str
    trace: str
    manager: str
    pool_pages: int
    block_size: int
    slots_per_page: int
    mean_running: float
    mean_waiting: float
    preemptions: int
    prefill_tokens: int
    pages_per_request: float
    capacity: float
    trapped_pages: float
    steps: int
    window: tuple[int, int]
    finished: bool
    seconds: float
    #: Running requests per step (the whole run), for the plot.
    running: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("running", "extra")}
        d.update(self.extra)
        return d


class _Capture(logging.Handler):
    """Keeps the adapter's warning lines (its fallback reason) while a scheduler is built."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _NoZeroing:
    """Mixed in over a ``KVCacheConfig`` class whose ``needs_kv_cache_zeroing`` is a property
    (vLLM 0.32, 0.33): reads False."""

    needs_kv_cache_zeroing = False


def without_zeroing(kvc: Any) -> Any:
    """``kvc`` with ``needs_kv_cache_zeroing`` off. Every supported vLLM marks a Mamba hybrid's
    configuration for zeroing new blocks (``has_mamba_layers``: a field set after construction
    on 0.34, a property on 0.32/0.33), and the core does not record slots for it yet (it refuses
    zeroing with two-level pages). The scheduler only forwards those ids to the workers
    (``_get_new_block_ids_to_zero``, and a connector's failed load): nothing it schedules
    depends on them, so the bench's two-level column turns the recording off."""
    if not getattr(kvc, "needs_kv_cache_zeroing", False):
        return kvc
    if isinstance(getattr(type(kvc), "needs_kv_cache_zeroing", None), property):
        kvc.__class__ = type(f"{type(kvc).__name__}WithoutZeroing", (_NoZeroing, type(kvc)), {})
    else:
        kvc.needs_kv_cache_zeroing = False
    return kvc


def build(
    shape: Any, manager: str, budget_bytes: int, max_num_seqs: int, small: int, headroom: int | None = None
) -> Any:
    """vLLM's Scheduler for ``shape`` over a pool of ``budget_bytes`` planned by vLLM's
    planner, with the column's manager (two-level: ``headroom`` slots per running request
    kept free at admission, None for the layout's default). ``RuntimeError`` when ours is
    asked for and the plugin fell back to vLLM's (the adapter's reason in the message)."""
    from hybrid_alloc.bench.offline import SchedulerSetup

    setup = SchedulerSetup(
        shape,
        manager="vllm" if manager == "vllm" else "hybrid_alloc",
        kv_budget_bytes=budget_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
    )
    return build_setup(setup, small if manager == "two-level" else None, manager, headroom)


def build_setup(
    setup: Any, small: int | None, label: str = "two-level", headroom: int | None = None, policy: str = "exact"
) -> Any:
    """The Scheduler of ``setup`` (an ``offline.SchedulerSetup``) under ``policy`` (the exact
    one unless told: the content oracle runs hit-aware too); with
    ``small``, ours over the two-level form of vLLM's plan at ``small``-token attention blocks
    (:func:`hybrid_alloc.vllm.pages.two_level_kv_cache_config` on the plan ``setup`` makes,
    the same bytes: ``num_blocks`` or ``kv_budget_bytes`` size vLLM's plan first), the
    scheduler's cache config and hit alignment as the engine side would set them, and
    :func:`without_zeroing`. Shared by the capacity bench and the serve bench's ``two_level``
    row. ``RuntimeError`` (naming ``label``) when ours is asked for and the plugin fell back to
    vLLM's (the adapter's reason in the message)."""
    from hybrid_alloc.bench.offline import SchedulerSetup
    from hybrid_alloc.vllm import pages

    if small is not None:
        size = small  # an int in the method below

        class TwoLevelSetup(SchedulerSetup):
            def kv_cache_config(self, vc: Any) -> Any:
                kvc = pages.two_level_kv_cache_config(super().kv_cache_config(vc), size)
                pages.scheduler_cache_config(vc.cache_config, kvc)
                return without_zeroing(kvc)

        setup = TwoLevelSetup(**{f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)})
    env = {
        "HYBRID_ALLOC_POLICY": policy,
        pages.PAGES_ENV: "two-level" if small is not None else None,
        pages.SMALL_BLOCK_ENV: str(small) if small is not None else None,
        pages.HEADROOM_ENV: str(headroom) if small is not None and headroom is not None else None,
    }
    log = logging.getLogger("vllm.hybrid_alloc")
    cap, level = _Capture(), log.level
    log.addHandler(cap)
    log.setLevel(logging.WARNING)
    try:
        with env_set(env):
            sched = setup.build()
    finally:
        log.removeHandler(cap)
        log.setLevel(level)
    mgr = sched.kv_cache_manager
    if setup.manager != "vllm" and getattr(mgr, "_alloc", None) is None:
        raise RuntimeError(f"{label}: the plugin fell back to vLLM's manager: {'; '.join(cap.lines) or '?'}")
    kvc = mgr.kv_cache_config
    unit = pages.prefix_match_unit(sched.vllm_config)
    if (align := pages.cache_hit_alignment_tokens(kvc, sched.block_size, unit)) is not None:
        # What the workers would read (vLLM's resolver gave the hash block): the manager's.
        assert not mgr.coordinator.enable_partial_hash_hits, "two-level pages with partial hash hits"
        kvc.cache_hit_alignment_tokens = align
    return sched


def run(
    shape: Any,
    trace: Trace,
    manager: str,
    budget_bytes: int,
    *,
    small: int = 64,
    headroom: int | None = None,
    max_steps: int = 200000,
) -> Result:
    """``trace`` on ``shape`` under ``manager`` (one of :data:`MANAGERS`) with a pool of
    ``budget_bytes`` (planned by vLLM's planner; the two-level column reshapes that plan at
    ``small``-token attention blocks, with ``headroom`` slots per running request kept free
    at admission, None for the layout's default)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from hybrid_alloc.bench.offline import fabricate_output, make_request
    from hybrid_alloc.vllm.pages import slots_per_page

    sched = build(shape, manager, budget_bytes, trace.clients, small, headroom)
    mgr = sched.kv_cache_manager
    kvc = mgr.kv_cache_config
    pool = kvc.num_blocks - 1  # the null page is never handed out
    k = slots_per_page(kvc) or 1
    attn = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    todo = trace_requests(trace)
    nxt = [0] * trace.clients  # each client's next request
    live: dict[str, tuple[int, Any]] = {}  # request id -> (client, Request)
    finished = 0
    warm = False  # past the first wave: half as many requests finished as there are clients
    drain_from: int | None = None
    reqs: list[Any] = []

    def submit(c: int) -> None:
        nonlocal drain_from
        if nxt[c] >= trace.per_client:
            if drain_from is None:
                drain_from = steps
            return
        prompt, out = todo[c][nxt[c]]
        rid = f"c{c}-{nxt[c]}"
        nxt[c] += 1
        r = make_request(sched, rid, prompt, out)
        reqs.append(r)
        live[rid] = (c, r)
        sched.add_request(r)

    steps = scheduled = 0
    running_series: list[int] = []
    # (running, waiting, used pages, trapped pages) per step with requests running: in the
    # window, and in the whole run (measured when the window is empty).
    win: list[tuple[int, int, int, float]] = []
    whole: list[tuple[int, int, int, float]] = []
    win_start = 0
    t0 = time.perf_counter()
    for c in range(trace.clients):
        submit(c)
    while live and steps < max_steps:
        so = sched.schedule()
        scheduled += sum(so.num_scheduled_tokens.values())
        sched.update_from_output(so, fabricate_output(sched, so))
        steps += 1
        running = len(sched.running)
        running_series.append(running)
        if running:
            free = mgr.block_pool.get_num_free_blocks()
            used = pool - free
            trapped = max(0.0, pool * (1.0 - free / pool - mgr.usage)) if k > 1 else 0.0
            sample = (running, len(sched.waiting), used, trapped)
            whole.append(sample)
            if warm and drain_from is None:
                win.append(sample)
        for rid, (c, r) in list(live.items()):
            if r.is_finished():
                del live[rid]
                finished += 1
                if 2 * finished >= trace.clients and not warm:
                    warm = True
                    win_start = steps
                submit(c)
    decode = sum(max(len(r.output_token_ids) - 1, 0) for r in reqs)
    window = (win_start, win_start + len(win)) if win else (0, steps)
    if not win:  # a trace too short for a steady state: every step with requests running
        win = whole
    n = len(win) or 1
    ppr = sum(u / r for r, _, u, _ in win) / n if win else 0.0
    return Result(
        shape=shape.name,
        trace=trace.name,
        manager=manager,
        pool_pages=kvc.num_blocks,
        block_size=min(attn) if attn else 0,
        slots_per_page=k,
        mean_running=sum(w[0] for w in win) / n,
        mean_waiting=sum(w[1] for w in win) / n,
        preemptions=sum(getattr(r, "num_preemptions", 0) for r in reqs),
        prefill_tokens=scheduled - decode,
        pages_per_request=ppr,
        capacity=pool / ppr if ppr else 0.0,
        trapped_pages=sum(w[3] for w in win) / n,
        steps=steps,
        window=window,
        finished=not live,
        seconds=time.perf_counter() - t0,
        running=running_series,
        extra={
            "hash_block_size": sched.hash_block_size,
            "scheduler_block_size": sched.block_size,
            "cache_hit_alignment_tokens": kvc.cache_hit_alignment_tokens,
        },
    )
