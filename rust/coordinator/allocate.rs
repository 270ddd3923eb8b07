//! Allocation: the capacity count over every group (vLLM's `get_num_blocks_to_allocate`)
//! and `allocate_slots` (checks, then out-of-window frees, the count, adoption of a hit or
//! external tokens, new blocks, caching), which changes nothing when a check fails.
//!
//! Cost: O(groups) for a decode step with no new block, else O(new blocks + freed blocks).
//! Two-level pages' admission headroom is O(1): the requests holding slots are counted as
//! their slot tables fill (here; O(groups) once per request) and empty (`release`).
#![forbid(unsafe_code)]

use super::{page_side, Allocator, CacheBlocksArgs, HashSource};

use crate::error::{Error, Result};
use crate::ids::{BlockId, ReqHandle, Slot};
use crate::manager::CountArgs;

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
    /// Take `num_computed_tokens` as vLLM's manager takes `request.num_computed_tokens`,
    /// unchecked against the tables (the vLLM adapter, which must do what vLLM's manager
    /// does with any `Request`). `false` (the direct API): a count ahead of the token slots
    /// a table was given is refused when the call would cache blocks past them, since they
    /// were never written and caching them under the request's hashes would serve hits on
    /// them.
    pub trust_computed_tokens: bool,
}

/// The arguments of [`Allocator::get_num_blocks_to_allocate`] (vLLM's
/// `coordinator.get_num_blocks_to_allocate` with no new hit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCountArgs {
    /// Token slots the tables must hold.
    pub num_tokens: u32,
    /// Of them, the slots of the target model (usually `num_tokens`).
    pub num_tokens_main_model: u32,
    /// Encoder tokens (cross attention's slots).
    pub num_encoder_tokens: u32,
    /// Tokens computed so far.
    pub total_computed_tokens: u32,
    /// Cap each group at its admission cap (the admission gate).
    pub apply_admission_cap: bool,
    /// Where the request's prefill ends (read under retention interval 0 only).
    pub prefill_end: u32,
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

