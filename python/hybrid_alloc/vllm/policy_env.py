"""The retention policy and its user controls, read from the environment when a manager is
built (issue 9).

- ``HYBRID_ALLOC_POLICY``: "exact" (vLLM's decisions, the default) or "hit-aware";
- under hit-aware only:
  - ``HYBRID_ALLOC_RETAIN_PRIORITY=N``: a request whose vLLM ``priority`` is <= N (lower is
    more important, as vLLM's priority scheduling) leaves its prefix cached at the pinned level;
  - ``HYBRID_ALLOC_PIN_PREFIXES=FILE``: a JSON list of token-id lists (e.g. system prompts) to
    pin, each pinned the first time a request starting with it is looked up (its own block
    hashes, so LoRA, cache salt and the hash function are those vLLM uses);
  - ``HYBRID_ALLOC_PIN_SHARE=F``: the pinned share of the pool (default 0.25).

A bad priority or share raises ``Unsupported`` naming the variable (the adapter falls back to
vLLM's own manager, with one line). A pin file that cannot be read keeps the plugin and the
hit-aware policy and drops only the pins (``PolicyControls.pins_error``; the manager says so
in one line). Controls set under the exact policy are ignored; the manager says so
in one line (:func:`ignored_controls`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from hybrid_alloc.vllm.unsupported import Unsupported

__all__ = [
    "PIN_PREFIXES_ENV",
    "PIN_SHARE_ENV",
    "POLICY_ENV",
    "RETAIN_PRIORITY_ENV",
    "PolicyControls",
    "ignored_controls",
    "policy_controls",
    "policy_from_env",
]

POLICY_ENV = "HYBRID_ALLOC_POLICY"
POLICIES = ("exact", "hit-aware")
RETAIN_PRIORITY_ENV = "HYBRID_ALLOC_RETAIN_PRIORITY"
PIN_PREFIXES_ENV = "HYBRID_ALLOC_PIN_PREFIXES"
PIN_SHARE_ENV = "HYBRID_ALLOC_PIN_SHARE"
CONTROL_ENVS = (RETAIN_PRIORITY_ENV, PIN_PREFIXES_ENV, PIN_SHARE_ENV)

Policy = Literal["exact", "hit-aware"]


def policy_from_env() -> Policy:
    """``HYBRID_ALLOC_POLICY`` (case and ``_``/``-`` ignored; unset or empty: exact)."""
    raw = os.environ.get(POLICY_ENV, "exact").strip().lower().replace("_", "-")
    if raw in ("", "exact"):
        return "exact"
    if raw == "hit-aware":
        return "hit-aware"
    raise Unsupported(f"{POLICY_ENV}={os.environ.get(POLICY_ENV)!r} is not one of {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True)
class PolicyControls:
    """The hit-aware controls: ``retain_priority`` (None: none retained), the prefixes to
    pin (token-id lists, none empty), ``pin_share`` (None: the core's default)."""

    retain_priority: int | None = None
    pins: list[list[int]] = field(default_factory=list)
    pin_share: float | None = None
    #: Why the pin file was not used (``pins`` is then empty), or None.
    pins_error: str | None = None


def policy_controls() -> PolicyControls:
    """The hit-aware controls from the environment; raises ``Unsupported`` naming the
    variable whose value is bad, except for the pin file: one that cannot be read leaves
    ``pins`` empty and says why in ``pins_error``."""
    env = os.environ
    retain: int | None = None
    if env.get(RETAIN_PRIORITY_ENV, "").strip():
        try:
            retain = int(env[RETAIN_PRIORITY_ENV])
        except ValueError:
            raise Unsupported(f"{RETAIN_PRIORITY_ENV}={env[RETAIN_PRIORITY_ENV]!r} is not an integer") from None
    pins: list[list[int]] = []
    pins_error: str | None = None
    path = env.get(PIN_PREFIXES_ENV, "").strip()
    if path:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            data, pins_error = None, f"{PIN_PREFIXES_ENV}={path!r} cannot be read as JSON: {e}"
        if pins_error is None and (
            not isinstance(data, list)
            or not all(
                isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data
            )
        ):
            pins_error = f"{PIN_PREFIXES_ENV}={path!r} must hold a JSON list of token-id lists"
        if pins_error is None:
            assert isinstance(data, list)
            pins = [p for p in data if p]
    share: float | None = None
    if env.get(PIN_SHARE_ENV, "").strip():
        try:
            share = float(env[PIN_SHARE_ENV])
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise Unsupported(f"{PIN_SHARE_ENV}={env[PIN_SHARE_ENV]!r} is not a number in 0..1")
    return PolicyControls(retain, pins, share, pins_error)


def ignored_controls() -> list[str]:
    """The hit-aware controls set (non-empty) in the environment: under the exact policy
    they are ignored, and the manager says so."""
    return [name for name in CONTROL_ENVS if os.environ.get(name, "").strip()]


def controls_for(policy: str, logger: logging.Logger) -> PolicyControls:
    """The controls a manager under ``policy`` uses, saying in one line what it leaves out:
    the pins of a pin file that cannot be read (hit-aware), or every control set under the
    exact policy (ignored)."""
    if policy != "exact":
        controls = policy_controls()
        if controls.pins_error is not None:
            logger.warning("hybrid_alloc: %s; the hit-aware policy runs without pinned prefixes", controls.pins_error)
        return controls
    if ignored := ignored_controls():
        logger.warning(
            "hybrid_alloc: %s ignored: these steer the hit-aware policy, and the policy is exact "
            "(set %s=hit-aware to use them)",
            ", ".join(ignored),
            POLICY_ENV,
        )
    return PolicyControls()
