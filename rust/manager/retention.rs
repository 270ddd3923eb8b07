//! The `hit-aware` retention rules of a group (see [`crate::policy`]): which cached blocks
//! a hit needs at its end, the levels masked blocks are cached at, and the promotions made
//! when a request adopts a hit or is freed.
//!
//! Cost: O(blocks of the request's table) per call; nothing here runs under `exact`.
#![forbid(unsafe_code)]

use super::SingleTypeManager;
use crate::block_pool::BlockPool;
use crate::ids::{BlockId, GroupId, Slot, NULL_BLOCK};
use crate::policy::{Level, LEVEL_NEAR, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_PROBATION, LEVEL_RESUMED, LEVEL_SPECULATIVE};

impl SingleTypeManager {
    /// Contiguous cached blocks a hit in this group needs at its end (`None`: the group
    /// needs the whole prefix, or never hits).
    pub fn hit_tail_blocks(&self) -> Option<u32> {
        super::with_rules!(self.spec.kind, r => r.hit_tail_blocks(self.spec.block_size))
    }

    /// Hit-aware: raises the retention level of the window tail ending at `h`'s last cached
    /// block (where a request re-sending this sequence resumes) to at least `lvl`, and of
    /// every other cached block of the table to at least `floor`.
    pub fn promote_for_free(&self, pool: &mut BlockPool, h: Slot, lvl: Level, floor: Level) {
        let table = &self.req_blocks[h as usize];
        let mut end = (self.num_cached(h) as usize).min(table.len());
        // Partial hash hits: the block past the cached ones may hold the prompt's partial
        // tail (a key inside the block), where the next request re-sending the prompt hits.
        if self.hash_block_size < self.spec.block_size
            && end < table.len()
            && table[end] != NULL_BLOCK
            && pool.block_hash(table[end]).is_some()
        {
            end += 1;
        }
        if self.is_mamba_align() {
            // The furthest state the request keyed is where the next turn resumes; the
            // earlier states it holds are passed (see `demote_passed_state`).
            let dominant = self.align_dominant_state(pool, h);
            for &b in &table[..end] {
                if Some(b) != dominant {
                    self.demote_passed_state(pool, h, b);
                }
            }
            if let Some(b) = dominant {
                if pool.level(b) < lvl {
                    pool.set_level(b, lvl);
                }
            }
            return;
        }
        let tail = self.hit_tail_blocks().map_or(end, |n| n as usize);
        for (i, &b) in table[..end].iter().enumerate() {
            if b == NULL_BLOCK || pool.block_hash(b).is_none() {
                continue;
            }
            let want = if i + tail >= end { lvl } else { floor };
            if pool.level(b) < want {
                pool.set_level(b, want);
            }
        }
        if self.spec.kind.is_full() && !pool.state_groups().is_empty() {
            self.form_hit_units(pool, h, end);
        }
    }

    /// Hit-aware, state-space hybrids, full attention: forms the hit unit `h` leaves behind
    /// ([`crate::policy::HitUnits`]): the furthest position of its cached blocks where a
    /// state is cached in every Mamba group, with the blocks before it. The blocks past that
    /// state that no live unit holds serve no hit (a hit needs a state at or past them): they
    /// are evicted first. Called once the levels of the request's blocks are set, before they
    /// are freed. O(`end` x state groups).
    fn form_hit_units(&self, pool: &mut BlockPool, h: Slot, end: usize) {
        let table = &self.req_blocks[h as usize];
        let mut furthest = 0;
        for i in (1..=end).rev() {
            // The null block is never keyed.
            let Some(&key) = pool.block_hash(table[i - 1]) else { continue };
            let states = pool.state_set(&key.0);
            if !states.is_empty() {
                furthest = i;
                pool.form_unit(&states, &table[..i]);
                break;
            }
        }
        for &b in &table[furthest..end] {
            if b != NULL_BLOCK && pool.block_hash(b).is_some() && pool.unit_support(b) == 0 && pool.ref_cnt(b) <= 1 {
                pool.evict_first(b);
            }
        }
    }

    /// Hit-aware: the cached blocks of `h` that are not the block a lookup of their key finds
    /// (a copy of a prefix cached before, recomputed because no state served it) go to
    /// [`LEVEL_SPECULATIVE`]: no hit can use them while the other copy is cached (a pinned
    /// key's block still goes back at the pinned level). O(table).
    pub fn demote_duplicates(&self, pool: &mut BlockPool, h: Slot) {
        for &b in &self.req_blocks[h as usize] {
            let Some(key) = (b != NULL_BLOCK).then(|| pool.block_hash(b)).flatten() else { continue };
            if pool.level(b) != LEVEL_SPECULATIVE && pool.index().get_one(key) != Some(b) {
                pool.set_level(b, LEVEL_SPECULATIVE);
            }
        }
    }

