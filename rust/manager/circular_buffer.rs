//! A circular buffer (vLLM's `CircularBufferSpec` + `CircularBufferManager`, DeepSeek-V4's
//! compressor ring): one block per request for its whole life, claimed the first time the
//! request needs it, never prefix cached (no hit search, nothing cached), never recorded for
//! KV cache zeroing (not an attention block: [`crate::AttentionKind::is_attention`]).
//!
//! Its rules ([`CircularBuffer`]) override the allocation, the count and the no-op limits,
//! and switch the hit search and caching off.
//!
//! Per-request state: none beyond the shared table (empty until the block is claimed).
//!
//! Cost: every function here is O(1).
#![forbid(unsafe_code)]

use super::cross::no_hits;
use super::{CacheArgs, CountArgs, HitQuery, KindRules, SingleTypeManager};
use crate::block_pool::BlockPool;
use crate::ids::{BlockId, Slot};

/// A circular buffer's rules (vLLM's `CircularBufferManager`).
#[derive(Clone, Copy, Debug)]
pub struct CircularBuffer;

impl KindRules for CircularBuffer {
    fn is_attention(&self) -> bool {
        false
    }

    fn is_prefix_cacheable(&self) -> bool {
        false
    }

    fn takes_hits(&self) -> bool {
        false
    }

    fn covers_sequence(&self) -> bool {
        false
    }

    fn find_longest_cache_hit(&self, _q: &HitQuery<'_>, _out: &mut [Vec<BlockId>]) -> u32 {
        0
    }

    fn noop_limits(&self, m: &SingleTypeManager, h: Slot) -> (u32, u32, u32, u32) {
        let (slots, processed, cached) = m.ring_noop_limits(h);
        (slots, processed, cached, u32::MAX)
    }

    fn get_num_blocks_to_allocate(&self, m: &SingleTypeManager, _pool: &BlockPool, h: Slot, _c: &CountArgs<'_>) -> i64 {
        m.ring_num_blocks_to_allocate(h)
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
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        _num_local_computed_tokens: u32,
        _num_external_computed_tokens: u32,
        record_for_zeroing: bool,
    ) {
        m.claim_ring_block(pool, h, record_for_zeroing);
    }

    fn allocate_new_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        _num_tokens: u32,
        _num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        m.ring_allocate_new_blocks(pool, h, out);
    }

    fn blocks_to_cache(&self, _m: &SingleTypeManager, _h: Slot, _num_hashes: usize, _num_tokens: u32) -> (u32, u32) {
        (0, 0)
    }

    fn cache_blocks(&self, _m: &mut SingleTypeManager, _pool: &mut BlockPool, _h: Slot, _c: &CacheArgs<'_>) {}
}

impl SingleTypeManager {
    /// The request's one block, taken the first time it needs it (vLLM's
    /// `CircularBufferManager._claim_ring_block`).
    pub(super) fn claim_ring_block(&mut self, pool: &mut BlockPool, h: Slot, record_for_zeroing: bool) {
        let table = &mut self.req_blocks[h as usize];
        if table.is_empty() {
            pool.get_new_blocks(1, table);
            if record_for_zeroing {
                self.record_new(0, h);
            }
        }
    }

    /// Blocks to take: one until the ring block is claimed.
    pub(super) fn ring_num_blocks_to_allocate(&self, h: Slot) -> i64 {
        self.req_blocks[h as usize].is_empty() as i64
    }

    /// `allocate_new_blocks`: claims the ring block (reported as new) if not yet claimed.
    pub(super) fn ring_allocate_new_blocks(&mut self, pool: &mut BlockPool, h: Slot, out: &mut Vec<BlockId>) {
        let start = self.req_blocks[h as usize].len();
        self.claim_ring_block(pool, h, true);
        out.extend_from_slice(&self.req_blocks[h as usize][start..]);
    }

    /// `(slots, processed, cached)` no-op limits: nothing changes once the block is claimed.
    pub(super) fn ring_noop_limits(&self, h: Slot) -> (u32, u32, u32) {
        let slots = if self.req_blocks[h as usize].is_empty() { 0 } else { u32::MAX };
        (slots, u32::MAX, u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AttentionKind, GroupSpec};

    #[test]
    fn allocate_new_blocks_ring_claims_one_block_once() {
        let spec = GroupSpec { kind: AttentionKind::CircularBuffer, block_size: 8, spec_key: 0 };
        let mut m = SingleTypeManager::new(spec, 0, None, true, 16, 8, 0);
        m.ensure_slot(0);
        let mut pool = BlockPool::new(8, true, false);
        assert_eq!(m.ring_num_blocks_to_allocate(0), 1);
        assert_eq!(m.ring_noop_limits(0).0, 0);
        let mut out = Vec::new();
        m.allocate_new_blocks(&mut pool, 0, 500, 500, &mut out);
        assert_eq!(out.len(), 1);
        m.allocate_new_blocks(&mut pool, 0, 900, 900, &mut out);
        assert_eq!((out.len(), m.blocks(0).len()), (1, 1));
        assert_eq!(m.ring_num_blocks_to_allocate(0), 0);
        assert_eq!(m.ring_noop_limits(0), (u32::MAX, u32::MAX, u32::MAX));
    }
}
