//! The rules that vary by attention kind, behind one trait ([`KindRules`], vLLM's
//! `SingleTypeKVCacheManager` base class and its overridable methods), and the one place
//! that maps a group's [`AttentionKind`] to its kind's rules (`with_rules!`, vLLM's
//! `spec_manager_map`). Each kind file holds one rules struct (the kind's parameters) and
//! its `impl KindRules`, overriding only what differs from the defaults here, which are
//! full attention's rules (as vLLM's subclasses override its base class). The shared
//! bookkeeping the rules work on is the manager's ([`SingleTypeManager`]); the kinds' files
//! are the manager's children, so their rules read and write it directly.
//!
//! Invariants: a rules struct is a copy of its group's parameters and nothing else (per-request
//! state lives in the manager's [`KindState`], made by [`KindRules::new_state`]); the dispatch
//! is static (one `match` on [`AttentionKind`], written once in `with_rules!` and inlined at
//! each use), so a manager operation costs what a hand-written `match` would.
//!
//! Cost: the dispatch is O(1); each method is its kind's (see the kind's file), the defaults
//! O(blocks they touch).
#![forbid(unsafe_code)]

use super::{cdiv, full, CacheArgs, CountArgs, HitQuery, KindState, SingleTypeManager};
use crate::block_pool::BlockPool;
use crate::config::{AttentionKind, Config, GroupSpec};
use crate::error::Result;
use crate::ids::{BlockId, Slot, NULL_BLOCK};

/// Runs `$body` with `$r` bound to the rules of attention kind `$kind` (a `&` to the kind
/// file's rules struct): the one place a kind is matched (vLLM's `spec_manager_map`). A new
/// kind adds one arm here.
macro_rules! with_rules {
    ($kind:expr, $r:ident => $body:expr) => {{
        use $crate::config::AttentionKind as K;
        use $crate::manager::kind::KindRules as _;
        match $kind {
            K::Full => {
                let $r = &$crate::manager::full::Full;
                $body
            }
            K::Rswa { window } => {
                let $r = &$crate::manager::rswa::Rswa { window };
                $body
            }
            K::SlidingWindow { window, extra_retained_tokens } => {
                let $r = &$crate::manager::sliding_window::SlidingWindow { window, extra_retained_tokens };
                $body
            }
            K::SlidingWindowReplay { window, extra_retained_tokens } => {
                let $r = &$crate::manager::swa_replay::SlidingWindowReplay {
                    swa: $crate::manager::sliding_window::SlidingWindow { window, extra_retained_tokens },
                };
                $body
            }
            K::ChunkedLocal { chunk } => {
                let $r = &$crate::manager::chunked_local::ChunkedLocal { chunk };
                $body
            }
            K::Cross => {
                let $r = &$crate::manager::cross::Cross;
                $body
            }
            K::Mamba { speculative_blocks, align: false, .. } => {
                let $r = &$crate::manager::mamba::MambaNone { speculative_blocks };
                $body
            }
            K::Mamba { speculative_blocks, align: true, rekey_cached_tail, checkpoint_alignment } => {
                let $r =
                    &$crate::manager::mamba::MambaAlign { speculative_blocks, rekey_cached_tail, checkpoint_alignment };
                $body
            }
            K::CircularBuffer => {
                let $r = &$crate::manager::circular_buffer::CircularBuffer;
                $body
            }
        }
    }};
}
pub(crate) use with_rules;

/// The rules of one attention kind (vLLM's `SingleTypeKVCacheManager` subclass). Every
/// method has a default, full attention's; a kind overrides what its vLLM subclass does.
/// Methods taking `m` are the manager operations of the same name
/// (see [`SingleTypeManager`]); `m` is the group's manager.
pub trait KindRules {
    /// Whether vLLM treats this kind as a `FullAttentionSpec` in the hybrid hit search.
    fn is_full(&self) -> bool {
        false
    }

    /// Whether vLLM records this kind's new blocks for KV cache zeroing (an attention spec;
    /// a Mamba state block or a circular buffer is not an attention block).
    fn is_attention(&self) -> bool {
        true
    }

    /// Whether the group takes part in prefix caching (vLLM's `prefix_cacheable`; cross
    /// attention is refused with caching on, so it counts as cacheable).
    fn is_prefix_cacheable(&self) -> bool {
        true
    }

