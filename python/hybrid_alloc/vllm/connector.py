"""Which KV connectors the native manager serves (vLLM 0.32.0 and 0.33.0).

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
- ``MultiConnector`` whose children are all served.

Anything else falls back to vLLM's own manager with one line naming the connector:
connectors whose scheduler side reaches into vLLM's ``BlockPool`` / coordinator internals
(SimpleCPUOffload, UMBP, MooncakeStore, HiSparse, LMCache, ...), connectors loaded from a
module path, and a connector with Mamba layers (vLLM's per-group divergent hit and
boundary-state offloads are not served yet).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

__all__ = ["NATIVE_CONNECTORS", "connector_reason"]

# Registered connector names whose scheduler side the native manager serves exactly.
NATIVE_CONNECTORS: frozenset[str] = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})


def _offloads_every_cached_group(kvc: KVCacheConfig) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

    offloaded = set(get_offloading_group_ids(kvc))
    return all(g in offloaded for g, group in enumerate(kvc.kv_cache_groups) if group.kv_cache_spec.prefix_cacheable)


def _unserved(name: Any, module_path: Any, extra: Any, kvc: KVCacheConfig) -> str | None:
    """The first connector in this (possibly nested) configuration the manager does not
    serve, or ``None``."""
    if module_path:
        return f"{name} (from {module_path})"
    if name == "MultiConnector":
        children = (extra or {}).get("connectors") or []
        if not children:
            return "MultiConnector (no child connectors)"
        for c in children:
            bad = _unserved(
                c.get("kv_connector"), c.get("kv_connector_module_path"), c.get("kv_connector_extra_config"), kvc
            )
            if bad is not None:
                return f"MultiConnector over {bad}"
        return None
    if name == "OffloadingConnector":
        return None if _offloads_every_cached_group(kvc) else "OffloadingConnector (with groups it does not offload)"
    return None if name in NATIVE_CONNECTORS else str(name)


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
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups):
        return f"KV connector {name} with Mamba layers is configured"
    return None
