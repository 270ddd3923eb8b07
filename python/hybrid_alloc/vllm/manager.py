"""A drop-in ``KVCacheManager`` for the supported vLLM releases, backed by the native core.

:class:`HybridKVCacheManager` takes the constructor arguments of vLLM's
``vllm.v1.core.kv_cache_manager.KVCacheManager`` and serves every method and attribute
vLLM's ``Scheduler``, ``AsyncScheduler``, engine core and stats use, with vLLM's return
types. Each call crosses into Rust once; ints, bytes and flat lists cross the boundary.

The rooms around it: :mod:`.compat` (what the installed vLLM offers, probed once),
:mod:`.args` (the constructor's arguments), :mod:`.plan` (what the core is built with, and
what it does not serve), :mod:`.spec_table` (vLLM specs to named group
specs), :mod:`.policy_env` (the retention policy's environment controls), :mod:`.blocks`
(the ``KVCacheBlocks`` handed out), :mod:`.facades` (``block_pool``, ``coordinator``),
:mod:`.kv_events` (vLLM's KV cache events), :mod:`.metrics` (residency metrics),
:mod:`.boundary` (Mamba boundary-state offloads for a KV connector) and :mod:`.state` (the
per-request state, and the view of the adapter that :mod:`.facades` and
:mod:`.connector_hits` work through, so that they need not import this module).

For a configuration the core does not serve exactly, and for anything the adapter does not
know at construction (an argument it has never seen, a missing attribute, an exception while
building the native manager), ``HybridKVCacheManager(...)`` returns vLLM's own
``KVCacheManager``, built once with the same arguments, and logs one line saying why. The
constructor never raises what vLLM's own would not; what vLLM's own raises reaches the caller
unchanged (:func:`raised_by_vllm` tells it apart).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    MambaSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from hybrid_alloc._core import Allocator, BlockIds, FastAllocate, Hit, HybridAllocError, UnsupportedConfigError
from hybrid_alloc.vllm import compat, pages, policy_env
from hybrid_alloc.vllm.args import KNOWN_ARGS, ManagerArgs
from hybrid_alloc.vllm.blocks import EmptyKVCacheBlocks, HitBlocks, NativeBlock, NativeKVCacheBlocks, register_views
from hybrid_alloc.vllm.boundary import BoundaryOffloads
from hybrid_alloc.vllm.compat import (
    EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE,
    LOOKAHEAD_HASHES,
    TRIM_NULL_HEAD,
    VllmKVCacheManager,
)
from hybrid_alloc.vllm.connector import fold_negative_external
from hybrid_alloc.vllm.connector_hits import local_hit_for_connector
from hybrid_alloc.vllm.facades import NativeBlockPool, NativeCoordinator
from hybrid_alloc.vllm.hints import (
    NOT_SERVED_OVER_PAGES,
    PIN_OVER_CAP,
    HintCounters,
    HintFields,
    read_hints,
    stats_line,
)
from hybrid_alloc.vllm.kv_events import EventLog
from hybrid_alloc.vllm.metrics import after_call_hook
from hybrid_alloc.vllm.plan import native_plan
from hybrid_alloc.vllm.policy_env import PIN_PREFIXES_ENV, PIN_SHARE_ENV, POLICY_ENV, RETAIN_PRIORITY_ENV
from hybrid_alloc.vllm.spec_table import describe
from hybrid_alloc.vllm.state import LiveBlocks, RequestState, freeze_live_blocks
from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = [
    "EAGLE_GROUPS_DROP_ONLY_WITH_USE_EAGLE",
    "KNOWN_ARGS",
    "LOOKAHEAD_HASHES",
    "PIN_PREFIXES_ENV",
    "PIN_SHARE_ENV",
    "POLICY_ENV",
    "RETAIN_PRIORITY_ENV",
    "TRIM_NULL_HEAD",
    "EmptyKVCacheBlocks",
    "HybridKVCacheManager",
    "NativeBlock",
    "NativeKVCacheBlocks",
    "RequestState",
    "Unsupported",
    "VllmKVCacheManager",
    "current_vllm_config",
    "native_config_or_reason",
    "raised_by_vllm",
]

logger = init_logger("vllm.hybrid_alloc")

_WAITING_OR_PREEMPTED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

# A retain hint's priority as the core's ``set_hints`` takes it.
_RETAIN_LEVEL = {"low": 1, "normal": 2, "high": 3}

# The parsed hints of a request (``_HintPlan``), kept on it (``Request`` has no slots): a request
# vLLM preempts is looked up again with a new handle, and takes its hints again without a second
# pin lease.
_HINTS_ATTR = "_hybrid_alloc_hints"


def _log_stats_interval_s() -> float:
    """vLLM's stats logging interval (``VLLM_LOG_STATS_INTERVAL``, 10 s by default): the
    plugin's KV hints line follows it."""
    try:
        from vllm import envs

        return float(envs.VLLM_LOG_STATS_INTERVAL)
    except Exception:  # noqa: BLE001 - a release without it, or a bad value: vLLM's default
        return 10.0