    /// Whether the group has a hit search and caches full blocks under the request's hashes.
    fn takes_hits(&self) -> bool {
        true
    }

    /// Whether the table is sized by the encoder tokens, not the sequence.
    fn sized_by_encoder_tokens(&self) -> bool {
        false
    }

    /// Whether the table is positional over the sequence (`len * block_size` covers the
    /// tokens given).
    fn covers_sequence(&self) -> bool {
        true
    }

    /// Whether this is a Mamba group in cache mode "align".
    fn is_mamba_align(&self) -> bool {
        false
    }

    /// Whether vLLM's manager looks hits up at hash granularity when partial hash hits are
    /// on (`supports_fine_grained_hash_lookup`: full attention and Mamba).
    fn fine_grained_lookup(&self) -> bool {
        false
    }

    /// Whether the kind has a retention mask (`reachable_block_mask`), so that
    /// `prefix_cache_retention_interval` applies to it.
    fn sparse_retention(&self) -> bool {
        false
    }

    /// The recycling-aware per-request admission cap in blocks
    /// (`max_admission_blocks_per_request`); `None`: no cap.
    fn max_admission_blocks(&self, _block_size: u32, _max_in_flight_tokens: u32, _max_model_len: u32) -> Option<u32> {
        None
    }

    /// The kind's own checks of its parameters (group `i` of `cfg`), before the caching checks.
    ///
    /// # Errors
    /// What [`Config::validate`] returns for them.
    fn check_params(&self, _cfg: &Config, _i: usize) -> Result<()> {
        Ok(())
    }

    /// The kind's own checks with prefix caching on (group `i` of `cfg` is `g`, whose block
    /// size is a multiple of the hash block size).
    ///
    /// # Errors
    /// What [`Config::validate`] returns for them.
    fn check_with_caching(&self, _cfg: &Config, _i: usize, _g: &GroupSpec) -> Result<()> {
        Ok(())
    }

    /// A new manager's per-request state (the [`KindState`] arm of a kind that keeps one).
    fn new_state(&self) -> KindState {
        KindState::Stateless
    }

    /// Tokens before the attention window of the next token (`get_num_skipped_tokens`).
    #[inline]
    fn num_skipped_tokens(&self, _num_computed_tokens: u32) -> u32 {
        0
    }

    /// The token slots the table is sized for when `num_tokens` slots are asked for.
    #[inline]
    fn slot_tokens(&self, num_tokens: u32, _block_size: u32) -> u64 {
        num_tokens as u64
    }

    /// The kind's `find_longest_cache_hit` (`out` is cleared; see [`super::find_longest_cache_hit`]).
    fn find_longest_cache_hit(&self, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
        full::find_longest_cache_hit(q, out)
    }

    /// Which blocks in `start..end` are worth caching (`reachable_block_mask`); `None`: all.
    fn reachable_block_mask(
        &self,
        _start: u32,
        _end: u32,
        _alignment_tokens: u32,
        _block_size: u32,
        _c: &CacheArgs<'_>,
    ) -> Option<Vec<bool>> {
        None
    }

    /// Contiguous cached blocks a hit needs at its end (`None`: the whole prefix, or no hit).
    fn hit_tail_blocks(&self, _block_size: u32) -> Option<u32> {
        None
    }

    /// Processed tokens below which a plain step of `h` frees nothing (the `processed` no-op
    /// limit of a positional table, see [`SingleTypeManager::noop_limits`]).
    #[inline]
    fn noop_processed(&self, _m: &SingleTypeManager, _h: Slot) -> u32 {
        u32::MAX
    }

    /// [`SingleTypeManager::noop_limits`]: a table that grows by block and frees by
    /// [`Self::noop_processed`].
    #[inline]
    fn noop_limits(&self, m: &SingleTypeManager, h: Slot) -> (u32, u32, u32, u32) {
        let (slots, cached) = m.positional_noop_limits(h);
        (slots, self.noop_processed(m, h), cached, u32::MAX)
    }

