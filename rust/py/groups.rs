//! The constructor's `groups`: one KV cache group per entry, as the legacy positional tuple
//! `(kind, block_size, spec_key, param1, param2[, param3])`. What each position means per
//! kind is the core's kind registry ([`crate::api::KINDS`]); this file only extracts.
#![forbid(unsafe_code)]

use pyo3::prelude::*;

use crate::api;
use crate::config::GroupSpec;

/// One `groups` entry: `(kind, block_size, spec_key, param1, param2)`, or with a `param3`.
#[derive(FromPyObject)]
pub(super) enum GroupArg {
    Six((String, i64, i64, i64, i64, i64)),
    Five((String, i64, i64, i64, i64)),
}

impl GroupArg {
    /// The group this entry names.
    pub(super) fn spec(self) -> PyResult<GroupSpec> {
        let (kind, bs, key, p1, p2, p3) = match self {
            GroupArg::Six(t) => t,
            GroupArg::Five((kind, bs, key, p1, p2)) => (kind, bs, key, p1, p2, 0),
        };
        Ok(api::positional_group_spec(&kind, bs, key, [p1, p2, p3])?)
    }
}
