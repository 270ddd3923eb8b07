//! The hit-aware policy's room per request (rule by rule in [`crate::policy`]): what it
//! decides for a request across the groups, through the policy's handle (`HitAware`, from
//! `BlockPool::hit_aware`), with the per-request state it keeps ([`HitAwareReq`], one field
//! of the coordinator's `ReqState`, all zero under `exact`):
//! - *junctions*, around vLLM's `find_longest_cache_hit`: where a request's shared prefix is
//!   reported to end (`num_uncached_common_prefix_tokens`, which vLLM's scheduler turns into
//!   `shared_prefix_boundary` and ends a prefill chunk at, so a Mamba "align" state is cached
//!   there). Under `exact` a junction is vLLM's (the shared prefix the hybrid search found);
//!   under `hit-aware` a pinned prefix's end is one too, a request nothing is shared with yet
//!   gets first-sighting stops, and the Mamba groups learn the junction that makes a state a
//!   branch point. With partial hash hits (a Mamba block larger than the hash block) it also
//!   reports the longest prefix another prompt went on past (the sightings, [`Sight`]), so a
//!   junction may lie inside a block, and keeps the branch points a hit passes (rule 8);
//! - the hooks the other rooms call under `hit-aware`: `retain_for_free` (`free`: the levels
//!   a freed request's blocks go back at and one freeing order across groups) and
//!   `note_allocation` (`allocate_slots`: an adopted hit's levels and junctions, and the
//!   probation rule's inputs);
//! - pinning ([`Allocator::pin_prefix`], [`Allocator::set_pinned_share`]);
//! - KV hints (issue 38, [`Allocator::set_hints`]): a request's pin lease (its prefix's keys,
//!   taken at once), its checkpoints (junctions the lookup reports and each chunk moves on,
//!   their states marked branch points), its retain and session release (applied when it is
//!   freed), the clock and the releases; the holds themselves are the policy's
//!   (`policy/hints.rs`). A request without hints pays one `Option` in its state and one
//!   flag test after an allocation that is not a no-op.
//!
//! Invariants: `guess_limit` is 0 unless the request's last lookup guessed a first-sighting
//! stop; `moved_junction` is 0 unless the last allocation moved it and it was not taken;
//! `stops` is set only while the request has hints with checkpoints not all passed.
//!
//! Cost: `place_junction` O(groups) plus O(pinned blocks) with pins and O(log(max length))
//! for a first-sighting stop, and with partial hash hits O(log(prompt)) plus O(prompt
//! hashes) at a request's first lookup; `keep_passed_junctions` O(hit / hash block x groups)
//! per adopted hit; `retain_for_free` O(table log table); pinning O(prefix blocks); the rest
//! O(1) or O(log(prompt)).
#![forbid(unsafe_code)]

use super::{page_side, Allocator, HashSource, Hit};

use crate::error::{Error, Result};
use crate::ids::{BlockHash, BlockId, GroupId, ReqHandle, Slot};
use crate::manager::{HashView, SingleTypeManager};
use crate::policy::retention::HitAware;
use crate::policy::{HintStats, Level, Policy, Retention, LEVEL_NORMAL, LEVEL_PINNED, LEVEL_SPECULATIVE};
use crate::prefix_index::HashKey;

/// The most hash-block prefixes [`Allocator::record_sighting`] keeps (48 bytes each, about
/// 14 MiB with the map's overhead: 16M tokens of prompts at a 64-token unit); past it the
/// sightings start over.
pub(super) const MAX_SIGHTINGS: usize = 1 << 18;

/// What the hit-aware policy saw of one hash-block prefix (see
/// [`Allocator::record_sighting`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sight {
    /// Who went on past it: 0 nobody, a request's handle + 1, or `u64::MAX` for several.
    pub(super) passer: u64,
}

/// The hit-aware policy's per-request state (all zero under `exact`, and for a new request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct HitAwareReq {
    /// `(adopted hit tokens, prompt tokens)` as the last allocation saw them (the probation
    /// rule of [`crate::policy::LEVEL_PROBATION`], read by `free`).
    pub(super) hit_and_prompt: (u32, u32),
    /// Mamba "align": while the request's last lookup guessed its junctions (nothing shared
    /// yet, see `first_sighting_stop`), the tokens that lookup covered (the last stop's
    /// bound); 0 otherwise.
    pub(super) guess_limit: u32,
    /// The junction the last allocation moved the request's `shared_prefix_boundary` to
    /// (the next first-sighting stop), until taken ([`Allocator::take_moved_junction`]); 0:
    /// not moved.
    pub(super) moved_junction: u32,
    /// Hit-aware with partial hash hits: the request's prompt is recorded in the sightings
    /// (its first lookup did it; a lookup repeated while it waits does not again).
    pub(super) sighted: bool,
    /// KV hints: the request has checkpoints its allocations have not all passed yet
    /// ([`ReqHints::checkpoints`]; each allocation checks them, see `advance_checkpoints`).
    pub(super) stops: bool,
}

/// A retain hint's priority: the level the request's prefix and its end state are freed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetainPriority {
    /// The pinned level (evicted last; within the pinned share, soft: past it the oldest
    /// pinned blocks go back to the normal level).
    High,
    /// The normal level, kept from the policy's own demotions (probation, a lost hit unit).
    Normal,
    /// The speculative level (evicted first).
    Low,
}

impl RetainPriority {
    /// The retention level it frees at.
    pub fn level(self) -> Level {
        match self {
            RetainPriority::High => LEVEL_PINNED,
            RetainPriority::Normal => LEVEL_NORMAL,
            RetainPriority::Low => LEVEL_SPECULATIVE,
        }
    }
}

