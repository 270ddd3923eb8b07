"""Which KV connectors the native manager serves (every supported vLLM release).

A connector is served natively when its scheduler side works through the manager's public
API only (``KVCacheBlocks`` with ``block_id`` / ``block_hash`` / ``is_null``,
``get_unhashed_block_ids_all_groups``, and the scheduler's calls: ``allocate_slots`` with
``num_external_computed_tokens`` / ``delay_cache_blocks`` / ``skip_zeroing_group_ids``,
``get_blocks``, ``cache_blocks`` after an async load, ``record_blocks_for_zeroing``,
``evict_blocks``, ``remove_skipped_blocks``, ``get_block_ids_for_computed_tokens``,
``pop_blocks_for_free`` and ``block_pool.free_blocks``), all of which the manager serves with
vLLM's semantics:

- ``NixlConnector`` and its ``NixlPullConnector`` / ``NixlPushConnector`` variants, as KV
  producer, consumer or both;
- the native ``OffloadingConnector`` (``--kv-offloading-size``) when it offloads every
  prefix-cacheable group (otherwise it asks ``coordinator.find_longest_cache_hit_per_group``
  of a ``HybridKVCacheCoordinator``, which the manager's facade is not);
- ``ExampleConnector``, which does not support the hybrid manager: vLLM turns that off for it
  (``VllmConfig``: "Turning off hybrid kv cache manager ...") and ``get_kv_cache_groups``
  makes one unified group, which the manager serves like any single-group model. Its
  scheduler side reads none of the manager's results (``update_state_after_alloc`` only
  counts external tokens; the hits are folders on disk, found by the prompt's hash);
- ``LMCacheConnectorV1`` likewise (no hybrid manager support: one unified group). Its scheduler
  side is the ``lmcache`` package's ``LMCacheConnectorV1Impl`` (tested with lmcache 0.5.6,
  ``lmcache/integration/vllm/vllm_v1_adapter.py``): the hit is what the workers' lookup
  servers answer over ZMQ (``lookup_client.lookup`` of the prompt's chunk hashes), vLLM's
  wrapper passes ``update_state_after_alloc`` the request and the external count only (not the
  blocks: ``lmcache_connector.py:291``), ``build_connector_meta`` reads the SchedulerOutput
  (``new_block_ids[0]``, ``num_scheduled_tokens``, ``resumed_req_ids``), ``request_finished``
  ignores its block ids and returns ``False``; none of it reads the manager. With ``use_native``
  (vLLM's in-tree ``lmcache_integration`` copy) it falls back: that copy imports names no
  lmcache release from 0.4.7 to 0.5.6 has together (``CudaIPCWrapper`` and
  ``IPCCacheEngineKey`` from ``lmcache.v1.multiprocess.custom_types``, ``lmcache.config``), so
  it is not tested;
- ``SimpleCPUOffloadConnector``, eager or lazy, with or without Mamba layers: its scheduler
  side is bound to the scheduler's block pool (``bind_gpu_block_pool``) and pins, frees, walks
  and looks up its blocks through the manager's pool facade (:mod:`.facades`: ``blocks[i]``,
  ``touch``, ``free_blocks`` with ``evict_first``, ``free_block_queue.iter_blocks_after``,
  ``get_cached_block``, ``cached_block_hashes_by_block``), the same reads on 0.32, 0.33 and
  0.34 (``test_connector_vllm.py``'s ``*simple*`` cases compare every call it makes on the pool
  with vLLM's manager); not with two-level pages, whose pool refuses ``touch``;
- ``MooncakeStoreConnector`` with attention groups of one block size: its store jobs pin the
  blocks they read (``blocks[i]``, ``touch``) and give them back (``free_blocks``); its hits
  come from the store (``*_mooncake_store*`` cases, its lookups faked);
- ``UMBPStoreConnector`` (vLLM 0.34 by name, 0.33 from its module path) with attention groups
  of one block size, without its ``enable_partial_hash_hits``: its store events pin and give
  back blocks as MooncakeStore's jobs do, and with several groups its lookup asks the pool
  which blocks are local (``get_cached_block``); its hits come from the ``umbp`` runtime
  (``*_umbp*`` cases, the runtime faked);
- ``LMCacheMPConnector`` (the ``lmcache`` package's) with attention groups of one block size,
  on 0.32 and 0.33: its scheduler side asks its multiprocess server and reads none of the
  manager (``*_lmcache_mp*`` cases, the server's client faked); with lazy offload (one group
  only) it walks the free queue's front (``fake_free_list_head``, ``next_free_block``) and pins
  the blocks it stores;
- ``MultiConnector`` whose children are all served (MooncakeStore, UMBP and LMCacheMP alone only).

Anything else falls back to vLLM's own manager with one line naming the connector:
connectors whose scheduler side reaches into vLLM's ``BlockPool`` / coordinator internals
(HiSparse, ...), connectors
loaded from a module path, and, with Mamba layers, any connector but
NixlConnector (its variants) and the OffloadingConnector, alone or under MultiConnectors over
them only. With Mamba layers NixlConnector's local hit is vLLM's per-group one
(:mod:`.connector_hits`) and it reads no boundary-state offloads; the OffloadingConnector reads
the boundary states the manager keys in Mamba "align" groups (``take_boundary_state_offloads``,
see :mod:`.boundary`). With sub-block partial hash hits (``--prefix-match-unit`` below the
Mamba block size) both are served too: a local hit ending inside a block (which the scheduler
may trim with ``truncate_computed_blocks`` when the connector's hit is longer), the copy-on-write
hand-off of a producer's partial tail among the boundary states, and a finishing producer's
``finalize_partial_tail_offloads`` (:mod:`.boundary`).

vLLM 0.34 changes what reaches the manager with a connector, all served with nothing more to
check here (``tests/python/parity/test_connector_lookahead.py`` compares each with vLLM's manager):

- lookahead block hashes: with EAGLE/MTP, a connector whose class's
  ``supports_lookahead_block_hashes`` is True (NixlConnector, the OffloadingConnector, a
  MultiConnector over such only) makes the Scheduler pass ``use_eagle=False`` and
  ``num_hash_lookahead_tokens`` > 0 (prefix caching on or off) where 0.32 and 0.33 pass
  ``use_eagle=True``, which falls back (``plan``: the trailing-block drop); a producer over a
  Mamba hybrid truncates the request's hashes (``truncate_block_hashes``) before the manager
  first sees the request;
- the OffloadingConnector raises ``request.shared_prefix_boundary`` in
  ``get_num_new_matched_tokens`` (after the local lookup, before ``allocate_slots``), which the
  manager reads from the request at ``allocate_slots``.

LMCacheConnectorV1 with vLLM 0.34 and lmcache 0.5.6 (the release tested) fails inside lmcache's
``build_connector_meta`` (it reads ``CachedRequestData.resumed_req_ids``, which 0.34 removed)
with vLLM's own manager as with this one: the manager keeps serving it, the tests skip it there.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec

__all__ = [
    "NATIVE_CONNECTORS",
    "SINGLE_GROUP_CONNECTORS",
    "connector_reason",
    "fold_negative_external",
]

_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# Registered connector names whose scheduler side the native manager serves exactly.
NATIVE_CONNECTORS: frozenset[str] = frozenset(
    {"NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector"}
)
# Those without hybrid manager support, served in the one unified group vLLM then makes.
SINGLE_GROUP_CONNECTORS: frozenset[str] = frozenset({"ExampleConnector", "LMCacheConnectorV1"})


# Served alone only: no parity case runs them under a MultiConnector.
_NOT_UNDER_MULTI = frozenset({"MooncakeStoreConnector", "UMBPStoreConnector", "LMCacheMPConnector"})


def _offloads_every_cached_group(kvc: KVCacheConfig) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

    offloaded = set(get_offloading_group_ids(kvc))
    return all(g in offloaded for g, group in enumerate(kvc.kv_cache_groups) if group.kv_cache_spec.prefix_cacheable)


def _children(extra: Any) -> list[dict[str, Any]]:
    """A MultiConnector's child configurations (from its ``kv_connector_extra_config``)."""
    return list((extra or {}).get("connectors") or [])


