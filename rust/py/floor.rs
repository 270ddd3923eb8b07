//! `DecodeFloor`: a bench-only probe of what the scheduler's decode call costs at the least
//! (issue 19). Not a mode of the plugin: only `hybrid-alloc bench --managers ...,floor`
//! installs it, as the adapter's `allocate_slots`, over a working manager.
//! Compiled only with the cargo feature `bench-probe` (`scripts/install-local.sh` turns it on;
//! the release wheel, `pyproject.toml`'s maturin `features`, does not): the shipped extension has
//! no `DecodeFloor`, and the bench then refuses `floor` (`hybrid_alloc.bench.floor`).
//!
//! Its `__call__` answers the scheduler's decode call (`(request, 1)` and at most one
//! keyword, `num_lookahead_tokens`) with a constant, the manager's empty result, reading
//! nothing of the request; every other call (an admission, a prefill chunk) goes to the
//! manager's own `allocate_slots`. So the decode call costs what CPython's call into a
//! C-level callable costs (the argument tuple, the keyword dict) and a few compares: the
//! floor of any manager under vLLM's call structure, where the scheduler calls
//! `allocate_slots` and `get_block_ids` once per running request per step. The manager's
//! state does not follow the decode steps (no block is ever added to a decoding request), so
//! its other calls stay valid but its pool stays emptier than a real manager's.
#![forbid(unsafe_code)]

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::PyTraverseError;

use super::errors::InvariantError;

/// The constant and the manager's `allocate_slots` (dropped by `__clear__`).
struct Targets {
    /// What every decode call returns (the manager's empty `KVCacheBlocks`).
    empty: Py<PyAny>,
    /// The manager's `allocate_slots`, for every other call.
    slow: Py<PyAny>,
}

/// The decode call's floor: see the module docs. Holds the manager's bound method and the
/// manager holds it, a cycle its `__traverse__` / `__clear__` show the garbage collector.
#[pyclass(module = "hybrid_alloc._core", name = "DecodeFloor")]
pub struct DecodeFloor {
    /// `None` once the garbage collector cleared it.
    targets: Option<Targets>,
}

#[pymethods]
impl DecodeFloor {
    #[new]
    fn new(empty: Py<PyAny>, slow: Py<PyAny>) -> Self {
        Self { targets: Some(Targets { empty, slow }) }
    }

    /// `allocate_slots(*args, **kwargs)`: `empty` for `(request, 1)` with at most one
    /// keyword (the int `1` compared by identity: CPython's small ints are shared), else
    /// `slow(*args, **kwargs)`.
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(&self, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Py<PyAny>> {
        let py = args.py();
        let t =
            self.targets.as_ref().ok_or_else(|| InvariantError::new_err("DecodeFloor used after it was cleared"))?;
        if args.len() == 2
            && kwargs.is_none_or(|d| d.len() <= 1)
            && args.get_borrowed_item(1)?.is(1_i64.into_pyobject(py)?)
        {
            return Ok(t.empty.clone_ref(py));
        }
        Ok(t.slow.bind(py).call(args, kwargs)?.unbind())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(t) = &self.targets {
            visit.call(&t.empty)?;
            visit.call(&t.slow)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.targets = None;
    }
}
