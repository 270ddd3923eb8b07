"""Mamba / linear-attention and other hybrid configurations for the differential tests,
shaped like the real architectures (Qwen3.5 / Qwen3-Next GDN, Nemotron-H and Jamba Mamba2,
LFM2 short convolution), and a ``ParityRun`` that also compares what the model runner is
told to zero (``take_new_block_ids``) and re-records blocks for zeroing after a failed load
(``record_blocks_for_zeroing``). Every spec object is vLLM's own."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from parity_driver import ParityRun
from vllm_harness import Setup, full

# With prefix caching off vLLM sets the Mamba block size to max_model_len (one state block
# per request, plus one per speculative token), and the scheduler block size (and the hash
# block size, hashing being off) to the LCM of the group block sizes.
MML = 4096


def gdn(bs: int = MML, mode: str = "none", spec_blocks: int = 0) -> MambaSpec:
    """A Gated DeltaNet layer's state (Qwen3.5 / Qwen3-Next): conv state + recurrent state."""
    return MambaSpec(
        block_size=bs,
        shapes=((3, 8192), (32, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
        num_speculative_blocks=spec_blocks,
    )


def mamba2(bs: int = MML, mode: str = "none", spec_blocks: int = 0, checkpoints: bool = True) -> MambaSpec:
    """A Mamba2 layer's state (Nemotron-H, Granite 4, Falcon-H1, Bamba, Zamba2). vLLM's
    MambaMixer2 always sets one prefill checkpoint block of alignment 1; the manager acts on
    it in cache mode "align" only. ``checkpoints=False`` is a state without them (a
    MambaMixer v1 layer, as Jamba's)."""
    return MambaSpec(
        block_size=bs,
        shapes=((3, 10240), (128, 64, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode=mode,
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=1 if checkpoints else 0,
        prefill_checkpoint_alignment=1 if checkpoints else None,
    )


def mamba1(bs: int = MML, mode: str = "none") -> MambaSpec:
    """A MambaMixer (v1) layer's state (Jamba): no prefill checkpoint blocks."""
    return MambaSpec(
        block_size=bs,
        shapes=((3, 8192), (8192, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA1,
        mamba_cache_mode=mode,
    )


def short_conv(bs: int = MML, mode: str = "none") -> MambaSpec:
    """An LFM2 short-convolution layer's state."""
    return MambaSpec(
        block_size=bs,
        shapes=((2, 2048),),
        dtypes=(torch.bfloat16,),
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        mamba_cache_mode=mode,
    )


def full_fp8(bs: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.float8_e4m3fn)


def swa_fp8(window: int, bs: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.float8_e4m3fn, sliding_window=window
    )


def swa_bf16(window: int, bs: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=window)


def swa_mla(window: int, bs: int = 16, bounded_replay: bool = False) -> SlidingWindowMLASpec:
    """DeepSeek-V4's sliding-window MLA layer (DeepSeek-V4.1's with ``bounded_replay``: kept
    out of prefix caching, its window replayed after a hit)."""
    return SlidingWindowMLASpec(
        block_size=bs,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=window,
        bounded_replay=bounded_replay,
    )


def ring(bs: int = 8) -> CircularBufferSpec:
    """DeepSeek-V4's compressor ring: one block per request."""
    return CircularBufferSpec(block_size=bs, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)


def mla_c(bs: int = 16) -> MLAAttentionSpec:
    """A compressed-attention (full) MLA layer."""
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def _nocache(name: str, specs: list[Any], num_blocks: int, attn_bs: int = 16) -> Setup:
    return Setup(
        name,
        specs,
        num_blocks=num_blocks,
        enable_caching=False,
        hash_block_size=MML,
        scheduler_block_size=MML,
        max_model_len=MML,
        retention_interval=None,
    )


# Group layouts as vLLM's grouping makes them: layers are split into groups of equal size,
# so a 3:1 GDN:attention model (Qwen3.5, Qwen3-Next) has one full-attention group and three
# GDN groups; Nemotron-H (4 attention : 24 Mamba2 layers in the 8B) one and six; Jamba (1 in
# 8) one and seven; LFM2-1.2B (6 attention : 10 conv) ~ two and three (sizes 3/3+2).
MAMBA_SETUPS: list[Setup] = [
    _nocache("qwen35_gdn_3to1_nocache", [full(64), gdn(), gdn(), gdn()], num_blocks=220),
    _nocache(
        "qwen35_gdn_mtp2_nocache",
        [full(64), gdn(spec_blocks=2), gdn(spec_blocks=2), gdn(spec_blocks=2)],
        num_blocks=300,
    ),
    _nocache("nemotron_h_mamba2_nocache", [full(16)] + [mamba2() for _ in range(6)], num_blocks=450),
    _nocache("jamba_mamba1_nocache", [full(16)] + [mamba1() for _ in range(7)], num_blocks=480),
    _nocache("lfm2_short_conv_nocache", [full(16), full(16), short_conv(), short_conv(), short_conv()], num_blocks=420),
    _nocache("mamba_only_nocache", [mamba2()], num_blocks=30),
    # Prefix caching on: cache mode "align", the Mamba block size equal to the attention
    # block size and the hash block size (vLLM's default with prefix caching).
    Setup(
        "qwen35_gdn_3to1_align",
        [full(16), gdn(16, "align"), gdn(16, "align"), gdn(16, "align")],
        num_blocks=260,
        retention_interval=None,
    ),
    Setup(
        "qwen35_gdn_3to1_align_retention0",
        [full(16), gdn(16, "align"), gdn(16, "align"), gdn(16, "align")],
        num_blocks=260,
        retention_interval=0,
    ),
    # Mamba2 (MambaMixer2) in "align": one prefill checkpoint block of alignment 1.
    Setup(
        "nemotron_h_mamba2_align",
        [full(16)] + [mamba2(16, "align") for _ in range(6)],
        num_blocks=420,
        retention_interval=None,
    ),
    Setup(
        "nemotron_h_mamba2_align_retention0",
        [full(16)] + [mamba2(16, "align") for _ in range(6)],
        num_blocks=420,
        retention_interval=0,
    ),
    Setup(
        "nemotron_h_mamba2_align_retention64",
        [full(16)] + [mamba2(16, "align") for _ in range(6)],
        num_blocks=420,
        retention_interval=64,
    ),
    Setup("mamba2_only_align", [mamba2(16, "align")], num_blocks=60, retention_interval=None),
    # The same Mamba2 state without checkpoint blocks, and Jamba's MambaMixer (v1) layers.
    Setup(
        "nemotron_h_mamba2_align_no_checkpoints",
        [full(16)] + [mamba2(16, "align", checkpoints=False) for _ in range(6)],
        num_blocks=420,
        retention_interval=None,
    ),
    Setup(
        "jamba_mamba1_align_retention64",
        [full(16)] + [mamba1(16, "align") for _ in range(7)],
        num_blocks=450,
        retention_interval=64,
    ),
    Setup(
        "lfm2_short_conv_align",
        [full(16), full(16), short_conv(16, "align"), short_conv(16, "align"), short_conv(16, "align")],
        num_blocks=420,
        retention_interval=None,
    ),
    Setup("mamba_only_align", [mamba2(16, "align", checkpoints=False)], num_blocks=60, retention_interval=None),
    # Speculative decoding in "align" (vLLM sets num_speculative_blocks to the speculative
    # tokens for every method; the trace schedules drafts and lookahead slots): scratch state
    # blocks past the running one, relocated as the table grows.
    Setup(
        "qwen35_gdn_3to1_align_spec1",
        [full(16), gdn(16, "align", 1), gdn(16, "align", 1), gdn(16, "align", 1)],
        num_blocks=300,
        retention_interval=None,
    ),
    Setup(
        "qwen3next_gdn_3to1_align_spec2_retention0",
        [full(16), gdn(16, "align", 2), gdn(16, "align", 2), gdn(16, "align", 2)],
        num_blocks=320,
        retention_interval=0,
    ),
    Setup(
        "qwen35_gdn_3to1_align_spec3",
        [full(16), gdn(16, "align", 3), gdn(16, "align", 3), gdn(16, "align", 3)],
        num_blocks=340,
        retention_interval=None,
    ),
    # Speculative blocks and prefill checkpoint blocks together (Nemotron-H with ngram).
    Setup(
        "nemotron_h_mamba2_align_spec2",
        [full(16)] + [mamba2(16, "align", 2) for _ in range(6)],
        num_blocks=480,
        retention_interval=None,
    ),
    Setup(
        "nemotron_h_mamba2_align_spec1_retention64",
        [full(16)] + [mamba2(16, "align", 1) for _ in range(6)],
        num_blocks=460,
        retention_interval=64,
    ),
    Setup("mamba2_only_align_spec3", [mamba2(16, "align", 3)], num_blocks=80, retention_interval=None),
    # vLLM 0.33 with MTP / EAGLE and prefix caching: lookahead block hashes (one token), the
    # draft layer's group flagged (Qwen3.5 / Qwen3-Next MTP: a full-attention draft layer),
    # one speculative state block per draft token; the prompt's checkpoint moves back by the
    # lookahead. 0.32 drops the last block for EAGLE (a fallback), so these run on 0.33 only.
    Setup(
        "qwen35_gdn_3to1_mtp1_lookahead_align",
        [full(16), gdn(16, "align", 1), gdn(16, "align", 1), gdn(16, "align", 1), full(16)],
        num_blocks=340,
        retention_interval=None,
        lookahead=1,
        eagle_groups=(4,),
        prefill_lookahead=1,
    ),
    Setup(
        "qwen3next_gdn_3to1_mtp3_lookahead_align_retention0",
        [full(16), gdn(16, "align", 3), gdn(16, "align", 3), gdn(16, "align", 3), full(16)],
        num_blocks=380,
        retention_interval=0,
        lookahead=1,
        eagle_groups=(4,),
        prefill_lookahead=1,
    ),
    Setup(
        "nemotron_h_mamba2_eagle2_lookahead_align",
        [full(16)] + [mamba2(16, "align", 2) for _ in range(6)] + [full(16)],
        num_blocks=520,
        retention_interval=None,
        lookahead=1,
        eagle_groups=(7,),
        prefill_lookahead=1,
    ),
    # Multi-module MTP with three tokens of prefill lookahead (0.33/0.34): lookahead block
    # hashes over three tokens, the prompt's checkpoint three tokens back; GDN states have no
    # prefill checkpoint blocks (one Mamba group alone falls back: vLLM's own lookup raises
    # IndexError there).
    Setup(
        "qwen3next_gdn_3to1_mtp3_lookahead3_align",
        [full(16), gdn(16, "align", 3), gdn(16, "align", 3), gdn(16, "align", 3), full(16)],
        num_blocks=380,
        retention_interval=None,
        lookahead=3,
        eagle_groups=(4,),
        prefill_lookahead=3,
    ),
    # Nemotron-H-style Mamba2 (MambaMixer2's prefill checkpoint blocks) with multi-module MTP
    # (0.33/0.34): lookahead block hashes over two and three tokens move every prefill
    # checkpoint back by as many tokens, so a chunk ending less than that past a block
    # boundary reserves its checkpoint block one block past the position (keyed there, the
    # block's full-block key of that step replaced).
    Setup(
        "nemotron_h_mamba2_mtp2_lookahead2_align",
        [full(16)] + [mamba2(16, "align", 2) for _ in range(6)] + [full(16)],
        num_blocks=520,
        retention_interval=None,
        lookahead=2,
        eagle_groups=(7,),
        prefill_lookahead=2,
    ),
    Setup(
        "nemotron_h_mamba2_mtp3_lookahead3_align",
        [full(16)] + [mamba2(16, "align", 3) for _ in range(6)] + [full(16)],
        num_blocks=560,
        retention_interval=None,
        lookahead=3,
        eagle_groups=(7,),
        prefill_lookahead=3,
    ),
    Setup(
        "nemotron_h_mamba2_mtp3_lookahead3_align_retention64",
        [full(16)] + [mamba2(16, "align", 3) for _ in range(6)] + [full(16)],
        num_blocks=560,
        retention_interval=64,
        lookahead=3,
        eagle_groups=(7,),
        prefill_lookahead=3,
    ),
    # Prefix caching off (every release): nothing cached; the drop and the lookahead read by
    # no manager.
    dataclasses.replace(
        _nocache(
            "qwen35_gdn_mtp3_prefill3_nocache",
            [full(64), gdn(spec_blocks=3), gdn(spec_blocks=3), gdn(spec_blocks=3)],
            num_blocks=320,
        ),
        use_eagle=True,
        prefill_lookahead=3,
    ),
    # Multi-module MTP (three tokens of prefill lookahead) with the block drop on a GDN hybrid
    # (0.32 with prefix caching, 0.33 on with lookahead hashes off): the checkpoints one block
    # back and the dropping groups' cache target short of the re-prefillable tokens.
    Setup(
        "qwen35_gdn_3to1_mtp3_drop_all_align",
        [full(16), gdn(16, "align", 3), gdn(16, "align", 3), gdn(16, "align", 3)],
        num_blocks=380,
        retention_interval=None,
        use_eagle=True,
        prefill_lookahead=3,
    ),
    Setup(
        "nemotron_h_mamba2_mtp3_drop_all_align",
        [full(16)] + [mamba2(16, "align", 1) for _ in range(6)],
        num_blocks=460,
        retention_interval=None,
        use_eagle=True,
        prefill_lookahead=3,
    ),
    # EAGLE / MTP with the prefix-cache block drop (``use_eagle``: 0.32 with prefix caching,
    # 0.33 on with ``disable_lookahead_block_hashes``): every Mamba "align" group's prefill
    # checkpoint positions move one block back (``drop_eagle_checkpoint_block``). With the
    # draft layer's group flagged (Qwen3.5 / Qwen3-Next MTP), the full-attention groups drop
    # and the GDN groups do not; with none flagged every group is in the drop set, Mamba
    # included (its finder never drops; it caches one block past the aligned boundary).
    Setup(
        "qwen35_gdn_3to1_mtp1_drop_align",
        [full(16), gdn(16, "align", 1), gdn(16, "align", 1), gdn(16, "align", 1), full(16)],
        num_blocks=340,
        retention_interval=None,
        eagle_groups=(4,),
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "qwen3next_gdn_3to1_mtp3_drop_all_align_retention0",
        [full(16), gdn(16, "align", 3), gdn(16, "align", 3), gdn(16, "align", 3)],
        num_blocks=380,
        retention_interval=0,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "nemotron_h_mamba2_eagle2_drop_align",
        [full(16)] + [mamba2(16, "align", 2) for _ in range(6)] + [full(16)],
        num_blocks=520,
        retention_interval=None,
        eagle_groups=(7,),
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "nemotron_h_mamba2_eagle1_drop_all_align_retention64",
        [full(16)] + [mamba2(16, "align", 1) for _ in range(6)],
        num_blocks=460,
        retention_interval=64,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup(
        "full_swa_mamba2_eagle_drop_all_align",
        [full(16), swa_bf16(48, 16), mamba2(16, "align", 1)],
        num_blocks=440,
        retention_interval=None,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    Setup("mamba2_only_eagle_drop_align", [mamba2(16, "align", 1)], num_blocks=80, use_eagle=True, prefill_lookahead=1),
    # Prefix caching off: ``use_eagle`` reaches the managers (the Mamba groups in mode "none").
    Setup(
        "qwen35_gdn_mtp2_eagle_nocache",
        [full(64), gdn(spec_blocks=2), gdn(spec_blocks=2), gdn(spec_blocks=2)],
        num_blocks=300,
        enable_caching=False,
        hash_block_size=MML,
        scheduler_block_size=MML,
        max_model_len=MML,
        retention_interval=None,
        use_eagle=True,
        prefill_lookahead=1,
    ),
    # Full + sliding window + Mamba: three spec groups, the hybrid hit search iterates.
    Setup(
        "full_swa_mamba_align",
        [full(16), swa_bf16(48, 16), mamba2(16, "align")],
        num_blocks=420,
        retention_interval=None,
    ),
    # DeepSeek-V4-shaped: compressed MLA (full), sliding-window MLA and the compressor ring.
    Setup("deepseek_v4_swa_mla_ring", [mla_c(16), swa_mla(128, 16), ring(8)], num_blocks=300),
    # DeepSeek-V4.1 (``--swa-bounded-replay``, its default): the sliding-window group is not
    # prefix-cacheable; hits come from the compressed MLA group alone.
    Setup("deepseek_v41_swa_replay_ring", [mla_c(16), swa_mla(128, 16, True), ring(8)], num_blocks=300),
    Setup(
        "deepseek_v4_swa_mla_ring_nocache", [mla_c(16), swa_mla(128, 16), ring(8)], num_blocks=300, enable_caching=False
    ),
    # Mixed-precision attention caches need zeroing too (no Mamba): new blocks are reported.
    Setup("mixed_precision_full_swa_zeroing", [full(16), swa_fp8(64, 16)], num_blocks=400),
    Setup("mixed_precision_full_nocache_zeroing", [full(16), full_fp8(16)], num_blocks=400, enable_caching=False),
]


class ZeroingParityRun(ParityRun):
    """``ParityRun`` that also compares the block ids reported for zeroing after every
    operation and sometimes re-records a request's blocks for zeroing. With Mamba "align"
    groups and prefix caching on, the boundary states both managers offer
    (``take_boundary_state_offloads``, recorded always, connector or not) are compared every
    16 operations too."""

    # Compare the boundary states every this many operations.
    boundary_every = 16

    def __init__(self, setup: Setup, seed: int, full_check_every: int = 64) -> None:
        super().__init__(setup, seed, full_check_every)
        self.boundary_ops = 0
        self.boundary = setup.enable_caching and any(
            isinstance(s, MambaSpec) and s.mamba_cache_mode == "align" for s in setup.specs
        )
        self.init_checkpoint_watch(setup)

    def init_checkpoint_watch(self, setup: Setup) -> None:
        """Sets up the checkpoint counters (see ``after_allocate``)."""
        # The first Mamba "align" group with prefill checkpoint blocks (all such groups act
        # alike): vLLM's manager there is watched for the checkpoints it reserves.
        self.ckpt_group = next(
            (
                g
                for g, s in enumerate(setup.specs)
                if setup.enable_caching
                and isinstance(s, MambaSpec)
                and s.mamba_cache_mode == "align"
                and s.num_prefill_checkpoint_blocks > 0
                and s.prefill_checkpoint_alignment
            ),
            None,
        )
        # vLLM's ``_checkpoints`` after the last count, and the checkpoints reserved where
        # the position does not end the reserved block (request id -> (position, index)),
        # waiting to be keyed; then the blocks keyed so (block id -> its key).
        self.ckpt_seen: dict[str, tuple[int, int]] = {}
        self.ckpt_pending: dict[str, tuple[int, int]] = {}
        self.ckpt_keyed: dict[int, Any] = {}

    def after_allocate(self) -> None:
        super().after_allocate()
        if self.ckpt_group is None:
            return
        m = self.ref.coordinator.single_type_managers[self.ckpt_group]
        now = dict(m._checkpoints)
        bs = m.block_size
        for rid, (pos, idx) in now.items():
            if self.ckpt_seen.get(rid) == (pos, idx):
                continue
            # A new reservation (a later one of the same request is always further on).
            self.stats["checkpoints_reserved"] = self.stats.get("checkpoints_reserved", 0) + 1
            if pos != (idx + 1) * bs:
                self.stats["checkpoints_off_block_end"] = self.stats.get("checkpoints_off_block_end", 0) + 1
                self.ckpt_pending[rid] = (pos, idx)
        self.ckpt_seen = now

    def watch_checkpoints(self) -> None:
        """Moves the off-end checkpoints vLLM keyed (the reserved block keyed at the
        position) from pending to keyed."""
        m = self.ref.coordinator.single_type_managers[self.ckpt_group]
        for rid, (pos, idx) in list(self.ckpt_pending.items()):
            blocks = m.req_to_blocks.get(rid)
            if blocks is None or idx >= len(blocks):
                if blocks is None:
                    del self.ckpt_pending[rid]
                continue
            b = blocks[idx]
            if not b.is_null and b.block_hash is not None and b.block_hash_num_tokens == pos:
                self.stats["checkpoints_off_block_end_keyed"] = self.stats.get("checkpoints_off_block_end_keyed", 0) + 1
                self.ckpt_keyed[b.block_id] = b.block_hash
                del self.ckpt_pending[rid]
            elif self.ckpt_seen.get(rid) != (pos, idx):
                del self.ckpt_pending[rid]

    def on_hit(self, hit: Any) -> None:
        """Counts the hits whose state is a checkpoint vLLM keyed off its block's end (the
        block still holding that key)."""
        if self.ckpt_group is None or not self.ckpt_keyed:
            return
        blocks = hit.blocks[self.ckpt_group]
        if blocks and self.ckpt_keyed.get(blocks[-1].block_id) == blocks[-1].block_hash:
            self.stats["off_block_end_checkpoint_hits"] = self.stats.get("off_block_end_checkpoint_hits", 0) + 1

    def after_op(self) -> None:
        a, b = self.ref.take_new_block_ids(), self.ours.take_new_block_ids()
        self.eq("take_new_block_ids", a, b)
        self.boundary_ops += 1
        if self.boundary and self.boundary_ops % self.boundary_every == 0:
            # Every 16 operations by default (cheaper; entries of requests freed meanwhile
            # must be gone).
            x, y = self.ref.take_boundary_state_offloads(), self.ours.take_boundary_state_offloads()
            self.eq("take_boundary_state_offloads", list(x.items()), list(y.items()))
            self.stats["boundary_states"] = self.stats.get("boundary_states", 0) + sum(len(e) for e in x.values())
            self.on_boundary_offloads(x)
        self.stats["zeroed"] = self.stats.get("zeroed", 0) + len(a)
        # Prefill checkpoints vLLM's Mamba "align" managers hold reserved (counted per op).
        self.stats["checkpoints"] = self.stats.get("checkpoints", 0) + sum(
            len(getattr(m, "_checkpoints", ())) for m in self.ref.coordinator.single_type_managers
        )
        if self.ckpt_pending:
            self.watch_checkpoints()
        super().after_op()

    def on_boundary_offloads(self, offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        """Hook: the boundary states vLLM's manager handed out (compared equal with ours)."""

    def maybe_new_step(self) -> None:
        # The scheduler starts a step before it schedules anything: Mamba "align" stops
        # deferring hits on states cached in the previous step.
        if self.rng.random() < 0.3:
            self.ref.new_step_starts()
            self.ours.new_step_starts()

    def admit(self) -> None:
        self.maybe_new_step()
        super().admit()

    def run_one(self) -> None:
        self.maybe_new_step()
        super().run_one()

    def misc(self) -> None:
        r = self.rng
        if self.running and r.random() < 0.1:
            req = r.choice(self.running)
            lcm = self.setup.scheduler_block_size
            start = r.randrange(0, req.num_computed_tokens + 1) // lcm * lcm
            self.ref.record_blocks_for_zeroing(req.request_id, start)
            self.ours.record_blocks_for_zeroing(req.request_id, start)
            self.stats["rerecorded"] = self.stats.get("rerecorded", 0) + 1
            self.after_op()
            return
        super().misc()
