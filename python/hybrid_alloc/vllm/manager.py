"""A drop-in ``KVCacheManager`` for vLLM 0.32.0 and 0.33.0 backed by the native core.

:class:`HybridKVCacheManager` takes the constructor arguments of vLLM's
``vllm.v1.core.kv_cache_manager.KVCacheManager`` and serves every method and attribute
vLLM's ``Scheduler``, ``AsyncScheduler``, engine core and stats use, with vLLM's return
types. Each call crosses into Rust once; ints, bytes and flat lists cross the boundary.

Block objects (``block_id``, ``block_hash``, ``ref_cnt``, ``is_null``) are made only where
a caller reads ``KVCacheBlocks.blocks``; ``get_block_ids`` hands out the id lists directly.

One installed package serves both releases: what differs is read from the installed vLLM
once, at import (see ``LOOKAHEAD_HASHES`` and ``TRIM_NULL_HEAD``).

For a configuration the core does not serve exactly, and for anything the adapter does not
know at construction (an argument it has never seen, a missing attribute, an exception while
building the native manager), ``HybridKVCacheManager(...)`` returns vLLM's own
``KVCacheManager``, built with the same arguments, and logs one line saying why. The
constructor never raises what vLLM's own would not.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core import kv_cache_manager as _vllm_kvm
from vllm.v1.core import kv_cache_utils as _vllm_kvu
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, RSWASpec, SinkFullAttentionSpec
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc._core import Allocator, BlockIds, FastAllocate, Hit, HybridAllocError, UnsupportedConfigError

logger = init_logger("vllm.hybrid_alloc")

_VLLM_RELEASE: str = getattr(__import__("vllm"), "__version__", "").split("+", 1)[0]

# The vLLM class this adapter replaces (captured before the plugin patches anything); the
# fallback builds it, and its signature says which constructor arguments exist.
VllmKVCacheManager = _vllm_kvm.KVCacheManager

# What differs between the supported releases, read from the installed vLLM once.
# vLLM 0.33: lookahead block hashes (``num_hash_lookahead_tokens``: EAGLE/MTP with prefix
# caching hash each block together with the next L tokens instead of dropping the last
# block; ``BlockStored`` then carries ``lookahead_token_ids``). The same release drops the
# EAGLE last block only with ``use_eagle`` (``drop_eagle_group_ids``): a group flagged
# ``is_eagle_group`` drops nothing without it. On 0.32 a flagged group always drops.
LOOKAHEAD_HASHES = "num_hash_lookahead_tokens" in inspect.signature(VllmKVCacheManager).parameters
EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE = LOOKAHEAD_HASHES
# vLLM 0.33: ``pop_blocks_for_free`` returns each group's blocks without its leading nulls.
TRIM_NULL_HEAD = hasattr(_vllm_kvu, "trim_null_head")
_generate_lookahead_extra_keys = getattr(_vllm_kvu, "generate_lookahead_block_hash_extra_keys", None)

# Every ``KVCacheManager.__init__`` argument the adapter knows (0.32.0 and 0.33.0). Any other
# argument of the installed vLLM's constructor means a release whose meaning we have not
# checked: fall back.
KNOWN_ARGS = frozenset(
    {
        "kv_cache_config",
        "max_model_len",
        "scheduler_block_size",
        "hash_block_size",
        "max_in_flight_tokens",
        "enable_caching",
        "use_eagle",
        "num_hash_lookahead_tokens",
        "num_prefill_lookahead",
        "log_stats",
        "enable_kv_cache_events",
        "dcp_world_size",
        "pcp_world_size",
        "metrics_collector",
        "watermark",
        "enable_mamba_shared_prefix_checkpoint",
    }
)

_WAITING_OR_PREEMPTED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# Spec classes whose exact type the core serves as full attention (vLLM gives
# ``HiddenStateCacheSpec`` the plain ``FullAttentionManager``).
_FULL_TYPES = (FullAttentionSpec, MLAAttentionSpec, HiddenStateCacheSpec)

# Set by the plugin around ``Scheduler.__init__``: the config being scheduled, so the
# manager can see what its constructor arguments do not say (a KV connector, ...).
current_vllm_config: Any = None


# The retention policy (issue 9): "exact" (vLLM's decisions) or "hit-aware"; read when a
# manager is built.
POLICY_ENV = "HYBRID_ALLOC_POLICY"
_POLICIES = ("exact", "hit-aware")


def _policy_from_env() -> str:
    raw = os.environ.get(POLICY_ENV, "exact").strip().lower().replace("_", "-")
    if raw in ("", "exact"):
        return "exact"
    if raw == "hit-aware":
        return raw
    raise Unsupported(f"{POLICY_ENV}={os.environ.get(POLICY_ENV)!r} is not one of {', '.join(_POLICIES)}")


# User controls of the hit-aware policy (ignored under exact):
# - HYBRID_ALLOC_RETAIN_PRIORITY=N: a request whose vLLM ``priority`` is <= N (lower is more
#   important, as vLLM's priority scheduling) leaves its prefix cached at the pinned level;
# - HYBRID_ALLOC_PIN_PREFIXES=FILE: a JSON list of token-id lists (e.g. system prompts) to pin,
#   each pinned the first time a request starting with it is looked up (its own block hashes,
#   so LoRA, cache salt and the hash function are those vLLM uses);
# - HYBRID_ALLOC_PIN_SHARE=F: the pinned share of the pool (default 0.25).
RETAIN_PRIORITY_ENV = "HYBRID_ALLOC_RETAIN_PRIORITY"
PIN_PREFIXES_ENV = "HYBRID_ALLOC_PIN_PREFIXES"
PIN_SHARE_ENV = "HYBRID_ALLOC_PIN_SHARE"


def _policy_controls() -> tuple[int | None, list[list[int]], float | None]:
    """(retain priority, prefixes to pin, pinned share) from the environment."""
    import json

    env = os.environ
    retain: int | None = None
    if env.get(RETAIN_PRIORITY_ENV, "").strip():
        try:
            retain = int(env[RETAIN_PRIORITY_ENV])
        except ValueError:
            raise Unsupported(f"{RETAIN_PRIORITY_ENV}={env[RETAIN_PRIORITY_ENV]!r} is not an integer") from None
    pins: list[list[int]] = []
    path = env.get(PIN_PREFIXES_ENV, "").strip()
    if path:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise Unsupported(f"{PIN_PREFIXES_ENV}={path!r} cannot be read as JSON: {e}") from None
        if not isinstance(data, list) or not all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data
        ):
            raise Unsupported(f"{PIN_PREFIXES_ENV}={path!r} must hold a JSON list of token-id lists")
        pins = [p for p in data if p]
    share: float | None = None
    if env.get(PIN_SHARE_ENV, "").strip():
        try:
            share = float(env[PIN_SHARE_ENV])
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise Unsupported(f"{PIN_SHARE_ENV}={env[PIN_SHARE_ENV]!r} is not a number in 0..1")
    return retain, pins, share


class Unsupported(Exception):
    """A configuration the core does not serve; the message names the reason."""


def _group_kind(spec: KVCacheSpec) -> tuple[str, int, int, int]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        # Nothing to be exact to: vLLM 0.32 and 0.33 register no manager for it, so their own
        # KVCacheManager cannot be built for such a group either (it asserts).
        raise Unsupported(
            "UniformTypeKVCacheSpecs (vLLM registers no manager for a uniform-type group: its own "
            "KVCacheManager cannot be built for it either)"
        )
    t = type(spec)
    if t in _FULL_TYPES:
        return ("full", 0, 0, 0)
    if t is SlidingWindowSpec:
        return ("sliding_window", spec.sliding_window, spec.extra_retained_tokens, 0)
    if t is SlidingWindowMLASpec:
        # vLLM serves it with the SlidingWindowManager (DeepSeek-V4's sliding-window MLA).
        if spec.bounded_replay:
            raise Unsupported("SlidingWindowMLASpec with bounded replay (prefix replay window)")
        return ("sliding_window", spec.sliding_window, spec.extra_retained_tokens, 0)
    if t is CircularBufferSpec:
        return ("circular_buffer", 0, 0, 0)
    if t is RSWASpec:
        # Full attention whose allocate_slots also frees the gap between the prompt and the
        # window (vLLM's RSWAManager, the same on 0.32 and 0.33).
        return ("rswa", spec.rswa_window, 0, 0)
    if t is SinkFullAttentionSpec:
        raise Unsupported(
            "SinkFullAttentionSpec (vLLM's own SinkFullAttentionManager cannot be built: its "
            "__init__ takes no needs_kv_cache_zeroing)"
        )
    if t is ChunkedLocalAttentionSpec:
        return ("chunked_local", spec.attention_chunk_size, 0, 0)
    if t is CrossAttentionSpec:
        return ("cross", 0, 0, 0)
    if t is MambaSpec:
        return _mamba_kind(spec)
    raise Unsupported(f"KV cache spec {t.__name__}")


def _mamba_kind(spec: MambaSpec) -> tuple[str, int, int, int]:
    """A ``MambaSpec`` group (GDN, Mamba2, short conv, ...) as the core serves it."""
    mode = spec.mamba_cache_mode
    if mode == "none":
        return ("mamba", spec.num_speculative_blocks, 0, 0)
    if mode == "align":
        # Prefill checkpoint blocks (MambaMixer2 always sets one, alignment 1): vLLM reserves
        # them only when both are set (``_needs_internal_checkpoint`` is False without an
        # alignment); 0 tells the core there are none.
        alignment = spec.prefill_checkpoint_alignment
        checkpoint = alignment if spec.num_prefill_checkpoint_blocks > 0 and alignment is not None else 0
        if not isinstance(checkpoint, int) or checkpoint < 0:
            raise Unsupported(f"prefill_checkpoint_alignment={alignment!r}")
        # vLLM 0.32 re-keys the prompt's checkpoint state even when it is keyed already;
        # 0.33 skips it. The core applies the installed release's rule.
        return ("mamba_align", spec.num_speculative_blocks, int(_VLLM_RELEASE.startswith("0.32.")), checkpoint)
    raise Unsupported(f"Mamba cache mode {mode!r}")


def _bind_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments by name, defaults applied, as vLLM's own ``KVCacheManager``
    (the installed release's) would receive them. Raises ``Unsupported`` naming any
    argument the adapter does not know."""
    try:
        sig = inspect.signature(VllmKVCacheManager)
    except (TypeError, ValueError) as e:
        raise Unsupported(f"cannot read vLLM's KVCacheManager signature ({e})") from None
    unknown = sorted(set(sig.parameters) - KNOWN_ARGS)
    if unknown:
        raise Unsupported(f"unknown KVCacheManager argument(s) {', '.join(unknown)} (not in the tested vLLM releases)")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise Unsupported(f"the arguments do not match vLLM's KVCacheManager: {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _native_plan(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    scheduler_block_size: int,
    hash_block_size: int,
    max_in_flight_tokens: int | None = None,
    enable_caching: bool = True,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    log_stats: bool = False,
    enable_kv_cache_events: bool = False,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    metrics_collector: Any = None,
    watermark: float = 0.0,
    enable_mamba_shared_prefix_checkpoint: bool = False,
) -> dict[str, Any]:
    """The native allocator's arguments; raises ``Unsupported`` naming what is not served
    exactly. Does not build the allocator (which may still refuse the configuration)."""
    vc = current_vllm_config
    if vc is not None and getattr(vc, "kv_transfer_config", None) is not None:
        raise Unsupported("a KV connector is configured")
    if use_eagle:
        raise Unsupported("EAGLE/MTP prefix-cache block drop")
    if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
        raise Unsupported(f"num_hash_lookahead_tokens={num_hash_lookahead_tokens!r}")
    if num_prefill_lookahead > 1:
        raise Unsupported("multi-token prefill lookahead")
    if dcp_world_size > 1 or pcp_world_size > 1:
        raise Unsupported("decode/prefill context parallelism")
    if metrics_collector is not None:
        raise Unsupported("KV cache residency metrics")
    zeroing = kv_cache_config.needs_kv_cache_zeroing
    groups: list[tuple[str, int, int, int, int, int]] = []
    seen_specs: list[KVCacheSpec] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if g.role != KVCacheGroupRole.DEFAULT or g.host_resident:
            raise Unsupported(f"group {i} has role {g.role.name} (HiSparse)")
        # On 0.33 a flagged group drops its last block only with use_eagle (refused above).
        if g.is_eagle_group and not EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE:
            raise Unsupported(f"group {i} holds EAGLE/MTP draft layers (prefix-cache block drop)")
        if not spec.prefix_cacheable and type(spec) is not CircularBufferSpec:
            raise Unsupported(f"group {i} ({type(spec).__name__}) is not prefix-cacheable")
        kind, p1, p2, p3 = _group_kind(spec)
        key = next((k for k, s in enumerate(seen_specs) if s == spec), None)
        if key is None:
            seen_specs.append(spec)
            key = len(seen_specs) - 1
        groups.append((kind, spec.block_size, key, p1, p2, p3))
    if not groups:
        raise Unsupported("no KV cache groups (attention-free model)")
    native: dict[str, Any] = dict(
        num_blocks=kv_cache_config.num_blocks,
        groups=groups,
        hash_block_size=hash_block_size,
        scheduler_block_size=scheduler_block_size,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len if max_in_flight_tokens is None else max_in_flight_tokens,
        enable_caching=enable_caching,
        enable_events=enable_kv_cache_events,
        watermark_blocks=int(watermark * kv_cache_config.num_blocks),
        retention_interval=kv_cache_config.prefix_cache_retention_interval,
    )
    if zeroing:
        native["zero_new_blocks"] = True
    if num_hash_lookahead_tokens > 0:
        # 0.33 moves the Mamba "align" prefill checkpoint positions by the lookahead tokens.
        native["hash_lookahead_tokens"] = num_hash_lookahead_tokens
    policy = _policy_from_env()  # HYBRID_ALLOC_POLICY; raises Unsupported on a bad value
    if policy != "exact":
        native["policy"] = policy
        _policy_controls()  # validated here, so a bad control falls back at construction
    return native


