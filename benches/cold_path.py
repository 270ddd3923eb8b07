"""The decode call's cost with a hot cache and a cold one (issue 19, item 2's profile).

vLLM's real scheduler brings ``--running`` requests (gemma-2-27b shape, 2048-2063-token
prompts) to decoding under vLLM's manager and ours; then, with the scheduler's state left as
it is, each request's decode call (``allocate_slots(r, 1, num_lookahead_tokens=0)``, then
``get_block_ids(allow_none=True)`` on its result, as the scheduler calls them) is timed:
- ``hot``: one request, called ``--reps`` times in a row (everything in L1);
- ``warm``: every request once, in turn, repeatedly (each request's objects are distinct,
  the set of them fits in the last-level cache or nearly);
- ``cold``: every request once, each pass after 64 MiB were written (what the rest of a
  scheduler step does to the caches between two calls of one request).
Only requests whose call is a no-op are timed (the call then changes nothing, so it can be
repeated). Process CPU time, nanoseconds per call, best of ``--rounds``.

    PYTHONPATH=target/pysite python benches/cold_path.py --running 1024

``--callgrind`` (under ``valgrind --tool=callgrind --instr-atstart=no``): instrumentation is
on for one warm pass over the no-op requests only (``callgrind_control -i on``), so the
profile's instruction count over the requests timed is what one decode call costs, with no
machine load in it; ``--managers`` picks the managers (``floor``: ours with the decode call
answered by a C-level constant, ``hybrid_alloc.bench.floor.install_floor``, in the probe build of
``scripts/install-local.sh``: the least any manager costs).

    PYTHONPATH=target/pysite valgrind --tool=callgrind --instr-atstart=no \
        python benches/cold_path.py --managers hybrid_alloc --callgrind

``--crossing`` (under callgrind, with ``--toggle-collect``): the block-crossing decode call
instead, the one whose step needs a new block (``num_computed_tokens`` a multiple of the
block size), and ``get_block_ids(allow_none=True)`` on its result. Such a call changes the
request, so it runs once per request: the first half of those requests warm the code, the
second half are measured, each call routed through a C function of CPython nothing else
calls (``allocate_slots`` through ``operator.call``, ``get_block_ids`` through
``operator.methodcaller``), so that each trampoline's inclusive count over the calls measured
is one call's cost (the trampoline's own few tens of instructions included):

    PYTHONPATH=target/pysite valgrind --tool=callgrind --toggle-collect=_operator_call \
        --toggle-collect=methodcaller_call --callgrind-out-file=/tmp/cx.out \
        python benches/cold_path.py --managers hybrid_alloc --crossing
    callgrind_annotate --inclusive=yes /tmp/cx.out | grep -E '_operator_call|methodcaller_call'
"""

from __future__ import annotations

import argparse
import logging
import operator
import os
import subprocess
import time
from typing import Any


def _bring_to_decode(manager: str, n: int, crossing: bool = False) -> tuple[Any, list[Any]]:
    """The manager with ``n`` requests decoding, and the requests whose next decode call is
    a no-op (``crossing``: those whose next one needs a new block, none of them called)."""
    from hybrid_alloc.bench import main as bench
    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup, fabricate_output, make_request

    floor = manager == "floor"
    manager = "hybrid_alloc" if floor else manager
    shape = SHAPES["gemma-2-27b"]
    setup = SchedulerSetup(
        shape,
        manager=manager,  # type: ignore[arg-type]
        num_blocks=bench.decode_pool_blocks(n, 2064, 64, 16),
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n),
    )
    sched = setup.build()
    for rid, toks, out in bench.decode_requests(n, 2048, seed=n):
        sched.add_request(make_request(sched, rid, toks, out))
    while len(sched.running) < n or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, fabricate_output(sched, so))
    mgr = sched.kv_cache_manager
    if crossing:
        return mgr, [r for r in sched.running if r.num_computed_tokens % sched.cache_config.block_size == 0]
    noop = [r for r in sched.running if mgr.allocate_slots(r, 1, num_lookahead_tokens=0) is mgr.empty_kv_cache_blocks]
    if floor:  # ours, the decode call then answered by a C-level constant (hybrid_alloc.bench.floor)
        from hybrid_alloc.bench.floor import install_floor

        install_floor(mgr)
    return mgr, noop


def _time(mgr: Any, reqs: list[Any], passes: int, flush: bytearray | None) -> float:
    alloc = mgr.allocate_slots
    total = 0
    calls = 0
    pt = time.process_time_ns
    for _ in range(passes):
        if flush is not None:  # a write to every cache line of 64 MiB: evicts the caches
            flush[::64] = bytes([flush[0] ^ 1]) * (len(flush) // 64)
        t = pt()
        for r in reqs:
            alloc(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)
        total += pt() - t
        calls += len(reqs)
    return total / calls


def _crossing(mgr: Any, reqs: list[Any]) -> int:
    """The block-crossing decode calls, and ``get_block_ids(allow_none=True)`` on their
    results: the first half direct (warming the code), the second half routed through the
    C trampolines ``--toggle-collect`` counts. Returns how many calls got new blocks."""
    alloc, empty = mgr.allocate_slots, mgr.empty_kv_cache_blocks
    call, ids = operator.call, operator.methodcaller("get_block_ids", allow_none=True)
    half, crossed = len(reqs) // 2, 0
    for r in reqs[:half]:
        out = alloc(r, 1, num_lookahead_tokens=0)
        out.get_block_ids(allow_none=True)
        crossed += out is not None and out is not empty
    for r in reqs[half:]:
        out = call(alloc, r, 1, num_lookahead_tokens=0)
        ids(out)
        crossed += out is not None and out is not empty
    return crossed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--running", type=int, default=1024)
    p.add_argument("--reps", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--managers", default="vllm,hybrid_alloc")
    p.add_argument("--callgrind", action="store_true", help="instrument one warm pass (see the module's doc)")
    p.add_argument("--crossing", action="store_true", help="the block-crossing call (see the module's doc)")
    args = p.parse_args()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    flush = bytearray(64 << 20)
    for manager in args.managers.split(","):
        mgr, reqs = _bring_to_decode(manager, args.running, args.crossing)
        if args.crossing:
            crossed = _crossing(mgr, reqs)
            half = len(reqs) - len(reqs) // 2
            print(f"{manager}: {len(reqs)} block-crossing decode calls ({crossed} got blocks), {half} routed")
            continue
        if args.callgrind:
            _time(mgr, reqs, 1, None)  # every request's objects warm once
            toggle = ["callgrind_control", "-i"]
            subprocess.run([*toggle, "on", str(os.getpid())], capture_output=True, check=False)
            _time(mgr, reqs, 1, None)
            subprocess.run([*toggle, "off", str(os.getpid())], capture_output=True, check=False)
            print(f"{manager}: instrumented one pass of {len(reqs)} no-op decode calls + get_block_ids")
            continue
        hot = min(_time(mgr, reqs[:1] * args.reps, 1, None) for _ in range(args.rounds))
        warm = min(_time(mgr, reqs, max(1, args.reps // len(reqs)), None) for _ in range(args.rounds))
        cold = min(_time(mgr, reqs, 20, flush) for _ in range(args.rounds))
        print(
            f"{manager}: {len(reqs)} no-op requests of {args.running}: decode call + get_block_ids, ns per call "
            f"(process CPU, best of {args.rounds}): hot {hot:.0f}, warm {warm:.0f}, cold {cold:.0f}"
        )


if __name__ == "__main__":
    main()
