//! The block pool: an arena of `num_blocks` blocks (struct of arrays), the free queue,
//! the prefix index (which also holds each block's hash key, in its per-block record), and
//! the KV cache event queue. Mirrors vLLM's `BlockPool`.
//!
//! Invariants (checked by `invariants::check`):
//! - block 0 is the null block: never queued, never hashed, its ref count unused;
//! - a non-null block is in the free queue iff its ref count is 0;
//! - a block has a hash key iff the prefix index maps that key to it;
//! - free blocks without a hash sit before hashed ones only as vLLM's order dictates
//!   (freed unhashed blocks go to the front, hashed ones to the back).
//!
//! The residency log ([`ResidencyOp`], `--kv-cache-metrics`) is kept here, where vLLM's pool
//! calls its collector: managers take blocks with `get_new_blocks` and hits with `touch`, and
//! call `maybe_evict_cached_block` only where vLLM calls `_maybe_evict_cached_block`
//! (re-keying a block, vLLM's `cache_partial_block`, is `remove_cached_block_hashes`).
//!
//! Cost: `get_new_blocks` O(n) (each popped block's lazy eviction O(1), plus, under
//! hit-aware with Mamba groups, O(members) when it dissolves a hit unit); `touch`,
//! `free_blocks` O(blocks given); `cache_full_blocks` O(blocks cached); `reset` O(`num_blocks`).
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::free_queue::{try_filled, FreeQueue};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, NULL_BLOCK};
use crate::policy::{HitUnits, Level, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_PROBATION, LEVEL_SPECULATIVE, NUM_LEVELS};
use crate::prefix_index::{HashKey, PrefixIndex};
use rustc_hash::FxHashSet;

/// Hit-aware block flag: served in a cache hit since it was cached.
const FLAG_REUSED: u8 = 1;
/// Hit-aware block flag: a Mamba state at a shared-prefix junction (see
/// `SingleTypeManager::demote_passed_state`).
const FLAG_BRANCH: u8 = 2;
/// Hit-aware block flag: a full-attention block that ended a finished request's cached
/// sequence (a chat's next turn continues there; see `Allocator::free`).
const FLAG_TAIL: u8 = 4;

/// A KV cache event, in the order vLLM emits them. `Stored` carries what the vLLM adapter
/// needs to build `BlockStored` (token ids and extra keys come from the request there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Blocks `block_indices` of a request's table became cached.
    Stored {
        /// The request whose blocks were cached.
        req: ReqHandle,
        /// The KV cache group.
        group: GroupId,
        /// Tokens per block of the group.
        block_size: u32,
        /// First token of the range (`num_cached_blocks * block_size`).
        start_token: u32,
        /// End of the range (`num_full_blocks * block_size`).
        end_token: u32,
        /// Hash of block `num_cached_blocks - 1`, if any.
        parent: Option<BlockHash>,
        /// Hashes of the blocks cached (null / masked blocks skipped).
        hashes: Vec<BlockHash>,
        /// Table indices of those blocks.
        block_indices: Vec<u32>,
    },
    /// A cached block lost its hash (lazy eviction or explicit eviction).
    Removed {
        /// The removed hash.
        hash: BlockHash,
        /// Its group.
        group: GroupId,
    },
    /// The prefix cache was reset.
    AllCleared,
}

/// One call vLLM's `BlockPool` makes on its `KVCacheMetricsCollector` (`--kv-cache-metrics`),
/// with the block it names (the collector reads only `block_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ResidencyOp {
    /// `on_block_allocated`: a block handed out by `get_new_blocks`.
    Allocated = 0,
    /// `on_block_accessed`: a block touched by a cache hit (`touch`), the null block
    /// included (vLLM 0.32 reports it, 0.33 skips it: the adapter drops it there).
    Accessed = 1,
    /// `on_block_evicted`: `_maybe_evict_cached_block`, called on every block
    /// `get_new_blocks` takes with prefix caching on (hashed or not), on each block of
    /// `evict_blocks` and on a transient Mamba checkpoint state.
    Evicted = 2,
    /// `reset`: a prefix-cache reset that succeeded (the block is 0).
    Reset = 3,
}

/// A request's table in one group, as [`BlockPool::cache_full_blocks`] reads it.
#[derive(Clone, Copy, Debug)]
pub struct TableRef<'a> {
    /// The request (events name it).
    pub req: ReqHandle,
    /// The KV cache group.
    pub group: GroupId,
    /// Tokens per block of the group.
    pub block_size: u32,
    /// The table.
    pub blocks: &'a [BlockId],
}