/// A retain hint: when the request is freed, its first `tokens` tokens' cached blocks (0:
/// all it hashed) and the state at their end go to `priority`'s level for `ttl_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetainHint {
    /// The level.
    pub priority: RetainPriority,
    /// Milliseconds of the manager's clock from the request's free (`1..=MAX_TTL_MS`).
    pub ttl_ms: u64,
    /// Tokens of the prefix retained (0: all the request hashed).
    pub tokens: u32,
}

/// A pin lease hint: the request's first `tokens` tokens (0: all it hashed), rounded down to
/// whole blocks, are leased now for `ttl_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinHint {
    /// Milliseconds of the manager's clock from now (`1..=MAX_TTL_MS`).
    pub ttl_ms: u64,
    /// Tokens of the prefix leased (0: all the request hashed).
    pub tokens: u32,
}

/// One request's KV hints, set in one call ([`Allocator::set_hints`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHints<'a> {
    /// The request's session (0: none): its retains and leases end at the session's release.
    pub session: u64,
    /// A retain, applied when the request is freed.
    pub retain: Option<RetainHint>,
    /// A pin lease, taken now.
    pub pin: Option<PinHint>,
    /// A session to release when the request is freed (0: none).
    pub release_session: u64,
    /// Prompt positions (tokens) where the prefill stops and the state is kept; at most
    /// [`MAX_CHECKPOINTS`].
    pub checkpoints: &'a [u32],
}

/// What became of a pin lease hint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PinOutcome {
    /// No pin was asked.
    #[default]
    NotAsked,
    /// The lease runs.
    Applied,
    /// Refused: its keys would take the pinned keys past the pinned share.
    RefusedOverCap,
}

/// What [`Allocator::set_hints`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HintOutcome {
    /// The pin lease's fate.
    pub pin: PinOutcome,
    /// Checkpoint positions taken (on a model without Mamba "align" groups, where they have
    /// nothing to do, all of them).
    pub checkpoints_applied: u32,
    /// Checkpoint positions refused: 0 once rounded down to the hit alignment.
    pub checkpoints_refused: u32,
}

/// The most checkpoint positions one request may name.
pub const MAX_CHECKPOINTS: usize = 64;

/// A request's KV hints kept until it is freed (`ReqState::hints`; `None` for a request
/// without hints, so the others pay one pointer).
#[derive(Clone, Debug, Default)]
pub(super) struct ReqHints {
    /// The request's session (0: none).
    session: u64,
    /// A retain to apply when the request is freed: its level, TTL and tokens (0: all).
    retain: Option<RetainHint>,
    /// A session to release when the request is freed (0: none).
    release: u64,
    /// Checkpoint positions rounded down to the hit alignment, sorted, distinct, within
    /// the request's hashes (Mamba "align" models only; empty otherwise).
    checkpoints: Vec<u32>,
    /// `checkpoints[..marked]` are done: the state there was found and marked a branch
    /// point, or the allocations went past it without its state keyed.
    marked: usize,
}

impl Allocator {
    /// The hybrid search's hit `res` for `s` (looked up within `max_cache_hit_length`
    /// tokens) with its junction placed: a pinned prefix's end, or (nothing shared, no hit)
    /// the first first-sighting stop, reported as the shared prefix's end when it lies past
    /// what the search found; under hit-aware the Mamba "align" groups learn the junction.
    /// Sets `guess_limit` when the junction is a guess.
    pub(super) fn place_junction(
        &mut self,
        s: Slot,
        max_cache_hit_length: u32,
        mut res: Hit,
        guess_limit: &mut u32,
    ) -> Hit {
        let mut junction = self.pinned_junction(s, max_cache_hit_length);
        // KV hints: the application's next checkpoint past the hit is a junction too (the
        // nearer of it and a pinned prefix's end), reported even inside a shared prefix
        // vLLM found (the application knows where its prompt's parts end).
        let checkpoint = self.next_checkpoint(s, res.num_tokens, max_cache_hit_length);
        if checkpoint > 0 && (junction <= res.num_tokens || checkpoint < junction) {
            junction = checkpoint;
        }
        let mut known = res.num_tokens + res.num_uncached_common_prefix_tokens;
        if self.pool.is_leveled() && self.partial_hash_hits {
            // Where another prompt looked up before branched off this one, to the hash block:
            // a junction inside a block, which the scheduler stops at (our manager sets
            // `mamba_shared_prefix_checkpoint`), so its state and the full-attention blocks
            // up to it are keyed there, and the next sibling hits the whole shared prefix.
            let seen = self.sighted_prefix(s, max_cache_hit_length);
            if !self.reqs[s as usize].hit_aware.sighted {
                self.record_sighting(s);
                self.reqs[s as usize].hit_aware.sighted = true;
            }
            // A prefix where earlier prompts only ended (a chat's previous turn, which this
            // request continues) is no branch point.
            if seen > known && self.passed_by_other(s, seen) {
                res.num_uncached_common_prefix_tokens = seen - res.num_tokens;
                known = seen;
            }
        }
        // The sightings' answer for the hit, read before the policy's handle is taken.
        let hit_passed = self.partial_hash_hits && res.num_tokens > 0 && self.passed_by_other(s, res.num_tokens);
        let Self { pool, managers, reqs, cfg, .. } = self;
        if let Some(ha) = pool.hit_aware() {
            let ends = |tokens| ends_a_sequence(&ha, managers, &reqs[s as usize].hashes, cfg.hash_block_size, tokens);
            // A junction another request shares (or a pin) is a branch point, unless
            // the shared prefix is where a finished request's sequence ended (a
            // chat's earlier turn, which this request continues).
            let mut shared = if res.num_uncached_common_prefix_tokens > 0 && !ends(known) { known } else { 0 };
            if shared == 0 && res.num_tokens > 0 {
                // A hit where another prompt went on (with partial hash hits, as the sightings
                // tell; otherwise where no finished request's sequence ended) is a shared
                // prefix (a system prompt), not this conversation's own earlier turn: its
                // states are branch points, kept when passed, not the running session's
                // unit that goes first (rule 7).
                let other = if self.partial_hash_hits { hit_passed } else { !ends(res.num_tokens) };
                if other {
                    shared = res.num_tokens;
                }
            }
            for m in managers.iter_mut().filter(|m| m.is_mamba_align()) {
                m.set_align_junction(s, junction.max(shared));
            }
        }
        if junction == 0 && res.num_tokens == 0 && res.num_uncached_common_prefix_tokens == 0 {
            junction = self.first_sighting_stop(0, max_cache_hit_length);
            if junction > 0 {
                *guess_limit = max_cache_hit_length;
            }
        }
        if junction > known || (checkpoint > 0 && junction == checkpoint) {
            res.num_uncached_common_prefix_tokens = junction - res.num_tokens;
        }
        res
    }

