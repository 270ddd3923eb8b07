//! Retention policies: which cached blocks stay in the prefix cache and in what order free
//! cached blocks are evicted.
//!
//! - [`Policy::Exact`] (the default) is vLLM's: sliding-window groups cache only the blocks
//!   their retention mask keeps (`prefix_cache_retention_interval`), and free cached blocks
//!   are evicted in one LRU order, whatever their group.
//! - [`Policy::HitAware`] keeps every prefix the full-attention group can serve servable by
//!   the window groups too, without letting window blocks push full-attention prefixes out:
//!   1. *Dense, tiered window caching.* A window group hashes every full block, but the
//!      blocks vLLM's mask would skip are cached at [`LEVEL_SPECULATIVE`]: the free queue
//!      hands out every free speculative block before any block at [`LEVEL_NORMAL`]. So they
//!      only ever use memory nothing else wants (with `exact` those blocks would be
//!      unhashed and free anyway): they cannot flood the LRU as dense retention (`None`)
//!      does. Those within one window before a boundary's tail go to [`LEVEL_NEAR`],
//!      evicted after the other speculative blocks: a prefix shared up to a little before a
//!      prompt's end stays servable longest.
//!   2. *The window tail where the next turn resumes.* When a request ends (`free`), the
//!      window tail ending at its last cached block (its whole sequence: prompt and reply)
//!      is promoted to [`LEVEL_NORMAL`], so a chat's next turn, which re-sends the
//!      conversation, hits all of it instead of resuming at the previous prompt's end.
//!   3. *A junction the first time it is used.* When a request adopts a hit, the window
//!      blocks of the hit (the tail that made it servable) are promoted to
//!      [`LEVEL_NORMAL`]: a shared prefix found by a second request through speculative
//!      blocks stays as well kept as the full-attention prefix it completes.
//!   4. *Hit units evicted together.* A request's blocks are freed in token-position order
//!      (tail first) across all groups, not group after group, so the LRU evicts a window
//!      tail together with the full-attention blocks of the same span instead of leaving one
//!      group holding blocks the other can no longer complete.
//!
//!   5. *State-space hybrids (Mamba "align"): only the states a hit resumes from keep their
//!      level.* A state its request has passed (a chat's previous turn, once the next turn
//!      computes on from it; the prompt's tail state, once decode passes the next boundary)
//!      goes to [`LEVEL_SPECULATIVE`] unless it is a branch point (a junction the lookup found
//!      shared with another request, or pinned; a prefix where a finished request's sequence
//!      ended, which a chat's next turn continues, is no junction). A full-attention block
//!      that duplicates the one lookups find for its key (recomputed because no state served
//!      it) is freed speculative. So under pressure the pool holds whole hit units, not
//!      dominated states and unreachable copies.
//!
//!   6. *Hit units (state-space hybrids).* A hit needs a state in every Mamba group and the
//!      full-attention blocks before it: a *unit* ([`HitUnits`]). When a request is freed,
//!      its furthest position where a state is cached in every Mamba group forms a unit with
//!      the full-attention blocks before it; its full-attention blocks past that state serve
//!      no hit and are evicted first. When any member of a unit is evicted, the members no
//!      other live unit needs go to the front of the queue (a state set is useless without
//!      its prefix, and a prefix without a state at or past it), so the pool loses one whole
//!      unit at a time instead of damaging many. A full-attention block where another state
//!      set is cached (a shared prefix's junction) and branch points keep their level.
//!   7. *The running session's unit goes first (state-space hybrids).* A state a request
//!      resumed from in its own conversation (no junction shared with another request, no
//!      pin) waits below every finished unit while the request runs: at [`LEVEL_NEAR`], or at
//!      [`LEVEL_RESUMED`] when it was on probation. Under round-robin chat the running
//!      session comes back last. When the request is freed its furthest state is raised again.
//!
//!   User controls ride on the same levels: blocks of a request freed with a retention
//!   priority and blocks of a pinned prefix go to [`LEVEL_PINNED`] (bounded share of the
//!   pool; see [`crate::Allocator::pin_prefix`]).
//!
//! Correctness does not depend on the policy: blocks are only ever found by their chained
//! hash (the full prefix up to and including the block, in that group), and a block keeps
//! a hash only while it holds the KV of exactly those tokens, so a hit is what recomputation
//! would produce. The policy only changes which hashes are kept and how long; every hash
//! entering the index emits `BlockStored`, every hash leaving it `BlockRemoved`.
//!
//! Cost: the levels add nothing to a decode step; `free` sorts the request's blocks
//! (O(table log table)); promotion is O(window blocks). With Mamba groups, `free` forms a
//! unit (O(table x Mamba groups) lookups) and evicting a block of a unit dissolves it
//! (O(members)).
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::free_queue::try_filled;
use crate::ids::BlockId;
use crate::prefix_index::HashKey;

