"""KV hints (issue 38), read by :func:`hybrid_alloc.vllm.hints.hints_of`: every action of the
vocabulary, from the envelope and from ``extra_args``; every kind of bad hint refused with its
counter key (and the rest of the request's hints kept); :class:`HintCounters` logs one line per
kind; and a hypothesis fuzz of random envelopes, payloads and ``extra_args`` (look-alikes, and
vLLM's own msgspec structs where vLLM is installed) that ``hints_of`` never raises and returns
None or a :class:`Hints` that keeps its invariants. No vLLM needed, except for the structs."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hint_cases import (
    Action,
    Envelope,
    Req,
    SamplingParams,
    assert_valid,
    env,
    envelopes,
    extra_args,
    good_actions,
    good_xargs,
    req,
)
from hybrid_alloc.vllm.hints import (
    ACTIONS,
    MAX_ACTIONS,
    MAX_POSITIONS,
    MAX_TTL_S,
    NOT_SERVED_OVER_PAGES,
    PIN_OVER_CAP,
    REFUSED_KINDS,
    XARG_KEYS,
    HintCounters,
    Hints,
    hints_of,
)

# ---- no hints -----------------------------------------------------------------------------


@pytest.mark.parametrize("xargs", [None, {}, {"other": 1, "kv_transfer_params": {"x": 1}}, [1], "kv_pin_ttl"])
def test_no_hint_of_ours_is_none(xargs: Any) -> None:
    assert hints_of(req(None, xargs)) is None


def test_a_request_without_the_attributes_is_none() -> None:
    assert hints_of(object()) is None
    assert hints_of(Req(None, None)) is None  # a pooling request: sampling_params None


def test_only_foreign_actions_is_none() -> None:
    assert hints_of(req(env(("kv.fetch", {"keys": [1]})))) is None
    assert hints_of(req(env())) is None


# ---- every action, from the envelope ------------------------------------------------------


@pytest.mark.parametrize("priority", ["high", "normal", "low"])
def test_retain(priority: Any) -> None:
    h = hints_of(req(env(("kv.retain", {"priority": priority, "ttl_s": 30}))))
    assert h == Hints(retain=priority, retain_ttl_s=30.0)
    assert type(h.retain_ttl_s) is float


def test_retain_tokens_may_pass_the_prompt() -> None:
    # A retain covers what the request cached, its output included.
    h = hints_of(req(env(("kv.retain", {"priority": "low", "ttl_s": 0.5, "tokens": 150})), prompt=100))
    assert h == Hints(retain="low", retain_ttl_s=0.5, retain_tokens=150)


def test_pin_whole_prompt_and_first_tokens() -> None:
    assert hints_of(req(env(("kv.pin", {"ttl_s": 600})))) == Hints(pin_ttl_s=600.0)
    assert hints_of(req(env(("kv.pin", {"ttl_s": 600, "tokens": 64})))) == Hints(pin_ttl_s=600.0, pin_tokens=64)
    assert hints_of(req(env(("kv.pin", {"ttl_s": 600, "tokens": 100})), prompt=100)) == Hints(
        pin_ttl_s=600.0, pin_tokens=100
    )


def test_release_own_session_and_named_session() -> None:
    own = env(("kv.retain", {"priority": "high", "ttl_s": 60, "session": "chat-7"}), ("kv.release", {}))
    assert hints_of(req(own)) == Hints(retain="high", retain_ttl_s=60.0, session="chat-7", release="chat-7")
    named = env(("kv.release", {"session": "chat-3"}))
    assert hints_of(req(named)) == Hints(release="chat-3")


def test_checkpoint_positions_sorted_distinct() -> None:
    h = hints_of(req(env(("kv.checkpoint", {"positions": [64, 17, 64, 100]})), prompt=100))
    assert h == Hints(checkpoints=(17, 64, 100))


@pytest.mark.parametrize("version", ["1", "1.0"])
def test_both_versions(version: str) -> None:
    h = hints_of(req(env(Action("kv.pin", {"ttl_s": 5}, action_version=version))))
    assert h == Hints(pin_ttl_s=5.0)


def test_all_actions_together_and_session_in_any_payload() -> None:
    e = env(
        ("kv.fetch", {"anything": 1}),
        ("kv.checkpoint", {"positions": [40], "session": "s"}),
        ("kv.pin", {"ttl_s": 10, "tokens": 32}),
        ("kv.retain", {"priority": "normal", "ttl_s": 120.5, "tokens": 80}),
        ("kv.release", {}),
    )
    assert hints_of(req(e)) == Hints(
        retain="normal",
        retain_ttl_s=120.5,
        retain_tokens=80,
        pin_ttl_s=10.0,
        pin_tokens=32,
        session="s",
        release="s",
        checkpoints=(40,),
    )


# ---- every action, from extra_args (the OpenAI server's vllm_xargs) -------------------------


def test_xargs_all_keys() -> None:
    xargs = {
        "kv_retain": "high",
        "kv_retain_ttl": 90,
        "kv_retain_tokens": 120,
        "kv_pin_ttl": 30.5,
        "kv_pin_tokens": 48,
        "kv_session": "agent-1",
        "kv_release": True,
        "kv_checkpoint": [50, 20],
        "kv_transfer_params": "not ours",
    }
    assert set(xargs) - {"kv_transfer_params"} == XARG_KEYS
    assert hints_of(req(None, xargs)) == Hints(
        retain="high",
        retain_ttl_s=90.0,
        retain_tokens=120,
        pin_ttl_s=30.5,
        pin_tokens=48,
        session="agent-1",
        release="agent-1",
        checkpoints=(20, 50),
    )


@pytest.mark.parametrize("value", [37, [37], [37, 37]])
def test_xargs_checkpoint_int_or_list(value: Any) -> None:
    assert hints_of(req(None, {"kv_checkpoint": value})) == Hints(checkpoints=(37,))


@pytest.mark.parametrize(
    ("value", "release", "errors"),
    [
        (True, "s", ()),
        (1, "s", ()),  # the server's pydantic turns a JSON true into 1
        ("other", "other", ()),
        (False, None, ()),
        (0, None, ()),
        (2, None, ("wrong_type",)),
        (1.0, None, ("wrong_type",)),
        ("", None, ("wrong_type",)),
        ([1], None, ("wrong_type",)),
    ],
)
def test_xargs_release_bool_or_str(value: Any, release: str | None, errors: tuple[str, ...]) -> None:
    h = hints_of(req(None, {"kv_session": "s", "kv_release": value}))
    assert h == Hints(session="s", release=release, errors=errors)


def test_vllms_session_id_is_the_default_session() -> None:
    # vLLM's own session (add_request(session_id=), the OpenAI server's session_id) when no hint names one.
    assert hints_of(req(None, {"kv_release": True}, session_id="v")) == Hints(session="v", release="v")
    assert hints_of(req(None, {"kv_session": "k", "kv_release": 1}, session_id="v")) == Hints(session="k", release="k")
    # A session alone asks for nothing: vLLM's is not taken for a request without a hint.
    assert hints_of(req(None, {"other": 1}, session_id="v")) is None
    assert hints_of(req(env(("kv.fetch", {})), session_id="v")) is None
    assert hints_of(req(None, {"kv_release": True}, session_id="")) == Hints(errors=("missing_field",))


def test_xargs_release_own_without_session_is_refused() -> None:
    assert hints_of(req(None, {"kv_release": True})) == Hints(errors=("missing_field",))


def test_envelope_and_xargs_together() -> None:
    h = hints_of(req(env(("kv.pin", {"ttl_s": 5})), {"kv_retain": "low", "kv_retain_ttl": 7, "kv_pin_ttl": 9}))
    assert h == Hints(retain="low", retain_ttl_s=7.0, pin_ttl_s=5.0, errors=("duplicate_action",))


def test_envelope_struct_hint_type_not_needed() -> None:
    # A tuple of actions reads as well as a list (msgspec may decode either).
    assert hints_of(req(Envelope((Action("kv.pin", {"ttl_s": 5}),)))) == Hints(pin_ttl_s=5.0)


# ---- every bad kind ---------------------------------------------------------------------

BAD: list[tuple[str, Any, Any, Hints]] = [
    ("not_envelope", {"actions": []}, None, Hints(errors=("not_envelope",))),
    ("not_envelope", Envelope("kv.pin"), None, Hints(errors=("not_envelope",))),
    (
        "too_many_actions",
        env(*[("kv.pin", {"ttl_s": 5})] * (MAX_ACTIONS + 1)),
        None,
        Hints(errors=("too_many_actions",)),
    ),
    ("not_action", Envelope([{"action_type": "kv.pin"}]), None, Hints(errors=("not_action",))),
    ("not_action", env(Action(7, {"ttl_s": 5})), None, Hints(errors=("not_action",))),
    ("unknown_action", env(("kv.demote", {})), None, Hints(errors=("unknown_action",))),
    (
        "unknown_version",
        env(Action("kv.pin", {"ttl_s": 5}, action_version="2")),
        None,
        Hints(errors=("unknown_version",)),
    ),
    ("not_action", env(Action("kv.pin", {"ttl_s": 5}, action_version=1)), None, Hints(errors=("not_action",))),
    ("payload_not_dict", env(("kv.pin", [5])), None, Hints(errors=("payload_not_dict",))),
    ("missing_field", env(("kv.retain", {"ttl_s": 5})), None, Hints(errors=("missing_field",))),
    ("missing_field", env(("kv.retain", {"priority": "low"})), None, Hints(errors=("missing_field",))),
    ("missing_field", env(("kv.pin", {})), None, Hints(errors=("missing_field",))),
    ("missing_field", env(("kv.checkpoint", {})), None, Hints(errors=("missing_field",))),
    ("missing_field", env(("kv.checkpoint", {"positions": []})), None, Hints(errors=("missing_field",))),
    ("missing_field", env(("kv.release", {})), None, Hints(errors=("missing_field",))),
    ("missing_field", None, {"kv_retain_ttl": 5}, Hints(errors=("missing_field",))),
    ("missing_field", None, {"kv_pin_tokens": 5}, Hints(errors=("missing_field",))),
    ("wrong_type", env(("kv.retain", {"priority": 1, "ttl_s": 5})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.pin", {"ttl_s": "60"})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.pin", {"ttl_s": True})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.pin", {"ttl_s": 5, "tokens": 4.0})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.pin", {"ttl_s": 5, "tokens": True})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.pin", {"ttl_s": 5, "session": 3})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.release", {"session": ""})), None, Hints(errors=("wrong_type",))),
    ("wrong_type", env(("kv.checkpoint", {"positions": 40})), None, Hints(errors=("wrong_type",))),
    (
        "wrong_type",
        env(("kv.checkpoint", {"positions": [40, "50", 60.0]})),
        None,
        Hints(checkpoints=(40,), errors=("wrong_type", "wrong_type")),
    ),
    ("wrong_type", None, {"kv_session": ["s"], "kv_pin_ttl": 5}, Hints(errors=("wrong_type",))),
    ("bad_priority", env(("kv.retain", {"priority": "urgent", "ttl_s": 5})), None, Hints(errors=("bad_priority",))),
    ("bad_priority", None, {"kv_retain": "HIGH", "kv_retain_ttl": 5}, Hints(errors=("bad_priority",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": -1})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": 0})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": math.nan})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": math.inf})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": 604800.5})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", env(("kv.pin", {"ttl_s": 10**400})), None, Hints(errors=("bad_ttl",))),
    ("bad_ttl", None, {"kv_retain": "low", "kv_retain_ttl": -3.5}, Hints(errors=("bad_ttl",))),
    ("bad_tokens", env(("kv.pin", {"ttl_s": 5, "tokens": 0})), None, Hints(errors=("bad_tokens",))),
    ("bad_tokens", env(("kv.pin", {"ttl_s": 5, "tokens": 101})), None, Hints(errors=("bad_tokens",))),
    (
        "bad_tokens",
        env(("kv.retain", {"priority": "low", "ttl_s": 5, "tokens": 2**40})),
        None,
        Hints(errors=("bad_tokens",)),
    ),
    ("bad_tokens", None, {"kv_pin_ttl": 5, "kv_pin_tokens": -4}, Hints(errors=("bad_tokens",))),
    ("bad_position", env(("kv.checkpoint", {"positions": [0]})), None, Hints(errors=("bad_position",))),
    (
        "bad_position",
        env(("kv.checkpoint", {"positions": [-5, 50, 101]})),
        None,
        Hints(checkpoints=(50,), errors=("bad_position", "bad_position")),
    ),
    ("bad_position", None, {"kv_checkpoint": 10**30}, Hints(errors=("bad_position",))),
    (
        "too_many_positions",
        env(("kv.checkpoint", {"positions": list(range(1, MAX_POSITIONS + 2))})),
        None,
        Hints(errors=("too_many_positions",)),
    ),
    (
        "too_many_positions",
        env(("kv.checkpoint", {"positions": list(range(1, 41))})),
        {"kv_checkpoint": list(range(41, 66))},
        Hints(checkpoints=tuple(range(1, 41)), errors=("too_many_positions",)),
    ),
    (
        "duplicate_action",
        env(("kv.pin", {"ttl_s": 5}), ("kv.pin", {"ttl_s": 50})),
        None,
        Hints(pin_ttl_s=5.0, errors=("duplicate_action",)),
    ),
    (
        "duplicate_action",
        env(("kv.release", {"session": "a"})),
        {"kv_release": "b"},
        Hints(release="a", errors=("duplicate_action",)),
    ),
    (
        "session_conflict",
        env(("kv.pin", {"ttl_s": 5, "session": "a"})),
        {"kv_session": "b", "kv_retain": "low", "kv_retain_ttl": 5},
        Hints(pin_ttl_s=5.0, session="a", errors=("session_conflict",)),
    ),
]


@pytest.mark.parametrize(("kind", "envelope", "xargs", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_hint_refused_with_its_kind(kind: str, envelope: Any, xargs: Any, expected: Hints) -> None:
    h = hints_of(req(envelope, xargs, prompt=100))
    assert h == expected
    assert kind in h.errors
    assert_valid(h, 100)


def test_every_parse_kind_is_tested() -> None:
    # ``malformed`` is tested below; ``pin_over_cap`` is the manager's (the core's refusal), as
    # is ``not_served_over_pages`` (a pin or retain over two-level pages).
    assert {b[0] for b in BAD} | {"malformed", PIN_OVER_CAP, NOT_SERVED_OVER_PAGES} == set(REFUSED_KINDS)


def test_a_bad_field_drops_only_its_action() -> None:
    e = env(("kv.pin", {"ttl_s": -1}), ("kv.retain", {"priority": "low", "ttl_s": 9}), ("kv.nope", {}))
    assert hints_of(req(e)) == Hints(retain="low", retain_ttl_s=9.0, errors=("bad_ttl", "unknown_action"))


class _Raises:
    @property
    def actions(self) -> Any:
        raise RuntimeError("boom")


class _BadDict(dict[str, Any]):
    def get(self, *a: Any) -> Any:
        raise KeyError("boom")


@pytest.mark.parametrize(
    "request_",
    [req(_Raises()), req(env(("kv.pin", _BadDict(ttl_s=5))))],
    ids=["envelope", "payload"],
)
def test_malformed_objects_are_refused_not_raised(request_: Any) -> None:
    assert hints_of(request_) == Hints(errors=("malformed",))


def test_unknown_prompt_length_skips_the_upper_bounds() -> None:
    h = hints_of(
        req(env(("kv.checkpoint", {"positions": [500]}), ("kv.pin", {"ttl_s": 1, "tokens": 500})), prompt=None)
    )
    assert h == Hints(pin_ttl_s=1.0, pin_tokens=500, checkpoints=(500,))


# ---- the counters ---------------------------------------------------------------------------


def test_counters_log_one_line_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    c = HintCounters(logging.getLogger("test.hints"))
    with caplog.at_level(logging.WARNING, logger="test.hints"):
        c.receive(Hints(errors=("bad_ttl", "bad_ttl", "not_envelope")), "r1")
        c.receive(Hints(pin_ttl_s=1.0), "r2")
        c.receive(Hints(errors=("bad_ttl",)), "r3")
        c.refuse(PIN_OVER_CAP, "r4")
        c.refuse(PIN_OVER_CAP, "r5")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "request r1" in lines[0] and "(bad_ttl)" in lines[0]
    assert "(not_envelope)" in lines[1] and "(pin_over_cap)" in lines[2] and "r4" in lines[2]
    c.applied += 1
    c.expired += 2
    c.ignored += 3
    assert c.as_dict() == {
        "received": 3,
        "applied": 1,
        "refused": 6,
        "expired": 2,
        "ignored": 3,
        "refused.bad_ttl": 3,
        "refused.not_envelope": 1,
        "refused.pin_over_cap": 2,
    }


def test_counters_default_to_vllms_logger() -> None:
    assert HintCounters()._logger.name == "vllm.hybrid_alloc"


# ---- the fuzz --------------------------------------------------------------------------------


def _structs() -> tuple[Any, Any] | None:
    """vLLM's own ``KvHintAction`` / ``KvHintsEnvelope`` (msgspec structs, which check no types
    at construction), or None without vLLM."""
    try:
        from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
    except ImportError:
        return None
    return KvHintAction, KvHintsEnvelope


STRUCTS = _structs()
MAKERS = [(Action, Envelope)] + ([STRUCTS] if STRUCTS is not None else [])


@pytest.mark.parametrize("makers", MAKERS, ids=["look-alike", "vllm"][: len(MAKERS)])
def test_fuzz_hints_of_never_raises_and_returns_valid_hints(makers: tuple[Any, Any]) -> None:
    @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        envelope=envelopes(*makers),
        xargs=extra_args,
        prompt=st.one_of(st.integers(1, 130), st.none(), st.just("x")),
        plain=st.booleans(),
        session_id=st.sampled_from([None, "", "v", 3]),
    )
    def run(envelope: Any, xargs: Any, prompt: Any, plain: bool, session_id: Any) -> None:
        request = Req(envelope, SamplingParams(xargs) if plain else None, prompt, session_id)
        h = hints_of(request)
        assert_valid(h, prompt if type(prompt) is int else None)
        assert h is None or "malformed" not in h.errors  # every malformed input is told apart, not caught

    run()


@pytest.mark.parametrize("makers", MAKERS, ids=["look-alike", "vllm"][: len(MAKERS)])
def test_fast_path_reads_as_the_full_reader(makers: tuple[Any, Any]) -> None:
    # ``read_hints`` reads good hints on a fast path; whatever it answers, the full reader alone
    # (the fast path turned off) answers the same, on random hints good and bad.
    from hybrid_alloc.vllm import hints as mod

    make_action, make_env = makers
    good_envelopes = st.builds(
        lambda a: make_env(protocol_version="0.1", message_id="m", actions=a),
        st.lists(good_actions(make_action), max_size=5),
    )
    fast = mod._fast
    answered = [0]

    def counted(request: Any, env: Any, xargs: Any) -> Any:
        out = fast(request, env, xargs)
        answered[0] += 1
        return out

    def slow(request: Any, env: Any, xargs: Any) -> Any:
        raise mod._Slow

    @settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        envelope=st.one_of(envelopes(*makers), good_envelopes, st.none()),
        xargs=st.one_of(extra_args, good_xargs),
        prompt=st.one_of(st.integers(0, 3000), st.none()),
        session_id=st.sampled_from([None, "", "v", "s1", 3]),
    )
    def run(envelope: Any, xargs: Any, prompt: Any, session_id: Any) -> None:
        request = Req(envelope, SamplingParams(xargs), prompt, session_id)
        try:
            mod._fast = counted
            got = mod.read_hints(request)
            mod._fast = slow
            assert got == mod.read_hints(request), (envelope, xargs, prompt, session_id)
        finally:
            mod._fast = fast

    run()
    assert answered[0] >= 100, answered  # the fast path answered a good share of the examples


@pytest.mark.skipif(STRUCTS is None, reason="vLLM is not installed")
def test_vllms_envelope_reads() -> None:
    assert STRUCTS is not None
    action, envelope = STRUCTS
    e = envelope(
        protocol_version="0.1",
        message_id="m1",
        actions=[action(action_id="1", action_type="kv.checkpoint", action_version="1.0", payload={"positions": [33]})],
    )
    assert hints_of(req(e)) == Hints(checkpoints=(33,))


# ---- the docs ------------------------------------------------------------------------------------


def test_docs_name_every_action_key_and_refused_kind() -> None:
    # docs/hit-aware.md's "KV hints" section documents the vocabulary this module reads.
    text = (Path(__file__).resolve().parents[3] / "docs" / "hit-aware.md").read_text()
    section = text[text.index("## KV hints") :]
    section = section[: section.index("\n## ", 1)]
    for name in [*ACTIONS, *XARG_KEYS, *REFUSED_KINDS]:
        assert f"`{name}`" in section, name
    for limit in (MAX_ACTIONS, MAX_POSITIONS, int(MAX_TTL_S)):
        assert str(limit) in section, limit
