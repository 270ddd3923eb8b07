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
    /// Served with the exact policy, full-attention slot groups and no partial hash hits
    /// ([`Self::validate`] names what it refuses); with `zero_new_blocks` the ids recorded for
    /// zeroing are slot ids (only attention groups record).
    pub slots_per_page: u32,
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
    /// hashes, no residency log, no boundary offloads, and `max_model_len` and
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
                    AttentionKind::SlidingWindow { .. } => "a sliding-window group",
                    AttentionKind::ChunkedLocal { .. } => "a chunked local attention group",
                    AttentionKind::Cross => "cross attention",
                    _ => "a circular buffer group",
                };
                return refuse(&format!("{name} (group {i}; only full attention takes slots)"));
            }
        }
        // Zeroing (`zero_new_blocks`) is served: only attention groups record new blocks, so
        // the ids recorded are slots, which the workers' small-block views address.
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
    /// groups, a Mamba "align" group whose block is larger than the hash block, and every
    /// other prefix-cacheable group either looked up at hash granularity (full attention,
    /// Mamba) or one hash block large. Hits may then end inside a block (the hash block
    /// is the hit alignment), and the prompt's last hash boundary is cached inside its block.
    /// Never with two-level pages ([`Self::slots_per_page`] > 1): there the hash block is the
    /// small attention block by construction, below the Mamba block without any
    /// `prefix_match_unit`; hits end at state blocks (`scheduler_block_size`), and a
    /// `prefix_match_unit` (hits inside a state block) is not served (the plugin falls back).
    pub fn partial_hash_hits(&self) -> bool {
        let hbs = self.hash_block_size;
        self.slots_per_page <= 1
            && self.coordinator_kind() == CoordinatorKind::Hybrid
            && self.groups.iter().any(|g| g.kind.is_mamba_align() && g.block_size > hbs)
            && self
                .groups
                .iter()
                .all(|g| !g.kind.is_prefix_cacheable() || g.kind.fine_grained_lookup() || g.block_size == hbs)
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
        if self.hash_block_size == 0 || self.scheduler_block_size == 0 {
            return bad("hash_block_size and scheduler_block_size must be positive".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be positive".into());
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
