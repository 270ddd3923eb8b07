//! The hit-aware policy's per-block state ([`Retention`]) and its decisions (`HitAware`):
//! each block's retention level and flags, the hit units, the pinned keys and the pinned
//! share. A hit-aware [`crate::block_pool::BlockPool`] holds a [`Retention`] (`None` under
//! `exact`) and calls it at six named hooks, one per pool operation whose exact path it
//! changes:
//!
//! | hook | pool operation (vLLM's `BlockPool`) | what the policy does |
//! |---|---|---|
//! | [`Retention::popped`] | `get_new_blocks` | counts a pinned block out |
//! | [`Retention::touched`] | `touch` | counts a pinned block out, marks the block reused |
//! | `Retention::freed` | `free_blocks` | queues cached blocks at their levels, keeps the pinned share |
//! | `Retention::unkeying` | `remove_cached_block_hashes`, `move_block_hashes` | dissolves the block's hit unit, clears its flags |
//! | [`Retention::keyed`] | `cache_full_blocks`, `cache_one_block`, `move_block_hashes` | a newly cached block is freed at [`LEVEL_NORMAL`] |
//! | [`Retention::reset`] | `reset_prefix_cache` | forgets flags, units and the pinned count |
//!
//! The decisions the managers' retention rules (`manager/retention.rs`, per group) and the
//! coordinator's hit-aware room (`coordinator/hit_aware.rs`, per request) take are the
//! methods of `HitAware`, the one handle the pool lends (`BlockPool::hit_aware`, `None`
//! under `exact`): the state and the pool's free queue, prefix index, reference counts and
//! hash token counts (`PoolParts`), borrowed for as long as the caller decides. It reads
//! the state through [`Retention`]'s reads (it dereferences to it). The policy never names
//! `BlockPool`.
//!
//! Invariants (checked by `invariants::check`): a free cached block sits in the free-queue
//! segment of its level; `pinned_free` equals the free keyed blocks at [`LEVEL_PINNED`] and
//! [`LEVEL_LEASED`], and stays within `pinned_cap` after every pool operation; the pinned
//! keys (permanent pins and leased keys together) are at most `pinned_cap`; a block at
//! [`LEVEL_LEASED`] while free is the block a lookup finds under a leased key, so the free
//! leased blocks never exceed the pinned share and its overflow never demotes one; the pin
//! filter (`PinFilter`) counts exactly the pinned keys.
//!
//! Cost: every hook O(1) a block (`freed` O(blocks freed), plus O(demoted) when the pinned
//! share overflows; while a pin or lease runs, a freed cached block's pin check hashes its
//! key only when the pin filter's counter for it is not 0); `unkeying` O(members) when it
//! dissolves a hit unit; `reset` O(`num_blocks`); a decision O(1) (`set_level` plus
//! O(demoted)), `form_unit` O(members), `pin_keys` O(keys); memory 12 bytes a block (level,
//! flags, and the retains' `held` and `keygen`, one record a block), the hit units' two words a block, and the pin
//! filter's 4 KiB.
#![forbid(unsafe_code)]

use super::hints::Holds;
use super::{
    HitUnits, Level, LEVEL_LEASED, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_PROBATION, LEVEL_RESUMED, LEVEL_SPECULATIVE,
};
use crate::error::{Error, Result};
use crate::free_queue::{try_filled, FreeQueue};
use crate::ids::{BlockHash, BlockId, GroupId, NULL_BLOCK};
use crate::prefix_index::{HashKey, PrefixIndex};
use rustc_hash::FxHashMap;

/// Block flag: served in a cache hit since it was cached.
const FLAG_REUSED: u8 = 1;
/// Block flag: a Mamba state at a shared-prefix junction (see
/// `GroupRetention::demote_passed_state` in `manager/retention.rs`).
const FLAG_BRANCH: u8 = 2;
/// Block flag: a full-attention block that ended a finished request's cached sequence (a
/// chat's next turn continues there; see `Allocator::retain_for_free` in `coordinator/hit_aware.rs`).
const FLAG_TAIL: u8 = 4;
/// Block flag: held by a running retain hint (`hints.rs`): the policy's own demotions of a
/// lost hit unit's members (`HitAware::evict_first`) pass it by until the retain ends.
pub(super) const FLAG_HELD: u8 = 8;

