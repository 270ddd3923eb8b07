//! The free block queue: an index-linked doubly linked list over block ids, with two
//! sentinel slots. It is both the free list and the LRU eviction order (front = next to
//! hand out / evict), exactly as vLLM's `FreeKVCacheBlockQueue`.
//!
//! Invariants: a block is in the queue iff `prev[b] != DETACHED`; `len` counts the blocks
//! in it; following `next` from `HEAD` visits every queued block once and ends at `TAIL`.
//!
//! Cost: `pop_front`, `remove`, `push_back`, `push_front` are O(1); the `_n` forms O(n).
//! No allocation after construction.
#![forbid(unsafe_code)]

use crate::ids::BlockId;

const DETACHED: u32 = u32::MAX;

/// A vector of `n` copies of `v`, or the allocation error (a huge pool must raise
/// `MemoryError`, not abort the process).
pub(crate) fn try_filled<T: Clone>(n: usize, v: T) -> Result<Vec<T>, std::collections::TryReserveError> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)?;
    out.resize(n, v);
    Ok(out)
}

/// Index-linked free queue over `0..num_blocks` plus two sentinels.
#[derive(Clone, Debug)]
pub struct FreeQueue {
    /// `next[i]`: the slot after `i` (slots `n` and `n+1` are the head and tail sentinels).
    next: Vec<u32>,
    /// `prev[i]`: the slot before `i`; `DETACHED` when `i` is not queued.
    prev: Vec<u32>,
    /// Number of queued blocks.
    len: u32,
    head: u32,
    tail: u32,
}

impl FreeQueue {
    /// A queue holding every block `0..n` in id order (`n <= u32::MAX - 2`).
    ///
    /// # Errors
    /// The two link arrays cannot be allocated.
    pub fn try_new(n: u32) -> Result<Self, std::collections::TryReserveError> {
        let head = n;
        let tail = n + 1;
        let mut next = try_filled(n as usize + 2, DETACHED)?;
        let mut prev = try_filled(n as usize + 2, DETACHED)?;
        let mut last = head;
        for b in 0..n {
            next[last as usize] = b;
            prev[b as usize] = last;
            last = b;
        }
        next[last as usize] = tail;
        prev[tail as usize] = last;
        Ok(Self { next, prev, len: n, head, tail })
    }

    /// [`Self::try_new`] for sizes known to fit (tests).
    pub fn new(n: u32) -> Self {
        Self::try_new(n).expect("free queue allocation")
    }

    /// Number of queued blocks.
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether no block is queued.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `b` is queued.
    #[inline]
    pub fn contains(&self, b: BlockId) -> bool {
        self.prev[b as usize] != DETACHED
    }

    #[inline]
    fn unlink(&mut self, b: u32) {
        let p = self.prev[b as usize];
        let n = self.next[b as usize];
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[b as usize] = DETACHED;
        self.next[b as usize] = DETACHED;
        self.len -= 1;
    }

    #[inline]
    fn link_after(&mut self, at: u32, b: u32) {
        let n = self.next[at as usize];
        self.next[at as usize] = b;
        self.prev[b as usize] = at;
        self.next[b as usize] = n;
        self.prev[n as usize] = b;
        self.len += 1;
    }

    /// Removes and returns the front block.
    #[inline]
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.next[self.head as usize];
        if b == self.tail {
            return None;
        }
        self.unlink(b);
        Some(b)
    }

    /// Removes `b` from anywhere in the queue. Panics if `b` is not queued (an invariant
    /// violation of the pool: callers check ref counts first).
    #[inline]
    pub fn remove(&mut self, b: BlockId) {
        assert!(self.contains(b), "free queue: remove of block {b} that is not queued");
        self.unlink(b);
    }

    /// Appends `b` at the back (evicted last).
    #[inline]
    pub fn push_back(&mut self, b: BlockId) {
        debug_assert!(!self.contains(b));
        let last = self.prev[self.tail as usize];
        self.link_after(last, b);
    }

    /// Appends `blocks` at the back, in order.
    pub fn push_back_n(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.push_back(b);
        }
    }

    /// Puts `blocks` at the front, keeping their order (the first of them becomes the
    /// front), as vLLM's `prepend_n`.
    pub fn push_front_n(&mut self, blocks: &[BlockId]) {
        let mut at = self.head;
        for &b in blocks {
            debug_assert!(!self.contains(b));
            self.link_after(at, b);
            at = b;
        }
    }

    /// The queued blocks from front to back (tests, invariants).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.next[self.head as usize];
        std::iter::from_fn(move || {
            if cur == self.tail {
                None
            } else {
                let b = cur;
                cur = self.next[cur as usize];
                Some(b)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_holds_all_in_order() {
        let q = FreeQueue::new(5);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(q.len(), 5);
    }

    #[test]
    fn pop_remove_push_keep_order() {
        let mut q = FreeQueue::new(5);
        assert_eq!(q.pop_front(), Some(0));
        q.remove(3);
        q.push_back(0);
        q.push_front_n(&[3]);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![3, 1, 2, 4, 0]);
        assert_eq!(q.len(), 5);
        assert!(q.contains(3));
    }

    #[test]
    fn push_front_n_keeps_given_order() {
        let mut q = FreeQueue::new(4);
        for _ in 0..4 {
            q.pop_front();
        }
        assert!(q.is_empty());
        assert_eq!(q.pop_front(), None);
        q.push_back_n(&[2]);
        q.push_front_n(&[0, 1]);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    #[should_panic(expected = "not queued")]
    fn remove_unqueued_panics() {
        let mut q = FreeQueue::new(3);
        q.pop_front();
        q.remove(0);
    }
}
