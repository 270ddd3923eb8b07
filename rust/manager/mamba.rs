//! Mamba / linear-attention state (vLLM's `MambaManager`; GDN in Qwen3.5 / Qwen3-Next,
//! Mamba2 in Nemotron-H / Jamba / Granite 4 / Falcon-H1, short convolution in LFM2).
//!
//! A Mamba layer needs only the state after the last computed token, so
//! `get_num_skipped_tokens(n) = n - 1`: every block before the one holding that state goes
//! back to the pool (as the null block, in place, like sliding-window recycling).
//!
//! Mode `"none"` (vLLM's `mamba_cache_mode`, the mode vLLM uses with prefix caching off):
//! the group allocates like any other, with `speculative_blocks` extra blocks reserved and
//! allocated past the token slots (speculative decoding keeps one state per draft
//! position). vLLM's Mamba block size is then `max_model_len`, so a request holds
//! `1 + speculative_blocks` state blocks for its whole life.
//!
//! Mode `"align"` (what vLLM uses with prefix caching on): the table is positional over
//! the whole sequence, but only the running state block and the one it was copied from are
//! real; every block before them is null. At each block boundary the running state block
//! is cached under the prefix hash of that boundary, so a later request can resume from
//! it. A hit is the *last* cached boundary state (`[null] * i + [block]`). Served here: a
//! Mamba block size equal to the hash block size, or larger with vLLM's partial hash hits
//! (`--prefix-match-unit`, [`crate::Config::partial_hash_hits`]: the hit is the last cached
//! hash-block boundary, inside a block or not; a hit inside a block is copied on write by the
//! next allocation, and the prompt's last hash boundary is keyed inside its block, its key
//! moving to a copy before the request's next forward overwrites it; so is the request's
//! junction, `shared_prefix_boundary`, under vLLM's shared-prefix checkpoint
//! ([`crate::Config::shared_prefix_checkpoint`]) when a prompt chunk computes it, and no
//! prefill step is then proved a no-op), with or without prefill
//! checkpoint blocks (vLLM's `MambaMixer2` always has them): a prefill chunk spanning more than
//! one block past its initial state reserves one more block, just before the running state
//! block, where the worker exports the state at the chunk's last cacheable boundary;
//! `cache_blocks` keys it there when that state is reusable (the prompt's checkpoint, a
//! retained boundary, the shared-prefix junction) and drops its key otherwise. With
//! speculative decoding the table also holds `speculative_blocks` scratch state blocks past
//! the running one (allocated with the first blocks); a step that moves the running state
//! past a scratch block moves that block to the table's end (`_relocate_speculative_block`),
//! so a request keeps `1 + speculative_blocks` state blocks plus the previous state. With
//! vLLM 0.33's lookahead block hashes the prompt's checkpoint positions move back by the
//! lookahead tokens (`get_mamba_prefill_checkpoint_position`), the prefill checkpoints too:
//! over several tokens (multi-module MTP) a chunk ending less than the lookahead past a block
//! boundary keys its reserved checkpoint block one block before that block's end, as vLLM
//! does; with EAGLE/MTP's `use_eagle`
//! they are one hash block below the last boundary at most the tokens given
//! (`drop_eagle_checkpoint_block`, [`crate::Config::eagle_checkpoints`]).
//!
//! Per request the align manager keeps, as vLLM does: `last_state_block_idx` (the state
//! block of the previous step, freed once the step after it is processed), the number of
//! retired table slots (`_num_retired_blocks`), whether the request ever got blocks
//! (`_allocated_block_reqs`), the checkpoint the last allocation reserved (`_checkpoints`),
//! and per manager the keys cached during the current step
//! (`cached_blocks_this_step`: a hit on such a state waits for the next step).
//!
//! Rules: [`MambaNone`] (skipped tokens, the hit search, the retention mask, the speculative
//! blocks' slots and no-op limits, its checks) and [`MambaAlign`] (the same search and mask,
//! with its own count, allocation, caching, freeing, no-op limits and per-request state).
//! Align's operations are methods of its state ([`AlignState`], which holds a copy of the
//! rules), on one request's share of the manager's bookkeeping the manager lends them
//! (`AlignReq`, `AlignView`). The hit-aware policy's rules for its states (the furthest one
//! a request keyed, the junction, the states a request passes) are in `manager/retention.rs`:
//! this file only calls its named hooks (`states_keyed`, `states_passed`, `state_moved`,
//! `keys_junction_state`).
//!
//! Cost: every function here is O(1), except [`find_longest_cache_hit`], O(blocks scanned
//! from the right until a cached one).
#![forbid(unsafe_code)]

use super::noop::clamp;
use super::retention::GroupRetention;
use super::{cdiv, CacheArgs, CountArgs, HitQuery, KindRules, KindState, SingleTypeManager};
use crate::block_pool::{BlockPool, OneBlock};
use crate::config::{Config, GroupSpec};
use crate::error::{Error, Result};
use crate::ids::{BlockId, GroupId, Slot, NULL_BLOCK};
use crate::prefix_index::HashKey;

/// Mamba's rules in cache mode "none" (vLLM's `MambaManager` without prefix caching).
#[derive(Clone, Copy, Debug)]
pub struct MambaNone {
    /// Extra state blocks kept for speculative decoding.
    pub speculative_blocks: u32,
}

/// Mamba's rules in cache mode "align" (vLLM's `MambaManager` with prefix caching).
#[derive(Clone, Copy, Debug, Default)]
pub struct MambaAlign {
    /// Extra state blocks kept for speculative decoding.
    pub speculative_blocks: u32,
    /// vLLM 0.32's rule for the prompt's checkpoint state.
    pub rekey_cached_tail: bool,
    /// `prefill_checkpoint_alignment` with prefill checkpoint blocks; 0: none.
    pub checkpoint_alignment: u32,
}

/// The checks both modes share: the speculative blocks are bounded.
fn check_speculative_blocks(speculative_blocks: u32, i: usize) -> Result<()> {
    if speculative_blocks > 1 << 20 {
        return Err(Error::InvalidConfig(format!("group {i}: {speculative_blocks} speculative Mamba blocks")));
    }
    Ok(())
}

impl KindRules for MambaNone {
    fn is_attention(&self) -> bool {
        false
    }

    fn sparse_retention(&self) -> bool {
        true
    }

    fn check_params(&self, _cfg: &Config, i: usize) -> Result<()> {
        check_speculative_blocks(self.speculative_blocks, i)
    }

