"""Differential tests: the installed vLLM's (a supported release's) own KVCacheManager against
ours, on seeded random request traces (shared prefixes, chunked prefill, decode, preemption
and re-admission, aborts, double frees and deferred frees through pop_blocks_for_free,
eviction under memory pressure, prefix-cache resets, explicit cache_blocks /
remove_skipped_blocks; on 0.33 also bounded hits and lookahead block hashes). Every call's
output must be identical.

``HYBRID_ALLOC_PARITY_OPS`` sets the operations per configuration (default 100000)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

NUM_OPS = int(os.environ.get("HYBRID_ALLOC_PARITY_OPS", "100000"))


def _setups():  # imported lazily: needs vLLM
    from vllm_harness import SETUPS

    return SETUPS


def _names() -> list[str]:
    try:
        return [s.name for s in _setups()]
    except ImportError:
        return ["(vllm missing)"]


@pytest.mark.parametrize("name", _names())
def test_parity_random_trace(name: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from parity_driver import ParityRun, run_seeds
    from vllm_harness import HAVE_MAX_CACHE_HIT_LENGTH, SETUPS

    setup = next(s for s in SETUPS if s.name == name)
    if not setup.available:
        pytest.skip(f"{name} is served natively only on vLLM 0.33 (lookahead hashes / no drop for flagged groups)")
    total = run_seeds(ParityRun, setup, 1000, NUM_OPS)
    # The traces must actually exercise what they claim to.
    assert total["finish"] > 0
    assert total["reset_ok"] > 0, f"{name}: no successful prefix-cache reset happened"
    assert total["preempt"] > 0, f"{name}: no preemption happened; the pool is too large"
    assert total["popped"] > 0
    if setup.enable_caching:
        assert total["hits"] > 0, f"{name}: no prefix-cache hit happened"
        assert total["cached_block_hits"] > 0, f"{name}: get_cached_block never found a block"
        if HAVE_MAX_CACHE_HIT_LENGTH:
            assert total["bounded_lookups"] > 0
        entries = any(s.block_size > setup.hash_block_size for s in setup.specs if isinstance(s, FullAttentionSpec))
        if entries and len(setup.specs) > 1:
            assert total["partial_entries"] > 0, f"{name}: no partial-block prefix entry was stored"
        if setup.lookahead:
            assert total["lookahead_events"] > 0, f"{name}: no BlockStored event with lookahead tokens"


def test_two_native_managers_on_the_same_requests_stay_apart() -> None:
    """Requests are tagged with the allocator's serial: a second native manager driving the
    same Request objects never answers from the first one's limits."""
    from vllm.v1.request import RequestStatus

    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from vllm_harness import SETUPS

    s = next(s for s in SETUPS if s.name == "full_swa_bs16")
    ref = s.build(events=False)[0]
    a = HybridKVCacheManager(**s.manager_kwargs(events=False))
    b = HybridKVCacheManager(**s.manager_kwargs(events=False))
    reqs = [s.make_request(f"x{i}", list(range(1 + i, 40 + i)), 100) for i in range(4)]
    for r in reqs:
        ids = [m.allocate_slots(r, 39).get_block_ids() for m in (ref, a)]
        assert ids[0] == ids[1]
        r.num_computed_tokens = 39
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids(5)
    for step in range(40):
        for r in reqs:
            want = ref.allocate_slots(r, 1)
            got_a = a.allocate_slots(r, 1)
            assert want.get_block_ids(allow_none=True) == got_a.get_block_ids(allow_none=True)
            # b has never seen these requests: it must allocate them from scratch.
            got_b = b.allocate_slots(r, 1) if step == 0 else None
            if got_b is not None:
                assert len(got_b.get_block_ids()[0]) == (r.num_computed_tokens + 1 + 15) // 16
            r.num_computed_tokens += 1
            r.append_output_token_ids(5)


def _scheduler_manager_flags(method: str, mtp_modules: int = 0) -> dict[str, int | bool]:
    """What the installed vLLM's ``Scheduler`` passes its KV cache manager for a speculative
    method (``use_eagle``, ``num_hash_lookahead_tokens``, ``num_prefill_lookahead``), computed
    by vLLM's own ``SpeculativeConfig`` and ``VllmConfig`` code on stand-in objects (building
    a real drafter config needs the draft model's files). ``mtp_modules``: a draft model of
    that many MTP modules (DeepSeek-style ``num_nextn_predict_layers``, 0.34's ``n_predict``)."""
    import types

    from vllm.config import SpeculativeConfig, VllmConfig

    draft = None
    if mtp_modules:
        hf = types.SimpleNamespace(
            model_type="deepseek_mtp",
            num_nextn_predict_layers=mtp_modules,
            n_predict=mtp_modules,
            index_share_for_mtp_iteration=False,
        )
        draft = types.SimpleNamespace(hf_config=hf)
    spec = types.SimpleNamespace(
        method=method,
        disable_eagle_block_drop=False,
        disable_lookahead_block_hashes=False,
        draft_model_config=draft,
        num_speculative_tokens=3,
        custom_method=None,
        index_share_for_mtp_iteration=None,
    )
    for name in (
        "use_eagle",
        "use_dflash",
        "use_dspark",
        "needs_eagle_block_drop",
        "use_eagle_block_drop",
        "use_multi_module_mtp",
        "num_mtp_modules",
    ):
        if hasattr(SpeculativeConfig, name):
            setattr(spec, name, types.MethodType(getattr(SpeculativeConfig, name), spec))
    if isinstance(getattr(SpeculativeConfig, "speculator_config", None), property):
        # 0.34: the lookahead counts come from the method's speculator config.
        spec.speculator_config = SpeculativeConfig.speculator_config.fget(spec)
    vc = types.SimpleNamespace(
        speculative_config=spec,
        kv_transfer_config=None,
        num_speculative_tokens=3,
        cache_config=types.SimpleNamespace(enable_prefix_caching=True),
    )
    vc.num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens.fget(vc)
    if hasattr(VllmConfig, "_resolve_num_hash_lookahead_tokens"):  # 0.34: a field resolved at build
        lookahead = VllmConfig._resolve_num_hash_lookahead_tokens(vc)
    elif hasattr(VllmConfig, "num_hash_lookahead_tokens"):  # 0.33: a property
        lookahead = VllmConfig.num_hash_lookahead_tokens.fget(vc)
    else:
        lookahead = 0
    use_eagle = spec.use_eagle_block_drop() and not lookahead  # the Scheduler clears it with lookahead hashes
    return dict(use_eagle=use_eagle, lookahead=lookahead, prefill=vc.num_prefill_lookahead_tokens)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle"])
