"""Builds vLLM's real ``Scheduler`` (the installed supported release's) offline (no GPU, no hub) for a model
shape, with vLLM's own manager, ours, or "no hybrid allocation", and drives it with
fabricated model outputs. Used by ``hybrid-alloc bench`` and by the tests.

A model shape is a list of per-layer attention kinds; the model folder handed to vLLM's
``ModelConfig`` holds only a ``config.json`` (a Llama-style stub: the scheduler reads
nothing from it but the context length), and the KV cache specs are built here from the
shape, then grouped and sized by vLLM's own planner (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``: ``vllm.v1.core.kv_cache_utils`` in 0.32,
``vllm.v1.core.kv_cache_planning`` from 0.33).

What a machine without a GPU needs (both releases): ``DeviceConfig(device="cpu")`` (the
CUDA wheel of 0.33 cannot infer a device there), and the hybrid manager switched back on
after ``VllmConfig(...)`` (a platform without hybrid KV cache support turns it off, which
would merge local-attention layers into full attention). The model folder is local: no
hub access happens, so nothing here sets ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hybrid_alloc.vllm.compat import (
    config_hash_lookahead_tokens,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)

ManagerName = Literal["vllm", "hybrid_alloc", "no_hybrid"]

#: Whether the installed vLLM has cache-aware admission (0.34: ``SchedulerConfig``'s
#: ``cache_aware_admission_window`` and ``cache_aware_admission_threshold``; the scheduler
#: then reorders its waiting queue by ``KVCacheManager.get_num_cached_tokens``). Probe: the
#: config's fields.
CACHE_AWARE_ADMISSION: bool = "cache_aware_admission_window" in {f.name for f in dataclasses.fields(SchedulerConfig)}


@dataclass(frozen=True)
class LayerKind:
    """One layer's cache: ``kind`` is "full", "sliding_window", "chunked_local", "rswa"
    (reference sliding window attention, ``window`` its ``rswa_window``), "mamba" (a Mamba /
    linear-attention state layer, shaped by ``ModelShape.mamba_state``), or one of
    DeepSeek-V4's: "mla" (compressed MLA, full attention), "swa_mla" (sliding-window MLA,
    ``window`` tokens) and "ring" (the compressor's circular buffer, one block per request)."""

    kind: str
    window: int = 0


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

    def kv_cache_specs(
        self,
        block_size: int,
        no_hybrid: bool = False,
        mamba_cache_mode: str = "align",
        num_speculative_blocks: int = 0,
    ) -> dict[str, KVCacheSpec]:
        """vLLM's layer specs; ``num_speculative_blocks`` is what Mamba layers get from a
        speculative config (vLLM's ``num_speculative_tokens``, for every method)."""
        specs: dict[str, KVCacheSpec] = {}
        block_size = self.attention_block_size(block_size)
        for i, layer in enumerate(self.layers):
            common = dict(
                block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size, dtype=self.dtype
            )
            spec: KVCacheSpec
            if layer.kind == "mamba":
                # Mamba layers stay Mamba layers even without the hybrid manager (vLLM
                # cannot serve their state as attention).
                from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

                ms = self.mamba_state
                assert ms is not None, f"{self.name}: a mamba layer needs ModelShape.mamba_state"
                page = FullAttentionSpec(**common).page_size_bytes
                # vLLM's MambaMixer2 (every MAMBA2 layer) always adds one prefill checkpoint
                # block of alignment 1 to its spec (``get_kv_cache_spec``); the managers act
                # on it in cache mode "align" only.
                mixer2 = ms.mamba_type == "MAMBA2"
                specs[f"model.layers.{i}.mixer"] = MambaSpec(
                    block_size=block_size if mamba_cache_mode == "align" else self.max_model_len,
                    shapes=ms.shapes,
                    dtypes=ms.dtypes,
                    page_size_padded=page,
                    mamba_type=MambaAttentionBackendEnum[ms.mamba_type],
                    mamba_cache_mode=mamba_cache_mode,
                    num_speculative_blocks=num_speculative_blocks,
                    num_prefill_checkpoint_blocks=1 if mixer2 else 0,
                    prefill_checkpoint_alignment=1 if mixer2 else None,
                )
                continue
            if layer.kind in ("mla", "swa_mla", "ring"):
                # DeepSeek-V4: one latent vector per token (no K/V pair), padded to 576.
                mla = dict(block_size=block_size, num_kv_heads=1, head_size=self.head_size, dtype=self.dtype)
                if layer.kind == "mla" or (no_hybrid and layer.kind == "swa_mla"):
                    spec = MLAAttentionSpec(**mla)
                elif layer.kind == "swa_mla":
                    spec = SlidingWindowMLASpec(**mla, sliding_window=layer.window)
                else:
                    spec = CircularBufferSpec(**{**mla, "block_size": 8})
                specs[f"model.layers.{i}.{layer.kind}"] = spec
                continue
            if layer.kind == "full" or no_hybrid:
                spec = FullAttentionSpec(**common)
            elif layer.kind == "sliding_window":
                spec = SlidingWindowSpec(**common, sliding_window=layer.window)
            elif layer.kind == "chunked_local":
                spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=layer.window)
            elif layer.kind == "rswa":
                # Reference sliding window attention (Unlimited-OCR): ``window`` is rswa_window.
                from vllm.v1.kv_cache_interface import RSWASpec

                spec = RSWASpec(**common, rswa_window=layer.window)
            else:
                raise ValueError(f"unknown layer kind {layer.kind!r}")
            specs[f"model.layers.{i}.self_attn.attn"] = spec
        return specs

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