    /// Hit-aware, [`Self::free`]'s hook: sets the retention levels `s`'s blocks are freed at
    /// (see [`crate::policy`], rules 2, 5 and 6, and `level`) and returns every non-null
    /// block of its tables as `(token position, group, block)`, tail first; at equal
    /// positions in group order (vLLM frees group after group), so a hit unit is freed
    /// together. The tables are left as they are. `None` under `exact` (nothing to decide:
    /// each group frees its own table). With two-level pages each group's rules take its
    /// own pool's handle (slots, states). O(table log table).
    pub(super) fn retain_for_free(&mut self, s: Slot, level: Level) -> Option<Vec<(u64, GroupId, BlockId)>> {
        let Self { pool, managers, reqs, state_groups, .. } = self;
        if !pool.is_leveled() {
            return None;
        }
        let mut blocks = Vec::new();
        // State-space hybrids: a request whose hit saved under half its prompt leaves
        // the blocks it computed on probation (see `LEVEL_PROBATION`).
        let (hit, prompt) = reqs[s as usize].hit_aware.hit_and_prompt;
        let mamba = managers.iter().any(|m| m.is_mamba_align());
        let probation = level <= LEVEL_NORMAL && (hit as u64) * 2 < prompt as u64 && mamba;
        for m in managers.iter() {
            let mut ha = pool.side(page_side(*state_groups, m.group_id())).hit_aware()?;
            if mamba && m.kind().is_full() {
                // Where a chat's next turn continues: a junction found there later is
                // no branch point (see `Allocator::place_junction`).
                let n = m.num_cached(s) as usize;
                if let Some(&b) = n.checked_sub(1).and_then(|i| m.blocks(s).get(i)) {
                    ha.mark_tail(b);
                }
            }
            m.promote_for_free(&mut ha, s, level.max(LEVEL_NORMAL), LEVEL_SPECULATIVE);
            if mamba {
                m.demote_duplicates(&mut ha, s);
            }
            if probation {
                m.demote_unproven(&mut ha, s, hit);
            }
            m.positioned_blocks(s, &mut blocks);
        }
        // Tail first; at equal positions, group order (vLLM frees group after group).
        blocks.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        Some(blocks)
    }

    /// Hit-aware, `allocate_slots`' hook once the request's hit (if it adopted one, of
    /// `adopted` tokens) is in its tables: the hit's blocks keep their level
    /// ([`SingleTypeManager::promote_hit`]), with partial hash hits the junctions the hit
    /// passed are kept ([`Self::keep_passed_junctions`]), and the probation rule's inputs
    /// are noted (the hit, `num_prompt_tokens`). O(hit blocks) with a hit, else O(1).
    pub(super) fn note_allocation(&mut self, s: Slot, adopted: Option<u32>, num_prompt_tokens: u32) {
        if let Some(hit) = adopted {
            for m in &self.managers {
                if let Some(mut ha) = self.pool.side(page_side(self.state_groups, m.group_id())).hit_aware() {
                    m.promote_hit(&mut ha, s);
                }
            }
            if self.partial_hash_hits {
                self.keep_passed_junctions(s, hit);
            }
            self.reqs[s as usize].hit_aware.hit_and_prompt.0 = hit;
        }
        self.reqs[s as usize].hit_aware.hit_and_prompt.1 = num_prompt_tokens;
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
        self.refuse_pins_over_pages("pinning a prefix")?;
        let keys = self.prefix_keys(hashes);
        match self.pool.hit_aware() {
            Some(mut ha) => ha.pin_keys(keys),
            None => {
                Err(Error::Unsupported("pinning a prefix needs the hit-aware policy with prefix caching on".into()))
            }
        }
    }

    /// The hash keys a hit on the whole prefix `hashes` (at `hash_block_size` granularity)
    /// needs: every block of a full-attention or chunked group, the window tail at its end
    /// in a sliding-window group, every state block of a Mamba group. O(prefix blocks).
    fn prefix_keys(&self, hashes: &[BlockHash]) -> Vec<HashKey> {
        let mut keys = Vec::new();
        for m in &self.managers {
            if m.kind().sized_by_encoder_tokens() {
                continue;
            }
            let view = HashView { hashes, scale: m.block_size() / self.cfg.hash_block_size };
            let n = view.len();
            let from = m.hit_tail_blocks().map_or(0, |t| n.saturating_sub(t));
            keys.reserve((n - from) as usize);
            keys.extend((from..n).map(|i| (view.get(i), m.group_id())));
        }
        keys
    }

