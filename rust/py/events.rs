//! The core's events as Python values: `("stored", handle, group, block_size, start_token,
//! end_token, parent_hash | None, [hashes], [block indices])`, `("removed", hash, group)`,
//! `("cleared",)`. O(hashes) per event.
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::block_pool::Event;

/// The events as a list of tuples.
pub(super) fn to_list(py: Python<'_>, events: Vec<Event>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        let item: Bound<'_, PyTuple> = match e {
            Event::Stored { req, group, block_size, start_token, end_token, parent, hashes, block_indices } => {
                let hs: Vec<Bound<'_, PyBytes>> = hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())).collect();
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
