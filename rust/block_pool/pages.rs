//! Two-level pages (`Config::slots_per_page = k > 1`): state groups take whole pages,
//! attention groups take small blocks, *slots*, `k` to a page, from any request. The
//! allocator's pool is then the **slot pool** A (ids = slots, `P * k` of them; slot `s` is
//! slot `s % k` of page `s / k`); it owns the **page pool** S (ids = pages, `P` of them,
//! page 0 the null page) and each page's state ([`Pages`]). Both are today's [`BlockPool`]:
//! prefix index, events, references and free queue work unchanged per pool; this file holds
//! the page transitions, called at the slot pool's hooks (`get_new_blocks`, `touch`,
//! `free_blocks`, `free_loose_evict_first`, `reset_prefix_cache`).
//!
//! A page is exactly one of: **free** (in S's free queue, *the page queue*, LRU by when it
//! became free), a **state page** (one state group's block, refs in S), or an **open slot
//! page** (at least one slot with a reference; S holds one reference for the slot side).
//! A's free queue holds exactly the free slots of open pages. A free page whose last owner
//! was the slot side keeps its slots' keys in A (lazy eviction) until it is taken.
//!
//! Rules:
//! 1. A slot is taken from the front of A's queue (free uncached slots of open pages first,
//!    then cached ones, LRU: compactness before LRU). Only when A's queue is empty is a page
//!    taken from the front of the page queue: a state page's key is evicted in S; a free
//!    slot page's slots keep theirs; its `k` slots join A's queue (unkeyed at the front,
//!    keyed at the back, in slot order) and the front one is taken.
//! 2. A state group takes the front of the page queue (S's `get_new_blocks`); if the page
//!    held slots, every keyed slot is evicted in A (`Removed` events) when the slot pool
//!    settles it ([`BlockPool::settle_pages`], before the allocation returns).
//! 3. When a slot's reference count drops to 0 and no other slot of its page is in use, the
//!    page's slots leave A's queue and the page joins the page queue: at the back if any of
//!    its slots is keyed, else at the front (vLLM's hashed / unhashed order).
//! 4. A hit on a keyed slot of a free page takes the page out of the page queue: it opens,
//!    the touched slot takes its reference and the others join A's queue as in rule 1.
//! 5. State pages: S's own rules, unchanged.
//!
//! Under `hit-aware` (prefix caching on) each pool holds its own policy state and a levelled
//! queue (docs/two-level-pages.md, "Hit-aware"): A's keyed free slots sit at their levels
//! (rule 1 still takes A's front first); a free slot page sits in the page queue at the highest
//! level among its keyed slots (at most the normal level), unkeyed pages at the front; a free
//! keyed slot of a free page keeps its level, in no queue, until its page opens (it joins A's
//! queue at that level) or is taken. The hooks call the policy's (`popped`, `touched`,
//! `freed`) where a slot or a page enters or leaves a queue.
//!
//! Capacity: `free_pages` = pages in the page queue (what `num_free_blocks` reports);
//! [`BlockPool::pages_needed`] turns a request's slots and state pages into pages.
//!
//! Cost: each hook O(1) per slot, plus O(k) when a page opens or closes; `settle_pages`
//! O(k) per page a state group took. With `k == 1` no pool has [`Pages`]: the hooks cost
//! one untaken branch each.
#![forbid(unsafe_code)]

use super::{BlockPool, Result};
use crate::free_queue::try_filled;
use crate::ids::{BlockId, NULL_BLOCK};
use crate::policy::retention::PoolParts;
use crate::policy::{LEVEL_NORMAL, LEVEL_PROBATION, LEVEL_RESUMED};

/// The page pool and each page's state (two-level pages; held by the slot pool).
#[derive(Clone, Debug)]
pub(crate) struct Pages {
    /// S, the page pool: its free queue is the page queue, its index the state groups' keys.
    pub(super) s: BlockPool,
    /// Slots per page (`> 1`).
    k: u32,
    /// `used[p]`: slots of page `p` with a reference in A; `> 0` iff `p` is an open slot page.
    used: Vec<u32>,
    /// `slot_page[p]`: the slot side owns `p` (open), or owned it last (free, its slots may
    /// still hold keys in A). False for a state page and a page never opened for slots.
    slot_page: Vec<bool>,
    /// Scratch: pages whose last slot in use was freed by one call.
    closed: Vec<BlockId>,
}

