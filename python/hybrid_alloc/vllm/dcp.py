"""Decode context parallelism (DCP): each group's block size as vLLM's managers use it.

Under DCP each rank holds ``1/dcp`` of every sharded group's KV, so one block spans
``dcp`` times the spec's ``block_size`` tokens. Every supported vLLM release scales exactly
one thing: ``SingleTypeKVCacheManager.block_size = spec.block_size * dcp`` for a spec with
``dcp_sharded`` (every ``AttentionSpec`` by default), ``spec.block_size`` otherwise (a
*replicated* group). The hash lookup views the request's hashes (computed at
``hash_block_size``, which ``resolve_kv_cache_block_sizes`` already derives from the scaled
sizes) at that scaled size; blocks needed, caching, skipped blocks and truncation all go
by it. So the core gets the scaled size as the group's block size, and nothing else changes.

Where vLLM's own code reads the unscaled ``spec.block_size`` under DCP (the BlockStored
events of a ``kv_cache_report_mode="full"`` hit, ``get_block_ids_for_computed_tokens``), the
adapter reads it too, as vLLM does.

Served: sharded ``FullAttentionSpec`` / ``MLAAttentionSpec`` groups, and replicated groups
(``dcp_sharded=False``), Mamba among them. A ``MambaSpec`` is replicated by default (the base
spec's ``dcp_sharded=False``): vLLM's ``MambaManager`` then keeps ``dcp_world_size`` 1, so its
``find_longest_cache_hit`` assert (``dcp_world_size == 1``, "DCP not support mamba now.") never
fires, and vLLM's coordinator turns partial hash hits on with a Mamba "align" block equal to the
hash block ("DCP accepts equality because it scales the effective full-attention block
instead"): hits end at hash boundaries inside the scaled full-attention block, which is copied
on write. The core gets ``dcp_world_size`` for that one decision. Everything else falls back,
naming why:
- a sharded group of any other kind (a sharded Mamba group too): vLLM's hybrid coordinator
  asserts ("DCP with hybrid KV cache layouts only supports full-attention, Mamba, and
  replicated draft groups"), and with one group its sliding-window / chunked-local / Mamba
  lookups assert on the scaled size;
- ``pcp_world_size > 1``: the scheduler of these releases passes 1 (prefill context
  parallelism never reaches the manager); the guard names it rather than guess.

Cost: one pass over the groups at construction.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = ["SHARDED_KINDS", "group_block_sizes"]

# The exact spec classes served sharded under DCP (vLLM picks managers by ``type(spec)``).
SHARDED_KINDS = (FullAttentionSpec, MLAAttentionSpec)


def group_block_sizes(kv_cache_config: Any, dcp_world_size: Any, pcp_world_size: Any) -> list[int]:
    """Each group's block size as vLLM's manager for it uses it (``spec.block_size``, times
    ``dcp_world_size`` for a sharded group). Raises ``Unsupported`` naming what is not served."""
    if pcp_world_size != 1:
        raise Unsupported(
            f"prefill context parallelism (pcp_world_size={pcp_world_size!r}; the scheduler of vLLM 0.32/0.33 passes 1)"
        )
    if not isinstance(dcp_world_size, int) or isinstance(dcp_world_size, bool) or dcp_world_size < 1:
        raise Unsupported(f"dcp_world_size={dcp_world_size!r}")
    sizes: list[int] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if dcp_world_size == 1:
            sizes.append(spec.block_size)
        elif not spec.dcp_sharded:
            sizes.append(spec.block_size)  # replicated: vLLM's manager keeps the spec's size
        elif type(spec) in SHARDED_KINDS:
            sizes.append(spec.block_size * dcp_world_size)
        else:
            raise Unsupported(
                f"decode context parallelism {dcp_world_size} with a sharded {type(spec).__name__} group "
                f"(group {i}: vLLM serves only full attention, MLA and replicated groups under DCP)"
            )
    return sizes
