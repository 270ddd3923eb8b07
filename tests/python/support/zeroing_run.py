"""vLLM's own KV block zeroing run on CPU tensors over a two-level configuration (issue 37, the
worker side on releases without a CPU engine here): which bytes each zeroer of the installed
release touches when the scheduler hands it new slot ids.

The setup (:func:`views`): the Qwen3.6-like shape at a 96 MiB pool (4 pages of 17 slots at 64
tokens), reshaped by ``two_level_kv_cache_config``, allocated by vLLM's ``allocate_kv_cache``
(with the plugin's ``num_blocks_of``) on the CPU, every byte of the buffer set to a sentinel.
:func:`zeroed` then runs one zeroer over :data:`NEW_SLOTS` and returns the byte intervals that
changed. The zeroers (:data:`ZEROERS`):

- ``gpu``: ``KVBlockZeroer`` (``v1/worker/utils.py``, the GPU runners' on every release), built
  on the CPU device as the runners build it (``_init_kv_zero_meta``), its Triton kernel run by
  Triton's interpreter: only when this process started with ``TRITON_INTERPRET=1`` (the
  interpreter patches ``triton.language`` at import) and the real ``triton`` is installed;
  ``gpu16`` is the same over views split in 16-token kernel blocks (a GPU backend's);
- ``cpu``: 0.34's ``CPUKVBlockZeroer`` (``v1/worker/cpu/utils.py``, the standalone CPU runner's);
- ``cpu_runner``: 0.32's and 0.33's ``CPUModelRunner._zero_block_ids``
  (``v1/worker/cpu_model_runner.py``), called on a stand-in runner holding the views.

With ``installed`` the plugin's engine side is installed (its zeroer wrapper); without it vLLM's
zeroers run as they are (the bug the wrapper fixes: a slot id zeroes a page).

    TRITON_INTERPRET=1 python zeroing_run.py [--plain]

prints one JSON line: ``{zeroer: intervals}`` for the zeroers this release has, plus the layout
(``layout``: pages, ``k``, the page and small page in bytes, the attention and state layers'
regions), and ``copies``: :func:`copied`; ``--plain`` runs without the plugin's wrapper, over :data:`PLAIN_SLOTS`.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

MiB = 1 << 20

#: The new slots the scheduler hands the workers: slots of pages 2 and 3 (page 1 holds a state
#: in use; the other slots of pages 2 and 3 are other requests').
NEW_SLOTS = (2 * 17 + 3, 3 * 17, 3 * 17 + 16)
#: Without the plugin's wrapper: slot 1 (vLLM's zeroers read it as page 1, the state in use; a
#: slot id at or above the page count, as :data:`NEW_SLOTS`, would write past the buffer).
PLAIN_SLOTS = (1,)
STATE_PAGES_IN_USE = (1,)
SENTINEL = 0xA5
ZEROERS = ("gpu", "gpu16", "cpu", "cpu_runner")
#: The zeroers run without the wrapper (the interpreted kernel over whole pages is slow: one is enough).
PLAIN_ZEROERS = ("gpu", "cpu", "cpu_runner")


def views(kernel_block: int | None = None) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """``(kvc, views, buffer, layout)``: the two-level configuration, vLLM's views of it (with
    the plugin's ``num_blocks_of``; attention views in ``kernel_block``-token kernel blocks when
    given), the backing buffer as bytes (every byte :data:`SENTINEL`), and the layout."""
    import torch
    from vllm.utils import torch_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    # vLLM's ``async_tensor_h2d`` (the zeroer's and the copies' ids) pins its host copy where
    # CUDA is built in; there is no driver here.
    torch_utils.PIN_MEMORY = False

    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages, pages

    setup = SchedulerSetup(SHAPES["qwen36"], kv_budget_bytes=96 * MiB, max_num_seqs=4)
    kvc = pages.two_level_kv_cache_config(setup.kv_cache_config(setup.vllm_config()), 64)
    groups = kvc.kv_cache_groups
    kernel = None
    if kernel_block is not None:
        kernel = [
            g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else kernel_block for g in groups
        ]
    original = KVCacheConfig.num_blocks_of
    if not getattr(original, "_hybrid_alloc_wrapped", False):
        KVCacheConfig.num_blocks_of = engine_pages._num_blocks_of(original)  # what install() sets
    try:
        kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC, kernel)
    finally:
        KVCacheConfig.num_blocks_of = original
    any_view = next(iter(kv.values()))
    any_view = any_view[0] if isinstance(any_view, (list, tuple)) else any_view
    buf = torch.empty(0, dtype=torch.uint8).set_(any_view.untyped_storage())
    buf.fill_(SENTINEL)
    state = {i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}
    group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    region = {name: t.offset + j * t.layer_stride for t in kvc.kv_cache_tensors for j, name in enumerate(t.layers)}
    (page,) = {groups[i].kv_cache_spec.page_size_bytes for i in state}
    (small_page,) = {g.kv_cache_spec.page_size_bytes for i, g in enumerate(groups) if i not in state}
    layout = {
        "pages": kvc.num_blocks,
        "k": pages.slots_per_page(kvc),
        "page": page,
        "small_page": small_page,
        "attention": sorted(region[n] for n in region if group_of[n] not in state),
        "state": sorted(region[n] for n in region if group_of[n] in state),
    }
    return kvc, kv, buf, layout


def _attention_groups(kvc: Any, kernel_block: int | None) -> tuple[list[Any], list[int]]:
    """vLLM's ``AttentionGroup`` per KV cache group (as a runner holds them; no backend: the
    zeroers read the spec, the group id and the layers) and the kernel block sizes."""
    from vllm.v1.worker.utils import AttentionGroup

    groups = [
        AttentionGroup(None, list(g.layer_names), g.kv_cache_spec, i)  # type: ignore[arg-type]
        for i, g in enumerate(kvc.kv_cache_groups)
    ]
    kernel = [kernel_block or g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    return groups, kernel


def _interpreted(fn: Any) -> Any:
    """vLLM's Triton kernel ``fn`` (the same code) jitted by the real Triton, in interpreter mode
    (vLLM's ``triton_utils`` hands out a placeholder without a GPU, unless ``TRITON_INTERPRET``
    made it take Triton's interpreter: then ``fn`` is already interpreted). The ``@triton.jit``
    helpers it calls (plain functions under the placeholder) are jitted the same way."""
    if not isinstance(fn, types.FunctionType):
        return fn
    import triton
    import triton.language as tl

    namespace = dict(fn.__globals__, tl=tl, triton=triton)
    for name in fn.__code__.co_names:
        helper = namespace.get(name)
        if isinstance(helper, types.FunctionType) and helper.__globals__.get("tl") is not tl:
            if "tl" in helper.__globals__:  # a kernel helper of vLLM's (placeholder ``tl``)
                namespace[name] = _interpreted(helper)
    return triton.jit(types.FunctionType(fn.__code__, namespace, fn.__name__))


def _changed(buf: Any) -> list[list[int]]:
    """The byte intervals ``[start, end)`` of ``buf`` that are no longer the sentinel."""
    import torch

    changed = (buf != SENTINEL).to(torch.int8)
    edges = torch.diff(changed, prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return [[s, e] for s, e in zip(starts, ends, strict=True)]


def zeroed(zeroer: str, slots: tuple[int, ...]) -> list[list[int]] | None:
    """The byte intervals one zeroer of this release changes for ``slots`` (None where this
    release or process has no such zeroer)."""
    import torch

    kernel_block = 16 if zeroer == "gpu16" else None
    kvc, kv, buf, _ = views(kernel_block)
    ctx = {name: types.SimpleNamespace(kv_cache=view) for name, view in kv.items()}
    groups, kernel = _attention_groups(kvc, kernel_block)
    cpu = torch.device("cpu")
    if zeroer in ("gpu", "gpu16"):
        if os.environ.get("TRITON_INTERPRET") != "1":
            return None
        from vllm.v1.worker import utils

        z = utils.KVBlockZeroer(
            cpu,
            attn_groups_iter=iter(groups),
            kernel_block_sizes=kernel,
            static_forward_context=ctx,
            num_blocks=kvc.num_blocks,
        )
        utils._zero_kv_blocks_kernel = _interpreted(utils._zero_kv_blocks_kernel)
        z.zero_block_ids(list(slots))
    elif zeroer == "cpu":
        try:
            from vllm.v1.worker.cpu.utils import CPUKVBlockZeroer  # type: ignore[import-not-found]
        except ImportError:
            return None
        z = CPUKVBlockZeroer(
            cpu,
            attn_groups_iter=iter(groups),
            kernel_block_sizes=kernel,
            static_forward_context=ctx,
            num_blocks=kvc.num_blocks,
        )
        z.zero_block_ids(list(slots))
    else:
        try:
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # type: ignore[import-not-found]
        except ImportError:
            return None
        runner = types.SimpleNamespace(
            kv_cache_config=kvc, compilation_config=types.SimpleNamespace(static_forward_context=ctx)
        )
        CPUModelRunner._zero_block_ids(runner, list(slots))
    return _changed(buf)


#: A copy-on-write of a partial hit (``prefix_match_unit``): the state page in use to a free page.
COPY = (1, 2)
COPY_BYTE = 0x3C


def copied() -> dict[str, Any]:
    """vLLM's ``copy_kv_cache_blocks_inplace`` (the runners' copy-on-write of partial hits, at
    the runner's ``num_blocks``, pages) over every view of the two-level configuration, page
    :data:`COPY` [0] (its bytes set to :data:`COPY_BYTE` in every region first) to page
    :data:`COPY` [1]: the changed intervals, and whether every changed byte is the copied byte."""
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    kvc, kv, buf, layout = views()
    src, dst = COPY
    page = layout["page"]
    for base in set(layout["state"]):
        buf[base + src * page : base + (src + 1) * page] = COPY_BYTE
    caches = [t for v in kv.values() for t in (v if isinstance(v, (list, tuple)) else [v])]
    copy_kv_cache_blocks_inplace(caches, kvc.num_blocks, [COPY])
    for base in set(layout["state"]):
        buf[base + src * page : base + (src + 1) * page] = SENTINEL  # only what the copy wrote
    changed = _changed(buf)
    # The bytes of a state block from its page's start (the widest state view's): what a copy
    # must cover. 0.34 copies every view's geometry (the attention views span the whole page);
    # 0.32 and 0.33 copy one view per address (a state view: its leading bytes).
    groups = kvc.kv_cache_groups
    state_layers = {n for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec" for n in g.layer_names}
    extent = 0
    for name in state_layers:
        for t in kv[name] if isinstance(kv[name], (list, tuple)) else [kv[name]]:
            el = t.element_size()
            start = t.storage_offset() * el
            last = sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)) + 1
            extent = max(extent, start % page + last * el)
    return {
        "intervals": changed,
        "all_copied": all(bool((buf[lo:hi] == COPY_BYTE).all()) for lo, hi in changed),
        "state_extent": extent,
    }


#: Block tables of two running requests, per group (attention: slot ids of the pages 2 and 3 that
#: hold slots; state: page 1), and the positions each schedules this step (a prefill chunk of 101
#: tokens, a 10-token one starting at 50).
TABLES = {"a": ([37, 52], [1]), "b": ([38, 53], [1])}
POSITIONS = {"a": list(range(101)), "b": list(range(50, 60))}
PAD = -1


def slot_mappings() -> dict[str, Any]:
    """vLLM's slot mapping kernels of this release (Triton, run by the interpreter; None without
    ``TRITON_INTERPRET=1``) over :data:`TABLES` and :data:`POSITIONS`, at the block sizes the
    runners pass (the groups' ``block_size``: the small block for attention, the state block for
    the state group, whose mapping is off): ``v2``: the V2 runner's ``_compute_slot_mappings_kernel``
    (``v1/worker/gpu/block_table.py``, every release); ``v1``: 0.32's and 0.33's
    ``ComputeSlotMappingKernel.kernel`` (``v1/worker/block_table.py``), per group. Each: one
    list per group, the slot of each scheduled token (``PAD`` where the group maps none)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {"v2": None, "v1": None}
    import importlib

    import torch

    kvc, _, _, _ = views()
    sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    state = [type(g.kv_cache_spec).__name__ == "MambaSpec" for g in kvc.kv_cache_groups]
    width = 4
    tables = [torch.zeros(len(TABLES), width, dtype=torch.int32) for _ in sizes]
    for r, (attn, st) in enumerate(TABLES.values()):
        for g, t in enumerate(tables):
            row = st if state[g] else attn
            t[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    positions = torch.tensor([p for ps in POSITIONS.values() for p in ps], dtype=torch.int64)
    lens = [len(ps) for ps in POSITIONS.values()]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1])
    out: dict[str, Any] = {}
    v2 = importlib.import_module("vllm.v1.worker.gpu.block_table")
    mappings = torch.zeros(len(sizes), n + 8, dtype=torch.int64)
    _interpreted(v2._compute_slot_mappings_kernel)[(len(sizes), len(lens) + 1)](
        mappings.shape[1],
        torch.arange(len(lens), dtype=torch.int32),
        qsl,
        positions,
        torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64),
        torch.tensor([t.stride(0) for t in tables], dtype=torch.int64),
        torch.tensor(sizes, dtype=torch.int32),
        torch.tensor([not s for s in state], dtype=torch.bool),
        torch.tensor([True] * len(sizes), dtype=torch.bool),
        mappings,
        mappings.stride(0),
        0,
        CP_SIZE=1,
        CP_INTERLEAVE=1,
        PAD_ID=PAD,
        TRITON_BLOCK_SIZE=1024,
    )
    out["v2"] = mappings[:, :n].tolist()
    out["sizes"] = sizes
    out["state"] = state
    try:
        v1 = importlib.import_module("vllm.v1.worker.block_table")
        kernel = _interpreted(v1.ComputeSlotMappingKernel.kernel)
    except (ImportError, AttributeError):
        out["v1"] = None
        return out
    per_group = []
    for g, t in enumerate(tables):
        if state[g]:  # vLLM's ``SlotMappingMode.NONE``: no mapping for a Mamba group
            per_group.append([PAD] * n)
            continue
        m = torch.zeros(n + 8, dtype=torch.int64)
        kernel[(len(lens) + 1,)](n, m.shape[0], qsl, positions, t, t.stride(0), m, sizes[g], 1, 0, 1, PAD, 1024)
        per_group.append(m[:n].tolist())
    out["v1"] = per_group
    return out


def run(installed: bool) -> dict[str, Any]:
    """Every zeroer's intervals (None: absent here) and the layout, with the plugin's engine
    side installed (for :data:`NEW_SLOTS`) or not (for :data:`PLAIN_SLOTS`)."""
    from hybrid_alloc.vllm import engine_pages
    from hybrid_alloc.vllm.plugin import vllm_release

    out: dict[str, Any] = {"layout": views()[3]}
    if installed and not engine_pages.install(vllm_release()):
        raise RuntimeError("the engine side did not install")
    try:
        for zeroer in ZEROERS if installed else PLAIN_ZEROERS:
            out[zeroer] = zeroed(zeroer, NEW_SLOTS if installed else PLAIN_SLOTS)
        if installed:
            out["copies"] = copied()
            out["slot_mappings"] = slot_mappings()
    finally:
        if installed:
            engine_pages.remove()
    return out


if __name__ == "__main__":
    print(json.dumps(run(installed="--plain" not in sys.argv[1:])))
