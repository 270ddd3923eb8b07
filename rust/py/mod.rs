//! The Python binding (`hybrid_alloc._core`): the only place that names pyo3. It converts
//! arguments and results and maps errors to the exception hierarchy; every rule (what is
//! refused, the no-op limits of the fast path, hash sync, handle generations) lives in the
//! core. One Python-to-Rust crossing per call; ints, bytes and flat lists cross the
//! boundary, never an object per block.
//!
//! Threads: an `Allocator` is meant for one thread at a time (vLLM's scheduler is one). Its
//! core sits behind a mutex that is only ever *tried*: a call made while another call on the
//! same allocator is in progress (another thread, or re-entry from Python code the first call
//! runs, such as a `Request` property read by `FastAllocate`) raises `ConcurrentUseError` and
//! changes nothing; calls never block and never interleave. If an internal invariant ever
//! breaks (a panic, our bug), the allocator refuses every later call with `InvariantError`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::block_pool::Event;
use crate::config::{AttentionKind, Config, GroupSpec};
use crate::coordinator::{
    token_count, AllocateArgs, Allocator, BlockCountArgs, CacheBlocksArgs, HashSource, NewComputed, PlainStep,
    StepFields,
};
use crate::error::Error;
use crate::ids::{BlockHash, BlockId, GroupId};

create_exception!(_core, HybridAllocError, PyException, "Base class of every hybrid_alloc error.");
create_exception!(_core, InvalidConfigError, HybridAllocError, "The configuration is invalid.");
create_exception!(
    _core,
    UnsupportedConfigError,
    HybridAllocError,
    "The configuration is valid for vLLM but not served by the native core."
);
create_exception!(_core, UnknownRequestError, HybridAllocError, "The request handle is not live.");
create_exception!(_core, OutOfRangeError, HybridAllocError, "A count or index is out of range.");
create_exception!(_core, InvalidBlockError, HybridAllocError, "A block id is invalid or in the wrong state.");
create_exception!(_core, InvariantError, HybridAllocError, "An internal invariant is violated (a bug).");
create_exception!(
    _core,
    ConcurrentUseError,
    HybridAllocError,
    "The allocator was called while another call on it was in progress (threads or re-entry)."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::InvalidConfig(_) => InvalidConfigError::new_err(msg),
            Error::Unsupported(_) => UnsupportedConfigError::new_err(msg),
            Error::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            Error::OutOfRange(_) => OutOfRangeError::new_err(msg),
            Error::InvalidBlock(_) => InvalidBlockError::new_err(msg),
            Error::OutOfMemory(_) => PyMemoryError::new_err(msg),
        }
    }
}

fn u32_arg(name: &str, v: i64) -> PyResult<u32> {
    Ok(token_count(name, v)?)
}

/// A block id from a Python int; a negative or too large one is an `InvalidBlockError`.
fn block_id_arg(b: i64) -> PyResult<BlockId> {
    u32::try_from(b).map_err(|_| InvalidBlockError::new_err(format!("block id {b}")))
}

fn block_ids_arg(ids: &[i64]) -> PyResult<Vec<BlockId>> {
    ids.iter().map(|&b| block_id_arg(b)).collect()
}

/// A handle from a Python int; one that cannot be a handle is unknown.
fn handle_arg(h: i64) -> PyResult<u64> {
    u64::try_from(h).map_err(|_| UnknownRequestError::new_err(format!("unknown request handle {h}")))
}

/// One `groups` entry of the constructor: `(kind, block_size, spec_key, param1, param2)`,
/// or with a `param3` (a Mamba "align" group's prefill checkpoint alignment).
#[derive(FromPyObject)]
enum GroupArg {
    Six((String, i64, i64, i64, i64, i64)),
    Five((String, i64, i64, i64, i64)),
}

fn parse_kind(kind: &str, p1: i64, p2: i64, p3: i64) -> PyResult<AttentionKind> {
    Ok(match kind {
        "full" | "mla" => AttentionKind::Full,
        "sliding_window" => AttentionKind::SlidingWindow {
            window: u32_arg("sliding_window", p1)?,
            extra_retained_tokens: u32_arg("extra_retained_tokens", p2)?,
        },
        "rswa" => AttentionKind::Rswa { window: u32_arg("rswa_window", p1)? },
        "chunked_local" => AttentionKind::ChunkedLocal { chunk: u32_arg("attention_chunk_size", p1)? },
        "cross" => AttentionKind::Cross,
        "circular_buffer" => AttentionKind::CircularBuffer,
        "mamba" => AttentionKind::Mamba {
            speculative_blocks: u32_arg("num_speculative_blocks", p1)?,
            align: false,
            rekey_cached_tail: false,
            checkpoint_alignment: 0,
        },
        // param2: 1 for vLLM 0.32's rule (re-key the prompt's cached checkpoint state), 0 for 0.33's;
        // param3: the prefill checkpoint alignment (0: no prefill checkpoint blocks).
        "mamba_align" => AttentionKind::Mamba {
            speculative_blocks: u32_arg("num_speculative_blocks", p1)?,
            align: true,
            rekey_cached_tail: p2 != 0,
            checkpoint_alignment: u32_arg("prefill_checkpoint_alignment", p3)?,
        },
        other => {
            return Err(UnsupportedConfigError::new_err(format!(
                "attention kind {other:?} is not served (full, mla, rswa, sliding_window, chunked_local, \
                 cross, mamba, mamba_align, circular_buffer are)"
            )))
        }
    })
}

