//! Chunked local attention (Llama 4): tokens attend only within their chunk of
//! `chunk` tokens, so blocks of earlier chunks go back to the pool. A cache hit marks
//! the blocks before the last chunk boundary as computed (null blocks) and looks up the
//! blocks of the current chunk left to right.
//!
//! Rules ([`ChunkedLocal`], vLLM's `ChunkedLocalAttentionManager`): skipped tokens, the hit
//! search, the no-op limit of freeing, the admission cap, and its checks.
//!
//! Per-request state: none beyond the shared table (the null prefix).
//!
//! Cost: the hit search is O(blocks in one chunk + leading nulls written); the rest O(1).
#![forbid(unsafe_code)]

use super::noop::clamp;
use super::{cdiv, HitQuery, KindRules, SingleTypeManager};
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::{BlockId, Slot, NULL_BLOCK};

/// Chunked local attention's rules (vLLM's `ChunkedLocalAttentionManager`).
#[derive(Clone, Copy, Debug)]
pub struct ChunkedLocal {
    /// Tokens per chunk (vLLM's `attention_chunk_size`).
    pub chunk: u32,
}

impl KindRules for ChunkedLocal {
    #[inline]
    fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        num_skipped_tokens(num_computed_tokens, self.chunk)
    }

    fn find_longest_cache_hit(&self, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
        find_longest_cache_hit(q, self.chunk, out)
    }

    /// Nothing frees until the processed tokens reach the chunk boundary past the first
    /// non-null block.
    #[inline]
    fn noop_processed(&self, m: &SingleTypeManager, h: Slot) -> u32 {
        let k1 = m.null_prefix(h) as u64 + 1;
        clamp(cdiv(k1 * m.block_size() as u64, self.chunk as u64) * self.chunk as u64)
    }

    /// `ChunkedLocalAttentionSpec.max_admission_blocks_per_request`.
    fn max_admission_blocks(&self, block_size: u32, max_in_flight_tokens: u32, max_model_len: u32) -> Option<u32> {
        let n = (self.chunk as u64 + max_in_flight_tokens as u64).min(max_model_len as u64);
        Some(cdiv(n, block_size as u64) as u32)
    }

    fn check_params(&self, _cfg: &Config, i: usize) -> Result<()> {
        if self.chunk == 0 {
            return Err(Error::InvalidConfig(format!("group {i}: attention chunk size must be positive")));
        }
        Ok(())
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        if g.block_size != cfg.cache_hit_alignment_tokens() {
            return Err(Error::Unsupported(format!(
                "group {i}: chunked local attention with a block size ({}) other than \
                 the scheduler block size ({})",
                g.block_size, cfg.scheduler_block_size
            )));
        }
        Ok(())
    }
}

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
