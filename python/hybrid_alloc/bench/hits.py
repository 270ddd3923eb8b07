"""``hybrid-alloc bench --suite hits`` (or ``hybrid-alloc hits``): prefix-cache hits on hybrid
models, on vLLM's real ``Scheduler`` (offline, fabricated model outputs), under three
retention policies: ``exact`` and ``dense`` (vLLM's own manager, default and dense
retention) and ``hit-aware`` (hybrid_alloc with ``HYBRID_ALLOC_POLICY=hit-aware``), and
``pinned`` on the sightings workload (:mod:`hybrid_alloc.bench.hits_run` says what each is and
what a run measures). This module is the command: its options and the cells it runs, each
workload on each shape under each budget, policy, prefix match unit and admission window.

| module | holds |
|---|---|
| ``hits.py`` | the command: ``parse_args``, ``main`` (the cells), ``cell_unit``, ``pressure_of`` |
| ``hits_report.py`` | what it prints and writes: the progress lines, the tables, ``hits.json``, ``hits.png`` |
| ``hits_run.py`` | one cell on vLLM's real scheduler (``run``), its ``Result``, the policies |
| ``hits_measure.py`` | what a cell measures beyond vLLM's stats (shares, refusals, hint counters), the simulated clock |
| ``hits_workloads.py`` | the workloads, the shapes ``--shape`` names, the pool budgets (``ample``, ``pressure``) |
| ``shapes.py`` | the shapes themselves: the one registry every bench reads |

Imports go down the table (``hits`` imports the ``hits_*`` modules, ``hits_report`` imports
``hits_run`` and ``hits_workloads``, ``hits_run`` imports ``hits_measure`` and ``hits_workloads``,
``hits_measure`` imports ``hits_workloads``);
``shapes`` and ``offline`` are imported inside the functions that need them, so ``--help``
loads neither torch nor vLLM.

Workloads (:mod:`hybrid_alloc.bench.hits_workloads`): ``chat``, ``shared``, ``resend`` and
``sightings`` by default, each at ``ample`` memory and under ``pressure`` (a pool of
``--pressure`` times the live working set; ``sightings``: ample only). ``--size small`` is the
CI size; ``--size full`` the issue's.

Shapes: ``gemma3`` (sliding window 1024, five window layers per full one) and ``gptoss``
(window 128, alternating), block size 16; ``qwen35`` (Qwen3-Next / 3.5 / 3.6: three Gated
DeltaNet layers per full-attention one) and ``nemotronh`` (Nemotron-H 8B: Mamba2 with its
prefill checkpoint block), both Mamba "align" at the attention block size vLLM picks for them
on a Hopper GPU (544 and 1040 tokens: :func:`hybrid_alloc.bench.shapes.hopper_block_size`).

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
prompt's 2nd sighting on, and the blocks keyed inside a block at the end and at the peak; a
second table holds them, with each row's prefill over vLLM's with the unit
(:mod:`hybrid_alloc.bench.hits_report`).

Issue 38 (asked for by name): the KV hints (docs/hit-aware.md). Workload ``agent`` (sessions
whose turns are separated by tool pauses of simulated time while other traffic churns the
cache; ``pressure`` only) with hint policies ``retain`` and ``pin``; workload ``shortsys`` (short
shared system prompts of 100-2000 tokens off every grid) with hint policy ``checkpoint``: each
is hit-aware with the workload's hints on its requests (vLLM's ``KvHintsEnvelope``). Their
tables (:mod:`hybrid_alloc.bench.hits_report`): each resumed turn's share of its previous
context that hit, the allocations refused and those pins may have delayed; the sightings that
hit their whole prompt from the 2nd on; and our manager's hint counters. The agent workload
runs on a simulated clock that our manager reads (:mod:`hybrid_alloc.bench.hits_measure`).

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
import math
import os
import sys
from typing import Any

from hybrid_alloc.bench.common import vllm_ready
from hybrid_alloc.bench.hits_report import progress, report
from hybrid_alloc.bench.hits_run import ALL_POLICIES, POLICIES, Result, run
from hybrid_alloc.bench.hits_workloads import (
    BUDGETS,
    DEFAULT_PRESSURE,
    DEFAULT_SHAPES,
    DEFAULT_WORKLOADS,
    HINT_POLICIES,
    SHAPE_NAMES,
    WORKLOADS,
    Workload,
    budget_blocks,
    shapes,
    workloads,
)


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
        "300-2000 tokens; agent: sessions with tool pauses of simulated time while other traffic churns the "
        "cache; shortsys: short shared system prompts of 100-2000 tokens)",
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
        help="repeatable; default exact, dense, hit-aware (and pinned on sightings; retain and pin on agent; "
        "checkpoint on shortsys: hit-aware with those hints on the requests)",
    )
    p.add_argument(
        "--pressure",
        type=float,
        help="pressure pool = this times the live working set, every shape (default: 3 at --size full, and on "
        "agent at both sizes; at --size small, where a pool of 3x holds everything, "
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
    p.add_argument(
        "--pin-share",
        type=float,
        metavar="F",
        help="the pinned share of the pool for hit-aware rows (HYBRID_ALLOC_PIN_SHARE: what pins and retains at "
        "the high level may hold; default the manager's, 0.25)",
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


def pressure_of(args: argparse.Namespace, shape: str, wl: Workload | None = None) -> float:
    """The pressure multiple for ``shape``: ``--pressure`` if given, else the workload's own
    (``Workload.pressure``: the agent workload's 3 at both sizes), else :data:`DEFAULT_PRESSURE`."""
    given = getattr(args, "pressure", None)
    if given is not None:
        return float(given)
    if wl is not None and wl.pressure is not None:
        return wl.pressure
    return DEFAULT_PRESSURE[args.size][shape]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not vllm_ready():
        return 2
    windows = args.admission_window or [0]
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        print("hybrid-alloc hits: --max-num-seqs takes 1 or more", file=sys.stderr)
        return 2
    from hybrid_alloc.bench.offline import admission_options_error

    if refused := admission_options_error("hits", windows, args.admission_threshold):
        print(refused, file=sys.stderr)
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
                if b not in wls[wn].budgets:
                    continue  # sightings: one request at a time, nothing to pressure; agent: pressure only
                pressure = pressure_of(args, sn, wls[wn])
                nb = budget_blocks(all_shapes[sn], wls[wn], b, pressure)
                default = (*POLICIES, *(["pinned"] if wls[wn].pins else []), *wls[wn].hint_policies)
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
                        if (pol == "pinned" and not wls[wn].pins) or (
                            pol in HINT_POLICIES and pol not in wls[wn].hint_policies
                        ):
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
                                pin_share=args.pin_share,
                            )
                            r.budget = b
                            if b == "pressure":
                                r.extra["pressure"] = pressure
                            results.append(r)
                            progress(sn, wn, b, pol, nb, r, getattr(args, "wide", False))
    report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
