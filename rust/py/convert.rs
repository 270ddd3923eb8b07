//! Conversions of Python arguments into the core's types: counts, handles, block ids, block
//! hashes (a list of `bytes` read in place as a [`HashSource`]) and a cache hit. Each is O(its
//! input); a value that cannot be one raises the class its core error maps to.
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::errors::{InvalidBlockError, UnknownRequestError};
use super::results::PyHit;
use crate::coordinator::{token_count, HashSource, NewComputed};
use crate::error::Error;
use crate::ids::{BlockHash, BlockId};

/// A count as `u32` (`OutOfRangeError` otherwise).
pub(super) fn u32_arg(name: &str, v: i64) -> PyResult<u32> {
    Ok(token_count(name, v)?)
}

/// A non-negative int as `u64` (`OutOfRangeError` for a negative one).
pub(super) fn u64_arg(name: &str, v: i64) -> PyResult<u64> {
    Ok(u64::try_from(v).map_err(|_| Error::OutOfRange(format!("{name}={v} is negative")))?)
}

/// A block id from a Python int; a negative or too large one is an `InvalidBlockError`.
pub(super) fn block_id_arg(b: i64) -> PyResult<BlockId> {
    u32::try_from(b).map_err(|_| InvalidBlockError::new_err(format!("block id {b}")))
}

/// Block ids from Python ints (see [`block_id_arg`]).
pub(super) fn block_ids_arg(ids: &[i64]) -> PyResult<Vec<BlockId>> {
    ids.iter().map(|&b| block_id_arg(b)).collect()
}

/// A handle from a Python int; one that cannot be a handle is unknown.
pub(super) fn handle_arg(h: i64) -> PyResult<u64> {
    u64::try_from(h).map_err(|_| UnknownRequestError::new_err(format!("unknown request handle {h}")))
}

/// One hash from `bytes` (1 to 32 of them).
pub(super) fn hash_arg(b: &[u8]) -> crate::Result<BlockHash> {
    BlockHash::from_bytes(b)
        .ok_or_else(|| Error::OutOfRange(format!("block hash has {} bytes (1 to 32 are valid)", b.len())))
}

/// A Python list of `bytes` as the core's [`HashSource`]; items are read when the core asks.
pub(super) struct PyHashes<'a, 'py>(pub(super) &'a Bound<'py, PyList>);

impl HashSource for PyHashes<'_, '_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, i: usize) -> crate::Result<BlockHash> {
        let item = self.0.get_item(i).map_err(|_| Error::OutOfRange(format!("block hash {i} vanished")))?;
        let bytes = item.cast::<PyBytes>().map_err(|_| Error::OutOfRange(format!("block hash {i} is not bytes")))?;
        let b = bytes.as_bytes();
        BlockHash::from_bytes(b)
            .ok_or_else(|| Error::OutOfRange(format!("block hash {i} has {} bytes (1 to 32 are valid)", b.len())))
    }
}

/// `allocate_slots`' `hit`: `None`, a [`PyHit`], or explicit block ids (one sequence per
/// group, stored in `explicit`, which the result borrows).
pub(super) fn hit_arg<'a>(
    hit: Option<&Bound<'_, PyAny>>,
    explicit: &'a mut Vec<Vec<BlockId>>,
) -> PyResult<NewComputed<'a>> {
    let Some(obj) = hit else { return Ok(NewComputed::Empty) };
    if let Ok(k) = obj.cast::<PyHit>() {
        return Ok(match *k.get() {
            PyHit::Empty => NewComputed::Empty,
            PyHit::Stored => NewComputed::Stored,
        });
    }
    let groups: Vec<Vec<i64>> = obj.extract()?;
    *explicit = groups.iter().map(|g| block_ids_arg(g)).collect::<PyResult<_>>()?;
    Ok(NewComputed::Explicit(explicit))
}
