//! KV hints' state and mechanics (issue 38; rule 9 of [`crate::policy`]): the *holds* an
//! application's hints leave on the pool, each until its TTL on the manager's clock or its
//! session's release.
//!
//! - A *lease* (a pin lease) holds hash keys through a *lease set*: leases on the same keys
//!   as the last lease taken, while a lease of that one's set still runs (every request pinning
//!   one shared system prompt), share its set, which counts them. Each key counts the lease
//!   sets naming it in `Retention::pinned_keys` (a key's pin reads only whether that count is
//!   0, which counting sets instead of leases leaves as it was), so a lease that joins a live
//!   set, and one that leaves it while another still runs, touch no key. The block a lookup
//!   finds under a leased key is freed at [`LEVEL_LEASED`]. A lease whose new keys would take
//!   the pinned keys past the pinned share is refused (counted); it never demotes another
//!   lease.
//! - A *retain* holds blocks at a level it chose, each in the key life it found it in
//!   (`Retention::keygen`, which the block's loss of its key moves on): each block counts
//!   the running retains holding it (`Retention::held`, reset when it loses its key), and a
//!   held block is marked (`FLAG_HELD`) so the policy's own demotions of a lost hit unit pass
//!   it by. Counting by block, not by key, costs no hash per block at a free or an expiry.
//! - The clock ([`HitAware::advance_clock`], at most once per scheduler step) ends the holds
//!   due, through a min-heap by expiry; a block still under the key a hold recorded, at the
//!   level the hold set, and held by nothing else, goes back to [`LEVEL_NORMAL`]; a block
//!   that lost its key since the hold took it is no longer the hold's.
//! - A session's release ([`HitAware::release_session`]) ends its holds at once and moves
//!   their blocks to the front of [`LEVEL_SPECULATIVE`] (evicted first), except a block
//!   something else still holds (a lease, a pin, another retain), a branch point, or a
//!   full-attention block more than one live hit unit needs (a prefix other sessions share).
//!
//! Invariants: a live hold is in the heap once under its generation (entries of ended holds
//! are skipped, and never left at the top); a hold with a session is in that session's list
//! at `sess_pos`; a lease set's `leases` counts the live leases naming it, and a set is in
//! use exactly while that is above 0 (its keys' counts include it then); `meta[b].held` counts
//! the live retains whose recorded key life of `b` is its current one, and `FLAG_HELD` is set
//! exactly where it is not 0; `stats`' gauges equal what the holds hold.
//!
//! Cost: a lease O(keys) to compare its keys with the last lease's, and no hashing when it
//! joins that one's live set; else O(keys) hashed (plus O(keys log keys) to sort them, unless
//! they are the last lease's); a retain O(blocks); the clock O(1) when nothing is due, else
//! O(log holds) per hold ended, plus O(keys) for the last lease of a set and O(blocks) for a
//! retain; a release O(keys of the session's holds). Memory: a lease set's keys (40 bytes
//! each) and a retain's blocks until they end, and the last lease's keys as given.
#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use super::retention::{sort_keys, HitAware, FLAG_HELD};
use super::{Level, LEVEL_LEASED, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_SPECULATIVE};
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::prefix_index::HashKey;

/// The longest TTL a hint may ask for: 7 days, in milliseconds.
pub const MAX_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// The KV hints' counters (totals since the allocator was built) and gauges (now).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HintStats {
    /// Requests whose hints were set.
    pub requests: u64,
    /// Pin leases taken.
    pub leases_applied: u64,
    /// Pin leases refused: their new keys would take the pinned keys past the pinned share.
    pub leases_refused_over_cap: u64,
    /// Pin leases ended at their TTL.
    pub leases_expired: u64,
    /// Pin leases ended by their session's release.
    pub leases_released: u64,
    /// Retains applied (when their request was freed).
    pub retains_applied: u64,
    /// Retains ended at their TTL.
    pub retains_expired: u64,
    /// Retains ended by their session's release.
    pub retains_released: u64,
    /// Session releases made.
    pub sessions_released: u64,
    /// Checkpoint positions taken.
    pub checkpoints_applied: u64,
    /// Checkpoint positions refused (0 once rounded down to the hit alignment).
    pub checkpoints_refused: u64,
    /// States cached at a checkpoint and marked a branch point.
    pub checkpoint_states: u64,
    /// Gauge: hash keys under a running lease.
    pub leased_keys: u64,
    /// Gauge: free cached blocks at the leased level (what the leases keep).
    pub leased_free_blocks: u64,
    /// Gauge: blocks the running retains hold (as recorded when they were applied).
    pub retained_blocks: u64,
    /// Gauge: Mamba state blocks among `retained_blocks`.
    pub retained_states: u64,
    /// Gauge: leases and retains running.
    pub live_holds: u64,
}

