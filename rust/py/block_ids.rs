//! `BlockIds`: block ids of several groups in one flat buffer, and the one function that
//! turns such ids into Python lists (`tuple_of_groups`). Building either is O(ids); a
//! `BlockIds` makes no Python int until a caller asks for lists. Its `get_block_ids` is
//! vLLM's `KVCacheBlocks.get_block_ids` as a builtin method (one crossing, no Python frame);
//! `GetBlockIds` installs it on the adapter's `KVCacheBlocks` class, and `EmptyBlockIds`
//! answers it for the empty result. O(groups selected + ids returned) each.
#![forbid(unsafe_code)]

use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyTuple, PyType};

use super::convert::block_ids_arg;
use crate::ids::BlockId;

/// The groups `group_ids` selects of `num_groups` (all of them when `None`), in its order:
/// indexed as vLLM's tuple of groups is (negative from the end; an `IndexError` past it, a
/// `TypeError` for an item that is not an int, as the tuple raises).
fn selected_groups(num_groups: usize, group_ids: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<usize>>> {
    let Some(ids) = group_ids else { return Ok(None) };
    let groups = num_groups as i64;
    let mut out = Vec::new();
    for g in ids.try_iter()? {
        let g = g?;
        let g: i64 = match g.extract() {
            Ok(g) => g,
            // An int past i64 is past any tuple too.
            Err(_) if g.is_instance_of::<PyInt>() => return Err(PyIndexError::new_err("tuple index out of range")),
            Err(_) => {
                let name = g.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                return Err(PyTypeError::new_err(format!("tuple indices must be integers or slices, not {name}")));
            }
        };
        if g >= groups || g < -groups {
            return Err(PyIndexError::new_err("tuple index out of range"));
        }
        out.push(if g < 0 { (g + groups) as usize } else { g as usize });
    }
    Ok(Some(out))
}

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
    /// Ids given as one sequence of ints per group (a negative or too large id is an
    /// `InvalidBlockError`).
    #[new]
    fn py_new(groups: Vec<Vec<i64>>) -> PyResult<Self> {
        let mut ids = Vec::new();
        let mut counts = Vec::with_capacity(groups.len());
        for g in &groups {
            counts.push(u32::try_from(g.len()).map_err(|_| PyIndexError::new_err("too many block ids"))?);
            ids.extend(block_ids_arg(g)?);
        }
        Ok(Self { ids, counts })
    }

    /// vLLM's `KVCacheBlocks.get_block_ids`: fresh lists of ids, one per group (per
    /// `group_ids` when given, indexed as a tuple is), or `None` when `allow_none` (any
    /// true value) and every selected group is empty.
    #[pyo3(signature = (allow_none=None, *, group_ids=None))]
    #[pyo3(text_signature = "(self, allow_none=False, *, group_ids=None)")]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: Option<&Bound<'py, PyAny>>,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let allow_none = match allow_none {
            None => false,
            Some(a) => a.is_truthy()?,
        };
        let sel = match group_ids {
            None => None,
            Some(_) => selected_groups(self.counts.len(), group_ids)?,
        };
        let Some(sel) = sel else {
            if allow_none && self.ids.is_empty() {
                return Ok(py.None().into_bound(py));
            }
            return Ok(tuple_of_groups(py, &self.ids, &self.counts)?.into_any());
        };
        let mut starts = Vec::with_capacity(self.counts.len());
        let mut off = 0usize;
        for &c in &self.counts {
            starts.push(off);
            off += c as usize;
        }
        if allow_none && sel.iter().all(|&g| self.counts[g] == 0) {
            return Ok(py.None().into_bound(py));
        }
        let mut lists = Vec::with_capacity(sel.len());
        for g in sel {
            lists.push(PyList::new(py, &self.ids[starts[g]..starts[g] + self.counts[g] as usize])?);
        }
        Ok(PyTuple::new(py, lists)?.into_any())
    }

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

    #[pyo3(signature = (allow_none=None, *, group_ids=None))]
    #[pyo3(text_signature = "(self, allow_none=False, *, group_ids=None)")]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: Option<&Bound<'py, PyAny>>,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = match group_ids {
            None => self.num_groups, // the scheduler's call: no function call to get here
            Some(_) => selected_groups(self.num_groups, group_ids)?.map_or(self.num_groups, |s| s.len()),
        };
        if let Some(a) = allow_none {
            if a.is_truthy()? {
                return Ok(py.None().into_bound(py));
            }
        }
        let lists = (0..n).map(|_| PyList::empty(py)).collect::<Vec<_>>();
        Ok(PyTuple::new(py, lists)?.into_any())
    }
}

/// `get_block_ids` of the adapter's `KVCacheBlocks` class (`NativeKVCacheBlocks`), whose
/// instances hold their ids as a `BlockIds` in the attribute `_src`: read on an instance, it
/// is that buffer's `get_block_ids` (a builtin method: the scheduler's
/// `get_block_ids(allow_none=True)` then runs no Python frame); called on the class with the
/// instance first (`NativeKVCacheBlocks.get_block_ids(blocks, ...)`, or a wrapper that
/// forwards to it), it answers the same. O(1) to read, plus the call's cost.
#[pyclass(module = "hybrid_alloc._core", name = "GetBlockIds", frozen)]
pub struct PyGetBlockIds;

/// `blocks._src` as a `BlockIds`.
fn source<'py>(blocks: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBlockIds>> {
    let src = blocks.getattr(intern!(blocks.py(), "_src"))?;
    src.cast_into::<PyBlockIds>().map_err(|e| {
        PyTypeError::new_err(format!("KVCacheBlocks._src must be a BlockIds, not {}", e.into_inner().get_type()))
    })
}

#[pymethods]
impl PyGetBlockIds {
    #[new]
    fn new() -> Self {
        Self
    }

    fn __get__<'py>(
        slf: &Bound<'py, Self>,
        instance: Option<&Bound<'py, PyAny>>,
        owner: Option<&Bound<'py, PyType>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = owner;
        match instance {
            None => Ok(slf.clone().into_any()),
            Some(blocks) => source(blocks)?.getattr(intern!(slf.py(), "get_block_ids")),
        }
    }

    #[pyo3(signature = (blocks, allow_none=None, *, group_ids=None))]
    fn __call__<'py>(
        &self,
        blocks: &Bound<'py, PyAny>,
        allow_none: Option<&Bound<'py, PyAny>>,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        source(blocks)?.get().get_block_ids(blocks.py(), allow_none, group_ids)
    }
}