def native_config_or_reason(*args: Any, **kwargs: Any) -> tuple[dict[str, Any] | None, str]:
    """The native allocator's arguments for a ``KVCacheManager`` construction (vLLM's
    arguments, as the installed release takes them), or ``None`` and the reason the core
    cannot serve it exactly. Never raises."""
    try:
        native = _native_plan(**_bind_arguments(args, kwargs))
        Allocator(**native)  # validates; UnsupportedConfigError names what is not served
        return native, ""
    except (Unsupported, UnsupportedConfigError) as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - whatever it is, vLLM's own manager serves
        return None, f"{type(e).__name__} while reading the configuration: {e}"


class NativeBlock:
    """A block handed to a caller that reads ``KVCacheBlocks.blocks``: an id-backed view
    of the pool, made on demand (never on the hot path)."""

    __slots__ = ("_alloc", "block_id")

    def __init__(self, alloc: Allocator, block_id: int) -> None:
        self._alloc = alloc
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def ref_cnt(self) -> int:
        return self._alloc.ref_cnt(self.block_id)

    @property
    def block_hash(self) -> bytes | None:
        h = self._alloc.block_hash(self.block_id)
        return None if h is None else make_block_hash_with_group_id(h[0], h[1])

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._alloc.block_hash_num_tokens(self.block_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NativeBlock) and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash(self.block_id)

    def __repr__(self) -> str:
        return f"NativeBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class EmptyKVCacheBlocks(KVCacheBlocks):
    """The manager's shared "no block" result (``empty_kv_cache_blocks``): vLLM's empty
    ``KVCacheBlocks`` (``blocks`` is one empty tuple per group, so ``+``, ``.blocks``,
    ``new_empty`` and the connectors see exactly vLLM's object), whose ``get_block_ids``
    answers without scanning the groups. The scheduler calls ``get_block_ids(allow_none=True)``
    on it for every running request that got no new block (15 of 16 decode steps at block
    size 16): vLLM's method costs about 0.4-0.6 us there, this one about 0.05 us."""

    def __init__(self, num_groups: int) -> None:
        super().__init__(tuple(() for _ in range(num_groups)))

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None) -> Any:
        if allow_none and group_ids is None:
            return None
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none:
            return None
        return tuple([] for _ in groups)


