"""The compatibility table (docs/compatibility.md; the README summarises it) is true for the
installed vLLM release: for each row that a ``KVCacheManager`` construction expresses, the
adapter's decision (``native_config_or_reason``, what ``HybridKVCacheManager(...)`` acts on)
is "native" where the table says native, and where it says "falls back" the reason it gives
is the one quoted in that row's cell for this release."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

COMPAT = Path(__file__).resolve().parents[3] / "docs" / "compatibility.md"


def _table() -> dict[str, dict[str, str]]:
    """Row label -> {release: cell} of docs/compatibility.md's compatibility table."""
    text = COMPAT.read_text()
    section = text[text.index("## Compatibility: what runs natively") :]
    all_lines = section.splitlines()
    first = next(i for i, ln in enumerate(all_lines) if ln.startswith("|"))
    lines: list[str] = []
    for ln in all_lines[first:]:  # the first table of the section only
        if not ln.startswith("|"):
            break
        lines.append(ln)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    releases = [re.sub(r"^vLLM ", "", h) for h in header[1:]]
    rows: dict[str, dict[str, str]] = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(releases, cells[1:]))
    return rows


def _release() -> str:
    from hybrid_alloc.vllm.plugin import vllm_release

    release = vllm_release()
    assert release is not None
    return release


def _cell(row_prefix: str) -> str:
    rows = _table()
    label = next((k for k in rows if k.startswith(row_prefix)), None)
    assert label is not None, f"docs/compatibility.md's table has no row {row_prefix!r}"
    release = _release()
    assert release in rows[label], f"docs/compatibility.md's table has no column for vLLM {release}"
    cell = rows[label][release]
    seen = {release}
    while cell.startswith("same as "):  # may chain: 0.34.0 -> 0.33.0 -> 0.32.0
        other = cell[len("same as ") :]
        assert other not in seen, f"{label}: 'same as' loops through {other}"
        seen.add(other)
        cell = rows[label][other]
    return cell


def _kwargs(specs: list[Any], **over: Any) -> dict[str, Any]:
    from vllm_harness import Setup

    kw = Setup("t", specs, num_blocks=400).manager_kwargs(events=False)
    kw.update(over)
    return kw


def _decide(kwargs: dict[str, Any], vllm_config: Any = None) -> tuple[bool, str]:
    from hybrid_alloc.vllm import manager

    previous = manager.current_vllm_config
    manager.current_vllm_config = vllm_config
    try:
        native, reason = manager.native_config_or_reason(**kwargs)
    finally:
        manager.current_vllm_config = previous
    return native is not None, reason


def _specs(name: str) -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec

    from rswa_harness import rswa
    from vllm_harness import chunked, full, mla, swa

    return {
        "full": [full(16)],
        "mla": [mla(16)],
        "swa": [swa(64, 16)],
        "swa_retained": [full(16), swa(64, 16)],
        "chunked": [full(16), chunked(64, 16)],
        "mix": [full(16), swa(64, 16), chunked(128, 16)],
        "swa_bs32_over_full_bs16": [full(16), swa(64, 32)],
        "full_bs32_over_swa_bs16": [full(32), swa(64, 16)],
        "rswa_bs32_over_swa_bs16": [rswa(128, 32), swa(64, 16)],
        "cross": [full(16), CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)],
        "mamba": [full(16), MambaSpec(block_size=16, shapes=((16, 16),), dtypes=(torch.float32,))],
        # MambaMixer2's spec with prefix caching on: one prefill checkpoint block, alignment 1.
        "mamba2_align": [
            full(16),
            MambaSpec(
                block_size=16,
                shapes=((16, 16),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=1,
            ),
        ],
        # A GDN-style "align" state: no prefill checkpoint blocks.
        "gdn_align": [
            full(16),
            MambaSpec(block_size=16, shapes=((16, 16),), dtypes=(torch.float32,), mamba_cache_mode="align"),
        ],
        "gdn_sharded": [
            full(16),
            MambaSpec(
                block_size=16, shapes=((16, 16),), dtypes=(torch.float32,), mamba_cache_mode="align", dcp_sharded=True
            ),
        ],
        "gdn_partial": [
            full(64),
            MambaSpec(block_size=64, shapes=((16, 16),), dtypes=(torch.float32,), mamba_cache_mode="align"),
        ],
    }[name]