/// A Python list of `bytes` as the core's [`HashSource`].
struct PyHashes<'a, 'py>(&'a Bound<'py, PyList>);

impl HashSource for PyHashes<'_, '_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, i: usize) -> crate::Result<BlockHash> {
        let item = self.0.get_item(i).map_err(|_| Error::OutOfRange(format!("block hash {i} vanished")))?;
        let bytes = item.cast::<PyBytes>().map_err(|_| Error::OutOfRange(format!("block hash {i} is not bytes")))?;
        let b = bytes.as_bytes();
        BlockHash::from_bytes(b)
            .ok_or_else(|| Error::OutOfRange(format!("block hash {i} has {} bytes (1 to 32 are valid)", b.len())))
    }
}

/// Where `allocate_slots` takes the request's new cache-hit blocks from, besides explicit
/// block ids (one list per group).
#[pyclass(module = "hybrid_alloc._core", name = "Hit", eq, eq_int, frozen)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PyHit {
    /// No new hit.
    #[pyo3(name = "NONE")]
    Empty,
    /// The hit the last `get_computed_blocks` of this request found (revalidated).
    #[pyo3(name = "STORED")]
    Stored,
}

fn tuple_of_groups<'py>(py: Python<'py>, ids: &[BlockId], counts: &[u32]) -> PyResult<Bound<'py, PyTuple>> {
    let mut off = 0usize;
    let mut lists = Vec::with_capacity(counts.len());
    for &c in counts {
        lists.push(PyList::new(py, &ids[off..off + c as usize])?);
        off += c as usize;
    }
    PyTuple::new(py, lists)
}

/// Block ids of several groups in one flat buffer (4 bytes an id): what the adapter gets
/// back from a call that may hand out thousands of ids (an admission, a block table, a hit),
/// so that no Python int is made for an id nobody reads. `lists()` makes fresh lists.
#[pyclass(module = "hybrid_alloc._core", name = "BlockIds", frozen)]
pub struct PyBlockIds {
    ids: Vec<BlockId>,
    counts: Vec<u32>,
}

impl PyBlockIds {
    fn new(ids: &[BlockId], counts: &[u32]) -> Self {
        Self { ids: ids.to_vec(), counts: counts.to_vec() }
    }

    /// A request's table, or its stored hit, in every group.
    fn gather<'a>(num_groups: usize, group: impl Fn(usize) -> crate::Result<&'a [BlockId]>) -> PyResult<Self> {
        let mut ids = Vec::new();
        let mut counts = Vec::with_capacity(num_groups);
        for g in 0..num_groups {
            let v = group(g)?;
            counts.push(v.len() as u32);
            ids.extend_from_slice(v);
        }
        Ok(Self { ids, counts })
    }
}

#[pymethods]
impl PyBlockIds {
    /// Fresh lists of ids, one per group.
    fn lists<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        tuple_of_groups(py, &self.ids, &self.counts)
    }

    /// Whether every group is empty.
    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The number of ids in each group.
    fn counts(&self) -> Vec<u32> {
        self.counts.clone()
    }

    /// The number of groups.
    fn __len__(&self) -> usize {
        self.counts.len()
    }

    fn __repr__(&self) -> String {
        let mut off = 0usize;
        let groups: Vec<String> = self
            .counts
            .iter()
            .map(|&c| {
                let g = &self.ids[off..off + c as usize];
                off += c as usize;
                format!("{g:?}")
            })
            .collect();
        format!("BlockIds({})", groups.join(", "))
    }
}

/// The native allocator: one per vLLM `KVCacheManager`.
#[pyclass(module = "hybrid_alloc._core", name = "Allocator", frozen)]
pub struct PyAllocator {
    inner: Mutex<Allocator>,
    /// Set once a `FastAllocate` serves this allocator (the vLLM adapter): its
    /// `allocate_slots` is then exact to vLLM's manager and trusts the request's computed
    /// tokens ([`AllocateArgs::trust_computed_tokens`]); the direct API checks them.
    serves_vllm: AtomicBool,
}