impl HintStats {
    /// Every counter and gauge with its field's name, in declaration order.
    pub fn named(&self) -> [(&'static str, u64); 17] {
        [
            ("requests", self.requests),
            ("leases_applied", self.leases_applied),
            ("leases_refused_over_cap", self.leases_refused_over_cap),
            ("leases_expired", self.leases_expired),
            ("leases_released", self.leases_released),
            ("retains_applied", self.retains_applied),
            ("retains_expired", self.retains_expired),
            ("retains_released", self.retains_released),
            ("sessions_released", self.sessions_released),
            ("checkpoints_applied", self.checkpoints_applied),
            ("checkpoints_refused", self.checkpoints_refused),
            ("checkpoint_states", self.checkpoint_states),
            ("leased_keys", self.leased_keys),
            ("leased_free_blocks", self.leased_free_blocks),
            ("retained_blocks", self.retained_blocks),
            ("retained_states", self.retained_states),
            ("live_holds", self.live_holds),
        ]
    }
}

/// One lease or retain.
#[derive(Clone, Debug, Default)]
struct Hold {
    /// Generation of the hold in this slot; 0 while the slot is free.
    gen: u32,
    /// A lease (else a retain).
    lease: bool,
    /// A retain's level ([`LEVEL_LEASED`] for a lease).
    level: Level,
    /// Its session (0: none).
    session: u64,
    /// Its index in its session's list.
    sess_pos: u32,
    /// A lease's set (an index into `Holds::sets`); 0 for a retain.
    set: u32,
    /// A retain's blocks; empty for a lease.
    blocks: Vec<BlockId>,
    /// The key life of each of `blocks` when the retain took it (`Retention::keygen`).
    gens: Vec<u32>,
    /// State blocks among `blocks`.
    states: u32,
}

/// The keys of one or more running leases (see the module docs).
#[derive(Clone, Debug, Default)]
struct LeaseSet {
    /// The keys, sorted and without repeats (`sort_keys`).
    keys: Vec<HashKey>,
    /// Live leases naming this set (0: the slot is free).
    leases: u32,
}

/// The holds of a pool (see the module docs), kept in the policy's state.
#[derive(Clone, Debug, Default)]
pub(crate) struct Holds {
    /// The latest time [`HitAware::advance_clock`] was given, in milliseconds.
    now_ms: u64,
    /// Slab of holds; `free` lists the slots not in use.
    slots: Vec<Hold>,
    free: Vec<u32>,
    /// The last generation handed out (generations start at 1).
    last_gen: u32,
    /// `(expiry, slot, generation)` of every live hold, and of ended ones below the top.
    heap: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// Session -> its live holds' slots.
    sessions: FxHashMap<u64, Vec<u32>>,
    /// The counters and gauges (`leased_free_blocks` is read from the retention state).
    stats: HintStats,
    /// Slab of lease sets; `free_sets` lists the slots not in use.
    sets: Vec<LeaseSet>,
    free_sets: Vec<u32>,
    /// The last lease's keys as given, and its set (`None`: no lease yet, or that set
    /// ended): a lease on the same keys (a shared prompt every request pins) joins that set
    /// while it is live, without sorting or hashing a key.
    last_lease: (Vec<HashKey>, Option<u32>),
}

impl Holds {
    /// The counters and gauges; `leased_free` is the pool's count of free leased blocks.
    pub(crate) fn stats(&self, leased_free: u32) -> HintStats {
        HintStats { leased_free_blocks: leased_free as u64, live_holds: self.num_holds() as u64, ..self.stats }
    }

    /// The counters, to count what the coordinator decides (requests, checkpoints).
    pub(crate) fn stats_mut(&mut self) -> &mut HintStats {
        &mut self.stats
    }

