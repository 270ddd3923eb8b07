//! `FastAllocate`, the vLLM adapter's `allocate_slots` fast path, and `PyStep`, the vLLM
//! `Request` as the core's [`StepFields`].
//!
//! # The `Request` protocol
//! What `FastAllocate.__call__` reads from the `request` it is given (vLLM's `Request`), only
//! on a plain step as the scheduler makes it for a running request (`(request,
//! num_new_tokens)` and at most the keyword `num_lookahead_tokens`, `num_new_tokens > 0`),
//! each attribute only when the core asks for it ([`StepFields`]):
//! - its handle in this allocator: from the table `track` fills (keyed by the request
//!   object's address, no attribute read), else from `_hybrid_alloc_handle: int`, optional,
//!   set by the adapter; absent, negative or stale sends the call to `slow`.
//! - `num_computed_tokens: int`: always.
//! - `num_in_flight_tokens: int`, `num_prompt_tokens: int`, `num_tokens: int`: when the
//!   no-op limits need them to prove the step changes nothing (in-flight tokens only if
//!   `num_computed_tokens` alone is not below the window limit, the prompt only with an
//!   R-SWA group, `num_tokens` only if the step would fill a block).
//! - all of those and `shared_prefix_boundary: int` and `block_hashes: list[bytes]` when
//!   the step allocates.
//!
//! It writes one attribute: `shared_prefix_boundary`, when the step reached a hit-aware
//! first-sighting stop and the core moved the request's junction to the next one
//! ([`crate::coordinator::Allocator::take_moved_junction`]).
//!
//! A property that raises propagates its exception; a wrong type raises `TypeError` (an int
//! field) or `OutOfRangeError` (`block_hashes` not a list, an item not 1 to 32 bytes). Cost:
//! a no-op step makes no Python object and reads one to four counts, and the handle's
//! attribute only for an untracked request (one probe of a small Rust table otherwise).
//! A step that allocates returns its new ids as the adapter's `KVCacheBlocks` class built
//! without a Python frame ([`MakeBlocks::Class`]: `object.__new__` and two attributes set,
//! the ids in one `BlockIds`), or through any other callable given as `make_blocks`.
#![forbid(unsafe_code)]

use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::PyTraverseError;
use rustc_hash::FxHashMap;
use std::sync::{Mutex, MutexGuard};

use super::allocator::PyAllocator;
use super::block_ids::{tuple_of_groups, PyBlockIds};
use super::convert::PyHashes;
use super::errors::{InvariantError, OutOfRangeError};
use crate::coordinator::{HashSource, PlainStep, StepFields};

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

/// `(request, num_new_tokens, num_lookahead_tokens)` of a plain step as the scheduler
/// calls it for a running request: two positionals, `num_new_tokens` an int above 0, and no
/// keyword but an int `num_lookahead_tokens`. Anything else (another keyword, a third
/// positional, a value of the wrong type) is `None`: the call goes to `slow`, which takes
/// every argument and raises for a wrong one. Cost: no Python object is made; the keyword's
/// dict is read by its one item, not probed.
fn decode_call<'py>(
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Option<(Bound<'py, PyAny>, i64, i64)>> {
    if args.len() != 2 {
        return Ok(None);
    }
    let Ok(num_new_tokens) = args.get_borrowed_item(1)?.extract::<i64>() else { return Ok(None) };
    if num_new_tokens <= 0 {
        return Ok(None);
    }
    let look = match kwargs {
        None => 0,
        Some(d) => match d.len() {
            0 => 0,
            // The dict's one item, and the key compared by identity first (CPython interns
            // keyword names): cheaper than a probe by key.
            1 => {
                let Some((key, value)) = d.iter().next() else { return Ok(None) };
                let name = intern!(args.py(), "num_lookahead_tokens");
                if !(key.is(name) || key.eq(name)?) {
                    return Ok(None);
                }
                match value.extract::<i64>() {
                    Ok(n) => n,
                    Err(_) => return Ok(None),
                }
            }
            _ => return Ok(None),
        },
    };
    Ok(Some((args.get_item(0)?, num_new_tokens, look)))
}

/// The junction the step just moved the request's `shared_prefix_boundary` to, taken: only
/// hit-aware moves one (its first-sighting stops), so under exact nothing is looked up.
fn moved_junction(core: &mut crate::coordinator::Allocator, handle: u64) -> PyResult<Option<u32>> {
    if core.policy() != crate::policy::Policy::HitAware {
        return Ok(None);
    }
    Ok(core.take_moved_junction(handle)?)
}

/// `FastAllocate`'s request table: a request object's address -> (the request, its handle).
type Tracked = FxHashMap<usize, (Py<PyAny>, u64)>;

