"""Builds the installed vLLM's (a supported release's) own KVCacheManager and ours from one
KVCacheConfig, and real vLLM Requests (with vLLM's own block hasher) to drive them with. Used
by the parity tests and the pytest-benchmark benches; never an imitation of vLLM: every
object here is vLLM's.

On 0.33 the managers get every argument 0.33's ``Scheduler`` passes
(``num_hash_lookahead_tokens`` too), and a setup may ask for lookahead block hashes (EAGLE
with prefix caching on 0.33: requests hashed with the lookahead hasher, ``use_eagle=False``,
the draft group flagged ``is_eagle_group``)."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from hybrid_alloc.vllm.manager import HybridKVCacheManager  # noqa: E402

_HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(_HASH_FN)

# vLLM 0.33's manager takes lookahead block hashes and a hit bound in get_computed_blocks.
HAVE_LOOKAHEAD_HASHES = "num_hash_lookahead_tokens" in inspect.signature(KVCacheManager).parameters
HAVE_MAX_CACHE_HIT_LENGTH = "max_cache_hit_length" in inspect.signature(KVCacheManager.get_computed_blocks).parameters


def full(bs: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def mla(bs: int = 16) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def swa(window: int, bs: int = 16, num_kv_heads: int = 8, extra_retained_tokens: int = 0) -> SlidingWindowSpec:
    """``extra_retained_tokens``: what vLLM's planner sets with multi-module MTP
    (``num_prefill_lookahead_tokens - 1``)."""
    return SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=num_kv_heads,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=window,
        extra_retained_tokens=extra_retained_tokens,
    )


def chunked(chunk: int, bs: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, attention_chunk_size=chunk
    )


@dataclass
class Setup:
    """One configuration of the differential tests."""

    name: str
    specs: list[Any]
    num_blocks: int
    enable_caching: bool = True
    hash_block_size: int = 16
    scheduler_block_size: int = 16
    max_model_len: int = 4096
    max_in_flight_tokens: int = 2048
    watermark: float = 0.0
    retention_interval: int | None = 0
    # Lookahead block hashes (vLLM 0.33 only): tokens after each block its hash covers;
    # ``eagle_groups`` are flagged ``is_eagle_group`` (the draft model's layers).
    lookahead: int = 0
    eagle_groups: tuple[int, ...] = ()
    # What vLLM's Scheduler passes as num_prefill_lookahead (1 for EAGLE-family drafters).
    prefill_lookahead: int = 0
    # What vLLM's Scheduler passes as ``use_eagle``: the EAGLE/MTP prefix-cache block drop
    # (0.32 with prefix caching; 0.33 with ``disable_lookahead_block_hashes`` too).
    use_eagle: bool = False
    # Decode context parallelism: what the Scheduler passes as ``dcp_world_size``
    # (``hash_block_size`` / ``scheduler_block_size`` then come from the DCP-scaled sizes).
    dcp: int = 1
    # Whether the trace gives some requests ``kv_cache_report_mode="full"`` (vLLM's own
    # event code asserts on their hits under DCP, a test of its own covers that).
    report_full: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Whether the installed vLLM has this setup: lookahead hashes exist from 0.33 on."""
        return not self.lookahead or HAVE_LOOKAHEAD_HASHES

    def kv_cache_config(self) -> KVCacheConfig:
        groups = [
            KVCacheGroupSpec([f"layer.{i}"], s, is_eagle_group=i in self.eagle_groups) for i, s in enumerate(self.specs)
        ]
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=self.retention_interval,
        )

    def manager_kwargs(self, events: bool = True) -> dict[str, Any]:
        """The arguments the installed release's ``Scheduler`` passes."""
        la: dict[str, Any] = {"num_hash_lookahead_tokens": self.lookahead} if HAVE_LOOKAHEAD_HASHES else {}
        return dict(
            kv_cache_config=self.kv_cache_config(),
            max_model_len=self.max_model_len,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            max_in_flight_tokens=self.max_in_flight_tokens,
            enable_caching=self.enable_caching,
            use_eagle=self.use_eagle,
            **la,
            num_prefill_lookahead=self.prefill_lookahead,
            log_stats=True,
            enable_kv_cache_events=events,
            dcp_world_size=self.dcp,
            pcp_world_size=1,
            metrics_collector=None,
            watermark=self.watermark,
            enable_mamba_shared_prefix_checkpoint=False,
        )

    def build(self, events: bool = True) -> tuple[KVCacheManager, HybridKVCacheManager]:
        ref = KVCacheManager(**self.manager_kwargs(events))
        ours = HybridKVCacheManager(**self.manager_kwargs(events))
        assert type(ours) is HybridKVCacheManager, f"{self.name}: fell back to vLLM's manager"
        return ref, ours

    def make_request(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int = 64,
        report_full: bool = False,
        **sampling: Any,
    ) -> Request:
        """A vLLM Request; ``report_full`` sets ``kv_cache_report_mode="full"`` (reused
        prefix blocks are reported in BlockStored events too); ``sampling``: more
        ``SamplingParams`` arguments (e.g. 0.34's ``prompt_logprobs`` with
        ``prompt_logprob_start``, which bound the request's prefix-cache hit)."""
        extra = {"kv_cache_report_mode": "full"} if report_full else None
        la = (self.lookahead,) if self.lookahead else ()
        return Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra, **sampling),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.hash_block_size, _HASH_FN, *la),
        )


