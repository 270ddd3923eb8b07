"""Mamba "align" boundary-state offloads for a KV connector (every supported vLLM release).

Every step the scheduler drains ``KVCacheManager.take_boundary_state_offloads()`` into
``KVConnectorBlockState.boundary_state_offloads``: ``{request_id: [(group_id, block_id,
boundary_tokens), ...]}``, one entry per boundary state a Mamba "align" group keyed in
``cache_blocks`` (the OffloadingConnector stores that block under that boundary's hash, since
an align table cannot be read positionally). The core records them when the configuration has Mamba
groups (``Allocator(boundary_offloads=True)``), connector or not, as vLLM's manager offers them
(the scheduler drains them every step, and builds ``KVConnectorBlockState`` only with a
connector; a direct caller sees the same offers as from vLLM's), and drops a request's entries when
its blocks go back to the pool, as vLLM's ``MambaManager.pop_blocks_for_free`` does; see
``rust/manager/boundary.rs``. :class:`BoundaryOffloads` takes them (one crossing: flat
``[handle, group, block, tokens, ...]``) and names each request by its id.

With sub-block partial hash hits (``--prefix-match-unit`` below the Mamba block size) the
prompt's last hash boundary may be keyed inside the request's own running state block (a
producer's partial tail): the copy-on-write that preserves it at the request's next allocation
appends the copy to the same entries (with the tail's tokens), and when the request finishes
first, ``HybridKVCacheManager.finalize_partial_tail_offloads`` returns the block itself (the
core's ``finalize_partial_tail_offloads``, one crossing; vLLM's rule: nothing forwarded past
the tail). Without sub-block keys it returns ``[]``, as vLLM's.
"""

from __future__ import annotations

from hybrid_alloc._core import Allocator

__all__ = ["BoundaryOffloads"]


class BoundaryOffloads:
    """The boundary-state offloads of one manager: ``req_ids`` maps the handle of each live
    request to its id (kept by the manager from a request's first call to its free), and
    :meth:`take` drains the core's entries into vLLM's dict. Cost: one crossing per take,
    O(entries)."""

    __slots__ = ("_alloc", "req_ids")

    def __init__(self, alloc: Allocator) -> None:
        self._alloc = alloc
        self.req_ids: dict[int, str] = {}

    def take(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM's ``take_boundary_state_offloads``: the entries keyed since the last take,
        group by group, by request in the order each first appears."""
        flat = self._alloc.take_boundary_state_offloads()
        out: dict[str, list[tuple[int, int, int]]] = {}
        if not flat:
            return out
        ids = self.req_ids
        for i in range(0, len(flat), 4):
            out.setdefault(ids[flat[i]], []).append((flat[i + 1], flat[i + 2], flat[i + 3]))
        return out
