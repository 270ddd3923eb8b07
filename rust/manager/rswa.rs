//! Reference sliding window attention (R-SWA, vLLM's `RSWAManager(FullAttentionManager)`,
//! DeepSeek-V2 "Unlimited-OCR"): the prompt stays visible to every token, generated tokens
//! see only the `window` newest. Everything is full attention's (hits, caching, admission,
//! sizing) except `remove_skipped_blocks` given the prompt length: it frees the *gap*, the
//! blocks wholly between the prompt's last block and the window, and puts the null block in
//! their slots, in the middle of the table (vLLM's `_remove_blocks_in_range`: walking back
//! from the gap's end, stopping at the first null block). Without the prompt length (vLLM's
//! other callers pass `None`) it frees nothing, as full attention.
//!
//! Invariant kept per request ([`RswaState`]: `prompt`, `gap_end`): with prompt length `p`
//! as last seen, every slot in `cdiv(p, bs)..gap_end` holds the null block; it is what the
//! no-op limit of a decode step is computed from in O(1).
//!
//! Rules ([`Rswa`]): full attention's, but for `remove_skipped_blocks`, its no-op limit of
//! freeing, and its per-request state.
//!
//! Cost: O(blocks freed + 1) per call.
#![forbid(unsafe_code)]

use super::{cdiv, full, KindRules, KindState, SingleTypeManager, ABSENT};
use crate::block_pool::BlockPool;
use crate::config::{Config, GroupSpec};
use crate::error::Result;
use crate::ids::Slot;

/// R-SWA's rules (vLLM's `RSWAManager(FullAttentionManager)`).
#[derive(Clone, Copy, Debug)]
pub struct Rswa {
    /// Generated tokens see this many newest tokens (the prompt stays visible).
    pub window: u32,
}

impl KindRules for Rswa {
    fn is_full(&self) -> bool {
        true
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        full::check_block_size(cfg, i, g)
    }

    fn new_state(&self) -> KindState {
        KindState::Rswa(RswaState::default())
    }

    #[inline]
    fn noop_processed(&self, m: &SingleTypeManager, h: Slot) -> u32 {
        m.rswa_noop_processed(h, self.window)
    }

    /// Frees the gap given the prompt length; nothing without it (full attention's rule).
    #[inline]
    fn remove_skipped_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        processed_computed_tokens: u32,
        num_prompt_tokens: Option<u32>,
    ) {
        if let Some(p) = num_prompt_tokens {
            m.rswa_remove_gap(pool, h, processed_computed_tokens, p, self.window);
        }
    }
}

/// R-SWA's per-request state, by slot.
#[derive(Clone, Debug, Default)]
pub struct RswaState {
    /// `prompt[h]`: the prompt length the last gap removal was given (`ABSENT` until one was).
    prompt: Vec<u32>,
    /// `gap_end[h]`: slots `cdiv(prompt[h], bs)..gap_end[h]` all hold the null block.
    gap_end: Vec<u32>,
}

impl RswaState {
    /// Makes room for `n` slots.
    pub(super) fn ensure_slot(&mut self, n: usize) {
        self.prompt.resize(n, ABSENT);
        self.gap_end.resize(n, 0);
    }

    /// Forgets slot `h`.
    pub(super) fn clear(&mut self, h: Slot) {
        self.prompt[h as usize] = ABSENT;
        self.gap_end[h as usize] = 0;
    }

    /// The smallest prompt length the no-op limits of `h` hold for (0: any).
    pub(super) fn min_prompt(&self, h: Slot) -> u32 {
        match self.prompt[h as usize] {
            ABSENT => 0,
            p => p,
        }
    }

    /// `(prompt length, gap end)` of `h` (`ABSENT` prompt until a removal was given one).
    pub(super) fn gap(&self, h: Slot) -> (u32, u32) {
        (self.prompt[h as usize], self.gap_end[h as usize])
    }
}

impl SingleTypeManager {
    fn rswa_state(&mut self) -> &mut RswaState {
        match &mut self.kind_state {
            KindState::Rswa(st) => st,
            _ => unreachable!("an R-SWA group keeps R-SWA state"),
        }
    }

    /// vLLM's `RSWAManager.remove_skipped_blocks` given the prompt length: frees the gap
    /// walking back from its end, stopping at the first null block.
    pub(super) fn rswa_remove_gap(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        processed: u32,
        num_prompt_tokens: u32,
        window: u32,
    ) {
        let hs = h as usize;
        let bs = self.spec.block_size;
        let (first, last) = gap_range(num_prompt_tokens, processed, window, bs);
        let st = self.rswa_state();
        if st.prompt[hs] != num_prompt_tokens {
            // A new prompt length: nothing is known null yet past its first gap slot.
            st.prompt[hs] = num_prompt_tokens;
            st.gap_end[hs] = first.min(u32::MAX as u64) as u32;
        }
        if first >= last {
            return;
        }
        let last = last.min(self.req_blocks[hs].len() as u64);
        // `stop`: the slot of the null block the walk stopped at (vLLM's `break`), if any.
        let stop = if first < last {
            super::null_out_backwards(
                &mut self.req_blocks[hs],
                &mut self.scratch,
                pool,
                first as usize,
                last as usize,
                true,
            )
            .map(|j| j as u64)
        } else {
            None
        };
        // `first..last` is all null now when the walk reached `first`, or stopped at a slot
        // inside the known-null range (whose slots below it are null too).
        let st = self.rswa_state();
        let end = st.gap_end[hs] as u64;
        if stop.is_none_or(|j| j <= end) && last > end {
            st.gap_end[hs] = last as u32;
        }
    }

