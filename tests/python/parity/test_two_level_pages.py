"""Two-level pages, the scheduler side (issue 37, ``hybrid_alloc.vllm.pages``): the switch
``HYBRID_ALLOC_PAGES`` / ``HYBRID_ALLOC_SMALL_BLOCK``, the reshaping of vLLM's own plan of a
state-space hybrid (the installed release's planner, 40 GiB at real per-layer sizes), what the
scheduler then resolves from it, and what ``plan.native_plan`` passes the core or refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

GiB = 1 << 30


@pytest.fixture(scope="module")
def planned() -> dict[str, tuple[Any, Any]]:
    """(VllmConfig, vLLM's KVCacheConfig) per shape, from vLLM's own planner at 40 GiB."""
    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup

    out = {}
    for name in ("qwen36", "nemotron3nano", "falconh1", "gemma3"):
        setup = SchedulerSetup(SHAPES[name], kv_budget_bytes=40 * GiB, max_num_seqs=512)
        vc = setup.vllm_config()
        out[name] = (vc, setup.kv_cache_config(vc))
    return out


def _groups(kvc: Any) -> tuple[list[Any], list[Any]]:
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
    return [s for s in specs if isinstance(s, MambaSpec)], [s for s in specs if not isinstance(s, MambaSpec)]


@pytest.mark.parametrize(
    "name, k, state_block, pages",
    [
        # 2,146,304-byte state / 64 x 2,048 = 16.4 -> 17 small pages: vLLM's 1088-token page exactly.
        ("qwen36", 17, 1088, 1927),
        # 2,134,016 / 65,536 = 32.6 -> 33 (vLLM's page: 2096 x 1024): the page grows, 3335 -> 3309 pages.
        ("nemotron3nano", 33, 2112, 3309),
        # 1,594,368 / 65,536 = 24.3 -> 25 (vLLM's: 1568 x 1024): 607 -> 594 pages.
        ("falconh1", 25, 1600, 594),
    ],
)
def test_two_level_config_keeps_the_tensors_and_puts_k_small_blocks_in_a_page(
    planned: dict[str, tuple[Any, Any]], name: str, k: int, state_block: int, pages: int
) -> None:
    from hybrid_alloc.vllm.pages import slots_per_page, two_level_kv_cache_config

    _, kvc = planned[name]
    before = dataclasses.replace(kvc)  # a shallow copy: the input must come back unchanged
    specs_before = [g.kv_cache_spec for g in kvc.kv_cache_groups]
    t = two_level_kv_cache_config(kvc, 64)
    assert [g.kv_cache_spec for g in kvc.kv_cache_groups] == specs_before and kvc.num_blocks == before.num_blocks
    states, attns = _groups(t)
    (page,) = {s.page_size_bytes for s in states}
    (small_page,) = {s.page_size_bytes for s in attns}
    assert {s.block_size for s in attns} == {64} and page == k * small_page
    assert {s.block_size for s in states} == {state_block} and state_block % 64 == 0
    assert slots_per_page(t) == k and slots_per_page(kvc) is None
    assert t.num_blocks == pages
    # Block sizes the engine resolved for vLLM's plan are unset, to be resolved again.
    bs = kvc.kv_cache_groups[0].kv_cache_spec.block_size
    resolved = two_level_kv_cache_config(
        dataclasses.replace(kvc, hash_block_size=bs, cache_hit_alignment_tokens=bs), 64
    )
    assert (resolved.hash_block_size, resolved.cache_hit_alignment_tokens) == (None, None)
    # Equal memory: the pages fit vLLM's bytes, and fewer only where the state page grew.
    old_page = _groups(kvc)[0][0].page_size_bytes
    assert t.num_blocks * page <= kvc.num_blocks * old_page
    assert (t.num_blocks == kvc.num_blocks) == (page == old_page)
    # The same tensors; slot s of an attention layer lies inside page s // k of that layer.
    assert [(x.size, x.layers, x.layer_stride, x.offset) for x in t.kv_cache_tensors] == [
        (x.size, x.layers, x.layer_stride, x.offset) for x in kvc.kv_cache_tensors
    ]
    names = {n for g in t.kv_cache_groups if g.kv_cache_spec in attns for n in g.layer_names}
    for x in t.kv_cache_tensors:
        attention = set(x.layers) <= names
        assert x.block_stride == (small_page if attention else page)
        assert t.num_blocks * page <= x.layer_stride
        if attention:
            for s in (1, k - 1, k, t.num_blocks * k - 1):
                start = s * x.block_stride
                assert s // k * page <= start and start + small_page <= (s // k + 1) * page


def test_two_level_config_refuses_what_it_cannot_reshape(planned: dict[str, tuple[Any, Any]]) -> None:
    from hybrid_alloc.vllm.pages import two_level_kv_cache_config

    with pytest.raises(ValueError, match="no state"):
        two_level_kv_cache_config(planned["gemma3"][1], 64)
    with pytest.raises(ValueError, match="no smaller block"):
        two_level_kv_cache_config(planned["qwen36"][1], 1088)  # k = 1
    with pytest.raises(ValueError, match="positive"):
        two_level_kv_cache_config(planned["qwen36"][1], 0)
    kvc = planned["qwen36"][1]
    packed = dataclasses.replace(
        kvc, kv_cache_tensors=[dataclasses.replace(x, block_stride=x.block_stride * 10) for x in kvc.kv_cache_tensors]
    )
    with pytest.raises(ValueError, match="block-outermost"):
        two_level_kv_cache_config(packed, 64)


@pytest.mark.parametrize("name, state_block", [("qwen36", 1088), ("falconh1", 1600)])
def test_scheduler_resolves_the_state_block_and_hashes_at_the_small_block(
    planned: dict[str, tuple[Any, Any]], name: str, state_block: int
) -> None:
    """The align split reads ``cache_config.block_size`` as the Mamba block; the scheduler
    block is the groups' LCM (the state block), the hash block their GCD (the small block)."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

    from hybrid_alloc.vllm.pages import cache_hit_alignment_tokens, scheduler_cache_config, two_level_kv_cache_config

    vc, kvc = planned[name]
    t = two_level_kv_cache_config(kvc, 64)
    old = (vc.cache_config.block_size, vc.cache_config.mamba_block_size)
    try:
        scheduler_cache_config(vc.cache_config, t)
        assert (vc.cache_config.block_size, vc.cache_config.mamba_block_size) == (state_block, state_block)
        assert resolve_kv_cache_block_sizes(t, vc) == (state_block, 64)
        # vLLM's resolver would align hits to the hash block (its managers' partial hits); the
        # core serves none with two-level pages: the state block.
        assert resolve_cache_hit_alignment_tokens(t, vc, state_block, 64) == 64
        assert cache_hit_alignment_tokens(t, state_block) == state_block
        assert cache_hit_alignment_tokens(kvc, old[0]) is None
    finally:
        vc.cache_config.block_size, vc.cache_config.mamba_block_size = old


@pytest.mark.parametrize(
    "value, expected",
    [(None, "off"), ("", "off"), ("off", "off"), ("two-level", "two-level"), (" TWO_LEVEL ", "two-level")],
)
def test_pages_env_values(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str) -> None:
    from hybrid_alloc.vllm import pages

    if value is None:
        monkeypatch.delenv(pages.PAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(pages.PAGES_ENV, value)
    assert pages.pages_from_env() == expected


@pytest.mark.parametrize("value", ["on", "2level", "jenga"])
def test_pages_env_bad_value_is_unsupported_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.unsupported import Unsupported

    monkeypatch.setenv(pages.PAGES_ENV, value)
    with pytest.raises(Unsupported, match=f"{pages.PAGES_ENV}='{value}' is not one of off, two-level"):
        pages.pages_from_env()


def test_small_block_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.unsupported import Unsupported

    monkeypatch.delenv(pages.SMALL_BLOCK_ENV, raising=False)
    assert pages.small_block_from_env() == 64
    monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "32")
    assert pages.small_block_from_env() == 32
    for bad in ("0", "-16", "sixty-four", "1.5"):
        monkeypatch.setenv(pages.SMALL_BLOCK_ENV, bad)
        with pytest.raises(Unsupported, match=pages.SMALL_BLOCK_ENV):
            pages.small_block_from_env()


def test_headroom_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.unsupported import Unsupported

    monkeypatch.delenv(pages.HEADROOM_ENV, raising=False)
    assert pages.headroom_from_env() == pages.DEFAULT_HEADROOM == 1
    for raw, slots in (("0", 0), ("3", 3), (" 2 ", 2)):
        monkeypatch.setenv(pages.HEADROOM_ENV, raw)
        assert pages.headroom_from_env() == slots
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv(pages.HEADROOM_ENV, bad)
        with pytest.raises(Unsupported, match=pages.HEADROOM_ENV):
            pages.headroom_from_env()


def _args(kvc: Any, **over: Any) -> Any:
    from hybrid_alloc.vllm.args import ManagerArgs

    kw: dict[str, Any] = dict(
        kv_cache_config=kvc, max_model_len=32768, scheduler_block_size=1088, hash_block_size=64, enable_caching=True
    )
    kw.update(over)
    return ManagerArgs(**kw)


@pytest.fixture
def qwen36(planned: dict[str, tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(vLLM's plan, its two-level form at 64) of qwen36, with ``HYBRID_ALLOC_PAGES=two-level``,
    the exact policy and the default small block in the environment."""
    from hybrid_alloc.vllm import pages

    monkeypatch.delenv("HYBRID_ALLOC_POLICY", raising=False)
    monkeypatch.delenv(pages.SMALL_BLOCK_ENV, raising=False)
    monkeypatch.setenv(pages.PAGES_ENV, "two-level")
    vllm_plan = planned["qwen36"][1]
    return vllm_plan, pages.two_level_kv_cache_config(vllm_plan, 64)


def test_native_plan_passes_slots_per_page_only_with_the_option_on(
    qwen36: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.plan import native_plan
    from hybrid_alloc.vllm.unsupported import Unsupported

    vllm_plan, t = qwen36
    monkeypatch.delenv(pages.PAGES_ENV, raising=False)
    assert "slots_per_page" not in native_plan(_args(vllm_plan, hash_block_size=1088), None)
    monkeypatch.setenv(pages.PAGES_ENV, "off")
    assert "slots_per_page" not in native_plan(_args(vllm_plan, hash_block_size=1088), None)
    monkeypatch.setenv(pages.PAGES_ENV, "two-level")
    monkeypatch.delenv(pages.HEADROOM_ENV, raising=False)
    native = native_plan(_args(t), None)
    assert (native["slots_per_page"], native["admission_headroom_slots"]) == (17, 1)
    monkeypatch.setenv(pages.HEADROOM_ENV, "0")
    assert "admission_headroom_slots" not in native_plan(_args(t), None)
    monkeypatch.setenv(pages.HEADROOM_ENV, "-1")
    with pytest.raises(Unsupported, match=pages.HEADROOM_ENV):
        native_plan(_args(t), None)
    monkeypatch.delenv(pages.PAGES_ENV)
    monkeypatch.setenv(pages.HEADROOM_ENV, "2")  # read only under two-level pages
    assert "admission_headroom_slots" not in native_plan(_args(vllm_plan, hash_block_size=1088), None)


def test_native_plan_refuses_what_two_level_does_not_serve(
    planned: dict[str, tuple[Any, Any]], qwen36: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.plan import native_plan
    from hybrid_alloc.vllm.unsupported import Unsupported

    vllm_plan, t = qwen36
    monkeypatch.setenv(pages.PAGES_ENV, "two-lvl")
    with pytest.raises(Unsupported, match="HYBRID_ALLOC_PAGES='two-lvl' is not one of"):
        native_plan(_args(t), None)
    monkeypatch.setenv(pages.PAGES_ENV, "two-level")
    with pytest.raises(Unsupported, match="is not two-level"):
        native_plan(_args(vllm_plan, hash_block_size=1088), None)
    with pytest.raises(Unsupported, match="needs a state-space hybrid"):
        native_plan(_args(planned["gemma3"][1], scheduler_block_size=16, hash_block_size=16), None)
    with pytest.raises(Unsupported, match="speculative decoding"):
        native_plan(_args(t, num_prefill_lookahead=1), None)
    spec_blocks = dataclasses.replace(
        t,
        kv_cache_groups=[
            dataclasses.replace(g, kv_cache_spec=dataclasses.replace(g.kv_cache_spec, num_speculative_blocks=2))
            if hasattr(g.kv_cache_spec, "num_speculative_blocks")
            else g
            for g in t.kv_cache_groups
        ],
    )
    with pytest.raises(Unsupported, match="speculative decoding"):
        native_plan(_args(spec_blocks), None)
    with pytest.raises(Unsupported):  # Mamba under DCP: refused before two-level is looked at
        native_plan(_args(t, dcp_world_size=2), None)
    monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "32")
    with pytest.raises(Unsupported, match="attention blocks of \\[64\\] tokens, HYBRID_ALLOC_SMALL_BLOCK is 32"):
        native_plan(_args(t), None)
    monkeypatch.delenv(pages.SMALL_BLOCK_ENV)
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    monkeypatch.setenv("HYBRID_ALLOC_RETAIN_PRIORITY", "0")
    with pytest.raises(Unsupported, match="HYBRID_ALLOC_RETAIN_PRIORITY \\(two-level pages serve hit-aware's own"):
        native_plan(_args(t), None)


def test_native_plan_serves_hit_aware_under_two_level(
    qwen36: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Hit-aware is served under two-level pages with prefix caching on (each pool with its
    own levels) and off (it caches nothing, decides as exact); pinned prefixes and a
    retention priority, the user's pinned levels, are refused, naming why."""
    import json

    from hybrid_alloc import Allocator
    from hybrid_alloc.vllm.plan import native_plan
    from hybrid_alloc.vllm.unsupported import Unsupported

    _, t = qwen36
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    plan = native_plan(_args(t), None)
    assert (plan["slots_per_page"], plan["policy"], plan["enable_caching"]) == (17, "hit-aware", True)
    a = Allocator(**plan)
    assert (a.policy, a.slots_per_page) == ("hit-aware", 17)
    plan = native_plan(_args(t, enable_caching=False), None)
    assert (plan["slots_per_page"], plan["policy"], plan["enable_caching"]) == (17, "hit-aware", False)
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps([[1, 2, 3]]))
    monkeypatch.setenv("HYBRID_ALLOC_PIN_PREFIXES", str(pins))
    with pytest.raises(Unsupported, match="HYBRID_ALLOC_PIN_PREFIXES \\(two-level pages serve hit-aware's own"):
        native_plan(_args(t), None)


def test_native_plan_refuses_a_kv_connector_under_two_level(qwen36: tuple[Any, Any]) -> None:
    """NixlConnector is served with Mamba layers today; under two-level pages it is refused."""
    from types import SimpleNamespace

    from hybrid_alloc.vllm.plan import native_plan
    from hybrid_alloc.vllm.unsupported import Unsupported

    _, t = qwen36
    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector", kv_role="kv_both"))
    with pytest.raises(Unsupported, match="two-level with a KV connector \\(NixlConnector"):
        native_plan(_args(t), vc)


def test_the_core_builds_the_two_level_plan_with_zeroing_and_without(qwen36: tuple[Any, Any]) -> None:
    """Every supported release marks a Mamba hybrid's configuration for zeroing new blocks
    (``needs_kv_cache_zeroing``: ``has_mamba_layers``): the core builds ``native_plan``'s
    arguments with ``zero_new_blocks`` (it records the new slots, which the engine side's
    workers zero in their small-block views), and without it (the capacity bench's
    ``without_zeroing``)."""
    import inspect

    from hybrid_alloc import Allocator
    from hybrid_alloc.bench.capacity_run import without_zeroing
    from hybrid_alloc.vllm.plan import native_plan

    if "slots_per_page" not in inspect.signature(Allocator).parameters:
        pytest.skip("the core has no slots_per_page (two-level pages) yet")
    _, t = qwen36
    assert t.needs_kv_cache_zeroing
    native = native_plan(_args(t), None)
    assert native["zero_new_blocks"] is True
    Allocator(**native)
    native = native_plan(_args(without_zeroing(t)), None)
    assert "zero_new_blocks" not in native
    alloc = Allocator(**native)
    assert alloc.slots_per_page == 17 and alloc.num_blocks == t.num_blocks == 1927
    assert alloc.num_free_blocks == 1926 and alloc.usage == 0.0


def _with_unit(vc: Any, unit: int | None, caching: bool = True) -> Any:
    """A copy of ``vc`` whose ``cache_config`` has ``prefix_match_unit=unit``."""
    from types import SimpleNamespace

    cache = SimpleNamespace(prefix_match_unit=unit, enable_prefix_caching=caching)
    return SimpleNamespace(cache_config=cache, kv_transfer_config=None, speculative_config=None)


def test_prefix_match_unit_is_read_from_the_users_setting_and_defaults_the_small_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybrid_alloc.vllm import pages

    monkeypatch.delenv(pages.SMALL_BLOCK_ENV, raising=False)
    assert pages.prefix_match_unit(None) is None
    assert pages.prefix_match_unit(_with_unit(None, None)) is None
    assert pages.prefix_match_unit(_with_unit(None, 32, caching=False)) is None  # no hits to serve
    assert pages.prefix_match_unit(_with_unit(None, 32)) == 32
    assert pages.small_block(_with_unit(None, 32)) == 32  # the unit, where the variable is unset
    assert pages.small_block(_with_unit(None, None)) == pages.small_block(None) == 64
    monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "64")
    assert pages.small_block(_with_unit(None, 32)) == 64  # the variable wins
    assert pages.unit_refusal(_with_unit(None, 64), 64) is None
    assert pages.unit_refusal(_with_unit(None, None), 64) is None
    assert "prefix_match_unit=32: served only equal to the small block" in str(
        pages.unit_refusal(_with_unit(None, 32), 64)
    )
    assert "prefix_match_unit=128" in str(pages.unit_refusal(_with_unit(None, 128), 64))


def test_native_plan_serves_a_unit_equal_to_the_small_block_and_refuses_any_other(
    qwen36: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``prefix_match_unit`` equal to the small block goes to the core as
    ``prefix_match_unit`` (partial hash hits: hits at every unit, the hit alignment the unit);
    another unit is refused with the reason; with prefix caching off the unit serves nothing
    and is not passed. Read from ``cache_config``, never from the hash block (caching off, the
    adapter's hash block is the scheduler block)."""
    from hybrid_alloc import Allocator
    from hybrid_alloc.bench.capacity_run import without_zeroing
    from hybrid_alloc.vllm import pages
    from hybrid_alloc.vllm.plan import native_plan
    from hybrid_alloc.vllm.unsupported import Unsupported

    _, t = qwen36
    t = without_zeroing(t)
    native = native_plan(_args(t), _with_unit(None, 64))
    assert native["prefix_match_unit"] == 64 and native["slots_per_page"] == 17
    alloc = Allocator(**native)
    assert alloc.partial_hash_hits
    assert not Allocator(**native_plan(_args(t), None)).partial_hash_hits  # no unit: hits end at state blocks
    off = native_plan(_args(t, enable_caching=False, hash_block_size=1088), _with_unit(None, 64, caching=False))
    assert "prefix_match_unit" not in off
    # Unset, the small block would be the unit (32), and the 64-token plan is then refused as
    # not at the small block; set to 64, the unit itself is refused.
    with pytest.raises(Unsupported, match="attention blocks of \\[64\\] tokens, HYBRID_ALLOC_SMALL_BLOCK is 32"):
        native_plan(_args(t, hash_block_size=32), _with_unit(None, 32))
    monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "64")
    for unit in (32, 128):
        with pytest.raises(Unsupported, match=f"prefix_match_unit={unit}: served only equal to the small block"):
            native_plan(_args(t, hash_block_size=unit), _with_unit(None, unit))
    # The core refuses what the plugin would not pass: a unit other than the hash block and slots.
    with pytest.raises(Exception, match="with 64-token slots is not served"):
        Allocator(**{**native, "hash_block_size": 32, "prefix_match_unit": 32})


def test_a_unit_below_the_small_block_keeps_vllms_plan_and_manager_with_one_line(
    plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--prefix-match-unit 32`` with 64-token slots (vLLM would hash at 32 and hit inside
    slots). The engine side (``engine_pages.decide``, the plugin applied) keeps vLLM's plan,
    naming the unit, before vLLM's resolver is asked; the same unit with the small block at
    32 (``HYBRID_ALLOC_SMALL_BLOCK`` unset: the unit) is planned two-level. Then vLLM's real
    Scheduler over vLLM's plan: the plugin falls back to vLLM's manager at construction, with
    one line naming the unit."""
    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup
    from hybrid_alloc.vllm import engine_pages, pages, plugin

    monkeypatch.delenv("HYBRID_ALLOC_POLICY", raising=False)
    monkeypatch.setenv(pages.PAGES_ENV, "two-level")
    monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "64")
    setup = SchedulerSetup(
        SHAPES["qwen36"], manager="hybrid_alloc", kv_budget_bytes=GiB, max_num_seqs=8, prefix_match_unit=32
    )
    vc = setup.vllm_config()
    kvc = setup.kv_cache_config(vc)
    assert plugin.apply()
    try:
        reshaped, why = engine_pages.decide(vc, [kvc])
        assert reshaped is None and "prefix_match_unit=32: served only equal to the small block" in why, why
        monkeypatch.delenv(pages.SMALL_BLOCK_ENV)
        reshaped, why = engine_pages.decide(vc, [kvc])
        assert reshaped is not None and "attention at 32-token blocks" in why, why
        monkeypatch.setenv(pages.SMALL_BLOCK_ENV, "64")
    finally:
        plugin.remove()
    plugin_lines.clear()
    sched = setup.build()
    assert getattr(sched.kv_cache_manager, "_alloc", None) is None  # vLLM's manager
    lines = [ln for ln in plugin_lines if "fall" in ln]
    assert len(lines) == 1 and "prefix_match_unit=32: served only equal to the small block" in lines[0], plugin_lines
