//! The prefix index: (block hash, group id) -> the cached blocks holding that content.
//!
//! Duplicates are allowed, as in vLLM's `BlockHashToBlockMap`: a block that becomes full
//! is cached even when an identical block already is (block tables stay append-only).
//! Lookups return the earliest-inserted block still present, matching vLLM's dict order.
//!
//! Cost: `get_one`, `insert` O(1), one hash and one probe each; `remove` O(1) for a unique key, O(k) for k duplicates.
#![forbid(unsafe_code)]

use crate::ids::{BlockHash, BlockId, GroupId};
use rustc_hash::FxHashMap;

/// A hash key: the block hash and the group it was cached for.
pub type HashKey = (BlockHash, GroupId);

#[derive(Clone, Debug)]
enum Entry {
    One(BlockId),
    /// Insertion-ordered, never empty (the key is removed with its last block).
    Many(Vec<BlockId>),
}

/// Map from hash key to the blocks cached under it.
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    map: FxHashMap<HashKey, Entry>,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index with room for `n` keys: a pool of `n` blocks never holds more (each
    /// block has at most one hash), so inserts never rehash on the hot path.
    ///
    /// # Errors
    /// The table cannot be allocated.
    pub fn try_with_capacity(n: usize) -> Result<Self, std::collections::TryReserveError> {
        let mut map = FxHashMap::default();
        map.try_reserve(n)?;
        Ok(Self { map })
    }

    /// The earliest-inserted block cached under `key`.
    #[inline]
    pub fn get_one(&self, key: &HashKey) -> Option<BlockId> {
        match self.map.get(key)? {
            Entry::One(b) => Some(*b),
            Entry::Many(v) => v.first().copied(),
        }
    }

    /// Whether `key` maps to `block`.
    pub fn contains(&self, key: &HashKey, block: BlockId) -> bool {
        match self.map.get(key) {
            None => false,
            Some(Entry::One(b)) => *b == block,
            Some(Entry::Many(v)) => v.contains(&block),
        }
    }

    /// Adds `block` under `key` (after any block already there).
    /// One hash of the key and one probe (the entry API), where a lookup then an insert
    /// hashed and probed twice for every new key.
    pub fn insert(&mut self, key: HashKey, block: BlockId) {
        match self.map.entry(key) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry::One(block));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let e = o.get_mut();
                match e {
                    Entry::One(b) => *e = Entry::Many(vec![*b, block]),
                    Entry::Many(v) => v.push(block),
                }
            }
        }
    }

    /// Removes `block` from `key`; returns whether it was there.
    /// One hash and one probe, as [`Self::insert`].
    pub fn remove(&mut self, key: &HashKey, block: BlockId) -> bool {
        let std::collections::hash_map::Entry::Occupied(mut o) = self.map.entry(*key) else { return false };
        let emptied = match o.get_mut() {
            Entry::One(b) => {
                if *b != block {
                    return false;
                }
                true
            }
            Entry::Many(v) => {
                let Some(pos) = v.iter().position(|&x| x == block) else { return false };
                v.remove(pos);
                v.is_empty()
            }
        };
        if emptied {
            o.remove();
        }
        true
    }

    /// Number of distinct keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Every (key, block) pair (invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = (&HashKey, BlockId)> + '_ {
        self.map.iter().flat_map(|(k, e)| {
            let v: Vec<BlockId> = match e {
                Entry::One(b) => vec![*b],
                Entry::Many(v) => v.clone(),
            };
            v.into_iter().map(move |b| (k, b))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(x: u64) -> HashKey {
        (BlockHash::from_u64(x), 0)
    }

    #[test]
    fn get_one_duplicates_returns_earliest() {
        let mut ix = PrefixIndex::new();
        ix.insert(key(1), 5);
        ix.insert(key(1), 7);
        ix.insert(key(1), 9);
        assert_eq!(ix.get_one(&key(1)), Some(5));
        assert!(ix.remove(&key(1), 5));
        assert_eq!(ix.get_one(&key(1)), Some(7));
        assert!(ix.remove(&key(1), 9));
        assert!(ix.remove(&key(1), 7));
        assert_eq!(ix.get_one(&key(1)), None);
        assert!(ix.is_empty());
    }

    #[test]
    fn remove_wrong_block_keeps_entry() {
        let mut ix = PrefixIndex::new();
        ix.insert(key(2), 3);
        assert!(!ix.remove(&key(2), 4));
        assert_eq!(ix.get_one(&key(2)), Some(3));
        assert!(ix.contains(&key(2), 3));
        assert!(!ix.contains(&key(3), 3));
    }
}
