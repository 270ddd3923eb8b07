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
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, NULL_BLOCK};
use crate::manager::{cdiv, find_longest_cache_hit, HashView, SingleTypeManager};

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
    /// The slot holds a live request.
    live: bool,
    /// Block hashes at `hash_block_size` granularity, as vLLM computed them.
    hashes: Vec<BlockHash>,
    /// The last cache hit found for the request, per group.
    hit: Vec<Vec<BlockId>>,
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
    kind: CoordinatorKind,
    pool: BlockPool,
    managers: Vec<SingleTypeManager>,
    /// Cacheable spec groups, full attention first (hybrid search order).
    spec_groups: Vec<SpecGroup>,
    reqs: Vec<ReqState>,
    free_handles: Vec<ReqHandle>,
    /// New block ids of the last `allocate_slots`, all groups concatenated.
    out_ids: Vec<BlockId>,
    /// `out_counts[g]`: how many of `out_ids` belong to group g.
    out_counts: Vec<u32>,
    /// Scratch for the hit search.
    scratch_spec: Vec<Vec<BlockId>>,
}

impl Allocator {
    /// Builds an allocator.
    ///
    /// # Errors
    /// What [`Config::validate`] reports.
    pub fn new(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        let kind = cfg.coordinator_kind();
        let caching = cfg.enable_caching;
        let pool = BlockPool::new(cfg.num_blocks, caching, cfg.enable_events);
        let align = cfg.cache_hit_alignment_tokens();
        let managers = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| SingleTypeManager::new(*g, i as GroupId, cfg.max_admission_blocks(g), caching, align))
            .collect();
        let mut spec_groups: Vec<SpecGroup> = Vec::new();
        for (i, g) in cfg.groups.iter().enumerate() {
            if matches!(g.kind, AttentionKind::Cross) {
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
            kind,
            pool,
            managers,
            spec_groups,
            reqs: Vec::new(),
            free_handles: Vec::new(),
            out_ids: Vec::new(),
            out_counts: vec![0; n],
            scratch_spec: vec![Vec::new(); n],
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
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

    /// Registers a request; returns its handle.
    pub fn add_request(&mut self) -> ReqHandle {
        let h = match self.free_handles.pop() {
            Some(h) => h,
            None => {
                self.reqs.push(ReqState::default());
                (self.reqs.len() - 1) as ReqHandle
            }
        };
        let st = &mut self.reqs[h as usize];
        st.live = true;
        st.hashes.clear();
        if st.hit.len() != self.managers.len() {
            st.hit = vec![Vec::new(); self.managers.len()];
        }
        for v in st.hit.iter_mut() {
            v.clear();
        }
        for m in self.managers.iter_mut() {
            m.ensure_slot(h);
        }
        h
    }

    fn check(&self, h: ReqHandle) -> Result<()> {
        match self.reqs.get(h as usize) {
            Some(st) if st.live => Ok(()),
            _ => Err(Error::UnknownRequest(h)),
        }
    }

    /// Checks that `h` is a live request.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn check_handle(&self, h: ReqHandle) -> Result<()> {
        self.check(h)
    }

    /// Whether `h` is a live request.
    pub fn is_live(&self, h: ReqHandle) -> bool {
        self.check(h).is_ok()
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.reqs.len() - self.free_handles.len()
    }

    /// Appends block hashes to a request (`hash_len` bytes each, concatenated).
    ///
    /// # Errors
    /// Unknown handle; `hash_len` not in `1..=32` or not dividing `bytes.len()`.
    pub fn append_hashes(&mut self, h: ReqHandle, bytes: &[u8], hash_len: usize) -> Result<()> {
        self.check(h)?;
        if bytes.is_empty() {
            return Ok(());
        }
        if hash_len == 0 || hash_len > crate::ids::MAX_HASH_LEN || bytes.len() % hash_len != 0 {
            return Err(Error::OutOfRange(format!(
                "hash bytes of length {} cannot be split into hashes of {hash_len} bytes",
                bytes.len()
            )));
        }
        let st = &mut self.reqs[h as usize];
        st.hashes.extend(bytes.chunks_exact(hash_len).map(|c| BlockHash::from_bytes(c).expect("length checked")));
        Ok(())
    }

    /// Drops hashes of `h` past the first `n` (undoes an append when a later step of the
    /// same call fails, so a failed call leaves no trace).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn truncate_hashes(&mut self, h: ReqHandle, n: usize) -> Result<()> {
        self.check(h)?;
        self.reqs[h as usize].hashes.truncate(n);
        Ok(())
    }

