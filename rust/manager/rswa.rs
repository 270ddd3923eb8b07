//! Reference sliding window attention (R-SWA, vLLM's `RSWAManager(FullAttentionManager)`,
//! DeepSeek-V2 "Unlimited-OCR"): the prompt stays visible to every token, generated tokens
//! see only the `window` newest. Everything is full attention's (hits, caching, admission,
//! sizing) except `remove_skipped_blocks` given the prompt length: it frees the *gap*, the
//! blocks wholly between the prompt's last block and the window, and puts the null block in
//! their slots, in the middle of the table (vLLM's `_remove_blocks_in_range`: walking back
//! from the gap's end, stopping at the first null block). Without the prompt length (vLLM's
//! other callers pass `None`) it frees nothing, as full attention.
//!
//! Invariant kept per request by the manager (`rswa_prompt`, `rswa_gap_end`): with prompt
//! length `p` as last seen, every slot in `cdiv(p, bs)..gap_end` holds the null block; it is
//! what the no-op limit of a decode step is computed from in O(1).
//!
//! Cost: O(blocks freed + 1) per call.
#![forbid(unsafe_code)]

use super::cdiv;

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
