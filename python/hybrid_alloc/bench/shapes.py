"""The model shapes every bench runs: one registry, :data:`SHAPES`, read by ``hybrid-alloc
bench`` (``--model``), ``hybrid-alloc hits`` (``--shape``), the offline scheduler
(:mod:`hybrid_alloc.bench.offline`, which re-exports these names for the tests) and the tests. A
shape is what the KV cache sees of a model: each layer's attention kind, the KV heads, a Mamba
layer's state. Nothing here imports vLLM: ``offline.kv_cache_specs`` turns a shape into vLLM's
layer specs.

| name | holds |
|---|---|
| ``LayerKind``, ``MambaState``, ``ModelShape`` | one layer's cache, a Mamba layer's state, a model's shape (all frozen) |
| ``alternating`` | ``n`` layers, every ``every``-th full attention, the rest local |
| ``SHAPES`` | every shape, keyed by its ``name`` |
| ``ALIASES``, ``by_name`` | other names the benches take for a shape, and the lookup that resolves them |
| ``hopper_block_size`` | the attention block vLLM picks for a shape on a Hopper GPU |

Names. The shapes ``hybrid-alloc bench`` runs are named after a model (``gemma-2-27b``) or a
family (``qwen3.5-style``); those of ``hybrid-alloc hits`` keep the short names its command
line, its tables and the docs use (``gemma3``, ``qwen35``, ``nemotronh``, ``qwen3next``,
``qwen36``, ``nemotron3nano``; ``falconh1`` is ``hybrid-alloc capacity``'s): a row is labelled
with its shape's ``name``. Two of them are near
a ``bench`` shape without being it: ``qwen35`` holds its Gated DeltaNet SSM state in bfloat16
(544-token blocks on a Hopper GPU) where ``qwen3.5-style`` holds float32 (1048), and
``nemotronh`` is ``nemotron-h-style`` under the name its hits rows carry. ``gptoss`` is an alias
(:data:`ALIASES`) of ``gpt-oss-120b``, whose name its hits rows have always carried. The hits
shapes weigh nothing (``weight_bytes`` 0: that bench sizes its pools in blocks), so
``hybrid-alloc bench --model`` on one of them gives the whole GPU to the KV cache.

Invariants (``tests/python/bench/test_bench_registry.py``): every key is its shape's ``name``,
every alias names a shape, and ``ModelShape.attention_block_size(16)`` (what the offline
scheduler builds) equals :func:`hopper_block_size` for every shape. Cost: importing this module
imports torch (the layers' dtypes); a lookup is a dict lookup.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKind:
    """One layer's cache: ``kind`` is "full", "sliding_window", "chunked_local", "rswa"
    (reference sliding window attention, ``window`` its ``rswa_window``), "mamba" (a Mamba /
    linear-attention state layer, shaped by ``ModelShape.mamba_state``), or one of
    DeepSeek-V4's: "mla" (compressed MLA, full attention), "swa_mla" (sliding-window MLA,
    ``window`` tokens; with ``bounded_replay``, DeepSeek-V4.1's, kept out of prefix caching and
    replayed after a hit) and "ring" (the compressor's circular buffer, one block per request)."""

    kind: str
    window: int = 0
    bounded_replay: bool = False


@dataclass(frozen=True)
class MambaState:
    """The per-layer state of a Mamba / linear-attention layer (vLLM's ``MambaSpec``)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    mamba_type: str = "MAMBA2"  # a ``MambaAttentionBackendEnum`` member name


@dataclass(frozen=True)
class ModelShape:
    """The KV-cache-relevant shape of a model."""

    name: str
    layers: tuple[LayerKind, ...]
    num_kv_heads: int
    head_size: int
    weight_bytes: int
    max_model_len: int = 8192
    dtype: torch.dtype = torch.bfloat16
    description: str = ""
    mamba_state: MambaState | None = None
    #: The Mamba layers' prefill checkpoint alignment, which vLLM's
    #: ``Platform._align_hybrid_block_size`` folds into the attention block's alignment in
    #: cache mode "align" (``get_mamba_prefill_checkpoint_alignment``): 64 for Gated
    #: DeltaNet on FlashInfer's prefill (``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``, vLLM 0.34,
    #: Hopper), 1 for none (Mamba2's checkpoints align to 1 token).
    block_alignment: int = 1

    def attention_block_size(self, block_size: int) -> int:
        """The attention block size vLLM's hybrid config picks: with Mamba layers, the
        smallest multiple of ``lcm(block_size, block_alignment)`` whose attention page holds
        a Mamba state (the state page is then padded to it). The alignment is applied in
        every cache mode (vLLM applies it in "align" only, the mode of prefix caching)."""
        if self.mamba_state is None:
            return block_size
        per_token = 2 * self.num_kv_heads * self.head_size * torch.finfo(self.dtype).bits // 8
        state = self.mamba_state_bytes()
        align = math.lcm(block_size, self.block_alignment)
        return -(-state // (per_token * align)) * align

    def mamba_state_bytes(self) -> int:
        assert self.mamba_state is not None
        total = 0
        for shape, dt in zip(self.mamba_state.shapes, self.mamba_state.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * torch.finfo(dt).bits // 8
        return total

    def kv_bytes_per_token(self) -> int:
        width = torch.finfo(self.dtype).bits // 8
        kv = sum(layer.kind in ("full", "sliding_window", "chunked_local") for layer in self.layers)
        mla = sum(layer.kind in ("mla", "swa_mla") for layer in self.layers)
        return kv * 2 * self.num_kv_heads * self.head_size * width + mla * self.head_size * width


def alternating(n: int, window: int, kind: str = "sliding_window", every: int = 2) -> tuple[LayerKind, ...]:
    """``n`` layers where every ``every``-th layer (from layer ``every - 1``) is full and the
    rest are local of ``kind`` with ``window``."""
    return tuple(LayerKind("full") if i % every == every - 1 else LayerKind(kind, window) for i in range(n))


GiB = 1 << 30
SHAPES: dict[str, ModelShape] = {
    "gemma-2-27b": ModelShape(
        "gemma-2-27b",
        alternating(46, 4096),
        num_kv_heads=16,
        head_size=128,
        weight_bytes=int(54.5 * GiB),
        description="46 layers, sliding window 4096 and full attention alternating, 16 KV heads of 128",
    ),
    "llama-3.1-8b": ModelShape(
        "llama-3.1-8b",
        tuple(LayerKind("full") for _ in range(32)),
        num_kv_heads=8,
        head_size=128,
        weight_bytes=int(16.1 * GiB),
        description="32 full-attention layers, 8 KV heads of 128",
    ),
    "gpt-oss-120b": ModelShape(
        "gpt-oss-120b",
        alternating(36, 128),
        num_kv_heads=8,
        head_size=64,
        weight_bytes=int(65.3 * GiB),
        description="36 layers, 128-token sliding window and full attention alternating, 8 KV heads of 64",
    ),
    "llama-4-scout": ModelShape(
        "llama-4-scout",
        alternating(48, 8192, kind="chunked_local", every=4),
        num_kv_heads=8,
        head_size=128,
        weight_bytes=int(40.0 * GiB),
        max_model_len=16384,
        description="48 layers, chunked local attention (chunk 8192) with every 4th layer full, 8 KV heads of 128",
    ),
    # Qwen3.5 / Qwen3-Next style: 3 Gated DeltaNet layers to 1 full-attention layer (48
    # layers), GDN state of 16 key / 32 value heads of 128 (conv kernel 4), 2 KV heads of 256.
    "qwen3.5-style": ModelShape(
        "qwen3.5-style",
        tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(48)),
        num_kv_heads=2,
        head_size=256,
        weight_bytes=int(28.0 * GiB),
        max_model_len=32768,
        mamba_state=MambaState(
            shapes=((3, 8192), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32), mamba_type="GDN_ATTN"
        ),
        description="48 layers, 3 GDN : 1 full attention (Qwen3.5 / Qwen3-Next), 2 KV heads of 256",
    ),
    # Nemotron-H-8B style: 52 layers, 4 attention, 24 Mamba2 (the rest MLP, no cache).
    "nemotron-h-style": ModelShape(
        "nemotron-h-style",
        tuple(LayerKind("full") if i % 7 == 6 else LayerKind("mamba") for i in range(28)),
        num_kv_heads=8,
        head_size=128,
        weight_bytes=int(16.2 * GiB),
        max_model_len=32768,
        mamba_state=MambaState(shapes=((3, 10240), (128, 64, 128)), dtypes=(torch.bfloat16, torch.float32)),
        description="Mamba2 + attention (Nemotron-H 8B): 24 Mamba2, 4 attention layers, 8 KV heads of 128",
    ),
    # Jamba-1.5-Mini style: 32 layers, one attention layer in 8 (4), the rest Mamba (v1) with
    # an inner width of 8192 (conv kernel 4, state 16), 8 KV heads of 128.
    "jamba-style": ModelShape(
        "jamba-style",
        tuple(LayerKind("full") if i % 8 == 4 else LayerKind("mamba") for i in range(32)),
        num_kv_heads=8,
        head_size=128,
        weight_bytes=int(24.0 * GiB),
        max_model_len=32768,
        mamba_state=MambaState(
            shapes=((3, 8192), (8192, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="MAMBA1"
        ),
        description="32 layers, Mamba (v1) with attention every 8th layer (Jamba 1.5 Mini), 8 KV heads of 128",
    ),
    # LFM2-1.2B style: 16 layers, 10 gated short-convolution blocks (kernel 3, hidden 2048)
    # and 6 grouped-query attention layers, 8 KV heads of 64.
    "lfm2-style": ModelShape(
        "lfm2-style",
        tuple(LayerKind("full") if i in (2, 5, 8, 10, 12, 14) else LayerKind("mamba") for i in range(16)),
        num_kv_heads=8,
        head_size=64,
        weight_bytes=int(2.3 * GiB),
        max_model_len=32768,
        mamba_state=MambaState(shapes=((2, 2048),), dtypes=(torch.bfloat16,), mamba_type="SHORT_CONV"),
        description="16 layers, 10 short convolution : 6 attention (LFM2-1.2B), 8 KV heads of 64",
    ),
    # DeepSeek-V4 style: each of 32 layers has a compressed MLA cache (full attention), a
    # sliding-window MLA cache (128 tokens) and its compressor's circular buffer.
    "deepseek-v4-style": ModelShape(
        "deepseek-v4-style",
        tuple(LayerKind(k, 128 if k == "swa_mla" else 0) for _ in range(32) for k in ("mla", "swa_mla", "ring")),
        num_kv_heads=1,
        head_size=576,
        weight_bytes=int(60.0 * GiB),
        max_model_len=32768,
        description="32 layers, each compressed MLA (full) + sliding-window MLA (128) + compressor ring, latent 576",
    ),
    "mistral-sw": ModelShape(
        "mistral-sw",
        alternating(32, 4096, every=4),
        num_kv_heads=8,
        head_size=128,
        weight_bytes=int(14.5 * GiB),
        description="32 layers, sliding window 4096 with every 4th layer full (Mistral/Ministral style), 8 KV heads of 128",
    ),
}

# The hits bench's shapes (``hybrid-alloc hits --shape``), at the attention block sizes vLLM
# picks for them on a Hopper GPU (:func:`hopper_block_size`).
# Qwen3-Next-80B-A3B (and Qwen3.5 / 3.6 of that layout): 48 layers, every 4th full
# attention with 2 KV heads of 256; Gated DeltaNet with 16 key / 32 value heads of 128 and
# conv kernel 4 (conv state 3 x (2 * 16 * 128 + 32 * 128)), SSM state in the model dtype
# (``mamba_ssm_cache_dtype`` "auto"): 1,097,728 bytes a state, 2,048 a token -> 544.
_QWEN35 = ModelShape(
    "qwen35",
    tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(48)),
    num_kv_heads=2,
    head_size=256,
    weight_bytes=0,
    max_model_len=32768,
    mamba_state=MambaState(
        shapes=((3, 8192), (32, 128, 128)), dtypes=(torch.bfloat16, torch.bfloat16), mamba_type="GDN_ATTN"
    ),
    description="48 layers, 3 Gated DeltaNet : 1 full attention (Qwen3-Next / 3.5 / 3.6), 2 KV heads of 256",
)
SHAPES.update(
    {
        # Sliding window 1024 with every 6th layer full (8 of the 48).
        "gemma3": ModelShape(
            "gemma3",
            alternating(48, 1024, every=6),
            num_kv_heads=8,
            head_size=128,
            weight_bytes=0,
            description="48 layers, sliding window 1024 with every 6th layer full (Gemma-3 style)",
        ),
        "qwen35": _QWEN35,
        # Nemotron-H 8B: 24 Mamba2 layers (128 heads of 64, state 128, 8 groups: conv state
        # 3 x 10240), 4 attention layers of 8 KV heads of 128; vLLM sets its SSM cache dtype to
        # float32 (``NemotronHForCausalLMConfig``): 4,255,744 bytes a state, 4,096 a token -> 1040.
        "nemotronh": dataclasses.replace(SHAPES["nemotron-h-style"], name="nemotronh"),
        # Issue 30's Hopper block sizes, derived as above with vLLM 0.34's checkpoint alignment
        # (``ModelShape.block_alignment``; each matches the size the issue measured).
        # Qwen3-Next-80B-A3B: qwen35's layout and state (SSM state in bfloat16), FlashInfer's GDN
        # prefill checkpoints align to 64: 1,097,728 / 2,048 = 536 -> 576.
        "qwen3next": dataclasses.replace(
            _QWEN35,
            name="qwen3next",
            block_alignment=64,
            description="48 layers, 3 Gated DeltaNet : 1 full attention (Qwen3-Next-80B-A3B), 2 KV heads of 256, 576-token blocks",
        ),
        # Qwen3.6-35B-A3B (Qwen3.5 layout): 40 layers, every 4th full attention (2 KV heads of
        # 256), the same GDN heads; its config's ``mamba_ssm_dtype`` float32 (vLLM's
        # ``Qwen3_5ForConditionalGenerationConfig``): 2,146,304 bytes a state -> 1048 -> 1088.
        "qwen36": ModelShape(
            "qwen36",
            tuple(LayerKind("full") if i % 4 == 3 else LayerKind("mamba") for i in range(40)),
            num_kv_heads=2,
            head_size=256,
            weight_bytes=0,
            max_model_len=32768,
            mamba_state=MambaState(
                shapes=((3, 8192), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32), mamba_type="GDN_ATTN"
            ),
            block_alignment=64,
            description="40 layers, 3 Gated DeltaNet : 1 full attention (Qwen3.6-35B-A3B), float32 SSM state, 1088-token blocks",
        ),
        # Nemotron-3-Nano-30B-A3B: 23 Mamba2 layers (64 heads of 64, state 128, 8 groups: conv
        # state 3 x 6144), 6 attention layers of 2 KV heads of 128 (the other 23 layers are MoE,
        # no cache); SSM state in float32: 2,134,016 bytes a state, 1,024 a token -> 2084 -> 2096.
        "nemotron3nano": ModelShape(
            "nemotron3nano",
            tuple(LayerKind("full") if i in (4, 9, 14, 19, 24, 28) else LayerKind("mamba") for i in range(29)),
            num_kv_heads=2,
            head_size=128,
            weight_bytes=0,
            max_model_len=32768,
            mamba_state=MambaState(shapes=((3, 6144), (64, 64, 128)), dtypes=(torch.bfloat16, torch.float32)),
            description="23 Mamba2 + 6 attention layers (Nemotron-3-Nano-30B-A3B), 2 KV heads of 128, 2096-token blocks",
        ),
        # Falcon-H1-7B (issue 37's capacity bench): 44 decoder layers, each an attention and a
        # Mamba2 mixer side by side (listed here as 88 cache layers: one attention group of 44
        # and one Mamba2 group of 44); 2 KV heads of 128; Mamba2 conv state 3 x 3584 and SSM
        # state 24 heads x 128 x 256, both bfloat16: 1,594,368 bytes a state, 1,024 a token
        # -> 1557 -> 1568-token blocks.
        "falconh1": ModelShape(
            "falconh1",
            tuple(LayerKind("mamba") if i % 2 == 0 else LayerKind("full") for i in range(88)),
            num_kv_heads=2,
            head_size=128,
            weight_bytes=0,
            max_model_len=32768,
            mamba_state=MambaState(shapes=((3, 3584), (24, 128, 256)), dtypes=(torch.bfloat16, torch.bfloat16)),
            description="44 layers, each attention and Mamba2 side by side (Falcon-H1-7B), 2 KV heads of 128, 1568-token blocks",
        ),
    }
)

#: Other names a bench takes for a shape of :data:`SHAPES` (alias -> name). A row is labelled
#: with the shape's own name: ``hybrid-alloc hits --shape gptoss`` rows say ``gpt-oss-120b``.
ALIASES: dict[str, str] = {"gptoss": "gpt-oss-120b"}


def by_name(name: str) -> ModelShape:
    """The shape called ``name`` or, through :data:`ALIASES`, another name for it.

    # Errors
    ``KeyError`` for a name that is neither."""
    return SHAPES[ALIASES.get(name, name)]


#: The kernel block alignment of vLLM's FlashAttention backend on a Hopper GPU
#: (``FlashAttentionBackend.get_supported_kernel_block_sizes``: ``[MultipleOf(16)]`` for
#: FA3, which Hopper runs for these head sizes).
HOPPER_KERNEL_BLOCK = 16


def hopper_block_size(shape: ModelShape) -> int:
    """The attention block size vLLM picks for a Mamba hybrid on a Hopper GPU: vLLM's
    ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``, called from
    ``update_block_size_for_backend`` once the attention backend is known) with the
    FlashAttention backend's kernel block alignment (:data:`HOPPER_KERNEL_BLOCK`):
    ``attn_block_size = align * cdiv(mamba_page_size, align * attn_page_size_1_token)``,
    then rounded up to every backend's alignment (the same 16 here), so one attention page
    holds one Mamba state; in cache mode "align" the alignment is also a multiple of the Mamba
    layers' prefill checkpoint alignment (``ModelShape.block_alignment``: 64 for Gated DeltaNet
    on FlashInfer, vLLM 0.34). The default block size (16) for a shape without Mamba layers."""
    if shape.mamba_state is None:
        return 16
    # max(kernel alignment, cache_config.block_size), then (cache mode "align") a multiple of
    # the Mamba layers' prefill checkpoint alignment.
    align = math.lcm(max(HOPPER_KERNEL_BLOCK, 16), shape.block_alignment)
    attn_page_1_token = 2 * shape.num_kv_heads * shape.head_size * torch.finfo(shape.dtype).bits // 8
    mamba_page = shape.mamba_state_bytes()
    bs = align * -(-mamba_page // (align * attn_page_1_token))
    return HOPPER_KERNEL_BLOCK * -(-bs // HOPPER_KERNEL_BLOCK)
