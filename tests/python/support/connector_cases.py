"""The KV connector cases the connector tests share (``test_connector_vllm``,
``test_connector_lookahead``, ``connector_cpu``): the tiny shapes, ``CASES`` (shape, role, pool,
async, load failure policy, connector) and ``setup_case``, which builds one case's
``SchedulerSetup``, connector workload and role."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any


def tiny_shapes() -> dict[str, Any]:
    import torch

    from hybrid_alloc.bench.offline import LayerKind, MambaState, ModelShape

    gdn = MambaState(shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="GDN_ATTN")
    return {
        # Qwen3.5-like: GDN layers with one full attention layer in four (three Mamba "align"
        # groups and one full attention group).
        "qwen": ModelShape(
            "tiny-qwen3.5",
            tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(8)),
            num_kv_heads=2,
            head_size=64,
            weight_bytes=0,
            max_model_len=2048,
            mamba_state=gdn,
        ),
        "llama": ModelShape(
            "tiny-llama",
            tuple(LayerKind("full") for _ in range(4)),
            num_kv_heads=2,
            head_size=64,
            weight_bytes=0,
            max_model_len=2048,
        ),
        "gemma": ModelShape(
            "tiny-gemma",
            tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4)),
            num_kv_heads=2,
            head_size=64,
            weight_bytes=0,
            max_model_len=2048,
        ),
    }


# case: (shape, role, num_blocks, async with 2 steps in flight, load failure policy, connector)
CASES: dict[str, tuple[str, str, int, bool, str, str]] = {
    "llama_consumer": ("llama", "kv_consumer", 120, False, "recompute", "nixl"),
    "llama_consumer_fail": ("llama", "kv_consumer", 120, False, "fail", "nixl"),
    "gemma_consumer": ("gemma", "kv_consumer", 80, False, "recompute", "nixl"),
    "gemma_consumer_fail": ("gemma", "kv_consumer", 80, False, "fail", "nixl"),
    "llama_producer": ("llama", "kv_producer", 50, False, "recompute", "nixl"),
    "gemma_producer": ("gemma", "kv_producer", 80, False, "recompute", "nixl"),
    # vLLM's AsyncScheduler (async scheduling, two steps in flight).
    "llama_consumer_async": ("llama", "kv_consumer", 60, True, "recompute", "nixl"),
    "llama_consumer_async_fail": ("llama", "kv_consumer", 60, True, "fail", "nixl"),
    "gemma_consumer_async": ("gemma", "kv_consumer", 100, True, "recompute", "nixl"),
    "gemma_consumer_async_fail": ("gemma", "kv_consumer", 100, True, "fail", "nixl"),
    "llama_producer_async": ("llama", "kv_producer", 50, True, "recompute", "nixl"),
    "gemma_producer_async": ("gemma", "kv_producer", 80, True, "recompute", "nixl"),
    "gemma_consumer_multi": ("gemma", "kv_consumer", 80, False, "recompute", "multi"),
    "llama_consumer_push": ("llama", "kv_consumer", 120, False, "recompute", "push"),
    "gemma_producer_push": ("gemma", "kv_producer", 80, False, "recompute", "push"),
    # The native OffloadingConnector (CPU offloading): stores and loads as transfer jobs.
    "llama_offload": ("llama", "kv_both", 60, False, "recompute", "offload"),
    "gemma_offload": ("gemma", "kv_both", 60, False, "recompute", "offload"),
    "llama_offload_async": ("llama", "kv_both", 60, True, "recompute", "offload"),
    "gemma_offload_async": ("gemma", "kv_both", 100, True, "recompute", "offload"),
    # A MultiConnector over NixlConnector and the OffloadingConnector (kv_both): remote
    # prefills load through NIXL, local requests' offloaded prefixes through transfer jobs.
    "llama_multi_offload": ("llama", "kv_both", 80, False, "recompute", "multi_offload"),
    "gemma_multi_offload": ("gemma", "kv_both", 80, False, "fail", "multi_offload"),
    "gemma_multi_offload_async": ("gemma", "kv_both", 100, True, "recompute", "multi_offload"),
    # GDN + full (Mamba "align"): the OffloadingConnector stores the boundary states the
    # manager hands it (``take_boundary_state_offloads``) and loads them back.
    "qwen_offload": ("qwen", "kv_both", 120, False, "recompute", "offload"),
    "qwen_offload_async": ("qwen", "kv_both", 140, True, "recompute", "offload"),
    "qwen_multi_offload": ("qwen", "kv_both", 120, False, "recompute", "multi_offload_only"),
    # A MultiConnector over NixlConnector and the OffloadingConnector: Nixl's remote loads and
    # the boundary-state stores in one run (the MultiConnector asks for no divergent hit).
    "qwen_multi_nixl_offload": ("qwen", "kv_both", 200, False, "recompute", "multi_offload"),
    # ExampleConnector, without hybrid manager support: vLLM runs one unified group (the
    # Gemma-like shape's sliding window layers promoted to full attention); sync loads.
    "llama_example": ("llama", "kv_both", 80, False, "recompute", "example"),
    "llama_example_fail": ("llama", "kv_both", 80, False, "fail", "example"),
    "gemma_example": ("gemma", "kv_both", 80, False, "recompute", "example"),
    "gemma_example_async": ("gemma", "kv_both", 80, True, "fail", "example"),
    # A MultiConnector over NixlConnector and ExampleConnector: one unified group too.
    "gemma_multi_example": ("gemma", "kv_both", 80, False, "recompute", "multi_example"),
    # LMCacheConnectorV1 (the ``lmcache`` package's scheduler side), without hybrid manager
    # support either: chunk-prefix hits from a lookup server over the stored chunks, sync
    # loads; "lmcache_unfull" saves and hits partial last chunks too (external counts not
    # block-aligned).
    "llama_lmcache": ("llama", "kv_both", 80, False, "recompute", "lmcache"),
    "gemma_lmcache_async": ("gemma", "kv_both", 80, True, "fail", "lmcache"),
    "llama_lmcache_unfull": ("llama", "kv_both", 80, False, "fail", "lmcache_unfull"),
    # A MultiConnector over NixlConnector and LMCacheConnectorV1: one unified group too.
    "gemma_multi_lmcache": ("gemma", "kv_both", 80, False, "recompute", "multi_lmcache"),
    # LMCache's own module path (``lmcache.integration.vllm.lmcache_connector_v1``,
    # ``LMCacheConnectorV1Dynamic``: the same scheduler side, no hybrid manager support).
    "llama_lmcache_module": ("llama", "kv_both", 80, False, "fail", "lmcache_module"),
    "gemma_lmcache_module_async": ("gemma", "kv_both", 80, True, "recompute", "lmcache_module"),
    # A connector written for the tests, loaded from its module path
    # (``module_connectors.HashStoreConnector``, ``SupportsHMA``): sync external hits from
    # its store of finished requests' block hashes, read through the bound block pool.
    "llama_module": ("llama", "kv_both", 60, False, "recompute", "module_hashstore"),
    "gemma_module": ("gemma", "kv_both", 64, False, "recompute", "module_hashstore"),
    "gemma_module_async": ("gemma", "kv_both", 70, True, "recompute", "module_hashstore"),
    # MooncakeConnector (P/D over Mooncake's transfer engine; its scheduler side needs none
    # of it): remote prefills and decodes as NixlConnector's.
    "llama_mooncake_consumer": ("llama", "kv_consumer", 120, False, "fail", "mooncake"),
    "gemma_mooncake_consumer_async": ("gemma", "kv_consumer", 100, True, "recompute", "mooncake"),
    "gemma_mooncake_producer": ("gemma", "kv_producer", 80, False, "recompute", "mooncake"),
    # SimpleCPUOffloadConnector (its scheduler side pins, walks and frees the scheduler's
    # block pool: ``touch``, ``free_block_queue.iter_blocks_after``, ``free_blocks`` with
    # ``evict_first``, ``get_cached_block``, ``cached_block_hashes_by_block``): eager mode
    # (stores each request's computed blocks) and lazy mode (stores the blocks near the free
    # queue's front), loads of the CPU hits as async loads.
    "llama_simple": ("llama", "kv_both", 60, False, "recompute", "simple"),
    "llama_simple_lazy": ("llama", "kv_both", 60, False, "recompute", "simple_lazy"),
    "gemma_simple": ("gemma", "kv_both", 70, False, "recompute", "simple"),
    "gemma_simple_lazy": ("gemma", "kv_both", 70, False, "recompute", "simple_lazy"),
    "llama_simple_async": ("llama", "kv_both", 60, True, "recompute", "simple"),
    "gemma_simple_lazy_async": ("gemma", "kv_both", 90, True, "recompute", "simple_lazy"),
    "qwen_simple": ("qwen", "kv_both", 120, False, "recompute", "simple"),
    "qwen_simple_lazy": ("qwen", "kv_both", 120, False, "recompute", "simple_lazy"),
    # A MultiConnector over NixlConnector and SimpleCPUOffloadConnector: remote prefills load
    # through NIXL, local requests' stored prefixes from the CPU.
    "llama_multi_simple": ("llama", "kv_both", 80, False, "recompute", "multi_simple"),
    "llama_multi_simple_lazy": ("llama", "kv_both", 80, False, "fail", "multi_simple_lazy"),
    # MooncakeStoreConnector (its lookups faked: ``connector_driver.FakeMooncakeLookup``): store
    # jobs pin the blocks they read (``touch``) until every rank reports them done.
    "llama_mooncake_store": ("llama", "kv_both", 60, False, "recompute", "mooncake_store"),
    "gemma_mooncake_store": ("gemma", "kv_both", 70, False, "recompute", "mooncake_store"),
    "llama_mooncake_store_async": ("llama", "kv_both", 60, True, "recompute", "mooncake_store"),
    # UMBPStoreConnector (vLLM 0.33 and 0.34; its runtime faked: ``connector_driver.FakeUMBPRuntime``):
    # store events pin the blocks they read (``touch``) until done (``free_blocks``); the hits
    # come back as async loads.
    "llama_umbp": ("llama", "kv_both", 60, False, "recompute", "umbp"),
    "gemma_umbp": ("gemma", "kv_both", 70, False, "recompute", "umbp"),
    "llama_umbp_async": ("llama", "kv_both", 60, True, "recompute", "umbp"),
    "gemma_umbp_async": ("gemma", "kv_both", 70, True, "recompute", "umbp"),
    # Its other options that change what reaches the manager: loads in the step
    # (``load_async`` false) with decode blocks stored too, and lookups answered a step later
    # (``lookup_async``: ``get_num_new_matched_tokens`` first returns ``None``).
    "llama_umbp_sync": ("llama", "kv_both", 60, False, "recompute", "umbp_sync"),
    "gemma_umbp_lookup_async": ("gemma", "kv_both", 70, False, "recompute", "umbp_lookup_async"),
    # LMCacheMPConnector without lazy offload (vLLM 0.32 and 0.33; its server's client faked:
    # ``connector_driver.FakeLMCacheMPAdapter``): stores of whole chunks, every finished request
    # held until its stores are done (``finished_sending``), hits loaded async.
    "llama_lmcache_mp": ("llama", "kv_both", 60, False, "recompute", "lmcache_mp"),
    "gemma_lmcache_mp": ("gemma", "kv_both", 70, False, "recompute", "lmcache_mp"),
    "llama_lmcache_mp_async": ("llama", "kv_both", 60, True, "recompute", "lmcache_mp"),
    # With ``lmcache.mp.lazy_offload`` (its eviction-aware policy): stores deferred until the
    # blocks near the free queue's front (``fake_free_list_head`` / ``next_free_block``), pinned
    # while stored (``touch``, ``free_blocks``), completions in the worker metadata. (On the
    # Gemma-like model at these sizes it stores nothing: not a case, and not served there.)
    "llama_lmcache_mp_lazy": ("llama", "kv_both", 60, False, "recompute", "lmcache_mp_lazy"),
    "llama_lmcache_mp_lazy_async": ("llama", "kv_both", 60, True, "recompute", "lmcache_mp_lazy"),
}
# The workload's seed and share of remote requests, where a case needs others than the
# default to show what it claims (the Gemma-like consumers: local hits joined with remote ones).
WORKLOAD_SEED: dict[str, tuple[int, float]] = {
    "gemma_consumer": (7, 0.5),
    "gemma_consumer_fail": (7, 0.5),
    "gemma_consumer_multi": (7, 0.5),
}

# GDN + full attention (Qwen3.5-like, Mamba "align") with NixlConnector, in both roles (a
# producer's ``finalize_partial_tail_offloads`` is ``[]`` without sub-block partial hits: see
# the ``*_pmu`` cases below for them), each with vLLM's Scheduler and AsyncScheduler, both failure policies, NixlConnector
# alone, its push variant and under a MultiConnector. The local hit is vLLM's per-group one
# (``get_computed_blocks_for_connector``): shared prefixes whose Mamba state is not cached make
# full attention hit deeper than the Mamba groups (``hit_diverged``), adopted as is when the
# connector loads the rest (a producer reconciles every diverged hit).
# (``kv_both`` is served too, as it is without Mamba layers; the driver's workload, like the
# cases above, runs NixlConnector as consumer or producer.)
MAMBA_ROLES: tuple[str, ...] = ("kv_consumer", "kv_producer")
# (suffix, num_blocks, async, load failure policy, connector, workload seed)
_QWEN: tuple[tuple[str, int, bool, str, str, int], ...] = (
    ("", 120, False, "recompute", "nixl", 3),
    ("_fail", 80, False, "fail", "nixl", 7),
    ("_async", 70, True, "recompute", "nixl", 7),
    ("_async_fail", 70, True, "fail", "nixl", 11),
    ("_multi", 80, False, "recompute", "multi", 7),
    ("_push", 80, False, "recompute", "push", 7),
    # The reverse: a Mamba group deeper than full attention (vLLM reconciles). Requests
    # aborted mid-prefill with a step in flight are freed deferred, in reverse (full
    # attention's blocks first), so pressure evicts full attention's tail while the Mamba
    # state survives, and repeated prompts look it up.
    ("_async_reverse", 50, True, "recompute", "nixl", 11),
)
# Workload changes per case suffix (``PDWorkload`` fields).
QWEN_WORKLOAD: dict[str, dict[str, Any]] = {
    "_async_reverse": dict(repeat_share=0.5, abort_prefilling={f"req{i}" for i in range(0, 24, 2)} - {"req2"}),
}
# The remote share of the workload, where a case needs another than 0.7.
QWEN_REMOTE_SHARE: dict[str, float] = {"_async_reverse": 0.3}
QWEN_CASES: list[str] = []
for _role in MAMBA_ROLES:
    for _sfx, _blocks, _overlap, _policy, _conn, _seed in _QWEN:
        if _sfx == "_async_reverse" and _role != "kv_consumer":
            continue  # its aborts mid-prefill make sense for remote prefills only
        _case = f"qwen_{_role.removeprefix('kv_')}{_sfx}"
        CASES[_case] = ("qwen", _role, _blocks, _overlap, _policy, _conn)
        WORKLOAD_SEED[_case] = (_seed, QWEN_REMOTE_SHARE.get(_sfx, 0.7))
        QWEN_CASES.append(_case)

# Sub-block partial hash hits with a connector: the Qwen3.5-like shape (blocks of 16 tokens)
# with ``cache_config.prefix_match_unit`` 8, so hits may end inside a block (copy-on-write),
# the prompt's last hash boundary is keyed inside its block (a producer's partial tail, handed
# to the connector by the copy-on-write that preserves it, or at the finish) and the scheduler
# trims a sub-block local tail when the connector's hit exceeds it
# (``truncate_computed_blocks``). The OffloadingConnector (kv_both: it stores and loads) and
# NixlConnector as producer and as consumer, with the Scheduler and the AsyncScheduler;
# prompts repeat earlier ones, so local hits end on the partial tails.
PREFIX_MATCH_UNIT: dict[str, int] = {}
for _case, _spec in {
    "qwen_offload_pmu": ("qwen", "kv_both", 120, False, "recompute", "offload"),
    "qwen_offload_pmu_async": ("qwen", "kv_both", 140, True, "recompute", "offload"),
    "qwen_producer_pmu": ("qwen", "kv_producer", 120, False, "recompute", "nixl"),
    "qwen_producer_pmu_async": ("qwen", "kv_producer", 120, True, "recompute", "nixl"),
    "qwen_consumer_pmu": ("qwen", "kv_consumer", 120, False, "recompute", "nixl"),
    "qwen_consumer_pmu_async": ("qwen", "kv_consumer", 120, True, "fail", "nixl"),
    # SimpleCPUOffload's eager mode stores a prompt's partial tail block, found by its second
    # key (``cached_block_hashes_by_block``), and registers every key of a stored block.
    "qwen_simple_pmu": ("qwen", "kv_both", 120, False, "recompute", "simple"),
}.items():
    CASES[_case] = _spec
    PREFIX_MATCH_UNIT[_case] = 8
    WORKLOAD_SEED[_case] = (7, 0.5)


def setup_case(case: str) -> tuple[Any, Any, str]:
    setup, w, role = _setup_case(case)
    unit = PREFIX_MATCH_UNIT.get(case)
    if unit is not None:
        setup = dataclasses.replace(setup, prefix_match_unit=unit)
        # Some requests aborted right after the chunk that ends at the prompt's last hash
        # boundary inside a block: a producer's finish then finds its partial tail.
        aborts = {f"req{i}" for i in range(4, 30, 3)} - w.fail - w.abort_waiting - w.abort_running
        w = dataclasses.replace(w, repeat_share=max(w.repeat_share, 0.5), abort_partial_tail=aborts)
    return setup, w, role


def _setup_case(case: str) -> tuple[Any, Any, str]:
    from vllm.config import KVTransferConfig

    from connector_driver import PDWorkload, nixl_config
    from hybrid_alloc.bench.offline import SchedulerSetup

    shape, role, blocks, overlap, policy, conn = CASES[case]
    if conn == "multi":
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector", "kv_role": role}]},
        )
    elif conn == "offload":
        ktc = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role=role,
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22},
        )
    elif conn == "multi_offload_only":
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_connector_extra_config={
                "connectors": [
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_role": role,
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22},
                    },
                ]
            },
        )
    elif conn == "multi_offload":
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": role},
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_role": role,
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22},
                    },
                ]
            },
        )
    elif conn in ("example", "multi_example"):
        storage = os.path.join(tempfile.gettempdir(), f"hybrid_alloc-example-{os.getpid()}-{case}")
        example = {"kv_connector": "ExampleConnector", "kv_role": role}
        example["kv_connector_extra_config"] = {"shared_storage_path": storage}
        if conn == "example":
            ktc = KVTransferConfig(**example, kv_load_failure_policy=policy)
        else:
            ktc = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role=role,
                kv_load_failure_policy=policy,
                kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector", "kv_role": role}, example]},
            )
    elif "lmcache" in conn and not conn.startswith("lmcache_mp"):
        # Both keys every time: the package's configuration is one object per process.
        lmc: dict[str, Any] = {"lmcache.chunk_size": 64, "lmcache.save_unfull_chunk": conn == "lmcache_unfull"}
        # A lookup that timed out would count as a miss in one run only.
        lmc["lmcache.lookup_timeout_ms"] = 120_000
        child = {"kv_connector": "LMCacheConnectorV1", "kv_role": role, "kv_connector_extra_config": lmc}
        if conn == "lmcache_module":
            child["kv_connector"] = "LMCacheConnectorV1Dynamic"
            child["kv_connector_module_path"] = "lmcache.integration.vllm.lmcache_connector_v1"
        if conn == "multi_lmcache":
            ktc = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role=role,
                kv_load_failure_policy=policy,
                kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector", "kv_role": role}, child]},
            )
        else:
            ktc = KVTransferConfig(**child, kv_load_failure_policy=policy)
    elif conn == "push":
        ktc = KVTransferConfig(kv_connector="NixlPushConnector", kv_role=role, kv_load_failure_policy=policy)
    elif conn == "mooncake":
        ktc = KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role, kv_load_failure_policy=policy)
    elif conn in ("simple", "simple_lazy"):
        ktc = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role=role,
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22, "lazy_offload": conn == "simple_lazy"},
        )
    elif conn in ("multi_simple", "multi_simple_lazy"):
        simple_child = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22, "lazy_offload": conn == "multi_simple_lazy"},
        }
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "connectors": [{"kv_connector": "NixlConnector", "kv_role": role}, simple_child]
            },
        )
    elif conn == "mooncake_store":
        ktc = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role=role)
    elif conn.startswith("umbp"):
        # An explicit namespace: the scheduler side binds its runtime at construction (with
        # "auto" it waits for the workers' handshake, which the driver does not fake).
        umbp_extra: dict[str, Any] = {"key_namespace": "parity"}
        if conn == "umbp_sync":
            umbp_extra.update(load_async=False, save_decode_cache=True)
        if conn == "umbp_lookup_async":
            umbp_extra["lookup_async"] = True
        # vLLM 0.33 has the connector but does not register its name: a module path loads it.
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registered = "UMBPStoreConnector" in getattr(KVConnectorFactory, "_registry", {})
        ktc = KVTransferConfig(
            kv_connector="UMBPStoreConnector",
            kv_connector_module_path=None if registered else "vllm.distributed.kv_transfer.kv_connector.v1.umbp",
            kv_role=role,
            kv_connector_extra_config=umbp_extra,
        )
    elif conn in ("lmcache_mp", "lmcache_mp_lazy"):
        ktc = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role=role,
            kv_connector_extra_config={"lmcache.mp.lazy_offload": conn == "lmcache_mp_lazy"},
        )
    elif conn == "module_hashstore":
        ktc = KVTransferConfig(
            kv_connector="HashStoreConnector", kv_connector_module_path="module_connectors", kv_role=role
        )
    else:
        ktc = nixl_config(role, policy)
    setup = SchedulerSetup(
        shape=tiny_shapes()[shape],
        num_blocks=blocks,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_events=True,
        async_scheduling=overlap,
        extra={"kv_transfer_config": ktc},
    )
    if conn in ("offload", "multi_offload_only"):
        # Local requests only: the offloaded prefixes come back as loads.
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            offload=True,
            offload_child=0 if conn == "multi_offload_only" else None,
            num_children=1,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            # Shorter outputs on the Gemma-like model, so its 30 requests finish in the
            # driver's steps with preemptions at these pool sizes.
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn in ("example", "multi_example") or ("lmcache" in conn and not conn.startswith("lmcache_mp")):
        multi = conn.startswith("multi_")
        w = PDWorkload(
            num_requests=30,
            remote_share=0.3 if multi else 0.0,
            repeat_share=0.5,
            example_storage=None if "lmcache" in conn else storage,
            example_child=1 if multi else None,
            lmcache="lmcache" in conn,
            fail_sync_loads=2,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
        )
        return setup, w, "kv_consumer"
    if conn == "module_hashstore":
        # Local requests only, repeating earlier prompts: the store's hits come back as sync
        # loads once the pool evicted the local copies.
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            repeat_share=0.5,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            # Shorter outputs on the Gemma-like model, so its 30 requests finish in the
            # driver's steps with preemptions at these pool sizes.
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn in ("simple", "simple_lazy"):
        # Local requests only, repeating earlier prompts: the stored prefixes come back as
        # async loads once the pool evicted the local copies.
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            repeat_share=0.5,
            simple_cpu=True,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn == "mooncake_store":
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            repeat_share=0.5,
            mooncake_store=True,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn in ("lmcache_mp", "lmcache_mp_lazy"):
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            repeat_share=0.5,
            lmcache_mp=True,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn.startswith("umbp"):
        w = PDWorkload(
            num_requests=30,
            remote_share=0.0,
            repeat_share=0.5,
            umbp=True,
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
            max_tokens=(1, 40) if shape == "gemma" else (1, 60),
        )
        return setup, w, role
    if conn in ("multi_simple", "multi_simple_lazy"):
        w = PDWorkload(
            num_requests=30,
            remote_share=0.4,
            repeat_share=0.4,
            simple_cpu=True,
            simple_child=1,
            fail={"req3", "req7"},
            abort_waiting={"req5"},
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
        )
        return setup, w, "kv_consumer"
    if conn == "multi_offload":
        w = PDWorkload(
            num_requests=30,
            remote_share=0.4,
            offload=True,
            offload_child=1,
            fail={"req3", "req7"},
            abort_waiting={"req5"},
            abort_running={"req2", "req13"},
            batch_queue=2 if overlap else 1,
        )
        return setup, w, "kv_consumer"
    seed, share = WORKLOAD_SEED.get(case, (3, 0.7))
    over = next((v for k, v in QWEN_WORKLOAD.items() if case in QWEN_CASES and case.endswith(k)), {})
    w = PDWorkload(
        seed=seed,
        remote_share=share,
        fail={"req3", "req7"},
        abort_waiting={"req5"},
        # A sync failure maps invalid block ids to requests: one KV cache group only.
        fail_running={"req9", "req11"} if shape == "llama" else set(),
        abort_running={"req2", "req13", "req17"},
        batch_queue=2 if overlap else 1,
    )
    w = dataclasses.replace(w, **over)
    if conn == "mooncake":
        w = dataclasses.replace(w, params="mooncake")
    w.abort_prefilling -= w.fail | w.abort_waiting | w.abort_running
    return setup, w, role
