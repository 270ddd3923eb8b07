//! Hit-aware, state-space hybrids: the hit units of the free blocks ([`HitUnits`]), the
//! policy's rule 6 (see [`crate::policy`]).
//!
//! Invariants: `support[b]` equals the live units holding `b` in their prefix; `unit_of[b]`
//! names a live unit or `NO_UNIT`; a dissolved unit's id is in `free_ids` once.
//!
//! Cost: `form` O(members); `lose` / `dissolve` O(members of the unit); `clear`
//! O(`num_blocks`); memory O(`num_blocks` + members of the live units).
#![forbid(unsafe_code)]

use crate::free_queue::try_filled;
use crate::ids::BlockId;
use crate::prefix_index::HashKey;

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
}