/// One block keyed by [`BlockPool::cache_one_block`].
#[derive(Clone, Copy, Debug)]
pub struct OneBlock {
    /// The request (events name it).
    pub req: ReqHandle,
    /// The block keyed.
    pub block: BlockId,
    /// Its index in the request's table.
    pub index: u32,
    /// The key (the hash of the prefix ending at the block, and the group).
    pub key: HashKey,
    /// Prefix tokens the key covers.
    pub num_tokens: u32,
    /// Tokens per block of the group.
    pub block_size: u32,
    /// The hash of the block before it, if any (the event's parent).
    pub parent: Option<BlockHash>,
}

/// The arena of blocks with their free queue and prefix index.
#[derive(Clone, Debug)]
pub struct BlockPool {
    /// Blocks in the pool, the null block included.
    num_blocks: u32,
    /// Reference count of each block: table slots holding it plus `loose[b]`.
    ref_cnt: Vec<u32>,
    /// References no table holds any more: blocks handed out by `pop_blocks_for_free` and
    /// not yet given back to `free_block_ids`. Only these may be freed by id, so a block a
    /// live table holds can never get a second owner.
    loose: Vec<u32>,
    /// Prefix tokens the block's hash covers (`block_hash_num_tokens`), 0 when unhashed.
    hash_tokens: Vec<u32>,
    /// Free blocks in eviction order.
    queue: FreeQueue,
    /// Retention level of each block (the `hit-aware` policy): where a cached block goes
    /// when freed. Empty under `exact`, whose queue has a single LRU level.
    level: Vec<Level>,
    /// Hit-aware: what a block proved since it was cached, as bits: [`FLAG_REUSED`] (served
    /// in a cache hit: never put on `LEVEL_PROBATION`) and [`FLAG_BRANCH`] (a Mamba state
    /// where requests branch off: kept when a request passes it). Cleared when the block
    /// loses its hash. Empty under `exact`.
    flags: Vec<u8>,
    /// Hit-aware, state-space hybrids: the hit units of the cached blocks (see
    /// [`HitUnits`]). Empty under `exact`.
    units: HitUnits,
    /// Hit-aware: the Mamba "align" groups that cached a state (a unit holds a state in each).
    state_groups: Vec<GroupId>,
    /// Hash keys of pinned prefixes: a block cached under one is freed at `LEVEL_PINNED`.
    pinned_keys: FxHashSet<HashKey>,
    /// Free cached blocks at `LEVEL_PINNED` (invariant: equals the count in the queue).
    pinned_free: u32,
    /// The most free cached blocks kept at `LEVEL_PINNED`: past it, the oldest is demoted to
    /// `LEVEL_NORMAL` (the pinned share of the pool).
    pinned_cap: u32,
    /// Cached blocks by hash key, and each block's hash key.
    index: PrefixIndex,
    /// Prefix caching on.
    enable_caching: bool,
    /// Record events.
    enable_events: bool,
    /// Events not yet taken.
    events: Vec<Event>,
    /// Record the residency log ([`Self::take_residency_log`]).
    record_residency: bool,
    /// Residency log entries not yet taken, in vLLM's call order.
    residency: Vec<(ResidencyOp, BlockId)>,
    /// Scratch buffers for `free_blocks` (kept to avoid allocating per call).
    scratch_first: Vec<BlockId>,
    scratch_last: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (`1..=MAX_NUM_BLOCKS`); block 0 is taken as the null
    /// block. Every per-block array is allocated here, fallibly.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the metadata of `num_blocks` blocks cannot be allocated.
    pub fn try_new(num_blocks: u32, enable_caching: bool, enable_events: bool) -> Result<Self> {
        Self::try_new_leveled(num_blocks, enable_caching, enable_events, false)
    }

    /// [`Self::try_new`], with a free queue split into retention levels when `leveled`
    /// (the `hit-aware` policy; see [`crate::policy`]).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the metadata of `num_blocks` blocks cannot be allocated.
    pub fn try_new_leveled(num_blocks: u32, enable_caching: bool, enable_events: bool, leveled: bool) -> Result<Self> {
        let oom = |what: &str| {
            let what = what.to_string();
            move |e: std::collections::TryReserveError| {
                Error::OutOfMemory(format!("{what} of a pool of {num_blocks} blocks: {e}"))
            }
        };
        let n = num_blocks as usize;
        // The largest buffers first, so a pool that cannot fit fails before memory is written.
        // Always built: it holds each block's hash key (the table of a pool without
        // caching stays empty).
        let index = PrefixIndex::try_with_capacity(n).map_err(oom("the prefix index"))?;
        let hash_tokens = try_filled(n, 0).map_err(oom("block hashes"))?;
        let mut queue = if leveled {
            FreeQueue::try_new_with_levels(num_blocks, NUM_LEVELS)
        } else {
            FreeQueue::try_new(num_blocks)
        }
        .map_err(oom("the free queue"))?;
        let level = if leveled { try_filled(n, LEVEL_NORMAL).map_err(oom("block levels"))? } else { Vec::new() };
        let flags = if leveled { try_filled(n, 0u8).map_err(oom("block flags"))? } else { Vec::new() };
        let units = if leveled { HitUnits::try_new(n).map_err(oom("hit units"))? } else { HitUnits::default() };
        let null = queue.pop_front();
        debug_assert_eq!(null, Some(NULL_BLOCK));
        Ok(Self {
            num_blocks,
            ref_cnt: try_filled(n, 0).map_err(oom("reference counts"))?,
            loose: try_filled(n, 0).map_err(oom("reference counts"))?,
            hash_tokens,
            queue,
            level,
            flags,
            units,
            state_groups: Vec::new(),
            pinned_keys: FxHashSet::default(),
            pinned_free: 0,
            pinned_cap: (num_blocks.saturating_sub(1)) / 4,
            index,
            enable_caching,
            enable_events,
            events: Vec::new(),
            record_residency: false,
            residency: Vec::new(),
            scratch_first: Vec::new(),
            scratch_last: Vec::new(),
        })
    }