    /// Sets the pinned share of the pool (`0.0..=1.0`, default 0.25): at most that fraction
    /// of the blocks may be pinned keys, or free at the pinned level (past it the oldest
    /// free pinned block is demoted to the normal LRU).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a share outside `0.0..=1.0` or below the keys pinned.
    pub fn set_pinned_share(&mut self, share: f64) -> Result<()> {
        let num_blocks = self.pool.num_blocks();
        if self.state_groups != 0 && self.pool.is_leveled() {
            // Two-level pages: each pool's share (no key is pinned there: the range is the
            // only error, the same for both).
            Retention::pinned_cap_for(share, num_blocks)?;
            if let Some(mut ha) = self.pool.side(true).hit_aware() {
                ha.set_pinned_share(share)?;
            }
        }
        match self.pool.hit_aware() {
            Some(mut ha) => ha.set_pinned_share(share),
            // Under exact only the share's range is checked.
            None => Retention::pinned_cap_for(share, num_blocks).map(|_| ()),
        }
    }

    /// Hit-aware with partial hash hits: a request that adopted a hit of `hit` tokens keeps
    /// the junctions it passed. A state set (cached in every Mamba group) at the hit's end
    /// where another prompt went on is marked a branch point; every branch point at or
    /// before the hit's end, with the full-attention block keyed there, goes to at least
    /// [`LEVEL_NORMAL`] and, when free, to the back of its level, as a hit on it would put
    /// it (not one whose full-attention block is gone: it serves no hit, and ages out).
    /// Under `exact` every sibling hits the shared system prompt's state, which so stays
    /// recent; a hit-aware sibling resumes further on (its own previous turn), and without
    /// this the shared state ages out first under pressure, after which the siblings whose
    /// own states were evicted (round-robin chat) hit nothing. O(hit / hash block x groups).
    pub(super) fn keep_passed_junctions(&mut self, s: Slot, hit: u32) {
        let hbs = self.cfg.hash_block_size;
        let n = ((hit / hbs) as usize).min(self.reqs[s as usize].hashes.len());
        // Two-level pages: the states are pages (the page pool's lookups and handle), the
        // full-attention blocks slots (this pool's).
        let sp = self.state_groups != 0;
        let states: Vec<_> = self.pool.side_ref(sp).retention().map_or(Vec::new(), |r| r.state_groups().to_vec());
        if n == 0 || states.is_empty() {
            return;
        }
        let fulls: Vec<_> = self.managers.iter().filter(|m| m.kind().is_full()).map(|m| m.group_id()).collect();
        let shared_end = self.passed_by_other(s, n as u32 * hbs);
        // The lookups first (the pool's: second keys count), then the decisions on what they
        // found (the policy's handle): a decision changes no key, so no lookup. Per position
        // with a state set: (the hit's end, where its blocks start, its states, whether
        // every full-attention block is cached too, where its blocks end) in `blocks`.
        let (mut found, mut one, mut blocks, mut sets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let h = self.reqs[s as usize].hashes[i];
            if !self.pool.side_ref(sp).get_cached_block(&h, &states, &mut found) {
                continue;
            }
            let start = blocks.len();
            blocks.extend_from_slice(&found);
            let mut whole = true;
            for &g in &fulls {
                whole &= self.pool.get_cached_block(&h, &[g], &mut one);
                blocks.extend_from_slice(&one);
            }
            sets.push((i + 1 == n, start, found.len(), whole, blocks.len()));
        }
        let keep = |ha: &mut HitAware<'_>, b: BlockId| {
            let lvl = ha.level(b);
            if lvl < LEVEL_PINNED {
                ha.set_level(b, lvl.max(LEVEL_NORMAL));
            }
        };
        for (last, start, k, whole, end) in sets {
            let st = &blocks[start..start + k];
            // The states (each set's first, as one pool orders them), then the blocks.
            let Some(mut ha) = self.pool.side(sp).hit_aware() else { return };
            if last && shared_end {
                for &b in st {
                    ha.mark_branch(b);
                }
            }
            // A state set whose full-attention block is gone serves no hit: it is left to age.
            if !st.iter().any(|&b| ha.is_branch(b)) || !whole {
                continue;
            }
            for &b in st {
                keep(&mut ha, b);
            }
            let Some(mut ha) = self.pool.hit_aware() else { return };
            for &b in &blocks[start + k..end] {
                keep(&mut ha, b);
            }
        }
    }

    /// Hit-aware with partial hash hits: the longest prefix of `s`'s hashes (within
    /// `max_len` tokens) some earlier lookup's prompt had, in tokens (a multiple of the hash
    /// block). The hashes chain, so a seen prefix's every shorter prefix was seen too: a
    /// binary search. O(log(prompt)).
    fn sighted_prefix(&self, s: Slot, max_len: u32) -> u32 {
        let hbs = self.cfg.hash_block_size;
        let hashes = &self.reqs[s as usize].hashes;
        let n = ((max_len / hbs) as usize).min(hashes.len());
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.sightings.contains_key(&hashes[mid - 1]) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo as u32 * hbs
    }

    /// Hit-aware with partial hash hits: records `s`'s hashes as seen (forgetting every
    /// sighting once [`MAX_SIGHTINGS`] are held): each one but the last as passed through by
    /// `s`, the last as seen only (a prompt's end). O(hashes).
    fn record_sighting(&mut self, s: Slot) {
        let me = self.handle_of(s) + 1;
        let hashes = &self.reqs[s as usize].hashes;
        if self.sightings.len() + hashes.len() > MAX_SIGHTINGS {
            self.sightings.clear();
        }
        let Some((last, rest)) = hashes.split_last() else { return };
        for h in rest {
            let e = self.sightings.entry(*h).or_default();
            e.passer = match e.passer {
                0 => me,
                p if p == me => me,
                _ => u64::MAX,
            };
        }
        self.sightings.entry(*last).or_default();
    }

    /// Hit-aware with partial hash hits: whether a prompt other than `s`'s went on past the
    /// prefix of `tokens` tokens (a multiple of the hash block): a branch point, not only a
    /// chat's earlier turn that `s` continues. O(1).
    fn passed_by_other(&self, s: Slot, tokens: u32) -> bool {
        let n = (tokens / self.cfg.hash_block_size) as usize;
        if n == 0 || n > self.reqs[s as usize].hashes.len() {
            return false;
        }
        let me = self.handle_of(s) + 1;
        self.sightings.get(&self.reqs[s as usize].hashes[n - 1]).is_some_and(|e| e.passer != 0 && e.passer != me)
    }

    /// Hit-aware, Mamba "align": where a pinned prefix the request starts with ends, at a
    /// state position (0 for none). Reported as the shared prefix's end, so the scheduler
    /// ends a prefill chunk there and its state is cached the first time the prefix is
    /// seen (vLLM finds the junction only when the full-attention index already shares it,
    /// and a pinned prompt would hit only from its 3rd sighting). O(pinned blocks) per
    /// lookup, nothing without pins.
    fn pinned_junction(&self, s: Slot, max_len: u32) -> u32 {
        let pins = self.pool.retention();
        let mut best = 0;
        let hashes = &self.reqs[s as usize].hashes;
        for m in self.managers.iter().filter(|m| m.is_mamba_align()) {
            let bs = m.block_size();
            let view = HashView { hashes, scale: bs / self.cfg.hash_block_size };
            let n = (max_len / bs).min(view.len());
            let mut i = 0;
            while i < n && pins.is_some_and(|r| r.is_pinned_key(&(view.get(i), m.group_id()))) {
                i += 1;
            }
            best = best.max(i * bs);
        }
        best
    }

    /// Hit-aware, Mamba "align": the first-sighting stops of a request nothing is shared with
    /// yet (no hit, no prefix the full-attention index shares, no pin). Its lookup reports
    /// the first stop as the shared prefix's end (`shared_prefix_boundary`), and each
    /// allocation that reaches the reported stop moves it to the next one
    /// ([`Self::take_moved_junction`]): vLLM's scheduler ends a prefill chunk at each, and
    /// each chunk end's state is cached. The stops are the power-of-two numbers of blocks (of
    /// the largest Mamba block) within the lookup's `max_len` tokens, each a multiple of the
    /// hit alignment: 1, 2, 4, 8, ... blocks. So a later request sharing `L` tokens of the
    /// prompt (`L` at least one block) finds a state covering more than half of them on its
    /// 2nd sighting, instead of nothing until its 3rd; a prompt of `n` blocks pays
    /// `floor(log2(n)) + 1` more prefill chunks at most. Returns the first stop past `after`
    /// tokens, 0 for none. O(log(max_len)).
    fn first_sighting_stop(&self, after: u32, max_len: u32) -> u32 {
        if self.policy != Policy::HitAware {
            return 0;
        }
        let Some(bs) = self.managers.iter().filter(|m| m.is_mamba_align()).map(|m| m.block_size()).max() else {
            return 0;
        };
        let align = self.hit_alignment as u64;
        let mut stop = bs as u64;
        while stop <= max_len as u64 {
            if stop > after as u64 && stop % align == 0 {
                return stop as u32;
            }
            stop *= 2;
        }
        0
    }

    /// Hit-aware: after an allocation of `s` that computes up to `end` tokens with
    /// `boundary` as its `shared_prefix_boundary`, moves a guessed junction the allocation
    /// reached to the next first-sighting stop ([`Self::first_sighting_stop`]), or ends the
    /// guessing when there is none; and with KV hints' checkpoints, moves on to the next one
    /// ([`Self::advance_checkpoints`]). O(log(prompt)); a request with neither (every
    /// request under `exact`, and a decoding one) pays one test, inlined into the caller.
    #[inline]
    pub(super) fn advance_first_sighting(&mut self, s: Slot, end: u64, boundary: u32) {
        let st = &self.reqs[s as usize].hit_aware;
        if st.guess_limit > 0 || st.stops {
            self.advance_stops(s, end, boundary);
        }
    }

    /// [`Self::advance_first_sighting`] for a request with a guessed junction or
    /// checkpoints, out of the allocation's line.
    #[inline(never)]
    fn advance_stops(&mut self, s: Slot, end: u64, boundary: u32) {
        let st = &self.reqs[s as usize].hit_aware;
        let (limit, stops) = (st.guess_limit, st.stops);
        if limit > 0 {
            self.advance_guess(s, end, boundary, limit);
        }
        if stops {
            self.advance_checkpoints(s, end, boundary);
        }
    }

    /// [`Self::advance_first_sighting`]'s first-sighting stops, for a request whose last
    /// lookup guessed its junction within `limit` tokens. O(log(prompt)).
    fn advance_guess(&mut self, s: Slot, end: u64, boundary: u32, limit: u32) {
        let st = &mut self.reqs[s as usize];
        st.hit_aware.moved_junction = 0;
        if boundary == 0 || end < boundary as u64 {
            return;
        }
        let next = if end < limit as u64 { self.first_sighting_stop(end as u32, limit) } else { 0 };
        let st = &mut self.reqs[s as usize];
        st.hit_aware.moved_junction = next;
        if next == 0 {
            st.hit_aware.guess_limit = 0;
        }
    }

    /// Whether an allocation of `h` may move its junction: its last lookup guessed it (a
    /// first-sighting stop, hit-aware) and a later stop remains, or a KV hint's checkpoint
    /// remains (`advance_checkpoints`). A caller that writes the
    /// moved junction back into an object checks first that it can, so a call that raises
    /// changes nothing. O(1).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn may_move_junction(&self, h: ReqHandle) -> Result<bool> {
        let st = &self.reqs[self.slot(h)? as usize].hit_aware;
        Ok(st.guess_limit > 0 || st.stops)
    }

    /// The junction the last allocation of `h` moved its `shared_prefix_boundary` to (the
    /// next first-sighting stop: see `first_sighting_stop`), taken: `None` when it
    /// did not move it, or it was taken already. The vLLM adapter sets
    /// `request.shared_prefix_boundary` to it, so the scheduler ends the next prefill chunk
    /// there. O(1).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn take_moved_junction(&mut self, h: ReqHandle) -> Result<Option<u32>> {
        let s = self.slot(h)?;
        let j = std::mem::take(&mut self.reqs[s as usize].hit_aware.moved_junction);
        Ok((j > 0).then_some(j))
    }
}