/// Which blocks stay cached and in what order they are evicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// vLLM's decisions, bit for bit.
    #[default]
    Exact,
    /// Keeps hybrid models' hits (see the module docs).
    HitAware,
}

impl Policy {
    /// Parses `"exact"` or `"hit-aware"` (also `"hit_aware"`), case-insensitive.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the valid values.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" | "" => Ok(Policy::Exact),
            "hit-aware" | "hit_aware" | "hitaware" => Ok(Policy::HitAware),
            other => Err(Error::InvalidConfig(format!("unknown policy {other:?}: use \"exact\" or \"hit-aware\""))),
        }
    }

    /// The name `parse` accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Exact => "exact",
            Policy::HitAware => "hit-aware",
        }
    }
}

/// A free cached block's retention level: lower levels are evicted first.
pub type Level = u8;
/// Window blocks no known boundary needs (the blocks vLLM's mask skips).
pub const LEVEL_SPECULATIVE: Level = 0;
/// Speculative window blocks within one window before a boundary's tail: with them a hit
/// can resume anywhere in the window before the boundary (a shared prefix that ends a little
/// before a prompt's end, as a re-sent context with a new question does).
pub const LEVEL_NEAR: Level = 1;
/// State-space hybrids only: the blocks a finished request computed itself, when its own
/// hit saved less than half its prompt (it has not shown that its conversation comes back).
/// Evicted before [`LEVEL_NORMAL`]: under a cyclic load larger than the cache (round-robin
/// chat sessions) LRU evicts every session just before it returns; with this level the
/// sessions that do hit keep their hit units and the others wait their turn (segmented LRU).
pub const LEVEL_PROBATION: Level = 3;
/// State-space hybrids only: a state on probation that its own conversation's next turn
/// resumed from, while that turn runs (rule 7 above): queued newest first, like probation,
/// and evicted just before it. It served a hit, so it is not on probation; its session comes
/// back last.
pub const LEVEL_RESUMED: Level = 2;
/// Every other cached block (vLLM's single LRU level).
pub const LEVEL_NORMAL: Level = 4;
/// Blocks of a pinned prefix or of a request with a retention priority.
pub const LEVEL_PINNED: Level = 5;
/// Levels of a hit-aware free queue.
pub const NUM_LEVELS: u32 = 6;

/// Hit-aware, state-space hybrids: the *hit units* of the free blocks. A unit is a cached
/// state in every Mamba group at one position and the full-attention blocks before it: a
/// hit needs all of them, and once one is gone the others serve no hit through it. Units
/// are formed when a request is freed (its furthest state, and every branch-point state
/// it holds); when any member loses its hash (evicted), the unit is dissolved and the
/// members no other live unit needs are returned, to be evicted first.
///
/// `support[b]` counts the live units holding full-attention block `b` in their prefix (a
/// shared prefix serves several); `unit_of[b]` is the latest live unit naming `b` (a state,
/// or a prefix block), whose loss dissolves it. Each member is recorded with its key, so a
/// block re-keyed since is skipped.
///
/// Cost: `form` O(members); `dissolve` O(members of the unit); memory O(members of the
/// live units).
#[derive(Clone, Debug, Default)]
pub struct HitUnits {
    /// Live units by id (`None`: a free id, listed in `free_ids`).
    units: Vec<Option<HitUnit>>,
    /// Ids of dissolved units, reused first.
    free_ids: Vec<u32>,
    /// `unit_of[b]`: the latest live unit naming block `b` (`NO_UNIT`: none).
    unit_of: Vec<u32>,
    /// `support[b]`: live units holding block `b` in their prefix.
    support: Vec<u32>,
}

/// One hit unit: its states (one per Mamba group) and the full-attention prefix before them.
#[derive(Clone, Debug)]
struct HitUnit {
    states: Vec<(BlockId, HashKey)>,
    prefix: Vec<(BlockId, HashKey)>,
}

/// No unit.
const NO_UNIT: u32 = u32::MAX;

impl HitUnits {
    /// Bookkeeping for `num_blocks` blocks.
    ///
    /// # Errors
    /// The per-block arrays cannot be allocated.
    pub fn try_new(num_blocks: usize) -> std::result::Result<Self, std::collections::TryReserveError> {
        Ok(Self {
            units: Vec::new(),
            free_ids: Vec::new(),
            unit_of: try_filled(num_blocks, NO_UNIT)?,
            support: try_filled(num_blocks, 0)?,
        })
    }

    /// Live units holding full-attention block `b` in their prefix.
    pub fn support(&self, b: BlockId) -> u32 {
        self.support.get(b as usize).copied().unwrap_or(0)
    }

    /// Whether `b` is in a live unit (a state or a prefix block).
    pub fn in_unit(&self, b: BlockId) -> bool {
        self.unit_of.get(b as usize).is_some_and(|&u| u != NO_UNIT) || self.support(b) > 0
    }

