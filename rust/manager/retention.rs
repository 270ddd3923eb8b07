//! The `hit-aware` retention rules of a group (see [`crate::policy`]), the one home of the
//! policy's per-group rules, Mamba "align"'s included: which cached blocks a hit needs at
//! its end, the levels masked blocks are cached at, the promotions made when a request
//! adopts a hit or is freed, the hit units a freed request leaves, and a Mamba "align"
//! group's states: the furthest one a request keyed (it dominates the earlier ones), the
//! junction its lookup found shared, and the states it passes ([`GroupRetention`], the
//! per-request state these rules keep).
//!
//! Every rule works on the policy's handle ([`HitAware`], from `BlockPool::hit_aware`),
//! taken once by its caller; the kinds' files call the named hooks here (`states_keyed`,
//! `states_passed`, `state_moved`, `keys_junction_state`), each a no-op under `exact`.
//!
//! Invariants: a [`GroupRetention`] is sized only for a Mamba "align" group (empty
//! otherwise); its entries of a slot are reset when the slot is forgotten.
//!
//! Cost: O(blocks of the request's table) per rule; a hook O(1) (`states_passed` O(blocks
//! passed)); nothing here runs under `exact` but the hooks' one `Option` check.
#![forbid(unsafe_code)]

use super::SingleTypeManager;
use crate::block_pool::BlockPool;
use crate::ids::{BlockId, GroupId, Slot, NULL_BLOCK};
use crate::policy::retention::HitAware;
use crate::policy::{Level, LEVEL_NEAR, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_PROBATION, LEVEL_RESUMED, LEVEL_SPECULATIVE};
use crate::prefix_index::HashKey;

/// Hit-aware's per-request state of a group: for a Mamba "align" group, the furthest state
/// each request keyed and the junction its lookup found shared; empty for other groups.
#[derive(Clone, Debug, Default)]
pub(crate) struct GroupRetention {
    /// Whether the group is Mamba "align" (the only kind with per-request hit-aware state).
    states: bool,
    /// `last_keyed[h] = (block, key, tokens)` of the furthest state the request keyed
    /// (`tokens` 0: none). It dominates the request's earlier states: a later request
    /// re-sending the sequence resumes from it (see [`SingleTypeManager::promote_for_free`]).
    last_keyed: Vec<(BlockId, Option<HashKey>, u32)>,
    /// `junction[h]`: the junction the request's last lookup found shared with another
    /// request or pinned (0: none). The state there is where other requests branch off: it
    /// is not demoted when the request passes it (see [`GroupRetention::demote_passed_state`]).
    junction: Vec<u32>,
}

impl GroupRetention {
    /// The state of a group (`states`: a Mamba "align" group).
    pub(super) fn new(states: bool) -> Self {
        Self { states, ..Self::default() }
    }

    /// Makes room for `n` slots.
    pub(super) fn ensure_slot(&mut self, n: usize) {
        if self.states {
            self.last_keyed.resize(n, (NULL_BLOCK, None, 0));
            self.junction.resize(n, 0);
        }
    }

    /// Forgets slot `h`.
    pub(super) fn clear(&mut self, h: Slot) {
        if self.states {
            self.last_keyed[h as usize] = (NULL_BLOCK, None, 0);
            self.junction[h as usize] = 0;
        }
    }

    /// The block of a `last_keyed` entry while it still holds the key it was recorded with
    /// (`None` once the block was re-keyed or evicted, or when nothing was keyed).
    fn still_keyed(ha: &HitAware<'_>, (b, key, _): (BlockId, Option<HashKey>, u32)) -> Option<BlockId> {
        (key.is_some() && ha.key_of(b) == key.as_ref()).then_some(b)
    }

    /// The request's furthest keyed state, when its block still holds that key (it may be
    /// free already: the previous state goes back to the pool during decode).
    fn dominant_state(&self, ha: &HitAware<'_>, h: Slot) -> Option<BlockId> {
        Self::still_keyed(ha, *self.last_keyed.get(h as usize)?)
    }

    /// The tokens the furthest state `h` keyed covers (0: none keyed yet).
    fn furthest_keyed(&self, h: Slot) -> u32 {
        self.last_keyed.get(h as usize).map_or(0, |x| x.2)
    }

