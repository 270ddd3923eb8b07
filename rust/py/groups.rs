//! The constructor's `groups`: one KV cache group per entry, either a named group spec (an
//! object read by attribute: `kind`, `block_size`, `spec_key` and the kind's own fields,
//! as the dataclasses of `hybrid_alloc.specs` have them) or the legacy positional tuple
//! `(kind, block_size, spec_key, param1, param2[, param3])`. Which fields a kind has, what
//! each tuple position means and their defaults are the core's kind registry
//! ([`crate::api::KINDS`]); this file only reads them. O(fields) per group.
#![forbid(unsafe_code)]

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use super::errors::InvalidConfigError;
use crate::api;
use crate::config::GroupSpec;

/// One legacy `groups` entry: `(kind, block_size, spec_key, param1, param2)`, or with a `param3`.
#[derive(FromPyObject)]
enum GroupTuple {
    Six((String, i64, i64, i64, i64, i64)),
    Five((String, i64, i64, i64, i64)),
}

/// The group entry `index` of `groups` names.
///
/// # Errors
/// `TypeError` for an entry that is neither a tuple of that shape nor an object with a
/// `kind`; `UnsupportedConfigError` for an unknown kind; `InvalidConfigError` for a spec
/// missing a required field or with a field of the wrong type; `OutOfRangeError` for a
/// negative or too large value.
pub(super) fn group_spec(index: usize, entry: &Bound<'_, PyAny>) -> PyResult<GroupSpec> {
    if entry.is_instance_of::<PyTuple>() {
        let (kind, bs, key, p1, p2, p3) = match entry.extract::<GroupTuple>()? {
            GroupTuple::Six(t) => t,
            GroupTuple::Five((kind, bs, key, p1, p2)) => (kind, bs, key, p1, p2, 0),
        };
        return Ok(api::positional_group_spec(&kind, bs, key, [p1, p2, p3])?);
    }
    let py = entry.py();
    let type_name = entry.get_type().name()?.to_string();
    let Some(kind) = entry.getattr_opt(pyo3::intern!(py, "kind"))? else {
        return Err(PyTypeError::new_err(format!(
            "groups[{index}]: expected a group spec (an object with kind, block_size, ...) or a \
             (kind, block_size, spec_key, param1, param2[, param3]) tuple, got {type_name}"
        )));
    };
    let kind = kind
        .cast::<PyString>()
        .map_err(|_| InvalidConfigError::new_err(format!("groups[{index}] ({type_name}): kind must be a str")))?;
    let kind = kind.to_str()?;
    let entry_of = api::kind_entry(kind)?;
    let field = |name: &str, default: Option<i64>| -> PyResult<i64> {
        match entry.getattr_opt(name)? {
            Some(v) => v.extract::<i64>().map_err(|_| {
                InvalidConfigError::new_err(format!(
                    "groups[{index}] ({type_name}, kind {kind:?}): {name} must be an int"
                ))
            }),
            None => default.ok_or_else(|| {
                InvalidConfigError::new_err(format!(
                    "groups[{index}] ({type_name}, kind {kind:?}) has no field {name:?}"
                ))
            }),
        }
    };
    let block_size = field("block_size", None)?;
    let spec_key = field("spec_key", Some(0))?;
    // The kind's fields in registry order are exactly the legacy tuple's `param1..3`.
    let mut params = [0i64; 3];
    for (v, p) in params.iter_mut().zip(entry_of.params) {
        *v = field(p.name(), p.default_value())?;
    }
    Ok(api::positional_group_spec(kind, block_size, spec_key, params)?)
}
