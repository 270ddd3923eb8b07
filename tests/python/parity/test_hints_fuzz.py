"""Random KV hints through vLLM's real Scheduler with our manager (issue 38): hypothesis draws an
envelope and ``extra_args`` for each request of a seeded workload (``sched_driver.run_workload``:
shared prefixes, arrivals, aborts, preemptions), vLLM's own ``KvHintsEnvelope`` /
``KvHintAction`` structs holding whatever the strategies give (``hint_cases``), under memory
pressure, on a sliding-window shape (Gemma-3-like) and a state-space one with
``prefix_match_unit`` (Qwen3-Next-like, where checkpoints act).

- Any hints, under hit-aware: no exception escapes, every request finishes, and the core's
  invariants hold after every step (``check_invariants``).
- BAD hints only (every request's hints refused, or only naming a session), under hit-aware:
  the run is the run without hints, step for step (every SchedulerOutput: block ids, hits,
  preemptions), event for event, with the same usage and prefix-cache counters. A valid hint
  may change another request's evictions; a refused one may not.
- Pin leases with no pinned share (``HYBRID_ALLOC_PIN_SHARE=0``): each over the cap, refused and
  counted, and the run is the run without hints, likewise.
- Any hints under ``exact``: the run without hints, likewise (exact ignores them).

``HYBRID_ALLOC_HINT_FUZZ_EXAMPLES`` sets the examples per test (default 10); derandomized, so CI
runs the same examples each time."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hint_cases import asks_nothing, envelopes, extra_args, good_payloads, one, spoiled
from hybrid_alloc.vllm.hints import hints_of

pytestmark = pytest.mark.vllm

EXAMPLES = int(os.environ.get("HYBRID_ALLOC_HINT_FUZZ_EXAMPLES", "10"))
NUM_REQUESTS = 24
SEED = 5
# shape name -> (num_blocks under pressure, prefix_match_unit)
CASES = {"gemma3": (900, None), "qwen3next": (40, 64)}


def _setup(case: str, policy: str, monkeypatch: pytest.MonkeyPatch, pin_share: str = "") -> Any:
    from hybrid_alloc.bench.offline import SchedulerSetup
    from hybrid_alloc.bench.shapes import by_name

    monkeypatch.setenv("HYBRID_ALLOC_POLICY", policy)
    monkeypatch.setenv("HYBRID_ALLOC_PIN_SHARE", pin_share)  # empty: the default share
    num_blocks, unit = CASES[case]
    return SchedulerSetup(
        by_name(case),
        manager="hybrid_alloc",
        num_blocks=num_blocks,
        max_num_seqs=12,
        max_num_batched_tokens=1024,
        kv_events=True,
        prefix_match_unit=unit,
    )


def _run(setup: Any, hints: list[tuple[Any, Any]] | None, only_bad: bool = False) -> dict[str, Any]:
    """``run_workload`` on ``setup`` with ``hints[i]`` (envelope, extra_args) on request ``i``,
    checking the invariants after every step (``only_bad``: and that no request's hints ask for
    anything). Adds the manager's hint counters (``"counters"``, ``hint_stats``) and how many
    requests carried hints (``"hinted"``)."""
    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from sched_driver import run_workload

    orig = type(setup).build
    box: dict[str, Any] = {"hinted": 0}

    def build(self: Any) -> Any:
        sched = orig(self)
        mgr = sched.kv_cache_manager
        assert isinstance(mgr, HybridKVCacheManager)
        box["mgr"] = mgr
        ticks = [0.0]
        # A clock that moves 1 s per step: TTLs from 0.5 s up run out within the run.
        mgr._clock = lambda: ticks[0]
        add, update = sched.add_request, sched.update_from_output

        def add_request(request: Any) -> None:
            if hints is not None:
                env, xargs = hints[int(request.request_id[3:])]
                request.kv_hints = env
                request.sampling_params.extra_args = xargs
                h = hints_of(request)
                assert not only_bad or asks_nothing(h), h
                box["hinted"] += h is not None
            add(request)

        def update_from_output(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            mgr.check_invariants()
            ticks[0] += 1.0
            return out

        sched.add_request = add_request
        sched.update_from_output = update_from_output
        return sched

    setup.build = build.__get__(setup)
    out = run_workload(setup, seed=SEED, num_requests=NUM_REQUESTS, max_tokens_hi=60)
    assert out["native"] == "HybridKVCacheManager" and out["finished"]
    out["counters"] = box["mgr"].hint_stats()
    out["hinted"] = box["hinted"]
    return out


def _same_run(ref: dict[str, Any], ours: dict[str, Any]) -> None:
    assert len(ref["steps"]) == len(ours["steps"])
    for i, (a, b) in enumerate(zip(ref["steps"], ours["steps"], strict=True)):
        assert a == b, f"SchedulerOutput differs at step {i}"
    for key in ("events", "usage", "hits", "queries", "preemptions", "aborted", "cache_blocks_calls"):
        assert ref[key] == ours[key], key


def _baseline(
    case: str, policy: str, cache: dict[tuple[str, str, str], dict[str, Any]], pin_share: str = ""
) -> dict[str, Any]:
    if (case, policy, pin_share) not in cache:
        with pytest.MonkeyPatch.context() as mp:
            cache[case, policy, pin_share] = _run(_setup(case, policy, mp, pin_share), None)
    return cache[case, policy, pin_share]


@pytest.fixture(scope="module")
def baselines() -> dict[tuple[str, str, str], dict[str, Any]]:
    return {}


def _hints_lists(bad: bool = False) -> st.SearchStrategy[list[tuple[Any, Any]]]:
    """One (envelope, extra_args) per request: vLLM's structs; extra_args a dict or None (the
    type vLLM's ``SamplingParams`` has); about a quarter of the requests without hints.
    ``bad``: only hints that ask for nothing whatever the prompt's length (refused, or a
    session alone)."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    pair = st.tuples(
        envelopes(KvHintAction, KvHintsEnvelope), extra_args.filter(lambda x: x is None or type(x) is dict)
    )
    if bad:
        pair = pair.map(lambda p: spoiled(*p, KvHintAction, KvHintsEnvelope))
    return st.lists(one(pair, pair, pair, st.just((None, None))), min_size=NUM_REQUESTS, max_size=NUM_REQUESTS)


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def _totals(outs: list[dict[str, Any]]) -> dict[str, int]:
    """The examples' hint counters added up, and ``hinted``: requests that carried hints."""
    total: dict[str, int] = {"hinted": sum(o["hinted"] for o in outs)}
    for o in outs:
        for k, v in o["counters"].items():
            total[k] = total.get(k, 0) + v
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_any_hints_never_raise_and_keep_the_invariants(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _setup(case, "hit-aware", monkeypatch)
    outs: list[dict[str, Any]] = []

    @FUZZ
    @given(hints=_hints_lists())
    def run(hints: list[tuple[Any, Any]]) -> None:
        out = _run(setup, hints)
        c = out["counters"]
        # A request aborted before its first lookup never shows its hints to the manager.
        assert c["received"] <= out["hinted"] and c["applied"] <= c["received"]
        # The manager catches whatever the core raises as "malformed": none may be.
        assert "refused.malformed" not in c, c
        outs.append(out)

    run()
    total = _totals(outs)
    print(f"{case}: {total}")
    # The examples exercised the hints: taken, leases and retains applied and run out, refusals.
    assert total["applied"] > 0 and total["refused"] > 0, total
    if case == "qwen3next":
        assert total["checkpoints_applied"] > 0, total


@pytest.mark.parametrize("case", list(CASES))
def test_bad_hints_change_nothing(
    case: str, monkeypatch: pytest.MonkeyPatch, baselines: dict[tuple[str, str, str], dict[str, Any]]
) -> None:
    ref = _baseline(case, "hit-aware", baselines)
    setup = _setup(case, "hit-aware", monkeypatch)
    outs: list[dict[str, Any]] = []

    @FUZZ
    @given(hints=_hints_lists(bad=True))
    def run(hints: list[tuple[Any, Any]]) -> None:
        out = _run(setup, hints, only_bad=True)
        _same_run(ref, out)
        assert out["counters"]["requests"] == 0  # nothing reached the core
        outs.append(out)

    run()
    total = _totals(outs)
    print(f"{case}: {total}")
    assert total["hinted"] >= NUM_REQUESTS and total["refused"] > 0, total  # the examples did carry hints


@pytest.mark.parametrize("case", list(CASES))
def test_pins_over_the_cap_change_nothing(
    case: str, monkeypatch: pytest.MonkeyPatch, baselines: dict[tuple[str, str, str], dict[str, Any]]
) -> None:
    """With no pinned share (``HYBRID_ALLOC_PIN_SHARE=0``) every pin lease is over the cap:
    refused and counted, and the run is the run without hints."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    ref = _baseline(case, "hit-aware", baselines, pin_share="0")
    setup = _setup(case, "hit-aware", monkeypatch, pin_share="0")
    outs: list[dict[str, Any]] = []
    pin = good_payloads["kv.pin"].map(
        lambda p: KvHintAction(action_id="1", action_type="kv.pin", action_version="1", payload=p)
    )
    envelope = st.builds(lambda a: KvHintsEnvelope(protocol_version="0.1", message_id="m", actions=[a]), pin)
    pins = st.lists(
        one(st.tuples(envelope, st.none()), st.just((None, None))), min_size=NUM_REQUESTS, max_size=NUM_REQUESTS
    )

    @FUZZ
    @given(hints=pins)
    def run(hints: list[tuple[Any, Any]]) -> None:
        out = _run(setup, hints)
        _same_run(ref, out)
        c = out["counters"]
        # (A lease on a prompt shorter than a hash block holds no key, and is taken.)
        assert c.get("refused.pin_over_cap", 0) == c["leases_refused_over_cap"], c
        outs.append(out)

    run()
    total = _totals(outs)
    print(f"{case}: {total}")
    assert total["leases_refused_over_cap"] > 0, total


@pytest.mark.parametrize("case", list(CASES))
def test_exact_ignores_every_hint(
    case: str, monkeypatch: pytest.MonkeyPatch, baselines: dict[tuple[str, str, str], dict[str, Any]]
) -> None:
    ref = _baseline(case, "exact", baselines)
    setup = _setup(case, "exact", monkeypatch)
    outs: list[dict[str, Any]] = []

    @FUZZ
    @given(hints=_hints_lists())
    def run(hints: list[tuple[Any, Any]]) -> None:
        out = _run(setup, hints)
        _same_run(ref, out)
        c = out["counters"]
        assert c["applied"] == 0 and c["ignored"] == c["received"] and c["requests"] == 0, c
        outs.append(out)

    run()
    assert _totals(outs)["ignored"] > 0
