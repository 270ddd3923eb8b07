//! Boundary-state offloads of a Mamba "align" group, for a KV connector (vLLM's
//! `MambaManager._pending_boundary_state_offloads`, drained by
//! `KVCacheManager.take_boundary_state_offloads` into `KVConnectorBlockState`).
//!
//! An align table is not append-only (interior states become null, speculative scratch
//! blocks move), so a connector cannot find a boundary state by its position: vLLM hands it
//! `(request, group, block, boundary tokens)` for every state `cache_blocks` keys, and the
//! OffloadingConnector stores that block under that boundary's hash. vLLM appends one entry
//! per block that `cache_blocks` newly counts as cached and that holds a key (null slots and
//! blocks the retention mask left unkeyed are skipped), with the tokens its key covers, after
//! the checkpoint / prompt-tail re-keying of the same call; it drops a request's entries when
//! the request's blocks go back to the pool (`pop_blocks_for_free`, so also `free` and a
//! preemption), and the scheduler drains them once per step.
//!
//! vLLM's two other sources come from sub-block partial keys (partial hash hits: a Mamba
//! block larger than the hash block): a producer's partial tail (the prompt's last hash
//! boundary keyed inside its own running state block, `AlignState::producer`) is recorded
//! here by the copy-on-write that preserves it (the copy, with the tail's tokens: see
//! `AlignState`'s `allocate_new_blocks`), or, when the request finishes before its next allocation,
//! returned by `finalize_partial_tail_offload` (`rust/manager/mamba.rs`). Without sub-block
//! keys neither source has anything.
//!
//! Recorded only when [`crate::Config::boundary_offloads`] is on (the adapter turns it on
//! with a KV connector: without one the scheduler drains vLLM's list and reads nothing).
//! Off, it costs one untaken branch per newly cached block of an align group.
//!
//! Cost: a record O(1); dropping a request's entries O(entries pending), a handful (the
//! list is drained every step); a take O(entries).
#![forbid(unsafe_code)]

use super::{KindState, SingleTypeManager};
use crate::ids::{BlockId, GroupId, ReqHandle, Slot};

/// One align group's pending boundary-state offloads, in vLLM's order.
#[derive(Clone, Debug, Default)]
pub struct BoundaryOffloads {
    /// Record them ([`crate::Config::boundary_offloads`]).
    pub(super) on: bool,
    /// `(request, block, boundary tokens)`, in the order vLLM appends them.
    pending: Vec<(ReqHandle, BlockId, u32)>,
}

impl BoundaryOffloads {
    /// Records that `block`, keyed at `tokens`, is `req`'s boundary state (a no-op when off).
    #[inline]
    pub(super) fn record(&mut self, req: ReqHandle, block: BlockId, tokens: u32) {
        if self.on {
            self.pending.push((req, block, tokens));
        }
    }

    /// Drops the entries of the request in slot `h`, whose blocks go back to the pool.
    pub(super) fn drop_slot(&mut self, h: Slot) {
        if !self.pending.is_empty() {
            self.pending.retain(|&(req, _, _)| req as Slot != h);
        }
    }

    /// Moves the pending entries to `out` as flat `[request, group, block, tokens]` quadruples.
    pub(super) fn take_into(&mut self, group: GroupId, out: &mut Vec<u64>) {
        for (req, block, tokens) in self.pending.drain(..) {
            out.extend([req, group as u64, block as u64, tokens as u64]);
        }
    }

    /// Entries pending (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.len()
    }
}

impl SingleTypeManager {
    /// Turns the recording of boundary-state offloads on or off (align groups only; at
    /// construction).
    pub(crate) fn set_boundary_offloads(&mut self, on: bool) {
        if let KindState::MambaAlign(st) = &mut self.kind_state {
            st.offloads.on = on;
        }
    }

    /// Moves this group's pending boundary-state offloads to `out` (see [`BoundaryOffloads::take_into`]).
    pub(crate) fn take_boundary_offloads(&mut self, out: &mut Vec<u64>) {
        if let KindState::MambaAlign(st) = &mut self.kind_state {
            st.offloads.take_into(self.group_id, out);
        }
    }

    /// This group's pending boundary-state offloads, `(request, block, tokens)` (invariant
    /// checks).
    pub(crate) fn pending_boundary_offloads(&self) -> &[(ReqHandle, BlockId, u32)] {
        match &self.kind_state {
            KindState::MambaAlign(st) => &st.offloads.pending,
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_when_on_and_drops_a_slot() {
        let mut b = BoundaryOffloads::default();
        b.record(7, 3, 16);
        assert_eq!(b.len(), 0, "off by default");
        b.on = true;
        let (r1, r2) = ((5u64 << 32) | 1, (6u64 << 32) | 2);
        b.record(r1, 3, 16);
        b.record(r2, 4, 32);
        b.record(r1, 9, 48);
        b.drop_slot(1);
        let mut out = Vec::new();
        b.take_into(2, &mut out);
        assert_eq!(out, vec![r2, 2, 4, 32]);
        assert_eq!(b.len(), 0);
    }
}