def _ttl_ms(ttl_s: float | None) -> int:
    """A checked TTL (``Hints``' invariant: finite, in ``(0, MAX_TTL_S]``) in whole
    milliseconds, rounded up so that no TTL becomes 0."""
    return 0 if ttl_s is None else max(1, math.ceil(ttl_s * 1000))


# What a request's hints ask of the core, as ``set_hints`` takes them by position after the
# handle and the block hashes: ``(session, retain, retain_ttl_ms, retain_tokens, pin_ttl_ms,
# pin_tokens, release_session, checkpoints)``, the sessions already the core's ints
# (``_session_int``); ``()`` when they ask nothing of it (refused, or a session alone).
_Plan = tuple[int, int, int, int, int, int, int, tuple[int, ...]]
_HintPlan = tuple[()] | _Plan


def _session_int(name: str | None) -> int:
    """The core's int for a session name (0: none): the name's hash, 63 bits, never 0. No
    table of names is kept, so nothing grows with the sessions a long-running server sees
    (an interned table dropped a name only at its release). The manager lives in one
    process, whose string hashes are stable; two names would share an id, and so each
    other's release, with a chance of about 1 in 10^18 a pair."""
    if name is None:
        return 0
    return (hash(name) & 0x7FFF_FFFF_FFFF_FFFF) or 1


def _hint_plan(fields: HintFields) -> _HintPlan:
    """``set_hints``' arguments from :func:`read_hints`' fields (``Hints``' order): computed
    once per request, at its first sighting."""
    retain, retain_ttl_s, retain_tokens, pin_ttl_s, pin_tokens, session, release, checkpoints, _ = fields
    if retain is None and pin_ttl_s is None and release is None and not checkpoints:
        return ()
    return (
        _session_int(session),
        0 if retain is None else _RETAIN_LEVEL[retain],
        _ttl_ms(retain_ttl_s),
        retain_tokens or 0,
        _ttl_ms(pin_ttl_s),
        pin_tokens or 0,
        _session_int(release),
        checkpoints,
    )


# The ``VllmConfig`` a construction reads when it is not passed one (``vllm_config=``): what
# its constructor arguments do not say (a KV connector, ...). The plugin passes the config
# of the scheduler being built; direct callers (tests, the bench) may set this instead.
current_vllm_config: Any = None

# Set on an exception vLLM's own ``KVCacheManager`` raised in the fallback (see
# :func:`raised_by_vllm`).
_RAISED_BY_VLLM = "_hybrid_alloc_raised_by_vllm"


def raised_by_vllm(error: BaseException) -> bool:
    """Whether ``error`` was raised by vLLM's own ``KVCacheManager`` after the adapter fell
    back to it: it is vLLM's answer, to reach the engine unchanged (not an adapter failure
    to fall back from). Also set on the adapter's refusal of a two-level configuration
    (:mod:`.engine_pages` planned it for our manager: vLLM's manager cannot serve it either)."""
    return getattr(error, _RAISED_BY_VLLM, False) is True


