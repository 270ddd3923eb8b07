"""Two-level pages for state-space hybrids (issue 37), the scheduler side: the opt-in switch,
and the KV cache configuration it asks vLLM to schedule with.

- ``HYBRID_ALLOC_PAGES``: ``two-level`` turns the layout on; unset, empty or ``off``: vLLM's
  layout (nothing changes). Any other value raises ``Unsupported`` naming the variable (the
  adapter falls back to vLLM's manager with one line, as ``policy_env`` does).
- ``HYBRID_ALLOC_SMALL_BLOCK``: the attention block inside a page, in tokens (default 64, or
  vLLM's ``prefix_match_unit`` where the user set one: :func:`small_block`).
- ``HYBRID_ALLOC_PAGES_HEADROOM``: the admission headroom, in slots per running request
  (default 1; 0 turns it off): a waiting or preempted request is admitted while others run only
  if ``ceil(running x headroom / k)`` pages stay free (:func:`headroom_from_env`; the core's
  ``admission_headroom_slots``).

Prefix caching (docs/two-level-pages.md): attention slots are cached and hit at the small block;
states at state blocks, or, with a ``prefix_match_unit`` equal to the small block, at every unit
(vLLM's partial hash hits, :func:`prefix_match_unit`); any other unit falls back
(``plan.two_level_slots``).

The layout (docs/two-level-pages.md): vLLM's planner gives every group one page size, so a
state-space hybrid's attention block grows until one attention page holds one layer's state
(528-2096 tokens on Hopper). :func:`two_level_kv_cache_config` keeps vLLM's pool (the same
tensors, the same bytes) and its pages, but every attention group's block becomes ``small``
tokens: a page holds either one state group's block or ``k`` small attention blocks ("slots"),
``k = state page / small page``. The state page is padded up to ``k`` small pages where it is
not a multiple (then fewer pages fit the same tensors: ``num_blocks`` shrinks to what fits),
and the state groups' block (the align mode's checkpoint spacing, in tokens) is rounded up to a
multiple of ``small``. Slot ``s`` of an attention group is slot ``s % k`` of page ``s // k``:
with a layer-outermost layout (``block_stride`` = the page, every release's default), each
attention tensor's ``block_stride`` becomes the small page, so slot ``s`` starts at
``offset + layer * layer_stride + s * small_page``, inside page ``s // k``.

:func:`slots_per_page` reads ``k`` back from a configuration (``plan.native_plan`` passes it to
the core as ``slots_per_page``), and :func:`scheduler_cache_config` sets what vLLM's scheduler
reads from ``CacheConfig`` so that it agrees with the configuration (see the docs page's
"scheduler side").

Cost: one pass over the groups and tensors, at construction only. Imports vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal

from vllm.v1.kv_cache_interface import MambaSpec

from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_SMALL_BLOCK",
    "HEADROOM_ENV",
    "PAGES_ENV",
    "SMALL_BLOCK_ENV",
    "cache_hit_alignment_tokens",
    "headroom_from_env",
    "pages_from_env",
    "prefix_match_unit",
    "scheduler_cache_config",
    "slots_per_page",
    "small_block",
    "small_block_from_env",
    "unit_refusal",
    "state_block_size",
    "two_level_kv_cache_config",
]

PAGES_ENV = "HYBRID_ALLOC_PAGES"
SMALL_BLOCK_ENV = "HYBRID_ALLOC_SMALL_BLOCK"
DEFAULT_SMALL_BLOCK = 64
HEADROOM_ENV = "HYBRID_ALLOC_PAGES_HEADROOM"
#: Slots of growth room per running request kept free at admission (docs/two-level-pages.md,
#: "Admission headroom").
DEFAULT_HEADROOM = 1
LAYOUTS = ("off", "two-level")

Layout = Literal["off", "two-level"]


def pages_from_env() -> Layout:
    """``HYBRID_ALLOC_PAGES`` (case and ``_``/``-`` ignored; unset, empty or ``off``: off).
    Raises ``Unsupported`` naming the variable on any other value."""
    raw = os.environ.get(PAGES_ENV, "").strip().lower().replace("_", "-")
    if raw in ("", "off"):
        return "off"
    if raw == "two-level":
        return "two-level"
    raise Unsupported(f"{PAGES_ENV}={os.environ.get(PAGES_ENV)!r} is not one of {', '.join(LAYOUTS)}")


def _whole_env(name: str, default: int, least: int, what: str) -> int:
    """The whole number in variable ``name`` (unset or empty: ``default``). Raises
    ``Unsupported`` naming the variable and ``what`` it must be unless it is at least ``least``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise Unsupported(f"{name}={os.environ.get(name)!r} is not {what}")
    return value


def small_block_from_env(default: int = DEFAULT_SMALL_BLOCK) -> int:
    """``HYBRID_ALLOC_SMALL_BLOCK`` (unset or empty: ``default``). Raises ``Unsupported``
    naming the variable unless it is a positive whole number of tokens."""
    return _whole_env(SMALL_BLOCK_ENV, default, 1, "a positive number of tokens")