    /// The junction `h`'s last lookup found shared (0: none).
    fn junction(&self, h: Slot) -> u32 {
        self.junction.get(h as usize).copied().unwrap_or(0)
    }

    /// Mamba "align": a state block `h` has passed (it keyed a later state) goes to
    /// [`LEVEL_SPECULATIVE`]: a request re-sending this sequence resumes from the later
    /// state (a chat's next turn does), so the earlier one only uses memory nothing else
    /// wants. A state at the shared-prefix boundary `h` reported is where other requests
    /// branch off: it is marked a branch point ([`HitAware::mark_branch`]) and keeps its
    /// level, as does every branch point passed later, a block another request holds, and
    /// a pinned block. O(1).
    fn demote_passed_state(&self, ha: &mut HitAware<'_>, h: Slot, b: BlockId) {
        if b == NULL_BLOCK || ha.key_of(b).is_none() {
            return;
        }
        if ha.hash_tokens(b) == self.junction(h) {
            ha.mark_branch(b);
            if ha.level(b) == LEVEL_SPECULATIVE {
                // A state passed before (a hit's end that turned out shared): a branch point
                // now, kept as one.
                ha.set_level(b, LEVEL_NORMAL);
            }
        }
        let lvl = ha.level(b);
        if lvl == LEVEL_SPECULATIVE || lvl >= LEVEL_PINNED || ha.ref_cnt(b) > 1 || ha.is_branch(b) {
            return;
        }
        // Not passed yet: the furthest state `h` keyed (vLLM frees it once the step after it
        // is processed, while a prompt or a decode without a later boundary goes on). It is
        // demoted when `h` keys a later one (`states_keyed`).
        if ha.hash_tokens(b) >= self.furthest_keyed(h) {
            return;
        }
        ha.set_level(b, LEVEL_SPECULATIVE);
    }

    // --- The hooks Mamba "align" calls (`manager/mamba.rs`), no-ops under `exact` ---

    /// Hook of align's `remove_skipped_blocks`: `h` passes the state blocks `blocks`, about
    /// to be freed ([`Self::demote_passed_state`]). O(blocks).
    pub(super) fn states_passed(&self, pool: &mut BlockPool, h: Slot, blocks: &[BlockId]) {
        if let Some(mut ha) = pool.hit_aware() {
            for &b in blocks {
                self.demote_passed_state(&mut ha, h, b);
            }
        }
    }

    /// Hook of align's `cache_blocks`, once `h`'s states of this step are keyed (`table` is
    /// its table in group `g`): the group caches states (a hit unit holds one in it); the
    /// furthest keyed state becomes the dominant one, above the speculative level while its
    /// request runs (vLLM's mask may skip it), and the previous dominant one is passed now
    /// (demoted unless another request holds it). O(1).
    pub(super) fn states_keyed(&mut self, pool: &mut BlockPool, g: GroupId, h: Slot, table: &[BlockId]) {
        let Some(mut ha) = pool.hit_aware() else { return };
        ha.note_state_group(g);
        // The few real blocks at the table's end (running state, previous state,
        // checkpoint, speculative scratch): the furthest keyed one dominates.
        let last = &mut self.last_keyed[h as usize];
        let prev = *last;
        for &b in table.iter().rev().filter(|&&b| b != NULL_BLOCK).take(4) {
            let t = ha.hash_tokens(b);
            if t > last.2 {
                if let Some(key) = ha.key_of(b) {
                    *last = (b, Some(*key), t);
                }
            }
        }
        let now = *last;
        // The new furthest state is where a re-sent sequence resumes: above the
        // speculative level (vLLM's mask may skip it) while its request runs.
        if now.2 > prev.2 && ha.level(now.0) < LEVEL_NEAR {
            ha.set_level(now.0, LEVEL_NEAR);
        }
        // The previous furthest state is passed now (it was kept while it was the
        // furthest): demoted unless another request holds it.
        let passed = if now.2 > prev.2 { Self::still_keyed(&ha, prev) } else { None };
        if let Some(b) = passed {
            let held = table.contains(&b) as u32;
            if ha.ref_cnt(b) <= held {
                self.demote_passed_state(&mut ha, h, b);
            }
        }
    }

