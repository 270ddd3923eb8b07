"""A router-side consumer of vLLM's KV cache events: which data-parallel rank holds the longest
servable prefix of these tokens?

An example of consuming the events (hybrid_alloc's or vLLM's own: they are the same), not a
router product. It uses only vLLM's event classes (``vllm.distributed.kv_events``), msgspec
(which vLLM's publisher encodes with) and pyzmq:

    python examples/kv_router.py --endpoint tcp://127.0.0.1:5557 --ranks 2 \\
        --replay-endpoint tcp://127.0.0.1:5657 --listen 10 --query 1,2,3,...

subscribes to ranks 0..N-1 (vLLM offsets the publisher port by the rank: 5557, 5558, ...),
fetches what they published before (their replay endpoints, 5657, 5658, ...), listens, and
prints each rank's index and the answer for each ``--query`` (token ids).

What a router can know, and what it cannot:

- Per rank and per KV cache group, which blocks are cached: ``BlockStored`` adds blocks
  (``block_hashes``, their ``token_ids``, the ``parent_block_hash`` they chain on, ``group_idx``),
  ``BlockRemoved`` withdraws them, ``AllBlocksCleared`` empties the rank. A stored block can be
  stored twice (two requests computed it at once); each copy is withdrawn on its own, so the
  index counts copies.
- The token prefix of each block, from the chain: a block's prefix is its parent's plus its own
  tokens. So the index is keyed by tokens and needs no hash function: it walks the query's
  blocks from the root through ``(parent hash, block tokens, LoRA, extra keys)``.
- Each group's kind (full attention, sliding window and its window) and block size: vLLM's
  manager annotates every ``BlockStored`` with ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window`` (in ``take_events``, 0.32 and 0.33; hybrid_alloc's events
  are the same), so the index learns them. A router may also be told the groups, in vLLM's
  group order (``--groups``; ``GroupSpec.from_kv_cache_config``). That order is vLLM's, not
  the layers': a Gemma-2-style model has the sliding-window group first.
- A hit is servable only if every group serves it, as the engine's coordinator decides:
  full attention needs every block of the prefix; sliding window (window W, block size B) needs
  only the ``ceil((W - 1) / B)`` blocks before the hit's end (the engine frees and evicts the
  ones before), or every block when the hit is shorter than that. The longest length that all
  groups serve is the hit (the engine's fixed point), capped at ``len(tokens) - 1`` (the engine
  always computes the prompt's last token).
- Where a sliding-window block sits, only through another group: vLLM caches only the window
  tails a later request can hit (sparse retention), so a sliding-window ``BlockStored`` skips
  blocks and its hashes' positions are not sent. Every group hashes a block alike, and a
  full-attention group announces every block with its tokens, so the chain is learnt there.
  A sliding-window-only model would need the router to compute vLLM's block hashes itself
  (the hash function and its seed). Lost messages show as sequence gaps
  (``gaps``); a real router then asks the rank's replay endpoint for the missed batches.
- Not the engine's state between two published batches: events are published once per engine
  step, so a request sent now is scheduled against what the rank does meanwhile.

Assumes one block size for all groups (the common case; vLLM can mix sizes for some hybrids).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["GroupSpec", "PrefixIndex", "Router"]

Hash = Any  # vLLM's ExternalBlockHash: bytes or int
KINDS = ("full_attention", "sliding_window")


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: ``kind`` is vLLM's ``KVCacheSpecKind`` value, "full_attention" or
    "sliding_window"."""

    kind: str
    block_size: int
    sliding_window: int = 0

    @classmethod
    def parse(cls, text: str) -> GroupSpec:
        """``full_attention:16`` or ``sliding_window:16:4096``."""
        kind, *rest = text.split(":")
        return cls(kind, *map(int, rest))

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> list[GroupSpec]:
        """The groups of an engine's ``KVCacheConfig``, in group order (``group_idx``)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        out = []
        for g in kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                out.append(cls("sliding_window", spec.block_size, spec.sliding_window))
            elif isinstance(spec, FullAttentionSpec):
                out.append(cls("full_attention", spec.block_size))
            else:
                raise ValueError(f"a group of {type(spec).__name__} is not covered by this example")
        return out

    def window_blocks(self) -> int:
        """Blocks a sliding-window hit needs before its end (vLLM's ``cdiv(W - 1, B)``)."""
        return -(-(self.sliding_window - 1) // self.block_size)


class PrefixIndex:
    """One rank's prefix index over its groups. ``apply`` costs O(blocks in the event);
    ``hit`` and ``servable_at`` O(blocks in the query x groups).

    ``groups`` (in group order) may be left out: vLLM annotates each ``BlockStored`` with its
    group's kind and window, and the index learns them there."""

    def __init__(self, groups: list[GroupSpec] | None = None) -> None:
        self.groups: dict[int, GroupSpec] = {}
        for i, g in enumerate(groups or []):
            self._learn(i, g)
        self.num_events = 0
        #: BlockStored events of a group whose kind is neither given nor annotated.
        self.unknown_group_events = 0
        self.clear()

    def _learn(self, idx: int, g: GroupSpec) -> None:
        if g.kind not in KINDS:
            raise ValueError(f"group {idx}: kind {g.kind!r} is not one of {', '.join(KINDS)}")
        if any(o.block_size != g.block_size for o in self.groups.values()):
            raise ValueError("one block size for all groups is assumed")
        self.groups[idx] = g

    @property
    def block_size(self) -> int:
        return next(iter(self.groups.values())).block_size

    def _spec_sets(self) -> dict[GroupSpec, list[int]]:
        """Groups of one spec are served together (vLLM's coordinator looks them up at once)."""
        sets: dict[GroupSpec, list[int]] = {}
        for i, g in sorted(self.groups.items()):
            sets.setdefault(g, []).append(i)
        return sets

    def clear(self) -> None:
        #: hash -> (parent hash, key): every block whose chain the router knows.
        self._node: dict[Hash, tuple[Hash | None, tuple[Any, ...]]] = {}
        #: (parent hash, key) -> hash: the chain walked by tokens.
        self._child: dict[tuple[Hash | None, tuple[Any, ...]], Hash] = {}
        self._num_children: Counter[Hash] = Counter()
        #: per group: hash -> copies stored.
        self._stored: defaultdict[int, Counter[Hash]] = defaultdict(Counter)

    def apply(self, event: Any) -> None:
        self.num_events += 1
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            stored = self._stored[event.group_idx or 0]
            for h in event.block_hashes:
                stored[h] -= 1
                if stored[h] <= 0:
                    del stored[h]
                    self._prune(h)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def _store(self, ev: BlockStored) -> None:
        g = ev.group_idx or 0
        if g not in self.groups and ev.kv_cache_spec_kind is not None:
            self._learn(g, GroupSpec(ev.kv_cache_spec_kind, ev.block_size, ev.kv_cache_spec_sliding_window or 0))
        if g not in self.groups:
            self.unknown_group_events += 1
            return
        bs = self.groups[g].block_size
        for h in ev.block_hashes:
            self._stored[g][h] += 1
        if len(ev.block_hashes) != len(ev.token_ids) // bs:
            # Some blocks of the range were skipped (null, or left out by sliding window's
            # sparse retention): the hashes' positions are not sent. Their chain is announced
            # by a group that keeps every block (full attention), keyed by the same hashes.
            return
        extra = ev.extra_keys or [None] * len(ev.block_hashes)
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            key = (tuple(ev.token_ids[i * bs : (i + 1) * bs]), ev.lora_name, extra[i])
            if h not in self._node:
                self._node[h] = (parent, key)
                self._child[(parent, key)] = h
                self._num_children[parent] += 1
            parent = h

    def _prune(self, h: Hash | None) -> None:
        """Forgets blocks no group stores and no known block chains on."""
        while h is not None and h in self._node and not self._num_children[h]:
            if any(h in s for s in self._stored.values()):
                return
            parent, key = self._node.pop(h)
            del self._child[(parent, key)]
            self._num_children.pop(h, None)
            self._num_children[parent] -= 1
            h = parent

    def chain(self, tokens: list[int], lora_name: str | None = None) -> list[Hash]:
        """The hashes of the query's leading full blocks whose chain the router knows."""
        bs, out, parent = self.block_size, [], None
        for i in range(len(tokens) // bs):
            h = self._child.get((parent, (tuple(tokens[i * bs : (i + 1) * bs]), lora_name, None)))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    def _in_all(self, gids: list[int], h: Hash) -> bool:
        return all(h in self._stored[g] for g in gids)

    def hit(self, tokens: list[int], max_length: int | None = None, lora_name: str | None = None) -> int:
        """The hit (tokens) the rank would serve for ``tokens``, from the events alone."""
        if not self.groups:
            return 0
        hashes = self.chain(tokens, lora_name)
        limit = len(tokens) - 1 if max_length is None else max_length
        n = min(len(hashes), max(limit, 0) // self.block_size)
        sets = self._spec_sets()
        while True:
            before = n
            for spec, gids in sets.items():
                if spec.kind == "full_attention":
                    n = next((i for i in range(n) if not self._in_all(gids, hashes[i])), n)
                else:
                    n = self._window_hit(spec.window_blocks(), gids, hashes, n)
            if n == before:
                return n * self.block_size

    def _window_hit(self, need: int, gids: list[int], hashes: list[Hash], n: int) -> int:
        run = 0
        for i in range(n - 1, -1, -1):
            if self._in_all(gids, hashes[i]):
                run += 1
                if run >= need:
                    return i + run
            else:
                run = 0
        return run

    def servable_at(self, tokens: list[int], length: int, lora_name: str | None = None) -> bool:
        """Whether every group holds what a hit of ``length`` tokens needs."""
        if not length:
            return True
        n = length // self.block_size
        hashes = self.chain(tokens, lora_name)
        if not self.groups or n > len(hashes):
            return False
        for spec, gids in self._spec_sets().items():
            first = 0 if spec.kind == "full_attention" else max(0, n - spec.window_blocks())
            if not all(self._in_all(gids, hashes[i]) for i in range(first, n)):
                return False
        return True

    def num_blocks(self) -> dict[int, int]:
        """Blocks stored per group (copies counted once)."""
        return {g: len(self._stored[g]) for g in sorted(self.groups)}


class Router:
    """Subscribes to N ranks' publishers (``endpoints[r]`` is rank r) and keeps one index each.

    With ``replay_endpoints`` (the ranks' ``replay_endpoint``s), ``catch_up`` asks each rank
    for the batches published before the router subscribed (PUB/SUB drops what is sent before a
    subscriber connects), and a sequence gap in ``poll`` asks for the missed batches."""

    def __init__(
        self,
        endpoints: list[str],
        groups: list[GroupSpec] | None = None,
        topic: str = "",
        replay_endpoints: list[str] | None = None,
    ) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.indexes = [PrefixIndex(groups) for _ in endpoints]
        self._last_seq = [-1] * len(endpoints)
        self._replay = list(replay_endpoints or [])
        self.gaps = 0
        self.num_events = [0] * len(endpoints)
        self._socks = []
        self._ctx: Any = zmq.Context.instance()
        for ep in endpoints:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.connect(ep)
            self._socks.append(s)

    def _apply(self, rank: int, seq: int, payload: bytes) -> None:
        if seq <= self._last_seq[rank]:
            return  # seen (replayed, then delivered live)
        self._last_seq[rank] = seq
        batch = self._decoder.decode(payload)
        for ev in batch.events:
            self.indexes[rank].apply(ev)
        self.num_events[rank] += len(batch.events)

    def catch_up(self, rank: int | None = None, timeout_ms: int = 5000) -> None:
        """Applies the batches rank ``rank`` (None: every rank) still buffers after the last
        one seen, from its replay endpoint."""
        for r in range(len(self._replay)) if rank is None else [rank]:
            s = self._ctx.socket(self._zmq.DEALER)
            s.connect(self._replay[r])
            s.send_multipart((b"", (self._last_seq[r] + 1).to_bytes(8, "big")))
            while s.poll(timeout_ms):
                _empty, _topic, seq_bytes, payload = s.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                self._apply(r, seq, payload)
            s.close(linger=0)

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every batch waiting (waiting up to ``timeout_ms`` for the first); returns
        how many messages it read."""
        poller = self._zmq.Poller()
        for s in self._socks:
            poller.register(s, self._zmq.POLLIN)
        n, wait = 0, timeout_ms
        while ready := dict(poller.poll(wait)):
            for rank, s in enumerate(self._socks):
                if s in ready:
                    _topic, seq_bytes, payload = s.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq > self._last_seq[rank] + 1:
                        self.gaps += 1
                        if self._replay:
                            self.catch_up(rank)
                    self._apply(rank, seq, payload)
                    n += 1
            wait = 0
        return n

    def best_rank(self, tokens: list[int], lora_name: str | None = None) -> tuple[int, int]:
        """(rank, hit tokens) of the longest servable prefix; the lowest rank on a tie."""
        hits = [ix.hit(tokens, lora_name=lora_name) for ix in self.indexes]
        best = max(range(len(hits)), key=lambda r: (hits[r], -r))
        return best, hits[best]

    def close(self) -> None:
        for s in self._socks:
            s.close(linger=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="rank 0's publisher (rank r: port + r)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--topic", default="")
    p.add_argument("--replay-endpoint", default=None, help="rank 0's replay endpoint (rank r: port + r)")
    p.add_argument(
        "--groups",
        nargs="*",
        default=[],
        help="full_attention:B or sliding_window:B:W in group order (default: learnt)",
    )
    p.add_argument("--listen", type=float, default=10.0, help="seconds to listen before answering")
    p.add_argument("--query", action="append", default=[], help="comma-separated token ids")
    args = p.parse_args()

    def ranks(endpoint: str) -> list[str]:
        base, port = endpoint.rsplit(":", 1)
        return [f"{base}:{int(port) + r}" for r in range(args.ranks)]

    router = Router(
        ranks(args.endpoint),
        [GroupSpec.parse(g) for g in args.groups] or None,
        args.topic,
        ranks(args.replay_endpoint) if args.replay_endpoint else None,
    )
    router.catch_up()
    end = time.monotonic() + args.listen
    while time.monotonic() < end:
        router.poll(timeout_ms=100)
    for r, ix in enumerate(router.indexes):
        kinds = {g: spec.kind for g, spec in sorted(ix.groups.items())}
        print(f"rank {r}: {router.num_events[r]} events, groups {kinds}, blocks stored per group {ix.num_blocks()}")
    for q in args.query:
        tokens = [int(t) for t in q.split(",") if t.strip()]
        rank, hit = router.best_rank(tokens)
        hits = [ix.hit(tokens) for ix in router.indexes]
        print(f"query of {len(tokens)} tokens: rank {rank} serves {hit} (per rank {hits})")
    router.close()


if __name__ == "__main__":
    main()
