//! The prefix index: (block hash, group id) -> the cached blocks holding that content, and
//! each block's own hash key (the key lives once, in the block's record).
//!
//! Layout: one record per block (`recs`, indexed by block id: its key and two chain links,
//! 48 bytes) and an open-addressing table (`slots`, linear probing, a power of two of at
//! least 2 x `num_blocks` slots, so at most half full) whose 8-byte slots hold a block id
//! and a 32-bit tag from the key's hash. The tag's top bits are the key's home slot, so
//! a slot can be moved without reading its key again; a probe compares the tag first and
//! the full key only against the block's record on a tag match. A 323k-block pool's table
//! is 8 MiB (the `FxHashMap` it replaces reserved about 37 MB of buckets). At most half
//! full, an insert probes about 1.5 slots on average and a removal's backward shift scans
//! about as many (a table 1.5 x `num_blocks`, up to 2/3 full, measured 4 and 5: more
//! instructions than the `FxHashMap`).
//!
//! Duplicates are allowed, as in vLLM's `BlockHashToBlockMap`: a block that becomes full
//! is cached even when an identical block already is (block tables stay append-only).
//! Lookups return the earliest-inserted block still present, matching vLLM's dict order:
//! the table's slot holds the earliest, later ones hang off it in insertion order through
//! the records' `next` links (`prev` links back; the head's `prev` is the chain's tail).
//!
//! Invariants (checked by [`PrefixIndex::check`], which `invariants::check` runs):
//! - a block is keyed iff its `prev` is non-zero (block 0, the null block, is never keyed);
//! - each occupied slot holds the head of one key's chain, its tag is the key's hash's, and
//!   every slot from the key's home slot to it is occupied (linear probing's invariant, kept
//!   on removal by backward-shift deletion, so no tombstones);
//! - no two slots hold the same key; every keyed block is on exactly one chain, under its key;
//! - `len` is the number of occupied slots (distinct keys).
//!
//! Cost: `get_one`, `insert`, `remove` O(1) expected: one hash of the key, a probe of a few
//! adjacent slots (one cache line, mostly), the full key compared once on a tag match;
//! `key_of` O(1); `insert` of a duplicate O(1) (appended after the tail the head links to);
//! `contains` O(k) for k duplicates (invariant checks only); `clear` O(`num_blocks`).
#![forbid(unsafe_code)]

use crate::ids::{BlockHash, BlockId, GroupId, NULL_BLOCK};

/// A hash key: the block hash and the group it was cached for.
pub type HashKey = (BlockHash, GroupId);

/// A block's record: its key and its place among the blocks cached under that key.
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// The block's hash key; meaningful only while `prev != 0`.
    key: HashKey,
    /// The next block cached under the same key (inserted later), 0 at the tail.
    next: BlockId,
    /// The previous block under the same key; for the chain's head (the block a slot
    /// holds), the chain's tail (itself when alone); 0 when the block is not keyed.
    prev: BlockId,
}

impl Rec {
    /// A record of a block with no key.
    fn unkeyed() -> Self {
        Rec { key: (BlockHash::from_u64(0), 0), next: NULL_BLOCK, prev: NULL_BLOCK }
    }
}

/// A table slot: the head block of one key's chain and the key's tag; `block == 0` is empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    block: BlockId,
    tag: u32,
}

/// Map from hash key to the blocks cached under it, and from block to its key.
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    /// One record per block id (`0..num_blocks`).
    recs: Vec<Rec>,
    /// The table: a power of two of slots, never more than half occupied.
    slots: Vec<Slot>,
    /// `slots.len() - 1`.
    mask: usize,
    /// `32 - log2(slots.len())`: a tag's home slot is `tag >> home_shift`.
    home_shift: u32,
    /// Occupied slots (distinct keys).
    len: usize,
    /// Tests: replaces the key hash, to force collisions.
    #[cfg(test)]
    force_hash: Option<fn(&HashKey) -> u64>,
}