    /// Number of block hashes known for `h`.
    pub fn num_hashes(&self, h: ReqHandle) -> Result<usize> {
        self.check(h)?;
        Ok(self.reqs[h as usize].hashes.len())
    }

    /// The hashes of `h`.
    pub fn hashes(&self, h: ReqHandle) -> Result<&[BlockHash]> {
        self.check(h)?;
        Ok(&self.reqs[h as usize].hashes)
    }

    /// The block table of `h` in group `g`.
    ///
    /// # Errors
    /// Unknown handle or group.
    pub fn blocks(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        self.check(h)?;
        let m = self.managers.get(g).ok_or_else(|| Error::OutOfRange(format!("group {g}")))?;
        Ok(m.blocks(h))
    }

    /// The last cache hit stored for `h`, group `g`.
    pub fn stored_hit(&self, h: ReqHandle, g: usize) -> Result<&[BlockId]> {
        self.check(h)?;
        self.reqs[h as usize].hit.get(g).map(|v| v.as_slice()).ok_or_else(|| Error::OutOfRange(format!("group {g}")))
    }

    // ---- cache-hit search -----------------------------------------------------------

    /// Finds the longest cache hit of `h` not longer than `max_cache_hit_length` tokens and
    /// stores it as the request's pending hit (vLLM's `coordinator.find_longest_cache_hit`,
    /// called by `get_computed_blocks` with `num_tokens - 1`). Touches nothing.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn find_longest_cache_hit(&mut self, h: ReqHandle, max_cache_hit_length: u32) -> Result<Hit> {
        self.check(h)?;
        let mut hit = std::mem::take(&mut self.reqs[h as usize].hit);
        for v in hit.iter_mut() {
            v.clear();
        }
        let res = match self.kind {
            CoordinatorKind::NoPrefixCache => Hit { num_tokens: 0, num_uncached_common_prefix_tokens: 0 },
            CoordinatorKind::Unitary => {
                let m = &self.managers[0];
                let bs = m.block_size();
                let view = HashView { hashes: &self.reqs[h as usize].hashes, scale: bs / self.cfg.hash_block_size };
                let n = find_longest_cache_hit(
                    m.spec.kind,
                    &self.pool,
                    view,
                    max_cache_hit_length,
                    &[0],
                    bs,
                    bs,
                    &mut hit[..1],
                );
                Hit { num_tokens: n, num_uncached_common_prefix_tokens: 0 }
            }
            CoordinatorKind::Hybrid => self.hybrid_hit(h, max_cache_hit_length, &mut hit),
        };
        self.reqs[h as usize].hit = hit;
        Ok(res)
    }

    fn hybrid_hit(&mut self, h: ReqHandle, max_len: u32, out: &mut [Vec<BlockId>]) -> Hit {
        let ng = self.managers.len();
        let align = self.cfg.cache_hit_alignment_tokens();
        let mut hit_length = max_len;
        let mut longest = 0u32;
        let mut computed = 0u64; // bitset of groups with a result
        let mut len_by_group = [0u32; 64];
        let simple = self.spec_groups.len() == 2 && self.spec_groups[0].kind.is_full();
        let hashes = &self.reqs[h as usize].hashes;
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
                let new_len = find_longest_cache_hit(
                    sg.kind,
                    &self.pool,
                    view,
                    curr,
                    &sg.group_ids,
                    sg.block_size,
                    align,
                    &mut tmp[..k],
                );
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

    fn num_blocks_to_allocate(
        &self,
        h: ReqHandle,
        num_tokens: u32,
        new_computed: &[Vec<BlockId>],
        num_encoder_tokens: u32,
        total_computed_tokens: u32,
        apply_admission_cap: bool,
    ) -> u64 {
        let mut n = 0u64;
        for (i, m) in self.managers.iter().enumerate() {
            n += if matches!(m.spec.kind, AttentionKind::Cross) {
                m.get_num_blocks_to_allocate(&self.pool, h, num_encoder_tokens, &[], 0, apply_admission_cap)
            } else {
                let nc: &[BlockId] = new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
                m.get_num_blocks_to_allocate(&self.pool, h, num_tokens, nc, total_computed_tokens, apply_admission_cap)
            } as u64;
        }
        n
    }

    /// Blocks `h` needs from the pool for `num_tokens` slots with the given new hit
    /// (vLLM's `coordinator.get_num_blocks_to_allocate`, used by the scheduler directly).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn get_num_blocks_to_allocate(
        &self,
        h: ReqHandle,
        num_tokens: u32,
        num_encoder_tokens: u32,
        total_computed_tokens: u32,
        apply_admission_cap: bool,
    ) -> Result<u64> {
        self.check(h)?;
        Ok(self.num_blocks_to_allocate(
            h,
            num_tokens,
            &[],
            num_encoder_tokens,
            total_computed_tokens,
            apply_admission_cap,
        ))
    }

    /// vLLM's `KVCacheManager.allocate_slots`. On success the new blocks are in
    /// [`Self::new_block_ids`] (per group counts in [`Self::new_block_counts`]) and the
    /// result is `Some(total new blocks)`; `None` means they do not fit. As in vLLM,
    /// out-of-window blocks are freed even when the result is `None`.
    ///
    /// # Errors
    /// Unknown handle; nothing to do (`num_new_tokens == 0` with nothing to adopt); an
    /// explicit hit with the wrong number of groups or an invalid block id; cache-hit blocks
    /// with prefix caching off, or for a request that already holds blocks (computed tokens
    /// are adopted only into an empty table). Errors are raised before any change.
    pub fn allocate_slots(
        &mut self,
        h: ReqHandle,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
    ) -> Result<Option<u32>> {
        self.check(h)?;
        if a.num_new_tokens == 0 && a.num_external_computed_tokens == 0 && a.num_new_computed_tokens == 0 {
            return Err(Error::OutOfRange(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt".into(),
            ));
        }
        let ng = self.managers.len();
        let stored = match new_computed {
            NewComputed::Stored => Some(std::mem::take(&mut self.reqs[h as usize].hit)),
            _ => None,
        };
        let res = self.allocate_with(h, a, new_computed, stored.as_deref(), ng);
        if let Some(mut back) = stored {
            if res.is_ok() {
                for v in back.iter_mut() {
                    v.clear();
                }
            }
            self.reqs[h as usize].hit = back;
        }
        res
    }

    fn allocate_with(
        &mut self,
        h: ReqHandle,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
        stored: Option<&[Vec<BlockId>]>,
        ng: usize,
    ) -> Result<Option<u32>> {
        let nc: &[Vec<BlockId>] = match new_computed {
            NewComputed::Empty => &[],
            NewComputed::Stored => stored.unwrap_or(&[]),
            NewComputed::Explicit(v) => {
                if v.len() != ng {
                    return Err(Error::OutOfRange(format!("{} hit groups given, the config has {ng}", v.len())));
                }
                for &b in v.iter().flatten() {
                    if b >= self.pool.num_blocks() {
                        return Err(Error::InvalidBlock(format!(
                            "block id {b} >= num_blocks {}",
                            self.pool.num_blocks()
                        )));
                    }
                }
                v
            }
        };
        let has_new_computed = nc.iter().any(|v| !v.is_empty());
        if has_new_computed && !self.cfg.enable_caching {
            return Err(Error::OutOfRange("cache-hit blocks given with prefix caching off".into()));
        }
        let tracked = self.managers.iter().any(|m| m.is_tracked(h));
        if has_new_computed && tracked {
            return Err(Error::OutOfRange("a running request cannot adopt new cache-hit blocks".into()));
        }
        // Not tracked yet (nothing cached) but holding blocks: adoption would need an empty
        // table (`add_local_computed_blocks`; vLLM asserts it), so refuse before any change.
        let adopts = has_new_computed || a.num_external_computed_tokens > 0;
        if adopts && !tracked && self.managers.iter().any(|m| !m.blocks(h).is_empty()) {
            return Err(Error::OutOfRange("a request that already holds blocks cannot adopt computed tokens".into()));
        }
        Ok(self.allocate_slots_inner(h, a, nc, has_new_computed))
    }

    fn allocate_slots_inner(
        &mut self,
        h: ReqHandle,
        a: &AllocateArgs,
        nc: &[Vec<BlockId>],
        has_new_computed: bool,
    ) -> Option<u32> {
        let num_local = a.num_computed_tokens + a.num_new_computed_tokens;
        let unclamped_total = num_local + a.num_external_computed_tokens;
        let total_computed = unclamped_total.min(self.cfg.max_model_len);
        let watermark = if a.apply_watermark { self.cfg.watermark_blocks as u64 } else { 0 };
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(self.cfg.max_model_len);
            let need = self.num_blocks_to_allocate(h, full, nc, a.num_encoder_tokens, total_computed, true);
            if need + watermark > self.pool.num_free_blocks() as u64 {
                return None;
            }
        }
        let main = total_computed + a.num_new_tokens;
        let need_slot = (main + a.num_lookahead_tokens).min(self.cfg.max_model_len);
        let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
        for m in self.managers.iter_mut() {
            m.remove_skipped_blocks(&mut self.pool, h, processed);
        }
        let need = self.num_blocks_to_allocate(h, need_slot, nc, a.num_encoder_tokens, unclamped_total, false);
        let available = self.pool.num_free_blocks() as i64 - a.reserved_blocks as i64;
        if (need + watermark) as i64 > available {
            return None;
        }
        if has_new_computed || a.num_external_computed_tokens > 0 {
            self.allocate_new_computed_blocks(h, nc, num_local, a.num_external_computed_tokens);
        }
        self.out_ids.clear();
        for (g, m) in self.managers.iter_mut().enumerate() {
            let before = self.out_ids.len();
            let n = if matches!(m.spec.kind, AttentionKind::Cross) { a.num_encoder_tokens } else { need_slot };
            m.allocate_new_blocks(&mut self.pool, h, n, &mut self.out_ids);
            self.out_counts[g] = (self.out_ids.len() - before) as u32;
        }
        if !a.delay_cache_blocks {
            let to_cache = (total_computed + a.num_new_tokens).min(a.num_tokens);
            self.cache_blocks_inner(h, to_cache, a.num_prompt_tokens, a.shared_prefix_boundary);
        }
        Some(self.out_ids.len() as u32)
    }

    fn allocate_new_computed_blocks(&mut self, h: ReqHandle, nc: &[Vec<BlockId>], num_local: u32, num_external: u32) {
        if self.managers.iter().any(|m| m.is_tracked(h)) {
            return;
        }
        for (i, m) in self.managers.iter_mut().enumerate() {
            let blocks: &[BlockId] = nc.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            m.add_local_computed_blocks(&mut self.pool, h, blocks, num_local, num_external);
        }
        if num_external > 0 {
            for m in self.managers.iter_mut() {
                m.allocate_external_computed_blocks(&mut self.pool, h, num_local, num_external);
            }
        }
    }

    /// The limits under which a plain decode/prefill step of `h` changes nothing (the
    /// component-wise minimum of every group's [`SingleTypeManager::noop_limits`]). The vLLM
    /// adapter answers such steps without crossing into Rust.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn noop_limits(&self, h: ReqHandle) -> Result<(u32, u32, u32)> {
        self.check(h)?;
        let mut lim = (u32::MAX, u32::MAX, u32::MAX);
        for m in &self.managers {
            let (a, b, c) = m.noop_limits(h);
            lim = (lim.0.min(a), lim.1.min(b), lim.2.min(c));
        }
        Ok(lim)
    }

    /// New block ids of the last successful `allocate_slots`, groups concatenated.
    pub fn new_block_ids(&self) -> &[BlockId] {
        &self.out_ids
    }

    /// Per-group counts of [`Self::new_block_ids`].
    pub fn new_block_counts(&self) -> &[u32] {
        &self.out_counts
    }

    fn cache_blocks_inner(
        &mut self,
        h: ReqHandle,
        num_tokens: u32,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) {
        if !self.cfg.enable_caching {
            return;
        }
        let boundaries_buf = [num_prompt_tokens.saturating_sub(1), shared_prefix_boundary];
        let boundaries = if shared_prefix_boundary != 0 { &boundaries_buf[..] } else { &boundaries_buf[..1] };
        let hashes = &self.reqs[h as usize].hashes;
        let n = match self.kind {
            CoordinatorKind::Hybrid => num_tokens / self.cfg.scheduler_block_size * self.cfg.scheduler_block_size,
            _ => num_tokens,
        };
        for m in self.managers.iter_mut() {
            m.cache_blocks(
                &mut self.pool,
                h,
                hashes,
                self.cfg.hash_block_size,
                n,
                self.cfg.retention_interval,
                boundaries,
            );
        }
    }

    /// Caches the full blocks of `h` up to `num_computed_tokens` (vLLM's `cache_blocks`).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn cache_blocks(
        &mut self,
        h: ReqHandle,
        num_computed_tokens: u32,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) -> Result<()> {
        self.check(h)?;
        self.cache_blocks_inner(h, num_computed_tokens, num_prompt_tokens, shared_prefix_boundary);
        Ok(())
    }

    /// Frees out-of-window blocks of `h` (vLLM's `remove_skipped_blocks`).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn remove_skipped_blocks(&mut self, h: ReqHandle, processed_computed_tokens: u32) -> Result<()> {
        self.check(h)?;
        for m in self.managers.iter_mut() {
            m.remove_skipped_blocks(&mut self.pool, h, processed_computed_tokens);
        }
        Ok(())
    }

    /// Frees every block of `h`, tail first, and releases the handle (vLLM's `free`).
    ///
    /// # Errors
    /// Unknown handle (a double free is one).
    pub fn free(&mut self, h: ReqHandle) -> Result<()> {
        self.check(h)?;
        for m in self.managers.iter_mut() {
            m.free(&mut self.pool, h);
        }
        self.release(h);
        Ok(())
    }

    /// Releases the handle and returns its blocks without freeing them (vLLM's
    /// `pop_blocks_for_free`); the caller frees them later with [`Self::free_block_ids`].
    ///
    /// # Errors
    /// Unknown handle.
    pub fn pop_blocks_for_free(&mut self, h: ReqHandle, out: &mut Vec<BlockId>) -> Result<()> {
        self.check(h)?;
        for m in self.managers.iter_mut() {
            m.pop_blocks(h, out);
        }
        self.release(h);
        Ok(())
    }

    fn release(&mut self, h: ReqHandle) {
        let st = &mut self.reqs[h as usize];
        st.live = false;
        st.hashes.clear();
        for v in st.hit.iter_mut() {
            v.clear();
        }
        self.free_handles.push(h);
    }

    /// Drops one reference from each block, in eviction order (vLLM's
    /// `block_pool.free_blocks`).
    ///
    /// # Errors
    /// A block id out of range, or more frees of a block than it has references; checked
    /// before any change.
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
            if *c > self.pool.ref_cnt(b) {
                return Err(Error::InvalidBlock(format!("block {b} freed more times than it is referenced")));
            }
        }
        self.pool.free_blocks(ids.iter().copied());
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
        self.check(h)?;
        let mut best: Option<u32> = None;
        for m in &self.managers {
            if matches!(m.spec.kind, AttentionKind::Cross) {
                continue;
            }
            let t = m.blocks(h).iter().map(|&b| self.pool.block_hash_num_tokens(b)).max().unwrap_or(0);
            best = Some(best.map_or(t, |x| x.min(t)));
        }
        Ok(best.unwrap_or(0))
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
        self.reqs.iter().enumerate().filter(|(_, s)| s.live).map(|(h, _)| h as ReqHandle)
    }
}
