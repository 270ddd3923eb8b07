"""hybrid_alloc: a native (Rust) KV-cache block allocator for hybrid-attention models.

``import hybrid_alloc`` never imports vLLM; the vLLM integration lives in
:mod:`hybrid_alloc.vllm` and is switched on with ``HYBRID_ALLOC=1``. The names below load
the native extension on first use, so vLLM's plugin entry point
(``hybrid_alloc.vllm.plugin``) imports nothing while the plugin is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_alloc._core import Allocator, Hit, NoopLimits, __version__
    from hybrid_alloc.errors import (
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
    from hybrid_alloc.events import AllBlocksCleared, BlockRemoved, BlockStored, CoreEvent

__all__ = [
    "AllBlocksCleared",
    "Allocator",
    "BlockRemoved",
    "BlockStored",
    "ConcurrentUseError",
    "CoreEvent",
    "Hit",
    "HybridAllocError",
    "InvalidBlockError",
    "InvalidConfigError",
    "InvalidStateError",
    "InvariantError",
    "NoopLimits",
    "OutOfRangeError",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hybrid_alloc import _core, errors, events

        for module in (errors, events):
            if name in module.__all__:
                return getattr(module, name)
        return getattr(_core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
