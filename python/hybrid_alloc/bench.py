"""``hybrid-alloc bench``: vLLM 0.32.0's real scheduler, with fabricated model outputs, under
three KV cache managers in one run -- vLLM's own, hybrid_alloc, and "no hybrid allocation"
(every layer treated as full attention, as ``--disable-hybrid-kv-cache-manager`` does).

Scenarios (all on the CPU; the GPU only sets the KV budget):
- ``throughput``: vLLM's ``benchmark_throughput`` shape, ``--input-len 6144 --output-len 1024
  --num-prompts 50``: every prompt arrives at once, random tokens.
- ``shared-prefix``: a few long system prompts shared by many requests.
- ``decode-N``: N requests decoding together (default N = 256 and 1024): the KV-manager CPU
  time per scheduler step with N running requests, the number vLLM's Python manager makes
  large.

KV budget: ``gpu_memory_gib * gpu_memory_utilization - weights - reserve`` (weights of the
model shape at bf16; ``reserve`` stands for activations and the CUDA context). The decode-N
scenario sizes its pool to hold all N requests instead.

KV-manager time is the time spent inside the manager's methods called by the scheduler
(measured by wrapping them; the wrapper's own cost, calibrated at start, is subtracted).
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
INSTALL_HINT = "vLLM is not installed: pip install 'vllm>=0.32,<0.34' (0.32.0 or 0.33.0), or run `bash scripts/bench.sh` (vLLM 0.32.0's CPU build)"

# Methods of KVCacheManager (and what the scheduler reaches through it) that are timed.
_TIMED = (
    "get_computed_blocks", "get_computed_blocks_for_connector", "allocate_slots", "free", "pop_blocks_for_free",
    "cache_blocks", "take_events", "get_blocks", "get_block_ids", "get_block_ids_for_computed_tokens",
    "new_step_starts", "take_new_block_ids", "take_kv_cache_block_copies", "take_boundary_state_offloads",
    "record_prefix_cache_stats", "make_prefix_cache_stats", "estimate_cached_tokens", "remove_skipped_blocks",
    "truncate_computed_blocks",
)


class ManagerClock:
    """Accumulates the time spent inside a manager's methods."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self.last_calls = 0
        self.depth = 0
        self.overhead_ns = 0.0

    def wrap(self, obj: Any, name: str) -> None:
        f = getattr(obj, name, None)
        if f is None:
            return
        pc = time.perf_counter_ns

        def timed(*a: Any, **k: Any) -> Any:
            if self.depth:  # a manager method calling another: counted by the outer one
                return f(*a, **k)
            self.depth = 1
            t = pc()
            try:
                return f(*a, **k)
            finally:
                self.ns += pc() - t
                self.calls += 1
                self.depth = 0

        setattr(obj, name, timed)

    def install(self, mgr: Any) -> None:
        for name in _TIMED:
            self.wrap(mgr, name)
        self.wrap(mgr.coordinator, "get_num_blocks_to_allocate")
        self.wrap(mgr.block_pool, "free_blocks")
        self.calibrate()

    def calibrate(self) -> None:
        """The wrapper's own cost per call, measured around a C function that does nothing
        (so what is subtracted is the timing, not the callee; the few ns of the empty
        callee are subtracted too, for both managers alike)."""
        from types import SimpleNamespace

        from hybrid_alloc._core import _noop

        probe = ManagerClock()
        o = SimpleNamespace(f=_noop)
        probe.wrap(o, "f")
        req = SimpleNamespace(num_computed_tokens=1)
        best = float("inf")
        for _ in range(5):
            probe.ns = probe.calls = 0
            for _ in range(20000):
                o.f(req, 1, num_lookahead_tokens=0)
            best = min(best, probe.ns / probe.calls)
        self.overhead_ns = best

    def take(self) -> float:
        """Nanoseconds since the last take, wrapper cost subtracted."""
        v = max(0.0, self.ns - self.calls * self.overhead_ns)
        self.last_calls = self.calls
        self.ns = 0
        self.calls = 0
        return v


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

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            if not xs:
                return 0.0
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        return {
            "model": self.model, "scenario": self.scenario, "manager": self.manager,
            "num_blocks": self.num_blocks, "block_size": self.block_size, "num_groups": self.num_groups,
            "max_concurrency": self.max_concurrency, "steps": self.steps, "peak_running": self.peak_running,
            "hit_rate": self.hit_rate, "mean_usage": statistics.fmean(self.usage) if self.usage else 0.0,
            "kv_us_median": pct(self.kv_ns, 0.5) / 1e3, "kv_us_p99": pct(self.kv_ns, 0.99) / 1e3,
            "step_us_median": pct(self.step_ns, 0.5) / 1e3, "step_us_p99": pct(self.step_ns, 0.99) / 1e3,
            "finished": self.finished, **self.extra,
        }


