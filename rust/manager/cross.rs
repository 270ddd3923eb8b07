//! Cross attention (encoder-decoder, vLLM's `CrossAttentionManager`): one static allocation
//! from the encoder length, never prefix cached (refused with caching on) and never recycled.
//! Its rules ([`Cross`]) only switch off what the defaults do: no hit search, no caching,
//! nothing skipped, no tokens computed elsewhere, a table sized by the encoder tokens.
//!
//! Per-request state: none beyond the shared table.
//!
//! Cost: every method here is O(1) (the allocation is the default's).
#![forbid(unsafe_code)]

use super::{CacheArgs, HitQuery, KindRules, SingleTypeManager};
use crate::block_pool::BlockPool;
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::{BlockId, Slot};

/// Cross attention's rules (vLLM's `CrossAttentionManager`).
#[derive(Clone, Copy, Debug)]
pub struct Cross;

impl KindRules for Cross {
    fn takes_hits(&self) -> bool {
        false
    }

    fn sized_by_encoder_tokens(&self) -> bool {
        true
    }

    fn covers_sequence(&self) -> bool {
        false
    }

    fn check_with_caching(&self, _cfg: &Config, i: usize, _g: &GroupSpec) -> Result<()> {
        Err(Error::Unsupported(format!(
            "group {i}: cross attention with prefix caching on (vLLM's own \
             CrossAttentionManager raises on cache_blocks and on the hit search then; \
             vLLM turns prefix caching off for encoder-decoder models)"
        )))
    }

    fn find_longest_cache_hit(&self, _q: &HitQuery<'_>, _out: &mut [Vec<BlockId>]) -> u32 {
        0
    }

    /// Nothing changes once the encoder's allocation is made.
    fn noop_limits(&self, _m: &SingleTypeManager, _h: Slot) -> (u32, u32, u32, u32) {
        (u32::MAX, u32::MAX, u32::MAX, u32::MAX)
    }

    fn add_local_computed_blocks(
        &self,
        _m: &mut SingleTypeManager,
        _pool: &mut BlockPool,
        _h: Slot,
        new_computed: &[BlockId],
        _num_local_computed_tokens: u32,
        _num_external_computed_tokens: u32,
    ) {
        no_hits(new_computed);
    }

    fn allocate_external_computed_blocks(
        &self,
        _m: &mut SingleTypeManager,
        _pool: &mut BlockPool,
        _h: Slot,
        _num_local_computed_tokens: u32,
        _num_external_computed_tokens: u32,
        _record_for_zeroing: bool,
    ) {
    }

    fn blocks_to_cache(&self, _m: &SingleTypeManager, _h: Slot, _num_hashes: usize, _num_tokens: u32) -> (u32, u32) {
        (0, 0)
    }

    fn cache_blocks(&self, _m: &mut SingleTypeManager, _pool: &mut BlockPool, _h: Slot, _c: &CacheArgs<'_>) {}
}

/// `add_local_computed_blocks` of a kind without a hit search: there is nothing to add.
pub(super) fn no_hits(new_computed: &[BlockId]) {
    assert!(new_computed.is_empty(), "cross attention and circular buffers never have cache hits");
}
