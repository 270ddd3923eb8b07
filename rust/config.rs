//! Configuration of an allocator: the pool size, the KV cache groups and their attention
//! types, and the scheduler-level knobs vLLM's `KVCacheManager` is built with.
//! Validation happens once, in [`Config::validate`]; everything after may rely on it.
//! What varies by kind (its predicates, its checks, its admission cap) is the kind's rules,
//! in its manager file (`manager::KindRules`); this file holds only the data.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// The attention type of one KV cache group, with the parameters its manager needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Full attention (also MLA, which allocates the same way): every block is kept.
    Full,
    /// Reference sliding window attention (vLLM's `RSWASpec` + `RSWAManager`, DeepSeek-V2
    /// "Unlimited-OCR"): full attention whose `allocate_slots` also frees the *gap*, the
    /// blocks wholly between the prompt's last block and the `window` newest processed
    /// tokens, replacing them by the null block in the middle of the table. Cache hits,
    /// caching, admission and sizing are full attention's (it is a `FullAttentionSpec`).
    Rswa {
        /// Generated tokens see this many newest tokens (the prompt stays visible).
        window: u32,
    },
    /// Sliding-window attention: blocks wholly before `window - 1 + extra_retained_tokens`
    /// tokens of the newest computed token are recycled.
    SlidingWindow {
        /// Tokens a token attends to (itself included).
        window: u32,
        /// Tokens kept past the window (vLLM's `extra_retained_tokens`).
        extra_retained_tokens: u32,
    },
    /// Sliding-window attention kept out of prefix caching with a bounded replay (vLLM's
    /// `SlidingWindowMLASpec` with `bounded_replay`, DeepSeek-V4.1's `--swa-bounded-replay`,
    /// on by default): allocated and recycled as [`Self::SlidingWindow`], but never cached
    /// and never searched for hits (`prefix_cacheable` is false). After a hit of the other
    /// groups, the scheduler recomputes the hit's last window (its `prefix_replay_tokens`);
    /// the manager sees ordinary calls, and this group's table starts with the nulls of the
    /// skipped blocks and no hit blocks.
    SlidingWindowReplay {
        /// Tokens a token attends to (itself included).
        window: u32,
        /// Tokens kept past the window (vLLM's `extra_retained_tokens`).
        extra_retained_tokens: u32,
    },
    /// Chunked local attention (Llama 4): blocks of earlier chunks are recycled.
    ChunkedLocal {
        /// Tokens per chunk (vLLM's `attention_chunk_size`).
        chunk: u32,
    },
    /// Cross attention (encoder-decoder): a static allocation from the encoder length,
    /// never prefix cached.
    Cross,
    /// Mamba / linear-attention state (vLLM's `MambaSpec` + `MambaManager`): only the state
    /// after the last computed token is needed, so every block before the one holding it
    /// goes back to the pool. `speculative_blocks` extra state blocks are kept for
    /// speculative decoding. `align` is vLLM's `mamba_cache_mode == "align"` (prefix caching
    /// of states at block boundaries); `false` is mode `"none"`. `rekey_cached_tail` is
    /// vLLM 0.32's rule for the prompt's checkpoint state in "align" (a state block already
    /// keyed there counts as cached again this step); vLLM 0.33 skips it.
    /// `checkpoint_alignment` is the spec's `prefill_checkpoint_alignment` when it has
    /// prefill checkpoint blocks (`num_prefill_checkpoint_blocks > 0`, "align" only; vLLM's
    /// `MambaMixer2` sets 1): a prefill chunk reserves one more block, where the worker exports
    /// the state at the last cacheable boundary inside the chunk. 0: none.
    Mamba {
        /// Extra state blocks kept for speculative decoding.
        speculative_blocks: u32,
        /// Cache mode "align" (`false`: "none").
        align: bool,
        /// vLLM 0.32's rule for the prompt's checkpoint state in "align".
        rekey_cached_tail: bool,
        /// `prefill_checkpoint_alignment` with prefill checkpoint blocks; 0: none.
        checkpoint_alignment: u32,
    },
    /// A circular buffer (vLLM's `CircularBufferSpec`, DeepSeek-V4's compressor ring): one
    /// block per request for its whole life, never prefix cached, never zeroed.
    CircularBuffer,
}

