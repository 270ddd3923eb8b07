//! Requests and their hashes: the slab of handles (`generation << 32 | slot`, a stale
//! handle refused), the block hashes vLLM computed for each request (synced from the
//! caller's list, rewrite-aware, undone when a later check of the same call fails), and
//! the request's tables and stored hit as read by callers.
//!
//! Cost: `add_request` / `release` O(groups); a hash sync O(1) when the caller's list only
//! grew (plus the new hashes), O(common prefix) after a rewrite.
#![forbid(unsafe_code)]

use super::{next_generation, Allocator, NoopLimits, ReqState};

use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, ReqHandle, Slot};

/// Block hashes as the caller holds them (vLLM's `request.block_hashes`): a list that
/// usually only grows, but may be cleared and regrown or truncated between two calls.
/// The core reads only what it needs: one entry to detect a rewrite, then the new tail.
pub trait HashSource {
    /// Number of hashes.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Hash `i` (`i < len()`).
    ///
    /// # Errors
    /// The entry is not a valid hash (not bytes, empty, longer than 32 bytes).
    fn get(&self, i: usize) -> Result<BlockHash>;
}

impl HashSource for [BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        Ok(self[i])
    }
}

impl HashSource for Vec<BlockHash> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        Ok(self[i])
    }
}

/// What [`Allocator::sync_hashes`] changed, so a call that fails later can put it back.
#[derive(Clone, Copy, Debug)]
pub(super) struct HashUndo {
    /// Hashes kept from before the sync (a common prefix with the caller's list).
    keep: usize,
}

