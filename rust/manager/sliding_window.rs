//! Sliding-window attention: a token attends to the `window - 1` tokens before it, so
//! blocks wholly before that range go back to the pool and their table slots become the
//! null block. A cache hit needs `cdiv(window - 1, block_size)` contiguous cached blocks
//! ending at the hit point, searched right to left; cached blocks before a hit are not
//! needed and come back as null blocks.
//!
//! Rules ([`SlidingWindow`], vLLM's `SlidingWindowManager`): skipped tokens, the hit
//! search, the retention mask and hit tail, the no-op limit of freeing, the admission cap,
//! and its checks.
//!
//! Per-request state: none beyond the shared table (the null prefix).
//!
//! Cost: the hit search is O(blocks scanned) (vLLM's too); `num_skipped_tokens` O(1);
//! the retention mask O(blocks cached).
#![forbid(unsafe_code)]

use super::noop::clamp;
use super::{cdiv, CacheArgs, HitQuery, KindRules, SingleTypeManager};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::ids::{BlockId, Slot, NULL_BLOCK};

/// Sliding-window attention's rules (vLLM's `SlidingWindowManager`).
#[derive(Clone, Copy, Debug)]
pub struct SlidingWindow {
    /// Tokens a token attends to (itself included).
    pub window: u32,
    /// Tokens kept past the window (vLLM's `extra_retained_tokens`).
    pub extra_retained_tokens: u32,
}

impl KindRules for SlidingWindow {
    fn sparse_retention(&self) -> bool {
        true
    }

    #[inline]
    fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        num_skipped_tokens(num_computed_tokens, self.window, self.extra_retained_tokens)
    }

    fn find_longest_cache_hit(&self, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
        find_longest_cache_hit(q, self.window, out)
    }

    fn reachable_block_mask(
        &self,
        start: u32,
        end: u32,
        alignment_tokens: u32,
        block_size: u32,
        c: &CacheArgs<'_>,
    ) -> Option<Vec<bool>> {
        reachable_block_mask(
            start,
            end,
            alignment_tokens,
            block_size,
            self.window,
            c.eagle,
            c.retention_interval,
            c.reachable_boundaries,
        )
    }

    fn hit_tail_blocks(&self, block_size: u32) -> Option<u32> {
        // The hit-aware policy's (the EAGLE drop is refused under it).
        Some(contiguous_blocks_for_hit(self.window, block_size, false))
    }

    /// Nothing frees while the window still reaches the first non-null block.
    #[inline]
    fn noop_processed(&self, m: &SingleTypeManager, h: Slot) -> u32 {
        let k1 = m.null_prefix(h) as u64 + 1;
        clamp(k1 * m.block_size() as u64 + self.window as u64 - 1 + self.extra_retained_tokens as u64)
    }

    /// `SlidingWindowSpec.max_admission_blocks_per_request`.
    fn max_admission_blocks(&self, block_size: u32, max_in_flight_tokens: u32, max_model_len: u32) -> Option<u32> {
        let n = (self.window as u64 - 1 + self.extra_retained_tokens as u64 + max_in_flight_tokens as u64)
            .min(max_model_len as u64);
        Some((cdiv(n, block_size as u64) + 1) as u32)
    }

    fn check_params(&self, _cfg: &Config, i: usize) -> Result<()> {
        if self.window == 0 {
            return Err(Error::InvalidConfig(format!("group {i}: sliding window must be positive")));
        }
        Ok(())
    }
}

/// Tokens before the window of the next token: `max(0, n - window + 1 - extra)`.
#[inline]
pub fn num_skipped_tokens(num_computed_tokens: u32, window: u32, extra_retained_tokens: u32) -> u32 {
    (num_computed_tokens as i64 - window as i64 + 1 - extra_retained_tokens as i64).max(0) as u32
}

/// Contiguous cached blocks a hit needs (`_contiguous_blocks_for_hit`): those the window
/// reaches, and with the EAGLE drop one more (matched, then dropped).
#[inline]
pub fn contiguous_blocks_for_hit(window: u32, block_size: u32, eagle: bool) -> u32 {
    cdiv(window as u64 - 1, block_size as u64) as u32 + eagle as u32
}

/// Pops blocks off every group's hit until its length is a multiple of `alignment_tokens`.
fn realign(out: &mut [Vec<BlockId>], block_size: u32, alignment_tokens: u32) {
    while block_size != alignment_tokens && (out[0].len() as u32 * block_size) % alignment_tokens != 0 {
        for o in out.iter_mut() {
            o.pop();
        }
    }
}