class NativeKVCacheBlocks(KVCacheBlocks):
    """``KVCacheBlocks`` whose content is block ids; ``blocks`` makes block views lazily.
    Made from lists, or from the core's flat ``BlockIds`` buffer: then no Python int is made
    for an id until a caller reads the ids (the scheduler does not read an admission's new
    blocks, nor a hit's)."""

    __slots__ = ("_alloc", "_src", "_lists", "_blocks")

    def __init__(self, alloc: Allocator, ids: tuple[list[int], ...] | BlockIds) -> None:
        # Deliberately not calling the dataclass __init__: ``blocks`` is lazy.
        self._alloc = alloc
        self._src: BlockIds | None
        self._lists: tuple[list[int], ...] | None
        if type(ids) is BlockIds:
            self._src, self._lists = ids, None
        else:
            self._src, self._lists = None, ids  # type: ignore[assignment]
        self._blocks: tuple[list[NativeBlock], ...] | None = None

    @property
    def _ids(self) -> tuple[list[int], ...]:
        if self._lists is None:
            assert self._src is not None
            self._lists = self._src.lists()
        return self._lists

    @property  # type: ignore[override]
    def blocks(self) -> tuple[Sequence[Any], ...]:
        if self._blocks is None:
            a = self._alloc
            self._blocks = tuple([NativeBlock(a, b) for b in g] for g in self._ids)
        return self._blocks

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None) -> Any:
        src = self._src
        if src is not None and group_ids is None:
            # Fresh lists straight from the buffer (one crossing), as vLLM's are fresh.
            return None if allow_none and src.is_empty() else src.lists()
        groups = self._ids if group_ids is None else tuple(self._ids[g] for g in group_ids)
        if allow_none and not any(groups):
            return None
        # Fresh lists, as vLLM's; ``map`` builds them in C (half the cost of a generator).
        return tuple(map(list, groups))

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        other_ids = other.get_block_ids()
        return NativeKVCacheBlocks(self._alloc, tuple(a + b for a, b in zip(self._ids, other_ids)))

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self._ids) == 1, "Only one group is supported"
        a = self._alloc
        return [b for b in self._ids[0] if a.block_hash(b) is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        a = self._alloc
        return [[b for b in g if b != 0 and a.block_hash(b) is None] for g in self._ids]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in range(len(self._ids))))

    def __repr__(self) -> str:
        return f"NativeKVCacheBlocks({self._ids})"


