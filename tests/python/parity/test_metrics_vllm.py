"""``--kv-cache-metrics`` served natively: the installed vLLM's (a supported release's) real
Scheduler with its ``KVCacheMetricsCollector`` (sample rate 1.0, a fake clock), run once with
vLLM's KVCacheManager and once with ours on the same seeded workload: shared prefixes (hits),
a small pool (lazy evictions, preemption), an explicit ``evict_blocks``, a prefix-cache reset
refused while requests run and one that succeeds, then a second wave on the same prefixes.

The collector's whole call sequence, ``(op, block_id)`` for ``on_block_allocated``,
``on_block_accessed``, ``on_block_evicted`` and ``reset``, and the eviction events the
scheduler drains from it each step (lifetimes, idle times and reuse gaps on the fake clock)
must be identical, with the SchedulerOutputs; shapes: sliding window + full (Gemma-like), full
only, and GDN + full (Qwen3.5-like, Mamba "align", whose transient checkpoint states are
evicted through ``_maybe_evict_cached_block``)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _shape(name: str) -> Any:
    from hybrid_alloc.bench.offline import LayerKind, MambaState, ModelShape

    if name == "gemma":
        layers = tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4))
        return ModelShape("tiny-gemma2", layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048)
    if name == "llama":
        layers = tuple(LayerKind("full") for _ in range(4))
        return ModelShape("tiny-llama", layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048)
    import torch

    layers = tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(8))
    state = MambaState(shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="GDN_ATTN")
    return ModelShape(
        "tiny-qwen3.5", layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048, mamba_state=state
    )


CASES = {
    "gemma2_sync": dict(shape="gemma", num_blocks=110),
    "gemma2_async": dict(shape="gemma", num_blocks=110, async_scheduling=True),
    "llama_sync": dict(shape="llama", num_blocks=70),
    "qwen35_gdn_align_sync": dict(shape="qwen", num_blocks=220),
}

_OPS = {"on_block_allocated": "allocated", "on_block_accessed": "accessed", "on_block_evicted": "evicted"}


def _record(col: Any) -> list[tuple[str, int]]:
    """Wraps the collector's methods (both managers call them through the instance) so that
    each call is recorded as ``(op, block_id)``; drained eviction events as ``("drained", n)``
    followed by the events."""
    calls: list[Any] = []
    for name, op in _OPS.items():
        orig = getattr(col, name)

        def call(block: Any, _orig: Any = orig, _op: str = op) -> None:
            calls.append((_op, block.block_id))
            _orig(block)

        setattr(col, name, call)
    orig_reset, orig_drain = col.reset, col.drain_events

    def reset() -> None:
        calls.append(("reset", -1))
        orig_reset()

    def drain_events() -> list[Any]:
        evs = orig_drain()
        if evs:
            calls.append(("drained", evs))
        return evs

    col.reset, col.drain_events = reset, drain_events
    return calls


def _run(case: str, manager: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import vllm.v1.core.kv_cache_metrics as km
    from vllm.config import ObservabilityConfig

    from hybrid_alloc.bench.offline import SchedulerSetup, fabricate_output, make_request
    from sched_driver import digest

    # The collector's only clock: 1 us per reading, the same readings in both runs.
    clock = itertools.count(0, 1000)
    monkeypatch.setattr(km, "time", SimpleNamespace(monotonic_ns=lambda: next(clock)))
    kw = dict(CASES[case])
    shape = _shape(kw.pop("shape"))
    obs = ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    setup = SchedulerSetup(
        shape=shape,
        manager=manager,
        max_num_seqs=12,
        max_num_batched_tokens=384,
        extra={"observability_config": obs},
        **kw,
    )
    sched = setup.build()
    col = sched.kv_metrics_collector
    assert col is not None and sched.kv_cache_manager.metrics_collector is col
    calls = _record(col)
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.randrange(150, 500))] for _ in range(3)]
    steps: list[Any] = []
    resets: list[bool] = []

    def wave(tag: str, n: int) -> None:
        pending = []
        for i in range(n):
            toks = list(prefixes[rng.randrange(3)]) + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 300))]
            pending.append((rng.randrange(0, 20), f"{tag}{i}", toks, rng.randrange(1, 60)))
        pending.sort(key=lambda p: p[0])
        step = 0
        while (pending or sched.get_num_unfinished_requests()) and step < 3000:
            while pending and pending[0][0] <= step:
                _, rid, toks, mt = pending.pop(0)
                sched.add_request(make_request(sched, rid, toks, mt))
            if step == 25:
                resets.append(sched.reset_prefix_cache())  # blocks in use: refused
                # What a KV connector's failed sync load asks for (a set, in its order).
                sched.kv_cache_manager.evict_blocks({3, 17, 29, 41, 58, 60})
            so = sched.schedule()
            steps.append(digest(so))
            sched.update_from_output(so, fabricate_output(sched, so))
            step += 1
        assert step < 3000

    wave("a", 16)
    resets.append(sched.reset_prefix_cache())
    wave("b", 12)
    return {
        "native": type(sched.kv_cache_manager).__name__,
        "calls": calls,
        "steps": steps,
        "preempted": sum(len(d["preempted"]) for d in steps),
        "resets": resets,
        "free": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_metrics_collector_sees_identical_calls(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _run(case, "vllm", monkeypatch)
    ours = _run(case, "hybrid_alloc", monkeypatch)
    assert ref["native"] == "KVCacheManager" and ours["native"] == "HybridKVCacheManager"
    assert ref["steps"] == ours["steps"], f"{case}: SchedulerOutputs differ"
    assert ref["resets"] == ours["resets"] == [False, True, False]
    a, b = ref["calls"], ours["calls"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"{case}: collector calls differ at {first}: {a[first : first + 5]} vs {b[first : first + 5]}"
    assert ref["free"] == ours["free"]
    print(case, "steps", len(ref["steps"]), "calls", len(a), "preempted", ref["preempted"])
    # The workload reaches every kind of call, and sampled blocks were reused then evicted.
    ops = {op for op, _ in a}
    assert ops >= {"allocated", "accessed", "evicted", "reset", "drained"}, ops
    assert sum(op == "reset" for op, _ in a) == 1
    drained = [e for op, evs in a if op == "drained" for e in evs]
    assert any(e.reuse_gaps_seconds for e in drained) and all(e.lifetime_seconds > 0 for e in drained)


def test_replay_filters_null_touch_by_release() -> None:
    """The replay makes the calls the core logged, in order, and drops the null block's
    access only where the installed vLLM's ``touch`` skips it (0.33)."""
    from hybrid_alloc._core import Allocator
    from hybrid_alloc.specs import FullAttention
    from hybrid_alloc.vllm import compat
    from hybrid_alloc.vllm.metrics import ResidencyReplay

    class Collector:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        def on_block_allocated(self, block: Any) -> None:
            self.calls.append(("allocated", block.block_id))

        def on_block_accessed(self, block: Any) -> None:
            self.calls.append(("accessed", block.block_id))

        def on_block_evicted(self, block: Any) -> None:
            self.calls.append(("evicted", block.block_id))

        def reset(self) -> None:
            self.calls.append(("reset", -1))

    class FakeLog:
        def take_residency_log(self) -> list[int]:
            return [0, 4, 1, 0, 1, 4, 2, 4, 3, 0]

    for reports_null in (True, False):
        c = Collector()
        ResidencyReplay(FakeLog(), c, reports_null)()  # type: ignore[arg-type]
        null = [("accessed", 0)] if reports_null else []
        assert c.calls == [("allocated", 4), *null, ("accessed", 4), ("evicted", 4), ("reset", -1)]
    assert isinstance(compat.TOUCH_REPORTS_NULL, bool)
    # Off by default: a core built without ``residency_log`` logs nothing.
    a = Allocator(8, [FullAttention(block_size=16)], 16, 16, 256)
    h = a.add_request()
    a.allocate_slots(h, 32, num_computed_tokens=0, num_prompt_tokens=32, num_tokens=32)
    assert a.take_residency_log() == []
    a = Allocator(8, [FullAttention(block_size=16)], 16, 16, 256, residency_log=True)
    h = a.add_request()
    a.allocate_slots(h, 32, num_computed_tokens=0, num_prompt_tokens=32, num_tokens=32)
    assert a.take_residency_log() == [2, 1, 0, 1, 2, 2, 0, 2]
    assert a.take_residency_log() == []
