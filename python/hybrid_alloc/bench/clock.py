"""The bench's clock: :class:`ManagerClock` times what the scheduler pays for a KV cache
manager (every call into it, and every method the scheduler calls on the ``KVCacheBlocks`` it
returned), with its own cost calibrated and subtracted, and classifies the calls the per-call
figures tell apart (:func:`_classifiers`).

Cost: a timed call pays two ``perf_counter_ns`` reads and the wrapper's call (subtracted);
:meth:`ManagerClock.calibrate` runs 7 x 40,000 probe calls (about 30 ms).
"""

from __future__ import annotations

import time
from typing import Any

# A C function that does nothing with any arguments (and, being a builtin, does not bind as a
# method): the clock calibrates its timing wrappers on it, so what it subtracts is the timing.
NOOP = "".format

# Methods of KVCacheManager (and what the scheduler reaches through it) that are timed.
_TIMED = (
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "cache_blocks",
    "take_events",
    "get_blocks",
    "get_block_ids",
    "get_block_ids_for_computed_tokens",
    "new_step_starts",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "estimate_cached_tokens",
    "remove_skipped_blocks",
    "truncate_computed_blocks",
    # vLLM 0.34's probe: cache-aware admission asks it of the first N waiting requests each
    # step (``--cache-aware-admission-window``); absent before 0.34, and then not patched.
    "get_num_cached_tokens",
)
# What the scheduler (and connectors) call on the ``KVCacheBlocks`` the manager returns:
# timed on ``KVCacheBlocks`` and on every subclass that defines them (ours, lazily built).
_RESULT_METHODS = (
    "get_block_ids",
    "__add__",
    "get_unhashed_block_ids",
    "get_unhashed_block_ids_all_groups",
    "new_empty",
    "blocks",
)
# Properties of the manager the scheduler reads every step (``make_stats``).
_MANAGER_PROPERTIES = ("usage",)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = [cls]
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        out.extend(c for c in _subclasses(sub) if c not in out)
    return out