    fn check_with_caching(&self, _cfg: &Config, i: usize, _g: &GroupSpec) -> Result<()> {
        Err(Error::Unsupported(format!(
            "group {i}: Mamba cache mode \"none\" with prefix caching on (vLLM itself switches \
             to \"align\" when prefix caching is on)"
        )))
    }

    #[inline]
    fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        num_skipped_tokens(num_computed_tokens)
    }

    /// The speculative state blocks' slots come on top (see [`none_mode_tokens`]).
    #[inline]
    fn slot_tokens(&self, num_tokens: u32, block_size: u32) -> u64 {
        none_mode_tokens(num_tokens, block_size, self.speculative_blocks)
    }

    fn find_longest_cache_hit(&self, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
        find_longest_cache_hit(q, out)
    }

    fn reachable_block_mask(
        &self,
        start: u32,
        end: u32,
        alignment_tokens: u32,
        block_size: u32,
        c: &CacheArgs<'_>,
    ) -> Option<Vec<bool>> {
        reachable_block_mask(start, end, alignment_tokens, block_size, c.retention_interval, c.reachable_boundaries)
    }

    fn noop_limits(&self, m: &SingleTypeManager, h: Slot) -> (u32, u32, u32, u32) {
        let (slots, processed) =
            none_mode_noop_limits(m.blocks(h).len() as u32, m.null_prefix(h), m.block_size(), self.speculative_blocks);
        (clamp(slots), clamp(processed), m.noop_cached(h), u32::MAX)
    }
}

impl KindRules for MambaAlign {
    fn is_attention(&self) -> bool {
        false
    }

    fn is_mamba_align(&self) -> bool {
        true
    }

    fn fine_grained_lookup(&self) -> bool {
        true
    }

    fn sparse_retention(&self) -> bool {
        true
    }

    fn check_params(&self, cfg: &Config, i: usize) -> Result<()> {
        check_speculative_blocks(self.speculative_blocks, i)?;
        if !cfg.enable_caching {
            return Err(Error::Unsupported(format!(
                "group {i}: Mamba cache mode \"align\" with prefix caching off (vLLM's config \
                 sets \"none\" then)"
            )));
        }
        Ok(())
    }

    fn check_with_caching(&self, cfg: &Config, i: usize, g: &GroupSpec) -> Result<()> {
        if self.checkpoint_alignment > 0 && g.block_size != cfg.scheduler_block_size {
            return Err(Error::Unsupported(format!(
                "group {i}: Mamba prefill checkpoint blocks with a Mamba block size ({}) other than \
                 the scheduler block size ({}) (the checkpoint would be keyed inside its block)",
                g.block_size, cfg.scheduler_block_size
            )));
        }
        // Two-level pages: the hash block is the slot, below the Mamba block by construction;
        // hits end at state blocks (see `Config::partial_hash_hits`).
        if g.block_size != cfg.hash_block_size && !cfg.partial_hash_hits() && cfg.slots_per_page <= 1 {
            return Err(Error::Unsupported(format!(
                "group {i}: Mamba block size {} over hash block size {} in cache mode \"align\" \
                 with partial hash hits off (another group's block is over the hash block and is \
                 not looked up at hash granularity)",
                g.block_size, cfg.hash_block_size
            )));
        }
        Ok(())
    }

    fn new_state(&self) -> KindState {
        KindState::MambaAlign(AlignState::new(*self))
    }

    #[inline]
    fn num_skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        num_skipped_tokens(num_computed_tokens)
    }

    fn find_longest_cache_hit(&self, q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
        find_longest_cache_hit(q, out)
    }

    fn reachable_block_mask(
        &self,
        start: u32,
        end: u32,
        alignment_tokens: u32,
        block_size: u32,
        c: &CacheArgs<'_>,
    ) -> Option<Vec<bool>> {
        reachable_block_mask(start, end, alignment_tokens, block_size, c.retention_interval, c.reachable_boundaries)
    }

    /// Align's own limits ([`AlignState::noop_limits`]); a group without align state is
    /// never a no-op (it cannot be one: see `SingleTypeManager::align_req`).
    fn noop_limits(&self, m: &SingleTypeManager, h: Slot) -> (u32, u32, u32, u32) {
        m.align_view(h).map_or((0, 0, 0, 0), |(st, v)| st.noop_limits(&v))
    }

    fn get_num_blocks_to_allocate(&self, m: &SingleTypeManager, pool: &BlockPool, h: Slot, c: &CountArgs<'_>) -> i64 {
        let partial_local_hit = m.has_partial_local_hit(c.new_computed, c.num_local_computed_tokens);
        m.align_view(h).map_or(0, |(st, v)| st.num_blocks_to_allocate(pool, &v, c, partial_local_hit))
    }

    fn allocate_new_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        _num_tokens: u32,
        num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        if let Some((st, mut q)) = m.align_req(h) {
            st.allocate_new_blocks(pool, &mut q, num_tokens_main_model, out);
        }
    }

    /// The full blocks (the default's), then the align states (see
    /// [`AlignState::cache_blocks`]).
    fn cache_blocks(&self, m: &mut SingleTypeManager, pool: &mut BlockPool, h: Slot, c: &CacheArgs<'_>) {
        let before = m.num_cached(h);
        m.cache_full(self, pool, h, c);
        if let Some((st, mut q)) = m.align_req(h) {
            st.cache_blocks(pool, &mut q, c, before);
        }
    }

    fn remove_skipped_blocks(
        &self,
        m: &mut SingleTypeManager,
        pool: &mut BlockPool,
        h: Slot,
        processed_computed_tokens: u32,
        _num_prompt_tokens: Option<u32>,
    ) {
        if let Some((st, mut q)) = m.align_req(h) {
            st.remove_skipped_blocks(pool, &mut q, processed_computed_tokens);
        }
    }
}
/// Marker for "no entry" in the per-request align state.
pub const NONE: u32 = u32::MAX;

