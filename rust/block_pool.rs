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
//! The pool holds no policy. Under `hit-aware` it holds the policy's state
//! ([`crate::policy::Retention`], `None` under `exact`) and calls it at one named hook in
//! each pool operation whose exact path it changes: `get_new_blocks` (`popped`), `touch`
//! (`touched`), `free_blocks` (`freed`), `remove_cached_block_hashes` (`unkeying`),
//! `cache_full_blocks` and `cache_one_block` (`keyed`), `move_block_hashes` (`unkeying`,
//! `keyed`) and `reset_prefix_cache` (`reset`). The policy's decisions the managers and the
//! coordinator take (levels, flags, units, pins) go through one handle it lends,
//! `BlockPool::hit_aware` (`None` under `exact`: nothing to decide), and its state is
//! read through [`BlockPool::retention`].
//!
//! Cost: `get_new_blocks` O(n) (each popped block's lazy eviction O(1), plus, under
//! hit-aware with Mamba groups, O(members) when it dissolves a hit unit); `touch`,
//! `free_blocks` O(blocks given); `cache_full_blocks` O(blocks cached); `reset` O(`num_blocks`).
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::free_queue::{try_filled, FreeQueue};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, NULL_BLOCK};
use crate::policy::retention::{HitAware, PoolParts};
use crate::policy::{Retention, NUM_LEVELS};
use crate::prefix_index::{HashKey, PrefixIndex};

/// The pool's parts the policy works on ([`PoolParts`]), lent for one hook call; borrows
/// the fields apart from `retention`.
macro_rules! parts {
    ($pool:ident) => {
        PoolParts {
            queue: &mut $pool.queue,
            index: &$pool.index,
            ref_cnt: &$pool.ref_cnt,
            hash_tokens: &$pool.hash_tokens,
        }
    };
}

mod pages;
pub(crate) use pages::Pages;

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
pub(crate) struct OneBlock {
    /// The request (events name it).
    pub(crate) req: ReqHandle,
    /// The block keyed.
    pub(crate) block: BlockId,
    /// Its index in the request's table.
    pub(crate) index: u32,
    /// The key (the hash of the prefix ending at the block, and the group).
    pub(crate) key: HashKey,
    /// Prefix tokens the key covers.
    pub(crate) num_tokens: u32,
    /// Tokens per block of the group.
    pub(crate) block_size: u32,
    /// The hash of the block before it, if any (the event's parent).
    pub(crate) parent: Option<BlockHash>,
}

/// Second keys of blocks (vLLM's `cached_block_hashes_by_block`, and their entries in its
/// `cached_block_hash_to_block`): by key, the blocks holding it as a second key with their
/// insertion stamps, in insertion order; by block, its second keys in insertion order.
/// Only partial hash hits make any (a handful: one per promoted prompt-tail block).
#[derive(Clone, Debug, Default)]
struct SecondKeys {
    by_key: rustc_hash::FxHashMap<HashKey, Vec<(u64, BlockId)>>,
    by_block: rustc_hash::FxHashMap<BlockId, Vec<HashKey>>,
}

impl SecondKeys {
    #[inline]
    fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    fn contains(&self, key: &HashKey, b: BlockId) -> bool {
        !self.is_empty() && self.by_block.get(&b).is_some_and(|ks| ks.contains(key))
    }

    fn insert(&mut self, key: HashKey, b: BlockId, seq: u64) {
        self.by_key.entry(key).or_default().push((seq, b));
        self.by_block.entry(b).or_default().push(key);
    }

    /// Drops `b`'s second keys, returning them in insertion order.
    fn remove_block(&mut self, b: BlockId) -> Vec<HashKey> {
        let keys = self.by_block.remove(&b).unwrap_or_default();
        for k in &keys {
            if let Some(v) = self.by_key.get_mut(k) {
                v.retain(|&(_, x)| x != b);
                if v.is_empty() {
                    self.by_key.remove(k);
                }
            }
        }
        keys
    }

