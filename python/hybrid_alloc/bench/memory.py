"""``hybrid-alloc bench --workload memory``: what a KV cache manager costs to build and to
keep, per block of its pool, for vLLM's manager and ours.

Each (manager, pool size) is measured in a fresh interpreter, so nothing of one build is
reused by the next: the scheduler is built as the ``serve`` workload builds it, and the
``KVCacheManager(...)`` call inside the scheduler's constructor is measured alone:
- its wall time (construction time);
- the process's resident set before and after it (``/proc/self/statm``; RSS delta);
- and two counts: the bytes the C heap (glibc ``malloc``, where the core's buffers and
  Python's large buffers live; ``mallinfo2``) holds more after it, and the Python objects
  (memory blocks of Python's small-object allocator, ``sys.getallocatedblocks``) it holds
  more after it: vLLM's manager makes a ``KVCacheBlock`` per block, ours none.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

from hybrid_alloc.bench.common import render_table

MEMORY_BLOCKS = (344_064, 4_194_304)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (0 where there is no mallinfo2)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return 0
    f.restype = _MallInfo2
    m = f()
    return int(m.uordblks + m.hblkhd)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: str, manager: str, num_blocks: int) -> dict[str, Any]:
    """Builds the scheduler once in this process and measures its ``KVCacheManager(...)``."""
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm.v1.core.sched import scheduler as sched_mod

    from hybrid_alloc.bench.offline import SchedulerSetup, scheduler_manager
    from hybrid_alloc.bench.shapes import by_name

    setup = SchedulerSetup(by_name(model), manager=manager, num_blocks=num_blocks, max_num_seqs=1024)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    with scheduler_manager(setup.manager):
        build = sched_mod.KVCacheManager

        def measured(*a: Any, **k: Any) -> Any:
            gc.collect()
            rss0, heap0, objs0 = _rss(), _malloc_in_use(), sys.getallocatedblocks()
            t0 = time.perf_counter()
            mgr = build(*a, **k)
            t1 = time.perf_counter()
            gc.collect()
            out.update(
                construction_s=t1 - t0,
                rss_bytes=_rss() - rss0,
                malloc_bytes=_malloc_in_use() - heap0,
                python_objects=sys.getallocatedblocks() - objs0,
                native=type(mgr).__name__ == "HybridKVCacheManager",
            )
            return mgr

        sched_mod.KVCacheManager = measured
        try:
            sched = setup.build_with_installed_manager()
        finally:
            sched_mod.KVCacheManager = build
    n = sched.kv_cache_manager.kv_cache_config.num_blocks
    return {
        "model": model,
        "manager": manager,
        "num_blocks": n,
        **out,
        "rss_bytes_per_block": out["rss_bytes"] / n,
        "malloc_bytes_per_block": out["malloc_bytes"] / n,
        "python_objects_per_block": out["python_objects"] / n,
    }


def run_memory(model: str, managers: list[str], sizes: tuple[int, ...] = MEMORY_BLOCKS) -> list[dict[str, Any]]:
    """One fresh interpreter per (pool size, manager)."""
    rows = []
    for n in sizes:
        for mg in managers:
            code = (
                "import json, sys; from hybrid_alloc.bench.memory import measure; "
                f"print('MEASURED ' + json.dumps(measure({model!r}, {mg!r}, {n})))"
            )
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MEASURED ")), None)
            if p.returncode != 0 or line is None:
                raise SystemExit(f"memory measurement of {mg} at {n} blocks failed:\n{p.stderr[-2000:]}")
            rows.append(json.loads(line[len("MEASURED ") :]))
    return rows


def print_memory(rows: list[dict[str, Any]], wide: bool = False) -> None:
    """The memory table: by default its main columns, which fit 80 columns; ``wide``
    (``--wide``) the C-heap bytes per block too."""
    if not rows:
        return
    shown = [
        {
            **r,
            "construction_ms": r["construction_s"] * 1e3,
        }
        for r in rows
    ]
    cols = [
        ("model", "model", "{}"),
        ("manager", "manager", "{}"),
        ("num_blocks", "blocks", "{}"),
        ("construction_ms", "build ms", "{:.1f}"),
        ("rss_bytes_per_block", "RSS B/block", "{:.1f}"),
        ("malloc_bytes_per_block", "malloc B/block", "{:.1f}"),
        ("python_objects_per_block", "Py objs/block", "{:.3f}"),
    ]
    if not wide:
        cols = [c for c in cols if c[0] != "malloc_bytes_per_block"]
    render_table(
        "memory and start-up: the KVCacheManager(...) call in the scheduler's constructor, one fresh interpreter "
        "each (RSS delta and C-heap bytes per block; Python objects per block)",
        cols,
        shown,
        None if wide else "C-heap (malloc) bytes per block: --wide, or bench.json",
        wide,
    )