    /// Forms a unit of `states` and `prefix` (each block with its current key). A unit that
    /// already names one of the states is dissolved first, its blocks left where they are
    /// (the new unit takes them over). `holds(m)` says whether member `m` of a unit still
    /// holds the key it was recorded with.
    pub fn form(
        &mut self,
        states: Vec<(BlockId, HashKey)>,
        prefix: Vec<(BlockId, HashKey)>,
        holds: &mut dyn FnMut(&(BlockId, HashKey)) -> bool,
    ) {
        if self.unit_of.is_empty() {
            return;
        }
        for &(b, _) in &states {
            let u = self.unit_of[b as usize];
            if u != NO_UNIT {
                self.dissolve(u, holds, &mut Vec::new());
            }
        }
        let id = self.free_ids.pop().unwrap_or_else(|| {
            self.units.push(None);
            self.units.len() as u32 - 1
        });
        for &(b, _) in &prefix {
            self.support[b as usize] += 1;
            self.unit_of[b as usize] = id;
        }
        for &(b, _) in &states {
            self.unit_of[b as usize] = id;
        }
        self.units[id as usize] = Some(HitUnit { states, prefix });
    }

    /// Block `b` loses its hash: the unit naming it (if any) is dissolved, and every other
    /// member no live unit still needs is appended to `orphans`. `holds(m)` says whether
    /// member `m` still holds the key it was recorded with.
    pub fn lose(&mut self, b: BlockId, holds: &mut dyn FnMut(&(BlockId, HashKey)) -> bool, orphans: &mut Vec<BlockId>) {
        let Some(&u) = self.unit_of.get(b as usize) else { return };
        if u != NO_UNIT {
            self.dissolve(u, holds, orphans);
        }
        self.unit_of[b as usize] = NO_UNIT;
        self.support[b as usize] = 0;
        orphans.retain(|&m| m != b);
    }

    fn dissolve(&mut self, u: u32, holds: &mut dyn FnMut(&(BlockId, HashKey)) -> bool, orphans: &mut Vec<BlockId>) {
        let Some(unit) = self.units[u as usize].take() else { return };
        self.free_ids.push(u);
        for m in &unit.states {
            if self.unit_of[m.0 as usize] == u {
                self.unit_of[m.0 as usize] = NO_UNIT;
            }
            if holds(m) {
                orphans.push(m.0);
            }
        }
        for m in &unit.prefix {
            let b = m.0 as usize;
            if self.unit_of[b] == u {
                self.unit_of[b] = NO_UNIT;
            }
            if holds(m) {
                self.support[b] = self.support[b].saturating_sub(1);
                if self.support[b] == 0 {
                    orphans.push(m.0);
                }
            }
        }
    }

    /// Forgets every unit (a prefix-cache reset).
    pub fn clear(&mut self) {
        self.units.clear();
        self.free_ids.clear();
        self.unit_of.fill(NO_UNIT);
        self.support.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_units_lose_returns_members_no_live_unit_needs() {
        let key = |h: u64, g: u32| (crate::ids::BlockHash::from_u64(h), g);
        let mut u = HitUnits::try_new(16).unwrap();
        // Two units share prefix block 1; unit A: state 5, prefix 1, 2; unit B: state 6, prefix 1, 3.
        u.form(vec![(5, key(52, 1))], vec![(1, key(51, 0)), (2, key(52, 0))], &mut |_| true);
        u.form(vec![(6, key(53, 1))], vec![(1, key(51, 0)), (3, key(53, 0))], &mut |_| true);
        assert_eq!((u.support(1), u.support(2), u.support(3)), (2, 1, 1));
        let mut orphans = Vec::new();
        u.lose(5, &mut |_| true, &mut orphans);
        assert_eq!(orphans, vec![2], "block 1 is still in unit B");
        assert_eq!(u.support(1), 1);
        assert!(!u.in_unit(5) && !u.in_unit(2) && u.in_unit(1));
        // A member that no longer holds its key is skipped.
        let mut orphans = Vec::new();
        u.lose(3, &mut |m| m.0 != 6, &mut orphans);
        assert_eq!(orphans, vec![1]);
        assert!((0..16).all(|b| !u.in_unit(b)));
        // Re-forming a unit on the same state dissolves the old one without orphans.
        u.form(vec![(5, key(52, 1))], vec![(2, key(52, 0))], &mut |_| true);
        u.form(vec![(5, key(52, 1))], vec![(2, key(52, 0))], &mut |_| true);
        assert_eq!(u.support(2), 1);
        u.clear();
        assert!(!u.in_unit(5) && u.support(2) == 0);
    }

    #[test]
    fn parse_known_names_round_trip() {
        for p in [Policy::Exact, Policy::HitAware] {
            assert_eq!(Policy::parse(p.name()).unwrap(), p);
        }
        assert_eq!(Policy::parse(" HIT_AWARE ").unwrap(), Policy::HitAware);
        assert!(matches!(Policy::parse("lru"), Err(Error::InvalidConfig(_))));
    }
}
