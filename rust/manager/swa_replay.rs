//! Sliding-window attention with a bounded replay (vLLM's `SlidingWindowMLASpec` with
//! `bounded_replay`, DeepSeek-V4.1): the window's blocks are allocated and recycled as
//! [`SlidingWindow`]'s, but the group is kept out of prefix caching (vLLM's
//! `prefix_cacheable` is false): no hit search, nothing cached, no events. After a hit of the
//! other groups the scheduler recomputes the hit's last window; the manager sees ordinary
//! calls, and this group's table is the skipped blocks' nulls followed by new blocks.
//!
//! Rules ([`SlidingWindowReplay`]): [`SlidingWindow`]'s skipped tokens, freeing, admission
//! cap and checks; hits, caching and their no-op limit switched off.
//!
//! Per-request state: none beyond the shared table (the null prefix).
//!
//! Cost: every method here is O(1), or [`SlidingWindow`]'s.
#![forbid(unsafe_code)]

use super::sliding_window::SlidingWindow;
use super::{CacheArgs, HitQuery, KindRules, SingleTypeManager};
use crate::block_pool::BlockPool;
use crate::config::Config;
use crate::error::Result;
use crate::ids::{BlockId, Slot};

/// The rules of a sliding window kept out of prefix caching (vLLM's `SlidingWindowManager`
/// over a spec that is not `prefix_cacheable`).
#[derive(Clone, Copy, Debug)]
pub struct SlidingWindowReplay {
    /// The window's own rules (skipped tokens, freeing, admission cap).
    pub swa: SlidingWindow,
}

impl KindRules for SlidingWindowReplay {
    fn is_prefix_cacheable(&self) -> bool {
        false
    }

    fn takes_hits(&self) -> bool {
        false
    }

    /// vLLM's config checks count it as a sliding-window group (a retention interval is
    /// accepted); its `cache_blocks` returns before any retention applies.
    fn sparse_retention(&self) -> bool {
        true
    }

    #[inline]
    fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        self.swa.num_skipped_tokens(num_computed_tokens)
    }

    fn find_longest_cache_hit(&self, _q: &HitQuery<'_>, _out: &mut [Vec<BlockId>]) -> u32 {
        0
    }

    #[inline]
    fn noop_processed(&self, m: &SingleTypeManager, h: Slot) -> u32 {
        self.swa.noop_processed(m, h)
    }

    /// The window's limits, with nothing ever cached.
    #[inline]
    fn noop_limits(&self, m: &SingleTypeManager, h: Slot) -> (u32, u32, u32, u32) {
        let (slots, _) = m.positional_noop_limits(h);
        (slots, self.noop_processed(m, h), u32::MAX, u32::MAX)
    }

    fn max_admission_blocks(&self, block_size: u32, max_in_flight_tokens: u32, max_model_len: u32) -> Option<u32> {
        self.swa.max_admission_blocks(block_size, max_in_flight_tokens, max_model_len)
    }

    fn check_params(&self, cfg: &Config, i: usize) -> Result<()> {
        self.swa.check_params(cfg, i)
    }

    fn blocks_to_cache(&self, _m: &SingleTypeManager, _h: Slot, _num_hashes: usize, _num_tokens: u32) -> (u32, u32) {
        (0, 0)
    }

    /// vLLM's `cache_blocks` returns at once for a group that is not prefix-cacheable.
    fn cache_blocks(&self, _m: &mut SingleTypeManager, _pool: &mut BlockPool, _h: Slot, _c: &CacheArgs<'_>) {}
}