/// What pins a hash key: a permanent pin ([`HitAware::pin_keys`]) and the running pin
/// leases (KV hints, `hints.rs`) on it. An entry exists only while one of them does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Pin {
    /// Pinned by `pin_prefix` (for the allocator's life).
    pub(super) permanent: bool,
    /// Live lease sets naming the key (`hints.rs`: leases on the same keys share a set; a
    /// block cached under the key is freed at [`LEVEL_LEASED`] while this is above 0, the
    /// only thing read of it).
    pub(super) leases: u32,
}

/// A counting filter over the pinned keys (`Retention::pinned_keys`): each counter counts
/// the pinned keys whose first hash bytes and group map to it, so a key whose counter is 0 is
/// not pinned, known without hashing it. A freed cached block's pin check (every one, while a
/// pin or lease runs) so costs a multiply for most keys instead of a map lookup. 1,024
/// counters (4 KiB); a collision only sends the check on to the map.
#[derive(Clone, Debug)]
pub(super) struct PinFilter {
    /// Invariant: `counts[i]` is the number of keys of `pinned_keys` with `slot(key) == i`.
    counts: Vec<u32>,
}

impl PinFilter {
    const BITS: u32 = 10;

    fn new() -> Self {
        Self { counts: vec![0; 1 << Self::BITS] }
    }

    /// The counter of `key`: its hash's first 8 bytes (a cryptographic or xxhash digest in
    /// vLLM: spread already) and its group, mixed by a multiply. O(1).
    #[inline]
    fn slot(key: &HashKey) -> usize {
        let bytes = key.0.as_bytes();
        let mut w = [0u8; 8];
        let n = bytes.len().min(8);
        w[..n].copy_from_slice(&bytes[..n]);
        let x = (u64::from_le_bytes(w) ^ u64::from(key.1)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x >> (64 - Self::BITS)) as usize
    }

    /// `key` was added to the pinned keys.
    #[inline]
    pub(super) fn add(&mut self, key: &HashKey) {
        self.counts[Self::slot(key)] += 1;
    }

    /// `key` was removed from the pinned keys.
    #[inline]
    pub(super) fn remove(&mut self, key: &HashKey) {
        self.counts[Self::slot(key)] -= 1;
    }

    /// False when `key` is certainly not pinned; true when it may be.
    #[inline]
    pub(super) fn maybe(&self, key: &HashKey) -> bool {
        self.counts[Self::slot(key)] != 0
    }

    /// Checks the invariant against `keys`.
    fn check<'k>(&self, keys: impl Iterator<Item = &'k HashKey>) -> std::result::Result<(), String> {
        let mut want = vec![0u32; self.counts.len()];
        for k in keys {
            want[Self::slot(k)] += 1;
        }
        if want != self.counts {
            return Err("the pinned keys' filter does not count the pinned keys".into());
        }
        Ok(())
    }
}

/// The parts of the pool the policy works on, lent for one hook call or for a [`HitAware`]
/// handle.
pub(crate) struct PoolParts<'a> {
    /// The free queue (split into the retention levels).
    pub(crate) queue: &'a mut FreeQueue,
    /// The prefix index (each block's hash key).
    pub(crate) index: &'a PrefixIndex,
    /// Each block's reference count (0: free).
    pub(crate) ref_cnt: &'a [u32],
    /// Prefix tokens each block's key covers (0: unkeyed).
    pub(crate) hash_tokens: &'a [u32],
}

/// The hit-aware policy's decisions: its state and the pool's parts it works on, lent by
/// `BlockPool::hit_aware` (`None` under `exact`) for as long as the caller decides. Reads
/// of the state go through [`Retention`] (the handle dereferences to it); the pool's
/// reads a rule needs (a block's key, its tokens, its references) are here too, so a rule
/// never goes back to the pool while it holds the handle.
pub(crate) struct HitAware<'a> {
    /// The policy's state.
    pub(super) r: &'a mut Retention,
    /// The pool's parts.
    pub(super) p: PoolParts<'a>,
}

impl std::ops::Deref for HitAware<'_> {
    type Target = Retention;

    #[inline]
    fn deref(&self) -> &Retention {
        self.r
    }
}