impl BlockPool {
    /// The slot pool of two-level pages: `num_pages` pages of `k` slots, the page pool
    /// inside. No slot is free until its page opens.
    ///
    /// # Errors
    /// [`crate::Error::OutOfMemory`] when the metadata cannot be allocated.
    pub(crate) fn try_new_paged(
        num_pages: u32,
        k: u32,
        enable_caching: bool,
        enable_events: bool,
        leveled: bool,
    ) -> Result<Self> {
        let mut s = Self::build(num_pages, enable_caching, enable_events, leveled, false)?;
        s.taken = Some(Vec::new());
        let n = num_pages as usize;
        let oom = |e| crate::Error::OutOfMemory(format!("the page table of {num_pages} pages: {e}"));
        let used = try_filled(n, 0).map_err(oom)?;
        let slot_page = try_filled(n, false).map_err(oom)?;
        let mut a = Self::build(num_pages * k, enable_caching, enable_events, leveled, true)?;
        a.pages = Some(Box::new(Pages { s, k, used, slot_page, closed: Vec::new() }));
        Ok(a)
    }

    /// Slots per page: 1 unless this is the slot pool of two-level pages.
    #[inline]
    pub fn slots_per_page(&self) -> u32 {
        self.pages.as_ref().map_or(1, |p| p.k)
    }

    /// The page pool (two-level pages only).
    pub fn page_pool(&self) -> Option<&BlockPool> {
        self.pages.as_ref().map(|p| &p.s)
    }

    /// The pool a group uses: the page pool for a state group under two-level pages
    /// (`page_side`, which only a state group of an allocator with pages has), else this
    /// one: a branch on `page_side`, nothing more, for every other group.
    #[inline(always)]
    pub(crate) fn side(&mut self, page_side: bool) -> &mut BlockPool {
        if page_side {
            self.page_pool_mut()
        } else {
            self
        }
    }

