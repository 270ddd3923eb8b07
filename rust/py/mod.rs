//! The Python binding (`hybrid_alloc._core`): the only place that names pyo3. It converts
//! arguments, maps errors to the exception hierarchy, and builds return values; the
//! semantics all live in the core. One Python-to-Rust crossing per call; ints, bytes and
//! flat lists cross the boundary, never an object per block.
#![forbid(unsafe_code)]

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::block_pool::Event;
use crate::config::{AttentionKind, Config, GroupSpec};
use crate::coordinator::{AllocateArgs, Allocator, NewComputed};
use crate::error::Error;
use crate::ids::BlockId;

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

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidConfig(_) => InvalidConfigError::new_err(msg),
        Error::Unsupported(_) => UnsupportedConfigError::new_err(msg),
        Error::UnknownRequest(_) => UnknownRequestError::new_err(msg),
        Error::OutOfRange(_) => OutOfRangeError::new_err(msg),
        Error::InvalidBlock(_) => InvalidBlockError::new_err(msg),
    }
}

fn u32_arg(name: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| OutOfRangeError::new_err(format!("{name}={v} is outside 0..=4294967295")))
}

/// Block ids from Python ints; a negative or too large one is an `InvalidBlockError`.
fn block_ids_arg(ids: &[i64]) -> PyResult<Vec<BlockId>> {
    ids.iter().map(|&b| u32::try_from(b).map_err(|_| InvalidBlockError::new_err(format!("block id {b}")))).collect()
}

fn parse_kind(kind: &str, p1: i64, p2: i64) -> PyResult<AttentionKind> {
    Ok(match kind {
        "full" | "mla" => AttentionKind::Full,
        "sliding_window" => AttentionKind::SlidingWindow {
            window: u32_arg("sliding_window", p1)?,
            extra_retained_tokens: u32_arg("extra_retained_tokens", p2)?,
        },
        "chunked_local" => AttentionKind::ChunkedLocal { chunk: u32_arg("attention_chunk_size", p1)? },
        "cross" => AttentionKind::Cross,
        other => {
            return Err(UnsupportedConfigError::new_err(format!(
                "attention kind {other:?} is not served (full, mla, sliding_window, chunked_local, cross are)"
            )))
        }
    })
}

/// `(slots, processed, cached)`: see `Allocator::noop_limits`.
type NoopLimits = (u32, u32, u32);

/// The native allocator: one per vLLM `KVCacheManager`.
#[pyclass(module = "hybrid_alloc._core", name = "Allocator")]
pub struct PyAllocator {
    inner: Allocator,
    /// A number unique to this allocator in the process: the vLLM adapter tags requests
    /// with `serial << 32 | handle`, so a request registered with another allocator is
    /// never mistaken for one of ours.
    serial: u64,
    /// `limits[h]`: the no-op limits of request `h`'s next plain step, as of its last
    /// crossing (`(0, 0, 0)`: unknown, the next step must cross).
    limits: Vec<NoopLimits>,
}

impl PyAllocator {
    fn clear_limits(&mut self, h: u32) {
        if let Some(l) = self.limits.get_mut(h as usize) {
            *l = (0, 0, 0);
        }
    }

    fn handle(&self, h: i64) -> PyResult<u32> {
        u32::try_from(h).map_err(|_| UnknownRequestError::new_err(format!("unknown request handle {h}")))
    }

    /// Brings the core's copy of a request's block hashes up to `block_hashes` (vLLM's
    /// `request.block_hashes`, a list of bytes that only grows): only the new tail is read.
    fn push_hashes(&mut self, h: u32, block_hashes: Option<&Bound<'_, PyList>>) -> PyResult<()> {
        let Some(list) = block_hashes else { return Ok(()) };
        let known = self.inner.num_hashes(h).map_err(to_py)?;
        let n = list.len();
        if n < known {
            return self.inner.truncate_hashes(h, n).map_err(to_py);
        }
        for i in known..n {
            let item = list.get_item(i)?;
            let appended = match item.cast::<PyBytes>() {
                Ok(b) => self.inner.append_hashes(h, b.as_bytes(), b.as_bytes().len()).map_err(to_py),
                Err(_) => Err(OutOfRangeError::new_err(format!("block hash {i} is not bytes"))),
            };
            if let Err(e) = appended {
                // A failed call leaves the request as it was.
                self.inner.truncate_hashes(h, known).map_err(to_py)?;
                return Err(e);
            }
        }
        Ok(())
    }

