//! Full attention (and MLA, which allocates the same way; vLLM's `FullAttentionManager`):
//! every block is kept until the request ends; a cache hit is the longest run of cached
//! blocks from the start. Its rules ([`Full`]) are [`KindRules`]' defaults, but for being
//! full attention in the hybrid hit search and its block size check.
//!
//! In a hybrid the block may be larger than the hash block (a full-attention group of 32
//! beside a sliding-window group of 16, hash block 16: [`crate::Config::partial_block_entries`]):
//! the prompt's last hash boundary is then keyed inside its block (its *partial tail*, vLLM's
//! `_cache_partial_tail_block`, which keys it even without partial hash hits; hits, aligned to
//! the scheduler block, never reach it there, but it is stored, reported and evicted).
//! With partial hash hits (vLLM's `--prefix-match-unit` on a Mamba hybrid, see
//! [`crate::Config::partial_hash_hits`]) a hit may also end inside a block (the block is then
//! copied on write, see [`SingleTypeManager::take_partial_hit`]), and, under `hit-aware`, the
//! junction a lookup reported there (a shared prefix's end inside a
//! block). A block keyed for a longer prefix takes such a key as a second key (the pool's
//! `cache_partial_block`).
//!
//! Per-request state ([`FullState`]): the partial-tail boundary each request keys (and the
//! one it waits to reach, which the no-op limits watch).
//!
//! Cost: the hit search is O(hit blocks + 1) (chained hashes: the first miss ends it); a
//! key inside a block O(1).
#![forbid(unsafe_code)]

