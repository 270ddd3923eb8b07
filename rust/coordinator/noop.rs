//! The no-op path: per request, the limits under which a plain step provably changes
//! nothing (kept equal to what its tables imply by every call that changes them), and
//! `plain_step`, the scheduler's per-request `allocate_slots` answered from them without
//! running any allocation code.
//!
//! Cost: `plain_step` on a no-op is O(1), reads at most five request fields and allocates
//! nothing; `refresh_noop` is O(groups).
#![forbid(unsafe_code)]

use super::{token_count, AllocateArgs, Allocator, HashSource, NewComputed};

use crate::config::CoordinatorKind;
use crate::error::{Error, Result};
use crate::ids::{ReqHandle, Slot};

/// `x` capped at `u32::MAX`.
#[inline]
fn clamp(x: u64) -> u32 {
    x.min(u32::MAX as u64) as u32
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
    /// Proves everything (the identity of the component-wise minimum).
    pub const ANY: Self =
        Self { slots: u32::MAX, processed: u32::MAX, cached: u32::MAX, new_tokens: u32::MAX, prompt: 0 };

    /// The component-wise minimum with one group's limits (the prompt bound is left).
    pub(super) fn min(self, (slots, processed, cached, new_tokens): (u32, u32, u32, u32)) -> Self {
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

impl Allocator {
    pub(super) fn refresh_noop(&mut self, s: Slot) {
        self.reqs[s as usize].noop = self.compute_noop(s);
    }

    /// The component-wise minimum of every group's [`SingleTypeManager::noop_limits`] (the
    /// largest of their prompt bounds). Where the coordinator caches only up to a multiple
    /// of the scheduler block ([`Self::cache_target`]: hybrid, no partial hash hits), each
    /// group's `cached` limit is rounded up to that multiple: a plain step caches only at
    /// its cache target, which stays below a limit `t` while the step stays below `t`
    /// rounded up. (It matters where a group keys below the scheduler block, as under
    /// two-level pages: 64-token slots, a Mamba "align" prompt checkpoint on the 64-token
    /// hash grid, 1088-token scheduler blocks; elsewhere the limits are multiples already.)
    pub(super) fn compute_noop(&self, s: Slot) -> NoopLimits {
        let sbs = self.cfg.scheduler_block_size as u64;
        let round = matches!(self.kind, CoordinatorKind::Hybrid) && !self.partial_hash_hits && sbs > 1;
        let mut lim = NoopLimits::ANY;
        for m in &self.managers {
            let (slots, processed, mut cached, new_tokens) = m.noop_limits(s);
            // A group dropping the EAGLE block caches past the scheduler block
            // ([`Self::group_cache_target`]): its limit stays as it is.
            if round && cached != u32::MAX && !m.eagle() {
                cached = clamp((cached as u64).div_ceil(sbs) * sbs);
            }
            lim = lim.min((slots, processed, cached, new_tokens));
            lim.prompt = lim.prompt.max(m.noop_min_prompt(s));
        }
        lim
    }

    /// Whether `a` is a plain step (see [`NoopLimits`]) that the request's limits prove
    /// changes nothing.
    pub(super) fn is_noop(&self, s: Slot, a: &AllocateArgs) -> bool {
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
    /// minimum of every group's limits, `SingleTypeManager::noop_limits`).
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
        let computed = token_count("num_computed_tokens", req.num_computed_tokens()?)? as u64;
        let lim = self.reqs[s as usize].noop;
        let to_cache = computed + new;
        if new > 0 && new <= lim.new_tokens as u64 && to_cache + look <= lim.slots as u64 {
            // In-flight tokens only lower `computed - inflight`: below the limit with `computed` alone,
            // `num_in_flight_tokens` is not read (a decode step of full attention, or of a
            // window longer than the context, reads one field fewer).
            let below = computed < lim.processed as u64
                || computed.saturating_sub(token_count("num_in_flight_tokens", req.num_in_flight_tokens()?)? as u64)
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
            num_computed_tokens: computed as u32,
            num_in_flight_tokens: token_count("num_in_flight_tokens", req.num_in_flight_tokens()?)?,
            num_prompt_tokens: token_count("num_prompt_tokens", req.num_prompt_tokens()?)?,
            num_tokens: token_count("num_tokens", req.num_tokens()?)?,
            shared_prefix_boundary: token_count("shared_prefix_boundary", req.shared_prefix_boundary()?)?,
            // vLLM's scheduler step: exact to vLLM's manager, whatever the request carries.
            trust_computed_tokens: true,
            ..AllocateArgs::default()
        };
        let r = req.with_block_hashes(|src| Ok(self.allocate_slots(h, &a, NewComputed::Empty, Some(src))?))?;
        Ok(PlainStep::Allocated(r))
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