def kv_budget_bytes(shape: Any, gpu_memory_gib: float, utilization: float, reserve_gib: float) -> int:
    gib = 1 << 30
    budget = gpu_memory_gib * gib * utilization - shape.weight_bytes - reserve_gib * gib
    if budget <= 0:
        raise SystemExit(f"{shape.name}: no KV budget left on {gpu_memory_gib} GiB (weights {shape.weight_bytes / gib:.1f} GiB)")
    return int(budget)


def run_scenario(
    shape: Any, manager: str, scenario: str, requests: list[tuple[str, list[int], int]], *,
    num_blocks: int | None, kv_budget: int | None, max_num_seqs: int, max_num_batched_tokens: int,
    measure_from_running: int = 0, max_steps: int = 200000,
    decode_steps: int | None = None,
) -> RunResult:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from hybrid_alloc.vllm.offline import SchedulerSetup, fabricate_output, make_request

    setup = SchedulerSetup(shape, manager=manager, num_blocks=num_blocks, kv_budget_bytes=kv_budget,  # type: ignore[arg-type]
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sched = setup.build()
    mgr = sched.kv_cache_manager
    kvc = mgr.kv_cache_config
    try:
        conc = float(get_max_concurrency_for_kv_cache_config(sched.vllm_config, kvc))
    except Exception:  # noqa: BLE001 - informational only
        conc = float("nan")
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
    raw_calls: list[int] = []
    step_ns: list[float] = []
    running: list[int] = []
    usage: list[float] = []
    step = 0
    measuring = measure_from_running == 0
    measured = 0
    pc = time.perf_counter_ns
    while sched.get_num_unfinished_requests() and step < max_steps:
        clock.take()
        t0 = pc()
        so = sched.schedule()
        t1 = pc()
        out = fabricate_output(sched, so)
        t2 = pc()
        sched.update_from_output(so, out)
        t3 = pc()
        kv = clock.take()
        n_run = len(sched.running)
        if not measuring and n_run >= measure_from_running and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
        ):
            measuring = True
        if measuring:
            kv_ns.append(kv)
            raw_calls.append(clock.last_calls)
            step_ns.append((t1 - t0) + (t3 - t2))
            measured += 1
        running.append(n_run)
        usage.append(mgr.usage)
        step += 1
        if decode_steps is not None and measured >= decode_steps:
            break
    finished = not sched.get_num_unfinished_requests() or decode_steps is not None
    return RunResult(
        model=shape.name, scenario=scenario, manager=manager, num_blocks=kvc.num_blocks,
        block_size=kvc.kv_cache_groups[0].kv_cache_spec.block_size, num_groups=len(kvc.kv_cache_groups),
        max_concurrency=conc, steps=step, peak_running=max(running) if running else 0,
        hit_rate=hits["hits"] / hits["queries"] if hits["queries"] else 0.0,
        kv_ns=kv_ns, step_ns=step_ns, running=running, usage=usage, finished=finished,
        extra={
            "native": type(mgr).__name__ == "HybridKVCacheManager",
            "timer_overhead_ns_per_call": clock.overhead_ns,
            "manager_calls_per_step_median": sorted(raw_calls)[len(raw_calls) // 2] if raw_calls else 0,
            "kv_us_mean": statistics.fmean(kv_ns) / 1e3 if kv_ns else 0.0,
        },
    )


def throughput_requests(n: int, input_len: int, output_len: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"tp{i}", [rng.randrange(1, 30000) for _ in range(input_len)], output_len) for i in range(n)]