    /// [`Self::try_new`] for sizes known to fit (tests).
    pub fn new(num_blocks: u32, enable_caching: bool, enable_events: bool) -> Self {
        Self::try_new(num_blocks, enable_caching, enable_events).expect("pool allocation")
    }

    /// Turns the residency log on or off (see [`ResidencyOp`]); entries not taken stay.
    pub fn set_residency_log(&mut self, on: bool) {
        self.record_residency = on;
    }

    /// Appends to the residency log when it is on.
    #[inline]
    fn note(&mut self, op: ResidencyOp, b: BlockId) {
        if self.record_residency {
            self.residency.push((op, b));
        }
    }

    /// Whether residency log entries wait.
    pub fn has_residency_log(&self) -> bool {
        !self.residency.is_empty()
    }

    /// Takes the residency log: the collector calls vLLM's pool would have made since the
    /// last take, in its order. Empty unless [`Self::set_residency_log`].
    pub fn take_residency_log(&mut self) -> Vec<(ResidencyOp, BlockId)> {
        std::mem::take(&mut self.residency)
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Free blocks (cached-but-unused ones included).
    #[inline]
    pub fn num_free_blocks(&self) -> u32 {
        self.queue.len()
    }

    /// Fraction of the pool in use, the null block excluded (vLLM's `get_usage`).
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - (self.num_free_blocks() as f64 / total as f64)
    }

    /// Reference count of `b`.
    pub fn ref_cnt(&self, b: BlockId) -> u32 {
        self.ref_cnt[b as usize]
    }

    /// References of `b` that no table holds (popped, not yet freed by id).
    pub fn loose_refs(&self, b: BlockId) -> u32 {
        self.loose[b as usize]
    }

