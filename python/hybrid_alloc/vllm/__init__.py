"""The vLLM V1 integration (vLLM 0.32.0).

- :mod:`hybrid_alloc.vllm.plugin`: the ``vllm.general_plugins`` entry point; with
  ``HYBRID_ALLOC=1`` it makes vLLM's scheduler build :class:`HybridKVCacheManager`.
- :mod:`hybrid_alloc.vllm.manager`: the ``KVCacheManager``-compatible adapter over the
  native core, and the fallback to vLLM's own manager for configurations the core does
  not serve.

Importing this package imports vLLM.
"""

from hybrid_alloc.vllm.manager import HybridKVCacheManager, native_config_or_reason

__all__ = ["HybridKVCacheManager", "native_config_or_reason"]