/// Hit-aware: whether the full-attention block ending at `tokens` of a request with these
/// `hashes` ended a finished request's cached sequence ([`crate::policy::Retention::is_tail`]).
/// O(groups).
fn ends_a_sequence(
    ha: &HitAware<'_>,
    managers: &[SingleTypeManager],
    hashes: &[BlockHash],
    hash_block_size: u32,
    tokens: u32,
) -> bool {
    managers.iter().filter(|m| m.kind().is_full()).any(|m| {
        let bs = m.block_size();
        let view = HashView { hashes, scale: bs / hash_block_size };
        let n = tokens / bs;
        n > 0 && n <= view.len() && ha.keyed_block(&(view.get(n - 1), m.group_id())).is_some_and(|b| ha.is_tail(b))
    })
}

/// KV hints (issue 38, rule 9 of [`crate::policy`]): a request's hints set in one call, the
/// checkpoints it stops at, what its free applies, the clock and a session's release. The
/// holds' state and mechanics are the policy's (`policy/hints.rs`), reached through its
/// handle; this room decides per request which keys and blocks they name.
impl Allocator {
    /// Sets `h`'s KV hints in one call (hit-aware with prefix caching only), after bringing
    /// its hashes up to `hashes` when given (call it before the request's lookup, which then
    /// reports its first checkpoint). A pin lease is taken now on its prefix's keys (see
    /// [`Self::pin_prefix`] for which keys a prefix needs), until the clock
    /// ([`Self::advance_clock`]) passes its TTL; refused, and counted, when its keys would
    /// take the pinned keys past the pinned share. Checkpoints are rounded down to the hit
    /// alignment (the hash block with partial hash hits, else the scheduler block); one that
    /// rounds to 0 is refused (counted); on a model without Mamba "align" groups they have
    /// nothing to do and are taken as they are. The retain and the session release are kept
    /// for the request's free. O(prefix blocks) with a pin, O(checkpoints) otherwise.
    ///
    /// # Errors
    /// [`Error::Unsupported`] under `exact` or with prefix caching off; unknown handle;
    /// [`Error::InvalidState`] when the request's hints are set already; [`Error::OutOfRange`]
    /// for a TTL outside `1..=MAX_TTL_MS`, more than [`MAX_CHECKPOINTS`] checkpoints, or a
    /// checkpoint past the request's hashed tokens; an invalid hash. Nothing changes then.
    pub fn set_hints(
        &mut self,
        h: ReqHandle,
        hashes: Option<&dyn HashSource>,
        hints: &RequestHints<'_>,
    ) -> Result<HintOutcome> {
        let s = self.slot(h)?;
        let Some(r) = self.pool.retention() else {
            return Err(Error::Unsupported("KV hints need the hit-aware policy with prefix caching on".into()));
        };
        if self.reqs[s as usize].hints.is_some() {
            return Err(Error::InvalidState(format!("the KV hints of request {h} are set already")));
        }
        if hints.pin.is_some() {
            self.refuse_pins_over_pages("a pin lease hint")?;
        }
        if hints.retain.is_some() {
            self.refuse_pins_over_pages("a retain hint")?;
        }
        if hints.checkpoints.len() > MAX_CHECKPOINTS {
            return Err(Error::OutOfRange(format!(
                "{} checkpoints, more than the {MAX_CHECKPOINTS} a request may name",
                hints.checkpoints.len()
            )));
        }
        let now = r.holds().now_ms();
        let pin_expiry = hints.pin.map(|p| r.holds().expiry(now, p.ttl_ms)).transpose()?;
        if let Some(rt) = hints.retain {
            r.holds().expiry(now, rt.ttl_ms)?;
        }
        let undo = match hashes {
            Some(src) => Some(self.sync_hashes(s, src)?),
            None => None,
        };
        let hbs = self.cfg.hash_block_size;
        let hashed = self.reqs[s as usize].hashes.len() as u64 * hbs as u64;
        let align = self.hit_alignment.max(1);
        let mut out = HintOutcome::default();
        let mut checkpoints = Vec::with_capacity(hints.checkpoints.len());
        for &p in hints.checkpoints {
            let c = p / align * align;
            if c as u64 > hashed {
                if let Some(u) = undo {
                    self.undo_hashes(s, u);
                }
                return Err(Error::OutOfRange(format!("checkpoint {p} is past the request's {hashed} hashed tokens")));
            }
            if c == 0 {
                out.checkpoints_refused += 1;
            } else {
                out.checkpoints_applied += 1;
                checkpoints.push(c);
            }
        }
        checkpoints.sort_unstable();
        checkpoints.dedup();
        if !self.managers.iter().any(|m| m.is_mamba_align()) {
            checkpoints.clear();
        }
        let pin_keys = match (hints.pin, pin_expiry) {
            (Some(pin), Some(expiry)) => {
                let hashes = &self.reqs[s as usize].hashes;
                let n = if pin.tokens == 0 { hashes.len() } else { ((pin.tokens / hbs) as usize).min(hashes.len()) };
                Some((self.prefix_keys(&hashes[..n]), expiry))
            }
            _ => None,
        };
        // `retention()` answered above, so the policy's handle is there; were it not, nothing
        // has changed but the hashes, which go back.
        let Some(mut ha) = self.pool.hit_aware() else {
            if let Some(u) = undo {
                self.undo_hashes(s, u);
            }
            return Err(Error::Unsupported("KV hints need the hit-aware policy with prefix caching on".into()));
        };
        // Checked; the changes.
        if let Some((keys, expiry)) = pin_keys {
            out.pin =
                if ha.lease(keys, hints.session, expiry) { PinOutcome::Applied } else { PinOutcome::RefusedOverCap };
        }
        let st = ha.hint_stats_mut();
        st.requests += 1;
        st.checkpoints_applied += out.checkpoints_applied as u64;
        st.checkpoints_refused += out.checkpoints_refused as u64;
        let req = &mut self.reqs[s as usize];
        req.hit_aware.stops = !checkpoints.is_empty();
        req.hints = Some(Box::new(ReqHints {
            session: hints.session,
            retain: hints.retain,
            release: hints.release_session,
            checkpoints,
            marked: 0,
        }));
        Ok(out)
    }