    /// The earliest-keyed block under `key`: `primary` (the index's, stamped in `seq`) or
    /// the first block holding it as a second key.
    fn earliest(&self, key: &HashKey, primary: Option<BlockId>, seq: &[u64]) -> Option<BlockId> {
        match (primary, self.by_key.get(key).and_then(|v| v.first())) {
            (Some(p), Some(&(s, b))) => Some(if s < seq[p as usize] { b } else { p }),
            (p, None) => p,
            (None, Some(&(_, b))) => Some(b),
        }
    }
}

/// The arena of blocks with their free queue and prefix index.
#[derive(Clone, Debug)]
pub struct BlockPool {
    /// Blocks in the pool, the null block included.
    num_blocks: u32,
    /// Reference count of each block: table slots holding it plus `loose[b]`.
    ref_cnt: Vec<u32>,
    /// References no table holds: blocks handed out by `pop_blocks_for_free`, or pinned by
    /// `touch_block_ids` (a connector's `block_pool.touch`), not yet given back to
    /// `free_block_ids`. Only these may be freed by id, so a block a live table holds can
    /// never get a second owner.
    loose: Vec<u32>,
    /// Prefix tokens the block's hash covers (`block_hash_num_tokens`), 0 when unhashed.
    hash_tokens: Vec<u32>,
    /// Free blocks in eviction order (split into retention levels under `hit-aware`).
    queue: FreeQueue,
    /// The hit-aware policy's per-block state, called at the hooks (see the module docs);
    /// `None` under `exact`, whose queue has a single LRU level.
    retention: Option<Retention>,
    /// Cached blocks by hash key, and each block's hash key.
    index: PrefixIndex,
    /// `seq[b]`: when `b` got its key (an insertion counter), to order it against the
    /// second keys below (vLLM's one dict keeps insertion order across both).
    seq: Vec<u64>,
    /// The next insertion's `seq`.
    next_seq: u64,
    /// Stamp every key's insertion in `seq` (partial hash hits, where second keys are common;
    /// see [`Self::set_stamp_keys`]). Off, only second keys are stamped and a block's own key
    /// counts as older than any second key (one random write less per cached block).
    stamp_keys: bool,
    /// Second keys (vLLM's `cached_block_hashes_by_block`): a block keyed for a longer
    /// prefix that is also keyed at a partial boundary inside it (with partial hash hits:
    /// a prompt's tail block, promoted to its full key, keeps its partial key). Empty
    /// otherwise, so lookups and evictions skip it with one branch.
    second: SecondKeys,
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
    /// Two-level pages (`pages.rs`), on the slot pool only: the page pool and each page's
    /// state, called at the hooks where a slot is handed out, touched or freed. `None`
    /// (one untaken branch per operation) for every other pool.
    pages: Option<Box<Pages>>,
    /// The page pool of two-level pages only: the pages `get_new_blocks` handed out since
    /// the slot pool last settled them (`Pages::settle`: a page that held slots loses
    /// their keys). `None` for every other pool.
    taken: Option<Vec<BlockId>>,
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
    pub(crate) fn try_new_leveled(
        num_blocks: u32,
        enable_caching: bool,
        enable_events: bool,
        leveled: bool,
    ) -> Result<Self> {
        Self::build(num_blocks, enable_caching, enable_events, leveled, false)
    }

