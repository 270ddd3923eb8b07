"""What a hits cell measures beyond vLLM's own ``PrefixCacheStats``, and the simulated time it
runs in: each a small watcher :func:`hybrid_alloc.bench.hits_run.run` sets up on the scheduler
and its manager, or a function of the per-job hits it recorded.

| name | holds |
|---|---|
| ``SimClock`` | the simulated clock: the bench moves it a step at a time, the manager reads it (``manager._clock``) |
| ``second_sighting_share`` | the share of shared-prompt tokens hit from each prompt's 2nd sighting on |
| ``whole_sightings`` | the sightings, from each prompt's 2nd, that hit the whole prompt on the hash grid |
| ``resumed_share`` | the share of each resumed turn's previous context that hit |
| ``PartialTails`` | counts the pool's blocks keyed inside a block, after each step |
| ``Refusals`` | the refused allocations, and those refused while the pool withheld free blocks and pins held blocks |

Nothing here imports vLLM at module level. Cost: the shares are O(jobs); ``PartialTails`` is
O(candidates) per step (O(pool) in Rust for our manager); ``Refusals`` costs nothing until an
allocation is refused, then O(blocks the running requests hold).
"""

from __future__ import annotations

from typing import Any

from hybrid_alloc.bench.hits_workloads import Workload


