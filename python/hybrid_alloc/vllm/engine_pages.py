"""Two-level pages (issue 37), the engine side: the plugin makes vLLM's engine plan, and its
workers view, the two-level KV cache configuration of :mod:`hybrid_alloc.vllm.pages`.

Installed by the plugin (:mod:`hybrid_alloc.vllm.plugin`) in every process it runs in (vLLM
loads general plugins in the engine core and in the workers) when ``HYBRID_ALLOC_PAGES`` is
``two-level``, and only on the releases in :data:`ENGINE_RELEASES` (where a real engine ran it).
What it patches (vLLM 0.32.0, docs/two-level-pages.md "Engine side"):

- ``vllm.v1.engine.core.get_kv_cache_configs`` (``EngineCore._initialize_kv_caches`` calls it,
  then derives the scheduler's configuration from its result and hands the result to the
  workers): each worker's plan is replaced by :func:`pages.two_level_kv_cache_config`'s, when
  :func:`decide` says our manager will serve it (the same checks as ``plan.native_plan``, and
  the core built once); otherwise vLLM's plan is returned as it is. One log line either way.
- ``vllm.v1.engine.core.resolve_kv_cache_block_sizes``: called right after the engine set
  ``cache_config.block_size`` to the smallest group block (the small block): for a two-level
  configuration :func:`pages.scheduler_cache_config` sets it back to the state block first
  (the Mamba block the scheduler's align split and the workers read).
- ``vllm.v1.engine.core.resolve_cache_hit_alignment_tokens``: for a two-level configuration the
  state block (:func:`pages.cache_hit_alignment_tokens`; vLLM's resolver answers the small block,
  as its managers would serve partial hits there; the core does not, and the engine writes the
  value into every worker's configuration, where Mamba prefill checkpoints are placed by it).
  With a ``prefix_match_unit`` (equal to the small block, else the plan falls back) the core
  serves partial hits at the unit: vLLM's answer stands.
- ``KVCacheConfig.num_blocks_of``: vLLM's workers (``allocate_kv_cache``) view every tensor with
  ``num_blocks`` blocks; an attention tensor of a two-level configuration has ``num_blocks * k``
  small blocks (``block_stride`` the small page). vLLM's own configurations (one page for every
  group) are answered as before.

Nothing else of the worker changes: block tables and slot mappings are per group at the
group's block size (the small block), and the kernel block size is the small block, which must
be one the attention backend takes (the CPU backend: multiples of 32).

Anything this module cannot serve leaves vLLM's plan as it is, and the scheduler side then falls
back (``plan.two_level_slots``: "not two-level"); nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from hybrid_alloc.vllm import pages

__all__ = ["ENGINE_RELEASES", "decide", "install", "installed", "remove"]

logger = logging.getLogger("vllm.hybrid_alloc")

#: The releases whose engine plans and views two-level pages through this module, on the CPU
#: platform only (a real CPU engine ran it: tests/python/engine/test_engine_pages.py). Not on a
#: GPU: 0.32's ``KVBlockZeroer`` reads a view of ``P * k`` blocks as ``k`` kernel blocks per
#: page and would zero page ``s`` for slot ``s`` (``v1/worker/utils.py``); the CPU runner's
#: ``_zero_block_ids`` zeroes ``kv[s]``, the slot (``v1/worker/cpu_model_runner.py``).
ENGINE_RELEASES = ("0.32.0",)

# What install() replaced: (core module, get_kv_cache_configs, resolve_kv_cache_block_sizes,
# resolve_cache_hit_alignment_tokens, KVCacheConfig class, num_blocks_of); None while not installed.
_saved: tuple[Any, Any, Any, Any, Any, Any] | None = None


def _scheduler_args(vllm_config: Any, kvc: Any) -> Any:
    """The ``KVCacheManager`` arguments vLLM's ``Scheduler`` (0.32) will pass for ``kvc``
    (the scheduler's configuration), read from ``vllm_config`` as the Scheduler reads them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from hybrid_alloc.vllm.args import ManagerArgs

    sched_block, hash_block = resolve_kv_cache_block_sizes(kvc, vllm_config)
    spec = vllm_config.speculative_config
    kv_events = getattr(vllm_config, "kv_events_config", None)
    return ManagerArgs(
        kv_cache_config=kvc,
        max_model_len=vllm_config.model_config.max_model_len,
        max_in_flight_tokens=getattr(vllm_config, "max_in_flight_tokens", None),
        scheduler_block_size=sched_block,
        hash_block_size=hash_block,
        enable_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        use_eagle=bool(spec is not None and spec.use_eagle()),
        num_prefill_lookahead=getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0,
        enable_kv_cache_events=bool(kv_events is not None and kv_events.enable_kv_cache_events),
        dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
        pcp_world_size=1,
        watermark=getattr(vllm_config.scheduler_config, "watermark", 0.0),
    )


def decide(vllm_config: Any, kv_cache_configs: list[Any]) -> tuple[list[Any] | None, str]:
    """The two-level form of every worker's plan, or None and the reason vLLM's plan stays.
    Reshaped only when our manager will serve the scheduler's configuration: the plugin's flag
    is on, and ``plan.native_plan`` and the core accept the configuration the scheduler will
    be given; and the state block (``mamba_block_size``, which the workers read from their own
    copy of the config, made before planning) is not rounded: ``small`` divides it. Never
    raises."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

        from hybrid_alloc.vllm import manager
        from hybrid_alloc.vllm.plan import native_plan
        from hybrid_alloc.vllm.unsupported import Unsupported

        # The plugin (which installed this module's patches, so it is loaded) has put our
        # manager in vLLM's scheduler. Read through sys.modules: the plugin imports this
        # module, and an import back would close a circle.
        plugin = sys.modules.get("hybrid_alloc.vllm.plugin")
        if plugin is None or not plugin.applied():
            return None, "the plugin's manager is not installed"
        small = pages.small_block(vllm_config)
        if (why := pages.unit_refusal(vllm_config, small)) is not None:
            return None, why  # before vLLM's resolver, which refuses a unit above the small block
        reshaped = [pages.two_level_kv_cache_config(c, small) for c in kv_cache_configs]
        before, after = pages.state_block_size(kv_cache_configs[0]), pages.state_block_size(reshaped[0])
        if before != after:
            # The workers (started before planning) keep vLLM's ``mamba_block_size``.
            return None, f"the state block of {before} tokens is not a multiple of {pages.SMALL_BLOCK_ENV}={small}"
        sched = generate_scheduler_kv_cache_config(reshaped)
        try:
            native = native_plan(_scheduler_args(vllm_config, sched), vllm_config)
            manager._allocator(native)  # the core's own refusals
        except (Unsupported, manager.UnsupportedConfigError) as e:
            return None, str(e)
        return (
            reshaped,
            f"attention at {small}-token blocks, {native['slots_per_page']} per page, {sched.num_blocks} pages",
        )
    except Exception as e:  # noqa: BLE001 - vLLM's plan is always a valid answer
        return None, f"{type(e).__name__}: {e}"


def _num_blocks_of(original: Any) -> Any:
    told: list[bool] = []  # one log line per process

    def num_blocks_of(self: Any, tensor: Any) -> int:
        """``num_blocks`` times ``k`` for an attention tensor of a two-level configuration
        (hybrid_alloc: its views hold ``k`` small blocks per page), vLLM's answer otherwise."""
        n = original(self, tensor)
        if getattr(tensor, "host_resident", False):
            return n
        k = pages.slots_per_page(self)
        if k is None:
            return n
        from vllm.v1.kv_cache_interface import MambaSpec

        layer = tensor.layers[0]
        group = next((g for g in self.kv_cache_groups if layer in g.layer_names), None)
        if group is None or isinstance(group.kv_cache_spec, MambaSpec):
            return n
        if not told:
            told.append(True)
            logger.info(
                "hybrid_alloc: two-level pages: attention tensors viewed as %d blocks (%d pages x %d)", n * k, n, k
            )
        return n * k

    num_blocks_of._hybrid_alloc_wrapped = True  # type: ignore[attr-defined]
    return num_blocks_of


def install(release: str | None) -> bool:
    """Installs the engine side (idempotent); returns whether it is installed. On a release
    outside :data:`ENGINE_RELEASES`, or on any error, vLLM is left as it is, with one line
    (the scheduler side then falls back: the configuration is not two-level)."""
    global _saved
    if _saved is not None:
        return True
    try:
        from vllm.platforms import current_platform

        device = "CPU" if current_platform.is_cpu() else type(current_platform).__name__
        if release not in ENGINE_RELEASES or device != "CPU":
            logger.warning(
                "hybrid_alloc: %s=two-level is proven on vLLM %s's CPU engine only (this is vLLM %s on %s): "
                "vLLM's KV cache layout stays",
                pages.PAGES_ENV,
                ", ".join(ENGINE_RELEASES),
                release,
                device,
            )
            return False
        from vllm.v1.engine import core as core_mod
        from vllm.v1.kv_cache_interface import KVCacheConfig

        original_plan = core_mod.get_kv_cache_configs
        original_resolve = core_mod.resolve_kv_cache_block_sizes
        original_alignment = core_mod.resolve_cache_hit_alignment_tokens
        original_num_blocks_of = KVCacheConfig.num_blocks_of
    except Exception as e:  # noqa: BLE001
        logger.warning("hybrid_alloc: two-level pages not installed, vLLM's layout stays: %s: %s", type(e).__name__, e)
        return False

    def get_kv_cache_configs(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        configs = original_plan(vllm_config, *args, **kwargs)
        reshaped, why = decide(vllm_config, configs)
        if reshaped is None:
            logger.warning("hybrid_alloc: two-level pages fall back to vLLM's layout: %s", why)
            return configs
        logger.info("hybrid_alloc: two-level pages: %s", why)
        return reshaped

    def resolve_kv_cache_block_sizes(kvc: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        if pages.slots_per_page(kvc) is not None:
            pages.scheduler_cache_config(vllm_config.cache_config, kvc)
        return original_resolve(kvc, vllm_config, *args, **kwargs)

    def resolve_cache_hit_alignment_tokens(kvc: Any, vllm_config: Any, scheduler_block_size: int, *args: Any) -> Any:
        aligned = original_alignment(kvc, vllm_config, scheduler_block_size, *args)
        ours = pages.cache_hit_alignment_tokens(kvc, scheduler_block_size, pages.prefix_match_unit(vllm_config))
        return aligned if ours is None else ours

    core_mod.get_kv_cache_configs = get_kv_cache_configs
    core_mod.resolve_kv_cache_block_sizes = resolve_kv_cache_block_sizes
    core_mod.resolve_cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens
    KVCacheConfig.num_blocks_of = _num_blocks_of(original_num_blocks_of)
    _saved = (core_mod, original_plan, original_resolve, original_alignment, KVCacheConfig, original_num_blocks_of)
    return True


def installed() -> bool:
    """Whether :func:`install` has patched vLLM in this process."""
    return _saved is not None


def remove() -> None:
    """Undoes :func:`install` (tests); a no-op if it is not installed."""
    global _saved
    if _saved is None:
        return
    core_mod, original_plan, original_resolve, original_alignment, cls, original_num_blocks_of = _saved
    core_mod.get_kv_cache_configs = original_plan
    core_mod.resolve_kv_cache_block_sizes = original_resolve
    core_mod.resolve_cache_hit_alignment_tokens = original_alignment
    cls.num_blocks_of = original_num_blocks_of
    _saved = None