    /// The pool's arrays; `empty`: the free queue starts empty (the slot pool of two-level
    /// pages, whose slots join the queue as their pages open).
    fn build(num_blocks: u32, enable_caching: bool, enable_events: bool, leveled: bool, empty: bool) -> Result<Self> {
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
        let mut queue = if empty && leveled {
            FreeQueue::try_new_empty_with_levels(num_blocks, NUM_LEVELS)
        } else if empty {
            FreeQueue::try_new_empty(num_blocks)
        } else if leveled {
            FreeQueue::try_new_with_levels(num_blocks, NUM_LEVELS)
        } else {
            FreeQueue::try_new(num_blocks)
        }
        .map_err(oom("the free queue"))?;
        let retention = if leveled { Some(Retention::try_new(num_blocks)?) } else { None };
        if !empty {
            let null = queue.pop_front();
            debug_assert_eq!(null, Some(NULL_BLOCK));
        }
        Ok(Self {
            num_blocks,
            ref_cnt: try_filled(n, 0).map_err(oom("reference counts"))?,
            loose: try_filled(n, 0).map_err(oom("reference counts"))?,
            hash_tokens,
            queue,
            retention,
            index,
            seq: try_filled(n, 0).map_err(oom("block hashes"))?,
            next_seq: 0,
            stamp_keys: false,
            second: SecondKeys::default(),
            enable_caching,
            enable_events,
            events: Vec::new(),
            record_residency: false,
            residency: Vec::new(),
            scratch_first: Vec::new(),
            scratch_last: Vec::new(),
            pages: None,
            taken: None,
        })
    }

    /// [`Self::try_new`] for sizes known to fit (tests).
    pub fn new(num_blocks: u32, enable_caching: bool, enable_events: bool) -> Self {
        Self::try_new(num_blocks, enable_caching, enable_events).expect("pool allocation")
    }

    /// Turns the residency log on or off (see [`ResidencyOp`]); entries not taken stay.
    pub(crate) fn set_residency_log(&mut self, on: bool) {
        self.record_residency = on;
        if let Some(p) = &mut self.pages {
            p.s.set_residency_log(on);
        }
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
        !self.residency.is_empty() || self.pages.as_ref().is_some_and(|p| p.s.has_residency_log())
    }

    /// Takes the residency log: the collector calls vLLM's pool would have made since the
    /// last take, in its order. Empty unless the log is on (`set_residency_log`).
    /// With two-level pages the slot pool's entries come first, then the page pool's, each
    /// page `p` written `num_blocks + p` (after every slot id), so a collector keyed by id
    /// never mixes a slot with a page.
    pub fn take_residency_log(&mut self) -> Vec<(ResidencyOp, BlockId)> {
        let mut log = std::mem::take(&mut self.residency);
        if let Some(p) = &mut self.pages {
            let n = self.num_blocks;
            log.extend(p.s.take_residency_log().into_iter().map(|(op, b)| (op, n + b)));
        }
        log
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
        if self.pages.is_some() {
            for &b in ordered {
                if b != NULL_BLOCK {
                    self.loose[b as usize] -= 1;
                }
            }
            return self.free_slots(ordered.iter().copied(), true);
        }
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut cached = std::mem::take(&mut self.scratch_last);
        let leveled = self.retention.is_some() && self.enable_caching;
        for &b in ordered {
            if b == NULL_BLOCK {
                continue;
            }
            self.loose[b as usize] -= 1;
            let rc = &mut self.ref_cnt[b as usize];
            assert!(*rc > 0, "free of block {b} whose reference count is 0");
            *rc -= 1;
            if *rc == 0 {
                if leveled && self.index.is_keyed(b) {
                    cached.push(b);
                } else {
                    first.push(b);
                }
            }
        }
        match &mut self.retention {
            Some(r) => r.freed(&first, &cached, true, parts!(self)),
            None => self.queue.push_front_n(&first),
        }
        first.clear();
        cached.clear();
        self.scratch_first = first;
        self.scratch_last = cached;
    }

    /// Hash key of `b`, if cached.
    pub fn block_hash(&self, b: BlockId) -> Option<&HashKey> {
        self.index.key_of(b)
    }

    /// Prefix tokens covered by `b`'s hash (0 when unhashed).
    pub fn block_hash_num_tokens(&self, b: BlockId) -> u32 {
        self.hash_tokens[b as usize]
    }

    /// The keys `b` holds besides its own (partial hash hits' second keys), in the order they
    /// were added (vLLM's `cached_block_hashes_by_block[b]`); empty for most blocks. O(keys).
    pub fn second_keys_of(&self, b: BlockId) -> &[HashKey] {
        if self.second.is_empty() {
            return &[];
        }
        self.second.by_block.get(&b).map_or(&[], Vec::as_slice)
    }