# The hash / scheduler block sizes vLLM resolves for one group of block 16 under DCP 2 / 4.
_DCP2 = {"hash_block_size": 32, "scheduler_block_size": 32}
_DCP4 = {"hash_block_size": 64, "scheduler_block_size": 64}

# (row of the table, specs, extra KVCacheManager arguments, the fallback reason's quoted
# fragment or None for native). Rows that need a whole VllmConfig (speculative methods,
# routed experts) are proven by the scheduler parity tests instead.
CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("full attention, MLA", "full", {}, None),
    ("full attention, MLA", "mla", {}, None),
    ("sliding window", "swa", {}, None),
    ("chunked local attention", "chunked", {}, None),
    ("any mix of the above", "mix", {}, None),
    ("prefix caching on or off", "swa_retained", {"enable_caching": False}, None),
    ("KV cache events", "swa_retained", {"enable_kv_cache_events": True}, None),
    ("sync and async scheduling", "swa_retained", {"watermark": 0.02, "max_in_flight_tokens": 4096}, None),
    ("groups of different block sizes", "swa_bs32_over_full_bs16", {"scheduler_block_size": 32}, None),
    ("groups of different block sizes", "full_bs32_over_swa_bs16", {"scheduler_block_size": 32}, None),
    (
        "groups of different block sizes",
        "rswa_bs32_over_swa_bs16",
        {"scheduler_block_size": 32},
        "(partial-block prefix entries)",
    ),
    ("cross attention", "cross", {"enable_caching": False}, None),
    ("cross attention", "cross", {}, "cross attention with prefix caching on"),
    ("Mamba / linear attention", "mamba", {"enable_caching": False}, None),
    ("Mamba / linear attention", "mamba2_align", {}, None),
    # Partial hash hits: a Mamba block of 64 over a unit of 16 (full attention aligned).
    ("`--prefix-match-unit` below", "gdn_partial", {"hash_block_size": 16, "scheduler_block_size": 64}, None),
    ("decode context parallelism (DCP > 1) on full", "full", {"dcp_world_size": 2, **_DCP2}, None),
    ("decode context parallelism (DCP > 1) on full", "mla", {"dcp_world_size": 4, **_DCP4}, None),
    (
        "decode context parallelism with a sharded",
        "swa",
        {"dcp_world_size": 2, **_DCP2},
        "with a sharded",
    ),
    # A replicated GDN group beside sharded full attention (16 x 2): hash 16, scheduler 32.
    (
        "decode context parallelism with a (replicated) Mamba",
        "gdn_align",
        {"dcp_world_size": 2, "hash_block_size": 16, "scheduler_block_size": 32},
        None,
    ),
    ("decode context parallelism with a sharded", "gdn_sharded", {"dcp_world_size": 2}, "with a sharded"),
    ("prefill context parallelism", "full", {"pcp_world_size": 2}, "prefill context parallelism"),
    ("KV cache residency metrics", "full", {"metrics_collector": object()}, None),
    ("KV cache residency metrics", "mix", {"metrics_collector": object(), "enable_kv_cache_events": True}, None),
    ("multi-module MTP", "full", {"num_prefill_lookahead": 2}, None),
    ("multi-module MTP", "swa_retained", {"num_prefill_lookahead": 3, "use_eagle": True}, None),
    (
        "multi-module MTP",
        "swa_retained",
        {"num_prefill_lookahead": 3, "use_eagle": True, "enable_caching": False},
        None,
    ),
    # vLLM's own manager raises ValueError: a lookahead over the scheduler block.
    ("multi-module MTP", "full", {"num_prefill_lookahead": 17, "use_eagle": True}, "over a scheduler block"),
]


