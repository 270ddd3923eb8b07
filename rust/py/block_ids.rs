//! `BlockIds`: block ids of several groups in one flat buffer, and the one function that
//! turns such ids into Python lists (`tuple_of_groups`). Building either is O(ids); a
//! `BlockIds` makes no Python int until a caller asks for lists.
#![forbid(unsafe_code)]

use pyo3::exceptions::PyIndexError;
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

/// `get_block_ids` of the adapter's shared empty `KVCacheBlocks`, as a builtin: the
/// scheduler calls `get_block_ids(allow_none=True)` on it for every running request that got
/// no new block, and a builtin method answers with no Python frame. `None` when
/// `allow_none`; otherwise one fresh empty list per group (per `group_ids` when given).
#[pyclass(module = "hybrid_alloc._core", name = "EmptyBlockIds", frozen)]
pub struct PyEmptyBlockIds {
    /// Groups of the manager.
    num_groups: usize,
}

#[pymethods]
impl PyEmptyBlockIds {
    #[new]
    fn new(num_groups: usize) -> Self {
        Self { num_groups }
    }

    #[pyo3(signature = (allow_none=false, *, group_ids=None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: bool,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // As the tuple of groups indexes them: negative from the end, else an IndexError.
        let n = match group_ids {
            None => self.num_groups,
            Some(ids) => {
                let groups = self.num_groups as i64;
                let mut n = 0usize;
                for g in ids.try_iter()? {
                    let g: i64 = g?.extract()?;
                    if g >= groups || g < -groups {
                        return Err(PyIndexError::new_err("tuple index out of range"));
                    }
                    n += 1;
                }
                n
            }
        };
        if allow_none {
            return Ok(py.None().into_bound(py));
        }
        let lists = (0..n).map(|_| PyList::empty(py)).collect::<Vec<_>>();
        Ok(PyTuple::new(py, lists)?.into_any())
    }
}
