"""The constructor arguments of vLLM's ``KVCacheManager``, spelled once.

:class:`ManagerArgs` holds every argument the adapter knows (every supported release's), each
with vLLM's default; :meth:`ManagerArgs.bind` reads a call's arguments the way the installed
vLLM's constructor would take them. An argument the installed constructor takes and this
class does not know means a release whose meaning has not been checked: it is refused
(``Unsupported``), and the adapter falls back.

Cost: one ``inspect.signature`` and one bind per manager construction (not on any hot path).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = ["KNOWN_ARGS", "ManagerArgs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerArgs:
    """``KVCacheManager.__init__``'s arguments by name; an argument the installed release
    does not take keeps the default below (which is what that release does without it)."""

    kv_cache_config: Any
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    use_eagle: bool = False
    # 0.33 only: lookahead block hashes (see ``compat.LOOKAHEAD_HASHES``).
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    log_stats: bool = False
    enable_kv_cache_events: bool = False
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    metrics_collector: Any = None
    watermark: float = 0.0
    enable_mamba_shared_prefix_checkpoint: bool = False

    @classmethod
    def bind(cls, vllm_manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ManagerArgs:
        """The arguments of the call ``vllm_manager(*args, **kwargs)``, defaults applied.
        Raises ``Unsupported`` naming any argument ``vllm_manager`` takes that this class
        does not know, or when the call does not match its signature."""
        try:
            sig = inspect.signature(vllm_manager)
        except (TypeError, ValueError) as e:
            raise Unsupported(f"cannot read vLLM's KVCacheManager signature ({e})") from None
        unknown = sorted(set(sig.parameters) - KNOWN_ARGS)
        if unknown:
            raise Unsupported(
                f"unknown KVCacheManager argument(s) {', '.join(unknown)} (not in the tested vLLM releases)"
            )
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise Unsupported(f"the arguments do not match vLLM's KVCacheManager: {e}") from None
        bound.apply_defaults()
        return cls(**bound.arguments)


# Every ``KVCacheManager.__init__`` argument the adapter knows.
KNOWN_ARGS = frozenset(f.name for f in dataclasses.fields(ManagerArgs))
