"""Drives the installed vLLM's (a supported release's) real Scheduler (sync or async) with a
KV connector configured (NixlConnector as KV consumer or producer, the OffloadingConnector,
MultiConnectors over them, SimpleCPUOffloadConnector, MooncakeStoreConnector, ...) through a
seeded workload of P/D lifecycles, faking the worker side as vLLM's own connector unit tests do:
each step's ``ModelRunnerOutput`` carries a ``KVConnectorOutput`` with ``finished_recving``,
``finished_sending``, ``invalid_block_ids``, ``failed_recving`` and the connector's worker
metadata (transfer jobs, store events, store jobs completed); MooncakeStore's lookups are
answered by :class:`FakeMooncakeLookup`; optionally with speculative decoding (drafts,
accepted in part). With a connector bound to the scheduler's pool (SimpleCPUOffload,
MooncakeStore) a run also records every ``touch`` and ``free_blocks`` it makes on the pool.

A run records, per step, the SchedulerOutput digest, the connector metadata the scheduler
built (times dropped: they are wall-clock), the free block count, the requests whose blocks
wait for ``finished_sending`` (delayed frees), the manager's and the connector's KV cache
events, every local hit the scheduler took through ``get_computed_blocks_for_connector``
(block ids per group, tokens, boundary, ``hit_diverged``) and every shared-prefix junction the
connector raised (``get_num_new_matched_tokens``), so two runs (vLLM's manager and ours) can
be compared step by step; with vLLM's manager, also how often its per-group lookup diverged
each way. The NIXL scheduler side needs ``zmq`` and ``msgspec`` only (both in the test
environments), not the ``nixl`` package.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc.bench.offline import SchedulerSetup, fabricate_output
from sched_driver import capture_events, digest, fabricate_drafts, fabricate_spec_output


def nixl_config(role: str, failure_policy: str = "recompute") -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_load_failure_policy=failure_policy)


def _plain(obj: Any, depth: int = 0) -> Any:
    """A comparable form of connector metadata: Requests by id, floats (wall-clock
    deadlines) dropped, tensors and arrays (a transfer job's block ids) as lists, objects by
    their attributes, sets sorted. NixlConnector's ``heartbeat_by_engine`` is dropped too:
    the scheduler side packs it only when ``heartbeat_interval`` of wall time passed since it
    last did (``build_connector_meta``), so which step carries it depends on how long the
    steps took (on a loaded machine the two runs put it on different steps), not on the
    manager."""
    if depth > 8:
        return "..."
    if isinstance(obj, Request):
        return ("Request", obj.request_id)
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str, bytes)):
        return obj
    if isinstance(obj, float):
        return "float"
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): _plain(v, depth + 1) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (set, frozenset)):
        return sorted((_plain(v, depth + 1) for v in obj), key=repr)
    if isinstance(obj, (list, tuple)):
        return [_plain(v, depth + 1) for v in obj]
    attrs = getattr(obj, "__dict__", None)
    if attrs is None and hasattr(obj, "__slots__"):
        attrs = {s: getattr(obj, s, None) for s in obj.__slots__}
    if attrs is None:
        return type(obj).__name__
    return {
        "_type": type(obj).__name__,
        **{k: _plain(v, depth + 1) for k, v in sorted(attrs.items()) if k not in _WALL_CLOCK_THROTTLED},
    }


#: Metadata fields whose presence on a step is decided by wall time (see :func:`_plain`).
_WALL_CLOCK_THROTTLED = frozenset({"heartbeat_by_engine"})


@dataclass
class PDWorkload:
    """What the fake worker does: a request listed in ``fail`` has its remote load fail
    (``invalid_block_ids`` with one KV cache group, ``failed_recving`` otherwise, as vLLM 0.33
    requires), one in ``abort_waiting`` is aborted while it waits for remote KVs; loads
    finish ``recv_delay`` steps after the worker is asked for them, sends ``send_delay``
    steps after the request finished."""

    seed: int = 3
    num_requests: int = 24
    remote_share: float = 0.7
    recv_delay: int = 2
    send_delay: int = 3
    fail: set[str] = field(default_factory=set)
    abort_waiting: set[str] = field(default_factory=set)
    use_failed_recving: bool = False
    fail_running: set[str] = field(default_factory=set)
    abort_running: set[str] = field(default_factory=set)
    # Steps in flight (2: the next step is scheduled before the last one's output is
    # processed, as vLLM's engine core does with async scheduling).
    batch_queue: int = 1
    # The native OffloadingConnector's worker: every transfer job in the metadata completes
    # (``OffloadingWorkerMetadata.completed_jobs``) after the delays above, a sync load in its
    # own step; an async load's request is reported in ``finished_recving``.
    offload: bool = False
    # A MultiConnector over NixlConnector and the OffloadingConnector: the offloading child's
    # index among ``num_children`` (its metadata and worker metadata are the Multi's tuples'
    # entries); remote requests load through NIXL, the rest through offloaded transfer jobs.
    offload_child: int | None = None
    num_children: int = 2
    # ExampleConnector (one unified KV cache group): its worker saves each stored prompt to a
    # folder under ``storage`` (the fake creates the folder, named as the connector names it)
    # and loads synchronously in the step; the first ``fail_sync_loads`` loads report a block
    # invalid (``invalid_block_ids``). ``repeat_share``: the share of requests that repeat an
    # earlier request's whole prompt (the connector hits whole prompts only).
    example_storage: str | None = None
    example_child: int | None = None  # its index under a MultiConnector
    # LMCacheConnectorV1 (one unified group): the same save and sync-load work, done by
    # :class:`lmcache_worker.LMCacheWorker` (a lookup server over the stored chunks; under a
    # MultiConnector, the child ``example_child``).
    lmcache: bool = False
    fail_sync_loads: int = 0
    repeat_share: float = 0.0
    # The range ``max_tokens`` is drawn from for a request that is not a producer's remote
    # one (those decode 1 token). Short ones finish while their prompt's last Mamba state is
    # still in their table.
    max_tokens: tuple[int, int] = (1, 60)
    # Requests aborted once their prefill has started and before it ends (with a step in
    # flight under async scheduling: their table is freed deferred, in reverse).
    abort_prefilling: set[str] = field(default_factory=set)
    # Requests aborted once their prefill stops inside a block before the prompt's end
    # (sub-block partial hash hits: the chunk that ends at the prompt's last hash boundary,
    # where a producer's partial tail is keyed; the finish hands it to the connector).
    abort_partial_tail: set[str] = field(default_factory=set)
    # Speculative decoding (a ``SpecSchedulerSetup``, ``num_spec_tokens`` drafts a step):
    # outputs carry the accepted share of the scheduled drafts, and in sync scheduling the
    # proposer's drafts are handed to the scheduler after each step, as ``sched_driver`` does.
    spec_tokens: int = 0
    # SimpleCPUOffloadConnector: its worker finishes each load event's requests
    # (``finished_recving``) ``recv_delay`` steps after the metadata asks for it, and each
    # store event (``SimpleCPUOffloadWorkerMetadata.completed_store_events``) ``send_delay``
    # steps after; under a MultiConnector, the child ``simple_child``.
    simple_cpu: bool = False
    simple_child: int | None = None
    # MooncakeStoreConnector: its lookups (``LookupKeyClient``, ZMQ to rank 0's worker in vLLM)
    # answered by :class:`FakeMooncakeLookup` over the keys of the store jobs completed so far;
    # each store job (``ReqMeta.store_job_id``) completes ``send_delay`` steps after the
    # metadata carries it (``MooncakeStoreWorkerMetadata.completed_saves``), each load
    # ``recv_delay`` steps after (``finished_recving``).
    mooncake_store: bool = False
    # UMBPStoreConnector: its runtime (the ``umbp`` package's, built through vLLM's
    # ``UMBPRuntimeFactory``) replaced by :class:`FakeUMBPRuntime`, whose scheduler handle answers
    # ``lookup(keys)`` from the keys of the store events completed so far; each store event
    # (``UMBPConnectorMetadata.store_event``) completes ``send_delay`` steps after the metadata
    # carries it (``UMBPConnectorWorkerMetadata.store_events``), each async load ``recv_delay``
    # steps after (``finished_recving``).
    umbp: bool = False
    # LMCacheMPConnector (the ``lmcache`` package's, without lazy offload): its LMCache
    # multiprocess server's client (``LMCacheMPSchedulerAdapter``) replaced by
    # :class:`FakeLMCacheMPAdapter`, whose lookups answer from the chunks of the stores completed
    # so far; each store op completes ``send_delay`` steps after the metadata carries it, each
    # retrieve ``recv_delay`` steps after (``finished_recving``), and each finished request
    # (held: the connector stores as a producer) is reported sent once its stores are done.
    lmcache_mp: bool = False
    # The remote requests' ``kv_transfer_params`` as this connector reads them: "nixl"
    # (NixlConnector's) or "mooncake" (MooncakeConnector's: a bootstrap address and a
    # transfer id instead of remote block ids).
    params: str = "nixl"


def _make_request(sched: Any, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args=None if params is None else {"kv_transfer_params": params},
        ),
        pooling_params=None,
        block_hasher=sched._hybrid_alloc_block_hasher,
    )


def _remote_params(role: str, rid: str, kind: str = "nixl") -> dict[str, Any]:
    if kind == "mooncake":
        if role == "kv_consumer":
            return dict(
                do_remote_prefill=True,
                do_remote_decode=False,
                remote_engine_id="remote-engine",
                remote_bootstrap_addr="127.0.0.1:5998",
                transfer_id=f"xfer-{rid}",
            )
        return dict(do_remote_decode=True, do_remote_prefill=False, transfer_id=f"xfer-{rid}")
    common = dict(
        remote_engine_id="remote-engine",
        remote_request_id=f"remote-{rid}",
        remote_host="127.0.0.1",
        remote_port=5999,
        tp_size=1,
    )
    if role == "kv_consumer":
        return dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[1, 2, 3], **common)
    return dict(do_remote_decode=True, do_remote_prefill=False)


def _lagging_groups(mgr: Any, blocks: Any, num_new_computed_tokens: int) -> list[int]:
    """The groups of ``blocks`` (an ``allocate_slots`` hit) holding fewer tokens than
    ``num_new_computed_tokens``: a per-group hit whose groups diverged."""
    if blocks is None or not num_new_computed_tokens:
        return []
    sizes = [m.block_size for m in mgr.coordinator.single_type_managers]
    return [g for g, ids in enumerate(blocks.get_block_ids()) if len(ids) * sizes[g] < num_new_computed_tokens]


def _record_local_hits(mgr: Any, calls: dict[str, int]) -> list[Any]:
    """Wraps ``mgr.get_computed_blocks_for_connector`` (the local hit the scheduler takes
    when the connector allows divergent hybrid hits): each call's request, block ids per
    group, local tokens, shared-prefix boundary and ``hit_diverged``, in order."""
    out: list[Any] = []
    orig = mgr.get_computed_blocks_for_connector

    def lookup(request: Request, *a: Any, **k: Any) -> Any:
        blocks, n, boundary, diverged = orig(request, *a, **k)
        out.append((request.request_id, blocks.get_block_ids(), n, boundary, diverged))
        if diverged:
            calls["hit_diverged"] = calls.get("hit_diverged", 0) + 1
        return blocks, n, boundary, diverged

    mgr.get_computed_blocks_for_connector = lookup  # type: ignore[method-assign]
    return out


def _record_per_group(mgr: Any) -> dict[str, int]:
    """vLLM's manager only: how often its per-group lookup (the coordinator's
    ``find_longest_cache_hit_per_group``) found full attention deeper than another group,
    and another group deeper than full attention (the hit it then reconciles)."""
    out = {"fa_deeper": 0, "fa_lagging": 0}
    coord = mgr.coordinator
    fa = getattr(coord, "full_attention_group_id", None)
    if type(mgr).__name__ != "KVCacheManager" or fa is None:
        return out
    orig = coord.find_longest_cache_hit_per_group

    def per_group(*a: Any, **k: Any) -> Any:
        blocks, hits = orig(*a, **k)
        out["fa_deeper"] += min(hits) < hits[fa]
        out["fa_lagging"] += max(hits) > hits[fa]
        return blocks, hits

    coord.find_longest_cache_hit_per_group = per_group
    return out


def _record_connector(sched: Any, calls: dict[str, int]) -> tuple[list[Any], list[tuple[str, int, int]]]:
    """Wraps the scheduler's connector: every KV event it hands the scheduler
    (``take_events``: the OffloadingConnector's CPU-tier ``BlockStored`` / ``BlockRemoved``),
    and each ``get_num_new_matched_tokens`` call that raised the request's
    ``shared_prefix_boundary`` (vLLM 0.34's OffloadingConnector does where a sliding-window or
    Mamba group cut the external hit below the full-attention boundary): (request, the
    junction the local lookup set, the connector's). Counts the lookups not answered yet
    (``None``) in ``calls["connector_pending"]``."""
    conn = sched.connector
    events: list[Any] = []
    raised: list[tuple[str, int, int]] = []
    orig_take = conn.take_events
    orig_match = conn.get_num_new_matched_tokens

    def take_events() -> list[Any]:
        evs = list(orig_take() or ())
        events.extend(evs)
        return evs

    def get_num_new_matched_tokens(request: Request, *a: Any, **k: Any) -> Any:
        before = request.shared_prefix_boundary
        res = orig_match(request, *a, **k)
        if res[0] is None:
            # The connector's lookup is not answered yet (UMBP's ``lookup_async``).
            calls["connector_pending"] = calls.get("connector_pending", 0) + 1
        if request.shared_prefix_boundary != before:
            raised.append((request.request_id, before, request.shared_prefix_boundary))
            calls["junction_raised"] = calls.get("junction_raised", 0) + 1
        return res

    conn.take_events = take_events
    conn.get_num_new_matched_tokens = get_num_new_matched_tokens
    return events, raised


class FakeMooncakeLookup:
    """Stands for MooncakeStore's ``LookupKeyClient``: the worker's ``lookup`` (the longest hit
    of the store coordinator over the ``(group, hash)`` keys present, recomputing the last
    token) over the keys ``stored`` holds, which the fake worker adds when a store job
    completes: every store group's hash keys up to the job's ``token_len_chunk``."""

    #: The keys present (shared by the run: set by ``run_pd``).
    stored: set[tuple[int, bytes]] = set()
    #: The scheduler side whose store coordinator answers (set at its first lookup).
    coord: Any = None

    def __init__(self, vllm_config: Any) -> None:
        del vllm_config

    def lookup(self, req_id: str, num_tokens: int, block_hashes: Any, non_block: bool = False) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import ExternalCachedBlockPool
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult

        coord = type(self).coord
        token_len = coord.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return MooncakeLookupResult(0)
        pool = ExternalCachedBlockPool(coord.hash_block_size, set(type(self).stored))
        _, hit = coord.find_longest_cache_hit(block_hashes, token_len, pool)
        if hit >= num_tokens:
            usable = coord.align_lookup_length(num_tokens - 1)
            if usable <= 0:
                return MooncakeLookupResult(0)
            _, hit = coord.find_longest_cache_hit(block_hashes, usable, pool)
        return MooncakeLookupResult(hit)

    def prefetch(self, req_id: str, num_tokens: int, block_hashes: Any) -> bool:
        return False

    def discard(self, req_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class _SyncExecutor:
    """Runs what is submitted at once (a done future): UMBP's scheduler submits its KV event
    residency checks to a thread pool and reads the answer the next step only if it is done,
    which with threads would depend on timing; with this it always is."""

    def submit(self, fn: Any, *a: Any, **k: Any) -> Any:
        from concurrent.futures import Future

        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*a, **k))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class FakeUMBPHandle:
    """Stands for the ``umbp`` runtime's ``UMBPSchedulerHandle``: ``lookup(keys)`` answers, per
    key, whether it is among the keys ``stored`` holds (which the fake worker adds when a store
    event completes: every plan's key). Nothing is ever evicted."""

    #: The keys present (shared by the run: set by ``run_pd``).
    stored: set[str] = set()

    def lookup(self, keys: Any) -> list[bool]:
        return [k in type(self).stored for k in keys]

    def clear(self) -> bool:
        type(self).stored.clear()
        return True

    def close(self) -> None:
        pass


class FakeUMBPRuntime:
    """Stands for the runtime vLLM's ``UMBPRuntimeFactory`` builds (MORI's, not installed):
    the scheduler's handle only (the worker side is faked by the driver)."""

    def __init__(self, config: Any) -> None:
        del config

    def create_scheduler_handle(self, namespace: str, topology: Any, layout: Any) -> FakeUMBPHandle:
        del namespace, topology, layout
        return FakeUMBPHandle()

    def create_worker_handle(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("the driver fakes the worker side")


class FakeLMCacheMPAdapter:
    """Stands for ``LMCacheMPSchedulerAdapter`` (the LMCache multiprocess server's client on the
    scheduler, ZMQ in lmcache): a lookup submitted is answered at the next check after the one
    that submitted it (``None`` first, as a server still prefetching), with the longest prefix
    of whole chunks whose keys ``stored`` holds at submission; the rest (locks, sessions,
    telemetry) does nothing. A chunk's key is the prompt's tokens up to its end."""

    #: The chunks present (shared by the run: set by ``run_pd``).
    stored: set[tuple[int, ...]] = set()
    chunk: int = 64

    def __init__(self, **kw: Any) -> None:
        self.lmcache_tokens_per_chunk = type(self).chunk
        self.blocks_in_chunk = self.lmcache_tokens_per_chunk // int(kw["vllm_block_size"])
        self._lookups: dict[str, list[int]] = {}  # request -> [hit, checks so far]

    def maybe_submit_lookup_request(
        self,
        request_id: str,
        token_ids: list[int],
        cache_salt: str = "",
        request_configs: Any = None,
        reserve_last_token: bool = False,
    ) -> None:
        if request_id in self._lookups:
            return
        n = len(token_ids) - (1 if reserve_last_token else 0)
        c, hit = self.lmcache_tokens_per_chunk, 0
        while hit + c <= n and tuple(token_ids[: hit + c]) in type(self).stored:
            hit += c
        self._lookups[request_id] = [hit, 0]

    def check_lookup_result(self, request_id: str) -> int | None:
        entry = self._lookups.get(request_id)
        if entry is None:
            return None
        entry[1] += 1
        return None if entry[1] == 1 else entry[0]

    def cleanup_lookup_result(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk

    def free_lookup_locks(self, **kw: Any) -> None:
        pass

    def end_session(self, request_id: str) -> None:
        pass

    def update_pending_store_count(self, req_id: str, count: int) -> bool:
        return count >= 1  # one worker

    def report_block_allocations(self, records: Any) -> None:
        pass

    def reset_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _record_pool(pool: Any, caller: str = "vllm.v1.simple_kv_offload.") -> list[Any]:
    """Wraps the block pool's ``touch`` and ``free_blocks``: each call made from a module
    under ``caller`` (the connector bound to the pool; vLLM's manager touches its own pool for
    hits, which ours does inside its core), with its block ids, in order, and ``evict_first``."""
    out: list[Any] = []
    orig_touch, orig_free = pool.touch, pool.free_blocks

    def _ours() -> bool:
        return str(sys._getframe(2).f_globals.get("__name__", "")).startswith(caller)

    def touch(blocks: Any) -> None:
        blocks = list(blocks)
        if _ours():
            out.append(("touch", [b.block_id for b in blocks]))
        orig_touch(blocks)

    def free_blocks(blocks: Any, evict_first: bool = False) -> None:
        blocks = list(blocks)
        if _ours():
            out.append(("free", [b.block_id for b in blocks], evict_first))
        if evict_first:
            orig_free(blocks, evict_first=True)
        else:
            orig_free(blocks)

    pool.touch = touch
    pool.free_blocks = free_blocks
    return out


def run_pd(setup: SchedulerSetup, role: str, w: PDWorkload, max_steps: int = 600) -> dict[str, Any]:
    """One run; returns per-step records and counters (see the module docstring)."""
    rng = random.Random(w.seed)
    if w.example_storage is not None:
        # Each run starts with nothing saved.
        shutil.rmtree(w.example_storage, ignore_errors=True)
        os.makedirs(w.example_storage)
    if w.mooncake_store:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import scheduler as moon_sched

        FakeMooncakeLookup.stored = set()
        with mock.patch.object(moon_sched, "LookupKeyClient", FakeMooncakeLookup):
            sched = setup.build()
        moon = sched.connector.connector_scheduler
        FakeMooncakeLookup.coord = moon._store_coord
    elif w.lmcache_mp:
        from lmcache.integration.vllm import lmcache_mp_connector as lmc_mp

        FakeLMCacheMPAdapter.stored = set()
        with mock.patch.object(lmc_mp, "LMCacheMPSchedulerAdapter", FakeLMCacheMPAdapter):
            sched = setup.build()
    elif w.umbp:
        from vllm.distributed.kv_transfer.kv_connector.v1.umbp.runtime import UMBPRuntimeFactory

        FakeUMBPHandle.stored = set()
        # vLLM 0.34 registers its MORI-backed runtimes; 0.33 none (the ``umbp`` package would):
        # the fake is the "embedded" one while the scheduler is built (patch.dict restores the
        # registry as it was, the key removed if it was absent).
        with mock.patch.dict(UMBPRuntimeFactory._builders, {"embedded": FakeUMBPRuntime}):
            sched = setup.build()
        umbp = sched.connector.connector_scheduler
        umbp._lookup_executor.shutdown(wait=True)
        umbp._lookup_executor = _SyncExecutor()
        # Its re-checks of published objects run at most once a wall-clock second; the fake
        # store never evicts, so they would answer nothing new: off, so that a run does not
        # depend on the clock.
        umbp._next_event_reconcile = float("inf")
    else:
        sched = setup.build()
    mgr = sched.kv_cache_manager
    lmc = None
    if w.lmcache:
        from lmcache_worker import LMCacheWorker

        lmc = LMCacheWorker(sched, w.example_child)
    events = capture_events(mgr)
    calls: dict[str, int] = {}

    def count(name: str) -> None:
        fn = getattr(mgr, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)

        setattr(mgr, name, wrapped)

    for name in (
        "evict_blocks",
        "pop_blocks_for_free",
        "free",
        "record_blocks_for_zeroing",
        "truncate_computed_blocks",
    ):
        count(name)
    connector_events, junctions = _record_connector(sched, calls)
    pool_calls: list[Any] = []
    if w.simple_cpu:
        pool_calls = _record_pool(mgr.block_pool)
    elif w.mooncake_store:
        pool_calls = _record_pool(mgr.block_pool, "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.")
    elif w.umbp:
        pool_calls = _record_pool(mgr.block_pool, "vllm.distributed.kv_transfer.kv_connector.v1.umbp.")
    elif w.lmcache_mp:
        pool_calls = _record_pool(mgr.block_pool, "lmcache.integration.vllm.")
        lazy = getattr(sched.connector, "_lazy_offload_manager", None)
        policy = getattr(lazy, "_policy", None)
        if policy is not None and hasattr(policy, "_free_queue_ranks"):
            # Its eviction-aware policy's walks of the free queue's front (through
            # ``fake_free_list_head`` / ``next_free_block``): each walk's blocks and ranks.
            orig_ranks = policy._free_queue_ranks

            def free_queue_ranks(depth: int) -> dict[int, int]:
                ranks = orig_ranks(depth)
                pool_calls.append(("walk", depth, sorted(ranks.items())))
                return ranks

            policy._free_queue_ranks = free_queue_ranks
    second_keys = {"n": 0}
    if w.simple_cpu:
        # The stored blocks that hold second keys (partial hash hits), as the connector reads
        # them from the pool when a store completes (``cached_block_hashes_by_block``).
        simple = sched.connector if w.simple_child is None else sched.connector._connectors[w.simple_child]
        simple_mgr = simple.scheduler_manager
        orig_completion = simple_mgr._process_store_completion

        def completion(gpu_ids: list[int], *a: Any, **k: Any) -> Any:
            by_block = simple_mgr._gpu_block_pool.cached_block_hashes_by_block
            second_keys["n"] += sum(1 for b in gpu_ids if by_block.get(b, ()))
            return orig_completion(gpu_ids, *a, **k)

        simple_mgr._process_store_completion = completion
    # What the cache holds right after the scheduler caches an async load (before the next
    # allocation would re-cache the same blocks): a probe with the same prompt looks it up.
    after_load: list[tuple[str, int, int]] = []
    orig_cache_blocks = mgr.cache_blocks

    def cache_blocks(request: Request, num_computed_tokens: int) -> None:
        calls["cache_blocks"] = calls.get("cache_blocks", 0) + 1
        orig_cache_blocks(request, num_computed_tokens)
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            probe = _make_request(sched, "probe", request.prompt_token_ids, 1, None)
            _, hit, _ = mgr.get_computed_blocks(probe)
            mgr.free(probe)
            after_load.append((request.request_id, num_computed_tokens, hit))

    mgr.cache_blocks = cache_blocks  # type: ignore[method-assign]
    orig_allocate = mgr.allocate_slots

    def allocate_slots(request: Request, num_new_tokens: int, *a: Any, **k: Any) -> Any:
        raised_to = next((j for r, _, j in reversed(junctions) if r == request.request_id), 0)
        if raised_to == request.shared_prefix_boundary > 0:
            # The manager reads the junction the connector raised (the request's admission).
            calls["alloc_connector_junction"] = calls.get("alloc_connector_junction", 0) + 1
        if k.get("num_external_computed_tokens", 0) < 0:
            # ExampleConnector's hit behind a longer local one.
            calls["alloc_negative_external"] = calls.get("alloc_negative_external", 0) + 1
        if _lagging_groups(mgr, k.get("new_computed_blocks"), k.get("num_new_computed_tokens", 0)):
            # A connector's per-group hit adopted with a group lagging behind full attention.
            calls["alloc_divergent"] = calls.get("alloc_divergent", 0) + 1
        if k.get("num_external_computed_tokens", 0) > 0:
            calls["alloc_external"] = calls.get("alloc_external", 0) + 1
            if k.get("num_new_computed_tokens", 0) > 0:
                calls["alloc_local_and_external"] = calls.get("alloc_local_and_external", 0) + 1
            if k.get("delay_cache_blocks"):
                calls["alloc_delay_cache"] = calls.get("alloc_delay_cache", 0) + 1
            if k["num_external_computed_tokens"] % setup.block_size:
                # Not whole blocks (LMCache's partial last chunk, its full hit less one token).
                calls["alloc_unaligned_external"] = calls.get("alloc_unaligned_external", 0) + 1
        junction = request.shared_prefix_boundary
        res = orig_allocate(request, num_new_tokens, *a, **k)
        if request.shared_prefix_boundary != junction:
            # The manager moved the junction (the hit-aware policy's first-sighting stops),
            # which must never lower it (below one the connector raised, say).
            calls["alloc_moved_junction"] = calls.get("alloc_moved_junction", 0) + 1
            if request.shared_prefix_boundary < junction:
                calls["alloc_lowered_junction"] = calls.get("alloc_lowered_junction", 0) + 1
        return res

    mgr.allocate_slots = allocate_slots  # type: ignore[method-assign]
    local_hits = _record_local_hits(mgr, calls)
    per_group = _record_per_group(mgr)
    # The Mamba "align" boundary states the scheduler hands the connector each step, and the
    # producer partial tails finished requests hand it, as each manager returned them.
    boundary: list[Any] = []
    finals: list[tuple[str, Any]] = []
    orig_take = mgr.take_boundary_state_offloads
    orig_finalize = mgr.finalize_partial_tail_offloads

    def take_boundary_state_offloads() -> dict[str, list[tuple[int, int, int]]]:
        res = orig_take()
        boundary.append(list(res.items()))
        return res

    def finalize_partial_tail_offloads(request: Request) -> list[tuple[int, int, int]]:
        res = orig_finalize(request)
        finals.append((request.request_id, list(res)))
        return res

    mgr.take_boundary_state_offloads = take_boundary_state_offloads  # type: ignore[method-assign]
    mgr.finalize_partial_tail_offloads = finalize_partial_tail_offloads  # type: ignore[method-assign]
    mml = setup.shape.max_model_len
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.randrange(60, 300))] for _ in range(3)]
    pending = []
    remote: set[str] = set()
    for i in range(w.num_requests):
        rid = f"req{i}"
        toks = list(prefixes[rng.randrange(3)]) if rng.random() < 0.6 else []
        toks += [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 400))]
        toks = toks[: mml - 100]
        if w.repeat_share and pending and rng.random() < w.repeat_share:
            toks = list(pending[rng.randrange(len(pending))][2])
        is_remote = rng.random() < w.remote_share or rid in w.fail | w.abort_waiting | w.fail_running
        params = _remote_params(role, rid, w.params) if is_remote else None
        if is_remote:
            remote.add(rid)
        mt = 1 if (is_remote and role == "kv_producer") else rng.randrange(*w.max_tokens)
        pending.append((rng.randrange(0, 30), rid, toks, mt, params))
    pending.sort(key=lambda p: p[0])
    recv_due: dict[str, int] = {}  # request -> step its load completes
    jobs_due: dict[int, tuple[int, str | None]] = {}  # offloading job -> (step, request of an async load)
    stores_due: dict[int, int] = {}  # SimpleCPUOffload store event -> step it completes
    # MooncakeStore store job -> (step it completes, the keys it stores)
    saves_due: dict[int, tuple[int, set[tuple[int, bytes]]]] = {}
    # UMBP store event -> (step it completes, the keys it stores)
    umbp_due: dict[int, tuple[int, set[str]]] = {}
    # LMCacheMP store op -> (step it completes, the chunks it stores); request -> its last
    # store's step
    mp_due: dict[int, tuple[int, set[tuple[int, ...]], str]] = {}
    mp_last_store: dict[str, int] = {}
    send_due: dict[str, int] = {}
    loaded: dict[str, int] = {}  # request -> step its load was reported done
    steps: list[dict[str, Any]] = []
    counters = {
        "recv": 0,
        "sent": 0,
        "failed": 0,
        "failed_running": 0,
        "aborted_waiting": 0,
        "aborted_running": 0,
        "aborted_prefilling": 0,
        "aborted_partial_tail": 0,
        "waited": 0,
        "delayed_free": 0,
        "preempted": 0,
        "overlapped": 0,
        "jobs": 0,
        "preempted_loading": 0,
        "load_jobs": 0,
        "sync_loads": 0,
        "stores": 0,
        "failed_sync": 0,
        "boundary_states": 0,
        "boundary_partial": 0,
        "cow_copies": 0,
        "drafts": 0,
        "store_events": 0,
        "load_events": 0,
        "stored_blocks": 0,
        "loaded_blocks": 0,
    }
    # ExampleConnector: the prompts to save (folders to create) and the first block of each
    # sync load, for the step whose output is next processed.
    example_work: dict[int, tuple[list[Any], list[int]]] = {}
    multi_group = len(sched.kv_cache_config.kv_cache_groups) > 1
    in_flight: deque[tuple[Any, Any, dict[str, Any]]] = deque()
    check = getattr(mgr, "check_invariants", None)

    def process(so: Any, out: Any, d: dict[str, Any], step: int) -> None:
        """The worker's answer to a step (its model output made when it was scheduled),
        then the scheduler's update from it."""
        finished_recving = {r for r, s in recv_due.items() if s <= step}
        completed = {j: 1 for j, (s, _) in jobs_due.items() if s <= step}
        for j in completed:
            _, rid = jobs_due.pop(j)
            if rid is not None:
                finished_recving.add(rid)
        finished_sending = {r for r, s in send_due.items() if s <= step}
        invalid: set[int] = set()
        failed: set[str] = set()
        for rid in sorted(finished_recving & w.fail):
            req = sched.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            counters["failed"] += 1
            if multi_group or w.use_failed_recving:
                failed.add(rid)
            else:
                (ids,) = mgr.get_block_ids(rid)
                invalid.add(ids[len(ids) // 2])
        for rid in sorted(w.fail_running):
            # A load reported done, whose blocks turn out invalid once the request runs
            # (a sync failure: the scheduler evicts them under the "fail" policy).
            req = sched.requests.get(rid)
            if loaded.get(rid) == step - 2 and req is not None and req.status == RequestStatus.RUNNING:
                (ids,) = mgr.get_block_ids(rid)
                if ids:
                    invalid.add(ids[len(ids) // 3])
                    counters["failed_running"] += 1
        stores, sync_loads = example_work.pop(id(so), ([], []))
        for m in stores:
            if lmc is not None:
                lmc.store(m)
                continue
            example = sched.connector if w.example_child is None else sched.connector._connectors[w.example_child]
            example._generate_foldername_debug(m.token_ids, m.mm_hashes, create_folder=True)
        for block in sync_loads:
            if counters["failed_sync"] < w.fail_sync_loads:
                invalid.add(block)
                counters["failed_sync"] += 1
        for r in finished_recving:
            recv_due.pop(r, None)
            loaded[r] = step
        for r in finished_sending:
            del send_due[r]
        counters["recv"] += len(finished_recving)
        counters["sent"] += len(finished_sending)
        worker_meta: Any = OffloadingWorkerMetadata(completed_jobs=completed) if w.offload else None
        if worker_meta is not None and w.offload_child is not None:
            metas: list[Any] = [None] * w.num_children
            metas[w.offload_child] = worker_meta
            worker_meta = MultiKVConnectorWorkerMetadata(metadata=tuple(metas))
        stored = sorted(e for e, s in stores_due.items() if s <= step)
        if w.mooncake_store:
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata

            stored = sorted(j for j, (s, _) in saves_due.items() if s <= step)
            for j in stored:
                FakeMooncakeLookup.stored |= saves_due.pop(j)[1]
            worker_meta = MooncakeStoreWorkerMetadata(completed_saves={j: 1 for j in stored})
        if w.lmcache_mp:
            from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata

            done: dict[str, int] = {}
            for j in sorted(j for j, (s, _, _) in mp_due.items() if s <= step):
                _, chunks, rid = mp_due.pop(j)
                FakeLMCacheMPAdapter.stored |= chunks
                done[rid] = 1
            # (Read in lazy mode only: each request's coalesced store of the step, done.)
            worker_meta = LMCacheMPWorkerMetadata(completed_store_requests=done, failed_store_requests=set())
        if w.umbp:
            from vllm.distributed.kv_transfer.kv_connector.v1.umbp.data import (
                StoreEventResult,
                UMBPConnectorWorkerMetadata,
            )

            stored = sorted(e for e, (s, _) in umbp_due.items() if s <= step)
            for e in stored:
                FakeUMBPHandle.stored |= umbp_due.pop(e)[1]
            worker_meta = UMBPConnectorWorkerMetadata(
                store_events={e: StoreEventResult(completed_workers=1) for e in stored}
            )
        if w.simple_cpu:
            from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

            for e in stored:
                del stores_due[e]
            worker_meta = SimpleCPUOffloadWorkerMetadata(completed_store_events={e: 1 for e in stored})
            if w.simple_child is not None:
                metas = [None] * w.num_children
                metas[w.simple_child] = worker_meta
                worker_meta = MultiKVConnectorWorkerMetadata(metadata=tuple(metas))
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
            kv_connector_worker_meta=worker_meta,
        )
        d["worker"] = (
            sorted(finished_recving),
            sorted(finished_sending),
            sorted(invalid),
            sorted(failed),
            sorted(completed),
            stored,
        )
        counters["jobs"] += len(completed)
        sched.update_from_output(so, out)
        if w.spec_tokens and not setup.async_scheduling:
            sched.update_draft_token_ids(fabricate_drafts(sched, so, w.spec_tokens))
        # Finished requests still held (their blocks wait for finished_sending).
        held = sorted(r for r, q in sched.requests.items() if q.is_finished())
        for r in held:
            if r not in send_due and w.lmcache_mp:
                send_due[r] = max(step + w.send_delay, mp_last_store.get(r, 0))
                counters["delayed_free"] += 1
            elif r not in send_due and r in remote and role == "kv_producer":
                send_due[r] = step + w.send_delay
                counters["delayed_free"] += 1
        d["held"] = held
        if check is not None:
            check()  # ours: the core's invariants (boundary offloads name live requests, ...)
        d["free"] = mgr.block_pool.get_num_free_blocks()
        d["usage"] = mgr.usage

    step = 0
    while (
        pending
        or sched.get_num_unfinished_requests()
        or recv_due
        or send_due
        or jobs_due
        or stores_due
        or saves_due
        or umbp_due
    ) and step < max_steps:
        while pending and pending[0][0] <= step:
            _, rid, toks, mt, params = pending.pop(0)
            sched.add_request(_make_request(sched, rid, toks, mt, params))
        for rid in sorted(w.abort_waiting | w.abort_running | w.abort_prefilling | w.abort_partial_tail):
            req = sched.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if rid in w.abort_partial_tail and req.status == RequestStatus.RUNNING:
                done = req.num_computed_tokens - req.num_in_flight_tokens
                if 0 < done < req.num_prompt_tokens and done % setup.block_size:
                    sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    counters["aborted_partial_tail"] += 1
                continue
            if rid in w.abort_prefilling and req.status == RequestStatus.RUNNING:
                if 0 < req.num_computed_tokens - req.num_in_flight_tokens < req.num_prompt_tokens:
                    sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    counters["aborted_prefilling"] += 1
                continue
            if rid in w.abort_waiting and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                counters["aborted_waiting"] += 1
            elif rid in w.abort_running and req.status == RequestStatus.RUNNING and req.num_output_tokens > 0:
                # With a step in flight: its blocks go back only once that step is done.
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                counters["aborted_running"] += 1
        so = sched.schedule()
        meta = so.kv_connector_metadata
        waiting = sorted(r for r, q in sched.requests.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        if w.offload:
            off_meta = meta if w.offload_child is None else meta.metadata[w.offload_child]
            for jid, job in getattr(off_meta, "load_jobs", {}).items():
                counters["load_jobs"] += 1
                sync = getattr(job, "sync", False)
                jobs_due[jid] = (step if sync else step + w.recv_delay, None if sync else job.req_id)
            for jid in getattr(off_meta, "store_jobs", {}):
                jobs_due[jid] = (step + w.send_delay, None)
        if w.simple_cpu:
            sm = meta if w.simple_child is None else meta.metadata[w.simple_child]
            if sm.load_event >= 0:
                counters["load_events"] += 1
                counters["loaded_blocks"] += len(sm.load_gpu_blocks)
                for rid in sm.load_event_to_reqs.get(sm.load_event, ()):
                    recv_due[rid] = step + w.recv_delay
            if sm.store_event >= 0:
                counters["store_events"] += 1
                counters["stored_blocks"] += len(sm.store_gpu_blocks)
                stores_due[sm.store_event] = step + w.send_delay
        if w.mooncake_store:
            hbs = FakeMooncakeLookup.coord.hash_block_size
            groups = range(len(sched.kv_cache_config.kv_cache_groups))
            for rm in meta.requests:
                if rm.load_spec is not None and rm.load_spec.can_load:
                    counters["load_events"] += 1
                    recv_due[rm.req_id] = step + w.recv_delay
                if rm.can_save and rm.store_job_id is not None and rm.store_job_id not in saves_due:
                    counters["store_events"] += 1
                    n = min(rm.token_len_chunk // hbs, len(rm.block_hashes))
                    keys = {(g, bytes(rm.block_hashes[i])) for g in groups for i in range(n)}
                    counters["stored_blocks"] += n
                    saves_due[rm.store_job_id] = (step + w.send_delay, keys)
        if w.lmcache_mp:
            for rm in meta.requests:
                op = rm.op
                if rm.direction == "RETRIEVE":
                    counters["load_events"] += 1
                    recv_due[rm.request_id] = step + w.recv_delay
                    continue
                counters["store_events"] += 1
                c = FakeLMCacheMPAdapter.chunk
                chunks = {tuple(op.token_ids[:e]) for e in range(op.start + c, op.end + 1, c)}
                counters["stored_blocks"] += len(chunks)
                mp_due[counters["store_events"]] = (step + w.send_delay, chunks, rm.request_id)
                mp_last_store[rm.request_id] = step + w.send_delay
        if w.umbp:
            for rid in meta.load_requests:
                counters["load_events"] += 1
                req = sched.requests.get(rid)
                if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    recv_due[rid] = step + w.recv_delay
                else:
                    counters["sync_loads"] += 1
            if meta.store_event >= 0:
                counters["store_events"] += 1
                keys = {p.key for p in meta.iter_store_plans()}
                counters["stored_blocks"] += len(keys)
                umbp_due[meta.store_event] = (step + w.send_delay, keys)
        if w.example_storage is not None:
            reqs = (meta if w.example_child is None else meta.metadata[w.example_child]).requests
            stores = [m for m in reqs if m.is_store]
            loads = [int(m.slot_mapping[0]) // setup.block_size for m in reqs if not m.is_store]
            counters["stores"] += len(stores)
            counters["sync_loads"] += len(loads)
            example_work[id(so)] = (stores, loads)
        if lmc is not None:
            stores, loads = lmc.work(meta, setup.block_size)
            counters["stores"] += len(stores)
            counters["sync_loads"] += len(loads)
            example_work[id(so)] = (stores, loads)
        # The worker starts each remote (NIXL) load the scheduler parked a request for.
        for rid in waiting:
            if rid in remote and rid not in loaded:  # a finished load waits for the scheduler
                recv_due.setdefault(rid, step + w.recv_delay)
        counters["waited"] += len(waiting)
        d = digest(so)
        d["boundary"] = list(boundary)
        counters["boundary_states"] += sum(len(e) for taken in boundary for _, e in taken)
        # Boundary states inside their block: producer partial tails a copy-on-write kept.
        counters["boundary_partial"] += sum(
            n % setup.block_size != 0 for taken in boundary for _, e in taken for _, _, n in e
        )
        # Copy-on-write copies of sub-block partial hits (``prefix_match_unit``).
        counters["cow_copies"] += len(getattr(so, "kv_cache_block_copies", None) or ())
        boundary.clear()
        counters["preempted"] += len(d["preempted"])
        if waiting:
            # Preempted while other requests' loads are pending.
            counters["preempted_loading"] += len(d["preempted"])
        d["meta"] = _plain(meta)
        steps.append(d)
        if w.spec_tokens:
            d["spec"] = {r: len(t) for r, t in so.scheduled_spec_decode_tokens.items()}
            counters["drafts"] += sum(d["spec"].values())
        out = fabricate_spec_output(sched, so) if w.spec_tokens else fabricate_output(sched, so)
        in_flight.appendleft((so, out, d))
        if len(in_flight) < w.batch_queue and so.total_num_scheduled_tokens > 0:
            step += 1
            continue
        if len(in_flight) > 1:
            counters["overlapped"] += 1
        process(*in_flight.pop(), step)
        step += 1
    while in_flight:
        process(*in_flight.pop(), step)
    counters["second_keys"] = second_keys["n"]
    deferred = bool(getattr(sched, "defer_block_free", False))
    groups = [
        (type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None))
        for g in sched.kv_cache_config.kv_cache_groups
    ]
    finished = step < max_steps
    if lmc is not None:
        lmc.close()
    sched.shutdown()
    return {
        "steps": steps,
        "local_hits": local_hits,
        "per_group": per_group,
        "events": events,
        "connector_events": connector_events,
        "pool_calls": pool_calls,
        "junctions": junctions,
        "lookahead": getattr(sched, "num_hash_lookahead_tokens", 0),
        "calls": calls,
        "after_load": after_load,
        "finals": finals,
        "counters": counters,
        "native": type(mgr).__name__,
        "finished": finished,
        "defer_block_free": deferred,
        "groups": groups,
    }


def assert_same_pd(case: str, ref: dict[str, Any], ours: dict[str, Any]) -> None:
    assert ref["native"] == "KVCacheManager", ref["native"]
    assert ours["native"] == "HybridKVCacheManager", ours["native"]
    assert ref["finished"] and ours["finished"], case
    for i, (a, b) in enumerate(zip(ref["steps"], ours["steps"])):
        for k in a:
            assert a[k] == b[k], f"{case}: step {i}: {k} differs:\n vllm: {a[k]}\n ours: {b[k]}"
    assert len(ref["steps"]) == len(ours["steps"]), case
    for i, (a, b) in enumerate(zip(ref["local_hits"], ours["local_hits"])):
        assert a == b, f"{case}: connector lookup {i} differs:\n vllm: {a}\n ours: {b}"
    assert len(ref["local_hits"]) == len(ours["local_hits"]), case
    assert ref["events"] == ours["events"], f"{case}: KV events differ"
    assert ref["connector_events"] == ours["connector_events"], f"{case}: the connector's KV events differ"
    for i, (a, b) in enumerate(zip(ref["pool_calls"], ours["pool_calls"])):
        assert a == b, f"{case}: block pool call {i} differs:\n vllm: {a}\n ours: {b}"
    assert len(ref["pool_calls"]) == len(ours["pool_calls"]), case
    assert ref["junctions"] == ours["junctions"], f"{case}: the junctions the connector raised differ"
    assert ref["lookahead"] == ours["lookahead"]
    assert ref["calls"] == ours["calls"], (ref["calls"], ours["calls"])
    assert ref["after_load"] == ours["after_load"], f"{case}: the cache after an async load differs"
    assert ref["finals"] == ours["finals"], f"{case}: finalize_partial_tail_offloads differs"
    assert ref["counters"] == ours["counters"]
    assert ref["groups"] == ours["groups"]