    /// Free blocks in eviction order (tests).
    pub fn free_queue_order(&self) -> Vec<BlockId> {
        self.queue.iter().collect()
    }

    /// Up to `max` free blocks after `after` (from the front when `None`), in eviction order:
    /// one chunk of vLLM's `free_block_queue.iter_blocks_after`; empty when `after` is not
    /// free. O(blocks returned).
    pub fn free_queue_after(&self, after: Option<BlockId>, max: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(max.min(self.queue.len() as usize));
        self.queue.extend_after(after, max, &mut out);
        out
    }

    /// The free queue (invariant checks).
    pub(crate) fn queue(&self) -> &FreeQueue {
        &self.queue
    }

    /// The prefix index (invariant checks).
    pub(crate) fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The first cached block for `hash` in every group of `groups`, or `None` on any miss
    /// (vLLM's `get_cached_block`). Writes into `out` (cleared first).
    #[inline]
    pub fn get_cached_block(&self, hash: &BlockHash, groups: &[GroupId], out: &mut Vec<BlockId>) -> bool {
        out.clear();
        for &g in groups {
            let key = (*hash, g);
            let first = self.index.get_one(&key);
            let first = if self.second.is_empty() { first } else { self.earliest_with_second(&key, first) };
            match first {
                Some(b) => out.push(b),
                None => return false,
            }
        }
        true
    }

    /// Whether [`Self::get_cached_block`] of `key`'s hash in `key`'s group alone would find
    /// `b`: `b` is the earliest block cached under `key` and no block holds a second key (a
    /// second key may make an earlier block the one found). O(1), with no hashing; false
    /// tells the caller to look the key up.
    #[inline]
    pub(crate) fn is_first_cached(&self, b: BlockId, key: &HashKey) -> bool {
        self.second.is_empty() && self.index.is_first_under(b, key)
    }

    /// [`SecondKeys::earliest`], out of the lookup's line (only partial hash hits reach it).
    #[cold]
    #[inline(never)]
    fn earliest_with_second(&self, key: &HashKey, primary: Option<BlockId>) -> Option<BlockId> {
        self.second.earliest(key, primary, &self.seq)
    }

    /// Whether `b` is cached under `key`, as its key or a second key (vLLM's
    /// `cached_block_hash_to_block.contain`).
    pub(crate) fn holds_key(&self, b: BlockId, key: &HashKey) -> bool {
        self.index.key_of(b) == Some(key) || self.second.contains(key, b)
    }

    /// Invariant checks of the second keys: each held by a keyed block under a key other than
    /// its own, listed the same way by key and by block, and stamped after the block's key.
    pub(crate) fn check_second_keys(&self) -> std::result::Result<(), String> {
        let mut n = 0;
        for (key, v) in &self.second.by_key {
            for &(seq, b) in v {
                n += 1;
                let Some(own) = self.index.key_of(b) else {
                    return Err(format!("block {b} holds a second key but no key"));
                };
                if own == key || (self.stamp_keys && seq <= self.seq[b as usize]) {
                    return Err(format!("block {b}: second key {key:?} is its key or older than it"));
                }
                if !self.second.by_block.get(&b).is_some_and(|ks| ks.contains(key)) {
                    return Err(format!("block {b}: second key {key:?} missing from its block's list"));
                }
            }
        }
        if n != self.second.by_block.values().map(Vec::len).sum::<usize>() {
            return Err("second keys listed by key and by block differ".into());
        }
        Ok(())
    }

    /// Keys `b` (which holds no key) under `key` in the index, stamping its insertion order.
    #[inline]
    fn insert_key(&mut self, key: HashKey, b: BlockId) {
        if self.stamp_keys {
            self.seq[b as usize] = self.next_seq;
            self.next_seq += 1;
        }
        self.index.insert(key, b);
    }

    /// Stamps every key's insertion order (the allocator turns it on with partial hash hits,
    /// where a block's own key and other blocks' second keys share keys); with two-level
    /// pages in the page pool too (the state groups' keys).
    pub(crate) fn set_stamp_keys(&mut self, on: bool) {
        self.stamp_keys = on;
        if let Some(p) = self.pages.as_deref_mut() {
            p.s.stamp_keys = on;
        }
    }

