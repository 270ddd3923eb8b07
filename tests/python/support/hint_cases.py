"""What the KV hints tests share (``core/test_hints.py``, the scheduler fuzz, the path tests):
look-alikes of vLLM's ``KvHintsEnvelope`` / ``KvHintAction`` (plain objects with their
attributes, so the core tests need no vLLM), a request look-alike, :func:`assert_valid` (the
invariants :func:`hybrid_alloc.vllm.hints.hints_of` promises of what it returns), and hypothesis
strategies for random envelopes, payloads and ``extra_args``, good and bad mixed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from hybrid_alloc.vllm.hints import (
    ACTIONS,
    MAX_POSITIONS,
    MAX_TOKENS,
    MAX_TTL_S,
    PRIORITIES,
    REFUSED_KINDS,
    XARG_KEYS,
    Hints,
    hints_of,
)


@dataclass(frozen=True)
class Action:
    """``KvHintAction``'s attributes."""

    action_type: Any
    payload: Any
    action_version: Any = "1"
    action_id: Any = "a"


@dataclass(frozen=True)
class Envelope:
    """``KvHintsEnvelope``'s attributes."""

    actions: Any
    protocol_version: Any = "0.1"
    message_id: Any = "m"


@dataclass
class SamplingParams:
    extra_args: Any = None


@dataclass
class Req:
    """The attributes ``hints_of`` reads of a vLLM ``Request``."""

    kv_hints: Any = None
    sampling_params: Any = field(default_factory=SamplingParams)
    num_prompt_tokens: Any = 100
    session_id: Any = None


def req(env: Any = None, xargs: Any = None, prompt: Any = 100, session_id: Any = None) -> Req:
    return Req(env, SamplingParams(xargs), prompt, session_id)


def env(*actions: tuple[str, Any] | Action) -> Envelope:
    """An envelope of ``(action_type, payload)`` pairs (version "1") or ready actions."""
    return Envelope([a if isinstance(a, Action) else Action(a[0], a[1]) for a in actions])


def assert_valid(h: Hints | None, prompt_len: int | None) -> None:
    """The invariants of what ``hints_of`` returns (its module docstring)."""
    if h is None:
        return
    assert isinstance(h, Hints)
    assert all(k in REFUSED_KINDS for k in h.errors), h.errors
    assert (h.retain is None) == (h.retain_ttl_s is None), h
    if h.retain is not None:
        assert h.retain in PRIORITIES
    for ttl in (h.retain_ttl_s, h.pin_ttl_s):
        assert ttl is None or (type(ttl) is float and math.isfinite(ttl) and 0 < ttl <= MAX_TTL_S), h
    for n in (h.retain_tokens, h.pin_tokens):
        assert n is None or (type(n) is int and 1 <= n <= MAX_TOKENS), h
    if h.retain is None:
        assert h.retain_tokens is None
    if h.pin_ttl_s is None:
        assert h.pin_tokens is None
    elif h.pin_tokens is not None and prompt_len is not None:
        assert h.pin_tokens <= prompt_len
    cps = h.checkpoints
    assert type(cps) is tuple and list(cps) == sorted(set(cps)) and len(cps) <= MAX_POSITIONS, h
    assert all(type(p) is int and p >= 1 and (prompt_len is None or p <= prompt_len) for p in cps), h
    for s in (h.session, h.release):
        assert s is None or (type(s) is str and s), h
    asks = (h.retain, h.pin_ttl_s, h.session, h.release) != (None,) * 4 or cps
    assert asks or h.errors, "an empty Hints must be None"


# ---- hypothesis strategies ---------------------------------------------------------------