    /// Hook of align's copy-on-write of a running request's partial tail: the key on
    /// `source` moved to `copy`, and with it the furthest state `h` keyed. O(1).
    pub(super) fn state_moved(&mut self, h: Slot, source: BlockId, copy: BlockId) {
        if let Some(last) = self.last_keyed.get_mut(h as usize) {
            if last.0 == source {
                last.0 = copy;
            }
        }
    }

    /// Hook of align's prompt-tail caching: whether the state at `num_tokens` is keyed as
    /// the junction the scheduler stopped at (vLLM's `shared_prefix_checkpoint`, which the
    /// hit-aware policy turns on with partial hash hits: a Mamba block over the hash block
    /// `hbs`), a shared prefix's end within the prompt. False under `exact`.
    pub(super) fn keys_junction_state(
        pool: &BlockPool,
        block_size: u32,
        hbs: u32,
        num_tokens: u32,
        c: &super::CacheArgs<'_>,
    ) -> bool {
        pool.is_leveled()
            && hbs < block_size
            && num_tokens == c.shared_prefix_boundary
            && num_tokens <= c.num_prompt_tokens
    }
}

impl SingleTypeManager {
    /// Contiguous cached blocks a hit in this group needs at its end (`None`: the group
    /// needs the whole prefix, or never hits).
    pub(crate) fn hit_tail_blocks(&self) -> Option<u32> {
        super::with_rules!(self.spec.kind, r => r.hit_tail_blocks(self.spec.block_size))
    }

    /// Hit-aware, Mamba "align": records the junction `h`'s lookup found shared with another
    /// request or pinned (0: none; not a first-sighting guess), where other requests branch
    /// off. Nothing for other groups.
    pub(crate) fn set_align_junction(&mut self, h: Slot, pos: u32) {
        if let Some(j) = self.retention.junction.get_mut(h as usize) {
            *j = pos;
        }
    }

    /// Hit-aware: raises the retention level of the window tail ending at `h`'s last cached
    /// block (where a request re-sending this sequence resumes) to at least `lvl`, and of
    /// every other cached block of the table to at least `floor`.
    pub(crate) fn promote_for_free(&self, ha: &mut HitAware<'_>, h: Slot, lvl: Level, floor: Level) {
        let table = &self.req_blocks[h as usize];
        let mut end = (self.num_cached(h) as usize).min(table.len());
        // Partial hash hits: the block past the cached ones may hold the prompt's partial
        // tail (a key inside the block), where the next request re-sending the prompt hits.
        if self.hash_block_size < self.spec.block_size
            && end < table.len()
            && table[end] != NULL_BLOCK
            && ha.key_of(table[end]).is_some()
        {
            end += 1;
        }
        if self.retention.states {
            // The furthest state the request keyed is where the next turn resumes; the
            // earlier states it holds are passed (see `demote_passed_state`).
            let dominant = self.retention.dominant_state(ha, h);
            for &b in &table[..end] {
                if Some(b) != dominant {
                    self.retention.demote_passed_state(ha, h, b);
                }
            }
            if let Some(b) = dominant {
                if ha.level(b) < lvl {
                    ha.set_level(b, lvl);
                }
            }
            return;
        }
        let tail = self.hit_tail_blocks().map_or(end, |n| n as usize);
        for (i, &b) in table[..end].iter().enumerate() {
            if b == NULL_BLOCK || ha.key_of(b).is_none() {
                continue;
            }
            let want = if i + tail >= end { lvl } else { floor };
            if ha.level(b) < want {
                ha.set_level(b, want);
            }
        }
        if self.spec.kind.is_full() && !ha.state_groups().is_empty() {
            self.form_hit_units(ha, h, end);
        }
    }

