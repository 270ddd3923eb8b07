"""vLLM's KV cache events (``vllm.distributed.kv_events``) made from the core's events.

:class:`EventLog` collects them for one manager: :meth:`EventLog.drain` turns the core's
events (:mod:`hybrid_alloc.events`: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) into vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, built as vLLM's own
``BlockPool`` builds them; :meth:`EventLog.take` hands them over, each ``BlockStored``
tagged with its group's spec kind and sliding window, as vLLM's manager tags them.

Only used with ``enable_kv_cache_events``. Cost: O(blocks stored) per drain, the extra keys
of each stored block included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
from vllm.v1.request import Request

from hybrid_alloc.events import AllBlocksCleared as CoreAllBlocksCleared
from hybrid_alloc.events import BlockRemoved as CoreBlockRemoved
from hybrid_alloc.events import CoreEvent
from hybrid_alloc.vllm import compat

__all__ = ["EventLog"]


class EventLog:
    """The vLLM events of one manager, not yet taken.

    ``lookahead_tokens``: the tokens after each block its hash covers (vLLM 0.33's lookahead
    block hashes; 0: none). ``metadata``: per group, the (spec kind, sliding window) a
    ``BlockStored`` of that group carries."""

    def __init__(self, kv_cache_config: KVCacheConfig, hash_block_size: int, lookahead_tokens: int) -> None:
        self.events: list[KVCacheEvent] = []
        self.lookahead_tokens = lookahead_tokens
        self.hash_block_size = hash_block_size
        self.block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )

    def drain(self, core_events: Iterable[CoreEvent], request: Request | None) -> None:
        """Appends the vLLM events of ``core_events``; ``request`` is the request whose
        blocks were stored (``None`` where nothing can be stored: eviction, reset)."""
        for ev in core_events:
            if isinstance(ev, CoreBlockRemoved):
                self.events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(ev.block_hash)], medium=MEDIUM_GPU, group_idx=ev.group
                    )
                )
            elif isinstance(ev, CoreAllBlocksCleared):
                self.events.append(AllBlocksCleared())
            else:
                assert request is not None
                self.events.append(
                    self.block_stored(
                        request,
                        [maybe_convert_block_hash(h) for h in ev.block_hashes],
                        None if ev.parent_hash is None else maybe_convert_block_hash(ev.parent_hash),
                        ev.start_token,
                        ev.end_token,
                        ev.block_size,
                        ev.group,
                        ev.block_indices,
                    )
                )

    def cached_blocks(self, request: Request, counts: Sequence[int]) -> None:
        """A ``BlockStored`` per group for the ``counts[g]`` blocks a hit found (a request
        with ``kv_cache_report_mode="full"``)."""
        hashes = request.block_hashes
        for g, n in enumerate(counts):
            if n == 0:
                continue
            bs = self.block_sizes[g]  # the spec's, unscaled under DCP, as vLLM's event reads it
            # vLLM's resolve_block_hashes asserts this (it fails for a DCP-sharded group: the
            # spec's size is below the hash block size there), before this group's event.
            assert bs % self.hash_block_size == 0
            scale = bs // self.hash_block_size
            self.events.append(
                self.block_stored(
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

    def block_stored(
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
        ``lookahead_tokens`` after it, as ``_generate_event_extra_keys``) and, with
        lookahead hashes, those tokens per block (``lookahead_token_ids``)."""
        la = self.lookahead_tokens
        extra: list[Any] = []
        lookahead: list[list[int]] = []
        tokens = request.all_token_ids
        mm_idx = 0
        for i in block_indices:
            b_start = i * block_size
            b_end = b_start + block_size
            if la:
                assert compat.generate_lookahead_extra_keys is not None
                k, mm_idx = compat.generate_lookahead_extra_keys(request, b_start, b_end, b_end + la, mm_idx)
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

    def take(self) -> list[KVCacheEvent]:
        """The events collected since the last call, oldest first."""
        events = self.events
        self.events = []
        meta = self.metadata
        for ev in events:
            if isinstance(ev, BlockStored) and ev.group_idx is not None and 0 <= ev.group_idx < len(meta):
                ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[ev.group_idx]
        return events
