//! The coordinator: several KV cache groups sharing one block pool, with the request-level
//! operations of vLLM's `KVCacheManager` (+ `KVCacheCoordinator`): cache-hit search across
//! groups (the hybrid fixed point), slot allocation that checks capacity over every group
//! before it changes anything, caching of full blocks, freeing, events.
//!
//! Requests are dense handles into a slab; per request the coordinator keeps the block
//! hashes vLLM computed (appended incrementally, never re-sent) and the last cache hit
//! found for it, and each group's manager keeps its block table.
//!
//! Cost: `allocate_slots` for a decoding request is O(groups) with no allocation (new
//! block ids go to reused buffers); a hit search is O(blocks scanned); `free` O(table).
#![forbid(unsafe_code)]

use crate::block_pool::{BlockPool, Event};
use crate::config::{AttentionKind, Config, CoordinatorKind};
use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};
use crate::manager::{cdiv, find_longest_cache_hit, CacheArgs, CountArgs, HashView, HitQuery, SingleTypeManager};
use crate::policy::{Level, Policy, LEVEL_NORMAL, LEVEL_SPECULATIVE};

/// Groups with equal specs, looked up together (vLLM's `SpecGroup`).
#[derive(Clone, Debug)]
struct SpecGroup {
    kind: AttentionKind,
    block_size: u32,
    group_ids: Vec<GroupId>,
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
}

/// Block hashes as the caller holds them (vLLM's `request.block_hashes`): a list that
/// usually only grows, but may be cleared and regrown or truncated between two calls.
/// The core reads only what it needs: one entry to detect a rewrite, then the new tail.
pub trait HashSource {
    /// Number of hashes.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Hash `i` (`i < len()`).
    ///
    /// # Errors
    /// The entry is not a valid hash (not bytes, empty, longer than 32 bytes).
    fn get(&self, i: usize) -> Result<BlockHash>;
}

impl HashSource for [BlockHash] {
    fn len(&self) -> usize {
        <[BlockHash]>::len(self)
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        Ok(self[i])
    }
}

impl HashSource for Vec<BlockHash> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn get(&self, i: usize) -> Result<BlockHash> {
        Ok(self[i])
    }
}

/// What [`Allocator::sync_hashes`] changed, so a call that fails later can put it back.
#[derive(Clone, Copy, Debug)]
struct HashUndo {
    /// Hashes kept from before the sync (a common prefix with the caller's list).
    keep: usize,
}

/// `(slots, processed, cached)`: a plain step of a request (no new hit, no external or
/// encoder tokens, no admission gate, reserve or watermark) with `num_computed_tokens +
/// num_new_tokens + num_lookahead_tokens <= slots`, `num_computed_tokens -
/// num_in_flight_tokens < processed` and `min(num_computed_tokens + num_new_tokens,
/// num_tokens) < cached` and `num_new_tokens <= new_tokens` allocates, frees and caches
/// nothing, provided its `num_prompt_tokens >= prompt`. `(0, 0, 0, 0, 0)` proves nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoopLimits {
    /// Token slots the tables already hold.
    pub slots: u32,
    /// Processed tokens below which no block falls out of a window.
    pub processed: u32,
    /// Tokens below which no new block becomes full (and cacheable).
    pub cached: u32,
    /// Most tokens a no-op step schedules (a wider step may reserve a Mamba prefill
    /// checkpoint block).
    pub new_tokens: u32,
    /// The smallest `num_prompt_tokens` the limits hold for (0: any). Only an R-SWA group
    /// sets it: its gap starts after the prompt, so a shorter prompt could free more.
    pub prompt: u32,
}

impl NoopLimits {
    /// Proves everything (the identity of [`Self::min`]).
    pub const ANY: Self =
        Self { slots: u32::MAX, processed: u32::MAX, cached: u32::MAX, new_tokens: u32::MAX, prompt: 0 };

    /// The component-wise minimum with one group's limits (the prompt bound is left).
    fn min(self, (slots, processed, cached, new_tokens): (u32, u32, u32, u32)) -> Self {
        Self {
            slots: self.slots.min(slots),
            processed: self.processed.min(processed),
            cached: self.cached.min(cached),
            new_tokens: self.new_tokens.min(new_tokens),
            prompt: self.prompt,
        }
    }
}

/// The request fields a plain step reads, read lazily (the vLLM adapter reads them as
/// attributes of vLLM's `Request`; most steps need only the first two).
pub trait StepFields {
    /// The caller's error type (the core's errors convert into it).
    type Error: From<Error>;
    /// `request.num_computed_tokens`.
    fn num_computed_tokens(&self) -> std::result::Result<i64, Self::Error>;
    /// `request.num_in_flight_tokens`.
    fn num_in_flight_tokens(&self) -> std::result::Result<i64, Self::Error>;
    /// `request.num_tokens`.
    fn num_tokens(&self) -> std::result::Result<i64, Self::Error>;
    /// `request.num_prompt_tokens`.
    fn num_prompt_tokens(&self) -> std::result::Result<i64, Self::Error>;
    /// `request.shared_prefix_boundary`.
    fn shared_prefix_boundary(&self) -> std::result::Result<i64, Self::Error>;
    /// Runs `f` with `request.block_hashes`.
    fn with_block_hashes<T>(
        &self,
        f: impl FnOnce(&dyn HashSource) -> std::result::Result<T, Self::Error>,
    ) -> std::result::Result<T, Self::Error>;
}

/// What [`Allocator::plain_step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainStep {
    /// The handle is not a live request of this allocator (the caller serves the step
    /// another way).
    NotHere,
    /// The step provably changes nothing: no call into the allocation code was made.
    NoOp,
    /// `allocate_slots` ran: its result.
    Allocated(Option<u32>),
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

/// The arguments of `allocate_slots` besides the request and its cache hit; the request
/// fields vLLM reads are passed in (`num_computed_tokens`, `num_tokens`, ...).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocateArgs {
    /// Tokens to compute this step (including unverified draft tokens).
    pub num_new_tokens: u32,
    /// Tokens of the local prefix-cache hit being adopted now.
    pub num_new_computed_tokens: u32,
    /// Speculative lookahead slots.
    pub num_lookahead_tokens: u32,
    /// Tokens a KV connector computed.
    pub num_external_computed_tokens: u32,
    /// Skip caching (P/D receives).
    pub delay_cache_blocks: bool,
    /// Encoder tokens for cross attention.
    pub num_encoder_tokens: u32,
    /// Admission gate: only allocate if the whole sequence fits.
    pub full_sequence_must_fit: bool,
    /// Free blocks kept for other in-flight sequences.
    pub reserved_blocks: u32,
    /// Apply the watermark (the request is waiting or preempted and others run).
    pub apply_watermark: bool,
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: u32,
    /// `request.num_in_flight_tokens`.
    pub num_in_flight_tokens: u32,
    /// `request.num_prompt_tokens`.
    pub num_prompt_tokens: u32,
    /// `request.num_tokens`.
    pub num_tokens: u32,
    /// `request.shared_prefix_boundary`.
    pub shared_prefix_boundary: u32,
    /// Bit `g` set: group `g`'s blocks for external tokens are written by an async load and
    /// are not recorded for zeroing (vLLM's `skip_zeroing_group_ids`).
    pub skip_zeroing_groups: u64,
}