def test_drafter_flags_served_natively(method: str) -> None:
    """DFlash/DSpark (no block drop on 0.33) and EAGLE (lookahead hashes on 0.33, with prefix
    caching) are served natively on 0.33 with the flags vLLM's own config code produces, the
    draft layers' group flagged; on 0.32 they drop the last block, served natively too, with
    the coordinator's EAGLE sets and each manager's ``use_eagle`` as vLLM's manager has them."""
    import dataclasses

    from hybrid_alloc.vllm.manager import HybridKVCacheManager, native_config_or_reason
    from vllm_harness import HAVE_LOOKAHEAD_HASHES, SETUPS

    flags = _scheduler_manager_flags(method)
    base = next(s for s in SETUPS if s.name == "full_swa_bs16")
    setup = dataclasses.replace(
        base, eagle_groups=(0,), lookahead=int(flags["lookahead"]), prefill_lookahead=int(flags["prefill"])
    )
    kw = setup.manager_kwargs(events=True)
    kw["use_eagle"] = flags["use_eagle"]
    native, reason = native_config_or_reason(**kw)
    mgr = HybridKVCacheManager(**kw)
    if HAVE_LOOKAHEAD_HASHES:
        assert not flags["use_eagle"] and flags["prefill"] == 1
        assert flags["lookahead"] == (1 if method == "eagle" else 0)
        assert native is not None, reason
        assert type(mgr) is HybridKVCacheManager
        assert mgr.coordinator.eagle_group_ids == {0} and not mgr.coordinator.drop_eagle_group_ids
    else:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        assert flags["use_eagle"]
        assert native is not None, reason
        assert native["eagle_drop_groups"] == [0]
        assert type(mgr) is HybridKVCacheManager
        ref = KVCacheManager(**kw)
        assert mgr.coordinator.eagle_group_ids == ref.coordinator.eagle_group_ids == {0}
        uses = [m.use_eagle for m in ref.coordinator.single_type_managers]
        assert [m.use_eagle for m in mgr.coordinator.single_type_managers] == uses == [True, False]


def test_multi_module_mtp_flags_served_natively() -> None:
    """Multi-module MTP (three modules, three draft tokens): vLLM's own config code gives a
    prefill lookahead of 3 on every release (on 0.33/0.34 lookahead block hashes over 3
    tokens, no drop; on 0.32 the drop), and ours serves it natively, with vLLM's
    ``num_reprefillable_tokens`` on the coordinator and each manager's ``use_eagle``."""
    import dataclasses

    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from hybrid_alloc.vllm.manager import HybridKVCacheManager, native_config_or_reason
    from vllm_harness import HAVE_LOOKAHEAD_HASHES, SETUPS

    flags = _scheduler_manager_flags("mtp", mtp_modules=3)
    assert flags["prefill"] == 3
    assert flags["lookahead"] == (3 if HAVE_LOOKAHEAD_HASHES else 0)
    assert flags["use_eagle"] is (not HAVE_LOOKAHEAD_HASHES)
    base = next(s for s in SETUPS if s.name == "full_swa_bs16")
    for specs in (base.specs, base.specs[:1]):
        setup = dataclasses.replace(
            base,
            specs=specs,
            eagle_groups=(0,),
            lookahead=int(flags["lookahead"]),
            prefill_lookahead=int(flags["prefill"]),
            use_eagle=bool(flags["use_eagle"]),
        )
        kw = setup.manager_kwargs(events=True)
        native, reason = native_config_or_reason(**kw)
        assert native is not None, reason
        assert native["reprefillable_tokens"] == 2
        mgr, ref = HybridKVCacheManager(**kw), KVCacheManager(**kw)
        assert type(mgr) is HybridKVCacheManager
        assert mgr.coordinator.num_reprefillable_tokens == ref.coordinator.num_reprefillable_tokens == 2
        uses = [m.use_eagle for m in ref.coordinator.single_type_managers]
        assert [m.use_eagle for m in mgr.coordinator.single_type_managers] == uses