    fn groups_tuple<'py>(&self, py: Python<'py>, ids: &[BlockId], counts: &[u32]) -> PyResult<Bound<'py, PyTuple>> {
        let mut off = 0usize;
        let mut lists = Vec::with_capacity(counts.len());
        for &c in counts {
            lists.push(PyList::new(py, &ids[off..off + c as usize])?);
            off += c as usize;
        }
        PyTuple::new(py, lists)
    }
}

#[pymethods]
impl PyAllocator {
    /// Builds an allocator. `groups` holds one `(kind, block_size, spec_key, param1,
    /// param2)` per KV cache group: kind is "full", "mla", "sliding_window" (param1 the
    /// window, param2 the extra retained tokens), "chunked_local" (param1 the chunk size) or
    /// "cross"; groups with equal `spec_key` are looked up together.
    #[new]
    #[pyo3(signature = (num_blocks, groups, hash_block_size, scheduler_block_size, max_model_len,
        max_in_flight_tokens=None, enable_caching=true, enable_events=false, watermark_blocks=0,
        retention_interval=Some(0)))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        groups: Vec<(String, i64, i64, i64, i64)>,
        hash_block_size: i64,
        scheduler_block_size: i64,
        max_model_len: i64,
        max_in_flight_tokens: Option<i64>,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: i64,
        retention_interval: Option<i64>,
    ) -> PyResult<Self> {
        let mut gs = Vec::with_capacity(groups.len());
        for (kind, bs, key, p1, p2) in groups {
            gs.push(GroupSpec {
                kind: parse_kind(&kind, p1, p2)?,
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
        };
        let inner = Allocator::new(cfg).map_err(|e| match e {
            Error::InvalidConfig(_) | Error::Unsupported(_) => to_py(e),
            other => InvalidConfigError::new_err(other.to_string()),
        })?;
        static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let serial = NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self { inner, serial, limits: Vec::new() })
    }

    /// Registers a request; returns its handle.
    fn add_request(&mut self) -> u32 {
        let h = self.inner.add_request();
        if self.limits.len() <= h as usize {
            self.limits.resize(h as usize + 1, (0, 0, 0));
        }
        self.clear_limits(h);
        h
    }

    /// Appends block hashes (`hash_len` bytes each, concatenated) to a request.
    fn append_hashes(&mut self, handle: i64, new_hashes: &[u8], hash_len: usize) -> PyResult<()> {
        let h = self.handle(handle)?;
        self.inner.append_hashes(h, new_hashes, hash_len).map_err(to_py)
    }

    /// Number of block hashes known for a request.
    fn num_hashes(&self, handle: i64) -> PyResult<usize> {
        self.inner.num_hashes(self.handle(handle)?).map_err(to_py)
    }

    /// Syncs the request's `block_hashes`, finds the longest cache hit not longer than `max_length`
    /// tokens and stores it as the request's pending hit. Returns `(hit_tokens,
    /// uncached_common_prefix_tokens, hit block ids of all groups concatenated, per-group
    /// counts)`.
    fn get_computed_blocks<'py>(
        &mut self,
        py: Python<'py>,
        handle: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        max_length: i64,
    ) -> PyResult<(u32, u32, Bound<'py, PyList>, Bound<'py, PyList>)> {
        let h = self.handle(handle)?;
        let max_length = u32_arg("max_length", max_length)?;
        self.push_hashes(h, block_hashes)?;
        let hit = self.inner.find_longest_cache_hit(h, max_length).map_err(to_py)?;
        let ng = self.inner.num_groups();
        let mut ids: Vec<BlockId> = Vec::new();
        let mut counts: Vec<u32> = Vec::with_capacity(ng);
        for g in 0..ng {
            let v = self.inner.stored_hit(h, g).map_err(to_py)?;
            ids.extend_from_slice(v);
            counts.push(v.len() as u32);
        }
        Ok((hit.num_tokens, hit.num_uncached_common_prefix_tokens, PyList::new(py, ids)?, PyList::new(py, counts)?))
    }

    /// vLLM's `allocate_slots`. `hit_mode`: 0 no new hit, 1 the stored hit, 2 the explicit
    /// `hit_ids` (groups concatenated, split by `hit_counts`). Returns `(result, slots,
    /// processed, cached)`: result is `None` when the blocks do not fit, `0` when no block
    /// was added, else a tuple with one list of new block ids per group; the three limits
    /// bound the next plain steps that change nothing (see `noop_limits`).
    #[pyo3(signature = (handle, block_hashes, num_new_tokens, num_new_computed_tokens,
        hit_mode, hit_ids, hit_counts, num_lookahead_tokens, num_external_computed_tokens,
        delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
        apply_watermark, num_computed_tokens, num_in_flight_tokens, num_prompt_tokens,
        num_tokens, shared_prefix_boundary))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        &mut self,
        py: Python<'py>,
        handle: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        hit_mode: u8,
        hit_ids: Option<Vec<i64>>,
        hit_counts: Option<Vec<i64>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        apply_watermark: bool,
        num_computed_tokens: i64,
        num_in_flight_tokens: i64,
        num_prompt_tokens: i64,
        num_tokens: i64,
        shared_prefix_boundary: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle(handle)?;
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
            num_prompt_tokens: u32_arg("num_prompt_tokens", num_prompt_tokens)?,
            num_tokens: u32_arg("num_tokens", num_tokens)?,
            shared_prefix_boundary: u32_arg("shared_prefix_boundary", shared_prefix_boundary)?,
        };
        let explicit: Vec<Vec<BlockId>>;
        let nc = match hit_mode {
            0 => NewComputed::Empty,
            1 => NewComputed::Stored,
            2 => {
                let ids = hit_ids.unwrap_or_default();
                let counts = hit_counts.unwrap_or_default();
                let total: i64 = counts.iter().sum();
                if counts.iter().any(|&c| c < 0) || total != ids.len() as i64 {
                    return Err(OutOfRangeError::new_err("hit_counts do not add up to len(hit_ids)"));
                }
                let mut off = 0usize;
                let mut groups = Vec::with_capacity(counts.len());
                for &c in &counts {
                    groups.push(block_ids_arg(&ids[off..off + c as usize])?);
                    off += c as usize;
                }
                explicit = groups;
                NewComputed::Explicit(&explicit)
            }
            m => return Err(OutOfRangeError::new_err(format!("hit_mode {m} (0, 1 or 2)"))),
        };
        let before = self.inner.num_hashes(h).map_err(to_py)?;
        self.push_hashes(h, block_hashes)?;
        let res = match self.inner.allocate_slots(h, &args, nc) {
            Ok(r) => r,
            Err(e) => {
                // A failed call leaves the request as it was.
                self.inner.truncate_hashes(h, before).map_err(to_py)?;
                return Err(to_py(e));
            }
        };
        let res: Bound<'py, PyAny> = match res {
            None => py.None().into_bound(py),
            Some(0) => 0i64.into_pyobject(py)?.into_any(),
            Some(_) => self.groups_tuple(py, self.inner.new_block_ids(), self.inner.new_block_counts())?.into_any(),
        };
        let (slots, processed, cached) = self.inner.noop_limits(h).map_err(to_py)?;
        self.limits[h as usize] = (slots, processed, cached);
        Ok((res, slots, processed, cached).into_pyobject(py)?.into_any())
    }

    /// The plain step of a running request (the scheduler's decode / chunked-prefill call:
    /// no new hit, no external or encoder tokens, no admission gate, reserve or watermark):
    /// `allocate_slots` with its other arguments at their defaults, in fewer arguments.
    /// Returns what `allocate_slots` returns.
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        handle: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
        num_computed_tokens: i64,
        num_in_flight_tokens: i64,
        num_prompt_tokens: i64,
        num_tokens: i64,
        shared_prefix_boundary: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.allocate_slots(
            py,
            handle,
            block_hashes,
            num_new_tokens,
            0,
            0,
            None,
            None,
            num_lookahead_tokens,
            0,
            false,
            0,
            false,
            0,
            false,
            num_computed_tokens,
            num_in_flight_tokens,
            num_prompt_tokens,
            num_tokens,
            shared_prefix_boundary,
        )
    }

    /// Syncs the request's `block_hashes` and caches full blocks up to `num_computed_tokens`.
    fn cache_blocks(
        &mut self,
        handle: i64,
        block_hashes: Option<&Bound<'_, PyList>>,
        num_computed_tokens: i64,
        num_prompt_tokens: i64,
        shared_prefix_boundary: i64,
    ) -> PyResult<()> {
        let h = self.handle(handle)?;
        let n = u32_arg("num_computed_tokens", num_computed_tokens)?;
        let p = u32_arg("num_prompt_tokens", num_prompt_tokens)?;
        let s = u32_arg("shared_prefix_boundary", shared_prefix_boundary)?;
        self.push_hashes(h, block_hashes)?;
        self.clear_limits(h);
        self.inner.cache_blocks(h, n, p, s).map_err(to_py)
    }

    /// `(slots, processed, cached)`: a plain step (no new hit, external or encoder tokens,
    /// admission gate, reserve or watermark) with `need_slot <= slots`, `processed <
    /// processed` and `to_cache < cached` changes nothing.
    fn noop_limits(&self, handle: i64) -> PyResult<(u32, u32, u32)> {
        self.inner.noop_limits(self.handle(handle)?).map_err(to_py)
    }

    /// Frees out-of-window blocks (vLLM's `remove_skipped_blocks`).
    fn remove_skipped_blocks(&mut self, handle: i64, processed_computed_tokens: i64) -> PyResult<()> {
        let h = self.handle(handle)?;
        let n = u32_arg("processed_computed_tokens", processed_computed_tokens)?;
        self.clear_limits(h);
        self.inner.remove_skipped_blocks(h, n).map_err(to_py)
    }

    /// Blocks needed for `num_tokens` slots (vLLM's `coordinator.get_num_blocks_to_allocate`
    /// with no new hit).
    fn get_num_blocks_to_allocate(
        &self,
        handle: i64,
        num_tokens: i64,
        num_encoder_tokens: i64,
        total_computed_tokens: i64,
        apply_admission_cap: bool,
    ) -> PyResult<u64> {
        let h = self.handle(handle)?;
        self.inner
            .get_num_blocks_to_allocate(
                h,
                u32_arg("num_tokens", num_tokens)?,
                u32_arg("num_encoder_tokens", num_encoder_tokens)?,
                u32_arg("total_computed_tokens", total_computed_tokens)?,
                apply_admission_cap,
            )
            .map_err(to_py)
    }

    /// Frees every block of the request, tail first, and releases its handle.
    fn free(&mut self, handle: i64) -> PyResult<()> {
        let h = self.handle(handle)?;
        self.inner.free(h).map_err(to_py)?;
        self.clear_limits(h);
        Ok(())
    }

    /// Releases the handle and returns its blocks (groups concatenated) without freeing.
    fn pop_blocks_for_free<'py>(&mut self, py: Python<'py>, handle: i64) -> PyResult<Bound<'py, PyList>> {
        let h = self.handle(handle)?;
        let mut out = Vec::new();
        self.inner.pop_blocks_for_free(h, &mut out).map_err(to_py)?;
        self.clear_limits(h);
        PyList::new(py, out)
    }

    /// Drops one reference from each block, in eviction order.
    fn free_block_ids(&mut self, ids: Vec<i64>) -> PyResult<()> {
        self.inner.free_block_ids(&block_ids_arg(&ids)?).map_err(to_py)
    }

    /// The block tables of a request, one list per group.
    fn block_ids<'py>(&self, py: Python<'py>, handle: i64) -> PyResult<Bound<'py, PyTuple>> {
        let h = self.handle(handle)?;
        let ng = self.inner.num_groups();
        let mut lists = Vec::with_capacity(ng);
        for g in 0..ng {
            lists.push(PyList::new(py, self.inner.blocks(h, g).map_err(to_py)?)?);
        }
        PyTuple::new(py, lists)
    }

    /// Drops the prefix-cache hashes of these blocks.
    fn evict_blocks(&mut self, ids: Vec<i64>) -> PyResult<()> {
        self.inner.evict_blocks(&block_ids_arg(&ids)?).map_err(to_py)
    }

    /// Clears the prefix cache if no block is in use; returns whether it did.
    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    /// vLLM's `estimate_cached_tokens`.
    fn estimate_cached_tokens(&self, handle: i64) -> PyResult<u32> {
        self.inner.estimate_cached_tokens(self.handle(handle)?).map_err(to_py)
    }

    /// This allocator's tag for request handles (see `FastAllocate`).
    #[getter]
    fn serial(&self) -> u64 {
        self.serial
    }

    /// Free blocks.
    #[getter]
    fn num_free_blocks(&self) -> u32 {
        self.inner.num_free_blocks()
    }

    /// Blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.pool().num_blocks()
    }

    /// Number of KV cache groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Live requests.
    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    /// KV cache usage in [0, 1].
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    /// Whether events wait to be taken.
    #[getter]
    fn has_events(&self) -> bool {
        self.inner.has_events()
    }

    /// Reference count of a block.
    fn ref_cnt(&self, block_id: i64) -> PyResult<u32> {
        let b = self.block(block_id)?;
        Ok(self.inner.pool().ref_cnt(b))
    }

    /// `(hash bytes, group)` of a cached block, or None.
    fn block_hash<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let b = self.block(block_id)?;
        Ok(self.inner.pool().block_hash(b).map(|(h, g)| (PyBytes::new(py, h.as_bytes()), *g)))
    }

    /// Prefix tokens covered by a block's hash, or None when unhashed.
    fn block_hash_num_tokens(&self, block_id: i64) -> PyResult<Option<u32>> {
        let b = self.block(block_id)?;
        let pool = self.inner.pool();
        Ok(pool.block_hash(b).map(|_| pool.block_hash_num_tokens(b)))
    }

    /// Free blocks in eviction order.
    fn free_queue_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.pool().free_queue_order())
    }

    /// Takes the queued events: `("stored", handle, group, block_size, start_token,
    /// end_token, parent_hash | None, [hashes], [block indices])`, `("removed", hash,
    /// group)`, `("cleared",)`.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.take_events();
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
    #[pyo3(signature = (exact_refs=true))]
    fn check_invariants(&self, exact_refs: bool) -> PyResult<()> {
        crate::invariants::check_with(&self.inner, exact_refs).map_err(InvariantError::new_err)
    }
}

