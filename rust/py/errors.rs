//! The exception hierarchy under `HybridAllocError`, and the one mapping from the core's
//! [`Error`] to it (each variant raises one class; running out of memory is `MemoryError`).
#![forbid(unsafe_code)]

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::prelude::*;

use crate::error::Error;

create_exception!(_core, HybridAllocError, PyException, "Base class of every hybrid_alloc error.");
create_exception!(_core, InvalidConfigError, HybridAllocError, "The configuration is invalid.");
create_exception!(
    _core,
    UnsupportedConfigError,
    HybridAllocError,
    "The configuration is valid for vLLM but not served by the native core."
);
create_exception!(_core, UnknownRequestError, HybridAllocError, "The request handle is not live.");
create_exception!(_core, OutOfRangeError, HybridAllocError, "A count or index is out of range.");
create_exception!(
    _core,
    InvalidStateError,
    OutOfRangeError,
    "The call is not allowed in the request's state (a subclass of OutOfRangeError, which it was before)."
);
create_exception!(_core, InvalidBlockError, HybridAllocError, "A block id is invalid or in the wrong state.");
create_exception!(_core, InvariantError, HybridAllocError, "An internal invariant is violated (a bug).");
create_exception!(
    _core,
    ConcurrentUseError,
    HybridAllocError,
    "The allocator was called while another call on it was in progress (threads or re-entry)."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::InvalidConfig(_) => InvalidConfigError::new_err(msg),
            Error::Unsupported(_) => UnsupportedConfigError::new_err(msg),
            Error::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            Error::OutOfRange(_) => OutOfRangeError::new_err(msg),
            Error::InvalidState(_) => InvalidStateError::new_err(msg),
            Error::InvalidBlock(_) => InvalidBlockError::new_err(msg),
            Error::OutOfMemory(_) => PyMemoryError::new_err(msg),
        }
    }
}

/// Adds the exception classes to the module.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridAllocError", py.get_type::<HybridAllocError>())?;
    m.add("InvalidConfigError", py.get_type::<InvalidConfigError>())?;
    m.add("UnsupportedConfigError", py.get_type::<UnsupportedConfigError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("OutOfRangeError", py.get_type::<OutOfRangeError>())?;
    m.add("InvalidStateError", py.get_type::<InvalidStateError>())?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    m.add("ConcurrentUseError", py.get_type::<ConcurrentUseError>())?;
    Ok(())
}
