"""One admission's calls under callgrind, each counted on its own (issue 19, item 1).

Runs the serve workload's closed loop (``benches/serve_profile.py``: gemma-2-27b shape,
``--clients`` clients, 2048-token prompts, 512 tokens of them shared) with one manager to its
steady state, then ``--steps`` more steps in which the admission's calls, as the scheduler
makes them, are each routed through a C function of CPython that nothing else in a step
calls, so that callgrind's ``--toggle-collect`` counts each kind of call alone, the adapter's
Python and the core's Rust together:

- ``get_computed_blocks`` (the lookup) through ``operator.call`` (``_operator_call``);
- ``allocate_slots`` of an admission (the call with ``new_computed_blocks``) through
  ``Context.run`` (``context_run``);
- ``get_blocks`` and ``get_block_ids`` on its result (``NewRequestData``'s block ids), both
  through ``operator.methodcaller`` (``methodcaller_call``).

(``itertools.starmap`` is no such function: vLLM's start-up calls it millions of times.) Each
trampoline's inclusive count in one run is its kind's total::

    PYTHONPATH=target/pysite OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind \\
        --toggle-collect=_operator_call --toggle-collect=context_run \\
        --toggle-collect=methodcaller_call --cache-sim=yes --LL=33554432,16,64 \\
        --callgrind-out-file=/tmp/ap.out python benches/admission_profile.py --clients 256
    callgrind_annotate --inclusive=yes /tmp/ap.out | grep -E '_operator_call|context_run|methodcaller_call'

The script prints how many calls of each kind the measured steps made: the count over the
calls is the cost of one. The routing's own cost (the C trampoline, a few tens of
instructions) is inside the count; the Python wrapper that routes is outside it.
"""

from __future__ import annotations

import argparse
import contextvars
import operator
from typing import Any


def _route(mgr: Any, counts: dict[str, int]) -> None:
    """Installs the routing wrappers on ``mgr`` and on its result classes."""
    lookup, alloc, get_blocks = mgr.get_computed_blocks, mgr.allocate_slots, mgr.get_blocks
    ctx = contextvars.copy_context()
    from_get_blocks: set[int] = set()

    def get_computed_blocks(*a: Any, **k: Any) -> Any:
        counts["lookup"] += 1
        return operator.call(lookup, *a, **k)

    def allocate_slots(*a: Any, **k: Any) -> Any:
        if "new_computed_blocks" not in k:
            return alloc(*a, **k)
        counts["admission"] += 1
        return ctx.run(alloc, *a, **k)

    def blocks_of(request_id: str) -> Any:
        counts["get_blocks"] += 1
        r = operator.methodcaller("__call__", request_id)(get_blocks)
        from_get_blocks.add(id(r))
        return r

    mgr.get_computed_blocks, mgr.allocate_slots, mgr.get_blocks = get_computed_blocks, allocate_slots, blocks_of
    call_ids = operator.methodcaller("_profiled_get_block_ids")
    for cls in {type(mgr.empty_kv_cache_blocks), *_result_classes()}:
        orig = cls.__dict__.get("get_block_ids")
        if orig is None:
            continue

        def get_block_ids(self: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            if a or k or id(self) not in from_get_blocks:
                return _orig(self, *a, **k)
            from_get_blocks.discard(id(self))
            counts["get_block_ids"] += 1
            return call_ids(self)

        cls._profiled_get_block_ids = orig
        cls.get_block_ids = get_block_ids


def _result_classes() -> list[type]:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    out, todo = [], [KVCacheBlocks]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def main() -> None:
    from serve_profile import add_loop_args, run_closed_loop

    p = argparse.ArgumentParser()
    add_loop_args(p, steps=8)
    args = p.parse_args()
    counts = dict.fromkeys(("lookup", "admission", "get_blocks", "get_block_ids"), 0)
    run_closed_loop(args, lambda sched: _route(sched.kv_cache_manager, counts))
    print(f"{args.manager}: {args.steps} steps, calls routed: {counts}")


if __name__ == "__main__":
    main()
