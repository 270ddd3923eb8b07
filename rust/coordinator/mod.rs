//! The coordinator: several KV cache groups sharing one block pool, with the request-level
//! operations of vLLM's `KVCacheManager` (+ `KVCacheCoordinator`): cache-hit search across
//! groups (the hybrid fixed point), slot allocation that checks capacity over every group
//! before it changes anything, caching of full blocks, freeing, events.
//!
//! Requests are dense handles into a slab; per request the coordinator keeps the block
//! hashes vLLM computed (appended incrementally, never re-sent) and the last cache hit
//! found for it, and each group's manager keeps its block table.
//!
//! The rooms: [`requests`] (the slab of handles and the request's block hashes), [`hits`]
//! (the hit search and the validation of a hit before it is adopted), [`noop`] (the no-op
//! limits and the scheduler's plain step), [`allocate`] (counting and allocation),
//! [`cache_free`] (caching, freeing, eviction), and [`hit_aware`], the hit-aware policy's
//! room per request: its per-request state, the junctions around the hit search, the
//! sightings, and the hooks the other rooms call under `hit-aware` (`retain_for_free` in
//! `free`, `note_allocation` in `allocate_slots`), and pinning. This file holds the types
//! and the allocator's construction and accessors.
//!
//! Cost: `allocate_slots` for a decoding request is O(groups) with no allocation (new
//! block ids go to reused buffers); a hit search is O(blocks scanned); `free` O(table).
#![forbid(unsafe_code)]

mod allocate;
mod cache_free;
mod hit_aware;
mod hits;
mod noop;
mod requests;

pub use allocate::{AllocateArgs, BlockCountArgs, NewComputed};
pub use cache_free::CacheBlocksArgs;
pub use hit_aware::{HintOutcome, PinHint, PinOutcome, RequestHints, RetainHint, RetainPriority, MAX_CHECKPOINTS};
pub use hits::ConnectorHit;
pub use noop::{NoopLimits, PlainStep, StepFields};
pub use requests::HashSource;

use crate::block_pool::{BlockPool, Event, ResidencyOp};
use crate::config::{AttentionKind, Config, CoordinatorKind};
use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot};
use crate::manager::SingleTypeManager;
use crate::policy::Policy;

/// Groups with equal specs, looked up together (vLLM's `SpecGroup`).
#[derive(Clone, Debug)]
struct SpecGroup {
    kind: AttentionKind,
    block_size: u32,
    group_ids: Vec<GroupId>,
    /// vLLM's `SpecGroup.use_eagle`: the group's hits drop the EAGLE block
    /// ([`Config::drops_eagle_block`], decided for the whole spec group).
    eagle: bool,
}

/// Per-request state kept by the coordinator.
#[derive(Clone, Debug, Default)]
struct ReqState {
    /// The generation of the live request in this slot; 0 when the slot is free.
    generation: u32,
    /// Block hashes at `hash_block_size` granularity, as vLLM computed them.
    hashes: Vec<BlockHash>,
    /// The last cache hit found for the request, per group.
    hit: Vec<Vec<BlockId>>,
    /// The no-op limits of the request's next plain step: always equal to
    /// [`Allocator::noop_limits`] of its tables (refreshed by every call that changes them).
    noop: NoopLimits,
    /// The direct API only: the first token the request's tables were given slots for only
    /// after a `num_computed_tokens` already past it (those tokens were never written), so
    /// no block from there on is ever cached for it; `None` for every request the vLLM
    /// adapter drives ([`AllocateArgs::trust_computed_tokens`]).
    unwritten_from: Option<u32>,
    /// Hit-aware: the junctions and the probation input ([`hit_aware::HitAwareReq`]; all
    /// zero under `exact`).
    hit_aware: hit_aware::HitAwareReq,
    /// KV hints (hit-aware): what the request's free applies and its checkpoints; `None`
    /// for a request without hints.
    hints: Option<Box<hit_aware::ReqHints>>,
    /// Two-level pages: whether a slot group's table (a group not on the page side) of the
    /// request is non-empty, i.e. the request is counted in [`Allocator::slot_holders`]. Set
    /// by `allocate_slots` (the only call that grows a table), cleared by `release` (after
    /// `free` / `pop_blocks_for_free` emptied every table; nothing else shortens one).
    /// Always `false` with one pool.
    holds_slots: bool,
}