/// The 64-bit hash of a key: FxHash-style word mixing of the hash bytes and the group,
/// then a MurmurHash3 finalizer so that the high 32 bits (the tag) are well mixed.
#[inline]
fn hash_key(k: &HashKey) -> u64 {
    const K: u64 = 0xf135_7aea_2e62_a9c5;
    let bytes = k.0.as_bytes();
    let mut h = (k.1 as u64) ^ ((bytes.len() as u64) << 32);
    let word = |c: &[u8]| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
    if let Ok(b) = <&[u8; 32]>::try_from(bytes) {
        // sha256, vLLM's default: four words, unrolled (the general loop's result).
        for c in [&b[0..8], &b[8..16], &b[16..24], &b[24..32]] {
            h = (h.rotate_left(26) ^ word(c)).wrapping_mul(K);
        }
        return finish(h);
    }
    let mut words = bytes.chunks_exact(8);
    for c in &mut words {
        h = (h.rotate_left(26) ^ word(c)).wrapping_mul(K);
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(26) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    finish(h)
}

/// MurmurHash3's 64-bit finalizer.
#[inline]
fn finish(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

impl PrefixIndex {
    /// An empty index for blocks `0..num_blocks` (`try_with_capacity` for sizes known to
    /// fit: tests).
    #[cfg(test)]
    fn new(num_blocks: usize) -> Self {
        Self::try_with_capacity(num_blocks).expect("prefix index allocation")
    }

    /// An empty index for blocks `0..n`: `n` records and a table of the least power of two
    /// of at least 2 x `n` slots (at least 4; at most 2^32, where the tag's bits end). A
    /// pool of `n` blocks never holds more than `n - 1` keys (each block has at most one),
    /// so the table never grows and stays at most half full.
    ///
    /// # Errors
    /// The records or the table cannot be allocated.
    pub fn try_with_capacity(n: usize) -> Result<Self, std::collections::TryReserveError> {
        let want = n.saturating_mul(2).max(4);
        let cap = want.checked_next_power_of_two().unwrap_or(1 << 32).min(1 << 32);
        let mut slots = Vec::new();
        slots.try_reserve_exact(cap)?;
        slots.resize(cap, Slot::default());
        let mut recs = Vec::new();
        recs.try_reserve_exact(n)?;
        recs.resize(n, Rec::unkeyed());
        Ok(Self {
            recs,
            slots,
            mask: cap - 1,
            home_shift: 32 - cap.trailing_zeros(),
            len: 0,
            #[cfg(test)]
            force_hash: None,
        })
    }

    #[inline]
    fn hash_of(&self, k: &HashKey) -> u64 {
        #[cfg(test)]
        if let Some(f) = self.force_hash {
            return f(k);
        }
        hash_key(k)
    }

    /// The key's tag: the hash's high 32 bits (their top bits are the home slot).
    #[inline]
    fn tag_of(&self, k: &HashKey) -> u32 {
        (self.hash_of(k) >> 32) as u32
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        // At least 4 slots: `home_shift` <= 30.
        (tag >> self.home_shift) as usize
    }

    /// The slot holding `key`'s chain, if any.
    #[inline]
    fn find(&self, key: &HashKey, tag: u32) -> Option<usize> {
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s.block == NULL_BLOCK {
                return None;
            }
            if s.tag == tag && self.recs[s.block as usize].key == *key {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The key `b` is cached under, if any.
    #[inline]
    pub fn key_of(&self, b: BlockId) -> Option<&HashKey> {
        let r = &self.recs[b as usize];
        (r.prev != NULL_BLOCK).then_some(&r.key)
    }

    /// Whether `b` is the block [`Self::get_one`] finds under `key`: cached under it and the
    /// earliest there (its chain's head). O(1), with no hashing: a head's `prev` is its
    /// chain's tail, whose `next` is 0; any other block is its `prev`'s `next`.
    #[inline]
    pub fn is_first_under(&self, b: BlockId, key: &HashKey) -> bool {
        let Some(r) = self.recs.get(b as usize) else { return false };
        r.prev != NULL_BLOCK && r.key == *key && self.recs.get(r.prev as usize).is_some_and(|p| p.next != b)
    }

    /// Whether `b` is cached under a key.
    #[inline]
    pub fn is_keyed(&self, b: BlockId) -> bool {
        self.recs[b as usize].prev != NULL_BLOCK
    }

    /// The earliest-inserted block cached under `key`.
    #[inline]
    pub fn get_one(&self, key: &HashKey) -> Option<BlockId> {
        self.find(key, self.tag_of(key)).map(|i| self.slots[i].block)
    }

    /// Whether `key` maps to `block`: walks the key's chain from its slot (invariant checks).
    pub fn contains(&self, key: &HashKey, block: BlockId) -> bool {
        let Some(i) = self.find(key, self.tag_of(key)) else { return false };
        let mut b = self.slots[i].block;
        for _ in 0..self.recs.len() {
            if b == block {
                return true;
            }
            b = self.recs[b as usize].next;
            if b == NULL_BLOCK {
                return false;
            }
        }
        false
    }

    /// Caches `block` under `key` (after any block already there).
    ///
    /// # Panics
    /// `block` is the null block, out of range or already keyed (the pool checks first).
    pub fn insert(&mut self, key: HashKey, block: BlockId) {
        assert!(block != NULL_BLOCK && !self.is_keyed(block), "prefix index: block {block} keyed twice");
        let tag = self.tag_of(&key);
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s.block == NULL_BLOCK {
                self.slots[i] = Slot { block, tag };
                self.recs[block as usize] = Rec { key, next: NULL_BLOCK, prev: block };
                self.len += 1;
                return;
            }
            if s.tag == tag && self.recs[s.block as usize].key == key {
                let head = s.block;
                let tail = self.recs[head as usize].prev;
                self.recs[tail as usize].next = block;
                self.recs[head as usize].prev = block;
                self.recs[block as usize] = Rec { key, next: NULL_BLOCK, prev: tail };
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Drops `b`'s key and returns it (`None`, changing nothing, when `b` has none), as a
    /// reference into `b`'s record: nothing is copied unless the caller reads it.
    #[inline]
    pub fn remove_block(&mut self, b: BlockId) -> Option<&HashKey> {
        // Inlined: an unkeyed block (most blocks a pool pops, outside a full cache) costs
        // one load, not a call.
        if !self.is_keyed(b) {
            return None;
        }
        self.remove_keyed(b);
        Some(&self.recs[b as usize].key)
    }

    /// [`Self::remove_block`] of a keyed block.
    fn remove_keyed(&mut self, b: BlockId) {
        let Rec { ref key, next, prev } = self.recs[b as usize];
        let tag = self.tag_of(key);
        // The key's slot: found by block id when `b` heads the chain (no key compare).
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            assert!(s.block != NULL_BLOCK, "prefix index: keyed block {b} has no slot");
            if s.tag == tag && (s.block == b || self.recs[s.block as usize].key == *key) {
                break;
            }
            i = (i + 1) & self.mask;
        }
        let head = self.slots[i].block;
        if head == b {
            if next == NULL_BLOCK {
                self.delete_slot(i);
            } else {
                self.slots[i].block = next;
                self.recs[next as usize].prev = prev;
            }
        } else {
            self.recs[prev as usize].next = next;
            let after = if next == NULL_BLOCK { head } else { next };
            self.recs[after as usize].prev = prev;
        }
        let rec = &mut self.recs[b as usize];
        rec.prev = NULL_BLOCK;
        rec.next = NULL_BLOCK;
    }

    /// Empties slot `i` by backward-shift deletion: each later slot of the run whose home
    /// is not cyclically within `(i, j]` moves back into the hole, so every key stays
    /// reachable from its home without tombstones.
    fn delete_slot(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s.block == NULL_BLOCK {
                break;
            }
            let home = self.home(s.tag);
            // `s` may move to `i` unless its home lies cyclically in (i, j].
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(i) & self.mask) {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = Slot::default();
        self.len -= 1;
    }

    /// Removes `block` from `key`; returns whether it was there (tests).
    #[cfg(test)]
    fn remove(&mut self, key: &HashKey, block: BlockId) -> bool {
        self.key_of(block) == Some(key) && self.remove_block(block).is_some()
    }

    /// Number of distinct keys (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    /// Whether the index is empty (tests).
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every key (keeps the allocation).
    pub fn clear(&mut self) {
        self.slots.fill(Slot::default());
        for r in &mut self.recs {
            r.prev = NULL_BLOCK;
            r.next = NULL_BLOCK;
        }
        self.len = 0;
    }

    /// Every (key, block) pair, chains in insertion order (invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = (&HashKey, BlockId)> + '_ {
        self.slots.iter().filter(|s| s.block != NULL_BLOCK).flat_map(move |s| {
            let mut chain = Vec::new();
            let mut b = s.block;
            while b != NULL_BLOCK && chain.len() < self.recs.len() {
                chain.push(b);
                b = self.recs[b as usize].next;
            }
            let key = &self.recs[s.block as usize].key;
            chain.into_iter().map(move |b| (key, b))
        })
    }

    /// Checks the structure's invariants (module docs); returns the first violation.
    /// O(table + `num_blocks`): for tests and debugging.
    pub fn check(&self) -> Result<(), String> {
        let mut on_chain = vec![false; self.recs.len()];
        let mut keys = std::collections::HashSet::new();
        let mut occupied = 0usize;
        for (j, s) in self.slots.iter().enumerate() {
            if s.block == NULL_BLOCK {
                continue;
            }
            occupied += 1;
            let head = s.block;
            let key = self.key_of(head).ok_or_else(|| format!("slot {j} holds unkeyed block {head}"))?;
            if self.tag_of(key) != s.tag {
                return Err(format!("slot {j}: tag {:#x} is not block {head}'s key's", s.tag));
            }
            let home = self.home(s.tag);
            let mut k = home;
            while k != j {
                if self.slots[k].block == NULL_BLOCK {
                    return Err(format!("slot {j} (home {home}): empty slot {k} breaks its probe run"));
                }
                k = (k + 1) & self.mask;
            }
            if !keys.insert(*key) {
                return Err(format!("slot {j}: block {head}'s key is in another slot too"));
            }
            let (mut prev, mut b) = (NULL_BLOCK, head);
            while b != NULL_BLOCK {
                if on_chain[b as usize] {
                    return Err(format!("block {b} is on a chain twice"));
                }
                on_chain[b as usize] = true;
                let r = &self.recs[b as usize];
                if r.prev == NULL_BLOCK || r.key != *key {
                    return Err(format!("block {b} on the chain of slot {j} is not keyed under its key"));
                }
                if prev != NULL_BLOCK && r.prev != prev {
                    return Err(format!("block {b}: prev {} but follows {prev}", r.prev));
                }
                (prev, b) = (b, r.next);
            }
            if self.recs[head as usize].prev != prev {
                return Err(format!(
                    "chain of block {head}: head's prev {} is not the tail {prev}",
                    self.recs[head as usize].prev
                ));
            }
        }
        if occupied != self.len {
            return Err(format!("{occupied} occupied slots, len {}", self.len));
        }
        if occupied * 2 > self.slots.len() {
            return Err(format!("{occupied} keys in {} slots: above half", self.slots.len()));
        }
        for (b, r) in self.recs.iter().enumerate() {
            if r.prev != NULL_BLOCK && !on_chain[b] {
                return Err(format!("keyed block {b} is on no chain"));
            }
            if r.prev == NULL_BLOCK && r.next != NULL_BLOCK {
                return Err(format!("unkeyed block {b} links to {}", r.next));
            }
        }
        if self.recs.first().is_some_and(|r| r.prev != NULL_BLOCK) {
            return Err("the null block is keyed".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(x: u64) -> HashKey {
        (BlockHash::from_u64(x), 0)
    }

    /// An index of 64 blocks (a table of 128 slots) whose hash is `f`.
    fn forced(f: fn(&HashKey) -> u64) -> PrefixIndex {
        let mut ix = PrefixIndex::new(64);
        ix.force_hash = Some(f);
        ix
    }

    /// A degenerate hash: every key has tag 0xFFFF_FFFF, home the last slot.
    fn all_last(_: &HashKey) -> u64 {
        u64::MAX
    }

    /// Tag from the key's last hash byte only (`key(x)`'s low byte): in a 128-slot table
    /// key x homes at slot x / 2 (x << 56 puts x in the tag's top bits), distinct tags.
    fn by_low_byte(k: &HashKey) -> u64 {
        (k.0.as_bytes()[7] as u64) << 56
    }

    #[test]
    fn get_one_duplicates_returns_earliest() {
        let mut ix = PrefixIndex::new(16);
        ix.insert(key(1), 5);
        ix.insert(key(1), 7);
        ix.insert(key(1), 9);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.get_one(&key(1)), Some(5));
        assert!(ix.remove(&key(1), 5));
        assert_eq!(ix.get_one(&key(1)), Some(7));
        ix.check().unwrap();
        assert!(ix.remove(&key(1), 9));
        assert!(ix.remove(&key(1), 7));
        assert_eq!(ix.get_one(&key(1)), None);
        assert!(ix.is_empty());
        ix.check().unwrap();
    }

    #[test]
    fn is_first_under_is_get_one() {
        let mut ix = PrefixIndex::new(16);
        let agrees = |ix: &PrefixIndex| {
            for b in 0..16 {
                for k in 1..4 {
                    assert_eq!(ix.is_first_under(b, &key(k)), ix.get_one(&key(k)) == Some(b), "block {b} key {k}");
                }
            }
        };
        agrees(&ix);
        ix.insert(key(1), 5);
        agrees(&ix);
        ix.insert(key(1), 7);
        ix.insert(key(1), 9);
        ix.insert(key(2), 3);
        agrees(&ix);
        assert!(ix.remove(&key(1), 5));
        agrees(&ix);
        assert!(ix.remove(&key(1), 9));
        agrees(&ix);
        assert!(ix.remove(&key(1), 7));
        agrees(&ix);
        assert!(!ix.is_first_under(99, &key(2)));
    }

    #[test]
    fn remove_wrong_block_keeps_entry() {
        let mut ix = PrefixIndex::new(16);
        ix.insert(key(2), 3);
        assert!(!ix.remove(&key(2), 4));
        assert!(!ix.remove(&key(3), 3));
        assert_eq!(ix.get_one(&key(2)), Some(3));
        assert!(ix.contains(&key(2), 3));
        assert!(!ix.contains(&key(3), 3));
        assert_eq!(ix.key_of(3), Some(&key(2)));
        assert_eq!(ix.key_of(4), None);
        assert_eq!(ix.remove_block(4), None);
        ix.check().unwrap();
    }

    #[test]
    fn remove_middle_duplicate_keeps_order_and_tail() {
        let mut ix = PrefixIndex::new(16);
        for b in [2, 4, 6, 8] {
            ix.insert(key(1), b);
        }
        assert_eq!(ix.remove_block(6), Some(&key(1)));
        // The tail (8) is still the tail: a new duplicate goes after it.
        ix.insert(key(1), 10);
        assert_eq!(ix.remove_block(8), Some(&key(1)));
        ix.check().unwrap();
        let order: Vec<BlockId> = ix.iter().map(|(_, b)| b).collect();
        assert_eq!(order, vec![2, 4, 10]);
        assert!(ix.remove(&key(1), 2));
        assert_eq!(ix.get_one(&key(1)), Some(4));
        ix.insert(key(1), 6);
        assert!(ix.remove(&key(1), 10));
        let order: Vec<BlockId> = ix.iter().map(|(_, b)| b).collect();
        assert_eq!(order, vec![4, 6]);
        ix.check().unwrap();
    }

    #[test]
    fn remove_in_middle_of_probe_run_keeps_later_keys_reachable() {
        // All keys home at the same slot: a run of 40; remove from its middle and front.
        let mut ix = forced(all_last);
        for x in 1..=40u64 {
            ix.insert(key(x), x as BlockId);
        }
        ix.check().unwrap();
        for x in [20u64, 1, 39, 2, 21] {
            assert!(ix.remove(&key(x), x as BlockId));
            ix.check().unwrap();
            assert_eq!(ix.get_one(&key(x)), None);
        }
        for x in 1..=40u64 {
            let want = (![20u64, 1, 39, 2, 21].contains(&x)).then_some(x as BlockId);
            assert_eq!(ix.get_one(&key(x)), want, "key {x}");
        }
        assert_eq!(ix.len(), 35);
    }

    #[test]
    fn probe_run_wraps_around_the_table_end() {
        // Home is the last slot (127): the run wraps to slots 0, 1, ...
        let mut ix = forced(all_last);
        for x in 1..=5u64 {
            ix.insert(key(x), x as BlockId);
        }
        assert_eq!(ix.slots[127].block, 1);
        assert_eq!(ix.slots[0].block, 2);
        assert!(ix.remove(&key(1), 1));
        ix.check().unwrap();
        // Backward shift pulled the wrapped entries back over the end.
        assert_eq!(ix.slots[127].block, 2);
        assert_eq!(ix.slots[3].block, NULL_BLOCK);
        for x in 2..=5u64 {
            assert_eq!(ix.get_one(&key(x)), Some(x as BlockId));
        }
    }

    #[test]
    fn backward_shift_keeps_entries_at_their_own_home() {
        // Keys 0, 1 home at slot 0, keys 2, 3 at slot 1: fill slots 0..=3, then remove from
        // slot 0. Key 3 (slot 1, home 1) must stay; key 2 (slot 3, home 1) moves to slot 2.
        let mut ix = forced(by_low_byte);
        ix.insert(key(1), 11); // home 0 -> slot 0
        ix.insert(key(3), 13); // home 1 -> slot 1
        ix.insert(key(0), 10); // home 0 -> slot 2
        ix.insert(key(2), 12); // home 1 -> slot 3
        ix.check().unwrap();
        assert!(ix.remove(&key(1), 11));
        ix.check().unwrap();
        assert_eq!(ix.slots[0].block, 10, "key 0 (home 0) moves into the hole");
        assert_eq!(ix.slots[1].block, 13);
        assert_eq!(ix.slots[2].block, 12, "key 2 (home 1) moves up to slot 2, not past its home");
        for (x, b) in [(0u64, 10), (2, 12), (3, 13)] {
            assert_eq!(ix.get_one(&key(x)), Some(b));
        }
    }

    #[test]
    fn degenerate_tag_many_collisions_compares_full_keys() {
        // Every key has the same tag: lookups must tell them apart by the full key, and
        // duplicates must chain, not take a slot each.
        let mut ix = forced(all_last);
        for x in 1..=30u64 {
            ix.insert(key(x), x as BlockId);
        }
        for x in 1..=30u64 {
            ix.insert(key(x), 30 + x as BlockId);
        }
        assert_eq!(ix.len(), 30);
        ix.check().unwrap();
        for x in 1..=30u64 {
            assert_eq!(ix.get_one(&key(x)), Some(x as BlockId));
            assert!(ix.contains(&key(x), 30 + x as BlockId));
            assert!(!ix.contains(&key(x), 31 + (x % 30) as BlockId));
        }
        for x in (1..=30u64).step_by(3) {
            assert!(ix.remove(&key(x), x as BlockId));
        }
        ix.check().unwrap();
        for x in 1..=30u64 {
            let want = if x % 3 == 1 { 30 + x } else { x };
            assert_eq!(ix.get_one(&key(x)), Some(want as BlockId));
        }
        assert_eq!(ix.get_one(&key(31)), None);
    }

    #[test]
    fn random_ops_match_a_naive_model() {
        // Insert/remove at random against a Vec model, for the real hash and a colliding one.
        for f in [None, Some(by_low_byte as fn(&HashKey) -> u64)] {
            let mut ix = PrefixIndex::new(64);
            ix.force_hash = f;
            let mut model: Vec<(HashKey, BlockId)> = Vec::new();
            let mut x = 0x1234_5678u64;
            for step in 0..4000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = (x % 63 + 1) as BlockId;
                let k = key((x >> 8) % 12);
                if let Some(pos) = model.iter().position(|&(_, mb)| mb == b) {
                    let (mk, _) = model.remove(pos);
                    assert_eq!(ix.remove_block(b), Some(&mk), "step {step}");
                    assert_eq!(ix.key_of(b), None);
                } else {
                    ix.insert(k, b);
                    model.push((k, b));
                }
                for kx in 0..12 {
                    let k = key(kx);
                    let want = model.iter().find(|(mk, _)| *mk == k).map(|&(_, b)| b);
                    assert_eq!(ix.get_one(&k), want, "step {step}, key {kx}");
                }
                if step % 97 == 0 {
                    ix.check().unwrap();
                }
            }
            ix.check().unwrap();
            ix.clear();
            assert!(ix.is_empty());
            assert_eq!(ix.iter().count(), 0);
            ix.check().unwrap();
        }
    }

    #[test]
    fn check_finds_a_broken_probe_run() {
        let mut ix = forced(all_last);
        ix.insert(key(1), 1);
        ix.insert(key(2), 2);
        // Empty the first slot of the run by hand: key 2 is now unreachable.
        ix.slots[127] = Slot::default();
        ix.len -= 1;
        ix.recs[1].prev = NULL_BLOCK;
        assert!(ix.check().unwrap_err().contains("breaks its probe run"));
    }

    #[test]
    fn table_is_a_power_of_two_at_most_half_full() {
        for n in [1usize, 4, 63, 64, 65, 323_000] {
            let ix = PrefixIndex::new(n);
            assert!(ix.slots.len().is_power_of_two());
            assert!(ix.slots.len() >= n * 2, "n {n}: {} slots", ix.slots.len());
        }
        assert_eq!(PrefixIndex::new(64).slots.len(), 128);
        assert_eq!(PrefixIndex::new(323_000).slots.len(), 1 << 20);
    }
}
