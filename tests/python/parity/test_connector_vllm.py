"""KV connectors served natively: the installed vLLM's (a supported release's) real
Scheduler and AsyncScheduler with NixlConnector configured (as KV consumer and as KV producer,
alone, as its push variant and under a MultiConnector) and with the native OffloadingConnector, run
once with vLLM's KVCacheManager and once with ours, the worker side faked with
``KVConnectorOutput`` (see ``connector_driver``). Every step's SchedulerOutput, the connector
metadata the scheduler built, the free block count, the requests held for
``finished_sending`` (delayed frees), the manager's and the connector's KV events, the
junctions the connector raised (vLLM 0.34's OffloadingConnector) and the manager calls must be
identical. (LMCacheConnectorV1 cases skip on 0.34: lmcache 0.5.6 does not run with it.)

Lifecycles: remote prefill (async loads), remote decode with the free delayed until
``finished_sending``, async load failure (``invalid_block_ids`` with one KV cache group,
``failed_recving`` with several) under both ``kv_load_failure_policy`` values, a sync
failure of a running request (``evict_blocks`` under "fail"), abort while waiting for
remote KVs, abort with a step in flight (deferred frees through ``pop_blocks_for_free``),
preemption (also while other requests' loads are pending), local hits combined with external
hits, each with vLLM's Scheduler and AsyncScheduler. Shapes: full attention only, sliding
window + full (Gemma-like), and GDN + full (Qwen3.5-like, Mamba "align") with NixlConnector as
KV consumer, where every connector lookup (``get_computed_blocks_for_connector``) is compared
too and vLLM's per-group hits diverge both ways (full attention deeper, adopted with remote
tokens; a Mamba group deeper, reconciled). Also a MultiConnector over NixlConnector and the
OffloadingConnector, ExampleConnector (no hybrid manager support: vLLM's one unified group,
sync loads from folders the fake worker writes), LMCacheConnectorV1 (the ``lmcache`` package's
scheduler side, one unified group too: hits from a real lookup server over the chunks the fake
worker stored, ``lmcache_worker``), ``cache_blocks`` after an async load,
``truncate_computed_blocks``, and the connectors that still fall back, with one line. With
sub-block partial hash hits (``prefix_match_unit`` 8 under blocks of 16, the ``qwen_*_pmu``
cases): the OffloadingConnector and NixlConnector as producer and as consumer, sync and async,
with hits ending inside a block (copy-on-write copies in the SchedulerOutputs), producer partial
tails handed over by the copy-on-write and by ``finalize_partial_tail_offloads``, and local
sub-block tails trimmed behind a longer remote hit (``truncate_computed_blocks``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
from typing import Any

import pytest

import module_connectors
from connector_cases import CASES, PREFIX_MATCH_UNIT, QWEN_CASES, WORKLOAD_SEED, setup_case, tiny_shapes

pytestmark = pytest.mark.vllm


def _pair(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from connector_driver import run_pd

    setup, w, role = setup_case(case)
    try:
        ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)
        ours = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    finally:
        if w.example_storage is not None:
            shutil.rmtree(w.example_storage, ignore_errors=True)
    return ref, ours


def _lmcache_reads_this_vllm() -> bool:
    """Whether this vLLM's ``CachedRequestData`` has the field lmcache 0.5.6 reads to tell a
    resumed request (``resumed_req_ids``, 0.32 and 0.33; ``resumed_from_preemption`` before)."""
    from vllm.v1.core.sched.output import CachedRequestData

    names = {f.name for f in dataclasses.fields(CachedRequestData)}
    return bool(names & {"resumed_req_ids", "resumed_from_preemption"})


def _has_evict_first() -> bool:
    """Whether this vLLM's ``BlockPool.free_blocks`` takes ``evict_first`` (0.34: the
    SimpleCPUOffload connector's lazy mode gives its pins back at the free queue's front)."""
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    return "evict_first" in inspect.signature(BlockPool.free_blocks).parameters


_EVICT_FIRST = _has_evict_first()


def _skip_without_umbp(case: str) -> None:
    """UMBPStoreConnector is in vLLM 0.33 and 0.34, not 0.32."""
    if "umbp" in CASES[case][5] and importlib.util.find_spec(_UMBP) is None:
        pytest.skip("this vLLM has no UMBPStoreConnector (0.33 and 0.34 have)")


_UMBP = "vllm.distributed.kv_transfer.kv_connector.v1.umbp"


@pytest.mark.parametrize("case", list(CASES))
def test_connector_scheduler_identical(case: str) -> None:
    from connector_driver import assert_same_pd

    if "lmcache" in CASES[case][5] and importlib.util.find_spec("lmcache") is None:
        why = "the lmcache package is not installed (scripts/test-env.sh installs lmcache==0.5.6)"
        if os.environ.get("HYBRID_ALLOC_REQUIRE_VLLM"):
            pytest.fail(why)  # scripts/test.sh's run has it
        pytest.skip(why)
    if "lmcache" in CASES[case][5] and not _lmcache_reads_this_vllm():
        # Not the manager's: vLLM's own manager fails the same way, in the first step that
        # schedules a running request.
        pytest.skip(
            "lmcache's scheduler side (vllm_v1_adapter.build_connector_meta, "
            "lmcache_mp_connector._process_cached_requests) reads "
            "CachedRequestData.resumed_req_ids or .resumed_from_preemption, which this vLLM "
            "(0.34) has neither of: it raises with vLLM's own manager too"
        )
    _skip_without_umbp(case)
    ref, ours = _pair(case)
    assert_same_pd(case, ref, ours)
    c, calls = ref["counters"], ref["calls"]
    _, role, _, overlap, policy, _ = CASES[case]
    # The workload exercises what the case claims.
    assert ref["events"]
    conn = CASES[case][5]
    if conn in ("offload", "multi_offload_only"):
        assert c["jobs"] > 20 and c["recv"] > 0 and calls["alloc_delay_cache"] > 0
    elif conn in ("example", "multi_example"):
        # One unified group (vLLM promoted the sliding window layers), whole-prompt hits
        # loaded in the step, two of them failing.
        assert ref["groups"] == [("FullAttentionSpec", 64 if case.startswith("gemma") else None)]
        assert c["stores"] > 5 and c["sync_loads"] > 5 and c["failed_sync"] == 2
        assert calls["alloc_local_and_external"] > 0 and c["preempted"] > 0
        if policy == "fail":
            # And hits behind a longer local one (a negative external count).
            assert calls["evict_blocks"] > 0 and calls["alloc_negative_external"] > 0
    elif conn == "lmcache_mp_lazy":
        # Lazy offload: stores of the blocks near the free queue's front, each walk of it
        # (``fake_free_list_head`` / ``next_free_block``: the blocks and their ranks) and every
        # pin and unpin compared call by call above; async loads, preemption; no delayed frees.
        pool = ref["pool_calls"]
        walks = [p for p in pool if p[0] == "walk"]
        assert c["store_events"] > 10 and c["load_events"] > 5 and c["recv"] == c["load_events"]
        assert len(walks) > 100 and sum(len(p[2]) for p in walks) > 1000
        assert sum(p[0] == "touch" for p in pool) > 10 and sum(p[0] == "free" for p in pool) > 10
        assert c["delayed_free"] == 0 and c["preempted"] > 0 and calls["alloc_local_and_external"] > 50
    elif conn == "lmcache_mp":
        # Stores of whole chunks, every finished request held until its stores are done
        # (delayed frees), async loads of the stored prefixes behind local hits (not on the
        # Gemma-like model at these sizes), lookups answered a step later, preemption.
        assert c["store_events"] > 20 and c["load_events"] > 5 and c["recv"] == c["load_events"]
        assert c["sent"] == c["delayed_free"] == 30 and any(s["held"] for s in ref["steps"])
        assert calls["connector_pending"] > 20 and calls["alloc_delay_cache"] > 30
        if CASES[case][0] == "llama":
            assert calls["alloc_local_and_external"] > 100 and c["preempted"] > 0
    elif "lmcache" in conn:
        # One unified group, chunk-prefix hits (mostly behind a local hit) loaded in the step,
        # two loads failing; partial chunks give external counts that are not whole blocks.
        assert ref["groups"] == [("FullAttentionSpec", 64 if case.startswith("gemma") else None)]
        assert c["stores"] > 10 and c["sync_loads"] > 5 and c["failed_sync"] == 2
        assert calls["alloc_local_and_external"] > 0 and c["preempted"] > 0
        if conn == "lmcache_unfull":
            assert calls["alloc_unaligned_external"] > 0
        if policy == "fail":
            assert calls["evict_blocks"] > 0
    elif conn == "module_hashstore":
        # Sync external hits from the test connector's store (loads listed in its metadata),
        # behind local hits too, with preemption; stores of finished requests' hashes.
        metas = [st["meta"] for st in ref["steps"]]
        assert sum(1 for m in metas if m["loads"]) > 5, metas
        assert sum(n for m in metas for n in m["stores"].values()) > 20
        assert calls["alloc_external"] > 5 and c["preempted"] > 0
        if CASES[case][0] == "llama":
            # Behind a local hit too (the Gemma-like model's sliding-window group leaves none
            # with an external one at these sizes).
            assert calls["alloc_local_and_external"] > 0
    elif conn in ("simple", "simple_lazy"):
        # SimpleCPUOffload: store events (eager: the requests' computed blocks; lazy: the free
        # queue's front, given back ``evict_first``) and async loads of the CPU hits, behind
        # local hits too (not on the Gemma-like model at these sizes), with preemption; the
        # connector's own pins and frees on the pool were compared call by call above.
        pool = ref["pool_calls"]
        assert c["store_events"] > 20 and c["load_events"] > 5 and c["recv"] > 5 and c["preempted"] > 0
        assert calls["alloc_external"] > 30 and ref["connector_events"]
        assert sum(p[0] == "touch" for p in pool) > 30 and sum(p[0] == "free" for p in pool) > 30
        assert (sum(p[0] == "free" and p[2] for p in pool) > 20) == (conn == "simple_lazy" and _EVICT_FIRST)
        if CASES[case][0] == "llama":
            assert calls["alloc_local_and_external"] > 100
        if CASES[case][0] == "qwen":
            assert c["boundary_states"] > 10, c
        if case in PREFIX_MATCH_UNIT:
            # Stored blocks holding second keys, which the connector registers on the CPU.
            assert c["second_keys"] > 5, c
    elif conn == "mooncake_store":
        # Store jobs (each pinning its blocks until done: the touches and frees compared
        # call by call above) and async loads of the stored prefixes, behind local hits too
        # (not on the Gemma-like model at these sizes), with preemption.
        pool = ref["pool_calls"]
        assert c["store_events"] > 20 and c["load_events"] > 10 and c["recv"] > 10 and c["preempted"] > 0
        assert sum(p[0] == "touch" for p in pool) == sum(p[0] == "free" for p in pool) > 20
        assert calls["alloc_external"] > 30
        if CASES[case][0] == "llama":
            assert calls["alloc_local_and_external"] > 100
    elif conn.startswith("umbp"):
        # Store events (each pinning its blocks until done: the touches and frees compared
        # call by call above) and loads of the stored prefixes (async, or in the step with
        # ``load_async`` false), behind local hits too (not on the Gemma-like model at these
        # sizes), with preemption; with ``lookup_async``, lookups answered a step later.
        pool = ref["pool_calls"]
        assert c["store_events"] > 20 and c["load_events"] > 5 and c["preempted"] > 0
        assert sum(p[0] == "touch" for p in pool) == sum(p[0] == "free" for p in pool) > 20
        assert calls["alloc_external"] > 30 and ref["connector_events"]
        if conn == "umbp_sync":
            assert c["sync_loads"] == c["load_events"] and c["recv"] == 0
        else:
            assert c["recv"] == c["load_events"] and calls["alloc_delay_cache"] > 30
        assert (calls.get("connector_pending", 0) > 5) == (conn == "umbp_lookup_async")
        if CASES[case][0] == "llama":
            assert calls["alloc_local_and_external"] > 100
    elif conn in ("multi_simple", "multi_simple_lazy"):
        # Both children load: NIXL for the remote prefills (two failing), SimpleCPUOffload
        # for local requests' stored prefixes; its pins and frees compared call by call.
        pool = ref["pool_calls"]
        assert c["store_events"] > 10 and c["load_events"] >= 4 and c["recv"] > 10
        assert c["failed"] == 2 and c["aborted_waiting"] == 1 and ref["connector_events"]
        assert sum(p[0] == "touch" for p in pool) > 20 and calls["alloc_local_and_external"] > 100
        assert (sum(p[0] == "free" and p[2] for p in pool) > 10) == (conn == "multi_simple_lazy" and _EVICT_FIRST)
    elif conn == "multi_offload":
        # Both children load: NIXL for the remote prefills, offloading for local prefixes.
        assert c["jobs"] > 20 and c["load_jobs"] > 0 and c["recv"] > 10
        assert c["failed"] == 2 and c["aborted_waiting"] == 1 and calls["cache_blocks"] > 0
    elif role == "kv_consumer":
        assert c["recv"] > 10 and c["waited"] > 0
        assert calls["alloc_delay_cache"] > 0 and calls["cache_blocks"] > 0
        assert c["failed"] == 2 and c["aborted_waiting"] == 1
        if case.startswith("llama") or case in WORKLOAD_SEED:
            assert calls.get("alloc_local_and_external", 0) > 0
        if case.startswith("llama"):
            assert c["failed_running"] > 0
            if policy == "fail":
                assert calls["evict_blocks"] > 0
    else:
        assert c["sent"] == c["delayed_free"] > 10
        assert any(s["held"] for s in ref["steps"])
    if overlap:
        assert c["overlapped"] > 0
    if overlap and role in ("kv_consumer", "kv_both"):
        assert ref["defer_block_free"]
        # (LMCacheMP holds every finished request for its stores: none is freed deferred.)
        assert calls.get("pop_blocks_for_free", 0) > 0 or conn == "lmcache_mp"
    if CASES[case][0] == "qwen" and "offload" in CASES[case][5]:
        _assert_boundary_lifecycles(ref, partial=case in PREFIX_MATCH_UNIT)
    if case in PREFIX_MATCH_UNIT:
        _assert_partial_hit_lifecycles(case, ref)
    if case in PREEMPTS:
        assert c["preempted"] > 0
    if case in PREEMPTS_WHILE_LOADING:
        assert c["preempted_loading"] > 0
    if case in QWEN_CASES:
        # The per-group hits really diverged in vLLM's run (full attention deeper than the
        # Mamba groups).
        assert ref["per_group"]["fa_deeper"] > 0 and calls["hit_diverged"] > 0
        if role == "kv_consumer":
            # Such hits were adopted with remote tokens (the rest reconciled), with
            # preemption (while loads were pending, but in the reverse case's workload).
            assert calls["alloc_divergent"] > 0 and calls["alloc_local_and_external"] > 0
            assert c["preempted"] > 0
            assert c["preempted_loading"] > 0 or case.endswith("_reverse")
        else:
            # No remote tokens back a diverged hit: the scheduler reconciles every one.
            assert calls.get("alloc_divergent", 0) == 0
        if case.endswith("_reverse"):
            assert ref["per_group"]["fa_lagging"] > 0 and c["aborted_prefilling"] > 0


# Cases whose workload preempts requests (and, for the second set, while other requests'
# loads are pending), on both releases.
PREEMPTS = {"llama_consumer", "llama_consumer_fail", "llama_consumer_async", "gemma_consumer"}
PREEMPTS |= {"gemma_consumer_async", "llama_offload", "llama_multi_offload", "gemma_multi_offload"}
PREEMPTS |= {"qwen_offload", "qwen_offload_async", "qwen_multi_offload"}
PREEMPTS_WHILE_LOADING = {"llama_consumer", "gemma_consumer_async"}


def _assert_boundary_lifecycles(ref: dict[str, Any], partial: bool = False) -> None:
    """What a GDN + full case claims, in vLLM's own run (ours is compared to it): vLLM's
    manager handed the OffloadingConnector boundary states (the same ones, step by step, as
    ours: ``steps[i]["boundary"]``), over several chunks of one prefill, and later requests
    loaded offloaded prefixes back (a Mamba state only reaches the CPU tier as a boundary
    state); requests finished (producer role: ``finalize_partial_tail_offloads`` called for
    each) and were aborted while running. ``partial``: sub-block partial hash hits
    (``prefix_match_unit``), whose workload is smaller; see ``_assert_partial_hit_lifecycles``."""
    c = ref["counters"]
    assert (
        c["boundary_states"] > (20 if partial else 50)
        and c["load_jobs"] > 0
        and c["recv"] > 0
        and c["aborted_running"] > 0
    )
    chunks: dict[str, set[int]] = {}  # request -> steps that handed over its states
    for i, step in enumerate(ref["steps"]):
        for taken in step["boundary"]:
            for rid, entries in taken:
                # Each boundary once per Mamba group (a chunk with a prefill checkpoint
                # hands over two: the checkpoint and the running state).
                bounds = {n for _, _, n in entries}
                assert all(sorted(g for g, _, m in entries if m == n) == [0, 1, 2] for n in bounds), entries
                chunks.setdefault(rid, set()).add(i)
    assert max(len(s) for s in chunks.values()) >= 2, chunks
    assert len(ref["finals"]) >= 20
    if not partial:
        # vLLM hands a finishing producer's partial tail over only for a boundary key ending
        # inside its Mamba block (sub-block partial hits); here it returns nothing, as ours.
        assert not any(res for _, res in ref["finals"])


def _assert_partial_hit_lifecycles(case: str, ref: dict[str, Any]) -> None:
    """What a ``*_pmu`` case (GDN + full, blocks of 16, ``prefix_match_unit`` 8) claims, in
    vLLM's run (ours is compared to it step by step): hits ending inside a block redirected by
    copy-on-write (``kv_cache_block_copies``), producer partial tails handed to the connector by
    the copy-on-write that preserved them (a boundary state inside its block), and requests
    aborted right after the chunk that ends at the prompt's last hash boundary. A producer's
    finish there returns the tail (``finalize_partial_tail_offloads``, every Mamba group) when
    nothing is in flight (sync scheduling); a consumer trims a sub-block local tail behind a
    longer remote hit (``truncate_computed_blocks``)."""
    c, calls = ref["counters"], ref["calls"]
    _, role, _, overlap, _, _ = CASES[case]
    assert c["cow_copies"] > 10 and c["boundary_partial"] > 10, c
    assert c["aborted_partial_tail"] > 0, c
    finals = [res for _, res in ref["finals"]]
    if role in ("kv_producer", "kv_both"):
        assert finals, "a producer's finish asks for its partial tails"
        if not overlap:
            tails = [res for res in finals if res]
            assert tails, "no finish found its partial tail"
            assert all(sorted(g for g, _, _ in res) == [0, 1, 2] and len({n for _, _, n in res}) == 1 for res in tails)
            assert all(n % 16 for res in tails for _, _, n in res)
    else:
        assert not finals
    if role == "kv_consumer":
        assert calls.get("truncate_computed_blocks", 0) > 0, calls


def test_boundary_state_offloads_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An off-by-one boundary in the offloads our manager hands the connector fails the
    step-by-step comparison (the direct record and the store jobs the connector builds)."""
    from connector_driver import assert_same_pd
    from hybrid_alloc.vllm.boundary import BoundaryOffloads

    orig = BoundaryOffloads.take

    def off_by_one(self: Any) -> dict[str, list[tuple[int, int, int]]]:
        return {r: [(g, b, n + 1) for g, b, n in e] for r, e in orig(self).items()}

    monkeypatch.setattr(BoundaryOffloads, "take", off_by_one)
    ref, ours = _pair("qwen_offload")
    with pytest.raises(AssertionError, match="step [0-9]+: (boundary|meta) differs"):
        assert_same_pd("qwen_offload", ref, ours)


