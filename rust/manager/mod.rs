//! One manager per KV cache group, with the rules of its attention type (vLLM's
//! `SingleTypeKVCacheManager` and subclasses). The shared bookkeeping lives in
//! [`SingleTypeManager`]; what differs per attention type (how many leading tokens fall out
//! of use, how a cache hit is found, which full blocks are worth caching) lives in one file
//! per type and is dispatched statically on [`AttentionKind`]. Cross attention (one static
//! allocation from the encoder length, never cached or recycled; the configuration refuses it
//! with prefix caching on) needs nothing beyond the shared bookkeeping, so it has no file.
//!
//! Per request (by handle) a manager keeps its block table and `num_cached_block`.
//! Invariants: every non-null block in a table holds one reference for that slot; a
//! table's first `num_cached` blocks are cached or null; tables only grow, except that
//! out-of-window blocks become the null block in place (tables stay positional).
//!
//! Cost: every method is O(blocks it touches); `remove_skipped_blocks` stops at the first
//! null block it meets walking backwards, so a decode step costs O(1) amortised.
#![forbid(unsafe_code)]

pub mod chunked_local;
pub mod full;
pub mod mamba;
pub mod sliding_window;

use crate::block_pool::BlockPool;
use crate::config::{AttentionKind, GroupSpec};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};

/// Marker for "no `num_cached_block` entry" (vLLM: request id absent from the dict).
const ABSENT: u32 = u32::MAX;

#[inline]
pub(crate) fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

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

    /// Whether no whole group block is hashed.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash of group block `i` (`i < len()`).
    #[inline]
    pub fn get(&self, i: u32) -> BlockHash {
        self.hashes[((i + 1) * self.scale - 1) as usize]
    }
}

/// Finds the longest cache hit for one spec group (groups with equal specs), as the
/// attention type's `find_longest_cache_hit` classmethod. Fills `out[k]` for each group
/// id `group_ids[k]` and returns the hit length in tokens.
#[allow(clippy::too_many_arguments)]
pub fn find_longest_cache_hit(
    kind: AttentionKind,
    pool: &BlockPool,
    view: HashView<'_>,
    max_length: u32,
    group_ids: &[GroupId],
    block_size: u32,
    alignment_tokens: u32,
    out: &mut [Vec<BlockId>],
) -> u32 {
    for o in out.iter_mut() {
        o.clear();
    }
    match kind {
        AttentionKind::Full => {
            full::find_longest_cache_hit(pool, view, max_length, group_ids, block_size, alignment_tokens, out)
        }
        AttentionKind::SlidingWindow { window, .. } => sliding_window::find_longest_cache_hit(
            pool,
            view,
            max_length,
            group_ids,
            block_size,
            alignment_tokens,
            window,
            out,
        ),
        AttentionKind::ChunkedLocal { chunk } => {
            chunked_local::find_longest_cache_hit(pool, view, max_length, group_ids, block_size, chunk, out)
        }
        AttentionKind::Cross => 0,
        AttentionKind::Mamba { .. } => unreachable!("Mamba groups are served with prefix caching off only"),
    }
}

/// The bookkeeping of one KV cache group.
#[derive(Clone, Debug)]
pub struct SingleTypeManager {
    /// The group's spec.
    pub spec: GroupSpec,
    /// The group's index.
    pub group_id: GroupId,
    /// Recycling-aware admission cap in blocks (SWA, chunked local), if any.
    pub max_admission_blocks: Option<u32>,
    /// Prefix caching on for this manager.
    pub enable_caching: bool,
    /// Alignment of cache hits in tokens (the coordinator's).
    pub cache_hit_alignment_tokens: u32,
    /// `req_blocks[h]`: the block table of request `h` (empty when it has none).
    req_blocks: Vec<Vec<BlockId>>,
    /// `num_cached[h]`: blocks of the table already cached, or `ABSENT`.
    num_cached: Vec<u32>,
    /// `null_prefix[h]`: table slots `0..null_prefix[h]` hold the null block (out-of-window
    /// blocks only ever become null as a prefix of the table).
    null_prefix: Vec<u32>,
    /// Scratch for freed blocks (reused, so decode steps do not allocate).
    scratch: Vec<BlockId>,
    /// Whether this group records the blocks it hands out for KV cache zeroing (vLLM's
    /// `_record_new_block_ids`: zeroing needed and an attention group).
    pub records_new_block_ids: bool,
    /// The block ids handed out since the last [`Self::take_new_block_ids`], in order.
    new_block_ids: Vec<BlockId>,
}

