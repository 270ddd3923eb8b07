"""What the hits bench prints and writes: a progress line on stderr as each cell ends, the
table (the main columns fitted to the terminal, or with ``--wide`` the full one as markdown),
the sightings table, issue 30's unit table, ``hits.json`` and ``hits.png``.

| name | holds |
|---|---|
| ``progress`` | the line on stderr as a cell ends |
| ``rows_of`` | the results as the rows of the tables and of ``hits.json`` |
| ``policy_label`` ... ``window_label``, ``versus_vllm_unit`` | how a row's cells read |
| ``print_table``, ``print_unit_table`` | the tables |
| ``print_agent_table``, ``print_shortsys_table``, ``hints_label`` | issue 38's tables, and a row's hint counters |
| ``report`` | everything after the runs: ``hits.json``, the tables, the plot |
| ``plot`` | ``hits.png`` (nothing, and one line, without matplotlib) |

Issue 30's table (printed when some row set a prefix match unit or has shared prompts): each
row with its unit, its prefill over vLLM's exact retention with the unit in the same cell, the
share of shared-prompt tokens hit from each prompt's 2nd sighting on, and the blocks keyed
inside a block at the end and at the peak. Issue 38's tables (printed when an agent or
shortsys row ran): the agent rows with each resumed turn's share of its previous context that
hit, the allocations refused and those pins may have delayed, the hint counters and the blocks
pins and retains held at the peak; the shortsys rows with the sightings that hit their whole
prompt from the 2nd on and the first such sighting per prompt. Nothing here imports vLLM; matplotlib only in
:func:`plot`. Cost: O(rows) per table and per panel of the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hybrid_alloc.bench.common import pyplot, render_table
from hybrid_alloc.bench.hits_run import ALL_POLICIES, Result
from hybrid_alloc.bench.hits_workloads import BUDGETS, DEFAULT_PRESSURE, HINT_POLICIES, SHAPE_NAMES, WORKLOADS


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
            "whole_sightings",
            "refused_admissions",
            "refused_running",
            "refused_with_pins",
            "refused_withheld",
            "pin_delayed",
            "hint_counters",
            "hint_held_peak",
            "resumed",
            "sim_seconds",
            "churn_per_pause",
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
    if pol in HINT_POLICIES:
        pol = f"hit-aware + {pol}"
    if row.get("pin_share") is not None:
        pol = f"{pol} (pinned share {row['pin_share']:g})"
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
    if any(r["workload"] == "agent" for r in rows):
        print_agent_table([r for r in rows if r["workload"] == "agent"])
    if any(r["workload"] == "shortsys" for r in rows):
        print_shortsys_table([r for r in rows if r["workload"] == "shortsys"], versus_vllm_unit(rows), rows)


def hints_label(row: dict[str, Any]) -> str:
    """A row's hint counters: "received / applied / refused / expired" ("-" for vLLM's manager,
    which has none)."""
    c = row.get("hint_counters")
    if not c:
        return "-"
    return f"{c.get('received', 0)} / {c.get('applied', 0)} / {c.get('refused', 0)} / {c.get('expired', 0)}"


def print_agent_table(rows: list[dict[str, Any]]) -> None:
    """Issue 38's agent table (markdown): each row's resumed turns (the share of each resumed
    turn's previous context, on the hash grid, that hit: in all, the least of any turn, and the
    turns that hit at least 90%), its hit rate and prefill tokens (the other traffic's
    included), the admissions refused and those pins may have delayed (``Refusals``), the hint
    counters, the blocks pins and retains held at the peak, and the other traffic's prompt
    tokens in a mean pause over the live working set."""
    units = any(r.get("prefix_match_unit") for r in rows)
    print(
        "\n| shape | block | unit | policy | resumed turns: context hit | least | turns >= 90% | hit rate | "
        "prefill tokens | refused admissions (pin-delayed) | hints recv / applied / refused / expired | "
        "held by pins+retains, peak | churn per pause |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        res = r.get("resumed") or {}
        share = f"{100 * res['share']:.1f}%" if res else "-"
        least = f"{100 * res['least']:.0f}%" if res else "-"
        turns = f"{res['turns_90']}/{res['turns']}" if res else "-"
        held = r.get("hint_held_peak")
        churn = r.get("churn_per_pause")
        print(
            f"| {r['shape']} | {r.get('block_size', '')} | {unit_label(r)} | {policy_label(r, units)} | {share} | "
            f"{least} | {turns} | {100 * r['hit_rate']:.1f}% | {r['prefill_tokens']} | "
            f"{r.get('refused_admissions', 0)} ({r.get('pin_delayed', 0)}) | {hints_label(r)} | "
            f"{'-' if held is None else held} | {'-' if churn is None else f'{churn:.1f}x'} |"
        )


def print_shortsys_table(rows: list[dict[str, Any]], versus: dict[int, float], all_rows: list[dict[str, Any]]) -> None:
    """Issue 38's short-system-prompt table (markdown): each row's sightings, from each prompt's
    2nd on, that hit the whole prompt on the hash grid (prompts shorter than the grid left out),
    the first sighting from which each prompt (by length) hit whole ("-": never), the 2nd-sighting
    share, hit rate, prefill tokens and their ratio to vLLM's with the unit, and the hint
    counters. ``versus`` is :func:`versus_vllm_unit` of ``all_rows``."""
    units = any(r.get("prefix_match_unit") for r in rows)
    print(
        "\n| shape | block | budget | unit | policy | whole from 2nd | first whole sighting, by prompt length | "
        "2nd-sighting share | hit rate | prefill tokens | vs vLLM+unit | hints recv / applied / refused / expired |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    index = {id(r): i for i, r in enumerate(all_rows)}
    for r in rows:
        w = r.get("whole_sightings") or {}
        whole = f"{w['whole']}/{w['sightings']}" if w and w["sightings"] else "-"
        first = w.get("first_whole") or {}
        firsts = " ".join(f"{n}:{'-' if k is None else k}" for n, k in sorted(first.items(), key=lambda kv: int(kv[0])))
        vs = versus.get(index.get(id(r), -1))
        print(
            f"| {r['shape']} | {r.get('block_size', '')} | {r['budget']} | {unit_label(r)} | {policy_label(r, units)} | "
            f"{whole} | {firsts or '-'} | {share_label(r)} | {100 * r['hit_rate']:.1f}% | {r['prefill_tokens']} | "
            f"{'-' if vs is None else f'{vs:.3f}x'} | {hints_label(r)} |"
        )


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
