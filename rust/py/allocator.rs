//! `Allocator`, the native allocator class (one per vLLM `KVCacheManager`): its
//! per-request half, every call that takes a request handle. The pool-wide half (pool and
//! prefix-cache state, events, pinning) is its base class `AllocatorBase` (`pool.rs`), which
//! holds the core. Each method converts its arguments (`convert`), makes one core call and
//! converts the result; the rules (defaults, filters, levels, the kind registry) are the
//! core's ([`crate::api`]).
#![forbid(unsafe_code)]

use std::sync::MutexGuard;

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::block_ids::{tuple_of_groups, PyBlockIds};
use super::convert::{handle_arg, hit_arg, u32_arg, u64_arg, PyHashes};
use super::kwargs::{AllocateOptions, BlockCountOptions, HintOptions, NewOptions};
use super::pool::PyAllocatorBase;
use super::results::PyNoopLimits;
use crate::api::{self, AllocateRequest};
use crate::coordinator::{
    Allocator, BlockCountArgs, CacheBlocksArgs, HashSource, PinHint, PinOutcome, RequestHints, RetainHint,
    RetainPriority,
};
use crate::error::Error;

/// `get_computed_blocks_for_connector`'s result: `(hit tokens, uncached shared-prefix tokens,
/// per-group hit lengths or None, hit block ids per group)`.
type ConnectorHitResult = (u32, u32, Option<Vec<u32>>, Py<PyAny>);

/// `set_hints`' arguments, `handle` included: at most this many by position.
const HINT_ARGS: usize = 10;

/// The native allocator: one per vLLM `KVCacheManager`. Its state is its base's.
#[pyclass(module = "hybrid_alloc._core", name = "Allocator", extends = PyAllocatorBase, frozen)]
pub struct PyAllocator;

/// The core of `slf` (see [`PyAllocatorBase::core`]).
pub(super) fn core<'a>(slf: &'a Bound<'_, PyAllocator>) -> PyResult<MutexGuard<'a, Allocator>> {
    slf.as_super().get().core()
}