    /// Hit-aware, state-space hybrids, full attention: forms the hit unit `h` leaves behind
    /// ([`crate::policy::HitUnits`]): the furthest position of its cached blocks where a
    /// state is cached in every Mamba group, with the blocks before it. The blocks past that
    /// state that no live unit holds serve no hit (a hit needs a state at or past them): they
    /// are evicted first. Called once the levels of the request's blocks are set, before they
    /// are freed. O(`end` x state groups).
    fn form_hit_units(&self, ha: &mut HitAware<'_>, h: Slot, end: usize) {
        let table = &self.req_blocks[h as usize];
        let mut furthest = 0;
        for i in (1..=end).rev() {
            // The null block is never keyed.
            let Some(&key) = ha.key_of(table[i - 1]) else { continue };
            let states = ha.state_set(&key.0);
            if !states.is_empty() {
                furthest = i;
                ha.form_unit(&states, &table[..i]);
                break;
            }
        }
        for &b in &table[furthest..end] {
            if b != NULL_BLOCK && ha.key_of(b).is_some() && ha.unit_support(b) == 0 && ha.ref_cnt(b) <= 1 {
                ha.evict_first(b);
            }
        }
    }

    /// Hit-aware: the cached blocks of `h` that are not the block a lookup of their key finds
    /// (a copy of a prefix cached before, recomputed because no state served it) go to
    /// [`LEVEL_SPECULATIVE`]: no hit can use them while the other copy is cached (a pinned
    /// key's block still goes back at the pinned level). O(table).
    pub(crate) fn demote_duplicates(&self, ha: &mut HitAware<'_>, h: Slot) {
        for &b in &self.req_blocks[h as usize] {
            let Some(&key) = (b != NULL_BLOCK).then(|| ha.key_of(b)).flatten() else { continue };
            if ha.level(b) != LEVEL_SPECULATIVE && ha.keyed_block(&key) != Some(b) {
                ha.set_level(b, LEVEL_SPECULATIVE);
            }
        }
    }

    /// Hit-aware, state-space hybrids: the blocks `h` cached past its adopted hit of
    /// `hit_tokens` (its furthest state included) that only it holds and that sit at
    /// [`LEVEL_NORMAL`] go to [`LEVEL_PROBATION`] (see the level). Pinned blocks, blocks
    /// another request holds and blocks served in a hit since they were cached keep their level.
    pub(crate) fn demote_unproven(&self, ha: &mut HitAware<'_>, h: Slot, hit_tokens: u32) {
        let bs = self.spec.block_size as u64;
        let from = (hit_tokens as u64).div_ceil(bs) as usize;
        let table = &self.req_blocks[h as usize];
        let demote = |ha: &mut HitAware<'_>, b: BlockId| {
            if b != NULL_BLOCK
                && ha.key_of(b).is_some()
                && ha.level(b) == LEVEL_NORMAL
                && ha.ref_cnt(b) <= 1
                && !ha.reused(b)
                && ha.hash_tokens(b) > hit_tokens
            {
                ha.set_level(b, LEVEL_PROBATION);
            }
        };
        for &b in table.iter().skip(from) {
            demote(ha, b);
        }
        if self.retention.states {
            if let Some(b) = self.retention.dominant_state(ha, h) {
                demote(ha, b);
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
    pub(crate) fn promote_hit(&self, ha: &mut HitAware<'_>, h: Slot) {
        let own = self.retention.states && self.retention.junction(h) == 0;
        for &b in &self.req_blocks[h as usize] {
            if b == NULL_BLOCK {
                continue;
            }
            let lvl = ha.level(b);
            let want = if !own || (lvl == LEVEL_NORMAL && ha.is_branch(b)) {
                LEVEL_NORMAL
            } else if lvl == LEVEL_PROBATION || lvl == LEVEL_RESUMED {
                LEVEL_RESUMED
            } else {
                LEVEL_NEAR
            };
            if lvl < want || (own && lvl != want && lvl <= LEVEL_NORMAL) {
                ha.set_level(b, want);
            }
        }
    }

    /// Appends `(position, group, block)` for every non-null block of `h`'s table
    /// (hit-aware free order).
    pub(crate) fn positioned_blocks(&self, h: Slot, out: &mut Vec<(u64, GroupId, BlockId)>) {
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
        ha: &mut HitAware<'_>,
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
                ha.set_level(table[i as usize], if near { LEVEL_NEAR } else { LEVEL_SPECULATIVE });
            }
        }
    }
}
