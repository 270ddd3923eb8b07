"""KV connectors written for the tests, loaded by vLLM from this module's path
(``kv_connector_module_path="module_connectors"``), as a user's own connector would be.

- :class:`HashStoreConnector` (``SupportsHMA``): an external store of block hashes. Its
  scheduler side binds the block pool (``bind_gpu_block_pool``) and reads only what the
  manager serves: a finished request's blocks' hashes (``block_pool.blocks[i].block_hash``,
  ``is_null``), the groups' block sizes (``coordinator.single_type_managers[g].block_size``),
  and a free-block count for its metadata. A later prompt whose leading hashes are stored gets
  them as a sync external hit (beyond the local one, on scheduler-block boundaries); its
  metadata lists each step's loads (blocks per group) and stores. The worker side does nothing.
- :class:`PinningConnector`: the same, but pins blocks (``block_pool.touch``), which the
  manager does not serve: it falls back.
- :class:`HandOffConnector`: the same, but hands the pool to code outside its package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


@dataclass
class HashStoreMetadata(KVConnectorMetadata):
    # request -> (blocks per group, external tokens) of each load this step.
    loads: dict[str, tuple[list[list[int]], int]] = field(default_factory=dict)
    # requests whose blocks' hashes were stored since the last step, with how many.
    stores: dict[str, int] = field(default_factory=dict)
    free_blocks: int = 0


class HashStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._pool: Any = None
        self._stored: set[bytes] = set()
        self._pending: dict[str, int] = {}  # request -> external tokens it was promised
        self._meta = HashStoreMetadata()
        cfg = vllm_config.cache_config
        self._block_size = vllm_config.cache_config.block_size if cfg is not None else 16

    # ---- scheduler side -----------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool

    def _scheduler_block_size(self) -> int:
        mgr = self._kv_cache_manager
        sizes = [m.block_size for m in mgr.coordinator.single_type_managers]
        out = 1
        for s in sizes:
            out = out * s // _gcd(out, s)
        return out

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        hbs = self._pool.hash_block_size
        n = 0
        for h in request.block_hashes:
            if h not in self._stored:
                break
            n += hbs
        bs = self._scheduler_block_size()
        n = min(n, request.num_tokens - 1) // bs * bs
        return max(n - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            ids = [[b.block_id for b in g if not b.is_null] for g in blocks.blocks]
            self._meta.loads[request.request_id] = (ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, HashStoreMetadata()
        meta.free_blocks = self._pool.get_num_free_blocks()
        return meta

    def _store(self, request: Any, block_ids: tuple[list[int], ...]) -> None:
        # The group whose table holds the longest run of hashed blocks from the start (a
        # sliding-window group's early blocks are null by the time the request finishes).
        blocks = self._pool.blocks
        hbs = self._pool.hash_block_size
        best: list[Any] = []
        for g, ids in enumerate(block_ids):
            per = self._kv_cache_manager.coordinator.single_type_managers[g].block_size // hbs
            run = []
            for i, b in enumerate(ids):
                view = blocks[b]
                if view.is_null or view.block_hash is None:
                    break
                run.extend(request.block_hashes[i * per : (i + 1) * per])
            if len(run) > len(best):
                best = run
        self._stored.update(best)
        self._meta.stores[request.request_id] = len(best)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._store(request, (block_ids,))
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._store(request, block_ids)
        return False, None

    # ---- worker side: nothing to move ---------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class PinningConnector(HashStoreConnector):
    """Pins a finished request's blocks in the GPU pool (``block_pool.touch``: the pool facade
    serves it for SimpleCPUOffloadConnector, whose pins it gives back, but a module-path
    connector's own pins are not vetted, so the source read does not serve it)."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pool.touch([self._pool.blocks[b] for b in block_ids[0]])
        return super().request_finished_all_groups(request, block_ids)


class HandOffConnector(HashStoreConnector):
    """Hands the pool to code outside its package, which the vetting cannot follow."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        import weakref

        self._pool = gpu_block_pool
        self._finalizer = weakref.finalize(gpu_block_pool, print, "pool collected")
