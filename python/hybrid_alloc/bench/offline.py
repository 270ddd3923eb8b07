"""Builds vLLM's real ``Scheduler`` (the installed supported release's) offline (no GPU, no hub) for a model
shape, with vLLM's own manager, ours, or "no hybrid allocation", and drives it with
fabricated model outputs. Used by ``hybrid-alloc bench``, ``hybrid-alloc hits`` and by the tests.

A model shape (:mod:`hybrid_alloc.bench.shapes`, the one registry: ``SHAPES``; this module
re-exports its ``LayerKind``, ``MambaState``, ``ModelShape`` and ``SHAPES``, so a test that
builds a scheduler imports one module) is a list of per-layer attention kinds; the model folder
handed to vLLM's ``ModelConfig`` holds only a ``config.json`` (a Llama-style stub: the scheduler
reads nothing from it but the context length), and the KV cache specs are built here from the
shape (:func:`kv_cache_specs`), then grouped and sized by vLLM's own planner (``get_kv_cache_groups``,
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
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

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
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hybrid_alloc.bench.shapes import SHAPES, LayerKind, MambaState, ModelShape
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


def admission_options_error(command: str, windows: list[int], threshold: float | None) -> str | None:
    """The one line ``hybrid-alloc COMMAND`` refuses its ``--admission-window`` /
    ``--admission-threshold`` with (a negative window; either option on a vLLM without
    :data:`CACHE_AWARE_ADMISSION`), or None when they can run. Shared by ``bench`` and ``hits``."""
    if any(w < 0 for w in windows):
        return f"hybrid-alloc {command}: --admission-window takes a window of 0 or more requests"
    if (any(windows) or threshold is not None) and not CACHE_AWARE_ADMISSION:
        return (
            f"hybrid-alloc {command}: this vLLM has no cache-aware admission "
            "(SchedulerConfig.cache_aware_admission_window, vLLM 0.34); drop --admission-window/--admission-threshold"
        )
    return None


def kv_cache_specs(
    shape: ModelShape,
    block_size: int,
    no_hybrid: bool = False,
    mamba_cache_mode: str = "align",
    num_speculative_blocks: int = 0,
) -> dict[str, KVCacheSpec]:
    """vLLM's layer specs for ``shape``; ``num_speculative_blocks`` is what Mamba layers get
    from a speculative config (vLLM's ``num_speculative_tokens``, for every method)."""
    specs: dict[str, KVCacheSpec] = {}
    block_size = shape.attention_block_size(block_size)
    for i, layer in enumerate(shape.layers):
        common = dict(
            block_size=block_size, num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, dtype=shape.dtype
        )
        spec: KVCacheSpec
        if layer.kind == "mamba":
            # Mamba layers stay Mamba layers even without the hybrid manager (vLLM
            # cannot serve their state as attention).
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

            ms = shape.mamba_state
            assert ms is not None, f"{shape.name}: a mamba layer needs ModelShape.mamba_state"
            page = FullAttentionSpec(**common).page_size_bytes
            # vLLM's MambaMixer2 (every MAMBA2 layer) always adds one prefill checkpoint
            # block of alignment 1 to its spec (``get_kv_cache_spec``); the managers act
            # on it in cache mode "align" only.
            mixer2 = ms.mamba_type == "MAMBA2"
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                block_size=block_size if mamba_cache_mode == "align" else shape.max_model_len,
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
            mla = dict(block_size=block_size, num_kv_heads=1, head_size=shape.head_size, dtype=shape.dtype)
            if layer.kind == "mla" or (no_hybrid and layer.kind == "swa_mla"):
                spec = MLAAttentionSpec(**mla)
            elif layer.kind == "swa_mla":
                replay = {"bounded_replay": True} if layer.bounded_replay else {}
                spec = SlidingWindowMLASpec(**mla, sliding_window=layer.window, **replay)
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
        specs = kv_cache_specs(
            self.shape,
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


def make_request(
    sched: Scheduler,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    kv_hints: KvHintsEnvelope | None = None,
    extra_args: dict[str, Any] | None = None,
) -> Request:
    """A vLLM Request hashed with the scheduler's block hasher; ``kv_hints``: vLLM's envelope
    (``Request.kv_hints``, as ``LLMEngine.add_request(..., kv_hints=)`` sets it);
    ``extra_args``: ``SamplingParams.extra_args`` (as the OpenAI server fills it from
    ``vllm_xargs``)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args),
        pooling_params=None,
        block_hasher=sched._hybrid_alloc_block_hasher,
        kv_hints=kv_hints,
    )


def hints_envelope(message_id: str, actions: list[tuple[str, dict[str, Any]]]) -> KvHintsEnvelope:
    """vLLM's ``KvHintsEnvelope`` holding ``actions`` (``(action_type, payload)``, version "1"
    of hybrid_alloc's vocabulary: docs/hit-aware.md)."""
    return KvHintsEnvelope(
        protocol_version="1",
        message_id=message_id,
        actions=[
            KvHintAction(action_id=f"{message_id}-{i}", action_type=t, action_version="1", payload=p)
            for i, (t, p) in enumerate(actions)
        ],
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


def hint_counters(mgr: Any) -> dict[str, Any] | None:
    """Our manager's KV hint counters (``HybridKVCacheManager.hint_stats()``: ``received``,
    ``applied``, ``refused`` and ``refused.<kind>``, ``expired``, ``ignored``, and the core's
    counters and gauges: ``leased_free_blocks``, ``retained_blocks``, ...), or None for a
    manager without them (vLLM's own)."""
    stats = getattr(mgr, "hint_stats", None)
    return None if stats is None else dict(stats())


def pins_held(counters: dict[str, Any] | None) -> int:
    """The blocks pins and retains hold now, from :func:`hint_counters`: the free blocks at the
    leased level and the blocks the running retains hold (0 without counters)."""
    if not counters:
        return 0
    return int(counters.get("leased_free_blocks", 0)) + int(counters.get("retained_blocks", 0))


__all__ = [
    "CACHE_AWARE_ADMISSION",
    "SHAPES",
    "LayerKind",
    "MambaState",
    "ModelShape",
    "SchedulerSetup",
    "fabricate_output",
    "hint_counters",
    "hints_envelope",
    "pins_held",
    "kv_cache_specs",
    "make_request",
]
