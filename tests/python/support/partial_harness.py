"""Mamba hybrids with a prefix-match unit (vLLM's ``cache_config.prefix_match_unit``, the hash
block size) below the Mamba block size: vLLM's sub-block "partial hash hits". vLLM then hashes
requests at the unit, its coordinator sets ``enable_partial_hash_hits``, a hit may end inside a
block (the shared Mamba state block is redirected to a private copy-on-write block, the copy
handed out by ``take_kv_cache_block_copies``), and the prompt's last hash boundary is cached as
a partial-block entry (a ``BlockStored`` event shorter than the group's block).

``PartialParityRun`` drives vLLM's manager and ours (built with an OffloadingConnector
``kv_transfer_config``, as a KV connector builds it) with the same calls (``ZeroingParityRun``'s
comparisons, plus the copies and their retained blocks after every allocation, freed at once as
the scheduler frees them, the boundary states a connector is handed, the copy-on-write copies of
producer partial tails among them, after every operation, the partial tails
``finalize_partial_tail_offloads`` hands a producer's connector at every finish and abort, and
``coordinator.enable_partial_hash_hits``), schedules prefill chunks as vLLM's scheduler splits
them (its own ``Scheduler._mamba_block_aligned_split``), and draws prompts that repeat or
extend earlier ones so hits end at non-block boundaries.

``HYBRID_ALLOC_PARTIAL_VLLM_TWICE=1`` builds vLLM's manager on both sides (a check of the
harness itself: the traces must reach partial hits, copies and partial tails on every
release)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import Request

from mamba_harness import ZeroingParityRun, gdn, mamba2, short_conv
from parity_driver import ParityRun
from vllm_harness import Setup, full

VLLM_TWICE = os.environ.get("HYBRID_ALLOC_PARTIAL_VLLM_TWICE", "") not in ("", "0")


class PartialSetup(Setup):
    def manager_kwargs(self, events: bool = True) -> dict[str, Any]:
        # ``extra["shared_prefix_checkpoint"]``: the scheduler's
        # ``enable_mamba_shared_prefix_checkpoint`` (vLLM's shared-prefix checkpoint).
        kw = super().manager_kwargs(events)
        kw["enable_mamba_shared_prefix_checkpoint"] = bool(self.extra.get("shared_prefix_checkpoint"))
        return kw

    def build(self, events: bool = True) -> tuple[Any, Any]:
        if VLLM_TWICE:
            return KVCacheManager(**self.manager_kwargs(events)), KVCacheManager(**self.manager_kwargs(events))
        return super().build(events)


def partial_setup(
    name: str,
    specs: list[Any],
    block: int,
    unit: int,
    num_blocks: int,
    retention: int | None = None,
    use_eagle: bool = False,
    lookahead: int = 0,
    eagle_groups: tuple[int, ...] = (),
    shared_prefix_checkpoint: bool = False,
    prefill_lookahead: int | None = None,
) -> Setup:
    """Every group's block is ``block`` (vLLM aligns the attention block to the Mamba block
    with prefix caching); requests are hashed every ``unit`` tokens. ``use_eagle``: the
    EAGLE/MTP block drop (every group in the drop set, the Mamba checkpoints one unit back;
    the split as vLLM's scheduler makes it then). ``lookahead`` with ``eagle_groups``: 0.33's
    lookahead block hashes with the draft layer's group flagged (MTP without the drop).
    ``shared_prefix_checkpoint``: vLLM's ``enable_mamba_shared_prefix_checkpoint`` (the
    scheduler's split also ends a chunk at the junction; the Mamba state is keyed there).
    ``prefill_lookahead``: the scheduler's ``num_prefill_lookahead`` (default 1 with EAGLE or
    lookahead hashes, else 0)."""
    assert block % unit == 0 and unit < block
    assert all(s.block_size == block for s in specs)
    return PartialSetup(
        name,
        specs,
        num_blocks=num_blocks,
        hash_block_size=unit,
        scheduler_block_size=block,
        retention_interval=retention,
        # vLLM's BlockPool.emit_cached_block_events (kv_cache_report_mode="full") indexes a
        # partial hit's last block by its full-block hash: IndexError when the prompt ends
        # inside that block (0.32-0.34), so no request of these traces asks for it.
        report_full=False,
        use_eagle=use_eagle,
        prefill_lookahead=prefill_lookahead if prefill_lookahead is not None else 1 if use_eagle or lookahead else 0,
        lookahead=lookahead,
        eagle_groups=eagle_groups,
        extra={"block": block, "unit": unit, "shared_prefix_checkpoint": shared_prefix_checkpoint},
    )


def _gdn(block: int) -> list[Any]:
    # Qwen3.5 / Qwen3-Next: one full-attention group, three GDN groups.
    return [full(block)] + [gdn(block, "align") for _ in range(3)]


def _mamba2(block: int) -> list[Any]:
    # Nemotron-H: one attention group, six Mamba2 groups (MambaMixer2's prefill checkpoint).
    return [full(block)] + [mamba2(block, "align") for _ in range(6)]


def _short_conv(block: int) -> list[Any]:
    # LFM2: two attention groups, three short-convolution groups.
    return [full(block), full(block)] + [short_conv(block, "align") for _ in range(3)]


PARTIAL_SETUPS: list[Setup] = [
    partial_setup("qwen35_gdn_b64_u16", _gdn(64), 64, 16, num_blocks=120),
    partial_setup("qwen35_gdn_b128_u32", _gdn(128), 128, 32, num_blocks=80),
    partial_setup("qwen35_gdn_b128_u64_retention0", _gdn(128), 128, 64, num_blocks=80, retention=0),
    partial_setup("nemotron_h_mamba2_b64_u32", _mamba2(64), 64, 32, num_blocks=170),
    partial_setup("nemotron_h_mamba2_b128_u16", _mamba2(128), 128, 16, num_blocks=120),
    partial_setup("nemotron_h_mamba2_b128_u64", _mamba2(128), 128, 64, num_blocks=120),
    partial_setup("lfm2_short_conv_b64_u16", _short_conv(64), 64, 16, num_blocks=160),
    partial_setup("lfm2_short_conv_b128_u64", _short_conv(128), 128, 64, num_blocks=110),
    # EAGLE / MTP with the block drop (0.32 with prefix caching, 0.33 on with
    # ``disable_lookahead_block_hashes``).
    partial_setup("qwen35_gdn_b64_u16_eagle_drop", _gdn(64), 64, 16, num_blocks=120, use_eagle=True),
    partial_setup("nemotron_h_mamba2_b64_u32_eagle_drop", _mamba2(64), 64, 32, num_blocks=170, use_eagle=True),
    # vLLM's shared-prefix checkpoint (``enable_mamba_shared_prefix_checkpoint``) with EAGLE /
    # MTP: the scheduler ends a prefill chunk at the junction (``shared_prefix_boundary``, a
    # hash boundary inside a block) and the Mamba state is keyed there. With the block drop
    # (every release), and with 0.33's lookahead block hashes (the MTP draft layer's
    # full-attention group flagged, no drop; 0.33 and 0.34 only).
    partial_setup(
        "qwen35_gdn_b64_u16_eagle_drop_spc",
        _gdn(64),
        64,
        16,
        num_blocks=120,
        use_eagle=True,
        shared_prefix_checkpoint=True,
    ),
    partial_setup(
        "nemotron_h_mamba2_b64_u16_eagle_drop_spc",
        _mamba2(64),
        64,
        16,
        num_blocks=170,
        use_eagle=True,
        shared_prefix_checkpoint=True,
    ),
    partial_setup(
        "qwen35_gdn_b128_u32_mtp_lookahead_spc_retention0",
        [full(128)] + [gdn(128, "align", 1) for _ in range(3)] + [full(128)],
        128,
        32,
        num_blocks=100,
        retention=0,
        lookahead=1,
        eagle_groups=(4,),
        shared_prefix_checkpoint=True,
    ),
    # Multi-module MTP: lookahead block hashes over 3 tokens (0.33 and 0.34). A prompt's last
    # hash boundary inside a full-attention block is keyed only once the lookahead tokens past
    # it arrive (decode steps: vLLM bounds the partial tail by the request's hashes). GDN
    # states; Mamba2 with its prefill checkpoint blocks; Mamba2 with a prefill lookahead of 1.
    partial_setup(
        "qwen35_gdn_b64_u16_mtp3_lookahead3",
        [full(64)] + [gdn(64, "align", 3) for _ in range(3)] + [full(64)],
        64,
        16,
        num_blocks=160,
        lookahead=3,
        eagle_groups=(4,),
        prefill_lookahead=3,
    ),
    partial_setup(
        "nemotron_h_mamba2_b64_u16_mtp3_lookahead3",
        [full(64)] + [mamba2(64, "align", 3) for _ in range(6)] + [full(64)],
        64,
        16,
        num_blocks=200,
        lookahead=3,
        eagle_groups=(7,),
        prefill_lookahead=3,
    ),
    partial_setup(
        "nemotron_h_mamba2_b64_u16_lookahead3_prefill1",
        [full(64)] + [mamba2(64, "align", 3) for _ in range(6)] + [full(64)],
        64,
        16,
        num_blocks=200,
        lookahead=3,
        eagle_groups=(7,),
        prefill_lookahead=1,
    ),
]


class PartialParityRun(ZeroingParityRun):
    """``ZeroingParityRun`` over a partial-hit setup; see the module docstring."""

    def __init__(self, setup: Setup, seed: int, full_check_every: int = 64) -> None:
        # Ours is built with a KV connector (the OffloadingConnector, as ``ZeroingParityRun``
        # builds it), so it records the boundary states and partial tails a connector is
        # handed; they are compared after every operation and at every finish.
        ParityRun.__init__(self, setup, seed, full_check_every)
        self.init_checkpoint_watch(setup)
        self.boundary_ops = 0
        self.boundary = True
        self.boundary_every = 1
        if not VLLM_TWICE:
            from vllm.config import KVTransferConfig

            from hybrid_alloc.vllm import HybridKVCacheManager

            ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
            self.ours = HybridKVCacheManager(
                **setup.manager_kwargs(True), vllm_config=SimpleNamespace(kv_transfer_config=ktc)
            )
            assert type(self.ours) is HybridKVCacheManager, f"{setup.name}: fell back with a connector"
        self.block = setup.extra["block"]
        self.unit = setup.extra["unit"]
        self.admit_chunks = (self.block // 2, self.block, 2 * self.block, 300, 512, 1024)
        self.run_chunks = (1, self.block // 2, self.block, 200, 512)
        self.prompts: list[list[int]] = []
        self.eq(
            "coordinator.enable_partial_hash_hits",
            self.ref.coordinator.enable_partial_hash_hits,
            self.ours.coordinator.enable_partial_hash_hits,
        )
        assert self.ref.coordinator.enable_partial_hash_hits, f"{setup.name}: vLLM did not enable partial hits"
        self.eq(
            "mamba_shared_prefix_checkpoint",
            self.ref.mamba_shared_prefix_checkpoint,
            self.ours.mamba_shared_prefix_checkpoint,
        )
        assert self.ref.mamba_shared_prefix_checkpoint == bool(setup.extra.get("shared_prefix_checkpoint"))
        mamba = [s for s in setup.specs if isinstance(s, MambaSpec)]
        ckpt = mamba[0].prefill_checkpoint_alignment
        # The attributes vLLM's Scheduler._mamba_block_aligned_split reads (0.32-0.34).
        self.split_self = SimpleNamespace(
            block_size=setup.scheduler_block_size,
            cache_config=SimpleNamespace(block_size=self.block),
            hash_block_size=self.unit,
            mamba_has_prefill_checkpoint_blocks=all(s.num_prefill_checkpoint_blocks > 0 for s in mamba),
            # The scheduler's block: the Mamba block, or under DCP the scaled full-attention one.
            mamba_partial_cache_hit=self.ref.coordinator.enable_partial_hash_hits
            and self.unit < setup.scheduler_block_size,
            mamba_prefill_checkpoint_alignment=ckpt,
            # vLLM's scheduler stops at the junction where its manager keys the state there.
            mamba_shared_prefix_checkpoint=self.ref.mamba_shared_prefix_checkpoint,
            max_num_scheduled_tokens=setup.max_in_flight_tokens,
            num_hash_lookahead_tokens=setup.lookahead,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            use_eagle_block_drop=setup.use_eagle,
        )
        for k in (
            "partial_hits",
            "cow_copies",
            "cow_retained",
            "partial_tails",
            "partial_tails_mamba",
            "partial_tail_offloads",
            "finalize_calls",
            "boundary_states",
            "boundary_partial",
            "junction_stops",
        ):
            self.stats[k] = 0

    # ---- the side that is not vLLM's when VLLM_TWICE ----------------------------------

    def ours_free_queue_order(self) -> list[int]:
        if VLLM_TWICE:
            return [b.block_id for b in self.ours.block_pool.free_block_queue.get_all_free_blocks()]
        return super().ours_free_queue_order()

    def check_ours_invariants(self) -> None:
        if not VLLM_TWICE:
            super().check_ours_invariants()

    # ---- the scheduler's shape of the calls ------------------------------------------------

    def clip_chunk(self, req: Request, num_new: int, num_new_computed: int) -> int:
        n = Scheduler._mamba_block_aligned_split(self.split_self, req, num_new, num_new_computed)  # type: ignore[arg-type]
        # A chunk ending at the junction inside a block (vLLM's shared-prefix checkpoint:
        # where the Mamba state is keyed only because of it).
        j = req.shared_prefix_boundary
        if j % self.block and req.num_computed_tokens + num_new_computed + n == j <= req.num_prompt_tokens:
            self.stats["junction_stops"] += 1
        return n

    def new_request(self) -> Request:
        """Prompts that repeat an earlier prompt, extend one (a conversation's next turn), or
        share one of the run's prefixes; an earlier prompt's last hash boundary (a partial tail
        when it is not a block multiple) is then where a later prompt's hit can end."""
        r = self.rng
        x = r.random()
        if self.prompts and x < 0.2:
            toks = list(r.choice(self.prompts))
        elif self.prompts and x < 0.45:
            toks = list(r.choice(self.prompts)) + [r.randrange(1, 5000) for _ in range(r.randrange(1, 200))]
        elif x < 0.85:
            toks = list(self.prefixes[r.randrange(len(self.prefixes))])
            toks += [r.randrange(1, 5000) for _ in range(r.randrange(1, 300))]
        else:
            toks = [r.randrange(1, 5000) for _ in range(r.randrange(1, 600))]
        toks = toks[:1500]
        self.prompts.append(toks)
        if len(self.prompts) > 24:
            self.prompts.pop(0)
        self.next_id += 1
        return self.setup.make_request(
            f"r{self.next_id}",
            toks,
            max_tokens=r.randrange(1, 64),
            report_full=self.setup.report_full and r.random() < 0.2,
        )

    # ---- the extra comparisons ---------------------------------------------------------

    def after_allocate(self) -> None:
        ca, ra = self.ref.take_kv_cache_block_copies()
        cb, rb = self.ours.take_kv_cache_block_copies()
        self.eq(
            "take_kv_cache_block_copies copies",
            [(c.src_block_id, c.dst_block_id) for c in ca],
            [(c.src_block_id, c.dst_block_id) for c in cb],
        )
        self.eq(
            "take_kv_cache_block_copies retained",
            [b.block_id for b in ra],
            [b.block_id for b in rb],
        )
        self.stats["cow_copies"] += len(ca)
        self.stats["cow_retained"] += len(ra)
        # The scheduler's _free_cow_retained_blocks once the copying step ran (here at once).
        if ra or rb:
            self.ref.block_pool.free_blocks(ra)
            self.ours.block_pool.free_blocks(rb)

    def on_events(self, events: list[Any]) -> None:
        # A partial-block entry: a BlockStored event shorter than its group's block.
        for e in events:
            if type(e).__name__ == "BlockStored" and e.block_size < self.setup.specs[e.group_idx].block_size:
                self.stats["partial_tails"] += 1
                self.stats["partial_tails_mamba"] += isinstance(self.setup.specs[e.group_idx], MambaSpec)

    def admit(self) -> None:
        hits, hit_tokens = self.stats["hits"], self.stats["hit_tokens"]
        super().admit()
        if self.stats["hits"] > hits and (self.stats["hit_tokens"] - hit_tokens) % self.block:
            self.stats["partial_hits"] += 1

    def on_boundary_offloads(self, offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        # A producer's partial tail preserved by its copy-on-write: the copy, at a boundary
        # inside its block.
        self.stats["boundary_partial"] += sum(t % self.block != 0 for e in offloads.values() for _, _, t in e)

    def _finalize(self, req: Request) -> None:
        a = self.ref.finalize_partial_tail_offloads(req)
        self.eq("finalize_partial_tail_offloads", a, self.ours.finalize_partial_tail_offloads(req))
        self.stats["finalize_calls"] += 1
        self.stats["partial_tail_offloads"] += len(a)

    def finish(self, req: Request) -> None:
        # The scheduler asks a KV producer connector for the partial tails before the free.
        self._finalize(req)
        super().finish(req)

    def abort(self) -> None:
        # The request ParityRun.abort picks (the same draw), finalized first as the
        # scheduler's _free_request does for every finished request.
        pool = list(self.running) + list(self.waiting)
        if pool:
            state = self.rng.getstate()
            req = self.rng.choice(pool)
            self.rng.setstate(state)
            self._finalize(req)
        super().abort()