SETUPS: list[Setup] = [
    Setup("full_bs16", [full(16)], num_blocks=300),
    Setup("full_swa_bs16", [full(16), swa(64, 16)], num_blocks=400),
    Setup("swa_only_bs16", [swa(48, 16)], num_blocks=200),
    Setup("full_chunked_bs16", [full(16), chunked(64, 16)], num_blocks=400),
    Setup("mla_bs16", [mla(16)], num_blocks=300),
    Setup("full_swa_bs32", [full(32), swa(96, 32)], num_blocks=240, hash_block_size=32, scheduler_block_size=32),
    Setup("full_swa_nocache_bs16", [full(16), swa(64, 16)], num_blocks=400, enable_caching=False),
    Setup(
        "full_only_nocache_bs32",
        [full(32)],
        num_blocks=200,
        enable_caching=False,
        hash_block_size=32,
        scheduler_block_size=32,
    ),
    Setup("gemma3_full_swa_swa_bs16", [full(16), swa(80, 16), swa(80, 16)], num_blocks=500, watermark=0.02),
    Setup("full_swa_dense_retention", [full(16), swa(40, 16)], num_blocks=400, retention_interval=None),
    Setup("full_swa_retention_64", [full(16), swa(40, 16)], num_blocks=400, retention_interval=64),
    Setup(
        "swa_bs32_over_full_bs16", [full(16), swa(64, 32)], num_blocks=500, hash_block_size=16, scheduler_block_size=32
    ),
    # Full attention's block over the hash block (vLLM's planner doubles the block of the
    # layers with half the page: here global layers with half the KV heads of the window's):
    # the prompt's last hash boundary inside its block is keyed (partial-block prefix entries).
    Setup(
        "full_bs32_over_swa_bs16",
        [full(32), swa(64, 16, num_kv_heads=16)],
        num_blocks=400,
        hash_block_size=16,
        scheduler_block_size=32,
    ),
    # EAGLE with prefix caching on vLLM 0.33: lookahead block hashes (one token), the draft
    # layers' group flagged, nothing dropped; events carry lookahead_token_ids.
    Setup(
        "eagle_lookahead_full_swa_bs16",
        [full(16), swa(64, 16), full(16)],
        num_blocks=500,
        lookahead=1,
        eagle_groups=(2,),
        prefill_lookahead=1,
    ),
    # DFlash/DSpark on vLLM 0.33: draft layers flagged, no block drop, no lookahead hashes
    # (on 0.32 the flagged group drops its last hit block: the EAGLE drop below).
    Setup("dflash_full_swa_bs16", [full(16), swa(64, 16)], num_blocks=400, eagle_groups=(0,), prefill_lookahead=1),
    # The EAGLE/MTP prefix-cache block drop (``use_eagle``): EAGLE/MTP with prefix caching on
    # 0.32, with ``disable_lookahead_block_hashes`` on 0.33 and 0.34.
    Setup("eagle_drop_full_bs16", [full(16)], num_blocks=300, use_eagle=True, prefill_lookahead=1),
    # The draft layers' group has the target's full-attention spec: both drop (one spec group).
    Setup(
        "eagle_drop_full_swa_draft_bs16",
        [full(16), swa(64, 16), full(16)],
        num_blocks=500,
        eagle_groups=(2,),
        use_eagle=True,
        prefill_lookahead=1,
    ),
    # No group flagged: every group drops, the sliding window matching one block further.
    Setup("eagle_drop_full_swa_bs16", [full(16), swa(64, 16)], num_blocks=400, use_eagle=True, prefill_lookahead=1),
    Setup(
        "eagle_drop_swa_bs32_over_full_bs16",
        [full(16), swa(64, 32)],
        num_blocks=500,
        hash_block_size=16,
        scheduler_block_size=32,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    # The drop over partial-block prefix entries: a dropping full-attention group keys the
    # prompt's last hash boundary up to the whole prompt (vLLM's ``use_eagle`` token limit).
    Setup(
        "eagle_drop_full_bs32_over_swa_bs16",
        [full(32), swa(64, 16, num_kv_heads=16)],
        num_blocks=400,
        hash_block_size=16,
        scheduler_block_size=32,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "eagle_drop_full_swa_dense_retention",
        [full(16), swa(40, 16)],
        num_blocks=400,
        retention_interval=None,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "eagle_drop_full_swa_retention_64",
        [full(16), swa(40, 16)],
        num_blocks=400,
        retention_interval=64,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup("eagle_drop_swa_only_bs16", [swa(48, 16)], num_blocks=200, use_eagle=True, prefill_lookahead=1),
    # Prefix caching off: vLLM's no-prefix-cache coordinator reads none of the drop.
    # Multi-module MTP (DeepSeek-V3-style heads drafting several tokens): the drafter reads
    # ``num_prefill_lookahead`` prefill tokens past a chunk, so the last ``- 1`` computed
    # tokens are not final (vLLM's ``num_reprefillable_tokens``). With prefix caching on
    # 0.33/0.34: lookahead block hashes over as many tokens, nothing dropped; one group leaves
    # the re-prefillable tokens out of its cache target, a hybrid's groups do not. vLLM's
    # planner keeps ``- 1`` more tokens in each sliding window (``extra_retained_tokens``).
    Setup("mtp3_lookahead_full_bs16", [full(16)], num_blocks=300, lookahead=3, eagle_groups=(0,), prefill_lookahead=3),
    Setup(
        "mtp3_lookahead_full_swa_bs16",
        [full(16), swa(64, 16, extra_retained_tokens=2), full(16)],
        num_blocks=500,
        lookahead=3,
        eagle_groups=(2,),
        prefill_lookahead=3,
    ),
    # With the drop (0.32 with prefix caching; 0.33/0.34 with ``disable_lookahead_block_hashes``):
    # a dropping group's cache limit comes from the finalized tokens.
    Setup("mtp3_drop_full_bs16", [full(16)], num_blocks=300, use_eagle=True, prefill_lookahead=3),
    Setup(
        "mtp2_drop_full_swa_draft_bs16",
        [full(16), swa(64, 16, extra_retained_tokens=1), full(16)],
        num_blocks=500,
        eagle_groups=(2,),
        use_eagle=True,
        prefill_lookahead=2,
    ),
    Setup(
        "mtp3_drop_swa_bs32_over_full_bs16",
        [full(16), swa(64, 32, extra_retained_tokens=2)],
        num_blocks=500,
        hash_block_size=16,
        scheduler_block_size=32,
        use_eagle=True,
        prefill_lookahead=3,
    ),
    Setup(
        "mtp3_drop_full_swa_retention_64",
        [full(16), swa(40, 16, extra_retained_tokens=2)],
        num_blocks=400,
        retention_interval=64,
        use_eagle=True,
        prefill_lookahead=3,
    ),
    Setup(
        "mtp3_nocache_full_swa_bs16",
        [full(16), swa(64, 16, extra_retained_tokens=2)],
        num_blocks=400,
        enable_caching=False,
        use_eagle=True,
        prefill_lookahead=3,
    ),
    Setup(
        "eagle_nocache_full_swa_bs16",
        [full(16), swa(64, 16)],
        num_blocks=400,
        enable_caching=False,
        use_eagle=True,
        prefill_lookahead=1,
    ),
]
