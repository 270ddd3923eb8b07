//! `AllocatorBase`, the base class of `Allocator`: it holds the core and serves the
//! pool-wide half of the allocator, calls that take no request handle (pool and prefix-cache
//! state, eviction, pinning, events, zeroing records, the invariant check).
//!
//! Threads: the core sits behind a mutex that is only ever *tried*: a call made while another
//! call on the same allocator is in progress (another thread, or re-entry from Python code
//! the first call runs, such as a `Request` property read by `FastAllocate`) raises
//! `ConcurrentUseError` and changes nothing. After a panic (a broken invariant, our bug) the
//! allocator refuses every later call with `InvariantError`.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::convert::{block_ids_arg, hash_arg, PyHashes};
use super::errors::{ConcurrentUseError, InvalidBlockError, InvariantError};
use crate::api;
use crate::coordinator::{Allocator, HashSource};

/// The state of an `Allocator` and its pool-wide calls.
#[pyclass(module = "hybrid_alloc._core", name = "AllocatorBase", subclass, frozen)]
pub struct PyAllocatorBase {
    /// The core; only ever `try_lock`ed (see the module doc).
    inner: Mutex<Allocator>,
    /// Set once a `FastAllocate` serves this allocator (the vLLM adapter): its
    /// `allocate_slots` is then exact to vLLM's manager and trusts the request's computed
    /// tokens ([`crate::coordinator::AllocateArgs::trust_computed_tokens`]); the direct API
    /// checks them.
    serves_vllm: AtomicBool,
}

impl PyAllocatorBase {
    /// Wraps a core.
    pub(super) fn new(core: Allocator) -> Self {
        Self { inner: Mutex::new(core), serves_vllm: AtomicBool::new(false) }
    }

    /// Whether a `FastAllocate` serves this allocator (see `serves_vllm`).
    pub(super) fn serves_vllm(&self) -> bool {
        self.serves_vllm.load(Ordering::Relaxed)
    }

    /// Marks this allocator as served by a `FastAllocate` (the vLLM adapter).
    pub(super) fn set_serves_vllm(&self) {
        self.serves_vllm.store(true, Ordering::Relaxed);
    }

    /// The core, or `ConcurrentUseError` when a call on this allocator is in progress.
    pub(super) fn core(&self) -> PyResult<MutexGuard<'_, Allocator>> {
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

    /// A block id of the pool.
    /// The pool and id of a block id from Python (with two-level pages, page `p` is written
    /// `num_slots + p`: see `Allocator::locate_block`).
    fn block(core: &Allocator, block_id: i64) -> PyResult<(&crate::block_pool::BlockPool, u32)> {
        let n = core.pool().num_blocks() + core.page_pool().map_or(0, |s| s.num_blocks());
        match u32::try_from(block_id).ok().and_then(|b| core.locate_block(b)) {
            Some(x) => Ok(x),
            None => Err(InvalidBlockError::new_err(format!("block id {block_id} outside 0..{n}"))),
        }
    }
}