/// How a step's new block ids become its result.
enum MakeBlocks {
    /// A class (the adapter's `NativeKVCacheBlocks`): the result is `object.__new__(cls)`,
    /// its `__init__` not run, with the attributes `_alloc` (the allocator) and `_src` (the
    /// ids as a `BlockIds`) set: no Python frame and no Python int.
    Class {
        /// The class.
        cls: Py<PyType>,
        /// `object.__new__`.
        new: Py<PyAny>,
    },
    /// Any other callable, called with a tuple of lists (one per group).
    Call(Py<PyAny>),
}

/// A step's new block ids, taken out of the core before its lock is released.
enum NewIds {
    /// For [`MakeBlocks::Class`].
    Buffer(PyBlockIds),
    /// For [`MakeBlocks::Call`].
    Lists(Py<PyTuple>),
}

/// The callbacks of a `FastAllocate` (dropped by the garbage collector's `__clear__`).
struct Callbacks {
    /// What a step with no new block returns (vLLM's empty `KVCacheBlocks`).
    empty: Py<PyAny>,
    /// The Python `allocate_slots`, for every call the fast path does not serve.
    slow: Py<PyAny>,
    /// Wraps new block ids in the adapter's blocks class.
    make_blocks: MakeBlocks,
    /// Called with the request when the step queued events or residency log entries, or
    /// `None`.
    on_events: Py<PyAny>,
}

/// `allocate_slots` for the vLLM adapter, called by the scheduler for every request every
/// step. A plain step of a running request (see [`decode_call`]) is served here
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
    /// The allocator the steps run on.
    alloc: Py<PyAllocator>,
    /// `None` once the garbage collector cleared it.
    callbacks: Option<Callbacks>,
    /// The handles `track` recorded, keyed by the request object's address, each with a
    /// reference to its request: the address cannot be reused by another object while the
    /// entry lives. A stale handle (its request freed in the core but not untracked) is
    /// refused by the core's generation check, as a stale attribute is. Behind a lock, not
    /// `&mut self`: `track` runs inside `__call__` (its `slow` path admits requests).
    tracked: Mutex<Tracked>,
}

impl FastAllocate {
    fn callbacks(&self) -> PyResult<&Callbacks> {
        self.callbacks.as_ref().ok_or_else(|| InvariantError::new_err("FastAllocate used after it was cleared"))
    }

    fn tracked(&self) -> PyResult<MutexGuard<'_, Tracked>> {
        self.tracked.lock().map_err(|_| InvariantError::new_err("FastAllocate's request table was poisoned"))
    }

    /// The request's handle: the tracked one, else its `_hybrid_alloc_handle` (`None`:
    /// absent or negative).
    fn handle(&self, request: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        if let Some((_, h)) = self.tracked()?.get(&(request.as_ptr() as usize)) {
            return Ok(Some(*h));
        }
        let Some(tag) = request.getattr_opt(intern!(request.py(), "_hybrid_alloc_handle"))? else { return Ok(None) };
        Ok(u64::try_from(tag.extract::<i64>()?).ok())
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
        let alloc = self.alloc.bind(py);
        let (blocks, has_events, moved) = {
            let mut core = super::allocator::core(alloc)?;
            if core.policy() == crate::policy::Policy::HitAware && core.may_move_junction(handle).unwrap_or(false) {
                super::allocator::junction_writable(request)?;
            }
            match core.plain_step(handle, num_new_tokens, num_lookahead_tokens, &PyStep(request))? {
                PlainStep::NotHere => return Ok(None),
                PlainStep::NoOp => return Ok(Some(cb.empty.clone_ref(py))),
                PlainStep::Allocated(None) => (None, core.has_events() || core.has_residency_log(), None),
                PlainStep::Allocated(Some(0)) => {
                    let moved = moved_junction(&mut core, handle)?;
                    (Some(None), core.has_events() || core.has_residency_log(), moved)
                }
                PlainStep::Allocated(Some(_)) => {
                    let (ids, counts) = (core.new_block_ids(), core.new_block_counts());
                    let new = match &cb.make_blocks {
                        MakeBlocks::Class { .. } => NewIds::Buffer(PyBlockIds::new(ids, counts)),
                        MakeBlocks::Call(_) => NewIds::Lists(tuple_of_groups(py, ids, counts)?.unbind()),
                    };
                    let moved = moved_junction(&mut core, handle)?;
                    (Some(Some(new)), core.has_events() || core.has_residency_log(), moved)
                }
            }
        };
        if let Some(j) = moved {
            // Hit-aware's next first-sighting stop: the scheduler ends the next chunk there.
            request.setattr(intern!(py, "shared_prefix_boundary"), j)?;
        }
        if has_events && !cb.on_events.is_none(py) {
            cb.on_events.bind(py).call1((request,))?;
        }
        Ok(Some(match blocks {
            None => py.None(),
            Some(None) => cb.empty.clone_ref(py),
            Some(Some(new)) => self.make_blocks(py, &cb.make_blocks, new)?.unbind(),
        }))
    }

    /// The result holding a step's new block ids.
    fn make_blocks<'py>(&self, py: Python<'py>, make: &MakeBlocks, new: NewIds) -> PyResult<Bound<'py, PyAny>> {
        match (make, new) {
            (MakeBlocks::Class { cls, new: object_new }, NewIds::Buffer(ids)) => {
                let out = object_new.bind(py).call1((cls.bind(py),))?;
                out.setattr(intern!(py, "_alloc"), self.alloc.bind(py))?;
                out.setattr(intern!(py, "_src"), Bound::new(py, ids)?)?;
                Ok(out)
            }
            (MakeBlocks::Call(f), NewIds::Lists(t)) => f.bind(py).call1((t,)),
            _ => Err(InvariantError::new_err("FastAllocate's new ids do not match its make_blocks")),
        }
    }
}