    /// Drops `h`'s KV hints (the checkpoints, the retain and the release it would apply when
    /// freed; a lease it took runs on): the vLLM adapter's call before it frees a request
    /// vLLM preempts, which is not finished. O(1).
    ///
    /// # Errors
    /// Unknown handle.
    pub fn clear_hints(&mut self, h: ReqHandle) -> Result<()> {
        let s = self.slot(h)?;
        let req = &mut self.reqs[s as usize];
        req.hints = None;
        req.hit_aware.stops = false;
        Ok(())
    }

    /// The manager's clock reads `now_ms` (milliseconds of any monotonic clock; the vLLM
    /// adapter calls it at most once per scheduler step, with `time.monotonic`): the KV
    /// hints' leases and retains due by then end, and their blocks still under the keys they
    /// held go back to the normal level. Later hints' TTLs count from this time. Returns the
    /// holds ended and when the next one ends (`None`: none runs). O(1) when nothing is due,
    /// else O(log holds + keys) per hold ended.
    ///
    /// # Errors
    /// [`Error::Unsupported`] under `exact` or with prefix caching off.
    pub fn advance_clock(&mut self, now_ms: u64) -> Result<(u32, Option<u64>)> {
        let Some(mut ha) = self.pool.hit_aware() else {
            return Err(Error::Unsupported("KV hints need the hit-aware policy with prefix caching on".into()));
        };
        let ended = ha.advance_clock(now_ms);
        Ok((ended, ha.holds().next_expiry()))
    }