    /// Pops `n` blocks from the front of the free queue, evicting their cached hashes,
    /// and gives each a reference; appends them to `out`. The caller has checked
    /// `n <= num_free_blocks()`.
    pub fn get_new_blocks(&mut self, n: u32, out: &mut Vec<BlockId>) {
        if self.pages.is_some() {
            return self.get_new_slots(n, out);
        }
        assert!(n <= self.num_free_blocks(), "get_new_blocks: {n} blocks asked, fewer free");
        for _ in 0..n {
            let b = self.queue.pop_front().expect("free queue shorter than its count");
            if let Some(r) = &mut self.retention {
                r.popped(b, &self.index);
            }
            if self.enable_caching {
                self.maybe_evict_cached_block(b);
            }
            assert_eq!(self.ref_cnt[b as usize], 0, "free block {b} had references");
            self.ref_cnt[b as usize] = 1;
            self.note(ResidencyOp::Allocated, b);
            if let Some(t) = &mut self.taken {
                t.push(b);
            }
            out.push(b);
        }
    }

    /// vLLM's `_maybe_evict_cached_block`: reports `b` evicted to the residency log, then
    /// drops its hash ([`Self::remove_cached_block_hashes`]); returns whether it had one.
    pub(crate) fn maybe_evict_cached_block(&mut self, b: BlockId) -> bool {
        self.note(ResidencyOp::Evicted, b);
        self.remove_cached_block_hashes(b)
    }

    /// Drops `b`'s hash from the prefix index (emitting `Removed`); returns whether it had one
    /// (vLLM's `_remove_cached_block_hashes` with its events, which reports nothing to the
    /// metrics collector: re-keying a block in `cache_partial_block` uses this).
    pub(crate) fn remove_cached_block_hashes(&mut self, b: BlockId) -> bool {
        if let Some(r) = &mut self.retention {
            r.unkeying(b, parts!(self));
        }
        let Some(&(hash, group)) = self.index.remove_block(b) else { return false };
        if self.enable_events {
            self.events.push(Event::Removed { hash, group });
        }
        self.hash_tokens[b as usize] = 0;
        if !self.second.is_empty() {
            for (hash, group) in self.second.remove_block(b) {
                if self.enable_events {
                    self.events.push(Event::Removed { hash, group });
                }
            }
        }
        true
    }

