"""KV hints (issue 38) through vLLM's real Scheduler (offline, fabricated outputs), with the
manager the plugin installs: a retain keeps a paused session's prefix through churn that
evicts it without one; a pin lease ends at its TTL on the manager's clock (injected); a
checkpoint at a system prompt's end makes its 2nd sighting hit all of it on a GDN hybrid
(with ``--prefix-match-unit`` and without); a pin over the pinned share is refused, counted,
and changes no step; under exact hints are counted as ignored and change no step; a hint the
core refuses or raises on never reaches vLLM as an exception."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _sched(monkeypatch: pytest.MonkeyPatch, policy: str | None, shape: Any = None, **setup: Any) -> Any:
    from hybrid_alloc.bench.hits_workloads import shapes
    from hybrid_alloc.bench.offline import SchedulerSetup

    if policy is None:
        monkeypatch.delenv("HYBRID_ALLOC_POLICY", raising=False)
    else:
        monkeypatch.setenv("HYBRID_ALLOC_POLICY", policy)
    setup.setdefault("max_num_seqs", 8)
    return SchedulerSetup(shape or shapes()["gptoss"], manager="hybrid_alloc", **setup).build()


def _req(sched: Any, rid: str, prompt: list[int], max_tokens: int = 8, **xargs: Any) -> Any:
    """A request carrying ``xargs`` as ``SamplingParams.extra_args`` (the OpenAI server's
    ``vllm_xargs``)."""
    from hybrid_alloc.bench.offline import make_request

    r = make_request(sched, rid, prompt, max_tokens)
    if xargs:
        r.sampling_params.extra_args = dict(xargs)
    return r


def _drive(sched: Any, reqs: list[Any], trace: list[Any] | None = None) -> None:
    """Runs ``reqs`` to the end, our manager's invariants checked after every step; ``trace``
    gets each step's scheduled (request, tokens)."""
    from sched_driver import drive_to_end

    drive_to_end(sched, reqs, trace, check_invariants=True)


def _spy_hits(mgr: Any) -> dict[str, int]:
    """Each request's hit at its first lookup, by request id."""
    hits: dict[str, int] = {}
    lookup = mgr.get_computed_blocks

    def spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        res = lookup(request, *args, **kwargs)
        hits.setdefault(request.request_id, res[1])
        return res

    mgr.get_computed_blocks = spy
    return hits


def _clock(mgr: Any) -> list[float]:
    """Replaces the manager's clock by a settable one (seconds); returns its cell."""
    now = [1000.0]
    mgr._clock = lambda: now[0]
    return now


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def _paused_session_hit(monkeypatch: pytest.MonkeyPatch, **hints: Any) -> tuple[int, int, dict[str, int]]:
    """A session's turn 1 (512 tokens, with ``hints``), 40 unrelated requests of churn (4 in
    flight, a pool of 600 blocks: the churn caches over 1,300 blocks), then
    its turn 2 re-sending turn 1's whole sequence and 64 more tokens. Returns (turn 2's hit,
    turn 1's sequence length, the hint counters)."""
    sched = _sched(monkeypatch, "hit-aware", num_blocks=600, max_num_seqs=4)
    mgr = sched.kv_cache_manager
    _clock(mgr)
    hits = _spy_hits(mgr)
    turn1 = _req(sched, "s-1", _tokens(1, 512), 16, **hints)
    _drive(sched, [turn1])
    _drive(sched, [_req(sched, f"churn-{i}", _tokens(100 + i, 512), 16) for i in range(40)])
    seq = list(turn1.all_token_ids)
    _drive(sched, [_req(sched, "s-2", seq + _tokens(2, 64), 16)])
    return hits["s-2"], len(seq), mgr.hint_stats()


def test_retain_keeps_a_paused_sessions_prefix_through_churn(monkeypatch: pytest.MonkeyPatch) -> None:
    kept, seq, stats = _paused_session_hit(monkeypatch, kv_retain="high", kv_retain_ttl=600, kv_session="s")
    lost, _, plain = _paused_session_hit(monkeypatch)
    assert stats["applied"] == 1 and stats["retains_applied"] == 1 and stats["refused"] == 0, stats
    assert lost < 256, f"the churn does not evict the paused session (hit {lost}): the test proves nothing"
    assert kept >= seq // 16 * 16 - 16, f"turn 2 hit {kept} of its previous {seq} tokens"
    assert plain["received"] == 0 and plain["retains_applied"] == 0


def test_pin_lease_ends_at_its_ttl_on_the_managers_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = _sched(monkeypatch, "hit-aware", num_blocks=400)
    mgr = sched.kv_cache_manager
    now = _clock(mgr)
    _drive(sched, [_req(sched, "p", _tokens(3, 320), 4, kv_pin_ttl=10)])
    st = mgr.hint_stats()
    # 20 full-attention blocks and the window's 8 (window 128 at block 16).
    assert st["leases_applied"] == 1 and st["leased_keys"] == 28 and st["leased_free_blocks"] == 28, st
    now[0] += 9.99
    sched.schedule()  # a step: the clock is read once
    assert mgr.hint_stats()["leased_keys"] == 28
    now[0] += 0.01
    sched.schedule()
    st = mgr.hint_stats()
    assert st["leases_expired"] == 1 and st["expired"] == 1, st
    assert st["leased_keys"] == 0 and st["leased_free_blocks"] == 0, st


