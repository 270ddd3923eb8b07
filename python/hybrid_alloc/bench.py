"""``hybrid-alloc bench``: vLLM's real scheduler, with fabricated model outputs, under three KV
cache managers in one run -- vLLM's own, hybrid_alloc, and "no hybrid allocation" (every layer
treated as full attention, as ``--disable-hybrid-kv-cache-manager`` does).

Scenarios (all on the CPU; the GPU only sets the KV budget):
- ``throughput``: vLLM's ``benchmark_throughput`` shape, ``--input-len 6144 --output-len 1024
  --num-prompts 50``: every prompt arrives at once, random tokens.
- ``shared-prefix``: a few long system prompts shared by many requests.
- ``decode-N``: N requests decoding together (default N = 256 and 1024, 2048-token prompts):
  the KV-manager CPU time per scheduler step with N running requests, the number vLLM's
  Python manager makes large.

KV budget: ``gpu_memory_gib * gpu_memory_utilization - weights - reserve`` (weights of the
model shape at bf16; ``reserve`` stands for activations and the CUDA context). The decode-N
scenario sizes its pool to hold all N requests instead.

KV time counts what the scheduler pays for the manager: the time inside every call into it
(and into the ``coordinator`` / ``block_pool`` methods the scheduler reaches through it), plus
the time inside every method the scheduler calls on the ``KVCacheBlocks`` the manager returned
(``get_block_ids(allow_none=True)`` for each running request, ``+``, ``.blocks``, ...). Steps
alternate: even steps run with the timing wrappers (their calibrated cost subtracted, call by
call), odd steps run bare and give the whole step's time (``schedule()`` +
``update_from_output()``), in wall time and in the thread's CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from typing import Any

DEFAULT_MODELS = ("gemma-2-27b", "llama-3.1-8b")
INSTALL_HINT = "vLLM is not installed: pip install 'vllm>=0.32,<0.35' (0.32.0, 0.33.0 or 0.34.0), or run `bash scripts/bench.sh` (vLLM 0.32.0's CPU build)"
# The bench's own dependencies (rich for the table, matplotlib for the plot) are the `bench` extra.
# A C function that does nothing with any arguments (and, being a builtin, does not bind as a
# method): the clock calibrates its timing wrappers on it, so what it subtracts is the timing.
NOOP = "".format
PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install 'hybrid-alloc[bench]')"

# Methods of KVCacheManager (and what the scheduler reaches through it) that are timed.
_TIMED = (
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "cache_blocks",
    "take_events",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "new_step_starts",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "estimate_cached_tokens",
    "remove_skipped_blocks",
    "truncate_computed_blocks",
)
# What the scheduler (and connectors) call on the ``KVCacheBlocks`` the manager returns:
# timed on ``KVCacheBlocks`` and on every subclass that defines them (ours, lazily built).
_RESULT_METHODS = (
    "get_block_ids",
    "__add__",
    "get_unhashed_block_ids",
    "get_unhashed_block_ids_all_groups",
    "new_empty",
    "blocks",
)
# Properties of the manager the scheduler reads every step (``make_stats``).
_MANAGER_PROPERTIES = ("usage",)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = [cls]
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        out.extend(c for c in _subclasses(sub) if c not in out)
    return out


class ManagerClock:
    """Accumulates everything the scheduler pays for a KV cache manager: the time inside each
    call into the manager (its methods, wrapped on the instance, and ``coordinator`` /
    ``block_pool`` methods the scheduler reaches through it), and the time inside each method
    the scheduler calls on the ``KVCacheBlocks`` the manager returned (wrapped on
    ``KVCacheBlocks`` and its subclasses: vLLM's ``get_block_ids`` runs in vLLM's class, ours in
    ours). A call made inside a timed call is counted by the outer one.

    The wrappers are installed with :meth:`on` and removed with :meth:`off`, so steps can be
    timed with none installed. Each timed call's own timer cost (two ``perf_counter_ns`` reads
    and the call through the wrapper), calibrated per wrapper form around a C function that
    does nothing, is subtracted from what it measured."""

    def __init__(self) -> None:
        self.ns = 0.0
        self.calls = 0
        self.last_calls = 0
        self.depth = 0
        # Calibrated timer cost per call: instance-attribute wrappers (manager methods) and
        # class-attribute wrappers (methods of the returned blocks, properties).
        self.overhead_ns = 0.0
        self.overhead_method_ns = 0.0
        # name -> [ns, calls] since the last take_breakdown.
        self.by_name: dict[str, list[float]] = {}
        self._patches: list[tuple[Any, str, bool, Any, Any]] = []
        # "name/kind" -> each call's ns (the timer's cost subtracted), for the calls that have
        # a classifier (``_classifiers``), since the last reset_breakdown.
        self.samples: dict[str, list[float]] = {}
        self._installed = False

    def _timed(self, name: str, f: Any, method: bool, classify: Classifier | None = None) -> Any:
        pc = time.perf_counter_ns
        clock = self
        entry = self.by_name.setdefault(name, [0.0, 0])
        samples = self.samples

        def timed(*a: Any, **k: Any) -> Any:
            if clock.depth:  # a call inside a timed call: counted by the outer one
                return f(*a, **k)
            clock.depth = 1
            t = pc()
            try:
                r = f(*a, **k)
            finally:
                dt = pc() - t - (clock.overhead_method_ns if method else clock.overhead_ns)
                clock.depth = 0
                clock.ns += dt
                clock.calls += 1
                entry[0] += dt
                entry[1] += 1
            if classify is not None:  # after the clock is read: not part of the call's time
                key = f"{name}/{classify(a, k, r)}"
                found = samples.get(key)
                if found is None:
                    samples[key] = [dt]
                else:
                    found.append(dt)
            return r

        return timed

    def _patch(self, obj: Any, name: str, label: str, method: bool, classify: Classifier | None = None) -> None:
        own = obj.__dict__ if isinstance(obj, type) else getattr(obj, "__dict__", {})
        had_own = name in own
        orig = own[name] if had_own else getattr(obj, name, None)
        if orig is None:
            return
        if isinstance(orig, property):
            if orig.fget is None:
                return
            wrapper: Any = property(self._timed(label, orig.fget, True), orig.fset, orig.fdel, orig.__doc__)
        else:
            wrapper = self._timed(label, orig, method, classify)
        self._patches.append((obj, name, had_own, orig, wrapper))

    def install(self, mgr: Any) -> None:
        """Prepares the wrappers for ``mgr`` (and the blocks classes) and calibrates them."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        classifiers = _classifiers(mgr.empty_kv_cache_blocks)
        for name in _TIMED:
            self._patch(mgr, name, name, False, classifiers.get(name))
        self._patch(mgr.coordinator, "get_num_blocks_to_allocate", "coordinator.get_num_blocks_to_allocate", False)
        self._patch(mgr.block_pool, "free_blocks", "block_pool.free_blocks", False)
        for prop in _MANAGER_PROPERTIES:
            for cls in type(mgr).__mro__:
                if isinstance(cls.__dict__.get(prop), property):
                    self._patch(cls, prop, prop, True)
                    break
        for cls in _subclasses(KVCacheBlocks):
            for name in _RESULT_METHODS:
                if name in cls.__dict__:
                    label = f"blocks.{name}"
                    self._patch(cls, name, label, True, classifiers.get(label))
        # Ours: the empty result's get_block_ids is an instance attribute (a builtin method),
        # which the class's wrapper does not reach; it gets no ``self`` to classify by.
        empty = mgr.empty_kv_cache_blocks
        if "get_block_ids" in getattr(empty, "__dict__", {}):
            self._patch(empty, "get_block_ids", "blocks.get_block_ids", False, lambda a, k, r: "empty")
        self.calibrate()

    def on(self) -> None:
        if self._installed:
            return
        for obj, name, _, _, wrapper in self._patches:
            setattr(obj, name, wrapper)
        self._installed = True

    def off(self) -> None:
        if not self._installed:
            return
        for obj, name, had_own, orig, _ in reversed(self._patches):
            if had_own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
        self._installed = False

    def calibrate(self) -> None:
        """The timer's own cost per call, for each wrapper form, measured around a C function
        that does nothing (so what is subtracted is the timing, not the callee; the few ns of
        the empty callee are subtracted too, for both managers alike)."""
        from types import SimpleNamespace

        probe = ManagerClock()
        o = SimpleNamespace(f=NOOP)
        probe._patch(o, "f", "probe", False)

        class Probe:
            g = NOOP

        probe._patch(Probe, "g", "probe", True)
        probe.on()
        p = Probe()
        req = SimpleNamespace(num_computed_tokens=1)
        best_attr = best_method = float("inf")
        try:
            for _ in range(7):
                probe.ns, probe.calls = 0.0, 0
                for _ in range(20000):
                    o.f(req, 1, num_lookahead_tokens=0)
                best_attr = min(best_attr, probe.ns / probe.calls)
                probe.ns, probe.calls = 0.0, 0
                for _ in range(20000):
                    p.g(allow_none=True)
                best_method = min(best_method, probe.ns / probe.calls)
        finally:
            probe.off()
        self.overhead_ns = best_attr
        self.overhead_method_ns = best_method

    def take(self) -> float:
        """Nanoseconds since the last take, the timer's cost subtracted."""
        # Not clamped at 0: the step's total is the sum of its calls' times, as the breakdown
        # is (a step of cheap calls can come out slightly negative when the calibration ran slow).
        v = self.ns
        self.last_calls = self.calls
        self.ns = 0.0
        self.calls = 0
        return v

    def reset_breakdown(self) -> None:
        for e in self.by_name.values():
            e[0], e[1] = 0.0, 0
        self.samples.clear()


