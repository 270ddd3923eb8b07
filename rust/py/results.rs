//! Small typed values that cross the boundary: `Hit`, where `allocate_slots` takes a cache
//! hit from,. Each is a frozen pyclass; making one is O(1).
#![forbid(unsafe_code)]

use pyo3::prelude::*;

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
