//! The free block queue: an index-linked doubly linked list over block ids, with two
//! sentinel slots. It is both the free list and the LRU eviction order (front = next to
//! hand out / evict), exactly as vLLM's `FreeKVCacheBlockQueue`.
//!
//! Invariants: a block is in the queue iff `prev[b] != DETACHED`; `len` counts the blocks
//! in it; following `next` from `HEAD` visits every queued block once and ends at `TAIL`.
//!
//! Retention levels (the `hit-aware` policy, [`crate::policy`]): a queue built with
//! [`FreeQueue::try_new_with_levels`] holds `levels - 1` more sentinel slots that split it
//! into segments, level 0 nearest the front. [`FreeQueue::push_back_level`] appends at the
//! back of one level, so a block of a lower level is always handed out before any block of a
//! higher one, and within a level the order is LRU. Sentinels are never counted, handed out
//! or iterated. A queue without levels (the `exact` policy) is exactly vLLM's queue.
//!
//! Cost: `pop_front` (O(levels) worst case: it steps over empty segments), `remove`,
//! `push_back`, `push_back_level`, `push_front` are O(1); the `_n` forms O(n); `extend_after`
//! (one chunk of a walk from the front or from a queued block) O(blocks read + sentinels passed).
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
    /// `ends[k]`: the sentinel after the last block of level `k` (the last level ends at
    /// `tail`); empty for a queue without levels. Sentinel slots are `n + 2..`.
    ends: Vec<u32>,
    /// Block ids are `0..n`; slots `n..` are sentinels.
    n: u32,
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
        Ok(Self { next, prev, len: n, head, tail, ends: Vec::new(), n })
    }

    /// An empty queue over block ids `0..n` (`n <= u32::MAX - 2`): the slot pool of
    /// two-level pages starts with no free slot (its slots join as pages open).
    ///
    /// # Errors
    /// The two link arrays cannot be allocated.
    pub fn try_new_empty(n: u32) -> Result<Self, std::collections::TryReserveError> {
        let (head, tail) = (n, n + 1);
        let mut next = try_filled(n as usize + 2, DETACHED)?;
        let mut prev = try_filled(n as usize + 2, DETACHED)?;
        next[head as usize] = tail;
        prev[tail as usize] = head;
        Ok(Self { next, prev, len: 0, head, tail, ends: Vec::new(), n })
    }

    /// A queue holding every block `0..n` in id order (all at level 0), split into
    /// `levels` (`1..=8`) retention levels (see the module docs).
    ///
    /// # Errors
    /// The link arrays cannot be allocated.
    pub fn try_new_with_levels(n: u32, levels: u32) -> Result<Self, std::collections::TryReserveError> {
        Self::with_levels(Self::try_new(n)?, levels)
    }

    /// [`Self::try_new_empty`] split into `levels` (`1..=8`) retention levels: the slot pool
    /// of two-level pages under `hit-aware`.
    ///
    /// # Errors
    /// The link arrays cannot be allocated.
    pub fn try_new_empty_with_levels(n: u32, levels: u32) -> Result<Self, std::collections::TryReserveError> {
        Self::with_levels(Self::try_new_empty(n)?, levels)
    }

    /// `q` (no levels yet) with the sentinels of `levels` levels added before its tail.
    fn with_levels(mut q: Self, levels: u32) -> Result<Self, std::collections::TryReserveError> {
        assert!((1..=8).contains(&levels), "free queue: {levels} levels (1 to 8 are served)");
        let n = q.n;
        let extra = levels as usize - 1;
        q.next.try_reserve_exact(extra)?;
        q.prev.try_reserve_exact(extra)?;
        // Sentinels for the ends of levels 0..levels-1, in order, just before the tail.
        for k in 0..extra {
            let s = n + 2 + k as u32;
            q.next.push(DETACHED);
            q.prev.push(DETACHED);
            let last = q.prev[q.tail as usize];
            q.next[last as usize] = s;
            q.prev[s as usize] = last;
            q.next[s as usize] = q.tail;
            q.prev[q.tail as usize] = s;
            q.ends.push(s);
        }
        q.ends.push(q.tail);
        Ok(q)
    }

    /// Number of retention levels (1 for a queue without levels; tests).
    #[cfg(test)]
    fn levels(&self) -> u32 {
        self.ends.len().max(1) as u32
    }

    #[inline]
    fn is_sentinel(&self, slot: u32) -> bool {
        slot >= self.n
    }

    /// [`Self::try_new`] for sizes known to fit (tests).
    #[cfg(test)]
    fn new(n: u32) -> Self {
        Self::try_new(n).expect("free queue allocation")
    }

    /// Number of queued blocks.
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether no block is queued (tests).
    #[cfg(test)]
    fn is_empty(&self) -> bool {
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

    /// Removes and returns the front block (of the lowest non-empty level).
    #[inline]
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let mut b = self.next[self.head as usize];
        while b != self.tail && self.is_sentinel(b) {
            b = self.next[b as usize];
        }
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

    /// Appends `b` at the back of retention level `level` (clamped to the last level): it is
    /// handed out after every block of lower levels and of its own level queued before it.
    #[inline]
    pub fn push_back_level(&mut self, b: BlockId, level: u8) {
        debug_assert!(!self.contains(b));
        let end = match self.ends.len() {
            0 => self.tail,
            k => self.ends[(level as usize).min(k - 1)],
        };
        let last = self.prev[end as usize];
        self.link_after(last, b);
    }

    /// Puts `b` at the front of retention level `level` (clamped): handed out before every
    /// block queued at that level.
    #[inline]
    pub fn push_front_level(&mut self, b: BlockId, level: u8) {
        debug_assert!(!self.contains(b));
        let l = (level as usize).min(self.ends.len().saturating_sub(1));
        let start = if l == 0 { self.head } else { self.ends[l - 1] };
        self.link_after(start, b);
    }

    /// The first block queued at retention level `level` (`None` when that level is empty
    /// or the queue has no such level).
    pub fn first_in_level(&self, level: u8) -> Option<BlockId> {
        let k = level as usize;
        if k >= self.ends.len().max(1) {
            return None;
        }
        let start = if k == 0 { self.head } else { self.ends[k - 1] };
        let b = self.next[start as usize];
        (b != self.tail && !self.is_sentinel(b)).then_some(b)
    }

    /// The block after queued block `b` in its retention level (`None` at the level's end).
    /// O(1).
    #[inline]
    pub fn next_in_level(&self, b: BlockId) -> Option<BlockId> {
        let n = self.next[b as usize];
        (!self.is_sentinel(n)).then_some(n)
    }

    /// Moves the end of retention level `level` past the front of level `level + 1` through
    /// block `last` (a block of level `level + 1`): those blocks join the back of `level`
    /// in their order, exactly as if each, front first, were removed and pushed at the back
    /// of `level` ([`Self::push_back_level`]). No block moves; only the sentinel does. O(1).
    pub fn extend_level_through(&mut self, level: u8, last: BlockId) {
        let k = level as usize;
        debug_assert!(k + 1 < self.ends.len(), "free queue: level {level} has no level after it");
        debug_assert!(self.contains(last));
        let s = self.ends[k];
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        let after = self.next[last as usize];
        self.next[last as usize] = s;
        self.prev[s as usize] = last;
        self.next[s as usize] = after;
        self.prev[after as usize] = s;
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
        std::iter::from_fn(move || loop {
            if cur == self.tail {
                return None;
            }
            let b = cur;
            cur = self.next[cur as usize];
            if !self.is_sentinel(b) {
                return Some(b);
            }
        })
    }

    /// Up to `max` queued blocks after `after` (from the front when `None`), front to back,
    /// appended to `out` (vLLM's `FreeKVCacheBlockQueue.iter_blocks_after`, one chunk of it).
    /// Nothing when `after` is not queued (vLLM's removed block has no `next_free_block`).
    /// O(blocks returned + level sentinels passed).
    pub fn extend_after(&self, after: Option<BlockId>, max: usize, out: &mut Vec<BlockId>) {
        let start = match after {
            None => self.head,
            Some(b) if b < self.n && self.contains(b) => b,
            Some(_) => return,
        };
        let mut cur = self.next[start as usize];
        let mut n = 0;
        while n < max && cur != self.tail {
            if !self.is_sentinel(cur) {
                out.push(cur);
                n += 1;
            }
            cur = self.next[cur as usize];
        }
    }

    /// The queued blocks of each level, front to back (tests, invariants).
    pub fn iter_levels(&self) -> Vec<Vec<BlockId>> {
        let mut out = vec![Vec::new()];
        let mut cur = self.next[self.head as usize];
        while cur != self.tail {
            if self.is_sentinel(cur) {
                out.push(Vec::new());
            } else {
                out.last_mut().expect("one level at least").push(cur);
            }
            cur = self.next[cur as usize];
        }
        out
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
    fn push_front_level_goes_before_its_level_only() {
        let mut q = FreeQueue::try_new_with_levels(6, 3).unwrap();
        for _ in 0..6 {
            q.pop_front();
        }
        q.push_back_level(1, 1);
        q.push_back_level(2, 0);
        q.push_front_level(3, 1);
        q.push_front_level(4, 2);
        q.push_front_level(5, 0);
        q.push_front_level(0, 9); // clamped to the last level
        assert_eq!(q.iter_levels(), vec![vec![5, 2], vec![3, 1], vec![0, 4]]);
        let mut flat = FreeQueue::new(2);
        flat.pop_front();
        flat.push_front_level(0, 3);
        assert_eq!(flat.iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn extend_after_walks_chunks_across_levels_as_iter() {
        // Chunks of 2 from the front, each after the last block read, join into `iter`'s
        // order, the level sentinels stepped over; after a block not queued: nothing.
        let mut q = FreeQueue::try_new_with_levels(6, 3).unwrap();
        for _ in 0..6 {
            q.pop_front();
        }
        for (b, level) in [(1, 2), (2, 1), (3, 2), (4, 0), (0, 1)] {
            q.push_back_level(b, level);
        }
        let (mut walked, mut cursor) = (Vec::new(), None);
        loop {
            let mut chunk = Vec::new();
            q.extend_after(cursor, 2, &mut chunk);
            if chunk.is_empty() {
                break;
            }
            cursor = chunk.last().copied();
            walked.extend(chunk);
        }
        assert_eq!(walked, q.iter().collect::<Vec<_>>());
        let mut out = Vec::new();
        q.extend_after(Some(5), 2, &mut out);
        q.extend_after(Some(6), 2, &mut out);
        q.extend_after(Some(u32::MAX), 2, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn push_back_level_lower_levels_pop_first() {
        let mut q = FreeQueue::try_new_with_levels(6, 3).unwrap();
        for _ in 0..6 {
            q.pop_front();
        }
        assert_eq!(q.pop_front(), None);
        q.push_back_level(1, 2);
        q.push_back_level(2, 1);
        q.push_back_level(3, 2);
        q.push_back_level(4, 0);
        q.push_front_n(&[5]);
        q.push_back_level(0, 9); // clamped to the last level
        assert_eq!(q.len(), 6);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![5, 4, 2, 1, 3, 0]);
        assert_eq!(q.iter_levels(), vec![vec![5, 4], vec![2], vec![1, 3, 0]]);
        assert_eq!(q.first_in_level(1), Some(2));
        assert_eq!(q.first_in_level(2), Some(1));
        assert_eq!(q.first_in_level(3), None);
        q.remove(2);
        assert_eq!(q.pop_front(), Some(5));
        assert_eq!(q.pop_front(), Some(4));
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn extend_level_through_equals_moving_each_block() {
        // Levels 0..3 filled: level 1 = [1, 2], level 2 = [3, 4, 5, 6], level 3 = [7].
        let build = || {
            let mut q = FreeQueue::try_new_with_levels(8, 4).unwrap();
            for _ in 0..8 {
                q.pop_front();
            }
            for (b, l) in [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (6, 2), (7, 3)] {
                q.push_back_level(b, l);
            }
            q
        };
        for through in [3, 4, 6] {
            let mut batched = build();
            batched.extend_level_through(1, through);
            let mut each = build();
            let mut b = each.first_in_level(2);
            while let Some(x) = b {
                let next = each.next_in_level(x);
                each.remove(x);
                each.push_back_level(x, 1);
                if x == through {
                    break;
                }
                b = next;
            }
            assert_eq!(batched.iter_levels(), each.iter_levels(), "through {through}");
            assert_eq!(batched.len(), 8);
            // The queue stays whole: pushes at either end of each level still land there.
            batched.remove(0);
            batched.push_back_level(0, 2);
            let levels = batched.iter_levels();
            assert_eq!(levels[2].last(), Some(&0));
            assert_eq!(levels.iter().map(Vec::len).sum::<usize>(), 8);
        }
        let q = build();
        assert_eq!(q.next_in_level(3), Some(4));
        assert_eq!(q.next_in_level(6), None);
        assert_eq!(q.next_in_level(7), None);
    }

    #[test]
    fn push_back_level_without_levels_is_push_back() {
        let mut q = FreeQueue::new(3);
        q.remove(1);
        q.push_back_level(1, 0);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 2, 1]);
        assert_eq!(q.levels(), 1);
    }

    #[test]
    #[should_panic(expected = "not queued")]
    fn remove_unqueued_panics() {
        let mut q = FreeQueue::new(3);
        q.pop_front();
        q.remove(0);
    }
}