/// vLLM's `MambaManager.find_longest_cache_hit` without fine-grained hashing: the rightmost
/// block (below `max_length`) cached in every group of `group_ids` whose end is a multiple of
/// `alignment_tokens`; `out[k] = [null] * i + [block]`.
pub fn find_longest_cache_hit(q: &HitQuery<'_>, out: &mut [Vec<BlockId>]) -> u32 {
    let HitQuery { pool, view, max_length, group_ids, block_size, alignment_tokens, .. } = *q;
    if alignment_tokens < block_size && block_size % alignment_tokens == 0 {
        // Partial hash hits: the rightmost cached hash boundary, inside its block or not.
        let scale = block_size / alignment_tokens;
        let max_units = (max_length / alignment_tokens).min(view.hashes.len() as u32);
        let mut hit = Vec::with_capacity(group_ids.len());
        for fine in (0..max_units).rev() {
            if !pool.get_cached_block(&view.hashes[fine as usize], group_ids, &mut hit) {
                continue;
            }
            let i = (fine / scale) as usize;
            for (o, &b) in out.iter_mut().zip(hit.iter()) {
                o.extend(std::iter::repeat_n(NULL_BLOCK, i));
                o.push(b);
            }
            return (fine + 1) * alignment_tokens;
        }
        return 0;
    }
    let max_num_blocks = (max_length / block_size).min(view.len());
    let mut hit = Vec::with_capacity(group_ids.len());
    for i in (0..max_num_blocks).rev() {
        if !pool.get_cached_block(&view.get(i), group_ids, &mut hit) {
            continue;
        }
        if block_size != alignment_tokens && ((i as u64 + 1) * block_size as u64) % alignment_tokens as u64 != 0 {
            continue;
        }
        for (o, &b) in out.iter_mut().zip(hit.iter()) {
            o.extend(std::iter::repeat_n(NULL_BLOCK, i as usize));
            o.push(b);
        }
        return (i + 1) * block_size;
    }
    0
}

/// vLLM's `get_mamba_prefill_checkpoint_position`: the last multiple of `block` at most
/// `num_tokens - max(1, lookahead)` (0 when there is none). `lookahead` is vLLM 0.33's
/// `num_hash_lookahead_tokens` (the checkpoint's hash covers that many tokens past it); 0.32
/// has none. With EAGLE's block drop (`drop_eagle`, vLLM's `drop_eagle_checkpoint_block`)
/// it is one `block` below the last multiple of `block` at most `num_tokens` (the drop
/// already leaves tokens to recompute), 0 at least.
#[inline]
pub fn prefill_checkpoint_position(num_tokens: u32, block: u32, lookahead: u32, drop_eagle: bool) -> u32 {
    if drop_eagle {
        return (num_tokens / block * block).saturating_sub(block);
    }
    match num_tokens.checked_sub(lookahead.max(1)) {
        Some(limit) => limit / block * block,
        None => 0,
    }
}

/// The prompt boundary `cache_blocks` to `num_tokens` records (`AlignState::prompt_boundary`):
/// 0 once the prompt is computed, else its prefill checkpoint position (at least 1 under
/// vLLM's shared-prefix checkpoint, [`Sizes::junction`], so the no-op limits tell a prompt
/// still being computed, which may key its junction, from a computed one).
#[inline]
fn prompt_boundary_for(num_tokens: u32, num_prompt_tokens: u32, s: &Sizes) -> u32 {
    if num_tokens >= num_prompt_tokens {
        0
    } else {
        s.checkpoint_position(num_prompt_tokens, s.hash_block_size).max(s.junction as u32)
    }
}

/// vLLM's `MambaManager.reachable_block_mask` (sparse state retention): `None` caches every
/// block; otherwise only segment-boundary states (every `retention_interval` tokens) and the
/// states ending on a reachable boundary are kept.
pub fn reachable_block_mask(
    start_block: u32,
    end_block: u32,
    alignment_tokens: u32,
    block_size: u32,
    retention_interval: Option<u32>,
    reachable_boundaries: &[u32],
) -> Option<Vec<bool>> {
    let r = retention_interval?;
    let mut mask = vec![false; (end_block - start_block) as usize];
    if r != 0 {
        let per_segment = r / block_size;
        if per_segment <= 1 {
            return None;
        }
        let first_boundary = (start_block + per_segment) / per_segment * per_segment - 1;
        let mut i = (first_boundary - start_block) as usize;
        while i < mask.len() {
            mask[i] = true;
            i += per_segment as usize;
        }
    }
    for &b in reachable_boundaries {
        let aligned = b / alignment_tokens * alignment_tokens;
        let Some(boundary_block) = (aligned / block_size).checked_sub(1) else { continue };
        if start_block <= boundary_block && boundary_block < end_block {
            mask[(boundary_block - start_block) as usize] = true;
        }
    }
    Some(mask)
}

/// vLLM's `is_mamba_prefill_checkpoint_valid`: whether a step computing tokens
/// `query_start..query_end` can export the state at `checkpoint_position` into a block of its
/// own (the backend writes it at a column past the one the step's initial state comes from,
/// strictly inside the chunk, at least one hash block in, `alignment` tokens apart from the
/// chunk start). Signed, as vLLM's integers (`query_start - 1` is -1 for a fresh prefill).
pub fn prefill_checkpoint_valid(
    query_start: i64,
    query_end: i64,
    checkpoint_position: i64,
    hash_block_size: i64,
    block_size: i64,
    alignment: i64,
) -> bool {
    let initial_state_col = (query_start - 1).div_euclid(block_size);
    let checkpoint_col = (query_end + block_size - 1).div_euclid(block_size) - 2;
    query_start % hash_block_size == 0
        && checkpoint_col > initial_state_col
        && query_start + hash_block_size <= checkpoint_position
        && query_start < checkpoint_position
        && checkpoint_position < query_end
        && (checkpoint_position - query_start) % alignment == 0
}

/// Tokens whose state is no longer needed after `num_computed_tokens` tokens: all but the
/// last (`num_computed_tokens - 1`, 0 for none computed).
#[inline]
pub fn num_skipped_tokens(num_computed_tokens: u32) -> u32 {
    num_computed_tokens.saturating_sub(1)
}

/// The token slots mode `"none"` sizes the table for: `num_tokens` plus one block of
/// slots per speculative state block (vLLM adds `block_size * num_speculative_blocks` to
/// `num_tokens` in both `get_num_blocks_to_allocate` and `allocate_new_blocks`).
#[inline]
pub fn none_mode_tokens(num_tokens: u32, block_size: u32, speculative_blocks: u32) -> u64 {
    num_tokens as u64 + block_size as u64 * speculative_blocks as u64
}

/// `(slots, processed)` no-op limits of a mode-`"none"` table of `table_len` blocks whose
/// first `null_prefix` blocks are null: a plain step needing at most `slots` token slots
/// allocates nothing, and one whose processed tokens stay below `processed` frees nothing
/// (block `null_prefix` is freed once `(processed - 1) / block_size > null_prefix`).
#[inline]
pub fn none_mode_noop_limits(table_len: u32, null_prefix: u32, block_size: u32, speculative_blocks: u32) -> (u64, u64) {
    let bs = block_size as u64;
    let slots = (table_len as u64).saturating_sub(speculative_blocks as u64) * bs;
    let processed = (null_prefix as u64 + 1) * bs + 1;
    (slots, processed)
}