def _build_vllm_manager(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """vLLM's own manager, built once with the caller's arguments; what it raises is marked
    (:func:`raised_by_vllm`) and re-raised unchanged."""
    try:
        return VllmKVCacheManager(*args, **kwargs)
    except BaseException as e:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(e, _RAISED_BY_VLLM, True)
        raise


def _config(vllm_config: Any) -> Any:
    return current_vllm_config if vllm_config is None else vllm_config


def _allocator(native: dict[str, Any]) -> Allocator:
    """The core built from ``native`` (its ``groups`` are :mod:`hybrid_alloc.specs` objects,
    which the binding reads by attribute)."""
    return Allocator(**native)


def native_config_or_reason(*args: Any, vllm_config: Any = None, **kwargs: Any) -> tuple[dict[str, Any] | None, str]:
    """The native allocator's arguments for a ``KVCacheManager`` construction (vLLM's
    arguments, as the installed release takes them; ``vllm_config`` as for
    :class:`HybridKVCacheManager`), or ``None`` and the reason the core cannot serve it
    exactly. Never raises."""
    try:
        native = native_plan(ManagerArgs.bind(VllmKVCacheManager, args, kwargs), _config(vllm_config))
        _allocator(native)  # validates; UnsupportedConfigError names what is not served
        return native, ""
    except (Unsupported, UnsupportedConfigError) as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - whatever it is, vLLM's own manager serves
        return None, f"{type(e).__name__} while reading the configuration: {e}"


def _planned_two_level(kvc: Any) -> bool:
    """Whether ``kvc`` is a two-level configuration (``pages.slots_per_page``). A spec whose
    page size cannot be read (a test's mock state shapes) is no configuration the plugin
    planned: the reason the native manager was refused then stands, not a ``TypeError``."""
    try:
        return kvc is not None and pages.slots_per_page(kvc) is not None
    except Exception:  # noqa: BLE001 - the fallback's own reason is the one to log
        return False


class HybridKVCacheManager:
    """vLLM's ``KVCacheManager`` (of whichever supported release is installed), served by the
    native core.

    Constructed with ``KVCacheManager``'s arguments, and optionally ``vllm_config`` (the
    ``VllmConfig`` being scheduled; default: the module's ``current_vllm_config``). When the
    core cannot serve the configuration exactly, or the adapter meets anything it does not
    know while building the native manager, the constructor returns vLLM's own
    ``KVCacheManager`` built with the same arguments and logs one line that names the reason.
    """

    def __new__(cls, *args: Any, vllm_config: Any = None, **kwargs: Any) -> Any:
        try:
            bound = ManagerArgs.bind(VllmKVCacheManager, args, kwargs)
            native = native_plan(bound, _config(vllm_config))
            self = super().__new__(cls)
            self._setup(native, bound)
            return self
        except (Unsupported, UnsupportedConfigError) as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - no exception of ours may reach the engine
            reason = f"{type(e).__name__} while building the native manager: {e}"
        if _planned_two_level(kwargs.get("kv_cache_config", args[0] if args else None)):
            # Planned for two-level pages (``engine_pages`` decided our manager serves it):
            # vLLM's manager would hand one id space to pages and slots, and corrupt the cache.
            err = RuntimeError(
                f"hybrid_alloc: a two-level KV cache configuration that the native manager refused: {reason}"
            )
            setattr(err, _RAISED_BY_VLLM, True)  # no fallback serves it: to the engine unchanged
            raise err
        logger.warning("hybrid_alloc: falling back to vLLM's KVCacheManager: %s", reason)
        return _build_vllm_manager(args, kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything is built in ``__new__`` (``_setup``), where a failure can still fall
        back to vLLM's manager."""

    def _setup(self, native: dict[str, Any], a: ManagerArgs) -> None:
        kvc = a.kv_cache_config
        # Lookahead block hashes (vLLM 0.33): tokens after each block that its hash and its
        # BlockStored event's extra keys cover (0: none).
        self.num_hash_lookahead_tokens = a.num_hash_lookahead_tokens
        self._alloc = _allocator(native)
        # Hit-aware user controls (see ``policy_env``); validated with the config.
        policy = native.get("policy", "exact")
        controls = policy_env.controls_for(policy, logger)
        self._retain_priority, self._pending_pins = controls.retain_priority, controls.pins
        if controls.pin_share is not None:
            self._alloc.set_pinned_share(controls.pin_share)
        self.kv_cache_config = kvc
        self.max_model_len = a.max_model_len
        self.enable_caching = a.enable_caching
        self.enable_kv_cache_events = a.enable_kv_cache_events
        self.use_eagle = a.use_eagle
        self.log_stats = a.log_stats
        self.metrics_collector = a.metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if a.log_stats else None
        self.num_kv_cache_groups = len(kvc.kv_cache_groups)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks: int = native["watermark_blocks"]
        # Two-level pages' admission headroom (the core adds it where the watermark applies).
        self._headroom = native.get("admission_headroom_slots", 0) > 0
        self._event_log = EventLog(kvc, a.hash_block_size, a.num_hash_lookahead_tokens)
        self.kv_cache_event_metadata = self._event_log.metadata
        self.empty_kv_cache_blocks = EmptyKVCacheBlocks(self.num_kv_cache_groups)
        # request_id -> its state. The core reads ``request.block_hashes`` itself and takes
        # only the hashes it has not seen (from the first difference when vLLM rewrote the list).
        self._reqs: dict[str, RequestState] = {}
        self._hit_gen = 0
        # With a KV connector and Mamba "align" groups: the boundary states to hand off.
        self._boundary = BoundaryOffloads(self._alloc) if native.get("boundary_offloads") else None
        # Each block's one view, made when first handed out (see ``blocks.BlockViews``).
        self._views = register_views(
            self, self._alloc, [i for i, g in enumerate(native["groups"]) if g.kind in ("mamba", "mamba_align")]
        )
        # The ``req_to_blocks`` lists handed out, by request and group, until the request's
        # blocks are freed (see ``facades.LiveBlocks``); empty unless someone reads them.
        self._live_blocks: dict[str, dict[int, LiveBlocks]] = {}
        self.block_pool = NativeBlockPool(self, self._views, a.hash_block_size, kvc.num_blocks)
        self.coordinator = NativeCoordinator(
            self,
            self.block_pool,
            kvc,
            [g.block_size for g in native["groups"]],
            a.dcp_world_size,
            scheduler_block_size=a.scheduler_block_size,
            max_in_flight_tokens=native["max_in_flight_tokens"],
            max_model_len=a.max_model_len,
        )
        self.coordinator.set_eagle(a.use_eagle, native.get("eagle_drop_groups", ()), native["groups"])
        # Multi-module MTP: the trailing tokens of a chunk the core does not cache (vLLM's).
        self.coordinator.num_reprefillable_tokens = native.get("reprefillable_tokens", 0)
        # ``--prefix-match-unit`` on a Mamba hybrid: hits may end inside a block, which is
        # then copied on write (``take_kv_cache_block_copies``).
        self._partial_hash_hits = bool(self._alloc.partial_hash_hits)
        self.coordinator.enable_partial_hash_hits = self._partial_hash_hits
        # vLLM's shared-prefix checkpoint (``enable_mamba_shared_prefix_checkpoint`` with
        # EAGLE/MTP groups, partial hash hits, no re-prefill): the scheduler ends a prefill
        # chunk at the junction, where the core keys the Mamba state, as vLLM's manager says.
        # Hit-aware with partial hash hits turns it on too, without EAGLE: there the core keys
        # the state and the full-attention block at the junction, so the next request sharing
        # the prefix hits all of it (see the README's state-space hits).
        self.mamba_shared_prefix_checkpoint = bool(self._alloc.shared_prefix_checkpoint) or (
            self._partial_hash_hits and self._alloc.policy == "hit-aware"
        )
        if self._alloc.shared_prefix_checkpoint:
            self.cache_blocks = self._cache_blocks_reading_computed  # type: ignore[method-assign]
        # KV hints (issue 38, ``hints``): read at a request's first lookup; under hit-aware
        # (with prefix caching: no lookup without it) the core executes them, under exact
        # they are counted as ignored. The clock is read at most once per step, in
        # ``new_step_starts``, once a hint was taken (the bench replaces ``_clock``).
        self._clock: Callable[[], float] = time.monotonic
        self._hint_counters = HintCounters(logger)
        self._hints_executed = self._alloc.policy == "hit-aware"
        # Two-level pages serve hit-aware's own levels, not a hint's pin or retain (the core
        # refuses them): they are dropped and counted, the request's other hints stand.
        self._pins_over_pages = self._alloc.slots_per_page > 1
        self._clock_on = False
        # The periodic hints line (``stats_line``), with vLLM's stats (``log_stats``), at
        # vLLM's stats interval, from the step clock's reading: on once a request carried
        # hints (``_hints_seen``), at most one per interval, only when a figure changed.
        self._hints_seen = False
        self._hint_log_interval_s = _log_stats_interval_s()
        self._hint_log_at = -math.inf
        self._hint_logged = ""
        # The scheduler's hot call goes straight to Rust (see ``allocate_slots``): an instance
        # attribute over the method on purpose, and the stub types the Rust callable loosely.
        alloc = self._alloc
        # After each call that may queue events or residency metrics; None when neither is on.
        self._after_call = after_call_hook(alloc, self._drain_events, a.enable_kv_cache_events, a.metrics_collector)
        self._fast = FastAllocate(
            alloc,
            self.empty_kv_cache_blocks,
            HybridKVCacheManager.allocate_slots.__get__(self),
            NativeKVCacheBlocks,  # a class: built from Rust, no frame (see FastAllocate)
            self._after_call,
        )
        self.allocate_slots = self._fast  # type: ignore[method-assign,assignment]
        logger.info(
            "hybrid_alloc: native KV cache manager serving %d group(s): %s; %d blocks, prefix caching %s%s, policy %s",
            self.num_kv_cache_groups,
            ", ".join(describe(g) for g in native["groups"]),
            kvc.num_blocks,
            "on" if a.enable_caching else "off",
            f", lookahead block hashes of {a.num_hash_lookahead_tokens} token(s)"
            if a.num_hash_lookahead_tokens
            else "",
            policy,
        )

    # ---- helpers ----------------------------------------------------------------------

    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        return self._new_state(request) if st is None else st

    def _new_state(self, request: Request) -> RequestState:
        """The state of a request the manager has none of yet: a core handle, tagged on the
        request and known to ``FastAllocate`` and the boundary offloads."""
        st = RequestState(self._alloc.add_request())
        self._reqs[request.request_id] = st
        if self._boundary is not None:
            self._boundary.req_ids[st.handle] = request.request_id
        request._hybrid_alloc_handle = st.handle
        self._fast.track(request, st.handle)  # found by address: no attribute read
        return st

    def _lookup_state(self, request: Request) -> RequestState:
        """``_state`` for a lookup: a request's first lookup also takes its KV hints."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._new_state(request)
            self._apply_hints(request, st)
        return st

    def _apply_hints(self, request: Request, st: RequestState) -> None:
        """A request's KV hints, at its first lookup (its block hashes are known then), in
        one crossing: under hit-aware the core takes its pin lease now, its checkpoints for
        the lookup that follows, and its retain and session release for its free; under
        exact they are counted as ignored. A request vLLM preempted takes them again without
        a second lease. Nothing here raises into vLLM: an error is counted (``malformed``)
        and logged once. Cost without hints: :func:`read_hints`' attribute reads. The hints
        are read once (:func:`read_hints`, no :class:`Hints` built) into what the core's
        ``set_hints`` takes (``_hint_plan``), kept on the request for a later sighting."""
        plan: _HintPlan | None = getattr(request, _HINTS_ATTR, None)
        again = plan is not None
        counters = self._hint_counters
        try:
            if plan is None:
                fields = read_hints(request)
                if fields is None:
                    return
                counters.received += 1
                for kind in fields[8]:
                    counters.refuse(kind, request.request_id)
                plan = _hint_plan(fields)
                setattr(request, _HINTS_ATTR, plan)
                self._hints_seen = True
            if not self._hints_executed:
                if not again:
                    counters.ignored += 1
                    if counters.ignored == 1:
                        logger.warning(
                            "hybrid_alloc: KV hints ignored: the policy is exact (set %s=hit-aware to use them); "
                            "later ones are only counted",
                            POLICY_ENV,
                        )
                return
            if not plan:
                return
            if not self._clock_on:
                # The clock's first reading: TTLs count from it (then once per step).
                self._clock_on = True
                self._alloc.advance_clock(self._now_ms())
            if again or self._pins_over_pages:
                plan = self._adjusted_plan(request, plan, again)
            # By position (the core's order): no keyword for the binding to match.
            pin, _, refused = self._alloc.set_hints(st.handle, request.block_hashes, *plan)
            st.hinted = True
            if not again:
                counters.applied += 1
            if pin == 2:
                counters.refuse(PIN_OVER_CAP, request.request_id)
            for _ in range(refused):
                counters.refuse("bad_position", request.request_id)
        except Exception:  # noqa: BLE001 - no hint may raise into the engine
            counters.refuse("malformed", request.request_id)

    def _adjusted_plan(self, request: Request, plan: _Plan, again: bool) -> _Plan:
        """``plan`` for a request seen ``again`` (vLLM preempted it: no second pin lease) or
        over two-level pages (no pin, no retain; counted at its first sighting)."""
        session, retain, retain_ttl_ms, retain_tokens, pin_ttl_ms, pin_tokens, release, checkpoints = plan
        if self._pins_over_pages:
            if not again and (retain or pin_ttl_ms):
                self._hint_counters.refuse(NOT_SERVED_OVER_PAGES, request.request_id)
            retain, pin_ttl_ms = 0, 0
        if again:
            pin_ttl_ms = 0
        return (session, retain, retain_ttl_ms, retain_tokens, pin_ttl_ms, pin_tokens, release, checkpoints)

    #: The core's int for a session name (:func:`_session_int`).
    _session_id = staticmethod(_session_int)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _hints_at_free(self, request: Request, st: RequestState) -> None:
        """Before freeing a request whose hints the core took: a request vLLM preempted (not
        finished) drops them (its next lookup takes them again); a finished one keeps them
        for the free."""
        try:
            if not request.is_finished():
                self._alloc.clear_hints(st.handle)
        except Exception:  # noqa: BLE001 - no hint may raise into the engine
            self._hint_counters.refuse("malformed", request.request_id)

    def hint_stats(self) -> dict[str, int]:
        """The KV hints' counters: this manager's (``received``, ``applied``, ``refused``
        and ``refused.<kind>``, ``ignored``), ``expired`` (leases and retains that ran out) and
        the core's counters and gauges by their names (``leased_free_blocks``,
        ``retained_blocks``, ...; 0 under exact)."""
        core = self._alloc.hint_stats()
        self._hint_counters.expired = core["leases_expired"] + core["retains_expired"]
        return {**self._hint_counters.as_dict(), **core}

    def _forget(self, request: Request) -> RequestState | None:
        """Drops ``request``'s state (``None`` if it has none), undoing what ``_state`` set:
        the handle tag, ``FastAllocate``'s table entry and the boundary offloads' name; the
        ``req_to_blocks`` lists handed out for it keep the blocks it holds now."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            if self._live_blocks:
                freeze_live_blocks(self._live_blocks, request.request_id, self._alloc.block_ids(st.handle))
            request._hybrid_alloc_handle = -1
            self._fast.track(request, -1)
            if self._boundary is not None:
                del self._boundary.req_ids[st.handle]
        return st

    def _drain_events(self, request: Request | None) -> None:
        events = self._alloc.take_events()
        if events:
            self._event_log.drain(events, request)

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
        # 0.34: ``request.prefix_cache_hit_limit != 0``; before: ``not skip_reading_prefix_cache``.
        return self.enable_caching and compat.prefix_cache_lookup_enabled(request)

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM 0.34's probe (cache-aware admission asks it of waiting requests): the tokens
        of the request's longest cache hit within ``num_tokens - 1`` (not the request's hit
        limit, as vLLM's), 0 when it may not read the prefix cache. Stores, touches, queues
        and counts nothing, and registers no request: one crossing."""
        if not self.enable_caching or not compat.prefix_cache_lookup_enabled(request):
            return 0
        return self._alloc.num_cached_tokens(request.block_hashes, request.num_tokens - 1)

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
        hit, ``None`` meaning ``request.num_tokens - 1`` (the only bound on 0.32); on 0.34 the
        request's own hit limit bounds it too (``request.get_max_cache_hit_length``)."""
        if not self.enable_caching or not compat.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_cache_hit_length = compat.max_cache_hit_length(request, max_cache_hit_length)
        st = self._lookup_state(request)
        if self._pending_pins:
            self._pin_from(request)
        hit, uncached, groups = self._alloc.get_computed_blocks(
            st.handle, max_cache_hit_length, block_hashes=request.block_hashes, as_buffer=True
        )
        return self._reconciled_hit(request, st, hit, uncached, groups)

    def _reconciled_hit(
        self, request: Request, st: RequestState, hit: int, uncached: int, groups: BlockIds
    ) -> tuple[KVCacheBlocks, int, int]:
        """``get_computed_blocks``' result for the hit the core found and stored."""
        if (
            hit > 0
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            self._event_log.cached_blocks(request, groups.counts())
        return self._hit_blocks(st, groups), hit, hit + uncached if uncached else 0

    def _hit_blocks(self, st: RequestState, groups: BlockIds) -> KVCacheBlocks:
        """The ``KVCacheBlocks`` of the hit stored for ``st`` (vLLM's
        ``create_kv_cache_blocks``: the shared empty one when no group has a block)."""
        if groups.is_empty():
            st.hit_gen = -1
            return self.empty_kv_cache_blocks
        self._hit_gen += 1
        st.hit_gen = self._hit_gen
        return HitBlocks(self._alloc, groups, self._hit_gen)

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

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        return local_hit_for_connector(self, request, max_cache_hit_length)

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
        ``__init__``: it serves, in Rust, a plain step of a running request as the scheduler
        calls it (``(request, num_new_tokens, num_lookahead_tokens=n)``) and calls this
        method, with the arguments as given, for everything else."""
        st = self._reqs.get(request.request_id)  # set by the lookup: no call to _state
        if st is None:
            st = self._state(request)
        hit: Hit | tuple[list[int], ...] = Hit.NONE
        if new_computed_blocks is not None and new_computed_blocks is not self.empty_kv_cache_blocks:
            if type(new_computed_blocks) is HitBlocks and new_computed_blocks._gen == st.hit_gen:
                hit = Hit.STORED
            else:
                groups = new_computed_blocks.get_block_ids()
                if any(groups):
                    hit = groups
        watermark = (
            (self.watermark_blocks > 0 or self._headroom)
            and has_scheduled_reqs
            and request.status in _WAITING_OR_PREEMPTED
        )
        n, ext, la = num_new_tokens, num_external_computed_tokens, num_lookahead_tokens
        if ext < 0:
            n, ext, la = fold_negative_external(n, ext, la)
        res = self._alloc.allocate_slots(
            st.handle,
            n,
            block_hashes=request.block_hashes,
            hit=hit,
            num_new_computed_tokens=num_new_computed_tokens,
            num_lookahead_tokens=la,
            num_external_computed_tokens=ext,
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
            request=request,
        )
        if self._after_call is not None:
            self._after_call(request)
        if res is None:
            return None
        if res.is_empty():
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, res)

    def free(self, request: Request) -> None:
        st = self._forget(request)
        if st is not None:
            if st.hinted:
                self._hints_at_free(request, st)
            rp = self._retain_priority
            self._alloc.free(st.handle, retain=rp is not None and request.priority <= rp)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            self._alloc.remove_skipped_blocks(st.handle, processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        st = self._forget(request)
        if st is None:
            return []
        if st.hinted:
            self._hints_at_free(request, st)
        groups = self._alloc.block_ids(st.handle) if compat.TRIM_NULL_HEAD else None
        ids = self._alloc.pop_blocks_for_free(st.handle)
        if groups is not None:
            # vLLM 0.33 drops each group's leading null blocks (``trim_null_head``); a
            # Mamba "align" table also has null gaps after its first state block, kept.
            ids = []
            for i, g in enumerate(groups):
                n = 0
                while n < len(g) and g[n] == 0:
                    n += 1
                # Pool-wide ids, as the core's list (a state page under two-level pages).
                off = self._views.offset(i)
                ids.extend(g[n:] if off == 0 else [b + off if b else 0 for b in g[n:]])
        return self._views.many(ids)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._alloc.evict_blocks(list(block_ids))
        if self._after_call is not None:
            self._after_call(None)

    def reset_prefix_cache(self) -> bool:
        ok = self._alloc.reset_prefix_cache()
        if self._after_call is not None:
            self._after_call(None)
        if not ok:
            logger.warning("Failed to reset prefix cache because some blocks are not freed yet")
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        # Called by 0.32 and 0.33's scheduler only (0.34 removed it from vLLM's manager).
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        return self._event_log.take()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        st = self._reqs.get(request_id)
        if st is None:
            return self.empty_kv_cache_blocks
        ids = self._alloc.block_ids(st.handle, as_buffer=True)
        if ids.is_empty():
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, ids)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        st = self._reqs.get(request_id)
        if st is None:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self._alloc.block_ids(st.handle)

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
        return self._alloc.estimate_cached_tokens(st.handle)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        st = self._state(request)
        self._alloc.cache_blocks(
            st.handle,
            num_computed_tokens,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            shared_prefix_boundary=request.shared_prefix_boundary,
        )
        if self._after_call is not None:
            self._after_call(request)

    def _cache_blocks_reading_computed(self, request: Request, num_computed_tokens: int) -> None:
        """``cache_blocks`` under vLLM's shared-prefix checkpoint, which also reads
        ``request.num_computed_tokens`` (the junction is keyed only by a call past it); the
        instance's ``cache_blocks`` then (one read and one argument fewer elsewhere)."""
        if not self.enable_caching:
            return
        st = self._state(request)
        self._alloc.cache_blocks(
            st.handle,
            num_computed_tokens,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            shared_prefix_boundary=request.shared_prefix_boundary,
            request_computed_tokens=request.num_computed_tokens,
        )
        if self._after_call is not None:
            self._after_call(request)

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> KVCacheBlocks:
        if not any(blocks):
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._alloc, tuple([b.block_id for b in g] for g in blocks))

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        ids = blocks.get_block_ids()
        out: list[list[int]] = []
        for group_ids, g, m in zip(ids, self.kv_cache_config.kv_cache_groups, self.coordinator.single_type_managers):
            if not g.kv_cache_spec.prefix_cacheable:
                assert not group_ids
                out.append([])
                continue
            bs = m.block_size  # DCP-scaled, as vLLM's manager.block_size
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
            self._alloc.record_blocks_for_zeroing(st.handle, start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """vLLM's ``take_kv_cache_block_copies``: the copy-on-write copies of partial hits
        queued since the last call, and their endpoints (source, copy per pair), each holding
        one extra reference the scheduler gives back through ``block_pool.free_blocks``."""
        if not self._partial_hash_hits:
            return [], []
        flat = self._alloc.take_kv_cache_block_copies()
        if not flat:
            return [], []
        # Pool-wide ids (a state page under two-level pages is ``num_slots + page``); the
        # workers copy the group's own ids, the views' ``block_id``.
        views = self._views.many(flat)
        copies = [
            KVCacheBlockCopy(src_block_id=views[i].block_id, dst_block_id=views[i + 1].block_id)
            for i in range(0, len(views), 2)
        ]
        return copies, views

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {} if self._boundary is None else self._boundary.take()

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """vLLM's ``finalize_partial_tail_offloads`` (a KV producer's connector, before the
        request's free): the producer partial tails (a sub-block key on the request's own
        running state block) still holding its last state, ``(group_id, block_id,
        boundary_tokens)``; each group's tail is popped either way. One crossing."""
        st = self._reqs.get(request.request_id)
        if st is None or not self._partial_hash_hits:
            return []
        flat = self._alloc.finalize_partial_tail_offloads(
            st.handle, request.num_computed_tokens, request.num_in_flight_tokens
        )
        return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

    def new_step_starts(self) -> None:
        self._alloc.new_step_starts()
        if self._hints_seen:
            # KV hints: the clock, once per step; the leases and retains due end; the
            # periodic hints line when its interval passed.
            try:
                now = self._clock()
                if self._clock_on:
                    self._alloc.advance_clock(int(now * 1000))
                if now >= self._hint_log_at and self.log_stats:
                    self._log_hints(now)
            except Exception:  # noqa: BLE001 - no hint may raise into the engine
                self._hint_counters.refuse("malformed")

    def _log_hints(self, now: float) -> None:
        """The plugin's KV hints line (``stats_line``: received, applied, refused, expired,
        ignored; the blocks and states pins and retains hold) on ``vllm.hybrid_alloc`` at
        INFO, when it differs from the last one logged; the next is due an interval on."""
        self._hint_log_at = now + self._hint_log_interval_s
        line = stats_line(self.hint_stats())
        if line != self._hint_logged:
            self._hint_logged = line
            logger.info("%s", line)

    def check_invariants(self) -> None:
        """Checks the native core's invariants (tests)."""
        self._alloc.check_invariants()
