"""The vLLM plugin: entry point, flag handling, the fallback to vLLM's own manager (with
its one log line), and bad input through vLLM's API behaving as vLLM's manager does."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():  # type: ignore[no-untyped-def]
    h = _Lines()
    lg = logging.getLogger("vllm.hybrid_alloc")
    level = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(h)
    yield h.lines
    lg.removeHandler(h)
    lg.setLevel(level)


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("hybrid_alloc") == "hybrid_alloc.vllm.plugin:register"


def _which_manager(flag: str | None) -> str:
    env = dict(os.environ)
    env.pop("HYBRID_ALLOC", None)
    if flag is not None:
        env["HYBRID_ALLOC"] = flag
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.core.sched import scheduler\n"
        "print('RESULT', scheduler.KVCacheManager.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][-1].split()[1]


def test_flag_unset_or_zero_leaves_vllm_untouched() -> None:
    assert _which_manager(None) == "KVCacheManager"
    assert _which_manager("0") == "KVCacheManager"


def test_flag_set_swaps_the_scheduler_manager() -> None:
    assert _which_manager("1") == "HybridKVCacheManager"


def test_register_without_flag_imports_nothing() -> None:
    code = (
        "import os, sys; os.environ.pop('HYBRID_ALLOC', None)\n"
        "from hybrid_alloc.vllm.plugin import register\n"
        "register()\n"
        "print('RESULT', 'vllm.v1.core.sched.scheduler' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESULT False" in out.stdout


def _kwargs(setup: str = "full_swa_bs16", **over):  # type: ignore[no-untyped-def]
    from vllm_harness import SETUPS

    s = next(s for s in SETUPS if s.name == setup)
    kw = s.manager_kwargs(events=False)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, reason",
    [
        (dict(use_eagle=True), "EAGLE"),
        (dict(setup="full_bs16", dcp_world_size=2, hash_block_size=32, scheduler_block_size=32), "context parallelism"),
        (dict(num_prefill_lookahead=3), "prefill lookahead"),
    ],
)
def test_fallback_returns_vllm_manager_with_one_line(over, reason, log_lines) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    m = HybridKVCacheManager(**_kwargs(**over))
    assert type(m) is KVCacheManager
    fallback = [ln for ln in log_lines if "falling back" in ln]
    assert len(fallback) == 1 and reason in fallback[0]


def test_fallback_for_mamba_groups(log_lines) -> None:  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from vllm_harness import full

    mamba = MambaSpec(block_size=16, shapes=((16, 16),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], full(16)), KVCacheGroupSpec(["b"], mamba)])
    kw = _kwargs(kv_cache_config=cfg, enable_caching=False)
    m = HybridKVCacheManager(**kw)
    assert type(m) is KVCacheManager
    assert any("falling back" in ln for ln in log_lines)


def test_fallback_for_kv_connector(log_lines) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm import manager

    manager.current_vllm_config = SimpleNamespace(kv_transfer_config=object())
    try:
        m = manager.HybridKVCacheManager(**_kwargs())
    finally:
        manager.current_vllm_config = None
    assert type(m) is KVCacheManager
    assert any("KV connector" in ln for ln in log_lines)


def test_native_manager_logs_one_serving_line(log_lines) -> None:  # type: ignore[no-untyped-def]
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    m = HybridKVCacheManager(**_kwargs())
    assert type(m) is HybridKVCacheManager
    serving = [ln for ln in log_lines if "native KV cache manager serving" in ln]
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
    from hybrid_alloc.vllm.offline import LayerKind, ModelShape, SchedulerSetup, fabricate_output, make_request
    from sched_driver import digest

    shape = ModelShape("tiny", (LayerKind("sliding_window", 64), LayerKind("full")), num_kv_heads=2, head_size=64,
                       weight_bytes=0, max_model_len=512)
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
