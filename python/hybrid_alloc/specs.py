"""Named KV cache group specs: what one group of ``Allocator(groups=...)`` is.

One frozen, slotted, keyword-only dataclass per attention kind the core serves. Each has a
``kind`` (the core's name for it), ``block_size`` (tokens per block), ``spec_key`` (groups
with equal keys have equal vLLM specs: they share cached blocks' hashes) and the kind's own
fields. vLLM's own spec classes map onto these in ``hybrid_alloc.vllm.spec_table``.

Pure Python, no vLLM: ``import hybrid_alloc.specs`` is cheap.

The binding reads them by attribute (``kind``, ``block_size``, ``spec_key``, then the
kind's own fields); it still takes the positional tuples ``(kind, block_size, spec_key,
p1, p2[, p3])`` of earlier releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias

__all__ = [
    "ChunkedLocal",
    "CircularBuffer",
    "CrossAttention",
    "FullAttention",
    "GroupSpec",
    "Mamba",
    "MambaAlign",
    "Rswa",
    "SlidingWindow",
    "SlidingWindowReplay",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttention:
    """Full attention (vLLM's ``FullAttentionSpec``, MLA, hidden-state caches)."""

    kind: ClassVar[str] = "full"
    block_size: int
    spec_key: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindow:
    """Sliding-window attention over ``window`` tokens, keeping ``extra_retained_tokens``
    more before the window (vLLM's ``SlidingWindowSpec``, ``SlidingWindowMLASpec``)."""

    kind: ClassVar[str] = "sliding_window"
    block_size: int
    spec_key: int = 0
    window: int
    extra_retained_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowReplay:
    """A sliding window kept out of prefix caching, which the scheduler replays after a hit
    (vLLM's ``SlidingWindowMLASpec`` with ``bounded_replay``, DeepSeek-V4.1): allocated and
    recycled as ``SlidingWindow``, never cached, never searched for hits."""

    kind: ClassVar[str] = "sliding_window_replay"
    block_size: int
    spec_key: int = 0
    window: int
    extra_retained_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Rswa:
    """Full attention that frees the gap between the prompt and the last ``window`` tokens
    (vLLM's ``RSWASpec``)."""

    kind: ClassVar[str] = "rswa"
    block_size: int
    spec_key: int = 0
    window: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocal:
    """Chunked local attention over chunks of ``chunk`` tokens (``ChunkedLocalAttentionSpec``)."""

    kind: ClassVar[str] = "chunked_local"
    block_size: int
    spec_key: int = 0
    chunk: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttention:
    """Cross-attention over the encoder's tokens (``CrossAttentionSpec``); never cached."""

    kind: ClassVar[str] = "cross"
    block_size: int
    spec_key: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CircularBuffer:
    """A fixed ring of blocks per request (``CircularBufferSpec``)."""

    kind: ClassVar[str] = "circular_buffer"
    block_size: int
    spec_key: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba:
    """A state-space group in cache mode "none": one state block (plus
    ``speculative_blocks``) per request, never cached (``MambaSpec``)."""

    kind: ClassVar[str] = "mamba"
    block_size: int
    spec_key: int = 0
    speculative_blocks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaAlign:
    """A state-space group in cache mode "align": states at block boundaries are cached.
    ``rekey_cached_tail``: vLLM 0.32's rule, which keys the prompt's checkpoint state again
    even when it is keyed already; ``checkpoint_alignment``: the prefill checkpoint
    alignment in tokens (0: no checkpoint blocks)."""

    kind: ClassVar[str] = "mamba_align"
    block_size: int
    spec_key: int = 0
    speculative_blocks: int = 0
    rekey_cached_tail: bool = False
    checkpoint_alignment: int = 0


GroupSpec: TypeAlias = (
    FullAttention
    | SlidingWindow
    | SlidingWindowReplay
    | Rswa
    | ChunkedLocal
    | CrossAttention
    | CircularBuffer
    | Mamba
    | MambaAlign
)