impl PyAllocator {
    /// The core, or `ConcurrentUseError` when a call on this allocator is in progress.
    fn core(&self) -> PyResult<MutexGuard<'_, Allocator>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::WouldBlock) => Err(ConcurrentUseError::new_err(
                "the allocator is in use by another call (another thread, or a callback of a call \
                 in progress); an Allocator serves one thread at a time",
            )),
            Err(TryLockError::Poisoned(_)) => Err(InvariantError::new_err(
                "an earlier call broke an internal invariant (a bug); this allocator refuses further calls",
            )),
        }
    }

    fn block(core: &Allocator, block_id: i64) -> PyResult<u32> {
        match u32::try_from(block_id) {
            Ok(b) if b < core.pool().num_blocks() => Ok(b),
            _ => {
                Err(InvalidBlockError::new_err(format!("block id {block_id} outside 0..{}", core.pool().num_blocks())))
            }
        }
    }
}

#[pymethods]
impl PyAllocator {
    /// Builds an allocator. `groups` holds one `(kind, block_size, spec_key, param1,
    /// param2[, param3])` per KV cache group: kind is "full", "mla", "sliding_window" (param1
    /// the window, param2 the extra retained tokens), "chunked_local" (param1 the chunk size),
    /// "cross", "circular_buffer", "mamba" (param1 the speculative state blocks) or
    /// "mamba_align" (param1 as "mamba", param2 the 0.32 re-key rule, param3 the prefill
    /// checkpoint alignment, 0 for none); groups with equal `spec_key` are looked up together.
    #[new]
    #[pyo3(signature = (num_blocks, groups, hash_block_size, scheduler_block_size, max_model_len,
        max_in_flight_tokens=None, enable_caching=true, enable_events=false, watermark_blocks=0,
        retention_interval=Some(0), policy="exact", zero_new_blocks=false, hash_lookahead_tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        groups: Vec<GroupArg>,
        hash_block_size: i64,
        scheduler_block_size: i64,
        max_model_len: i64,
        max_in_flight_tokens: Option<i64>,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: i64,
        retention_interval: Option<i64>,
        policy: &str,
        zero_new_blocks: bool,
        hash_lookahead_tokens: i64,
    ) -> PyResult<Self> {
        let policy = crate::policy::Policy::parse(policy)?;
        let mut gs = Vec::with_capacity(groups.len());
        for g in groups {
            let (kind, bs, key, p1, p2, p3) = match g {
                GroupArg::Six(t) => t,
                GroupArg::Five((kind, bs, key, p1, p2)) => (kind, bs, key, p1, p2, 0),
            };
            gs.push(GroupSpec {
                kind: parse_kind(&kind, p1, p2, p3)?,
                block_size: u32_arg("block_size", bs)?,
                spec_key: u32_arg("spec_key", key)?,
            });
        }
        let cfg = Config {
            num_blocks: u32_arg("num_blocks", num_blocks)?,
            groups: gs,
            hash_block_size: u32_arg("hash_block_size", hash_block_size)?,
            scheduler_block_size: u32_arg("scheduler_block_size", scheduler_block_size)?,
            max_model_len: u32_arg("max_model_len", max_model_len)?,
            max_in_flight_tokens: u32_arg("max_in_flight_tokens", max_in_flight_tokens.unwrap_or(max_model_len))?,
            enable_caching,
            enable_events,
            watermark_blocks: u32_arg("watermark_blocks", watermark_blocks)?,
            retention_interval: retention_interval.map(|r| u32_arg("retention_interval", r)).transpose()?,
            zero_new_blocks,
            hash_lookahead_tokens: u32_arg("hash_lookahead_tokens", hash_lookahead_tokens)?,
        };
        Ok(Self { inner: Mutex::new(Allocator::new(cfg, policy)?), serves_vllm: AtomicBool::new(false) })
    }

    /// Registers a request; returns its handle (an int, unique in the process).
    fn add_request(&self) -> PyResult<u64> {
        Ok(self.core()?.add_request())
    }

    /// Brings the request's block hashes up to `block_hashes` (its whole list of `bytes`).
    fn set_block_hashes(&self, handle: i64, block_hashes: &Bound<'_, PyList>) -> PyResult<()> {
        let h = handle_arg(handle)?;
        Ok(self.core()?.set_hashes(h, &PyHashes(block_hashes))?)
    }

    /// Number of block hashes known for a request.
    fn num_hashes(&self, handle: i64) -> PyResult<usize> {
        Ok(self.core()?.num_hashes(handle_arg(handle)?)?)
    }

    /// Syncs the request's `block_hashes`, finds the longest cache hit not longer than
    /// `max_length` tokens and stores it as the request's pending hit. Returns `(hit_tokens,
    /// uncached_common_prefix_tokens, hit block ids per group)`.
    #[pyo3(signature = (handle, max_length, *, block_hashes=None, as_buffer=false))]
    fn get_computed_blocks(
        &self,
        py: Python<'_>,
        handle: i64,
        max_length: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        as_buffer: bool,
    ) -> PyResult<(u32, u32, Py<PyAny>)> {
        let h = handle_arg(handle)?;
        let max_length = u32_arg("max_length", max_length)?;
        let mut core = self.core()?;
        let src = block_hashes.map(PyHashes);
        let hit = core.get_computed_blocks(h, src.as_ref().map(|s| s as &dyn HashSource), max_length)?;
        let ids = {
            let core = &*core;
            PyBlockIds::gather(core.num_groups(), |g| core.stored_hit(h, g))?
        };
        let ids = if as_buffer { Py::new(py, ids)?.into_any() } else { ids.lists(py)?.into_any().unbind() };
        Ok((hit.num_tokens, hit.num_uncached_common_prefix_tokens, ids))
    }

    /// vLLM's `allocate_slots`. `hit` is `Hit.NONE`, `Hit.STORED` (the hit the last
    /// `get_computed_blocks` found) or explicit block ids, one sequence per group. The
    /// request's fields default to a request whose tokens are exactly those computed and
    /// scheduled now. Returns `None` when the blocks do not fit, else the new block ids of
    /// each group.
    #[pyo3(signature = (handle, num_new_tokens, *, block_hashes=None, hit=None,
        num_new_computed_tokens=0, num_lookahead_tokens=0, num_external_computed_tokens=0,
        delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false, reserved_blocks=0,
        apply_watermark=false, num_computed_tokens=0, num_in_flight_tokens=0, num_prompt_tokens=None,
        num_tokens=None, shared_prefix_boundary=0, skip_zeroing_group_ids=Vec::new(), as_buffer=false))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        &self,
        py: Python<'py>,
        handle: i64,
        num_new_tokens: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        hit: Option<&Bound<'_, PyAny>>,
        num_new_computed_tokens: i64,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        apply_watermark: bool,
        num_computed_tokens: i64,
        num_in_flight_tokens: i64,
        num_prompt_tokens: Option<i64>,
        num_tokens: Option<i64>,
        shared_prefix_boundary: i64,
        skip_zeroing_group_ids: Vec<i64>,
        as_buffer: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let h = handle_arg(handle)?;
        let default_tokens = num_computed_tokens
            .saturating_add(num_new_computed_tokens)
            .saturating_add(num_external_computed_tokens)
            .saturating_add(num_new_tokens);
        let num_tokens = num_tokens.unwrap_or(default_tokens);
        let args = AllocateArgs {
            num_new_tokens: u32_arg("num_new_tokens", num_new_tokens)?,
            num_new_computed_tokens: u32_arg("num_new_computed_tokens", num_new_computed_tokens)?,
            num_lookahead_tokens: u32_arg("num_lookahead_tokens", num_lookahead_tokens)?,
            num_external_computed_tokens: u32_arg("num_external_computed_tokens", num_external_computed_tokens)?,
            delay_cache_blocks,
            num_encoder_tokens: u32_arg("num_encoder_tokens", num_encoder_tokens)?,
            full_sequence_must_fit,
            reserved_blocks: u32_arg("reserved_blocks", reserved_blocks)?,
            apply_watermark,
            num_computed_tokens: u32_arg("num_computed_tokens", num_computed_tokens)?,
            num_in_flight_tokens: u32_arg("num_in_flight_tokens", num_in_flight_tokens)?,
            num_prompt_tokens: u32_arg("num_prompt_tokens", num_prompt_tokens.unwrap_or(num_tokens))?,
            num_tokens: u32_arg("num_tokens", num_tokens)?,
            shared_prefix_boundary: u32_arg("shared_prefix_boundary", shared_prefix_boundary)?,
            // Ids of groups the config does not have are ignored, as vLLM ignores them.
            skip_zeroing_groups: skip_zeroing_group_ids
                .iter()
                .filter(|&&g| (0..64).contains(&g))
                .fold(0u64, |m, &g| m | 1 << g),
            trust_computed_tokens: self.serves_vllm.load(Ordering::Relaxed),
        };
        let explicit: Vec<Vec<BlockId>>;
        let nc = match hit {
            None => NewComputed::Empty,
            Some(obj) => match obj.cast::<PyHit>() {
                Ok(k) => match *k.get() {
                    PyHit::Empty => NewComputed::Empty,
                    PyHit::Stored => NewComputed::Stored,
                },
                Err(_) => {
                    let groups: Vec<Vec<i64>> = obj.extract()?;
                    explicit = groups.iter().map(|g| block_ids_arg(g)).collect::<PyResult<_>>()?;
                    NewComputed::Explicit(&explicit)
                }
            },
        };
        let mut core = self.core()?;
        let src = block_hashes.map(PyHashes);
        let res = core.allocate_slots(h, &args, nc, src.as_ref().map(|s| s as &dyn HashSource))?;
        match res {
            None => Ok(None),
            Some(_) if as_buffer => {
                Ok(Some(Bound::new(py, PyBlockIds::new(core.new_block_ids(), core.new_block_counts()))?.into_any()))
            }
            Some(_) => Ok(Some(tuple_of_groups(py, core.new_block_ids(), core.new_block_counts())?.into_any())),
        }
    }

    /// Drains the block ids attention groups handed out since the last call (vLLM's
    /// `take_new_block_ids`, for KV cache zeroing); empty unless `zero_new_blocks`.
    fn take_new_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = self.core()?.take_new_block_ids();
        PyList::new(py, ids)
    }

    /// Records the request's blocks from token `start_token` on for zeroing again (vLLM's
    /// `record_blocks_for_zeroing`).
    fn record_blocks_for_zeroing(&self, handle: i64, start_token: i64) -> PyResult<()> {
        let h = handle_arg(handle)?;
        let start = u32_arg("start_token", start_token)?;
        Ok(self.core()?.record_blocks_for_zeroing(h, start)?)
    }

    /// `(slots, processed, cached, new_tokens)`: a plain step (no new hit, external or
    /// encoder tokens, admission gate, reserve or watermark) with `num_computed_tokens +
    /// num_new_tokens + num_lookahead_tokens <= slots`, `num_computed_tokens -
    /// num_in_flight_tokens < processed`, `min(num_computed_tokens + num_new_tokens,
    /// num_tokens) < cached` and `num_new_tokens <= new_tokens` changes nothing.
    fn noop_limits(&self, handle: i64) -> PyResult<(u32, u32, u32, u32)> {
        let l = self.core()?.noop_limits(handle_arg(handle)?)?;
        Ok((l.slots, l.processed, l.cached, l.new_tokens))
    }

    /// Syncs the request's `block_hashes` and caches full blocks up to `num_computed_tokens`.
    #[pyo3(signature = (handle, num_computed_tokens, *, block_hashes=None, num_prompt_tokens=None,
        shared_prefix_boundary=0))]
    fn cache_blocks(
        &self,
        handle: i64,
        num_computed_tokens: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        num_prompt_tokens: Option<i64>,
        shared_prefix_boundary: i64,
    ) -> PyResult<()> {
        let h = handle_arg(handle)?;
        let n = u32_arg("num_computed_tokens", num_computed_tokens)?;
        let p = u32_arg("num_prompt_tokens", num_prompt_tokens.unwrap_or(num_computed_tokens))?;
        let s = u32_arg("shared_prefix_boundary", shared_prefix_boundary)?;
        let mut core = self.core()?;
        let src = block_hashes.map(PyHashes);
        let c = CacheBlocksArgs { num_computed_tokens: n, num_prompt_tokens: p, shared_prefix_boundary: s };
        Ok(core.cache_blocks(h, &c, src.as_ref().map(|s| s as &dyn HashSource))?)
    }

    /// Frees out-of-window blocks (vLLM's `remove_skipped_blocks`); with
    /// `num_prompt_tokens` an R-SWA group also frees its gap.
    #[pyo3(signature = (handle, processed_computed_tokens, num_prompt_tokens=None))]
    fn remove_skipped_blocks(
        &self,
        handle: i64,
        processed_computed_tokens: i64,
        num_prompt_tokens: Option<i64>,
    ) -> PyResult<()> {
        let h = handle_arg(handle)?;
        let n = u32_arg("processed_computed_tokens", processed_computed_tokens)?;
        let p = num_prompt_tokens.map(|p| u32_arg("num_prompt_tokens", p)).transpose()?;
        Ok(self.core()?.remove_skipped_blocks(h, n, p)?)
    }

    /// Blocks needed for `num_tokens` slots, `num_tokens_main_model` of them (default
    /// `num_tokens`) for the target model (vLLM's `coordinator.get_num_blocks_to_allocate`
    /// with no new hit); negative when a Mamba "align" table holds more than it needs.
    /// `prefill_end` is where the request's prefill ends (vLLM's argument); without the
    /// admission cap a Mamba "align" group records the prefill checkpoint it counts, as vLLM's.
    #[pyo3(signature = (handle, num_tokens, *, num_encoder_tokens=0, total_computed_tokens=0,
        apply_admission_cap=false, num_tokens_main_model=None, prefill_end=0))]
    #[allow(clippy::too_many_arguments)]
    fn get_num_blocks_to_allocate(
        &self,
        handle: i64,
        num_tokens: i64,
        num_encoder_tokens: i64,
        total_computed_tokens: i64,
        apply_admission_cap: bool,
        num_tokens_main_model: Option<i64>,
        prefill_end: i64,
    ) -> PyResult<i64> {
        let h = handle_arg(handle)?;
        let c = BlockCountArgs {
            num_tokens: u32_arg("num_tokens", num_tokens)?,
            num_tokens_main_model: u32_arg("num_tokens_main_model", num_tokens_main_model.unwrap_or(num_tokens))?,
            num_encoder_tokens: u32_arg("num_encoder_tokens", num_encoder_tokens)?,
            total_computed_tokens: u32_arg("total_computed_tokens", total_computed_tokens)?,
            apply_admission_cap,
            prefill_end: u32_arg("prefill_end", prefill_end)?,
        };
        Ok(self.core()?.get_num_blocks_to_allocate(h, &c)?)
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`).
    fn new_step_starts(&self) -> PyResult<()> {
        self.core()?.new_step_starts();
        Ok(())
    }

    /// Frees every block of the request, tail first, and releases its handle. `retain`
    /// (hit-aware only; ignored under exact): keep what the request leaves cached at the
    /// pinned retention level (evicted last, within the pinned share of the pool).
    #[pyo3(signature = (handle, *, retain=false))]
    fn free(&self, handle: i64, retain: bool) -> PyResult<()> {
        let level = if retain { crate::policy::LEVEL_PINNED } else { crate::policy::LEVEL_NORMAL };
        Ok(self.core()?.free(handle_arg(handle)?, level)?)
    }

    /// Pins a prefix given by its block hashes (`bytes`, at hash block size) under the
    /// hit-aware policy: what a hit on the whole prefix needs is evicted after every other
    /// cached block, within the pinned share. Returns the blocks pinned in all.
    fn pin_prefix(&self, block_hashes: &Bound<'_, PyList>) -> PyResult<u32> {
        let src = PyHashes(block_hashes);
        let mut hashes = Vec::with_capacity(src.len());
        for i in 0..src.len() {
            hashes.push(src.get(i)?);
        }
        Ok(self.core()?.pin_prefix(&hashes)?)
    }

    /// Sets the pinned share of the pool (0.0 to 1.0; default 0.25).
    fn set_pinned_share(&self, share: f64) -> PyResult<()> {
        Ok(self.core()?.set_pinned_share(share)?)
    }

    /// The retention policy: "exact" or "hit-aware".
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.core()?.policy().name())
    }

    /// Releases the handle and returns its blocks (groups concatenated) without freeing.
    fn pop_blocks_for_free<'py>(&self, py: Python<'py>, handle: i64) -> PyResult<Bound<'py, PyList>> {
        let h = handle_arg(handle)?;
        let mut out = Vec::new();
        self.core()?.pop_blocks_for_free(h, &mut out)?;
        PyList::new(py, out)
    }

    /// Drops one reference from each block that `pop_blocks_for_free` handed out, in
    /// eviction order.
    fn free_block_ids(&self, ids: Vec<i64>) -> PyResult<()> {
        let ids = block_ids_arg(&ids)?;
        Ok(self.core()?.free_block_ids(&ids)?)
    }

    /// The block tables of a request, one list per group.
    #[pyo3(signature = (handle, *, as_buffer=false))]
    fn block_ids(&self, py: Python<'_>, handle: i64, as_buffer: bool) -> PyResult<Py<PyAny>> {
        let h = handle_arg(handle)?;
        let ids = {
            let core = self.core()?;
            let core = &*core;
            PyBlockIds::gather(core.num_groups(), |g| core.blocks(h, g))?
        };
        Ok(if as_buffer { Py::new(py, ids)?.into_any() } else { ids.lists(py)?.into_any().unbind() })
    }

    /// Drops the prefix-cache hashes of these blocks.
    fn evict_blocks(&self, ids: Vec<i64>) -> PyResult<()> {
        let ids = block_ids_arg(&ids)?;
        Ok(self.core()?.evict_blocks(&ids)?)
    }

    /// Clears the prefix cache if no block is in use; returns whether it did.
    fn reset_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.core()?.reset_prefix_cache())
    }

    /// vLLM's `estimate_cached_tokens`.
    fn estimate_cached_tokens(&self, handle: i64) -> PyResult<u32> {
        Ok(self.core()?.estimate_cached_tokens(handle_arg(handle)?)?)
    }

    /// Free blocks.
    #[getter]
    fn num_free_blocks(&self) -> PyResult<u32> {
        Ok(self.core()?.num_free_blocks())
    }

    /// Blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.core()?.pool().num_blocks())
    }

    /// Number of KV cache groups.
    #[getter]
    fn num_groups(&self) -> PyResult<usize> {
        Ok(self.core()?.num_groups())
    }

    /// Live requests.
    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        Ok(self.core()?.num_requests())
    }

    /// KV cache usage in [0, 1].
    #[getter]
    fn usage(&self) -> PyResult<f64> {
        Ok(self.core()?.usage())
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self) -> PyResult<bool> {
        Ok(self.core()?.has_events())
    }

    /// Reference count of a block.
    fn ref_cnt(&self, block_id: i64) -> PyResult<u32> {
        let core = self.core()?;
        let b = Self::block(&core, block_id)?;
        Ok(core.pool().ref_cnt(b))
    }

    /// `(hash bytes, group)` of a cached block, or None.
    fn block_hash<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let core = self.core()?;
        let b = Self::block(&core, block_id)?;
        Ok(core.pool().block_hash(b).map(|(h, g)| (PyBytes::new(py, h.as_bytes()), *g)))
    }

    /// vLLM's `BlockPool.get_cached_block`: the first cached block for `block_hash` in each
    /// group of `group_ids`, or None on a miss in any group.
    ///
    /// # Errors
    /// `OutOfRangeError` for a hash that is not 1 to 32 bytes or a group that does not exist.
    fn get_cached_block(&self, block_hash: &Bound<'_, PyBytes>, group_ids: Vec<i64>) -> PyResult<Option<Vec<u32>>> {
        let core = self.core()?;
        let b = block_hash.as_bytes();
        let hash = BlockHash::from_bytes(b)
            .ok_or_else(|| Error::OutOfRange(format!("block hash has {} bytes (1 to 32 are valid)", b.len())))?;
        let num_groups = core.num_groups();
        let mut groups = Vec::with_capacity(group_ids.len());
        for &g in &group_ids {
            match usize::try_from(g) {
                Ok(i) if i < num_groups => groups.push(i as GroupId),
                _ => return Err(Error::OutOfRange(format!("group {g} (the allocator has {num_groups})")).into()),
            }
        }
        let mut out = Vec::with_capacity(groups.len());
        Ok(core.pool().get_cached_block(&hash, &groups, &mut out).then_some(out))
    }

    /// Prefix tokens covered by a block's hash, or None when unhashed.
    fn block_hash_num_tokens(&self, block_id: i64) -> PyResult<Option<u32>> {
        let core = self.core()?;
        let b = Self::block(&core, block_id)?;
        let pool = core.pool();
        Ok(pool.block_hash(b).map(|_| pool.block_hash_num_tokens(b)))
    }

    /// Free blocks in eviction order.
    fn free_queue_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core()?.pool().free_queue_order())
    }

    /// Takes the queued events: `("stored", handle, group, block_size, start_token,
    /// end_token, parent_hash | None, [hashes], [block indices])`, `("removed", hash,
    /// group)`, `("cleared",)`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.core()?.take_events();
        let out = PyList::empty(py);
        for e in events {
            let item: Bound<'py, PyTuple> = match e {
                Event::Stored { req, group, block_size, start_token, end_token, parent, hashes, block_indices } => {
                    let hs: Vec<Bound<'py, PyBytes>> = hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())).collect();
                    let parent = parent.map(|p| PyBytes::new(py, p.as_bytes()));
                    (
                        "stored",
                        req,
                        group,
                        block_size,
                        start_token,
                        end_token,
                        parent,
                        PyList::new(py, hs)?,
                        PyList::new(py, block_indices)?,
                    )
                        .into_pyobject(py)?
                }
                Event::Removed { hash, group } => {
                    ("removed", PyBytes::new(py, hash.as_bytes()), group).into_pyobject(py)?
                }
                Event::AllCleared => ("cleared",).into_pyobject(py)?,
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// Checks every internal invariant; raises `InvariantError` on a violation.
    fn check_invariants(&self) -> PyResult<()> {
        crate::invariants::check(&*self.core()?).map_err(InvariantError::new_err)
    }
}

/// A vLLM `Request` as the core's [`StepFields`]: its attributes, read when the core asks.
struct PyStep<'a, 'py>(&'a Bound<'py, PyAny>);

impl PyStep<'_, '_> {
    fn int(&self, name: &Bound<'_, PyString>) -> PyResult<i64> {
        self.0.getattr(name)?.extract()
    }
}

impl StepFields for PyStep<'_, '_> {
    type Error = PyErr;

    fn num_computed_tokens(&self) -> PyResult<i64> {
        self.int(intern!(self.0.py(), "num_computed_tokens"))
    }

    fn num_in_flight_tokens(&self) -> PyResult<i64> {
        self.int(intern!(self.0.py(), "num_in_flight_tokens"))
    }

    fn num_tokens(&self) -> PyResult<i64> {
        self.int(intern!(self.0.py(), "num_tokens"))
    }

    fn num_prompt_tokens(&self) -> PyResult<i64> {
        self.int(intern!(self.0.py(), "num_prompt_tokens"))
    }

    fn shared_prefix_boundary(&self) -> PyResult<i64> {
        self.int(intern!(self.0.py(), "shared_prefix_boundary"))
    }

    fn with_block_hashes<T>(&self, f: impl FnOnce(&dyn HashSource) -> PyResult<T>) -> PyResult<T> {
        let bh = self.0.getattr(intern!(self.0.py(), "block_hashes"))?;
        let list = bh.cast::<PyList>().map_err(|_| OutOfRangeError::new_err("request.block_hashes must be a list"))?;
        f(&PyHashes(list))
    }
}

/// The callbacks of a `FastAllocate` (dropped by the garbage collector's `__clear__`).
struct Callbacks {
    empty: Py<PyAny>,
    slow: Py<PyAny>,
    make_blocks: Py<PyAny>,
    on_events: Py<PyAny>,
}

/// `allocate_slots` for the vLLM adapter, called by the scheduler for every request every
/// step. A plain step of a running request (no new hit, no other keyword) is served here
/// by the core's `plain_step`: answered without any work when the request's no-op limits
/// prove it changes nothing (15 of 16 decode steps at block size 16), else with one call
/// into the core, which reads the request's fields and new block hashes itself. Every
/// other call, and a request that is not a live request of this allocator (its
/// `_hybrid_alloc_handle` absent, negative or stale), goes to the Python implementation
/// `slow`.
///
/// It holds the adapter's bound methods, and the adapter holds it: the cycle is visible to
/// Python's garbage collector (`__traverse__` / `__clear__`), so dropped managers are freed.
#[pyclass(module = "hybrid_alloc._core", name = "FastAllocate")]
pub struct FastAllocate {
    alloc: Py<PyAllocator>,
    /// `None` once the garbage collector cleared it.
    callbacks: Option<Callbacks>,
}

impl FastAllocate {
    fn callbacks(&self) -> PyResult<&Callbacks> {
        self.callbacks.as_ref().ok_or_else(|| InvariantError::new_err("FastAllocate used after it was cleared"))
    }

    /// The step of a registered request, or `None` when the request is not ours.
    fn plain(
        &self,
        py: Python<'_>,
        cb: &Callbacks,
        request: &Bound<'_, PyAny>,
        handle: u64,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
    ) -> PyResult<Option<Py<PyAny>>> {
        let alloc = self.alloc.get();
        let (blocks, has_events) = {
            let mut core = alloc.core()?;
            match core.plain_step(handle, num_new_tokens, num_lookahead_tokens, &PyStep(request))? {
                PlainStep::NotHere => return Ok(None),
                PlainStep::NoOp => return Ok(Some(cb.empty.clone_ref(py))),
                PlainStep::Allocated(None) => (None, core.has_events()),
                PlainStep::Allocated(Some(0)) => (Some(None), core.has_events()),
                PlainStep::Allocated(Some(_)) => {
                    let t = tuple_of_groups(py, core.new_block_ids(), core.new_block_counts())?;
                    (Some(Some(t)), core.has_events())
                }
            }
        };
        if has_events && !cb.on_events.is_none(py) {
            cb.on_events.bind(py).call1((request,))?;
        }
        Ok(Some(match blocks {
            None => py.None(),
            Some(None) => cb.empty.clone_ref(py),
            Some(Some(t)) => cb.make_blocks.bind(py).call1((t,))?.unbind(),
        }))
    }
}

#[pymethods]
impl FastAllocate {
    #[new]
    fn new(
        alloc: Py<PyAllocator>,
        empty: Py<PyAny>,
        slow: Py<PyAny>,
        make_blocks: Py<PyAny>,
        on_events: Py<PyAny>,
    ) -> Self {
        alloc.get().serves_vllm.store(true, Ordering::Relaxed);
        Self { alloc, callbacks: Some(Callbacks { empty, slow, make_blocks, on_events }) }
    }

    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
        num_lookahead_tokens=0, **rest))]
    #[allow(clippy::too_many_arguments)]
    fn __call__(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<Py<PyAny>>,
        num_lookahead_tokens: i64,
        rest: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let cb = self.callbacks()?;
        let plain = new_computed_blocks.is_none()
            && num_new_computed_tokens == 0
            && num_new_tokens > 0
            && rest.is_none_or(|d| d.is_empty());
        if plain {
            if let Some(tag) = request.getattr_opt(intern!(py, "_hybrid_alloc_handle"))? {
                let tag: i64 = tag.extract()?;
                if let Ok(h) = u64::try_from(tag) {
                    if let Some(out) = self.plain(py, cb, request, h, num_new_tokens, num_lookahead_tokens)? {
                        return Ok(out);
                    }
                }
            }
        }
        let args = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens);
        Ok(cb.slow.bind(py).call(args, rest)?.unbind())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.alloc)?;
        if let Some(cb) = &self.callbacks {
            visit.call(&cb.empty)?;
            visit.call(&cb.slow)?;
            visit.call(&cb.make_blocks)?;
            visit.call(&cb.on_events)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.callbacks = None;
    }
}

/// Does nothing, with any arguments: the benchmark calibrates its timing wrappers on it.
#[pyfunction]
#[pyo3(signature = (*_args, **_kwargs))]
fn _noop(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) {}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyAllocator>()?;
    m.add_class::<FastAllocate>()?;
    m.add_class::<PyHit>()?;
    m.add_class::<PyBlockIds>()?;
    m.add_function(wrap_pyfunction!(_noop, m)?)?;
    m.add("HybridAllocError", py.get_type::<HybridAllocError>())?;
    m.add("InvalidConfigError", py.get_type::<InvalidConfigError>())?;
    m.add("UnsupportedConfigError", py.get_type::<UnsupportedConfigError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("OutOfRangeError", py.get_type::<OutOfRangeError>())?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("ConcurrentUseError", py.get_type::<ConcurrentUseError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
