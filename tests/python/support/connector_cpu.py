"""The KV-manager CPU time per scheduler step with a KV connector configured, vLLM's manager
against ours, on the connector tests' workloads made 6x larger (150 requests, 3x the blocks).
Not a test (a measurement, run by hand). Times are the calling thread's CPU time inside every
manager method the scheduler calls (and ``block_pool.free_blocks``,
``coordinator.get_num_blocks_to_allocate``); they include the driver's own few calls (a probe
lookup after each async load, the block ids of a failed load). Usage, from the repository root:

    PYTHONPATH=$SITE:tests/python/support HF_HUB_OFFLINE=1 $PY tests/python/support/connector_cpu.py llama_consumer gemma_producer
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import connector_driver as cd
from connector_cases import setup_case

NAMES = (
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "cache_blocks",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "remove_skipped_blocks",
    "take_events",
    "new_step_starts",
    "take_new_block_ids",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "take_boundary_state_offloads",
    "take_kv_cache_block_copies",
    "finalize_partial_tail_offloads",
    "evict_blocks",
    "record_blocks_for_zeroing",
    "truncate_computed_blocks",
)


def main(cases: list[str]) -> None:
    acc = {"ns": 0}
    orig_build = cd.SchedulerSetup.build

    def wrap(obj: Any, name: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def timed(*a: Any, **k: Any) -> Any:
            t = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                acc["ns"] += time.thread_time_ns() - t

        setattr(obj, name, timed)

    def build(self: Any) -> Any:
        sched = orig_build(self)
        mgr = sched.kv_cache_manager
        for n in NAMES:
            wrap(mgr, n)
        wrap(mgr.block_pool, "free_blocks")
        wrap(mgr.coordinator, "get_num_blocks_to_allocate")
        return sched

    cd.SchedulerSetup.build = build  # type: ignore[method-assign]
    for case in cases:
        setup, w, role = setup_case(case)
        w = dataclasses.replace(w, num_requests=150)
        setup = dataclasses.replace(setup, num_blocks=setup.num_blocks * 3)
        res = {}
        for m in ("vllm", "hybrid_alloc"):
            acc["ns"] = 0
            r = cd.run_pd(dataclasses.replace(setup, manager=m), role, w, max_steps=5000)
            assert r["finished"], case
            res[m] = (acc["ns"] / len(r["steps"]) / 1000, len(r["steps"]))
        print(
            f"{case}: vLLM {res['vllm'][0]:.1f} us/step, ours {res['hybrid_alloc'][0]:.1f} us/step "
            f"over {res['vllm'][1]} steps"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama_consumer", "gemma_consumer", "gemma_producer"])