/// One KV cache group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The attention type and its parameters.
    pub kind: AttentionKind,
    /// Tokens per block of this group (a multiple of `hash_block_size`). Under vLLM's decode
    /// context parallelism this is the manager's block size, `spec.block_size * dcp` for a
    /// sharded group (the adapter passes it so; nothing else in the core depends on DCP).
    pub block_size: u32,
    /// Groups whose specs are equal in vLLM (same key here) are looked up together,
    /// as vLLM's `HybridKVCacheCoordinator` batches them into one `SpecGroup`.
    pub spec_key: u32,
}

/// Everything an allocator is built from; mirrors `KVCacheManager.__init__`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Blocks in the pool, the null block included (`>= 1`).
    pub num_blocks: u32,
    /// The KV cache groups, in vLLM's order.
    pub groups: Vec<GroupSpec>,
    /// Tokens per block hash.
    pub hash_block_size: u32,
    /// The scheduling granularity: a multiple of every group's block size.
    pub scheduler_block_size: u32,
    /// Longest sequence the model serves.
    pub max_model_len: u32,
    /// Tokens scheduled but not yet settled (sets the SWA / chunked admission cap).
    pub max_in_flight_tokens: u32,
    /// Prefix caching on or off.
    pub enable_caching: bool,
    /// Record KV cache events.
    pub enable_events: bool,
    /// Free blocks kept back when admitting waiting or preempted requests.
    pub watermark_blocks: u32,
    /// `KVCacheConfig.prefix_cache_retention_interval`: `None` dense, `Some(0)` only
    /// replay boundaries, `Some(n)` also every `n` tokens (sliding window only).
    pub retention_interval: Option<u32>,
    /// `KVCacheConfig.needs_kv_cache_zeroing` (Mamba layers or mixed-precision attention
    /// caches): attention groups record the blocks they hand out, for
    /// [`crate::Allocator::take_new_block_ids`].
    pub zero_new_blocks: bool,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (EAGLE-style lookahead block hashes): each
    /// block hash also covers this many tokens past the block. The caller hashes; the core
    /// reads it only where vLLM does (the Mamba "align" prefill checkpoint positions). 0 on
    /// vLLM 0.32.
    pub hash_lookahead_tokens: u32,
    /// Record the residency log: the calls vLLM's `BlockPool` makes on a
    /// `KVCacheMetricsCollector` (`--kv-cache-metrics`), for
    /// [`crate::Allocator::take_residency_log`]. Off: one untaken branch where a block is
    /// handed out, touched or evicted.
    pub residency_log: bool,
    /// Record the boundary states Mamba "align" groups key, for a KV connector
    /// ([`crate::Allocator::take_boundary_state_offloads`], vLLM's
    /// `take_boundary_state_offloads`). Off: one untaken branch per newly cached align block.
    pub boundary_offloads: bool,
    /// Two-level pages (`k`, see `block_pool/pages.rs`): 1 is today's layout (one pool,
    /// unchanged code paths). With `k > 1`, `num_blocks` counts **pages**; the state groups
    /// (Mamba) take whole pages (ids in `0..num_blocks`), every other group takes **slots**,
    /// `k` per page (slot `s` is slot `s % k` of page `s / k`, ids in `0..num_blocks * k`).
    /// Served with the exact policy and full-attention slot groups ([`Self::validate`] names
    /// what it refuses), partial hash hits only with [`Self::prefix_match_unit`]; with
    /// `zero_new_blocks` the ids recorded for zeroing are slot ids (only attention groups
    /// record).
    pub slots_per_page: u32,
    /// Two-level pages only ([`Self::slots_per_page`] `k > 1`): the admission headroom, in
    /// slots per running request. Where the watermark applies (a waiting or preempted
    /// request admitted while others run: `AllocateArgs::apply_watermark`), the allocation
    /// also keeps `ceil(running x this / k)` pages free, `running` being the requests that
    /// hold slots. Under vLLM's layout each running request carries up to a state-sized
    /// block of growth room inside its last block; under two-level pages it carries less
    /// than one slot, so without a headroom admissions fill the pool to its last page and the
    /// running requests' next slots preempt (docs/two-level-pages.md, "Admission headroom").
    /// 0: none (what `k == 1` requires).
    pub admission_headroom_slots: u32,
    /// vLLM's `cache_config.prefix_match_unit` (`--prefix-match-unit`) where the user set one,
    /// read only with two-level pages ([`Self::slots_per_page`] > 1): there the hash block is
    /// the slot block whether or not a unit is set, so only this tells them apart. A unit
    /// equal to the hash block and to every slot group's block turns partial hash hits on
    /// (states keyed and hit at unit boundaries inside a state block, as vLLM's with one page
    /// size; a slot is one hash block, so no slot is ever copied on write); any other unit
    /// is refused. Ignored with `slots_per_page == 1`, where the hash block is the unit.
    pub prefix_match_unit: Option<u32>,
    /// vLLM's EAGLE/MTP prefix-cache block drop (`use_eagle` without lookahead block hashes;
    /// vLLM 0.32 also for a group flagged `is_eagle_group`): bit `g` set for each group in
    /// the coordinator's drop set (0.33's `drop_eagle_group_ids`, 0.32's `eagle_group_ids`).
    /// A group looked up together with one of them (an equal spec) drops too, as vLLM
    /// decides the drop per `SpecGroup` ([`Self::drops_eagle_block`]). The hits of such a
    /// group match one block (or hash unit) further and drop it, so the draft's KV there is
    /// recomputed; caching goes one block past the aligned boundary and the retention masks
    /// keep the block matched past each boundary. Ignored with prefix caching off (vLLM's
    /// no-prefix-cache coordinator reads none of it). 0: no drop.
    pub eagle_drop_groups: u64,
    /// vLLM 0.33's rule (0.32 has none): with the block drop, a group's retention mask also
    /// keeps the tail ending one block below the request's junction
    /// (`shared_prefix_boundary - block_size`: a sibling diverging right after the junction
    /// cannot use the block past it as the EAGLE peek).
    pub eagle_junction_tail: bool,
    /// vLLM's `dcp_world_size` (decode context parallelism; 1 without it). Group block sizes
    /// come already scaled ([`GroupSpec::block_size`] is what vLLM's manager for the group
    /// uses); the core reads it only where vLLM's coordinator does: partial hash hits under
    /// DCP accept a Mamba "align" block equal to the hash block
    /// ([`Self::partial_hash_hits`]).
    pub dcp_world_size: u32,
    /// vLLM's `num_reprefillable_tokens`, `max(0, num_prefill_lookahead - 1)`: multi-module
    /// MTP (DeepSeek-V3-style heads drafting several tokens) reads that many prefill tokens
    /// past a chunk's end, so the last ones of a chunk may be prefilled again and their KV is
    /// not final. vLLM's coordinator caches only up to `num_computed_tokens` minus these:
    /// a single group (and the no-prefix-cache coordinator, which caches nothing) always,
    /// a hybrid coordinator only in the groups dropping the EAGLE block (the others cache the
    /// aligned `num_computed_tokens`, as without it). 0: every computed token is final.
    pub reprefillable_tokens: u32,
    /// vLLM's `MambaManager.drop_eagle_checkpoint_block`, which the coordinator sets on every
    /// Mamba group when the scheduler passes `use_eagle` (prefix caching on or off; 0.32 does
    /// not set it for a group flagged `is_eagle_group` alone): the Mamba "align" prefill
    /// checkpoint positions are the last hash boundary at most the tokens given, one hash
    /// block back (`get_mamba_prefill_checkpoint_position` with `drop_eagle_block`: the drop
    /// already leaves tokens to recompute, and the state matches the attention groups'
    /// replay boundary). Read by Mamba "align" groups only.
    pub eagle_checkpoints: bool,
    /// vLLM's `enable_mamba_shared_prefix_checkpoint` as the scheduler passes it, narrowed by
    /// the caller to a config with EAGLE/MTP groups (vLLM's `bool(eagle_group_ids)`: a group
    /// flagged `is_eagle_group`, or `use_eagle`); the core narrows it further to what
    /// vLLM's `KVCacheManager.mamba_shared_prefix_checkpoint` holds
    /// ([`Self::shared_prefix_checkpoint`]: partial hash hits, no re-prefillable tokens).
    /// Where it holds, a Mamba "align" group also keys the state at the request's junction
    /// (`shared_prefix_boundary`) when a prompt chunk computes it: the junction the scheduler
    /// ends a chunk at, so a sibling sharing the prefix resumes there.
    pub mamba_shared_prefix_checkpoint: bool,
}