class _HitBlocks(NativeKVCacheBlocks):
    """The result of ``get_computed_blocks``: carries the generation of the hit stored in
    Rust, so ``allocate_slots`` can reuse that hit instead of sending the ids back when it is
    handed the latest lookup of the same request."""

    __slots__ = ("_gen",)

    def __init__(self, alloc: Allocator, ids: tuple[list[int], ...] | BlockIds, gen: int) -> None:
        super().__init__(alloc, ids)
        self._gen = gen


class _NativeBlockPool:
    """The ``block_pool`` attributes and methods the scheduler reaches through."""

    def __init__(self, mgr: HybridKVCacheManager, hash_block_size: int, num_blocks: int) -> None:
        self._mgr = mgr
        self._alloc = mgr._alloc
        self.hash_block_size = hash_block_size
        self.num_gpu_blocks = num_blocks
        self.enable_caching = mgr.enable_caching
        self.num_hash_lookahead_tokens = mgr.num_hash_lookahead_tokens
        self.null_block = NativeBlock(self._alloc, 0)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        self._alloc.free_block_ids([b.block_id for b in ordered_blocks])

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[NativeBlock] | None:
        """vLLM's ``BlockPool.get_cached_block`` (the routed-experts auxiliary-output
        connector asks it): the first cached block for ``block_hash`` in each group, or
        ``None`` on a miss in any group."""
        ids = self._alloc.get_cached_block(block_hash, list(kv_cache_group_ids))
        return None if ids is None else [NativeBlock(self._alloc, b) for b in ids]

    def get_num_free_blocks(self) -> int:
        return self._alloc.num_free_blocks

    def get_usage(self) -> float:
        return self._alloc.usage

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._mgr.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self._mgr.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self._mgr.take_events()