use super::{cdiv, CacheArgs, HitQuery, KindRules, KindState, SingleTypeManager};
use crate::block_pool::{BlockPool, OneBlock};
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::{BlockId, GroupId, Slot};

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

    fn new_state(&self) -> KindState {
        KindState::Full(FullState::default())
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        if cfg.partial_block_entries() {
            // A block larger than the hash block: the prompt's last hash boundary is cached
            // inside its block (and, with partial hash hits, looked up at hash granularity).
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
    let sizes = Inside { block_size: m.spec.block_size, hash_block_size: m.hash_block_size, group: m.group_id };
    let SingleTypeManager { kind_state: KindState::Full(st), req_blocks, .. } = m else { return };
    let table = &req_blocks[h as usize];
    st.cache_partial_tail(pool, h, table, sizes, c);
    if pool.is_leveled() {
        st.cache_junction(pool, h, table, sizes, c);
    }
}

/// The sizes a key inside a block is computed with.
#[derive(Clone, Copy, Debug)]
struct Inside {
    /// Tokens per block.
    block_size: u32,
    /// Tokens per block hash.
    hash_block_size: u32,
    /// The group.
    group: GroupId,
}

/// Full attention's per-request state: the prompt's partial-tail boundary (partial hash
/// hits; vLLM's `FullAttentionManager._cache_partial_tail_block`).
///
/// Invariant: `pending[h]` is 0 or a boundary not yet keyed (not yet reached by the tokens
/// cached, or, with lookahead hashes, by the request's hashes), which the no-op limits stop
/// at; `boundary[h]` is 0 or the partial tail `h` keyed.
#[derive(Clone, Debug, Default)]
pub struct FullState {
    /// `pending[h]`: the prompt's partial-tail boundary (or, under hit-aware, the junction
    /// inside a block) that a later caching call will key, once the tokens cached reach it
    /// (0: none); the no-op limits stop there.
    pending: Vec<u32>,
    /// `boundary[h]`: the partial-tail boundary, kept once keyed (see [`Self::rearm`]).
    boundary: Vec<u32>,
}

impl FullState {
    /// Makes room for `n` slots.
    pub(super) fn ensure_slot(&mut self, n: usize) {
        self.pending.resize(n, 0);
        self.boundary.resize(n, 0);
    }

    /// Forgets slot `h`.
    pub(super) fn clear(&mut self, h: Slot) {
        self.pending[h as usize] = 0;
        self.boundary[h as usize] = 0;
    }

    /// The boundary inside a block `h` waits to key, if any (the no-op limits stop there).
    #[inline]
    pub(super) fn pending(&self, h: Slot) -> Option<u32> {
        self.pending.get(h as usize).copied().filter(|&t| t > 0)
    }

    /// After an eviction by id: every request's partial-tail boundary is watched again by the
    /// no-op limits (its key may be gone; the next caching call re-keys it, as vLLM's).
    pub(super) fn rearm(&mut self) {
        for (p, &b) in self.pending.iter_mut().zip(&self.boundary) {
            if b > 0 {
                *p = b;
            }
        }
    }

    /// vLLM's `FullAttentionManager._cache_partial_tail_block`: when the prompt's last hash
    /// boundary a resend could hit (`num_prompt_tokens - 1`, floored to the hash block, at
    /// most the hashes; with the EAGLE drop `num_prompt_tokens`, as an EAGLE lookup reads
    /// the whole prompt before dropping a hash unit) lies inside a block and within the
    /// tokens cached, `h`'s block holding it (in `table`) is keyed there too.
    ///
    /// With lookahead block hashes over several tokens (vLLM 0.33+), the request's hashes
    /// stop short of the prompt's last boundary until the lookahead tokens past it arrive
    /// (decode steps): vLLM's caching call at each step keys the boundary its hashes reach
    /// then. Until they reach the prompt's, that boundary stays pending (no step is a no-op:
    /// a few steps), so the call that sees the hash keys it, as vLLM's does.
    fn cache_partial_tail(&mut self, pool: &mut BlockPool, h: Slot, table: &[BlockId], z: Inside, c: &CacheArgs<'_>) {
        let (hbs, bs) = (z.hash_block_size, z.block_size);
        let limit = if c.eagle { c.num_prompt_tokens } else { c.num_prompt_tokens.saturating_sub(1) };
        let prompt_boundary = limit / hbs * hbs;
        let boundary = (limit / hbs).min(c.hashes.len() as u32) * hbs;
        // The prompt's boundary, inside a block, that hashes still to come will reach.
        let later = if prompt_boundary > boundary && prompt_boundary % bs != 0 { prompt_boundary } else { 0 };
        self.pending[h as usize] = later;
        if boundary == 0 || boundary % bs == 0 {
            return;
        }
        self.boundary[h as usize] = boundary;
        if boundary > c.num_tokens {
            self.pending[h as usize] = boundary;
            return;
        }
        key_inside_block(pool, table, z, c, boundary);
    }

    /// Hit-aware with partial hash hits: the block holding the request's junction
    /// (`shared_prefix_boundary`, inside a block, within the prompt and the tokens cached) is
    /// keyed there too, as a second key once it holds a longer one (a full-attention block is
    /// a valid prefix at every position it holds), so a sibling sharing the prefix up to the
    /// junction hits it; the Mamba groups key their state there.
    fn cache_junction(&mut self, pool: &mut BlockPool, h: Slot, table: &[BlockId], z: Inside, c: &CacheArgs<'_>) {
        let (hbs, bs, j) = (z.hash_block_size, z.block_size, c.shared_prefix_boundary);
        if j == 0 || j % bs == 0 || j % hbs != 0 || j > c.num_prompt_tokens {
            return;
        }
        if j > c.num_tokens {
            // Not reached yet: the no-op limits stop there (the scheduler ends a chunk there).
            let p = &mut self.pending[h as usize];
            *p = if *p == 0 { j } else { (*p).min(j) };
            return;
        }
        key_inside_block(pool, table, z, c, j);
    }
}

/// Keys the block of `table` holding the hash boundary at `tokens` (inside the block) under
/// that prefix's hash (vLLM's partial key; a second key once the block holds a longer one).
/// Nothing past the request's hashes or its table.
fn key_inside_block(pool: &mut BlockPool, table: &[BlockId], z: Inside, c: &CacheArgs<'_>, tokens: u32) {
    let nh = (tokens / z.hash_block_size) as usize;
    if nh == 0 || nh > c.hashes.len() {
        return;
    }
    let Some(&b) = table.get((tokens / z.block_size) as usize) else { return };
    let o = OneBlock {
        req: c.req,
        block: b,
        index: nh as u32 - 1,
        key: (c.hashes[nh - 1], z.group),
        num_tokens: tokens,
        block_size: z.hash_block_size,
        parent: if nh > 1 { Some(c.hashes[nh - 2]) } else { None },
    };
    pool.cache_partial_block(&o, false);
}

/// R-SWA (and full attention outside [`Config::partial_block_entries`]) with caching on: the
/// block is the hash block (no partial-block prefix entries).
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

/// vLLM's `FullAttentionManager.find_longest_cache_hit`: the longest run of cached blocks
/// from the start; with partial hash hits (`alignment_tokens` a proper divisor of the block
/// size), then the longest cached hash boundary inside the next block (probed high to low),
/// whose block ends the hit. With the EAGLE drop (`q.drop_eagle`) a non-empty hit then loses
/// one block, or one hash unit with partial hash hits (the tail block's KV is append-only,
/// so it still covers the shorter hit), before it is rounded down to the alignment.
pub fn find_longest_cache_hit(q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
    let HitQuery { pool, view, max_length, group_ids, block_size, alignment_tokens, drop_eagle } = *q;
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
    if drop_eagle && hit_length > 0 {
        hit_length -= alignment_tokens.min(block_size);
    }
    hit_length -= hit_length % alignment_tokens;
    let keep = cdiv(hit_length as u64, block_size as u64) as usize;
    for o in out.iter_mut() {
        o.truncate(keep);
    }
    hit_length
}
