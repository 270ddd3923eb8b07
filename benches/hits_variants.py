"""Variants of the hits bench's state-space workloads, out of CI: the shapes of
``hybrid-alloc hits`` (Qwen3.5-like at 544-token blocks, Nemotron-H-like at 1040) on
workloads the issue's table does not hold (other system-prompt lengths, fewer requests in
flight, shorter replies, longer contexts), exact (vLLM's own manager) against hit-aware
with ample memory. Prints, per workload, both hit rates, the ideal and the scheduler steps,
and flags a hit-aware row more than 1 point below the ideal or more than 2% above exact's
steps: what the first-sighting stops cost and gain off the table they were tuned on.

    PYTHONPATH=target/pysite python benches/hits_variants.py   # about 2 minutes

Needs vLLM (the cached environment of ``scripts/test-env.sh``).
"""

from __future__ import annotations

import argparse
from typing import Any


def variants() -> list[tuple[str, Any]]:
    from hybrid_alloc.bench.hits_workloads import resend_workload, shared_workload, sightings_workload

    out: list[tuple[str, Any]] = []
    for n in (1500, 3000, 4500, 7000):
        out.append(
            (f"shared: 8 prompts of {n}, 256 requests, 16 in flight", shared_workload(8, n, 256, (300, 800), 16))
        )
    out.append(
        (
            "shared: 4 prompts of 3000, 128 requests, 4 in flight, replies of 32",
            shared_workload(4, 3000, 128, (50, 200), 4, out_len=32),
        )
    )
    out.append(
        (
            "resend: 16 contexts of 5000-6000, replies of 16",
            resend_workload(16, (5000, 6000), 4, (16, 64), 16, out_len=16),
        )
    )
    out.append(
        (
            "resend: 8 contexts of 2000-9000, 4 in flight, replies of 32",
            resend_workload(8, (2000, 9000), 3, (16, 64), 4, out_len=32),
        )
    )
    out.append(("sightings: a 2500-token prompt, replies of 16", sightings_workload(6, 2500, (300, 800), out_len=16)))
    out.append(("sightings: a 5000-token prompt, replies of 16", sightings_workload(6, 5000, (300, 800), out_len=16)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=["qwen35", "nemotronh"], help="repeatable; default both")
    args = p.parse_args()
    from hybrid_alloc.bench.hits_run import run
    from hybrid_alloc.bench.hits_workloads import budget_blocks, shapes

    all_shapes = shapes()
    print("| shape | workload | ideal | exact | hit-aware | steps (exact / hit-aware) | flags |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shape or ["qwen35", "nemotronh"]:
        shape = all_shapes[name]
        for label, wl in variants():
            nb = budget_blocks(shape, wl, "ample", 3.0)
            exact = run(shape, wl, "exact", nb)
            aware = run(shape, wl, "hit-aware", nb)
            flags = []
            if aware.hit_rate < aware.ideal_hit_rate - 0.01:
                flags.append("more than 1 point below the ideal")
            if aware.steps > exact.steps * 1.02:
                flags.append(f"steps +{100 * (aware.steps / exact.steps - 1):.1f}%")
            if not (exact.finished and aware.finished):
                flags.append("did not finish")
            print(
                f"| {name} | {label} | {100 * aware.ideal_hit_rate:.1f}% | {100 * exact.hit_rate:.1f}% | "
                f"{100 * aware.hit_rate:.1f}% | {exact.steps} / {aware.steps} | {'; '.join(flags)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
