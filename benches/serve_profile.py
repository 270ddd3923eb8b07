"""The serve workload's steps under a deterministic profiler (issue 19, item 2).

Runs ``hybrid-alloc bench --workload serve``'s closed loop (gemma-2-27b shape, ``--clients``
clients, 2048-token prompts with a 512-token shared prefix, outputs 256 +- 128) with one
manager and no timer installed, to its steady state (half the clients replaced), then
``--steps`` more steps. Under callgrind, started with instrumentation off, it turns
instrumentation on for those steps only (``callgrind_control -i on``), so the profile holds
real steps with 1024 distinct requests and nothing of the warm-up:

    PYTHONPATH=target/pysite valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes \\
        --callgrind-out-file=/tmp/sp.%p python benches/serve_profile.py --steps 4
    callgrind_annotate --inclusive=yes /tmp/sp.<pid> | grep -E 'hybrid_alloc|PyObject_GetAttr'

Instruction counts (``Ir``) and the simulated cache's misses (``D1mr``, ``DLmr``: first
level and last level) do not depend on the machine's load. Without valgrind, it prints the
wall time of the steps.

``--manager hit_aware`` is ours under hit-aware; ``hit_aware+hints`` the same with the serve
bench's KV hints on every request (``serve_hints``: a retain at the high level, a pin lease on
the shared prefix, a checkpoint at its end, a session; TTLs of ``--hints-ttl`` seconds) and the
manager's clock on a simulated one, ``--step-ms`` a step, so the leases and retains end at the
same steps on every run: a fixed workload whose instruction counts compare two builds (issue 38).
"""

from __future__ import annotations

import argparse
import array
import logging
import os
import shutil
import subprocess
import time
import zlib
from collections.abc import Callable
from typing import Any


def add_loop_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The closed loop's options (``run_closed_loop``), ``--steps`` defaulting to ``steps``."""
    p.add_argument(
        "--manager", default="hybrid_alloc", choices=["hybrid_alloc", "vllm", "hit_aware", "hit_aware+hints"]
    )
    p.add_argument("--model", default="gemma-2-27b")
    p.add_argument("--clients", type=int, default=1024)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--hints-ttl", type=float, default=5.0, help="hit_aware+hints: the retains' and leases' TTL, s")
    p.add_argument("--step-ms", type=float, default=25.0, help="hit_aware+hints: simulated milliseconds a step")


def run_closed_loop(args: argparse.Namespace, on_steady: Callable[[Any], None]) -> Any:
    """Runs the serve workload's closed loop with ``args.manager`` to its steady state (half
    the clients replaced), calls ``on_steady(scheduler)`` once, runs ``args.steps`` more steps
    and returns the scheduler."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from hybrid_alloc.bench.common import env_set
    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup, fabricate_output, make_request
    from hybrid_alloc.bench.serve import ServeRequests, serve_hints, serve_pool_blocks

    n = args.clients
    stream = ServeRequests(2048, 256, 128, 0.25)
    base = args.manager.removesuffix("+hints")
    policy = {"HYBRID_ALLOC_POLICY": "hit-aware"} if base == "hit_aware" else {}
    with env_set(policy):
        sched = SchedulerSetup(
            SHAPES[args.model],
            manager="hybrid_alloc" if base == "hit_aware" else base,  # type: ignore[arg-type]
            num_blocks=serve_pool_blocks(n, stream.max_tokens()),
            max_num_seqs=n,
            max_num_batched_tokens=8192,
        ).build()
    hints = None
    step = [0]
    if base != args.manager:
        hints = serve_hints(len(stream.prefix), args.hints_ttl, "envelope")
        sched.kv_cache_manager._clock = lambda: step[0] * args.step_ms / 1000.0

    def request(k: int) -> Any:
        rid, toks, out = stream(k)
        return make_request(sched, rid, toks, out, **(hints(rid, toks) if hints is not None else {}))

    for k in range(n):
        sched.add_request(request(k))
    next_id, replaced, measured = n, 0, -1
    while measured < args.steps:
        if measured == 0:
            on_steady(sched)
        step[0] += 1
        so = sched.schedule()
        sched.update_from_output(so, fabricate_output(sched, so))
        if measured >= 0:
            measured += 1
        while sched.get_num_unfinished_requests() < n:
            sched.add_request(request(next_id))
            next_id += 1
            replaced += 1
        if measured < 0 and replaced >= n // 2:
            measured = 0
    return sched


def _callgrind(on: bool) -> None:
    if shutil.which("callgrind_control"):
        flag = "on" if on else "off"
        subprocess.run(["callgrind_control", "-i", flag, str(os.getpid())], capture_output=True, check=False)


def main() -> None:
    p = argparse.ArgumentParser()
    add_loop_args(p, steps=4)
    args = p.parse_args()
    t0 = [0.0]

    def start(_sched: Any) -> None:
        _callgrind(True)
        t0[0] = time.perf_counter()

    sched = run_closed_loop(args, start)
    dt = time.perf_counter() - t0[0]
    _callgrind(False)
    print(
        f"{args.manager}: {args.steps} steps in {dt * 1e3:.1f} ms (includes request creation), {len(sched.running)} running"
    )
    if args.manager.endswith("+hints"):
        print("hint stats:", sched.kv_cache_manager.hint_stats())
    alloc = getattr(sched.kv_cache_manager, "_alloc", None)
    if alloc is not None:
        # What the policy decided, in one figure: the free queue's order (a change of any
        # level or eviction order shows).
        order = alloc.free_queue_order()
        print(f"free queue: {len(order)} blocks, digest {zlib.crc32(array.array('I', order).tobytes()):08x}")


if __name__ == "__main__":
    main()
