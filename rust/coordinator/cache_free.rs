//! Caching, freeing and pinning: `cache_blocks`, `remove_skipped_blocks`, `free` (one body;
//! under hit-aware its hook, `retain_for_free`, sets the levels and one freeing order across
//! groups), `pop_blocks_for_free` / `free_block_ids`, `evict_blocks`, `reset_prefix_cache`,
//! and prefix pinning (the pool's retention state owns the pinned keys).
//!
//! Cost: caching O(blocks cached); `free` O(table) (O(table log table) under hit-aware);
//! pinning O(prefix blocks).
#![forbid(unsafe_code)]

use super::{Allocator, HashSource};

use crate::config::CoordinatorKind;
use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};
use crate::manager::{CacheArgs, HashView};
use crate::policy::{Level, LEVEL_NORMAL, LEVEL_SPECULATIVE};

/// The arguments of [`Allocator::cache_blocks`] (the request fields vLLM's `cache_blocks`
/// reads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheBlocksArgs {
    /// Cache full blocks up to this many tokens.
    pub num_computed_tokens: u32,
    /// `request.num_prompt_tokens` (the retention masks' replay boundary).
    pub num_prompt_tokens: u32,
    /// `request.shared_prefix_boundary` (0: none).
    pub shared_prefix_boundary: u32,
}

impl Allocator {
    /// Tokens whose full blocks are cached for `num_tokens` (a hybrid coordinator caches
    /// whole scheduler blocks).
    pub(super) fn cache_target(&self, num_tokens: u32) -> u32 {
        match self.kind {
            // vLLM's `_align_cacheable`: no rounding with partial hash hits (rounding even to
            // the hash block would re-key a privatized Mamba tail).
            CoordinatorKind::Hybrid if self.partial_hash_hits => num_tokens,
            CoordinatorKind::Hybrid => num_tokens / self.cfg.scheduler_block_size * self.cfg.scheduler_block_size,
            _ => num_tokens,
        }
    }

    /// [`Self::cache_target`] for request `s`, never past its first never-written token
    /// (`ReqState::unwritten_from`, direct API only).
    fn request_cache_target(&self, s: Slot, num_tokens: u32) -> u32 {
        self.cache_target(num_tokens.min(self.reqs[s as usize].unwritten_from.unwrap_or(u32::MAX)))
    }

    pub(super) fn cache_blocks_inner(
        &mut self,
        s: Slot,
        num_tokens: u32,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) {
        if !self.cfg.enable_caching {
            return;
        }
        let handle = self.handle_of(s);
        let boundaries_buf = [num_prompt_tokens.saturating_sub(1), shared_prefix_boundary];
        let boundaries = if shared_prefix_boundary != 0 { &boundaries_buf[..] } else { &boundaries_buf[..1] };
        let n = self.request_cache_target(s, num_tokens);
        let hashes = &self.reqs[s as usize].hashes;
        let c = CacheArgs {
            req: handle,
            hashes,
            num_tokens: n,
            retention_interval: self.cfg.retention_interval,
            reachable_boundaries: boundaries,
            num_prompt_tokens,
            shared_prefix_boundary,
        };
        for m in self.managers.iter_mut() {
            m.cache_blocks(&mut self.pool, s, &c);
        }
    }

    /// Caches the full blocks of `h` up to `c.num_computed_tokens` (vLLM's `cache_blocks`),
    /// after bringing the request's hashes up to `hashes` when given (undone if the call
    /// fails).
    ///
    /// # Errors
    /// Unknown handle; an invalid hash; a full block the request's table does not hold
    /// (nothing changes).
    pub fn cache_blocks(&mut self, h: ReqHandle, c: &CacheBlocksArgs, hashes: Option<&dyn HashSource>) -> Result<()> {
        let CacheBlocksArgs { num_computed_tokens, num_prompt_tokens, shared_prefix_boundary } = *c;
        let s = self.slot(h)?;
        let undo = match hashes {
            Some(src) => Some(self.sync_hashes(s, src)?),
            None => None,
        };
        if self.cfg.enable_caching {
            let n = self.request_cache_target(s, num_computed_tokens);
            let num_hashes = self.reqs[s as usize].hashes.len();
            for (g, m) in self.managers.iter().enumerate() {
                let (full, held) = m.blocks_to_cache(s, num_hashes, n);
                if full > m.num_cached(s) && full > held {
                    if let Some(u) = undo {
                        self.undo_hashes(s, u);
                    }
                    return Err(Error::OutOfRange(format!(
                        "cache_blocks up to {num_computed_tokens} tokens: group {g} would cache {full} full \
                         blocks, but the request holds {held}"
                    )));
                }
            }
        }
        self.cache_blocks_inner(s, num_computed_tokens, num_prompt_tokens, shared_prefix_boundary);
        self.refresh_noop(s);
        Ok(())
    }

