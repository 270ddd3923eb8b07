"""KV connectors with what vLLM 0.34 changed around them, vLLM's real Scheduler run once with
its KVCacheManager and once with ours (the worker side faked, see ``connector_driver``):
every step's SchedulerOutput and connector metadata, the free block count, every connector
lookup, the manager's and the connector's KV events, the junctions the connector raised and
the manager calls must be identical.

- Lookahead block hashes with a KV connector (0.34): with EAGLE, a connector whose class's
  ``supports_lookahead_block_hashes`` is True (NixlConnector, the OffloadingConnector, a
  MultiConnector over them) makes the Scheduler build its manager with ``use_eagle=False``
  and ``num_hash_lookahead_tokens`` > 0 (whether or not prefix caching is on), and requests
  hashed with the lookahead hasher; events carry ``lookahead_token_ids``. NixlConnector as KV
  consumer and producer, the OffloadingConnector, a MultiConnector over both, sync and async
  scheduling, full attention, sliding window + full and GDN + full (an MTP-like drafter over
  a Mamba hybrid: the producer truncates the request's hashes). On 0.32 and 0.33 the same
  configurations reach the manager with ``use_eagle=True`` (the trailing-block drop, the
  Mamba "align" checkpoints moved one block back with it), served natively and compared as
  above.
- The OffloadingConnector's junction (0.34): ``get_num_new_matched_tokens`` raises
  ``request.shared_prefix_boundary`` where a sliding-window or Mamba group cut the external
  hit below the full-attention boundary; the manager reads it at ``allocate_slots``. Checked
  to happen (and to reach ``allocate_slots``), compared as above, and planted wrong in ours
  to show the comparison catches it; and, under ``HYBRID_ALLOC_POLICY=hit-aware``, run beside
  the policy's first-sighting stops (the manager moving the junction) with the core's
  invariants checked after every step and every request finished.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _lookahead_with_connectors() -> bool:
    """Whether this vLLM lets a KV connector keep lookahead block hashes (0.34: the
    connector class's ``supports_lookahead_block_hashes``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes")


def _connector_raises_junction() -> bool:
    """Whether this vLLM's OffloadingConnector raises a request's shared-prefix junction
    (0.34)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    return hasattr(OffloadingConnectorScheduler, "_maybe_register_shared_prefix_junction")


# case: (the test_connector_vllm case it speculates over, drafts a step, prefix caching)
EAGLE_CASES: dict[str, tuple[str, int, bool]] = {
    "llama_consumer_eagle": ("llama_consumer", 3, True),
    "gemma_consumer_eagle": ("gemma_consumer", 2, True),
    "llama_consumer_eagle_async": ("llama_consumer_async", 3, True),
    "llama_producer_eagle": ("llama_producer", 3, True),
    "gemma_producer_eagle_async": ("gemma_producer_async", 2, True),
    # Prefix caching off: with a connector 0.34 keeps lookahead hashes all the same.
    "llama_consumer_eagle_nocache": ("llama_consumer", 2, False),
    "llama_offload_eagle": ("llama_offload", 3, True),
    "gemma_offload_eagle": ("gemma_offload", 2, True),
    "gemma_offload_eagle_async": ("gemma_offload_async", 3, True),
    "gemma_multi_offload_eagle": ("gemma_multi_offload", 2, True),
    "gemma_multi_offload_eagle_async": ("gemma_multi_offload_async", 3, True),
    # GDN + full (Mamba "align"), an MTP-like drafter: NixlConnector's producer truncates the
    # request's hashes (``truncate_block_hashes``); the OffloadingConnector's boundary states.
    "qwen_consumer_eagle": ("qwen_consumer", 2, True),
    "qwen_producer_eagle": ("qwen_producer", 2, True),
    "qwen_offload_eagle": ("qwen_offload", 2, True),
    # Prefix caching off: Mamba cache mode "none", lookahead hashes all the same.
    "qwen_consumer_eagle_nocache": ("qwen_consumer", 2, False),
}


def _specsetup_case(case: str) -> tuple[Any, Any, str]:
    """The base case's setup with an EAGLE drafter of ``k`` tokens (the full-attention group
    flagged as the draft layers' group, as vLLM's planner flags the group holding them), the
    OffloadingConnector's events self-describing (``self_describing_kv_events``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

    from connector_cases import setup_case
    from sched_driver import SpecSchedulerSetup

    base, k, caching = EAGLE_CASES[case]
    setup, w, role = setup_case(base)
    # The OffloadingConnector's CPU-tier events with their payload (tokens, lookahead tokens).
    ktc = setup.extra["kv_transfer_config"]
    for c in [{"kv_connector": ktc.kv_connector, "kv_connector_extra_config": ktc.kv_connector_extra_config}] + list(
        ktc.kv_connector_extra_config.get("connectors", [])
    ):
        if c["kv_connector"] == "OffloadingConnector":
            c["kv_connector_extra_config"]["self_describing_kv_events"] = True

    @dataclasses.dataclass
    class EagleSetup(SpecSchedulerSetup):
        def kv_cache_config(self, vc: Any) -> KVCacheConfig:
            kvc = super().kv_cache_config(vc)
            fa = next(g for g in kvc.kv_cache_groups if type(g.kv_cache_spec) is FullAttentionSpec)
            fa.is_eagle_group = True
            return kvc

    fields = {f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)}
    fields["enable_prefix_caching"] = caching
    spec = EagleSetup(**fields, num_spec_tokens=k, method="eagle")
    return spec, dataclasses.replace(w, spec_tokens=k), role