def _unserved(name: Any, module_path: Any, extra: Any, kvc: KVCacheConfig) -> str | None:
    """The first connector in this (possibly nested) configuration the manager does not
    serve, or ``None``."""
    if module_path:
        return _module_path_unserved(name, module_path, extra, kvc)
    if name == "MultiConnector":
        children = _children(extra)
        if not children:
            return "MultiConnector (no child connectors)"
        for c in children:
            bad = _unserved(
                c.get("kv_connector"), c.get("kv_connector_module_path"), c.get("kv_connector_extra_config"), kvc
            )
            if bad is not None:
                return f"MultiConnector over {bad}"
            if c.get("kv_connector") in _NOT_UNDER_MULTI:
                return (
                    f"MultiConnector over {c.get('kv_connector')} (not tested with hybrid_alloc under a MultiConnector)"
                )
        return None
    if name == "OffloadingConnector":
        return None if _offloads_every_cached_group(kvc) else "OffloadingConnector (with groups it does not offload)"
    if name == "LMCacheConnectorV1" and (extra or {}).get("use_native", False):
        return "LMCacheConnectorV1 (use_native: vLLM's in-tree lmcache_integration copy)"
    if name == "LMCacheMPConnector":
        return _lmcache_mp_unserved(extra, kvc)
    if name == "SimpleCPUOffloadConnector":
        return _simple_cpu_offload_unserved()
    if name == "MooncakeStoreConnector":
        return _mooncake_store_unserved(kvc)
    if name == "UMBPStoreConnector":
        return _umbp_unserved(extra, kvc)
    if name in SINGLE_GROUP_CONNECTORS:
        return _single_group_unserved(str(name), kvc)
    return None if name in NATIVE_CONNECTORS else str(name)