def headroom_from_env() -> int:
    """``HYBRID_ALLOC_PAGES_HEADROOM`` (unset or empty: :data:`DEFAULT_HEADROOM`): slots per
    running request kept free when a waiting or preempted request is admitted while others run.
    Raises ``Unsupported`` naming the variable unless it is a whole number >= 0."""
    return _whole_env(HEADROOM_ENV, DEFAULT_HEADROOM, 0, "a whole number of slots (0 or more)")


def prefix_match_unit(vllm_config: Any) -> int | None:
    """The user's ``cache_config.prefix_match_unit`` (``--prefix-match-unit``), or None: unset,
    prefix caching off (no hits to serve), or no ``vllm_config``. Read from the user's setting,
    never from the hash block: with two-level pages the hash block is the small block with or
    without a unit (and, caching off, vLLM's scheduler block)."""
    cache = getattr(vllm_config, "cache_config", None)
    unit = getattr(cache, "prefix_match_unit", None)
    if unit is None or not getattr(cache, "enable_prefix_caching", False):
        return None
    return int(unit)


def small_block(vllm_config: Any) -> int:
    """The small block two-level pages use: ``HYBRID_ALLOC_SMALL_BLOCK``, else the user's
    :func:`prefix_match_unit` (the unit two-level pages serve is the small block), else
    :data:`DEFAULT_SMALL_BLOCK`. Raises ``Unsupported`` as :func:`small_block_from_env`."""
    return small_block_from_env(prefix_match_unit(vllm_config) or DEFAULT_SMALL_BLOCK)


def unit_refusal(vllm_config: Any, small: int) -> str | None:
    """Why two-level pages at ``small``-token attention blocks do not serve the user's
    :func:`prefix_match_unit`, or None (no unit, or the unit is ``small``). Below the small
    block a hit would end inside a slot, which vLLM's workers would copy on write at their
    block (a page, ``copy_kv_cache_blocks_inplace``); above it no slot is a whole unit (vLLM's
    ``resolve_kv_cache_block_sizes`` refuses it)."""
    unit = prefix_match_unit(vllm_config)
    if unit is None or unit == small:
        return None
    return (
        f"{PAGES_ENV}=two-level with prefix_match_unit={unit}: served only equal to the small block "
        f"({SMALL_BLOCK_ENV}={small}, its default when unset), hits inside a slot are not"
    )


def _state_bytes(spec: Any) -> int:
    """A state spec's own bytes per block (its page before vLLM padded it)."""
    return int(dataclasses.replace(spec, page_size_padded=None).page_size_bytes)


def state_block_size(kv_cache_config: Any) -> int | None:
    """The state groups' block size (tokens; the align mode's checkpoint spacing), or None
    without a state group. Raises ``ValueError`` when state groups disagree."""
    sizes = {
        g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)
    }
    if len(sizes) > 1:
        raise ValueError(f"state groups with different block sizes {sorted(sizes)}")
    return next(iter(sizes), None)


