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

``--admission-window N`` (repeatable; vLLM 0.34+, refused with one line before) runs the
``serve`` workload with vLLM's cache-aware admission window N, paired per window
(:mod:`.serve`).

The tables fit the terminal (``COLUMNS``, else 80) with their main columns; ``--wide`` prints
every column, and ``bench.json`` holds every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Any

from hybrid_alloc.bench import floor
from hybrid_alloc.bench.common import pyplot, render_table, say, say_parts, vllm_ready
from hybrid_alloc.bench.memory import print_memory, run_memory
from hybrid_alloc.bench.runner import RunResult, run_scenario
from hybrid_alloc.bench.serve import (
    SERVE_MANAGERS,
    SERVE_MODELS,
    SERVE_SMALL_BLOCK,
    print_serve_table,
    run_serve,
    serve_ratios,
)

DEFAULT_MODELS = ("gemma-2-27b", "llama-3.1-8b")


def kv_budget_bytes(shape: Any, gpu_memory_gib: float, utilization: float, reserve_gib: float) -> int:
    gib = 1 << 30
    budget = gpu_memory_gib * gib * utilization - shape.weight_bytes - reserve_gib * gib
    if budget <= 0:
        raise SystemExit(
            f"{shape.name}: no KV budget left on {gpu_memory_gib} GiB (weights {shape.weight_bytes / gib:.1f} GiB)"
        )
    return int(budget)


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
        "Built in (hybrid_alloc/bench/shapes.py, every bench's): gemma-2-27b, llama-3.1-8b, gpt-oss-120b, "
        "llama-4-scout, mistral-sw, qwen3.5-style, nemotron-h-style, jamba-style, lfm2-style, deepseek-v4-style, "
        "and the hits bench's gemma3, qwen35, nemotronh, qwen3next, qwen36, nemotron3nano and the capacity bench's "
        "falconh1 (no weights: the whole GPU goes to the KV cache); gptoss is gpt-oss-120b",
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
    p.add_argument(
        "--admission-window",
        action="append",
        type=int,
        metavar="N",
        help="serve, repeatable: run the serve workload with vLLM's cache-aware admission window N "
        "(--cache-aware-admission-window; 0: off, the default; vLLM 0.34+), each window paired against vLLM's manager",
    )
    p.add_argument(
        "--admission-threshold",
        type=float,
        metavar="T",
        help="serve: the usage from which the admission window applies "
        "(vLLM's cache_aware_admission_threshold; default vLLM's, 0.5)",
    )
    p.add_argument(
        "--serve-hints-ttl",
        type=float,
        default=5.0,
        help="serve, the +hints managers: the TTL of each request's retain and pin, wall seconds (default 5: "
        "leases expire during the run)",
    )
    p.add_argument(
        "--serve-hints-via",
        choices=["envelope", "xargs"],
        default="envelope",
        help="serve, the +hints managers: vLLM's KvHintsEnvelope (Request.kv_hints) or SamplingParams.extra_args "
        "(the OpenAI server's vllm_xargs)",
    )
    p.add_argument(
        "--serve-small-block",
        type=int,
        default=SERVE_SMALL_BLOCK,
        help=f"serve, the two_level manager: the attention block inside a page, tokens (default {SERVE_SMALL_BLOCK})",
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
        "the least any manager can cost under vLLM's calls (hybrid_alloc.bench.floor; needs the probe build, "
        "scripts/install-local.sh's, not the release wheel); hit_aware (serve only): ours under hit-aware; "
        "hybrid_alloc+hints, hit_aware+hints (serve only): the same with KV hints on every request "
        "(--serve-hints-*); two_level (serve only, state-space shapes: qwen3.5-style, qwen36, falconh1, ...): ours "
        "over two-level pages of the same pool (--serve-small-block), against hybrid_alloc",
    )
    p.add_argument("--out-dir", default=from_env("HYBRID_ALLOC_BENCH_OUT", "bench-out"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--wide",
        action="store_true",
        help="print every column of the tables at their full width (default: the main columns, fitted to the "
        "terminal, COLUMNS or 80; bench.json holds every figure either way)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    managers = [m.strip() for m in args.managers.split(",") if m.strip()]
    unknown = [m for m in managers if m not in (*SERVE_MANAGERS, "no_hybrid")]
    if unknown:
        print(f"unknown manager {unknown[0]!r}; known: {', '.join((*SERVE_MANAGERS, 'no_hybrid'))}", file=sys.stderr)
        return 2
    if "floor" in managers and not floor.available():
        print(floor.MISSING, file=sys.stderr)
        return 2
    if not vllm_ready():
        return 2
    windows = args.admission_window or [0]
    from hybrid_alloc.bench.offline import admission_options_error

    if refused := admission_options_error("bench", windows, args.admission_threshold):
        print(refused, file=sys.stderr)
        return 2
    from tqdm import tqdm

    from hybrid_alloc.bench.shapes import ALIASES, SHAPES, by_name

    models = args.model or list(DEFAULT_MODELS)
    serve_models = args.model or list(SERVE_MODELS)
    for m in models:
        if m not in SHAPES and m not in ALIASES:
            print(f"unknown model shape {m!r}; built in: {', '.join([*SHAPES, *ALIASES])}", file=sys.stderr)
            return 2
    workloads = args.workload or ["serve", "throughput", "shared-prefix", "decode", "memory"]
    conc = args.decode_concurrency or [256, 1024]
    plan: list[tuple[str, str, str, Any]] = []
    if "serve" in workloads:
        for m in serve_models:
            if "two_level" in managers and by_name(m).mamba_state is None:
                print(
                    f"two_level: skipped on {m} (no state group: two-level pages are for state-space shapes)",
                    file=sys.stderr,
                )
            for w in windows:
                for mg in managers:
                    if mg in SERVE_MANAGERS and (mg != "two_level" or by_name(m).mamba_state is not None):
                        plan.append((m, "serve", mg, w))
    # floor, hit_aware and the +hints managers: the serve workload only.
    managers = [m for m in managers if m in ("vllm", "hybrid_alloc", "no_hybrid")]
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
        shape = by_name(model)
        bar.set_postfix_str(f"{model} {scen} {mg}" + (f" window {n}" if scen == "serve" and n else ""))
        if scen == "serve":
            r = run_serve(shape, mg, args, window=n)
        elif scen in ("throughput", "shared-prefix"):
            if scen == "throughput":
                reqs = throughput_requests(args.num_prompts, args.input_len, args.output_len)
            else:
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
                "admission_windows": getattr(args, "admission_window", None) or [0],
                "admission_threshold": getattr(args, "admission_threshold", None),
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
    wide = getattr(args, "wide", False)
    print_serve_table(rows, release, wide)
    print_table([r for r in rows if not r["scenario"].startswith("serve")], release, wide)
    print_breakdown(rows, wide)
    print_memory(memory or [], wide)
    print(f"\nJSON: {jpath}")
    if not args.no_plot:
        ppath = os.path.join(args.out_dir, "bench.png")
        if plot(results, rows, ppath):
            print(f"plot: {ppath}")


def print_table(rows: list[dict[str, Any]], vllm_release: str | None = None, wide: bool = False) -> None:
    """The scenarios' table (throughput, shared-prefix, decode-N): by default the main columns,
    which fit 80 columns; ``wide`` (``--wide``) every column."""
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
    if not wide:
        cols = [
            ("model", "model", "{}"),
            ("scenario", "scenario", "{}"),
            ("manager", "manager", "{}"),
            ("kv_us_median", "KV us", "{:.1f}"),
            ("step_us_median", "step us", "{:.0f}"),
            ("kv_speedup_vs_vllm", "KV x vs vLLM", "{:.1f}"),
            ("step_speedup_vs_vllm", "step x", "{:.2f}"),
        ]
    if not rows:
        return
    timer = [r["timer_overhead_ns_per_call"] for r in rows] + [r["timer_overhead_ns_per_method_call"] for r in rows]
    caption = f"timer cost subtracted per timed call: {min(timer):.0f}-{max(timer):.0f} ns" if timer else ""
    if not wide:
        caption += "; us: medians (p50) per step, x: vLLM's / ours; every column: --wide, or bench.json"
    title = f"hybrid-alloc bench (vLLM {vllm_release} scheduler, fabricated outputs)"
    render_table(title, cols, rows, caption, wide)


def print_breakdown(rows: list[dict[str, Any]], wide: bool = False) -> None:
    """Where the KV time of each serve and decode scenario goes, by call: means per timed step
    (a total and its parts are the same statistic, so the parts add up to the total). Each
    scenario's line wraps between its parts, to the terminal's width (one line with ``wide``)."""
    lines = []
    for r in rows:
        if not (r.get("running_requests") or r.get("clients")) or r["manager"] == "no_hybrid":
            continue
        bd = list(r.get("kv_breakdown", {}).items())
        parts = [f"{name} {v['us_per_step']:.1f} us ({v['calls_per_step']:.1f} calls)" for name, v in bd[:6]]
        rest = sum(v["us_per_step"] for _, v in bd[6:])
        if bd[6:]:
            parts.append(f"{len(bd) - 6} other calls {rest:.1f} us")
        lines.append((f"{r['model']} {r['scenario']} {r['manager']}: KV {r['kv_us_mean']:.1f} us/step = ", parts))
    if lines:
        say("KV time per step by call (means per timed step; calls per timed step in brackets):", wide)
        for head, parts in lines:
            say_parts(head, parts, " + ", wide, indent="  ")


MANAGER_STYLE = {
    "vllm": ("tab:blue", "vLLM's KVCacheManager"),
    "hybrid_alloc": ("tab:orange", "hybrid_alloc"),
    "floor": ("tab:gray", "floor probe (decode call a constant)"),
    "hit_aware": ("tab:red", "hybrid_alloc, hit-aware"),
    "hybrid_alloc+hints": ("tab:brown", "hybrid_alloc + KV hints"),
    "hit_aware+hints": ("tab:pink", "hybrid_alloc, hit-aware + KV hints"),
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
    decode-N means); the speedups (KV and whole step) per scenario, the statistic its table
    gives (serve: ratios of means; the other scenarios: ratios of medians); and the
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
    # The speedups, the statistic of the table each scenario is in: the serve table's ratios of
    # means (KV on timed steps, step on bare steps, wall), the scenarios' table's ratios of medians.
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
    for j, (label, color, serve_key, median_key) in enumerate(
        (
            ("KV time, vLLM's / ours", "tab:green", "serve_kv_x", "kv_speedup_vs_vllm"),
            ("whole step (wall), vLLM's / ours", "tab:purple", "serve_step_x", "step_speedup_vs_vllm"),
        )
    ):
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        ys = [
            float(by[(m, s, "hybrid_alloc")].get(serve_key if s.startswith("serve") else median_key, 0.0))
            for m, s in keys
        ]
        bars = ax_x.bar(xs, ys, width, color=color, label=label)
        for b, y in zip(bars, ys):
            ax_x.annotate(f"{y:.1f}x", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax_x.axhline(1.0, color="gray", linewidth=0.8)
    ax_x.set_xticks(range(len(keys)))
    ax_x.set_xticklabels(
        [f"{m}\n{s} ({'means' if s.startswith('serve') else 'medians'})" for m, s in keys],
        fontsize=7,
        rotation=30,
        ha="right",
    )
    ax_x.set_yscale("log")
    top = ax_x.get_ylim()[1]
    ax_x.set_ylim(top=top * 4)  # room above the bars for the legend
    ax_x.set_ylabel("speedup over vLLM's manager (x; the tables' statistic)")
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
    drawn = {r.manager for r in runs}  # the legend names only the managers drawn (floor only when it ran)
    handles = [
        Line2D([], [], color=c, linewidth=6, label=lab) for mg, (c, lab) in MANAGER_STYLE.items() if mg in drawn
    ] + [
        Line2D([], [], color="black", marker=marker[m], linestyle="none", markerfacecolor="white", label=m)
        for m in models
    ]
    if handles:
        fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=90)
    return True
