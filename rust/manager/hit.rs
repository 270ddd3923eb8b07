//! The hit search's inputs and its dispatch to the kinds' `find_longest_cache_hit`
//! ([`super::KindRules::find_longest_cache_hit`]): a request's hashes viewed at a group's
//! block size ([`HashView`]) and one search of a spec group ([`HitQuery`]).
//!
//! Cost: `HashView` is O(1) per lookup; the search is the kind's (see each kind's file).
#![forbid(unsafe_code)]

use super::with_rules;
use crate::block_pool::BlockPool;
use crate::config::AttentionKind;
use crate::ids::{BlockHash, BlockId, GroupId};

/// The view of a request's block hashes at a group's block size: block `i` of the group
/// has hash `hashes[(i + 1) * scale - 1]` (vLLM's `BlockHashListWithBlockSize`).
#[derive(Clone, Copy)]
pub struct HashView<'a> {
    /// The request's hashes at `hash_block_size` granularity.
    pub hashes: &'a [BlockHash],
    /// `block_size / hash_block_size`.
    pub scale: u32,
}

impl HashView<'_> {
    /// Number of whole group blocks hashed.
    #[inline]
    pub fn len(&self) -> u32 {
        self.hashes.len() as u32 / self.scale
    }

    /// Hash of group block `i` (`i < len()`).
    #[inline]
    pub fn get(&self, i: u32) -> BlockHash {
        self.hashes[((i + 1) * self.scale - 1) as usize]
    }
}

/// One cache-hit search of a spec group (groups with equal specs, looked up together).
#[derive(Clone, Copy)]
pub struct HitQuery<'a> {
    /// The pool whose prefix index is searched.
    pub pool: &'a BlockPool,
    /// The request's hashes at the groups' block size.
    pub view: HashView<'a>,
    /// Longest hit wanted, in tokens.
    pub max_length: u32,
    /// The groups searched together (`out[k]` is group `group_ids[k]`'s hit).
    pub group_ids: &'a [GroupId],
    /// Tokens per block of these groups.
    pub block_size: u32,
    /// Hit lengths are multiples of this many tokens.
    pub alignment_tokens: u32,
    /// Drop the last matched block (vLLM's `drop_eagle_block`, EAGLE/MTP): the kind matches
    /// one block further (full attention: one hash unit with partial hash hits) and drops
    /// it, so the draft's KV there is recomputed. Only full attention and sliding windows
    /// read it (the config refuses the drop for the other kinds that take hits).
    pub drop_eagle: bool,
}

/// Finds the longest cache hit for one spec group, as the attention type's
/// `find_longest_cache_hit` classmethod. Fills `out[k]` for each group id
/// `q.group_ids[k]` and returns the hit length in tokens.
pub fn find_longest_cache_hit(kind: AttentionKind, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
    for o in out.iter_mut() {
        o.clear();
    }
    with_rules!(kind, r => r.find_longest_cache_hit(q, out))
}