def _simple_cpu_offload_unserved() -> str | None:
    """``SimpleCPUOffloadConnector``'s scheduler side (``vllm/v1/simple_kv_offload/manager.py``,
    the same reads in every supported release) is bound to the scheduler's block pool and works on it
    as its owner would: ``blocks[i]`` (``block_id``, ``block_hash``, ``block_hash_num_tokens``,
    ``is_null``), ``touch`` (pins what it copies), ``free_blocks`` (with ``evict_first`` in lazy
    mode), ``free_block_queue.iter_blocks_after`` (lazy mode), ``get_cached_block`` and
    ``cached_block_hashes_by_block``, all of which the manager's facade serves
    (:mod:`.facades`). Not with two-level pages (``HYBRID_ALLOC_PAGES=two-level``), whose pool
    refuses ``touch``."""
    if _pages_two_level():
        return "SimpleCPUOffloadConnector (with two-level pages, whose block pool does not serve touch)"
    return None


def _mooncake_store_unserved(kvc: KVCacheConfig) -> str | None:
    """``MooncakeStoreConnector`` (vLLM 0.34; its scheduler side,
    ``mooncake/store/scheduler.py``): its store jobs pin the blocks they read in the scheduler's
    pool (``blocks[i]``, ``touch``) and give them back when every rank is done
    (``free_blocks``), which the pool facade serves; its hits come from the store (a lookup
    over ZMQ), not from the manager. Served where a parity test runs it (its lookups faked:
    ``test_connector_vllm.py``'s ``*_mooncake_store*`` cases): attention groups of one block
    size. With Mamba groups it also stores the boundary states and partial tails the manager
    hands it, and with groups of different block sizes partial-block keys: not tested, so
    not served."""
    groups = kvc.kv_cache_groups
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
        return "MooncakeStoreConnector (with Mamba layers: not tested with hybrid_alloc)"
    if len({g.kv_cache_spec.block_size for g in groups}) > 1:
        return "MooncakeStoreConnector (with groups of different block sizes: not tested with hybrid_alloc)"
    if _pages_two_level():
        return "MooncakeStoreConnector (with two-level pages, whose block pool does not serve touch)"
    return None


