"""One bench scenario on vLLM's real scheduler: :func:`run_scenario` builds the scheduler with
the named manager (``vllm``, ``hybrid_alloc``, ``no_hybrid``, or ``floor``: ours with the
decode call answered by the probe, :mod:`hybrid_alloc.bench.floor`), optionally with vLLM
0.34's cache-aware admission window, feeds it requests (optionally as a closed loop),
alternates timed and bare steps, and returns a
:class:`RunResult`. Shared by ``hybrid-alloc bench``'s scenarios (:mod:`.main`) and its
``serve`` workload (:mod:`.serve`).

Cost: the scheduler's own, plus the clock's wrappers on every other step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from hybrid_alloc.bench import floor
from hybrid_alloc.bench.clock import ManagerClock
from hybrid_alloc.bench.common import env_set


@dataclasses.dataclass
class RunResult:
    model: str
    scenario: str
    manager: str
    num_blocks: int
    block_size: int
    num_groups: int
    max_concurrency: float
    steps: int
    peak_running: int
    hit_rate: float
    kv_ns: list[float]
    step_ns: list[float]
    running: list[int]
    usage: list[float]
    finished: bool
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Requests scheduled on each measured timed step (beside ``kv_ns``) and bare step (beside
    # ``step_ns``): the plot's x axis.
    kv_running: list[int] = dataclasses.field(default_factory=list)
    step_running: list[int] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            if not xs:
                return 0.0
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        return {
            "model": self.model,
            "scenario": self.scenario,
            "manager": self.manager,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_groups": self.num_groups,
            "max_concurrency": self.max_concurrency,
            "steps": self.steps,
            "peak_running": self.peak_running,
            "hit_rate": self.hit_rate,
            "mean_usage": statistics.fmean(self.usage) if self.usage else 0.0,
            "kv_us_median": pct(self.kv_ns, 0.5) / 1e3,
            "kv_us_p99": pct(self.kv_ns, 0.99) / 1e3,
            "step_us_median": pct(self.step_ns, 0.5) / 1e3,
            "step_us_p99": pct(self.step_ns, 0.99) / 1e3,
            "finished": self.finished,
            **self.extra,
        }


def run_scenario(
    shape: Any,
    manager: str,
    scenario: str,
    requests: list[tuple[str, list[int], int]],
    *,
    num_blocks: int | None,
    kv_budget: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    measure_from_running: int = 0,
    max_steps: int = 200000,
    decode_steps: int | None = None,
    refill: Any = None,
    warmup_finished: int = 0,
    admission_window: int = 0,
    admission_threshold: float | None = None,
    policy: str | None = None,
    hints: Any = None,
    label: str | None = None,
    two_level_small: int | None = None,
) -> RunResult:
    """Runs the scheduler to the end (or for ``decode_steps`` measured steps once
    ``measure_from_running`` requests run with their prompts done). Steps alternate: on even
    steps the manager's calls and the methods called on its results are timed (KV time); odd
    steps run with no wrapper installed and give the whole step's time.

    A closed loop (``refill``, a function of the request's index returning ``(id, prompt,
    output length)``): after each step, every finished request is replaced at once by the next
    one, so that ``len(requests)`` clients are always in the scheduler; measuring starts once
    ``warmup_finished`` requests have been replaced.

    ``admission_window`` / ``admission_threshold``: the scheduler's cache-aware admission
    (vLLM 0.34's ``--cache-aware-admission-window`` / ``-threshold``; ``ValueError`` on a
    release without it, :meth:`SchedulerSetup.admission_kwargs`). The result's
    ``extra["admission_window"]`` / ``["admission_threshold"]`` are what the scheduler applies
    (its ``cache_aware_window``: 0 unless prefix caching is on and the policy is FCFS; its
    threshold, None with no window), and
    ``extra["waiting_mean"]`` / ``["waiting_p90"]`` / ``["waiting_max"]`` the waiting queue's
    depth before each measured step's ``schedule()`` (vLLM's docs ask for the smallest window
    that spans it), ``extra["probe_steps"]`` the share of timed steps in which the scheduler
    probed (``get_num_cached_tokens``: the window engages only once usage reaches the
    threshold, with two requests waiting).

    ``policy``: our manager's retention policy (``HYBRID_ALLOC_POLICY`` while the scheduler is
    built; None: the environment's). ``hints``: a function of a request's ``(id, prompt)``
    returning more arguments of ``offline.make_request`` (``kv_hints=`` or ``extra_args=``: the
    KV hints each request carries). ``label``: the result's ``manager`` (default ``manager``).
    The result's ``extra["hint_counters"]``: our manager's hint counters at the end.

    ``two_level_small``: ours (``manager`` "hybrid_alloc", the exact policy) over the two-level
    form of the same pool at attention blocks of that many tokens
    (:func:`hybrid_alloc.bench.capacity_run.build_setup`: the capacity bench's construction;
    ``RuntimeError`` if the plugin falls back, ``ValueError`` for a shape without a state
    group). The result's ``extra["slots_per_page"]`` and ``["hash_block_size"]`` say what ran."""
    from hybrid_alloc.bench.offline import SchedulerSetup, fabricate_output, hint_counters, make_request
    from hybrid_alloc.vllm.pages import slots_per_page

    setup = SchedulerSetup(
        shape,
        manager="hybrid_alloc" if manager == "floor" else manager,  # type: ignore[arg-type]
        num_blocks=num_blocks,
        kv_budget_bytes=kv_budget,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        admission_window=admission_window,
        admission_threshold=admission_threshold,
    )
    if two_level_small is not None:
        from hybrid_alloc.bench.capacity_run import build_setup

        assert manager == "hybrid_alloc" and policy in (None, "exact"), "two-level pages: ours, exact"
        sched = build_setup(setup, two_level_small, label or manager)
    else:
        sched = _build(setup, policy)
    mgr = sched.kv_cache_manager

    def request(rid: str, toks: list[int], out_len: int) -> Any:
        return make_request(sched, rid, toks, out_len, **(hints(rid, toks) if hints is not None else {}))

    if manager == "floor":
        floor.install_floor(mgr)
    kvc = mgr.kv_cache_config
    conc = _max_concurrency(sched.vllm_config, kvc)
    hits = {"hits": 0, "queries": 0}
    orig_record = mgr.record_prefix_cache_stats

    def record(request: Any, num_hits: int) -> None:
        hits["hits"] += num_hits
        hits["queries"] += request.num_tokens
        orig_record(request, num_hits)

    mgr.record_prefix_cache_stats = record
    clock = ManagerClock()
    clock.install(mgr)
    for rid, toks, out_len in requests:
        sched.add_request(request(rid, toks, out_len))
    kv_ns: list[float] = []
    kv_per_req_ns: list[float] = []
    raw_calls: list[int] = []
    step_ns: list[float] = []
    step_cpu_ns: list[float] = []  # the same steps in this thread's CPU time (robust to a busy machine)
    running: list[int] = []
    usage: list[float] = []
    running_timed: list[int] = []  # requests scheduled on each timed step
    step_running: list[int] = []  # and on each bare step
    waiting: list[int] = []  # the waiting queue's depth before each measured step
    probe_steps = 0  # timed steps in which the scheduler probed (cache-aware admission)
    probes = clock.by_name.get("get_num_cached_tokens", [0.0, 0])  # [ns, calls], kept by the clock
    step = 0
    measuring = measure_from_running == 0 and warmup_finished == 0
    measured = 0
    clients = len(requests)
    next_id = clients
    replaced = 0
    pc = time.perf_counter_ns
    tt = time.thread_time_ns
    try:
        while sched.get_num_unfinished_requests() and step < max_steps:
            timed = step % 2 == 0
            if timed:
                clock.on()
            else:
                clock.off()
            clock.take()
            n_waiting = len(sched.waiting)
            n_probes = probes[1]
            c0 = tt()
            t0 = pc()
            so = sched.schedule()
            t1 = pc()
            c1 = tt()
            out = fabricate_output(sched, so)
            c2 = tt()
            t2 = pc()
            sched.update_from_output(so, out)
            t3 = pc()
            c3 = tt()
            kv = clock.take()
            n_run = len(sched.running)
            if measuring:
                waiting.append(n_waiting)
                if timed:
                    kv_ns.append(kv)
                    kv_per_req_ns.append(kv / max(1, len(so.num_scheduled_tokens)))
                    raw_calls.append(clock.last_calls)
                    probe_steps += probes[1] > n_probes
                    running_timed.append(len(so.num_scheduled_tokens))
                else:
                    step_ns.append((t1 - t0) + (t3 - t2))
                    step_cpu_ns.append((c1 - c0) + (c3 - c2))
                    step_running.append(len(so.num_scheduled_tokens))
                measured += 1
            elif refill is not None:
                if replaced >= warmup_finished:  # measured from the next step on
                    measuring = True
                    clock.reset_breakdown()
            elif n_run >= measure_from_running and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
            ):  # measured from the next step on
                measuring = True
                clock.reset_breakdown()
            if refill is not None:  # the closed loop: finished requests replaced at once
                clock.off()
                while sched.get_num_unfinished_requests() < clients:
                    rid, toks, out_len = refill(next_id)
                    sched.add_request(request(rid, toks, out_len))
                    next_id += 1
                    replaced += 1
            running.append(n_run)
            clock.depth = 1  # the bench's own read: not timed, not the scheduler's
            usage.append(mgr.usage)
            clock.depth = 0
            step += 1
            if decode_steps is not None and measured >= decode_steps:
                break
    finally:
        clock.off()
    n_timed = max(1, len(kv_ns))
    window = int(getattr(sched, "cache_aware_window", 0) or 0)  # what the scheduler applies
    breakdown = {
        name: {"us_per_step": ns / n_timed / 1e3, "calls_per_step": calls / n_timed}
        for name, (ns, calls) in sorted(clock.by_name.items(), key=lambda kv: -kv[1][0])
        if calls
    }
    per_call = {
        key: {
            "calls_per_step": len(xs) / n_timed,
            "median_us": statistics.median(xs) / 1e3,
            "mean_us": statistics.fmean(xs) / 1e3,
            "us_per_step": sum(xs) / n_timed / 1e3,
        }
        for key, xs in sorted(clock.samples.items())
        if xs
    }
    finished = not sched.get_num_unfinished_requests() or decode_steps is not None
    counters = hint_counters(mgr)
    return RunResult(
        model=shape.name,
        scenario=scenario,
        manager=label or manager,
        num_blocks=kvc.num_blocks,
        block_size=kvc.kv_cache_groups[0].kv_cache_spec.block_size,
        num_groups=len(kvc.kv_cache_groups),
        max_concurrency=conc,
        steps=step,
        peak_running=max(running) if running else 0,
        hit_rate=hits["hits"] / hits["queries"] if hits["queries"] else 0.0,
        kv_ns=kv_ns,
        step_ns=step_ns,
        running=running,
        usage=usage,
        finished=finished,
        kv_running=running_timed,
        step_running=step_running,
        extra={
            "native": type(mgr).__name__ == "HybridKVCacheManager",
            "slots_per_page": slots_per_page(kvc) or 1,
            "hash_block_size": sched.hash_block_size,
            "timer_overhead_ns_per_call": clock.overhead_ns,
            "timer_overhead_ns_per_method_call": clock.overhead_method_ns,
            "manager_calls_per_step_median": sorted(raw_calls)[len(raw_calls) // 2] if raw_calls else 0,
            "kv_us_mean": statistics.fmean(kv_ns) / 1e3 if kv_ns else 0.0,
            "kv_us_per_scheduled_request_median": _median(kv_per_req_ns) / 1e3,
            "step_cpu_us_median": _median(step_cpu_ns) / 1e3,
            "kv_breakdown": breakdown,
            "per_call": per_call,
            "step_us_mean": statistics.fmean(step_ns) / 1e3 if step_ns else 0.0,
            "step_cpu_us_mean": statistics.fmean(step_cpu_ns) / 1e3 if step_cpu_ns else 0.0,
            "running_mean": statistics.fmean(running_timed) if running_timed else 0.0,
            # All timed steps' KV time over all the requests they scheduled.
            "kv_us_per_running_request_mean": sum(kv_ns) / max(1, sum(running_timed)) / 1e3,
            "replaced": replaced,
            "admission_window": window,
            "admission_threshold": getattr(sched, "cache_aware_threshold", None) if window else None,
            "waiting_mean": statistics.fmean(waiting) if waiting else 0.0,
            "waiting_p90": sorted(waiting)[int(0.9 * len(waiting))] if waiting else 0,
            "waiting_max": max(waiting) if waiting else 0,
            "probe_steps": probe_steps / n_timed,
            **({"hint_counters": counters} if counters is not None else {}),
        },
    )


def _build(setup: Any, policy: str | None) -> Any:
    """``setup``'s scheduler, built under ``HYBRID_ALLOC_POLICY=policy`` (None: the environment's)."""
    with env_set({"HYBRID_ALLOC_POLICY": policy} if policy is not None else {}):
        return setup.build()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _max_concurrency(vllm_config: Any, kvc: Any) -> float:
    try:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        return float(get_max_concurrency_for_kv_cache_config(vllm_config, kvc))
    except Exception:  # noqa: BLE001 - informational only (moved or changed between releases)
        return float("nan")