impl SingleTypeManager {
    /// A manager for group `group_id`.
    pub fn new(
        spec: GroupSpec,
        group_id: GroupId,
        max_admission_blocks: Option<u32>,
        enable_caching: bool,
        cache_hit_alignment_tokens: u32,
    ) -> Self {
        Self {
            spec,
            group_id,
            max_admission_blocks,
            enable_caching,
            cache_hit_alignment_tokens,
            req_blocks: Vec::new(),
            num_cached: Vec::new(),
            null_prefix: Vec::new(),
            scratch: Vec::new(),
            records_new_block_ids: false,
            new_block_ids: Vec::new(),
        }
    }

    /// Drains the block ids recorded for zeroing (vLLM's `take_new_block_ids`).
    pub fn take_new_block_ids(&mut self, out: &mut Vec<BlockId>) {
        out.append(&mut self.new_block_ids);
    }

    /// Records `h`'s table from slot `start_idx` on for zeroing again, null blocks included
    /// (vLLM's `record_blocks_for_zeroing`); nothing when this group does not record.
    pub fn record_blocks_for_zeroing(&mut self, h: Slot, start_idx: usize) {
        if self.records_new_block_ids {
            let t = &self.req_blocks[h as usize];
            self.new_block_ids.extend_from_slice(t.get(start_idx..).unwrap_or(&[]));
        }
    }

    /// Block ids recorded for zeroing and not yet taken.
    pub fn pending_new_block_ids(&self) -> &[BlockId] {
        &self.new_block_ids
    }

    /// The token slots the table is sized for when `num_tokens` slots are asked for
    /// (Mamba mode `"none"` adds its speculative state blocks).
    #[inline]
    fn slot_tokens(&self, num_tokens: u32) -> u64 {
        match self.spec.kind {
            AttentionKind::Mamba { speculative_blocks, align: false } => {
                mamba::none_mode_tokens(num_tokens, self.spec.block_size, speculative_blocks)
            }
            _ => num_tokens as u64,
        }
    }

    /// Tokens per block.
    #[inline]
    pub fn block_size(&self) -> u32 {
        self.spec.block_size
    }

    /// Makes room for handle `h` (a new request slot).
    pub fn ensure_slot(&mut self, h: Slot) {
        let n = h as usize + 1;
        if self.req_blocks.len() < n {
            self.req_blocks.resize_with(n, Vec::new);
            self.num_cached.resize(n, ABSENT);
            self.null_prefix.resize(n, 0);
        }
    }

    /// The block table of `h`.
    #[inline]
    pub fn blocks(&self, h: Slot) -> &[BlockId] {
        &self.req_blocks[h as usize]
    }

    /// Whether `h` has a `num_cached_block` entry (vLLM: "a running request").
    #[inline]
    pub fn is_tracked(&self, h: Slot) -> bool {
        self.num_cached[h as usize] != ABSENT
    }

    /// Leading null slots of `h`'s table.
    #[inline]
    pub fn null_prefix(&self, h: Slot) -> u32 {
        self.null_prefix[h as usize]
    }

    /// `num_cached_block` of `h` (0 when absent).
    #[inline]
    pub fn num_cached(&self, h: Slot) -> u32 {
        let n = self.num_cached[h as usize];
        if n == ABSENT {
            0
        } else {
            n
        }
    }

