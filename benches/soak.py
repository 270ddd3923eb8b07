"""Soak test, out of CI: millions of mixed operations on one ``hybrid_alloc.Allocator``
(admissions with prefix hits, prefill chunks, decode steps through ``FastAllocate``,
preemptions, pops, frees, evictions, resets, and bad inputs that must raise), with the
process RSS printed as it goes. Memory must stay flat once the pool and the request slots
are warm; the invariants are checked every ``--check-every`` operations.

    PYTHONPATH=target/pysite python benches/soak.py --ops 5000000
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time
from typing import Any

import hybrid_alloc as ha
from hybrid_alloc import Allocator, Hit
from hybrid_alloc._core import FastAllocate

BS = 16


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Req:
    """A request as FastAllocate reads it (the attributes of vLLM's Request)."""

    def __init__(self, handle: int, tokens: list[int]) -> None:
        self._hybrid_alloc_handle = handle
        self.handle = handle
        self.tokens = tokens
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_prompt_tokens = len(tokens)
        self.shared_prefix_boundary = 0
        self.block_hashes: list[bytes] = []
        self.sync_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sync_hashes(self) -> None:
        prev = self.block_hashes[-1] if self.block_hashes else b""
        for i in range(len(self.block_hashes), len(self.tokens) // BS):
            prev = hashlib.sha256(prev + bytes(t % 256 for t in self.tokens[i * BS : (i + 1) * BS])).digest()
            self.block_hashes.append(prev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=5_000_000)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--report-every", type=int, default=250_000)
    p.add_argument("--check-every", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    groups = [("full", BS, 0, 0, 0), ("sliding_window", BS, 1, 512, 0)]
    a = Allocator(args.blocks, groups, BS, BS, 8192, 2048, True, True, 8, 0)
    fast = FastAllocate(a, "empty", lambda *x, **k: None, lambda g: g, None)
    running: list[Req] = []
    waiting: list[Req] = []
    popped: list[list[int]] = []
    counts: dict[str, int] = {}
    start = time.time()
    print(f"{'ops':>10} {'s':>7} {'RSS MiB':>8} {'running':>8} {'free':>6}  operations so far")
    for n in range(1, args.ops + 1):
        x = rng.random()
        op: str
        if x < 0.05 and len(running) + len(waiting) < 256:
            op = "add"
            family = rng.randrange(8)
            length = rng.randrange(16, 2048)
            tokens = [family * 1000 + i // 64 if i < 1024 else rng.randrange(1 << 16) for i in range(length)]
            waiting.append(Req(a.add_request(), tokens))
        elif x < 0.12 and waiting:
            op = "admit"
            r = waiting.pop(rng.randrange(len(waiting)))
            hit, _, hit_groups = a.get_computed_blocks(r.handle, r.num_tokens - 1, block_hashes=r.block_hashes)
            chunk = min(rng.randrange(1, 1024), r.num_tokens - hit)
            res = a.allocate_slots(
                r.handle,
                chunk,
                block_hashes=r.block_hashes,
                hit=Hit.STORED if rng.random() < 0.5 else hit_groups,
                num_new_computed_tokens=hit,
                full_sequence_must_fit=True,
                apply_watermark=True,
                num_prompt_tokens=r.num_prompt_tokens,
                num_tokens=r.num_tokens,
            )
            if res is None:
                waiting.append(r)
            else:
                r.num_computed_tokens = hit + chunk
                running.append(r)
        elif x < 0.90 and running:
            op = "step"
            r = running[rng.randrange(len(running))]
            if r.num_computed_tokens >= r.num_tokens:
                r.tokens.append(rng.randrange(1 << 16))
                r.sync_hashes()
            new = min(rng.choice((1, 1, 1, 1, 64)), r.num_tokens - r.num_computed_tokens)
            out = fast(r, new, num_lookahead_tokens=rng.choice((0, 0, 2)))
            if out is None:  # does not fit: preempt it
                a.free(r.handle)
                running.remove(r)
                r2 = Req(a.add_request(), r.tokens)
                waiting.append(r2)
            else:
                r.num_computed_tokens += new
                if r.num_tokens >= 8000:
                    a.free(r.handle)
                    running.remove(r)
        elif x < 0.93 and running:
            op = "free"
            r = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.3:
                popped.append(a.pop_blocks_for_free(r.handle))
            else:
                a.free(r.handle)
        elif x < 0.95 and popped:
            op = "free_popped"
            a.free_block_ids(list(reversed(popped.pop())))
        elif x < 0.96:
            op = "evict"
            a.evict_blocks([rng.randrange(args.blocks) for _ in range(4)])
        elif x < 0.965:
            op = "reset"
            a.reset_prefix_cache()
        else:
            op = "bad"
            loose = {b for p in popped for b in p}
            not_popped = next(b for b in iter(lambda: rng.randrange(1, args.blocks), None) if b not in loose)
            bad: list[Any] = [
                lambda: a.free(rng.randrange(1 << 40)),
                lambda b=not_popped: a.free_block_ids([b]),
                lambda: a.allocate_slots(running[0].handle if running else 0, 0),
                lambda: a.allocate_slots(running[0].handle if running else 0, 2**32 - 1, num_computed_tokens=5),
                lambda: a.get_computed_blocks(waiting[0].handle if waiting else 0, 100, block_hashes=[b""]),
                lambda: a.cache_blocks(waiting[0].handle if waiting else 0, 10**6),
            ]
            try:
                rng.choice(bad)()
            except ha.HybridAllocError:
                pass
        counts[op] = counts.get(op, 0) + 1
        if n % 4096 == 0:
            a.take_events()
        if n % args.check_every == 0:
            a.check_invariants()
        if n % args.report_every == 0:
            summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            print(
                f"{n:>10} {time.time() - start:>7.1f} {rss_mib():>8.1f} {len(running):>8} {a.num_free_blocks:>6}  {summary}",
                flush=True,
            )
    a.check_invariants()


if __name__ == "__main__":
    main()