impl PyAllocator {
    fn block(&self, block_id: i64) -> PyResult<u32> {
        match u32::try_from(block_id) {
            Ok(b) if b < self.inner.pool().num_blocks() => Ok(b),
            _ => Err(InvalidBlockError::new_err(format!(
                "block id {block_id} outside 0..{}",
                self.inner.pool().num_blocks()
            ))),
        }
    }
}

/// `allocate_slots` for the vLLM adapter, called by the scheduler for every request every
/// step. A plain step of a running request (no new hit, no other keyword) is served here:
/// answered without any work when the core proved it changes nothing (see `noop_limits`;
/// 15 of 16 decode steps at block size 16), else with one call into the core, reading the
/// request's fields and new block hashes directly. Every other call goes to the Python
/// implementation `slow`. The request carries `serial << 32 | handle` in
/// `_hybrid_alloc_handle` (-1, absent or another allocator's serial: `slow` handles it).
#[pyclass(module = "hybrid_alloc._core", name = "FastAllocate", frozen)]
pub struct FastAllocate {
    alloc: Py<PyAllocator>,
    empty: Py<PyAny>,
    slow: Py<PyAny>,
    make_blocks: Py<PyAny>,
    on_events: Py<PyAny>,
}

fn get_i64(obj: &Bound<'_, PyAny>, name: &Bound<'_, pyo3::types::PyString>) -> PyResult<i64> {
    obj.getattr(name)?.extract()
}