class ManagerClock:
    """Accumulates everything the scheduler pays for a KV cache manager: the time inside each
    call into the manager (its methods, wrapped on the instance, and ``coordinator`` /
    ``block_pool`` methods the scheduler reaches through it), and the time inside each method
    the scheduler calls on the ``KVCacheBlocks`` the manager returned (wrapped on
    ``KVCacheBlocks`` and its subclasses: vLLM's ``get_block_ids`` runs in vLLM's class, ours in
    ours). A call made inside a timed call is counted by the outer one.

    The wrappers are installed with :meth:`on` and removed with :meth:`off`, so steps can be
    timed with none installed. Each timed call's own timer cost (two ``perf_counter_ns`` reads
    and the call through the wrapper), calibrated per wrapper form around a C function that
    does nothing, is subtracted from what it measured."""

    def __init__(self) -> None:
        self.ns = 0.0
        self.calls = 0
        self.last_calls = 0
        self.depth = 0
        # Calibrated timer cost per call: instance-attribute wrappers (manager methods) and
        # class-attribute wrappers (methods of the returned blocks, properties).
        self.overhead_ns = 0.0
        self.overhead_method_ns = 0.0
        # name -> [ns, calls] since the last take_breakdown.
        self.by_name: dict[str, list[float]] = {}
        self._patches: list[tuple[Any, str, bool, Any, Any]] = []
        # "name/kind" -> each call's ns (the timer's cost subtracted), for the calls that have
        # a classifier (``_classifiers``), since the last reset_breakdown.
        self.samples: dict[str, list[float]] = {}
        self._installed = False

    def _timed(self, name: str, f: Any, method: bool, classify: Classifier | None = None) -> Any:
        pc = time.perf_counter_ns
        clock = self
        entry = self.by_name.setdefault(name, [0.0, 0])
        samples = self.samples

        def timed(*a: Any, **k: Any) -> Any:
            if clock.depth:  # a call inside a timed call: counted by the outer one
                return f(*a, **k)
            clock.depth = 1
            t = pc()
            try:
                r = f(*a, **k)
            finally:
                dt = pc() - t - (clock.overhead_method_ns if method else clock.overhead_ns)
                clock.depth = 0
                clock.ns += dt
                clock.calls += 1
                entry[0] += dt
                entry[1] += 1
            if classify is not None:  # after the clock is read: not part of the call's time
                key = f"{name}/{classify(a, k, r)}"
                found = samples.get(key)
                if found is None:
                    samples[key] = [dt]
                else:
                    found.append(dt)
            return r

        return timed

    def _patch(self, obj: Any, name: str, label: str, method: bool, classify: Classifier | None = None) -> None:
        own = obj.__dict__ if isinstance(obj, type) else getattr(obj, "__dict__", {})
        had_own = name in own
        orig = own[name] if had_own else getattr(obj, name, None)
        if orig is None:
            return
        if isinstance(orig, property):
            if orig.fget is None:
                return
            wrapper: Any = property(self._timed(label, orig.fget, True), orig.fset, orig.fdel, orig.__doc__)
        else:
            wrapper = self._timed(label, orig, method, classify)
        self._patches.append((obj, name, had_own, orig, wrapper))

    def install(self, mgr: Any) -> None:
        """Prepares the wrappers for ``mgr`` (and the blocks classes) and calibrates them."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        classifiers = _classifiers(mgr.empty_kv_cache_blocks)
        for name in _TIMED:
            self._patch(mgr, name, name, False, classifiers.get(name))
        self._patch(mgr.coordinator, "get_num_blocks_to_allocate", "coordinator.get_num_blocks_to_allocate", False)
        self._patch(mgr.block_pool, "free_blocks", "block_pool.free_blocks", False)
        for prop in _MANAGER_PROPERTIES:
            for cls in type(mgr).__mro__:
                if isinstance(cls.__dict__.get(prop), property):
                    self._patch(cls, prop, prop, True)
                    break
        for cls in _subclasses(KVCacheBlocks):
            for name in _RESULT_METHODS:
                if name in cls.__dict__:
                    label = f"blocks.{name}"
                    self._patch(cls, name, label, True, classifiers.get(label))
        # Ours: the empty result's get_block_ids is an instance attribute (a builtin method),
        # which the class's wrapper does not reach; it gets no ``self`` to classify by.
        empty = mgr.empty_kv_cache_blocks
        if "get_block_ids" in getattr(empty, "__dict__", {}):
            self._patch(empty, "get_block_ids", "blocks.get_block_ids", False, lambda a, k, r: "empty")
        self.calibrate()

    def on(self) -> None:
        if self._installed:
            return
        for obj, name, _, _, wrapper in self._patches:
            setattr(obj, name, wrapper)
        self._installed = True

    def off(self) -> None:
        if not self._installed:
            return
        for obj, name, had_own, orig, _ in reversed(self._patches):
            if had_own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)
        self._installed = False

    def calibrate(self) -> None:
        """The timer's own cost per call, for each wrapper form, measured around a C function
        that does nothing (so what is subtracted is the timing, not the callee; the few ns of
        the empty callee are subtracted too, for both managers alike)."""
        from types import SimpleNamespace

        probe = ManagerClock()
        o = SimpleNamespace(f=NOOP)
        probe._patch(o, "f", "probe", False)

        class Probe:
            g = NOOP

        probe._patch(Probe, "g", "probe", True)
        probe.on()
        p = Probe()
        req = SimpleNamespace(num_computed_tokens=1)
        best_attr = best_method = float("inf")
        try:
            for _ in range(7):
                probe.ns, probe.calls = 0.0, 0
                for _ in range(20000):
                    o.f(req, 1, num_lookahead_tokens=0)
                best_attr = min(best_attr, probe.ns / probe.calls)
                probe.ns, probe.calls = 0.0, 0
                for _ in range(20000):
                    p.g(allow_none=True)
                best_method = min(best_method, probe.ns / probe.calls)
        finally:
            probe.off()
        self.overhead_ns = best_attr
        self.overhead_method_ns = best_method

    def take(self) -> float:
        """Nanoseconds since the last take, the timer's cost subtracted."""
        # Not clamped at 0: the step's total is the sum of its calls' times, as the breakdown
        # is (a step of cheap calls can come out slightly negative when the calibration ran slow).
        v = self.ns
        self.last_calls = self.calls
        self.ns = 0.0
        self.calls = 0
        return v

    def reset_breakdown(self) -> None:
        for e in self.by_name.values():
            e[0], e[1] = 0.0, 0
        self.samples.clear()


Classifier = Any  # (args, kwargs, result) -> the kind of call, a short string


def _classifiers(empty: Any) -> dict[str, Classifier]:
    """How each call the per-call figures tell apart is classified, from its arguments and
    result (``empty``: the manager's shared empty ``KVCacheBlocks``, which both managers
    return for a step that got no new block):
    - ``allocate_slots``: ``admission`` (a waiting request scheduled: the scheduler passes
      ``new_computed_blocks``), ``chunk`` (a running request's next prefill chunk: more
      than one new token), ``no-op`` (one new token, no new block: the empty result),
      ``crossing`` (one new token and a new block: the step crossed a block boundary),
      ``refused`` (``None``: it did not fit);
    - ``blocks.get_block_ids``: ``empty`` (on the empty result) or ``ids``;
    - ``get_computed_blocks``, ``get_blocks``, ``free``, ``get_num_cached_tokens``: one kind,
      ``all``."""

    def allocate(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        if r is None:
            return "refused"
        if "new_computed_blocks" in k or len(a) > 3:
            return "admission"
        n = a[1] if len(a) > 1 else k.get("num_new_tokens", 0)
        if n > 1:
            return "chunk"
        return "no-op" if r is empty else "crossing"

    def block_ids(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        return "empty" if a and a[0] is empty else "ids"

    def one(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> str:
        return "all"

    return {
        "allocate_slots": allocate,
        "blocks.get_block_ids": block_ids,
        "get_computed_blocks": one,
        "get_blocks": one,
        "free": one,
        "get_num_cached_tokens": one,
    }