def one(*options: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of ``options``, each about equally likely (repeat an option to weigh it):
    ``st.one_of`` flattens nested ``one_of`` branches and does not draw its branches evenly."""
    return st.sampled_from(options).flatmap(lambda o: o)


numbers = one(
    st.integers(-5, 200),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.5, 60, 60.0, 604800, 604801, 1e308, -1.0]),
)

scalars = one(st.none(), st.booleans(), numbers, st.text(max_size=4), st.sampled_from(["s1", "s2", "high"]))
values = one(
    scalars,
    st.lists(one(st.integers(-3, 150), scalars), max_size=70),
    st.lists(st.integers(1, 120), min_size=1, max_size=5),
    st.dictionaries(st.text(max_size=3), scalars, max_size=2),
)
payload_fields = {
    "priority": one(st.sampled_from([*PRIORITIES, "urgent"]), values),
    "ttl_s": one(st.sampled_from([1, 30.5, 604800]), values),
    "tokens": one(st.integers(-2, 130), values),
    "positions": one(st.lists(st.integers(-2, 130), max_size=6), values),
    "session": one(st.sampled_from(["s1", "s2"]), values),
    "other": values,
}
# Weighted towards what reaches the deeper checks: dict payloads, our action types, good versions.
_dict_payloads = st.fixed_dictionaries({}, optional=payload_fields)
payloads = one(_dict_payloads, _dict_payloads, _dict_payloads, values)
action_types = one(
    st.sampled_from(ACTIONS), st.sampled_from(ACTIONS), st.sampled_from(["kv.fetch", "kv.nope", ""]), scalars
)
versions = one(st.sampled_from(["1", "1.0"]), st.sampled_from(["1", "1.0", "2"]), scalars)


def actions_of(make: Any = Action) -> st.SearchStrategy[Any]:
    """Random actions made by ``make(action_id=, action_type=, action_version=, payload=)``
    (the look-alike, or vLLM's own msgspec struct, which checks no types), and non-actions."""
    good = st.builds(
        lambda t, v, p: make(action_id="a", action_type=t, action_version=v, payload=p),
        action_types,
        versions,
        payloads,
    )
    return one(good, good, good, scalars)


# Well-formed hints with random values (a token count or position may still pass the prompt).
SESSIONS = ("s1", "s2", "s3")
ttls = one(st.floats(0.5, 300.0), st.integers(1, 300))
counts = st.integers(1, 2000)
_session = {"session": st.sampled_from(SESSIONS)}
good_payloads = {
    "kv.retain": st.fixed_dictionaries(
        {"priority": st.sampled_from(PRIORITIES), "ttl_s": ttls}, optional={"tokens": counts, **_session}
    ),
    "kv.pin": st.fixed_dictionaries({"ttl_s": ttls}, optional={"tokens": counts, **_session}),
    "kv.release": st.fixed_dictionaries({}, optional=_session),
    "kv.checkpoint": st.fixed_dictionaries({"positions": st.lists(counts, min_size=1, max_size=4)}, optional=_session),
}
assert set(good_payloads) == set(ACTIONS)


def good_actions(make: Any = Action) -> st.SearchStrategy[Any]:
    """Well-formed actions of this vocabulary, made by ``make`` as in :func:`actions_of`."""
    return st.sampled_from(ACTIONS).flatmap(
        lambda t: good_payloads[t].map(lambda p: make(action_id="a", action_type=t, action_version="1", payload=p))
    )


def envelopes(make_action: Any = Action, make_env: Any = Envelope) -> st.SearchStrategy[Any]:
    """Random envelopes (and non-envelopes), up to 20 actions; some well-formed."""

    def build(acts: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.builds(lambda a: make_env(protocol_version="0.1", message_id="m", actions=a), acts)

    real = build(
        one(
            *[st.lists(actions_of(make_action), max_size=6)] * 3,
            st.lists(actions_of(make_action), max_size=20),
            scalars,
        )
    )
    good = build(
        st.lists(
            one(good_actions(make_action), good_actions(make_action), actions_of(make_action)), min_size=1, max_size=4
        )
    )
    return one(st.none(), real, real, real, good, good, scalars)


xarg_values = {
    "kv_retain": one(st.sampled_from([*PRIORITIES, "urgent"]), values),
    "kv_retain_ttl": one(st.sampled_from([1, 30.5]), values),
    "kv_retain_tokens": one(st.integers(-2, 130), values),
    "kv_pin_ttl": one(st.sampled_from([1, 30.5]), values),
    "kv_pin_tokens": one(st.integers(-2, 130), values),
    "kv_session": one(st.sampled_from(["s1", "s2"]), values),
    "kv_release": one(st.sampled_from([True, 1, 0, False, "s1", "s2"]), values),
    "kv_checkpoint": one(st.integers(-2, 130), st.lists(st.integers(-2, 130), max_size=6), values),
    "other": values,
}
assert set(xarg_values) - {"other"} == XARG_KEYS
_dict_xargs = st.fixed_dictionaries({}, optional=xarg_values)
good_xargs = st.fixed_dictionaries(
    {},
    optional={
        "kv_retain": st.sampled_from(PRIORITIES),
        "kv_retain_ttl": ttls,
        "kv_retain_tokens": counts,
        "kv_pin_ttl": ttls,
        "kv_pin_tokens": counts,
        "kv_session": st.sampled_from(SESSIONS),
        "kv_release": st.sampled_from([True, 1, *SESSIONS]),
        "kv_checkpoint": one(counts, st.lists(counts, min_size=1, max_size=4)),
    },
)
extra_args = one(st.none(), _dict_xargs, _dict_xargs, good_xargs, values)


def asks_nothing(h: Hints | None) -> bool:
    """Whether ``h`` asks the manager for nothing: no hints, or only refused ones (a session alone
    included)."""
    return h is None or not (h.retain or h.pin_ttl_s or h.release or h.checkpoints)


def spoiled(env: Any, xargs: Any, make_action: Any = Action, make_env: Any = Envelope) -> tuple[Any, Any]:
    """``(env, xargs)`` made to ask for nothing, whatever the prompt's length, by breaking what
    would ask for something: every action of the envelope gets an unknown version; the retain and
    pin TTLs of ``xargs`` become -1, a release 2, a checkpoint 0 (each refused). Unchanged when
    they already ask for nothing."""
    if asks_nothing(hints_of(Req(env, SamplingParams(xargs), None))):
        return env, xargs
    actions = getattr(env, "actions", None)
    if isinstance(actions, (list, tuple)):
        env = make_env(
            protocol_version="0.1",
            message_id="m",
            actions=[
                make_action(
                    action_id="a",
                    action_type=getattr(a, "action_type", None),
                    action_version="9",
                    payload=getattr(a, "payload", None),
                )
                for a in actions
            ],
        )
    if type(xargs) is dict:
        bad = {"kv_retain_ttl": -1, "kv_pin_ttl": -1, "kv_release": 2, "kv_checkpoint": 0}
        xargs = {
            **xargs,
            **{k: v for k, v in bad.items() if k in xargs or (k == "kv_retain_ttl" and "kv_retain" in xargs)},
        }
    assert asks_nothing(hints_of(Req(env, SamplingParams(xargs), None))), (env, xargs)
    return env, xargs