    /// Tokens before the attention window of the next token (`get_num_skipped_tokens`).
    #[inline]
    pub fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        match self.spec.kind {
            AttentionKind::Full | AttentionKind::Cross => 0,
            AttentionKind::SlidingWindow { window, extra_retained_tokens } => {
                sliding_window::num_skipped_tokens(num_computed_tokens, window, extra_retained_tokens)
            }
            AttentionKind::ChunkedLocal { chunk } => chunked_local::num_skipped_tokens(num_computed_tokens, chunk),
            AttentionKind::Mamba { .. } => mamba::num_skipped_tokens(num_computed_tokens),
        }
    }

    fn count_evictable(pool: &BlockPool, blocks: &[BlockId]) -> u32 {
        blocks.iter().filter(|&&b| b != NULL_BLOCK && pool.ref_cnt(b) == 0).count() as u32
    }

    /// Blocks this group must take from the pool to give `h` `num_tokens` slots, counting
    /// cache-hit blocks that are still in the free queue (vLLM's `get_num_blocks_to_allocate`).
    ///
    /// vLLM counts a request it does not track yet as if its computed tokens were adopted
    /// (out-of-window ones as null blocks). That is what `allocate_slots` does only when it
    /// adopts something (a hit or external tokens); with `adopting` false the table just
    /// grows from its current length, and the count says exactly that, so the capacity check
    /// and the allocation always agree (a request whose computed tokens run ahead of its
    /// table is not under-counted).
    #[allow(clippy::too_many_arguments)]
    pub fn get_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        h: Slot,
        num_tokens: u32,
        new_computed: &[BlockId],
        total_computed_tokens: u32,
        apply_admission_cap: bool,
        adopting: bool,
    ) -> u32 {
        let bs = self.block_size() as u64;
        let mut required = cdiv(self.slot_tokens(num_tokens), bs) as i64;
        if apply_admission_cap {
            if let Some(cap) = self.max_admission_blocks {
                required = required.min(cap as i64);
            }
        }
        let num_req_blocks = self.req_blocks[h as usize].len() as i64;
        if self.is_tracked(h) || !adopting {
            return (required - num_req_blocks).max(0) as u32;
        }
        let skipped_blocks = (self.num_skipped_tokens(total_computed_tokens) as u64 / bs) as i64;
        let local_blocks = new_computed.len() as i64 + num_req_blocks;
        let num_new = (required - skipped_blocks.max(local_blocks)).max(0);
        let skip_new = (skipped_blocks - num_req_blocks).max(0) as usize;
        let evictable = Self::count_evictable(pool, new_computed.get(skip_new..).unwrap_or(&[]));
        num_new as u32 + evictable
    }

    /// Adds a request's cache-hit blocks to its (empty) table, touching them; blocks that
    /// are already out of the window become null (vLLM's `add_local_computed_blocks`).
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
    ) {
        if matches!(self.spec.kind, AttentionKind::Cross) {
            assert!(new_computed.is_empty(), "cross attention never has cache hits");
            return;
        }
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let skipped_blocks = self.num_skipped_tokens(total) / self.spec.block_size;
        let table = &mut self.req_blocks[h as usize];
        assert!(table.is_empty(), "add_local_computed_blocks on a request that has blocks");
        let kept = new_computed.get(skipped_blocks as usize..).unwrap_or(&[]);
        if self.enable_caching {
            pool.touch(kept);
        } else {
            assert!(kept.is_empty(), "computed blocks with prefix caching off");
        }
        table.extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks as usize));
        table.extend_from_slice(kept);
        self.null_prefix[h as usize] = table.iter().take_while(|&&b| b == NULL_BLOCK).count() as u32;
        self.num_cached[h as usize] = table.len() as u32;
    }

    /// Allocates blocks for tokens a KV connector computed (vLLM's
    /// `allocate_external_computed_blocks`).
    pub fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        num_local_computed_tokens: u32,
        num_external_computed_tokens: u32,
        record_for_zeroing: bool,
    ) {
        if matches!(self.spec.kind, AttentionKind::Cross) {
            return;
        }
        let total = num_local_computed_tokens + num_external_computed_tokens;
        let skipped = self.num_skipped_tokens(total);
        let mut ext = num_external_computed_tokens as i64;
        if skipped > 0 {
            ext = ext.min(total as i64 - skipped as i64);
        }
        if ext <= 0 {
            return;
        }
        let table = &mut self.req_blocks[h as usize];
        let need = cdiv(total as u64, self.spec.block_size as u64) as i64 - table.len() as i64;
        if need > 0 {
            let start = table.len();
            pool.get_new_blocks(need as u32, table);
            if self.records_new_block_ids && record_for_zeroing {
                self.new_block_ids.extend_from_slice(&table[start..]);
            }
        }
    }

    /// Grows `h`'s table to `num_tokens` slots; appends the new block ids to `out`
    /// (vLLM's `allocate_new_blocks`). The caller checked capacity.
    pub fn allocate_new_blocks(&mut self, pool: &mut BlockPool, h: Slot, num_tokens: u32, out: &mut Vec<BlockId>) {
        let required = cdiv(self.slot_tokens(num_tokens), self.spec.block_size as u64) as usize;
        let table = &mut self.req_blocks[h as usize];
        if required > table.len() {
            let start = table.len();
            pool.get_new_blocks((required - start) as u32, table);
            out.extend_from_slice(&table[start..]);
            if self.records_new_block_ids {
                self.new_block_ids.extend_from_slice(&table[start..]);
            }
        }
    }

    /// Blocks of `h`'s table that [`Self::cache_blocks`] would treat as full for
    /// `num_tokens` tokens and `num_hashes` hashes (0 for cross attention), and the table's
    /// length: the coordinator refuses a caching call whose full blocks the table lacks.
    pub fn blocks_to_cache(&self, h: Slot, num_hashes: usize, hash_block_size: u32, num_tokens: u32) -> (u32, u32) {
        if matches!(self.spec.kind, AttentionKind::Cross) {
            return (0, 0);
        }
        let bs = self.spec.block_size;
        let view_len = (num_hashes as u64 / (bs / hash_block_size) as u64).min(u32::MAX as u64) as u32;
        ((num_tokens / bs).min(view_len), self.req_blocks[h as usize].len() as u32)
    }

    /// Caches the full blocks of `h` up to `num_tokens` (vLLM's `cache_blocks`), with the
    /// sliding-window retention mask. The caller checked with [`Self::blocks_to_cache`]
    /// that the table holds every full block.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        req: ReqHandle,
        hashes: &[BlockHash],
        hash_block_size: u32,
        num_tokens: u32,
        retention_interval: Option<u32>,
        reachable_boundaries: &[u32],
    ) {
        if matches!(self.spec.kind, AttentionKind::Cross) {
            return;
        }
        let bs = self.spec.block_size;
        let num_cached = self.num_cached(h);
        let view = HashView { hashes, scale: bs / hash_block_size };
        // vLLM 0.32 indexes the request's hashes without a bound; the scheduler always has
        // them. Capping here (as vLLM 0.33 does) keeps a short hash list from panicking.
        let num_full = (num_tokens / bs).min(view.len());
        if num_cached >= num_full {
            return;
        }
        let mask = match self.spec.kind {
            AttentionKind::SlidingWindow { window, .. } => sliding_window::reachable_block_mask(
                num_cached,
                num_full,
                self.cache_hit_alignment_tokens,
                bs,
                window,
                retention_interval,
                reachable_boundaries,
            ),
            _ => None,
        };
        pool.cache_full_blocks(
            req,
            &self.req_blocks[h as usize],
            num_cached,
            num_full,
            bs,
            self.group_id,
            mask.as_deref(),
            |i| view.get(i),
        );
        self.num_cached[h as usize] = num_full;
    }

    /// Frees the blocks of `h` that fell out of the attention window, replacing them with
    /// the null block (vLLM's `remove_skipped_blocks`).
    pub fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, h: Slot, processed_computed_tokens: u32) {
        let skipped = self.num_skipped_tokens(processed_computed_tokens);
        if skipped == 0 {
            return;
        }
        let table = &mut self.req_blocks[h as usize];
        let n = ((skipped / self.spec.block_size) as usize).min(table.len());
        let mut freed = std::mem::take(&mut self.scratch);
        for i in (0..n).rev() {
            if table[i] == NULL_BLOCK {
                break;
            }
            freed.push(table[i]);
            table[i] = NULL_BLOCK;
        }
        if !freed.is_empty() {
            pool.free_blocks(freed.iter().copied());
        }
        freed.clear();
        self.scratch = freed;
        let np = &mut self.null_prefix[h as usize];
        *np = (*np).max(n as u32);
    }

    /// Frees every block of `h`, tail first, and forgets its bookkeeping (vLLM's `free`).
    pub fn free(&mut self, pool: &mut BlockPool, h: Slot) {
        let table = &mut self.req_blocks[h as usize];
        pool.free_blocks(table.iter().rev().copied());
        table.clear();
        self.num_cached[h as usize] = ABSENT;
        self.null_prefix[h as usize] = 0;
    }

    /// Forgets `h`'s bookkeeping and moves its table into `out`, without freeing
    /// (vLLM's `pop_blocks_for_free`).
    pub fn pop_blocks(&mut self, h: Slot, out: &mut Vec<BlockId>) {
        let table = &mut self.req_blocks[h as usize];
        out.extend_from_slice(table);
        table.clear();
        self.num_cached[h as usize] = ABSENT;
        self.null_prefix[h as usize] = 0;
    }

    /// The limits under which a plain step of `h` (no new hit, no external tokens, no
    /// encoder tokens, no admission gate, no reserve, no watermark) changes nothing in this
    /// group: `(slots, processed, cached)` such that a step with
    /// `need_slot <= slots`, `processed < processed_limit` and `to_cache < cached` allocates,
    /// frees and caches nothing. Conservative: a step outside them may still be a no-op.
    pub fn noop_limits(&self, h: Slot) -> (u32, u32, u32) {
        let bs = self.spec.block_size as u64;
        let clamp = |x: u64| x.min(u32::MAX as u64) as u32;
        if matches!(self.spec.kind, AttentionKind::Cross) {
            return (u32::MAX, u32::MAX, u32::MAX);
        }
        if let AttentionKind::Mamba { speculative_blocks, align: false } = self.spec.kind {
            let (slots, processed) = mamba::none_mode_noop_limits(
                self.req_blocks[h as usize].len() as u32,
                self.null_prefix[h as usize],
                self.spec.block_size,
                speculative_blocks,
            );
            let cached = if self.enable_caching { clamp((self.num_cached(h) as u64 + 1) * bs) } else { u32::MAX };
            return (clamp(slots), clamp(processed), cached);
        }
        let slots = clamp(self.req_blocks[h as usize].len() as u64 * bs);
        let k1 = self.null_prefix[h as usize] as u64 + 1;
        let processed = match self.spec.kind {
            AttentionKind::SlidingWindow { window, extra_retained_tokens } => {
                clamp(k1 * bs + window as u64 - 1 + extra_retained_tokens as u64)
            }
            AttentionKind::ChunkedLocal { chunk } => clamp(cdiv(k1 * bs, chunk as u64) * chunk as u64),
            _ => u32::MAX,
        };
        let cached = if self.enable_caching { clamp((self.num_cached(h) as u64 + 1) * bs) } else { u32::MAX };
        (slots, processed, cached)
    }

    /// Every live table (invariant checks).
    pub fn tables(&self) -> impl Iterator<Item = (Slot, &[BlockId])> + '_ {
        self.req_blocks.iter().enumerate().map(|(h, t)| (h as Slot, t.as_slice()))
    }
}
