"""KV cache residency metrics (``--kv-cache-metrics``) for the native manager.

vLLM's ``BlockPool`` calls the scheduler's ``KVCacheMetricsCollector`` as it works:
``on_block_allocated`` for each block ``get_new_blocks`` hands out, ``on_block_evicted`` in
``_maybe_evict_cached_block`` (every block ``get_new_blocks`` takes with prefix caching on,
each block of ``evict_blocks``, a transient Mamba checkpoint state), ``on_block_accessed``
for each block a hit touches, and ``reset`` after a prefix-cache reset. The core records the
same calls, in the same order, in its residency log (``Allocator(residency_log=True)``);
after each manager call that may have logged some, :class:`ResidencyReplay` takes the log
(one crossing) and makes the calls on the collector.

With metrics off nothing here runs: the core's log is off (one untaken branch per block)
and the manager's after-call hook is ``None`` or only drains events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybrid_alloc._core import Allocator
from hybrid_alloc.vllm import compat

__all__ = ["ACCESSED", "ALLOCATED", "EVICTED", "RESET", "ResidencyReplay", "after_call_hook"]

# The core's residency log ops (``take_residency_log``: flat ``[op, block_id, ...]``).
ALLOCATED, ACCESSED, EVICTED, RESET = 0, 1, 2, 3


class _Block:
    """What the collector reads of a block: ``block_id``. One instance is reused for every
    call (vLLM's collector keeps the id, never the block)."""

    __slots__ = ("block_id",)

    def __init__(self) -> None:
        self.block_id = 0


class ResidencyReplay:
    """Replays the core's residency log on ``collector`` (vLLM's ``KVCacheMetricsCollector``
    or anything with its four methods). ``touch_reports_null``: whether a hit's null block
    is reported accessed (vLLM 0.32; 0.33 skips it). Cost: one crossing per call, one Python
    call per entry."""

    __slots__ = ("_alloc", "_block", "_collector", "_touch_reports_null")

    def __init__(self, alloc: Allocator, collector: Any, touch_reports_null: bool = compat.TOUCH_REPORTS_NULL) -> None:
        self._alloc = alloc
        self._collector = collector
        self._block = _Block()
        self._touch_reports_null = touch_reports_null

    def __call__(self) -> None:
        log = self._alloc.take_residency_log()
        if not log:
            return
        c, blk = self._collector, self._block
        # Looked up per replay, not at construction: the collector's methods may be rebound.
        calls = (c.on_block_allocated, c.on_block_accessed, c.on_block_evicted)
        it = iter(log)
        for op, block_id in zip(it, it):
            if op == RESET:
                c.reset()
            elif op != ACCESSED or block_id != 0 or self._touch_reports_null:
                blk.block_id = block_id
                calls[op](blk)


def after_call_hook(
    alloc: Allocator, drain_events: Callable[[Any], None], enable_events: bool, collector: Any
) -> Callable[[Any], None] | None:
    """What the manager calls (with the request, or ``None``) after each call that may have
    queued KV cache events or residency log entries: with ``enable_events``, drains the
    events with ``drain_events`` (one crossing: ``take_events``, an empty list when there are
    none, so no ``has_events`` crossing before it); with a ``collector`` (truthy, as vLLM's
    pool tests ``if self.metrics_collector``), replays the residency log on it. ``None`` when
    both are off, so the manager's check costs one attribute test."""
    if not collector:
        if not enable_events:
            return None
        return drain_events
    replay = ResidencyReplay(alloc, collector)
    if not enable_events:
        return lambda request: replay()

    def drain_and_replay(request: Any) -> None:
        drain_events(request)
        replay()

    return drain_and_replay