impl FastAllocate {
    /// The request's handle in this allocator and the no-op limits of its next plain step,
    /// or `None` when the request is not registered here.
    fn registered(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Option<(i64, NoopLimits)>> {
        let tag: i64 = match request.getattr_opt(intern!(py, "_hybrid_alloc_handle"))? {
            Some(v) => v.extract()?,
            None => return Ok(None),
        };
        let alloc = self.alloc.bind(py).try_borrow()?;
        if tag < 0 || (tag as u64) >> 32 != alloc.serial {
            return Ok(None);
        }
        let h = tag & 0xFFFF_FFFF;
        Ok(alloc.limits.get(h as usize).map(|&l| (h, l)))
    }

    /// Whether a plain step changes nothing: `need_slot <= slots`, `processed < processed`
    /// and `to_cache < cached` (see `Allocator::noop_limits`).
    fn is_noop(
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        (slots, processed, cached): NoopLimits,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
    ) -> PyResult<bool> {
        let nc = get_i64(request, intern!(py, "num_computed_tokens"))?;
        let to_cache = nc + num_new_tokens;
        if to_cache + num_lookahead_tokens > slots as i64 {
            return Ok(false);
        }
        // `num_in_flight_tokens` (>= 0) only lowers `nc - inflight`: below the limit with `nc`
        // alone, it need not be read (decode steps of full attention and of windows longer
        // than the context never read it).
        if nc >= processed as i64 && nc - get_i64(request, intern!(py, "num_in_flight_tokens"))? >= processed as i64 {
            return Ok(false);
        }
        if to_cache < cached as i64 {
            return Ok(true);
        }
        Ok(get_i64(request, intern!(py, "num_tokens"))? < cached as i64)
    }

    fn cross(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        h: i64,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
    ) -> PyResult<Py<PyAny>> {
        let bh = request.getattr(intern!(py, "block_hashes"))?;
        let bh = bh.cast::<PyList>().map_err(|_| OutOfRangeError::new_err("request.block_hashes must be a list"))?;
        let nc = get_i64(request, intern!(py, "num_computed_tokens"))?;
        let inflight = get_i64(request, intern!(py, "num_in_flight_tokens"))?;
        let prompt = get_i64(request, intern!(py, "num_prompt_tokens"))?;
        let tokens = get_i64(request, intern!(py, "num_tokens"))?;
        let spb = get_i64(request, intern!(py, "shared_prefix_boundary"))?;
        let (res, has_events) = {
            let mut a = self.alloc.bind(py).try_borrow_mut()?;
            let out =
                a.step(py, h, Some(bh), num_new_tokens, num_lookahead_tokens, nc, inflight, prompt, tokens, spb)?;
            let res = out.cast::<PyTuple>()?.get_item(0)?;
            (res, a.inner.has_events())
        };
        if has_events && !self.on_events.is_none(py) {
            self.on_events.bind(py).call1((request,))?;
        }
        if res.is_none() {
            return Ok(py.None());
        }
        if res.is_instance_of::<PyTuple>() {
            return Ok(self.make_blocks.bind(py).call1((res,))?.unbind());
        }
        Ok(self.empty.clone_ref(py))
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
        Self { alloc, empty, slow, make_blocks, on_events }
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
        let plain = new_computed_blocks.is_none()
            && num_new_computed_tokens == 0
            && num_new_tokens > 0
            && rest.is_none_or(|d| d.is_empty());
        if plain {
            if let Some((h, limits)) = self.registered(py, request)? {
                if Self::is_noop(py, request, limits, num_new_tokens, num_lookahead_tokens)? {
                    return Ok(self.empty.clone_ref(py));
                }
                return self.cross(py, request, h, num_new_tokens, num_lookahead_tokens);
            }
        }
        let args = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens);
        Ok(self.slow.bind(py).call(args, rest)?.unbind())
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
    m.add_function(wrap_pyfunction!(_noop, m)?)?;
    m.add("HybridAllocError", py.get_type::<HybridAllocError>())?;
    m.add("InvalidConfigError", py.get_type::<InvalidConfigError>())?;
    m.add("UnsupportedConfigError", py.get_type::<UnsupportedConfigError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("OutOfRangeError", py.get_type::<OutOfRangeError>())?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
