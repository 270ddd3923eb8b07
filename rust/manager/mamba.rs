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
//! Mode `"align"` (what vLLM uses with prefix caching on): the table is positional over
//! the whole sequence, but only the running state block and the one it was copied from are
//! real; every block before them is null. At each block boundary the running state block
//! is cached under the prefix hash of that boundary, so a later request can resume from
//! it. A hit is the *last* cached boundary state (`[null] * i + [block]`). Served here: a
//! Mamba block size equal to the hash block size (no sub-block "partial" hits, no
//! copy-on-write; the adapter falls back for those with the reason), with or without prefill
//! checkpoint blocks (vLLM's MambaMixer2 always has them): a prefill chunk spanning more than
//! one block past its initial state reserves one more block, just before the running state
//! block, where the worker exports the state at the chunk's last cacheable boundary;
//! `cache_blocks` keys it there when that state is reusable (the prompt's checkpoint, a
//! retained boundary, the shared-prefix junction) and drops its key otherwise. With
//! speculative decoding the table also holds `speculative_blocks` scratch state blocks past
//! the running one (allocated with the first blocks); a step that moves the running state
//! past a scratch block moves that block to the table's end (`_relocate_speculative_block`),
//! so a request keeps `1 + speculative_blocks` state blocks plus the previous state. With
//! vLLM 0.33's lookahead block hashes the prompt's checkpoint positions move back by the
//! lookahead tokens (`get_mamba_prefill_checkpoint_position`).
//!
//! Per request the align manager keeps, as vLLM does: `last_state_block_idx` (the state
//! block of the previous step, freed once the step after it is processed), the number of
//! retired table slots (`_num_retired_blocks`), whether the request ever got blocks
//! (`_allocated_block_reqs`), the checkpoint the last allocation reserved (`_checkpoints`),
//! and per manager the keys cached during the current step
//! (`cached_blocks_this_step`: a hit on such a state waits for the next step).
//!
//! Cost: every function here is O(1), except [`find_longest_cache_hit`], O(blocks scanned
//! from the right until a cached one).
#![forbid(unsafe_code)]

use super::HashView;
use crate::block_pool::BlockPool;
use crate::ids::{BlockId, GroupId, NULL_BLOCK};

/// Marker for "no entry" in the per-request align state.
pub const NONE: u32 = u32::MAX;

/// vLLM's `MambaManager.find_longest_cache_hit` without fine-grained hashing: the rightmost
/// block (below `max_length`) cached in every group of `group_ids` whose end is a multiple of
/// `alignment_tokens`; `out[k] = [null] * i + [block]`.
pub fn find_longest_cache_hit(
    pool: &BlockPool,
    view: HashView<'_>,
    max_length: u32,
    group_ids: &[GroupId],
    block_size: u32,
    alignment_tokens: u32,
    out: &mut [Vec<BlockId>],
) -> u32 {
    let max_num_blocks = (max_length / block_size).min(view.len());
    let mut hit = Vec::with_capacity(group_ids.len());
    for i in (0..max_num_blocks).rev() {
        if !pool.get_cached_block(&view.get(i), group_ids, &mut hit) {
            continue;
        }
        if block_size != alignment_tokens && ((i as u64 + 1) * block_size as u64) % alignment_tokens as u64 != 0 {
            continue;
        }
        for (o, &b) in out.iter_mut().zip(hit.iter()) {
            o.extend(std::iter::repeat_n(NULL_BLOCK, i as usize));
            o.push(b);
        }
        return (i + 1) * block_size;
    }
    0
}

/// vLLM's `get_mamba_prefill_checkpoint_position` without EAGLE's block drop: the last
/// multiple of `block` at most `num_tokens - max(1, lookahead)` (0 when there is none).
/// `lookahead` is vLLM 0.33's `num_hash_lookahead_tokens` (the checkpoint's hash covers that
/// many tokens past it); 0.32 has none.
#[inline]
pub fn prefill_checkpoint_position(num_tokens: u32, block: u32, lookahead: u32) -> u32 {
    match num_tokens.checked_sub(lookahead.max(1)) {
        Some(limit) => limit / block * block,
        None => 0,
    }
}

