//! Small typed values that cross the boundary: `Hit`, where `allocate_slots` takes a cache
//! hit from, and `NoopLimits`, what `noop_limits` returns. Each is a frozen pyclass; making
//! one is O(1).
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::{PyIterator, PyTuple};

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

/// `noop_limits`' result: a plain step (no new hit, external or encoder tokens, admission
/// gate, reserve or watermark) with `num_computed_tokens + num_new_tokens +
/// num_lookahead_tokens <= slots`, `num_computed_tokens - num_in_flight_tokens < processed`,
/// `min(num_computed_tokens + num_new_tokens, num_tokens) < cached` and `num_new_tokens <=
/// new_tokens` changes nothing. It reads by field name and still behaves as the 4-tuple
/// `(slots, processed, cached, new_tokens)` it used to be (unpacking, indexing, equality).
#[pyclass(module = "hybrid_alloc._core", name = "NoopLimits", frozen)]
#[derive(Clone, Copy)]
pub struct PyNoopLimits {
    /// Token slots the tables already hold.
    #[pyo3(get)]
    slots: u32,
    /// Processed tokens below which no block falls out of a window.
    #[pyo3(get)]
    processed: u32,
    /// Tokens below which no new block becomes full.
    #[pyo3(get)]
    cached: u32,
    /// Most tokens a no-op step schedules.
    #[pyo3(get)]
    new_tokens: u32,
}

impl From<crate::coordinator::NoopLimits> for PyNoopLimits {
    fn from(l: crate::coordinator::NoopLimits) -> Self {
        Self { slots: l.slots, processed: l.processed, cached: l.cached, new_tokens: l.new_tokens }
    }
}

impl PyNoopLimits {
    /// The fields as a tuple, in order.
    fn tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, [self.slots, self.processed, self.cached, self.new_tokens])
    }
}

#[pymethods]
impl PyNoopLimits {
    fn __len__(&self) -> usize {
        4
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.tuple(py)?.as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        self.tuple(py)?.try_iter()
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        match other.cast::<PyNoopLimits>() {
            Ok(o) => Ok(self.tuple(py)?.eq(o.get().tuple(py)?)?),
            Err(_) => self.tuple(py)?.eq(other),
        }
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        self.tuple(py)?.hash()
    }

    fn __repr__(&self) -> String {
        format!(
            "NoopLimits(slots={}, processed={}, cached={}, new_tokens={})",
            self.slots, self.processed, self.cached, self.new_tokens
        )
    }
}
