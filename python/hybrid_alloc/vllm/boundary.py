"""Mamba "align" boundary-state offloads for a KV connector (vLLM 0.32.0 and 0.33.0).

Every step the scheduler drains ``KVCacheManager.take_boundary_state_offloads()`` into
``KVConnectorBlockState.boundary_state_offloads``: ``{request_id: [(group_id, block_id,
boundary_tokens), ...]}``, one entry per boundary state a Mamba "align" group keyed in
``cache_blocks`` (the OffloadingConnector stores that block under that boundary's hash, since
an align table cannot be read positionally). The core records them when the manager is built
with a KV connector (``Allocator(boundary_offloads=True)``: the scheduler drains them always,
but only builds ``KVConnectorBlockState`` with a connector) and drops a request's entries when
its blocks go back to the pool, as vLLM's ``MambaManager.pop_blocks_for_free`` does; see
``rust/manager/boundary.rs``. :class:`BoundaryOffloads` takes them (one crossing: flat
``[handle, group, block, tokens, ...]``) and names each request by its id.

``finalize_partial_tail_offloads`` has nothing to return: vLLM's returns a producer's partial
tail only for a boundary key ending inside its Mamba block (a Mamba block larger than the hash
block, with sub-block partial hits), a configuration the core refuses (it falls back), and
the copy-on-write entries of ``take_boundary_state_offloads`` come from the same sub-block
hits.
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