/// Where `allocate_slots` takes the request's new cache-hit blocks from.
#[derive(Clone, Copy, Debug)]
pub enum NewComputed<'a> {
    /// No hit (vLLM's shared empty `KVCacheBlocks`).
    Empty,
    /// The hit the last `get_computed_blocks` found for this request.
    Stored,
    /// Explicit block ids per group.
    Explicit(&'a [Vec<BlockId>]),
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
    /// Scratch: hashes read from the caller before they are committed.
    scratch_hashes: Vec<BlockHash>,
    /// The hashes the last sync dropped (put back when the call fails).
    undo_tail: Vec<BlockHash>,
}

impl Allocator {
    /// Builds an allocator.
    ///
    /// # Errors
    /// What [`Config::validate`] reports; [`Error::OutOfMemory`] when the pool's metadata
    /// cannot be allocated.
    pub fn new(cfg: Config) -> Result<Self> {
        Self::with_policy(cfg, Policy::Exact)
    }

    /// Builds an allocator with a retention policy ([`Policy::Exact`] is [`Self::new`]).
    ///
    /// # Errors
    /// Those of [`Self::new`].
    pub fn with_policy(cfg: Config, policy: Policy) -> Result<Self> {
        cfg.validate()?;
        let kind = cfg.coordinator_kind();
        let caching = cfg.enable_caching;
        let leveled = policy == Policy::HitAware && caching;
        let pool = BlockPool::try_new_leveled(cfg.num_blocks, caching, cfg.enable_events, leveled)?;
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
                m.records_new_block_ids = cfg.zero_new_blocks && g.kind.is_attention();
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
            undo_tail: Vec::new(),
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

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The managers, one per group.
    pub fn managers(&self) -> &[SingleTypeManager] {
        &self.managers
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.managers.len()
    }

    // ---- requests -------------------------------------------------------------------

    /// Registers a request; returns its handle (`generation << 32 | slot`, see
    /// [`ReqHandle`]).
    pub fn add_request(&mut self) -> ReqHandle {
        let s = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.reqs.push(ReqState::default());
                (self.reqs.len() - 1) as Slot
            }
        };
        let ng = self.managers.len();
        let st = &mut self.reqs[s as usize];
        st.generation = next_generation();
        st.hashes.clear();
        if st.hit.len() != ng {
            st.hit = vec![Vec::new(); ng];
        }
        for v in st.hit.iter_mut() {
            v.clear();
        }
        for m in self.managers.iter_mut() {
            m.ensure_slot(s);
        }
        self.refresh_noop(s);
        self.handle_of(s)
    }

    fn handle_of(&self, s: Slot) -> ReqHandle {
        (self.reqs[s as usize].generation as u64) << 32 | s as u64
    }

    /// The slot of a live handle.
    fn slot(&self, h: ReqHandle) -> Result<Slot> {
        let s = (h & 0xFFFF_FFFF) as Slot;
        match self.reqs.get(s as usize) {
            Some(st) if st.generation != 0 && st.generation as u64 == h >> 32 => Ok(s),
            _ => Err(Error::UnknownRequest(h)),
        }
    }

    /// Whether `h` is a live request of this allocator.
    pub fn is_live(&self, h: ReqHandle) -> bool {
        self.slot(h).is_ok()
    }

    /// Whether slot `s` holds a live request (invariant checks).
    pub fn slot_is_live(&self, s: Slot) -> bool {
        self.reqs.get(s as usize).is_some_and(|st| st.generation != 0)
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.reqs.len() - self.free_slots.len()
    }

    /// Appends block hashes to a request (`hash_len` bytes each, concatenated).
    ///
    /// # Errors
    /// Unknown handle; `hash_len` not in `1..=32` or not dividing `bytes.len()`.
    pub fn append_hashes(&mut self, h: ReqHandle, bytes: &[u8], hash_len: usize) -> Result<()> {
        let s = self.slot(h)?;
        if bytes.is_empty() {
            return Ok(());
        }
        if hash_len == 0 || hash_len > crate::ids::MAX_HASH_LEN || bytes.len() % hash_len != 0 {
            return Err(Error::OutOfRange(format!(
                "hash bytes of length {} cannot be split into hashes of {hash_len} bytes",
                bytes.len()
            )));
        }
        let st = &mut self.reqs[s as usize];
        st.hashes.extend(bytes.chunks_exact(hash_len).map(|c| BlockHash::from_bytes(c).expect("length checked")));
        Ok(())
    }

    /// Drops hashes of `h` past the first `n`.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn truncate_hashes(&mut self, h: ReqHandle, n: usize) -> Result<()> {
        let s = self.slot(h)?;
        self.reqs[s as usize].hashes.truncate(n);
        Ok(())
    }

    /// Brings the request's hashes up to `src`, the caller's whole list. Block hashes are
    /// chained (each covers its whole prefix), so when the entry at the last common index
    /// agrees the lists agree up to it (O(1)); otherwise (the caller cleared and regrew the
    /// list, or truncated it) the hashes are kept up to the first difference and the rest
    /// are taken from `src`. Every new entry is read and checked before anything changes.
    fn sync_hashes(&mut self, s: Slot, src: &dyn HashSource) -> Result<HashUndo> {
        let known = &self.reqs[s as usize].hashes;
        let k = known.len();
        let n = src.len();
        let m = k.min(n);
        let keep = if m == 0 || src.get(m - 1)? == known[m - 1] {
            m
        } else {
            let mut i = 0;
            while i < m && src.get(i)? == known[i] {
                i += 1;
            }
            i
        };
        let mut staged = std::mem::take(&mut self.scratch_hashes);
        staged.clear();
        for i in keep..n {
            match src.get(i) {
                Ok(x) => staged.push(x),
                Err(e) => {
                    self.scratch_hashes = staged;
                    return Err(e);
                }
            }
        }
        let st = &mut self.reqs[s as usize];
        self.undo_tail.clear();
        self.undo_tail.extend_from_slice(&st.hashes[keep..]);
        st.hashes.truncate(keep);
        st.hashes.extend_from_slice(&staged);
        self.scratch_hashes = staged;
        Ok(HashUndo { keep })
    }

    fn undo_hashes(&mut self, s: Slot, u: HashUndo) {
        let st = &mut self.reqs[s as usize];
        st.hashes.truncate(u.keep);
        st.hashes.extend_from_slice(&self.undo_tail);
    }

    /// Brings the request's hashes up to `src` (see [`HashSource`]).
    ///
    /// # Errors
    /// Unknown handle; an invalid entry in `src` (nothing changes).
    pub fn set_hashes(&mut self, h: ReqHandle, src: &dyn HashSource) -> Result<()> {
        let s = self.slot(h)?;
        self.sync_hashes(s, src).map(|_| ())
    }

    /// Number of block hashes known for `h`.
    pub fn num_hashes(&self, h: ReqHandle) -> Result<usize> {
        let s = self.slot(h)?;
        Ok(self.reqs[s as usize].hashes.len())
    }

    /// The hashes of `h`.
    pub fn hashes(&self, h: ReqHandle) -> Result<&[BlockHash]> {
        let s = self.slot(h)?;
        Ok(&self.reqs[s as usize].hashes)
    }

    /// The block table of `h` in group `g`.
    ///
    /// # Errors
    /// Unknown handle or group.
    pub fn blocks(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        let s = self.slot(h)?;
        let m = self.managers.get(g).ok_or_else(|| Error::OutOfRange(format!("group {g}")))?;
        Ok(m.blocks(s))
    }

    /// The last cache hit stored for `h`, group `g`.
    pub fn stored_hit(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        let s = self.slot(h)?;
        self.reqs[s as usize].hit.get(g).map(|v| v.as_slice()).ok_or_else(|| Error::OutOfRange(format!("group {g}")))
    }

    // ---- cache-hit search -----------------------------------------------------------

    /// Finds the longest cache hit of `h` not longer than `max_cache_hit_length` tokens and
    /// stores it as the request's pending hit (vLLM's `coordinator.find_longest_cache_hit`,
    /// called by `get_computed_blocks` with `num_tokens - 1`). Touches nothing.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn find_longest_cache_hit(&mut self, h: ReqHandle, max_cache_hit_length: u32) -> Result<Hit> {
        let s = self.slot(h)?;
        Ok(self.find_hit(s, max_cache_hit_length))
    }

    /// [`Self::find_longest_cache_hit`] after bringing the request's hashes up to `hashes`.
    ///
    /// # Errors
    /// Unknown handle; an invalid hash (nothing changes).
    pub fn get_computed_blocks(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        max_cache_hit_length: u32,
    ) -> Result<Hit> {
        let s = self.slot(h)?;
        if let Some(src) = hashes {
            self.sync_hashes(s, src)?;
        }
        Ok(self.find_hit(s, max_cache_hit_length))
    }

    fn find_hit(&mut self, s: Slot, max_cache_hit_length: u32) -> Hit {
        let mut hit = std::mem::take(&mut self.reqs[s as usize].hit);
        for v in hit.iter_mut() {
            v.clear();
        }
        let res = match self.kind {
            CoordinatorKind::NoPrefixCache => Hit { num_tokens: 0, num_uncached_common_prefix_tokens: 0 },
            CoordinatorKind::Unitary => {
                let m = &self.managers[0];
                let bs = m.block_size();
                let view = HashView { hashes: &self.reqs[s as usize].hashes, scale: bs / self.cfg.hash_block_size };
                let q = HitQuery {
                    pool: &self.pool,
                    view,
                    max_length: max_cache_hit_length,
                    group_ids: &[0],
                    block_size: bs,
                    alignment_tokens: bs,
                };
                let n = find_longest_cache_hit(m.spec.kind, &q, &mut hit[..1]);
                Hit { num_tokens: n, num_uncached_common_prefix_tokens: 0 }
            }
            CoordinatorKind::Hybrid => self.hybrid_hit(s, max_cache_hit_length, &mut hit),
        };
        self.reqs[s as usize].hit = hit;
        res
    }

    fn hybrid_hit(&mut self, s: Slot, max_len: u32, out: &mut [Vec<BlockId>]) -> Hit {
        let ng = self.managers.len();
        let align = self.cfg.cache_hit_alignment_tokens();
        let mut hit_length = max_len;
        let mut longest = 0u32;
        let mut computed = 0u64; // bitset of groups with a result
        let mut len_by_group = [0u32; 64];
        let simple = self.spec_groups.len() == 2 && self.spec_groups[0].kind.is_full();
        let hashes = &self.reqs[s as usize].hashes;
        let mut tmp = std::mem::take(&mut self.scratch_spec);
        loop {
            let mut curr = hit_length;
            for sg in &self.spec_groups {
                let first = sg.group_ids[0] as usize;
                if sg.kind.is_full() && computed & (1 << first) != 0 {
                    curr = curr.min(len_by_group[first]);
                    continue;
                }
                let view = HashView { hashes, scale: sg.block_size / self.cfg.hash_block_size };
                let k = sg.group_ids.len();
                let q = HitQuery {
                    pool: &self.pool,
                    view,
                    max_length: curr,
                    group_ids: &sg.group_ids,
                    block_size: sg.block_size,
                    alignment_tokens: align,
                };
                let new_len = find_longest_cache_hit(sg.kind, &q, &mut tmp[..k]);
                curr = new_len;
                for (j, &gid) in sg.group_ids.iter().enumerate() {
                    std::mem::swap(&mut out[gid as usize], &mut tmp[j]);
                    len_by_group[gid as usize] = new_len;
                    computed |= 1 << gid;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        self.scratch_spec = tmp;
        for sg in &self.spec_groups {
            if !sg.kind.is_full() {
                continue;
            }
            let keep = cdiv(hit_length as u64, sg.block_size as u64) as usize;
            for &gid in &sg.group_ids {
                out[gid as usize].truncate(keep);
            }
        }
        debug_assert!(ng <= 64);
        Hit { num_tokens: hit_length, num_uncached_common_prefix_tokens: longest - hit_length }
    }

    // ---- allocation -----------------------------------------------------------------

    /// The sum over groups of [`SingleTypeManager::get_num_blocks_to_allocate`]; may be
    /// negative (a Mamba "align" group over-allocated in an earlier step), as in vLLM.
    #[allow(clippy::too_many_arguments)]
    fn num_blocks_to_allocate(
        &self,
        s: Slot,
        num_tokens: u32,
        num_tokens_main_model: u32,
        new_computed: &[Vec<BlockId>],
        num_encoder_tokens: u32,
        total_computed_tokens: u32,
        apply_admission_cap: bool,
        adopting: bool,
        prefill_end: u32,
    ) -> i64 {
        let mut n = 0i64;
        for (i, m) in self.managers.iter().enumerate() {
            let c = if m.spec.kind.sized_by_encoder_tokens() {
                CountArgs {
                    num_tokens: num_encoder_tokens,
                    num_tokens_main_model: num_encoder_tokens,
                    apply_admission_cap,
                    adopting,
                    ..CountArgs::default()
                }
            } else {
                CountArgs {
                    num_tokens,
                    num_tokens_main_model,
                    new_computed: new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]),
                    total_computed_tokens,
                    apply_admission_cap,
                    adopting,
                    prefill_end,
                }
            };
            n += m.get_num_blocks_to_allocate(&self.pool, s, &c);
        }
        n
    }

    /// Blocks `h` needs from the pool for `num_tokens` slots (`num_tokens_main_model` of
    /// them for the target model) with no new hit (vLLM's
    /// `coordinator.get_num_blocks_to_allocate`, used by the scheduler directly). Negative
    /// when a Mamba "align" table holds more than it needs, as in vLLM. `prefill_end` is
    /// where the request's prefill ends (read under retention interval 0 only). Without the
    /// admission cap the count records the Mamba prefill checkpoint it reserves, as vLLM's.
    ///
    /// # Errors
    /// Unknown handle.
    #[allow(clippy::too_many_arguments)]
    pub fn get_num_blocks_to_allocate(
        &mut self,
        h: ReqHandle,
        num_tokens: u32,
        num_tokens_main_model: u32,
        num_encoder_tokens: u32,
        total_computed_tokens: u32,
        apply_admission_cap: bool,
        prefill_end: u32,
    ) -> Result<i64> {
        let s = self.slot(h)?;
        let prefill_end = self.effective_prefill_end(prefill_end);
        let n = self.num_blocks_to_allocate(
            s,
            num_tokens,
            num_tokens_main_model,
            &[],
            num_encoder_tokens,
            total_computed_tokens,
            apply_admission_cap,
            true,
            prefill_end,
        );
        if !apply_admission_cap {
            self.record_checkpoints(s, &[], total_computed_tokens, num_tokens_main_model, prefill_end);
            self.refresh_noop(s);
        }
        Ok(n)
    }

    /// vLLM's coordinator passes `prefill_end` on only under retention interval 0 (under
    /// dense or segment retention every chunk publishes a state).
    fn effective_prefill_end(&self, prefill_end: u32) -> u32 {
        if self.cfg.retention_interval == Some(0) {
            prefill_end
        } else {
            0
        }
    }

    /// Every Mamba "align" group records the prefill checkpoint of this count.
    fn record_checkpoints(
        &mut self,
        s: Slot,
        new_computed: &[Vec<BlockId>],
        query_start: u32,
        query_end: u32,
        prefill_end: u32,
    ) {
        for (i, m) in self.managers.iter_mut().enumerate() {
            let nc: &[BlockId] = new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            m.record_checkpoint(&self.pool, s, nc, query_start, query_end, prefill_end);
        }
    }

    /// vLLM's `KVCacheManager.allocate_slots`. On success the new blocks are in
    /// [`Self::new_block_ids`] (per group counts in [`Self::new_block_counts`]) and the
    /// result is `Some(total new blocks)`; `None` means they do not fit. As in vLLM,
    /// out-of-window blocks are freed even when the result is `None`.
    ///
    /// # Errors
    /// Checked before any change, so a failed call changes nothing:
    /// - unknown handle;
    /// - nothing to do (`num_new_tokens == 0` with nothing to adopt);
    /// - token counts whose sum leaves `u32`, or external tokens reaching past
    ///   `max_model_len` (their blocks would not be counted by the capacity check);
    /// - a cache hit that is not one: see [`NewComputed`] (wrong number of groups, a length
    ///   other than `num_new_computed_tokens / block_size`, a block out of range, null
    ///   where the group's layout has no null, used twice, or not cached with the hash this
    ///   request has at that position; a stored hit whose blocks were reused since the
    ///   search is refused the same way);
    /// - cache-hit blocks with prefix caching off, for a running request, or for a request
    ///   that already holds blocks (computed tokens are adopted only into an empty table).
    pub fn allocate_slots(
        &mut self,
        h: ReqHandle,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
    ) -> Result<Option<u32>> {
        self.allocate_slots_synced(h, a, new_computed, None)
    }

    /// [`Self::allocate_slots`] after bringing the request's hashes up to `hashes` (undone
    /// if the call fails).
    ///
    /// # Errors
    /// Those of [`Self::allocate_slots`]; an invalid hash.
    pub fn allocate_slots_synced(
        &mut self,
        h: ReqHandle,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
        hashes: Option<&dyn HashSource>,
    ) -> Result<Option<u32>> {
        let s = self.slot(h)?;
        if a.num_new_tokens == 0 && a.num_external_computed_tokens == 0 && a.num_new_computed_tokens == 0 {
            return Err(Error::OutOfRange(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt".into(),
            ));
        }
        let num_local = a.num_computed_tokens as u64 + a.num_new_computed_tokens as u64;
        let total = num_local + a.num_external_computed_tokens as u64;
        if total + a.num_new_tokens as u64 + a.num_lookahead_tokens as u64 > u32::MAX as u64 {
            return Err(Error::OutOfRange(format!(
                "num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens + num_new_tokens \
                 + num_lookahead_tokens = {} does not fit 32 bits",
                total + a.num_new_tokens as u64 + a.num_lookahead_tokens as u64
            )));
        }
        if a.num_external_computed_tokens > 0 && total > self.cfg.max_model_len as u64 {
            return Err(Error::OutOfRange(format!(
                "{total} computed tokens (local + external) exceed max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        let undo = match hashes {
            Some(src) => Some(self.sync_hashes(s, src)?),
            None => None,
        };
        if matches!(new_computed, NewComputed::Empty) && self.is_noop(s, a) {
            // Provably changes nothing (see `NoopLimits`): skip the allocation code.
            self.out_ids.clear();
            self.out_counts.iter_mut().for_each(|c| *c = 0);
            return Ok(Some(0));
        }
        let stored = match new_computed {
            NewComputed::Stored => Some(std::mem::take(&mut self.reqs[s as usize].hit)),
            _ => None,
        };
        let res = self.allocate_with(s, a, new_computed, stored.as_deref());
        if let Some(mut back) = stored {
            if res.is_ok() {
                for v in back.iter_mut() {
                    v.clear();
                }
            }
            self.reqs[s as usize].hit = back;
        }
        match res {
            Ok(r) => {
                self.refresh_noop(s);
                Ok(r)
            }
            Err(e) => {
                if let Some(u) = undo {
                    self.undo_hashes(s, u);
                }
                Err(e)
            }
        }
    }

    /// Checks a hit before it is adopted (see [`Self::allocate_slots`]).
    fn validate_hit(&self, s: Slot, nc: &[Vec<BlockId>], num_new_computed_tokens: u32, explicit: bool) -> Result<()> {
        let ng = self.managers.len();
        if nc.len() != ng {
            return Err(Error::OutOfRange(format!("{} hit groups given, the config has {ng}", nc.len())));
        }
        let hashes = &self.reqs[s as usize].hashes;
        let nb = self.pool.num_blocks();
        if let Some(&b) = nc.iter().flatten().find(|&&b| b >= nb) {
            return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {nb}")));
        }
        let mut seen: rustc_hash::FxHashSet<BlockId> = Default::default();
        for (g, (m, v)) in self.managers.iter().zip(nc).enumerate() {
            if !m.spec.kind.takes_hits() {
                if !v.is_empty() {
                    return Err(Error::OutOfRange(format!(
                        "group {g} (cross attention or circular buffer) cannot have cache-hit blocks"
                    )));
                }
                continue;
            }
            let bs = m.block_size();
            if v.len() as u64 * bs as u64 != num_new_computed_tokens as u64 {
                return Err(Error::OutOfRange(format!(
                    "group {g}: a hit of {} blocks of {bs} tokens for num_new_computed_tokens={num_new_computed_tokens}",
                    v.len()
                )));
            }
            if v.is_empty() {
                continue;
            }
            let view = HashView { hashes, scale: bs / self.cfg.hash_block_size };
            if v.len() as u64 > view.len() as u64 {
                return Err(Error::OutOfRange(format!(
                    "group {g}: a hit of {} blocks, but the request has hashes for {}",
                    v.len(),
                    view.len()
                )));
            }
            let nulls_allowed = !m.spec.kind.is_full();
            let mut leading = true;
            for (i, &b) in v.iter().enumerate() {
                if b == NULL_BLOCK {
                    if !(nulls_allowed && leading) {
                        return Err(Error::InvalidBlock(format!(
                            "group {g}: the null block at hit position {i} (only a sliding-window or \
                             chunked group's hit starts with null blocks)"
                        )));
                    }
                    continue;
                }
                leading = false;
                if explicit && !seen.insert(b) {
                    return Err(Error::InvalidBlock(format!("block {b} appears twice in the hit")));
                }
                let want = (view.get(i as u32), g as GroupId);
                if self.pool.block_hash(b) != Some(&want) {
                    return Err(Error::InvalidBlock(format!(
                        "block {b} at hit position {i} of group {g} is not cached with this request's \
                         hash for that position{}",
                        if explicit { "" } else { " (it was reused since the hit was found)" }
                    )));
                }
            }
        }
        Ok(())
    }

    fn allocate_with(
        &mut self,
        s: Slot,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
        stored: Option<&[Vec<BlockId>]>,
    ) -> Result<Option<u32>> {
        let (nc, explicit): (&[Vec<BlockId>], bool) = match new_computed {
            NewComputed::Empty => (&[], false),
            NewComputed::Stored => (stored.unwrap_or(&[]), false),
            NewComputed::Explicit(v) => (v, true),
        };
        let has_new_computed = nc.iter().any(|v| !v.is_empty());
        if has_new_computed && !self.cfg.enable_caching {
            return Err(Error::OutOfRange("cache-hit blocks given with prefix caching off".into()));
        }
        if nc.is_empty() {
            if a.num_new_computed_tokens != 0 {
                return Err(Error::OutOfRange(format!(
                    "num_new_computed_tokens={} without cache-hit blocks",
                    a.num_new_computed_tokens
                )));
            }
        } else {
            self.validate_hit(s, nc, a.num_new_computed_tokens, explicit)?;
        }
        let num_local = a.num_computed_tokens as u64 + a.num_new_computed_tokens as u64;
        for (m, v) in self.managers.iter().zip(nc) {
            if m.is_mamba_align() && !v.is_empty() && num_local % m.block_size() as u64 != 0 {
                return Err(Error::OutOfRange(format!(
                    "a Mamba hit ending inside a block ({num_local} computed tokens, block size {}): \
                     a partial hit needs copy-on-write, which is not served",
                    m.block_size()
                )));
            }
        }
        let tracked = self.managers.iter().any(|m| m.is_tracked(s));
        if has_new_computed && tracked {
            return Err(Error::OutOfRange("a running request cannot adopt new cache-hit blocks".into()));
        }
        // Not tracked yet (nothing cached) but holding blocks: adoption would need an empty
        // table (`add_local_computed_blocks`; vLLM asserts it), so refuse before any change.
        let adopts = has_new_computed || a.num_external_computed_tokens > 0;
        if adopts && !tracked && self.managers.iter().any(|m| !m.blocks(s).is_empty()) {
            return Err(Error::OutOfRange("a request that already holds blocks cannot adopt computed tokens".into()));
        }
        Ok(self.allocate_slots_inner(s, a, nc, adopts && !tracked))
    }

    /// The allocation itself; every check passed. Token sums fit `u32` (checked by the
    /// caller), so the arithmetic here cannot wrap.
    fn allocate_slots_inner(&mut self, s: Slot, a: &AllocateArgs, nc: &[Vec<BlockId>], adopts: bool) -> Option<u32> {
        let mml = self.cfg.max_model_len;
        let num_local = a.num_computed_tokens + a.num_new_computed_tokens;
        let unclamped_total = num_local + a.num_external_computed_tokens;
        let total_computed = unclamped_total.min(mml);
        let watermark = if a.apply_watermark { self.cfg.watermark_blocks as u64 } else { 0 };
        // vLLM: `max(num_prompt_tokens, num_tokens - 1)`, the scheduler's prefill boundary.
        let prefill_end = self.effective_prefill_end(a.num_prompt_tokens.max(a.num_tokens.saturating_sub(1)));
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(mml);
            let need = self.num_blocks_to_allocate(
                s,
                full,
                full,
                nc,
                a.num_encoder_tokens,
                total_computed,
                true,
                adopts,
                prefill_end,
            );
            if need + watermark as i64 > self.pool.num_free_blocks() as i64 {
                return None;
            }
        }
        let main = total_computed + a.num_new_tokens;
        let need_slot = (main + a.num_lookahead_tokens).min(mml);
        let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
        for m in self.managers.iter_mut() {
            m.remove_skipped_blocks(&mut self.pool, s, processed, Some(a.num_prompt_tokens));
        }
        let need = self.num_blocks_to_allocate(
            s,
            need_slot,
            main,
            nc,
            a.num_encoder_tokens,
            unclamped_total,
            false,
            adopts,
            prefill_end,
        );
        // Recorded before the capacity check, as vLLM's count records it.
        self.record_checkpoints(s, nc, unclamped_total, main, prefill_end);
        let available = self.pool.num_free_blocks() as i64 - a.reserved_blocks as i64;
        if need + watermark as i64 > available {
            return None;
        }
        if adopts {
            self.allocate_new_computed_blocks(s, nc, num_local, a.num_external_computed_tokens, a.skip_zeroing_groups);
            if self.pool.is_leveled() {
                for m in &self.managers {
                    m.promote_hit(&mut self.pool, s);
                }
            }
        }
        self.out_ids.clear();
        for (g, m) in self.managers.iter_mut().enumerate() {
            let before = self.out_ids.len();
            let n = if m.spec.kind.sized_by_encoder_tokens() { a.num_encoder_tokens } else { need_slot };
            m.allocate_new_blocks(&mut self.pool, s, n, main, &mut self.out_ids);
            self.out_counts[g] = (self.out_ids.len() - before) as u32;
        }
        if !a.delay_cache_blocks {
            // Draft tokens are never cached (vLLM); nor are tokens past the table (a step
            // reaching past `max_model_len` gets `max_model_len` slots).
            let to_cache = main.min(a.num_tokens).min(need_slot);
            self.cache_blocks_inner(s, to_cache, a.num_prompt_tokens, a.shared_prefix_boundary);
        }
        Some(self.out_ids.len() as u32)
    }

    fn allocate_new_computed_blocks(
        &mut self,
        s: Slot,
        nc: &[Vec<BlockId>],
        num_local: u32,
        num_external: u32,
        skip_zeroing_groups: u64,
    ) {
        for (i, m) in self.managers.iter_mut().enumerate() {
            let blocks: &[BlockId] = nc.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            m.add_local_computed_blocks(&mut self.pool, s, blocks, num_local, num_external);
        }
        if num_external > 0 {
            for (g, m) in self.managers.iter_mut().enumerate() {
                let record = skip_zeroing_groups >> g & 1 == 0;
                m.allocate_external_computed_blocks(&mut self.pool, s, num_local, num_external, record);
            }
        }
    }

    fn refresh_noop(&mut self, s: Slot) {
        self.reqs[s as usize].noop = self.compute_noop(s);
    }

    /// The component-wise minimum of every group's [`SingleTypeManager::noop_limits`] (the
    /// largest of their prompt bounds).
    fn compute_noop(&self, s: Slot) -> NoopLimits {
        let mut lim = NoopLimits::ANY;
        for m in &self.managers {
            lim = lim.min(m.noop_limits(s));
            lim.prompt = lim.prompt.max(m.noop_min_prompt(s));
        }
        lim
    }

    /// Whether `a` is a plain step (see [`NoopLimits`]) that the request's limits prove
    /// changes nothing.
    fn is_noop(&self, s: Slot, a: &AllocateArgs) -> bool {
        if a.num_new_tokens == 0
            || a.num_new_computed_tokens != 0
            || a.num_external_computed_tokens != 0
            || a.num_encoder_tokens != 0
            || a.full_sequence_must_fit
            || a.reserved_blocks != 0
            || a.apply_watermark
        {
            return false;
        }
        let lim = self.reqs[s as usize].noop;
        let main = a.num_computed_tokens as u64 + a.num_new_tokens as u64;
        a.num_new_tokens <= lim.new_tokens
            && main + a.num_lookahead_tokens as u64 <= lim.slots as u64
            && a.num_prompt_tokens >= lim.prompt
            && a.num_computed_tokens.saturating_sub(a.num_in_flight_tokens) < lim.processed
            && main.min(a.num_tokens as u64) < lim.cached as u64
    }

    /// The limits under which a plain step of `h` changes nothing (the component-wise
    /// minimum of every group's [`SingleTypeManager::noop_limits`]).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn noop_limits(&self, h: ReqHandle) -> Result<NoopLimits> {
        let s = self.slot(h)?;
        Ok(self.reqs[s as usize].noop)
    }

    /// The plain step of a running request, as the scheduler makes it for every running
    /// request every step: `allocate_slots(h, num_new_tokens, num_lookahead_tokens)` with
    /// no new hit, no external or encoder tokens, no admission gate, reserve or watermark,
    /// the request's fields read through `req`. When the request's [`NoopLimits`] prove
    /// the step changes nothing, it is answered from them (reading as few fields as
    /// possible); otherwise `allocate_slots` runs, with the request's hashes synced.
    ///
    /// # Errors
    /// Those of [`Self::allocate_slots`], a field out of `0..=u32::MAX`, and what `req`
    /// raises; nothing changes.
    pub fn plain_step<F: StepFields>(
        &mut self,
        h: ReqHandle,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
        req: &F,
    ) -> std::result::Result<PlainStep, F::Error> {
        let Ok(s) = self.slot(h) else { return Ok(PlainStep::NotHere) };
        let new = token_count("num_new_tokens", num_new_tokens)? as u64;
        let look = token_count("num_lookahead_tokens", num_lookahead_tokens)? as u64;
        let nc = token_count("num_computed_tokens", req.num_computed_tokens()?)? as u64;
        let lim = self.reqs[s as usize].noop;
        let to_cache = nc + new;
        if new > 0 && new <= lim.new_tokens as u64 && to_cache + look <= lim.slots as u64 {
            // In-flight tokens only lower `nc - inflight`: below the limit with `nc` alone,
            // `num_in_flight_tokens` is not read (a decode step of full attention, or of a
            // window longer than the context, reads one field fewer).
            let below = nc < lim.processed as u64
                || nc.saturating_sub(token_count("num_in_flight_tokens", req.num_in_flight_tokens()?)? as u64)
                    < lim.processed as u64;
            // An R-SWA group's limits hold for its prompt length or a longer one (read only then).
            let prompt_ok =
                lim.prompt == 0 || token_count("num_prompt_tokens", req.num_prompt_tokens()?)? >= lim.prompt;
            if below
                && prompt_ok
                && (to_cache < lim.cached as u64
                    || (token_count("num_tokens", req.num_tokens()?)? as u64) < lim.cached as u64)
            {
                return Ok(PlainStep::NoOp);
            }
        }
        let a = AllocateArgs {
            num_new_tokens: new as u32,
            num_lookahead_tokens: look as u32,
            num_computed_tokens: nc as u32,
            num_in_flight_tokens: token_count("num_in_flight_tokens", req.num_in_flight_tokens()?)?,
            num_prompt_tokens: token_count("num_prompt_tokens", req.num_prompt_tokens()?)?,
            num_tokens: token_count("num_tokens", req.num_tokens()?)?,
            shared_prefix_boundary: token_count("shared_prefix_boundary", req.shared_prefix_boundary()?)?,
            ..AllocateArgs::default()
        };
        let r = req.with_block_hashes(|src| Ok(self.allocate_slots_synced(h, &a, NewComputed::Empty, Some(src))?))?;
        Ok(PlainStep::Allocated(r))
    }

    /// New block ids of the last successful `allocate_slots`, groups concatenated.
    pub fn new_block_ids(&self) -> &[BlockId] {
        &self.out_ids
    }

    /// Per-group counts of [`Self::new_block_ids`].
    pub fn new_block_counts(&self) -> &[u32] {
        &self.out_counts
    }

    fn cache_target(&self, num_tokens: u32) -> u32 {
        match self.kind {
            CoordinatorKind::Hybrid => num_tokens / self.cfg.scheduler_block_size * self.cfg.scheduler_block_size,
            _ => num_tokens,
        }
    }

    fn cache_blocks_inner(&mut self, s: Slot, num_tokens: u32, num_prompt_tokens: u32, shared_prefix_boundary: u32) {
        if !self.cfg.enable_caching {
            return;
        }
        let handle = self.handle_of(s);
        let boundaries_buf = [num_prompt_tokens.saturating_sub(1), shared_prefix_boundary];
        let boundaries = if shared_prefix_boundary != 0 { &boundaries_buf[..] } else { &boundaries_buf[..1] };
        let hashes = &self.reqs[s as usize].hashes;
        let n = self.cache_target(num_tokens);
        let c = CacheArgs {
            req: handle,
            hashes,
            num_tokens: n,
            retention_interval: self.cfg.retention_interval,
            reachable_boundaries: boundaries,
            num_prompt_tokens,
            shared_prefix_boundary,
        };
        for m in self.managers.iter_mut() {
            m.cache_blocks(&mut self.pool, s, &c);
        }
    }

    /// Caches the full blocks of `h` up to `num_computed_tokens` (vLLM's `cache_blocks`).
    ///
    /// # Errors
    /// Unknown handle; a full block the request's table does not hold (nothing changes).
    pub fn cache_blocks(
        &mut self,
        h: ReqHandle,
        num_computed_tokens: u32,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) -> Result<()> {
        self.cache_blocks_synced(h, None, num_computed_tokens, num_prompt_tokens, shared_prefix_boundary)
    }

    /// [`Self::cache_blocks`] after bringing the request's hashes up to `hashes` (undone if
    /// the call fails).
    ///
    /// # Errors
    /// Those of [`Self::cache_blocks`]; an invalid hash.
    pub fn cache_blocks_synced(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        num_computed_tokens: u32,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) -> Result<()> {
        let s = self.slot(h)?;
        let undo = match hashes {
            Some(src) => Some(self.sync_hashes(s, src)?),
            None => None,
        };
        if self.cfg.enable_caching {
            let n = self.cache_target(num_computed_tokens);
            let num_hashes = self.reqs[s as usize].hashes.len();
            for (g, m) in self.managers.iter().enumerate() {
                let (full, held) = m.blocks_to_cache(s, num_hashes, n);
                if full > m.num_cached(s) && full > held {
                    if let Some(u) = undo {
                        self.undo_hashes(s, u);
                    }
                    return Err(Error::OutOfRange(format!(
                        "cache_blocks up to {num_computed_tokens} tokens: group {g} would cache {full} full \
                         blocks, but the request holds {held}"
                    )));
                }
            }
        }
        self.cache_blocks_inner(s, num_computed_tokens, num_prompt_tokens, shared_prefix_boundary);
        self.refresh_noop(s);
        Ok(())
    }

    /// Frees out-of-window blocks of `h` (vLLM's `remove_skipped_blocks`).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn remove_skipped_blocks(&mut self, h: ReqHandle, processed_computed_tokens: u32) -> Result<()> {
        self.remove_skipped_blocks_with_prompt(h, processed_computed_tokens, None)
    }

    /// [`Self::remove_skipped_blocks`] with vLLM's optional `num_prompt_tokens` (passed by
    /// `allocate_slots` and by the scheduler before a connector reads the table): with it an
    /// R-SWA group frees its gap; without it R-SWA frees nothing, as full attention.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn remove_skipped_blocks_with_prompt(
        &mut self,
        h: ReqHandle,
        processed_computed_tokens: u32,
        num_prompt_tokens: Option<u32>,
    ) -> Result<()> {
        let s = self.slot(h)?;
        for m in self.managers.iter_mut() {
            m.remove_skipped_blocks(&mut self.pool, s, processed_computed_tokens, num_prompt_tokens);
        }
        self.refresh_noop(s);
        Ok(())
    }

    /// Frees every block of `h`, tail first, and releases the handle (vLLM's `free`).
    ///
    /// # Errors
    /// Unknown handle (a double free is one).
    pub fn free(&mut self, h: ReqHandle) -> Result<()> {
        self.free_with_level(h, LEVEL_NORMAL)
    }

    /// [`Self::free`] with a retention level for what the request leaves cached: under
    /// `hit-aware`, its full-attention prefix and the window tail ending at its last cached
    /// block keep at least `level` ([`crate::policy::LEVEL_PINNED`] for a request with a
    /// retention priority), and its blocks are freed in token-position order across groups
    /// (a hit unit together). Under `exact`, `level` is ignored: vLLM's `free`.
    ///
    /// # Errors
    /// Unknown handle (a double free is one).
    pub fn free_with_level(&mut self, h: ReqHandle, level: Level) -> Result<()> {
        let s = self.slot(h)?;
        if self.pool.is_leveled() {
            let mut blocks = Vec::new();
            for m in self.managers.iter() {
                m.promote_for_free(&mut self.pool, s, level.max(LEVEL_NORMAL), LEVEL_SPECULATIVE);
                m.positioned_blocks(s, &mut blocks);
            }
            // Tail first; at equal positions, group order (vLLM frees group after group).
            blocks.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
            for m in self.managers.iter_mut() {
                m.forget(s);
            }
            self.pool.free_blocks(blocks.iter().map(|x| x.2));
        } else {
            for m in self.managers.iter_mut() {
                m.free(&mut self.pool, s);
            }
        }
        self.release(s);
        Ok(())
    }

    /// Releases the handle and returns its blocks without freeing them (vLLM's
    /// `pop_blocks_for_free`); the caller frees them later with [`Self::free_block_ids`].
    ///
    /// # Errors
    /// Unknown handle.
    pub fn pop_blocks_for_free(&mut self, h: ReqHandle, out: &mut Vec<BlockId>) -> Result<()> {
        let s = self.slot(h)?;
        let start = out.len();
        for m in self.managers.iter_mut() {
            m.pop_blocks(s, out);
        }
        self.pool.loosen(&out[start..]);
        self.release(s);
        Ok(())
    }

    fn release(&mut self, s: Slot) {
        let st = &mut self.reqs[s as usize];
        st.generation = 0;
        st.hashes.clear();
        for v in st.hit.iter_mut() {
            v.clear();
        }
        st.noop = NoopLimits::default();
        self.free_slots.push(s);
    }

    /// Drops one reference from each block, in eviction order (vLLM's
    /// `block_pool.free_blocks`). Only references no table holds can be dropped: blocks
    /// handed out by [`Self::pop_blocks_for_free`].
    ///
    /// # Errors
    /// A block id out of range, or more frees of a block than it has references outside
    /// the tables (a block a live request still holds is refused); checked before any change.
    pub fn free_block_ids(&mut self, ids: &[BlockId]) -> Result<()> {
        let mut counts: rustc_hash::FxHashMap<BlockId, u32> = Default::default();
        for &b in ids {
            if b >= self.pool.num_blocks() {
                return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {}", self.pool.num_blocks())));
            }
            if b == NULL_BLOCK {
                continue;
            }
            let c = counts.entry(b).or_insert(0);
            *c += 1;
            if *c > self.pool.loose_refs(b) {
                return Err(Error::InvalidBlock(format!(
                    "block {b} freed more times than it was popped (pop_blocks_for_free) and not yet freed"
                )));
            }
        }
        self.pool.free_loose(ids);
        Ok(())
    }

    /// Drops the prefix-cache hashes of the given blocks (vLLM's `evict_blocks`).
    ///
    /// # Errors
    /// A block id out of range; checked before any change.
    pub fn evict_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        if let Some(&b) = ids.iter().find(|&&b| b >= self.pool.num_blocks()) {
            return Err(Error::InvalidBlock(format!("block id {b} >= num_blocks {}", self.pool.num_blocks())));
        }
        self.pool.evict_blocks(ids);
        Ok(())
    }

    /// Pins a prefix (e.g. a system prompt) given by its block hashes at `hash_block_size`
    /// granularity (`hashes[i]` covers tokens `0..(i + 1) * hash_block_size`), under the
    /// `hit-aware` policy: the blocks a hit on the whole prefix needs (every block of a
    /// full-attention or chunked group, the window tail at its end in a sliding-window
    /// group) are freed at [`crate::policy::LEVEL_PINNED`], evicted after every other cached
    /// block, within the pinned share ([`Self::set_pinned_share`]). Blocks cached now are
    /// pinned now; the others when they are cached. Returns the hash keys pinned in all.
    ///
    /// # Errors
    /// [`Error::Unsupported`] under `exact` or with prefix caching off (vLLM has no
    /// pinning); [`Error::OutOfRange`] when the pinned keys would exceed the pinned share
    /// (nothing changes).
    pub fn pin_prefix(&mut self, hashes: &[BlockHash]) -> Result<u32> {
        if !self.pool.is_leveled() {
            return Err(Error::Unsupported(
                "pinning a prefix needs the hit-aware policy with prefix caching on".into(),
            ));
        }
        let mut keys = Vec::new();
        for m in &self.managers {
            if m.spec.kind.sized_by_encoder_tokens() {
                continue;
            }
            let view = HashView { hashes, scale: m.block_size() / self.cfg.hash_block_size };
            let n = view.len();
            let from = m.hit_tail_blocks().map_or(0, |t| n.saturating_sub(t));
            keys.extend((from..n).map(|i| (view.get(i), m.group_id)));
        }
        keys.retain(|k| !self.pool.pinned_keys.contains(k));
        keys.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()).then(a.1.cmp(&b.1)));
        keys.dedup();
        let total = self.pool.pinned_keys.len() as u64 + keys.len() as u64;
        if total > self.pool.pinned_cap() as u64 {
            return Err(Error::OutOfRange(format!(
                "pinning {} more blocks would pin {total}, above the pinned share of {} blocks",
                keys.len(),
                self.pool.pinned_cap()
            )));
        }
        for k in &keys {
            self.pool.pinned_keys.insert(*k);
            if let Some(b) = self.pool.index.get_one(k) {
                self.pool.set_level(b, crate::policy::LEVEL_PINNED);
            }
        }
        Ok(total as u32)
    }

    /// Sets the pinned share of the pool (`0.0..=1.0`, default 0.25): at most that fraction
    /// of the blocks may be pinned keys, or free at the pinned level (past it the oldest
    /// free pinned block is demoted to the normal LRU).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a share outside `0.0..=1.0` or below the keys pinned.
    pub fn set_pinned_share(&mut self, share: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&share) {
            return Err(Error::OutOfRange(format!("pinned share {share} is outside 0.0..=1.0")));
        }
        let cap = ((self.pool.num_blocks() - 1) as f64 * share).floor() as u32;
        if (self.pool.pinned_keys.len() as u64) > cap as u64 {
            return Err(Error::OutOfRange(format!(
                "a pinned share of {cap} blocks is below the {} blocks already pinned",
                self.pool.pinned_keys.len()
            )));
        }
        self.pool.set_pinned_cap(cap);
        Ok(())
    }

    /// Clears the prefix cache when no block is in use (vLLM's `reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// vLLM's `estimate_cached_tokens`: the minimum over cacheable groups of the longest
    /// prefix any block of the table is hashed for.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn estimate_cached_tokens(&self, h: ReqHandle) -> Result<u32> {
        let s = self.slot(h)?;
        let mut best: Option<u32> = None;
        for m in &self.managers {
            if !m.spec.kind.takes_hits() {
                continue;
            }
            let t = m.blocks(s).iter().map(|&b| self.pool.block_hash_num_tokens(b)).max().unwrap_or(0);
            best = Some(best.map_or(t, |x| x.min(t)));
        }
        Ok(best.unwrap_or(0))
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
        if let Some(m) = self.managers.iter().find(|m| m.records_new_block_ids && start_token % m.block_size() != 0) {
            return Err(Error::OutOfRange(format!(
                "start_token={start_token} is not a multiple of group {}'s block size {}",
                m.group_id,
                m.block_size()
            )));
        }
        for m in self.managers.iter_mut() {
            let idx = (start_token / m.block_size()) as usize;
            m.record_blocks_for_zeroing(s, idx);
        }
        Ok(())
    }

    /// Free blocks.
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.num_free_blocks()
    }

    /// Usage in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Takes the queued KV cache events.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.pool.take_events()
    }

    /// Whether events wait.
    pub fn has_events(&self) -> bool {
        self.pool.has_events()
    }

    /// Live request handles (invariant checks).
    pub fn live_handles(&self) -> impl Iterator<Item = ReqHandle> + '_ {
        (0..self.reqs.len() as Slot).filter(|&s| self.slot_is_live(s)).map(|s| self.handle_of(s))
    }

    /// The stored no-op limits of every live request agree with its tables (invariant checks).
    pub(crate) fn check_noop_limits(&self) -> std::result::Result<(), String> {
        for s in 0..self.reqs.len() as Slot {
            if !self.slot_is_live(s) {
                continue;
            }
            let lim = self.compute_noop(s);
            if lim != self.reqs[s as usize].noop {
                return Err(format!(
                    "slot {s}: stored no-op limits {:?}, tables say {lim:?}",
                    self.reqs[s as usize].noop
                ));
            }
        }
        Ok(())
    }
}