def _umbp_unserved(extra: Any, kvc: KVCacheConfig) -> str | None:
    """``UMBPStoreConnector`` (vLLM 0.33 and 0.34; its scheduler side, ``umbp/scheduler.py``):
    its store events pin the blocks they read in the scheduler's pool (``blocks[i]``,
    ``touch``) and give them back when every worker is done (``free_blocks``); with several
    groups its lookup asks the manager's ``coordinator.single_type_managers[g].block_pool
    .get_cached_block`` which blocks are local; its hits come from the ``umbp`` runtime
    (``UMBPSchedulerHandle.lookup``), not from the manager. All of it the pool facade serves.
    Served where a parity test runs it (its runtime faked: ``test_connector_vllm.py``'s
    ``*_umbp*`` cases): attention groups of one block size, without its
    ``enable_partial_hash_hits``. With Mamba groups it also stores the boundary states and
    partial tails the manager hands it (``register_finished_partial_tail`` pins them), and with
    groups of different block sizes or partial hash hits it loads partial blocks: not tested,
    so not served."""
    import importlib.util

    if importlib.util.find_spec(_UMBP_MODULE) is None:  # vLLM 0.32 (its factory refuses the name too)
        return "UMBPStoreConnector (not in this vLLM release)"
    groups = kvc.kv_cache_groups
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
        return "UMBPStoreConnector (with Mamba layers: not tested with hybrid_alloc)"
    if len({g.kv_cache_spec.block_size for g in groups}) > 1:
        return "UMBPStoreConnector (with groups of different block sizes: not tested with hybrid_alloc)"
    if (extra or {}).get("enable_partial_hash_hits", False):
        return "UMBPStoreConnector (enable_partial_hash_hits: not tested with hybrid_alloc)"
    if _pages_two_level():
        return "UMBPStoreConnector (with two-level pages, whose block pool does not serve touch)"
    return None


def _pages_two_level() -> bool:
    """Whether two-level pages are asked for (``HYBRID_ALLOC_PAGES``; a bad value counts as
    not: the plan reports it itself)."""
    from hybrid_alloc.vllm.pages import pages_from_env

    try:
        return pages_from_env() == "two-level"
    except Exception:  # noqa: BLE001 - the plan reports a bad value itself
        return False


def _single_group_unserved(label: str, kvc: KVCacheConfig) -> str | None:
    """A connector without hybrid manager support: served in the one unified group vLLM makes
    for it, when that group is full attention."""
    groups = kvc.kv_cache_groups
    if len(groups) > 1:
        return f"{label} (with {len(groups)} KV cache groups)"
    if groups and not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        # ``fold_negative_external`` is exact where no tokens are skipped.
        return f"{label} (with a {type(groups[0].kv_cache_spec).__name__} group)"
    return None


