//! The Python binding (`hybrid_alloc._core`): the only place that names pyo3. It converts
//! arguments and results and maps errors to the exception hierarchy; every rule (what is
//! refused, the defaults, the kind registry, the no-op limits of the fast path, hash sync,
//! handle generations) lives in the core. One Python-to-Rust crossing per call; ints, bytes
//! and flat lists cross the boundary, never an object per block.
//!
//! | file | holds |
//! |---|---|
//! | `errors.rs` | the exception classes and the core error -> exception mapping |
//! | `convert.rs` | counts, handles, block ids, block hashes, the `hit` argument |
//! | `groups.rs` | the constructor's `groups`: named group specs and legacy tuples |
//! | `events.rs` | the core's events as the `NamedTuple`s of `hybrid_alloc.events` |
//! | `results.rs` | small typed values (`Hit`, `NoopLimits`) |
//! | `block_ids.rs` | `BlockIds`, the flat block-id buffer and its `get_block_ids`; `GetBlockIds`, the adapter class's `get_block_ids`; `EmptyBlockIds`, the empty result's |
//! | `pool.rs` | `AllocatorBase`: the core, and the calls that take no request handle |
//! | `allocator.rs` | `Allocator(AllocatorBase)`: the calls that take a request handle |
//! | `fast.rs` | `FastAllocate`, the vLLM fast path, and the `Request` protocol it reads |
//! | `floor.rs` | `DecodeFloor`, the bench's probe of the decode call's least cost (not a plugin mode); only with the cargo feature `bench-probe`, which the release wheel leaves out |
#![forbid(unsafe_code)]

mod allocator;
mod block_ids;
mod convert;
mod errors;
mod events;
mod fast;
#[cfg(feature = "bench-probe")]
mod floor;
mod groups;
mod kwargs;
mod pool;
mod results;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyAllocatorBase>()?;
    m.add_class::<allocator::PyAllocator>()?;
    m.add_class::<fast::FastAllocate>()?;
    #[cfg(feature = "bench-probe")]
    m.add_class::<floor::DecodeFloor>()?;
    m.add_class::<results::PyHit>()?;
    m.add_class::<results::PyNoopLimits>()?;
    m.add_class::<block_ids::PyBlockIds>()?;
    m.add_class::<block_ids::PyEmptyBlockIds>()?;
    m.add_class::<block_ids::PyGetBlockIds>()?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