@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_connector_with_lookahead_hashes_identical(
    case: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from connector_driver import assert_same_pd, run_pd

    setup, w, role = _specsetup_case(case)
    if not _lookahead_with_connectors():
        # 0.32 / 0.33: the connector keeps legacy hashes, EAGLE drops the trailing block
        # (``use_eagle=True``; with the GDN model's Mamba "align" layers the checkpoints move
        # one block back): served natively, compared as below.
        caplog.set_level(logging.INFO, logger="vllm.hybrid_alloc")
        sched = dataclasses.replace(setup, manager="hybrid_alloc").build()
        name = type(sched.kv_cache_manager).__name__
        lookahead = getattr(sched, "num_hash_lookahead_tokens", 0)
        sched.shutdown()
        lines = [r.getMessage() for r in caplog.records if "falling back to vLLM's KVCacheManager" in r.getMessage()]
        assert lookahead == 0
        assert name == "HybridKVCacheManager" and not lines, lines
        ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)
        ours = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
        assert_same_pd(case, ref, ours)
        assert ref["counters"]["drafts"] > 0
        return
    from vllm.v1.request import Request

    truncated = [0]
    truncate = Request.truncate_block_hashes

    def truncate_block_hashes(self: Any, *a: Any, **k: Any) -> Any:
        truncated[0] += 1
        return truncate(self, *a, **k)

    monkeypatch.setattr(Request, "truncate_block_hashes", truncate_block_hashes)
    ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)
    ours = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    assert_same_pd(case, ref, ours)
    if case.startswith("qwen_producer"):
        # The producer dropped the token the decoder recomputes (a GDN model) and cut the
        # request's lookahead hashes to match before the manager saw it (both runs).
        assert truncated[0] > 0 and truncated[0] % 2 == 0, truncated
    # The configuration is the one claimed: lookahead hashes with the connector, drafts
    # scheduled, and events (with caching) carrying the lookahead tokens.
    assert ref["lookahead"] == 1
    assert ref["counters"]["drafts"] > 0
    sched_base, _, caching = EAGLE_CASES[case]
    conn = sched_base.split("_", 1)[1]
    if caching:
        assert any(getattr(e, "lookahead_token_ids", None) for e in ref["events"]), case
    else:
        assert not ref["events"], case
    c, calls = ref["counters"], ref["calls"]
    if "offload" in conn:
        # The connector's own CPU-tier events hash with the lookahead tokens too.
        assert c["jobs"] > 10 and c["load_jobs"] > 0, c
        assert any(getattr(e, "lookahead_token_ids", None) for e in ref["connector_events"]), case
    elif conn.startswith("consumer"):
        assert c["recv"] > 5 and calls["alloc_delay_cache"] > 0 and calls["cache_blocks"] > 0
        if caching and not case.startswith("qwen"):
            assert calls.get("alloc_local_and_external", 0) > 0
    else:
        assert c["sent"] == c["delayed_free"] > 5
    if case.startswith("qwen") and "offload" in conn:
        assert c["boundary_states"] > 0


# The OffloadingConnector cases whose workload makes it raise a request's junction (a
# sliding-window or GDN group cut an offloaded hit): alone, under a MultiConnector, async.
JUNCTION_CASES = ["gemma_offload", "gemma_offload_async", "gemma_multi_offload", "qwen_offload", "qwen_offload_async"]