    /// Takes a reference on each block (a cache hit), pulling free ones out of the queue.
    /// Each block, the null block included, is reported accessed to the residency log.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        if self.pages.is_some() {
            return self.touch_slots(blocks);
        }
        for &b in blocks {
            self.note(ResidencyOp::Accessed, b);
            if b == NULL_BLOCK {
                continue;
            }
            let was_free = self.ref_cnt[b as usize] == 0;
            if was_free {
                self.queue.remove(b);
            }
            self.ref_cnt[b as usize] += 1;
            if let Some(r) = &mut self.retention {
                r.touched(b, was_free, &self.index);
            }
        }
    }

    /// Drops one reference from each block, in eviction-priority order: blocks reaching 0
    /// go to the front of the queue when unhashed (or caching is off), to the back when
    /// hashed (vLLM's `free_blocks`). The caller guarantees each non-null block has a
    /// reference to drop.
    pub fn free_blocks<I: IntoIterator<Item = BlockId>>(&mut self, ordered: I) {
        if self.pages.is_some() {
            return self.free_slots(ordered, false);
        }
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
                } else {
                    last.push(b);
                }
            }
        }
        match &mut self.retention {
            Some(r) => r.freed(&first, &last, false, parts!(self)),
            None => {
                self.queue.push_front_n(&first);
                self.queue.push_back_n(&last);
            }
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
            if self.index.is_keyed(b) {
                // Partial -> full promotion of the same block (its key ended inside it).
                debug_assert!(self.hash_tokens[b as usize] < (i + 1) * block_size);
                self.remove_cached_block_hashes(b);
            }
            self.hash_tokens[b as usize] = (i + 1) * block_size;
            if let Some(r) = &mut self.retention {
                r.keyed(b);
            }
            self.insert_key(key, b);
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
    pub(crate) fn cache_one_block(&mut self, o: &OneBlock) -> bool {
        let OneBlock { block: b, key, num_tokens, .. } = *o;
        if b == NULL_BLOCK || self.index.is_keyed(b) {
            return false;
        }
        self.hash_tokens[b as usize] = num_tokens;
        if let Some(r) = &mut self.retention {
            r.keyed(b);
        }
        self.insert_key(key, b);
        self.push_stored(o);
        true
    }

    /// The `Stored` event of one keyed block (see [`Self::cache_one_block`]).
    fn push_stored(&mut self, o: &OneBlock) {
        let OneBlock { req, index: idx, key, num_tokens, block_size, parent, .. } = *o;
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
    }

    /// vLLM's `cache_partial_block`: keys block `o.block` under `o.key`, the request's hash at
    /// the prefix of `o.num_tokens` tokens (a multiple of the hash block `o.block_size`, which
    /// may end inside the block), emitting `Stored` for that hash block (`o.index` is its
    /// index) unless the block already holds the key. `replace` drops the block's keys first
    /// (its contents were replaced); otherwise a key covering fewer tokens is dropped (a
    /// promotion). Returns the key, or `None` for the null block. A block keyed for more
    /// tokens takes it as a second key (vLLM's `cached_block_hashes_by_block`).
    pub(crate) fn cache_partial_block(&mut self, o: &OneBlock, replace: bool) -> Option<HashKey> {
        let b = o.block;
        if b == NULL_BLOCK {
            return None;
        }
        let already = self.index.key_of(b) == Some(&o.key) || self.second.contains(&o.key, b);
        let shorter = !already && self.index.is_keyed(b) && self.hash_tokens[b as usize] < o.num_tokens;
        if replace || shorter {
            self.remove_cached_block_hashes(b);
        }
        if already && !replace {
            return Some(o.key);
        }
        if self.index.is_keyed(b) {
            // Keyed for a longer prefix: a second key (vLLM's `cached_block_hashes_by_block`).
            let seq = self.next_seq;
            self.next_seq += 1;
            self.second.insert(o.key, b, seq);
            self.push_stored(o);
        } else {
            self.cache_one_block(o);
        }
        Some(o.key)
    }

    /// vLLM's `move_block_hashes`: `src`'s key moves to `dst` (which holds none), keeping its
    /// token count; no events (the entry stays live, on the private copy).
    pub(crate) fn move_block_hashes(&mut self, src: BlockId, dst: BlockId) {
        debug_assert!(!self.index.is_keyed(dst));
        let tokens = self.hash_tokens[src as usize];
        if let Some(r) = &mut self.retention {
            r.unkeying(src, parts!(self));
        }
        let Some(&key) = self.index.remove_block(src) else { return };
        let seconds = if self.second.is_empty() { Vec::new() } else { self.second.remove_block(src) };
        self.hash_tokens[src as usize] = 0;
        self.hash_tokens[dst as usize] = tokens;
        if let Some(r) = &mut self.retention {
            r.keyed(dst);
        }
        self.insert_key(key, dst);
        for k in seconds {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.second.insert(k, dst, seq);
        }
    }

    /// Takes one more reference on `b`, a block in use, that no table holds (the endpoints of
    /// a copy-on-write copy stay held until the copy has run: vLLM's `ref_cnt += 1`), given
    /// back by id (`free_block_ids`).
    pub(crate) fn incref(&mut self, b: BlockId) {
        debug_assert!(b != NULL_BLOCK && self.ref_cnt[b as usize] > 0);
        self.ref_cnt[b as usize] += 1;
        // No table holds this reference: the scheduler gives it back by id.
        self.loose[b as usize] += 1;
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
        if self.pages.is_some() {
            return self.reset_pages();
        }
        let used = self.num_blocks - self.num_free_blocks();
        if used != 1 {
            return false;
        }
        self.index.clear(); // keeps its capacity
        self.second = SecondKeys::default();
        for t in self.hash_tokens.iter_mut() {
            *t = 0;
        }
        if let Some(r) = &mut self.retention {
            r.reset();
        }
        self.note(ResidencyOp::Reset, NULL_BLOCK);
        if self.enable_events {
            self.events.push(Event::AllCleared);
        }
        true
    }

    /// Whether any event waits.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty() || self.pages.as_ref().is_some_and(|p| p.s.has_events())
    }

    /// Takes every queued event (with two-level pages the slot pool's, then the page
    /// pool's: a group lives in one pool, so each key's events keep their order).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut ev = std::mem::take(&mut self.events);
        if let Some(p) = &mut self.pages {
            ev.extend(p.s.take_events());
        }
        ev
    }

    /// Whether the free queue has retention levels (the `hit-aware` policy).
    #[inline]
    pub fn is_leveled(&self) -> bool {
        self.retention.is_some()
    }

    /// The hit-aware policy's state, to read (`None` under `exact`).
    #[inline]
    pub fn retention(&self) -> Option<&Retention> {
        self.retention.as_ref()
    }

    /// The hit-aware policy's decisions, over its state and the pool's parts it works on
    /// (see [`HitAware`]); `None` under `exact`, where a caller has nothing to decide. The
    /// pool is borrowed while the handle lives.
    #[inline]
    pub(crate) fn hit_aware(&mut self) -> Option<HitAware<'_>> {
        let r = self.retention.as_mut()?;
        Some(HitAware::new(r, parts!(self)))
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
    fn partial_key_promoted_then_kept_as_a_second_key_until_eviction() {
        // One block of 64 tokens, hashed every 16 (hash i covers (i + 1) * 16 tokens).
        let h = |i: u64| BlockHash::from_u64(i);
        let one = |b: BlockId, i: u32| OneBlock {
            req: 0,
            block: b,
            index: i,
            key: (h(i as u64), 0),
            num_tokens: (i + 1) * 16,
            block_size: 16,
            parent: (i > 0).then(|| h(i as u64 - 1)),
        };
        let mut p = BlockPool::new(3, true, true);
        let mut got = Vec::new();
        p.get_new_blocks(1, &mut got);
        let b = got[0];
        // A partial key at 48 tokens, then the block fills: promoted (the partial key leaves).
        assert_eq!(p.cache_partial_block(&one(b, 2), false), Some((h(2), 0)));
        assert_eq!(p.block_hash_num_tokens(b), 48);
        p.cache_full_blocks(&TableRef { req: 0, group: 0, block_size: 64, blocks: &got }, 0..1, None, |_| h(3));
        assert_eq!(p.block_hash_num_tokens(b), 64);
        let ev = p.take_events();
        assert!(matches!(ev[..], [Event::Stored { .. }, Event::Removed { .. }, Event::Stored { .. }]), "{ev:?}");
        // Keyed again at 48: a second key beside the full one; both find the block.
        assert_eq!(p.cache_partial_block(&one(b, 2), false), Some((h(2), 0)));
        assert_eq!(p.block_hash(b), Some(&(h(3), 0)));
        assert!(p.holds_key(b, &(h(2), 0)) && p.holds_key(b, &(h(3), 0)));
        let mut hit = Vec::new();
        assert!(p.get_cached_block(&h(2), &[0], &mut hit) && hit == vec![b]);
        assert_eq!(p.take_events().len(), 1);
        // Again: already held, no event.
        p.cache_partial_block(&one(b, 2), false);
        assert!(p.take_events().is_empty());
        // Evicting the block drops both keys, each with its event.
        p.free_blocks([b]);
        p.evict_blocks(&[b]);
        assert_eq!(
            p.take_events(),
            vec![Event::Removed { hash: h(3), group: 0 }, Event::Removed { hash: h(2), group: 0 }]
        );
        assert!(!p.get_cached_block(&h(2), &[0], &mut hit));
    }

    #[test]
    fn second_key_lookup_returns_the_earliest_keyed_block() {
        let h = |i: u64| BlockHash::from_u64(i);
        let one = |b: BlockId| OneBlock {
            req: 0,
            block: b,
            index: 0,
            key: (h(7), 0),
            num_tokens: 16,
            block_size: 16,
            parent: None,
        };
        let mut p = BlockPool::new(4, true, false);
        p.set_stamp_keys(true);
        let mut got = Vec::new();
        p.get_new_blocks(2, &mut got);
        let (a, b) = (got[0], got[1]);
        // `a` holds key 7 as a second key (keyed for 64 tokens first), then `b` as its key.
        p.cache_full_blocks(&TableRef { req: 0, group: 0, block_size: 64, blocks: &[a] }, 0..1, None, |_| h(1));
        p.cache_partial_block(&one(a), false);
        p.cache_partial_block(&one(b), false);
        let mut hit = Vec::new();
        assert!(p.get_cached_block(&h(7), &[0], &mut hit));
        assert_eq!(hit, vec![a], "vLLM's dict order: the earliest entry");
        p.evict_blocks(&[a]);
        assert!(p.get_cached_block(&h(7), &[0], &mut hit));
        assert_eq!(hit, vec![b]);
    }

    #[test]
    fn cache_one_block_hit_aware_recycled_block_keyed_at_the_normal_level_as_cache_full_blocks() {
        use crate::policy::{LEVEL_NORMAL, LEVEL_PINNED, LEVEL_SPECULATIVE};
        // Hit-aware: a block's level outlives its key (a block evicted keeps the level its
        // previous life left). Keying it again must start it at the normal level, whichever
        // call keys it: `cache_full_blocks` (a full block), `cache_one_block` (a Mamba
        // checkpoint state) or `cache_partial_block` (a key inside the block: a prompt's
        // partial tail, a junction).
        let h = |i: u64| BlockHash::from_u64(i);
        let one = |b: BlockId, key: u64| OneBlock {
            req: 0,
            block: b,
            index: 0,
            key: (h(key), 0),
            num_tokens: 16,
            block_size: 16,
            parent: None,
        };
        for (how, old) in [(0, LEVEL_PINNED), (1, LEVEL_PINNED), (2, LEVEL_PINNED), (1, LEVEL_SPECULATIVE)] {
            let mut p = BlockPool::try_new_leveled(9, true, false, true).unwrap();
            let mut got = Vec::new();
            p.get_new_blocks(1, &mut got);
            let b = got[0];
            // Its previous life: cached, left at `old`, freed there, then evicted by a pop.
            p.cache_full_blocks(&TableRef { req: 0, group: 0, block_size: 16, blocks: &got }, 0..1, None, |_| h(1));
            p.hit_aware().unwrap().set_level(b, old);
            p.free_blocks([b]);
            let level = |p: &BlockPool| p.retention().unwrap().level(b);
            assert_eq!(level(&p), old);
            // Popped again (the other free blocks first: unhashed, they are ahead of it).
            got.clear();
            p.get_new_blocks(p.num_free_blocks(), &mut got);
            assert_eq!((got.last(), p.block_hash(b)), (Some(&b), None), "the same block, evicted");
            got = vec![b];
            match how {
                0 => p.cache_full_blocks(
                    &TableRef { req: 0, group: 0, block_size: 16, blocks: &got },
                    0..1,
                    None,
                    |_| h(2),
                ),
                1 => assert!(p.cache_one_block(&one(b, 2))),
                _ => assert!(p.cache_partial_block(&one(b, 2), false).is_some()),
            }
            assert_eq!(level(&p), LEVEL_NORMAL, "keyed by call {how} after a life at level {old}");
            // Freed, it is queued at the normal level: not counted in the pinned share.
            p.free_blocks([b]);
            assert_eq!(p.retention().unwrap().pinned_free(), 0, "keyed by call {how} after a life at level {old}");
        }
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