/// Mamba "align"'s per-request state, by slot, and the keys cached this step (vLLM's
/// `MambaManager` attributes of the same meaning), with align's operations: each works on
/// one request's share of the manager's bookkeeping ([`AlignReq`], [`AlignView`]), borrowed
/// apart from this state by the manager (`SingleTypeManager::align_req`).
#[derive(Clone, Debug, Default)]
pub struct AlignState {
    /// The group's rules (its parameters).
    rules: MambaAlign,
    /// `last_state[h]`: the table index of the state block of the request's previous step
    /// (`NONE` when absent).
    last_state: Vec<u32>,
    /// `retired[h]`: table slots below which every block was already recycled
    /// (`_num_retired_blocks`, 0 when absent).
    retired: Vec<u32>,
    /// Whether `h` got blocks since it was admitted (`_allocated_block_reqs`).
    allocated: Vec<bool>,
    /// `prompt_boundary[h]`: the request's prefill checkpoint position as last seen (`NONE`
    /// until known; 0 once the prompt is computed); only the no-op limits read it.
    prompt_boundary: Vec<u32>,
    /// With prefill checkpoint blocks only: `checkpoint[h] = (position, table index)` of the
    /// checkpoint the request's last allocation reserved (`_checkpoints`; position 0 when
    /// none). Set by every allocation's count (not the admission gate's), kept until the
    /// next one: `cache_blocks` keys that block at that position.
    checkpoint: Vec<(u32, u32)>,
    /// Keys cached during the current scheduler step (`cached_blocks_this_step`); a hit
    /// ending on one of them waits a step.
    cached_this_step: rustc_hash::FxHashSet<HashKey>,
    /// The boundary states keyed for a KV connector, not yet taken (see [`super::boundary`]).
    pub(super) offloads: super::boundary::BoundaryOffloads,
    /// `producer[h] = (block, tokens, request)`: the partial tail (a key ending inside its
    /// block) the request keyed on its own running state block, which the next step's forward
    /// overwrites (vLLM's `_producer_partial_tail_reqs`); `tokens` 0: none. The copy-on-write
    /// that preserves it hands the copy to a KV connector.
    producer: Vec<(BlockId, u32, crate::ids::ReqHandle)>,
}

/// The sizes of an align group its operations read (copied from the manager).
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizes {
    /// Tokens per block.
    block_size: u32,
    /// Tokens per block hash.
    hash_block_size: u32,
    /// Tokens past each block its hash covers.
    lookahead: u32,
    /// EAGLE's block drop moves the prefill checkpoint positions one block back
    /// (vLLM's `drop_eagle_checkpoint_block`, see [`prefill_checkpoint_position`]).
    drop_eagle: bool,
    /// Alignment of cache hits in tokens.
    alignment: u32,
    /// The group.
    group: GroupId,
    /// vLLM's `shared_prefix_checkpoint` ([`crate::Config::shared_prefix_checkpoint`]): the
    /// prompt chunk that computes the request's junction keys the state there.
    junction: bool,
}

impl Sizes {
    /// The group's prefill checkpoint position for `num_tokens` at `block` granularity
    /// ([`prefill_checkpoint_position`] with its lookahead and EAGLE rule).
    #[inline]
    fn checkpoint_position(&self, num_tokens: u32, block: u32) -> u32 {
        prefill_checkpoint_position(num_tokens, block, self.lookahead, self.drop_eagle)
    }
}

/// One request's share of an align manager's shared bookkeeping, read-only (see
/// [`AlignState`]).
#[derive(Clone, Copy)]
pub(super) struct AlignView<'a> {
    /// The request's slot.
    h: Slot,
    /// Its block table.
    table: &'a [BlockId],
    /// Its `num_cached_block` (0 when absent).
    num_cached: u32,
    /// Its pending partial hit.
    partial: Option<(u32, BlockId)>,
    /// The group's sizes.
    sizes: Sizes,
}

/// One request's share of an align manager's shared bookkeeping, to change (see
/// [`AlignState`]).
pub(super) struct AlignReq<'a> {
    /// The request's slot.
    h: Slot,
    /// Its block table.
    table: &'a mut Vec<BlockId>,
    /// Its `num_cached_block` entry (`ABSENT` when absent).
    num_cached: &'a mut u32,
    /// Its pending partial hit entry.
    partial_hit: &'a mut (u32, BlockId),
    /// The manager's queued copy-on-write copies.
    pending_cow: &'a mut Vec<(BlockId, BlockId)>,
    /// The manager's scratch for freed blocks.
    scratch: &'a mut Vec<BlockId>,
    /// The group's hit-aware state (its hooks).
    retention: &'a mut GroupRetention,
    /// The group's sizes.
    sizes: Sizes,
}

impl AlignReq<'_> {
    /// `num_cached_block` of the request (0 when absent).
    fn num_cached(&self) -> u32 {
        if *self.num_cached == super::ABSENT {
            0
        } else {
            *self.num_cached
        }
    }

    /// The request's pending partial hit, if any.
    fn partial(&self) -> Option<(u32, BlockId)> {
        (self.partial_hit.0 != super::NO_PARTIAL).then_some(*self.partial_hit)
    }

    /// The read-only view.
    fn view(&self) -> AlignView<'_> {
        AlignView {
            h: self.h,
            table: self.table,
            num_cached: self.num_cached(),
            partial: self.partial(),
            sizes: self.sizes,
        }
    }
}

impl SingleTypeManager {
    /// The sizes of this group its align operations read.
    fn align_sizes(&self) -> Sizes {
        Sizes {
            block_size: self.spec.block_size,
            hash_block_size: self.hash_block_size,
            lookahead: self.hash_lookahead_tokens,
            drop_eagle: self.eagle_checkpoints,
            alignment: self.cache_hit_alignment_tokens,
            group: self.group_id,
            junction: self.shared_prefix_checkpoint,
        }
    }

    /// Request `h`'s align state and its share of the bookkeeping, borrowed apart. `None`
    /// for a group without align state: only another kind's (`new_state` gives an align
    /// group its state at construction, and a manager's kind never changes).
    fn align_req(&mut self, h: Slot) -> Option<(&mut AlignState, AlignReq<'_>)> {
        if !matches!(self.kind_state, KindState::MambaAlign(_)) {
            return None; // another kind's group pays this test only
        }
        let sizes = self.align_sizes();
        let hs = h as usize;
        let Self {
            kind_state: KindState::MambaAlign(st),
            req_blocks,
            num_cached,
            partial_hit,
            pending_cow,
            scratch,
            retention,
            ..
        } = self
        else {
            return None;
        };
        let req = AlignReq {
            h,
            table: &mut req_blocks[hs],
            num_cached: &mut num_cached[hs],
            partial_hit: &mut partial_hit[hs],
            pending_cow,
            scratch,
            retention,
            sizes,
        };
        Some((st, req))
    }

