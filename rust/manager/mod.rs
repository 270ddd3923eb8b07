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
pub mod rswa;
pub mod sliding_window;

use crate::block_pool::BlockPool;
use crate::config::{AttentionKind, GroupSpec};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot, NULL_BLOCK};
use crate::policy::{Level, LEVEL_NEAR, LEVEL_NORMAL, LEVEL_SPECULATIVE};

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
        AttentionKind::Full | AttentionKind::Rswa { .. } => {
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
        AttentionKind::Cross | AttentionKind::CircularBuffer => 0,
        AttentionKind::Mamba { .. } => {
            mamba::find_longest_cache_hit(pool, view, max_length, group_ids, block_size, alignment_tokens, out)
        }
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
    /// Tokens per block hash (the pool's `hash_block_size`).
    pub hash_block_size: u32,
    /// Tokens past each block its hash covers ([`crate::Config::hash_lookahead_tokens`]).
    pub hash_lookahead_tokens: u32,
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
    /// Mamba "align" only: `last_state[h]`, the table index of the state block of the
    /// request's previous step (`mamba::NONE` when absent).
    last_state: Vec<u32>,
    /// Mamba "align" only: `retired[h]`, table slots below which every block was already
    /// recycled (`_num_retired_blocks`, 0 when absent).
    retired: Vec<u32>,
    /// Mamba "align" only: whether `h` got blocks since it was admitted (`_allocated_block_reqs`).
    allocated: Vec<bool>,
    /// Mamba "align" only: `prompt_boundary[h]`, the request's prefill checkpoint position
    /// as last seen (`mamba::NONE` until known); only the no-op limits read it.
    prompt_boundary: Vec<u32>,
    /// Mamba "align" with prefill checkpoint blocks only: `checkpoint[h] = (position, table
    /// index)` of the checkpoint the request's last allocation reserved (`_checkpoints`;
    /// position 0 when none). Set by every allocation's count (not the admission gate's),
    /// kept until the next one: `cache_blocks` keys that block at that position.
    checkpoint: Vec<(u32, u32)>,
    /// Mamba "align" only: keys cached during the current scheduler step
    /// (`cached_blocks_this_step`); a hit ending on one of them waits a step.
    cached_this_step: rustc_hash::FxHashSet<crate::prefix_index::HashKey>,
    /// R-SWA only: `rswa_prompt[h]`, the prompt length the last gap removal was given
    /// (`ABSENT` until one was).
    rswa_prompt: Vec<u32>,
    /// R-SWA only: `rswa_gap_end[h]`; slots `cdiv(rswa_prompt[h], bs)..rswa_gap_end[h]` all
    /// hold the null block (see [`rswa`]).
    rswa_gap_end: Vec<u32>,
}

impl SingleTypeManager {
    /// A manager for group `group_id`.
    pub fn new(
        spec: GroupSpec,
        group_id: GroupId,
        max_admission_blocks: Option<u32>,
        enable_caching: bool,
        cache_hit_alignment_tokens: u32,
        hash_block_size: u32,
        hash_lookahead_tokens: u32,
    ) -> Self {
        Self {
            spec,
            group_id,
            max_admission_blocks,
            enable_caching,
            cache_hit_alignment_tokens,
            hash_block_size,
            hash_lookahead_tokens,
            req_blocks: Vec::new(),
            num_cached: Vec::new(),
            null_prefix: Vec::new(),
            scratch: Vec::new(),
            records_new_block_ids: false,
            new_block_ids: Vec::new(),
            last_state: Vec::new(),
            retired: Vec::new(),
            allocated: Vec::new(),
            prompt_boundary: Vec::new(),
            checkpoint: Vec::new(),
            cached_this_step: Default::default(),
            rswa_prompt: Vec::new(),
            rswa_gap_end: Vec::new(),
        }
    }

    /// A circular buffer's one block, taken the first time the request needs it (vLLM's
    /// `CircularBufferManager._claim_ring_block`).
    fn claim_ring_block(&mut self, pool: &mut BlockPool, h: Slot, record_for_zeroing: bool) {
        let table = &mut self.req_blocks[h as usize];
        if table.is_empty() {
            pool.get_new_blocks(1, table);
            if self.records_new_block_ids && record_for_zeroing {
                self.new_block_ids.push(table[0]);
            }
        }
    }