_STUB_DIRS: dict[tuple[int, int], str] = {}


def stub_model_dir(max_model_len: int, num_kv_heads: int = 2) -> str:
    """A folder holding only a Llama-style ``config.json`` (cached per context length and
    KV head count; one KV head lets vLLM's config checks allow decode context parallelism
    4 with tensor parallelism 4 on both releases)."""
    key = (max_model_len, num_kv_heads)
    if key in _STUB_DIRS:
        return _STUB_DIRS[key]
    d = tempfile.mkdtemp(prefix="hybrid_alloc_stub_")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": num_kv_heads,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    _STUB_DIRS[key] = d
    return d


@contextmanager
def scheduler_manager(name: ManagerName) -> Iterator[None]:
    """Makes ``Scheduler`` build the named manager while the block runs."""
    from hybrid_alloc.vllm import plugin

    if name == "hybrid_alloc":
        if not plugin.apply():
            raise RuntimeError("hybrid_alloc: the plugin could not patch vLLM's scheduler (see the log line above)")
        try:
            yield
        finally:
            plugin.remove()
    else:
        plugin.remove()
        yield


@dataclass
class SchedulerSetup:
    """Everything needed to build a real vLLM Scheduler for one run."""

    shape: ModelShape
    manager: ManagerName = "vllm"
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    kv_events: bool = False
    # KV heads of the stub model's ``config.json`` (vLLM's parallelism checks read them).
    stub_kv_heads: int = 2
    # More ``VllmConfig`` arguments (e.g. ``speculative_config``).
    extra: dict[str, Any] = field(default_factory=dict)
    # Cache-aware admission (vLLM 0.34, :data:`CACHE_AWARE_ADMISSION`): the scheduler's
    # ``cache_aware_admission_window`` (0: off, vLLM's default) and
    # ``cache_aware_admission_threshold`` (None: vLLM's default, 0.5). Asking for a window
    # on a release without the option raises ``ValueError``.
    admission_window: int = 0
    admission_threshold: float | None = None
    # vLLM's ``CacheConfig.prefix_match_unit`` (``--prefix-match-unit``, 0.32+): block hashes
    # every this many tokens, and sub-block hits for Mamba "align" groups; None: unset (the
    # hash block is then the GCD of the groups' block sizes).
    prefix_match_unit: int | None = None

    def admission_kwargs(self) -> dict[str, Any]:
        """The ``SchedulerConfig`` arguments of the cache-aware admission asked for."""
        if not self.admission_window and self.admission_threshold is None:
            return {}
        if not CACHE_AWARE_ADMISSION:
            raise ValueError("this vLLM has no cache-aware admission (SchedulerConfig.cache_aware_admission_window)")
        kw: dict[str, Any] = {"cache_aware_admission_window": self.admission_window}
        if self.admission_threshold is not None:
            kw["cache_aware_admission_threshold"] = self.admission_threshold
        return kw

    def vllm_config(self) -> VllmConfig:
        mml = self.shape.max_model_len
        mc = ModelConfig(
            model=stub_model_dir(mml, self.stub_kv_heads),
            tokenizer=None,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            max_model_len=mml,
        )
        sc = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=mml,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=self.async_scheduling,
            **self.admission_kwargs(),
        )
        kwargs: dict[str, Any] = dict(self.extra)
        if self.kv_events:
            kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        vc = VllmConfig(
            model_config=mc,
            scheduler_config=sc,
            cache_config=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching),
            device_config=DeviceConfig(device="cpu"),
            **kwargs,
        )
        # EngineCore resolves the layout before planning; the planner needs it set.
        vc.cache_config.kv_cache_layout = "LBHNC"
        # Set before the scheduler is built: ``resolve_kv_cache_block_sizes`` turns it into
        # the hash block size the scheduler and its manager are built with.
        vc.cache_config.prefix_match_unit = self.prefix_match_unit
        # A platform without hybrid KV cache support (0.33's CUDA wheel on a GPU-less
        # machine) turned the hybrid manager off; say again what this run asks for. A KV
        # connector that does not support the hybrid manager (ExampleConnector) turns it off
        # as vLLM's config does: ``get_kv_cache_groups`` then makes one unified group.
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        ktc = vc.kv_transfer_config
        vc.scheduler_config.disable_hybrid_kv_cache_manager = self.manager == "no_hybrid" or (
            ktc is not None and ktc.kv_connector is not None and not KVConnectorFactory.supports_hma_config(ktc)
        )
        # vLLM's CPU platform turns async scheduling off; put back what was asked for.
        vc.scheduler_config.async_scheduling = self.async_scheduling
        if self.shape.mamba_state is not None:
            # What vLLM's hybrid model config does for a Mamba hybrid: the attention block
            # grows to hold a state page; prefix caching means Mamba cache mode "align"
            # with Mamba blocks of the attention block size, no caching mode "none".
            bs = self.shape.attention_block_size(self.block_size)
            cc = vc.cache_config
            cc.block_size = bs
            cc.mamba_cache_mode = "align" if self.enable_prefix_caching else "none"
            cc.mamba_block_size = bs if self.enable_prefix_caching else self.shape.max_model_len
        return vc

    def kv_cache_config(self, vc: VllmConfig) -> KVCacheConfig:
        specs = self.shape.kv_cache_specs(
            self.block_size,
            no_hybrid=self.manager == "no_hybrid",
            mamba_cache_mode="align" if self.enable_prefix_caching else "none",
            num_speculative_blocks=vc.num_speculative_tokens,
        )
        groups = get_kv_cache_groups(vc, specs)
        if self.num_blocks is not None:
            probe = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
            per_block = (1 << 40) // probe.num_blocks
            budget = per_block * self.num_blocks
        else:
            assert self.kv_budget_bytes is not None
            budget = self.kv_budget_bytes
        return get_kv_cache_config_from_groups(vc, groups, budget)

    def build(self) -> Scheduler:
        """The Scheduler, with the manager named by ``manager``."""
        with scheduler_manager(self.manager):
            return self.build_with_installed_manager()

    def build_with_installed_manager(self) -> Scheduler:
        """The Scheduler, with whatever manager vLLM's scheduler module names now (vLLM's
        own, or what the plugin installed); ``manager`` only chooses the KV cache specs
        ("no_hybrid": all full attention)."""
        vc = self.vllm_config()
        kvc = self.kv_cache_config(vc)
        vc.cache_config.num_gpu_blocks = kvc.num_blocks
        sbs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
        # What the engine core resolves into the scheduler's config (all three releases): a KV
        # connector's scheduler side reads them (0.34's NixlConnector producer asserts the
        # hash block size when it truncates a request's hashes).
        kvc.hash_block_size = hbs
        kvc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kvc, vc, sbs, hbs)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        sched = cls(
            vllm_config=vc,
            kv_cache_config=kvc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=sbs,
            hash_block_size=hbs,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        # 0.33: with EAGLE-style speculative decoding, hashes lag by the lookahead tokens.
        lookahead = config_hash_lookahead_tokens(vc)
        hasher = (
            get_request_block_hasher(hbs, hash_fn, lookahead) if lookahead else get_request_block_hasher(hbs, hash_fn)
        )
        sched._hybrid_alloc_block_hasher = hasher
        return sched


def make_request(sched: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    """A vLLM Request hashed with the scheduler's block hasher."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=sched._hybrid_alloc_block_hasher,
    )


def fake_token(req_id: str, position: int, vocab: int = 32000) -> int:
    """A deterministic "sampled" token, equal across runs."""
    return (hash((req_id, position)) & 0x7FFFFFFF) % (vocab - 1) + 1


_OUTPUT_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def fabricate_output(sched: Scheduler, so: Any) -> ModelRunnerOutput:
    """The model output of a step: one token for each request whose prompt is done."""
    ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([fake_token(rid, req.num_tokens)] if done else [])
    # vLLM 0.34 indexes the output by ``req_ids`` and dropped ``req_id_to_index``.
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if _OUTPUT_HAS_INDEX else {}
    return ModelRunnerOutput(
        req_ids=ids,
        **index,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


__all__ = [
    "CACHE_AWARE_ADMISSION",
    "SHAPES",
    "LayerKind",
    "MambaState",
    "ModelShape",
    "SchedulerSetup",
    "fabricate_output",
    "make_request",
]