#[pymethods]
impl PyAllocator {
    /// Builds an allocator. `groups` holds one group spec per KV cache group (an object with
    /// `kind`, `block_size`, `spec_key` and its kind's fields, e.g. `hybrid_alloc.specs`), or
    /// the legacy tuple `(kind, block_size, spec_key, param1, param2[, param3])` whose params
    /// are the kind's fields in order; groups with equal `spec_key` are looked up together.
    #[new]
    #[pyo3(signature = (num_blocks, groups, hash_block_size, scheduler_block_size, max_model_len, *options,
        **keywords))]
    #[pyo3(text_signature = "(num_blocks, groups, hash_block_size, scheduler_block_size, max_model_len, \
        max_in_flight_tokens=None, enable_caching=True, enable_events=False, watermark_blocks=0, \
        retention_interval=0, policy='exact', zero_new_blocks=False, hash_lookahead_tokens=0, residency_log=False, \
        boundary_offloads=False, *, slots_per_page=1, prefix_match_unit=None, eagle_drop_groups=(), eagle_junction_tail=False, \
        dcp_world_size=1, admission_headroom_slots=0, reprefillable_tokens=0, eagle_checkpoints=False, \
        mamba_shared_prefix_checkpoint=False)")]
    fn new(
        num_blocks: i64,
        groups: Vec<Bound<'_, PyAny>>,
        hash_block_size: i64,
        scheduler_block_size: i64,
        max_model_len: i64,
        options: &Bound<'_, PyTuple>,
        keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let o = NewOptions::parse(Some(options), keywords)?;
        let (cfg, policy) = o.config(num_blocks, &groups, hash_block_size, scheduler_block_size, max_model_len)?;
        Ok(PyClassInitializer::from(PyAllocatorBase::new(Allocator::new(cfg, policy)?)).add_subclass(Self))
    }

    /// Registers a request; returns its handle (an int, unique in the process).
    fn add_request(slf: &Bound<'_, Self>) -> PyResult<u64> {
        Ok(core(slf)?.add_request())
    }

    /// Brings the request's block hashes up to `block_hashes` (its whole list of `bytes`).
    fn set_block_hashes(slf: &Bound<'_, Self>, handle: i64, block_hashes: &Bound<'_, PyList>) -> PyResult<()> {
        let h = handle_arg(handle)?;
        Ok(core(slf)?.set_hashes(h, &PyHashes(block_hashes))?)
    }

    /// Number of block hashes known for a request.
    fn num_hashes(slf: &Bound<'_, Self>, handle: i64) -> PyResult<usize> {
        Ok(core(slf)?.num_hashes(handle_arg(handle)?)?)
    }

    /// The tokens of the longest cache hit of `block_hashes` (a request's list of `bytes`)
    /// not longer than `max_length` tokens, as `get_computed_blocks` would find it, with no
    /// request and no side effect (vLLM 0.34's `KVCacheManager.get_num_cached_tokens`).
    fn num_cached_tokens(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyList>, max_length: i64) -> PyResult<u32> {
        let max_length = u32_arg("max_length", max_length)?;
        Ok(core(slf)?.num_cached_tokens(&PyHashes(block_hashes), max_length)?)
    }

    /// Syncs the request's `block_hashes`, finds the longest cache hit not longer than
    /// `max_length` tokens and stores it as the request's pending hit. Returns `(hit_tokens,
    /// uncached_common_prefix_tokens, hit block ids per group)`.
    #[pyo3(signature = (handle, max_length, *, block_hashes=None, as_buffer=false))]
    fn get_computed_blocks(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        handle: i64,
        max_length: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        as_buffer: bool,
    ) -> PyResult<(u32, u32, Py<PyAny>)> {
        let h = handle_arg(handle)?;
        let max_length = u32_arg("max_length", max_length)?;
        let mut core = core(slf)?;
        let src = block_hashes.map(PyHashes);
        let hit = core.get_computed_blocks(h, src.as_ref().map(|s| s as &dyn HashSource), max_length)?;
        let core = &*core;
        let ids = PyBlockIds::gather(core.num_groups(), |g| core.stored_hit(h, g))?;
        Ok((hit.num_tokens, hit.num_uncached_common_prefix_tokens, ids.into_py(py, as_buffer)?))
    }

    /// Syncs the request's `block_hashes` and finds the local hit a KV connector's scheduler
    /// takes, stored as the request's pending hit: with `reconcile` (vLLM's
    /// `KVCacheManager.get_computed_blocks_for_connector`) the per-group hit, or the
    /// reconciled one where that does not apply or some group hit deeper than full
    /// attention; without (vLLM's `find_longest_cache_hit_per_group`) always the per-group
    /// one. Returns `(hit_tokens, uncached_common_prefix_tokens, per-group hit lengths or
    /// None for the reconciled hit, hit block ids per group)`.
    #[pyo3(signature = (handle, max_length, *, block_hashes=None, reconcile=true, as_buffer=false))]
    fn get_computed_blocks_for_connector(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        handle: i64,
        max_length: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        reconcile: bool,
        as_buffer: bool,
    ) -> PyResult<ConnectorHitResult> {
        let (h, max_length) = (handle_arg(handle)?, u32_arg("max_length", max_length)?);
        let mut core = core(slf)?;
        let src = block_hashes.map(PyHashes);
        let src = src.as_ref().map(|s| s as &dyn HashSource);
        let c = if reconcile {
            core.get_computed_blocks_for_connector(h, src, max_length)?
        } else {
            let lens = core.find_longest_cache_hit_per_group(h, src, max_length)?;
            let hit = crate::coordinator::Hit { num_tokens: 0, num_uncached_common_prefix_tokens: 0 };
            crate::coordinator::ConnectorHit { hit, per_group: Some(lens) }
        };
        let core = &*core;
        let ids = PyBlockIds::gather(core.num_groups(), |g| core.stored_hit(h, g))?;
        let hit = c.hit;
        Ok((hit.num_tokens, hit.num_uncached_common_prefix_tokens, c.per_group, ids.into_py(py, as_buffer)?))
    }

    /// vLLM's `allocate_slots`. `hit` is `Hit.NONE`, `Hit.STORED` (the hit the last
    /// `get_computed_blocks` found) or explicit block ids, one sequence per group. The
    /// request's fields default to a request whose tokens are exactly those computed and
    /// scheduled now. Returns `None` when the blocks do not fit, else the new block ids of
    /// each group. `request` (vLLM's `Request`, or any object): when the call moves the
    /// request's junction (hit-aware's next first-sighting stop, see `take_moved_junction`),
    /// its `shared_prefix_boundary` attribute is set to it, taking it.
    #[pyo3(signature = (*args, **keywords))]
    #[pyo3(text_signature = "(self, handle, num_new_tokens, *, block_hashes=None, hit=None, \
        num_new_computed_tokens=0, num_lookahead_tokens=0, num_external_computed_tokens=0, \
        delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, \
        apply_watermark=False, num_computed_tokens=0, num_in_flight_tokens=0, num_prompt_tokens=None, \
        num_tokens=None, shared_prefix_boundary=0, skip_zeroing_group_ids=[], as_buffer=False, request=None)")]
    fn allocate_slots<'py>(
        slf: &Bound<'_, Self>,
        args: &Bound<'py, PyTuple>,
        keywords: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        // Read here, not by pyo3's parser (see `kwargs`): `handle` and `num_new_tokens`
        // positionally or by keyword, every other argument by keyword only. No other Rust
        // parameter (not even `py`): pyo3 hands over CPython's tuple and dict untouched only
        // for a signature of exactly `*args, **kwargs`.
        let py = args.py();
        if args.len() > 2 {
            return Err(PyTypeError::new_err(format!(
                "allocate_slots() takes 2 positional arguments but {} were given",
                args.len()
            )));
        }
        let o = AllocateOptions::parse(Some(args), keywords)?;
        let (handle, num_new_tokens): (i64, i64) = (o.handle.required()?, o.num_new_tokens.required()?);
        let h = handle_arg(handle)?;
        let skip_zeroing_group_ids: Vec<i64> = o.skip_zeroing_group_ids.get(Vec::new())?;
        let args = AllocateRequest {
            num_new_tokens,
            num_new_computed_tokens: o.num_new_computed_tokens.get(0)?,
            num_lookahead_tokens: o.num_lookahead_tokens.get(0)?,
            num_external_computed_tokens: o.num_external_computed_tokens.get(0)?,
            delay_cache_blocks: o.delay_cache_blocks.get(false)?,
            num_encoder_tokens: o.num_encoder_tokens.get(0)?,
            full_sequence_must_fit: o.full_sequence_must_fit.get(false)?,
            reserved_blocks: o.reserved_blocks.get(0)?,
            apply_watermark: o.apply_watermark.get(false)?,
            num_computed_tokens: o.num_computed_tokens.get(0)?,
            num_in_flight_tokens: o.num_in_flight_tokens.get(0)?,
            num_prompt_tokens: o.num_prompt_tokens.opt()?,
            num_tokens: o.num_tokens.opt()?,
            shared_prefix_boundary: o.shared_prefix_boundary.get(0)?,
            skip_zeroing_group_ids: &skip_zeroing_group_ids,
            trust_computed_tokens: slf.as_super().get().serves_vllm(),
        }
        .args()?;
        let (block_hashes, hit) = (o.block_hashes.opt::<Bound<'py, PyList>>()?, o.hit.opt::<Bound<'py, PyAny>>()?);
        let as_buffer = o.as_buffer.get(false)?;
        let mut explicit = Vec::new();
        let nc = hit_arg(hit.as_ref(), &mut explicit)?;
        let request = o.request.opt::<Bound<'py, PyAny>>()?;
        let mut core = core(slf)?;
        if let Some(r) = &request {
            if core.may_move_junction(h)? {
                junction_writable(r)?;
            }
        }
        let src = block_hashes.as_ref().map(PyHashes);
        if core.allocate_slots(h, &args, nc, src.as_ref().map(|s| s as &dyn HashSource))?.is_none() {
            return Ok(None);
        }
        let (ids, counts) = (core.new_block_ids(), core.new_block_counts());
        let out = if as_buffer {
            Bound::new(py, PyBlockIds::new(ids, counts))?.into_any()
        } else {
            tuple_of_groups(py, ids, counts)?.into_any()
        };
        let moved = match &request {
            Some(_) => core.take_moved_junction(h)?,
            None => None,
        };
        drop(core);
        if let (Some(r), Some(j)) = (request, moved) {
            r.setattr(intern!(py, "shared_prefix_boundary"), j)?;
        }
        Ok(Some(out))
    }

    /// Sets the request's KV hints in one call (hit-aware only; call it before the
    /// request's lookup). `session`: its session (0: none; a positive int the caller
    /// interns). `retain`: 0 none, 1 low, 2 normal, 3 high, for `retain_ttl_ms` from the
    /// request's free, over its first `retain_tokens` tokens (0: all). `pin_ttl_ms` > 0: a
    /// pin lease on its first `pin_tokens` tokens (0: all) from now. `release_session`: a
    /// session released when the request is freed (0: none). `checkpoints`: prompt
    /// positions where the prefill stops and the state is kept. TTLs count on the
    /// allocator's clock (`advance_clock`). Every argument may be passed by position, in
    /// this order (the adapter's call), or by keyword. Returns `(pin, checkpoints_applied,
    /// checkpoints_refused)`, `pin` 0 not asked, 1 applied, 2 refused over the pinned share.
    #[pyo3(signature = (*args, **keywords))]
    #[pyo3(text_signature = "($self, handle, block_hashes=None, session=0, retain=0, retain_ttl_ms=0, \
        retain_tokens=0, pin_ttl_ms=0, pin_tokens=0, release_session=0, checkpoints=...)")]
    fn set_hints<'py>(
        slf: &Bound<'_, Self>,
        args: &Bound<'py, PyTuple>,
        keywords: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<(u8, u32, u32)> {
        // Read here, not by pyo3's parser, as `allocate_slots` (see `kwargs`): pyo3 hands over
        // CPython's tuple and dict untouched only for a signature of exactly `*args, **kwargs`,
        // and a positional call then matches no name at all.
        if args.len() > HINT_ARGS {
            return Err(PyTypeError::new_err(format!(
                "set_hints() takes at most {HINT_ARGS} positional arguments but {} were given",
                args.len()
            )));
        }
        let o = HintOptions::parse(Some(args), keywords)?;
        let handle: i64 = o.handle.required()?;
        let block_hashes: Option<Bound<'_, PyList>> = o.block_hashes.opt()?;
        let retain: i64 = o.retain.given_or(0)?;
        let retain_ttl_ms: i64 = o.retain_ttl_ms.given_or(0)?;
        let retain_tokens: i64 = o.retain_tokens.given_or(0)?;
        let pin_ttl_ms: i64 = o.pin_ttl_ms.given_or(0)?;
        let pin_tokens: i64 = o.pin_tokens.given_or(0)?;
        let checkpoints: Vec<i64> = o.checkpoints.given_or(Vec::new())?;
        let h = handle_arg(handle)?;
        let priority = match retain {
            0 => None,
            1 => Some(RetainPriority::Low),
            2 => Some(RetainPriority::Normal),
            3 => Some(RetainPriority::High),
            r => {
                return Err(
                    Error::OutOfRange(format!("retain={r} is not 0 (none), 1 (low), 2 (normal) or 3 (high)")).into()
                )
            }
        };
        let retain = match priority {
            Some(priority) => Some(RetainHint {
                priority,
                ttl_ms: u64_arg("retain_ttl_ms", retain_ttl_ms)?,
                tokens: u32_arg("retain_tokens", retain_tokens)?,
            }),
            None => None,
        };
        let pin = match pin_ttl_ms {
            0 => None,
            t => Some(PinHint { ttl_ms: u64_arg("pin_ttl_ms", t)?, tokens: u32_arg("pin_tokens", pin_tokens)? }),
        };
        let checkpoints = checkpoints.iter().map(|&p| u32_arg("checkpoint", p)).collect::<PyResult<Vec<_>>>()?;
        let hints = RequestHints {
            session: u64_arg("session", o.session.given_or(0)?)?,
            retain,
            pin,
            release_session: u64_arg("release_session", o.release_session.given_or(0)?)?,
            checkpoints: &checkpoints,
        };
        let src = block_hashes.as_ref().map(PyHashes);
        let out = core(slf)?.set_hints(h, src.as_ref().map(|s| s as &dyn HashSource), &hints)?;
        let pin = match out.pin {
            PinOutcome::NotAsked => 0,
            PinOutcome::Applied => 1,
            PinOutcome::RefusedOverCap => 2,
        };
        Ok((pin, out.checkpoints_applied, out.checkpoints_refused))
    }

    /// Drops the request's KV hints (its checkpoints, and the retain and release its free
    /// would apply; a lease it took runs on): before freeing a request that is not finished
    /// (vLLM preempted it).
    fn clear_hints(slf: &Bound<'_, Self>, handle: i64) -> PyResult<()> {
        Ok(core(slf)?.clear_hints(handle_arg(handle)?)?)
    }

    /// Whether the next `allocate_slots` of `handle` may move its junction (hit-aware's
    /// first-sighting stops: see `take_moved_junction`).
    fn may_move_junction(slf: &Bound<'_, Self>, handle: i64) -> PyResult<bool> {
        Ok(core(slf)?.may_move_junction(handle_arg(handle)?)?)
    }

    /// The junction the last `allocate_slots` of `handle` moved its `shared_prefix_boundary`
    /// to, taken (0: not moved, or taken already). Hit-aware with Mamba "align" groups only:
    /// a request nothing was shared with on its lookup ends prefill chunks at 1, 2, 4, 8, ...
    /// blocks (each state is cached there); the lookup reports the first stop, and each
    /// allocation reaching the reported stop moves it to the next. A caller that does not
    /// pass `request=` to `allocate_slots` passes this as the next call's
    /// `shared_prefix_boundary` and ends its next chunk there.
    fn take_moved_junction(slf: &Bound<'_, Self>, handle: i64) -> PyResult<u32> {
        Ok(core(slf)?.take_moved_junction(handle_arg(handle)?)?.unwrap_or(0))
    }

    /// vLLM's `finalize_partial_tail_offloads` for a finishing request: pops each Mamba
    /// "align" group's producer partial tail and returns those still holding the request's
    /// last state, as flat `[group, block_id, boundary_tokens, ...]`.
    fn finalize_partial_tail_offloads<'py>(
        slf: &Bound<'py, Self>,
        handle: i64,
        num_computed_tokens: i64,
        num_in_flight_tokens: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let flat = core(slf)?.finalize_partial_tail_offloads(
            handle_arg(handle)?,
            num_computed_tokens,
            num_in_flight_tokens,
        )?;
        PyList::new(slf.py(), flat)
    }

    /// Records the request's blocks from token `start_token` on for zeroing again (vLLM's
    /// `record_blocks_for_zeroing`).
    fn record_blocks_for_zeroing(slf: &Bound<'_, Self>, handle: i64, start_token: i64) -> PyResult<()> {
        let (h, start) = (handle_arg(handle)?, u32_arg("start_token", start_token)?);
        Ok(core(slf)?.record_blocks_for_zeroing(h, start)?)
    }

    /// The request's no-op limits: what a plain step may ask without changing anything.
    fn noop_limits(slf: &Bound<'_, Self>, handle: i64) -> PyResult<PyNoopLimits> {
        Ok(core(slf)?.noop_limits(handle_arg(handle)?)?.into())
    }

    /// Syncs the request's `block_hashes` and caches full blocks up to `num_computed_tokens`
    /// (`request_computed_tokens`: the request's own `num_computed_tokens`, read only by
    /// vLLM's shared-prefix checkpoint).
    #[pyo3(signature = (handle, num_computed_tokens, *, block_hashes=None, num_prompt_tokens=None,
        shared_prefix_boundary=0, request_computed_tokens=0))]
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        handle: i64,
        num_computed_tokens: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        num_prompt_tokens: Option<i64>,
        shared_prefix_boundary: i64,
        request_computed_tokens: i64,
    ) -> PyResult<()> {
        let h = handle_arg(handle)?;
        let (n, p, s) = api::cache_blocks_counts(num_computed_tokens, num_prompt_tokens, shared_prefix_boundary)?;
        let c = CacheBlocksArgs {
            num_computed_tokens: n,
            num_prompt_tokens: p,
            shared_prefix_boundary: s,
            request_computed_tokens: u32_arg("request_computed_tokens", request_computed_tokens)?,
        };
        let mut core = core(slf)?;
        let src = block_hashes.map(PyHashes);
        Ok(core.cache_blocks(h, &c, src.as_ref().map(|s| s as &dyn HashSource))?)
    }

    /// Frees out-of-window blocks (vLLM's `remove_skipped_blocks`); with
    /// `num_prompt_tokens` an R-SWA group also frees its gap.
    #[pyo3(signature = (handle, processed_computed_tokens, num_prompt_tokens=None))]
    fn remove_skipped_blocks(
        slf: &Bound<'_, Self>,
        handle: i64,
        processed_computed_tokens: i64,
        num_prompt_tokens: Option<i64>,
    ) -> PyResult<()> {
        let h = handle_arg(handle)?;
        let n = u32_arg("processed_computed_tokens", processed_computed_tokens)?;
        let p = num_prompt_tokens.map(|p| u32_arg("num_prompt_tokens", p)).transpose()?;
        Ok(core(slf)?.remove_skipped_blocks(h, n, p)?)
    }

    /// Blocks needed for `num_tokens` slots, `num_tokens_main_model` of them (default
    /// `num_tokens`) for the target model (vLLM's `coordinator.get_num_blocks_to_allocate`
    /// with no new hit); negative when a Mamba "align" table holds more than it needs.
    /// `prefill_end` is where the request's prefill ends (vLLM's argument); without the
    /// admission cap a Mamba "align" group records the prefill checkpoint it counts, as vLLM's.
    #[pyo3(signature = (handle, num_tokens, **keywords))]
    #[pyo3(text_signature = "(self, handle, num_tokens, *, num_encoder_tokens=0, total_computed_tokens=0, \
        apply_admission_cap=False, num_tokens_main_model=None, prefill_end=0)")]
    fn get_num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        handle: i64,
        num_tokens: i64,
        keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<i64> {
        let o = BlockCountOptions::parse(None, keywords)?;
        let (num_encoder_tokens, total_computed_tokens) =
            (o.num_encoder_tokens.get(0)?, o.total_computed_tokens.get(0)?);
        let (apply_admission_cap, prefill_end) = (o.apply_admission_cap.get(false)?, o.prefill_end.get(0)?);
        let num_tokens_main_model = o.num_tokens_main_model.opt()?;
        let h = handle_arg(handle)?;
        let c = BlockCountArgs {
            num_tokens: u32_arg("num_tokens", num_tokens)?,
            num_tokens_main_model: api::num_tokens_main_model(num_tokens, num_tokens_main_model)?,
            num_encoder_tokens: u32_arg("num_encoder_tokens", num_encoder_tokens)?,
            total_computed_tokens: u32_arg("total_computed_tokens", total_computed_tokens)?,
            apply_admission_cap,
            prefill_end: u32_arg("prefill_end", prefill_end)?,
        };
        Ok(core(slf)?.get_num_blocks_to_allocate(h, &c)?)
    }

    /// Frees every block of the request, tail first, and releases its handle. `retain`
    /// (hit-aware only; ignored under exact): keep what the request leaves cached at the
    /// pinned retention level (evicted last, within the pinned share of the pool).
    #[pyo3(signature = (handle, *, retain=false))]
    fn free(slf: &Bound<'_, Self>, handle: i64, retain: bool) -> PyResult<()> {
        Ok(core(slf)?.free(handle_arg(handle)?, api::free_level(retain))?)
    }

    /// Releases the handle and returns its blocks (groups concatenated) without freeing.
    fn pop_blocks_for_free<'py>(slf: &Bound<'_, Self>, py: Python<'py>, handle: i64) -> PyResult<Bound<'py, PyList>> {
        let (h, mut out) = (handle_arg(handle)?, Vec::new());
        core(slf)?.pop_blocks_for_free(h, &mut out)?;
        PyList::new(py, out)
    }

    /// The block tables of a request, one list per group.
    #[pyo3(signature = (handle, *, as_buffer=false))]
    fn block_ids(slf: &Bound<'_, Self>, py: Python<'_>, handle: i64, as_buffer: bool) -> PyResult<Py<PyAny>> {
        let h = handle_arg(handle)?;
        let ids = {
            let core = core(slf)?;
            let core = &*core;
            PyBlockIds::gather(core.num_groups(), |g| core.blocks(h, g))?
        };
        ids.into_py(py, as_buffer)
    }

    /// vLLM's `estimate_cached_tokens`.
    fn estimate_cached_tokens(slf: &Bound<'_, Self>, handle: i64) -> PyResult<u32> {
        Ok(core(slf)?.estimate_cached_tokens(handle_arg(handle)?)?)
    }
}

/// Checks, before a call that may move a request's junction changes anything, that the moved
/// junction can be written back: `request.shared_prefix_boundary` is read and set to itself.
/// An object without the attribute, or one that refuses the write, raises here, so the call
/// changes nothing.
pub(super) fn junction_writable(request: &Bound<'_, PyAny>) -> PyResult<()> {
    let name = intern!(request.py(), "shared_prefix_boundary");
    request.setattr(name, request.getattr(name)?)
}
