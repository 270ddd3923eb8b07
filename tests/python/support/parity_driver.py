"""A seeded random mini-scheduler that drives vLLM's KVCacheManager and ours with the same
calls on the same vLLM Request objects, and asserts identical outputs after every call:
block ids per group, cache-hit lengths, free block count, usage and KV cache events; every
``full_check_every`` operations also every live block table, the free queue's eviction
order and the native invariants. A mismatch raises ``AssertionError`` naming the seed and
the operation number."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_harness import HAVE_MAX_CACHE_HIT_LENGTH, Setup


class Mismatch(AssertionError):
    pass


class ParityRun:
    def __init__(self, setup: Setup, seed: int, full_check_every: int = 64) -> None:
        self.setup = setup
        self.seed = seed
        self.rng = random.Random(seed)
        self.ref, self.ours = setup.build(events=True)
        self.ops = 0
        self.full_check_every = full_check_every
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Running requests whose last allocation failed. The scheduler retries such a request
        # (preempting others) until it succeeds or is itself preempted, and never caches its
        # blocks in between: vLLM's Mamba "align" manager asserts that the prefill checkpoint
        # block the failed count reserved exists when it caches.
        self.alloc_failed: set[str] = set()
        self.next_id = 0
        r = self.rng
        self.prefixes = [[r.randrange(1, 5000) for _ in range(r.randrange(16, 400))] for _ in range(5)]
        self.stats = {
            "hits": 0,
            "hit_tokens": 0,
            "preempt": 0,
            "finish": 0,
            "none": 0,
            "reset_ok": 0,
            "popped": 0,
            "bounded_lookups": 0,
            "lookahead_events": 0,
            "cached_block_hits": 0,
            "removed_events": 0,
            "partial_entries": 0,
        }

    # Chunk sizes drawn for an admission's first chunk and for a running request's step.
    admit_chunks: tuple[int, ...] = (16, 48, 64, 128, 256, 512)
    run_chunks: tuple[int, ...] = (1, 16, 64, 200)

    # ---- helpers -----------------------------------------------------------------------

    def clip_chunk(self, req: Request, num_new: int, num_new_computed: int) -> int:
        """The chunk the scheduler would schedule of ``num_new`` tokens (a subclass applies
        vLLM's Mamba split); 0 stops the operation."""
        return num_new

    def after_allocate(self) -> None:
        """Runs after every ``allocate_slots`` pair (compared), before ``after_op``."""

    def on_events(self, events: list[Any]) -> None:
        """Sees the (compared) KV cache events of every operation."""

    def on_hit(self, hit: Any) -> None:
        """Sees vLLM's (compared) cache-hit blocks of every admission that hit."""

    def fail(self, what: str, a: Any, b: Any) -> None:
        raise Mismatch(
            f"[{self.setup.name}] seed={self.seed} op={self.ops}: {what} differs\n vllm: {a!r}\n ours: {b!r}"
        )

    def eq(self, what: str, a: Any, b: Any) -> None:
        if a != b:
            self.fail(what, a, b)

    @staticmethod
    def ids(blocks: Any) -> Any:
        return None if blocks is None else blocks.get_block_ids()

    def after_op(self) -> None:
        self.ops += 1
        self.eq("free blocks", self.ref.block_pool.get_num_free_blocks(), self.ours.block_pool.get_num_free_blocks())
        self.eq("usage", self.ref.usage, self.ours.usage)
        events = self.ref.take_events()
        self.eq("events", events, self.ours.take_events())
        self.on_events(events)
        self.stats["lookahead_events"] += sum(1 for e in events if getattr(e, "lookahead_token_ids", None))
        self.stats["removed_events"] += sum(1 for e in events if type(e).__name__ == "BlockRemoved")
        # Partial-block prefix entries: BlockStored events shorter than their group's block
        # (the manager's: DCP-scaled where sharded).
        managers = self.ref.coordinator.single_type_managers
        self.stats["partial_entries"] += sum(
            1 for e in events if type(e).__name__ == "BlockStored" and e.block_size < managers[e.group_idx].block_size
        )
        if self.ops % self.full_check_every == 0:
            self.full_check()

    def full_check(self) -> None:
        for req in list(self.running) + list(self.waiting):
            rid = req.request_id
            self.eq(f"blocks of {rid}", self.ref.get_block_ids(rid), self.ours.get_block_ids(rid))
        self.check_cached_block_lookups()
        ref_q = [b.block_id for b in self.ref.block_pool.free_block_queue.get_all_free_blocks()]
        self.eq("free queue order", ref_q, self.ours_free_queue_order())
        self.check_ours_invariants()
        a, b = self.ref.make_prefix_cache_stats(), self.ours.make_prefix_cache_stats()
        self.eq("prefix cache stats", vars(a), vars(b))

    def ours_free_queue_order(self) -> list[int]:
        return list(self.ours._alloc.free_queue_order())

    def check_ours_invariants(self) -> None:
        self.ours._alloc.check_invariants()

    def check_cached_block_lookups(self) -> None:
        """``block_pool.get_cached_block(hash, group_ids)`` (the routed-experts connector's
        lookup) for the first and last hashes of every live request, in each group alone and
        in all groups together."""
        groups = list(range(len(self.setup.specs)))
        for req in list(self.running) + list(self.waiting):
            hashes = list(req.block_hashes)
            for h in hashes[:6] + hashes[-6:]:
                for gids in [[g] for g in groups] + [groups]:
                    a = self.ref.block_pool.get_cached_block(h, gids)
                    b = self.ours.block_pool.get_cached_block(h, gids)
                    self.eq(
                        f"get_cached_block({gids})",
                        None if a is None else [x.block_id for x in a],
                        None if b is None else [x.block_id for x in b],
                    )
                    self.stats["cached_block_hits"] += a is not None

    def new_request(self) -> Request:
        r = self.rng
        toks: list[int] = []
        if r.random() < 0.8:
            toks += self.prefixes[r.randrange(len(self.prefixes))]
        toks += [r.randrange(1, 5000) for _ in range(r.randrange(1, 300))]
        self.next_id += 1
        return self.setup.make_request(
            f"r{self.next_id}",
            toks,
            max_tokens=r.randrange(1, 64),
            report_full=self.setup.report_full and r.random() < 0.2,
        )

    # ---- operations --------------------------------------------------------------------

    def admit(self) -> None:
        r = self.rng
        if not self.waiting or r.random() < 0.3:
            self.waiting.append(self.new_request())
        req = self.waiting[0]
        hit_ref, n_ref, hit_ours, n_ours = self.ref.empty_kv_cache_blocks, 0, self.ours.empty_kv_cache_blocks, 0
        if req.num_computed_tokens == 0:
            # vLLM 0.33: the hit may be bounded below num_tokens - 1 (aux outputs' bound).
            bound: tuple[int, ...] = ()
            if HAVE_MAX_CACHE_HIT_LENGTH and r.random() < 0.2:
                bound = (r.randrange(0, req.num_tokens),)
                self.stats["bounded_lookups"] += 1
            hit_ref, n_ref, sb_ref = self.ref.get_computed_blocks(req, *bound)
            hit_ours, n_ours, sb_ours = self.ours.get_computed_blocks(req, *bound)
            self.eq("hit tokens", n_ref, n_ours)
            self.eq("hit blocks", self.ids(hit_ref), self.ids(hit_ours))
            self.eq("shared prefix boundary", sb_ref, sb_ours)
            req.shared_prefix_boundary = sb_ref
            self.ref.record_prefix_cache_stats(req, n_ref)
            self.ours.record_prefix_cache_stats(req, n_ref)
            self.after_op()
            if n_ref:
                self.stats["hits"] += 1
                self.stats["hit_tokens"] += n_ref
                self.on_hit(hit_ref)
        remaining = req.num_tokens - req.num_computed_tokens - n_ref
        num_new = self.clip_chunk(req, min(remaining, r.choice(self.admit_chunks)), n_ref)
        if num_new == 0:
            # vLLM's scheduler stops admitting when the Mamba split leaves nothing.
            self.stats["clipped_to_zero"] = self.stats.get("clipped_to_zero", 0) + 1
            return
        kw = dict(
            num_new_computed_tokens=n_ref,
            num_lookahead_tokens=r.choice([0, 0, 0, 2]),
            full_sequence_must_fit=r.random() < 0.3,
            has_scheduled_reqs=bool(self.running),
        )
        a = self.ref.allocate_slots(req, num_new, new_computed_blocks=hit_ref, **kw)
        b = self.ours.allocate_slots(req, num_new, new_computed_blocks=hit_ours, **kw)
        self.eq("admit allocate_slots", self.ids(a), self.ids(b))
        self.after_allocate()
        self.after_op()
        if a is None:
            self.stats["none"] += 1
            if r.random() < 0.5:
                self.waiting.rotate(-1)
            return
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens += n_ref + num_new
        self.running.append(req)
        self.maybe_sample(req)

    def maybe_sample(self, req: Request) -> None:
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(self.rng.randrange(1, 5000))
            if req.num_output_tokens >= req.max_tokens:
                self.finish(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.ref.free(req)
        self.ours.free(req)
        self.stats["finish"] += 1
        self.after_op()

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.alloc_failed.discard(req.request_id)
        self.ref.free(req)
        self.ours.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.stats["preempt"] += 1
        self.after_op()

    def run_one(self) -> None:
        r = self.rng
        if not self.running:
            return self.admit()
        req = r.choice(self.running)
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = min(remaining, r.choice(self.run_chunks)) if remaining > 1 else 1
        num_new = self.clip_chunk(req, num_new, 0)
        if num_new == 0:
            self.stats["clipped_to_zero"] = self.stats.get("clipped_to_zero", 0) + 1
            return
        la = r.choice([0, 0, 0, 1, 3])
        a = self.ref.allocate_slots(req, num_new, num_lookahead_tokens=la)
        b = self.ours.allocate_slots(req, num_new, num_lookahead_tokens=la)
        self.eq("allocate_slots", self.ids(a), self.ids(b))
        self.after_allocate()
        self.after_op()
        if a is None:
            self.stats["none"] += 1
            self.alloc_failed.add(req.request_id)
            victim = self.running[-1] if r.random() < 0.7 else r.choice(self.running)
            self.preempt(victim)
            return
        self.alloc_failed.discard(req.request_id)
        req.num_computed_tokens += num_new
        self.maybe_sample(req)

    def abort(self) -> None:
        r = self.rng
        pool = list(self.running) + list(self.waiting)
        if not pool:
            return
        req = r.choice(pool)
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        if r.random() < 0.3:
            # The scheduler's deferred free: pop the blocks now, free them tail first later
            # (here at once). 0.33 returns them without each group's leading nulls.
            a = self.ref.pop_blocks_for_free(req)
            b = self.ours.pop_blocks_for_free(req)
            self.eq("pop_blocks_for_free", [x.block_id for x in a], [x.block_id for x in b])
            self.ref.block_pool.free_blocks(reversed(a))
            self.ours.block_pool.free_blocks(reversed(b))
            self.stats["popped"] += 1
            self.after_op()
        for _ in range(2):  # a free after a pop, or a second free, is a no-op in both
            self.ref.free(req)
            self.ours.free(req)
            self.after_op()

    def misc(self) -> None:
        r = self.rng
        x = r.random()
        if x < 0.05:
            ok_a, ok_b = self.ref.reset_prefix_cache(), self.ours.reset_prefix_cache()
            self.eq("reset_prefix_cache", ok_a, ok_b)
            self.stats["reset_ok"] += ok_a
        elif x < 0.15:
            ids = {r.randrange(1, self.setup.num_blocks) for _ in range(r.randrange(1, 6))}
            self.ref.evict_blocks(ids)
            self.ours.evict_blocks(ids)
        elif x < 0.4 and self.running:
            req = r.choice(self.running)
            if req.request_id not in self.alloc_failed:
                self.ref.cache_blocks(req, req.num_computed_tokens)
                self.ours.cache_blocks(req, req.num_computed_tokens)
        elif x < 0.6 and self.running:
            req = r.choice(self.running)
            self.ref.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
            self.ours.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        elif x < 0.8 and self.running:
            req = r.choice(self.running)
            self.eq(
                "estimate_cached_tokens", self.ref.estimate_cached_tokens(req), self.ours.estimate_cached_tokens(req)
            )
            n = r.randrange(0, req.num_computed_tokens + 1)
            self.eq(
                "get_block_ids_for_computed_tokens",
                self.ref.get_block_ids_for_computed_tokens(req.request_id, n),
                self.ours.get_block_ids_for_computed_tokens(req.request_id, n),
            )
        else:
            req = r.choice(self.running) if self.running else None
            if req is not None:
                self.eq(
                    "get_blocks",
                    self.ids(self.ref.get_blocks(req.request_id)),
                    self.ids(self.ours.get_blocks(req.request_id)),
                )
                kw = dict(
                    request_id=req.request_id,
                    num_tokens=req.num_tokens + 1,
                    new_computed_blocks=self.ref.empty_kv_cache_blocks.blocks,
                    num_encoder_tokens=0,
                    total_computed_tokens=req.num_computed_tokens,
                    num_local_computed_tokens=req.num_computed_tokens,
                    num_tokens_main_model=req.num_tokens + 1,
                    apply_admission_cap=True,
                    prefill_end=req.num_prompt_tokens,
                )
                self.eq(
                    "coordinator.get_num_blocks_to_allocate",
                    self.ref.coordinator.get_num_blocks_to_allocate(**kw),
                    self.ours.coordinator.get_num_blocks_to_allocate(**kw),
                )
        self.after_op()

    def drain_and_reset(self) -> None:
        """Aborts everything, then resets the prefix cache (which must succeed)."""
        for req in list(self.running) + list(self.waiting):
            self.ref.free(req)
            self.ours.free(req)
            self.after_op()
        self.running.clear()
        self.waiting.clear()
        ok_a, ok_b = self.ref.reset_prefix_cache(), self.ours.reset_prefix_cache()
        self.eq("reset_prefix_cache on an idle pool", ok_a, ok_b)
        assert ok_a, "reset on an idle pool must succeed"
        self.stats["reset_ok"] += 1
        self.after_op()

    def run(self, num_ops: int) -> dict[str, int]:
        r = self.rng
        while self.ops < num_ops:
            x = r.random()
            if x < 0.0015:
                self.drain_and_reset()
            elif x < 0.2:
                self.admit()
            elif x < 0.85:
                self.run_one()
            elif x < 0.88:
                self.abort()
            else:
                self.misc()
            if len(self.running) + len(self.waiting) > 48:
                self.abort()
        self.full_check()
        # Drain: finish everything, then the pools must agree and be empty of requests.
        for req in list(self.running):
            self.finish(req)
        for req in list(self.waiting):
            self.ref.free(req)
            self.ours.free(req)
        self.waiting.clear()
        self.full_check()
        self.eq("all free at the end", self.ref.block_pool.get_num_free_blocks(), self.setup.num_blocks - 1)
        return self.stats


def run_seeds(
    run_cls: type[ParityRun], setup: Any, first_seed: int, num_ops: int, num_seeds: int = 4
) -> dict[str, int]:
    """``num_ops`` operations of ``run_cls`` over ``setup``, split across ``num_seeds`` seeded
    traces from ``first_seed``; the traces' statistics summed."""
    total: dict[str, int] = {}
    for seed in range(first_seed, first_seed + num_seeds):
        for k, v in run_cls(setup, seed).run(num_ops // num_seeds).items():
            total[k] = total.get(k, 0) + v
    return total
