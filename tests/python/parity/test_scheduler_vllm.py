"""The installed vLLM's (a supported release's) real Scheduler (and AsyncScheduler), run once with
vLLM's KVCacheManager and once with ours on the same seeded workload: shared prefixes,
chunked prefill, preemption under memory pressure, aborts, requests that slide past the
window; async scheduling with overlapped steps (outputs processed with the next step in
flight); n-gram speculative decoding with drafts and partial acceptance, sync and async (on
0.33 ``update_from_output`` then calls ``cache_blocks`` in sync scheduling too). The
SchedulerOutputs (scheduled requests, token counts, draft counts, new block ids per group)
and the KV events must be identical at every step.

Also: the manager's construction never stops a scheduler from starting (an argument the
adapter does not know, an exception while building the native manager)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _cases():
    from hybrid_alloc.bench.offline import LayerKind, ModelShape

    gemma = ModelShape(
        "tiny-gemma2",
        tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4)),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=2048,
    )
    llama = ModelShape(
        "tiny-llama",
        tuple(LayerKind("full") for _ in range(4)),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=2048,
    )
    scout = ModelShape(
        "tiny-scout",
        tuple(LayerKind("chunked_local", 128) if i % 4 != 3 else LayerKind("full") for i in range(8)),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=2048,
    )
    swa_only = ModelShape(
        "tiny-swa",
        tuple(LayerKind("sliding_window", 96) for _ in range(4)),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=2048,
    )
    cases: dict[str, dict[str, Any]] = {
        "gemma2_sync": dict(shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512),
        "gemma2_async": dict(
            shape=gemma, num_blocks=300, max_num_seqs=24, max_num_batched_tokens=512, async_scheduling=True
        ),
        "gemma2_nocache": dict(
            shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512, enable_prefix_caching=False
        ),
        "llama_sync": dict(shape=llama, num_blocks=150, max_num_seqs=16, max_num_batched_tokens=384),
        "scout_sync": dict(shape=scout, num_blocks=300, max_num_seqs=16, max_num_batched_tokens=512),
        # Sliding window only: memory per request is bounded by the window, so the
        # workload does not preempt; it exercises recycling and hits instead.
        "swa_only_bs32": dict(
            shape=swa_only, num_blocks=150, max_num_seqs=16, max_num_batched_tokens=256, block_size=32
        ),
        # Async scheduling as the engine core runs it: the next step is scheduled before the
        # previous step's output is processed.
        "gemma2_async_overlap": dict(
            shape=gemma,
            num_blocks=220,
            max_num_seqs=24,
            max_num_batched_tokens=512,
            async_scheduling=True,
            batch_queue=2,
        ),
        # n-gram speculative decoding (3 drafts a step, partly accepted).
        "gemma2_ngram_sync": dict(shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512, spec=3),
        "gemma2_ngram_async": dict(
            shape=gemma,
            num_blocks=250,
            max_num_seqs=24,
            max_num_batched_tokens=512,
            spec=3,
            async_scheduling=True,
            batch_queue=2,
        ),
        "llama_ngram_sync": dict(shape=llama, num_blocks=150, max_num_seqs=16, max_num_batched_tokens=384, spec=2),
        # EAGLE with prefix caching: lookahead block hashes from vLLM 0.33 on, the last-block
        # drop on 0.32.
        "gemma2_eagle_sync": dict(
            shape=gemma, num_blocks=250, max_num_seqs=24, max_num_batched_tokens=512, spec=3, method="eagle"
        ),
        "gemma2_eagle_async": dict(
            shape=gemma,
            num_blocks=250,
            max_num_seqs=24,
            max_num_batched_tokens=512,
            spec=3,
            method="eagle",
            async_scheduling=True,
            batch_queue=2,
        ),
    }
    # The EAGLE last-block drop (``use_eagle``) on every release: lookahead block hashes
    # turned off (0.33 on; 0.32 drops anyway), prefix caching on or off.
    eagle = cases["gemma2_eagle_sync"]
    cases["gemma2_eagle_drop_sync"] = {**eagle, "drop": True}
    cases["gemma2_eagle_drop_async"] = {**cases["gemma2_eagle_async"], "drop": True}
    cases["llama_eagle_drop_sync"] = {**cases["llama_ngram_sync"], "method": "eagle", "drop": True}
    cases["gemma2_eagle_nocache"] = {**eagle, "drop": True, "enable_prefix_caching": False}
    # Multi-module MTP: several tokens of prefill lookahead (the scheduler never ends a chunk
    # within them of the prompt's end; the manager leaves all but one out of its cache
    # target): lookahead block hashes over as many tokens from 0.33 on, the drop on 0.32.
    cases["gemma2_mtp3_sync"] = {**eagle, "prefill_lookahead": 3}
    cases["gemma2_mtp3_async"] = {**cases["gemma2_eagle_async"], "prefill_lookahead": 3}
    cases["gemma2_mtp3_drop_sync"] = {**eagle, "prefill_lookahead": 3, "drop": True}
    cases["gemma2_mtp2_drop_async"] = {**cases["gemma2_eagle_async"], "prefill_lookahead": 2, "drop": True}
    cases["llama_mtp3_sync"] = {**cases["llama_eagle_drop_sync"], "drop": False, "spec": 3, "prefill_lookahead": 3}
    cases["llama_mtp3_drop_sync"] = {**cases["llama_eagle_drop_sync"], "spec": 3, "prefill_lookahead": 3}
    cases["gemma2_mtp3_nocache"] = {**cases["gemma2_eagle_nocache"], "prefill_lookahead": 3}
    return cases


EXPECT_PREEMPTION = {"swa_only_bs32": False}


CASES = [
    "gemma2_sync",
    "gemma2_async",
    "gemma2_nocache",
    "llama_sync",
    "scout_sync",
    "swa_only_bs32",
    "gemma2_async_overlap",
    "gemma2_ngram_sync",
    "gemma2_ngram_async",
    "llama_ngram_sync",
    "gemma2_eagle_sync",
    "gemma2_eagle_async",
    "gemma2_eagle_drop_sync",
    "gemma2_eagle_drop_async",
    "llama_eagle_drop_sync",
    "gemma2_eagle_nocache",
    "gemma2_mtp3_sync",
    "gemma2_mtp3_async",
    "gemma2_mtp3_drop_sync",
    "gemma2_mtp2_drop_async",
    "llama_mtp3_sync",
    "llama_mtp3_drop_sync",
    "gemma2_mtp3_nocache",
]


@pytest.mark.parametrize("case", CASES)
def test_real_scheduler_identical(case: str) -> None:
    from hybrid_alloc.bench.offline import SchedulerSetup
    from sched_driver import SpecSchedulerSetup, assert_same_run, run_workload
    from vllm_harness import HAVE_LOOKAHEAD_HASHES

    kw = dict(_cases()[case])
    batch_queue = kw.pop("batch_queue", 1)
    spec = kw.pop("spec", 0)
    drop = kw.pop("drop", False)
    if drop and HAVE_LOOKAHEAD_HASHES:
        kw["disable_lookahead_block_hashes"] = True
    if spec:
        base: SchedulerSetup = SpecSchedulerSetup(kv_events=True, num_spec_tokens=spec, **kw)
    else:
        base = SchedulerSetup(kv_events=kw.get("enable_prefix_caching", True), **kw)
    run = dict(seed=11, num_requests=40, max_tokens_hi=1000, batch_queue=batch_queue)
    ref = run_workload(dataclasses.replace(base, manager="vllm"), **run)
    ours = run_workload(dataclasses.replace(base, manager="hybrid_alloc"), **run)
    assert_same_run(case, ref, ours)
    # The workload must exercise what it claims.
    if EXPECT_PREEMPTION.get(case, True):
        assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    assert ref["aborted"]
    if base.enable_prefix_caching:
        assert ref["hits"] > 0
        assert ref["events"]
    if batch_queue > 1:
        # Outputs were processed with the next step in flight, and the scheduler cached
        # blocks then (``num_computed_tokens - num_in_flight_tokens`` on 0.33).
        assert ref["overlapped"] > 0
        assert ref["cache_blocks_in_flight"] > 0
    if spec:
        # Drafts were scheduled, and some (not all) accepted.
        assert 0 < ref["accepted"] < ref["drafts"]
        if HAVE_LOOKAHEAD_HASHES and not base.async_scheduling:
            # vLLM 0.33 caches from update_from_output in sync scheduling with drafts too.
            assert ref["cache_blocks"] > 0
    prefill = kw.get("prefill_lookahead") or (1 if kw.get("method") == "eagle" else 0)
    assert ref["prefill_lookahead"] == prefill
    if kw.get("method") == "eagle" and (drop or not HAVE_LOOKAHEAD_HASHES):
        # The last-block drop: no lookahead hashes, vLLM's manager built with ``use_eagle``.
        assert ref["lookahead"] == 0 and ref["use_eagle"] is True
    elif kw.get("method") == "eagle":
        assert ref["lookahead"] == prefill
        assert any(getattr(e, "lookahead_token_ids", None) for e in ref["events"])


# ---- construction never stops the scheduler ---------------------------------------------


def _llama_setup() -> Any:
    from hybrid_alloc.bench.offline import SchedulerSetup

    return SchedulerSetup(
        shape=_cases()["llama_sync"]["shape"],
        num_blocks=150,
        max_num_seqs=16,
        max_num_batched_tokens=384,
        manager="hybrid_alloc",
    )


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "falling back to vLLM's KVCacheManager" in r.getMessage()]


def _runs(sched: Any) -> None:
    """The scheduler serves a request to its end."""
    from hybrid_alloc.bench.offline import fabricate_output, make_request

    sched.add_request(make_request(sched, "r0", list(range(1, 60)), 4))
    for _ in range(20):
        so = sched.schedule()
        sched.update_from_output(so, fabricate_output(sched, so))
        if not sched.get_num_unfinished_requests():
            return
    raise AssertionError("the request did not finish")


def _capture(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="vllm.hybrid_alloc")


def test_unknown_constructor_argument_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM whose KVCacheManager takes an argument the adapter has never seen (faked here
    by a subclass with one more argument, which the scheduler passes): vLLM's own manager,
    built with every argument, runs the scheduler, and one line names the argument."""
    from vllm.v1.core.sched import scheduler as sched_mod

    from hybrid_alloc.vllm import manager, plugin

    class FutureKVCacheManager(manager.VllmKVCacheManager):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, future_knob: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.future_knob = future_knob

    _capture(caplog)
    monkeypatch.setattr(manager, "VllmKVCacheManager", FutureKVCacheManager)
    setup = _llama_setup()
    assert plugin.apply()
    try:
        installed = sched_mod.KVCacheManager
        # The scheduler of that future vLLM passes the new argument.
        monkeypatch.setattr(sched_mod, "KVCacheManager", lambda *a, **k: installed(*a, future_knob=7, **k))
        sched = setup.build_with_installed_manager()
    finally:
        monkeypatch.undo()
        plugin.remove()
    assert sched_mod.KVCacheManager is manager.VllmKVCacheManager
    mgr = sched.kv_cache_manager
    assert type(mgr) is FutureKVCacheManager and mgr.future_knob == 7
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "future_knob" in lines[0], lines
    _runs(sched)


