"""The ``floor`` probe of ``hybrid-alloc bench --managers ...,floor`` (the serve workload only;
not a mode of the plugin): ours with the scheduler's decode call answered by a C-level constant,
``hybrid_alloc._core.DecodeFloor`` (``rust/py/floor.rs``), the least any manager can cost under
vLLM's calls.

The probe is not in the release wheel: it is compiled only with the cargo feature
``bench-probe``, which ``scripts/install-local.sh`` (the build of the tests and of
``scripts/bench.sh``) turns on and ``pyproject.toml``'s release build does not.
:func:`available` says whether this build has it; without it the bench refuses ``floor`` with
:data:`MISSING`.

Cost: :func:`install_floor` is one attribute assignment; the probe's call is a few compares.
"""

from __future__ import annotations

from typing import Any

#: What the bench says when ``--managers`` names ``floor`` on a build without the probe.
MISSING = (
    "hybrid-alloc bench: the floor manager needs the probe build (the cargo feature bench-probe, "
    "which the release wheel leaves out): build this checkout with `bash scripts/install-local.sh PYTHON` "
    "(or `bash scripts/bench.sh`), or drop floor from --managers"
)


def available() -> bool:
    """Whether the loaded extension was built with the probe (``DecodeFloor``)."""
    from hybrid_alloc import _core

    return hasattr(_core, "DecodeFloor")


def install_floor(mgr: Any) -> None:
    """``mgr`` (ours) with its ``allocate_slots`` replaced by a ``DecodeFloor``, which answers
    the scheduler's decode call (``(request, 1, num_lookahead_tokens=n)``) with the shared
    empty result and reads nothing of the request, and sends every other call (admissions,
    prefill chunks) to ours. The empty result's ``get_block_ids`` is ours (a builtin
    method). What the scheduler then pays per running request and step for the decode pair
    is the least any manager can cost under vLLM's calls. The decode steps allocate nothing,
    so the pool stays emptier than a real manager's: only the decode calls are comparable.
    ``RuntimeError`` (:data:`MISSING`) on a build without the probe."""
    from hybrid_alloc import _core

    probe = getattr(_core, "DecodeFloor", None)
    if probe is None:
        raise RuntimeError(MISSING)
    mgr.allocate_slots = probe(mgr.empty_kv_cache_blocks, mgr.allocate_slots)