impl Allocator {
    /// The sum over groups of [`SingleTypeManager::get_num_blocks_to_allocate`] for `c`,
    /// each group counting its own cache-hit blocks of `new_computed` (a cross-attention
    /// group counts `num_encoder_tokens` slots, with no hit); may be negative (a Mamba
    /// "align" group over-allocated in an earlier step), as in vLLM.
    pub(super) fn num_blocks_to_allocate(
        &self,
        s: Slot,
        c: CountArgs<'_>,
        new_computed: &[Vec<BlockId>],
        num_encoder_tokens: u32,
    ) -> i64 {
        if self.state_groups != 0 {
            return self.pages_to_allocate(s, c, new_computed, num_encoder_tokens);
        }
        let mut n = 0i64;
        for (i, m) in self.managers.iter().enumerate() {
            let group = if m.kind().sized_by_encoder_tokens() {
                CountArgs {
                    num_tokens: num_encoder_tokens,
                    num_tokens_main_model: num_encoder_tokens,
                    new_computed: &[],
                    total_computed_tokens: 0,
                    prefill_end: 0,
                    ..c
                }
            } else {
                CountArgs { new_computed: new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]), ..c }
            };
            n += m.get_num_blocks_to_allocate(&self.pool, s, &group);
        }
        n
    }

    /// [`Self::num_blocks_to_allocate`] with two-level pages: the pages the request needs
    /// (`BlockPool::pages_needed`): the state groups' counts, plus the slot groups' new
    /// slots after their hit's free slots are taken. Slot groups are full attention (the
    /// config checks it), so a hit's blocks are all touched when adopted. Out of line, so the
    /// one-pool count stays as it was (inlined into `allocate_slots`).
    #[cold]
    #[inline(never)]
    fn pages_to_allocate(&self, s: Slot, c: CountArgs<'_>, new_computed: &[Vec<BlockId>], _enc: u32) -> i64 {
        let (mut slots, mut pages) = (0i64, 0i64);
        let mut touched: Vec<BlockId> = Vec::new();
        for (i, m) in self.managers.iter().enumerate() {
            let hit = new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            let state = page_side(self.state_groups, m.group_id());
            let pool = self.pool.side_ref(state);
            let n = m.get_num_blocks_to_allocate(pool, s, &CountArgs { new_computed: hit, ..c });
            if state {
                pages += n;
            } else if c.adopting && !m.is_tracked(s) && !hit.is_empty() {
                slots += n - crate::manager::SingleTypeManager::count_evictable(pool, hit) as i64;
                touched.extend_from_slice(hit);
            } else {
                slots += n;
            }
        }
        self.pool.pages_needed(slots, pages, &touched)
    }

    /// Blocks `h` needs from the pool for `c.num_tokens` slots (`c.num_tokens_main_model` of
    /// them for the target model) with no new hit (vLLM's
    /// `coordinator.get_num_blocks_to_allocate`, used by the scheduler directly). Negative
    /// when a Mamba "align" table holds more than it needs, as in vLLM. Without the
    /// admission cap the count records the Mamba prefill checkpoint it reserves, as vLLM's.
    ///
    /// # Errors
    /// Unknown handle.
    pub fn get_num_blocks_to_allocate(&mut self, h: ReqHandle, c: &BlockCountArgs) -> Result<i64> {
        let s = self.slot(h)?;
        let prefill_end = self.effective_prefill_end(c.prefill_end);
        let count = CountArgs {
            num_tokens: c.num_tokens,
            num_tokens_main_model: c.num_tokens_main_model,
            new_computed: &[],
            num_local_computed_tokens: 0,
            total_computed_tokens: c.total_computed_tokens,
            apply_admission_cap: c.apply_admission_cap,
            adopting: true,
            prefill_end,
        };
        let n = self.num_blocks_to_allocate(s, count, &[], c.num_encoder_tokens);
        if !c.apply_admission_cap {
            self.record_checkpoints(s, &[], c.total_computed_tokens, c.num_tokens_main_model, prefill_end);
            self.refresh_noop(s);
        }
        Ok(n)
    }

    /// Two-level pages: the pages kept free when a waiting or preempted request is admitted
    /// while others run ([`crate::Config::admission_headroom_slots`] per request holding
    /// slots, rounded up to pages); 0 without a headroom (every `k == 1` config). O(1): the
    /// requests holding slots are counted as their tables fill and empty
    /// ([`Self::note_slot_holder`], `release`).
    #[inline]
    fn admission_headroom(&self) -> u64 {
        if self.cfg.admission_headroom_slots == 0 {
            0
        } else {
            let k = self.cfg.slots_per_page as u64;
            (self.slot_holders as u64 * self.cfg.admission_headroom_slots as u64).div_ceil(k)
        }
    }

    /// Whether a slot group's table of `s` is non-empty (two-level pages; O(groups)).
    fn holds_slots(&self, s: Slot) -> bool {
        self.managers.iter().any(|m| !page_side(self.state_groups, m.group_id()) && !m.blocks(s).is_empty())
    }

    /// Two-level pages, after `s`'s tables grew: counts `s` among the requests holding slots
    /// once a slot group's table is non-empty. O(1) once counted, else O(groups). Tables
    /// only grow here (`remove_skipped_blocks` nulls entries out, never drops them) and
    /// empty only when the request is released, where it is uncounted.
    fn note_slot_holder(&mut self, s: Slot) {
        if !self.reqs[s as usize].holds_slots && self.holds_slots(s) {
            self.reqs[s as usize].holds_slots = true;
            self.slot_holders += 1;
        }
    }

    /// The count of requests holding slots against a recount over every live request, and
    /// each request's mark against its tables (invariant checks; O(requests x groups)).
    pub(crate) fn check_slot_holders(&self) -> std::result::Result<(), String> {
        let mut n = 0u32;
        for (s, r) in self.reqs.iter().enumerate() {
            let holds = r.generation != 0 && self.state_groups != 0 && self.holds_slots(s as Slot);
            if r.holds_slots != holds {
                return Err(format!("slot {s}: marked holding slots {}, its tables say {holds}", r.holds_slots));
            }
            n += holds as u32;
        }
        if n != self.slot_holders {
            return Err(format!("{n} requests hold slots, counted {}", self.slot_holders));
        }
        Ok(())
    }

    /// vLLM's coordinator passes `prefill_end` on only under retention interval 0 (under
    /// dense or segment retention every chunk publishes a state).
    pub(super) fn effective_prefill_end(&self, prefill_end: u32) -> u32 {
        if self.cfg.retention_interval == Some(0) {
            prefill_end
        } else {
            0
        }
    }

    /// Every Mamba "align" group records the prefill checkpoint of this count.
    pub(super) fn record_checkpoints(
        &mut self,
        s: Slot,
        new_computed: &[Vec<BlockId>],
        query_start: u32,
        query_end: u32,
        prefill_end: u32,
    ) {
        for (i, m) in self.managers.iter_mut().enumerate() {
            let blocks: &[BlockId] = new_computed.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            let pool = self.pool.side_ref(page_side(self.state_groups, m.group_id()));
            m.record_checkpoint(pool, s, blocks, query_start, query_end, prefill_end);
        }
    }

    /// vLLM's `KVCacheManager.allocate_slots`, after bringing the request's hashes up to
    /// `hashes` when given (undone if the call fails). On success the new blocks are in
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
    ///   other than `num_new_computed_tokens / block_size` (shorter only in a group lagging
    ///   behind full attention in a KV connector's per-group hit, adopted with external
    ///   tokens, as vLLM's scheduler adopts it), a block out of range, null
    ///   where the group's layout has no null, used twice, or not cached with the hash this
    ///   request has at that position; a stored hit whose blocks were reused since the
    ///   search is refused the same way);
    /// - [`Error::InvalidState`]: cache-hit blocks with prefix caching off, for a running
    ///   request, or for a request that already holds blocks (computed tokens are adopted
    ///   only into an empty table); unless [`AllocateArgs::trust_computed_tokens`],
    ///   `num_computed_tokens` ahead of the token slots a table was given, when the call
    ///   would cache blocks past them;
    /// - an invalid hash in `hashes`.
    pub fn allocate_slots(
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
                if r.is_some() {
                    self.advance_first_sighting(s, total + a.num_new_tokens as u64, a.shared_prefix_boundary);
                }
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

    pub(super) fn allocate_with(
        &mut self,
        s: Slot,
        a: &AllocateArgs,
        new_computed: NewComputed<'_>,
        stored: Option<&[Vec<BlockId>]>,
    ) -> Result<Option<u32>> {
        let (hit_blocks, explicit): (&[Vec<BlockId>], bool) = match new_computed {
            NewComputed::Empty => (&[], false),
            NewComputed::Stored => (stored.unwrap_or(&[]), false),
            NewComputed::Explicit(v) => (v, true),
        };
        let has_new_computed = hit_blocks.iter().any(|v| !v.is_empty());
        if has_new_computed && !self.cfg.enable_caching {
            return Err(Error::InvalidState("cache-hit blocks given with prefix caching off".into()));
        }
        if hit_blocks.is_empty() {
            if a.num_new_computed_tokens != 0 {
                return Err(Error::OutOfRange(format!(
                    "num_new_computed_tokens={} without cache-hit blocks",
                    a.num_new_computed_tokens
                )));
            }
        } else {
            self.validate_hit(s, hit_blocks, a.num_new_computed_tokens, a.num_external_computed_tokens, explicit)?;
        }
        let num_local = a.num_computed_tokens as u64 + a.num_new_computed_tokens as u64;
        // With partial hash hits the next allocation copies such a block on write.
        let partial = self.partial_hash_hits && a.num_new_computed_tokens > 0;
        for (m, v) in self.managers.iter().zip(hit_blocks) {
            if m.is_mamba_align() && !v.is_empty() && num_local % m.block_size() as u64 != 0 && !partial {
                return Err(Error::OutOfRange(format!(
                    "a Mamba hit ending inside a block ({num_local} computed tokens, block size {}): \
                     a partial hit needs copy-on-write, served only with partial hash hits",
                    m.block_size()
                )));
            }
        }
        let unwritten_from = if a.trust_computed_tokens { None } else { self.check_computed_within_tables(s, a)? };
        let tracked = self.managers.iter().any(|m| m.is_tracked(s));
        if has_new_computed && tracked {
            return Err(Error::InvalidState("a running request cannot adopt new cache-hit blocks".into()));
        }
        // Not tracked yet (nothing cached) but holding blocks: adoption would need an empty
        // table (`add_local_computed_blocks`; vLLM asserts it), so refuse before any change.
        let adopts = has_new_computed || a.num_external_computed_tokens > 0;
        if adopts && !tracked && self.managers.iter().any(|m| !m.blocks(s).is_empty()) {
            return Err(Error::InvalidState("a request that already holds blocks cannot adopt computed tokens".into()));
        }
        let unwritten_before = self.reqs[s as usize].unwritten_from;
        if let Some(from) = unwritten_from {
            // Marked first, so this call's own caching stops there too; undone if it does not fit.
            self.reqs[s as usize].unwritten_from = Some(unwritten_before.map_or(from, |u| u.min(from)));
        }
        let got = self.allocate_slots_inner(s, a, hit_blocks, adopts && !tracked);
        if got.is_none() {
            self.reqs[s as usize].unwritten_from = unwritten_before;
        }
        Ok(got)
    }

    /// Refuses a computed-token count ahead of the token slots a table of `s` was given
    /// when this call would cache blocks past them under the request's hashes: the tokens
    /// between the slots and the count were never written (see
    /// [`AllocateArgs::trust_computed_tokens`]). A count ahead with nothing to cache there
    /// (no hashes for those blocks yet, caching off or delayed) allocates as vLLM's does, and
    /// returns the first never-written token (the fewest slots a covering table was given),
    /// past which nothing of the request is ever cached (a later call that knows the hashes
    /// caches only up to it).
    fn check_computed_within_tables(&self, s: Slot, a: &AllocateArgs) -> Result<Option<u32>> {
        if !self.cfg.enable_caching {
            return Ok(None);
        }
        let covered = |m: &crate::manager::SingleTypeManager| m.blocks(s).len() as u64 * m.block_size() as u64;
        let unwritten = self
            .managers
            .iter()
            .filter(|m| m.kind().covers_sequence())
            .map(covered)
            .min()
            .filter(|&slots| (a.num_computed_tokens as u64) > slots)
            .map(|slots| slots as u32);
        if unwritten.is_none() || a.delay_cache_blocks {
            return Ok(unwritten);
        }
        // What `allocate_slots_inner` caches; the sums fit `u32` (checked by the caller).
        let mml = self.cfg.max_model_len;
        let total = (a.num_computed_tokens + a.num_new_computed_tokens + a.num_external_computed_tokens).min(mml);
        let main = total + a.num_new_tokens;
        let cache_tokens = main.min(a.num_tokens).min((main + a.num_lookahead_tokens).min(mml));
        let num_hashes = self.reqs[s as usize].hashes.len();
        for (g, m) in self.managers.iter().enumerate() {
            let slots = m.blocks(s).len() as u64 * m.block_size() as u64;
            if !m.kind().covers_sequence() || a.num_computed_tokens as u64 <= slots {
                continue;
            }
            let to_cache = self.group_cache_target(g, cache_tokens);
            let (full, held) = m.blocks_to_cache(s, num_hashes, to_cache);
            if full > held {
                return Err(Error::InvalidState(format!(
                    "num_computed_tokens={} is ahead of the {slots} token slots group {g}'s table was given: \
                     caching {to_cache} tokens would cache {} blocks never written under this request's hashes \
                     (allocate the computed tokens first, or adopt them as a cache hit or external tokens)",
                    a.num_computed_tokens,
                    full - held
                )));
            }
        }
        Ok(unwritten)
    }

    /// The allocation itself; every check passed. Token sums fit `u32` (checked by the
    /// caller), so the arithmetic here cannot wrap.
    pub(super) fn allocate_slots_inner(
        &mut self,
        s: Slot,
        a: &AllocateArgs,
        hit_blocks: &[Vec<BlockId>],
        adopts: bool,
    ) -> Option<u32> {
        let mml = self.cfg.max_model_len;
        let num_local = a.num_computed_tokens + a.num_new_computed_tokens;
        let unclamped_total = num_local + a.num_external_computed_tokens;
        let total_computed = unclamped_total.min(mml);
        let watermark =
            if a.apply_watermark { self.cfg.watermark_blocks as u64 + self.admission_headroom() } else { 0 };
        // vLLM: `max(num_prompt_tokens, num_tokens - 1)`, the scheduler's prefill boundary.
        let prefill_end = self.effective_prefill_end(a.num_prompt_tokens.max(a.num_tokens.saturating_sub(1)));
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(mml);
            let count = CountArgs {
                num_tokens: full,
                num_tokens_main_model: full,
                new_computed: &[],
                num_local_computed_tokens: num_local,
                total_computed_tokens: total_computed,
                apply_admission_cap: true,
                adopting: adopts,
                prefill_end,
            };
            let need = self.num_blocks_to_allocate(s, count, hit_blocks, a.num_encoder_tokens);
            if need + watermark as i64 > self.pool.free_pages() as i64 {
                return None;
            }
        }
        let main = total_computed + a.num_new_tokens;
        let need_slot = (main + a.num_lookahead_tokens).min(mml);
        let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
        for m in self.managers.iter_mut() {
            let pool = self.pool.side(page_side(self.state_groups, m.group_id()));
            m.remove_skipped_blocks(pool, s, processed, Some(a.num_prompt_tokens));
        }
        let count = CountArgs {
            num_tokens: need_slot,
            num_tokens_main_model: main,
            new_computed: &[],
            num_local_computed_tokens: num_local,
            total_computed_tokens: unclamped_total,
            apply_admission_cap: false,
            adopting: adopts,
            prefill_end,
        };
        let need = self.num_blocks_to_allocate(s, count, hit_blocks, a.num_encoder_tokens);
        // Recorded before the capacity check, as vLLM's count records it.
        self.record_checkpoints(s, hit_blocks, unclamped_total, main, prefill_end);
        let available = self.pool.free_pages() as i64 - a.reserved_blocks as i64;
        if need + watermark as i64 > available {
            return None;
        }
        if adopts {
            self.allocate_new_computed_blocks(
                s,
                hit_blocks,
                num_local,
                a.num_external_computed_tokens,
                a.skip_zeroing_groups,
            );
        }
        if self.pool.is_leveled() {
            // The policy's hook: the adopted hit's levels and junctions, and its bookkeeping.
            self.note_allocation(s, adopts.then_some(num_local), a.num_prompt_tokens);
        }
        self.out_ids.clear();
        for (g, m) in self.managers.iter_mut().enumerate() {
            let before = self.out_ids.len();
            let n = if m.kind().sized_by_encoder_tokens() { a.num_encoder_tokens } else { need_slot };
            let pool = self.pool.side(page_side(self.state_groups, g as crate::ids::GroupId));
            m.allocate_new_blocks(pool, s, n, main, &mut self.out_ids);
            self.out_counts[g] = (self.out_ids.len() - before) as u32;
        }
        // Two-level pages, rule 2: the pages the state groups took lose their slots' keys.
        self.pool.settle_pages();
        if self.state_groups != 0 {
            self.note_slot_holder(s);
        }
        if !a.delay_cache_blocks {
            // Draft tokens are never cached (vLLM); nor are tokens past the table (a step
            // reaching past `max_model_len` gets `max_model_len` slots).
            let to_cache = main.min(a.num_tokens).min(need_slot);
            let c = CacheBlocksArgs {
                num_computed_tokens: to_cache,
                num_prompt_tokens: a.num_prompt_tokens,
                shared_prefix_boundary: a.shared_prefix_boundary,
                request_computed_tokens: a.num_computed_tokens,
            };
            self.cache_blocks_inner(s, &c);
        }
        Some(self.out_ids.len() as u32)
    }

    pub(super) fn allocate_new_computed_blocks(
        &mut self,
        s: Slot,
        hit_blocks: &[Vec<BlockId>],
        num_local: u32,
        num_external: u32,
        skip_zeroing_groups: u64,
    ) {
        for (i, m) in self.managers.iter_mut().enumerate() {
            let blocks: &[BlockId] = hit_blocks.get(i).map(|v| v.as_slice()).unwrap_or(&[]);
            let pool = self.pool.side(page_side(self.state_groups, m.group_id()));
            m.add_local_computed_blocks(pool, s, blocks, num_local, num_external);
        }
        if num_external > 0 {
            for (g, m) in self.managers.iter_mut().enumerate() {
                let record = skip_zeroing_groups >> g & 1 == 0;
                let pool = self.pool.side(page_side(self.state_groups, m.group_id()));
                m.allocate_external_computed_blocks(pool, s, num_local, num_external, record);
            }
        }
    }

    /// New block ids of the last successful `allocate_slots`, groups concatenated.
    pub fn new_block_ids(&self) -> &[BlockId] {
        &self.out_ids
    }

    /// Per-group counts of [`Self::new_block_ids`].
    pub fn new_block_counts(&self) -> &[u32] {
        &self.out_counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ids::BlockHash;
    use crate::policy::{Policy, LEVEL_NORMAL};

    /// Full attention at 16-token slots, 4 a page, + Mamba "align" at 32 tokens
    /// ([`super::super::full_and_align_config`]), over 16 pages; a headroom of 2 slots per
    /// request holding slots.
    fn allocator() -> Allocator {
        let cfg = Config { num_blocks: 16, admission_headroom_slots: 2, ..super::super::full_and_align_config(4) };
        Allocator::new(cfg, Policy::Exact).unwrap()
    }

    /// The headroom as the pass over the request table counted it: `ceil(R x h / k)`, `R` the
    /// live requests whose slot table is non-empty.
    fn recounted_headroom(a: &Allocator) -> u64 {
        let r = a.live_handles().filter(|&h| !a.blocks(h, 0).unwrap().is_empty()).count() as u64;
        (r * a.cfg.admission_headroom_slots as u64).div_ceil(a.cfg.slots_per_page as u64)
    }

    /// The counter agrees with the recount (and every other invariant holds).
    fn check(a: &Allocator, holders: u32) {
        assert_eq!(a.slot_holders, holders);
        assert_eq!(a.admission_headroom(), recounted_headroom(a));
        crate::invariants::check(a).unwrap();
    }

    /// Chained hashes of `n` 16-token blocks of request `seed`.
    fn hashes(seed: u64, n: usize) -> Vec<BlockHash> {
        (0..n as u64).map(|i| BlockHash::from_u64(seed << 32 | (i + 1))).collect()
    }

    /// Admits `h` in a new step (a prompt of `prompt` tokens, its hit adopted) with the watermark's
    /// condition, and a clone of `a` that keeps the recounted headroom as a plain watermark:
    /// both decide alike.
    fn admit(a: &mut Allocator, h: ReqHandle, seed: u64, prompt: u32) -> Option<u32> {
        a.new_step_starts();
        let hs = hashes(seed, (prompt / 16) as usize);
        a.set_hashes(h, &hs).unwrap();
        let hit = a.find_longest_cache_hit(h, prompt - 1).unwrap().num_tokens;
        let mut b = a.clone();
        b.cfg.watermark_blocks += recounted_headroom(a) as u32;
        b.cfg.admission_headroom_slots = 0;
        let args = AllocateArgs {
            num_new_tokens: prompt - hit,
            num_new_computed_tokens: hit,
            num_prompt_tokens: prompt,
            num_tokens: prompt,
            apply_watermark: true,
            ..Default::default()
        };
        let got = a.allocate_slots(h, &args, NewComputed::Stored, None).unwrap();
        assert_eq!(b.allocate_slots(h, &args, NewComputed::Stored, None).unwrap(), got, "prompt {prompt}");
        assert_eq!((a.num_free_blocks(), a.blocks(h, 0).unwrap()), (b.num_free_blocks(), b.blocks(h, 0).unwrap()));
        got
    }

    /// The largest prompt (16-token steps) `h` could be admitted with, on a clone.
    fn largest_admitted(a: &Allocator, h: ReqHandle, headroom: bool) -> u32 {
        let mut best = 0;
        for prompt in (16..=640).step_by(16) {
            let mut t = a.clone();
            if !headroom {
                t.cfg.admission_headroom_slots = 0;
            }
            if admit(&mut t, h, 99, prompt).is_some() {
                best = prompt;
            }
        }
        best
    }

    #[test]
    fn admission_headroom_counts_slot_holders_through_preemption_free_and_readmission() {
        let mut a = allocator();
        check(&a, 0);
        let r: Vec<ReqHandle> = (0..3).map(|_| a.add_request()).collect();
        let waiting = a.add_request();
        check(&a, 0);
        for (i, &h) in r.iter().enumerate() {
            assert!(admit(&mut a, h, i as u64 + 1, 64).is_some());
            check(&a, i as u32 + 1);
        }
        // A request refused at admission holds nothing and is not counted; nor is one that
        // only waits.
        assert_eq!(admit(&mut a, waiting, 50, 640), None);
        check(&a, 3);
        // The headroom (ceil(3 x 2 / 4) = 2 pages) decides: the waiting request fits a
        // shorter prompt than it would without it.
        let (with, without) = (largest_admitted(&a, waiting, true), largest_admitted(&a, waiting, false));
        assert!(0 < with && with < without, "admitted {with} tokens with the headroom, {without} without");
        // Preemption (vLLM frees the request, which waits again under a new handle).
        a.free(r[1], LEVEL_NORMAL).unwrap();
        check(&a, 2);
        // Finished, its blocks popped for a later free.
        let mut popped = Vec::new();
        a.pop_blocks_for_free(r[2], &mut popped).unwrap();
        check(&a, 1);
        a.free_block_ids(&popped).unwrap();
        check(&a, 1);
        // Re-admission of the preempted request, one block longer: its prompt's cached
        // blocks are a hit.
        let again = a.add_request();
        check(&a, 1);
        a.set_hashes(again, &hashes(2, 5)).unwrap();
        assert_eq!(a.find_longest_cache_hit(again, 79).unwrap().num_tokens, 64, "a hit on re-admission");
        assert!(admit(&mut a, again, 2, 80).is_some());
        check(&a, 2);
        // A running request's next step: counted once.
        let step = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: 80,
            num_prompt_tokens: 80,
            num_tokens: 81,
            ..Default::default()
        };
        assert!(a.allocate_slots(again, &step, NewComputed::Empty, None).unwrap().is_some());
        check(&a, 2);
        a.free(r[0], LEVEL_NORMAL).unwrap();
        a.free(again, LEVEL_NORMAL).unwrap();
        check(&a, 0);
        assert_eq!(a.admission_headroom(), 0);
        a.free(waiting, LEVEL_NORMAL).unwrap();
        check(&a, 0);
    }
}
