//! Full attention (and MLA, which allocates the same way; vLLM's `FullAttentionManager`):
//! every block is kept until the request ends; a cache hit is the longest run of cached
//! blocks from the start. Its rules ([`Full`]) are [`KindRules`]' defaults, but for being
//! full attention in the hybrid hit search and its block size check.
//!
//! With partial hash hits (vLLM's `--prefix-match-unit` on a Mamba hybrid, see
//! [`crate::Config::partial_hash_hits`]) the block may be larger than the hash block: a hit
//! may end inside a block (the block is then copied on write, see
//! [`SingleTypeManager::take_partial_hit`]) and the prompt's last hash boundary is cached
//! inside its block (`_cache_partial_tail_block`).
//!
//! Per-request state: none beyond the shared table.
//!
//! Cost: the hit search is O(hit blocks + 1) (chained hashes: the first miss ends it).
#![forbid(unsafe_code)]

use super::{cdiv, CacheArgs, HitQuery, KindRules, SingleTypeManager};
use crate::block_pool::BlockPool;
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::{BlockId, Slot};

/// Full attention's rules (vLLM's `FullAttentionManager`).
#[derive(Clone, Copy, Debug)]
pub struct Full;

impl KindRules for Full {
    fn is_full(&self) -> bool {
        true
    }

    fn fine_grained_lookup(&self) -> bool {
        true
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        if cfg.partial_hash_hits() {
            // Partial hash hits: a block larger than the hash block is looked up at hash
            // granularity, and the prompt's last hash boundary is cached inside its block.
            return Ok(());
        }
        check_block_size(cfg, i, g)
    }

    #[inline]
    fn cache_blocks(&self, m: &mut SingleTypeManager, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
        m.cache_full(self, pool, h, c);
        if m.block_size() != m.hash_block_size {
            cache_inside_blocks(m, pool, h, c);
        }
    }
}

/// Partial hash hits: the keys inside a block (the prompt's partial tail; under hit-aware the
/// junction too). Out of the decode path's line, so `cache_blocks` stays small enough to inline.
#[cold]
#[inline(never)]
fn cache_inside_blocks(m: &mut SingleTypeManager, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
    m.cache_partial_tail(pool, h, c);
    if pool.is_leveled() {
        m.cache_junction(pool, h, c);
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

/// vLLM's `FullAttentionManager.find_longest_cache_hit` (no EAGLE drop): the longest run
/// of cached blocks from the start; with partial hash hits (`alignment_tokens` a proper
/// divisor of the block size), then the longest cached hash boundary inside the next block
/// (probed high to low), whose block ends the hit.
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
    if alignment_tokens < block_size && block_size % alignment_tokens == 0 {
        let scale = block_size / alignment_tokens;
        let hashes = view.hashes;
        let first = out[0].len() as u32 * scale;
        let max_idx = (first + scale - 1).min(max_length / alignment_tokens).min(hashes.len() as u32);
        for fine in (first..max_idx).rev() {
            if !pool.get_cached_block(&hashes[fine as usize], group_ids, &mut hit) {
                continue;
            }
            for (o, &b) in out.iter_mut().zip(hit.iter()) {
                o.push(b);
            }
            hit_length = (fine + 1) * alignment_tokens;
            break;
        }
    }
    hit_length -= hit_length % alignment_tokens;
    let keep = cdiv(hit_length as u64, block_size as u64) as usize;
    for o in out.iter_mut() {
        o.truncate(keep);
    }
    hit_length
}