    /// Processed tokens below which a plain step of `h` frees nothing: nothing frees until
    /// the window's start passes the known-null gap; before the first removal told the
    /// prompt length nothing is proven (0).
    pub(super) fn rswa_noop_processed(&self, h: Slot, window: u32) -> u32 {
        let KindState::Rswa(st) = &self.kind_state else { unreachable!("an R-SWA group keeps R-SWA state") };
        match st.prompt[h as usize] {
            ABSENT => 0,
            _ => noop_processed_limit(st.gap_end[h as usize], window, self.spec.block_size).min(u32::MAX as u64) as u32,
        }
    }
}

/// The table range vLLM's `RSWAManager.remove_skipped_blocks` hands to
/// `_remove_blocks_in_range`: from the first block wholly after the prompt to the block
/// holding the window's first token (exclusive). Empty (`first >= last`) until the window
/// leaves the prompt.
#[inline]
pub fn gap_range(num_prompt_tokens: u32, processed: u32, window: u32, block_size: u32) -> (u64, u64) {
    let first = cdiv(num_prompt_tokens as u64, block_size as u64);
    let window_start = (num_prompt_tokens as u64).max((processed as u64).saturating_sub(window as u64));
    (first, window_start / block_size as u64)
}

/// Processed tokens below which a step frees nothing, when every slot in
/// `cdiv(p, bs)..gap_end` is null (`gap_end >= cdiv(p, bs)`): the gap's end stays at or
/// below `gap_end` while `processed - window < (gap_end + 1) * bs`.
#[inline]
pub fn noop_processed_limit(gap_end: u32, window: u32, block_size: u32) -> u64 {
    (gap_end as u64 + 1) * block_size as u64 + window as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AttentionKind, GroupSpec};
    use crate::ids::NULL_BLOCK;

    fn manager() -> (SingleTypeManager, BlockPool) {
        let spec = GroupSpec { kind: AttentionKind::Rswa { window: 32 }, block_size: 16, spec_key: 0 };
        let mut m = SingleTypeManager::new(spec, 0, None, true, 16, 16, 0);
        m.ensure_slot(0);
        (m, BlockPool::new(32, true, false))
    }

    #[test]
    fn remove_gap_frees_between_prompt_and_window_then_stops_at_first_null() {
        let (mut m, mut pool) = manager();
        let mut out = Vec::new();
        m.allocate_new_blocks(&mut pool, 0, 160, 160, &mut out);
        assert_eq!(out.len(), 10);
        // Prompt 40 (blocks 0..3), processed 112: window start 80 -> gap 3..5.
        m.remove_skipped_blocks(&mut pool, 0, 112, Some(40));
        assert_eq!(m.blocks(0)[3..5], [NULL_BLOCK, NULL_BLOCK]);
        assert_eq!(m.rswa_gap(0), Some((40, 5)));
        let free = pool.num_free_blocks();
        // A later step walks back from the new gap end and stops at slot 4 (already null).
        m.remove_skipped_blocks(&mut pool, 0, 144, Some(40));
        assert_eq!(m.blocks(0)[3..7], [NULL_BLOCK; 4]);
        assert_eq!(pool.num_free_blocks(), free + 2);
        assert_eq!(m.rswa_gap(0), Some((40, 7)));
        assert!(m.blocks(0)[..3].iter().chain(&m.blocks(0)[7..]).all(|&b| b != NULL_BLOCK));
    }

    #[test]
    fn gap_range_is_empty_inside_the_prompt_and_window() {
        // Prompt of 40 tokens (blocks 0..3, block 2 partial), window 32, block size 16.
        assert_eq!(gap_range(40, 40, 32, 16), (3, 2));
        assert_eq!(gap_range(40, 72, 32, 16), (3, 2));
        // processed - window = 48 ends block 2: still nothing whole after the prompt.
        assert_eq!(gap_range(40, 80, 32, 16), (3, 3));
        assert_eq!(gap_range(40, 96, 32, 16), (3, 4));
        assert_eq!(gap_range(40, 200, 32, 16), (3, 10));
    }

    #[test]
    fn gap_range_window_zero_and_short_processed_do_not_underflow() {
        assert_eq!(gap_range(16, 64, 0, 16), (1, 4));
        assert_eq!(gap_range(16, 3, 128, 16), (1, 1));
    }

    #[test]
    fn noop_limit_matches_gap_end() {
        // gap end 4, window 32, bs 16: processed 111 gives window start 79 -> block 4.
        let lim = noop_processed_limit(4, 32, 16);
        assert_eq!(lim, 112);
        assert!(gap_range(40, (lim - 1) as u32, 32, 16).1 <= 4);
        assert_eq!(gap_range(40, lim as u32, 32, 16).1, 5);
    }
}