@pytest.mark.parametrize("row, specs, over, fragment", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_row_matches_the_adapter(row: str, specs: str, over: dict[str, Any], fragment: str | None) -> None:
    cell = _cell(row)
    native, reason = _decide(_kwargs(_specs(specs), **over))
    if fragment is None:
        assert native, f"{row}: falls back ({reason}), the table says {cell!r}"
        assert cell.startswith("native"), cell
    else:
        assert not native and fragment in reason, (row, reason)
        assert f'"{fragment}' in cell or fragment in cell, (
            f"{row}: the table's cell {cell!r} does not quote {fragment!r}"
        )


def test_eagle_block_drop_row() -> None:
    """The Scheduler passes ``use_eagle=True`` where vLLM drops the last block for EAGLE: on
    0.32 for every EAGLE/MTP/DFlash/DSpark run, on 0.33 when lookahead hashes are off. Served
    with or without Mamba layers (their "align" checkpoints moved one block back), prefix
    caching on or off; chunked local attention dropping falls back (vLLM asserts)."""
    release = _release()
    row = "EAGLE / MTP with `disable_lookahead_block_hashes`" if release != "0.32.0" else "EAGLE / EAGLE3 / MTP"
    for specs in ("full", "mla", "swa", "swa_retained"):
        for caching in (True, False):
            native, reason = _decide(_kwargs(_specs(specs), use_eagle=True, enable_caching=caching))
            assert native, (specs, caching, reason)
    assert _cell(row).startswith("native"), _cell(row)
    # vLLM asserts at the first lookup of a dropping chunked local attention group.
    native, reason = _decide(_kwargs(_specs("chunked"), use_eagle=True))
    assert not native and "with chunked local attention" in reason, reason
    assert _decide(_kwargs(_specs("chunked"), use_eagle=True, enable_caching=False))[0]
    for specs in ("mamba2_align", "gdn_partial"):
        over = {"hash_block_size": 16, "scheduler_block_size": 64} if specs == "gdn_partial" else {}
        native, reason = _decide(_kwargs(_specs(specs), use_eagle=True, **over))
        assert native, (specs, reason)
    assert _decide(_kwargs(_specs("mamba"), use_eagle=True, enable_caching=False))[0]
    # vLLM's own shared-prefix checkpoint (its flag, EAGLE/MTP groups, partial hash hits) is
    # served by the default policy too (issue 39).
    pmu = {"hash_block_size": 16, "scheduler_block_size": 64, "enable_mamba_shared_prefix_checkpoint": True}
    native, reason = _decide(_kwargs(_specs("gdn_partial"), use_eagle=True, **pmu))
    assert native, reason
    pmu_cell = _cell("`--prefix-match-unit` below")
    assert "falls back" not in pmu_cell and "enable_mamba_shared_prefix_checkpoint" in pmu_cell, pmu_cell
    cell = _cell(row)
    assert "block drop with Mamba layers" not in cell and "Mamba" in cell, cell


def test_multi_module_mtp_row() -> None:
    """Multi-module MTP (``num_prefill_lookahead`` > 1) is served where vLLM's manager runs it,
    with lookahead block hashes from 0.33 on (Mamba "align" states with or without prefill
    checkpoint blocks included); what falls back gives the table's reasons, and where the adapter falls
    back because vLLM raises, vLLM's manager raises as it would have."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_harness import HAVE_LOOKAHEAD_HASHES

    cell = _cell("multi-module MTP")
    over = dict(num_prefill_lookahead=17, use_eagle=True)
    with pytest.raises(ValueError, match="scheduler_block_size"):
        KVCacheManager(**_kwargs(_specs("full"), **over))
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    with pytest.raises(ValueError, match="scheduler_block_size"):
        HybridKVCacheManager(**_kwargs(_specs("full"), **over))
    if not HAVE_LOOKAHEAD_HASHES:
        # 0.32: MTP drops the last block with prefix caching, Mamba layers included (the
        # checkpoints one block back, the dropping groups' cache target short of the
        # re-prefillable tokens: ``mamba_harness``'s ``*_mtp3_drop_all_align`` setups).
        for specs in ("mamba2_align", "gdn_align"):
            native, reason = _decide(_kwargs(_specs(specs), num_prefill_lookahead=3, use_eagle=True))
            assert native, (specs, reason)
        return
    for n in (2, 3):
        la = dict(num_prefill_lookahead=n, num_hash_lookahead_tokens=n)
        # Mamba2's prefill checkpoint blocks included (issue 39).
        for specs in ("full", "swa_retained", "gdn_align", "mamba2_align"):
            native, reason = _decide(_kwargs(_specs(specs), **la))
            assert native, (specs, n, reason)
    assert "lookahead hash tokens" not in cell and "Mamba2-style (MambaMixer2's prefill checkpoint blocks" in cell, cell
    native, reason = _decide(_kwargs(_specs("gdn_align")[1:], **la))
    assert not native and reason.startswith("a single Mamba group with lookahead block hashes over 3 tokens"), reason
    assert "a single Mamba group with lookahead block hashes over N tokens" in cell


def test_kv_connector_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import KVTransferConfig

    def vc(**kw: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(kv_transfer_config=KVTransferConfig(**kw))

    for role in ("kv_producer", "kv_consumer", "kv_both"):
        native, reason = _decide(_kwargs(_specs("full")), vllm_config=vc(kv_connector="NixlConnector", kv_role=role))
        assert native and reason == "", reason
    multi = vc(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}]},
    )
    assert _decide(_kwargs(_specs("full")), vllm_config=multi)[0]
    assert _cell("NixlConnector (and `NixlPullConnector`").startswith("native")
    off = vc(kv_connector="OffloadingConnector", kv_role="kv_both")
    assert _decide(_kwargs(_specs("swa_retained")), vllm_config=off) == (True, "")
    assert _cell("the native `OffloadingConnector`").startswith("native")
    # LMCacheMPConnector: served where lmcache's scheduler side runs (0.32, 0.33), its lazy
    # offload with one group only; 0.34 and Mamba layers fall back with their reason.
    mp = vc(kv_connector="LMCacheMPConnector", kv_role="kv_both")
    lazy = vc(
        kv_connector="LMCacheMPConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.lazy_offload": True},
    )
    cell = _cell("`LMCacheMPConnector`")
    if importlib.util.find_spec("lmcache") is not None:
        native, reason = _decide(_kwargs(_specs("swa_retained")), vllm_config=lazy)
        assert not native and f'"{reason}"' in cell, reason
        native, reason = _decide(_kwargs(_specs("full")), vllm_config=mp)
        if cell.startswith("native"):
            assert native and reason == "", reason
            assert _decide(_kwargs(_specs("full")), vllm_config=lazy) == (True, "")
            assert _decide(_kwargs(_specs("swa_retained")), vllm_config=mp) == (True, "")
            native, reason = _decide(_kwargs(_specs("gdn_align")), vllm_config=mp)
            assert not native and f'"{reason}"' in cell, reason
        else:
            assert not native and f'"{reason}"' in cell, reason
    assert '"KV connector <name> is configured"' in _cell("other KV connectors")
    # SimpleCPUOffloadConnector: served (its pool facade), but not with two-level pages.
    simple = vc(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both")
    monkeypatch.delenv("HYBRID_ALLOC_PAGES", raising=False)
    for specs in ("full", "swa_retained", "gdn_align"):
        assert _decide(_kwargs(_specs(specs)), vllm_config=simple) == (True, ""), specs
    assert _cell("`SimpleCPUOffloadConnector`").startswith("native")
    monkeypatch.setenv("HYBRID_ALLOC_PAGES", "two-level")
    native, reason = _decide(_kwargs(_specs("gdn_align")), vllm_config=simple)
    assert not native and f'"{reason}"' in _cell("`SimpleCPUOffloadConnector`"), reason
    monkeypatch.delenv("HYBRID_ALLOC_PAGES")
    # MooncakeStoreConnector: served with attention groups of one block size only.
    store = vc(kv_connector="MooncakeStoreConnector", kv_role="kv_both")
    cell = _cell("`MooncakeStoreConnector`")
    assert cell.startswith("native")
    for specs in ("full", "swa_retained"):
        assert _decide(_kwargs(_specs(specs)), vllm_config=store) == (True, ""), specs
    native, reason = _decide(_kwargs(_specs("gdn_align")), vllm_config=store)
    assert not native and f'"{reason}"' in cell, reason
    # Alone only: no parity case runs it under a MultiConnector.
    multi_store = vc(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}]},
    )
    native, reason = _decide(_kwargs(_specs("full")), vllm_config=multi_store)
    assert not native and f'"{reason}"' in cell, reason
    # UMBPStoreConnector (0.33 on): served with attention groups of one block size, without its
    # partial hash hits.
    umbp = vc(kv_connector="UMBPStoreConnector", kv_role="kv_both")
    cell = _cell("`UMBPStoreConnector`")
    if importlib.util.find_spec("vllm.distributed.kv_transfer.kv_connector.v1.umbp") is None:
        native, reason = _decide(_kwargs(_specs("full")), vllm_config=umbp)
        assert not native and f'"{reason}"' in cell, reason
    else:
        assert cell.startswith("native")
        # By its name (0.34 registers it) or from its module path (how 0.33 loads it).
        by_path = vc(
            kv_connector="UMBPStoreConnector",
            kv_connector_module_path="vllm.distributed.kv_transfer.kv_connector.v1.umbp",
            kv_role="kv_both",
        )
        for specs in ("full", "swa_retained"):
            assert _decide(_kwargs(_specs(specs)), vllm_config=umbp) == (True, ""), specs
            assert _decide(_kwargs(_specs(specs)), vllm_config=by_path) == (True, ""), specs
        native, reason = _decide(_kwargs(_specs("gdn_align")), vllm_config=umbp)
        assert not native and f'"{reason}"' in cell, reason
        partial = vc(
            kv_connector="UMBPStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"enable_partial_hash_hits": True},
        )
        native, reason = _decide(_kwargs(_specs("full")), vllm_config=partial)
        assert not native and reason.startswith("KV connector UMBPStoreConnector (enable_partial_hash_hits"), reason
        assert "(enable_partial_hash_hits: not tested with hybrid_alloc)" in cell
        multi = vc(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [{"kv_connector": "UMBPStoreConnector", "kv_role": "kv_both"}]},
        )
        native, reason = _decide(_kwargs(_specs("full")), vllm_config=multi)
        assert not native and f'"{reason}"' in cell, reason
    # MooncakeConnector: served as NixlConnector (its scheduler side reads KVCacheBlocks only).
    mooncake = vc(kv_connector="MooncakeConnector", kv_role="kv_both")
    assert _decide(_kwargs(_specs("swa_retained")), vllm_config=mooncake) == (True, "")
    assert _cell("`MooncakeConnector` as KV producer").startswith("native")
    assert _cell("a connector loaded from `kv_connector_module_path`").startswith("native when")
    # ExampleConnector: in the one unified group vLLM makes for it, when that is full attention.
    example = vc(kv_connector="ExampleConnector", kv_role="kv_both")
    assert _decide(_kwargs(_specs("full")), vllm_config=example) == (True, "")
    assert _cell("`ExampleConnector`").startswith("native")
    native, reason = _decide(_kwargs(_specs("swa")), vllm_config=example)
    assert not native and reason == "KV connector ExampleConnector (with a SlidingWindowSpec group) is configured"
    # LMCacheConnectorV1 (the lmcache package's scheduler side) likewise; not vLLM's in-tree copy.
    lmc = vc(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    assert _decide(_kwargs(_specs("full")), vllm_config=lmc) == (True, "")
    assert _cell("`LMCacheConnectorV1`").startswith("native")
    native_lmc = vc(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config={"use_native": True}
    )
    native, reason = _decide(_kwargs(_specs("full")), vllm_config=native_lmc)
    assert not native and "LMCacheConnectorV1 (use_native" in reason
    # With Mamba layers: NixlConnector in every role (alone or beside the OffloadingConnector).
    mamba = _kwargs(_specs("mamba2_align"))
    for role in ("kv_consumer", "kv_producer", "kv_both"):
        assert _decide(mamba, vllm_config=vc(kv_connector="NixlConnector", kv_role=role)) == (True, ""), role
    assert _cell("NixlConnector (and its variants").startswith("native")
    assert "get_computed_blocks_for_connector" in _cell("NixlConnector (and its variants")
    # The OffloadingConnector with Mamba "align" groups: the boundary-state offloads.
    assert _decide(_kwargs(_specs("mamba2_align")), vllm_config=off) == (True, "")
    assert "take_boundary_state_offloads" in _cell("the native `OffloadingConnector`")
    # Sub-block partial hash hits (``--prefix-match-unit`` below the Mamba block) with either
    # connector, and under a hit-aware policy (native too).
    partial = _kwargs(_specs("gdn_partial"), hash_block_size=16, scheduler_block_size=64)
    for conn in (off, vc(kv_connector="NixlConnector", kv_role="kv_producer")):
        assert _decide(partial, vllm_config=conn) == (True, ""), conn
    cell = _cell("`--prefix-match-unit` below")
    assert cell.startswith("native") and "with or without a KV connector" in cell, cell
    assert "finalize_partial_tail_offloads" in cell and "native under a hit-aware policy too" in cell, cell
    assert "mamba_shared_prefix_checkpoint" in cell, cell
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    assert _decide(partial) == (True, "")
    assert _decide(partial, vllm_config=off) == (True, "")


def test_routed_experts_row() -> None:
    from types import SimpleNamespace

    vc = SimpleNamespace(kv_transfer_config=None, aux_output_config=SimpleNamespace(enabled=True))
    native, reason = _decide(_kwargs(_specs("full")), vllm_config=vc)
    assert native and reason == ""
    assert _cell("routed experts").startswith("native")


def test_lookahead_hashes_row_on_033() -> None:
    """0.33: EAGLE-style lookahead block hashes (``use_eagle=False``, ``num_hash_lookahead_tokens>0``)."""
    if _release() == "0.32.0":
        # No lookahead hashes on 0.32: EAGLE is served through the last-block drop there.
        assert _cell("EAGLE / EAGLE3 / MTP").startswith("native: the last-block drop")
        return
    native, reason = _decide(_kwargs(_specs("swa_retained"), num_hash_lookahead_tokens=1))
    assert native, reason
    assert _cell("EAGLE / EAGLE3 / MTP").startswith("native")


def _spec_table() -> dict[str, str]:
    """Spec cell (first column) -> "served by" cell of docs/compatibility.md's spec table."""
    text = COMPAT.read_text()
    section = text[text.index("## KV cache specs vLLM ships: who serves each") :]
    rows: dict[str, str] = {}
    for ln in section.splitlines():
        if ln.startswith("| `"):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            rows[cells[0]] = cells[-1]
    return rows


def test_rswa_spec_row_is_native() -> None:
    """Unlimited-OCR's ``RSWASpec`` (alone, with prefix caching off as vLLM runs it, and next
    to full attention with it on) is served natively, as the spec table says."""
    import torch
    from vllm.v1.kv_cache_interface import RSWASpec

    from vllm_harness import full

    r = RSWASpec(block_size=16, num_kv_heads=10, head_size=128, dtype=torch.bfloat16, rswa_window=128)
    for specs, over in (([r], {"enable_caching": False}), ([r], {}), ([full(16), r], {})):
        native, reason = _decide(_kwargs(specs, **over))
        assert native, reason
    cell = next(v for k, v in _spec_table().items() if k.startswith("`RSWASpec`"))
    assert cell.startswith("hybrid_alloc"), cell


def test_uniform_type_spec_row_falls_back_as_vllm_cannot_build_it() -> None:
    """vLLM's own manager cannot be built for a ``UniformTypeKVCacheSpecs`` group (no manager
    is registered for the class), so the adapter falls back, as the spec table says."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    a = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    b = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    u = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l0": a, "l1": b})
    kwargs = _kwargs([u])
    with pytest.raises(AssertionError, match="No manager registered"):
        KVCacheManager(**kwargs)
    native, reason = _decide(kwargs)
    assert not native and reason.startswith("UniformTypeKVCacheSpecs"), reason
    cell = next(v for k, v in _spec_table().items() if k.startswith("`UniformTypeKVCacheSpecs`"))
    assert cell.startswith("falls back"), cell


def test_every_row_has_every_tested_release() -> None:
    from hybrid_alloc.vllm.releases import SUPPORTED_RELEASES

    rows = _table()
    assert len(rows) >= 15
    for label, cells in rows.items():
        if label == "any other vLLM release":
            continue
        assert sorted(cells) == sorted(SUPPORTED_RELEASES), label
        for release, cell in cells.items():
            assert cell.startswith(("native", "falls back", "same as ")), (label, release, cell)
