//! The no-op limits of a group: bounds under which a plain step of a request provably
//! allocates, frees and caches nothing in the group (the coordinator's decode fast path
//! takes their minimum over groups). Each kind's bound comes from its rules, in its own file
//! ([`super::KindRules::noop_limits`], by default a positional table's limits here with the
//! kind's [`super::KindRules::noop_processed`]).
//!
//! Cost: O(1) per request.
#![forbid(unsafe_code)]

use super::{with_rules, KindState, SingleTypeManager};
use crate::ids::Slot;

/// `x` capped at `u32::MAX`.
#[inline]
pub(super) fn clamp(x: u64) -> u32 {
    x.min(u32::MAX as u64) as u32
}

impl SingleTypeManager {
    /// The limits under which a plain step of `h` (no new hit, no external tokens, no
    /// encoder tokens, no admission gate, no reserve, no watermark) changes nothing in this
    /// group: `(slots, processed, cached, new_tokens)` such that a step with
    /// `need_slot <= slots`, `processed < processed_limit`, `to_cache < cached` and
    /// `num_new_tokens <= new_tokens` allocates, frees and caches nothing. Conservative: a
    /// step outside them may still be a no-op.
    pub(crate) fn noop_limits(&self, h: Slot) -> (u32, u32, u32, u32) {
        with_rules!(self.spec.kind, r => r.noop_limits(self, h))
    }

    /// `(slots, cached)` no-op limits of a positional table (the default rules'): no
    /// allocation while the slots fit the table, no caching before the next full block.
    #[inline]
    pub(super) fn positional_noop_limits(&self, h: Slot) -> (u32, u32) {
        let bs = self.spec.block_size as u64;
        let slots = clamp(self.req_blocks[h as usize].len() as u64 * bs);
        (slots, self.noop_cached(h))
    }

    /// The `cached` no-op limit: caching starts at the next full block (never with caching off).
    #[inline]
    pub(super) fn noop_cached(&self, h: Slot) -> u32 {
        if self.enable_caching {
            let next_block = clamp((self.num_cached(h) as u64 + 1) * self.spec.block_size as u64);
            if self.hash_block_size == self.spec.block_size {
                // No key inside a block (no pending partial tail): skip its load.
                return next_block;
            }
            match &self.kind_state {
                KindState::Full(st) => st.pending(h).map_or(next_block, |t| next_block.min(t)),
                _ => next_block,
            }
        } else {
            u32::MAX
        }
    }

    /// The smallest prompt length for which [`Self::noop_limits`] of `h` hold (R-SWA: the
    /// prompt length they were computed for; a shorter one moves the gap's start down).
    pub(crate) fn noop_min_prompt(&self, h: Slot) -> u32 {
        match &self.kind_state {
            KindState::Rswa(st) => st.min_prompt(h),
            _ => 0,
        }
    }
}