/// The largest pool: block ids and the free queue's two sentinel slots fit a `u32`.
pub const MAX_NUM_BLOCKS: u32 = u32::MAX - 2;

/// Which coordinator vLLM would build for this config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinatorKind {
    /// Prefix caching off.
    NoPrefixCache,
    /// Caching on, one group.
    Unitary,
    /// Caching on, several groups.
    Hybrid,
}

impl Config {
    /// A config of `num_blocks` blocks (the null block included) over `groups`, hashed and
    /// scheduled at `block_size` tokens, with the defaults: prefix caching on, events off,
    /// no watermark, dense retention (`retention_interval: None`), no zeroing, no lookahead
    /// hashes, no residency log, no boundary offloads, no EAGLE/MTP block drop or checkpoint
    /// move, no re-prefillable tokens, no shared-prefix checkpoint, and `max_model_len` and
    /// `max_in_flight_tokens` of [`Self::DEFAULT_MAX_MODEL_LEN`] tokens. Override a field
    /// with struct update syntax: `Config { enable_events: true, ..Config::new(..) }`.
    /// Nothing is checked here ([`Self::validate`] is, by `Allocator::new`).
    pub fn new(num_blocks: u32, groups: Vec<GroupSpec>, block_size: u32) -> Self {
        Self {
            num_blocks,
            groups,
            hash_block_size: block_size,
            scheduler_block_size: block_size,
            max_model_len: Self::DEFAULT_MAX_MODEL_LEN,
            max_in_flight_tokens: Self::DEFAULT_MAX_MODEL_LEN,
            enable_caching: true,
            enable_events: false,
            watermark_blocks: 0,
            retention_interval: None,
            zero_new_blocks: false,
            hash_lookahead_tokens: 0,
            residency_log: false,
            boundary_offloads: false,
            slots_per_page: 1,
            admission_headroom_slots: 0,
            prefix_match_unit: None,
            eagle_drop_groups: 0,
            eagle_junction_tail: false,
            dcp_world_size: 1,
            reprefillable_tokens: 0,
            eagle_checkpoints: false,
            mamba_shared_prefix_checkpoint: false,
        }
    }

