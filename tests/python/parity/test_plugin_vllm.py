"""The vLLM plugin: entry point, flag handling, the fallback to vLLM's own manager (with
its one log line), and bad input through vLLM's API behaving as vLLM's manager does."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest

from hybrid_alloc.vllm.releases import SUPPORTED_RELEASES

pytestmark = pytest.mark.vllm


def _run(code: str, **env_over: str | None) -> tuple[str, str]:
    """Runs ``code`` in a fresh interpreter (``HYBRID_ALLOC`` and the opt-in variable
    cleared, then ``env_over`` applied; ``None`` removes); returns its last ``RESULT`` line
    (without the prefix) and everything it printed."""
    env = dict(os.environ)
    for k in ("HYBRID_ALLOC", "HYBRID_ALLOC_UNTESTED_VLLM"):
        env.pop(k, None)
    for k, v in env_over.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return result[len("RESULT ") :], log


def _plugin_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "hybrid_alloc:" in ln]


# Loads vLLM's plugins as every vLLM process does; prints the scheduler's manager class and
# the hybrid_alloc modules loaded.
_WHICH = (
    "import sys\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.v1.core.sched import scheduler\n"
    "m = scheduler.KVCacheManager\n"
    "mods = sorted(n for n in sys.modules if n.startswith('hybrid_alloc'))\n"
    "print('RESULT', m.__module__ + '.' + m.__qualname__, ','.join(mods))\n"
)
_VLLM_CLASS = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_FACTORY = "hybrid_alloc.vllm.plugin.apply.<locals>.KVCacheManager"


def test_flag_unset_or_zero_leaves_vllm_untouched_and_loads_no_adapter() -> None:
    for flag in (None, "0"):
        result, log = _run(_WHICH, HYBRID_ALLOC=flag)
        # vLLM loaded the entry point, which imported only its own module (and its lazy packages).
        assert result == f"{_VLLM_CLASS} hybrid_alloc,hybrid_alloc.vllm,hybrid_alloc.vllm.plugin"
        assert _plugin_lines(log) == []


def test_flag_set_swaps_the_scheduler_manager() -> None:
    result, _ = _run(_WHICH, HYBRID_ALLOC="1")
    assert result.split()[0] == _FACTORY
    assert "hybrid_alloc.vllm.manager" in result.split()[1]


_LIGHT = (
    "import sys\n"
    "from hybrid_alloc.vllm.plugin import register\n"
    "register()\n"
    "mods = sorted(m for m in sys.modules if m.split('.')[0] in ('hybrid_alloc', 'vllm', 'torch'))\n"
    "print('RESULT', ','.join(mods))\n"
)


def test_register_without_flag_imports_nothing() -> None:
    for flag in (None, "0"):
        result, _ = _run(_LIGHT, HYBRID_ALLOC=flag)
        # Only the plugin module and its two (lazy) packages: no vLLM, torch, adapter or extension.
        assert result.split(",") == ["hybrid_alloc", "hybrid_alloc.vllm", "hybrid_alloc.vllm.plugin"]


# Loads vLLM's plugins (as every vLLM process does) after PRE, then builds vLLM's real
# Scheduler with whatever manager that left in place and runs two requests to the end.
_SCHEDULE = """
import sys
from typing import Any
{pre}
from vllm.plugins import load_general_plugins
load_general_plugins()
from hybrid_alloc.vllm import plugin
from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup, fabricate_output, make_request
shape = ModelShape("tiny", (LayerKind("sliding_window", 64), LayerKind("full")), num_kv_heads=2, head_size=64,
                   weight_bytes=0, max_model_len=512)
sched = SchedulerSetup(shape, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=256).build_with_installed_manager()
for i in range(2):
    sched.add_request(make_request(sched, f"r{{i}}", list(range(1 + i, 200 + i)), 8))
finished = set()
for _ in range(40):
    so = sched.schedule()
    finished |= set(so.finished_req_ids)
    sched.update_from_output(so, fabricate_output(sched, so))
