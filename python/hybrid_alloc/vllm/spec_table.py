"""vLLM's KV cache specs as the core's named group specs (``hybrid_alloc.specs``).

:data:`SPEC_TABLE` has the shape of vLLM's ``spec_manager_map``: the EXACT spec class (a
subclass is not its parent: vLLM picks managers by ``type(spec)`` too) to a translator that
returns the named spec, or raises ``Unsupported`` naming why the core cannot serve it. A
class absent from the table is not served. Adding a kind the core serves is one entry here.

Cost: one dict lookup and one small object per group, at construction only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from hybrid_alloc.specs import (
    ChunkedLocal,
    CircularBuffer,
    CrossAttention,
    FullAttention,
    GroupSpec,
    Mamba,
    MambaAlign,
    Rswa,
    SlidingWindow,
    SlidingWindowReplay,
)
from hybrid_alloc.vllm import compat
from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = ["SPEC_TABLE", "describe", "group_spec"]

Translator = Callable[[Any, int], GroupSpec]


def _full(spec: Any, key: int) -> GroupSpec:
    return FullAttention(block_size=spec.block_size, spec_key=key)


def _sliding_window(spec: Any, key: int) -> GroupSpec:
    return SlidingWindow(
        block_size=spec.block_size,
        spec_key=key,
        window=spec.sliding_window,
        extra_retained_tokens=spec.extra_retained_tokens,
    )


def _sliding_window_mla(spec: Any, key: int) -> GroupSpec:
    # vLLM serves it with the SlidingWindowManager (DeepSeek-V4's sliding-window MLA). With
    # ``bounded_replay`` (DeepSeek-V4.1, ``--swa-bounded-replay``, on by default) the spec is
    # not prefix-cacheable: the same manager, its hits and caching off; the scheduler replays
    # the hit's last window.
    if getattr(spec, "bounded_replay", False):
        return SlidingWindowReplay(
            block_size=spec.block_size,
            spec_key=key,
            window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    return _sliding_window(spec, key)


def _rswa(spec: Any, key: int) -> GroupSpec:
    # Full attention whose allocate_slots also frees the gap between the prompt and the
    # window (vLLM's RSWAManager, the same on 0.32 and 0.33).
    return Rswa(block_size=spec.block_size, spec_key=key, window=spec.rswa_window)


def _chunked_local(spec: Any, key: int) -> GroupSpec:
    return ChunkedLocal(block_size=spec.block_size, spec_key=key, chunk=spec.attention_chunk_size)


def _cross(spec: Any, key: int) -> GroupSpec:
    return CrossAttention(block_size=spec.block_size, spec_key=key)


def _circular_buffer(spec: Any, key: int) -> GroupSpec:
    return CircularBuffer(block_size=spec.block_size, spec_key=key)


def _mamba(spec: Any, key: int) -> GroupSpec:
    """A ``MambaSpec`` group (GDN, Mamba2, short conv, ...) as the core serves it."""
    mode = spec.mamba_cache_mode
    if mode == "none":
        return Mamba(block_size=spec.block_size, spec_key=key, speculative_blocks=spec.num_speculative_blocks)
    if mode == "align":
        # Prefill checkpoint blocks (MambaMixer2 always sets one, alignment 1): vLLM reserves
        # them only when both are set (``_needs_internal_checkpoint`` is False without an
        # alignment); 0 tells the core there are none.
        alignment = spec.prefill_checkpoint_alignment
        checkpoint = alignment if spec.num_prefill_checkpoint_blocks > 0 and alignment is not None else 0
        if not isinstance(checkpoint, int) or checkpoint < 0:
            raise Unsupported(f"prefill_checkpoint_alignment={alignment!r}")
        return MambaAlign(
            block_size=spec.block_size,
            spec_key=key,
            speculative_blocks=spec.num_speculative_blocks,
            rekey_cached_tail=compat.MAMBA_ALIGN_REKEYS_CACHED_TAIL,
            checkpoint_alignment=checkpoint,
        )
    raise Unsupported(f"Mamba cache mode {mode!r}")


def _refuse(reason: str) -> Translator:
    def translate(spec: Any, key: int) -> GroupSpec:
        raise Unsupported(reason)

    return translate


SPEC_TABLE: dict[type[KVCacheSpec], Translator] = {
    FullAttentionSpec: _full,
    MLAAttentionSpec: _full,
    # vLLM gives it the plain FullAttentionManager.
    HiddenStateCacheSpec: _full,
    SlidingWindowSpec: _sliding_window,
    SlidingWindowMLASpec: _sliding_window_mla,
    RSWASpec: _rswa,
    ChunkedLocalAttentionSpec: _chunked_local,
    CrossAttentionSpec: _cross,
    CircularBufferSpec: _circular_buffer,
    MambaSpec: _mamba,
    # Nothing to be exact to: vLLM 0.32 and 0.33 register no manager for it, so their own
    # KVCacheManager cannot be built for such a group either (it asserts).
    UniformTypeKVCacheSpecs: _refuse(
        "UniformTypeKVCacheSpecs (vLLM registers no manager for a uniform-type group: its own "
        "KVCacheManager cannot be built for it either)"
    ),
    SinkFullAttentionSpec: _refuse(
        "SinkFullAttentionSpec (vLLM's own SinkFullAttentionManager cannot be built: its "
        "__init__ takes no needs_kv_cache_zeroing)"
    ),
}


def group_spec(spec: KVCacheSpec, key: int) -> GroupSpec:
    """The named spec of a group whose vLLM spec is ``spec``, with ``spec_key`` ``key``;
    raises ``Unsupported`` naming what is not served."""
    translate = SPEC_TABLE.get(type(spec))
    if translate is None:
        raise Unsupported(f"KV cache spec {type(spec).__name__}")
    return translate(spec, key)


def describe(spec: GroupSpec) -> str:
    """The group as the serving log line names it, e.g. ``sliding_window(window=64)/bs=16``."""
    match spec:
        case SlidingWindow() | SlidingWindowReplay():
            params = f"(window={spec.window})"
        case ChunkedLocal():
            params = f"(chunk={spec.chunk})"
        case Mamba() | MambaAlign() if spec.speculative_blocks:
            params = f"(speculative_blocks={spec.speculative_blocks})"
        case _:
            params = ""
    return f"{spec.kind}{params}/bs={spec.block_size}"
