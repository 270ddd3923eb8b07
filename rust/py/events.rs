//! The core's events as the typed events of `hybrid_alloc.events` (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`: `NamedTuple`s, so they still equal the plain tuples
//! `("stored", handle, group, block_size, start_token, end_token, parent_hash | None,
//! [hashes], [block indices])`, `("removed", hash, group)` and `("cleared",)`).
//!
//! The classes and `tuple.__new__` are looked up once per process and kept; an event is then
//! built with one call of `tuple.__new__(cls, fields)`, as the class's own `_make` would, so
//! no Python code runs per event. O(hashes) per event.
#![forbid(unsafe_code)]

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyTuple, PyType};

use crate::block_pool::Event;

/// `hybrid_alloc.events.BlockStored`.
static STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `hybrid_alloc.events.BlockRemoved`.
static REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `hybrid_alloc.events.AllBlocksCleared`.
static CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `tuple.__new__`.
static TUPLE_NEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// One event of class `cls` (a `NamedTuple`) with `fields`.
fn make<'py>(
    py: Python<'py>,
    cls: &PyOnceLock<Py<PyType>>,
    name: &str,
    fields: Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyAny>> {
    let cls = cls.import(py, "hybrid_alloc.events", name)?;
    let new = TUPLE_NEW
        .get_or_try_init(py, || py.get_type::<PyTuple>().getattr(intern!(py, "__new__")).map(Bound::unbind))?;
    new.bind(py).call1((cls, fields))
}

/// The events as a list of typed events.
pub(super) fn to_list(py: Python<'_>, events: Vec<Event>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        let item = match e {
            Event::Stored { req, group, block_size, start_token, end_token, parent, hashes, block_indices } => {
                let hs: Vec<Bound<'_, PyBytes>> = hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())).collect();
                let parent = parent.map(|p| PyBytes::new(py, p.as_bytes()));
                let fields = (
                    intern!(py, "stored"),
                    req,
                    group,
                    block_size,
                    start_token,
                    end_token,
                    parent,
                    PyList::new(py, hs)?,
                    PyList::new(py, block_indices)?,
                )
                    .into_pyobject(py)?;
                make(py, &STORED, "BlockStored", fields)?
            }
            Event::Removed { hash, group } => {
                let fields = (intern!(py, "removed"), PyBytes::new(py, hash.as_bytes()), group).into_pyobject(py)?;
                make(py, &REMOVED, "BlockRemoved", fields)?
            }
            Event::AllCleared => make(py, &CLEARED, "AllBlocksCleared", (intern!(py, "cleared"),).into_pyobject(py)?)?,
        };
        out.append(item)?;
    }
    Ok(out)
}
