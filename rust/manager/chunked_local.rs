//! Chunked local attention (Llama 4): tokens attend only within their chunk of
//! `chunk` tokens, so blocks of earlier chunks go back to the pool. A cache hit marks
//! the blocks before the last chunk boundary as computed (null blocks) and looks up the
//! blocks of the current chunk left to right.
//!
//! Cost: the hit search is O(blocks in one chunk + leading nulls written).
#![forbid(unsafe_code)]

use super::HitQuery;
use crate::ids::{BlockId, NULL_BLOCK};

/// Tokens of the chunks before the current one: `n / chunk * chunk`.
#[inline]
pub fn num_skipped_tokens(num_computed_tokens: u32, chunk: u32) -> u32 {
    num_computed_tokens / chunk * chunk
}

/// vLLM's `ChunkedLocalAttentionManager.find_longest_cache_hit`.
pub fn find_longest_cache_hit(q: &HitQuery<'_>, chunk: u32, out: &mut [Vec<BlockId>]) -> u32 {
    let HitQuery { pool, view, max_length, group_ids, block_size, .. } = *q;
    let max_num_blocks = (max_length / block_size).min(view.len());
    let start_idx = if max_length > 0 { max_length / chunk * chunk } else { 0 };
    let start_block = start_idx / block_size;
    for o in out.iter_mut() {
        o.resize(start_block as usize, NULL_BLOCK);
    }
    let mut hit = Vec::with_capacity(group_ids.len());
    for i in start_block..max_num_blocks {
        if !pool.get_cached_block(&view.get(i), group_ids, &mut hit) {
            break;
        }
        for (o, &b) in out.iter_mut().zip(hit.iter()) {
            o.push(b);
        }
    }
    out[0].len() as u32 * block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_skipped_tokens_matches_vllm_examples() {
        assert_eq!(num_skipped_tokens(13, 8), 8);
        assert_eq!(num_skipped_tokens(8, 8), 8);
        assert_eq!(num_skipped_tokens(7, 8), 0);
    }
}