def _lmcache_mp_unserved(extra: Any, kvc: KVCacheConfig | None) -> str | None:
    """``LMCacheMPConnector``. vLLM resolves the name to the ``lmcache`` package's connector
    when that imports (0.32 and 0.33 through their in-tree module, which re-exports it; 0.34
    directly; else to vLLM's in-tree ``LMCacheMPConnectorUpstream``, which needs vLLM's
    ``lmcache_integration`` copy: falls back). The package's scheduler side (tested with
    lmcache 0.5.6, ``lmcache/integration/vllm/lmcache_mp_connector.py``) without
    ``lmcache.mp.lazy_offload`` reads none of the manager: it asks its LMCache multiprocess
    server (``LMCacheMPSchedulerAdapter``: lookups, locks, sessions) and tracks each request's
    blocks from ``update_state_after_alloc`` and the SchedulerOutput; as a producer it holds every
    finished request until its stores are done (``finished_sending``). Served where a parity test
    runs it (its server's client faked: ``test_connector_vllm.py``'s ``*_lmcache_mp*`` cases):
    attention groups of one block size, on releases whose ``CachedRequestData`` has
    ``resumed_req_ids`` (0.32, 0.33; lmcache 0.5.6 reads it, so on 0.34 it raises with vLLM's
    manager too). With ``lmcache.mp.lazy_offload`` its eviction-aware policy walks the front of
    the pool's free queue each step (``free_block_queue.fake_free_list_head``, then
    ``next_free_block``, one crossing per link: :class:`~hybrid_alloc.vllm.blocks.FreeListEnd`)
    and pins the blocks it stores (``blocks[i]``, ``touch``, ``free_blocks``), which the facade
    serves: served with one KV cache group (``*_lmcache_mp_lazy*`` cases), not with several
    (not tested) nor with two-level pages (no ``touch``). Mamba layers and mixed block sizes
    fall back (not tested)."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.sched.output import CachedRequestData

    try:
        cls = KVConnectorFactory.get_connector_class_by_name("LMCacheMPConnector")
    except Exception:  # noqa: BLE001 - vLLM's factory will raise its own error
        return "LMCacheMPConnector (does not import here)"
    if not cls.__module__.startswith("lmcache."):
        return f"LMCacheMPConnector ({cls.__name__}: vLLM's in-tree copy, without the lmcache package's)"
    if (extra or {}).get("lmcache.mp.lazy_offload", False) and _pages_two_level():
        return "LMCacheMPConnector (lazy offload with two-level pages, whose block pool does not serve touch)"
    if "resumed_req_ids" not in {f.name for f in dataclasses.fields(CachedRequestData)}:
        return (
            "LMCacheMPConnector (the lmcache package reads CachedRequestData.resumed_req_ids, "
            "which this vLLM does not have: not tested with hybrid_alloc)"
        )
    groups = kvc.kv_cache_groups if kvc is not None else []
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
        return "LMCacheMPConnector (with Mamba layers: not tested with hybrid_alloc)"
    if len({g.kv_cache_spec.block_size for g in groups}) > 1:
        return "LMCacheMPConnector (with groups of different block sizes: not tested with hybrid_alloc)"
    if (extra or {}).get("lmcache.mp.lazy_offload", False) and len(groups) > 1:
        return "LMCacheMPConnector (lazy offload with several KV cache groups: not tested with hybrid_alloc)"
    return None


# vLLM's connectors that a release has without registering their name (loaded from a module
# path there): name -> the class's module. vLLM 0.33's UMBPStoreConnector (0.34 registers it).
_UMBP_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.umbp"
_UNREGISTERED: dict[str, str] = {"UMBPStoreConnector": f"{_UMBP_MODULE}.connector"}


def _registered_name(cls: type) -> str | None:
    """The name vLLM's connector registry resolves to exactly ``cls``, if any (a module path
    naming one of vLLM's own connectors, or the ``lmcache`` package's ``LMCacheMPConnector``,
    which vLLM's registered name resolves to when it imports), or the name of one of vLLM's
    connectors its release does not register (``_UNREGISTERED``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    name = cls.__name__
    if name not in registry and _UNREGISTERED.get(name) == cls.__module__:
        return name
    if name in registry:
        try:
            if registry[name]() is cls:
                return name
        except Exception:  # noqa: BLE001 - a registered module that does not import here
            return None
    return None


def _module_path_unserved(name: Any, module_path: Any, extra: Any, kvc: KVCacheConfig) -> str | None:
    """A connector loaded from ``kv_connector_module_path`` (vLLM's factory imports the module
    and takes the class named ``kv_connector``; the scheduler has done so before it builds the
    manager). Served when:

    - it is a class vLLM registers (then its name's rules apply), or one of its classes in the
      MRO is, and that connector is served (its subclass's own code is then vetted as below);
      a subclass of another of vLLM's connector classes is not served;
    - it declares hybrid manager support (``SupportsHMA``), or it does not and vLLM's one
      unified group is full attention (as for ``ExampleConnector``);
    - its own code reads nothing of the manager that the manager does not serve
      (:func:`.connector_reads.unserved_reads`)."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from hybrid_alloc.vllm.connector_reads import unserved_reads

    label = f"{name} (from {module_path})"
    try:
        cls = getattr(importlib.import_module(str(module_path)), str(name))
    except Exception as e:  # noqa: BLE001 - vLLM's factory will raise its own error
        return f"{label}, which does not import here ({type(e).__name__}: {e})"
    registered = _registered_name(cls)
    if registered is not None:
        bad = _unserved(registered, None, extra, kvc)
        return None if bad is None else f"{label}: {bad}"
    for k in cls.__mro__:
        if not k.__module__.startswith("vllm.") or k.__module__ == _BASE_MODULE:
            continue
        registered = _registered_name(k)
        if registered is None:
            what = "" if k is cls else "a subclass of "
            return f"{label}: {what}vLLM's {k.__name__}, which is no registered connector"
        bad = _unserved(registered, None, extra, kvc)
        if bad is not None:
            return f"{label}: a subclass of {bad}"
        break  # the rest of the MRO is that served connector's
    if not (registered or supports_hma(cls)):
        bad = _single_group_unserved(label, kvc)
        if bad is not None:
            return f"{bad[:-1]}; no hybrid manager support)"
    reads = unserved_reads(cls)
    if reads:
        return f"{label}, which {reads[0]}: not served by hybrid_alloc"
    return None


def connector_reason(vllm_config: Any, kv_cache_config: KVCacheConfig) -> str | None:
    """Why the configured KV connector is not served natively (the fallback line's reason,
    naming the connector), or ``None`` when there is none or it is served."""
    ktc = getattr(vllm_config, "kv_transfer_config", None) if vllm_config is not None else None
    if ktc is None:
        return None
    name = getattr(ktc, "kv_connector", "of unknown kind")
    if name is None:
        return None
    bad = _unserved(
        name,
        getattr(ktc, "kv_connector_module_path", None),
        getattr(ktc, "kv_connector_extra_config", {}),
        kv_cache_config,
    )
    if bad is not None:
        return f"KV connector {bad} is configured"
    mamba = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    if mamba:
        # Every connector ``_unserved`` passes is served with them (NixlConnector's divergent
        # per-group hit: :mod:`.connector_hits`; the OffloadingConnector's boundary states:
        # :mod:`.boundary`), the OffloadingConnector in cache mode "align" only.
        extra = getattr(ktc, "kv_connector_extra_config", {})
        if _offloading_in(name, extra) and any(s.mamba_cache_mode != "align" for s in mamba):
            return f"KV connector {name} with Mamba layers in cache mode {mamba[0].mamba_cache_mode!r} is configured"
    return None


def _offloading_in(name: Any, extra: Any) -> bool:
    """Whether the OffloadingConnector is configured, alone or under MultiConnectors."""
    if name == "MultiConnector":
        return any(_offloading_in(c.get("kv_connector"), c.get("kv_connector_extra_config")) for c in _children(extra))
    return name == "OffloadingConnector"


def fold_negative_external(
    num_new_tokens: int, num_external_computed_tokens: int, num_lookahead_tokens: int
) -> tuple[int, int, int]:
    """``allocate_slots``' token counts with a negative external count folded in.

    ExampleConnector's hit is its prompt's length rounded down (``align_to_block_size``),
    less the local hit; a local hit past it (a prompt one token past a block boundary, or a
    resumed request whose hit covers its output tokens) makes that negative, and vLLM's
    scheduler passes it on. vLLM's manager then computes from ``local + external`` tokens
    while holding the whole local hit: for full attention (no skipped tokens) that is the
    same allocation and caching as no external tokens and ``num_new_tokens + external`` new
    tokens (when that is negative, the hit's blocks already hold every slot needed, and the
    lookahead slots come off the shortfall)."""
    if num_external_computed_tokens >= 0:
        return num_new_tokens, num_external_computed_tokens, num_lookahead_tokens
    short = num_new_tokens + num_external_computed_tokens
    return max(short, 0), 0, max(num_lookahead_tokens + min(short, 0), 0)