    /// The clock's latest time, in milliseconds.
    pub(crate) fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// When the next hold ends (`None`: no hold runs).
    pub(crate) fn next_expiry(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Live holds.
    pub(crate) fn num_holds(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The expiry of a hold taken at `now_ms` (or the clock's time, if later) for `ttl_ms`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a TTL of 0 or above [`MAX_TTL_MS`], or an expiry past
    /// `u64::MAX`.
    pub(crate) fn expiry(&self, now_ms: u64, ttl_ms: u64) -> Result<u64> {
        if ttl_ms == 0 || ttl_ms > MAX_TTL_MS {
            return Err(Error::OutOfRange(format!("a hint's TTL of {ttl_ms} ms is outside 1..={MAX_TTL_MS}")));
        }
        now_ms
            .max(self.now_ms)
            .checked_add(ttl_ms)
            .ok_or_else(|| Error::OutOfRange(format!("now_ms={now_ms} + ttl_ms={ttl_ms} overflows")))
    }

    /// Stores a new hold; returns its slot.
    fn insert(&mut self, mut hold: Hold, expiry_ms: u64) -> u32 {
        self.last_gen = self.last_gen.checked_add(1).unwrap_or(1);
        hold.gen = self.last_gen;
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Hold::default());
                (self.slots.len() - 1) as u32
            }
        };
        if hold.session != 0 {
            let list = self.sessions.entry(hold.session).or_default();
            hold.sess_pos = list.len() as u32;
            list.push(s);
        }
        self.heap.push(Reverse((expiry_ms, s, hold.gen)));
        self.slots[s as usize] = hold;
        s
    }

    /// Takes slot `s`'s hold out of the slab and of its session's list (its heap entry
    /// becomes stale).
    fn remove(&mut self, s: u32) -> Hold {
        let hold = std::mem::take(&mut self.slots[s as usize]);
        self.free.push(s);
        if hold.session != 0 {
            if let Some(list) = self.sessions.get_mut(&hold.session) {
                let pos = hold.sess_pos as usize;
                list.swap_remove(pos);
                if let Some(&moved) = list.get(pos) {
                    self.slots[moved as usize].sess_pos = pos as u32;
                }
                if list.is_empty() {
                    self.sessions.remove(&hold.session);
                }
            }
        }
        hold
    }

    /// The set a lease on `keys` joins: `(set, true)` for the last lease's set when the
    /// keys are the same as it was given and the set is live (its keys counted already);
    /// else `(set, false)` for a new set of `keys` sorted and without repeats (`sort_keys`),
    /// with no lease yet, now the last lease's: the caller counts its keys in, or drops it
    /// ([`Self::drop_set`]). O(keys) to compare, plus O(keys log keys) to sort a new set.
    fn lease_set(&mut self, mut keys: Vec<HashKey>) -> (u32, bool) {
        let (given, last) = &mut self.last_lease;
        let same = keys == *given;
        if let (true, Some(set)) = (same, *last) {
            return (set, true);
        }
        if !same {
            given.clone_from(&keys);
        }
        sort_keys(&mut keys);
        let set = LeaseSet { keys, leases: 0 };
        let i = match self.free_sets.pop() {
            Some(i) => {
                self.sets[i as usize] = set;
                i
            }
            None => {
                self.sets.push(set);
                (self.sets.len() - 1) as u32
            }
        };
        self.last_lease.1 = Some(i);
        (i, false)
    }

    /// Frees lease set `i` (no lease names it any more), returning its keys.
    fn drop_set(&mut self, i: u32) -> Vec<HashKey> {
        let set = std::mem::take(&mut self.sets[i as usize]);
        self.free_sets.push(i);
        if self.last_lease.1 == Some(i) {
            self.last_lease.1 = None;
        }
        set.keys
    }

    /// Pops the heap's stale entries off its top.
    fn drop_stale_top(&mut self) {
        while let Some(&Reverse((_, s, g))) = self.heap.peek() {
            if self.slots[s as usize].gen == g {
                break;
            }
            self.heap.pop();
        }
    }
}

/// How an ending hold leaves its blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// At its TTL: back to [`LEVEL_NORMAL`].
    Expired,
    /// At its session's release: to the front of [`LEVEL_SPECULATIVE`].
    Released,
}

