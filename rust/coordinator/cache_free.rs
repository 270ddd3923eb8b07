//! Caching and freeing: `cache_blocks`, `remove_skipped_blocks`, `free` (one body; under
//! hit-aware its hook, `retain_for_free` in [`super::hit_aware`], sets the levels and one
//! freeing order across groups), `pop_blocks_for_free` / `free_block_ids`, `touch_block_ids` (a
//! connector's pins, vLLM's `block_pool.touch`, given back by `free_block_ids`), `evict_blocks`,
//! `reset_prefix_cache`.
//!
//! Cost: caching O(blocks cached); `free` O(table) (O(table log table) under hit-aware);
//! `touch_block_ids`, `free_block_ids` O(blocks given).
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
    /// `request.num_computed_tokens` (read only under [`crate::Config::shared_prefix_checkpoint`]:
    /// a Mamba "align" group keys the junction only in a call past it, `request_computed_tokens
    /// < junction`; `allocate_slots` passes its own).
    pub request_computed_tokens: u32,
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
    /// drops it), once that boundary is past 0. The re-prefillable tokens
    /// ([`crate::Config::reprefillable_tokens`]) are left out where vLLM leaves them out: by a
    /// single group (vLLM's base coordinator) and, in a hybrid, by a dropping group (whose
    /// limit is then taken from the finalized tokens, the aligned boundary still from all).
    pub(super) fn group_cache_target(&self, g: usize, num_tokens: u32) -> u32 {
        let r = self.cfg.reprefillable_tokens;
        if self.kind != CoordinatorKind::Hybrid {
            return num_tokens.saturating_sub(r);
        }
        let aligned = self.cache_target(num_tokens);
        if aligned > 0 && self.managers[g].eagle() {
            let finalized = num_tokens.saturating_sub(r);
            return finalized.min(self.cache_target(finalized).saturating_add(self.managers[g].block_size()));
        }
        aligned
    }

    /// [`Self::group_cache_target`] for request `s`, never past its first never-written
    /// token (`ReqState::unwritten_from`, direct API only).
    fn request_cache_target(&self, s: Slot, g: usize, num_tokens: u32) -> u32 {
        self.group_cache_target(g, num_tokens.min(self.reqs[s as usize].unwritten_from.unwrap_or(u32::MAX)))
    }

    /// Caches the full blocks of `s` up to `c.num_computed_tokens` in every group, unchecked
    /// (vLLM's `coordinator.cache_blocks`).
    pub(super) fn cache_blocks_inner(&mut self, s: Slot, c: &CacheBlocksArgs) {
        let CacheBlocksArgs { num_computed_tokens: num_tokens, num_prompt_tokens, shared_prefix_boundary, .. } = *c;
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
                request_computed_tokens: c.request_computed_tokens,
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
        let num_computed_tokens = c.num_computed_tokens;
        let s = self.slot(h)?;
        let undo = match hashes {
            Some(src) => Some(self.sync_hashes(s, src)?),
            None => None,
        };
        if self.cfg.enable_caching && self.caches_nothing(s, c) {
            // Provably a no-op (see `caches_nothing`): the tables, keys and the no-op
            // limits stay as they are (the limits read no hash, so the sync above leaves
            // them right).
            return Ok(());
        }
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
        self.cache_blocks_inner(s, c);
        self.refresh_noop(s);
        Ok(())
    }

    /// Whether `cache_blocks` up to `c.num_computed_tokens` provably caches and changes
    /// nothing: the request's no-op limits ([`super::NoopLimits`]) prove a plain step of one
    /// token ending there a no-op, and such a step's `allocate_slots` would run the same
    /// `cache_blocks_inner` (to `min(computed + new, num_tokens)` tokens, with the request's
    /// prompt and shared-prefix boundary, which the proof does not depend on), and no Mamba
    /// "align" group's prompt boundary would move (the one thing such a call writes when it
    /// caches nothing; only the no-op limits read it). Exact policy without partial hash hits
    /// only (hit-aware keys junction states at the shared-prefix boundary, which the limits
    /// do not watch), and without the EAGLE/MTP block drop (its groups cache past the
    /// boundary the proof was made for). The scheduler calls `cache_blocks` for every running request of a Mamba
    /// hybrid every step: most calls are this. O(groups).
    #[inline]
    fn caches_nothing(&self, s: Slot, c: &CacheBlocksArgs) -> bool {
        let t = c.num_computed_tokens;
        let lim = self.reqs[s as usize].noop;
        if !(t > 0
            && t < lim.cached
            && t <= lim.slots
            && lim.new_tokens > 0
            && lim.processed > 0
            && c.num_prompt_tokens >= lim.prompt
            && !self.partial_hash_hits
            && !self.pool.is_leveled()
            && !self.cfg.eagle_drop())
        {
            return false;
        }
        self.managers
            .iter()
            .enumerate()
            .all(|(g, m)| m.keeps_prompt_boundary(s, self.request_cache_target(s, g, t), c.num_prompt_tokens))
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
        // Two-level pages serve no pinned level (see `refuse_pins_over_pages`): a request
        // with a retention priority is freed at the normal level.
        let level = if self.state_groups != 0 { level.min(crate::policy::LEVEL_NORMAL) } else { level };
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
                if self.state_groups == 0 {
                    self.pool.free_blocks(blocks.iter().map(|x| x.2));
                } else {
                    // Two-level pages: the same order, each run of one pool's blocks (slots or
                    // state pages) freed into its pool.
                    let side = |x: &(u64, crate::ids::GroupId, BlockId)| page_side(self.state_groups, x.1);
                    for run in blocks.chunk_by(|x, y| side(x) == side(y)) {
                        self.pool.side(side(&run[0])).free_blocks(run.iter().map(|x| x.2));
                    }
                }
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

    /// Takes one reference on each block, outside any table (vLLM's `BlockPool.touch`, which
    /// KV connectors call to keep blocks from being reused while they copy them): a free block
    /// leaves the free queue; the null block is skipped, as vLLM's. Each reference is loose:
    /// [`Self::free_block_ids`] gives it back. The residency log notes each block accessed, as
    /// vLLM's pool tells its metrics collector. O(blocks given).
    ///
    /// # Errors
    /// A block id out of range, or two-level pages (not served: a slot and its page would both
    /// be pinned); checked before any change.
    pub fn touch_block_ids(&mut self, ids: &[BlockId]) -> Result<()> {
        if self.state_groups != 0 {
            return Err(Error::Unsupported("touch of block ids with two-level pages".into()));
        }
        let n = self.pool.num_blocks();
        if let Some(&b) = ids.iter().find(|&&b| b >= n) {
            return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {n}")));
        }
        if ids.contains(&NULL_BLOCK) {
            let ids: Vec<BlockId> = ids.iter().copied().filter(|&b| b != NULL_BLOCK).collect();
            self.pool.touch(&ids);
        } else {
            self.pool.touch(ids);
        }
        self.pool.loosen(ids);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AttentionKind, Config, GroupSpec};
    use crate::ids::BlockHash;
    use crate::policy::Policy;
    use crate::AllocateArgs;
    use crate::NewComputed;

    /// [`super::super::full_and_align_config`] under `exact`.
    fn allocator(k: u32) -> Allocator {
        Allocator::new(super::super::full_and_align_config(k), Policy::Exact).unwrap()
    }

    /// Chained hashes of `n` hash blocks of request `seed`.
    fn hashes(seed: u64, n: usize) -> Vec<BlockHash> {
        let mut prev = seed;
        (0..n as u64)
            .map(|i| {
                prev = prev.rotate_left(5) ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                BlockHash::from_u64(prev)
            })
            .collect()
    }

    /// The events, the request handles left out (the two allocators number them apart).
    fn events(a: &mut Allocator) -> Vec<crate::Event> {
        let mut ev = a.take_events();
        for e in &mut ev {
            if let crate::Event::Stored { req, .. } = e {
                *req = 0;
            }
        }
        ev
    }

    /// `cache_blocks` as it was before its no-op answer: sync, cache, refresh the limits.
    fn cache_blocks_in_full(a: &mut Allocator, h: ReqHandle, c: &CacheBlocksArgs, hs: &dyn HashSource) {
        let s = a.slot(h).unwrap();
        a.sync_hashes(s, hs).unwrap();
        a.cache_blocks_inner(s, c);
        a.refresh_noop(s);
    }

    /// The workload of [`decode_in_lockstep`].
    struct Lockstep<'a> {
        /// Prefixes the assertion messages.
        what: &'a str,
        /// Tokens per hash.
        hash_block: u32,
        /// `(seed, prompt)` of each request, run one after the other.
        requests: &'a [(u64, u32)],
        /// Decode until this many tokens.
        end: u32,
        /// [`AllocateArgs::trust_computed_tokens`] of every step.
        trust_computed_tokens: bool,
    }

    /// Drives `fast` and `full` in lockstep through the scheduler's calls for each request
    /// of `w`: its prefill, then decode steps of one token up to `w.end` tokens, each step an
    /// allocation (`fast_step` on `fast`, `allocate_slots` on `full`) then `cache_blocks` at
    /// the computed tokens (`fast` answers it through its no-op test, `full` always runs it
    /// in full). After every step the tables of every group, the keys (events), the free
    /// counts and the no-op limits must not differ, and `fast`'s invariants hold; `after`
    /// sees `full`, its handle, the tokens and the step's events.
    fn decode_in_lockstep(
        fast: &mut Allocator,
        full: &mut Allocator,
        w: &Lockstep<'_>,
        mut fast_step: impl FnMut(&mut Allocator, ReqHandle, &AllocateArgs, &Vec<BlockHash>, &CacheBlocksArgs),
        mut after: impl FnMut(&Allocator, ReqHandle, u32, &[crate::Event]),
    ) {
        let Lockstep { what, hash_block, requests, end, trust_computed_tokens } = *w;
        for &(seed, prompt) in requests {
            let (hf, hl) = (fast.add_request(), full.add_request());
            for computed in std::iter::once(0).chain(prompt..end) {
                let new = if computed == 0 { prompt } else { 1 };
                let tokens = computed + new;
                let hs = hashes(seed, (tokens / hash_block) as usize);
                let a = AllocateArgs {
                    num_new_tokens: new,
                    num_computed_tokens: computed,
                    num_prompt_tokens: prompt,
                    num_tokens: tokens,
                    trust_computed_tokens,
                    ..Default::default()
                };
                let c = CacheBlocksArgs {
                    num_computed_tokens: tokens,
                    num_prompt_tokens: prompt,
                    shared_prefix_boundary: 0,
                    ..Default::default()
                };
                fast_step(fast, hf, &a, &hs, &c);
                full.allocate_slots(hl, &a, NewComputed::Empty, Some(&hs)).unwrap().unwrap();
                fast.cache_blocks(hf, &c, Some(&hs)).unwrap();
                cache_blocks_in_full(full, hl, &c, &hs);
                for g in 0..fast.num_groups() {
                    assert_eq!(fast.blocks(hf, g).unwrap(), full.blocks(hl, g).unwrap(), "{what}group {g} at {tokens}");
                }
                let ev = events(full);
                assert_eq!(events(fast), ev, "{what}at {tokens}");
                assert_eq!(fast.num_free_blocks(), full.num_free_blocks(), "{what}at {tokens}");
                assert_eq!(fast.noop_limits(hf).unwrap(), full.noop_limits(hl).unwrap(), "{what}at {tokens}");
                after(full, hl, tokens, &ev);
                crate::invariants::check(fast).unwrap();
            }
            fast.free(hf, crate::policy::LEVEL_NORMAL).unwrap();
            full.free(hl, crate::policy::LEVEL_NORMAL).unwrap();
        }
    }

    #[test]
    fn cache_blocks_answered_as_a_no_op_changes_nothing_the_full_call_would() {
        // The scheduler's calls of a decode (the step's `allocate_slots`, then `cache_blocks`
        // at the computed tokens), in lockstep against an allocator that runs every call in
        // full.
        for k in [1u32, 4] {
            let hash_block = if k == 1 { 32 } else { 16 };
            let (mut fast, mut full) = (allocator(k), allocator(k));
            let (mut answered, mut calls) = (0, 0);
            let w = Lockstep {
                what: &format!("k={k} "),
                hash_block,
                requests: &[(7, 40), (9, 56), (11, 64)],
                end: 200,
                trust_computed_tokens: false,
            };
            decode_in_lockstep(
                &mut fast,
                &mut full,
                &w,
                |x, h, a, hs, c| {
                    x.allocate_slots(h, a, NewComputed::Empty, Some(hs)).unwrap().unwrap();
                    calls += 1;
                    if x.caches_nothing(x.slot(h).unwrap(), c) {
                        answered += 1;
                    }
                },
                |_, _, _, _| {},
            );
            // Every call but those at a new state block's end (every 32 tokens) and the
            // prompt's: most of them.
            assert!(answered * 10 >= calls * 8, "k={k}: {answered} of {calls} answered as no-ops");
        }
    }

    fn full(block_size: u32, spec_key: u32) -> GroupSpec {
        GroupSpec { kind: AttentionKind::Full, block_size, spec_key }
    }

    #[test]
    fn group_cache_target_with_reprefillable_tokens_leaves_them_out_where_vllm_does() {
        let swa = GroupSpec {
            kind: AttentionKind::SlidingWindow { window: 64, extra_retained_tokens: 0 },
            block_size: 16,
            spec_key: 1,
        };
        // One group (vLLM's base coordinator): always `num_computed - reprefillable`.
        let one = |r| {
            let cfg = Config { reprefillable_tokens: r, ..Config::new(64, vec![full(16, 0)], 16) };
            Allocator::new(cfg, Policy::Exact).unwrap()
        };
        let (a0, a2) = (one(0), one(2));
        for (n, want) in [(0, 0), (1, 0), (2, 0), (3, 1), (33, 31), (34, 32)] {
            assert_eq!(a2.group_cache_target(0, n), want, "unitary, {n} tokens");
            assert_eq!(a0.group_cache_target(0, n), n);
        }
        // Prefix caching off: the same arithmetic (vLLM's base class), nothing is cached.
        let cfg = Config { reprefillable_tokens: 2, enable_caching: false, ..Config::new(64, vec![full(16, 0)], 16) };
        assert_eq!(Allocator::new(cfg, Policy::Exact).unwrap().group_cache_target(0, 34), 32);
        // A hybrid: the group dropping the EAGLE block takes its limit from the finalized
        // tokens (aligned boundary still from all of them); the others cache the aligned
        // computed tokens as without re-prefillable tokens.
        let cfg = Config {
            reprefillable_tokens: 2,
            eagle_drop_groups: 0b01,
            retention_interval: Some(0),
            ..Config::new(64, vec![full(16, 0), swa], 16)
        };
        let h = Allocator::new(cfg, Policy::Exact).unwrap();
        for (n, drop_want, swa_want) in
            [(15, 0, 0), (16, 14, 16), (17, 15, 16), (33, 31, 32), (50, 48, 48), (63, 61, 48)]
        {
            assert_eq!(h.group_cache_target(0, n), drop_want, "dropping group, {n} tokens");
            assert_eq!(h.group_cache_target(1, n), swa_want, "sliding window, {n} tokens");
        }
    }

    #[test]
    fn new_with_reprefillable_tokens_refuses_hit_aware_with_caching_only() {
        let cfg = |caching| Config {
            reprefillable_tokens: 1,
            enable_caching: caching,
            ..Config::new(64, vec![full(16, 0)], 16)
        };
        let err = Allocator::new(cfg(true), Policy::HitAware).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        assert!(Allocator::new(cfg(false), Policy::HitAware).is_ok());
        assert!(Allocator::new(cfg(true), Policy::Exact).is_ok());
    }

    #[test]
    fn no_op_answers_with_reprefillable_tokens_change_nothing_the_full_calls_would() {
        // One full-attention group whose last two computed tokens are not final: a prefill,
        // then decode steps through `plain_step` and `cache_blocks`, against an allocator
        // that runs every call in full. Tables, events, free counts and limits agree.
        struct Step<'a>(&'a AllocateArgs, &'a Vec<BlockHash>);
        impl super::super::noop::StepFields for Step<'_> {
            type Error = Error;
            fn num_computed_tokens(&self) -> Result<i64> {
                Ok(self.0.num_computed_tokens as i64)
            }
            fn num_in_flight_tokens(&self) -> Result<i64> {
                Ok(0)
            }
            fn num_tokens(&self) -> Result<i64> {
                Ok(self.0.num_tokens as i64)
            }
            fn num_prompt_tokens(&self) -> Result<i64> {
                Ok(self.0.num_prompt_tokens as i64)
            }
            fn shared_prefix_boundary(&self) -> Result<i64> {
                Ok(0)
            }
            fn with_block_hashes<T>(&self, f: impl FnOnce(&dyn HashSource) -> Result<T>) -> Result<T> {
                f(self.1)
            }
        }
        let new = || {
            let cfg = Config { reprefillable_tokens: 2, enable_events: true, ..Config::new(64, vec![full(16, 0)], 16) };
            Allocator::new(cfg, Policy::Exact).unwrap()
        };
        let (mut fast, mut full) = (new(), new());
        let (mut noops, mut cached) = (0, 0);
        let w = Lockstep {
            what: "",
            hash_block: 16,
            requests: &[(3, 30), (5, 47), (8, 64)],
            end: 160,
            trust_computed_tokens: true,
        };
        decode_in_lockstep(
            &mut fast,
            &mut full,
            &w,
            |x, h, a, hs, _| {
                if a.num_computed_tokens == 0 {
                    x.allocate_slots(h, a, NewComputed::Empty, Some(hs)).unwrap().unwrap();
                } else if x.plain_step(h, a.num_new_tokens as i64, 0, &Step(a, hs)).unwrap()
                    == super::super::PlainStep::NoOp
                {
                    noops += 1;
                }
            },
            |x, h, tokens, ev| {
                cached += ev.len();
                // Only the blocks wholly below the finalized tokens are cached.
                let s = x.slot(h).unwrap();
                assert_eq!(x.managers[0].num_cached(s), (tokens - 2) / 16, "at {tokens}");
            },
        );
        assert!(noops > 100 && cached > 0, "{noops} no-op steps, {cached} events");
    }

    /// An allocator of one full-attention group (blocks of 16 tokens) holding one request
    /// with `tokens` tokens cached under `seed`'s hashes, then freed: its blocks sit at the
    /// back of the free queue, keyed.
    fn freed_cached_request(num_blocks: u32, tokens: u32, seed: u64) -> Allocator {
        let mut a = Allocator::new(Config::new(num_blocks, vec![full(16, 0)], 16), Policy::Exact).unwrap();
        let h = a.add_request();
        let hs = hashes(seed, (tokens / 16) as usize);
        let args = AllocateArgs {
            num_new_tokens: tokens,
            num_prompt_tokens: tokens,
            num_tokens: tokens,
            ..Default::default()
        };
        a.allocate_slots(h, &args, NewComputed::Empty, Some(&hs)).unwrap().unwrap();
        let c = CacheBlocksArgs { num_computed_tokens: tokens, num_prompt_tokens: tokens, ..Default::default() };
        a.cache_blocks(h, &c, Some(&hs)).unwrap();
        a.free(h, crate::policy::LEVEL_NORMAL).unwrap();
        a
    }

    #[test]
    fn touch_block_ids_of_free_blocks_pulls_them_out_and_free_puts_them_back() {
        // vLLM's `BlockPool.touch` then `free_blocks`: a touched free block leaves the queue
        // (ref 1), a second touch adds a reference; freeing gives both back, the cached
        // block to the back of the queue (or the front with `evict_first`).
        let mut a = freed_cached_request(16, 64, 7);
        let order = a.pool().free_queue_order();
        let free = a.num_free_blocks();
        let (b1, b2) = (order[order.len() - 1], order[order.len() - 2]);
        a.touch_block_ids(&[b1, NULL_BLOCK, b2, b1]).unwrap();
        crate::invariants::check(&a).unwrap();
        assert_eq!((a.pool().ref_cnt(b1), a.pool().ref_cnt(b2)), (2, 1));
        assert_eq!(a.num_free_blocks(), free - 2);
        assert!(!a.pool().free_queue_order().contains(&b1));
        a.free_block_ids(&[b1]).unwrap();
        assert!(!a.pool().free_queue_order().contains(&b1), "one reference left");
        a.free_block_ids_ordered(&[b2, b1], true).unwrap();
        crate::invariants::check(&a).unwrap();
        let after = a.pool().free_queue_order();
        assert_eq!(&after[..2], &[b2, b1], "evict_first puts them at the front, in order");
        assert_eq!(a.num_free_blocks(), free);
        assert!(a.pool().block_hash(b1).is_some(), "still cached");
        // More frees than touches are refused.
        assert!(matches!(a.free_block_ids(&[b1]), Err(Error::InvalidBlock(_))));
    }

    #[test]
    fn touch_block_ids_out_of_range_changes_nothing() {
        let mut a = freed_cached_request(16, 64, 7);
        let before = (a.pool().free_queue_order(), a.num_free_blocks());
        let b = before.0[0];
        let err = a.touch_block_ids(&[b, 16]).unwrap_err();
        assert!(matches!(err, Error::InvalidBlock(_)), "{err}");
        assert_eq!((a.pool().free_queue_order(), a.num_free_blocks()), before);
        assert_eq!(a.pool().ref_cnt(b), 0);
        crate::invariants::check(&a).unwrap();
    }

    #[test]
    fn touch_block_ids_with_two_level_pages_is_refused() {
        let mut a = allocator(4);
        let err = a.touch_block_ids(&[1]).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        crate::invariants::check(&a).unwrap();
    }

    #[test]
    fn free_queue_after_walks_in_chunks_as_the_whole_order() {
        let mut a = freed_cached_request(16, 64, 7);
        a.touch_block_ids(&[3]).unwrap();
        let whole = a.pool().free_queue_order();
        let mut walked = Vec::new();
        let mut cursor = None;
        loop {
            let chunk = a.pool().free_queue_after(cursor, 4);
            if chunk.is_empty() {
                break;
            }
            cursor = chunk.last().copied();
            walked.extend(chunk);
        }
        assert_eq!(walked, whole);
        // After a block that is not free (or out of range): nothing, as vLLM's cursor.
        assert!(a.pool().free_queue_after(Some(3), 4).is_empty());
        assert!(a.pool().free_queue_after(Some(NULL_BLOCK), 4).is_empty());
        assert!(a.pool().free_queue_after(Some(99), 4).is_empty());
    }
}