    /// Releases `session` now: every lease and retain its requests' hints left ends, and
    /// their blocks go to the front of the speculative level (evicted first) unless another
    /// hold, a branch point or a shared prefix needs them. Returns the holds ended.
    /// O(keys of the session's holds).
    ///
    /// # Errors
    /// [`Error::Unsupported`] under `exact` or with prefix caching off.
    pub fn release_session(&mut self, session: u64) -> Result<u32> {
        match self.pool.hit_aware() {
            Some(mut ha) => Ok(ha.release_session(session)),
            None => Err(Error::Unsupported("KV hints need the hit-aware policy with prefix caching on".into())),
        }
    }

    /// Two-level pages (`slots_per_page = k > 1`): `what` (a pin, a lease, a retain: the
    /// user's levels) is not served. A pinned or leased slot must outlive every free page of
    /// lower levels and count in the pinned share while its page is free, which the page
    /// queue does not do yet (docs/two-level-pages.md, "Hit-aware").
    ///
    /// # Errors
    /// [`Error::Unsupported`] with two-level pages.
    fn refuse_pins_over_pages(&self, what: &str) -> Result<()> {
        if self.state_groups == 0 {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "{what} is not served with slots_per_page={} > 1 (hit-aware over two-level pages serves \
             its own levels, branch points and junctions, not the user's pins, leases or retains)",
            self.cfg.slots_per_page
        )))
    }

    /// The KV hints' counters and gauges (all zero under `exact`).
    pub fn hint_stats(&self) -> HintStats {
        self.pool.retention().map_or_else(HintStats::default, |r| r.hint_stats())
    }

    /// The first of `s`'s checkpoints past `hit` tokens, if within `max_len` (0: none). O(1)
    /// without hints, else O(log checkpoints).
    fn next_checkpoint(&self, s: Slot, hit: u32, max_len: u32) -> u32 {
        let Some(hints) = self.reqs[s as usize].hints.as_deref() else { return 0 };
        let cs = &hints.checkpoints;
        match cs.get(cs.partition_point(|&c| c <= hit)) {
            Some(&c) if c <= max_len => c,
            _ => 0,
        }
    }

    /// KV hints, after an allocation of `s` computing up to `end` tokens with `boundary` as
    /// its `shared_prefix_boundary`: each checkpoint it reached whose state set is cached is
    /// marked a branch point (kept when passed, at least at the normal level); one passed
    /// without its state is given up. When the allocation reached the reported boundary the
    /// junction moves to the next checkpoint ([`Self::take_moved_junction`]). O(checkpoints
    /// reached x Mamba groups).
    fn advance_checkpoints(&mut self, s: Slot, end: u64, boundary: u32) {
        let groups: Vec<GroupId> = self.managers.iter().filter(|m| m.is_mamba_align()).map(|m| m.group_id()).collect();
        let hbs = self.cfg.hash_block_size;
        let sp = self.state_groups != 0;
        let Self { pool, reqs, .. } = self;
        let req = &mut reqs[s as usize];
        let Some(hints) = req.hints.as_deref_mut() else {
            req.hit_aware.stops = false;
            return;
        };
        let mut found = Vec::new();
        while let Some(&c) = hints.checkpoints.get(hints.marked) {
            if c as u64 > end {
                break;
            }
            let hash = req.hashes[(c / hbs) as usize - 1];
            // Two-level pages: the states are in the page pool; the counters in this one's.
            if !groups.is_empty() && pool.side_ref(sp).get_cached_block(&hash, &groups, &mut found) {
                if let Some(mut ha) = pool.side(sp).hit_aware() {
                    for &b in &found {
                        ha.mark_branch(b);
                        if ha.level(b) < LEVEL_NORMAL {
                            ha.set_level(b, LEVEL_NORMAL);
                        }
                    }
                }
                if let Some(mut ha) = pool.hit_aware() {
                    ha.hint_stats_mut().checkpoint_states += 1;
                }
            } else if c as u64 == end {
                // Keyed by a later caching call of this chunk, maybe: looked for again then.
                break;
            }
            hints.marked += 1;
        }
        if boundary > 0 && end >= boundary as u64 {
            let next = hints.checkpoints[hints.marked..].iter().copied().find(|&c| c as u64 > end).unwrap_or(0);
            let moved = &mut req.hit_aware.moved_junction;
            if next > 0 && (*moved == 0 || next < *moved) {
                *moved = next;
            }
        }
        req.hit_aware.stops = hints.marked < hints.checkpoints.len();
    }

    /// KV hints, `free`'s (and `pop_blocks_for_free`'s) hook, once the policy set the levels
    /// `s`'s blocks are freed at and before they go back: its retain (the cached blocks of its
    /// prefix a hit needs and the state at its end, at the retain's level until its TTL,
    /// counted from now). Returns the session to release once its blocks are back
    /// ([`Self::release_at_free`]; 0: none). Nothing for a request without hints. O(prefix
    /// blocks x groups).
    pub(super) fn retain_at_free(&mut self, s: Slot) -> u64 {
        let Some(hints) = self.reqs[s as usize].hints.take() else { return 0 };
        self.reqs[s as usize].hit_aware.stops = false;
        if let Some(rt) = hints.retain {
            let blocks = self.retained_blocks(s, rt.tokens);
            if let Some(mut ha) = self.pool.hit_aware() {
                let now = ha.holds().now_ms();
                // The TTL was checked when the hints were set; a clock moved since can only
                // saturate at the far end of u64.
                let expiry = now.saturating_add(rt.ttl_ms);
                ha.retain(&blocks, rt.priority.level(), hints.session, expiry);
            }
        }
        hints.release
    }

    /// KV hints: the session release a freed request asked for ([`Self::retain_at_free`]),
    /// once its blocks are back in the pool (so the released ones go to the front of the
    /// queue). O(keys of the session's holds).
    pub(super) fn release_at_free(&mut self, session: u64) {
        if session != 0 {
            if let Some(mut ha) = self.pool.hit_aware() {
                ha.release_session(session);
            }
        }
    }

    /// The cached blocks a retain of `s`'s first `tokens` tokens (0: all it hashed) holds
    /// (each keyed now: `retain` reads its key for itself): the blocks of the prefix a hit there needs in each attention
    /// group (every block, or a window's tail), and the furthest state set at or before its
    /// end cached in every Mamba "align" group, with the full-attention block keyed there
    /// (inside a block, with partial hash hits). The pool's lookups only (second keys
    /// count). An attention group's block is read from `s`'s own table where it is the one
    /// the lookup would find (the pool's `is_first_cached`, no hashing), else looked up.
    /// O(prefix blocks x groups).
    fn retained_blocks(&self, s: Slot, tokens: u32) -> Vec<BlockId> {
        let hbs = self.cfg.hash_block_size;
        let all = &self.reqs[s as usize].hashes;
        let n = if tokens == 0 { all.len() } else { ((tokens / hbs) as usize).min(all.len()) };
        let hashes = &all[..n];
        let (mut out, mut found) = (Vec::with_capacity(2 * n + 4), Vec::new());
        let pool = &self.pool;
        let mut take = |hash: &BlockHash, g: GroupId, out: &mut Vec<BlockId>| {
            if pool.get_cached_block(hash, &[g], &mut found) && pool.block_hash(found[0]).is_some() {
                out.push(found[0]);
            }
        };
        let attention = || {
            self.managers.iter().filter(|m| {
                m.kind().is_prefix_cacheable() && !m.kind().sized_by_encoder_tokens() && !m.is_mamba_align()
            })
        };
        for m in attention() {
            let view = HashView { hashes, scale: m.block_size() / hbs };
            let k = view.len();
            let from = m.hit_tail_blocks().map_or(0, |t| k.saturating_sub(t));
            let (g, table) = (m.group_id(), m.blocks(s));
            for i in from..k {
                let key = (view.get(i), g);
                match table.get(i as usize) {
                    Some(&b) if pool.is_first_cached(b, &key) => out.push(b),
                    _ => take(&key.0, g, &mut out),
                }
            }
        }
        let states: Vec<GroupId> = self.managers.iter().filter(|m| m.is_mamba_align()).map(|m| m.group_id()).collect();
        if states.is_empty() {
            return out;
        }
        let mut set = Vec::new();
        for j in (1..=n).rev() {
            if !pool.get_cached_block(&hashes[j - 1], &states, &mut set) {
                continue;
            }
            out.extend(set.iter().copied().filter(|&b| pool.block_hash(b).is_some()));
            let end = j as u64 * hbs as u64;
            for m in attention().filter(|m| end % m.block_size() as u64 != 0) {
                take(&hashes[j - 1], m.group_id(), &mut out);
            }
            break;
        }
        out
    }
}