class SimClock:
    """Simulated seconds since the run's start: :meth:`advance` moves it (a step's duration, or
    an idle wait to the next arrival); calling it reads it, as ``time.monotonic`` is read (the
    manager's ``_clock``, where its TTLs expire)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def second_sighting_share(wl: Workload, job_hits: list[int]) -> float | None:
    """Of the shared-prompt tokens of every job that is not its prompt's first (in arrival
    order), the share served from the cache (each job's hit capped at its shared prompt);
    None for a workload without shared prompts (``Job.shared_key``)."""
    seen: set[int] = set()
    shared = hit = 0
    for job, h in zip(wl.jobs, job_hits):
        if job.shared_key < 0:
            continue
        if job.shared_key in seen:
            shared += job.shared_len
            hit += min(h, job.shared_len)
        seen.add(job.shared_key)
    return hit / shared if shared else None


def whole_sightings(wl: Workload, job_hits: list[int], grid: int) -> dict[str, Any] | None:
    """The sightings, from each shared prompt's 2nd on (in arrival order), that hit the whole
    prompt on the hash grid (``grid``: the hash block, the unit when one is set): a hit of at
    least the prompt's length rounded down to ``grid``. Prompts shorter than ``grid`` have nothing
    to hit and are left out. ``{"whole": n, "sightings": m, "first_whole": {prompt length: the
    first sighting (1-based) from which every later one hit whole, or None}}``; None for a
    workload without shared prompts."""
    seen: dict[int, int] = {}
    whole = sightings = 0
    hits_by_prompt: dict[int, list[bool]] = {}
    lens: dict[int, int] = {}
    for job, h in zip(wl.jobs, job_hits):
        if job.shared_key < 0:
            continue
        k = job.shared_key
        seen[k] = seen.get(k, 0) + 1
        lens[k] = job.shared_len
        on_grid = job.shared_len // grid * grid
        if not on_grid:
            continue
        ok = h >= on_grid
        hits_by_prompt.setdefault(k, []).append(ok)
        if seen[k] > 1:
            sightings += 1
            whole += ok
    if not lens:
        return None
    first: dict[int, int | None] = {}
    for k, oks in sorted(hits_by_prompt.items(), key=lambda kv: lens[kv[0]]):
        n = len(oks)
        while n > 0 and oks[n - 1]:
            n -= 1
        first[lens[k]] = n + 1 if n < len(oks) else None
    return {"whole": whole, "sightings": sightings, "first_whole": first}


def resumed_share(resumed: list[tuple[int, int]]) -> dict[str, Any] | None:
    """Of each resumed turn's previous context on the hash grid (``(hit, context)`` per resumed
    turn, the context being the tokens the previous turn computed, rounded down to the hash
    block: what a hit can reach), the share that hit: in all (token-weighted), the least of any
    turn, and the turns that hit at least 90%. None without resumed turns."""
    pairs = [(min(h, c), c) for h, c in resumed if c > 0]
    if not pairs:
        return None
    return {
        "share": sum(h for h, _ in pairs) / sum(c for _, c in pairs),
        "least": min(h / c for h, c in pairs),
        "turns": len(pairs),
        "turns_90": sum(1 for h, c in pairs if h >= 0.9 * c),
    }


class PartialTails:
    """Blocks of vLLM's block pool that hold a partial-tail prefix-cache key (a block whose
    ``block_hash_num_tokens`` is not a multiple of its group's block size: vLLM's sub-block
    entries with ``prefix_match_unit`` set), counted after each step (:meth:`count`): the
    last count and the peak. Watches the pool's ``_insert_block_hash`` (every key passes
    through it, all three releases) for candidates, so a count costs O(candidates), not
    O(pool). A native manager's pool is counted by the core
    (``Allocator.num_partial_tail_blocks``, O(pool) in Rust)."""

    def __init__(self, mgr: Any) -> None:
        self.last: int | None = None
        self.peak: int | None = None
        pool: Any = getattr(mgr, "block_pool", None)
        insert = getattr(pool, "_insert_block_hash", None)
        self._native = getattr(getattr(mgr, "_alloc", None), "num_partial_tail_blocks", None)
        if self._native is not None:
            self.last = self.peak = 0
            return
        if insert is None:
            return
        from vllm.v1.core.kv_cache_utils import get_group_id

        self._group_id = get_group_id
        self._sizes = [g.kv_cache_spec.block_size for g in mgr.kv_cache_config.kv_cache_groups]
        self._candidates: dict[int, Any] = {}
        self.last = self.peak = 0

        def watched(key: Any, block: Any, num_tokens: int | None) -> None:
            insert(key, block, num_tokens)
            if num_tokens is not None and num_tokens % self._sizes[get_group_id(key)]:
                self._candidates[block.block_id] = block

        pool._insert_block_hash = watched

    def _partial(self, block: Any) -> bool:
        n = block.block_hash_num_tokens
        return block.block_hash is not None and n is not None and n % self._sizes[self._group_id(block.block_hash)] != 0

    def count(self) -> None:
        if self.last is None or self.peak is None:
            return
        if self._native is not None:
            self.last = self._native()
            self.peak = max(self.peak, self.last)
            return
        for bid in [b for b, blk in self._candidates.items() if not self._partial(blk)]:
            del self._candidates[bid]
        self.last = len(self._candidates)
        self.peak = max(self.peak, self.last)


class Refusals:
    """Watches the manager's ``allocate_slots`` (an instance attribute over it) for refusals
    (``None``: the request does not fit; an admission then waits, a running request's step
    preempts another), and checks each one against the pool.

    At a refusal it counts the blocks no running request holds (the union of the running
    requests' block tables, read through the manager: a count that does not trust the pool's)
    and compares it with the pool's free count (``block_pool.get_num_free_blocks()``, what the
    manager's admission check reads). Every free block, pinned or not, is a block the refused
    request could have had: pinned blocks are free blocks, evicted last. A refusal at which the
    pool counted fewer free blocks than that while pins or retains held blocks
    (``pins_held()``) is **pin-delayed**: pins may have kept it waiting (counted whether or not
    the blocks withheld would have made room, so the count is an upper bound). ``admissions``
    and ``running`` split the refusals by the request's state; ``with_pins`` counts those made
    while pins or retains held blocks (where the check means something), ``withheld`` those with
    fewer free blocks counted than free, pins or not."""

    def __init__(self, sched: Any, mgr: Any, pins_held: Any) -> None:
        from vllm.v1.request import RequestStatus

        self.admissions = self.running = self.withheld = self.pin_delayed = self.with_pins = 0
        self._sched, self._mgr, self._pins_held = sched, mgr, pins_held
        self._waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self._num_blocks = mgr.kv_cache_config.num_blocks
        allocate = mgr.allocate_slots

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            r = allocate(request, *args, **kwargs)
            if r is None:
                self._refused(request)
            return r

        mgr.allocate_slots = allocate_slots

    def _refused(self, request: Any) -> None:
        if request.status in self._waiting:
            self.admissions += 1
        else:
            self.running += 1
        held: set[int] = set()
        for r in self._sched.running:
            for ids in self._mgr.get_block_ids(r.request_id):
                held.update(ids)
        held.discard(0)  # the null block
        free = self._num_blocks - 1 - len(held)
        pins = self._pins_held() > 0
        self.with_pins += pins
        if self._mgr.block_pool.get_num_free_blocks() < free:
            self.withheld += 1
            self.pin_delayed += pins

    def as_dict(self) -> dict[str, int]:
        return {
            "refused_admissions": self.admissions,
            "refused_running": self.running,
            "refused_with_pins": self.with_pins,
            "refused_withheld": self.withheld,
            "pin_delayed": self.pin_delayed,
        }