/// The hit-aware policy's state: see the module docs.
#[derive(Clone, Debug)]
pub struct Retention {
    /// Each block's level, flags and retain counts ([`BlockMeta`]), one record a block so a
    /// decision on a block reads one cache line of this state, not four.
    pub(super) meta: Vec<BlockMeta>,
    /// State-space hybrids: the hit units of the cached blocks (see [`HitUnits`]).
    units: HitUnits,
    /// The Mamba "align" groups that cached a state (a unit holds a state in each).
    state_groups: Vec<GroupId>,
    /// Hash keys of pinned prefixes and of running pin leases: a block cached under a leased
    /// one (the one a lookup finds) is freed at `LEVEL_LEASED`, under a permanently pinned
    /// one at `LEVEL_PINNED`. At most `pinned_cap` keys. Keys are added only through
    /// [`Self::pin_entry`] and removed with `pin_filter.remove`.
    pub(super) pinned_keys: FxHashMap<HashKey, Pin>,
    /// The pinned keys' counting filter (invariant: counts `pinned_keys`).
    pub(super) pin_filter: PinFilter,
    /// Free cached blocks at `LEVEL_PINNED` or `LEVEL_LEASED` (invariant: equals the count
    /// in the queue).
    pinned_free: u32,
    /// Free cached blocks at `LEVEL_LEASED` (of `pinned_free`; invariant: equals the count
    /// in the queue).
    leased_free: u32,
    /// The most free cached blocks kept at `LEVEL_PINNED`: past it, the oldest is demoted to
    /// `LEVEL_NORMAL` (the pinned share of the pool).
    pinned_cap: u32,
    /// The KV hints' leases and retains, their clock and counters (`hints.rs`).
    pub(super) holds: Holds,
}

/// A block's hit-aware state (one element of `Retention::meta`).
#[derive(Clone, Copy, Debug)]
pub(super) struct BlockMeta {
    /// `held`: the live retains holding the block in its current key life (`hints.rs`); 0
    /// when it loses its key.
    pub(super) held: u32,
    /// `keygen`: how many times the block lost its key (wrapping), so a retain that recorded
    /// an older value knows the block it held is gone from under it.
    pub(super) keygen: u32,
    /// Retention level: where the block goes when freed cached.
    pub(super) level: Level,
    /// What the block proved since it was cached, as bits: [`FLAG_REUSED`] (served in a
    /// cache hit: never put on `LEVEL_PROBATION`), [`FLAG_BRANCH`] (a Mamba state where
    /// requests branch off: kept when a request passes it), [`FLAG_TAIL`] and [`FLAG_HELD`].
    /// Cleared when the block loses its hash.
    pub(super) flags: u8,
}

impl BlockMeta {
    const NEW: Self = Self { held: 0, keygen: 0, level: LEVEL_NORMAL, flags: 0 };
}

impl Retention {
    /// The state of a pool of `num_blocks` blocks: every block at [`LEVEL_NORMAL`], no
    /// flags, no units, no pins, the default pinned share ([`Self::default_pinned_cap`]).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the per-block arrays cannot be allocated.
    pub(crate) fn try_new(num_blocks: u32) -> Result<Self> {
        let oom = |what: &str| {
            let what = what.to_string();
            move |e: std::collections::TryReserveError| {
                Error::OutOfMemory(format!("{what} of a pool of {num_blocks} blocks: {e}"))
            }
        };
        let n = num_blocks as usize;
        Ok(Self {
            meta: try_filled(n, BlockMeta::NEW).map_err(oom("block levels"))?,
            units: HitUnits::try_new(n).map_err(oom("hit units"))?,
            state_groups: Vec::new(),
            pinned_keys: FxHashMap::default(),
            pin_filter: PinFilter::new(),
            pinned_free: 0,
            leased_free: 0,
            pinned_cap: Self::default_pinned_cap(num_blocks),
            holds: Holds::default(),
        })
    }

    /// The pinned share a pool of `num_blocks` blocks starts with: a quarter of its blocks.
    pub fn default_pinned_cap(num_blocks: u32) -> u32 {
        num_blocks.saturating_sub(1) / 4
    }

    /// The pinned share of a pool of `num_blocks` blocks, in blocks, for a `share` of it.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a share outside `0.0..=1.0`.
    pub(crate) fn pinned_cap_for(share: f64, num_blocks: u32) -> Result<u32> {
        if !(0.0..=1.0).contains(&share) {
            return Err(Error::OutOfRange(format!("pinned share {share} is outside 0.0..=1.0")));
        }
        Ok((num_blocks.saturating_sub(1) as f64 * share).floor() as u32)
    }

    // --- The hooks (one per pool operation whose exact path the policy changes) ---