    /// The page pool, out of the one-pool line.
    #[cold]
    #[inline(never)]
    fn page_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pages.as_deref_mut().expect("a state group's pool under two-level pages").s
    }

    /// [`Self::side`], to read.
    #[inline(always)]
    pub(crate) fn side_ref(&self, page_side: bool) -> &BlockPool {
        if page_side {
            &self.pages.as_deref().expect("a state group's pool under two-level pages").s
        } else {
            self
        }
    }

    /// Whole free pages (the page queue), or the free blocks of a pool without pages.
    #[inline]
    pub fn free_pages(&self) -> u32 {
        match &self.pages {
            None => self.num_free_blocks(),
            Some(p) => p.s.num_free_blocks(),
        }
    }

    /// Fraction in use: `1 - (free pages + free slots of open pages / k) / (P - 1)` with
    /// two-level pages, else [`Self::usage`].
    pub fn page_usage(&self) -> f64 {
        let Some(p) = &self.pages else { return self.usage() };
        let total = p.s.num_blocks - 1;
        if total == 0 {
            return 0.0;
        }
        let free = p.s.num_free_blocks() as f64 + self.queue.len() as f64 / p.k as f64;
        1.0 - free / total as f64
    }

    /// Slots of page `p` in use (invariant checks; 0 without pages).
    pub fn page_used(&self, p: BlockId) -> u32 {
        self.pages.as_ref().map_or(0, |x| x.used[p as usize])
    }

    /// Whether the slot side owns page `p` or owned it last (invariant checks).
    pub fn is_slot_page(&self, p: BlockId) -> bool {
        self.pages.as_ref().is_some_and(|x| x.slot_page[p as usize])
    }

    /// Whether every page a state group took has been settled (invariant checks).
    pub fn pages_settled(&self) -> bool {
        self.pages.as_ref().is_none_or(|p| p.s.taken.as_ref().is_none_or(Vec::is_empty))
    }

    /// The pages one request needs: `state_pages` for its state groups (vLLM's count, its
    /// free hit pages included), `slots` new slots for its slot groups (their hit slots
    /// excluded), after the hit's free slots in `touched` are taken: a free slot of an open
    /// page leaves A's queue; a slot of a free page takes that page out of the page queue
    /// and its other slots join A's queue. Returns `state_pages + pages taken by touches +
    /// ceil(max(0, slots - free slots) / k)`; the request fits iff that is at most
    /// [`Self::free_pages`].
    pub(crate) fn pages_needed(&self, slots: i64, state_pages: i64, touched: &[BlockId]) -> i64 {
        let Some(p) = &self.pages else { return slots + state_pages };
        let k = p.k as i64;
        let mut free_slots = self.queue.len() as i64;
        let mut pages = state_pages;
        let mut opened: Vec<BlockId> = Vec::new();
        for &b in touched {
            if b == NULL_BLOCK || self.ref_cnt[b as usize] != 0 {
                continue;
            }
            let page = b / p.k;
            if p.used[page as usize] == 0 && !opened.contains(&page) {
                opened.push(page);
                pages += 1;
                free_slots += k;
            }
            free_slots -= 1;
        }
        pages + ((slots - free_slots).max(0) as u64).div_ceil(k as u64) as i64
    }

    /// Rule 1: `n` slots from the front of A's queue, opening pages when it runs out.
    pub(super) fn get_new_slots(&mut self, n: u32, out: &mut Vec<BlockId>) {
        let mut p = self.pages.take().expect("two-level pages");
        let room = self.queue.len() as u64 + p.s.queue.len() as u64 * p.k as u64;
        assert!(n as u64 <= room, "get_new_blocks: {n} slots asked, {room} free");
        for _ in 0..n {
            let b = match self.queue.pop_front() {
                Some(b) => b,
                None => {
                    self.open_page(&mut p);
                    self.queue.pop_front().expect("an opened page has free slots")
                }
            };
            if let Some(r) = &mut self.retention {
                r.popped(b, &self.index);
            }
            if self.enable_caching {
                self.maybe_evict_cached_block(b);
            }
            assert_eq!(self.ref_cnt[b as usize], 0, "free slot {b} had references");
            self.ref_cnt[b as usize] = 1;
            p.used[(b / p.k) as usize] += 1;
            self.note(super::ResidencyOp::Allocated, b);
            out.push(b);
        }
        self.pages = Some(p);
    }

    /// Rule 1's page: the front of the page queue becomes a slot page, its slots join A's
    /// (empty) queue.
    fn open_page(&mut self, p: &mut Pages) {
        let page = p.s.queue.pop_front().expect("a free page (the count checked it)");
        if let Some(r) = &mut p.s.retention {
            r.popped(page, &p.s.index);
        }
        if p.s.index.is_keyed(page) {
            // A free state page's key goes (reported evicted to the residency log); a free
            // slot page holds no key in S, and its slots keep theirs.
            p.s.maybe_evict_cached_block(page);
        }
        debug_assert_eq!(p.s.ref_cnt[page as usize], 0);
        p.s.ref_cnt[page as usize] = 1;
        p.slot_page[page as usize] = true;
        self.join_queue(p.k, page, None);
    }

    /// The slots of `page` but `except` join A's queue: unkeyed at the front, keyed at the
    /// back, each in slot order (under hit-aware, keyed ones at the back of their levels,
    /// which they kept while the page was free).
    fn join_queue(&mut self, k: u32, page: BlockId, except: Option<BlockId>) {
        let first = page * k;
        if self.retention.is_some() {
            let mut front = std::mem::take(&mut self.scratch_first);
            let mut keyed = std::mem::take(&mut self.scratch_last);
            for s in first..first + k {
                if Some(s) != except {
                    if self.index.is_keyed(s) {
                        keyed.push(s);
                    } else {
                        front.push(s);
                    }
                }
            }
            if let Some(r) = &mut self.retention {
                r.freed(&front, &keyed, false, parts!(self));
            }
            front.clear();
            keyed.clear();
            self.scratch_first = front;
            self.scratch_last = keyed;
            return;
        }
        for s in (first..first + k).rev() {
            if Some(s) != except && !self.index.is_keyed(s) {
                self.queue.push_front_level(s, 0);
            }
        }
        for s in first..first + k {
            if Some(s) != except && self.index.is_keyed(s) {
                self.queue.push_back(s);
            }
        }
    }

    /// `touch` with pages (rule 4 for a slot of a free page).
    pub(super) fn touch_slots(&mut self, blocks: &[BlockId]) {
        let mut p = self.pages.take().expect("two-level pages");
        for &b in blocks {
            self.note(super::ResidencyOp::Accessed, b);
            if b == NULL_BLOCK {
                continue;
            }
            // Whether `b` left the slot queue (a free slot of an open page): only such a slot
            // is counted in the hit-aware pinned share.
            let mut queued = false;
            if self.ref_cnt[b as usize] == 0 {
                let page = b / p.k;
                if p.used[page as usize] == 0 {
                    assert!(p.slot_page[page as usize], "hit on slot {b} of page {page}, which holds no slots");
                    p.s.queue.remove(page);
                    p.s.ref_cnt[page as usize] = 1;
                    self.join_queue(p.k, page, Some(b));
                } else {
                    self.queue.remove(b);
                    queued = true;
                }
                p.used[page as usize] += 1;
            }
            self.ref_cnt[b as usize] += 1;
            if let Some(r) = &mut self.retention {
                r.touched(b, queued, &self.index);
            }
        }
        self.pages = Some(p);
    }

    /// `free_blocks` with pages: freed slots join A's queue as in vLLM (unkeyed at the
    /// front, keyed at the back; all at the front with `evict_first`; under hit-aware, keyed
    /// ones at their levels, as one pool frees them), then rule 3 for each page whose last
    /// slot in use was freed.
    pub(super) fn free_slots<I: IntoIterator<Item = BlockId>>(&mut self, ordered: I, evict_first: bool) {
        let mut p = self.pages.take().expect("two-level pages");
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut last = std::mem::take(&mut self.scratch_last);
        let leveled = self.retention.is_some();
        for b in ordered {
            if b == NULL_BLOCK {
                continue;
            }
            let rc = &mut self.ref_cnt[b as usize];
            assert!(*rc > 0, "free of slot {b} whose reference count is 0");
            *rc -= 1;
            if *rc == 0 {
                let page = b / p.k;
                p.used[page as usize] -= 1;
                if p.used[page as usize] == 0 {
                    p.closed.push(page);
                }
                if (evict_first && !leveled) || !self.enable_caching || !self.index.is_keyed(b) {
                    first.push(b);
                } else {
                    last.push(b);
                }
            }
        }
        match &mut self.retention {
            Some(r) => r.freed(&first, &last, evict_first, parts!(self)),
            None => {
                self.queue.push_front_n(&first);
                self.queue.push_back_n(&last);
            }
        }
        first.clear();
        last.clear();
        for &page in &p.closed {
            // Hit-aware: the page is queued at the highest level among its keyed slots
            // (taking it evicts them all), at most the normal level (pins and leases are not
            // served over two-level pages); each slot leaves the slot queue, counted out.
            let mut level = None;
            for s in page * p.k..(page + 1) * p.k {
                if let Some(r) = &mut self.retention {
                    r.popped(s, &self.index);
                    if self.index.is_keyed(s) {
                        level = level.max(Some(r.level(s).min(LEVEL_NORMAL)));
                    }
                } else if self.index.is_keyed(s) {
                    level = Some(LEVEL_NORMAL);
                }
                self.queue.remove(s);
            }
            p.s.ref_cnt[page as usize] = 0;
            match level {
                Some(lvl) if self.enable_caching && !evict_first => match &p.s.retention {
                    // Newest first at the probation levels, as a state page is queued there.
                    Some(_) if lvl == LEVEL_PROBATION || lvl == LEVEL_RESUMED => p.s.queue.push_front_level(page, lvl),
                    Some(_) => p.s.queue.push_back_level(page, lvl),
                    None => p.s.queue.push_back(page),
                },
                _ => first.push(page),
            }
        }
        p.closed.clear();
        p.s.queue.push_front_n(&first);
        first.clear();
        self.scratch_first = first;
        self.scratch_last = last;
        self.pages = Some(p);
    }

    /// Rule 2, deferred to here: the pages state groups took since the last call lose their
    /// slots' keys (a page that held slots, taken from the page queue by a state group).
    /// The allocator calls it once its managers have allocated; O(k) per page taken.
    #[inline]
    pub(crate) fn settle_pages(&mut self) {
        if let Some(p) = &self.pages {
            if p.s.taken.as_ref().is_some_and(|t| !t.is_empty()) {
                self.settle_taken();
            }
        }
    }

    /// [`Self::settle_pages`] when a state group took pages, out of the allocation's line.
    #[cold]
    #[inline(never)]
    fn settle_taken(&mut self) {
        let mut p = self.pages.take().expect("checked");
        let mut taken = p.s.taken.take().expect("the page pool records its pops");
        for &page in &taken {
            if std::mem::take(&mut p.slot_page[page as usize]) {
                for s in page * p.k..(page + 1) * p.k {
                    if self.index.is_keyed(s) {
                        self.maybe_evict_cached_block(s);
                    }
                }
            }
        }
        taken.clear();
        p.s.taken = Some(taken);
        self.pages = Some(p);
    }

    /// `reset_prefix_cache` with pages: both pools' keys go when every page is free (one
    /// `AllCleared`, from the page pool).
    pub(super) fn reset_pages(&mut self) -> bool {
        let p = self.pages.as_mut().expect("two-level pages");
        if !p.s.reset_prefix_cache() {
            return false;
        }
        self.index.clear();
        self.second = Default::default();
        self.hash_tokens.iter_mut().for_each(|t| *t = 0);
        if let Some(r) = &mut self.retention {
            r.reset();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::TableRef;
    use crate::ids::BlockHash;

    /// 4 pages of 2 slots (page 0 null): slots 2..8.
    fn pool() -> BlockPool {
        BlockPool::try_new_paged(4, 2, true, true, false).unwrap()
    }

    #[test]
    fn hit_aware_free_slot_page_queued_at_its_slots_highest_level_and_kept_while_free() {
        use crate::policy::{LEVEL_NORMAL, LEVEL_SPECULATIVE};
        let mut p = BlockPool::try_new_paged(4, 2, true, true, true).unwrap();
        let mut got = Vec::new();
        p.get_new_blocks(6, &mut got); // every page: 1, 2, 3
        key(&mut p, &got, 600);
        // Page 1's slots speculative, page 2's one speculative and one normal, page 3 normal.
        for s in [2, 3, 4] {
            p.hit_aware().unwrap().set_level(s, LEVEL_SPECULATIVE);
        }
        p.free_blocks([7, 6]); // page 3 first (the least recently freed)
        p.free_blocks([5, 4]);
        p.free_blocks([3, 2]);
        let levels = p.page_pool().unwrap().queue().iter_levels();
        assert_eq!(levels[LEVEL_SPECULATIVE as usize], vec![1], "page 1: every slot speculative");
        assert_eq!(levels[LEVEL_NORMAL as usize], vec![3, 2], "pages 3 and 2 at normal, LRU");
        assert_eq!(p.page_pool().unwrap().free_queue_order()[0], 1, "evicted first, though freed last");
        // A level set on a slot of a free page (in no queue) is kept for when the page opens.
        p.hit_aware().unwrap().set_level(5, LEVEL_SPECULATIVE);
        assert_eq!(p.retention().unwrap().level(5), LEVEL_SPECULATIVE);
        p.touch(&[4]);
        assert_eq!(p.queue().iter_levels()[LEVEL_SPECULATIVE as usize], vec![5], "joins A's queue at its level");
        assert_eq!(p.retention().unwrap().pinned_free(), 0);
    }

    fn key(p: &mut BlockPool, blocks: &[BlockId], base: u64) {
        p.cache_full_blocks(
            &TableRef { req: 0, group: 0, block_size: 16, blocks },
            0..blocks.len() as u32,
            None,
            |i| BlockHash::from_u64(base + i as u64),
        );
    }

    #[test]
    fn get_new_slots_fills_a_page_before_opening_the_next() {
        let mut p = pool();
        assert_eq!((p.free_pages(), p.num_free_blocks()), (3, 0));
        let mut got = Vec::new();
        p.get_new_blocks(3, &mut got);
        assert_eq!(got, vec![2, 3, 4], "page 1's two slots, then page 2's first");
        assert_eq!((p.free_pages(), p.num_free_blocks()), (1, 1));
        assert_eq!((p.page_used(1), p.page_used(2)), (2, 1));
        assert!((p.page_usage() - (1.0 - 1.5 / 3.0)).abs() < 1e-9);
    }

    #[test]
    fn free_last_slot_returns_page_front_unkeyed_back_keyed() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(4, &mut got); // pages 1, 2
        key(&mut p, &got[2..3], 100); // slot 4 (page 2) keyed
        p.free_blocks([3, 2]); // page 1: unkeyed -> front of the page queue
        p.free_blocks([5, 4]); // page 2: keyed slot -> back
        assert_eq!(p.page_pool().unwrap().free_queue_order(), vec![1, 3, 2]);
        assert_eq!(p.num_free_blocks(), 0, "free pages' slots leave A's queue");
        assert_eq!(p.block_hash(4).map(|k| k.0), Some(BlockHash::from_u64(100)), "lazy: the key stays");
    }

    #[test]
    fn free_one_slot_of_an_open_page_keeps_it_open() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(2, &mut got);
        p.free_blocks([3]);
        assert_eq!((p.free_pages(), p.num_free_blocks(), p.page_used(1)), (2, 1, 1));
        got.clear();
        p.get_new_blocks(1, &mut got);
        assert_eq!(got, vec![3], "the open page's free slot before a new page");
    }

    #[test]
    fn touch_slot_of_free_page_reopens_it() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(2, &mut got);
        key(&mut p, &got, 200);
        p.free_blocks([3, 2]);
        assert_eq!(p.free_pages(), 3);
        p.touch(&[3]);
        assert_eq!((p.free_pages(), p.page_used(1), p.free_queue_order()), (2, 1, vec![2]));
        assert_eq!(p.block_hash(2).map(|k| k.0), Some(BlockHash::from_u64(200)), "slot 2 keeps its key");
    }

    #[test]
    fn state_takes_a_free_slot_page_and_settle_evicts_its_keys() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(6, &mut got); // every page
        key(&mut p, &got[..2], 300); // page 1's slots keyed
        p.free_blocks([2, 3]); // page 1 free (back), its keys kept
        p.take_events();
        let mut pages = Vec::new();
        p.side(true).get_new_blocks(1, &mut pages);
        assert_eq!(pages, vec![1]);
        assert!(!p.pages_settled());
        p.settle_pages();
        assert!(p.pages_settled() && !p.is_slot_page(1));
        assert!(p.block_hash(2).is_none() && p.block_hash(3).is_none());
        assert_eq!(p.take_events().len(), 2, "one Removed per keyed slot");
    }

    #[test]
    fn open_page_evicts_a_free_state_page_key() {
        let mut p = pool();
        let mut pages = Vec::new();
        p.side(true).get_new_blocks(3, &mut pages);
        p.settle_pages();
        let s = p.side(true);
        s.cache_full_blocks(&TableRef { req: 0, group: 1, block_size: 32, blocks: &pages[..1] }, 0..1, None, |_| {
            BlockHash::from_u64(9)
        });
        s.free_blocks([pages[0]]);
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        assert_eq!(got, vec![pages[0] * 2]);
        assert!(p.page_pool().unwrap().block_hash(pages[0]).is_none());
    }

    #[test]
    fn pages_needed_counts_touched_free_page_once() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(3, &mut got); // page 1 full, page 2 one slot (5 free in A)
        key(&mut p, &got[..2], 400);
        p.free_blocks([3, 2]); // page 1 free, keyed
                               // Touching slots 2 and 3: page 1 leaves the page queue (1 page), no slot left over;
                               // 2 more slots: A's free slot 5, then one page.
        assert_eq!(p.pages_needed(2, 0, &[2, 3]), 2);
        assert_eq!(p.pages_needed(1, 1, &[2]), 2, "touched page's other slot serves the new one");
        assert_eq!(p.pages_needed(0, 0, &[]), 0);
    }

    #[test]
    fn reset_clears_both_pools_when_every_page_is_free() {
        let mut p = pool();
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        key(&mut p, &got, 500);
        assert!(!p.reset_prefix_cache());
        p.free_blocks([2]);
        assert!(p.reset_prefix_cache());
        assert!(p.block_hash(2).is_none());
    }
}