    /// Marks one reference of each non-null block as loose (its table slot was popped).
    pub(crate) fn loosen(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if b != NULL_BLOCK {
                self.loose[b as usize] += 1;
            }
        }
    }

    /// Drops one loose reference from each block (the caller checked they exist), then
    /// frees them as [`Self::free_blocks`] does.
    pub(crate) fn free_loose(&mut self, ordered: &[BlockId]) {
        for &b in ordered {
            if b != NULL_BLOCK {
                self.loose[b as usize] -= 1;
            }
        }
        self.free_blocks(ordered.iter().copied());
    }

    /// [`Self::free_loose`] with vLLM 0.34's `free_blocks(..., evict_first=True)`: the blocks
    /// that become free, cached or not, go to the front of the free queue in `ordered`'s order
    /// (vLLM's `prepend_n`), so they are reused first. Under hit-aware a cached one goes to the
    /// front of the speculative level instead (pinned blocks and branch points keep theirs).
    /// O(blocks).
    pub(crate) fn free_loose_evict_first(&mut self, ordered: &[BlockId]) {
        let mut first = std::mem::take(&mut self.scratch_first);
        for &b in ordered {
            if b == NULL_BLOCK {
                continue;
            }
            self.loose[b as usize] -= 1;
            let rc = &mut self.ref_cnt[b as usize];
            assert!(*rc > 0, "free of block {b} whose reference count is 0");
            *rc -= 1;
            if *rc == 0 {
                if self.level.is_empty() || !self.index.is_keyed(b) || !self.enable_caching {
                    first.push(b);
                } else {
                    self.queue_cached(b);
                    self.evict_first(b);
                }
            }
        }
        self.queue.push_front_n(&first);
        if self.pinned_free > self.pinned_cap {
            self.enforce_pinned_cap();
        }
        first.clear();
        self.scratch_first = first;
    }

    /// Hash key of `b`, if cached.
    pub fn block_hash(&self, b: BlockId) -> Option<&HashKey> {
        self.index.key_of(b)
    }

    /// Prefix tokens covered by `b`'s hash (0 when unhashed).
    pub fn block_hash_num_tokens(&self, b: BlockId) -> u32 {
        self.hash_tokens[b as usize]
    }

    /// Free blocks in eviction order (tests).
    pub fn free_queue_order(&self) -> Vec<BlockId> {
        self.queue.iter().collect()
    }

    /// Whether the free queue has retention levels (the `hit-aware` policy).
    #[inline]
    pub fn is_leveled(&self) -> bool {
        !self.level.is_empty()
    }

    /// Whether `key` is a pinned prefix's (hit-aware; always false under `exact`).
    pub fn is_pinned_key(&self, key: &HashKey) -> bool {
        !self.pinned_keys.is_empty() && self.pinned_keys.contains(key)
    }

    /// Hit-aware: whether `b` was served in a cache hit since it was cached (false under
    /// `exact`).
    pub fn reused(&self, b: BlockId) -> bool {
        self.flags.get(b as usize).is_some_and(|f| f & FLAG_REUSED != 0)
    }

    /// Hit-aware: whether `b` (a Mamba state) was marked a branch point since it was cached
    /// ([`Self::mark_branch`]; false under `exact`).
    pub fn is_branch(&self, b: BlockId) -> bool {
        self.flags.get(b as usize).is_some_and(|f| f & FLAG_BRANCH != 0)
    }

    /// Hit-aware: marks cached block `b` a branch point until it loses its hash (no-op under
    /// `exact` or for an unhashed block).
    pub(crate) fn mark_branch(&mut self, b: BlockId) {
        self.set_flag(b, FLAG_BRANCH);
    }

    /// Hit-aware: whether `b` ended a finished request's cached sequence since it was cached
    /// ([`Self::mark_tail`]; false under `exact`).
    pub fn is_tail(&self, b: BlockId) -> bool {
        self.flags.get(b as usize).is_some_and(|f| f & FLAG_TAIL != 0)
    }

    /// Hit-aware: marks cached block `b` as the end of a finished request's cached sequence
    /// until it loses its hash (no-op under `exact` or for an unhashed block).
    pub(crate) fn mark_tail(&mut self, b: BlockId) {
        self.set_flag(b, FLAG_TAIL);
    }

    fn set_flag(&mut self, b: BlockId, flag: u8) {
        if self.index.is_keyed(b) {
            if let Some(f) = self.flags.get_mut(b as usize) {
                *f |= flag;
            }
        }
    }

    /// Hit-aware: records that Mamba "align" group `g` caches states (the groups a hit unit
    /// holds a state in). O(groups).
    pub(crate) fn note_state_group(&mut self, g: GroupId) {
        if !self.level.is_empty() && !self.state_groups.contains(&g) {
            self.state_groups.push(g);
        }
    }

    /// Hit-aware: the Mamba "align" groups that cached a state (empty under `exact` and
    /// without Mamba groups).
    pub fn state_groups(&self) -> &[GroupId] {
        &self.state_groups
    }

    /// Hit-aware: the state blocks cached under `hash` in every state group (empty when any
    /// is missing).
    pub(crate) fn state_set(&self, hash: &BlockHash) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.state_groups.len());
        if !self.get_cached_block(hash, &self.state_groups, &mut out) {
            out.clear();
        }
        out
    }

    /// Hit-aware: forms a hit unit of cached `states` and the cached full-attention `prefix`
    /// before them (see [`HitUnits`]). No-op under `exact`.
    pub(crate) fn form_unit(&mut self, states: &[BlockId], prefix: &[BlockId]) {
        let keyed = |pool: &Self, bs: &[BlockId]| -> Option<Vec<(BlockId, HashKey)>> {
            bs.iter().map(|&b| pool.index.key_of(b).map(|&k| (b, k))).collect()
        };
        if let (Some(st), Some(pre)) = (keyed(self, states), keyed(self, prefix)) {
            let index = &self.index;
            self.units.form(st, pre, &mut |m| index.key_of(m.0) == Some(&m.1));
        }
    }

    /// Hit-aware: live hit units holding full-attention block `b` in their prefix.
    pub fn unit_support(&self, b: BlockId) -> u32 {
        self.units.support(b)
    }

    /// `b` is about to lose its hash: the unit naming it is dissolved and its members that
    /// no live unit needs any more are evicted first ([`Self::evict_first`]), except a
    /// full-attention block at which another state set is cached.
    fn orphan_unit_of(&mut self, b: BlockId) {
        let mut orphans = Vec::new();
        let index = &self.index;
        self.units.lose(b, &mut |m| index.key_of(m.0) == Some(&m.1), &mut orphans);
        for m in orphans {
            // A full-attention block that ends where a state set other than `b`'s is cached
            // (a shared prefix's junction) still serves hits there.
            if let Some(&key) = self.index.key_of(m) {
                if !self.state_groups.contains(&key.1) {
                    let st = self.state_set(&key.0);
                    if !st.is_empty() && !st.contains(&b) {
                        continue;
                    }
                }
            }
            self.evict_first(m);
        }
    }

    /// Hit-aware: cached block `b` serves no hit (a member of a lost unit): it goes to
    /// [`LEVEL_SPECULATIVE`], at the front of the queue when free. Pinned blocks and branch
    /// points keep their level. O(1).
    pub(crate) fn evict_first(&mut self, b: BlockId) {
        if self.level.is_empty() || b == NULL_BLOCK || self.level[b as usize] >= LEVEL_PINNED || self.is_branch(b) {
            return;
        }
        let queued = self.ref_cnt[b as usize] == 0 && self.index.is_keyed(b);
        if queued {
            self.unqueue_cached(b);
        }
        self.level[b as usize] = LEVEL_SPECULATIVE;
        if queued {
            self.queue.push_front_level(b, LEVEL_SPECULATIVE);
        }
    }

    /// Retention level of `b` (`LEVEL_NORMAL` without levels).
    pub fn level(&self, b: BlockId) -> Level {
        self.level.get(b as usize).copied().unwrap_or(LEVEL_NORMAL)
    }

    /// Sets the retention level `b` gets when freed; a free block moves to the back of its
    /// new level now. No-op without levels or for the null block.
    pub(crate) fn set_level(&mut self, b: BlockId, lvl: Level) {
        if self.level.is_empty() || b == NULL_BLOCK {
            return;
        }
        let queued = self.ref_cnt[b as usize] == 0 && self.index.is_keyed(b);
        if queued {
            self.unqueue_cached(b);
        }
        self.level[b as usize] = lvl;
        if queued {
            self.queue_cached(b);
            self.enforce_pinned_cap();
        }
    }

    /// Whether `b` (free) counts in `pinned_free`.
    #[inline]
    fn counts_pinned(&self, b: BlockId) -> bool {
        !self.level.is_empty() && self.level[b as usize] == LEVEL_PINNED && self.index.is_keyed(b)
    }

    /// Takes a free cached block out of the queue (leveled pools), keeping the count.
    fn unqueue_cached(&mut self, b: BlockId) {
        if self.counts_pinned(b) {
            self.pinned_free -= 1;
        }
        self.queue.remove(b);
    }

    /// Queues a free cached block at the back of its level (at the front for
    /// `LEVEL_PROBATION`; a pinned key raises it to `LEVEL_PINNED`), keeping the count.
    fn queue_cached(&mut self, b: BlockId) {
        if !self.pinned_keys.is_empty() {
            if let Some(k) = self.index.key_of(b) {
                if self.pinned_keys.contains(k) {
                    self.level[b as usize] = LEVEL_PINNED;
                }
            }
        }
        if self.counts_pinned(b) {
            self.pinned_free += 1;
        }
        let lvl = self.level[b as usize];
        if lvl == LEVEL_PROBATION || lvl == crate::policy::LEVEL_RESUMED {
            // Newest first: under a cyclic load larger than the cache (round-robin chat) the
            // unproven sessions that waited longest, and come back next, keep their blocks.
            self.queue.push_front_level(b, lvl);
        } else {
            self.queue.push_back_level(b, lvl);
        }
    }

    /// Demotes the oldest free pinned blocks to `LEVEL_NORMAL` while more than
    /// `pinned_cap` are free (a pinned key's block too: the share is a bound).
    fn enforce_pinned_cap(&mut self) {
        while self.pinned_free > self.pinned_cap {
            let b = self.queue.first_in_level(LEVEL_PINNED).expect("pinned count above the pinned level's length");
            if self.counts_pinned(b) {
                self.pinned_free -= 1;
            }
            self.queue.remove(b);
            self.level[b as usize] = LEVEL_NORMAL;
            if self.index.is_keyed(b) {
                self.queue.push_back_level(b, LEVEL_NORMAL);
            } else {
                self.queue.push_front_n(&[b]);
            }
        }
    }

    /// Pins hash keys (a prefix's, see [`crate::Allocator::pin_prefix`]): a block cached
    /// under one is freed at `LEVEL_PINNED`; one cached now moves there now. Returns the
    /// keys pinned in all.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the pinned keys would exceed the pinned share (nothing
    /// changes).
    pub(crate) fn pin_keys(&mut self, mut keys: Vec<HashKey>) -> Result<u32> {
        keys.retain(|k| !self.pinned_keys.contains(k));
        keys.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()).then(a.1.cmp(&b.1)));
        keys.dedup();
        let total = self.pinned_keys.len() as u64 + keys.len() as u64;
        if total > self.pinned_cap as u64 {
            return Err(Error::OutOfRange(format!(
                "pinning {} more blocks would pin {total}, above the pinned share of {} blocks",
                keys.len(),
                self.pinned_cap
            )));
        }
        for k in &keys {
            self.pinned_keys.insert(*k);
            if let Some(b) = self.index.get_one(k) {
                self.set_level(b, LEVEL_PINNED);
            }
        }
        Ok(total as u32)
    }

    /// Sets the pinned share of the pool (`0.0..=1.0`): at most that fraction of the blocks
    /// may be pinned keys, or free at `LEVEL_PINNED` (past it the oldest free pinned block
    /// is demoted to `LEVEL_NORMAL`).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a share outside `0.0..=1.0` or below the keys pinned.
    pub(crate) fn set_pinned_share(&mut self, share: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&share) {
            return Err(Error::OutOfRange(format!("pinned share {share} is outside 0.0..=1.0")));
        }
        let cap = ((self.num_blocks - 1) as f64 * share).floor() as u32;
        if (self.pinned_keys.len() as u64) > cap as u64 {
            return Err(Error::OutOfRange(format!(
                "a pinned share of {cap} blocks is below the {} blocks already pinned",
                self.pinned_keys.len()
            )));
        }
        self.pinned_cap = cap;
        self.enforce_pinned_cap();
        Ok(())
    }

    /// The free queue (invariant checks).
    pub(crate) fn queue(&self) -> &FreeQueue {
        &self.queue
    }

    /// The prefix index (invariant checks).
    pub(crate) fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The pinned share in blocks.
    pub fn pinned_cap(&self) -> u32 {
        self.pinned_cap
    }

    /// Free cached blocks at `LEVEL_PINNED`.
    pub fn pinned_free(&self) -> u32 {
        self.pinned_free
    }

    /// The first cached block for `hash` in every group of `groups`, or `None` on any miss
    /// (vLLM's `get_cached_block`). Writes into `out` (cleared first).
    #[inline]
    pub fn get_cached_block(&self, hash: &BlockHash, groups: &[GroupId], out: &mut Vec<BlockId>) -> bool {
        out.clear();
        for &g in groups {
            match self.index.get_one(&(*hash, g)) {
                Some(b) => out.push(b),
                None => return false,
            }
        }
        true
    }

    /// Pops `n` blocks from the front of the free queue, evicting their cached hashes,
    /// and gives each a reference; appends them to `out`. The caller has checked
    /// `n <= num_free_blocks()`.
    pub fn get_new_blocks(&mut self, n: u32, out: &mut Vec<BlockId>) {
        assert!(n <= self.num_free_blocks(), "get_new_blocks: {n} blocks asked, fewer free");
        for _ in 0..n {
            let b = self.queue.pop_front().expect("free queue shorter than its count");
            if self.counts_pinned(b) {
                self.pinned_free -= 1;
            }
            if self.enable_caching {
                self.maybe_evict_cached_block(b);
            }
            assert_eq!(self.ref_cnt[b as usize], 0, "free block {b} had references");
            self.ref_cnt[b as usize] = 1;
            self.note(ResidencyOp::Allocated, b);
            out.push(b);
        }
    }

    /// vLLM's `_maybe_evict_cached_block`: reports `b` evicted to the residency log, then
    /// drops its hash ([`Self::remove_cached_block_hashes`]); returns whether it had one.
    pub fn maybe_evict_cached_block(&mut self, b: BlockId) -> bool {
        self.note(ResidencyOp::Evicted, b);
        self.remove_cached_block_hashes(b)
    }

    /// Drops `b`'s hash from the prefix index (emitting `Removed`); returns whether it had one
    /// (vLLM's `_remove_cached_block_hashes` with its events, which reports nothing to the
    /// metrics collector: re-keying a block in `cache_partial_block` uses this).
    pub fn remove_cached_block_hashes(&mut self, b: BlockId) -> bool {
        if self.ref_cnt[b as usize] == 0 && b != NULL_BLOCK && self.counts_pinned(b) && self.queue.contains(b) {
            self.pinned_free -= 1;
        }
        if self.units.in_unit(b) {
            self.orphan_unit_of(b);
        }
        let Some(&(hash, group)) = self.index.remove_block(b) else { return false };
        if self.enable_events {
            self.events.push(Event::Removed { hash, group });
        }
        self.hash_tokens[b as usize] = 0;
        if let Some(f) = self.flags.get_mut(b as usize) {
            *f = 0;
        }
        true
    }

    /// Takes a reference on each block (a cache hit), pulling free ones out of the queue.
    /// Each block, the null block included, is reported accessed to the residency log.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.note(ResidencyOp::Accessed, b);
            if b == NULL_BLOCK {
                continue;
            }
            if self.ref_cnt[b as usize] == 0 {
                if self.counts_pinned(b) {
                    self.pinned_free -= 1;
                }
                self.queue.remove(b);
            }
            self.ref_cnt[b as usize] += 1;
            if let Some(f) = self.flags.get_mut(b as usize) {
                *f |= FLAG_REUSED;
            }
        }
    }

    /// Drops one reference from each block, in eviction-priority order: blocks reaching 0
    /// go to the front of the queue when unhashed (or caching is off), to the back when
    /// hashed (vLLM's `free_blocks`). The caller guarantees each non-null block has a
    /// reference to drop.
    pub fn free_blocks<I: IntoIterator<Item = BlockId>>(&mut self, ordered: I) {
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut last = std::mem::take(&mut self.scratch_last);
        for b in ordered {
            if b == NULL_BLOCK {
                continue;
            }
            let rc = &mut self.ref_cnt[b as usize];
            assert!(*rc > 0, "free of block {b} whose reference count is 0");
            *rc -= 1;
            if *rc == 0 {
                if !self.index.is_keyed(b) || !self.enable_caching {
                    first.push(b);
                } else if self.level.is_empty() {
                    last.push(b);
                } else {
                    self.queue_cached(b);
                }
            }
        }
        self.queue.push_front_n(&first);
        self.queue.push_back_n(&last);
        if self.pinned_free > self.pinned_cap {
            self.enforce_pinned_cap();
        }
        first.clear();
        last.clear();
        self.scratch_first = first;
        self.scratch_last = last;
    }

    /// Caches blocks `range` (`num_cached..num_full`) of a table (vLLM's
    /// `cache_full_blocks`): each non-null, unmasked block gets the hash of its position and
    /// joins the index. `mask[i - num_cached]` false skips block `i`; `hash_of(i)` gives
    /// the hash of table block `i` at this group's block size.
    pub fn cache_full_blocks(
        &mut self,
        t: &TableRef<'_>,
        range: std::ops::Range<u32>,
        mask: Option<&[bool]>,
        hash_of: impl Fn(u32) -> BlockHash,
    ) {
        let TableRef { req, group, block_size, blocks } = *t;
        let (num_cached, num_full) = (range.start, range.end);
        if num_cached >= num_full {
            return;
        }
        let mut ev_hashes = Vec::new();
        let mut ev_idx = Vec::new();
        for i in num_cached..num_full {
            let b = blocks[i as usize];
            if b == NULL_BLOCK {
                continue;
            }
            if let Some(m) = mask {
                if !m[(i - num_cached) as usize] {
                    continue;
                }
            }
            let h = hash_of(i);
            let key = (h, group);
            assert!(
                !self.index.is_keyed(b),
                "cache_full_blocks: block {b} already cached (partial promotion is not served)"
            );
            self.hash_tokens[b as usize] = (i + 1) * block_size;
            if let Some(l) = self.level.get_mut(b as usize) {
                *l = LEVEL_NORMAL;
            }
            self.index.insert(key, b);
            if self.enable_events {
                ev_hashes.push(h);
                ev_idx.push(i);
            }
        }
        if self.enable_events {
            let parent = if num_cached == 0 { None } else { Some(hash_of(num_cached - 1)) };
            self.events.push(Event::Stored {
                req,
                group,
                block_size,
                start_token: num_cached * block_size,
                end_token: num_full * block_size,
                parent,
                hashes: ev_hashes,
                block_indices: ev_idx,
            });
        }
    }

    /// Keys one block under `o.key` for a prefix of `o.num_tokens` tokens, one block of
    /// `o.block_size` ending there (vLLM's `cache_partial_block` for a block that holds no
    /// hash yet), emitting `Stored` with `o.parent`. Returns `false`, changing nothing,
    /// when the block already holds a hash.
    pub fn cache_one_block(&mut self, o: &OneBlock) -> bool {
        let OneBlock { req, block: b, index: idx, key, num_tokens, block_size, parent } = *o;
        if b == NULL_BLOCK || self.index.is_keyed(b) {
            return false;
        }
        self.hash_tokens[b as usize] = num_tokens;
        self.index.insert(key, b);
        if self.enable_events {
            self.events.push(Event::Stored {
                req,
                group: key.1,
                block_size,
                start_token: num_tokens - block_size,
                end_token: num_tokens,
                parent,
                hashes: vec![key.0],
                block_indices: vec![idx],
            });
        }
        true
    }

    /// Drops the hashes of the given blocks from the prefix cache; blocks in use stay
    /// allocated (vLLM's `evict_blocks`). Ids were range-checked by the caller.
    pub fn evict_blocks(&mut self, ids: &[BlockId]) {
        for &b in ids {
            self.maybe_evict_cached_block(b);
        }
    }

    /// Clears the prefix cache if every block but the null block is free; returns whether
    /// it did (vLLM's `reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        let used = self.num_blocks - self.num_free_blocks();
        if used != 1 {
            return false;
        }
        self.index.clear(); // keeps its capacity
        for t in self.hash_tokens.iter_mut() {
            *t = 0;
        }
        for f in self.flags.iter_mut() {
            *f = 0;
        }
        self.units.clear();
        self.pinned_free = 0;
        self.note(ResidencyOp::Reset, NULL_BLOCK);
        if self.enable_events {
            self.events.push(Event::AllCleared);
        }
        true
    }

    /// Whether any event waits.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Takes every queued event.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_pool_reserves_null_block() {
        let p = BlockPool::new(4, true, false);
        assert_eq!(p.num_free_blocks(), 3);
        assert_eq!(p.free_queue_order(), vec![1, 2, 3]);
        assert_eq!(p.usage(), 0.0);
    }

    #[test]
    fn free_blocks_unhashed_front_hashed_back() {
        let mut p = BlockPool::new(6, true, true);
        let mut got = Vec::new();
        p.get_new_blocks(4, &mut got);
        assert_eq!(got, vec![1, 2, 3, 4]);
        p.cache_full_blocks(&TableRef { req: 0, group: 0, block_size: 16, blocks: &got }, 0..2, None, |i| {
            BlockHash::from_u64(i as u64 + 100)
        });
        // Free the table tail first, as a request does.
        p.free_blocks(got.iter().rev().copied());
        // Unhashed 4, 3 go to the front in that order; hashed 2, 1 to the back.
        assert_eq!(p.free_queue_order(), vec![4, 3, 5, 2, 1]);
        let ev = p.take_events();
        assert_eq!(ev.len(), 1);
        assert!(matches!(&ev[0], Event::Stored { hashes, parent: None, .. } if hashes.len() == 2));
    }

    #[test]
    fn get_new_blocks_evicts_lazily_with_event() {
        let mut p = BlockPool::new(3, true, true);
        let mut got = Vec::new();
        p.get_new_blocks(2, &mut got);
        p.cache_full_blocks(&TableRef { req: 0, group: 1, block_size: 16, blocks: &got }, 0..2, None, |i| {
            BlockHash::from_u64(i as u64)
        });
        p.free_blocks(got.iter().rev().copied());
        p.take_events();
        let mut again = Vec::new();
        p.get_new_blocks(1, &mut again);
        // The tail block (2) was freed first, so it is evicted first.
        assert_eq!(again, vec![2]);
        assert!(p.block_hash(2).is_none());
        assert_eq!(p.take_events(), vec![Event::Removed { hash: BlockHash::from_u64(1), group: 1 }]);
        let mut hit = Vec::new();
        assert!(p.get_cached_block(&BlockHash::from_u64(0), &[1], &mut hit));
        assert_eq!(hit, vec![1]);
        assert!(!p.get_cached_block(&BlockHash::from_u64(1), &[1], &mut hit));
    }

    #[test]
    fn touch_pulls_free_block_out_of_queue() {
        let mut p = BlockPool::new(4, true, false);
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        p.free_blocks([1]);
        assert_eq!(p.num_free_blocks(), 3);
        p.touch(&[1, NULL_BLOCK]);
        assert_eq!(p.ref_cnt(1), 1);
        assert_eq!(p.num_free_blocks(), 2);
    }

    #[test]
    fn residency_log_follows_vllm_pool_calls() {
        use ResidencyOp::*;
        let mut p = BlockPool::new(4, true, false);
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        assert!(!p.has_residency_log(), "off by default");
        p.set_residency_log(true);
        p.get_new_blocks(1, &mut got);
        p.cache_full_blocks(&TableRef { req: 0, group: 0, block_size: 16, blocks: &got }, 0..2, None, |i| {
            BlockHash::from_u64(i as u64)
        });
        p.free_blocks([2, 1]);
        p.touch(&[NULL_BLOCK, 1]);
        // Block 3 first (free, unhashed), then 2 (cached): evicted before allocated, each.
        got.clear();
        p.get_new_blocks(2, &mut got);
        assert_eq!(got, vec![3, 2]);
        p.remove_cached_block_hashes(1);
        p.evict_blocks(&[1]);
        assert!(!p.reset_prefix_cache(), "blocks in use: no reset reported");
        p.free_blocks([1, 2, 3]);
        assert!(p.reset_prefix_cache());
        let log = p.take_residency_log();
        assert_eq!(
            log,
            vec![
                (Evicted, 2),
                (Allocated, 2),
                (Accessed, NULL_BLOCK),
                (Accessed, 1),
                (Evicted, 3),
                (Allocated, 3),
                (Evicted, 2),
                (Allocated, 2),
                (Evicted, 1),
                (Reset, NULL_BLOCK),
            ]
        );
        assert!(!p.has_residency_log());
    }

    #[test]
    fn reset_prefix_cache_refuses_when_blocks_in_use() {
        let mut p = BlockPool::new(4, true, true);
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        assert!(!p.reset_prefix_cache());
        p.free_blocks([1]);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.take_events(), vec![Event::AllCleared]);
    }
}
