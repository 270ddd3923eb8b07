"""The bench counts what the scheduler pays for a KV cache manager: every call into it and
every method the scheduler calls on the KVCacheBlocks it returned, for vLLM's manager and
ours alike, with the timer's own cost calibrated; and its wrappers come off again."""

from __future__ import annotations

import logging
import math

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402

from hybrid_alloc.bench import clock as timing  # noqa: E402
from hybrid_alloc.bench import main, runner  # noqa: E402
from hybrid_alloc.bench.offline import SHAPES  # noqa: E402
from hybrid_alloc.vllm import manager as native  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)

N = 24


def _decode(manager: str) -> runner.RunResult:
    reqs = main.decode_requests(N, 80, seed=1)
    return runner.run_scenario(
        SHAPES["gpt-oss-120b"],
        manager,
        "decode",
        reqs,
        num_blocks=main.decode_pool_blocks(N, 96, 64, 16),
        kv_budget=None,
        max_num_seqs=N,
        max_num_batched_tokens=4096,
        measure_from_running=N,
        decode_steps=32,
    )


@pytest.mark.parametrize("manager", ["vllm", "hybrid_alloc"])
def test_decode_counts_allocate_and_get_block_ids_per_running_request(manager: str) -> None:
    r = _decode(manager)
    assert r.extra["native"] == (manager == "hybrid_alloc")
    bd = r.extra["kv_breakdown"]
    # Each running request, each timed step: one allocate_slots, and one get_block_ids on
    # what it returned (vLLM's class for vLLM, ours for ours).
    assert bd["allocate_slots"]["calls_per_step"] == N
    assert bd["blocks.get_block_ids"]["calls_per_step"] == N
    assert bd["new_step_starts"]["calls_per_step"] == 1
    assert len(r.kv_ns) == 16 and len(r.step_ns) == 16  # timed and bare steps alternate
    # The calibration ran (a finite cost per timed call in both wrapper forms), so every timed
    # step has a figure. Their values are the clock's: test_clock_subtracts_its_calibrated_cost
    # checks the arithmetic with a fake clock (a bound on a real one fails on a busy machine).
    assert math.isfinite(r.extra["timer_overhead_ns_per_call"])
    assert math.isfinite(r.extra["timer_overhead_ns_per_method_call"])
    assert all(math.isfinite(ns) for ns in r.kv_ns)


def test_wrappers_come_off() -> None:
    before = {
        cls: {k: v for k, v in vars(cls).items() if k in timing._RESULT_METHODS}
        for cls in (KVCacheBlocks, native.NativeKVCacheBlocks, native.EmptyKVCacheBlocks)
    }
    usage = native.HybridKVCacheManager.__dict__["usage"]
    _decode("hybrid_alloc")
    for cls, attrs in before.items():
        assert {k: v for k, v in vars(cls).items() if k in timing._RESULT_METHODS} == attrs
    assert native.HybridKVCacheManager.__dict__["usage"] is usage


def test_clock_subtracts_its_calibrated_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a clock that advances 100 ns per read, calibration finds 100 ns per timed call in
    both wrapper forms, and a timed call of a function that does nothing then counts 0; a
    callee that reads the clock once more (it "takes" 100 ns) counts 100."""
    from types import SimpleNamespace

    ticks = iter(range(0, 10**12, 100))
    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: next(ticks))
    clock = timing.ManagerClock()
    clock.calibrate()
    assert clock.overhead_ns == clock.overhead_method_ns == 100
    o = SimpleNamespace(f=timing.NOOP, g=lambda: timing.time.perf_counter_ns())

    class P:
        h = timing.NOOP

    clock._patch(o, "f", "f", False)
    clock._patch(o, "g", "g", False)
    clock._patch(P, "h", "h", True)
    clock.on()
    try:
        for _ in range(10):
            o.f(1, 2, num_lookahead_tokens=0)
            P().h(allow_none=True)
        assert clock.take() == 0
        for _ in range(10):
            o.g()
        assert clock.take() == 10 * 100
    finally:
        clock.off()
    assert P.__dict__["h"] is timing.NOOP and vars(o)["f"] is timing.NOOP


def test_empty_result_is_vllms_empty_blocks_with_a_cheap_get_block_ids() -> None:
    e = native.EmptyKVCacheBlocks(3)
    assert isinstance(e, KVCacheBlocks)
    assert e.blocks == ((), (), ())
    assert e.get_block_ids(allow_none=True) is None
    assert e.get_block_ids() == ([], [], [])
    assert e.get_block_ids(group_ids=[2]) == ([],)
    assert e.get_block_ids(True, group_ids=[0, 1]) is None
    with pytest.raises(IndexError):
        e.get_block_ids(True, group_ids=[5])
    a, b = e.get_block_ids(), e.get_block_ids()
    assert a[0] is not b[0]  # fresh lists, as vLLM's
    ref = KVCacheBlocks(((), (), ()))
    assert (e + ref).get_block_ids() == (ref + ref).get_block_ids()
    assert e.new_empty().blocks == ((), (), ())
    assert e.get_unhashed_block_ids_all_groups() == [[], [], []]