Classifier = Any  # (args, kwargs, result) -> the kind of call, a short string


def _classifiers(empty: Any) -> dict[str, Classifier]:
    """How each call the per-call figures tell apart is classified, from its arguments and
    result (``empty``: the manager's shared empty ``KVCacheBlocks``, which both managers
    return for a step that got no new block):
    - ``allocate_slots``: ``admission`` (a waiting request scheduled: the scheduler passes
      ``new_computed_blocks``), ``chunk`` (a running request's next prefill chunk: more
      than one new token), ``no-op`` (one new token, no new block: the empty result),
      ``crossing`` (one new token and a new block: the step crossed a block boundary),
      ``refused`` (``None``: it did not fit);
    - ``blocks.get_block_ids``: ``empty`` (on the empty result) or ``ids``;
    - ``get_computed_blocks``, ``get_blocks``, ``free``: one kind, ``all``."""

    def allocate(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        if r is None:
            return "refused"
        if "new_computed_blocks" in k or len(a) > 3:
            return "admission"
        n = a[1] if len(a) > 1 else k.get("num_new_tokens", 0)
        if n > 1:
            return "chunk"
        return "no-op" if r is empty else "crossing"

    def block_ids(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        return "empty" if a and a[0] is empty else "ids"

    def one(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        return "all"

    return {
        "allocate_slots": allocate,
        "blocks.get_block_ids": block_ids,
        "get_computed_blocks": one,
        "get_blocks": one,
        "free": one,
    }


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


def kv_budget_bytes(shape: Any, gpu_memory_gib: float, utilization: float, reserve_gib: float) -> int:
    gib = 1 << 30
    budget = gpu_memory_gib * gib * utilization - shape.weight_bytes - reserve_gib * gib
    if budget <= 0:
        raise SystemExit(
            f"{shape.name}: no KV budget left on {gpu_memory_gib} GiB (weights {shape.weight_bytes / gib:.1f} GiB)"
        )
    return int(budget)


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
) -> RunResult:
    """Runs the scheduler to the end (or for ``decode_steps`` measured steps once
    ``measure_from_running`` requests run with their prompts done). Steps alternate: on even
    steps the manager's calls and the methods called on its results are timed (KV time); odd
    steps run with no wrapper installed and give the whole step's time.

    A closed loop (``refill``, a function of the request's index returning ``(id, prompt,
    output length)``): after each step, every finished request is replaced at once by the next
    one, so that ``len(requests)`` clients are always in the scheduler; measuring starts once
    ``warmup_finished`` requests have been replaced."""
    from hybrid_alloc.vllm.offline import SchedulerSetup, fabricate_output, make_request

    setup = SchedulerSetup(
        shape,
        manager="hybrid_alloc" if manager == "floor" else manager,  # type: ignore[arg-type]
        num_blocks=num_blocks,
        kv_budget_bytes=kv_budget,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    sched = setup.build()
    mgr = sched.kv_cache_manager
    if manager == "floor":
        from hybrid_alloc.bench_serve import install_floor

        install_floor(mgr)
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
        sched.add_request(make_request(sched, rid, toks, out_len))
    kv_ns: list[float] = []
    kv_per_req_ns: list[float] = []
    raw_calls: list[int] = []
    step_ns: list[float] = []
    step_cpu_ns: list[float] = []  # the same steps in this thread's CPU time (robust to a busy machine)
    running: list[int] = []
    usage: list[float] = []
    running_timed: list[int] = []  # requests scheduled on each timed step
    step_running: list[int] = []  # and on each bare step
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
                if timed:
                    kv_ns.append(kv)
                    kv_per_req_ns.append(kv / max(1, len(so.num_scheduled_tokens)))
                    raw_calls.append(clock.last_calls)
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
                    sched.add_request(make_request(sched, rid, toks, out_len))
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
    return RunResult(
        model=shape.name,
        scenario=scenario,
        manager=manager,
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
        },
    )


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _max_concurrency(vllm_config: Any, kvc: Any) -> float:
    try:
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        return float(get_max_concurrency_for_kv_cache_config(vllm_config, kvc))
    except Exception:  # noqa: BLE001 - informational only (moved or changed between releases)
        return float("nan")


def throughput_requests(n: int, input_len: int, output_len: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"tp{i}", [rng.randrange(1, 30000) for _ in range(input_len)], output_len) for i in range(n)]


def shared_prefix_requests(
    n: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 1
) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        (f"sp{i}", prefixes[i % num_prefixes] + [rng.randrange(1, 30000) for _ in range(suffix_len)], output_len)
        for i in range(n)
    ]


