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


def _stand_in(name: str, reads: tuple[str, ...], without: str) -> type:
    """A class named ``name`` with every attribute in ``reads`` but ``without``."""
    return type(name, (), {n: None for n in reads if n != without})


def test_installed_vllm_has_every_attribute_the_adapter_reads() -> None:
    from hybrid_alloc.vllm import compat

    assert compat.missing_reads() == []


@pytest.mark.parametrize("which", ["Request", "KVCacheConfig", "VllmConfig"])
def test_compat_probe_names_each_missing_attribute_in_turn(which: str) -> None:
    """A stand-in lacking each attribute the adapter reads, one at a time: the probe names
    exactly that one (and nothing when none is missing)."""
    from hybrid_alloc.vllm import compat

    reads = {
        "Request": compat.REQUEST_READS,
        "KVCacheConfig": compat.KV_CACHE_CONFIG_READS,
        "VllmConfig": compat.VLLM_CONFIG_READS,
    }[which]
    arg = {"Request": "request_cls", "KVCacheConfig": "kv_cache_config_cls", "VllmConfig": "vllm_config_cls"}[which]
    assert compat.missing_reads(**{arg: _stand_in(which, reads, "")}) == []
    for name in reads:
        assert compat.missing_reads(**{arg: _stand_in(which, reads, name)}) == [f"{which}.{name}"], name


def test_compat_probe_reads_attributes_init_assigns() -> None:
    """An attribute assigned in ``__init__`` (as vLLM's ``Request`` sets most of its own)
    counts as present; one only read there does not."""
    from hybrid_alloc.vllm import compat

    class Assigns:
        def __init__(self, other: Any) -> None:
            self.block_hashes = other.priority

    names = compat._names(Assigns)
    assert "block_hashes" in names and "priority" not in names


@pytest.mark.parametrize("missing", ["request", "kv_cache_config"])
def test_missing_attribute_falls_back_at_construction_with_one_line(
    missing: str, plugin_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter built against a vLLM whose ``Request`` (or ``KVCacheConfig``) lacks an
    attribute it reads returns vLLM's own manager, with one line naming the attribute, for
    each attribute in turn."""
    import types

    from hybrid_alloc.vllm import compat, manager

    if missing == "request":
        reads, module, attr, cls = compat.REQUEST_READS, "_vllm_request", "Request", "Request"
    else:
        reads, module, attr, cls = compat.KV_CACHE_CONFIG_READS, "_vllm_kvi", "KVCacheConfig", "KVCacheConfig"
    for name in reads:
        plugin_lines.clear()
        monkeypatch.setattr(compat, module, types.SimpleNamespace(**{attr: _stand_in(cls, reads, name)}))
        built = manager.HybridKVCacheManager(**_kwargs())
        assert type(built) is manager.VllmKVCacheManager, name
        lines = _hybrid_alloc_lines(plugin_lines)
        assert len(lines) == 1 and f"lacks {cls}.{name}" in lines[0], (name, lines)
