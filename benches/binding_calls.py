"""The binding's calls on the serve step's paths, counted under callgrind in a process that
imports no vLLM (the crossing round, issue 19): a vLLM start-up takes several minutes of CPU
under valgrind, this script a few seconds, so a build can be counted before and after a
change on a busy machine. What it counts is what the binding and the adapter's blocks class
do; the scheduler, vLLM's ``Request`` and the adapter's ``allocate_slots`` are left out
(``benches/cold_path.py`` and ``benches/admission_profile.py`` count those, with vLLM).

vLLM's ``KVCacheBlocks`` (a plain dataclass with one field, ``blocks``) and
``make_block_hash_with_group_id`` are stood in by copies registered under their module names,
so the adapter's ``hybrid_alloc.vllm.blocks`` imports unchanged. The allocator has the
gemma-2-27b serve shape's two groups (full attention, sliding window of 4096), block size 16,
and ``--requests`` requests admitted with 2048-token prompts; a request is a plain object with
the attributes ``FastAllocate`` reads. ``--kind`` picks the call, each routed through a C
function of CPython that nothing else here calls, so callgrind's ``--toggle-collect`` counts
it alone (the trampoline's few tens of instructions included):

- ``noop``: the decode call whose step changes nothing, ``allocate_slots(r, 1,
  num_lookahead_tokens=0)`` through ``operator.call`` (``_operator_call``), and
  ``get_block_ids(allow_none=True)`` on its result through ``operator.methodcaller``
  (``methodcaller_call``);
- ``crossing``: the same two calls on the step that fills a block (one new block per group,
  the filled block cached);
- ``admission``: the core's ``Allocator.allocate_slots`` with the 17 keywords the adapter
  passes for an admission (2048 tokens, 2 x 128 new blocks), through ``operator.call``.

::

    PYTHONPATH=target/pysite valgrind --tool=callgrind --toggle-collect=_operator_call \\
        --toggle-collect=methodcaller_call --callgrind-out-file=/tmp/bc.out \\
        python benches/binding_calls.py --kind crossing
    callgrind_annotate --inclusive=yes /tmp/bc.out | grep -E '_operator_call|methodcaller_call'

The script prints how many calls it routed: a trampoline's inclusive count over them is one
call's cost. Each request's first call is made directly first (warming the code), except for
``crossing`` and ``admission``, which change the request: there the first half of the
requests warm and the second half are routed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import operator
import sys
import types
from typing import Any

BLOCK = 16
PROMPT = 2048


def _stand_in_vllm() -> None:
    """Registers the two names ``hybrid_alloc.vllm.blocks`` imports from vLLM."""

    @dataclasses.dataclass
    class KVCacheBlocks:
        blocks: tuple[Any, ...]

        def new_empty(self) -> KVCacheBlocks:
            return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))

    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.core")}
    mgr = types.ModuleType("vllm.v1.core.kv_cache_manager")
    mgr.KVCacheBlocks = KVCacheBlocks  # type: ignore[attr-defined]
    utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
    utils.make_block_hash_with_group_id = lambda h, g: h + g.to_bytes(4, "little")  # type: ignore[attr-defined]
    sys.modules.update(mods)
    sys.modules[mgr.__name__] = mgr
    sys.modules[utils.__name__] = utils


class Req:
    """What ``FastAllocate`` reads of a vLLM ``Request``."""

    def __init__(self, handle: int, hashes: list[bytes]) -> None:
        self._hybrid_alloc_handle = handle
        self.num_computed_tokens = PROMPT
        self.num_in_flight_tokens = 0
        self.num_prompt_tokens = PROMPT
        self.num_tokens = PROMPT
        self.shared_prefix_boundary = 0
        self.block_hashes = hashes


def _hashes(k: int, n: int) -> list[bytes]:
    return [(k * 1_000_003 + i).to_bytes(32, "big") for i in range(n)]


def _admission_keywords(r: Req) -> dict[str, Any]:
    """The keywords the adapter's ``allocate_slots`` passes the core for an admission."""
    from hybrid_alloc import Hit

    return {
        "block_hashes": r.block_hashes,
        "hit": Hit.NONE,
        "num_new_computed_tokens": 0,
        "num_lookahead_tokens": 0,
        "num_external_computed_tokens": 0,
        "delay_cache_blocks": False,
        "num_encoder_tokens": 0,
        "full_sequence_must_fit": False,
        "reserved_blocks": 0,
        "apply_watermark": False,
        "num_computed_tokens": 0,
        "num_in_flight_tokens": 0,
        "num_prompt_tokens": PROMPT,
        "num_tokens": PROMPT,
        "shared_prefix_boundary": 0,
        "skip_zeroing_group_ids": [],
        "as_buffer": True,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["noop", "crossing", "admission"], required=True)
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    _stand_in_vllm()
    from hybrid_alloc import Allocator, _core
    from hybrid_alloc._core import FastAllocate
    from hybrid_alloc.vllm.blocks import EmptyKVCacheBlocks, NativeKVCacheBlocks

    n = args.requests
    groups = [("full", BLOCK, 0, 0, 0), ("sliding_window", BLOCK, 1, 4096, 0)]
    a = Allocator(n * 2 * (PROMPT // BLOCK + 4) + 8, groups, BLOCK, BLOCK, 8192)
    empty = EmptyKVCacheBlocks(2)
    # What the installed adapter passes as make_blocks: its class where FastAllocate builds it
    # (``GetBlockIds`` exists), else the partial the earlier builds passed.
    native_class = hasattr(_core, "GetBlockIds")
    make = NativeKVCacheBlocks if native_class else functools.partial(NativeKVCacheBlocks, a)
    fast = FastAllocate(a, empty, lambda *x, **k: None, make, None)
    call, ids = operator.call, operator.methodcaller("get_block_ids", allow_none=True)
    reqs = []
    for k in range(n):
        r = Req(a.add_request(), _hashes(k, PROMPT // BLOCK))
        reqs.append(r)
        fast.track(r, r._hybrid_alloc_handle)
    half = reqs[: n // 2]
    routed = reqs[n // 2 :]
    got = 0
    if args.kind == "admission":
        for r in half:
            a.allocate_slots(r._hybrid_alloc_handle, PROMPT, **_admission_keywords(r))
        for r in routed:
            kw = _admission_keywords(r)
            got += call(a.allocate_slots, r._hybrid_alloc_handle, PROMPT, **kw) is not None
    else:
        for r in reqs:
            r.block_hashes = r.block_hashes[:-1]  # the last block is filled by the decode steps
            assert (
                a.allocate_slots(
                    r._hybrid_alloc_handle,
                    PROMPT - 1,
                    **_admission_keywords(r) | {"num_prompt_tokens": PROMPT - 1, "num_tokens": PROMPT - 1},
                )
                is not None
            )
            r.num_computed_tokens = r.num_prompt_tokens = PROMPT - 1
            r.num_tokens = PROMPT
            r.block_hashes = _hashes(reqs.index(r), PROMPT // BLOCK)
        if args.kind == "noop":  # token 2047 goes into block 127: nothing to do
            for r in reqs:
                fast(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)
            for r in reqs:
                out = call(fast, r, 1, num_lookahead_tokens=0)
                ids(out)
                got += out is empty
            routed = reqs
        else:  # token 2048 opens block 128 in each group and caches block 127
            for r in reqs:
                r.num_computed_tokens, r.num_tokens = PROMPT, PROMPT + 1
            for r in half:
                fast(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)
            for r in routed:
                out = call(fast, r, 1, num_lookahead_tokens=0)
                res = ids(out)
                got += res is not None and [len(g) for g in res] == [1, 1]
    a.check_invariants()
    print(f"{args.kind}: {len(routed)} calls routed, {got} as expected; make_blocks a class: {native_class}")


if __name__ == "__main__":
    main()