class _NativeSingleTypeManager:
    """What callers read from ``coordinator.single_type_managers[g]``."""

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: _NativeBlockPool) -> None:
        self.kv_cache_group_id = group_id
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.block_pool = pool
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        self.use_eagle = False
        self.retains_longer_hit = False


class _NativeCoordinator:
    """The ``coordinator`` attributes and methods the scheduler reaches through."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0

    def __init__(self, mgr: HybridKVCacheManager, kv_cache_config: KVCacheConfig) -> None:
        self._mgr = mgr
        self.kv_cache_config = kv_cache_config
        self.block_pool = mgr.block_pool
        self.single_type_managers = tuple(
            _NativeSingleTypeManager(i, g.kv_cache_spec, mgr.block_pool)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )
        # Groups holding EAGLE/MTP draft layers; none drops its last block (a drop falls
        # back), so ``drop_eagle_group_ids`` (vLLM 0.33) is empty.
        self.eagle_group_ids: set[int] = {i for i, g in enumerate(kv_cache_config.kv_cache_groups) if g.is_eagle_group}
        self.drop_eagle_group_ids: set[int] = set()
        self.full_attention_group_id = next(
            (i for i, g in enumerate(kv_cache_config.kv_cache_groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)),
            None,
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        assert not any(new_computed_blocks), "the scheduler only asks this without a new hit"
        st = self._mgr._reqs.get(request_id)
        alloc = self._mgr._alloc
        if st is None:
            # An unknown request holds nothing: the count for an empty table.
            h = alloc.add_request()
            try:
                return alloc.get_num_blocks_to_allocate(
                    h,
                    num_tokens,
                    num_encoder_tokens=num_encoder_tokens,
                    total_computed_tokens=total_computed_tokens,
                    apply_admission_cap=apply_admission_cap,
                    num_tokens_main_model=num_tokens_main_model,
                    prefill_end=prefill_end,
                )
            finally:
                alloc.free(h)
        return alloc.get_num_blocks_to_allocate(
            st[0],
            num_tokens,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=total_computed_tokens,
            apply_admission_cap=apply_admission_cap,
            num_tokens_main_model=num_tokens_main_model,
            prefill_end=prefill_end,
        )

    def get_blocks(self, request_id: str) -> tuple[list[Any], ...]:
        return self._mgr.get_blocks(request_id).blocks  # type: ignore[return-value]


class HybridKVCacheManager:
    """vLLM's ``KVCacheManager`` (0.32.0 or 0.33.0, whichever is installed), served by the
    native core.

    Constructed with ``KVCacheManager``'s arguments. When the core cannot serve the
    configuration exactly, or the adapter meets anything it does not know while building
    the native manager, the constructor returns vLLM's own ``KVCacheManager`` built with the
    same arguments and logs one line that names the reason.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = _bind_arguments(args, kwargs)
            native = _native_plan(**bound)
            self = super().__new__(cls)
            self._setup(native, **bound)
            return self
        except (Unsupported, UnsupportedConfigError) as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - no exception of ours may reach the engine
            reason = f"{type(e).__name__} while building the native manager: {e}"
        logger.warning("hybrid_alloc: falling back to vLLM's KVCacheManager: %s", reason)
        return VllmKVCacheManager(*args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything is built in ``__new__`` (``_setup``), where a failure can still fall
        back to vLLM's manager."""

    def _setup(
        self,
        native: dict[str, Any],
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        self._native_args = native
        # Lookahead block hashes (vLLM 0.33): tokens after each block that its hash and its
        # BlockStored event's extra keys cover (0: none).
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self._alloc = Allocator(**native)
        # Hit-aware user controls (see ``_policy_controls``); validated with the config.
        self._retain_priority: int | None = None
        self._pending_pins: list[list[int]] = []
        if native.get("policy", "exact") != "exact":
            self._retain_priority, self._pending_pins, share = _policy_controls()
            if share is not None:
                self._alloc.set_pinned_share(share)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = native["watermark_blocks"]
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        self.empty_kv_cache_blocks = EmptyKVCacheBlocks(self.num_kv_cache_groups)
        # request_id -> [handle, generation of the cache hit stored in Rust for it (-1:
        # none)]. The request also carries its handle (unique in the process: the core tags it
        # with a generation) as ``_hybrid_alloc_handle`` for FastAllocate (-1 once freed). The core reads ``request.block_hashes`` itself and
        # takes only the hashes it has not seen (from the first difference when vLLM rewrote the list).
        self._reqs: dict[str, list[int]] = {}
        self._hit_gen = 0
        self._events: list[KVCacheEvent] = []
        self.block_pool = _NativeBlockPool(self, hash_block_size, kv_cache_config.num_blocks)
        self.coordinator = _NativeCoordinator(self, kv_cache_config)
        # The scheduler's hot call goes straight to Rust (see ``allocate_slots``).
        alloc = self._alloc
        self.allocate_slots = FastAllocate(  # type: ignore[method-assign]
            alloc,
            self.empty_kv_cache_blocks,
            HybridKVCacheManager.allocate_slots.__get__(self),
            lambda ids: NativeKVCacheBlocks(alloc, ids),
            self._drain_events if enable_kv_cache_events else None,
        )
        logger.info(
            "hybrid_alloc: native KV cache manager serving %d group(s): %s; %d blocks, prefix caching %s%s, policy %s",
            self.num_kv_cache_groups,
            ", ".join(
                f"{k}"
                + (
                    f"(window={p1})"
                    if k == "sliding_window"
                    else f"(chunk={p1})"
                    if k == "chunked_local"
                    else f"(speculative_blocks={p1})"
                    if k.startswith("mamba") and p1
                    else ""
                )
                + f"/bs={bs}"
                for k, bs, _, p1, _, _ in native["groups"]
            ),
            kv_cache_config.num_blocks,
            "on" if enable_caching else "off",
            f", lookahead block hashes of {num_hash_lookahead_tokens} token(s)" if num_hash_lookahead_tokens else "",
            native.get("policy", "exact"),
        )

    # ---- helpers ----------------------------------------------------------------------

    def _state(self, request: Request) -> list[int]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = [self._alloc.add_request(), -1]
            self._reqs[request.request_id] = st
            request._hybrid_alloc_handle = st[0]
        return st

    def _drain_events(self, request: Request | None) -> None:
        for ev in self._alloc.take_events():
            tag = ev[0]
            if tag == "removed":
                self._events.append(
                    BlockRemoved(block_hashes=[maybe_convert_block_hash(ev[1])], medium=MEDIUM_GPU, group_idx=ev[2])
                )
            elif tag == "cleared":
                self._events.append(AllBlocksCleared())
            else:
                _, _h, group, block_size, start, end, parent, hashes, idxs = ev
                assert request is not None
                self._events.append(
                    self._block_stored(
                        request,
                        [maybe_convert_block_hash(h) for h in hashes],
                        None if parent is None else maybe_convert_block_hash(parent),
                        start,
                        end,
                        block_size,
                        group,
                        idxs,
                    )
                )

    def _block_stored(
        self,
        request: Request,
        hashes: list[Any],
        parent: Any,
        start: int,
        end: int,
        block_size: int,
        group: int,
        block_indices: Iterable[int],
    ) -> BlockStored:
        """vLLM's ``BlockPool._build_block_stored_event`` for the blocks at ``block_indices``
        of ``request``: extra keys per block (over the block and, with lookahead hashes, the
        ``num_hash_lookahead_tokens`` after it, as ``_generate_event_extra_keys``) and, with
        lookahead hashes, those tokens per block (``lookahead_token_ids``)."""
        la = self.num_hash_lookahead_tokens
        extra: list[Any] = []
        lookahead: list[list[int]] | None = [] if la else None
        tokens = request.all_token_ids
        mm_idx = 0
        for i in block_indices:
            b_start = i * block_size
            b_end = b_start + block_size
            if la:
                assert _generate_lookahead_extra_keys is not None
                k, mm_idx = _generate_lookahead_extra_keys(request, b_start, b_end, b_end + la, mm_idx)
                assert lookahead is not None
                lookahead.append(tokens[b_end : b_end + la])
            else:
                k, mm_idx = generate_block_hash_extra_keys(request, b_start, b_end, mm_idx)
            extra.append(k)
        lora = request.lora_request
        kw: dict[str, Any] = {"lookahead_token_ids": lookahead} if la else {}
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens[start:end],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            group_idx=group,
            session_id=request.session_id,
            **kw,
        )

    # ---- KVCacheManager API -------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self._alloc.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's ``get_computed_blocks``; ``max_cache_hit_length`` (vLLM 0.33) bounds the
        hit, ``None`` meaning ``request.num_tokens - 1`` (the only bound on 0.32)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        st = self._state(request)
        if self._pending_pins:
            self._pin_from(request)
        hit, uncached, groups = self._alloc.get_computed_blocks(
            st[0], max_cache_hit_length, block_hashes=request.block_hashes, as_buffer=True
        )
        if hit > 0 and self.enable_kv_cache_events and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._emit_cached_block_events(request, groups.counts())
        boundary = hit + uncached if uncached else 0
        if groups.is_empty():
            st[1] = -1
            return self.empty_kv_cache_blocks, hit, boundary
        self._hit_gen += 1
        st[1] = self._hit_gen
        return _HitBlocks(self._alloc, groups, self._hit_gen), hit, boundary

    def pin_prefix(self, token_ids: Sequence[int]) -> None:
        """Pins a prefix (hit-aware only), the first time a request starting with it is
        looked up. Raises ``UnsupportedConfigError`` under the exact policy."""
        if self._alloc.policy == "exact":
            raise UnsupportedConfigError("pinning a prefix needs HYBRID_ALLOC_POLICY=hit-aware")
        self._pending_pins.append([int(t) for t in token_ids])

    def _pin_from(self, request: Request) -> None:
        hbs = self.block_pool.hash_block_size
        prompt = request.prompt_token_ids or []
        for p in list(self._pending_pins):
            n = len(p) // hbs
            if len(prompt) >= len(p) and list(prompt[: len(p)]) == p and len(request.block_hashes) >= n:
                self._pending_pins.remove(p)
                try:
                    self._alloc.pin_prefix(list(request.block_hashes[:n]))
                except HybridAllocError as e:
                    logger.warning("hybrid_alloc: prefix of %d tokens not pinned: %s", len(p), e)

    def _emit_cached_block_events(self, request: Request, counts: list[int]) -> None:
        hashes = request.block_hashes
        for g, n in enumerate(counts):
            if n == 0:
                continue
            bs = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
            scale = bs // self.block_pool.hash_block_size
            self._events.append(
                self._block_stored(
                    request,
                    [maybe_convert_block_hash(hashes[(i + 1) * scale - 1]) for i in range(n)],
                    None,
                    0,
                    n * bs,
                    bs,
                    g,
                    range(n),
                )
            )

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        # vLLM's per-group path applies only with Mamba layers, which fall back.
        return *self.get_computed_blocks(request, max_cache_hit_length), False

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots``.

        The instance attribute ``allocate_slots`` is a ``FastAllocate`` made in
        ``__init__``: it serves, in Rust, a plain step of a running request (no new hit, no
        other keyword) and calls this method for everything else."""
        st = self._state(request)
        hit: Hit | tuple[list[int], ...] = Hit.NONE
        if new_computed_blocks is not None and new_computed_blocks is not self.empty_kv_cache_blocks:
            if type(new_computed_blocks) is _HitBlocks and new_computed_blocks._gen == st[1]:
                hit = Hit.STORED
            else:
                groups = new_computed_blocks.get_block_ids()
                if any(groups):
                    hit = groups
        watermark = self.watermark_blocks > 0 and has_scheduled_reqs and request.status in _WAITING_OR_PREEMPTED
        res = self._alloc.allocate_slots(
            st[0],
            num_new_tokens,
            block_hashes=request.block_hashes,
            hit=hit,
            num_new_computed_tokens=num_new_computed_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            apply_watermark=watermark,
            num_computed_tokens=request.num_computed_tokens,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_tokens=request.num_tokens,
            shared_prefix_boundary=request.shared_prefix_boundary,
            skip_zeroing_group_ids=list(skip_zeroing_group_ids),
            as_buffer=True,
        )
        if self.enable_kv_cache_events and self._alloc.has_events:
            self._drain_events(request)
        if res is None:
            return None
        if res.is_empty():
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, res)

    def free(self, request: Request) -> None:
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            request._hybrid_alloc_handle = -1
            rp = self._retain_priority
            self._alloc.free(st[0], retain=rp is not None and request.priority <= rp)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            self._alloc.remove_skipped_blocks(st[0], processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return []
        request._hybrid_alloc_handle = -1
        groups = self._alloc.block_ids(st[0]) if TRIM_NULL_HEAD else None
        ids = self._alloc.pop_blocks_for_free(st[0])
        if groups is not None:
            # vLLM 0.33 drops each group's leading null blocks (``trim_null_head``); a
            # Mamba "align" table also has null gaps after its first state block, kept.
            ids = []
            for g in groups:
                n = 0
                while n < len(g) and g[n] == 0:
                    n += 1
                ids.extend(g[n:])
        return [NativeBlock(self._alloc, b) for b in ids]

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._alloc.evict_blocks(list(block_ids))
        if self.enable_kv_cache_events and self._alloc.has_events:
            self._drain_events(None)

    def reset_prefix_cache(self) -> bool:
        ok = self._alloc.reset_prefix_cache()
        if self.enable_kv_cache_events and self._alloc.has_events:
            self._drain_events(None)
        if not ok:
            logger.warning("Failed to reset prefix cache because some blocks are not freed yet")
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events = self._events
        self._events = []
        meta = self.kv_cache_event_metadata
        for ev in events:
            if isinstance(ev, BlockStored) and ev.group_idx is not None and 0 <= ev.group_idx < len(meta):
                ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[ev.group_idx]
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        st = self._reqs.get(request_id)
        if st is None:
            return self.empty_kv_cache_blocks
        ids = self._alloc.block_ids(st[0], as_buffer=True)
        if ids.is_empty():
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, ids)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        st = self._reqs.get(request_id)
        if st is None:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self._alloc.block_ids(st[0])

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        ids = self.get_block_ids(request_id)
        out: list[list[int]] = []
        for g, group_ids in zip(self.kv_cache_config.kv_cache_groups, ids):
            spec = g.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
                out.append(group_ids)
            else:
                out.append(group_ids[: -(-num_computed_tokens // spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request: Request) -> int:
        st = self._reqs.get(request.request_id)
        if st is None:
            return 0
        return self._alloc.estimate_cached_tokens(st[0])

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        st = self._state(request)
        self._alloc.cache_blocks(
            st[0],
            num_computed_tokens,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            shared_prefix_boundary=request.shared_prefix_boundary,
        )
        if self.enable_kv_cache_events and self._alloc.has_events:
            self._drain_events(request)

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> KVCacheBlocks:
        if not any(blocks):
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, tuple([b.block_id for b in g] for g in blocks))

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        ids = blocks.get_block_ids()
        out: list[list[int]] = []
        for group_ids, g in zip(ids, self.kv_cache_config.kv_cache_groups):
            if not g.kv_cache_spec.prefix_cacheable:
                assert not group_ids
                out.append([])
                continue
            bs = g.kv_cache_spec.block_size
            assert num_computed_tokens % bs == 0
            n = num_computed_tokens // bs
            if isinstance(g.kv_cache_spec, MambaSpec):
                n = min(n, len(group_ids))
            assert n <= len(group_ids)
            out.append(group_ids[:n])
        if not any(out):
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, tuple(out))

    def take_new_block_ids(self) -> list[int]:
        return self._alloc.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            self._alloc.record_blocks_for_zeroing(st[0], start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        self._alloc.new_step_starts()

    def check_invariants(self) -> None:
        """Checks the native core's invariants (tests)."""
        self._alloc.check_invariants()