    /// Hook of `get_new_blocks`: free block `b`, still keyed, left the front of the queue
    /// (with two-level pages also when its page leaves the slot queue, see `block_pool/pages.rs`).
    #[inline]
    pub(crate) fn popped(&mut self, b: BlockId, index: &PrefixIndex) {
        if self.counts_pinned(b, index) {
            self.count_out(b);
        }
    }

    /// Hook of `touch`: a hit took a reference on `b` (`was_free`: it left the queue).
    #[inline]
    pub(crate) fn touched(&mut self, b: BlockId, was_free: bool, index: &PrefixIndex) {
        if was_free && self.counts_pinned(b, index) {
            self.count_out(b);
        }
        self.meta[b as usize].flags |= FLAG_REUSED;
    }

    /// Hook of `free_blocks`: `uncached` (in order) and `cached` (in order) lost their last
    /// reference. The uncached ones go to the front of the queue as under `exact` (vLLM's
    /// `prepend_n`), each cached one to the back of its level (the front for
    /// [`LEVEL_PROBATION`] and [`LEVEL_RESUMED`]), or, with `evict_first` (vLLM 0.34's
    /// `free_blocks(..., evict_first=True)`), to the front of [`LEVEL_SPECULATIVE`] unless
    /// pinned or a branch point. Then the pinned share is enforced. O(blocks).
    pub(crate) fn freed(&mut self, uncached: &[BlockId], cached: &[BlockId], evict_first: bool, p: PoolParts<'_>) {
        let mut ha = HitAware { r: self, p };
        for &b in cached {
            ha.queue_cached(b);
            if evict_first {
                ha.evict_first(b);
            }
        }
        ha.p.queue.push_front_n(uncached);
        if ha.r.pinned_free > ha.r.pinned_cap {
            ha.enforce_pinned_cap();
        }
    }

    /// Hook of `remove_cached_block_hashes`, called before the index drops `b`'s key: a free
    /// pinned block is counted out, the hit unit naming `b` is dissolved (its members no
    /// live unit needs are evicted first, see [`Self::evict_first`]) and `b`'s flags are
    /// cleared.
    pub(crate) fn unkeying(&mut self, b: BlockId, p: PoolParts<'_>) {
        if p.ref_cnt[b as usize] == 0 && b != NULL_BLOCK && self.counts_pinned(b, p.index) && p.queue.contains(b) {
            self.count_out(b);
        }
        let keyed = p.index.is_keyed(b);
        if self.units.in_unit(b) {
            HitAware { r: self, p }.orphan_unit_of(b);
        }
        if keyed {
            self.meta[b as usize].flags = 0;
            self.meta[b as usize].held = 0;
            self.meta[b as usize].keygen = self.meta[b as usize].keygen.wrapping_add(1);
        }
    }

    /// Hook of `cache_full_blocks` and `cache_one_block` (which `cache_partial_block` calls
    /// for a block holding no key): `b` was just cached; it is freed at [`LEVEL_NORMAL`],
    /// whatever level its previous life left (a level outlives the key).
    #[inline]
    pub(crate) fn keyed(&mut self, b: BlockId) {
        self.meta[b as usize].level = LEVEL_NORMAL;
    }

    /// Hook of `reset_prefix_cache`: forgets every flag, unit and free pinned block (the
    /// levels and pinned keys stay).
    pub(crate) fn reset(&mut self) {
        for m in &mut self.meta {
            m.flags = 0;
            // Every key is gone: no retain holds a block any more (each one's hold skips it).
            m.held = 0;
            m.keygen = m.keygen.wrapping_add(1);
        }
        self.units.clear();
        self.pinned_free = 0;
        self.leased_free = 0;
    }

    // --- The reads (of the state; [`HitAware`] dereferences to them) ---

    /// Whether `key` is a pinned prefix's or under a running pin lease.
    pub fn is_pinned_key(&self, key: &HashKey) -> bool {
        self.pinned(key).is_some()
    }

    /// Whether `key` is under a running pin lease (a KV hint).
    pub fn is_leased_key(&self, key: &HashKey) -> bool {
        self.pinned(key).is_some_and(|p| p.leases > 0)
    }

    /// What pins `key`, if anything: the filter first, then the map. O(1).
    #[inline]
    pub(super) fn pinned(&self, key: &HashKey) -> Option<&Pin> {
        if self.pinned_keys.is_empty() || !self.pin_filter.maybe(key) {
            return None;
        }
        self.pinned_keys.get(key)
    }

