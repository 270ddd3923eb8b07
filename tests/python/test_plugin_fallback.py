"""The plugin's fallback and environment controls against the installed vLLM: what vLLM's own
manager raises after the adapter fell back reaches the caller unchanged, after one line and
one construction (issue 15, defect 8b); ``HYBRID_ALLOC`` values; hit-aware controls set under
the exact policy (issue 15, item 9)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _kwargs(setup: str = "full_swa_bs16", **over: Any) -> dict[str, Any]:
    from vllm_harness import SETUPS

    s = next(s for s in SETUPS if s.name == setup)
    kw = s.manager_kwargs(events=False)
    kw.update(over)
    return kw


def _hybrid_alloc_lines(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("hybrid_alloc:")]


def test_vllm_error_after_fallback_reaches_caller_unchanged_once(
    plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode context parallelism 2 with a sliding-window group: the adapter falls back (one
    line), vLLM's own manager asserts against the layout, and that assertion reaches the
    scheduler's caller as vLLM raises it, after exactly one construction of vLLM's manager."""
    from vllm.v1.core.sched import scheduler as sched_mod

    from hybrid_alloc.vllm import manager, plugin

    kw = _kwargs(dcp_world_size=2)
    with pytest.raises(AssertionError) as direct:
        manager.VllmKVCacheManager(**_kwargs(dcp_world_size=2))

    built: list[int] = []

    class Counting(manager.VllmKVCacheManager):  # type: ignore[misc,valid-type]
        @functools.wraps(manager.VllmKVCacheManager.__init__)  # the same signature, for the adapter
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(manager, "VllmKVCacheManager", Counting)
    monkeypatch.setattr(sched_mod, "KVCacheManager", Counting)
    assert plugin.apply()
    try:
        factory = sched_mod.KVCacheManager
        with pytest.raises(AssertionError) as through_plugin:
            factory(**kw)
    finally:
        plugin.remove()
    assert type(through_plugin.value) is type(direct.value)
    assert str(through_plugin.value) == str(direct.value)
    assert "DCP" in str(through_plugin.value)
    assert built == [1], "vLLM's manager was built more than once"
    lines = _hybrid_alloc_lines(plugin_lines)
    assert len(lines) == 1, lines
    assert "falling back to vLLM's KVCacheManager" in lines[0] and "context parallelism" in lines[0]
    assert "building the native manager" not in lines[0]


def test_vllm_error_after_fallback_without_plugin_is_unchanged(plugin_lines: list[str]) -> None:
    """The same configuration built directly: vLLM's assertion, after the one fallback line."""
    from hybrid_alloc.vllm import manager

    with pytest.raises(AssertionError) as e:
        manager.HybridKVCacheManager(**_kwargs(dcp_world_size=2))
    assert manager.raised_by_vllm(e.value)
    assert len(_hybrid_alloc_lines(plugin_lines)) == 1


def test_adapter_error_is_not_taken_for_vllm_error() -> None:
    from hybrid_alloc.vllm import manager

    assert not manager.raised_by_vllm(RuntimeError("an adapter bug"))


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "Yes", "on", " ON "])
def test_flag_on_values_enable_the_plugin_silently(
    value: str, plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm import plugin

    assert plugin.flag(value) is True
    monkeypatch.setenv("HYBRID_ALLOC", value)
    plugin.remove()
    try:
        plugin.register()
        assert plugin.applied()
    finally:
        plugin.remove()
    assert _hybrid_alloc_lines(plugin_lines) == []


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "OFF"])
def test_flag_off_values_leave_vllm_untouched_silently(
    value: str | None, plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm import plugin

    assert plugin.flag(value) is False
    if value is None:
        monkeypatch.delenv("HYBRID_ALLOC", raising=False)
    else:
        monkeypatch.setenv("HYBRID_ALLOC", value)
    plugin.remove()
    plugin.register()
    assert not plugin.applied()
    assert _hybrid_alloc_lines(plugin_lines) == []


@pytest.mark.parametrize("value", ["2", "enable", "y", "hit-aware"])
def test_flag_other_values_leave_the_plugin_off_with_one_line(
    value: str, plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm import plugin

    assert plugin.flag(value) is None
    monkeypatch.setenv("HYBRID_ALLOC", value)
    plugin.remove()
    plugin.register()
    assert not plugin.applied()
    lines = _hybrid_alloc_lines(plugin_lines)
    assert len(lines) == 1, lines
    assert f"HYBRID_ALLOC={value!r}" in lines[0] and "stays off" in lines[0] and "1/true/yes/on" in lines[0]


def test_hit_aware_controls_under_exact_are_ignored_with_one_line(
    plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    pins = tmp_path / "pins.json"
    pins.write_text("[[1, 2, 3]]")
    monkeypatch.delenv("HYBRID_ALLOC_POLICY", raising=False)
    monkeypatch.setenv("HYBRID_ALLOC_PIN_PREFIXES", str(pins))
    monkeypatch.setenv("HYBRID_ALLOC_RETAIN_PRIORITY", "0")
    m = HybridKVCacheManager(**_kwargs())
    assert type(m) is HybridKVCacheManager and m._alloc.policy == "exact"
    assert m._pending_pins == [] and m._retain_priority is None
    ignored = [ln for ln in _hybrid_alloc_lines(plugin_lines) if "ignored" in ln]
    assert len(ignored) == 1, plugin_lines
    assert "HYBRID_ALLOC_RETAIN_PRIORITY, HYBRID_ALLOC_PIN_PREFIXES ignored" in ignored[0]
    assert "policy is exact" in ignored[0] and "HYBRID_ALLOC_POLICY=hit-aware" in ignored[0]
    assert not any("falling back" in ln for ln in plugin_lines)


def test_hit_aware_controls_under_hit_aware_say_nothing(
    plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    monkeypatch.setenv("HYBRID_ALLOC_RETAIN_PRIORITY", "0")
    m = HybridKVCacheManager(**_kwargs())
    assert type(m) is HybridKVCacheManager and m._retain_priority == 0
    assert not any("ignored" in ln for ln in plugin_lines)


def test_no_controls_under_exact_say_nothing(plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    for k in (
        "HYBRID_ALLOC_POLICY",
        "HYBRID_ALLOC_PIN_PREFIXES",
        "HYBRID_ALLOC_RETAIN_PRIORITY",
        "HYBRID_ALLOC_PIN_SHARE",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HYBRID_ALLOC_PIN_SHARE", "  ")  # blank counts as unset
    assert type(HybridKVCacheManager(**_kwargs())) is HybridKVCacheManager
    assert not any("ignored" in ln for ln in plugin_lines)