def two_level_kv_cache_config(kv_cache_config: Any, small: int) -> Any:
    """The two-level form of ``kv_cache_config`` (vLLM's plan of a state-space hybrid): a new
    ``KVCacheConfig``, the input unchanged.

    - every attention group's spec at ``block_size=small`` (its page: ``small`` tokens);
    - every state group's spec with its page padded up to ``k`` small pages
      (``k = ceil(state bytes / small page)``) and, in cache mode "align", its block size
      rounded up to a multiple of ``small``;
    - the same tensors (size, layers, ``layer_stride``, offset): a state tensor's
      ``block_stride`` is the new state page, an attention tensor's the small page;
    - ``num_blocks``: the pages that fit every tensor's layer region at the new state page
      (vLLM's count where the state page did not grow);
    - ``hash_block_size`` and ``cache_hit_alignment_tokens`` unset (None): resolved from the
      new groups, as the engine does after planning.

    # Errors
    ``ValueError`` naming what the layout cannot take: no state group, no attention group,
    attention groups with different bytes per token or an already padded attention page, a
    block-outermost tensor layout (a page's slots would not be evenly spaced), ``k < 2``
    (``small`` is not below the state page: no gain), a ``small`` that is not a positive
    whole number."""
    if not isinstance(small, int) or isinstance(small, bool) or small < 1:
        raise ValueError(f"small block {small!r} is not a positive number of tokens")
    groups = kv_cache_config.kv_cache_groups
    state = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    attn = [i for i, g in enumerate(groups) if not isinstance(g.kv_cache_spec, MambaSpec)]
    if not state:
        raise ValueError("no state (Mamba / linear attention) group: two-level pages are for state-space hybrids")
    if not attn:
        raise ValueError("no attention group: every page already holds a state")
    specs: dict[int, Any] = {}
    small_pages: set[int] = set()
    for i in attn:
        spec = groups[i].kv_cache_spec
        if getattr(spec, "page_size_padded", None) is not None:
            raise ValueError(f"group {i} ({type(spec).__name__}) has a padded page ({spec.page_size_padded} bytes)")
        specs[i] = dataclasses.replace(spec, block_size=small)
        small_pages.add(specs[i].page_size_bytes)
    if len(small_pages) != 1:
        raise ValueError(f"attention groups with different pages at {small} tokens: {sorted(small_pages)} bytes")
    small_page = small_pages.pop()
    k = max(math.ceil(_state_bytes(groups[i].kv_cache_spec) / small_page) for i in state)
    if k < 2:
        raise ValueError(
            f"a state fits one {small}-token attention page ({small_page} bytes): no smaller block to gain"
        )
    page = k * small_page
    for i in state:
        spec = groups[i].kv_cache_spec
        bs = spec.block_size
        if spec.mamba_cache_mode == "align":
            bs = -(-bs // small) * small
        specs[i] = dataclasses.replace(spec, block_size=bs, page_size_padded=page)
    group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    old_pages = {i: g.kv_cache_spec.page_size_bytes for i, g in enumerate(groups)}
    num_blocks: int | None = None
    tensors = []
    for t in kv_cache_config.kv_cache_tensors:
        owners = {group_of[name] for name in t.layers if name in group_of}
        if len(owners) != 1:
            raise ValueError(f"a KV cache tensor holds layers of groups {sorted(owners)} (one expected)")
        (i,) = owners
        if t.block_stride != old_pages[i]:
            raise ValueError(
                f"block-outermost KV cache layout (block_stride {t.block_stride} != page {old_pages[i]}): "
                "a page's attention slots would not be evenly spaced"
            )
        region = t.layer_stride if len(t.layers) > 1 else t.size - t.offset  # one layer's bytes
        fits = region // page
        num_blocks = fits if num_blocks is None else min(num_blocks, fits)
        new_stride = page if i in state else small_page
        tensors.append(dataclasses.replace(t, block_stride=new_stride))
    # Never more pages than vLLM's bytes hold (tensors may be absent: a scheduler-only plan).
    budget = kv_cache_config.num_blocks * old_pages[state[0]] // page
    num_blocks = budget if num_blocks is None else min(num_blocks, budget)
    new_groups = [dataclasses.replace(g, kv_cache_spec=specs[i]) for i, g in enumerate(groups)]
    # What the engine resolves from the groups after planning (``resolve_kv_cache_block_sizes``):
    # a value resolved for vLLM's blocks would be stale, so it is resolved again.
    stale = {f: None for f in ("hash_block_size", "cache_hit_alignment_tokens") if hasattr(kv_cache_config, f)}
    return dataclasses.replace(
        kv_cache_config, num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=new_groups, **stale
    )


def slots_per_page(kv_cache_config: Any) -> int | None:
    """``k`` of a two-level configuration (every attention group's page times ``k`` is every
    state group's page, ``k > 1``), or None when the configuration is not two-level (no state
    group, no attention group, or pages that are not such multiples: vLLM's own plan gives
    every group one page, ``k = 1``)."""
    groups = kv_cache_config.kv_cache_groups
    state = {g.kv_cache_spec.page_size_bytes for g in groups if isinstance(g.kv_cache_spec, MambaSpec)}
    attn = {g.kv_cache_spec.page_size_bytes for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)}
    if len(state) != 1 or len(attn) != 1:
        return None
    (sp,), (ap,) = state, attn
    if ap <= 0 or sp % ap or sp // ap < 2:
        return None
    return sp // ap


def scheduler_cache_config(cache_config: Any, kv_cache_config: Any) -> None:
    """Sets what vLLM's scheduler reads from ``cache_config`` to agree with a two-level
    ``kv_cache_config``: ``block_size`` and (align mode) ``mamba_block_size`` become the state
    groups' block. ``Scheduler._mamba_block_aligned_split`` reads ``cache_config.block_size``
    as the Mamba block (the state checkpoint spacing, 0.32-0.34); every other block size the
    scheduler and the manager use comes from the groups (``resolve_kv_cache_block_sizes``:
    the scheduler block is the LCM of the groups' blocks, the state block; the hash block is
    their GCD, ``small``, or ``prefix_match_unit``). A configuration without a state group is
    left alone."""
    bs = state_block_size(kv_cache_config)
    if bs is None:
        return
    cache_config.block_size = bs
    if getattr(cache_config, "mamba_cache_mode", None) == "align":
        cache_config.mamba_block_size = bs


def cache_hit_alignment_tokens(kv_cache_config: Any, scheduler_block_size: int, unit: int | None = None) -> int | None:
    """The hit alignment of a two-level ``kv_cache_config`` without a ``prefix_match_unit``
    (``unit``, :func:`prefix_match_unit`): the state block, as the core serves no sub-block
    ("partial") hash hits there; None for any other configuration (vLLM's
    ``resolve_cache_hit_alignment_tokens`` holds). vLLM's resolver gives the hash block
    (``small``) for a two-level configuration, because its own managers would serve partial
    hits there; the workers read that value (``cache_config.cache_hit_alignment_tokens``) to
    place Mamba prefill checkpoints, so it must be the manager's alignment instead. With a
    unit the core serves partial hits at the hash block (the unit), vLLM's answer."""
    if unit is not None or slots_per_page(kv_cache_config) is None:
        return None
    return scheduler_block_size