    /// `key`'s pin, added (no pin, no lease) when it has none. O(1).
    pub(super) fn pin_entry(&mut self, key: HashKey) -> &mut Pin {
        match self.pinned_keys.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                self.pin_filter.add(&key);
                e.insert(Pin::default())
            }
        }
    }

    /// Invariant check of the pinned keys' filter. O(pinned keys).
    pub(crate) fn check_pin_filter(&self) -> std::result::Result<(), String> {
        self.pin_filter.check(self.pinned_keys.keys())
    }

    /// Whether `b` is held by a running retain hint.
    pub fn is_held(&self, b: BlockId) -> bool {
        self.meta.get(b as usize).is_some_and(|m| m.flags & FLAG_HELD != 0)
    }

    /// Whether `b` was served in a cache hit since it was cached.
    pub fn reused(&self, b: BlockId) -> bool {
        self.meta.get(b as usize).is_some_and(|m| m.flags & FLAG_REUSED != 0)
    }

    /// Whether `b` (a Mamba state) was marked a branch point since it was cached.
    pub fn is_branch(&self, b: BlockId) -> bool {
        self.meta.get(b as usize).is_some_and(|m| m.flags & FLAG_BRANCH != 0)
    }

    /// Whether `b` ended a finished request's cached sequence since it was cached.
    pub fn is_tail(&self, b: BlockId) -> bool {
        self.meta.get(b as usize).is_some_and(|m| m.flags & FLAG_TAIL != 0)
    }

    /// The Mamba "align" groups that cached a state.
    pub fn state_groups(&self) -> &[GroupId] {
        &self.state_groups
    }

    /// Live hit units holding full-attention block `b` in their prefix.
    pub fn unit_support(&self, b: BlockId) -> u32 {
        self.units.support(b)
    }

    /// Retention level of `b`.
    #[inline]
    pub fn level(&self, b: BlockId) -> Level {
        self.meta.get(b as usize).map_or(LEVEL_NORMAL, |m| m.level)
    }

    /// A free block counted in `pinned_free` (checked by the caller) leaves the queue.
    #[inline]
    fn count_out(&mut self, b: BlockId) {
        self.pinned_free -= 1;
        self.leased_free -= u32::from(self.meta[b as usize].level == LEVEL_LEASED);
    }

    /// Whether `b` (free) counts in `pinned_free`.
    #[inline]
    fn counts_pinned(&self, b: BlockId, index: &PrefixIndex) -> bool {
        self.meta[b as usize].level >= LEVEL_PINNED && index.is_keyed(b)
    }

    /// The pinned share in blocks.
    pub fn pinned_cap(&self) -> u32 {
        self.pinned_cap
    }

    /// Free cached blocks at `LEVEL_PINNED` or `LEVEL_LEASED`.
    pub fn pinned_free(&self) -> u32 {
        self.pinned_free
    }

    /// Free cached blocks at `LEVEL_LEASED` (held by pin leases).
    pub fn leased_free(&self) -> u32 {
        self.leased_free
    }

    /// The KV hints' holds (`hints.rs`).
    pub(crate) fn holds(&self) -> &Holds {
        &self.holds
    }

    /// The KV hints' counters and gauges.
    pub fn hint_stats(&self) -> super::HintStats {
        self.holds.stats(self.leased_free)
    }
}

/// The decisions (see the module docs). Each is O(1) unless it says otherwise.
impl<'a> HitAware<'a> {
    /// The handle over `r` and the pool's parts `p`.
    #[inline]
    pub(crate) fn new(r: &'a mut Retention, p: PoolParts<'a>) -> Self {
        Self { r, p }
    }

    // --- The pool's reads a rule needs while it holds the handle ---

    /// Hash key of `b`, if cached (the pool's `block_hash`).
    #[inline]
    pub(crate) fn key_of(&self, b: BlockId) -> Option<&HashKey> {
        self.p.index.key_of(b)
    }

    /// Prefix tokens `b`'s key covers, 0 when unkeyed (the pool's `block_hash_num_tokens`).
    #[inline]
    pub(crate) fn hash_tokens(&self, b: BlockId) -> u32 {
        self.p.hash_tokens[b as usize]
    }

    /// Reference count of `b` (the pool's `ref_cnt`).
    #[inline]
    pub(crate) fn ref_cnt(&self, b: BlockId) -> u32 {
        self.p.ref_cnt[b as usize]
    }