/// The hints' decisions on the pool, through the policy's handle.
impl super::retention::Retention {
    /// Invariant checks of the holds' counts (see the module docs): a lease set's `leases`
    /// is the number of live leases naming it, a pinned key's `leases` the number of live
    /// sets naming it; `meta[b].held` is the number of live retains whose recorded key life of
    /// `b` is its current one, and `FLAG_HELD` is set exactly where it is not 0.
    /// O(blocks + held blocks + lease sets' keys).
    pub(crate) fn check_holds(&self) -> std::result::Result<(), String> {
        let mut want = vec![0u32; self.meta.len()];
        for hold in &self.holds.slots {
            if hold.gen == 0 || hold.lease {
                continue;
            }
            for (&b, &gen) in hold.blocks.iter().zip(&hold.gens) {
                if self.meta[b as usize].keygen == gen {
                    want[b as usize] += 1;
                }
            }
        }
        // Lease sets: each counts the live leases naming it; each key the live sets naming it.
        let mut leases = vec![0u32; self.holds.sets.len()];
        for hold in self.holds.slots.iter().filter(|h| h.gen != 0 && h.lease) {
            leases[hold.set as usize] += 1;
        }
        let mut sets_of: FxHashMap<HashKey, u32> = FxHashMap::default();
        for (i, (set, &n)) in self.holds.sets.iter().zip(&leases).enumerate() {
            if set.leases != n {
                return Err(format!("lease set {i}: {n} live leases name it, counted {}", set.leases));
            }
            if n > 0 {
                for k in &set.keys {
                    *sets_of.entry(*k).or_default() += 1;
                }
            }
        }
        for (k, p) in &self.pinned_keys {
            let n = sets_of.remove(k).unwrap_or(0);
            if p.leases != n {
                return Err(format!("key {k:?}: in {n} live lease sets, counted {}", p.leases));
            }
        }
        if let Some((k, n)) = sets_of.into_iter().next() {
            return Err(format!("key {k:?}: in {n} live lease sets, not pinned"));
        }
        for (b, (&w, h)) in want.iter().zip(self.meta.iter().map(|m| m.held)).enumerate() {
            if w != h {
                return Err(format!("block {b}: held by {w} live retains, counted {h}"));
            }
            if (self.meta[b].flags & FLAG_HELD != 0) != (h > 0) {
                return Err(format!("block {b}: held {h} times, flag {}", self.meta[b].flags & FLAG_HELD != 0));
            }
        }
        Ok(())
    }
}