    /// [`Self::align_req`], read-only.
    fn align_view(&self, h: Slot) -> Option<(&AlignState, AlignView<'_>)> {
        let KindState::MambaAlign(st) = &self.kind_state else { return None };
        let view = AlignView {
            h,
            table: &self.req_blocks[h as usize],
            num_cached: self.num_cached(h),
            partial: self.partial_hit(h),
            sizes: self.align_sizes(),
        };
        Some((st, view))
    }

    /// Whether `cache_blocks` to `num_tokens` (the cache target) of a `num_prompt_tokens`
    /// prompt leaves the align state's prompt boundary (what the no-op limits read) as it is;
    /// true for a group without align state. O(1).
    pub(crate) fn keeps_prompt_boundary(&self, h: Slot, num_tokens: u32, num_prompt_tokens: u32) -> bool {
        let KindState::MambaAlign(st) = &self.kind_state else { return true };
        let b = prompt_boundary_for(num_tokens, num_prompt_tokens, &self.align_sizes());
        st.prompt_boundary[h as usize] == b
    }

    /// vLLM's `MambaManager.finalize_partial_tail_offload` when `h` finishes (see
    /// [`AlignState::finalize_partial_tail_offload`]); a no-op (`None`) for other groups,
    /// as vLLM's base method.
    ///
    /// # Complexity
    /// O(1).
    pub(crate) fn finalize_partial_tail_offload(
        &mut self,
        h: Slot,
        num_computed: i64,
        num_in_flight: i64,
    ) -> Option<(BlockId, u32)> {
        match &mut self.kind_state {
            KindState::MambaAlign(st) => st.finalize_partial_tail_offload(h, num_computed, num_in_flight),
            _ => None,
        }
    }
}

impl AlignState {
    /// The state of an align group with these rules, no request yet.
    fn new(rules: MambaAlign) -> Self {
        Self { rules, ..Self::default() }
    }

    /// Makes room for `n` slots.
    pub(super) fn ensure_slot(&mut self, n: usize) {
        self.last_state.resize(n, NONE);
        self.retired.resize(n, 0);
        self.allocated.resize(n, false);
        self.prompt_boundary.resize(n, NONE);
        self.checkpoint.resize(n, (0, 0));
        self.producer.resize(n, (NULL_BLOCK, 0, 0));
    }

    /// Forgets slot `h`.
    pub(super) fn clear(&mut self, h: Slot) {
        let hs = h as usize;
        self.last_state[hs] = NONE;
        self.retired[hs] = 0;
        self.allocated[hs] = false;
        self.prompt_boundary[hs] = NONE;
        self.checkpoint[hs] = (0, 0);
        self.offloads.drop_slot(h);
        self.producer[hs] = (NULL_BLOCK, 0, 0);
    }