    /// vLLM's `get_num_blocks_to_allocate` (see [`SingleTypeManager::get_num_blocks_to_allocate`]).
    fn get_num_blocks_to_allocate(&self, m: &SingleTypeManager, pool: &BlockPool, h: Slot, c: &CountArgs<'_>) -> i64 {
        let bs = m.block_size() as u64;
        let mut required = cdiv(self.slot_tokens(c.num_tokens, m.spec.block_size), bs) as i64;
        if c.apply_admission_cap {
            if let Some(cap) = m.max_admission_blocks {
                required = required.min(cap as i64);
            }
        }
        let num_req_blocks = m.req_blocks[h as usize].len() as i64;
        if m.is_tracked(h) || !c.adopting {
            return (required - num_req_blocks).max(0);
        }
        let skipped_blocks = (self.num_skipped_tokens(c.total_computed_tokens) as u64 / bs) as i64;
        let local_blocks = c.new_computed.len() as i64 + num_req_blocks;
        let num_new = (required - skipped_blocks.max(local_blocks)).max(0);
        let skip_new = (skipped_blocks - num_req_blocks).max(0) as usize;
        let evictable = SingleTypeManager::count_evictable(pool, c.new_computed.get(skip_new..).unwrap_or(&[]));
        // A hit ending inside a block reserves its copy-on-write copy.
        let cow = m.has_partial_local_hit(c.new_computed, c.num_local_computed_tokens) as i64;
        num_new + cow + evictable as i64
    }

    /// vLLM's `add_local_computed_blocks`: the hit's blocks, touched; those already out of
    /// the window become null.
    fn add_local_computed_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
    ) {
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let skipped_blocks = self.num_skipped_tokens(total) / m.spec.block_size;
        let table = &mut m.req_blocks[h as usize];
        assert!(table.is_empty(), "add_local_computed_blocks on a request that has blocks");
        let kept = new_computed.get(skipped_blocks as usize..).unwrap_or(&[]);
        if m.enable_caching {
            pool.touch(kept);
        } else {
            assert!(kept.is_empty(), "computed blocks with prefix caching off");
        }
        table.extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks as usize));
        table.extend_from_slice(kept);
        m.null_prefix[h as usize] = table.iter().take_while(|&&b| b == NULL_BLOCK).count() as u32;
        m.num_cached[h as usize] = table.len() as u32;
        if let (true, Some(&last)) = (m.has_partial_local_hit(new_computed, num_local_computed_tokens), kept.last()) {
            // The hit ends inside its last block: the next allocation copies it on write;
            // `num_cached` stops before it, so the copy is cached once full.
            let idx = num_local_computed_tokens / m.spec.block_size;
            m.set_partial_hit(h, idx, last);
            m.num_cached[h as usize] = idx;
        }
    }

    /// vLLM's `allocate_external_computed_blocks`.
    fn allocate_external_computed_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
        record_for_zeroing: bool,
    ) {
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let skipped = self.num_skipped_tokens(total);
        let mut ext = num_external_computed_tokens as i64;
        if skipped > 0 {
            ext = ext.min(total as i64 - skipped as i64);
        }
        if ext <= 0 {
            return;
        }
        let table = &mut m.req_blocks[h as usize];
        let need = cdiv(total as u64, m.spec.block_size as u64) as i64 - table.len() as i64;
        if need > 0 {
            let start = table.len();
            pool.get_new_blocks(need as u32, table);
            if record_for_zeroing {
                m.record_new(start, h);
            }
        }
    }

    /// vLLM's `allocate_new_blocks`: grows the table to `num_tokens` slots.
    fn allocate_new_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        num_tokens: u32,
        _num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        if let Some((idx, source)) = m.take_partial_hit(h) {
            // vLLM's partial-hit redirect: the shared tail block is replaced by a private
            // copy (reserved by the count), reported first and recorded for zeroing.
            let mut cow = Vec::with_capacity(1);
            pool.get_new_blocks(1, &mut cow);
            m.apply_cow(pool, h, idx, source, cow[0]);
            m.new_block_ids.push(cow[0]);
            out.push(cow[0]);
        }
        let required = cdiv(self.slot_tokens(num_tokens, m.spec.block_size), m.spec.block_size as u64) as usize;
        let table = &mut m.req_blocks[h as usize];
        if required > table.len() {
            let start = table.len();
            pool.get_new_blocks((required - start) as u32, table);
            out.extend_from_slice(&table[start..]);
            m.record_new(start, h);
        }
    }

    /// See [`SingleTypeManager::blocks_to_cache`].
    fn blocks_to_cache(&self, m: &SingleTypeManager, h: Slot, num_hashes: usize, num_tokens: u32) -> (u32, u32) {
        let bs = m.spec.block_size;
        let view_len = (num_hashes as u64 / (bs / m.hash_block_size) as u64).min(u32::MAX as u64) as u32;
        ((num_tokens / bs).min(view_len), m.req_blocks[h as usize].len() as u32)
    }

    /// vLLM's `cache_blocks`: the full blocks, with the kind's retention mask.
    fn cache_blocks(&self, m: &mut SingleTypeManager, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
        m.cache_full(self, pool, h, c);
    }

    /// vLLM's `remove_skipped_blocks`: frees the blocks before the window, walking back
    /// and stopping at the first null block.
    #[inline]
    fn remove_skipped_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        processed_computed_tokens: u32,
        _num_prompt_tokens: Option<u32>,
    ) {
        let skipped = self.num_skipped_tokens(processed_computed_tokens);
        if skipped == 0 {
            return;
        }
        let n = ((skipped / m.spec.block_size) as usize).min(m.req_blocks[h as usize].len());
        super::null_out_backwards(&mut m.req_blocks[h as usize], &mut m.scratch, pool, 0, n, true);
        let np = &mut m.null_prefix[h as usize];
        *np = (*np).max(n as u32);
    }
}

