"""``hybrid-alloc capacity`` (or ``hybrid-alloc bench --suite capacity``): how many requests
fit in the same KV cache memory on state-space hybrids (issue 37), on vLLM's real
``Scheduler`` (offline, fabricated model outputs), under three managers at equal memory:
vLLM's own, ours (exact), and ours with two-level pages (small attention blocks inside
state-sized pages: :mod:`hybrid_alloc.vllm.pages`). One run is
:func:`hybrid_alloc.bench.capacity_run.run`, which says what each figure means.

| module | holds |
|---|---|
| ``capacity.py`` | the command: its options and sizes, the runs, the table, ``capacity.json``, ``capacity.png`` |
| ``capacity_run.py`` | one run: the traces, the scheduler under a column's manager, the figures |

Shapes (real per-layer sizes, :mod:`hybrid_alloc.bench.shapes`; vLLM's Hopper blocks):
``falconh1`` (Falcon-H1-7B, 1568-token blocks), ``qwen36`` (Qwen3.6-35B-A3B, 1088),
``nemotron3nano`` (Nemotron-3-Nano-30B-A3B, 2096). Traces (``docs/two-level-pages.md``): ``chat``
(closed-loop clients, prompts 100-1500 tokens log-uniform, outputs 50-400) and ``long``
(prompts 4k-16k). ``--size full``: a 40 GiB pool, 512 chat clients, 256 long-context clients
(issue 37's sizes); ``--size small`` (the default, minutes on two cores): an eighth of each.
Imports vLLM (through the runs) only once the options are read, so ``--help`` loads neither
torch nor vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from hybrid_alloc.bench.capacity_run import MANAGERS, Result, Trace, run
from hybrid_alloc.bench.common import Columns, pyplot, render_table, vllm_ready

SHAPE_NAMES = ("falconh1", "qwen36", "nemotron3nano")
GiB = 1 << 30
#: Per size: the pool (bytes, planned by vLLM's planner) and the traces.
SIZES: dict[str, tuple[int, tuple[Trace, ...]]] = {
    "full": (
        40 * GiB,
        (
            Trace("chat", clients=512, per_client=6, prompt=(100, 1500), output=(50, 400)),
            Trace("long", clients=256, per_client=4, prompt=(4000, 16000), output=(50, 400), seed=1),
        ),
    ),
    "small": (
        5 * GiB,
        (
            Trace("chat", clients=64, per_client=8, prompt=(100, 1500), output=(50, 400)),
            Trace("long", clients=32, per_client=4, prompt=(4000, 16000), output=(50, 400), seed=1),
        ),
    ),
}
LABELS = {"vllm": "vLLM", "ours": "ours", "two-level": "two-level"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hybrid-alloc capacity",
        description="Running requests, preemptions and pages per request on state-space hybrids at equal KV "
        "memory: vLLM's manager, ours, ours with two-level pages; on vLLM's real scheduler. Prints a table, "
        "writes capacity.json and capacity.png.",
    )
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="small",
        help="small (default: a 5 GiB pool, 64 chat / 32 long-context clients) or full (issue 37's: 40 GiB, 512 / 256)",
    )
    p.add_argument("--full", action="store_const", const="full", dest="size", help="the same as --size full")
    p.add_argument(
        "--shape", action="append", choices=SHAPE_NAMES, help=f"repeatable; default {', '.join(SHAPE_NAMES)}"
    )
    p.add_argument("--trace", action="append", choices=["chat", "long"], help="repeatable; default both")
    p.add_argument("--manager", action="append", choices=MANAGERS, help=f"repeatable; default {', '.join(MANAGERS)}")
    p.add_argument(
        "--small-block",
        type=int,
        default=64,
        help="two-level: the attention block inside a page, tokens (HYBRID_ALLOC_SMALL_BLOCK; default 64)",
    )
    p.add_argument(
        "--headroom",
        type=int,
        help="two-level: the admission headroom, slots per running request (HYBRID_ALLOC_PAGES_HEADROOM; "
        "default: the layout's, 1; 0 turns it off)",
    )
    p.add_argument("--pool-gib", type=float, help="the pool, GiB (default: the size's)")
    p.add_argument("--clients", type=float, help="scale every trace's clients by this (default 1)")
    p.add_argument("--out-dir", default=os.environ.get("HYBRID_ALLOC_BENCH_OUT", "bench-out"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--wide", action="store_true", help="every column, at full width")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.small_block < 1:
        print("hybrid-alloc capacity: --small-block takes a positive number of tokens", file=sys.stderr)
        return 2
    if args.headroom is not None and args.headroom < 0:
        print("hybrid-alloc capacity: --headroom takes a whole number of slots (0 or more)", file=sys.stderr)
        return 2
    if not vllm_ready():
        return 2
    from hybrid_alloc.bench.shapes import SHAPES

    pool, traces = SIZES[args.size]
    if args.pool_gib is not None:
        pool = int(args.pool_gib * GiB)
    if args.clients is not None:
        traces = tuple(replace(t, clients=max(1, round(t.clients * args.clients))) for t in traces)
    results: list[Result] = []
    skipped: dict[str, str] = {}
    for sn in args.shape or SHAPE_NAMES:
        for t in traces:
            if args.trace and t.name not in args.trace:
                continue
            for m in args.manager or MANAGERS:
                if m in skipped:
                    continue
                try:
                    r = run(SHAPES[sn], t, m, pool, small=args.small_block, headroom=args.headroom)
                except RuntimeError as e:
                    if m != "two-level":
                        raise
                    skipped[m] = str(e)
                    print(f"hybrid-alloc capacity: {e}; its column is left out", file=sys.stderr)
                    continue
                results.append(r)
                print(
                    f"{sn} {t.name} {m}: {r.mean_running:.1f} running, {r.pages_per_request:.2f} pages/request, "
                    f"{r.preemptions} preemptions ({r.seconds:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    report(results, args, pool, traces)
    return 0


def with_ratios(results: list[Result]) -> list[dict[str, Any]]:
    """Each run's summary, with its running requests, capacity and prefill tokens over vLLM's
    on the same shape and trace (``*_vs_vllm``)."""
    rows = [r.summary() for r in results]
    base = {(r["shape"], r["trace"]): r for r in rows if r["manager"] == "vllm"}
    for r in rows:
        b = base.get((r["shape"], r["trace"]))
        if b is None:
            continue
        for key in ("mean_running", "capacity", "prefill_tokens"):
            r[f"{key}_vs_vllm"] = r[key] / b[key] - 1 if b[key] else 0.0
    return rows


COLUMNS: Columns = [
    ("shape", "shape", "{}"),
    ("trace", "trace", "{}"),
    ("manager", "manager", "{}"),
    ("pool_pages", "pages", "{}"),
    ("mean_running", "running", "{:.1f}"),
    ("mean_running_vs_vllm", "vs vLLM", "{:+.1%}"),
    ("preemptions", "preempt", "{}"),
    ("mean_waiting", "waiting", "{:.1f}"),
    ("pages_per_request", "pages/req", "{:.2f}"),
    ("capacity_vs_vllm", "capacity vs vLLM", "{:+.1%}"),
    ("trapped_pages", "trapped", "{:.1f}"),
    ("prefill_tokens", "prefill tokens", "{}"),
]
WIDE_ONLY = {"pool_pages", "mean_waiting", "trapped_pages", "prefill_tokens"}


def report(results: list[Result], args: argparse.Namespace, pool: int, traces: tuple[Trace, ...]) -> None:
    rows = with_ratios(results)
    cols = COLUMNS if args.wide else [c for c in COLUMNS if c[0] not in WIDE_ONLY]
    render_table(
        f"Capacity at equal memory ({pool / GiB:g} GiB pool, vLLM's planner; vLLM's real scheduler)",
        cols,
        rows,
        caption="running, waiting: means over the steady state (from the step at which half as many requests "
        "finished as there are clients to the step at which a client first has none left); "
        "pages/req: used pages over running requests; trapped: free slots inside used pages, as pages "
        "(two-level's fragmentation)",
        wide=args.wide,
    )
    os.makedirs(args.out_dir, exist_ok=True)
    payload = {
        "size": args.size,
        "pool_bytes": pool,
        "small_block": args.small_block,
        "headroom": args.headroom,
        "traces": [t.__dict__ for t in traces],
        "rows": rows,
        "running_series": [
            {"shape": r.shape, "trace": r.trace, "manager": r.manager, "running": r.running, "window": r.window}
            for r in results
        ],
    }
    path = os.path.join(args.out_dir, "capacity.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=list)
    print(f"wrote {path}")
    if not args.no_plot and results:
        out = plot(results, os.path.join(args.out_dir, "capacity.png"))
        if out:
            print(f"wrote {out}")


def plot(results: list[Result], path: str) -> str | None:
    """Running requests over the scheduler's steps, one panel per shape and trace, one line per
    manager, and a dotted line at what the pool holds at that manager's pages per request; the
    measured window shaded, each line's mean in the legend. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    shapes = list(dict.fromkeys(r.shape for r in results))
    traces = list(dict.fromkeys(r.trace for r in results))
    colors = {"vllm": "#7f7f7f", "ours": "#1f77b4", "two-level": "#d62728"}
    fig, axes = plt.subplots(
        len(traces), len(shapes), figsize=(4.6 * len(shapes), 3.4 * len(traces)), squeeze=False, sharex=False
    )
    for i, tn in enumerate(traces):
        for j, sn in enumerate(shapes):
            ax = axes[i][j]
            panel = [r for r in results if r.shape == sn and r.trace == tn]
            base = next((r for r in panel if r.manager == "vllm"), None)
            for r in panel:
                gain = ""
                if base is not None and r is not base and base.mean_running:
                    gain = f" ({r.mean_running / base.mean_running - 1:+.0%})"
                vllm = r.manager == "vllm"  # wide and pale: ours (exact) runs on top of it
                ax.plot(
                    r.running,
                    "--" if r.manager == "ours" else "-",
                    color=colors.get(r.manager, "black"),
                    linewidth=3.5 if vllm else 1.2,
                    alpha=0.45 if vllm else 1.0,
                    label=f"{LABELS.get(r.manager, r.manager)}: {r.mean_running:.0f} running{gain}, "
                    f"{r.pages_per_request:.2f} pages/req",
                )
                # What the pool holds at this manager's pages per request (above the line where
                # the clients, not the pool, bind).
                ax.axhline(r.capacity, linestyle=":", color=colors.get(r.manager, "black"), linewidth=1)
                if vllm:
                    ax.axvspan(*r.window, color="#eeeeee", zorder=0)
            ax.set_title(f"{sn}, {tn}", fontsize=10)
            ax.set_xlabel("scheduler step")
            if j == 0:
                ax.set_ylabel("running requests")
            ax.legend(fontsize=7, loc="lower right")
            ax.grid(alpha=0.3)
    fig.suptitle(
        "Running requests at equal KV memory (shaded: vLLM's measured window; dotted: pool pages / pages per request)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
