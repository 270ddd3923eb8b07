"""The worker side of ``LMCacheConnectorV1`` for connector_driver's runs, faked over the
``lmcache`` package's real lookup protocol.

The connector's scheduler side (the ``lmcache`` package's ``LMCacheConnectorV1Impl``, which
vLLM's ``LMCacheConnectorV1`` wraps) asks the workers' lookup servers, over ZMQ, how many
leading tokens of a prompt the LMCache engine holds. Here one real ``LMCacheLookupServer``
(built by the package's ``LookupClientFactory.create_lookup_server``, as worker 0 builds it)
answers from a stand-in for the engine: the chunk hashes of what the fake worker stored, made
by the package's own ``ChunkedTokenDatabase``, so a hit is the longest stored chunk prefix,
as ``LMCacheEngine.lookup`` counts it. The worker stores each request the scheduler's
metadata asks it to save (``save_spec.can_save``, the metadata's chunk-cut ``token_ids``) once
the step's output comes back, and loads each one with ``load_spec.can_load`` in the step
(sync: LMCache reports no ``finished_recving``); a failed load reports the first loaded block
in ``invalid_block_ids``, as the connector's ``get_block_ids_with_load_errors`` does.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any


class _StoredChunks:
    """The engine as the lookup server sees it: ``config`` and ``lookup``."""

    def __init__(self, config: Any, metadata: Any) -> None:
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.config = config
        self.db = ChunkedTokenDatabase(config, metadata)
        self.stored: set[int] = set()

    def store(self, token_ids: list[int]) -> None:
        for _, _, key in self.db.process_tokens(list(token_ids), make_key=False):
            self.stored.add(int(key))

    def lookup(self, hashes: Any = None, offsets: Any = None, **_: Any) -> int:
        hit = 0
        for h, n in zip(hashes or [], offsets or []):
            if int(h) not in self.stored:
                break
            hit += int(n)
        return hit


class LMCacheWorker:
    """Worker 0 of a run whose scheduler has ``LMCacheConnectorV1`` configured (alone, or as
    the MultiConnector's child ``child``)."""

    def __init__(self, sched: Any, child: int | None = None) -> None:
        from lmcache.v1.lookup_client.factory import LookupClientFactory

        conn = sched.connector if child is None else sched.connector._connectors[child]
        self.child = child
        self.impl = conn._lmcache_engine
        meta = copy.copy(self.impl._manager.lmcache_engine_metadata)
        meta.worker_id = 0
        self.engine = _StoredChunks(self.impl.config, meta)
        self.server = LookupClientFactory.create_lookup_server(self.engine, meta)  # type: ignore[arg-type]
        assert self.server is not None

    def work(self, meta: Any, block_size: int) -> tuple[list[list[int]], list[int]]:
        """A step's stores (token ids) and sync loads (each load's first block)."""
        stores: list[list[int]] = []
        loads: list[int] = []
        if self.child is not None:
            meta = meta.metadata[self.child]  # under a MultiConnector
        for m in meta.requests:
            ls = m.load_spec
            if ls is not None and ls.can_load and len(m.slot_mapping) > ls.vllm_cached_tokens:
                loads.append(int(m.slot_mapping[ls.vllm_cached_tokens]) // block_size)
            if m.save_spec is not None and m.save_spec.can_save and m.token_ids:
                stores.append(list(m.token_ids))
        return stores, loads

    def store(self, token_ids: list[int]) -> None:
        self.engine.store(token_ids)

    def close(self) -> None:
        path = str(getattr(self.server.transport, "socket_path", "")).removeprefix("ipc://")
        self.server.close()
        self.impl.shutdown()
        if path:
            # ZMQ leaves an ipc socket's file behind.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
