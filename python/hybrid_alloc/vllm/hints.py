"""KV hints (issue 38): what an application asks of the cache for one request, read from vLLM's
``Request.kv_hints`` envelope or from ``SamplingParams.extra_args`` (the OpenAI server's
``vllm_xargs``), checked, and turned into one frozen :class:`Hints`.

The vocabulary, version 1 (``docs/hit-aware.md``, "KV hints", documents it for users):

- envelope actions (``KvHintAction.action_type``, ``action_version`` ``"1"`` or ``"1.0"``):
  ``kv.retain`` ``{"priority": "high"|"normal"|"low", "ttl_s": number, "tokens"?: int}``,
  ``kv.pin`` ``{"ttl_s": number, "tokens"?: int}``, ``kv.release`` ``{"session"?: str}``,
  ``kv.checkpoint`` ``{"positions": [int, ...]}``; any action's payload may carry
  ``"session": str`` (the request's session; for ``kv.release``, the session released);
  without one, a request that asks for something takes vLLM's own ``Request.session_id``
  (``add_request(session_id=)``; the OpenAI server's ``session_id`` field or header);
- ``extra_args`` keys (:data:`XARG_KEYS`): ``kv_retain``, ``kv_retain_ttl``,
  ``kv_retain_tokens``, ``kv_pin_ttl``, ``kv_pin_tokens``, ``kv_session``, ``kv_release``
  (true/1: this request's session; a str: that session), ``kv_checkpoint`` (an int or a list).
  Other keys are other components' and are left alone.

What this module decides, and what it leaves to the manager: it checks every field it can
check from the request alone (types, TTL range, positions within the prompt, counts) and
refuses what fails, one counter key per kind (:data:`REFUSED_KINDS`); the manager rounds
positions to its hash blocks (a position that rounds to 0 is refused there, as
``bad_position``), refuses a pin over the pinned share (``pin_over_cap``), and counts every
hint under the exact policy as ignored. A refused field drops only its action (a bad position
only itself); the rest of the request's hints stand. Nothing here raises: a malformed object
anywhere is refused (``malformed`` at worst), never crashed on.

Invariants of a :class:`Hints` that :func:`hints_of` returns: ``retain`` is one of
:data:`PRIORITIES` exactly when ``retain_ttl_s`` is set; every TTL is a finite float in
``(0, MAX_TTL_S]``; every token count an int in ``[1, MAX_TOKENS]``; ``checkpoints`` sorted,
distinct, in ``[1, num_prompt_tokens]``, at most :data:`MAX_POSITIONS`; ``session`` and
``release`` non-empty strings or None; ``errors`` holds only keys of :data:`REFUSED_KINDS`;
and the ``Hints`` asks for something or refused something (never all empty: that is None).

Cost: without hints, :func:`read_hints` (the manager's call; :func:`hints_of` is it, as a
:class:`Hints`) reads three attributes (``kv_hints``, ``sampling_params``, ``extra_args``) and,
when ``extra_args`` is a non-empty dict, checks its keys against :data:`XARG_KEYS` (one set
operation); it is called once per request. With hints, parsing is linear in the envelope's
actions (at most :data:`MAX_ACTIONS`) and positions (at most :data:`MAX_POSITIONS` per
action). Good hints (the common case) take a fast path, one function over locals that builds
no object but the answer's tuple (2.9 us for a retain, a pin and a checkpoint in vLLM's
envelope, against 6.3 us through the full reader and a :class:`Hints`, 2026-12-06); a refusal
of any kind sends the request to the full reader, which decides alone. vLLM is not imported: the envelope is read by its
attributes (``actions``; each action's ``action_type``, ``action_version``, ``payload``), so
the module works on every release and refuses look-alikes that do not fit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ACTIONS",
    "ACTION_VERSIONS",
    "CHECKPOINT",
    "FOREIGN_ACTIONS",
    "MAX_ACTIONS",
    "MAX_POSITIONS",
    "MAX_TOKENS",
    "MAX_TTL_S",
    "NOT_SERVED_OVER_PAGES",
    "PIN",
    "PIN_OVER_CAP",
    "PRIORITIES",
    "REFUSED_KINDS",
    "RELEASE",
    "RETAIN",
    "VOCABULARY_VERSION",
    "XARG_KEYS",
    "HintCounters",
    "Hints",
    "hints_of",
    "stats_line",
]

#: The vocabulary's version (the actions' ``action_version`` may say ``"1"`` or ``"1.0"``).
VOCABULARY_VERSION = 1
ACTION_VERSIONS = frozenset({"1", "1.0"})

RETAIN = "kv.retain"
PIN = "kv.pin"
RELEASE = "kv.release"
CHECKPOINT = "kv.checkpoint"
#: The envelope's action types this vocabulary defines.
ACTIONS = (RETAIN, PIN, RELEASE, CHECKPOINT)
#: Action types other components of vLLM execute (the offload tier's ``kv.fetch``): left to
#: them, neither applied nor refused here.
FOREIGN_ACTIONS = frozenset({"kv.fetch"})

PRIORITIES = ("high", "normal", "low")
Priority = Literal["high", "normal", "low"]
_PRIORITY: dict[str, Priority] = {"high": "high", "normal": "normal", "low": "low"}

#: The longest TTL: 7 days, in seconds.
MAX_TTL_S = 604800.0
#: The most actions in one envelope, and positions in one checkpoint.
MAX_ACTIONS = 16
MAX_POSITIONS = 64
#: The largest token count a retain or pin may name (it crosses into the core as an integer).
MAX_TOKENS = 2**31 - 1

#: The ``SamplingParams.extra_args`` keys of this vocabulary (the OpenAI server's ``vllm_xargs``).
XARG_KEYS = frozenset(
    {
        "kv_retain",
        "kv_retain_ttl",
        "kv_retain_tokens",
        "kv_pin_ttl",
        "kv_pin_tokens",
        "kv_session",
        "kv_release",
        "kv_checkpoint",
    }
)

#: A pin the core refused because its blocks would take the pool past the pinned share (the
#: manager counts it; nothing in this module refuses it).
PIN_OVER_CAP = "pin_over_cap"

#: A pin or retain the manager drops over two-level pages (``HYBRID_ALLOC_PAGES=two-level``),
#: which serve hit-aware's own levels, not the user's pinned ones (the request's other hints
#: stand; nothing in this module refuses it).
NOT_SERVED_OVER_PAGES = "not_served_over_pages"

#: Every kind of refused hint: its counter key, and what it means (the log line says it).
REFUSED_KINDS: dict[str, str] = {
    "not_envelope": "kv_hints is not a KvHintsEnvelope (no list of actions)",
    "too_many_actions": f"the envelope has more than {MAX_ACTIONS} actions (all ignored)",
    "not_action": "an action is not a KvHintAction (action_type, action_version, payload)",
    "unknown_action": f"an action_type that is not one of {', '.join(ACTIONS)}",
    "unknown_version": "an action_version that is not 1 or 1.0",
    "payload_not_dict": "an action's payload is not a dict",
    "missing_field": "a field the action needs is missing (a retain without priority or TTL, a pin without TTL, "
    "a checkpoint without positions, a release without a session)",
    "wrong_type": "a field of the wrong type (a bool or str for a number, a float for an int, a non-str session)",
    "bad_priority": f"a retain priority that is not one of {', '.join(PRIORITIES)}",
    "bad_ttl": f"a TTL that is not a number of seconds in (0, {int(MAX_TTL_S)}] (negative, zero, NaN, inf, huge)",
    "bad_tokens": f"a token count below 1, over {MAX_TOKENS}, or (for a pin) beyond the prompt",
    "bad_position": "a checkpoint position <= 0 (after rounding down to the hash block) or beyond the prompt",
    "too_many_positions": f"a checkpoint with more than {MAX_POSITIONS} positions (all ignored)",
    "duplicate_action": "a second retain, pin or release for the same request (the first stands)",
    "session_conflict": "a second, different session for the same request (the first stands)",
    "malformed": "reading the hints raised (an object that is not what it claims to be)",
    PIN_OVER_CAP: "a pin lease that would take the pinned blocks past the pool's pinned share",
    NOT_SERVED_OVER_PAGES: "a pin or retain over two-level pages (HYBRID_ALLOC_PAGES=two-level), which serve "
    "hit-aware's own levels only",
}


@dataclass(frozen=True, slots=True)
class Hints:
    """One request's hints, checked (the invariants in the module's docstring hold).

    ``retain``: the level its cached prefix (the first ``retain_tokens`` tokens; None: all it
    cached) and its end state are freed at, for ``retain_ttl_s`` seconds. ``pin_ttl_s`` not
    None: a pin lease on its prompt's prefix (the first ``pin_tokens``; None: the whole
    prompt). ``session``: the session it belongs to (a hint's, else vLLM's
    ``Request.session_id``); ``release``: the session whose retains
    and pins end when it finishes. ``checkpoints``: prompt positions where its prefill stops
    and the state is kept. ``errors``: the kinds refused while reading (counter keys of
    :data:`REFUSED_KINDS`, one entry per refusal)."""

    retain: Priority | None = None
    retain_ttl_s: float | None = None
    retain_tokens: int | None = None
    pin_ttl_s: float | None = None
    pin_tokens: int | None = None
    session: str | None = None
    release: str | None = None
    checkpoints: tuple[int, ...] = ()
    errors: tuple[str, ...] = ()


def hints_of(request: Any) -> Hints | None:
    """The hints ``request`` carries (vLLM's ``Request``, or anything with its attributes:
    ``kv_hints``, ``sampling_params.extra_args``, ``num_prompt_tokens``, ``session_id``), or None when it
    carries none of this vocabulary. Never raises. :func:`read_hints`, as a :class:`Hints`."""
    fields = read_hints(request)
    return None if fields is None else Hints(*fields)


#: :class:`Hints`' fields in their order, as :func:`read_hints` returns them: ``retain``,
#: ``retain_ttl_s``, ``retain_tokens``, ``pin_ttl_s``, ``pin_tokens``, ``session``, ``release``,
#: ``checkpoints``, ``errors`` (``Hints(*fields)`` is :func:`hints_of`'s answer).
HintFields = tuple[
    Priority | None,
    float | None,
    int | None,
    float | None,
    int | None,
    str | None,
    str | None,
    tuple[int, ...],
    tuple[str, ...],
]

_MALFORMED: HintFields = (None, None, None, None, None, None, None, (), ("malformed",))


class _Slow(Exception):
    """The fast path met something other than a good hint: the full reader decides."""


def read_hints(request: Any) -> HintFields | None:
    """:func:`hints_of`'s answer as a flat tuple (:data:`HintFields`), without building a
    :class:`Hints`: what the manager reads at a request's first lookup. Never raises.

    Hints that are all good (the common case: each action's fields of the right type and in
    range, no repeat, no conflict) are read by one function over locals (``_fast``); anything
    else, a refusal of any kind, a look-alike of another type, or an object that raises, sends
    the request to the full reader (``_Reader``), which decides as if the fast path were not
    there (the fast path changes nothing on its way: it only returns)."""
    try:
        env = getattr(request, "kv_hints", None)
        sp = getattr(request, "sampling_params", None)
        xargs = None if sp is None else getattr(sp, "extra_args", None)
        if env is None and (type(xargs) is not dict or not xargs or XARG_KEYS.isdisjoint(xargs)):
            return None
        try:
            return _fast(request, env, xargs)
        except Exception:  # noqa: BLE001 - _Slow, or an object that raised: the full reader's case
            pass
        return _Reader(request).read(request, env, xargs)
    except Exception:  # noqa: BLE001 - no hint may raise into the engine
        return _MALFORMED


def _fast_ttl(value: Any) -> float:
    """A good TTL as a float (``_Reader._ttl``'s accepted values), else :class:`_Slow`."""
    t = type(value)
    if t is float:
        # NaN fails both comparisons and infinity the second: ``math.isfinite`` is implied.
        if 0.0 < value <= MAX_TTL_S:
            return value
    elif t is int and 0 < value <= MAX_TTL_S:  # compared as an int: a huge one would overflow float()
        return float(value)
    raise _Slow


def _fast(request: Any, env: Any, xargs: Any) -> HintFields | None:
    """The fast path of :func:`read_hints`: good hints only, read as ``_Reader`` reads them
    (the same order, the same first-stands rules, the same defaults); raises :class:`_Slow`
    (or whatever a look-alike raises) at the first thing ``_Reader`` would refuse or treat
    otherwise, so that ``_Reader`` reads the request instead. Exact types only (a subclass of
    list or dict goes to ``_Reader``)."""
    n = getattr(request, "num_prompt_tokens", None)
    limit = n if type(n) is int else None
    retain: Priority | None = None
    retain_ttl: float | None = None
    pin_ttl: float | None = None
    retain_tokens: int | None = None
    pin_tokens: int | None = None
    pinned = release_own = False
    session: str | None = None
    release: str | None = None
    checkpoints: set[int] | None = None
    if env is not None:
        actions = env.actions
        if type(actions) is not list or len(actions) > MAX_ACTIONS:
            raise _Slow
        for action in actions:
            kind = action.action_type
            version = action.action_version
            payload = action.payload
            if type(kind) is not str or type(version) is not str or type(payload) is not dict:
                raise _Slow
            if kind in FOREIGN_ACTIONS:
                continue
            if version not in ACTION_VERSIONS:
                raise _Slow
            s = payload.get("session")
            if kind == RELEASE:
                if release is not None or release_own:
                    raise _Slow
                if s is None:
                    release_own = True
                elif type(s) is str and s:
                    release = s
                else:
                    raise _Slow
                continue
            if s is not None:
                if type(s) is not str or not s or (session is not None and s != session):
                    raise _Slow
                session = s
            if kind == RETAIN:
                p = payload.get("priority")
                if retain is not None or type(p) is not str:
                    raise _Slow
                retain = _PRIORITY[p]  # KeyError: a bad priority, the full reader's case
                retain_ttl = _fast_ttl(payload.get("ttl_s"))
                t = payload.get("tokens")
                if t is not None and (type(t) is not int or not 1 <= t <= MAX_TOKENS):
                    raise _Slow
                retain_tokens = t
            elif kind == PIN:
                if pinned:
                    raise _Slow
                pinned = True
                pin_ttl = _fast_ttl(payload.get("ttl_s"))
                t = payload.get("tokens")
                if t is not None and (
                    type(t) is not int or not 1 <= t <= MAX_TOKENS or (limit is not None and t > limit)
                ):
                    raise _Slow
                pin_tokens = t
            elif kind == CHECKPOINT:
                checkpoints = _fast_positions(payload.get("positions"), checkpoints, limit)
            else:
                raise _Slow
    if type(xargs) is dict and xargs and not XARG_KEYS.isdisjoint(xargs):
        get = xargs.get
        s = get("kv_session")
        if s is not None:
            if type(s) is not str or not s or (session is not None and s != session):
                raise _Slow
            session = s
        if "kv_retain" in xargs or "kv_retain_ttl" in xargs or "kv_retain_tokens" in xargs:
            p = get("kv_retain")
            if retain is not None or type(p) is not str:
                raise _Slow
            retain = _PRIORITY[p]
            retain_ttl = _fast_ttl(get("kv_retain_ttl"))
            t = get("kv_retain_tokens")
            if t is not None and (type(t) is not int or not 1 <= t <= MAX_TOKENS):
                raise _Slow
            retain_tokens = t
        if "kv_pin_ttl" in xargs or "kv_pin_tokens" in xargs:
            if pinned:
                raise _Slow
            pinned = True
            pin_ttl = _fast_ttl(get("kv_pin_ttl"))
            t = get("kv_pin_tokens")
            if t is not None and (type(t) is not int or not 1 <= t <= MAX_TOKENS or (limit is not None and t > limit)):
                raise _Slow
            pin_tokens = t
        r = get("kv_release")
        if r is not None and r is not False and not (type(r) is int and r == 0):
            if release is not None or release_own:
                raise _Slow
            if type(r) is str and r:
                release = r
            elif r is True or (type(r) is int and r == 1):
                release_own = True
            else:
                raise _Slow
        if "kv_checkpoint" in xargs:
            c = xargs["kv_checkpoint"]
            checkpoints = _fast_positions([c] if type(c) is int else c, checkpoints, limit)
    if session is None and (retain is not None or pinned or release_own or checkpoints):
        own = getattr(request, "session_id", None)
        if type(own) is str and own:
            session = own
    if release_own:
        if session is None:
            raise _Slow
        release = session
    if retain is None and not pinned and release is None and session is None and not checkpoints:
        return None
    return (
        retain,
        retain_ttl,
        retain_tokens,
        pin_ttl,
        pin_tokens,
        session,
        release,
        () if not checkpoints else tuple(sorted(checkpoints)),
        (),
    )


def _fast_positions(positions: Any, taken: set[int] | None, limit: int | None) -> set[int]:
    """``_Reader._checkpoint`` of good positions: ``taken`` with ``positions`` added, else
    :class:`_Slow`."""
    if (type(positions) is not list and type(positions) is not tuple) or not positions:
        raise _Slow
    out = set() if taken is None else taken
    if len(positions) + len(out) > MAX_POSITIONS:
        raise _Slow
    for p in positions:
        if type(p) is not int or p <= 0 or (limit is not None and p > limit):
            raise _Slow
        out.add(p)
    return out


class _Reader:
    """Reads one request's envelope and extra_args into a :class:`Hints`. The first retain,
    pin, release and session stand; later ones are refused."""

    __slots__ = ("checkpoints", "errors", "pin", "prompt_len", "release", "release_own", "retain", "session")

    def __init__(self, request: Any) -> None:
        n = getattr(request, "num_prompt_tokens", None)
        # The prompt's length when the request says it (positions and pins are checked against it).
        self.prompt_len: int | None = n if type(n) is int else None
        self.retain: tuple[Priority, float, int | None] | None = None
        self.pin: tuple[float, int | None] | None = None
        self.session: str | None = None
        self.release: str | None = None
        # A release of this request's own session (resolved once the session is known).
        self.release_own = False
        self.checkpoints: set[int] = set()
        self.errors: list[str] = []

    def read(self, request: Any, env: Any, xargs: Any) -> HintFields | None:
        if env is not None:
            self._envelope(env)
        if type(xargs) is dict and xargs and not XARG_KEYS.isdisjoint(xargs):
            self._xargs(xargs)
        if self.session is None and (self.retain or self.pin or self.release_own or self.checkpoints):
            # No hint named the request's session: vLLM's own, when it has one.
            own = getattr(request, "session_id", None)
            if type(own) is str and own:
                self.session = own
        release = self.release
        if self.release_own:
            if self.session is None:
                self.errors.append("missing_field")
            elif release is None:
                release = self.session
        retain, pin = self.retain, self.pin
        if retain is None and pin is None and release is None and self.session is None and not self.checkpoints:
            if not self.errors:
                return None
            return (None, None, None, None, None, None, None, (), tuple(self.errors))
        return (
            None if retain is None else retain[0],
            None if retain is None else retain[1],
            None if retain is None else retain[2],
            None if pin is None else pin[0],
            None if pin is None else pin[1],
            self.session,
            release,
            tuple(sorted(self.checkpoints)),
            tuple(self.errors),
        )

    # ---- the envelope ---------------------------------------------------------------

    def _envelope(self, env: Any) -> None:
        actions = getattr(env, "actions", None)
        if not isinstance(actions, (list, tuple)):
            self.errors.append("not_envelope")
            return
        if len(actions) > MAX_ACTIONS:
            self.errors.append("too_many_actions")
            return
        for action in actions:
            self._action(action)

    def _action(self, action: Any) -> None:
        kind = getattr(action, "action_type", None)
        version = getattr(action, "action_version", None)
        payload = getattr(action, "payload", None)
        if type(kind) is not str or type(version) is not str or not hasattr(action, "payload"):
            self.errors.append("not_action")
            return
        if kind in FOREIGN_ACTIONS:
            return
        if kind not in ACTIONS:
            self.errors.append("unknown_action")
            return
        if version not in ACTION_VERSIONS:
            self.errors.append("unknown_version")
            return
        if not isinstance(payload, dict):
            self.errors.append("payload_not_dict")
            return
        session = payload.get("session")
        if kind == RELEASE:
            self._release(session, own=session is None)
            return
        if session is not None and not self._session(session):
            return
        if kind == RETAIN:
            self._retain(payload.get("priority"), payload.get("ttl_s"), payload.get("tokens"))
        elif kind == PIN:
            self._pin(payload.get("ttl_s"), payload.get("tokens"))
        else:
            self._checkpoint(payload.get("positions"), as_list=False)

    # ---- extra_args -------------------------------------------------------------------

    def _xargs(self, xargs: dict[Any, Any]) -> None:
        session = xargs.get("kv_session")
        if session is not None and not self._session(session):
            return
        if "kv_retain" in xargs or "kv_retain_ttl" in xargs or "kv_retain_tokens" in xargs:
            self._retain(xargs.get("kv_retain"), xargs.get("kv_retain_ttl"), xargs.get("kv_retain_tokens"))
        if "kv_pin_ttl" in xargs or "kv_pin_tokens" in xargs:
            self._pin(xargs.get("kv_pin_ttl"), xargs.get("kv_pin_tokens"))
        release = xargs.get("kv_release")
        if type(release) is str:
            self._release(release, own=False)
        elif release is True or (type(release) is int and release == 1):
            self._release(None, own=True)
        elif not (release is None or release is False or (type(release) is int and release == 0)):
            self.errors.append("wrong_type")
        if "kv_checkpoint" in xargs:
            self._checkpoint(xargs["kv_checkpoint"], as_list=True)

    # ---- the fields ---------------------------------------------------------------------

    def _session(self, session: Any) -> bool:
        """Takes the request's session; False (refused) when it is not a non-empty str or
        differs from the one already taken."""
        if type(session) is not str or not session:
            self.errors.append("wrong_type")
            return False
        if self.session is not None and session != self.session:
            self.errors.append("session_conflict")
            return False
        self.session = session
        return True

    def _ttl(self, value: Any) -> float | None:
        if value is None:
            self.errors.append("missing_field")
            return None
        if type(value) is int:
            # Compared as an int: a huge one would overflow float().
            if 0 < value <= MAX_TTL_S:
                return float(value)
        elif type(value) is float:
            if math.isfinite(value) and 0.0 < value <= MAX_TTL_S:
                return value
        else:
            self.errors.append("wrong_type")
            return None
        self.errors.append("bad_ttl")
        return None

    def _tokens(self, value: Any, limit: int | None) -> tuple[bool, int | None]:
        """(ok, tokens): ``None`` is the default (ok); ``limit`` bounds it when known."""
        if value is None:
            return True, None
        if type(value) is not int:
            self.errors.append("wrong_type")
            return False, None
        if not 1 <= value <= MAX_TOKENS or (limit is not None and value > limit):
            self.errors.append("bad_tokens")
            return False, None
        return True, value

    def _retain(self, priority: Any, ttl: Any, tokens: Any) -> None:
        if self.retain is not None:
            self.errors.append("duplicate_action")
            return
        if priority is None:
            self.errors.append("missing_field")
            return
        if type(priority) is not str:
            self.errors.append("wrong_type")
            return
        level = _PRIORITY.get(priority)
        if level is None:
            self.errors.append("bad_priority")
            return
        ttl_s = self._ttl(ttl)
        if ttl_s is None:
            return
        ok, n = self._tokens(tokens, None)
        if ok:
            self.retain = (level, ttl_s, n)

    def _pin(self, ttl: Any, tokens: Any) -> None:
        if self.pin is not None:
            self.errors.append("duplicate_action")
            return
        ttl_s = self._ttl(ttl)
        if ttl_s is None:
            return
        ok, n = self._tokens(tokens, self.prompt_len)
        if ok:
            self.pin = (ttl_s, n)

    def _release(self, session: Any, own: bool) -> None:
        if self.release is not None or self.release_own:
            self.errors.append("duplicate_action")
            return
        if own:
            self.release_own = True
        elif type(session) is not str or not session:
            self.errors.append("wrong_type")
        else:
            self.release = session

    def _checkpoint(self, positions: Any, as_list: bool) -> None:
        """``positions``: a list (or tuple) of ints; from extra_args also a single int."""
        if positions is None:
            self.errors.append("missing_field")
            return
        if as_list and type(positions) is int:
            positions = [positions]
        if not isinstance(positions, (list, tuple)):
            self.errors.append("wrong_type")
            return
        if not positions:
            self.errors.append("missing_field")
            return
        if len(positions) > MAX_POSITIONS or len(self.checkpoints) + len(positions) > MAX_POSITIONS:
            self.errors.append("too_many_positions")
            return
        limit = self.prompt_len
        for p in positions:
            if type(p) is not int:
                self.errors.append("wrong_type")
            elif p <= 0 or (limit is not None and p > limit):
                self.errors.append("bad_position")
            else:
                self.checkpoints.add(p)


def stats_line(stats: dict[str, int]) -> str:
    """The plugin's periodic KV hints line (see ``HybridKVCacheManager.new_step_starts``)
    from ``HybridKVCacheManager.hint_stats()``: the requests whose hints were received,
    applied, refused (in all), the leases and retains that expired, the requests ignored
    (exact), and the blocks and states pins and retains hold now."""
    g = stats.get
    return (
        f"hybrid_alloc: KV hints: {g('received', 0)} received, {g('applied', 0)} applied, "
        f"{g('refused', 0)} refused, {g('expired', 0)} expired, {g('ignored', 0)} ignored; "
        f"held by pins: {g('leased_free_blocks', 0)} free blocks ({g('leased_keys', 0)} keys leased), "
        f"by retains: {g('retained_blocks', 0)} blocks, {g('retained_states', 0)} states"
    )


class HintCounters:
    """One manager's hint counters: ``received`` (requests that carried hints of this
    vocabulary), ``applied`` (requests whose hints the core took), ``refused`` (by kind, a
    key of :data:`REFUSED_KINDS`), ``expired`` (leases and retains that ran out) and
    ``ignored`` (requests whose hints the exact policy ignored). The first refusal of each
    kind logs one line (on ``logger``; default vLLM's ``vllm.hybrid_alloc``); later ones are
    only counted. Cost: a dict update per refusal."""

    __slots__ = ("_logged", "_logger", "applied", "expired", "ignored", "received", "refused")

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.received = 0
        self.applied = 0
        self.expired = 0
        self.ignored = 0
        self.refused: dict[str, int] = {}
        self._logged: set[str] = set()
        self._logger = logger if logger is not None else logging.getLogger("vllm.hybrid_alloc")

    def receive(self, hints: Hints, request_id: str = "") -> None:
        """Counts a request's hints as received, and each kind it refused while reading."""
        self.received += 1
        for kind in hints.errors:
            self.refuse(kind, request_id)

    def refuse(self, kind: str, request_id: str = "") -> None:
        """Counts one refusal of ``kind``; logs the first of each kind."""
        self.refused[kind] = self.refused.get(kind, 0) + 1
        if kind not in self._logged:
            self._logged.add(kind)
            self._logger.warning(
                "hybrid_alloc: a KV hint%s was ignored: %s (%s); later hints refused for this reason are only counted",
                f" of request {request_id}" if request_id else "",
                REFUSED_KINDS.get(kind, kind),
                kind,
            )

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())

    def as_dict(self) -> dict[str, int]:
        """``received``, ``applied``, ``refused`` (the total), ``expired``, ``ignored``, then
        ``refused.<kind>`` for each kind refused at least once (sorted)."""
        out = {
            "received": self.received,
            "applied": self.applied,
            "refused": self.refused_total,
            "expired": self.expired,
            "ignored": self.ignored,
        }
        for kind in sorted(self.refused):
            out[f"refused.{kind}"] = self.refused[kind]
        return out