impl HitAware<'_> {
    /// The KV hints' counters, to count what the coordinator decides.
    pub(crate) fn hint_stats_mut(&mut self) -> &mut HintStats {
        self.r.holds.stats_mut()
    }

    /// A pin lease on `keys` (a request's prefix: see `Allocator::set_hints`) for `session`
    /// (0: none) until `expiry_ms`: the block a lookup finds under each key moves to
    /// [`LEVEL_LEASED`] now (or when freed), the key counted under a lease until the lease
    /// ends. Returns false, changing nothing but the counter, when the keys not pinned yet
    /// would take the pinned keys past the pinned share. A lease on the last lease's keys
    /// while its set is live joins that set: O(keys) to compare, no key hashed (every key of
    /// a live set is leased already, so none is new). Else O(keys log keys); O(keys) for the
    /// last lease's keys again.
    pub(crate) fn lease(&mut self, keys: Vec<HashKey>, session: u64, expiry_ms: u64) -> bool {
        let (set, live) = self.r.holds.lease_set(keys);
        if live {
            // Its keys are all pinned (leased): none is new.
            if self.r.pinned_keys.len() as u64 > self.r.pinned_cap() as u64 {
                self.r.holds.stats.leases_refused_over_cap += 1;
                return false;
            }
        } else {
            let keys = &self.r.holds.sets[set as usize].keys;
            let new = keys.iter().filter(|k| !self.r.pinned_keys.contains_key(k)).count() as u64;
            if self.r.pinned_keys.len() as u64 + new > self.r.pinned_cap() as u64 {
                self.r.holds.drop_set(set);
                self.r.holds.stats.leases_refused_over_cap += 1;
                return false;
            }
            let keys = std::mem::take(&mut self.r.holds.sets[set as usize].keys);
            for k in &keys {
                let p = self.r.pin_entry(*k);
                p.leases += 1;
                if p.leases == 1 {
                    self.r.holds.stats.leased_keys += 1;
                    if let Some(b) = self.p.index.get_one(k) {
                        self.set_level(b, LEVEL_LEASED);
                    }
                }
            }
            self.r.holds.sets[set as usize].keys = keys;
        }
        self.r.holds.sets[set as usize].leases += 1;
        let hold = Hold { lease: true, level: LEVEL_LEASED, session, set, ..Hold::default() };
        self.r.holds.insert(hold, expiry_ms);
        self.r.holds.stats.leases_applied += 1;
        true
    }

    /// A retain of `blocks` (each one cached: an unkeyed one is passed by) at `level` for
    /// `session` (0: none) until `expiry_ms`: each block gets `level` (a pinned one within
    /// the pinned share: past it the oldest pinned blocks are demoted, as for any pinned
    /// block; a leased key's block stays leased) and is marked held, in the key life it is
    /// in now. O(blocks).
    pub(crate) fn retain(&mut self, blocks: &[BlockId], level: Level, session: u64, expiry_ms: u64) {
        let mut hold = Hold {
            level,
            session,
            blocks: Vec::with_capacity(blocks.len()),
            gens: Vec::with_capacity(blocks.len()),
            ..Hold::default()
        };
        for &b in blocks {
            let Some(&(_, group)) = self.p.index.key_of(b) else { continue };
            self.set_level(b, level);
            let i = b as usize;
            self.r.meta[i].flags |= FLAG_HELD;
            self.r.meta[i].held += 1;
            hold.states += u32::from(self.r.state_groups().contains(&group));
            hold.blocks.push(b);
            hold.gens.push(self.r.meta[i].keygen);
        }
        let st = &mut self.r.holds.stats;
        st.retains_applied += 1;
        st.retained_blocks += hold.blocks.len() as u64;
        st.retained_states += hold.states as u64;
        self.r.holds.insert(hold, expiry_ms);
    }

    /// The clock reads `now_ms` (a time earlier than the last one is taken as the last):
    /// every hold due by then ends, and its blocks go back to [`LEVEL_NORMAL`] (see the
    /// module docs). Returns the holds ended. O(1) when none is due, else O(log holds +
    /// keys) per hold ended.
    pub(crate) fn advance_clock(&mut self, now_ms: u64) -> u32 {
        let holds = &mut self.r.holds;
        holds.now_ms = holds.now_ms.max(now_ms);
        let mut ended = 0;
        loop {
            let holds = &mut self.r.holds;
            holds.drop_stale_top();
            match holds.heap.peek() {
                Some(&Reverse((t, s, _))) if t <= holds.now_ms => {
                    holds.heap.pop();
                    let hold = holds.remove(s);
                    self.end_hold(hold, End::Expired);
                    ended += 1;
                }
                _ => break,
            }
        }
        ended
    }

    /// Ends every hold of `session` at once (its release): their blocks go to the front of
    /// [`LEVEL_SPECULATIVE`] unless something else holds them (see the module docs).
    /// Returns the holds ended. O(keys of the session's holds).
    pub(crate) fn release_session(&mut self, session: u64) -> u32 {
        self.r.holds.stats.sessions_released += 1;
        let Some(list) = self.r.holds.sessions.remove(&session) else { return 0 };
        let n = list.len() as u32;
        for s in list {
            // Out of its session already: `remove` finds no list to take it from.
            let hold = self.r.holds.remove(s);
            self.end_hold(hold, End::Released);
        }
        self.r.holds.drop_stale_top();
        n
    }

    /// Ends one hold (already out of the slab), leaving its blocks as `end` says.
    fn end_hold(&mut self, hold: Hold, end: End) {
        let st = &mut self.r.holds.stats;
        match (hold.lease, end) {
            (true, End::Expired) => st.leases_expired += 1,
            (true, End::Released) => st.leases_released += 1,
            (false, End::Expired) => st.retains_expired += 1,
            (false, End::Released) => st.retains_released += 1,
        }
        if hold.lease {
            let set = &mut self.r.holds.sets[hold.set as usize];
            set.leases -= 1;
            if set.leases > 0 {
                // Another lease on the same keys runs on: every key stays leased.
                return;
            }
            let keys = self.r.holds.drop_set(hold.set);
            for key in &keys {
                // One hash of the key: the count, its removal, and what `leave` would read.
                let Entry::Occupied(mut p) = self.r.pinned_keys.entry(*key) else { continue };
                p.get_mut().leases -= 1;
                if p.get().leases > 0 {
                    continue;
                }
                self.r.holds.stats.leased_keys -= 1;
                let permanent = p.get().permanent;
                if !permanent {
                    p.remove();
                    self.r.pin_filter.remove(key);
                }
                if let Some(b) = self.p.index.get_one(key) {
                    if self.r.level(b) == LEVEL_LEASED {
                        // `leave`, knowing the key's pin: a permanent one with no lease left
                        // (back to the pinned level), else none.
                        if permanent {
                            self.set_level(b, LEVEL_PINNED);
                        } else {
                            self.leave_unpinned(b, end);
                        }
                    }
                }
            }
            return;
        }
        let st = &mut self.r.holds.stats;
        st.retained_blocks -= hold.blocks.len() as u64;
        st.retained_states -= hold.states as u64;
        for (&b, &gen) in hold.blocks.iter().zip(&hold.gens) {
            let i = b as usize;
            if self.r.meta[i].keygen != gen {
                continue; // it lost the key it was held under: its count was reset then
            }
            self.r.meta[i].held -= 1;
            if self.r.meta[i].held > 0 {
                continue;
            }
            self.r.meta[i].flags &= !FLAG_HELD;
            if end == End::Released || self.r.level(b) == hold.level {
                // Same key life: the key it was held under (read through the index's own
                // reference, not copied).
                let index = self.p.index;
                let Some(key) = index.key_of(b) else { continue };
                self.leave(b, key, end);
            }
        }
    }

    /// Block `b`, under `key`, held by an ending hold and by no other hold of its kind:
    /// back to [`LEVEL_NORMAL`] at a TTL; to the front of [`LEVEL_SPECULATIVE`] at a
    /// release, unless a branch point or a shared prefix (more than one live hit unit)
    /// still needs it. A block still pinned (a permanent pin, another lease) or held by
    /// another retain only leaves the leased level. O(1).
    fn leave(&mut self, b: BlockId, key: &HashKey, end: End) {
        if let Some(p) = self.r.pinned(key) {
            if p.leases == 0 && self.r.level(b) == LEVEL_LEASED {
                self.set_level(b, LEVEL_PINNED);
            }
            return;
        }
        self.leave_unpinned(b, end);
    }

    /// [`Self::leave`] of a block whose key no pin or lease names (the caller looked: the
    /// level is set without looking again, `set_level_unpinned`). O(1).
    fn leave_unpinned(&mut self, b: BlockId, end: End) {
        let lvl = self.r.level(b);
        if self.r.is_held(b) {
            if lvl == LEVEL_LEASED {
                self.set_level_unpinned(b, LEVEL_NORMAL);
            }
            return;
        }
        match end {
            End::Expired => {
                if lvl != LEVEL_NORMAL {
                    self.set_level_unpinned(b, LEVEL_NORMAL);
                }
            }
            End::Released if self.r.is_branch(b) || self.r.unit_support(b) > 1 => {
                // A shared prefix's block: it leaves the hold's level only.
                if lvl >= LEVEL_PINNED {
                    self.set_level_unpinned(b, LEVEL_NORMAL);
                }
            }
            End::Released => self.demote_front(b, LEVEL_SPECULATIVE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockHash;

    #[test]
    fn lease_set_same_keys_while_live_joins_the_set() {
        let keys =
            |xs: &[u64]| -> Vec<HashKey> { xs.iter().map(|&x| (BlockHash::from_u64(x), (x % 2) as u32)).collect() };
        let sorted = |mut k: Vec<HashKey>| {
            sort_keys(&mut k);
            k
        };
        let mut holds = Holds::default();
        // No lease yet: even no keys (equal to the empty "last keys") make a new set.
        let (s0, live) = holds.lease_set(Vec::new());
        assert!(!live);
        assert_eq!(holds.drop_set(s0), Vec::new());
        let a = [5, 3, 9, 3, 1];
        let (s1, live) = holds.lease_set(keys(&a));
        assert!(!live);
        assert_eq!(holds.sets[s1 as usize].keys, sorted(keys(&a)));
        holds.sets[s1 as usize].leases += 1;
        // The same keys while the set is live: joined.
        assert_eq!(holds.lease_set(keys(&a)), (s1, true));
        // Other keys: a set of their own; the first one is no longer the last.
        let (s2, live) = holds.lease_set(keys(&[2, 8]));
        assert!(!live && s2 != s1);
        assert_eq!(holds.sets[s2 as usize].keys, sorted(keys(&[2, 8])));
        holds.sets[s2 as usize].leases += 1;
        let (s3, live) = holds.lease_set(keys(&a));
        assert!(!live && s3 != s1 && s3 != s2);
        holds.sets[s3 as usize].leases += 1;
        // The last set ended: the same keys again make a new set, sorted.
        assert_eq!(holds.drop_set(s3), sorted(keys(&a)));
        let (s4, live) = holds.lease_set(keys(&a));
        assert!(!live);
        assert_eq!(holds.sets[s4 as usize].keys, sorted(keys(&a)));
        let (s5, live) = holds.lease_set(Vec::new());
        assert!(!live);
        assert!(holds.sets[s5 as usize].keys.is_empty());
    }
}
