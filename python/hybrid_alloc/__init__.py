"""hybrid_alloc: a native (Rust) KV-cache block allocator for hybrid-attention models.

``import hybrid_alloc`` never imports vLLM; the vLLM integration lives in
:mod:`hybrid_alloc.vllm` and is switched on with ``HYBRID_ALLOC=1``.
"""

from hybrid_alloc._core import Allocator, Hit, __version__
from hybrid_alloc.errors import (
    ConcurrentUseError,
    HybridAllocError,
    InvalidBlockError,
    InvalidConfigError,
    InvariantError,
    OutOfRangeError,
    UnknownRequestError,
    UnsupportedConfigError,
)

__all__ = [
    "Allocator",
    "ConcurrentUseError",
    "Hit",
    "HybridAllocError",
    "InvalidBlockError",
    "InvalidConfigError",
    "InvariantError",
    "OutOfRangeError",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "__version__",
]