    /// The block keyed first under `key` (its own key; second keys aside), if any.
    #[inline]
    pub(crate) fn keyed_block(&self, key: &HashKey) -> Option<BlockId> {
        self.p.index.get_one(key)
    }

    // --- Flags and hit units ---

    /// Marks cached block `b` a branch point until it loses its hash (no-op for an
    /// unhashed block).
    pub(crate) fn mark_branch(&mut self, b: BlockId) {
        self.set_flag(b, FLAG_BRANCH);
    }

    /// Marks cached block `b` as the end of a finished request's cached sequence until it
    /// loses its hash (no-op for an unhashed block).
    pub(crate) fn mark_tail(&mut self, b: BlockId) {
        self.set_flag(b, FLAG_TAIL);
    }

    fn set_flag(&mut self, b: BlockId, flag: u8) {
        if self.p.index.is_keyed(b) {
            if let Some(m) = self.r.meta.get_mut(b as usize) {
                m.flags |= flag;
            }
        }
    }

    /// Records that Mamba "align" group `g` caches states. O(groups).
    pub(crate) fn note_state_group(&mut self, g: GroupId) {
        if !self.r.state_groups.contains(&g) {
            self.r.state_groups.push(g);
        }
    }

    /// The state blocks cached under `hash` in every state group (empty when any is
    /// missing). O(state groups).
    pub(crate) fn state_set(&self, hash: &BlockHash) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.r.state_groups.len());
        for &g in &self.r.state_groups {
            match self.p.index.get_one(&(*hash, g)) {
                Some(b) => out.push(b),
                None => {
                    out.clear();
                    break;
                }
            }
        }
        out
    }

    /// Forms a hit unit of cached `states` and the cached full-attention `prefix` before
    /// them (see [`HitUnits`]); nothing when one of them is not cached. O(members).
    pub(crate) fn form_unit(&mut self, states: &[BlockId], prefix: &[BlockId]) {
        let index = self.p.index;
        let keyed = |bs: &[BlockId]| -> Option<Vec<(BlockId, HashKey)>> {
            bs.iter().map(|&b| index.key_of(b).map(|&k| (b, k))).collect()
        };
        if let (Some(st), Some(pre)) = (keyed(states), keyed(prefix)) {
            self.r.units.form(st, pre, &mut |m| index.key_of(m.0) == Some(&m.1));
        }
    }

    /// `b` is about to lose its hash: the unit naming it is dissolved and its members that
    /// no live unit needs any more are evicted first ([`Self::evict_first`]), except a
    /// full-attention block at which another state set is cached. O(members).
    fn orphan_unit_of(&mut self, b: BlockId) {
        let mut orphans = Vec::new();
        let index = self.p.index;
        self.r.units.lose(b, &mut |m| index.key_of(m.0) == Some(&m.1), &mut orphans);
        for m in orphans {
            // A full-attention block that ends where a state set other than `b`'s is cached
            // (a shared prefix's junction) still serves hits there.
            if let Some(&key) = index.key_of(m) {
                if !self.r.state_groups.contains(&key.1) {
                    let st = self.state_set(&key.0);
                    if !st.is_empty() && !st.contains(&b) {
                        continue;
                    }
                }
            }
            self.evict_first(m);
        }
    }

    // --- Levels ---

    /// Cached block `b` serves no hit (a member of a lost unit): it goes to
    /// [`LEVEL_SPECULATIVE`], at the front of the queue when free. Pinned blocks, branch
    /// points and blocks a retain hint holds keep their level.
    pub(crate) fn evict_first(&mut self, b: BlockId) {
        if b == NULL_BLOCK
            || self.r.meta[b as usize].level >= LEVEL_PINNED
            || self.r.meta[b as usize].flags & (FLAG_BRANCH | FLAG_HELD) != 0
        {
            return;
        }
        self.demote_front(b, LEVEL_SPECULATIVE);
    }

    /// Sets `b`'s level to `lvl` (below [`LEVEL_PINNED`]), at the front of that level when
    /// free (evicted first in it). No-op for the null block. O(1).
    pub(super) fn demote_front(&mut self, b: BlockId, lvl: Level) {
        if b == NULL_BLOCK {
            return;
        }
        let queued = self.is_queued(b);
        if queued {
            self.unqueue_cached(b);
        }
        self.r.meta[b as usize].level = lvl;
        if queued {
            self.p.queue.push_front_level(b, lvl);
        }
    }

    /// Sets the retention level `b` gets when freed; a free block moves to the back of its
    /// new level now. No-op for the null block. O(1) plus O(demoted) when the pinned share
    /// overflows.
    pub(crate) fn set_level(&mut self, b: BlockId, lvl: Level) {
        self.relevel(b, lvl, true);
    }

    /// [`Self::set_level`] of a block whose key no pin or lease names (the caller knows: it
    /// looked the key up, or removed its pin), without looking the key up again: the same
    /// decision as `set_level`'s (its pin check would find nothing). O(1) plus O(demoted).
    pub(super) fn set_level_unpinned(&mut self, b: BlockId, lvl: Level) {
        debug_assert!(self.p.index.key_of(b).is_none_or(|k| !self.r.pinned_keys.contains_key(k)));
        self.relevel(b, lvl, false);
    }

    /// The body of [`Self::set_level`] (`pin_check`: queue a free block through
    /// `queue_cached`'s pin check) and [`Self::set_level_unpinned`] (straight to its level).
    #[inline]
    fn relevel(&mut self, b: BlockId, lvl: Level, pin_check: bool) {
        if b == NULL_BLOCK {
            return;
        }
        let queued = self.is_queued(b);
        if queued {
            self.unqueue_cached(b);
        }
        self.r.meta[b as usize].level = lvl;
        if queued {
            if pin_check {
                self.queue_cached(b);
            } else {
                self.queue_at_level(b);
            }
            if self.r.pinned_free > self.r.pinned_cap {
                self.enforce_pinned_cap();
            }
        }
    }

    /// Whether `b` is a free cached block in the queue. With one pool every free cached
    /// block is; in the slot pool of two-level pages a free keyed slot of a free page is in
    /// no queue (its page is in the page queue, and the slot keeps its key and level until
    /// the page is taken: lazy eviction), so a level set on it now applies when its page
    /// opens again. O(1).
    #[inline]
    fn is_queued(&self, b: BlockId) -> bool {
        self.p.ref_cnt[b as usize] == 0 && self.p.index.is_keyed(b) && self.p.queue.contains(b)
    }

    /// Takes a free cached block out of the queue, keeping the count.
    fn unqueue_cached(&mut self, b: BlockId) {
        if self.r.counts_pinned(b, self.p.index) {
            self.r.count_out(b);
        }
        self.p.queue.remove(b);
    }

    /// Queues a free cached block at the back of its level (at the front for
    /// `LEVEL_PROBATION` and `LEVEL_RESUMED`; a pinned key raises it to `LEVEL_PINNED`, a
    /// leased key the block a lookup finds under it to `LEVEL_LEASED`), keeping the count.
    fn queue_cached(&mut self, b: BlockId) {
        let r = &mut *self.r;
        if !r.pinned_keys.is_empty() {
            if let Some(k) = self.p.index.key_of(b) {
                if let Some(p) = r.pinned(k) {
                    if p.leases > 0 && self.p.index.get_one(k) == Some(b) {
                        r.meta[b as usize].level = LEVEL_LEASED;
                    } else if p.permanent {
                        r.meta[b as usize].level = LEVEL_PINNED;
                    }
                }
            }
        }
        self.queue_at_level(b);
    }

    /// [`Self::queue_cached`] past its pin check: queues a free cached block at the back
    /// of its level as it is (the front for `LEVEL_PROBATION` and `LEVEL_RESUMED`), keeping
    /// the count.
    fn queue_at_level(&mut self, b: BlockId) {
        let r = &mut *self.r;
        if r.counts_pinned(b, self.p.index) {
            r.pinned_free += 1;
            r.leased_free += u32::from(r.meta[b as usize].level == LEVEL_LEASED);
        }
        let lvl = r.meta[b as usize].level;
        if lvl == LEVEL_PROBATION || lvl == LEVEL_RESUMED {
            // Newest first: under a cyclic load larger than the cache (round-robin chat) the
            // unproven sessions that waited longest, and come back next, keep their blocks.
            self.p.queue.push_front_level(b, lvl);
        } else {
            self.p.queue.push_back_level(b, lvl);
        }
    }

    /// Demotes the oldest free pinned blocks to `LEVEL_NORMAL` while more than
    /// `pinned_cap` are free (a pinned key's block too: the share is a bound). Blocks at
    /// `LEVEL_LEASED` go last: there are never more of them than leased keys, which are
    /// within the share, so none is demoted while `LEVEL_PINNED` holds a block.
    ///
    /// The oldest keyed blocks at `LEVEL_PINNED` (the front of its segment, which follows
    /// `LEVEL_NORMAL`'s in the queue) are demoted as one run: their levels are written and the
    /// end of `LEVEL_NORMAL` moves past them (`FreeQueue::extend_level_through`), the order
    /// that taking each out and queuing it at the back of `LEVEL_NORMAL` gives. The rest (an
    /// unkeyed block, the leased level) goes one block at a time.
    pub(super) fn enforce_pinned_cap(&mut self) {
        let (r, queue, index) = (&mut *self.r, &mut *self.p.queue, self.p.index);
        let (mut run_end, mut next) = (None, queue.first_in_level(LEVEL_PINNED));
        while r.pinned_free > r.pinned_cap {
            let Some(b) = next.filter(|&b| index.is_keyed(b)) else { break };
            // Keyed at `LEVEL_PINNED`: it counts in `pinned_free` (`counts_pinned`).
            r.count_out(b);
            r.meta[b as usize].level = LEVEL_NORMAL;
            run_end = Some(b);
            next = queue.next_in_level(b);
        }
        if let Some(last) = run_end {
            const _: () = assert!(LEVEL_PINNED == LEVEL_NORMAL + 1, "the pinned segment follows the normal one");
            queue.extend_level_through(LEVEL_NORMAL, last);
        }
        while r.pinned_free > r.pinned_cap {
            // The count never exceeds the two levels' length (the invariants check it); were
            // it to, demoting stops here rather than panicking inside vLLM's step.
            let Some(b) = queue.first_in_level(LEVEL_PINNED).or_else(|| queue.first_in_level(LEVEL_LEASED)) else {
                break;
            };
            if r.counts_pinned(b, index) {
                r.count_out(b);
            }
            queue.remove(b);
            r.meta[b as usize].level = LEVEL_NORMAL;
            if index.is_keyed(b) {
                queue.push_back_level(b, LEVEL_NORMAL);
            } else {
                queue.push_front_n(&[b]);
            }
        }
    }

    // --- Pins ---

    /// Pins hash keys (a prefix's, see [`crate::Allocator::pin_prefix`]): a block cached
    /// under one is freed at `LEVEL_PINNED`; one cached now moves there now. Returns the
    /// keys pinned in all. O(keys).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the pinned keys would exceed the pinned share (nothing
    /// changes).
    pub(crate) fn pin_keys(&mut self, mut keys: Vec<HashKey>) -> Result<u32> {
        keys.retain(|k| !self.r.pinned_keys.get(k).is_some_and(|p| p.permanent));
        sort_keys(&mut keys);
        let new = keys.iter().filter(|k| !self.r.pinned_keys.contains_key(k)).count();
        let total = self.r.pinned_keys.len() as u64 + new as u64;
        if total > self.r.pinned_cap as u64 {
            return Err(Error::OutOfRange(format!(
                "pinning {new} more blocks would pin {total}, above the pinned share of {} blocks",
                self.r.pinned_cap
            )));
        }
        for k in &keys {
            let p = self.r.pin_entry(*k);
            p.permanent = true;
            let leased = p.leases > 0;
            if let Some(b) = self.p.index.get_one(k) {
                if !leased {
                    self.set_level(b, LEVEL_PINNED);
                }
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
        let cap = Retention::pinned_cap_for(share, self.p.ref_cnt.len() as u32)?;
        if (self.r.pinned_keys.len() as u64) > cap as u64 {
            return Err(Error::OutOfRange(format!(
                "a pinned share of {cap} blocks is below the {} blocks already pinned",
                self.r.pinned_keys.len()
            )));
        }
        self.r.pinned_cap = cap;
        self.enforce_pinned_cap();
        Ok(())
    }
}

/// Sorts hash keys by their bytes, then group, and drops repeats (a deterministic order:
/// the pins' effects do not depend on a hash map's). The bytes compared a word at a time
/// (`BlockHash::cmp_bytes`, the order of `as_bytes`). O(keys log keys).
pub(super) fn sort_keys(keys: &mut Vec<HashKey>) {
    keys.sort_unstable_by(|a, b| a.0.cmp_bytes(&b.0).then(a.1.cmp(&b.1)));
    keys.dedup();
}
