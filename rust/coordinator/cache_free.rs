//! Caching and freeing: `cache_blocks`, `remove_skipped_blocks`, `free` (one body; under
//! hit-aware its hook, `retain_for_free` in [`super::hit_aware`], sets the levels and one
//! freeing order across groups), `pop_blocks_for_free` / `free_block_ids`, `evict_blocks`,
//! `reset_prefix_cache`.
//!
//! Cost: caching O(blocks cached); `free` O(table) (O(table log table) under hit-aware).
#![forbid(unsafe_code)]

use super::{page_side, Allocator, HashSource};

use crate::config::CoordinatorKind;
use crate::error::{Error, Result};
use crate::ids::{BlockId, ReqHandle, Slot, NULL_BLOCK};
use crate::manager::CacheArgs;
use crate::policy::Level;

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

    /// Tokens group `g` caches for `num_tokens` (vLLM's `get_num_cacheable_tokens`): the
    /// [`Self::cache_target`], except that a hybrid coordinator's group dropping the EAGLE
    /// block caches one of its blocks past the aligned boundary (it matches that block, then
    /// drops it), once that boundary is past 0.
    pub(super) fn group_cache_target(&self, g: usize, num_tokens: u32) -> u32 {
        let aligned = self.cache_target(num_tokens);
        if self.kind == CoordinatorKind::Hybrid && aligned > 0 && self.managers[g].eagle() {
            return num_tokens.min(aligned.saturating_add(self.managers[g].block_size()));
        }
        aligned
    }

    /// [`Self::group_cache_target`] for request `s`, never past its first never-written
    /// token (`ReqState::unwritten_from`, direct API only).
    fn request_cache_target(&self, s: Slot, g: usize, num_tokens: u32) -> u32 {
        self.group_cache_target(g, num_tokens.min(self.reqs[s as usize].unwritten_from.unwrap_or(u32::MAX)))
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
        // vLLM's `replay_boundaries`, then the junction: without the EAGLE drop a resend's
        // `num_prompt_tokens - 1`; with it (any group dropping) the scheduler blocks below
        // a resend's and a longer sibling's hit, where the dropping groups match one block
        // further. vLLM 0.33 adds, for a dropping group, the junction one of its blocks lower.
        let mut buf = [0u32; 4];
        let mut nb;
        if self.cfg.eagle_drop() {
            let sbs = self.cfg.scheduler_block_size;
            let resend = (num_prompt_tokens.saturating_sub(1) / sbs * sbs).saturating_sub(sbs);
            let extension = (num_prompt_tokens / sbs * sbs).saturating_sub(sbs);
            buf[0] = resend;
            nb = 1;
            if extension != resend {
                buf[1] = extension;
                nb = 2;
            }
        } else {
            buf[0] = num_prompt_tokens.saturating_sub(1);
            nb = 1;
        }
        if shared_prefix_boundary != 0 {
            buf[nb] = shared_prefix_boundary;
            nb += 1;
        }
        for g in 0..self.managers.len() {
            let n = self.request_cache_target(s, g, num_tokens);
            let m = &self.managers[g];
            let eagle = m.eagle();
            let mut nbg = nb;
            if eagle && self.cfg.eagle_junction_tail && shared_prefix_boundary >= m.block_size() {
                // Below one block the tail would end before 0: vLLM's mask keeps nothing there.
                buf[nbg] = shared_prefix_boundary - m.block_size();
                nbg += 1;
            }
            let c = CacheArgs {
                req: handle,
                hashes: &self.reqs[s as usize].hashes,
                num_tokens: n,
                retention_interval: self.cfg.retention_interval,
                reachable_boundaries: &buf[..nbg],
                num_prompt_tokens,
                shared_prefix_boundary,
                eagle,
            };
            let m = &mut self.managers[g];
            m.cache_blocks(self.pool.side(page_side(self.state_groups, m.group_id())), s, &c);
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
            let num_hashes = self.reqs[s as usize].hashes.len();
            for (g, m) in self.managers.iter().enumerate() {
                let n = self.request_cache_target(s, g, num_computed_tokens);
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
            let pool = self.pool.side(page_side(self.state_groups, m.group_id()));
            m.remove_skipped_blocks(pool, s, processed_computed_tokens, num_prompt_tokens);
        }
        self.refresh_noop(s);
        Ok(())
    }

    /// Frees every block of `h`, tail first, and releases the handle (vLLM's `free`, with
    /// `level` [`crate::policy::LEVEL_NORMAL`]). Under `hit-aware`, its full-attention prefix and the
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
        match self.retain_for_free(s, level) {
            None => {
                for m in self.managers.iter_mut() {
                    m.free(self.pool.side(page_side(self.state_groups, m.group_id())), s);
                }
            }
            Some(blocks) => {
                // KV hints: the request's retain over the levels set, and, once its blocks
                // are back, its session release.
                let release = self.retain_at_free(s);
                for m in self.managers.iter_mut() {
                    m.forget(s);
                }
                self.pool.free_blocks(blocks.iter().map(|x| x.2));
                self.release_at_free(release);
            }
        }
        self.release(s);
        Ok(())
    }

    /// Releases the handle and returns its blocks without freeing them (vLLM's
    /// `pop_blocks_for_free`); the caller frees them later with [`Self::free_block_ids`].
    ///
    /// # Errors
    /// Unknown handle.
    pub fn pop_blocks_for_free(&mut self, h: ReqHandle, out: &mut Vec<BlockId>) -> Result<()> {
        let s = self.slot(h)?;
        // KV hints: the request's retain and session release (the levels its blocks get
        // when the caller frees them).
        let release = self.retain_at_free(s);
        let start = out.len();
        if self.state_groups == 0 {
            for m in self.managers.iter_mut() {
                m.pop_blocks(s, out);
            }
            self.pool.loosen(&out[start..]);
        } else {
            // Two-level pages: each group's blocks loosen in its pool; pages are written
            // after the slots (`num_slots + page`, see `free_block_ids`).
            let num_slots = self.pool.num_blocks();
            for m in self.managers.iter_mut() {
                let before = out.len();
                m.pop_blocks(s, out);
                let state = page_side(self.state_groups, m.group_id());
                self.pool.side(state).loosen(&out[before..]);
                if state {
                    out[before..].iter_mut().filter(|b| **b != NULL_BLOCK).for_each(|b| *b += num_slots);
                }
            }
        }
        self.release_at_free(release);
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
        if self.state_groups != 0 {
            return self.free_paged_ids(ids, evict_first);
        }
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
        if self.state_groups != 0 {
            let (slots, pages) = self.split_paged_ids(ids)?;
            self.pool.evict_blocks(&slots);
            self.pool.side(true).evict_blocks(&pages);
        } else {
            if let Some(&b) = ids.iter().find(|&&b| b >= self.pool.num_blocks()) {
                return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {}", self.pool.num_blocks())));
            }
            self.pool.evict_blocks(ids);
        }
        if self.cfg.partial_block_entries() {
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

    /// Two-level pages: the flat ids of `free_block_ids` and `evict_blocks` split by pool
    /// (slot ids `0..num_slots`, page `p` written `num_slots + p`), each range-checked
    /// against its pool, in their order.
    ///
    /// # Errors
    /// An id in neither range.
    fn split_paged_ids(&self, ids: &[BlockId]) -> Result<(Vec<BlockId>, Vec<BlockId>)> {
        let num_slots = self.pool.num_blocks();
        let num_pages = self.pool.side_ref(true).num_blocks();
        let (mut slots, mut pages) = (Vec::new(), Vec::new());
        for &b in ids {
            if b < num_slots {
                slots.push(b);
            } else if (b - num_slots) < num_pages {
                pages.push(b - num_slots);
            } else {
                return Err(Error::InvalidBlock(format!(
                    "block id {b}: neither a slot (< {num_slots}) nor a page ({num_slots} + page, page < {num_pages})"
                )));
            }
        }
        Ok((slots, pages))
    }

    /// [`Self::free_block_ids_ordered`] with two-level pages: each pool's loose references
    /// checked, then freed (slots first).
    fn free_paged_ids(&mut self, ids: &[BlockId], evict_first: bool) -> Result<()> {
        let (slots, pages) = self.split_paged_ids(ids)?;
        for (state, list) in [(false, &slots), (true, &pages)] {
            let pool = self.pool.side_ref(state);
            let mut counts: rustc_hash::FxHashMap<BlockId, u32> = Default::default();
            for &b in list.iter().filter(|&&b| b != NULL_BLOCK) {
                let c = counts.entry(b).or_insert(0);
                *c += 1;
                if *c > pool.loose_refs(b) {
                    let what = if state { "page" } else { "slot" };
                    return Err(Error::InvalidBlock(format!(
                        "{what} {b} freed more times than it was popped (pop_blocks_for_free) and not yet freed"
                    )));
                }
            }
        }
        for (state, list) in [(false, &slots), (true, &pages)] {
            let pool = self.pool.side(state);
            if evict_first {
                pool.free_loose_evict_first(list);
            } else {
                pool.free_loose(list);
            }
        }
        Ok(())
    }

    /// Clears the prefix cache when no block is in use (vLLM's `reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }
}