    /// Whether group `g` takes whole pages under two-level pages (a state group: Mamba).
    pub fn is_state_group(g: &GroupSpec) -> bool {
        matches!(g.kind, AttentionKind::Mamba { .. })
    }

    /// The two-level page checks ([`Self::slots_per_page`] > 1); nothing with `k == 1`.
    fn validate_pages(&self) -> Result<()> {
        let k = self.slots_per_page;
        if k == 0 {
            return Err(Error::InvalidConfig("slots_per_page must be at least 1".into()));
        }
        if k == 1 {
            if self.admission_headroom_slots > 0 {
                return Err(Error::InvalidConfig(format!(
                    "admission_headroom_slots={} needs two-level pages (slots_per_page > 1)",
                    self.admission_headroom_slots
                )));
            }
            return Ok(());
        }
        let refuse = |what: &str| Err(Error::Unsupported(format!("{what} is not served with slots_per_page={k} > 1")));
        if (self.num_blocks as u64) * (k as u64) > MAX_NUM_BLOCKS as u64 {
            return Err(Error::InvalidConfig(format!(
                "num_blocks {} pages x slots_per_page {k} = {} slots is above the largest pool served ({MAX_NUM_BLOCKS})",
                self.num_blocks,
                self.num_blocks as u64 * k as u64
            )));
        }
        if !self.groups.iter().any(Self::is_state_group) {
            return Err(Error::InvalidConfig(format!(
                "slots_per_page={k} needs a state group (mamba or mamba_align) to size the pages"
            )));
        }
        if self.groups.iter().all(Self::is_state_group) {
            return Err(Error::InvalidConfig(format!(
                "slots_per_page={k} needs a slot group (an attention group) to take the slots"
            )));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if !Self::is_state_group(g) && g.kind != AttentionKind::Full {
                let name = match g.kind {
                    AttentionKind::Rswa { .. } => "an R-SWA group",
                    AttentionKind::SlidingWindow { .. } | AttentionKind::SlidingWindowReplay { .. } => {
                        "a sliding-window group"
                    }
                    AttentionKind::ChunkedLocal { .. } => "a chunked local attention group",
                    AttentionKind::Cross => "cross attention",
                    _ => "a circular buffer group",
                };
                return refuse(&format!("{name} (group {i}; only full attention takes slots)"));
            }
        }
        // Zeroing (`zero_new_blocks`) is served: only attention groups record new blocks, so
        // the ids recorded are slots, which the workers' small-block views address.
        self.validate_unit()
    }

