//! Mamba / linear-attention state (vLLM's `MambaManager`; GDN in Qwen3.5 / Qwen3-Next,
//! Mamba2 in Nemotron-H / Jamba / Granite 4 / Falcon-H1, short convolution in LFM2).
//!
//! A Mamba layer needs only the state after the last computed token, so
//! `get_num_skipped_tokens(n) = n - 1`: every block before the one holding that state goes
//! back to the pool (as the null block, in place, like sliding-window recycling).
//!
//! Mode `"none"` (vLLM's `mamba_cache_mode`, the mode vLLM uses with prefix caching off):
//! the group allocates like any other, with `speculative_blocks` extra blocks reserved and
//! allocated past the token slots (speculative decoding keeps one state per draft
//! position). vLLM's Mamba block size is then `max_model_len`, so a request holds
//! `1 + speculative_blocks` state blocks for its whole life.
//!
//! Cost: every function here is O(1).
#![forbid(unsafe_code)]

/// Tokens whose state is no longer needed after `num_computed_tokens` tokens: all but the
/// last (`num_computed_tokens - 1`, 0 for none computed).
#[inline]
pub fn num_skipped_tokens(num_computed_tokens: u32) -> u32 {
    num_computed_tokens.saturating_sub(1)
}

/// The token slots mode `"none"` sizes the table for: `num_tokens` plus one block of
/// slots per speculative state block (vLLM adds `block_size * num_speculative_blocks` to
/// `num_tokens` in both `get_num_blocks_to_allocate` and `allocate_new_blocks`).
#[inline]
pub fn none_mode_tokens(num_tokens: u32, block_size: u32, speculative_blocks: u32) -> u64 {
    num_tokens as u64 + block_size as u64 * speculative_blocks as u64
}

/// `(slots, processed)` no-op limits of a mode-`"none"` table of `table_len` blocks whose
/// first `null_prefix` blocks are null: a plain step needing at most `slots` token slots
/// allocates nothing, and one whose processed tokens stay below `processed` frees nothing
/// (block `null_prefix` is freed once `(processed - 1) / block_size > null_prefix`).
#[inline]
pub fn none_mode_noop_limits(table_len: u32, null_prefix: u32, block_size: u32, speculative_blocks: u32) -> (u64, u64) {
    let bs = block_size as u64;
    let slots = (table_len as u64).saturating_sub(speculative_blocks as u64) * bs;
    let processed = (null_prefix as u64 + 1) * bs + 1;
    (slots, processed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_skipped_tokens_keeps_the_last_state() {
        assert_eq!(num_skipped_tokens(0), 0);
        assert_eq!(num_skipped_tokens(1), 0);
        assert_eq!(num_skipped_tokens(17), 16);
    }

    #[test]
    fn none_mode_tokens_adds_one_block_per_speculative_state() {
        assert_eq!(none_mode_tokens(5, 16, 0), 5);
        assert_eq!(none_mode_tokens(5, 16, 2), 37);
        assert_eq!(none_mode_tokens(u32::MAX, u32::MAX, 3), u32::MAX as u64 * 4);
    }

    #[test]
    fn none_mode_noop_limits_freeing_starts_past_the_next_block() {
        // Block 0 is freed when (processed - 1) / 16 > 0, i.e. processed >= 17.
        assert_eq!(none_mode_noop_limits(3, 0, 16, 0), (48, 17));
        assert_eq!(none_mode_noop_limits(3, 0, 16, 2), (16, 17));
        assert_eq!(none_mode_noop_limits(1, 0, 16, 2), (0, 17));
    }
}