def test_exception_while_building_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Anything raised while the native manager is built (here, by the core's constructor)
    falls back to vLLM's manager with one line; the scheduler runs."""
    from hybrid_alloc.vllm import manager

    def broken(**kwargs: Any) -> Any:
        raise RuntimeError("simulated failure in the native core")

    _capture(caplog)
    monkeypatch.setattr(manager, "Allocator", broken)
    sched = _llama_setup().build()
    monkeypatch.undo()
    assert type(sched.kv_cache_manager) is manager.VllmKVCacheManager
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "RuntimeError" in lines[0] and "simulated failure" in lines[0], lines
    _runs(sched)


def test_missing_attribute_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    """A configuration object without an attribute the adapter reads (a group without
    ``role``, as a future vLLM might build it) falls back instead of raising."""
    from types import SimpleNamespace

    from hybrid_alloc.vllm import manager
    from vllm_harness import SETUPS

    _capture(caplog)
    s = next(x for x in SETUPS if x.name == "full_bs16")
    kw = s.manager_kwargs(events=False)
    cfg = kw["kv_cache_config"]
    g = cfg.kv_cache_groups[0]
    cfg.kv_cache_groups[0] = SimpleNamespace(kv_cache_spec=g.kv_cache_spec, layer_names=g.layer_names)
    native, reason = manager.native_config_or_reason(**kw)
    assert native is None and "AttributeError" in reason
    cfg.kv_cache_groups[0] = g
    assert type(manager.HybridKVCacheManager(**kw)) is manager.HybridKVCacheManager
    assert not _fallback_lines(caplog)


def test_native_with_the_installed_release_arguments(caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's own arguments (0.33's ``num_hash_lookahead_tokens`` included) give
    the native manager, without a fallback line."""
    from hybrid_alloc.vllm import manager

    _capture(caplog)
    sched = _llama_setup().build()
    assert type(sched.kv_cache_manager) is manager.HybridKVCacheManager
    assert not _fallback_lines(caplog)
    assert any("native KV cache manager serving" in r.getMessage() for r in caplog.records)
    _runs(sched)


def test_aux_outputs_served_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auxiliary outputs (``--enable-return-routed-experts``, vLLM 0.33): the adapter stays
    native, and vLLM's own ``AuxOutputSchedulerConnector``, built over each manager, reads
    the same group, block size and capacity and answers the same ``max_cache_hit`` (through
    ``block_pool.get_cached_block``) as requests are admitted, cached and finished."""
    import inspect
    from types import SimpleNamespace

    from hybrid_alloc.vllm import manager
    from vllm_harness import SETUPS

    aux_mod = pytest.importorskip("vllm.distributed.aux_output_connector.connector")
    if "kv_cache_manager" not in inspect.signature(aux_mod.AuxOutputSchedulerConnector).parameters:
        pytest.skip("this vLLM's auxiliary-output connector does not read the KV cache manager (0.32)")
    setup = next(x for x in SETUPS if x.name == "full_swa_bs16")
    monkeypatch.setattr(
        manager,
        "current_vllm_config",
        SimpleNamespace(kv_transfer_config=None, aux_output_config=SimpleNamespace(enabled=True)),
    )
    ref, ours = setup.build(events=False)
    conns = [aux_mod.AuxOutputSchedulerConnector(m) for m in (ref, ours)]
    for attr in ("_group_id", "_block_size", "_hash_block_size", "_capacity"):
        assert getattr(conns[0], attr) == getattr(conns[1], attr), attr
    prefix = list(range(1, 161))
    hits = 0
    for i in range(6):
        req_pair = [setup.make_request(f"r{i}", prefix + [1000 + i] * (17 + i)) for _ in range(2)]
        answers = [c.max_cache_hit(r) for c, r in zip(conns, req_pair)]
        assert answers[0] == answers[1], (i, answers)
        hits += answers[0] > 0
        for m, r in zip((ref, ours), req_pair):
            blocks, *_ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, r.num_tokens, new_computed_blocks=blocks) is not None
            r.num_computed_tokens = r.num_tokens
            m.cache_blocks(r, r.num_tokens)
        after = [c.max_cache_hit(r) for c, r in zip(conns, req_pair)]
        assert after[0] == after[1] > 0, (i, after)
        for c, m, r in zip(conns, (ref, ours), req_pair):
            c.request_finished(r)
            m.free(r)
    assert hits > 0, "no lookup found cached blocks: the test exercised nothing"
    assert conns[0]._kv_cached.keys() == conns[1]._kv_cached.keys()