/// The kind's rules, asked through `with_rules!` (the forms the coordinator and the
/// config read).
impl AttentionKind {
    /// Whether vLLM treats this kind as a `FullAttentionSpec` in the hybrid hit search.
    #[inline]
    pub fn is_full(&self) -> bool {
        with_rules!(*self, r => r.is_full())
    }

    /// Whether vLLM records this kind's new blocks for KV cache zeroing (an attention spec).
    #[inline]
    pub fn is_attention(&self) -> bool {
        with_rules!(*self, r => r.is_attention())
    }

    /// Whether the group takes part in prefix caching (vLLM's `prefix_cacheable`).
    #[inline]
    pub fn is_prefix_cacheable(&self) -> bool {
        with_rules!(*self, r => r.is_prefix_cacheable())
    }

    /// Whether the group has a hit search and caches full blocks under the request's hashes.
    #[inline]
    pub fn takes_hits(&self) -> bool {
        with_rules!(*self, r => r.takes_hits())
    }

    /// Whether the table is sized by the encoder tokens, not the sequence.
    #[inline]
    pub fn sized_by_encoder_tokens(&self) -> bool {
        with_rules!(*self, r => r.sized_by_encoder_tokens())
    }

    /// Whether the table is positional over the sequence.
    #[inline]
    pub fn covers_sequence(&self) -> bool {
        with_rules!(*self, r => r.covers_sequence())
    }

    /// Whether this is a Mamba group in cache mode "align".
    #[inline]
    pub fn is_mamba_align(&self) -> bool {
        with_rules!(*self, r => r.is_mamba_align())
    }

    /// Whether vLLM's manager looks hits up at hash granularity with partial hash hits
    /// (`supports_fine_grained_hash_lookup`: full attention and Mamba).
    #[inline]
    pub fn fine_grained_lookup(&self) -> bool {
        with_rules!(*self, r => r.fine_grained_lookup())
    }

    /// See [`KindRules::sparse_retention`].
    pub(crate) fn sparse_retention(&self) -> bool {
        with_rules!(*self, r => r.sparse_retention())
    }

    /// See [`KindRules::max_admission_blocks`].
    pub(crate) fn max_admission_blocks(
        &self,
        block_size: u32,
        max_in_flight_tokens: u32,
        max_model_len: u32,
    ) -> Option<u32> {
        with_rules!(*self, r => r.max_admission_blocks(block_size, max_in_flight_tokens, max_model_len))
    }

    /// See [`KindRules::check_params`].
    pub(crate) fn check_params(&self, cfg: &Config, i: usize) -> Result<()> {
        with_rules!(*self, r => r.check_params(cfg, i))
    }

    /// See [`KindRules::check_with_caching`].
    pub(crate) fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        with_rules!(*self, r => r.check_with_caching(cfg, i, g))
    }
}