def test_the_hints_line_comes_at_vllms_stats_interval_when_a_figure_changed(
    monkeypatch: pytest.MonkeyPatch, plugin_lines: list[str]
) -> None:
    """The plugin's KV hints line (with vLLM's stats on, at ``VLLM_LOG_STATS_INTERVAL``, read
    from the step's clock): the first step after a request brought hints, then at most once an
    interval and only when a figure changed; with vLLM's stats off, none."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "10")
    sched = _sched(monkeypatch, "hit-aware", num_blocks=400)
    mgr = sched.kv_cache_manager
    now = _clock(mgr)

    def lines() -> list[str]:
        return [s for s in plugin_lines if s.startswith("hybrid_alloc: KV hints: ")]

    _drive(sched, [_req(sched, "p", _tokens(3, 320), 4, kv_pin_ttl=60)])
    assert lines() == [
        "hybrid_alloc: KV hints: 1 received, 1 applied, 0 refused, 0 expired, 0 ignored; "
        "held by pins: 0 free blocks (28 keys leased), by retains: 0 blocks, 0 states"
    ], plugin_lines
    now[0] += 9.99
    sched.schedule()  # within the interval: nothing, though the pinned blocks are free now
    assert len(lines()) == 1
    now[0] += 0.01
    sched.schedule()
    assert lines()[-1].endswith("held by pins: 28 free blocks (28 keys leased), by retains: 0 blocks, 0 states")
    now[0] += 10
    sched.schedule()  # an interval on, nothing changed: nothing
    assert len(lines()) == 2
    now[0] += 40  # past the lease's 60 s
    sched.schedule()
    assert lines()[-1] == (
        "hybrid_alloc: KV hints: 1 received, 1 applied, 0 refused, 1 expired, 0 ignored; "
        "held by pins: 0 free blocks (0 keys leased), by retains: 0 blocks, 0 states"
    )
    sched.log_stats = mgr.log_stats = False  # as vLLM built with --disable-log-stats
    _drive(sched, [_req(sched, "q", _tokens(4, 100), 4, kv_pin_ttl=-1)])
    now[0] += 100
    sched.schedule()
    assert len(lines()) == 3 and mgr.hint_stats()["received"] == 2


def _sysprompt_hits(monkeypatch: pytest.MonkeyPatch, system: int, checkpoint: bool, **setup: Any) -> list[int]:
    """Two requests sharing a ``system``-token prompt on a GDN + full attention hybrid (the
    1st with a checkpoint at its end when asked), each with its own 200 tokens after it:
    their hits."""
    from test_policy_vllm import _tiny_qwen35

    sched = _sched(monkeypatch, "hit-aware", shape=_tiny_qwen35(4096), num_blocks=300, **setup)
    mgr = sched.kv_cache_manager
    hits = _spy_hits(mgr)
    head = _tokens(5, system)
    xargs = {"kv_checkpoint": system} if checkpoint else {}
    _drive(sched, [_req(sched, "a", head + _tokens(6, 200), 4, **xargs)])
    _drive(sched, [_req(sched, "b", head + _tokens(7, 200), 4)])
    if checkpoint:
        st = mgr.hint_stats()
        assert st["checkpoints_applied"] == 1 and st["checkpoint_states"] == 1, st
    return [hits["a"], hits["b"]]


@pytest.mark.parametrize(
    ("setup", "system", "whole"),
    [({"block_size": 64}, 200, 192), ({"block_size": 64, "prefix_match_unit": 16}, 100, 96)],
)
def test_checkpoint_at_a_system_prompts_end_is_hit_whole_on_its_second_sighting_gdn(
    monkeypatch: pytest.MonkeyPatch, setup: dict[str, int], system: int, whole: int
) -> None:
    """The system prompt ends off the grid: the checkpoint is rounded down to the block
    (without ``--prefix-match-unit``) or to the unit (with it)."""
    with_cp = _sysprompt_hits(monkeypatch, system, True, **setup)
    without = _sysprompt_hits(monkeypatch, system, False, **setup)
    assert with_cp == [0, whole], with_cp
    assert without[1] < whole, f"without the checkpoint the 2nd sighting hits {without[1]} already"


def _pin_run(monkeypatch: pytest.MonkeyPatch, hinted: bool, policy: str | None = "hit-aware") -> tuple[list[Any], Any]:
    """Twelve requests, the first of them pinning its 512-token prompt when ``hinted``, with a
    pinned share of 1% (3 blocks): the steps and the manager."""
    monkeypatch.setenv("HYBRID_ALLOC_PIN_SHARE", "0.01")
    sched = _sched(monkeypatch, policy, num_blocks=400, max_num_seqs=4)
    mgr = sched.kv_cache_manager
    _clock(mgr)
    xargs = {"kv_pin_ttl": 60, "kv_session": "x", "kv_retain": "low", "kv_retain_ttl": 5} if hinted else {}
    reqs = [_req(sched, "r0", _tokens(9, 512), 8, **xargs)]
    reqs += [_req(sched, f"r{i}", _tokens(9, 256) + _tokens(10 + i, 256), 8) for i in range(1, 12)]
    trace: list[Any] = []
    _drive(sched, reqs, trace)
    return trace, mgr


def test_pin_over_the_pinned_share_is_refused_counted_and_delays_no_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    hinted, mgr = _pin_run(monkeypatch, True)
    plain, _ = _pin_run(monkeypatch, False)
    st = mgr.hint_stats()
    assert st["refused.pin_over_cap"] == 1 and st["leases_refused_over_cap"] == 1 and st["leases_applied"] == 0, st
    assert hinted == plain, "a refused pin changed the schedule"


def test_exact_counts_hints_as_ignored_and_makes_vllms_steps(
    monkeypatch: pytest.MonkeyPatch, plugin_lines: list[str]
) -> None:
    hinted, mgr = _pin_run(monkeypatch, True, policy=None)
    plain, _ = _pin_run(monkeypatch, False, policy=None)
    assert mgr._alloc.policy == "exact"
    st = mgr.hint_stats()
    assert st["received"] == 1 and st["ignored"] == 1 and st["applied"] == 0, st
    assert all(v == 0 for k, v in st.items() if k not in ("received", "ignored")), st
    assert hinted == plain
    assert sum("KV hints ignored" in s for s in plugin_lines) == 1, plugin_lines


def test_a_hint_error_never_raises_into_vllm(monkeypatch: pytest.MonkeyPatch, plugin_lines: list[str]) -> None:
    sched = _sched(monkeypatch, "hit-aware", num_blocks=400)
    mgr = sched.kv_cache_manager
    fail: Callable[..., Any]

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planted")

    core = mgr._alloc

    class Failing:
        def __getattr__(self, name: str) -> Any:
            return fail if name in ("set_hints", "advance_clock") else getattr(core, name)

    mgr._alloc = Failing()
    reqs = [_req(sched, f"e{i}", _tokens(20 + i, 100), 4, kv_pin_ttl=5, kv_checkpoint=[50, 60]) for i in range(3)]
    reqs.append(_req(sched, "bad", _tokens(30, 100), 4, kv_pin_ttl=-1, kv_retain="urgent", kv_retain_ttl=1))
    _drive(sched, reqs)
    mgr._alloc = core
    st = mgr.hint_stats()
    assert st["received"] == 4 and st["applied"] == 0 and st["refused.malformed"] >= 3, st
    assert st["refused.bad_ttl"] >= 1 and st["refused.bad_priority"] == 1, st
    assert sum("malformed" in s for s in plugin_lines) == 1, plugin_lines


def test_a_preempted_request_takes_its_hints_again_without_a_second_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request vLLM preempts is freed unfinished: its retain and release are not applied
    then, and its next lookup takes its hints again with no second lease."""
    sched = _sched(monkeypatch, "hit-aware", num_blocks=400)
    mgr = sched.kv_cache_manager
    _clock(mgr)
    r = _req(sched, "p", _tokens(40, 300), 64, kv_pin_ttl=60, kv_retain="high", kv_retain_ttl=60, kv_session="s")
    sched.add_request(r)
    from vllm.v1.request import RequestStatus

    from hybrid_alloc.bench.offline import fabricate_output

    so = sched.schedule()
    sched.update_from_output(so, fabricate_output(sched, so))
    assert r.status == RequestStatus.RUNNING
    sched.running.remove(r)
    sched._preempt_request(r, 0.0)  # back to the waiting queue, freed unfinished
    st = mgr.hint_stats()
    assert st["retains_applied"] == 0 and st["leases_applied"] == 1, st
    _drive(sched, [])
    st = mgr.hint_stats()
    assert st["leases_applied"] == 1 and st["retains_applied"] == 1 and st["applied"] == 1, st
    mgr.check_invariants()


def test_session_ids_keep_no_table_of_names() -> None:
    """A session name maps to the core's int by its hash: the same name to the same id (so a
    release finds the holds of a session seen long before), distinct names to distinct ids,
    never 0 (no session) and within the core's range. (An interned table of names grew with
    every session a long-running server saw that was never released.)"""
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    sid = HybridKVCacheManager._session_id
    names = [f"chat-{i}" for i in range(100_000)]
    ids = [sid(n) for n in names]
    assert sid(None) == 0
    assert all(0 < i < 2**63 for i in ids)
    assert len(set(ids)) == len(names)
    assert [sid(n) for n in names[:100]] == ids[:100]