/// vLLM's `MambaManager.reachable_block_mask` (sparse state retention): `None` caches every
/// block; otherwise only segment-boundary states (every `retention_interval` tokens) and the
/// states ending on a reachable boundary are kept.
pub fn reachable_block_mask(
    start_block: u32,
    end_block: u32,
    alignment_tokens: u32,
    block_size: u32,
    retention_interval: Option<u32>,
    reachable_boundaries: &[u32],
) -> Option<Vec<bool>> {
    let r = retention_interval?;
    let mut mask = vec![false; (end_block - start_block) as usize];
    if r != 0 {
        let per_segment = r / block_size;
        if per_segment <= 1 {
            return None;
        }
        let first_boundary = (start_block + per_segment) / per_segment * per_segment - 1;
        let mut i = (first_boundary - start_block) as usize;
        while i < mask.len() {
            mask[i] = true;
            i += per_segment as usize;
        }
    }
    for &b in reachable_boundaries {
        let aligned = b / alignment_tokens * alignment_tokens;
        let Some(boundary_block) = (aligned / block_size).checked_sub(1) else { continue };
        if start_block <= boundary_block && boundary_block < end_block {
            mask[(boundary_block - start_block) as usize] = true;
        }
    }
    Some(mask)
}

/// vLLM's `is_mamba_prefill_checkpoint_valid`: whether a step computing tokens
/// `query_start..query_end` can export the state at `checkpoint_position` into a block of its
/// own (the backend writes it at a column past the one the step's initial state comes from,
/// strictly inside the chunk, at least one hash block in, `alignment` tokens apart from the
/// chunk start). Signed, as vLLM's integers (`query_start - 1` is -1 for a fresh prefill).
pub fn prefill_checkpoint_valid(
    query_start: i64,
    query_end: i64,
    checkpoint_position: i64,
    hash_block_size: i64,
    block_size: i64,
    alignment: i64,
) -> bool {
    let initial_state_col = (query_start - 1).div_euclid(block_size);
    let checkpoint_col = (query_end + block_size - 1).div_euclid(block_size) - 2;
    query_start % hash_block_size == 0
        && checkpoint_col > initial_state_col
        && query_start + hash_block_size <= checkpoint_position
        && query_start < checkpoint_position
        && checkpoint_position < query_end
        && (checkpoint_position - query_start) % alignment == 0
}

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
    fn prefill_checkpoint_position_leaves_one_token() {
        assert_eq!(prefill_checkpoint_position(0, 16, 0), 0);
        assert_eq!(prefill_checkpoint_position(16, 16, 0), 0);
        assert_eq!(prefill_checkpoint_position(17, 16, 0), 16);
        assert_eq!(prefill_checkpoint_position(33, 16, 1), 32);
        // Lookahead hashes: the hash at the checkpoint covers `lookahead` more tokens.
        assert_eq!(prefill_checkpoint_position(33, 16, 2), 16);
        assert_eq!(prefill_checkpoint_position(34, 16, 2), 32);
        assert_eq!(prefill_checkpoint_position(1, 16, 3), 0);
    }

    #[test]
    fn reachable_block_mask_keeps_segment_ends_and_boundaries() {
        assert_eq!(reachable_block_mask(0, 4, 16, 16, None, &[]), None);
        // Interval 0: only the block ending on the replay boundary (49 -> 48 -> block 2).
        assert_eq!(reachable_block_mask(0, 4, 16, 16, Some(0), &[49]), Some(vec![false, false, true, false]));
        // Interval 32 (two blocks): blocks 1, 3, ...
        assert_eq!(reachable_block_mask(0, 5, 16, 16, Some(32), &[]), Some(vec![false, true, false, true, false]));
        assert_eq!(reachable_block_mask(0, 4, 16, 16, Some(16), &[]), None);
        // A boundary below one block reaches nothing.
        assert_eq!(reachable_block_mask(0, 2, 16, 16, Some(0), &[5]), Some(vec![false, false]));
    }

    #[test]
    fn prefill_checkpoint_valid_needs_a_column_past_the_initial_state() {
        // A fresh prefill of 40 tokens (block 16): checkpoint 32 in column 1, initial -1.
        assert!(prefill_checkpoint_valid(0, 40, 32, 16, 16, 1));
        // 17 tokens: checkpoint 16 in column 0, still past the initial -1.
        assert!(prefill_checkpoint_valid(0, 17, 16, 16, 16, 1));
        // One block or less never reserves one.
        assert!(!prefill_checkpoint_valid(0, 16, 0, 16, 16, 1));
        assert!(!prefill_checkpoint_valid(16, 32, 16, 16, 16, 1));
        // A chunk starting mid-block, or an alignment the distance misses.
        assert!(!prefill_checkpoint_valid(8, 60, 48, 16, 16, 1));
        assert!(!prefill_checkpoint_valid(16, 60, 48, 16, 16, 64));
        assert!(prefill_checkpoint_valid(16, 60, 48, 16, 16, 32));
    }

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