so = sched.schedule()
finished |= set(so.finished_req_ids)
print("RESULT", type(sched.kv_cache_manager).__name__, plugin.applied(), sorted(finished))
"""

_FAKE_RELEASE = "import hybrid_alloc.vllm.plugin as p; p.vllm_release = lambda: '0.31.9'"


def test_untested_release_leaves_vllm_running_with_one_line() -> None:
    result, log = _run(_SCHEDULE.format(pre=_FAKE_RELEASE), HYBRID_ALLOC="1")
    assert result == "KVCacheManager False ['r0', 'r1']"
    lines = _plugin_lines(log)
    assert len(lines) == 1, lines
    assert f"vLLM 0.31.9 is not a tested release (tested: {', '.join(SUPPORTED_RELEASES)})" in lines[0]
    assert "HYBRID_ALLOC_UNTESTED_VLLM=1" in lines[0]


def test_untested_release_with_opt_in_applies_the_patch() -> None:
    result, log = _run(_SCHEDULE.format(pre=_FAKE_RELEASE), HYBRID_ALLOC="1", HYBRID_ALLOC_UNTESTED_VLLM="1")
    assert result == "HybridKVCacheManager True ['r0', 'r1']"
    assert any("vLLM 0.31.9 is not a tested release" in ln and "trying anyway" in ln for ln in _plugin_lines(log))


def test_installed_release_is_tested_and_read_without_importing_vllm() -> None:
    code = (
        "import sys\n"
        "from hybrid_alloc.vllm import plugin\n"
        "print('RESULT', plugin.vllm_release(), 'vllm' in sys.modules)\n"
    )
    result, _ = _run(code)
    release, imported = result.split()
    assert release in SUPPORTED_RELEASES and imported == "False"


def test_extension_that_does_not_import_leaves_vllm_running_with_one_line() -> None:
    result, log = _run(_SCHEDULE.format(pre="sys.modules['hybrid_alloc._core'] = None"), HYBRID_ALLOC="1")
    assert result == "KVCacheManager False ['r0', 'r1']"
    lines = _plugin_lines(log)
    assert len(lines) == 1, lines
    assert "not enabled, vLLM is left untouched: ModuleNotFoundError" in lines[0] and "hybrid_alloc._core" in lines[0]


def test_missing_vllm_attribute_leaves_vllm_untouched_with_one_line() -> None:
    code = (
        "from vllm.v1.core.sched import scheduler\n"
        "from vllm.plugins import load_general_plugins\n"
        "original = scheduler.KVCacheManager\n"
        "del scheduler.KVCacheManager\n"
        "load_general_plugins()\n"
        "from hybrid_alloc.vllm import plugin\n"
        "wrapped = getattr(scheduler.Scheduler.__init__, '_hybrid_alloc_wrapped', False)\n"
        "print('RESULT', plugin.applied(), wrapped, hasattr(scheduler, 'KVCacheManager'))\n"
    )
    result, log = _run(code, HYBRID_ALLOC="1")
    assert result == "False False False"
    lines = _plugin_lines(log)
    assert len(lines) == 1 and "not enabled, vLLM is left untouched: AttributeError" in lines[0], lines


def _tiny_scheduler_with_the_plugin() -> Any:
    """vLLM's Scheduler of a tiny sliding-window + full model, built with the plugin applied
    (removed again after)."""
    from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup
    from hybrid_alloc.vllm import plugin

    shape = ModelShape(
        "tiny",
        (LayerKind("sliding_window", 64), LayerKind("full")),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=512,
    )
    assert plugin.apply()
    try:
        return SchedulerSetup(shape, num_blocks=100, max_num_seqs=4).build_with_installed_manager()
    finally:
        plugin.remove()


def test_adapter_raising_in_scheduler_falls_back_with_one_line(plugin_lines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm import manager

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("an adapter bug")

    monkeypatch.setattr(manager.HybridKVCacheManager, "__new__", boom)
    sched = _tiny_scheduler_with_the_plugin()
    assert type(sched.kv_cache_manager) is KVCacheManager
    lines = [ln for ln in plugin_lines if ln.startswith("hybrid_alloc:")]
    assert lines == [
        "hybrid_alloc: falling back to vLLM's KVCacheManager: building the native manager raised "
        "RuntimeError: an adapter bug"
    ]


def test_fallback_reason_survives_an_unreadable_page_size(plugin_lines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A refused configuration whose page size cannot be read (vLLM's own tests build Mamba
    specs with mock state shapes, whose ``page_size_bytes`` raises ``TypeError``) falls back
    with the refusal's reason, not the error of the two-level check after it."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm import pages

    def unreadable(kvc):  # type: ignore[no-untyped-def]
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(pages, "slots_per_page", unreadable)
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "no-such-policy")
    sched = _tiny_scheduler_with_the_plugin()
    assert type(sched.kv_cache_manager) is KVCacheManager
    lines = [ln for ln in plugin_lines if ln.startswith("hybrid_alloc:")]
    assert len(lines) == 1, lines
    assert "no-such-policy" in lines[0] and "TypeError" not in lines[0], lines


def test_remove_restores_vllm() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched import scheduler

    from hybrid_alloc.vllm import plugin

    init = scheduler.Scheduler.__init__
    assert plugin.apply() and plugin.apply()  # idempotent
    assert scheduler.KVCacheManager is not KVCacheManager
    plugin.remove()
    plugin.remove()
    assert scheduler.KVCacheManager is KVCacheManager and scheduler.Scheduler.__init__ is init


def _kwargs(setup: str = "full_swa_bs16", **over):  # type: ignore[no-untyped-def]
    from vllm_harness import SETUPS

    s = next(s for s in SETUPS if s.name == setup)
    kw = s.manager_kwargs(events=False)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, reason",
    [
        # The EAGLE drop is served (full attention, sliding windows); vLLM asserts with it over
        # chunked local attention, so the plugin leaves vLLM's manager (and its error) in place.
        (dict(setup="full_chunked_bs16", use_eagle=True), "EAGLE/MTP prefix-cache block drop with chunked local"),
        (dict(setup="full_bs16", pcp_world_size=2), "prefill context parallelism"),
    ],
)
def test_fallback_returns_vllm_manager_with_one_line(over, reason, plugin_lines) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    m = HybridKVCacheManager(**_kwargs(**over))
    assert type(m) is KVCacheManager
    fallback = [ln for ln in plugin_lines if "falling back" in ln]
    assert len(fallback) == 1 and reason in fallback[0]


def test_partial_hash_hits_served_under_both_policies(plugin_lines, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from vllm_harness import full

    # A Mamba block of two hash blocks in cache mode "align" (vLLM's partial hash hits,
    # ``--prefix-match-unit``) is served natively (issue 30) under both policies; hit-aware
    # asks vLLM's scheduler to end a prefill chunk at a junction inside a block (vLLM's
    # shared-prefix checkpoint), exact only where vLLM's own manager does (its flag with
    # EAGLE/MTP groups and at most one token of prefill lookahead; issue 39).
    mamba = MambaSpec(
        block_size=32, shapes=((16, 16),), dtypes=(torch.float32,), mamba_cache_mode="align", num_speculative_blocks=1
    )
    cfg = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], full(16)), KVCacheGroupSpec(["b"], mamba)],
    )
    kw = _kwargs(kv_cache_config=cfg, enable_caching=True, scheduler_block_size=32)
    m = HybridKVCacheManager(**kw)
    assert type(m) is HybridKVCacheManager
    assert m.coordinator.enable_partial_hash_hits
    assert not m.mamba_shared_prefix_checkpoint
    ref = KVCacheManager(**kw)
    assert ref.coordinator.enable_partial_hash_hits and not ref.mamba_shared_prefix_checkpoint
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    m = HybridKVCacheManager(**kw)
    assert type(m) is HybridKVCacheManager and m._alloc.policy == "hit-aware"
    assert m.coordinator.enable_partial_hash_hits and m.mamba_shared_prefix_checkpoint
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "exact")
    for use_eagle, flag, lookahead in [(True, True, 1), (True, True, 3), (True, False, 1), (False, True, 0)]:
        kw = _kwargs(
            kv_cache_config=cfg,
            enable_caching=True,
            scheduler_block_size=32,
            use_eagle=use_eagle,
            num_prefill_lookahead=lookahead,
            enable_mamba_shared_prefix_checkpoint=flag,
        )
        m, ref = HybridKVCacheManager(**kw), KVCacheManager(**kw)
        assert type(m) is HybridKVCacheManager
        assert m.mamba_shared_prefix_checkpoint == ref.mamba_shared_prefix_checkpoint, (use_eagle, flag, lookahead)
        assert ref.mamba_shared_prefix_checkpoint == (use_eagle and flag and lookahead <= 1)
    assert not any("falling back" in ln for ln in plugin_lines)


def test_fallback_for_kv_connector(plugin_lines) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm import manager

    # A connector no release's plugin serves (LMCacheMPConnector, the one here before, is served
    # on 0.32 and 0.33 now).
    ktc = KVTransferConfig(kv_connector="FlexKVConnectorV1", kv_role="kv_both")
    manager.current_vllm_config = SimpleNamespace(kv_transfer_config=ktc)
    try:
        m = manager.HybridKVCacheManager(**_kwargs())
    finally:
        manager.current_vllm_config = None
    assert type(m) is KVCacheManager
    assert any(ln.endswith("KV connector FlexKVConnectorV1 is configured") for ln in plugin_lines)


def test_native_manager_logs_one_serving_line(plugin_lines) -> None:  # type: ignore[no-untyped-def]
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    m = HybridKVCacheManager(**_kwargs())
    assert type(m) is HybridKVCacheManager
    serving = [ln for ln in plugin_lines if "native KV cache manager serving" in ln]
    assert len(serving) == 1 and "sliding_window(window=64)" in serving[0]


def test_bad_input_through_vllm_api_matches_vllm() -> None:
    """Aborted request freed twice, a request longer than the model, reset while running."""
    from vllm.v1.request import RequestStatus

    from vllm_harness import SETUPS

    s = next(s for s in SETUPS if s.name == "full_swa_bs16")
    ref, ours = s.build(events=True)
    req = s.make_request("long", list(range(1, s.max_model_len + 100)))
    short = s.make_request("short", list(range(1, 50)))
    for m in (ref, ours):
        m.get_computed_blocks(short)
    a = ref.allocate_slots(short, 49)
    b = ours.allocate_slots(short, 49)
    assert a.get_block_ids() == b.get_block_ids()
    assert ref.reset_prefix_cache() is False and ours.reset_prefix_cache() is False  # a request runs
    # Longer than max_model_len: both clamp slots at max_model_len, with the same result.
    ha, hb = ref.get_computed_blocks(req), ours.get_computed_blocks(req)
    assert ha[1] == hb[1]
    a = ref.allocate_slots(req, req.num_tokens, full_sequence_must_fit=True)
    b = ours.allocate_slots(req, req.num_tokens, full_sequence_must_fit=True)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.get_block_ids() == b.get_block_ids()
    assert ref.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
    # Abort: free twice (the second is a no-op in both); an unknown request is a no-op too.
    short.status = RequestStatus.FINISHED_ABORTED
    for m in (ref, ours):
        m.free(short)
        m.free(short)
        m.free(s.make_request("never-seen", [1, 2, 3]))
    assert ref.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks()
    assert ref.take_events() == ours.take_events()


def test_too_long_prompt_through_real_scheduler_matches_vllm() -> None:
    from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup, fabricate_output, make_request
    from sched_driver import digest

    shape = ModelShape(
        "tiny",
        (LayerKind("sliding_window", 64), LayerKind("full")),
        num_kv_heads=2,
        head_size=64,
        weight_bytes=0,
        max_model_len=512,
    )
    base = SchedulerSetup(shape, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=256)
    runs = []
    for name in ("vllm", "hybrid_alloc"):
        sched = dataclasses.replace(base, manager=name).build()
        sched.add_request(make_request(sched, "ok", list(range(1, 100)), 5))
        steps = []
        for _ in range(12):
            so = sched.schedule()
            steps.append(digest(so))
            sched.update_from_output(so, fabricate_output(sched, so))
        # Resetting while nothing runs succeeds in both.
        steps.append(sched.reset_prefix_cache())
        runs.append(steps)
    assert runs[0] == runs[1]


# A release whose ``Request`` lacks an attribute the adapter reads (as 0.34 dropped
# ``skip_reading_prefix_cache``): the stand-in has every other name the adapter reads.
_MISSING_REQUEST_ATTR = """
import types
import hybrid_alloc.vllm.plugin as p; p.vllm_release = lambda: '0.35.0'
import hybrid_alloc.vllm.compat as c
missing = c.REQUEST_READS[-1]
c._vllm_request = types.SimpleNamespace(Request=type("Request", (), {n: None for n in c.REQUEST_READS if n != missing}))
print("MISSING", missing)
"""


def test_untested_release_missing_a_request_attribute_falls_back_at_construction() -> None:
    """Under ``HYBRID_ALLOC_UNTESTED_VLLM=1`` a ``Request`` without an attribute the adapter
    reads ends in one fallback line naming it, at construction; vLLM's scheduler then runs
    its requests to the end with its own manager (prefix caching on), with no exception in
    ``schedule()``."""
    result, log = _run(_SCHEDULE.format(pre=_MISSING_REQUEST_ATTR), HYBRID_ALLOC="1", HYBRID_ALLOC_UNTESTED_VLLM="1")
    assert result == "KVCacheManager True ['r0', 'r1']"
    missing = next(ln.split()[1] for ln in log.splitlines() if ln.startswith("MISSING "))
    fallback = [ln for ln in _plugin_lines(log) if "falling back" in ln]
    assert len(fallback) == 1, _plugin_lines(log)
    assert f"lacks Request.{missing}" in fallback[0]
