"""The native allocator's arguments read from a ``KVCacheManager`` construction: the
configuration checks that name what the core does not serve exactly (each raises
:class:`~hybrid_alloc.vllm.unsupported.Unsupported` with the fallback line's reason) and the
group specs, sized as vLLM's managers size them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowMLASpec,
)

from hybrid_alloc.specs import GroupSpec
from hybrid_alloc.vllm import compat, pages, policy_env
from hybrid_alloc.vllm.args import ManagerArgs
from hybrid_alloc.vllm.connector import connector_reason
from hybrid_alloc.vllm.dcp import group_block_sizes
from hybrid_alloc.vllm.spec_table import group_spec
from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = ["native_plan"]


def _served_uncacheable(spec: KVCacheSpec) -> bool:
    """A spec that opts out of prefix caching which the core serves: the compressor's
    circular buffer, and a sliding window with a bounded replay (DeepSeek-V4.1)."""
    return type(spec) is CircularBufferSpec or (
        type(spec) is SlidingWindowMLASpec and bool(getattr(spec, "bounded_replay", False))
    )


def native_plan(a: ManagerArgs, vllm_config: Any) -> dict[str, Any]:
    """The native allocator's arguments (``groups`` as named specs); raises ``Unsupported``
    naming what is not served exactly. Does not build the allocator (which may still refuse
    the configuration)."""
    if missing := compat.missing_reads():
        # A release without them would fail inside ``Scheduler.schedule()``, past construction.
        raise Unsupported(f"the installed vLLM lacks {', '.join(missing)} (read by the adapter)")
    if (reason := connector_reason(vllm_config, a.kv_cache_config)) is not None:
        raise Unsupported(reason)
    if not isinstance(a.num_hash_lookahead_tokens, int) or a.num_hash_lookahead_tokens < 0:
        raise Unsupported(f"num_hash_lookahead_tokens={a.num_hash_lookahead_tokens!r}")
    reprefillable = reprefillable_tokens(a)
    kvc = a.kv_cache_config
    sizes = group_block_sizes(kvc, a.dcp_world_size, a.pcp_world_size)  # DCP-scaled (see .dcp)
    groups: list[GroupSpec] = []
    seen_specs: list[KVCacheSpec] = []
    for i, g in enumerate(kvc.kv_cache_groups):
        spec = g.kv_cache_spec
        if g.role != KVCacheGroupRole.DEFAULT or g.host_resident:
            raise Unsupported(f"group {i} has role {g.role.name} (HiSparse)")
        if not spec.prefix_cacheable and not _served_uncacheable(spec):
            raise Unsupported(f"group {i} ({type(spec).__name__}) is not prefix-cacheable")
        key = next((k for k, s in enumerate(seen_specs) if s == spec), None)
        if key is None:
            seen_specs.append(spec)
            key = len(seen_specs) - 1
        gs = group_spec(spec, key)
        groups.append(gs if gs.block_size == sizes[i] else replace(gs, block_size=sizes[i]))
    if not groups:
        raise Unsupported("no KV cache groups (attention-free model)")
    native: dict[str, Any] = dict(
        num_blocks=kvc.num_blocks,
        groups=groups,
        hash_block_size=a.hash_block_size,
        scheduler_block_size=a.scheduler_block_size,
        max_model_len=a.max_model_len,
        max_in_flight_tokens=a.max_model_len if a.max_in_flight_tokens is None else a.max_in_flight_tokens,
        enable_caching=a.enable_caching,
        enable_events=a.enable_kv_cache_events,
        watermark_blocks=int(a.watermark * kvc.num_blocks),
        retention_interval=kvc.prefix_cache_retention_interval,
    )
    if kvc.needs_kv_cache_zeroing:
        native["zero_new_blocks"] = True
    if a.dcp_world_size > 1:
        # Read by the core only where vLLM's coordinator reads it: partial hash hits under DCP
        # (a replicated Mamba "align" block equal to the hash block, see ``.dcp``).
        native["dcp_world_size"] = a.dcp_world_size
    if a.metrics_collector:  # vLLM's pool tests it so (see ``metrics``)
        native["residency_log"] = True
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in kvc.kv_cache_groups):
        # The boundary states Mamba "align" groups key, offered as vLLM's manager offers them
        # (see ``.boundary``): the scheduler drains them every step, and hands them to a KV
        # connector when there is one. Without Mamba groups there are none to offer.
        native["boundary_offloads"] = True
    drop = eagle_drop_groups(a)
    if drop:
        native["eagle_drop_groups"] = drop
        # 0.33's retention masks also keep a dropping group's tail one block below the junction.
        native["eagle_junction_tail"] = compat.EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE
    if reprefillable:
        native["reprefillable_tokens"] = reprefillable
    if a.use_eagle and any(isinstance(g.kv_cache_spec, MambaSpec) for g in kvc.kv_cache_groups):
        # vLLM's coordinator sets ``drop_eagle_checkpoint_block`` on every Mamba manager with
        # ``use_eagle`` (prefix caching on or off): the "align" prefill checkpoint positions
        # move one hash block back, to the attention groups' replay boundary.
        native["eagle_checkpoints"] = True
    if a.num_hash_lookahead_tokens > 0:
        # 0.33 moves the Mamba "align" prefill checkpoint positions by the lookahead tokens.
        native["hash_lookahead_tokens"] = a.num_hash_lookahead_tokens
    if a.enable_mamba_shared_prefix_checkpoint and (a.use_eagle or any(g.is_eagle_group for g in kvc.kv_cache_groups)):
        # vLLM's shared-prefix checkpoint, as its ``KVCacheManager`` narrows the flag: EAGLE/MTP
        # groups (its coordinator's ``eagle_group_ids``) here, partial hash hits and no
        # re-prefillable tokens in the core (``Config::shared_prefix_checkpoint``).
        native["mamba_shared_prefix_checkpoint"] = True
    policy = policy_env.policy_from_env()  # raises Unsupported on a bad value
    if policy != "exact":
        native["policy"] = policy
        policy_env.policy_controls()  # validated here, so a bad control falls back at construction
    if pages.pages_from_env() == "two-level":  # raises Unsupported on a bad value
        native["slots_per_page"] = two_level_slots(a, vllm_config, policy, native)
    return native


def reprefillable_tokens(a: ManagerArgs) -> int:
    """vLLM's ``num_reprefillable_tokens``, ``max(0, num_prefill_lookahead - 1)``: with
    multi-module MTP the last tokens of a prefill chunk are not final (the drafter reads
    that far past the chunk, which may be prefilled again), so vLLM's coordinator caches
    only up to ``num_computed_tokens`` minus these (a single group always, a hybrid's
    dropping groups; see ``Config::reprefillable_tokens`` in the core). Raises
    ``Unsupported`` for what vLLM's own manager refuses: a lookahead over the scheduler block
    with prefix caching and an EAGLE/MTP group (vLLM raises ``ValueError`` then, as it does
    once the adapter falls back)."""
    la = a.num_prefill_lookahead
    if not isinstance(la, int) or isinstance(la, bool) or la < 0:
        raise Unsupported(f"num_prefill_lookahead={la!r}")
    groups = a.kv_cache_config.kv_cache_groups
    eagle_groups = a.use_eagle or any(g.is_eagle_group for g in groups)
    if a.enable_caching and eagle_groups and a.scheduler_block_size < la:
        raise Unsupported(
            f"multi-token prefill lookahead of {la} tokens over a scheduler block of {a.scheduler_block_size} "
            "with prefix caching (vLLM's manager raises ValueError)"
        )
    specs = [g.kv_cache_spec for g in groups]
    if a.enable_caching and a.num_hash_lookahead_tokens > 1 and len(specs) == 1 and isinstance(specs[0], MambaSpec):
        # vLLM's single-group Mamba lookup reads hashes up to the prompt's last token, which
        # lookahead hashes over more than one token do not reach: it raises IndexError.
        raise Unsupported(
            f"a single Mamba group with lookahead block hashes over {a.num_hash_lookahead_tokens} tokens "
            "(vLLM's own lookup indexes past the request's hashes there)"
        )
    return max(0, la - 1)


def eagle_drop_groups(a: ManagerArgs) -> list[int]:
    """The groups in vLLM's coordinator's EAGLE/MTP drop set (0.33's
    ``drop_eagle_group_ids``, 0.32's ``eagle_group_ids``): the groups flagged
    ``is_eagle_group``, or every group when ``use_eagle`` flags none; on 0.33 only with
    ``use_eagle`` (lookahead block hashes clear it), on 0.32 always. Empty with prefix caching
    off, where vLLM's coordinator reads none of it. A Mamba group in the set matches as
    without the drop (vLLM's Mamba finder never drops) but caches one block past the aligned
    boundary, as every dropping group does. Raises ``Unsupported`` for a drop the core does
    not serve: with chunked local attention (vLLM asserts on it)."""
    groups = a.kv_cache_config.kv_cache_groups
    flagged = [i for i, g in enumerate(groups) if g.is_eagle_group]
    if a.use_eagle and not flagged:
        flagged = list(range(len(groups)))
    drops = a.use_eagle or not compat.EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE
    specs = [g.kv_cache_spec for g in groups]
    if not (a.enable_caching and drops and flagged):
        return []
    if any(isinstance(s, ChunkedLocalAttentionSpec) for s in specs):
        raise Unsupported("EAGLE/MTP prefix-cache block drop with chunked local attention (vLLM asserts on it)")
    return flagged


def two_level_slots(a: ManagerArgs, vllm_config: Any, policy: str, native: dict[str, Any]) -> int:
    """``slots_per_page`` for the core under ``HYBRID_ALLOC_PAGES=two-level``
    (:mod:`.pages`): ``k`` of a two-level configuration. Raises ``Unsupported`` naming what
    two-level pages do not serve (this first version): a model without a state group, a KV
    connector (it moves whole blocks: a page's slots belong to other requests), decode or
    prefill context parallelism, speculative decoding (lookahead hashes or blocks, Mamba
    speculative blocks), the hit-aware policy's pinned prefixes and retention priority with prefix
    caching on (hit-aware itself is served), an attention block other than
    ``HYBRID_ALLOC_SMALL_BLOCK``, a configuration that is not two-level (the plugin's
    planning, :mod:`.engine_pages`, did not run), and a ``prefix_match_unit`` other than the
    small block (prefix caching on). KV cache zeroing is served: the core records the new
    slots, which the workers of the engine side zero in their small-block views (only that
    planning hands real workers a two-level configuration). A unit equal to the small block
    (the small block's default when the variable is unset) is passed to the core as
    ``prefix_match_unit`` in ``native``: states are then keyed and hit at every unit, as
    vLLM's partial hash hits do. The admission headroom (``HYBRID_ALLOC_PAGES_HEADROOM``,
    default 1 slot per running request) goes in as ``admission_headroom_slots``."""
    kvc = a.kv_cache_config
    small = pages.small_block(vllm_config)  # raises Unsupported on a bad value
    on = f"{pages.PAGES_ENV}=two-level"
    specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
    if not any(isinstance(s, MambaSpec) for s in specs):
        raise Unsupported(f"{on} needs a state-space hybrid (no Mamba / linear-attention group)")
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is not None and getattr(ktc, "kv_connector", None):
        raise Unsupported(f"{on} with a KV connector ({ktc.kv_connector}: it moves whole blocks)")
    if a.dcp_world_size != 1 or a.pcp_world_size != 1:
        raise Unsupported(f"{on} with context parallelism (dcp {a.dcp_world_size}, pcp {a.pcp_world_size})")
    lookahead = a.num_hash_lookahead_tokens or a.num_prefill_lookahead
    mamba_spec_blocks = max((s.num_speculative_blocks for s in specs if isinstance(s, MambaSpec)), default=0)
    spec_config = getattr(vllm_config, "speculative_config", None)
    if a.use_eagle or lookahead or mamba_spec_blocks or spec_config is not None:
        raise Unsupported(f"{on} with speculative decoding (lookahead tokens or blocks)")
    if policy != "exact" and a.enable_caching:
        # Hit-aware is served (each pool with its own levels), not the user's pinned levels:
        # a pinned slot must outlive every free page of lower levels, which the page queue
        # does not do yet. With prefix caching off hit-aware caches nothing: served as exact.
        controls = policy_env.policy_controls()
        for name, asked in (
            (policy_env.PIN_PREFIXES_ENV, bool(controls.pins)),
            (policy_env.RETAIN_PRIORITY_ENV, controls.retain_priority is not None),
        ):
            if asked:
                raise Unsupported(
                    f"{on} with {policy_env.POLICY_ENV}={policy} and {name} (two-level pages serve hit-aware's "
                    "own levels, branch points and junctions, not pinned prefixes or retained requests)"
                )
    if (why := pages.unit_refusal(vllm_config, small)) is not None:
        # Before "not two-level": the engine side kept vLLM's plan for this same reason.
        raise Unsupported(why)
    k = pages.slots_per_page(kvc)
    if k is None:
        sizes = ", ".join(f"{type(s).__name__} {s.block_size} tokens / {s.page_size_bytes} bytes" for s in specs)
        raise Unsupported(f"{on} but the KV cache configuration is not two-level ({sizes})")
    blocks = {s.block_size for s in specs if not isinstance(s, MambaSpec)}
    if blocks != {small}:
        raise Unsupported(f"{on}: attention blocks of {sorted(blocks)} tokens, {pages.SMALL_BLOCK_ENV} is {small}")
    if (unit := pages.prefix_match_unit(vllm_config)) is not None:
        native["prefix_match_unit"] = unit
    if headroom := pages.headroom_from_env():  # raises Unsupported on a bad value
        native["admission_headroom_slots"] = headroom
    return k
