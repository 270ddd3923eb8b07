//! Full attention (and MLA, which allocates the same way; vLLM's `FullAttentionManager`):
//! every block is kept until the request ends; a cache hit is the longest run of cached
//! blocks from the start. Its rules ([`Full`]) are [`KindRules`]' defaults, but for being
//! full attention in the hybrid hit search and its block size check.
//!
//! Per-request state: none beyond the shared table.
//!
//! Cost: the hit search is O(hit blocks + 1) (chained hashes: the first miss ends it).
#![forbid(unsafe_code)]

use super::{cdiv, HitQuery, KindRules};
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::BlockId;

/// Full attention's rules (vLLM's `FullAttentionManager`).
#[derive(Clone, Copy, Debug)]
pub struct Full;

impl KindRules for Full {
    fn is_full(&self) -> bool {
        true
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        check_block_size(cfg, i, g)
    }
}

/// Full attention (and R-SWA) with caching on: the block is the hash block (no
/// partial-block prefix entries).
///
/// # Errors
/// [`Error::Unsupported`] for a block size over the hash block size.
pub fn check_block_size(cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
    if g.block_size != cfg.hash_block_size {
        return Err(Error::Unsupported(format!(
            "group {i}: full attention with block size {} over hash block size {} \
             (partial-block prefix entries)",
            g.block_size, cfg.hash_block_size
        )));
    }
    Ok(())
}

/// vLLM's `FullAttentionManager.find_longest_cache_hit` (block-aligned, no EAGLE drop).
pub fn find_longest_cache_hit(q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
    let HitQuery { pool, view, max_length, group_ids, block_size, alignment_tokens } = *q;
    let n = (max_length / block_size).min(view.len());
    let mut hit = Vec::with_capacity(group_ids.len());
    for i in 0..n {
        if !pool.get_cached_block(&view.get(i), group_ids, &mut hit) {
            break;
        }
        for (o, &b) in out.iter_mut().zip(hit.iter()) {
            o.push(b);
        }
    }
    let mut hit_length = out[0].len() as u32 * block_size;
    hit_length -= hit_length % alignment_tokens;
    let keep = cdiv(hit_length as u64, block_size as u64) as usize;
    for o in out.iter_mut() {
        o.truncate(keep);
    }
    hit_length
}