# ---- a full-attention block over the hash block (partial-block prefix entries) -----------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_real_scheduler_identical_full_block_over_hash_block(async_scheduling: bool) -> None:
    """A Gemma-2-like hybrid whose sliding-window layers hold twice the KV per token of its
    global layers (twice the KV heads): vLLM's planner (``unify_kv_cache_spec_page_size``)
    doubles the global layers' block to 32 beside the window's 16, so requests are hashed
    every 16 tokens, the scheduler block is 32, and full attention keys each prompt's last
    hash boundary inside its block (``_cache_partial_tail_block``) without partial hits.
    Ours serves it natively and runs identically; the entries are stored and evicted."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from hybrid_alloc.bench.offline import SchedulerSetup, kv_cache_specs
    from hybrid_alloc.vllm.compat import get_kv_cache_config_from_groups, get_kv_cache_groups
    from sched_driver import assert_same_run, run_workload

    @dataclasses.dataclass
    class WideWindowSetup(SchedulerSetup):
        def kv_cache_config(self, vc: Any) -> Any:
            specs = kv_cache_specs(self.shape, self.block_size)
            wide = {
                k: dataclasses.replace(s, num_kv_heads=2 * s.num_kv_heads) if isinstance(s, SlidingWindowSpec) else s
                for k, s in specs.items()
            }
            groups = get_kv_cache_groups(vc, wide)
            probe = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
            budget = (1 << 40) // probe.num_blocks * (self.num_blocks or 0)
            return get_kv_cache_config_from_groups(vc, groups, budget)

    kw = dict(_cases()["gemma2_sync"])
    base = WideWindowSetup(kv_events=True, **{**kw, "num_blocks": 200}, async_scheduling=async_scheduling)
    run = dict(seed=11, num_requests=60, max_tokens_hi=600, batch_queue=2 if async_scheduling else 1)
    ref = run_workload(dataclasses.replace(base, manager="vllm"), **run)
    ours = run_workload(dataclasses.replace(base, manager="hybrid_alloc"), **run)
    assert_same_run("full_bs32_over_swa_bs16", ref, ours)
    sched = dataclasses.replace(base, manager="vllm").build()
    sizes = {type(g.kv_cache_spec): g.kv_cache_spec.block_size for g in sched.kv_cache_config.kv_cache_groups}
    assert sizes == {FullAttentionSpec: 32, SlidingWindowSpec: 16}, sizes
    assert (sched.hash_block_size, sched.block_size) == (16, 32)
    assert ref["preemptions"] > 0 and ref["aborted"] and ref["hits"] > 0
    evs = [ev for e in ref["events"] for ev in getattr(e, "events", [e])]
    entries = [ev for ev in evs if type(ev).__name__ == "BlockStored" and ev.block_size < 32 and ev.group_idx == 0]
    assert entries, "no partial-block prefix entry was stored"
    entry_hashes = {h for ev in entries for h in ev.block_hashes}
    removed = {h for ev in evs if type(ev).__name__ == "BlockRemoved" for h in ev.block_hashes}
    assert entry_hashes & removed, "no partial-block prefix entry was evicted"