    /// A `prefix_match_unit` with two-level pages (caching on): the hash block, and every slot
    /// group's block. A unit below the slot would make a hit end inside a slot, copied on
    /// write by vLLM's workers at the scheduler's block, a page, not a slot.
    fn validate_unit(&self) -> Result<()> {
        let Some(u) = self.prefix_match_unit.filter(|_| self.enable_caching) else { return Ok(()) };
        if u != self.hash_block_size {
            return Err(Error::InvalidConfig(format!(
                "prefix_match_unit {u} is not the hash block size {} (vLLM hashes at the unit)",
                self.hash_block_size
            )));
        }
        if let Some(g) = self.groups.iter().find(|g| !Self::is_state_group(g) && g.block_size != u) {
            return Err(Error::Unsupported(format!(
                "prefix_match_unit {u} with {}-token slots is not served with slots_per_page={} > 1 \
                 (only a unit equal to the slot block: a hit inside a slot would be copied on write)",
                g.block_size, self.slots_per_page
            )));
        }
        Ok(())
    }

    /// `max_model_len` (and `max_in_flight_tokens`) of [`Self::new`].
    pub const DEFAULT_MAX_MODEL_LEN: u32 = 4096;

    /// The coordinator vLLM picks (`get_kv_cache_coordinator`).
    pub fn coordinator_kind(&self) -> CoordinatorKind {
        if !self.enable_caching {
            CoordinatorKind::NoPrefixCache
        } else if self.groups.len() == 1 {
            CoordinatorKind::Unitary
        } else {
            CoordinatorKind::Hybrid
        }
    }

    /// Whether vLLM's coordinator enables fine-grained ("partial") hash hits
    /// (`partial_hash_hits_enabled`, the `--prefix-match-unit` machinery): caching on, several
    /// groups, a Mamba "align" group whose block is larger than the hash block (at least the
    /// hash block under DCP, [`Self::dcp_world_size`] > 1: the scaled full-attention block then
    /// exceeds the hash block, so its hits end inside blocks), and every
    /// other prefix-cacheable group either looked up at hash granularity (full attention,
    /// Mamba) or one hash block large. Hits may then end inside a block (the hash block
    /// is the hit alignment), and the prompt's last hash boundary is cached inside its block.
    /// With two-level pages ([`Self::slots_per_page`] > 1) only with a
    /// [`Self::prefix_match_unit`]: there the hash block is the small attention block by
    /// construction, below the Mamba block without any unit, and hits then end at state blocks
    /// (`scheduler_block_size`). With a unit (the slot block, see its checks) hits end at any
    /// unit boundary, as with one page size.
    pub fn partial_hash_hits(&self) -> bool {
        let hbs = self.hash_block_size;
        (self.slots_per_page <= 1 || self.prefix_match_unit.is_some())
            && self.coordinator_kind() == CoordinatorKind::Hybrid
            && self.groups.iter().any(|g| {
                g.kind.is_mamba_align() && (g.block_size > hbs || (self.dcp_world_size > 1 && g.block_size >= hbs))
            })
            && self
                .groups
                .iter()
                .all(|g| !g.kind.is_prefix_cacheable() || g.kind.fine_grained_lookup() || g.block_size == hbs)
    }