    /// Whether this is a Mamba group in cache mode "align".
    #[inline]
    pub fn is_mamba_align(&self) -> bool {
        matches!(self.spec.kind, AttentionKind::Mamba { align: true, .. })
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`): hits on states cached in the
    /// previous step are no longer deferred.
    pub fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }

    /// The window of an R-SWA group.
    #[inline]
    fn rswa_window(&self) -> Option<u32> {
        match self.spec.kind {
            AttentionKind::Rswa { window } => Some(window),
            _ => None,
        }
    }

    fn clear_align_state(&mut self, h: Slot) {
        if self.rswa_window().is_some() {
            self.rswa_prompt[h as usize] = ABSENT;
            self.rswa_gap_end[h as usize] = 0;
        }
        if self.is_mamba_align() {
            self.last_state[h as usize] = mamba::NONE;
            self.retired[h as usize] = 0;
            self.allocated[h as usize] = false;
            self.prompt_boundary[h as usize] = mamba::NONE;
            self.checkpoint[h as usize] = (0, 0);
        }
    }

    /// `(speculative_blocks, checkpoint_alignment)` of a Mamba group (zeros for others).
    #[inline]
    fn mamba_params(&self) -> (u32, u32) {
        match self.spec.kind {
            AttentionKind::Mamba { speculative_blocks, checkpoint_alignment, .. } => {
                (speculative_blocks, checkpoint_alignment)
            }
            _ => (0, 0),
        }
    }

    /// Mamba "align": whether a hit ending on `new_computed`'s last block waits a step (its
    /// state was cached during this step: vLLM answers `num_gpu_blocks + 1`).
    fn align_defers(&self, pool: &BlockPool, new_computed: &[BlockId]) -> bool {
        new_computed.last().and_then(|&b| pool.block_hash(b)).is_some_and(|key| self.cached_this_step.contains(key))
    }

    /// Mamba "align": the prefill checkpoint a step computing tokens `query_start..query_end`
    /// reserves a block for (vLLM's `get_mamba_prefill_checkpoint_position` of the chunk end,
    /// kept when `_needs_internal_checkpoint`): its position, 0 for none. `prefill_end` is 0
    /// except under retention interval 0, where only the chunk reaching it reserves one.
    fn align_checkpoint(&self, h: Slot, query_start: u32, query_end: u32, prefill_end: u32) -> u32 {
        let (spec, alignment) = self.mamba_params();
        if alignment == 0 || query_end < prefill_end {
            return 0;
        }
        let pos =
            mamba::prefill_checkpoint_position(query_end, self.cache_hit_alignment_tokens, self.hash_lookahead_tokens);
        let bs = self.spec.block_size as i64;
        if !mamba::prefill_checkpoint_valid(
            query_start as i64,
            query_end as i64,
            pos as i64,
            self.hash_block_size as i64,
            bs,
            alignment as i64,
        ) {
            return 0;
        }
        let idx = (query_end as i64 + bs - 1) / bs - 2;
        if idx < 0 {
            return 0;
        }
        let table = &self.req_blocks[h as usize];
        let len = table.len() as i64;
        let free_slot =
            idx >= len || table[idx as usize] == NULL_BLOCK || (self.allocated[h as usize] && idx >= len - spec as i64);
        if free_slot {
            pos
        } else {
            0
        }
    }

    /// Mamba "align" with prefill checkpoint blocks: records the checkpoint of this
    /// allocation's count, as vLLM's `get_num_blocks_to_allocate` does outside the admission
    /// gate (a count that defers a hit records nothing).
    pub fn record_checkpoint(
        &mut self,
        pool: &BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        query_start: u32,
        query_end: u32,
        prefill_end: u32,
    ) {
        if !self.is_mamba_align() || self.mamba_params().1 == 0 || self.align_defers(pool, new_computed) {
            return;
        }
        let pos = self.align_checkpoint(h, query_start, query_end, prefill_end);
        let bs = self.spec.block_size as u64;
        self.checkpoint[h as usize] = if pos > 0 { (pos, (cdiv(query_end as u64, bs) - 2) as u32) } else { (0, 0) };
    }

    /// Mamba "align": the blocks to take (vLLM's align branch of
    /// `MambaManager.get_num_blocks_to_allocate`, without partial hits): the running state
    /// block, a prefill checkpoint block when the chunk reserves one, and the speculative
    /// blocks of a first allocation. May be negative (an over-allocated table), as in vLLM;
    /// `num_blocks + 1` defers a hit on a state cached this step.
    fn align_num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        query_start: u32,
        num_tokens_main_model: u32,
        prefill_end: u32,
    ) -> i64 {
        if self.align_defers(pool, new_computed) {
            return pool.num_blocks() as i64 + 1;
        }
        let spec = self.mamba_params().0 as i64;
        let required = cdiv(num_tokens_main_model as u64, self.spec.block_size as u64) as i64 + spec;
        let mut num_new = required - new_computed.len() as i64 - self.req_blocks[h as usize].len() as i64;
        if num_new > 0 {
            let checkpoint = (self.align_checkpoint(h, query_start, num_tokens_main_model, prefill_end) > 0) as i64;
            let cap = 1 + checkpoint + if self.allocated[h as usize] { 0 } else { spec };
            num_new = num_new.min(cap);
        }
        num_new + Self::count_evictable(pool, new_computed) as i64
    }

    /// Mamba "align": vLLM's align branch of `MambaManager.allocate_new_blocks` (no partial
    /// hit): the table is padded with null blocks up to the new running state block (up to
    /// the checkpoint block when the count reserved one, which is allocated then), the
    /// speculative scratch blocks this step leaves behind move to the table's end, and the
    /// padding, the moved blocks and the new blocks are the "new blocks" reported.
    fn align_allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        let hs = h as usize;
        let spec = self.mamba_params().0 as usize;
        let required = cdiv(num_tokens_main_model as u64, self.spec.block_size as u64) as usize + spec;
        let checkpoint = (self.checkpoint[hs].0 > 0) as usize;
        let table = &mut self.req_blocks[hs];
        if required <= table.len() && checkpoint == 0 {
            self.allocated[hs] = true;
            return;
        }
        let prev = table.len();
        let was_allocated = self.allocated[hs];
        if was_allocated {
            // The running state sits before the speculative blocks. An allocated table holds
            // at least `1 + spec` blocks (its first allocation reached `required`).
            self.last_state[hs] = prev.saturating_sub(1 + spec) as u32;
        } else if prev > 0 {
            // A new request on a hit: the hit's last block holds the state.
            self.last_state[hs] = (prev - 1) as u32;
        }
        let num_skipped = required as i64 - spec as i64 - 1;
        let null_end = num_skipped - checkpoint as i64;
        if (prev as i64) < num_skipped && null_end > prev as i64 {
            table.resize(null_end as usize, NULL_BLOCK);
        }
        if was_allocated {
            // Relocate the scratch blocks this step leaves behind (a checkpoint step keeps the
            // one at the checkpoint index, where the worker exports the checkpoint).
            for i in prev.saturating_sub(spec)..prev {
                if (i as i64) >= null_end {
                    break;
                }
                let b = table[i];
                table.push(b);
                table[i] = NULL_BLOCK;
            }
        }
        let n = required.saturating_sub(table.len());
        pool.get_new_blocks(n as u32, table);
        out.extend_from_slice(&table[prev..]);
        self.allocated[hs] = true;
    }

    /// Mamba "align": vLLM's `MambaManager.remove_skipped_blocks` (the retired range, null
    /// gaps skipped, then the previous step's state block once the step after it is processed).
    fn align_remove_skipped_blocks(&mut self, pool: &mut BlockPool, h: Slot, processed: u32) {
        let hs = h as usize;
        let bs = self.spec.block_size;
        let skipped = mamba::num_skipped_tokens(processed);
        let table = &mut self.req_blocks[hs];
        if skipped > 0 {
            let last = ((skipped / bs) as usize).min(table.len());
            let first = self.retired[hs] as usize;
            if first < last {
                let mut freed = std::mem::take(&mut self.scratch);
                for i in (first..last).rev() {
                    if table[i] != NULL_BLOCK {
                        freed.push(table[i]);
                        table[i] = NULL_BLOCK;
                    }
                }
                if !freed.is_empty() {
                    pool.free_blocks(freed.iter().copied());
                }
                freed.clear();
                self.scratch = freed;
                self.retired[hs] = last as u32;
            }
        }
        let ls = self.last_state[hs];
        if ls != mamba::NONE && (ls as u64) + 1 < cdiv(processed as u64, bs as u64) {
            let b = table[ls as usize];
            if b != NULL_BLOCK {
                pool.free_blocks([b]);
                table[ls as usize] = NULL_BLOCK;
            }
        }
    }

    /// Mamba "align": vLLM's `_cache_partial_tail_block` when the Mamba block is the hash
    /// block: at the prompt's checkpoint position the state block ending there is keyed
    /// (again, if an eviction dropped its key) and counted as cached this step.
    /// `rekey_cached` is vLLM 0.32's rule (a block already keyed there is counted again);
    /// 0.33 skips such a block.
    #[allow(clippy::too_many_arguments)]
    fn align_cache_prompt_tail(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        req: ReqHandle,
        hashes: &[BlockHash],
        hash_block_size: u32,
        num_tokens: u32,
        num_prompt_tokens: u32,
        rekey_cached: bool,
    ) {
        if num_tokens == 0 || num_tokens % hash_block_size != 0 {
            return;
        }
        if num_tokens
            != mamba::prefill_checkpoint_position(num_prompt_tokens, hash_block_size, self.hash_lookahead_tokens)
        {
            return;
        }
        let bs = self.spec.block_size;
        let idx = (num_tokens.div_ceil(bs) - 1) as usize;
        let table = &self.req_blocks[h as usize];
        let Some(&b) = table.get(idx) else { return };
        if b == NULL_BLOCK {
            return;
        }
        let nh = (num_tokens / hash_block_size) as usize;
        if nh > hashes.len() {
            return;
        }
        let key = (hashes[nh - 1], self.group_id);
        let tokens = pool.block_hash_num_tokens(b);
        if !rekey_cached && pool.block_hash(b).is_some() && tokens == num_tokens {
            return;
        }
        match pool.block_hash(b) {
            Some(k) if *k == key => {}
            Some(_) if tokens < num_tokens => {
                pool.maybe_evict_cached_block(b);
                let parent = if nh > 1 { Some(hashes[nh - 2]) } else { None };
                pool.cache_one_block(req, b, idx as u32, key, num_tokens, bs, parent);
            }
            // Another key at this position (a rewritten hash list): vLLM would add a second
            // key to the block; not served, and never reached through the scheduler.
            Some(_) => return,
            None => {
                let parent = if nh > 1 { Some(hashes[nh - 2]) } else { None };
                pool.cache_one_block(req, b, idx as u32, key, num_tokens, bs, parent);
            }
        }
        self.cached_this_step.insert(key);
    }

    /// Mamba "align": the checkpoint branch of vLLM's `_cache_partial_tail_block`. The block
    /// reserved at the checkpoint index is keyed at the checkpoint position (replacing any key
    /// it holds) when that state is reusable: the prompt's checkpoint, a retained boundary
    /// (every one under dense retention) or the shared-prefix junction. Otherwise the state
    /// is transient and any key the block got this step is dropped. The scheduler block size
    /// is the Mamba block size here (the config requires it), so the position ends the block.
    #[allow(clippy::too_many_arguments)]
    fn align_cache_checkpoint(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        req: ReqHandle,
        hashes: &[BlockHash],
        retention_interval: Option<u32>,
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) {
        let (pos, idx) = self.checkpoint[h as usize];
        // vLLM asserts the index is in the table; a count whose allocation then failed can
        // leave it past the table until the next allocation: nothing to key then.
        let Some(&b) = self.req_blocks[h as usize].get(idx as usize) else { return };
        let bs = self.spec.block_size;
        let align = self.cache_hit_alignment_tokens;
        let is_prompt_checkpoint =
            pos == mamba::prefill_checkpoint_position(num_prompt_tokens, align, self.hash_lookahead_tokens);
        let mut retained = false;
        if pos % bs == 0 {
            let i = pos / bs - 1;
            retained = mamba::reachable_block_mask(i, i + 1, align, bs, retention_interval, &[]).is_none_or(|m| m[0]);
        }
        if !is_prompt_checkpoint && !retained && pos != shared_prefix_boundary {
            if b != NULL_BLOCK {
                pool.maybe_evict_cached_block(b);
            }
            return;
        }
        if b == NULL_BLOCK || (pool.block_hash(b).is_some() && pool.block_hash_num_tokens(b) == pos) {
            return;
        }
        let nh = (pos / self.hash_block_size) as usize;
        if nh == 0 || nh > hashes.len() {
            // vLLM asserts the request has the hashes (the scheduler's requests do).
            return;
        }
        let key = (hashes[nh - 1], self.group_id);
        pool.maybe_evict_cached_block(b);
        let parent = if nh > 1 { Some(hashes[nh - 2]) } else { None };
        pool.cache_one_block(req, b, pos / bs - 1, key, pos, bs, parent);
        self.cached_this_step.insert(key);
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
            AttentionKind::Mamba { speculative_blocks, align: false, .. } => {
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
            if self.is_mamba_align() {
                self.last_state.resize(n, mamba::NONE);
                self.retired.resize(n, 0);
                self.allocated.resize(n, false);
                self.prompt_boundary.resize(n, mamba::NONE);
                self.checkpoint.resize(n, (0, 0));
            }
            if self.rswa_window().is_some() {
                self.rswa_prompt.resize(n, ABSENT);
                self.rswa_gap_end.resize(n, 0);
            }
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
            AttentionKind::Full | AttentionKind::Rswa { .. } | AttentionKind::Cross | AttentionKind::CircularBuffer => {
                0
            }
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
        num_tokens_main_model: u32,
        new_computed: &[BlockId],
        total_computed_tokens: u32,
        apply_admission_cap: bool,
        adopting: bool,
        prefill_end: u32,
    ) -> i64 {
        if self.is_mamba_align() {
            return self.align_num_blocks_to_allocate(
                pool,
                h,
                new_computed,
                total_computed_tokens,
                num_tokens_main_model,
                prefill_end,
            );
        }
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return self.req_blocks[h as usize].is_empty() as i64;
        }
        let bs = self.block_size() as u64;
        let mut required = cdiv(self.slot_tokens(num_tokens), bs) as i64;
        if apply_admission_cap {
            if let Some(cap) = self.max_admission_blocks {
                required = required.min(cap as i64);
            }
        }
        let num_req_blocks = self.req_blocks[h as usize].len() as i64;
        if self.is_tracked(h) || !adopting {
            return (required - num_req_blocks).max(0);
        }
        let skipped_blocks = (self.num_skipped_tokens(total_computed_tokens) as u64 / bs) as i64;
        let local_blocks = new_computed.len() as i64 + num_req_blocks;
        let num_new = (required - skipped_blocks.max(local_blocks)).max(0);
        let skip_new = (skipped_blocks - num_req_blocks).max(0) as usize;
        let evictable = Self::count_evictable(pool, new_computed.get(skip_new..).unwrap_or(&[]));
        num_new + evictable as i64
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
        if matches!(self.spec.kind, AttentionKind::Cross | AttentionKind::CircularBuffer) {
            assert!(new_computed.is_empty(), "cross attention and circular buffers never have cache hits");
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
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            return self.claim_ring_block(pool, h, record_for_zeroing);
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
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        num_tokens: u32,
        num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        if self.is_mamba_align() {
            return self.align_allocate_new_blocks(pool, h, num_tokens_main_model, out);
        }
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            let start = self.req_blocks[h as usize].len();
            self.claim_ring_block(pool, h, true);
            out.extend_from_slice(&self.req_blocks[h as usize][start..]);
            return;
        }
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
        if matches!(self.spec.kind, AttentionKind::Cross | AttentionKind::CircularBuffer) {
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
        num_prompt_tokens: u32,
        shared_prefix_boundary: u32,
    ) {
        if matches!(self.spec.kind, AttentionKind::Cross | AttentionKind::CircularBuffer) {
            return;
        }
        let before = self.num_cached(h);
        self.cache_full(pool, h, req, hashes, hash_block_size, num_tokens, retention_interval, reachable_boundaries);
        if let AttentionKind::Mamba { align: true, rekey_cached_tail, .. } = self.spec.kind {
            // Once the prompt is computed, the tokens to cache never come back down to its
            // checkpoint position (below the prompt's end), so the no-op limits stop
            // watching it (0: no position to watch).
            self.prompt_boundary[h as usize] = if num_tokens >= num_prompt_tokens {
                0
            } else {
                mamba::prefill_checkpoint_position(num_prompt_tokens, hash_block_size, self.hash_lookahead_tokens)
            };
            if self.checkpoint[h as usize].0 > 0 {
                self.align_cache_checkpoint(
                    pool,
                    h,
                    req,
                    hashes,
                    retention_interval,
                    num_prompt_tokens,
                    shared_prefix_boundary,
                );
            } else {
                self.align_cache_prompt_tail(
                    pool,
                    h,
                    req,
                    hashes,
                    hash_block_size,
                    num_tokens,
                    num_prompt_tokens,
                    rekey_cached_tail,
                );
            }
            let after = self.num_cached(h);
            for i in before..after {
                let b = self.req_blocks[h as usize][i as usize];
                if b != NULL_BLOCK {
                    if let Some(key) = pool.block_hash(b) {
                        self.cached_this_step.insert(*key);
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn cache_full(
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
            AttentionKind::Mamba { .. } => mamba::reachable_block_mask(
                num_cached,
                num_full,
                self.cache_hit_alignment_tokens,
                bs,
                retention_interval,
                reachable_boundaries,
            ),
            _ => None,
        };
        // Hit-aware (a leveled pool): cache every block; those the mask skips go to the
        // speculative level (see `crate::policy`).
        let dense = pool.is_leveled() && mask.is_some();
        pool.cache_full_blocks(
            req,
            &self.req_blocks[h as usize],
            num_cached,
            num_full,
            bs,
            self.group_id,
            if dense { None } else { mask.as_deref() },
            |i| view.get(i),
        );
        if dense {
            let table = &self.req_blocks[h as usize];
            let need = self.hit_tail_blocks().unwrap_or(0) as u64;
            let align = self.cache_hit_alignment_tokens.max(1);
            // Block index where each boundary's retained tail ends.
            let ends: Vec<u64> = reachable_boundaries.iter().map(|&b| (b / align * align / bs) as u64).collect();
            for (k, keep) in mask.iter().flatten().enumerate() {
                if !keep {
                    let i = num_cached as u64 + k as u64;
                    let near = ends.iter().any(|&e| i + need < e && i + 2 * need >= e);
                    pool.set_level(table[i as usize], if near { LEVEL_NEAR } else { LEVEL_SPECULATIVE });
                }
            }
        }
        self.num_cached[h as usize] = num_full;
    }

    /// R-SWA: vLLM's `RSWAManager.remove_skipped_blocks` given the prompt length: frees the
    /// gap (see [`rswa`]) walking back from its end, stopping at the first null block.
    fn rswa_remove_gap(&mut self, pool: &mut BlockPool, h: Slot, processed: u32, num_prompt_tokens: u32, window: u32) {
        let hs = h as usize;
        let bs = self.spec.block_size;
        let (first, last) = rswa::gap_range(num_prompt_tokens, processed, window, bs);
        if self.rswa_prompt[hs] != num_prompt_tokens {
            // A new prompt length: nothing is known null yet past its first gap slot.
            self.rswa_prompt[hs] = num_prompt_tokens;
            self.rswa_gap_end[hs] = first.min(u32::MAX as u64) as u32;
        }
        if first >= last {
            return;
        }
        let table = &mut self.req_blocks[hs];
        let last = last.min(table.len() as u64);
        let mut freed = std::mem::take(&mut self.scratch);
        // `stop`: the slot of the null block the walk stopped at (vLLM's `break`), if any.
        let mut stop = None;
        let mut i = last;
        while i > first {
            i -= 1;
            let b = table[i as usize];
            if b == NULL_BLOCK {
                stop = Some(i);
                break;
            }
            freed.push(b);
            table[i as usize] = NULL_BLOCK;
        }
        if !freed.is_empty() {
            pool.free_blocks(freed.iter().copied());
        }
        freed.clear();
        self.scratch = freed;
        // `first..last` is all null now when the walk reached `first`, or stopped at a slot
        // inside the known-null range (whose slots below it are null too).
        let end = self.rswa_gap_end[hs] as u64;
        if stop.is_none_or(|j| j <= end) && last > end {
            self.rswa_gap_end[hs] = last as u32;
        }
    }

    /// Frees the blocks of `h` that fell out of the attention window, replacing them with
    /// the null block (vLLM's `remove_skipped_blocks`). `num_prompt_tokens` is what vLLM's
    /// `allocate_slots` passes (`None` from its other callers); only R-SWA reads it.
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut BlockPool,
        h: Slot,
        processed_computed_tokens: u32,
        num_prompt_tokens: Option<u32>,
    ) {
        if let Some(window) = self.rswa_window() {
            if let Some(p) = num_prompt_tokens {
                self.rswa_remove_gap(pool, h, processed_computed_tokens, p, window);
            }
            return;
        }
        if self.is_mamba_align() {
            return self.align_remove_skipped_blocks(pool, h, processed_computed_tokens);
        }
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
        self.clear_align_state(h);
    }

    /// Forgets `h`'s bookkeeping and moves its table into `out`, without freeing
    /// (vLLM's `pop_blocks_for_free`).
    pub fn pop_blocks(&mut self, h: Slot, out: &mut Vec<BlockId>) {
        let table = &mut self.req_blocks[h as usize];
        out.extend_from_slice(table);
        table.clear();
        self.num_cached[h as usize] = ABSENT;
        self.null_prefix[h as usize] = 0;
        self.clear_align_state(h);
    }

    /// Contiguous cached blocks a hit in this group needs at its end (`None`: the group
    /// needs the whole prefix, or never hits).
    pub fn hit_tail_blocks(&self) -> Option<u32> {
        match self.spec.kind {
            AttentionKind::SlidingWindow { window, .. } => {
                Some(sliding_window::contiguous_blocks_for_hit(window, self.spec.block_size))
            }
            _ => None,
        }
    }

    /// Hit-aware: raises the retention level of the window tail ending at `h`'s last cached
    /// block (where a request re-sending this sequence resumes) to at least `lvl`, and of
    /// every other cached block of the table to at least `floor`.
    pub fn promote_for_free(&self, pool: &mut BlockPool, h: Slot, lvl: Level, floor: Level) {
        let table = &self.req_blocks[h as usize];
        let end = (self.num_cached(h) as usize).min(table.len());
        let tail = self.hit_tail_blocks().map_or(end, |n| n as usize);
        for (i, &b) in table[..end].iter().enumerate() {
            if b == NULL_BLOCK || pool.block_hash(b).is_none() {
                continue;
            }
            let want = if i + tail >= end { lvl } else { floor };
            if pool.level(b) < want {
                pool.set_level(b, want);
            }
        }
    }

    /// Hit-aware: the blocks of a hit just adopted keep at least [`LEVEL_NORMAL`].
    pub fn promote_hit(&self, pool: &mut BlockPool, h: Slot) {
        for &b in &self.req_blocks[h as usize] {
            if b != NULL_BLOCK && pool.level(b) < LEVEL_NORMAL {
                pool.set_level(b, LEVEL_NORMAL);
            }
        }
    }

    /// Appends `(position, group, block)` for every non-null block of `h`'s table
    /// (hit-aware free order).
    pub fn positioned_blocks(&self, h: Slot, out: &mut Vec<(u64, GroupId, BlockId)>) {
        let bs = self.spec.block_size as u64;
        for (i, &b) in self.req_blocks[h as usize].iter().enumerate() {
            if b != NULL_BLOCK {
                out.push((i as u64 * bs, self.group_id, b));
            }
        }
    }

    /// Forgets `h`'s table without freeing its blocks (the caller frees them).
    pub fn forget(&mut self, h: Slot) {
        self.req_blocks[h as usize].clear();
        self.num_cached[h as usize] = ABSENT;
        self.null_prefix[h as usize] = 0;
        self.clear_align_state(h);
    }

    /// The limits under which a plain step of `h` (no new hit, no external tokens, no
    /// encoder tokens, no admission gate, no reserve, no watermark) changes nothing in this
    /// group: `(slots, processed, cached, new_tokens)` such that a step with
    /// `need_slot <= slots`, `processed < processed_limit`, `to_cache < cached` and
    /// `num_new_tokens <= new_tokens` allocates, frees and caches nothing. Conservative: a
    /// step outside them may still be a no-op.
    pub fn noop_limits(&self, h: Slot) -> (u32, u32, u32, u32) {
        let (slots, processed, cached) = self.noop_limits3(h);
        if !self.is_mamba_align() || self.mamba_params().1 == 0 {
            return (slots, processed, cached, u32::MAX);
        }
        // Prefill checkpoints: a step reserves one only when it spans more than one block
        // past the block its first token's state comes from (`prefill_checkpoint_valid`), so
        // a step of at most one block never does; and a stored checkpoint is dropped (or
        // renewed) by the next allocation's count, which the no-op answer would skip.
        let slots = if self.checkpoint[h as usize].0 > 0 { 0 } else { slots };
        (slots, processed, cached, self.spec.block_size)
    }

    fn noop_limits3(&self, h: Slot) -> (u32, u32, u32) {
        let bs = self.spec.block_size as u64;
        let clamp = |x: u64| x.min(u32::MAX as u64) as u32;
        if matches!(self.spec.kind, AttentionKind::Cross) {
            return (u32::MAX, u32::MAX, u32::MAX);
        }
        if matches!(self.spec.kind, AttentionKind::CircularBuffer) {
            let slots = if self.req_blocks[h as usize].is_empty() { 0 } else { u32::MAX };
            return (slots, u32::MAX, u32::MAX);
        }
        if self.is_mamba_align() {
            // No allocation while the main tokens fit the table before its speculative
            // blocks (lookahead slots are not allocated in align mode, so `slots` is
            // conservative); nothing freed below the retired range's next block nor before
            // the previous state block falls out; no new full block, and not the prompt's
            // checkpoint position (re-keyed there).
            let hs = h as usize;
            let len = self.req_blocks[hs].len() as u64;
            let slots = clamp(len.saturating_sub(self.mamba_params().0 as u64) * bs);
            let mut processed = (self.retired[hs] as u64 + 1) * bs + 1;
            let ls = self.last_state[hs];
            if ls != mamba::NONE && self.req_blocks[hs][ls as usize] != NULL_BLOCK {
                processed = processed.min((ls as u64 + 1) * bs + 1);
            }
            let mut cached = (self.num_cached(h) as u64 + 1) * bs;
            let pb = self.prompt_boundary[hs];
            if pb == mamba::NONE {
                cached = 0;
            } else if pb != 0 && (pb as u64) < cached {
                cached = pb as u64;
            }
            return (slots, clamp(processed), clamp(cached));
        }
        if let AttentionKind::Mamba { speculative_blocks, align: false, .. } = self.spec.kind {
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
            // Nothing frees until the window's start passes the known-null gap; before the
            // first removal told the prompt length nothing is proven.
            AttentionKind::Rswa { window } => match self.rswa_prompt[h as usize] {
                ABSENT => 0,
                _ => clamp(rswa::noop_processed_limit(self.rswa_gap_end[h as usize], window, self.spec.block_size)),
            },
            AttentionKind::SlidingWindow { window, extra_retained_tokens } => {
                clamp(k1 * bs + window as u64 - 1 + extra_retained_tokens as u64)
            }
            AttentionKind::ChunkedLocal { chunk } => clamp(cdiv(k1 * bs, chunk as u64) * chunk as u64),
            _ => u32::MAX,
        };
        let cached = if self.enable_caching { clamp((self.num_cached(h) as u64 + 1) * bs) } else { u32::MAX };
        (slots, processed, cached)
    }

    /// The smallest prompt length for which [`Self::noop_limits`] of `h` hold (R-SWA: the
    /// prompt length they were computed for; a shorter one moves the gap's start down).
    pub fn noop_min_prompt(&self, h: Slot) -> u32 {
        match self.spec.kind {
            AttentionKind::Rswa { .. } => match self.rswa_prompt[h as usize] {
                ABSENT => 0,
                p => p,
            },
            _ => 0,
        }
    }

    /// R-SWA: `(prompt length, gap end)` of `h` (invariant checks).
    pub fn rswa_gap(&self, h: Slot) -> Option<(u32, u32)> {
        self.rswa_window().map(|_| (self.rswa_prompt[h as usize], self.rswa_gap_end[h as usize]))
    }

    /// Every live table (invariant checks).
    pub fn tables(&self) -> impl Iterator<Item = (Slot, &[BlockId])> + '_ {
        self.req_blocks.iter().enumerate().map(|(h, t)| (h as Slot, t.as_slice()))
    }
}
