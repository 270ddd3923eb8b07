//! The no-op limits of a group: bounds under which a plain step of a request provably
//! allocates, frees and caches nothing in the group (the coordinator's decode fast path
//! takes their minimum over groups). Each kind's bound comes from its own file.
//!
//! Cost: O(1) per request.
#![forbid(unsafe_code)]

use super::{cdiv, mamba, KindState, SingleTypeManager};
use crate::config::AttentionKind;
use crate::ids::Slot;

impl SingleTypeManager {
    /// The limits under which a plain step of `h` (no new hit, no external tokens, no
    /// encoder tokens, no admission gate, no reserve, no watermark) changes nothing in this
    /// group: `(slots, processed, cached, new_tokens)` such that a step with
    /// `need_slot <= slots`, `processed < processed_limit`, `to_cache < cached` and
    /// `num_new_tokens <= new_tokens` allocates, frees and caches nothing. Conservative: a
    /// step outside them may still be a no-op.
    pub fn noop_limits(&self, h: Slot) -> (u32, u32, u32, u32) {
        if self.is_mamba_align() {
            return self.align_noop_limits(h);
        }
        let (slots, processed, cached) = self.noop_limits3(h);
        (slots, processed, cached, u32::MAX)
    }

    fn noop_limits3(&self, h: Slot) -> (u32, u32, u32) {
        let bs = self.spec.block_size as u64;
        let clamp = |x: u64| x.min(u32::MAX as u64) as u32;
        if self.spec.kind.sized_by_encoder_tokens() {
            return (u32::MAX, u32::MAX, u32::MAX);
        }
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return self.ring_noop_limits(h);
        }
        let cached = if self.enable_caching { clamp((self.num_cached(h) as u64 + 1) * bs) } else { u32::MAX };
        if let AttentionKind::Mamba { speculative_blocks, align: false, .. } = self.spec.kind {
            let (slots, processed) = mamba::none_mode_noop_limits(
                self.req_blocks[h as usize].len() as u32,
                self.null_prefix[h as usize],
                self.spec.block_size,
                speculative_blocks,
            );
            return (clamp(slots), clamp(processed), cached);
        }
        let slots = clamp(self.req_blocks[h as usize].len() as u64 * bs);
        let k1 = self.null_prefix[h as usize] as u64 + 1;
        let processed = match self.spec.kind {
            AttentionKind::Rswa { window } => self.rswa_noop_processed(h, window),
            AttentionKind::SlidingWindow { window, extra_retained_tokens } => {
                clamp(k1 * bs + window as u64 - 1 + extra_retained_tokens as u64)
            }
            AttentionKind::ChunkedLocal { chunk } => clamp(cdiv(k1 * bs, chunk as u64) * chunk as u64),
            _ => u32::MAX,
        };
        (slots, processed, cached)
    }

    /// The smallest prompt length for which [`Self::noop_limits`] of `h` hold (R-SWA: the
    /// prompt length they were computed for; a shorter one moves the gap's start down).
    pub fn noop_min_prompt(&self, h: Slot) -> u32 {
        match &self.kind_state {
            KindState::Rswa(st) => st.min_prompt(h),
            _ => 0,
        }
    }
}