/// A caller-supplied token count as `u32`.
///
/// # Errors
/// [`Error::OutOfRange`] when `v` is negative or above `u32::MAX`.
pub fn token_count(name: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::OutOfRange(format!("{name}={v} is outside 0..=4294967295")))
}

/// The next generation: process-wide, so handles of different allocators never collide;
/// `1..2^31` (0 marks a free slot), so a handle fits an `i64`.
fn next_generation() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    loop {
        let g = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0x7FFF_FFFF;
        if g != 0 {
            return g;
        }
    }
}

/// Result of a cache-hit search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    /// Tokens of the hit (every group agrees on them).
    pub num_tokens: u32,
    /// A shared prefix that some group cached further than the hit (vLLM's
    /// `num_uncached_common_prefix_tokens`).
    pub num_uncached_common_prefix_tokens: u32,
}

/// The allocator: pool, managers, requests.
#[derive(Clone, Debug)]
pub struct Allocator {
    cfg: Config,
    /// The retention policy (see [`crate::policy`]); fixed at construction.
    policy: Policy,
    kind: CoordinatorKind,
    pool: BlockPool,
    managers: Vec<SingleTypeManager>,
    /// Cacheable spec groups, full attention first (hybrid search order).
    spec_groups: Vec<SpecGroup>,
    /// Request slots; `reqs[s].generation == 0` iff slot `s` is in `free_slots`.
    reqs: Vec<ReqState>,
    free_slots: Vec<Slot>,
    /// New block ids of the last `allocate_slots`, all groups concatenated.
    out_ids: Vec<BlockId>,
    /// `out_counts[g]`: how many of `out_ids` belong to group g.
    out_counts: Vec<u32>,
    /// Scratch for the hit search.
    scratch_spec: Vec<Vec<BlockId>>,
    /// Scratch: hashes read from the caller before they are committed (or probed).
    scratch_hashes: Vec<BlockHash>,
    /// Scratch: each group's blocks of a probed hit ([`Self::num_cached_tokens`]).
    scratch_probe: Vec<Vec<BlockId>>,
    /// The hashes the last sync dropped (put back when the call fails).
    undo_tail: Vec<BlockHash>,
    /// Hit-aware with partial hash hits: the hash-block prefixes of the prompts looked up so
    /// far (see [`hit_aware`]), bounded by [`hit_aware::MAX_SIGHTINGS`].
    sightings: rustc_hash::FxHashMap<BlockHash, hit_aware::Sight>,
    /// [`Config::partial_hash_hits`], computed once (it walks the groups).
    partial_hash_hits: bool,
    /// [`Config::cache_hit_alignment_tokens`], computed once.
    hit_alignment: u32,
    /// Two-level pages: bit `g` set when group `g` is a state group, whose blocks are
    /// pages of the page pool (`pool.side(true)`); 0 without pages (one pool).
    state_groups: u64,
    /// Two-level pages: the live requests holding slots (`ReqState::holds_slots` set), so
    /// the admission headroom is O(1) (checked against a recount by the invariant checks);
    /// 0 with one pool, where nothing updates it.
    slot_holders: u32,
}

/// The rooms' unit tests: full attention at 16 tokens + Mamba "align" at 32, over `k` slots
/// a page (1: one pool of 32-token blocks for both), 64 blocks (pages when `k > 1`), events on.
#[cfg(test)]
fn full_and_align_config(k: u32) -> Config {
    use crate::config::GroupSpec;
    let (attn, state) = if k == 1 { (32, 32) } else { (16, 32) };
    let align =
        AttentionKind::Mamba { speculative_blocks: 0, align: true, rekey_cached_tail: false, checkpoint_alignment: 0 };
    let groups = vec![
        GroupSpec { kind: AttentionKind::Full, block_size: attn, spec_key: 0 },
        GroupSpec { kind: align, block_size: state, spec_key: 1 },
    ];
    Config { slots_per_page: k, scheduler_block_size: state, enable_events: true, ..Config::new(64, groups, attn) }
}