def decode_requests(n: int, ctx: int, seed: int) -> list[tuple[str, list[int], int]]:
    """``n`` requests of ``ctx`` to ``ctx + 15`` prompt tokens that never finish: clients that
    arrived at different times, so each decode step crosses a block boundary for about one
    request in 16 (block size 16), not for all of them at once."""
    rng = random.Random(seed)
    return [(f"dc{i}", [rng.randrange(1, 30000) for _ in range(ctx + i % 16)], 100000) for i in range(n)]


def decode_pool_blocks(n: int, ctx: int, out: int, block_size: int) -> int:
    """Blocks for ``n`` requests of ``ctx + out`` tokens in two groups, with headroom."""
    per_req = -(-(ctx + out + 64) // block_size) + 2
    return n * per_req * 2 + 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from_env = os.environ.get
    p = argparse.ArgumentParser(
        prog="hybrid-alloc bench",
        description="Replay vLLM's benchmark_throughput scheduler side on the CPU under vLLM's KV cache manager, "
        "hybrid_alloc, and no hybrid allocation; print a table, write JSON and a PNG plot.",
    )
    p.add_argument(
        "--model",
        action="append",
        help="model shape (repeatable); default: gemma-2-27b and llama-3.1-8b. "
        "Built in: gemma-2-27b, llama-3.1-8b, gpt-oss-120b, llama-4-scout, mistral-sw, qwen3.5-style, "
        "nemotron-h-style, jamba-style, lfm2-style, deepseek-v4-style",
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=["serve", "throughput", "shared-prefix", "decode", "memory"],
        help="scenario (repeatable); default: all five. serve: the closed loop (--serve-*), on "
        "gemma-2-27b, qwen3.5-style and deepseek-v4-style unless --model names shapes, vLLM's manager "
        "and ours only; memory: each manager's construction time and bytes per block at 344k and 4M "
        "blocks (gemma-2-27b unless --model names a shape), one fresh interpreter each",
    )
    p.add_argument("--serve-clients", type=int, default=1024, help="serve: requests always in the scheduler")
    p.add_argument("--serve-prompt-len", type=int, default=2048, help="serve: prompt tokens per request")
    p.add_argument(
        "--serve-prefix-share",
        type=float,
        default=0.25,
        help="serve: share of each prompt that is one system prompt all requests share (default 0.25: 512 of 2048)",
    )
    p.add_argument("--serve-output-len", type=int, default=256, help="serve: mean output tokens per request")
    p.add_argument(
        "--serve-output-spread",
        type=int,
        default=128,
        help="serve: output lengths are uniform in output-len +- this (default 128-384), so finishes are staggered",
    )
    p.add_argument(
        "--serve-steps",
        type=int,
        default=200,
        help="serve: steps measured once half the clients have been replaced (half timed, half bare)",
    )
    p.add_argument("--input-len", type=int, default=6144)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory (default 80: an H100 80GB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gib", type=float, default=4.0, help="memory for activations and the CUDA context")
    p.add_argument("--max-num-seqs", type=int, default=256, help="scheduler concurrency cap (vLLM's --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--decode-concurrency",
        type=int,
        action="append",
        help="running requests for the decode scenario (repeatable; default 256 and 1024)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=2048,
        help="prompt length in the decode scenario (request i gets i %% 16 more tokens)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=96,
        help="decode steps measured per concurrency (half timed for KV time, half bare for the step time)",
    )
    p.add_argument("--shared-prefixes", type=int, default=4)
    p.add_argument("--shared-requests", type=int, default=200)
    p.add_argument(
        "--managers",
        default="vllm,hybrid_alloc,no_hybrid",
        help="comma-separated; floor (serve only): ours with the decode call answered by a C-level constant, "
        "the least any manager can cost under vLLM's calls (bench_serve.install_floor)",
    )
    p.add_argument("--out-dir", default=from_env("HYBRID_ALLOC_BENCH_OUT", "bench-out"))
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def vllm_ready() -> bool:
    """Whether vLLM imports (else prints the install hint); quiets vLLM's logger for the run.
    The common start of ``hybrid-alloc bench`` and ``hybrid-alloc hits``."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return False
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not vllm_ready():
        return 2
    from tqdm import tqdm

    from hybrid_alloc.bench_serve import SERVE_MODELS, run_serve
    from hybrid_alloc.vllm.offline import SHAPES

    models = args.model or list(DEFAULT_MODELS)
    serve_models = args.model or list(SERVE_MODELS)
    for m in models:
        if m not in SHAPES:
            print(f"unknown model shape {m!r}; built in: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
    workloads = args.workload or ["serve", "throughput", "shared-prefix", "decode", "memory"]
    managers = [m.strip() for m in args.managers.split(",") if m.strip()]
    conc = args.decode_concurrency or [256, 1024]
    plan: list[tuple[str, str, str, Any]] = []
    if "serve" in workloads:
        for m in serve_models:
            for mg in managers:
                if mg in ("vllm", "hybrid_alloc", "floor"):
                    plan.append((m, "serve", mg, args.serve_clients))
    managers = [m for m in managers if m != "floor"]  # floor: the serve workload only
    for m in models:
        for w in workloads:
            if w in ("serve", "memory"):
                continue
            if w == "decode":
                for n in conc:
                    for mg in managers:
                        plan.append((m, f"decode-{n}", mg, n))
            else:
                for mg in managers:
                    plan.append((m, w, mg, None))
    results: list[RunResult] = []
    bar = tqdm(total=len(plan), desc="bench", unit="run", file=sys.stderr)
    for model, scen, mg, n in plan:
        shape = SHAPES[model]
        bar.set_postfix_str(f"{model} {scen} {mg}")
        if scen == "serve":
            r = run_serve(shape, mg, args)
        elif scen == "throughput":
            reqs = throughput_requests(args.num_prompts, args.input_len, args.output_len)
            budget = kv_budget_bytes(shape, args.gpu_memory_gib, args.gpu_memory_utilization, args.reserve_gib)
            r = run_scenario(
                shape,
                mg,
                scen,
                reqs,
                num_blocks=None,
                kv_budget=budget,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        elif scen == "shared-prefix":
            reqs = shared_prefix_requests(args.shared_requests, args.shared_prefixes, 2048, 512, 256)
            budget = kv_budget_bytes(shape, args.gpu_memory_gib, args.gpu_memory_utilization, args.reserve_gib)
            r = run_scenario(
                shape,
                mg,
                scen,
                reqs,
                num_blocks=None,
                kv_budget=budget,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        else:
            ctx = args.decode_context
            reqs = decode_requests(n, ctx, seed=n)
            r = run_scenario(
                shape,
                mg,
                scen,
                reqs,
                num_blocks=decode_pool_blocks(n, ctx + 16, 4 * args.decode_steps, 16),
                kv_budget=None,
                max_num_seqs=n,
                max_num_batched_tokens=max(args.max_num_batched_tokens, n),
                measure_from_running=n,
                decode_steps=args.decode_steps,
            )
            r.extra["running_requests"] = n
        results.append(r)
        bar.update(1)
    bar.close()
    memory: list[dict[str, Any]] = []
    if "memory" in workloads:
        from hybrid_alloc.bench_memory import run_memory

        memory = run_memory((args.model or ["gemma-2-27b"])[0], [m for m in managers if m != "no_hybrid"])
    report(results, args, memory)
    return 0


def _ratios(rows: list[dict[str, Any]]) -> None:
    base = {(r["model"], r["scenario"]): r for r in rows if r["manager"] == "vllm"}
    for r in rows:
        n = r.get("running_requests")
        if n:
            r["kv_us_per_running_request"] = r["kv_us_median"] / n
        b = base.get((r["model"], r["scenario"]))
        if b is None:
            continue
        r["kv_speedup_vs_vllm"] = b["kv_us_median"] / r["kv_us_median"] if r["kv_us_median"] else float("inf")
        r["step_speedup_vs_vllm"] = b["step_us_median"] / r["step_us_median"] if r["step_us_median"] else float("inf")
        if r.get("step_cpu_us_median"):
            r["step_cpu_speedup_vs_vllm"] = b["step_cpu_us_median"] / r["step_cpu_us_median"]


def report(results: list[RunResult], args: argparse.Namespace, memory: list[dict[str, Any]] | None = None) -> None:
    from hybrid_alloc.bench_serve import print_serve_table, serve_ratios

    rows = [r.summary() for r in results]
    _ratios(rows)
    serve_ratios(rows)
    os.makedirs(args.out_dir, exist_ok=True)
    from hybrid_alloc.vllm.plugin import vllm_release

    release = vllm_release()
    meta = {
        "vllm_release": release,
        "assumptions": {
            "gpu_memory_gib": args.gpu_memory_gib,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "reserve_gib": args.reserve_gib,
            "weights": "bf16 parameters of the model shape",
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "decode_context": args.decode_context,
            "decode_steps": args.decode_steps,
            "serve": {
                "clients": args.serve_clients,
                "prompt_len": args.serve_prompt_len,
                "prefix_share": args.serve_prefix_share,
                "output_len": args.serve_output_len,
                "output_spread": args.serve_output_spread,
                "steps": args.serve_steps,
            },
        },
        "counting": "KV time: every call into the manager (and the coordinator/block_pool methods the "
        "scheduler reaches through it) plus every method the scheduler calls on the KVCacheBlocks it "
        "returned, on alternate steps, each call's calibrated timer cost subtracted; step time: "
        "schedule() + update_from_output() on the other steps, with no wrapper installed (wall time, "
        "and this thread's CPU time, which a busy machine disturbs less)",
        "results": rows,
        "memory": memory or [],
    }
    jpath = os.path.join(args.out_dir, "bench.json")
    with open(jpath, "w") as f:
        json.dump(meta, f, indent=1, default=float)
    print_serve_table(rows, release)
    print_table([r for r in rows if not r["scenario"].startswith("serve")], release)
    print_breakdown(rows)
    from hybrid_alloc.bench_memory import print_memory

    print_memory(memory or [])
    print(f"\nJSON: {jpath}")
    if not args.no_plot:
        ppath = os.path.join(args.out_dir, "bench.png")
        if plot(results, rows, ppath):
            print(f"plot: {ppath}")


def print_table(rows: list[dict[str, Any]], vllm_release: str | None = None) -> None:
    cols = [
        ("model", "model", "{}"),
        ("scenario", "scenario", "{}"),
        ("manager", "manager", "{}"),
        ("num_blocks", "blocks", "{}"),
        ("max_concurrency", "fit@len", "{:.1f}"),
        ("peak_running", "peak run", "{}"),
        ("mean_usage", "mean KV use", "{:.2f}"),
        ("hit_rate", "hit rate", "{:.3f}"),
        ("steps", "steps", "{}"),
        ("kv_us_median", "KV us p50", "{:.1f}"),
        ("kv_us_p99", "KV us p99", "{:.1f}"),
        ("kv_us_per_running_request", "KV us/req", "{:.3f}"),
        ("step_us_median", "step us p50", "{:.0f}"),
        ("step_us_p99", "step us p99", "{:.0f}"),
        ("step_cpu_us_median", "step CPU us", "{:.0f}"),
        ("kv_speedup_vs_vllm", "KV x vs vLLM", "{:.1f}"),
        ("step_speedup_vs_vllm", "step x vs vLLM", "{:.2f}"),
        ("step_cpu_speedup_vs_vllm", "step CPU x", "{:.2f}"),
    ]
    if not rows:
        return
    timer = [r["timer_overhead_ns_per_call"] for r in rows] + [r["timer_overhead_ns_per_method_call"] for r in rows]
    caption = f"timer cost subtracted per timed call: {min(timer):.0f}-{max(timer):.0f} ns" if timer else ""
    title = f"hybrid-alloc bench (vLLM {vllm_release} scheduler, fabricated outputs)"
    render_table(title, cols, rows, caption)


def print_breakdown(rows: list[dict[str, Any]]) -> None:
    """Where the KV time of each serve and decode scenario goes, by call: means per timed step
    (a total and its parts are the same statistic, so the parts add up to the total)."""
    lines = []
    for r in rows:
        if not (r.get("running_requests") or r.get("clients")) or r["manager"] == "no_hybrid":
            continue
        bd = list(r.get("kv_breakdown", {}).items())
        parts = [f"{name} {v['us_per_step']:.1f} us ({v['calls_per_step']:.1f} calls)" for name, v in bd[:6]]
        rest = sum(v["us_per_step"] for _, v in bd[6:])
        if bd[6:]:
            parts.append(f"{len(bd) - 6} other calls {rest:.1f} us")
        lines.append(
            f"{r['model']} {r['scenario']} {r['manager']}: KV {r['kv_us_mean']:.1f} us/step = " + " + ".join(parts)
        )
    if lines:
        print("KV time per step by call (means per timed step; calls per timed step in brackets):")
        for ln in lines:
            print("  " + ln)


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` on the Agg backend, or ``None`` after one line on stderr when
    matplotlib is not installed: the plot is the only output that needs it, so the run (its
    table and JSON) goes on without it. Shared by ``hybrid-alloc bench`` and ``hits``."""
    try:
        import matplotlib
    except ImportError:
        print(PLOT_SKIPPED, file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MANAGER_STYLE = {
    "vllm": ("tab:blue", "vLLM's KVCacheManager"),
    "hybrid_alloc": ("tab:orange", "hybrid_alloc"),
    "floor": ("tab:gray", "floor probe (decode call a constant)"),
}
MARKERS = "osD^v<>Px*"


def same_scheduling(results: list[RunResult]) -> tuple[int, int]:
    """(scenarios where vLLM's manager and ours scheduled identically -- same steps, running
    requests, usage and hit rate --, scenarios run under both)."""
    by = {(r.model, r.scenario, r.manager): r for r in results}
    pairs = [
        (a, by[(a.model, a.scenario, "hybrid_alloc")])
        for a in results
        if a.manager == "vllm" and (a.model, a.scenario, "hybrid_alloc") in by
    ]
    same = sum(
        a.steps == b.steps and a.running == b.running and a.usage == b.usage and a.hit_rate == b.hit_rate
        for a, b in pairs
    )
    return same, len(pairs)


def plot(results: list[RunResult], rows: list[dict[str, Any]], path: str) -> bool:
    """Writes the PNG to ``path``; False (nothing written) when matplotlib is not installed.

    Four panels: KV time per step and the whole step against the requests scheduled in it,
    for both managers (a dot per measured step of the serve workload, a line through the
    decode-N means); the speedups (KV and whole step, ratios of means) per scenario; and the
    running requests per step of every scenario under both managers, drawn over each other
    (identical scheduling is the point: the caption says in how many scenarios)."""
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    runs = [r for r in results if r.manager in MANAGER_STYLE]
    models = sorted({r.model for r in runs})
    marker = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(models)}
    fig, axes = plt.subplots(2, 2, figsize=(15, 10.5))
    ax_kv, ax_step, ax_x, ax_sched = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    for ax, field, ylabel, title in (
        (ax_kv, "kv", "KV time per step (us)", "KV cache manager time per scheduler step"),
        (ax_step, "step", "whole step (ms): schedule() + update_from_output()", "Whole scheduler step"),
    ):
        scale = 1e3 if field == "kv" else 1e6
        for r in runs:
            color = MANAGER_STYLE[r.manager][0]
            at, ns = (r.kv_running, r.kv_ns) if field == "kv" else (r.step_running, r.step_ns)
            if r.scenario.startswith("serve") and at:
                pts = [(x, y / scale) for x, y in zip(at, ns) if y > 0]  # log axis
                ax.scatter(
                    [x for x, _ in pts], [y for _, y in pts], s=9, alpha=0.45, color=color, marker=marker[r.model]
                )
        for m in models:
            for mg, (color, _) in MANAGER_STYLE.items():
                dec = sorted(
                    (r for r in runs if r.model == m and r.manager == mg and r.scenario.startswith("decode-")),
                    key=lambda r: int(r.scenario.split("-")[1]),
                )
                if not dec:
                    continue
                xs2 = [int(r.scenario.split("-")[1]) for r in dec]
                ys2 = [
                    statistics.fmean(r.kv_ns if field == "kv" else r.step_ns) / scale if (r.kv_ns and r.step_ns) else 0
                    for r in dec
                ]
                ax.plot(xs2, ys2, "-", color=color, marker=marker[m], markerfacecolor="white", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = sorted({int(r.scenario.split("-")[1]) for r in runs if r.scenario.split("-")[-1].isdigit()})
        if ticks:
            ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("requests scheduled in the step")
        ax.set_ylabel(ylabel)
        ax.set_title(title + " (dots: serve steps; lines: decode-N means)", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    # The speedups, ratios of means (KV: timed steps; step: bare steps, wall time).
    by = {(r["model"], r["scenario"], r["manager"]): r for r in rows}
    keys = sorted(
        {
            (r["model"], r["scenario"])
            for r in rows
            if r["manager"] == "hybrid_alloc" and (r["model"], r["scenario"], "vllm") in by
        },
        key=lambda k: (not k[1].startswith("serve"), k[0], k[1]),
    )
    width = 0.4
    for j, (label, color, num, den) in enumerate(
        (
            ("KV time, vLLM's / ours", "tab:green", "kv_us_mean", "kv_us_mean"),
            ("whole step (wall), vLLM's / ours", "tab:purple", "step_us_mean", "step_us_mean"),
        )
    ):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        ys = [
            by[(m, s, "vllm")][num] / by[(m, s, "hybrid_alloc")][den] if by[(m, s, "hybrid_alloc")].get(den) else 0.0
            for m, s in keys
        ]
        bars = ax_x.bar(xs, ys, width, color=color, label=label)
        for b, y in zip(bars, ys):
            ax_x.annotate(f"{y:.1f}x", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax_x.axhline(1.0, color="gray", linewidth=0.8)
    ax_x.set_xticks(range(len(keys)))
    ax_x.set_xticklabels([f"{m}\n{s}" for m, s in keys], fontsize=7, rotation=30, ha="right")
    ax_x.set_yscale("log")
    top = ax_x.get_ylim()[1]
    ax_x.set_ylim(top=top * 4)  # room above the bars for the legend
    ax_x.set_ylabel("speedup over vLLM's manager (x, ratio of means)")
    ax_x.set_title("How much less time: KV cache manager and whole step", fontsize=10)
    ax_x.legend(loc="upper right", ncol=2, fontsize=8, frameon=False)
    # Scheduling: every scenario's running requests per step, both managers over each other.
    same, total = same_scheduling(results)
    for r in runs:
        style = "-" if r.manager == "vllm" else ":"
        ax_sched.plot(
            r.running, style, color=MANAGER_STYLE[r.manager][0], linewidth=1.4 if r.manager == "vllm" else 2.0
        )
    ax_sched.set_xlabel("scheduler step")
    ax_sched.set_ylabel("running requests")
    ax_sched.set_title(
        f"Scheduling is identical: {same} of {total} scenarios have the same steps, running requests,\n"
        "KV usage and hit rate under both managers (ours dotted over vLLM's solid line)",
        fontsize=9,
    )
    handles = [Line2D([], [], color=c, linewidth=6, label=lab) for c, lab in MANAGER_STYLE.values()] + [
        Line2D([], [], color="black", marker=marker[m], linestyle="none", markerfacecolor="white", label=m)
        for m in models
    ]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=90)
    return True


def render_table(
    title: str, cols: list[tuple[str, str, str]], rows: list[dict[str, Any]], caption: str | None = None
) -> None:
    """One table: ``cols`` are (row key, heading, format); with rich if it is installed, else as
    plain text."""
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, caption=caption)
        for _, head, _ in cols:
            t.add_column(head, justify="right")
        for r in rows:
            t.add_row(*[fmt.format(r[k]) if k in r else "" for k, _, fmt in cols])
        Console(width=320).print(t)
    except ImportError:
        print(title)
        print(" | ".join(h for _, h, _ in cols))
        for r in rows:
            print(" | ".join(fmt.format(r[k]) if k in r else "" for k, _, fmt in cols))
        if caption is not None:
            print(caption)