    /// A new scheduler step: hits on states cached in the previous step are served.
    pub(super) fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }

    /// vLLM's `MambaManager.finalize_partial_tail_offload` when `h` finishes: pops the
    /// producer tail `h` keyed on its running state block (none once a copy-on-write took it
    /// over), and returns `(block, tokens)` only when no token past it was forwarded
    /// (`num_in_flight` 0 and `num_computed` equal to the tail's tokens). O(1).
    fn finalize_partial_tail_offload(
        &mut self,
        h: Slot,
        num_computed: i64,
        num_in_flight: i64,
    ) -> Option<(BlockId, u32)> {
        let slot = self.producer.get_mut(h as usize)?;
        let (block, tokens, _) = std::mem::replace(slot, (NULL_BLOCK, 0, 0));
        (tokens > 0 && num_in_flight == 0 && num_computed == tokens as i64).then_some((block, tokens))
    }

    /// Whether a hit ending on `new_computed`'s last block waits a step (its state was
    /// cached during this step: vLLM answers `num_gpu_blocks + 1`).
    fn defers(&self, pool: &BlockPool, new_computed: &[BlockId]) -> bool {
        let cached = &self.cached_this_step;
        new_computed.last().and_then(|&b| pool.block_hash(b)).is_some_and(|key| cached.contains(key))
    }

    /// The prefill checkpoint a step computing tokens `query_start..query_end` reserves a
    /// block for (vLLM's `get_mamba_prefill_checkpoint_position` of the chunk end, kept when
    /// `_needs_internal_checkpoint`): its position, 0 for none. `prefill_end` is 0 except
    /// under retention interval 0, where only the chunk reaching it reserves one.
    fn checkpoint_at(&self, v: &AlignView<'_>, query_start: u32, query_end: u32, prefill_end: u32) -> u32 {
        let (spec, alignment) = (self.rules.speculative_blocks, self.rules.checkpoint_alignment);
        if alignment == 0 || query_end < prefill_end {
            return 0;
        }
        let Sizes { block_size, hash_block_size, alignment: hit_alignment, .. } = v.sizes;
        let pos = v.sizes.checkpoint_position(query_end, hit_alignment);
        let bs = block_size as i64;
        if !prefill_checkpoint_valid(
            query_start as i64,
            query_end as i64,
            pos as i64,
            hash_block_size as i64,
            bs,
            alignment as i64,
        ) {
            return 0;
        }
        let idx = (query_end as i64 + bs - 1) / bs - 2;
        if idx < 0 {
            return 0;
        }
        let table = v.table;
        let len = table.len() as i64;
        let free_slot = idx >= len
            || table[idx as usize] == NULL_BLOCK
            || (self.allocated[v.h as usize] && idx >= len - spec as i64);
        if free_slot {
            pos
        } else {
            0
        }
    }

    /// With prefill checkpoint blocks: records the checkpoint of this allocation's count, as
    /// vLLM's `get_num_blocks_to_allocate` does outside the admission gate (a count that
    /// defers a hit records nothing).
    pub(super) fn record_checkpoint(
        &mut self,
        pool: &BlockPool,
        v: &AlignView<'_>,
        new_computed: &[BlockId],
        query_start: u32,
        query_end: u32,
        prefill_end: u32,
    ) {
        if self.rules.checkpoint_alignment == 0 || self.defers(pool, new_computed) {
            return;
        }
        let pos = self.checkpoint_at(v, query_start, query_end, prefill_end);
        let bs = v.sizes.block_size as u64;
        self.checkpoint[v.h as usize] = if pos > 0 { (pos, (cdiv(query_end as u64, bs) - 2) as u32) } else { (0, 0) };
    }

    /// The no-op limits of a plain step in mode "align" (see
    /// [`SingleTypeManager::noop_limits`]).
    fn noop_limits(&self, v: &AlignView<'_>) -> (u32, u32, u32, u32) {
        let bs = v.sizes.block_size as u64;
        let (spec, alignment) = (self.rules.speculative_blocks, self.rules.checkpoint_alignment);
        // No allocation while the main tokens fit the table before its speculative blocks
        // (lookahead slots are not allocated in align mode, so `slots` is conservative);
        // nothing freed below the retired range's next block nor before the previous state
        // block falls out; no new full block, and not the prompt's checkpoint position
        // (re-keyed there).
        let hs = v.h as usize;
        let len = v.table.len() as u64;
        let slots = clamp(len.saturating_sub(spec as u64) * bs);
        let mut processed = (self.retired[hs] as u64 + 1) * bs + 1;
        let ls = self.last_state[hs];
        if ls != NONE && v.table[ls as usize] != NULL_BLOCK {
            processed = processed.min((ls as u64 + 1) * bs + 1);
        }
        let mut cached = (v.num_cached as u64 + 1) * bs;
        let pb = self.prompt_boundary[hs];
        if pb == NONE || (pb != 0 && v.sizes.junction) {
            // Under vLLM's shared-prefix checkpoint a step of a prompt not yet computed may
            // end at its junction (`shared_prefix_boundary`, which the limits do not read),
            // keyed then: no such step is proved a no-op.
            cached = 0;
        } else if pb != 0 && (pb as u64) < cached {
            cached = pb as u64;
        }
        let (processed, cached) = (clamp(processed), clamp(cached));
        if alignment == 0 {
            return (slots, processed, cached, u32::MAX);
        }
        // Prefill checkpoints: a step reserves one only when it spans more than one block
        // past the block its first token's state comes from (`prefill_checkpoint_valid`), so
        // a step of at most one block never does; and a stored checkpoint is dropped (or
        // renewed) by the next allocation's count, which the no-op answer would skip.
        let slots = if self.checkpoint[hs].0 > 0 || v.partial.is_some() { 0 } else { slots };
        (slots, processed, cached, v.sizes.block_size)
    }

    /// The blocks to take (vLLM's align branch of `MambaManager.get_num_blocks_to_allocate`):
    /// the running state block, a prefill checkpoint block when the chunk reserves one, a
    /// copy-on-write copy for a partial hit (`partial_local_hit`: the local hit ends inside a
    /// block), and the speculative blocks of a first allocation. May be negative (an
    /// over-allocated table), as in vLLM; `num_blocks + 1` defers a hit on a state cached
    /// this step. `c.total_computed_tokens` is where the step's query starts.
    fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        v: &AlignView<'_>,
        c: &CountArgs<'_>,
        partial_local_hit: bool,
    ) -> i64 {
        if self.defers(pool, c.new_computed) {
            return pool.num_blocks() as i64 + 1;
        }
        let spec = self.rules.speculative_blocks as i64;
        let required = cdiv(c.num_tokens_main_model as u64, v.sizes.block_size as u64) as i64 + spec;
        let mut num_new = required - c.new_computed.len() as i64 - v.table.len() as i64;
        let partial = (partial_local_hit || v.partial.is_some()) as i64;
        if partial == 1 {
            num_new = num_new.max(0) + 1;
        }
        if num_new > 0 {
            let checkpoint =
                (self.checkpoint_at(v, c.total_computed_tokens, c.num_tokens_main_model, c.prefill_end) > 0) as i64;
            let cap = 1 + partial + checkpoint + if self.allocated[v.h as usize] { 0 } else { spec };
            num_new = num_new.min(cap);
        }
        num_new + SingleTypeManager::count_evictable(pool, c.new_computed) as i64
    }

    /// vLLM's align branch of `MambaManager.allocate_new_blocks`: the table is padded with
    /// null blocks up to the new running state block (up to the checkpoint block when the
    /// count reserved one, which is allocated then), the speculative scratch blocks this
    /// step leaves behind move to the table's end, a pending partial hit is copied on write,
    /// and the padding, the moved blocks and the new blocks are the "new blocks" reported.
    fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        q: &mut AlignReq<'_>,
        num_tokens_main_model: u32,
        out: &mut Vec<BlockId>,
    ) {
        let hs = q.h as usize;
        let spec = self.rules.speculative_blocks as usize;
        let required = cdiv(num_tokens_main_model as u64, q.sizes.block_size as u64) as usize + spec;
        let partial = q.partial();
        let checkpoint = (self.checkpoint[hs].0 > 0) as usize;
        let table = &mut *q.table;
        if required <= table.len() && checkpoint == 0 && partial.is_none() {
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
        let n = required.saturating_sub(table.len()) + partial.is_some() as usize;
        let mut new_blocks = Vec::with_capacity(n);
        pool.get_new_blocks(n as u32, &mut new_blocks);
        let mut fresh = &new_blocks[..];
        if let Some((idx, source)) = partial {
            let cow = fresh[0];
            fresh = &fresh[1..];
            if was_allocated {
                // A running request's table is append-only for the worker: it stays on
                // `source` (its state moves on there) and the cache entry moves to the copy,
                // which this step's copy fills before the forward overwrites `source`.
                debug_assert_eq!(table[idx as usize], source);
                pool.move_block_hashes(source, cow);
                q.retention.state_moved(q.h, source, cow);
                q.pending_cow.push((source, cow));
                pool.incref(source);
                // The copy's one reference is held by no table: the scheduler gives it back.
                pool.loosen(&[cow]);
                let (pb, tokens, req) = std::mem::replace(&mut self.producer[hs], (NULL_BLOCK, 0, 0));
                if tokens > 0 {
                    debug_assert_eq!(pb, source);
                    self.offloads.record(req, cow, tokens);
                }
                if let Some(key) = pool.block_hash(cow) {
                    self.cached_this_step.insert(*key);
                }
                out.extend_from_slice(&table[prev..]);
            } else {
                table[idx as usize] = cow;
                q.pending_cow.push((source, cow));
                pool.loosen(&[source]);
                pool.incref(cow);
                out.push(cow);
                out.extend_from_slice(&table[prev..]);
            }
        } else {
            out.extend_from_slice(&table[prev..]);
        }
        table.extend_from_slice(fresh);
        out.extend_from_slice(fresh);
        self.allocated[hs] = true;
        *q.partial_hit = (super::NO_PARTIAL, NULL_BLOCK);
    }

    /// vLLM's `MambaManager.remove_skipped_blocks` in mode "align" (the retired range, null
    /// gaps skipped, then the previous step's state block once the step after it is processed).
    fn remove_skipped_blocks(&mut self, pool: &mut BlockPool, q: &mut AlignReq<'_>, processed: u32) {
        let hs = q.h as usize;
        let bs = q.sizes.block_size;
        let skipped = num_skipped_tokens(processed);
        if skipped > 0 {
            let last = ((skipped / bs) as usize).min(q.table.len());
            let first = self.retired[hs] as usize;
            if first < last {
                q.retention.states_passed(pool, q.h, &q.table[first..last]);
                super::null_out_backwards(q.table, q.scratch, pool, first, last, false);
                self.retired[hs] = last as u32;
            }
        }
        let ls = self.last_state[hs];
        if ls != NONE && (ls as u64) + 1 < cdiv(processed as u64, bs as u64) {
            let b = q.table[ls as usize];
            if b != NULL_BLOCK {
                q.retention.states_passed(pool, q.h, &[b]);
                pool.free_blocks([b]);
                q.table[ls as usize] = NULL_BLOCK;
            }
        }
    }

    /// What `cache_blocks` does in mode "align" after caching the full blocks (`before` of
    /// them were cached before): the no-op limits' prompt boundary, the checkpoint or
    /// prompt-tail state block, and the keys cached this step.
    fn cache_blocks(&mut self, pool: &mut BlockPool, q: &mut AlignReq<'_>, c: &CacheArgs<'_>, before: u32) {
        let hs = q.h as usize;
        // Read before the prompt tail: a partial tail moves `num_cached` back to its block.
        let after = q.num_cached();
        // Once the prompt is computed, the tokens to cache never come back down to its
        // checkpoint position (below the prompt's end), so the no-op limits stop watching it
        // (0: no position to watch).
        self.prompt_boundary[hs] = prompt_boundary_for(c.num_tokens, c.num_prompt_tokens, &q.sizes);
        if self.checkpoint[hs].0 > 0 {
            self.cache_checkpoint(pool, q, c);
        } else {
            self.cache_prompt_tail(pool, q, c);
        }
        for i in before..after {
            let b = q.table[i as usize];
            if b != NULL_BLOCK {
                if let Some(key) = pool.block_hash(b) {
                    self.cached_this_step.insert(*key);
                    self.offloads.record(c.req, b, pool.block_hash_num_tokens(b));
                }
            }
        }
        q.retention.states_keyed(pool, q.sizes.group, q.h, q.table);
    }

    /// vLLM's `_cache_partial_tail_block` when the Mamba block is the hash block: at the
    /// prompt's checkpoint position the state block ending there is keyed (again, if an
    /// eviction dropped its key) and counted as cached this step. The rules'
    /// `rekey_cached_tail` is vLLM 0.32's rule (a block already keyed there is counted
    /// again); 0.33 skips such a block.
    fn cache_prompt_tail(&mut self, pool: &mut BlockPool, q: &mut AlignReq<'_>, c: &CacheArgs<'_>) {
        let (req, hashes, num_tokens) = (c.req, c.hashes, c.num_tokens);
        let Sizes { block_size: bs, hash_block_size, group, .. } = q.sizes;
        if num_tokens == 0 || num_tokens % hash_block_size != 0 {
            return;
        }
        // vLLM's shared-prefix checkpoint: also the junction the scheduler stopped at, when
        // this prompt chunk computed it (hit-aware keys it whenever it is reached).
        let junction = (q.sizes.junction
            && num_tokens == c.shared_prefix_boundary
            && c.request_computed_tokens < num_tokens
            && num_tokens <= c.num_prompt_tokens)
            || GroupRetention::keys_junction_state(pool, bs, hash_block_size, num_tokens, c);
        if num_tokens != q.sizes.checkpoint_position(c.num_prompt_tokens, hash_block_size) && !junction {
            return;
        }
        let idx = (num_tokens.div_ceil(bs) - 1) as usize;
        let Some(&b) = q.table.get(idx) else { return };
        if b == NULL_BLOCK {
            return;
        }
        let nh = (num_tokens / hash_block_size) as usize;
        if nh > hashes.len() {
            return;
        }
        let key = (hashes[nh - 1], group);
        let tokens = pool.block_hash_num_tokens(b);
        if !self.rules.rekey_cached_tail && pool.block_hash(b).is_some() && tokens == num_tokens {
            return;
        }
        let one = OneBlock {
            req,
            block: b,
            index: nh as u32 - 1,
            key,
            num_tokens,
            block_size: hash_block_size,
            parent: if nh > 1 { Some(hashes[nh - 2]) } else { None },
        };
        // vLLM's `cache_partial_block`: a key for fewer tokens is replaced, one for more
        // (a rewritten hash list) keeps this one as a second key; `None` for the null block.
        let Some(key) = pool.cache_partial_block(&one, false) else { return };
        if num_tokens % bs != 0 {
            // A partial tail on the running state block, which the next forward overwrites:
            // the next allocation copies it on write and moves the key to the copy.
            *q.partial_hit = (idx as u32, b);
            *q.num_cached = idx as u32;
            self.producer[q.h as usize] = (b, num_tokens, req);
        }
        self.cached_this_step.insert(key);
    }

    /// The checkpoint branch of vLLM's `_cache_partial_tail_block`. The block reserved at the
    /// checkpoint index is keyed at the checkpoint position (replacing any key it holds) when
    /// that state is reusable: the prompt's checkpoint, a retained boundary (every one under
    /// dense retention) or the shared-prefix junction. Otherwise the state is transient and
    /// any key the block got this step is dropped. The scheduler block size is the Mamba
    /// block size here (the config requires it), so the position is a block boundary; it ends
    /// the reserved block unless lookahead hashes over several tokens moved it a block back
    /// (a chunk ending less than the lookahead past a boundary): the block is keyed there all
    /// the same, as vLLM keys it, replacing the full-block key this step's caching gave it.
    fn cache_checkpoint(&mut self, pool: &mut BlockPool, q: &mut AlignReq<'_>, c: &CacheArgs<'_>) {
        let (pos, idx) = self.checkpoint[q.h as usize];
        // vLLM asserts the index is in the table; a count whose allocation then failed can
        // leave it past the table until the next allocation: nothing to key then.
        let Some(&b) = q.table.get(idx as usize) else { return };
        let Sizes { block_size: bs, hash_block_size, alignment: align, group, .. } = q.sizes;
        let is_prompt_checkpoint = pos == q.sizes.checkpoint_position(c.num_prompt_tokens, align);
        let mut retained = false;
        if pos % bs == 0 {
            let i = pos / bs - 1;
            retained = reachable_block_mask(i, i + 1, align, bs, c.retention_interval, &[]).is_none_or(|m| m[0]);
        }
        if !is_prompt_checkpoint && !retained && pos != c.shared_prefix_boundary {
            // vLLM's `_maybe_evict_cached_block`, on whatever block sits there (the metrics
            // collector hears of it; the null block holds no hash to drop).
            pool.maybe_evict_cached_block(b);
            return;
        }
        if b == NULL_BLOCK || (pool.block_hash(b).is_some() && pool.block_hash_num_tokens(b) == pos) {
            return;
        }
        let hashes = c.hashes;
        let nh = (pos / hash_block_size) as usize;
        if nh == 0 || nh > hashes.len() {
            // vLLM asserts the request has the hashes (the scheduler's requests do).
            return;
        }
        let key = (hashes[nh - 1], group);
        // `cache_partial_block(replace_existing_hashes=True)`: the metrics collector hears nothing.
        pool.remove_cached_block_hashes(b);
        let parent = if nh > 1 { Some(hashes[nh - 2]) } else { None };
        let o = OneBlock {
            req: c.req,
            block: b,
            index: nh as u32 - 1,
            key,
            num_tokens: pos,
            block_size: hash_block_size,
            parent,
        };
        pool.cache_one_block(&o);
        self.cached_this_step.insert(key);
    }
}