/// Whether group `g` takes pages (a state group under two-level pages) in `state_groups`.
#[inline]
pub(crate) fn page_side(state_groups: u64, g: GroupId) -> bool {
    state_groups >> g & 1 != 0
}

impl Allocator {
    /// Builds an allocator with a retention policy ([`Policy::Exact`] is vLLM's).
    ///
    /// # Errors
    /// What [`Config::validate`] reports; [`Error::OutOfMemory`] when the pool's metadata
    /// cannot be allocated.
    pub fn new(cfg: Config, policy: Policy) -> Result<Self> {
        cfg.validate()?;
        let kind = cfg.coordinator_kind();
        let caching = cfg.enable_caching;
        let leveled = policy == Policy::HitAware && caching;
        let k = cfg.slots_per_page;
        if cfg.eagle_drop() && policy != Policy::Exact {
            return Err(Error::Unsupported(format!(
                "the {policy:?} policy is not served with the EAGLE/MTP block drop (exact only)"
            )));
        }
        if cfg.reprefillable_tokens > 0 && leveled {
            // Hit-aware keys junction states where a chunk ends, which multi-module MTP may
            // prefill again (vLLM turns its shared-prefix checkpoint off there too).
            return Err(Error::Unsupported(format!(
                "the {policy:?} policy with prefix caching is not served with {} re-prefillable tokens \
                 (multi-token prefill lookahead; exact only)",
                cfg.reprefillable_tokens
            )));
        }
        // Hit-aware over two-level pages: each pool holds its own policy state (the slot
        // pool its slots', the page pool its states'), and each group's rules take its own
        // pool's handle (docs/two-level-pages.md, "Hit-aware"). With prefix caching off it
        // decides as `exact` (nothing is cached), as with one pool.
        let mut pool = if k > 1 {
            BlockPool::try_new_paged(cfg.num_blocks, k, caching, cfg.enable_events, leveled)?
        } else {
            BlockPool::try_new_leveled(cfg.num_blocks, caching, cfg.enable_events, leveled)?
        };
        let state_groups = if k > 1 {
            cfg.groups.iter().enumerate().filter(|(_, g)| Config::is_state_group(g)).fold(0u64, |m, (i, _)| m | 1 << i)
        } else {
            0
        };
        pool.set_residency_log(cfg.residency_log);
        pool.set_stamp_keys(cfg.partial_block_entries());
        let align = cfg.cache_hit_alignment_tokens();
        let managers = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let mut m = SingleTypeManager::new(
                    *g,
                    i as GroupId,
                    cfg.max_admission_blocks(g),
                    caching,
                    align,
                    cfg.hash_block_size,
                    cfg.hash_lookahead_tokens,
                );
                m.set_records_new_block_ids(cfg.zero_new_blocks && g.kind.is_attention());
                m.set_boundary_offloads(cfg.boundary_offloads);
                m.set_eagle(cfg.drops_eagle_block(i));
                m.set_eagle_checkpoints(cfg.eagle_checkpoints);
                m.set_shared_prefix_checkpoint(cfg.shared_prefix_checkpoint());
                m
            })
            .collect();
        let mut spec_groups: Vec<SpecGroup> = Vec::new();
        for (i, g) in cfg.groups.iter().enumerate() {
            if !g.kind.takes_hits() {
                continue;
            }
            match spec_groups.iter_mut().find(|s| {
                s.kind == g.kind
                    && s.block_size == g.block_size
                    && cfg.groups[s.group_ids[0] as usize].spec_key == g.spec_key
            }) {
                Some(s) => s.group_ids.push(i as GroupId),
                None => spec_groups.push(SpecGroup {
                    kind: g.kind,
                    block_size: g.block_size,
                    group_ids: vec![i as GroupId],
                    eagle: cfg.drops_eagle_block(i),
                }),
            }
        }
        spec_groups.sort_by_key(|s| !s.kind.is_full());
        let n = cfg.groups.len();
        Ok(Self {
            policy,
            kind,
            pool,
            managers,
            spec_groups,
            reqs: Vec::new(),
            free_slots: Vec::new(),
            out_ids: Vec::new(),
            out_counts: vec![0; n],
            scratch_spec: vec![Vec::new(); n],
            scratch_hashes: Vec::new(),
            scratch_probe: vec![Vec::new(); n],
            undo_tail: Vec::new(),
            sightings: Default::default(),
            partial_hash_hits: cfg.partial_hash_hits(),
            hit_alignment: align,
            state_groups,
            slot_holders: 0,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The retention policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The block pool (read-only); with two-level pages the slot pool, which holds the
    /// page pool ([`Self::page_pool`]).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The page pool of two-level pages (`None` with `slots_per_page == 1`).
    pub fn page_pool(&self) -> Option<&BlockPool> {
        self.pool.page_pool()
    }

    /// The pool group `g`'s block ids index: the page pool for a state group under
    /// two-level pages, else [`Self::pool`].
    pub fn pool_for(&self, g: GroupId) -> &BlockPool {
        self.pool.side_ref(page_side(self.state_groups, g))
    }

    /// The managers, one per group.
    pub fn managers(&self) -> &[SingleTypeManager] {
        &self.managers
    }

    /// The pool and id of a flat block id as the id lists of `pop_blocks_for_free`,
    /// `free_block_ids` and `evict_blocks` write it: with two-level pages a slot id is
    /// itself and page `p` is `num_slots + p`; without, every id is the pool's. `None` when
    /// out of range.
    pub fn locate_block(&self, id: BlockId) -> Option<(&BlockPool, BlockId)> {
        let n = self.pool.num_blocks();
        match self.pool.page_pool() {
            _ if id < n => Some((&self.pool, id)),
            Some(s) if id - n < s.num_blocks() => Some((s, id - n)),
            _ => None,
        }
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.managers.len()
    }

    /// A new scheduler step starts (vLLM's `KVCacheManager.new_step_starts`): Mamba "align"
    /// groups stop deferring hits on states cached in the previous step.
    pub fn new_step_starts(&mut self) {
        for m in self.managers.iter_mut() {
            m.new_step_starts();
        }
    }

    /// Drains the block ids the attention groups handed out since the last call, group by
    /// group, for the model runner to zero (vLLM's `KVCacheManager.take_new_block_ids`).
    /// Empty unless [`Config::zero_new_blocks`].
    pub fn take_new_block_ids(&mut self) -> Vec<BlockId> {
        let mut out = Vec::new();
        for m in self.managers.iter_mut() {
            m.take_new_block_ids(&mut out);
        }
        out
    }

    /// Drains the boundary states the Mamba "align" groups keyed since the last call, for a
    /// KV connector (vLLM's `KVCacheManager.take_boundary_state_offloads`), as flat
    /// `[request handle, group, block, boundary tokens]` quadruples, group by group, each in
    /// the order the group keyed them. Empty unless [`Config::boundary_offloads`].
    pub fn take_boundary_state_offloads(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        for m in self.managers.iter_mut() {
            m.take_boundary_offloads(&mut out);
        }
        out
    }

    /// vLLM's `KVCacheManager.finalize_partial_tail_offloads` when `h` finishes (a KV
    /// producer's connector, before the free): each group's producer partial tail (see
    /// `SingleTypeManager::finalize_partial_tail_offload`) is popped, and those still
    /// holding the request's last state (`num_computed` equal to the tail's tokens and
    /// `num_in_flight` 0, compared as vLLM compares them) come back as flat
    /// `[group, block, boundary tokens]` triples, group by group.
    ///
    /// # Errors
    /// Unknown handle (checked before any change).
    pub fn finalize_partial_tail_offloads(
        &mut self,
        h: ReqHandle,
        num_computed: i64,
        num_in_flight: i64,
    ) -> Result<Vec<u64>> {
        let s = self.slot(h)?;
        let mut out = Vec::new();
        for m in self.managers.iter_mut() {
            if let Some((block, tokens)) = m.finalize_partial_tail_offload(s, num_computed, num_in_flight) {
                out.extend([m.group_id() as u64, block as u64, tokens as u64]);
            }
        }
        Ok(out)
    }

    /// Drains the copy-on-write copies queued since the last call (vLLM's
    /// `KVCacheManager.take_kv_cache_block_copies`), as flat `[source, copy, ...]` pairs,
    /// group by group. Both blocks of each pair hold one extra reference, which the caller
    /// gives back (`free_block_ids`, source then copy, pair by pair: vLLM's retained
    /// blocks) once the copy has run. Empty unless [`Config::partial_hash_hits`]. With
    /// two-level pages the ids are pool-wide, as `free_block_ids` takes them: a state
    /// group's page `p` is `num_slots + p` (only state groups copy: a slot is one hash block).
    pub fn take_kv_cache_block_copies(&mut self) -> Vec<BlockId> {
        let mut pairs = Vec::new();
        let num_slots = self.pool.num_blocks();
        for m in self.managers.iter_mut() {
            let before = pairs.len();
            m.take_pending_cow_copies(&mut pairs);
            if page_side(self.state_groups, m.group_id()) {
                pairs[before..].iter_mut().for_each(|(s, d)| (*s, *d) = (*s + num_slots, *d + num_slots));
            }
        }
        pairs.into_iter().flat_map(|(s, d)| [s, d]).collect()
    }

    /// Whether block ids wait in [`Self::take_new_block_ids`].
    pub fn has_new_block_ids(&self) -> bool {
        self.managers.iter().any(|m| !m.pending_new_block_ids().is_empty())
    }

    /// Records `h`'s blocks from token `start_token` on for zeroing again (vLLM's
    /// `record_blocks_for_zeroing`, after a failed KV load).
    ///
    /// # Errors
    /// Unknown handle; `start_token` not a multiple of a recording group's block size
    /// (checked before any change).
    pub fn record_blocks_for_zeroing(&mut self, h: ReqHandle, start_token: u32) -> Result<()> {
        let s = self.slot(h)?;
        if let Some(m) = self.managers.iter().find(|m| m.records_new_block_ids() && start_token % m.block_size() != 0) {
            return Err(Error::OutOfRange(format!(
                "start_token={start_token} is not a multiple of group {}'s block size {}",
                m.group_id(),
                m.block_size()
            )));
        }
        for m in self.managers.iter_mut() {
            let idx = (start_token / m.block_size()) as usize;
            m.record_blocks_for_zeroing(s, idx);
        }
        Ok(())
    }

    /// Free blocks; with two-level pages, whole free pages (the page queue).
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.free_pages()
    }

    /// Usage in `[0, 1]`; with two-level pages, `1 - (free pages + free slots of open
    /// pages / k) / (pages - 1)`.
    pub fn usage(&self) -> f64 {
        self.pool.page_usage()
    }

    /// Takes the queued KV cache events.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.pool.take_events()
    }

    /// Whether events wait.
    pub fn has_events(&self) -> bool {
        self.pool.has_events()
    }

    /// Takes the residency log: the calls vLLM's `BlockPool` would have made on a
    /// `KVCacheMetricsCollector` since the last take, in its order (see [`ResidencyOp`]).
    /// Empty unless [`Config::residency_log`]; take it after every call, or it grows.
    pub fn take_residency_log(&mut self) -> Vec<(ResidencyOp, BlockId)> {
        self.pool.take_residency_log()
    }

    /// Whether residency log entries wait.
    pub fn has_residency_log(&self) -> bool {
        self.pool.has_residency_log()
    }
}