impl Allocator {
    /// Registers a request; returns its handle (`generation << 32 | slot`, see
    /// [`ReqHandle`]).
    pub fn add_request(&mut self) -> ReqHandle {
        let s = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.reqs.push(ReqState::default());
                (self.reqs.len() - 1) as Slot
            }
        };
        let ng = self.managers.len();
        let st = &mut self.reqs[s as usize];
        st.generation = next_generation();
        st.hashes.clear();
        st.unwritten_from = None;
        if st.hit.len() != ng {
            st.hit = vec![Vec::new(); ng];
        }
        for v in st.hit.iter_mut() {
            v.clear();
        }
        for m in self.managers.iter_mut() {
            m.ensure_slot(s);
        }
        self.refresh_noop(s);
        self.handle_of(s)
    }

    pub(super) fn handle_of(&self, s: Slot) -> ReqHandle {
        (self.reqs[s as usize].generation as u64) << 32 | s as u64
    }

    /// The slot of a live handle.
    pub(super) fn slot(&self, h: ReqHandle) -> Result<Slot> {
        let s = (h & 0xFFFF_FFFF) as Slot;
        match self.reqs.get(s as usize) {
            Some(st) if st.generation != 0 && st.generation as u64 == h >> 32 => Ok(s),
            _ => Err(Error::UnknownRequest(h)),
        }
    }

    /// Whether `h` is a live request of this allocator.
    pub fn is_live(&self, h: ReqHandle) -> bool {
        self.slot(h).is_ok()
    }

    /// Whether slot `s` holds a live request (invariant checks).
    pub fn slot_is_live(&self, s: Slot) -> bool {
        self.reqs.get(s as usize).is_some_and(|st| st.generation != 0)
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.reqs.len() - self.free_slots.len()
    }

    /// Live request handles (invariant checks).
    pub fn live_handles(&self) -> impl Iterator<Item = ReqHandle> + '_ {
        (0..self.reqs.len() as Slot).filter(|&s| self.slot_is_live(s)).map(|s| self.handle_of(s))
    }

    pub(super) fn release(&mut self, s: Slot) {
        let st = &mut self.reqs[s as usize];
        st.generation = 0;
        st.hashes.clear();
        for v in st.hit.iter_mut() {
            v.clear();
        }
        st.noop = NoopLimits::default();
        st.hit_aware = Default::default();
        st.hints = None;
        if st.holds_slots {
            // Two-level pages: its tables were emptied (`free`, `pop_blocks_for_free`).
            st.holds_slots = false;
            self.slot_holders -= 1;
        }
        self.free_slots.push(s);
    }

    /// Appends block hashes to a request (`hash_len` bytes each, concatenated).
    ///
    /// # Errors
    /// Unknown handle; `hash_len` not in `1..=32` or not dividing `bytes.len()`.
    pub fn append_hashes(&mut self, h: ReqHandle, bytes: &[u8], hash_len: usize) -> Result<()> {
        let s = self.slot(h)?;
        if bytes.is_empty() {
            return Ok(());
        }
        if hash_len == 0 || hash_len > crate::ids::MAX_HASH_LEN || bytes.len() % hash_len != 0 {
            return Err(Error::OutOfRange(format!(
                "hash bytes of length {} cannot be split into hashes of {hash_len} bytes",
                bytes.len()
            )));
        }
        let st = &mut self.reqs[s as usize];
        st.hashes.extend(bytes.chunks_exact(hash_len).map(|c| BlockHash::from_bytes(c).expect("length checked")));
        Ok(())
    }

    /// Drops hashes of `h` past the first `n`.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn truncate_hashes(&mut self, h: ReqHandle, n: usize) -> Result<()> {
        let s = self.slot(h)?;
        self.reqs[s as usize].hashes.truncate(n);
        Ok(())
    }

    /// Brings the request's hashes up to `src`, the caller's whole list. Block hashes are
    /// chained (each covers its whole prefix), so when the entry at the last common index
    /// agrees the lists agree up to it (O(1)); otherwise (the caller cleared and regrew the
    /// list, or truncated it) the hashes are kept up to the first difference and the rest
    /// are taken from `src`. Every new entry is read and checked before anything changes.
    pub(super) fn sync_hashes(&mut self, s: Slot, src: &dyn HashSource) -> Result<HashUndo> {
        let known = &self.reqs[s as usize].hashes;
        let k = known.len();
        let n = src.len();
        let m = k.min(n);
        let keep = if m == 0 || src.get(m - 1)? == known[m - 1] {
            m
        } else {
            let mut i = 0;
            while i < m && src.get(i)? == known[i] {
                i += 1;
            }
            i
        };
        let mut staged = std::mem::take(&mut self.scratch_hashes);
        staged.clear();
        for i in keep..n {
            match src.get(i) {
                Ok(x) => staged.push(x),
                Err(e) => {
                    self.scratch_hashes = staged;
                    return Err(e);
                }
            }
        }
        let st = &mut self.reqs[s as usize];
        self.undo_tail.clear();
        self.undo_tail.extend_from_slice(&st.hashes[keep..]);
        st.hashes.truncate(keep);
        st.hashes.extend_from_slice(&staged);
        self.scratch_hashes = staged;
        Ok(HashUndo { keep })
    }

    pub(super) fn undo_hashes(&mut self, s: Slot, u: HashUndo) {
        let st = &mut self.reqs[s as usize];
        st.hashes.truncate(u.keep);
        st.hashes.extend_from_slice(&self.undo_tail);
    }

    /// Brings the request's hashes up to `src` (see [`HashSource`]).
    ///
    /// # Errors
    /// Unknown handle; an invalid entry in `src` (nothing changes).
    pub fn set_hashes(&mut self, h: ReqHandle, src: &dyn HashSource) -> Result<()> {
        let s = self.slot(h)?;
        self.sync_hashes(s, src).map(|_| ())
    }

    /// Number of block hashes known for `h`.
    pub fn num_hashes(&self, h: ReqHandle) -> Result<usize> {
        let s = self.slot(h)?;
        Ok(self.reqs[s as usize].hashes.len())
    }

    /// The hashes of `h`.
    pub fn hashes(&self, h: ReqHandle) -> Result<&[BlockHash]> {
        let s = self.slot(h)?;
        Ok(&self.reqs[s as usize].hashes)
    }

    /// The block table of `h` in group `g`.
    ///
    /// # Errors
    /// Unknown handle or group.
    pub fn blocks(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        let s = self.slot(h)?;
        let m = self.managers.get(g).ok_or_else(|| Error::OutOfRange(format!("group {g}")))?;
        Ok(m.blocks(s))
    }

    /// The last cache hit stored for `h`, group `g`.
    pub fn stored_hit(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        let s = self.slot(h)?;
        self.reqs[s as usize].hit.get(g).map(|v| v.as_slice()).ok_or_else(|| Error::OutOfRange(format!("group {g}")))
    }
}