    /// Hit-aware, Mamba "align": a state block `h` has passed (it keyed a later state)
    /// goes to [`LEVEL_SPECULATIVE`]: a
    /// request re-sending this sequence resumes from the later state (a chat's next turn
    /// does), so the earlier one only uses memory nothing else wants. A state at the
    /// shared-prefix boundary `h` reported is where other requests branch off: it is marked a
    /// branch point ([`BlockPool::mark_branch`]) and keeps its level, as does every branch
    /// point passed later, a block another request holds, and a pinned block. O(1).
    pub fn demote_passed_state(&self, pool: &mut BlockPool, h: Slot, b: BlockId) {
        if b == NULL_BLOCK || pool.block_hash(b).is_none() {
            return;
        }
        if pool.block_hash_num_tokens(b) == self.align_junction(h) {
            pool.mark_branch(b);
            if pool.level(b) == LEVEL_SPECULATIVE {
                // A state passed before (a hit's end that turned out shared): a branch point
                // now, kept as one.
                pool.set_level(b, LEVEL_NORMAL);
            }
        }
        let lvl = pool.level(b);
        if lvl == LEVEL_SPECULATIVE || lvl >= LEVEL_PINNED || pool.ref_cnt(b) > 1 || pool.is_branch(b) {
            return;
        }
        // Not passed yet: the furthest state `h` keyed (vLLM frees it once the step after it
        // is processed, while a prompt or a decode without a later boundary goes on). It is
        // demoted when `h` keys a later one (`align_cache_blocks`).
        if pool.block_hash_num_tokens(b) >= self.align_furthest_keyed(h) {
            return;
        }
        pool.set_level(b, LEVEL_SPECULATIVE);
    }

    /// Hit-aware, state-space hybrids: the blocks `h` cached past its adopted hit of
    /// `hit_tokens` (its furthest state included) that only it holds and that sit at
    /// [`LEVEL_NORMAL`] go to [`LEVEL_PROBATION`] (see the level). Pinned blocks, blocks
    /// another request holds and blocks served in a hit since they were cached keep their level.
    pub fn demote_unproven(&self, pool: &mut BlockPool, h: Slot, hit_tokens: u32) {
        let bs = self.spec.block_size as u64;
        let from = (hit_tokens as u64).div_ceil(bs) as usize;
        let table = &self.req_blocks[h as usize];
        let demote = |pool: &mut BlockPool, b: BlockId| {
            if b != NULL_BLOCK
                && pool.block_hash(b).is_some()
                && pool.level(b) == LEVEL_NORMAL
                && pool.ref_cnt(b) <= 1
                && !pool.reused(b)
                && pool.block_hash_num_tokens(b) > hit_tokens
            {
                pool.set_level(b, LEVEL_PROBATION);
            }
        };
        for &b in table.iter().skip(from) {
            demote(pool, b);
        }
        if self.is_mamba_align() {
            if let Some(b) = self.align_dominant_state(pool, h) {
                demote(pool, b);
            }
        }
    }

    /// Hit-aware: the blocks of a hit just adopted keep at least [`LEVEL_NORMAL`]. In a Mamba
    /// "align" group, a state resumed where the request's own sequence ended (no junction
    /// shared with another request, no pin) is kept at [`LEVEL_NEAR`] instead while the
    /// request runs (vLLM frees it after the first step): under a cyclic load larger than the
    /// cache (round-robin chat) the running session comes back last, so its unit is the one
    /// to lose first. When the request is freed its furthest state is raised again
    /// ([`Self::promote_for_free`]). A branch point keeps its level; a state on probation
    /// leaves it (it served a hit).
    pub fn promote_hit(&self, pool: &mut BlockPool, h: Slot) {
        let own = self.is_mamba_align() && self.align_junction(h) == 0;
        for &b in &self.req_blocks[h as usize] {
            if b == NULL_BLOCK {
                continue;
            }
            let lvl = pool.level(b);
            let want = if !own || (lvl == LEVEL_NORMAL && pool.is_branch(b)) {
                LEVEL_NORMAL
            } else if lvl == LEVEL_PROBATION || lvl == LEVEL_RESUMED {
                LEVEL_RESUMED
            } else {
                LEVEL_NEAR
            };
            if lvl < want || (own && lvl != want && lvl <= LEVEL_NORMAL) {
                pool.set_level(b, want);
            }
        }
    }

    /// Appends `(position, group, block)` for every non-null block of `h`'s table
    /// (hit-aware free order).
    pub fn positioned_blocks(&self, h: Slot, out: &mut Vec<(u64, GroupId, BlockId)>) {
        let bs = self.spec.block_size as u64;
        for (i, &b) in self.req_blocks[h as usize].iter().enumerate() {
            if b != NULL_BLOCK {
                out.push((i as u64 * bs, self.group_id, b));
            }
        }
    }

    /// Hit-aware caching of a masked range (blocks `num_cached..` of `h`'s table, all just
    /// cached): the blocks the mask skips go to [`LEVEL_SPECULATIVE`], or to [`LEVEL_NEAR`]
    /// when within one window tail before a reachable boundary's tail.
    pub(super) fn level_masked_blocks(
        &self,
        pool: &mut BlockPool,
        h: Slot,
        num_cached: u32,
        mask: &[bool],
        reachable_boundaries: &[u32],
    ) {
        let bs = self.spec.block_size;
        let table = &self.req_blocks[h as usize];
        let need = self.hit_tail_blocks().unwrap_or(0) as u64;
        let align = self.cache_hit_alignment_tokens.max(1);
        // Block index where each boundary's retained tail ends.
        let ends: Vec<u64> = reachable_boundaries.iter().map(|&b| (b / align * align / bs) as u64).collect();
        for (k, &keep) in mask.iter().enumerate() {
            if !keep {
                let i = num_cached as u64 + k as u64;
                let near = ends.iter().any(|&e| i + need < e && i + 2 * need >= e);
                pool.set_level(table[i as usize], if near { LEVEL_NEAR } else { LEVEL_SPECULATIVE });
            }
        }
    }
}
