"""A hypothesis state machine over the public Python API, valid and invalid operations
mixed: requests with chained block hashes over a small token alphabet (so prefixes are
shared and hits happen), prefill and decode steps, cache-hit adoption (the stored hit and
explicit, sometimes wrong, block ids), the FastAllocate path, caching, recycling, pops,
frees, evictions and resets, plus stale and foreign handles, out-of-range counts, malformed
hashes. After every step ``check_invariants()`` holds; a call that raises a
``HybridAllocError`` (or ``TypeError`` / ``OverflowError``) leaves everything observable
as it was; a Rust ``PanicException`` (a ``BaseException``) fails the test at once.

``HYBRID_ALLOC_STATEFUL_EXAMPLES`` sets the number of examples (default 2000)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hybrid_alloc as ha
from hybrid_alloc import Allocator, Hit
from hybrid_alloc._core import FastAllocate

BS = 16
MML = 512
SHAPES: dict[str, list[tuple[str, int, int, int, int]]] = {
    "full": [("full", BS, 0, 0, 0)],
    "full_swa": [("full", BS, 0, 0, 0), ("sliding_window", BS, 1, 33, 0)],
    "swa": [("sliding_window", BS, 0, 48, 0)],
    "full_chunked": [("full", BS, 0, 0, 0), ("chunked_local", BS, 1, 64, 0)],
    "full_cross": [("full", BS, 0, 0, 0), ("cross", BS, 1, 0, 0)],
}
EXPECTED = (ha.HybridAllocError, TypeError, OverflowError)


def chained(tokens: list[int]) -> list[bytes]:
    out, prev = [], b""
    for i in range(len(tokens) // BS):
        prev = hashlib.sha256(prev + bytes(tokens[i * BS : (i + 1) * BS])).digest()
        out.append(prev)
    return out


class Req:
    """What the test knows of a request."""

    def __init__(self, handle: int, tokens: list[int]) -> None:
        self.handle = handle
        self.tokens = tokens
        self.computed = 0
        self.hit_tokens = 0  # of the last lookup (0: none)
        self._hybrid_alloc_handle = handle

    # The attributes FastAllocate reads (a vLLM Request's).
    @property
    def num_computed_tokens(self) -> int:
        return self.computed

    @property
    def num_in_flight_tokens(self) -> int:
        return 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def shared_prefix_boundary(self) -> int:
        return 0

    @property
    def block_hashes(self) -> list[bytes]:
        return chained(self.tokens)


counts = st.one_of(st.integers(0, 80), st.sampled_from([-1, 2**31, 2**32 - 1, 2**32, 2**40]))
# Mostly valid values, sometimes not: most calls must succeed for the state to go anywhere.
mostly_small = st.integers(0, 7).flatmap(lambda k: counts if k == 0 else st.integers(1, 64))
which_handle = st.integers(0, 15)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a: Allocator
        self.reqs: list[Req] = []
        self.stale: list[int] = []
        self.popped: list[list[int]] = []
        self.fast: FastAllocate
        self.kinds: list[str] = []

    @initialize(
        shape=st.sampled_from(sorted(SHAPES)),
        caching=st.booleans(),
        events=st.booleans(),
        num_blocks=st.integers(4, 64),
        first=st.lists(st.tuples(st.integers(0, 1), st.integers(1, 120)), min_size=1, max_size=3),
    )
    def build(self, shape: str, caching: bool, events: bool, num_blocks: int, first: list[tuple[int, int]]) -> None:
        if shape == "full_cross":
            caching = False
        self.a = Allocator(num_blocks, SHAPES[shape], BS, BS, MML, 128, caching, events, 1, 0)
        self.kinds = [g[0] for g in SHAPES[shape]]
        self.fast = FastAllocate(self.a, "empty", lambda *a, **k: "slow", lambda groups: groups, None)
        for family, length in first:
            self.add(family, length, 0)

    # ---- helpers --------------------------------------------------------------------------

    def snapshot(self) -> tuple[Any, ...]:
        a = self.a
        live = [r.handle for r in self.reqs]
        return (
            a.num_free_blocks,
            a.free_queue_order(),
            a.num_requests,
            [(a.ref_cnt(b), a.block_hash(b)) for b in range(a.num_blocks)],
            [(a.block_ids(h), a.num_hashes(h), a.noop_limits(h), a.estimate_cached_tokens(h)) for h in live],
        )

    def attempt(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """Runs ``call``: ``(True, result)``, or ``(False, None)`` after an expected error,
        with the state checked unchanged. A panic fails the test."""
        before = self.snapshot()
        try:
            res = call()
            event("call succeeded")
            return True, res
        except BaseException as e:
            if type(e).__name__ == "PanicException":
                raise AssertionError(f"Rust panic reached Python: {e!r}") from e
            if not isinstance(e, EXPECTED):
                raise
            event(f"refused: {type(e).__name__}")
            after = self.snapshot()
            assert after == before, f"{type(e).__name__}: {e} changed the state"
            return False, None

    def pick(self, i: int) -> Req | None:
        return self.reqs[i % len(self.reqs)] if self.reqs else None

    def handle(self, which: int, i: int) -> int:
        """A live handle mostly; sometimes a stale one, a made-up one, or a negative one."""
        r = self.pick(i)
        if which < 12 and r is not None:
            return r.handle
        if which < 14 and self.stale:
            return self.stale[i % len(self.stale)]
        return [-1, 12345, 2**40 + 3, i][which % 4]

    # ---- rules ----------------------------------------------------------------------------

    @rule(family=st.integers(0, 1), length=st.integers(1, 300) | st.integers(1, 100), tail=st.integers(0, 9))
    def add(self, family: int, length: int, tail: int) -> None:
        if len(self.reqs) >= 12:
            return
        tokens = [family * 7 + (i // 40) % 3 if i < 200 else (tail * 31 + i) % 251 for i in range(length)]
        ok, h = self.attempt(self.a.add_request)
        assert ok
        self.reqs.append(Req(h, tokens))

    @rule(i=st.integers(0, 99), which=which_handle, max_len=counts, send=st.booleans())
    def lookup(self, i: int, which: int, max_len: int, send: bool) -> None:
        h = self.handle(which, i)
        r = self.pick(i)
        hashes = r.block_hashes if (send and r is not None) else None
        ok, res = self.attempt(lambda: self.a.get_computed_blocks(h, max_len, block_hashes=hashes))
        if ok and r is not None and h == r.handle:
            hit, _, groups = res
            assert all(len(g) == hit // BS for g, k in zip(groups, self.kinds) if k != "cross")
            r.hit_tokens = hit

    @rule(
        i=st.integers(0, 99),
        which=which_handle,
        new=mostly_small,
        hit_kind=st.sampled_from(["none", "none", "stored", "stored", "stored", "explicit", "explicit", "garbage"]),
        garbage=st.lists(st.lists(st.integers(-2, 60), max_size=4), max_size=3),
        lookahead=st.integers(0, 3),
        external=st.sampled_from([0] * 8 + [16, 700]),
        flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.integers(0, 3)),
        bad_hash=st.sampled_from([None] * 9 + [b"", b"x" * 33, "str"]),
        encoder=st.integers(0, 100),
    )
    def allocate(
        self,
        i: int,
        which: int,
        new: int,
        hit_kind: str,
        garbage: list[list[int]],
        lookahead: int,
        external: int,
        flags: tuple[bool, bool, bool, int],
        bad_hash: Any,
        encoder: int,
    ) -> None:
        h = self.handle(which, i)
        r = self.pick(i)
        delay, must_fit, watermark, reserved = flags
        computed = r.computed if r is not None else 0
        tokens = len(r.tokens) if r is not None else 64
        hashes = r.block_hashes if r is not None else []
        if bad_hash is not None and hashes:
            hashes = hashes[:-1] + [bad_hash]
        hit: Any = None
        nnc = 0
        if hit_kind == "stored" and r is not None:
            hit, nnc = Hit.STORED, r.hit_tokens
        elif hit_kind == "explicit" and r is not None and r.hit_tokens:
            _, _, groups = self.a.get_computed_blocks(r.handle, r.hit_tokens, block_hashes=r.block_hashes)
            hit, nnc = groups, r.hit_tokens
        elif hit_kind == "garbage":
            hit, nnc = garbage, BS * len(garbage[0]) if garbage else 0
        ok, res = self.attempt(
            lambda: self.a.allocate_slots(
                h,
                new,
                block_hashes=hashes,
                hit=hit,
                num_new_computed_tokens=nnc,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=external,
                delay_cache_blocks=delay,
                num_encoder_tokens=encoder,
                full_sequence_must_fit=must_fit,
                reserved_blocks=reserved,
                apply_watermark=watermark,
                num_computed_tokens=computed,
                num_prompt_tokens=tokens,
                num_tokens=tokens,
            )
        )
        if ok and res is not None and r is not None and h == r.handle:
            r.computed = min(computed + nnc + external + max(new, 0), MML)
            r.hit_tokens = 0
            event(f"allocated (hit: {hit_kind if nnc else 'none'}, external: {external > 0})")
        elif ok:
            event("allocate: does not fit")

    @rule(i=st.integers(0, 99), explicit=st.booleans(), chunk=st.integers(1, 300), must_fit=st.booleans())
    def admit(self, i: int, explicit: bool, chunk: int, must_fit: bool) -> None:
        """The scheduler's admission of a waiting request: look up its prefix, adopt the hit."""
        waiting = [r for r in self.reqs if r.computed == 0]
        if not waiting:
            return
        r = waiting[i % len(waiting)]
        ok, res = self.attempt(
            lambda: self.a.get_computed_blocks(r.handle, len(r.tokens) - 1, block_hashes=r.block_hashes)
        )
        if not ok:
            return
        hit_tokens, _, groups = res
        hit: Any = (groups if explicit else Hit.STORED) if hit_tokens else None
        new = min(chunk, len(r.tokens) - hit_tokens)
        ok, res = self.attempt(
            lambda: self.a.allocate_slots(
                r.handle,
                new,
                block_hashes=r.block_hashes,
                hit=hit,
                num_new_computed_tokens=hit_tokens,
                full_sequence_must_fit=must_fit,
                num_prompt_tokens=len(r.tokens),
                num_tokens=len(r.tokens),
            )
        )
        assert ok, "a valid admission was refused"
        if res is not None:
            r.computed = hit_tokens + new
            event(f"admitted with a {'hit' if hit_tokens else 'miss'}")

    # Allocation drives everything else: give it twice the weight of the other rules.
    allocate_again = allocate

    @rule(i=st.integers(0, 99), new=st.integers(1, 40), lookahead=st.integers(0, 2))
    def fast_step(self, i: int, new: int, lookahead: int) -> None:
        r = self.pick(i)
        if r is None or r.computed == 0:
            return
        new = min(new, max(len(r.tokens) - r.computed, 1))
        ok, res = self.attempt(lambda: self.fast(r, new, num_lookahead_tokens=lookahead))
        if ok and res is not None and res != "slow":
            r.computed = min(r.computed + new, MML)
            event("fast path: no-op" if res == "empty" else "fast path: crossed")

    @rule(i=st.integers(0, 99), which=which_handle, n=counts, send=st.booleans())
    def cache(self, i: int, which: int, n: int, send: bool) -> None:
        h = self.handle(which, i)
        r = self.pick(i)
        hashes = r.block_hashes if (send and r is not None) else None
        self.attempt(lambda: self.a.cache_blocks(h, n, block_hashes=hashes))

    @rule(i=st.integers(0, 99), which=which_handle, n=counts)
    def remove_skipped(self, i: int, which: int, n: int) -> None:
        h = self.handle(which, i)
        self.attempt(lambda: self.a.remove_skipped_blocks(h, n))

    @rule(i=st.integers(0, 99), which=which_handle)
    def free(self, i: int, which: int) -> None:
        h = self.handle(which, i)
        ok, _ = self.attempt(lambda: self.a.free(h))
        if ok:
            self.reqs = [r for r in self.reqs if r.handle != h]
            self.stale.append(h)

    @rule(i=st.integers(0, 99), which=which_handle)
    def pop(self, i: int, which: int) -> None:
        h = self.handle(which, i)
        ok, blocks = self.attempt(lambda: self.a.pop_blocks_for_free(h))
        if ok:
            self.reqs = [r for r in self.reqs if r.handle != h]
            self.stale.append(h)
            self.popped.append(blocks)

    @precondition(lambda self: bool(self.popped))
    @rule(i=st.integers(0, 99), extra=st.lists(st.integers(-1, 60), max_size=2))
    def free_popped(self, i: int, extra: list[int]) -> None:
        k = i % len(self.popped)
        # An extra id that another popped list holds is a legal free of that block; keep the
        # extras to ids no popped list accounts for, so the model stays exact.
        extra = [b for b in extra if not any(b in p for p in self.popped)]
        ok, _ = self.attempt(lambda: self.a.free_block_ids(list(reversed(self.popped[k])) + extra))
        if ok:
            self.popped.pop(k)

    @precondition(lambda self: not self.popped)
    @rule(ids=st.lists(st.integers(-1, 60), max_size=4))
    def free_ids(self, ids: list[int]) -> None:
        ok, _ = self.attempt(lambda: self.a.free_block_ids(ids))
        assert not ok or all(b == 0 for b in ids), "freed blocks nobody popped"

    @rule(ids=st.lists(st.integers(-1, 60), max_size=4))
    def evict(self, ids: list[int]) -> None:
        self.attempt(lambda: self.a.evict_blocks(ids))

    @rule()
    def reset(self) -> None:
        self.attempt(self.a.reset_prefix_cache)

    @rule(i=st.integers(0, 99), cut=st.integers(0, 30), bad=st.booleans())
    def rewrite_hashes(self, i: int, cut: int, bad: bool) -> None:
        r = self.pick(i)
        if r is None:
            return
        hashes = r.block_hashes[:cut] + ([b""] if bad else [])
        ok, _ = self.attempt(lambda: self.a.set_block_hashes(r.handle, hashes))
        assert ok != bad
        if ok:
            assert self.a.num_hashes(r.handle) == len(hashes)

    @rule()
    def take_events(self) -> None:
        self.attempt(self.a.take_events)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        assert self.a.num_requests == len(self.reqs)
        held = {b for r in self.reqs for g in self.a.block_ids(r.handle) for b in g if b}
        held |= {b for p in self.popped for b in p if b}
        assert self.a.num_free_blocks + len(held) == self.a.num_blocks - 1

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        for r in self.reqs:
            self.a.free(r.handle)
        for p in self.popped:
            self.a.free_block_ids(list(reversed(p)))
        self.a.check_invariants()
        assert self.a.num_free_blocks == self.a.num_blocks - 1


AllocatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HYBRID_ALLOC_STATEFUL_EXAMPLES", "2000")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=False,
)
TestAllocatorMachine = AllocatorMachine.TestCase
