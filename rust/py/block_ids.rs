//! `BlockIds`: block ids of several groups in one flat buffer, and the one function that
//! turns such ids into Python lists (`tuple_of_groups`). Building either is O(ids); a
//! `BlockIds` makes no Python int until a caller asks for lists.
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::ids::BlockId;

/// One list per group from flat `ids` cut by `counts` (which sum to `ids.len()`).
pub(super) fn tuple_of_groups<'py>(py: Python<'py>, ids: &[BlockId], counts: &[u32]) -> PyResult<Bound<'py, PyTuple>> {
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
    /// Every group's ids, group after group.
    ids: Vec<BlockId>,
    /// Ids of each group; sums to `ids.len()`.
    counts: Vec<u32>,
}

impl PyBlockIds {
    /// A copy of flat ids cut by `counts`.
    pub(super) fn new(ids: &[BlockId], counts: &[u32]) -> Self {
        Self { ids: ids.to_vec(), counts: counts.to_vec() }
    }

    /// A request's table, or its stored hit, in every group.
    pub(super) fn gather<'a>(
        num_groups: usize,
        group: impl Fn(usize) -> crate::Result<&'a [BlockId]>,
    ) -> PyResult<Self> {
        let mut ids = Vec::new();
        let mut counts = Vec::with_capacity(num_groups);
        for g in 0..num_groups {
            let v = group(g)?;
            counts.push(v.len() as u32);
            ids.extend_from_slice(v);
        }
        Ok(Self { ids, counts })
    }

    /// As a `BlockIds` object (`as_buffer=True`) or a tuple of lists.
    pub(super) fn into_py(self, py: Python<'_>, as_buffer: bool) -> PyResult<Py<PyAny>> {
        Ok(if as_buffer { Py::new(py, self)?.into_any() } else { self.lists(py)?.into_any().unbind() })
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