    /// vLLM's `KVCacheManager.mamba_shared_prefix_checkpoint` (0.32-0.34: the flag with
    /// EAGLE/MTP groups, [`Self::mamba_shared_prefix_checkpoint`], the coordinator's partial
    /// hash hits, and no re-prefillable tokens, whose chunk end `cache_blocks` is not handed):
    /// the Mamba "align" groups key the state at the junction a prompt chunk computes, and the
    /// scheduler ends chunks there.
    pub fn shared_prefix_checkpoint(&self) -> bool {
        self.mamba_shared_prefix_checkpoint && self.partial_hash_hits() && self.reprefillable_tokens == 0
    }

    /// Whether some group keys blocks at hash boundaries inside them (vLLM's
    /// `FullAttentionManager._cache_partial_tail_block`, "partial-block prefix entries"): with
    /// partial hash hits, or where a hybrid's full-attention group has a block larger than
    /// the hash block (a full group of 32 beside a sliding-window group of 16: hash block 16).
    /// vLLM keys the prompt's last hash boundary inside its block there even without partial
    /// hits (hits never reach those keys then, but they are stored, evicted and reported).
    pub fn partial_block_entries(&self) -> bool {
        self.partial_hash_hits()
            || (self.enable_caching
                && self.slots_per_page <= 1
                && self.coordinator_kind() == CoordinatorKind::Hybrid
                && self.groups.iter().any(|g| g.kind == AttentionKind::Full && g.block_size > self.hash_block_size))
    }

    /// The alignment (in tokens) of cache-hit lengths (the coordinator's
    /// `_cache_hit_alignment_tokens`): the hash block size with partial hash hits, else the
    /// scheduler block size.
    pub fn cache_hit_alignment_tokens(&self) -> u32 {
        if self.partial_hash_hits() {
            self.hash_block_size
        } else {
            self.scheduler_block_size
        }
    }

    /// Whether group `g`'s cache hits drop their last matched block (vLLM's EAGLE/MTP drop,
    /// decided per spec group: `g` or a group with an equal spec is in
    /// [`Self::eagle_drop_groups`]); the group's manager is then vLLM's `use_eagle` one.
    /// Always false with prefix caching off (vLLM's no-prefix-cache coordinator sets no
    /// manager's flag) and for a group that takes no hits.
    pub fn drops_eagle_block(&self, g: usize) -> bool {
        if self.eagle_drop_groups == 0 {
            return false;
        }
        let me = &self.groups[g];
        match self.coordinator_kind() {
            CoordinatorKind::NoPrefixCache => false,
            CoordinatorKind::Unitary => self.eagle_drop_groups & 1 != 0,
            CoordinatorKind::Hybrid => {
                me.kind.is_prefix_cacheable()
                    && me.kind.takes_hits()
                    && self.groups.iter().enumerate().any(|(i, o)| {
                        self.eagle_drop_groups >> i & 1 != 0
                            && o.kind == me.kind
                            && o.block_size == me.block_size
                            && o.spec_key == me.spec_key
                    })
            }
        }
    }

    /// Whether any group drops the EAGLE block (vLLM's `bool(drop_eagle_group_ids)`, which
    /// sets the replay boundaries every group's retention mask keeps).
    pub fn eagle_drop(&self) -> bool {
        self.enable_caching && self.eagle_drop_groups != 0
    }