#[pymethods]
impl FastAllocate {
    #[new]
    fn new(
        py: Python<'_>,
        alloc: Py<PyAllocator>,
        empty: Py<PyAny>,
        slow: Py<PyAny>,
        make_blocks: Py<PyAny>,
        on_events: Py<PyAny>,
    ) -> PyResult<Self> {
        alloc.bind(py).as_super().get().set_serves_vllm();
        let make_blocks = match make_blocks.bind(py).cast::<PyType>() {
            Ok(cls) => MakeBlocks::Class {
                cls: cls.clone().unbind(),
                new: py.get_type::<PyAny>().getattr(intern!(py, "__new__"))?.unbind(),
            },
            Err(_) => MakeBlocks::Call(make_blocks),
        };
        let callbacks = Some(Callbacks { empty, slow, make_blocks, on_events });
        Ok(Self { alloc, callbacks, tracked: Mutex::default() })
    }

    /// Records `handle` as `request`'s (found by the object's address, without reading an
    /// attribute), or forgets the request when `handle` is negative. The adapter calls it
    /// where it sets and resets `_hybrid_alloc_handle`. O(1).
    fn track(&self, request: Bound<'_, PyAny>, handle: i64) -> PyResult<()> {
        let key = request.as_ptr() as usize;
        // The replaced entry (a reference to a request) is dropped after the lock is released.
        let _old = match u64::try_from(handle) {
            Ok(h) => self.tracked()?.insert(key, (request.unbind(), h)),
            Err(_) => self.tracked()?.remove(&key),
        };
        Ok(())
    }

    /// How many requests are tracked.
    fn num_tracked(&self) -> PyResult<usize> {
        Ok(self.tracked()?.len())
    }

    /// `allocate_slots(request, num_new_tokens, num_new_computed_tokens=0,
    /// new_computed_blocks=None, num_lookahead_tokens=0, **rest)`, vLLM's signature. Taken
    /// as `*args, **kwargs` and read here, not by pyo3's argument parser: the scheduler's
    /// decode call (`(request, num_new_tokens, num_lookahead_tokens=n)`, see
    /// [`decode_call`]) is recognised from the tuple and the one-key dict CPython builds for
    /// it anyway, and every other call is forwarded to `slow` as it came.
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(&self, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Py<PyAny>> {
        let py = args.py();
        let cb = self.callbacks()?;
        if let Some((request, num_new_tokens, num_lookahead_tokens)) = decode_call(args, kwargs)? {
            if let Some(h) = self.handle(&request)? {
                if let Some(out) = self.plain(py, cb, &request, h, num_new_tokens, num_lookahead_tokens)? {
                    return Ok(out);
                }
            }
        }
        Ok(cb.slow.bind(py).call(args, kwargs)?.unbind())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.alloc)?;
        if let Some(cb) = &self.callbacks {
            visit.call(&cb.empty)?;
            visit.call(&cb.slow)?;
            match &cb.make_blocks {
                MakeBlocks::Class { cls, new } => {
                    visit.call(cls)?;
                    visit.call(new)?;
                }
                MakeBlocks::Call(f) => visit.call(f)?,
            }
            visit.call(&cb.on_events)?;
        }
        if let Ok(t) = self.tracked.try_lock() {
            for (request, _) in t.values() {
                visit.call(request)?;
            }
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.callbacks = None;
        let old = self.tracked.get_mut().map(std::mem::take);
        drop(old);
    }
}
