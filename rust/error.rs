//! The core's error type: every variant is a caller mistake or a configuration the core
//! cannot serve. Running out of blocks is not an error (it is `Ok(None)`, as in vLLM).
//! Each variant maps to one Python exception class (see `rust/py`).
#![forbid(unsafe_code)]

use std::fmt;

/// What went wrong; a failed call leaves the allocator unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The configuration is invalid or outside what the core serves.
    InvalidConfig(String),
    /// The configuration is valid for vLLM but the core does not implement it.
    Unsupported(String),
    /// A request handle that is not live (never issued, freed, or another allocator's).
    UnknownRequest(u64),
    /// A count or index outside its allowed range.
    OutOfRange(String),
    /// A call the request's state does not allow (a running request adopting a cache hit,
    /// cache-hit blocks with prefix caching off, computed tokens past the slots the tables
    /// were given). Python raises `InvalidStateError`, a subclass of `OutOfRangeError`
    /// (which these calls raised before the kind was split off).
    InvalidState(String),
    /// A block id that is not in the pool, or a block in the wrong state (e.g. freeing
    /// a block whose reference count is already 0).
    InvalidBlock(String),
    /// A buffer the configuration needs (the pool's metadata) cannot be allocated.
    OutOfMemory(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidConfig(m) => write!(f, "invalid configuration: {m}"),
            Error::Unsupported(m) => write!(f, "unsupported configuration: {m}"),
            Error::UnknownRequest(h) => write!(f, "unknown request handle {h}"),
            Error::OutOfRange(m) => write!(f, "value out of range: {m}"),
            Error::InvalidState(m) => write!(f, "invalid state: {m}"),
            Error::InvalidBlock(m) => write!(f, "invalid block: {m}"),
            Error::OutOfMemory(m) => write!(f, "out of memory: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;