impl SingleTypeManager {
    /// With prefill checkpoint blocks: records the checkpoint of this allocation's count
    /// (see [`AlignState::record_checkpoint`]). Nothing for other kinds.
    pub(crate) fn record_checkpoint(
        &mut self,
        pool: &BlockPool,
        h: Slot,
        new_computed: &[BlockId],
        query_start: u32,
        query_end: u32,
        prefill_end: u32,
    ) {
        if let Some((st, q)) = self.align_req(h) {
            st.record_checkpoint(pool, &q.view(), new_computed, query_start, query_end, prefill_end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_checkpoint_position_leaves_one_token() {
        assert_eq!(prefill_checkpoint_position(0, 16, 0, false), 0);
        assert_eq!(prefill_checkpoint_position(16, 16, 0, false), 0);
        assert_eq!(prefill_checkpoint_position(17, 16, 0, false), 16);
        assert_eq!(prefill_checkpoint_position(33, 16, 1, false), 32);
        // Lookahead hashes: the hash at the checkpoint covers `lookahead` more tokens.
        assert_eq!(prefill_checkpoint_position(33, 16, 2, false), 16);
        assert_eq!(prefill_checkpoint_position(34, 16, 2, false), 32);
        assert_eq!(prefill_checkpoint_position(1, 16, 3, false), 0);
    }

    #[test]
    fn prefill_checkpoint_position_with_eagle_drop_is_one_block_back() {
        // vLLM: the proof limit is `num_tokens` (the drop leaves tokens to recompute),
        // floored to the block, then one block less, 0 at least; the lookahead is not read.
        assert_eq!(prefill_checkpoint_position(33, 16, 0, true), 16);
        assert_eq!(prefill_checkpoint_position(32, 16, 0, true), 16);
        assert_eq!(prefill_checkpoint_position(31, 16, 0, true), 0);
        assert_eq!(prefill_checkpoint_position(15, 16, 0, true), 0);
        assert_eq!(prefill_checkpoint_position(64, 16, 3, true), 48);
    }

    #[test]
    fn reachable_block_mask_keeps_segment_ends_and_boundaries() {
        assert_eq!(reachable_block_mask(0, 4, 16, 16, None, &[]), None);
        // Interval 0: only the block ending on the replay boundary (49 -> 48 -> block 2).
        assert_eq!(reachable_block_mask(0, 4, 16, 16, Some(0), &[49]), Some(vec![false, false, true, false]));
        // Interval 32 (two blocks): blocks 1, 3, ...
        assert_eq!(reachable_block_mask(0, 5, 16, 16, Some(32), &[]), Some(vec![false, true, false, true, false]));
        assert_eq!(reachable_block_mask(0, 4, 16, 16, Some(16), &[]), None);
        // A boundary below one block reaches nothing.
        assert_eq!(reachable_block_mask(0, 2, 16, 16, Some(0), &[5]), Some(vec![false, false]));
    }

    #[test]
    fn prefill_checkpoint_valid_needs_a_column_past_the_initial_state() {
        // A fresh prefill of 40 tokens (block 16): checkpoint 32 in column 1, initial -1.
        assert!(prefill_checkpoint_valid(0, 40, 32, 16, 16, 1));
        // 17 tokens: checkpoint 16 in column 0, still past the initial -1.
        assert!(prefill_checkpoint_valid(0, 17, 16, 16, 16, 1));
        // One block or less never reserves one.
        assert!(!prefill_checkpoint_valid(0, 16, 0, 16, 16, 1));
        assert!(!prefill_checkpoint_valid(16, 32, 16, 16, 16, 1));
        // A chunk starting mid-block, or an alignment the distance misses.
        assert!(!prefill_checkpoint_valid(8, 60, 48, 16, 16, 1));
        assert!(!prefill_checkpoint_valid(16, 60, 48, 16, 16, 64));
        assert!(prefill_checkpoint_valid(16, 60, 48, 16, 16, 32));
    }

    #[test]
    fn num_skipped_tokens_keeps_the_last_state() {
        assert_eq!(num_skipped_tokens(0), 0);
        assert_eq!(num_skipped_tokens(1), 0);
        assert_eq!(num_skipped_tokens(17), 16);
    }

    #[test]
    fn none_mode_tokens_adds_one_block_per_speculative_state() {
        assert_eq!(none_mode_tokens(5, 16, 0), 5);
        assert_eq!(none_mode_tokens(5, 16, 2), 37);
        assert_eq!(none_mode_tokens(u32::MAX, u32::MAX, 3), u32::MAX as u64 * 4);
    }

    #[test]
    fn none_mode_noop_limits_freeing_starts_past_the_next_block() {
        // Block 0 is freed when (processed - 1) / 16 > 0, i.e. processed >= 17.
        assert_eq!(none_mode_noop_limits(3, 0, 16, 0), (48, 17));
        assert_eq!(none_mode_noop_limits(3, 0, 16, 2), (16, 17));
        assert_eq!(none_mode_noop_limits(1, 0, 16, 2), (0, 17));
    }
}