def _junction_pair(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from connector_cases import setup_case
    from connector_driver import run_pd

    setup, w, role = setup_case(case)
    ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)
    ours = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    return ref, ours


@pytest.mark.parametrize("case", JUNCTION_CASES)
def test_connector_raised_junction_identical(case: str) -> None:
    """The junction the OffloadingConnector raises reaches ``allocate_slots`` (the sliding
    window's retained tail, the Mamba chunk split and state) the same in both managers."""
    from connector_driver import assert_same_pd

    if not _connector_raises_junction():
        pytest.skip("this vLLM's OffloadingConnector writes no junction (0.34 does)")
    ref, ours = _junction_pair(case)
    assert_same_pd(case, ref, ours)
    # Not vacuous: the connector raised junctions above the local lookup's, and admissions
    # (allocate_slots) ran with them.
    assert ref["junctions"] and all(after > before for _, before, after in ref["junctions"]), ref["junctions"]
    assert ref["calls"]["alloc_connector_junction"] > 0


def test_connector_raised_junction_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proof can fail: a manager that took the junction from its own lookup (ignoring the
    one the connector wrote after it) breaks the comparison."""
    from connector_cases import setup_case
    from connector_driver import assert_same_pd, run_pd
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    if not _connector_raises_junction():
        pytest.skip("this vLLM's OffloadingConnector writes no junction (0.34 does)")
    case = "gemma_offload"
    setup, w, role = setup_case(case)
    ref = run_pd(dataclasses.replace(setup, manager="vllm"), role, w)
    local: dict[str, int] = {}  # request -> the junction its last local lookup reported
    orig_lookup = HybridKVCacheManager.get_computed_blocks
    orig_init = HybridKVCacheManager.__init__

    def get_computed_blocks(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        blocks, n, junction = orig_lookup(self, request, *a, **k)
        local[request.request_id] = junction
        return blocks, n, junction

    def init(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        fast = self.allocate_slots

        def allocate_slots(request: Any, *a: Any, **k: Any) -> Any:
            raised = request.shared_prefix_boundary
            request.shared_prefix_boundary = local.get(request.request_id, raised)
            try:
                return fast(request, *a, **k)
            finally:
                request.shared_prefix_boundary = raised

        self.allocate_slots = allocate_slots

    monkeypatch.setattr(HybridKVCacheManager, "get_computed_blocks", get_computed_blocks)
    monkeypatch.setattr(HybridKVCacheManager, "__init__", init)
    planted = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    assert ref["junctions"]
    with pytest.raises(AssertionError):
        assert_same_pd(case, ref, planted)


@pytest.mark.parametrize("case", ["qwen_offload", "qwen_offload_async", "gemma_offload"])
def test_connector_junction_with_hit_aware_stops(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``HYBRID_ALLOC_POLICY=hit-aware`` (ours only: its decisions differ from vLLM's by
    design) the OffloadingConnector's junction writes and the policy's first-sighting stops
    (the manager moving a request's junction at ``allocate_slots``) run side by side, the
    connector raising a junction over a guessed stop: the core's invariants hold after every
    step (``check_invariants``, in ``run_pd``), every request finishes, and the manager never
    lowers a junction."""
    from connector_cases import setup_case
    from connector_driver import run_pd

    if not _connector_raises_junction():
        pytest.skip("this vLLM's OffloadingConnector writes no junction (0.34 does)")
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    setup, w, role = setup_case(case)
    checks = [0]
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    orig = HybridKVCacheManager.check_invariants

    def check_invariants(self: Any) -> None:
        checks[0] += 1
        orig(self)

    monkeypatch.setattr(HybridKVCacheManager, "check_invariants", check_invariants)
    run = run_pd(dataclasses.replace(setup, manager="hybrid_alloc"), role, w)
    assert run["native"] == "HybridKVCacheManager"
    assert run["finished"], "a request never finished"
    assert checks[0] >= len(run["steps"]) > 0
    calls = run["calls"]
    assert calls.get("junction_raised", 0) > 0, calls
    assert calls.get("alloc_connector_junction", 0) > 0, calls
    # The manager moves a junction only forward, past one the connector raised too.
    assert calls.get("alloc_lowered_junction", 0) == 0, calls
    if case.startswith("qwen"):
        # The first-sighting stops ran in the same run (GDN "align" groups only), and the
        # connector raised a junction over one (the lookup's guessed stop).
        assert calls.get("alloc_moved_junction", 0) > 0, calls
        assert any(before > 0 for _, before, _ in run["junctions"]), run["junctions"]