    /// Frees out-of-window blocks of `h` (vLLM's `remove_skipped_blocks`). With vLLM's
    /// optional `num_prompt_tokens` (passed by `allocate_slots` and by the scheduler before a
    /// connector reads the table) an R-SWA group frees its gap; without it R-SWA frees
    /// nothing, as full attention.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn remove_skipped_blocks(
        &mut self,
        h: ReqHandle,
        processed_computed_tokens: u32,
        num_prompt_tokens: Option<u32>,
    ) -> Result<()> {
        let s = self.slot(h)?;
        for m in self.managers.iter_mut() {
            m.remove_skipped_blocks(&mut self.pool, s, processed_computed_tokens, num_prompt_tokens);
        }
        self.refresh_noop(s);
        Ok(())
    }

    /// Frees every block of `h`, tail first, and releases the handle (vLLM's `free`, with
    /// `level` [`LEVEL_NORMAL`]). Under `hit-aware`, its full-attention prefix and the
    /// window tail ending at its last cached block keep at least `level`
    /// ([`crate::policy::LEVEL_PINNED`] for a request with a retention priority), and its
    /// blocks are freed in token-position order across groups (a hit unit together). Under
    /// `exact`, `level` is ignored.
    ///
    /// # Errors
    /// Unknown handle (a double free is one).
    pub fn free(&mut self, h: ReqHandle, level: Level) -> Result<()> {
        let s = self.slot(h)?;
        // The policy's hook (hit-aware only): the levels the blocks are freed at, and one
        // freeing order across groups. Under exact each group frees its own table.
        let ordered = self.pool.is_leveled().then(|| self.retain_for_free(s, level));
        for m in self.managers.iter_mut() {
            match ordered {
                None => m.free(&mut self.pool, s),
                Some(_) => m.forget(s),
            }
        }
        if let Some(blocks) = ordered {
            self.pool.free_blocks(blocks.iter().map(|x| x.2));
        }
        self.release(s);
        Ok(())
    }

    /// Hit-aware, [`Self::free`]'s hook: sets the retention levels `s`'s blocks are freed at
    /// (see [`crate::policy`], rules 2, 5 and 6, and `level`) and returns every non-null
    /// block of its tables as `(token position, group, block)`, tail first; at equal
    /// positions in group order (vLLM frees group after group), so a hit unit is freed
    /// together. The tables are left as they are. O(table log table).
    fn retain_for_free(&mut self, s: Slot, level: Level) -> Vec<(u64, GroupId, BlockId)> {
        let mut blocks = Vec::new();
        // State-space hybrids: a request whose hit saved under half its prompt leaves
        // the blocks it computed on probation (see `LEVEL_PROBATION`).
        let (hit, prompt) = self.reqs[s as usize].hit_aware.hit_and_prompt;
        let mamba = self.managers.iter().any(|m| m.is_mamba_align());
        let probation = level <= LEVEL_NORMAL && (hit as u64) * 2 < prompt as u64 && mamba;
        for m in self.managers.iter() {
            if mamba && m.spec.kind.is_full() {
                // Where a chat's next turn continues: a junction found there later is
                // no branch point (see `Allocator::place_junction`).
                let n = m.num_cached(s) as usize;
                if let Some(&b) = n.checked_sub(1).and_then(|i| m.blocks(s).get(i)) {
                    self.pool.mark_tail(b);
                }
            }
            m.promote_for_free(&mut self.pool, s, level.max(LEVEL_NORMAL), LEVEL_SPECULATIVE);
            if mamba {
                m.demote_duplicates(&mut self.pool, s);
            }
            if probation {
                m.demote_unproven(&mut self.pool, s, hit);
            }
            m.positioned_blocks(s, &mut blocks);
        }
        // Tail first; at equal positions, group order (vLLM frees group after group).
        blocks.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        blocks
    }

    /// Releases the handle and returns its blocks without freeing them (vLLM's
    /// `pop_blocks_for_free`); the caller frees them later with [`Self::free_block_ids`].
    ///
    /// # Errors
    /// Unknown handle.
    pub fn pop_blocks_for_free(&mut self, h: ReqHandle, out: &mut Vec<BlockId>) -> Result<()> {
        let s = self.slot(h)?;
        let start = out.len();
        for m in self.managers.iter_mut() {
            m.pop_blocks(s, out);
        }
        self.pool.loosen(&out[start..]);
        self.release(s);
        Ok(())
    }

    /// Drops one reference from each block, in eviction order (vLLM's
    /// `block_pool.free_blocks`). Only references no table holds can be dropped: blocks
    /// handed out by [`Self::pop_blocks_for_free`].
    ///
    /// # Errors
    /// A block id out of range, or more frees of a block than it has references outside
    /// the tables (a block a live request still holds is refused); checked before any change.
    pub fn free_block_ids(&mut self, ids: &[BlockId]) -> Result<()> {
        self.free_block_ids_ordered(ids, false)
    }

    /// [`Self::free_block_ids`] with vLLM 0.34's `evict_first`: the blocks freed go to the front
    /// of the free queue, cached ones too, so they are reused first.
    ///
    /// # Errors
    /// As [`Self::free_block_ids`]; nothing changes.
    pub fn free_block_ids_ordered(&mut self, ids: &[BlockId], evict_first: bool) -> Result<()> {
        let mut counts: rustc_hash::FxHashMap<BlockId, u32> = Default::default();
        for &b in ids {
            if b >= self.pool.num_blocks() {
                return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {}", self.pool.num_blocks())));
            }
            if b == NULL_BLOCK {
                continue;
            }
            let c = counts.entry(b).or_insert(0);
            *c += 1;
            if *c > self.pool.loose_refs(b) {
                return Err(Error::InvalidBlock(format!(
                    "block {b} freed more times than it was popped (pop_blocks_for_free) and not yet freed"
                )));
            }
        }
        if evict_first {
            self.pool.free_loose_evict_first(ids);
        } else {
            self.pool.free_loose(ids);
        }
        Ok(())
    }

    /// Drops the prefix-cache hashes of the given blocks (vLLM's `evict_blocks`).
    ///
    /// # Errors
    /// A block id out of range; checked before any change.
    pub fn evict_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        if let Some(&b) = ids.iter().find(|&&b| b >= self.pool.num_blocks()) {
            return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {}", self.pool.num_blocks())));
        }
        self.pool.evict_blocks(ids);
        if self.partial_hash_hits {
            // A prompt's partial tail key may have gone with its block's: vLLM keys it again
            // on the request's next caching call, which the no-op limits must not skip.
            for m in self.managers.iter_mut() {
                m.rearm_partial_tails();
            }
            for s in 0..self.reqs.len() as Slot {
                if self.slot_is_live(s) {
                    self.refresh_noop(s);
                }
            }
        }
        Ok(())
    }

    /// Pins a prefix (e.g. a system prompt) given by its block hashes at `hash_block_size`
    /// granularity (`hashes[i]` covers tokens `0..(i + 1) * hash_block_size`), under the
    /// `hit-aware` policy: the blocks a hit on the whole prefix needs (every block of a
    /// full-attention or chunked group, the window tail at its end in a sliding-window
    /// group) are freed at [`crate::policy::LEVEL_PINNED`], evicted after every other cached
    /// block, within the pinned share ([`Self::set_pinned_share`]). Blocks cached now are
    /// pinned now; the others when they are cached. Returns the hash keys pinned in all.
    ///
    /// # Errors
    /// [`Error::Unsupported`] under `exact` or with prefix caching off (vLLM has no
    /// pinning); [`Error::OutOfRange`] when the pinned keys would exceed the pinned share
    /// (nothing changes).
    pub fn pin_prefix(&mut self, hashes: &[BlockHash]) -> Result<u32> {
        if !self.pool.is_leveled() {
            return Err(Error::Unsupported(
                "pinning a prefix needs the hit-aware policy with prefix caching on".into(),
            ));
        }
        let mut keys = Vec::new();
        for m in &self.managers {
            if m.spec.kind.sized_by_encoder_tokens() {
                continue;
            }
            let view = HashView { hashes, scale: m.block_size() / self.cfg.hash_block_size };
            let n = view.len();
            let from = m.hit_tail_blocks().map_or(0, |t| n.saturating_sub(t));
            keys.extend((from..n).map(|i| (view.get(i), m.group_id)));
        }
        self.pool.pin_keys(keys)
    }

    /// Sets the pinned share of the pool (`0.0..=1.0`, default 0.25): at most that fraction
    /// of the blocks may be pinned keys, or free at the pinned level (past it the oldest
    /// free pinned block is demoted to the normal LRU).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a share outside `0.0..=1.0` or below the keys pinned.
    pub fn set_pinned_share(&mut self, share: f64) -> Result<()> {
        self.pool.set_pinned_share(share)
    }

    /// Clears the prefix cache when no block is in use (vLLM's `reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }
}