    /// The EAGLE block drop checks ([`Self::eagle_drop`]): what vLLM cannot run and what
    /// the core does not serve with it (yet).
    fn validate_eagle(&self) -> Result<()> {
        let n = self.groups.len();
        if n < 64 && self.eagle_drop_groups >> n != 0 {
            return Err(Error::InvalidConfig(format!(
                "eagle_drop_groups {:#x} names a group past the {n} groups",
                self.eagle_drop_groups
            )));
        }
        if !self.eagle_drop() {
            return Ok(());
        }
        let refuse = |what: String| Err(Error::Unsupported(format!("the EAGLE/MTP block drop with {what}")));
        if self.slots_per_page > 1 {
            return refuse(format!("slots_per_page={}", self.slots_per_page));
        }
        for (i, g) in self.groups.iter().enumerate() {
            match g.kind {
                // vLLM asserts (`Hybrid KV cache is not supported for eagle + chunked local
                // attention`) at the first lookup of a dropping chunked group.
                AttentionKind::ChunkedLocal { .. } if self.drops_eagle_block(i) => {
                    return Err(Error::InvalidConfig(format!(
                        "group {i}: vLLM does not run the EAGLE/MTP block drop with chunked local attention"
                    )));
                }
                AttentionKind::Rswa { .. } => return refuse(format!("an R-SWA group (group {i})")),
                _ => {}
            }
        }
        Ok(())
    }

    /// The recycling-aware per-request admission cap of a group, in blocks
    /// (`SlidingWindowSpec` / `ChunkedLocalAttentionSpec.max_admission_blocks_per_request`).
    pub fn max_admission_blocks(&self, g: &GroupSpec) -> Option<u32> {
        g.kind.max_admission_blocks(g.block_size, self.max_in_flight_tokens, self.max_model_len)
    }

    /// Checks the config; the allocator relies on every rule here.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for what vLLM would reject too, [`Error::Unsupported`] for
    /// what vLLM serves but this core does not (the vLLM plugin falls back on it).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.num_blocks == 0 {
            return bad("num_blocks must be at least 1 (block 0 is the null block)".into());
        }
        if self.num_blocks > MAX_NUM_BLOCKS {
            return bad(format!("num_blocks {} is above the largest pool served ({MAX_NUM_BLOCKS})", self.num_blocks));
        }
        if self.groups.is_empty() {
            return bad("at least one KV cache group is required".into());
        }
        self.validate_pages()?;
        if self.groups.len() > 64 {
            return bad(format!("{} groups; at most 64 are supported", self.groups.len()));
        }
        self.validate_eagle()?;
        if self.hash_block_size == 0 || self.scheduler_block_size == 0 {
            return bad("hash_block_size and scheduler_block_size must be positive".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be positive".into());
        }
        if self.dcp_world_size == 0 {
            return bad("dcp_world_size must be at least 1".into());
        }
        if self.scheduler_block_size % self.hash_block_size != 0 {
            return bad(format!(
                "scheduler_block_size {} is not a multiple of hash_block_size {}",
                self.scheduler_block_size, self.hash_block_size
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.block_size == 0 {
                return bad(format!("group {i}: block_size must be positive"));
            }
            if self.scheduler_block_size % g.block_size != 0 {
                return bad(format!(
                    "group {i}: scheduler_block_size {} is not a multiple of block_size {}",
                    self.scheduler_block_size, g.block_size
                ));
            }
            g.kind.check_params(self, i)?;
            if self.enable_caching && g.kind.is_prefix_cacheable() {
                if g.block_size % self.hash_block_size != 0 {
                    return bad(format!(
                        "group {i}: block_size {} is not a multiple of hash_block_size {}",
                        g.block_size, self.hash_block_size
                    ));
                }
                g.kind.check_with_caching(self, i, g)?;
            }
        }
        if self.enable_caching && !self.groups.iter().any(|g| g.kind.is_prefix_cacheable()) {
            return Err(Error::Unsupported("prefix caching on with no prefix-cacheable group".into()));
        }
        if self.coordinator_kind() == CoordinatorKind::Unitary && self.hash_block_size != self.groups[0].block_size {
            return bad("a single cached group needs hash_block_size == block_size".into());
        }
        if let Some(r) = self.retention_interval {
            let has_sparse = self.groups.iter().any(|g| g.kind.sparse_retention());
            if !has_sparse && r != 0 {
                return bad("prefix_cache_retention_interval is set but no sliding-window group exists".into());
            }
            if has_sparse && r % self.scheduler_block_size != 0 {
                return bad(format!(
                    "prefix_cache_retention_interval ({r}) must be a multiple of \
                     scheduler_block_size ({})",
                    self.scheduler_block_size
                ));
            }
        }
        Ok(())
    }
}