#[pymethods]
impl PyAllocatorBase {
    /// Drains the block ids attention groups handed out since the last call (vLLM's
    /// `take_new_block_ids`, for KV cache zeroing); empty unless `zero_new_blocks`.
    fn take_new_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core()?.take_new_block_ids())
    }

    /// A new scheduler step starts (vLLM's `new_step_starts`).
    fn new_step_starts(&self) -> PyResult<()> {
        self.core()?.new_step_starts();
        Ok(())
    }

    /// Pins a prefix given by its block hashes (`bytes`, at hash block size) under the
    /// hit-aware policy: what a hit on the whole prefix needs is evicted after every other
    /// cached block, within the pinned share. Returns the blocks pinned in all.
    fn pin_prefix(&self, block_hashes: &Bound<'_, PyList>) -> PyResult<u32> {
        let src = PyHashes(block_hashes);
        let hashes = (0..src.len()).map(|i| src.get(i)).collect::<crate::Result<Vec<_>>>()?;
        Ok(self.core()?.pin_prefix(&hashes)?)
    }

    /// The allocator's clock reads `now_ms` (milliseconds; at most once per scheduler step):
    /// the KV hints' leases and retains due by then end, and their blocks still cached go back
    /// to the normal level. Returns `(holds ended, when the next one ends or None)`.
    fn advance_clock(&self, now_ms: i64) -> PyResult<(u32, Option<u64>)> {
        let now = super::convert::u64_arg("now_ms", now_ms)?;
        Ok(self.core()?.advance_clock(now)?)
    }

    /// Releases a KV hints session now: its leases and retains end, their blocks go to the
    /// front of the speculative level (evicted first). Returns the holds ended.
    fn release_session(&self, session: i64) -> PyResult<u32> {
        let session = super::convert::u64_arg("session", session)?;
        Ok(self.core()?.release_session(session)?)
    }

    /// The KV hints' counters and gauges, by name (all 0 under the exact policy).
    fn hint_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.core()?.hint_stats();
        let d = pyo3::types::PyDict::new(py);
        for (k, v) in s.named() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Sets the pinned share of the pool (0.0 to 1.0; default 0.25).
    fn set_pinned_share(&self, share: f64) -> PyResult<()> {
        Ok(self.core()?.set_pinned_share(share)?)
    }

    /// Whether vLLM's coordinator would enable partial hash hits for this config
    /// (``enable_partial_hash_hits``: ``--prefix-match-unit`` on a Mamba hybrid).
    #[getter]
    fn partial_hash_hits(&self) -> PyResult<bool> {
        Ok(self.core()?.config().partial_hash_hits())
    }

    /// Whether vLLM's manager would turn its Mamba shared-prefix checkpoint on for this config
    /// (``KVCacheManager.mamba_shared_prefix_checkpoint``; see ``Config::shared_prefix_checkpoint``).
    #[getter]
    fn shared_prefix_checkpoint(&self) -> PyResult<bool> {
        Ok(self.core()?.config().shared_prefix_checkpoint())
    }

    /// The retention policy: "exact" or "hit-aware".
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.core()?.policy().name())
    }

    /// Drops one reference from each block that `pop_blocks_for_free` handed out, in
    /// eviction order; with `evict_first` (vLLM 0.34's `free_blocks`) the blocks freed go to
    /// the front of the free queue, cached ones too.
    #[pyo3(signature = (ids, *, evict_first=false))]
    fn free_block_ids(&self, ids: Vec<i64>, evict_first: bool) -> PyResult<()> {
        let ids = block_ids_arg(&ids)?;
        Ok(self.core()?.free_block_ids_ordered(&ids, evict_first)?)
    }

    /// Takes one reference on each block outside any table (vLLM's `BlockPool.touch`): a free
    /// block leaves the free queue; the null block is skipped. Given back by
    /// `free_block_ids`. `InvalidBlockError` for an id outside the pool, `UnsupportedConfigError`
    /// with two-level pages; nothing changes then.
    fn touch_block_ids(&self, ids: Vec<i64>) -> PyResult<()> {
        let ids = block_ids_arg(&ids)?;
        Ok(self.core()?.touch_block_ids(&ids)?)
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

    /// Free blocks.
    #[getter]
    fn num_free_blocks(&self) -> PyResult<u32> {
        Ok(self.core()?.num_free_blocks())
    }

    /// Blocks in the pool, the null block included (with two-level pages: pages, the
    /// config's `num_blocks`).
    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.core()?.config().num_blocks)
    }

    /// Slots per page (two-level pages; 1: one pool, today's layout).
    #[getter]
    fn slots_per_page(&self) -> PyResult<u32> {
        Ok(self.core()?.config().slots_per_page)
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

    /// Takes the residency log (``residency_log=True``): the calls vLLM's ``BlockPool`` would
    /// have made on a ``KVCacheMetricsCollector`` since the last take, in its order, as flat
    /// ``[op, block_id, op, block_id, ...]`` (op 0 ``on_block_allocated``, 1
    /// ``on_block_accessed``, 2 ``on_block_evicted``, 3 ``reset`` with block 0).
    fn take_residency_log<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let log = self.core()?.take_residency_log();
        PyList::new(py, log.into_iter().flat_map(|(op, b)| [op as u32, b]))
    }

    /// Drains the copy-on-write copies queued since the last take (vLLM's
    /// ``take_kv_cache_block_copies``; partial hash hits only), as flat
    /// ``[source, copy, source, copy, ...]``. Both blocks of a pair hold one extra reference
    /// until given back with ``free_block_ids`` (vLLM's retained blocks).
    fn take_kv_cache_block_copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core()?.take_kv_cache_block_copies())
    }

    /// Takes the boundary states Mamba "align" groups keyed since the last take
    /// (``boundary_offloads=True``; vLLM's ``take_boundary_state_offloads``), as flat
    /// ``[handle, group, block_id, boundary_tokens, ...]``, group by group.
    fn take_boundary_state_offloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core()?.take_boundary_state_offloads())
    }

    /// Reference count of a block.
    fn ref_cnt(&self, block_id: i64) -> PyResult<u32> {
        let core = self.core()?;
        let (pool, b) = Self::block(&core, block_id)?;
        Ok(pool.ref_cnt(b))
    }

    /// `(hash bytes, group)` of a cached block, or None.
    fn block_hash<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let core = self.core()?;
        let (pool, b) = Self::block(&core, block_id)?;
        Ok(pool.block_hash(b).map(|(h, g)| (PyBytes::new(py, h.as_bytes()), *g)))
    }

    /// vLLM's `BlockPool.get_cached_block`: the first cached block for `block_hash` in each
    /// group of `group_ids`, or None on a miss in any group. `OutOfRangeError` for a hash
    /// that is not 1 to 32 bytes or a group that does not exist.
    fn get_cached_block(&self, block_hash: &Bound<'_, PyBytes>, group_ids: Vec<i64>) -> PyResult<Option<Vec<u32>>> {
        let core = self.core()?;
        let hash = hash_arg(block_hash.as_bytes())?;
        let groups = api::cached_block_groups(&group_ids, core.num_groups())?;
        let mut out = Vec::with_capacity(groups.len());
        if core.page_pool().is_none() {
            return Ok(core.pool().get_cached_block(&hash, &groups, &mut out).then_some(out));
        }
        // Two-level pages: each group in its own pool (a state group's block is a page id).
        let mut one = Vec::with_capacity(1);
        for g in groups {
            if !core.pool_for(g).get_cached_block(&hash, &[g], &mut one) {
                return Ok(None);
            }
            out.push(one[0]);
        }
        Ok(Some(out))
    }

    /// Prefix tokens covered by a block's hash, or None when unhashed.
    fn block_hash_num_tokens(&self, block_id: i64) -> PyResult<Option<u32>> {
        let core = self.core()?;
        let (pool, b) = Self::block(&core, block_id)?;
        Ok(pool.block_hash(b).map(|_| pool.block_hash_num_tokens(b)))
    }

    /// Blocks whose own prefix-cache key ends inside the block (a partial tail or a junction
    /// under `--prefix-match-unit`): the memory the hits bench reports. O(pool).
    fn num_partial_tail_blocks(&self) -> PyResult<u32> {
        let core = self.core()?;
        let (pool, groups) = (core.pool(), &core.config().groups);
        let mut n = 0;
        for b in 1..pool.num_blocks() {
            if let Some(&(_, g)) = pool.block_hash(b) {
                let bs = groups.get(g as usize).map_or(0, |s| s.block_size);
                n += u32::from(bs > 0 && pool.block_hash_num_tokens(b) % bs != 0);
            }
        }
        Ok(n)
    }

    /// Free blocks in eviction order.
    fn free_queue_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.core()?.pool().free_queue_order())
    }

    /// Up to `max_blocks` free blocks after block `after` (from the front when None), in
    /// eviction order: one chunk of vLLM's `free_block_queue.iter_blocks_after`. Empty when
    /// `after` is not a free block. O(blocks returned).
    #[pyo3(signature = (after, max_blocks))]
    fn free_queue_after<'py>(
        &self,
        py: Python<'py>,
        after: Option<i64>,
        max_blocks: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let after = after.map(|b| u32::try_from(b).unwrap_or(u32::MAX));
        PyList::new(py, self.core()?.pool().free_queue_after(after, max_blocks))
    }

    /// `(hash bytes, group)` of each key a block holds besides its own (partial hash hits'
    /// second keys; vLLM's `cached_block_hashes_by_block`), in the order they were added.
    fn second_keys<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Vec<(Bound<'py, PyBytes>, u32)>> {
        let core = self.core()?;
        let (pool, b) = Self::block(&core, block_id)?;
        Ok(pool.second_keys_of(b).iter().map(|(h, g)| (PyBytes::new(py, h.as_bytes()), *g)).collect())
    }

    /// Takes the queued events (see `hybrid_alloc.events`).
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.core()?.take_events();
        super::events::to_list(py, events)
    }

    /// Checks every internal invariant; raises `InvariantError` on a violation.
    fn check_invariants(&self) -> PyResult<()> {
        crate::invariants::check(&*self.core()?).map_err(InvariantError::new_err)
    }
}