/// vLLM's `SlidingWindowManager.find_longest_cache_hit`: the rightmost run of
/// [`contiguous_blocks_for_hit`] cached blocks, searched right to left (blocks before it
/// are null); with the EAGLE drop (`q.drop_eagle`) the run is one block longer and its last
/// block is dropped (then the hit realigned).
pub fn find_longest_cache_hit(q: &HitQuery<'_>, window: u32, out: &mut [Vec<BlockId>]) -> u32 {
    let HitQuery { pool, view, max_length, group_ids, block_size, alignment_tokens, drop_eagle } = *q;
    let need = contiguous_blocks_for_hit(window, block_size, drop_eagle);
    // `max_length` may reach past the hashes the caller sent: only hashed blocks can hit.
    let max_num_blocks = (max_length / block_size).min(view.len());
    for o in out.iter_mut() {
        o.resize(max_num_blocks as usize, NULL_BLOCK);
    }
    let mut contiguous = 0u32;
    let mut found = false;
    let mut hit = Vec::with_capacity(group_ids.len());
    for i in (0..max_num_blocks).rev() {
        if pool.get_cached_block(&view.get(i), group_ids, &mut hit) {
            // The hit's end after the drop must be aligned (the run's last block is checked).
            let post_pop = if drop_eagle { i } else { i + 1 };
            if contiguous == 0 && block_size != alignment_tokens && (post_pop * block_size) % alignment_tokens != 0 {
                continue;
            }
            for (o, &b) in out.iter_mut().zip(hit.iter()) {
                o[i as usize] = b;
            }
            contiguous += 1;
            if contiguous >= need {
                for o in out.iter_mut() {
                    o.truncate((i + contiguous) as usize);
                }
                found = true;
                break;
            }
        } else {
            contiguous = 0;
        }
    }
    if !found {
        for o in out.iter_mut() {
            o.truncate(contiguous as usize);
        }
        realign(out, block_size, alignment_tokens);
    }
    if drop_eagle && !out[0].is_empty() {
        for o in out.iter_mut() {
            o.pop();
        }
        realign(out, block_size, alignment_tokens);
    }
    out[0].len() as u32 * block_size
}

/// Which blocks in `start..end` are worth caching (`SlidingWindowManager.reachable_block_mask`):
/// `None` means all of them. With `retention_interval` `Some(0)` (vLLM's default) only the
/// `need` blocks ending at each reachable boundary are cached. With the EAGLE drop (`eagle`)
/// a hit needs one block more, matched past the boundary (the kept tails end one block
/// later).
#[allow(clippy::too_many_arguments)]
pub fn reachable_block_mask(
    start: u32,
    end: u32,
    alignment_tokens: u32,
    block_size: u32,
    window: u32,
    eagle: bool,
    retention_interval: Option<u32>,
    reachable_boundaries: &[u32],
) -> Option<Vec<bool>> {
    if alignment_tokens % block_size != 0 {
        return None;
    }
    let need = contiguous_blocks_for_hit(window, block_size, eagle) as i64;
    let shift = eagle as i64;
    let mut mask = vec![false; (end - start) as usize];
    let segment_tokens = match retention_interval {
        None => Some(alignment_tokens),
        Some(0) => None,
        Some(r) => Some(r),
    };
    if let Some(seg) = segment_tokens {
        let per_segment = (seg / block_size) as i64;
        if need >= per_segment {
            return None;
        }
        for i in start..end {
            let i = i as i64;
            if i >= shift && (i - shift) % per_segment >= per_segment - need {
                mask[(i - start as i64) as usize] = true;
            }
        }
    }
    if retention_interval.is_some() {
        for &boundary in reachable_boundaries {
            let aligned = boundary / alignment_tokens * alignment_tokens;
            let e = (aligned / block_size) as i64 + shift;
            let lo = (start as i64).max(e - need);
            let hi = (end as i64).min(e);
            for j in lo..hi {
                mask[(j - start as i64) as usize] = true;
            }
        }
    }
    Some(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_skipped_tokens_window_4_at_7_is_4() {
        assert_eq!(num_skipped_tokens(7, 4, 0), 4);
        assert_eq!(num_skipped_tokens(2, 4, 0), 0);
        assert_eq!(num_skipped_tokens(7, 4, 2), 2);
    }

    #[test]
    fn reachable_block_mask_retention_zero_keeps_replay_tail() {
        // window 33 at block 16 needs 2 blocks; boundary 99 -> aligned 96 -> blocks 4, 5.
        let m = reachable_block_mask(0, 7, 16, 16, 33, false, Some(0), &[99]).unwrap();
        assert_eq!(m, vec![false, false, false, false, true, true, false]);
    }

    #[test]
    fn reachable_block_mask_with_eagle_keeps_the_block_past_the_boundary() {
        // With the drop a hit needs 3 blocks, the last matched past the boundary: 4, 5, 6.
        let m = reachable_block_mask(0, 8, 16, 16, 33, true, Some(0), &[99]).unwrap();
        assert_eq!(m, vec![false, false, false, false, true, true, true, false]);
        assert_eq!(contiguous_blocks_for_hit(33, 16, true), 3);
    }

    #[test]
    fn reachable_block_mask_dense_is_none_when_window_spans_segment() {
        assert_eq!(reachable_block_mask(0, 7, 16, 16, 33, false, None, &[99]), None);
    }
}