@pytest.mark.parametrize("case", ["llama_simple_lazy", "qwen_simple_pmu"])
def test_simple_cpu_offload_under_hit_aware_keeps_invariants(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the hit-aware policy (no parity: it evicts by its own order) SimpleCPUOffload's
    pins, walks of the leveled free queue and ``evict_first`` frees keep the core's invariants
    (checked after every step) and the workload runs to its end with stores and loads."""
    from connector_driver import run_pd

    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    setup, w, role = setup_case(case)
    res = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    assert res["native"] == "HybridKVCacheManager" and res["finished"]
    c = res["counters"]
    assert c["store_events"] > 20 and c["load_events"] > 5 and c["preempted"] > 0, c


@pytest.mark.parametrize(
    ("bug", "case"),
    [
        ("walk_skips_front", "llama_simple_lazy"),
        ("evict_first_ignored", "llama_simple_lazy"),
        ("touch_skips_last", "llama_simple_lazy"),
        ("touch_skips_last", "llama_mooncake_store"),
        ("touch_skips_last", "llama_umbp"),
        ("next_skips_one", "llama_lmcache_mp_lazy"),
        ("touch_skips_last", "llama_lmcache_mp_lazy"),
    ],
)
def test_pool_facade_planted_bug_is_caught(bug: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block pool facade that walks the free queue from its second block, queues the blocks
    the lazy stores give back at the back instead of the front, or pins one block fewer fails
    the step-by-step comparison with vLLM's manager (the store decisions in the metadata, the
    pool calls, the allocations that follow, or a free the core refuses), with
    SimpleCPUOffload, MooncakeStore and UMBP; a free-queue link that skips a block fails it with
    LMCacheMP's lazy offload (its walks, compared call by call)."""
    from connector_driver import assert_same_pd
    from hybrid_alloc.vllm import facades

    _skip_without_umbp(case)
    if "lmcache" in case and (importlib.util.find_spec("lmcache") is None or not _lmcache_reads_this_vllm()):
        pytest.skip("lmcache's scheduler side does not run on this vLLM (0.34) or is not installed")
    if bug == "next_skips_one":
        from hybrid_alloc.vllm import blocks

        orig_next = blocks.NativeBlock.next_free_block.fget
        assert orig_next is not None

        def next_skips_one(self: Any) -> Any:
            nxt = orig_next(self)
            return orig_next(nxt) if isinstance(nxt, blocks.NativeBlock) else nxt

        monkeypatch.setattr(blocks.NativeBlock, "next_free_block", property(next_skips_one))
    elif bug == "walk_skips_front":
        orig_walk = facades.NativeFreeBlockQueue.iter_blocks_after

        def walk(self: Any, block: Any) -> Any:
            it = orig_walk(self, block)
            next(it, None)
            return it

        monkeypatch.setattr(facades.NativeFreeBlockQueue, "iter_blocks_after", walk)
    elif bug == "evict_first_ignored":
        if not _EVICT_FIRST:
            pytest.skip("this vLLM's BlockPool.free_blocks has no evict_first (0.34 has)")
        orig_free = facades.NativeBlockPool.free_blocks
        monkeypatch.setattr(
            facades.NativeBlockPool, "free_blocks", lambda self, blocks, evict_first=False: orig_free(self, blocks)
        )
    else:
        orig_touch = facades.NativeBlockPool.touch
        monkeypatch.setattr(facades.NativeBlockPool, "touch", lambda self, blocks: orig_touch(self, list(blocks)[:-1]))
    from hybrid_alloc.errors import InvalidBlockError

    try:
        ref, ours = _pair(case)
    except InvalidBlockError as e:  # the core refuses a free of a reference never taken
        assert bug == "touch_skips_last" and "freed more times" in str(e), e
        return
    with pytest.raises(AssertionError, match="differs"):
        assert_same_pd(case, ref, ours)


@pytest.mark.parametrize("case", ["llama_consumer", "gemma_consumer", "gemma_multi_offload"])
def test_cache_blocks_after_async_load(case: str) -> None:
    """Right after the scheduler caches a finished async load (``cache_blocks`` while the
    request still waits for remote KVs), a request with the same prompt hits the loaded
    blocks, as with vLLM's manager: the next allocation would re-cache them anyway, so a
    step-by-step diff would barely see a missing call."""
    ref, ours = _pair(case)
    assert ref["after_load"] == ours["after_load"]
    assert len(ref["after_load"]) >= 8
    bs = 16
    # The full blocks the load wrote are a hit (all but the last when the prompt ends on a
    # block boundary: a hit leaves the last token to compute). With a sliding window group,
    # a few loads are no hit at all, with vLLM's manager as with ours (compared above).
    full = [(rid, n, hit) for rid, n, hit in ours["after_load"] if hit >= (n // bs - 1) * bs > 0]
    if case.startswith("llama"):
        assert len(full) == len(ours["after_load"]), ours["after_load"]
    else:
        assert 2 * len(full) >= len(ours["after_load"]), ours["after_load"]


@pytest.mark.parametrize("case", ["llama_consumer", "gemma_consumer"])
def test_truncate_computed_blocks_matches_vllm(case: str) -> None:
    """``truncate_computed_blocks`` on a real hit (as the scheduler calls it when a remote
    hit beats a local sub-block tail): the same block ids per group as vLLM's, for every
    block-aligned endpoint, and the hit's own blocks untouched."""
    from hybrid_alloc.bench.offline import fabricate_output, make_request

    out = {}
    for mgr_name in ("vllm", "hybrid_alloc"):
        setup, _, _ = setup_case(case)
        sched = dataclasses.replace(setup, manager=mgr_name).build()
        prompt = list(range(1, 200))
        sched.add_request(make_request(sched, "a", prompt, 2))
        for _ in range(10):
            so = sched.schedule()
            sched.update_from_output(so, fabricate_output(sched, so))
        mgr = sched.kv_cache_manager
        probe = make_request(sched, "b", prompt, 1)
        blocks, hit, _ = mgr.get_computed_blocks(probe)
        before = blocks.get_block_ids()
        res = [hit]
        for n in range(0, hit + 1, 16):
            t = mgr.truncate_computed_blocks(blocks, n)
            res.append((n, t.get_block_ids(), [[b.block_id for b in g] for g in t.blocks]))
        assert blocks.get_block_ids() == before
        mgr.free(probe)
        out[mgr_name] = res
        sched.shutdown()
    assert out["vllm"][0] >= 160
    assert out["vllm"] == out["hybrid_alloc"]


def _fallback_line(
    caplog: pytest.LogCaptureFixture, ktc: Any, shape: str = "gemma", caching: bool = True, **cache: Any
) -> tuple[str, list[str]]:
    from hybrid_alloc.bench.offline import SchedulerSetup

    caplog.set_level(logging.INFO, logger="vllm.hybrid_alloc")
    setup = SchedulerSetup(
        shape=tiny_shapes()[shape],
        manager="hybrid_alloc",
        num_blocks=60,
        enable_prefix_caching=caching,
        extra={"kv_transfer_config": ktc},
    )
    if cache:
        # ``CacheConfig`` fields set on the built config (``SchedulerSetup`` makes its own).
        vllm_config = setup.vllm_config

        def patched() -> Any:
            vc = vllm_config()
            for k, v in cache.items():
                setattr(vc.cache_config, k, v)
            return vc

        setup.vllm_config = patched  # type: ignore[method-assign]
    sched = setup.build()
    name = type(sched.kv_cache_manager).__name__
    sched.shutdown()
    lines = [r.getMessage() for r in caplog.records if "falling back to vLLM's KVCacheManager" in r.getMessage()]
    return name, lines


_SIMPLE_CPU = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
}


@pytest.mark.parametrize("conn", ["SimpleCPUOffloadConnector", "MultiConnector", "module_path"])
@pytest.mark.parametrize("shape", ["gemma", "qwen"])
def test_simple_cpu_offload_served_without_a_fallback_line(
    conn: str, shape: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SimpleCPUOffloadConnector (alone, under a MultiConnector over NixlConnector, and vLLM's
    own class from its module path) is served: its scheduler side works on the manager's block
    pool facade (the ``*simple*`` cases of ``test_connector_scheduler_identical`` compare it
    with vLLM's manager)."""
    from vllm.config import KVTransferConfig

    monkeypatch.delenv("HYBRID_ALLOC_PAGES", raising=False)
    if conn == "SimpleCPUOffloadConnector":
        ktc = KVTransferConfig(**_SIMPLE_CPU)
    elif conn == "MultiConnector":
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, _SIMPLE_CPU]
            },
        )
    else:
        path = "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"
        ktc = KVTransferConfig(**_SIMPLE_CPU, kv_connector_module_path=path)
    name, lines = _fallback_line(caplog, ktc, shape)
    assert name == "HybridKVCacheManager" and not lines, lines


def test_simple_cpu_offload_with_two_level_pages_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two-level pages the pool refuses ``touch`` (the core's ``touch_block_ids``), so
    SimpleCPUOffloadConnector is not served there: the reason names both."""
    from vllm.config import KVTransferConfig

    from hybrid_alloc.vllm.connector import connector_reason

    class _Config:
        kv_transfer_config = KVTransferConfig(**_SIMPLE_CPU)

    from vllm.v1.kv_cache_interface import KVCacheConfig

    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    monkeypatch.setenv("HYBRID_ALLOC_PAGES", "two-level")
    reason = connector_reason(_Config(), kvc)
    assert reason == (
        "KV connector SimpleCPUOffloadConnector (with two-level pages, whose block pool does not serve "
        "touch) is configured"
    )
    monkeypatch.setenv("HYBRID_ALLOC_PAGES", "off")
    assert connector_reason(_Config(), kvc) is None


@pytest.mark.parametrize("conn", ["module_pins", "module_hands_off"])
def test_unserved_connector_falls_back_with_one_line(conn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A connector from a module path that pins blocks (``block_pool.touch``) outside what the
    manager vets, or hands the pool to code outside its package, builds vLLM's own manager,
    with one line naming the connector and what it reads."""
    from vllm.config import KVTransferConfig

    if conn == "module_pins":
        ktc = KVTransferConfig(
            kv_connector="PinningConnector", kv_connector_module_path="module_connectors", kv_role="kv_both"
        )
        line = _source_line(module_connectors.PinningConnector.request_finished_all_groups, "touch")
        expect = (
            "KV connector PinningConnector (from module_connectors), which reads block_pool.touch "
            f"(module_connectors:{line}): not served by hybrid_alloc is configured"
        )
    else:
        ktc = KVTransferConfig(
            kv_connector="HandOffConnector", kv_connector_module_path="module_connectors", kv_role="kv_both"
        )
        line = _source_line(module_connectors.HandOffConnector.bind_gpu_block_pool, "finalize(")
        expect = (
            "KV connector HandOffConnector (from module_connectors), which hands block_pool to finalize(), "
            f"whose code is not found (module_connectors:{line}): not served by hybrid_alloc is configured"
        )
    name, lines = _fallback_line(caplog, ktc)
    assert name == "KVCacheManager"
    assert len(lines) == 1 and lines[0].endswith(expect), lines


def _source_line(fn: Any, needle: str) -> int:
    """The line of ``fn``'s source (in its file) holding ``needle``."""
    import inspect

    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(src) if needle in text)


def test_nixl_is_served_natively_without_a_fallback_line(caplog: pytest.LogCaptureFixture) -> None:
    from connector_driver import nixl_config

    name, lines = _fallback_line(caplog, nixl_config("kv_both"))
    assert name == "HybridKVCacheManager" and not lines


@pytest.mark.parametrize(
    "module_path,cls,shape",
    [
        ("module_connectors", "HashStoreConnector", "gemma"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector", "gemma"),
        ("lmcache.integration.vllm.lmcache_connector_v1", "LMCacheConnectorV1Dynamic", "gemma"),
    ],
)
def test_module_path_connector_served(module_path: str, cls: str, shape: str, caplog: pytest.LogCaptureFixture) -> None:
    """Connectors from a module path that the vetting passes build the native manager, with no
    fallback line: one written for the tests (``SupportsHMA``, it binds the pool and reads only
    served attributes; on a Gemma-like model's two groups), vLLM's own NixlConnector from its
    module (judged as the registered one), LMCache's own module path (no hybrid manager
    support: vLLM's one unified group)."""
    from vllm.config import KVTransferConfig

    if module_path.startswith("lmcache") and importlib.util.find_spec("lmcache") is None:
        pytest.skip("the lmcache package is not installed")
    ktc = KVTransferConfig(kv_connector=cls, kv_connector_module_path=module_path, kv_role="kv_both")
    name, lines = _fallback_line(caplog, ktc, shape)
    assert name == "HybridKVCacheManager" and not lines, lines


def test_module_path_vetting_reads() -> None:
    """The vetting's findings on the test connectors and LMCache's: the test store reads only
    what is served; the pinning one's ``touch`` and the hand-off are found where they are;
    LMCache's ``LMCacheConnectorV1Dynamic`` reads nothing of the manager, and its
    ``LMCacheMPConnector``'s lazy offload (behind ``lmcache.mp.lazy_offload``) walks the free
    list and pins blocks. Every name the vetting counts as served is one a built manager has."""
    from hybrid_alloc.vllm.connector_reads import SERVED, unserved_reads

    assert unserved_reads(module_connectors.HashStoreConnector) == ()
    (pins,) = unserved_reads(module_connectors.PinningConnector)
    assert pins.startswith("reads block_pool.touch (module_connectors:")
    (hands,) = unserved_reads(module_connectors.HandOffConnector)
    assert hands.startswith("hands block_pool to finalize(), whose code is not found")
    if importlib.util.find_spec("lmcache") is not None:
        from lmcache.integration.vllm import lmcache_connector_v1, lmcache_mp_connector

        assert unserved_reads(lmcache_connector_v1.LMCacheConnectorV1Dynamic) == ()
        mp = " ".join(unserved_reads(lmcache_mp_connector.LMCacheMPConnector))
        assert "free_block_queue.fake_free_list_head" in mp and "block_pool.touch" in mp, mp
    # SERVED against a built manager's objects.
    setup, _, _ = setup_case("qwen_offload")
    sched = dataclasses.replace(setup, manager="hybrid_alloc").build()
    mgr = sched.kv_cache_manager
    objs = {
        "manager": mgr,
        "block_pool": mgr.block_pool,
        "coordinator": mgr.coordinator,
        "free_block_queue": mgr.block_pool.free_block_queue,
        "block": mgr.block_pool.blocks[1],
    }
    objs["single_type_manager"] = next(
        m for m in mgr.coordinator.single_type_managers if hasattr(m, "mamba_cache_mode")
    )
    for kind, obj in objs.items():
        missing = sorted(n for n in SERVED[kind] if not hasattr(obj, n))
        assert not missing, (kind, missing)
    sched.shutdown()


def test_mamba_divergent_hit_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof can fail: with the reconciled hit handed back where vLLM's manager hands the
    per-group one (``get_computed_blocks`` plus ``hit_diverged=False``), the step-by-step
    comparison of a GDN + full consumer case breaks."""
    import dataclasses

    import hybrid_alloc.vllm.manager as manager
    from connector_driver import assert_same_pd, run_pd

    case = QWEN_CASES[0]
    setup, w, role = setup_case(case)
    ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)

    def reconciled(mgr: Any, request: Any, max_cache_hit_length: Any) -> Any:
        return *mgr.get_computed_blocks(request, max_cache_hit_length), False

    monkeypatch.setattr(manager, "local_hit_for_connector", reconciled)
    planted = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    with pytest.raises(AssertionError):
        assert_same_pd(case, ref, planted)


def _qwen_manager(mgr_name: str) -> tuple[Any, Any]:
    from connector_driver import nixl_config
    from hybrid_alloc.bench.offline import SchedulerSetup

    setup = SchedulerSetup(
        shape=tiny_shapes()["qwen"],
        manager=mgr_name,
        num_blocks=60,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_events=True,
        extra={"kv_transfer_config": nixl_config("kv_consumer")},
    )
    sched = setup.build()
    return sched, sched.kv_cache_manager


def _lookup(mgr: Any, request: Any) -> tuple[Any, ...]:
    blocks, n, boundary, diverged = mgr.get_computed_blocks_for_connector(request)
    per_group_blocks, per_group = mgr.coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    return (
        blocks.get_block_ids(),
        n,
        boundary,
        diverged,
        [[b.block_id for b in g] for g in per_group_blocks],
        tuple(per_group),
    )


def test_mamba_connector_hit_both_ways_matches_vllm() -> None:
    """``get_computed_blocks_for_connector`` on a GDN + full manager, against vLLM's on the same
    calls: a convergent hit; then, after a deferred free (the scheduler frees a deferred table
    in reverse, full attention's blocks first) and block pressure that evicts full attention's
    tail while the Mamba state survives, a Mamba group deeper than full attention (vLLM then
    reconciles: no hit, the shared prefix as the boundary); and full attention deeper than the
    Mamba groups (``hit_diverged``), adopted with external tokens as the scheduler does. The
    coordinator facade's ``find_longest_cache_hit_per_group`` answers as vLLM's, and the
    tables, free counts and events after the adoption are the same."""
    import random

    from hybrid_alloc.bench.offline import make_request

    out: dict[str, list[Any]] = {}
    for mgr_name in ("vllm", "hybrid_alloc"):
        sched, mgr = _qwen_manager(mgr_name)
        fa = mgr.coordinator.full_attention_group_id
        bs = mgr.coordinator.single_type_managers[fa].block_size
        rng = random.Random(1)
        prompt = [rng.randrange(1, 30000) for _ in range(9 * bs + 6)]
        res: list[Any] = []
        a = make_request(sched, "a", prompt, 1)
        assert mgr.get_computed_blocks_for_connector(a)[1] == 0
        # One chunk up to the prompt's last block boundary: its Mamba state is cached there.
        assert mgr.allocate_slots(a, 9 * bs) is not None
        b = make_request(sched, "b", prompt, 1)
        res.append(_lookup(mgr, b))
        # The scheduler's deferred free of ``a`` (``pop_blocks_for_free``, freed in reverse).
        mgr.block_pool.free_blocks(reversed(mgr.pop_blocks_for_free(a)))
        # Pressure: a fresh request takes every never-used block and two of ``a``'s.
        held = sum(len([x for x in g if x]) for g in res[0][0])
        unused = mgr.block_pool.get_num_free_blocks() - held
        c = make_request(sched, "c", [rng.randrange(1, 30000) for _ in range(60 * bs)], 1)
        assert mgr.allocate_slots(c, (unused + 2 - 3) * bs) is not None
        res.append(_lookup(mgr, b))
        # Full attention deeper than the Mamba groups: ``a``'s first blocks, another suffix.
        d = make_request(sched, "d", prompt[: 5 * bs] + [rng.randrange(1, 30000) for _ in range(3 * bs)], 1)
        blocks, n, _, diverged = mgr.get_computed_blocks_for_connector(d)
        res.append(_lookup(mgr, d))
        assert diverged
        mgr.free(c)
        new = mgr.allocate_slots(
            d,
            0,
            num_new_computed_tokens=n,
            new_computed_blocks=blocks,
            num_external_computed_tokens=d.num_tokens - 1 - n,
            delay_cache_blocks=True,
        )
        res.append((new.get_block_ids(), mgr.get_block_ids("d"), mgr.block_pool.get_num_free_blocks()))
        res.append(mgr.take_events())
        out[mgr_name] = res
        sched.shutdown()
    ref = out["vllm"]
    fa_hit = ref[0][5][-1]
    # Convergent at first; then the Mamba groups hold a deeper state than full attention
    # (reconciled: no hit, a boundary); then full attention deeper (diverged).
    assert ref[0][1] == fa_hit > 0 and not ref[0][3] and min(ref[0][5]) == fa_hit
    assert max(ref[1][5]) > ref[1][5][-1] and ref[1][1] == 0 and ref[1][2] > 0 and not ref[1][3]
    assert ref[2][3] and min(ref[2][5]) < ref[2][1]
    assert out["hybrid_alloc"][:4] == ref[:4]
    assert [repr(e) for e in out["hybrid_alloc"][4]] == [repr(e) for e in ref[4]]


@pytest.mark.parametrize(
    "conn", ["offload", "multi_offload", "nixl", "multi_nixl_offload", "sub_block", "sub_block_nixl", "mode_none"]
)
def test_mamba_with_connector_falls_back_or_not(conn: str, caplog: pytest.LogCaptureFixture) -> None:
    """GDN + full: the OffloadingConnector (alone or under a MultiConnector over it only),
    NixlConnector (whose scheduler asks for vLLM's per-group divergent hit) and a
    MultiConnector over both are served natively, also with a prefix match unit below the
    Mamba block (sub-block partial hash hits: the ``*_pmu`` cases prove them). With prefix
    caching off (Mamba cache mode "none") vLLM's OffloadingConnector refuses the hybrid."""
    from connector_driver import nixl_config

    case = {"multi_offload": "qwen_multi_offload", "multi_nixl_offload": "gemma_multi_offload"}.get(
        conn, "qwen_offload"
    )
    nixl = conn in ("nixl", "sub_block_nixl")
    ktc = nixl_config("kv_both") if nixl else setup_case(case)[0].extra["kv_transfer_config"]
    cache = {"prefix_match_unit": 8} if conn.startswith("sub_block") else {}
    if conn == "mode_none":
        # Prefix caching off (Mamba cache mode "none"): vLLM's OffloadingConnector refuses
        # the hybrid itself; the manager's guard for that mode ("... in cache mode 'none'")
        # stays for a release that would not.
        with pytest.raises(AssertionError, match="need --enable-prefix-caching"):
            _fallback_line(caplog, ktc, "qwen", caching=False)
        return
    name, lines = _fallback_line(caplog, ktc, "qwen", **cache)
    assert name == "HybridKVCacheManager" and not lines, lines


def test_boundary_state_offloads_dropped_with_freed_blocks() -> None:
    """The manager calls without the scheduler, on vLLM's manager and ours (GDN + full, the
    OffloadingConnector configured): four chunked prefills of the same length key their
    prompt's state in their third chunk; one request freed and one popped for a deferred free
    before the offloads are taken take their entries with them (vLLM's
    ``pop_blocks_for_free`` drops them: the blocks may already be another request's). Same
    dicts, step by step."""
    from hybrid_alloc.bench.offline import make_request

    out = {}
    for mgr_name in ("vllm", "hybrid_alloc"):
        setup, _, _ = setup_case("qwen_offload")
        sched = dataclasses.replace(setup, manager=mgr_name).build()
        mgr = sched.kv_cache_manager
        reqs = [make_request(sched, f"r{i}", [i * 1000 + t for t in range(1, 200)], 1) for i in range(4)]
        got: list[Any] = []
        # The scheduler's chunks for Mamba "align": block-aligned, the last but one ending
        # at the prompt's checkpoint (192), whose state is kept.
        for chunk, n in enumerate((80, 80, 32)):
            for r in reqs:
                assert mgr.allocate_slots(r, n) is not None
                r.num_computed_tokens += n
            if chunk == 2:
                mgr.free(reqs[1])
                mgr.block_pool.free_blocks(mgr.pop_blocks_for_free(reqs[2]))
            got.append(list(mgr.take_boundary_state_offloads().items()))
            mgr.new_step_starts()
        out[mgr_name] = (type(mgr).__name__, got)
        sched.shutdown()
    assert out["vllm"][0] == "KVCacheManager" and out["hybrid_alloc"][0] == "HybridKVCacheManager"
    got = out["vllm"][1]
    # vLLM's retention mask keys only the prompt's state (at 192 of 199 tokens) here.
    assert got[:2] == [[], []]
    assert [r for r, _ in got[2]] == ["r0", "r3"], "the freed and the popped request's entries are dropped"
    assert all(sorted((g, n) for g, _, n in e) == [(0, 192), (1, 192), (2, 192)] for _, e in got[2]), got[2]
    assert out["vllm"][1] == out["hybrid_alloc"][1]


def test_lmcache_mp_connector_served_or_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LMCacheMPConnector`` (the lmcache package's) is served, with or without lazy offload, on
    releases whose ``CachedRequestData`` has ``resumed_req_ids`` (the ``*_lmcache_mp*`` cases
    prove it); on 0.34, with lazy offload under two-level pages (no ``touch``) or without the
    package (vLLM's in-tree copy) it falls back with its reason."""
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from hybrid_alloc.vllm.connector import _unserved

    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    lazy_extra = {"lmcache.mp.lazy_offload": True}
    plain = _unserved("LMCacheMPConnector", None, {}, kvc)
    lazy = _unserved("LMCacheMPConnector", None, lazy_extra, kvc)
    if importlib.util.find_spec("lmcache") is None:
        assert plain is not None and "in-tree" in plain, plain
        return
    if "resumed_req_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}:
        assert plain is None and lazy is None, (plain, lazy)
    else:
        assert plain is not None and "resumed_req_ids" in plain, plain
    monkeypatch.setenv("HYBRID_ALLOC_PAGES", "two-level")
    paged = _unserved("LMCacheMPConnector", None, lazy_extra, kvc)
    assert paged is not None and "two-level pages" in paged, paged
    assert _unserved("LMCacheMPConnector", None, {}, kvc) == plain
