"""The exception hierarchy: every error the core raises is a :class:`HybridAllocError`.

- :class:`InvalidConfigError`: the configuration is invalid.
- :class:`UnsupportedConfigError`: valid for vLLM, not served natively (the vLLM plugin
  falls back to vLLM's own manager on it).
- :class:`UnknownRequestError`: a request handle that is not live (a double free is one).
- :class:`OutOfRangeError`: a count or index outside its range.
- :class:`InvalidStateError` (a subclass of :class:`OutOfRangeError`, which these calls raised
  before): a call the request's state does not allow (a running request adopting a cache hit,
  cache-hit blocks with prefix caching off, computed tokens past the slots the tables were given).
- :class:`InvalidBlockError`: a block id outside the pool, or freed more often than held.
- :class:`InvariantError`: an internal invariant is broken (a bug; please report it).
- :class:`ConcurrentUseError`: a call reached an allocator while another call on it was in
  progress (another thread, or a callback re-entering it); nothing changed.

A call that raises leaves the allocator as it was.
"""

from hybrid_alloc._core import (
    ConcurrentUseError,
    HybridAllocError,
    InvalidBlockError,
    InvalidConfigError,
    InvalidStateError,
    InvariantError,
    OutOfRangeError,
    UnknownRequestError,
    UnsupportedConfigError,
)

__all__ = [
    "ConcurrentUseError",
    "HybridAllocError",
    "InvalidBlockError",
    "InvalidConfigError",
    "InvalidStateError",
    "InvariantError",
    "OutOfRangeError",
    "UnknownRequestError",
    "UnsupportedConfigError",
]