def shared_prefix_requests(n: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 1) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        (f"sp{i}", prefixes[i % num_prefixes] + [rng.randrange(1, 30000) for _ in range(suffix_len)], output_len)
        for i in range(n)
    ]


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
    p.add_argument("--model", action="append", help="model shape (repeatable); default: gemma-2-27b and llama-3.1-8b. "
                   "Built in: gemma-2-27b, llama-3.1-8b, gpt-oss-120b, llama-4-scout, mistral-sw")
    p.add_argument("--workload", action="append", choices=["throughput", "shared-prefix", "decode"],
                   help="scenario (repeatable); default: all three")
    p.add_argument("--input-len", type=int, default=6144)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU memory (default 80: an H100 80GB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gib", type=float, default=4.0, help="memory for activations and the CUDA context")
    p.add_argument("--max-num-seqs", type=int, default=256, help="scheduler concurrency cap (vLLM's --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--decode-concurrency", type=int, action="append",
                   help="running requests for the decode scenario (repeatable; default 256 and 1024)")
    p.add_argument("--decode-context", type=int, default=1024, help="prompt length in the decode scenario")
    p.add_argument("--decode-steps", type=int, default=30, help="decode steps measured per concurrency")
    p.add_argument("--shared-prefixes", type=int, default=4)
    p.add_argument("--shared-requests", type=int, default=200)
    p.add_argument("--managers", default="vllm,hybrid_alloc,no_hybrid")
    p.add_argument("--out-dir", default=from_env("HYBRID_ALLOC_BENCH_OUT", "bench-out"))
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from tqdm import tqdm

    from hybrid_alloc.vllm.offline import SHAPES

    models = args.model or list(DEFAULT_MODELS)
    for m in models:
        if m not in SHAPES:
            print(f"unknown model shape {m!r}; built in: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
    workloads = args.workload or ["throughput", "shared-prefix", "decode"]
    managers = [m.strip() for m in args.managers.split(",") if m.strip()]
    conc = args.decode_concurrency or [256, 1024]
    plan: list[tuple[str, str, str, Any]] = []
    for m in models:
        for w in workloads:
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
        if scen == "throughput":
            reqs = throughput_requests(args.num_prompts, args.input_len, args.output_len)
            budget = kv_budget_bytes(shape, args.gpu_memory_gib, args.gpu_memory_utilization, args.reserve_gib)
            r = run_scenario(shape, mg, scen, reqs, num_blocks=None, kv_budget=budget, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens)
        elif scen == "shared-prefix":
            reqs = shared_prefix_requests(args.shared_requests, args.shared_prefixes, 2048, 512, 256)
            budget = kv_budget_bytes(shape, args.gpu_memory_gib, args.gpu_memory_utilization, args.reserve_gib)
            r = run_scenario(shape, mg, scen, reqs, num_blocks=None, kv_budget=budget, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens)
        else:
            ctx = args.decode_context
            reqs = throughput_requests(n, ctx, 100000, seed=n)
            r = run_scenario(shape, mg, scen, reqs, num_blocks=decode_pool_blocks(n, ctx, 4 * args.decode_steps, 16),
                             kv_budget=None, max_num_seqs=n, max_num_batched_tokens=max(args.max_num_batched_tokens, n),
                             measure_from_running=n, decode_steps=args.decode_steps)
            r.extra["running_requests"] = n
        results.append(r)
        bar.update(1)
    bar.close()
    report(results, args)
    return 0


def _ratios(rows: list[dict[str, Any]]) -> None:
    base = {(r["model"], r["scenario"]): r for r in rows if r["manager"] == "vllm"}
    for r in rows:
        b = base.get((r["model"], r["scenario"]))
        if b is None:
            continue
        r["kv_speedup_vs_vllm"] = b["kv_us_median"] / r["kv_us_median"] if r["kv_us_median"] else float("inf")
        r["step_speedup_vs_vllm"] = b["step_us_median"] / r["step_us_median"] if r["step_us_median"] else float("inf")
        n = r.get("running_requests")
        if n:
            r["kv_us_per_running_request"] = r["kv_us_median"] / n


def report(results: list[RunResult], args: argparse.Namespace) -> None:
    rows = [r.summary() for r in results]
    _ratios(rows)
    os.makedirs(args.out_dir, exist_ok=True)
    from hybrid_alloc.vllm.plugin import vllm_release

    release = vllm_release()
    meta = {
        "vllm_release": release,
        "assumptions": {
            "gpu_memory_gib": args.gpu_memory_gib, "gpu_memory_utilization": args.gpu_memory_utilization,
            "reserve_gib": args.reserve_gib, "weights": "bf16 parameters of the model shape",
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
        },
        "results": rows,
    }
    jpath = os.path.join(args.out_dir, "bench.json")
    with open(jpath, "w") as f:
        json.dump(meta, f, indent=1, default=float)
    print_table(rows)
    print(f"\nJSON: {jpath}")
    if not args.no_plot:
        ppath = os.path.join(args.out_dir, "bench.png")
        plot(results, ppath)
        print(f"plot: {ppath}")


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("model", "model", "{}"), ("scenario", "scenario", "{}"), ("manager", "manager", "{}"),
        ("num_blocks", "blocks", "{}"), ("max_concurrency", "fit@len", "{:.1f}"), ("peak_running", "peak run", "{}"),
        ("mean_usage", "mean KV use", "{:.2f}"), ("hit_rate", "hit rate", "{:.3f}"), ("steps", "steps", "{}"),
        ("kv_us_median", "KV us p50", "{:.1f}"), ("kv_us_p99", "KV us p99", "{:.1f}"),
        ("step_us_median", "step us p50", "{:.0f}"), ("step_us_p99", "step us p99", "{:.0f}"),
        ("kv_speedup_vs_vllm", "KV x vs vLLM", "{:.1f}"), ("step_speedup_vs_vllm", "step x vs vLLM", "{:.2f}"),
    ]
    from hybrid_alloc.vllm.plugin import vllm_release

    title = f"hybrid-alloc bench (vLLM {vllm_release()} scheduler, fabricated outputs)"
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for _, head, _ in cols:
            t.add_column(head, justify="right")
        for r in rows:
            t.add_row(*[fmt.format(r[k]) if k in r else "" for k, _, fmt in cols])
        Console(width=200).print(t)
    except ImportError:
        print(title)
        print(" | ".join(h for _, h, _ in cols))
        for r in rows:
            print(" | ".join(fmt.format(r[k]) if k in r else "" for k, _, fmt in cols))


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r.model, r.scenario) for r in results if not r.scenario.startswith("decode")})
    if not keys:
        keys = sorted({(r.model, r.scenario) for r in results})
    fig, axes = plt.subplots(len(keys), 2, figsize=(13, 3.2 * len(keys)), squeeze=False)
    for i, key in enumerate(keys):
        for r in results:
            if (r.model, r.scenario) != key:
                continue
            style = {"vllm": "-", "hybrid_alloc": "--", "no_hybrid": ":"}.get(r.manager, "-")
            axes[i][0].plot(r.usage, style, label=r.manager, linewidth=1.2)
            axes[i][1].plot(r.running, style, label=r.manager, linewidth=1.2)
        axes[i][0].set_title(f"{key[0]} / {key[1]}: KV cache usage")
        axes[i][1].set_title(f"{key[0]} / {key[1]}: running requests")
        for ax in axes[i]:
            ax.set_xlabel("scheduler step")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
