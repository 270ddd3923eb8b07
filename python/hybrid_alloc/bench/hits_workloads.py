"""The hits bench's cells, before they run: the workloads (:class:`Workload`, built by
:func:`workloads` at ``--size small`` or ``full``), the shapes it takes by name (:func:`shapes`,
from the one registry, :mod:`hybrid_alloc.bench.shapes`) and the pool each cell gets
(:func:`budget_blocks`). Nothing here imports vLLM; :func:`shapes` and :func:`budget_blocks`
import the registry (and so torch) when called.

| name | holds |
|---|---|
| ``WORKLOADS``, ``DEFAULT_WORKLOADS``, ``BUDGETS``, ``SHAPE_NAMES``, ``DEFAULT_SHAPES`` | what ``--workload``, ``--budget`` and ``--shape`` take, and their defaults |
| ``DEFAULT_PRESSURE`` | the pressure multiple per size and shape when ``--pressure`` is not given |
| ``Job``, ``Workload`` | one request (its prompt's parts, its reply length, what it waits for), a workload |
| ``chat_workload`` ... ``sysprompt_workload``, ``workloads`` | the five workloads, and each at a size |
| ``shapes`` | the shapes ``--shape`` names, by those names |
| ``budget_blocks`` | a cell's pool in blocks: ``ample`` or ``pressure`` times the live working set |

Workloads (each at ``ample`` memory, where nothing is ever evicted, and under ``pressure``,
a pool of ``--pressure`` times the live working set of the requests in flight; by default 3
at ``--size full`` and, at ``--size small``, each shape's multiple in :data:`DEFAULT_PRESSURE`,
where the pool evicts):

- ``chat``: sessions share a system prompt and take turns; every turn re-sends the whole
  conversation (the earlier replies included) plus a new message; a fixed number of turns
  are in flight, round-robin over the sessions.
- ``shared``: a few long system prompts serve many requests, each with a unique suffix.
- ``resend``: distinct long contexts re-sent round-robin with short new suffixes (the shape
  of vLLM issue #48435).
- ``sightings``: one system prompt with unique suffixes, strictly one request after another
  (nothing else in flight), reporting the hit of each sighting (``extra["hits"]``); ample
  memory only. Policy ``pinned`` (this workload only) is hit-aware with the system prompt in
  ``HYBRID_ALLOC_PIN_PREFIXES``.
- ``sysprompt`` (issue 30; asked for by name): a few shared system prompts of 300-2000 tokens,
  many requests each with a unique suffix, arrivals replacing finished requests.

Cost: a workload is built once per command, O(its tokens); a budget is O(its jobs' parts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("chat", "shared", "resend", "sightings", "sysprompt")
#: The workloads and shapes a run without ``--workload`` / ``--shape`` takes (issue 30's
#: ``sysprompt`` workload and Hopper shapes are asked for by name).
DEFAULT_WORKLOADS = ("chat", "shared", "resend", "sightings")
BUDGETS = ("ample", "pressure")
#: The names ``--shape`` takes, each a name or an alias in the one registry
#: (:mod:`hybrid_alloc.bench.shapes`; ``tests/python/bench/test_bench_registry.py`` checks), and
#: those a run without ``--shape`` takes.
SHAPE_NAMES = ("gemma3", "gptoss", "qwen35", "nemotronh", "qwen3next", "qwen36", "nemotron3nano")
DEFAULT_SHAPES = ("gemma3", "gptoss", "qwen35", "nemotronh")
#: ``--pressure`` when not given: the pressure pool is this times the live working set. The
#: full workloads evict at 3x. The small ones (CI size: 8 chat sessions of 3 turns, 4 in
#: flight) fit whole in a pool of 3x, where every pressure row equalled its ample row
#: (vLLM 0.34.0, 2026-12-03); the first multiple at which each shape's small rows differ from
#: the ample ones, with hit-aware ahead of vLLM's exact retention on chat as at the full size:
#: 0.85 for the window shapes (below the mean-length estimate: a chat's later turns are longer)
#: and 2 for the Mamba shapes (whose pool counts one state per group and request).
DEFAULT_PRESSURE: dict[str, dict[str, float]] = {
    "small": {
        "gemma3": 0.85,
        "gptoss": 0.85,
        "qwen35": 2.0,
        "nemotronh": 2.0,
        "qwen3next": 2.0,
        "qwen36": 2.0,
        "nemotron3nano": 2.0,
    },
    "full": dict.fromkeys(SHAPE_NAMES, 3.0),
}


@dataclass
class Job:
    """One request of a workload. ``parts`` builds its prompt: token lists and references
    ``("reply", job_index)`` to an earlier job's output (resolved when it is submitted)."""

    rid: str
    parts: list[Any]
    max_tokens: int
    after: int = -1  # index of a job that must have finished first (-1: none)
    #: Which shared prompt the job's prompt opens with (-1: none) and its length in tokens:
    #: the "2nd sighting" share counts the hits on them from each prompt's 2nd job on.
    shared_key: int = -1
    shared_len: int = 0


@dataclass
class Workload:
    name: str
    jobs: list[Job]
    in_flight: int
    #: Token-id prefixes policy ``pinned`` pins (``HYBRID_ALLOC_PIN_PREFIXES``).
    pins: list[list[int]] = field(default_factory=list)


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(n)]


def chat_workload(
    sessions: int,
    turns: int,
    sys_len: int,
    in_flight: int,
    seed: int = 7,
    user: tuple[int, int] = (64, 256),
    reply: tuple[int, int] = (96, 256),
) -> Workload:
    rng = random.Random(seed)
    system = _toks(rng, sys_len)
    jobs: list[Job] = []
    history: dict[int, list[Any]] = {s: [system] for s in range(sessions)}
    last: dict[int, int] = {}
    for t in range(turns):
        for s in range(sessions):
            msg = _toks(rng, rng.randint(*user))
            parts = history[s] + [msg]
            idx = len(jobs)
            jobs.append(Job(f"chat-s{s}-t{t}", parts, rng.randint(*reply), after=last.get(s, -1)))
            history[s] = parts + [("reply", idx)]
            last[s] = idx
    return Workload("chat", jobs, in_flight)


def shared_workload(
    num_prompts: int,
    prompt_len: int,
    requests: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 128,
    seed: int = 11,
) -> Workload:
    rng = random.Random(seed)
    prompts = [_toks(rng, prompt_len) for _ in range(num_prompts)]
    jobs = [
        Job(f"shared-{i}", [prompts[rng.randrange(num_prompts)], _toks(rng, rng.randint(*suffix))], out_len)
        for i in range(requests)
    ]
    return Workload("shared", jobs, in_flight)


def resend_workload(
    contexts: int,
    ctx_len: tuple[int, int],
    rounds: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 64,
    seed: int = 13,
) -> Workload:
    rng = random.Random(seed)
    ctxs = [_toks(rng, rng.randint(*ctx_len)) for _ in range(contexts)]
    jobs = [
        Job(f"resend-r{r}-c{c}", [ctxs[c], _toks(rng, rng.randint(*suffix))], out_len)
        for r in range(rounds)
        for c in range(contexts)
    ]
    return Workload("resend", jobs, in_flight)


def sightings_workload(
    sightings: int, sys_len: int, suffix: tuple[int, int], out_len: int = 32, seed: int = 17
) -> Workload:
    """One system prompt, ``sightings`` requests each with a unique suffix, one at a time."""
    rng = random.Random(seed)
    system = _toks(rng, sys_len)
    jobs = [
        Job(f"sighting-{i}", [system, _toks(rng, rng.randint(*suffix))], out_len, after=i - 1) for i in range(sightings)
    ]
    return Workload("sightings", jobs, 1, pins=[system])


def sysprompt_workload(
    num_prompts: int,
    prompt_len: tuple[int, int],
    requests: int,
    suffix: tuple[int, int],
    in_flight: int,
    out_len: int = 64,
    seed: int = 19,
) -> Workload:
    """A few shared system prompts of lengths drawn in ``prompt_len`` (none a multiple of 16,
    so none a multiple of a block or of a 64-token prefix match unit), ``requests`` requests
    each opening with one of them (drawn at random) and a unique suffix; ``in_flight`` at a
    time, each arrival replacing a finished request. The shape of issue 30: on vLLM's Hopper
    blocks of 528-2096 tokens, a system prompt shorter than a block never hits."""
    rng = random.Random(seed)
    lens = []
    for _ in range(num_prompts):
        n = rng.randint(*prompt_len)
        lens.append(n + 1 if n % 16 == 0 else n)
    prompts = [_toks(rng, n) for n in lens]
    jobs = []
    for i in range(requests):
        k = rng.randrange(num_prompts)
        jobs.append(
            Job(
                f"sysprompt-{i}",
                [prompts[k], _toks(rng, rng.randint(*suffix))],
                out_len,
                shared_key=k,
                shared_len=lens[k],
            )
        )
    return Workload("sysprompt", jobs, in_flight)


def workloads(size: str) -> list[Workload]:
    if size == "full":
        return [
            chat_workload(48, 6, 1024, 16),
            shared_workload(8, 2048, 256, (300, 800), 16),
            resend_workload(16, (5000, 6000), 4, (16, 64), 16),
            sightings_workload(6, 2500, (300, 800), out_len=64),
            sysprompt_workload(6, (300, 2000), 256, (50, 400), 16),
        ]
    return [
        chat_workload(8, 3, 1024, 4, user=(32, 96), reply=(48, 96)),
        shared_workload(2, 1024, 12, (100, 300), 4, out_len=32),
        resend_workload(4, (1500, 2000), 3, (16, 48), 4, out_len=16),
        sightings_workload(4, 2500, (300, 800), out_len=8),
        sysprompt_workload(3, (300, 2000), 16, (50, 200), 4, out_len=16),
    ]


def shapes() -> dict[str, Any]:
    """The shapes ``--shape`` takes, by those names (:data:`SHAPE_NAMES`), from the one registry
    (``gptoss`` through its alias: :data:`hybrid_alloc.bench.shapes.ALIASES`).

    # Errors
    ``KeyError`` if the registry lost a name this bench takes."""
    from hybrid_alloc.bench.shapes import by_name

    return {name: by_name(name) for name in SHAPE_NAMES}


def _window_blocks(shape: Any, bs: int) -> tuple[int, int, int]:
    """(full-attention groups, window groups, blocks a window group holds per request; one
    state for a Mamba group: the budget then comes within 4-12% of vLLM's own peak of blocks
    held by running requests, ``extra["peak_held_blocks"]``, on the Mamba shapes' chat). The
    groups as vLLM's planner makes them (``_get_kv_cache_groups_uniform_page_size``): groups
    of the smaller layer count, or of the larger one when it is under 1.5 times the smaller
    (23 Mamba2 and 6 attention layers: groups of 6, 4 Mamba groups and 1 attention group)."""
    full = sum(1 for x in shape.layers if x.kind == "full")
    local = len(shape.layers) - full
    window = max((x.window for x in shape.layers if x.kind != "full"), default=0)
    if not full or not local:
        return (1 if full else 0), (1 if local else 0), -(-window // bs) + 1
    size = max(full, local) if max(full, local) < 1.5 * min(full, local) else min(full, local)
    return -(-full // size), -(-local // size), -(-window // bs) + 1


def budget_blocks(shape: Any, wl: Workload, budget: str, pressure: float, bs: int | None = None) -> int:
    """Pool size in blocks (of the shape's block size,
    :func:`hybrid_alloc.bench.shapes.hopper_block_size`): ``ample`` holds every token of every
    request in every group; ``pressure`` is ``pressure`` times the live working set
    (``in_flight`` requests of the mean length, window groups capped at their window, Mamba
    groups at one state)."""
    from hybrid_alloc.bench.shapes import hopper_block_size

    bs = bs or hopper_block_size(shape)
    nf, nw, wblocks = _window_blocks(shape, bs)
    lens = [sum(len(p) if isinstance(p, list) else 0 for p in j.parts) + j.max_tokens for j in wl.jobs]
    # Replies re-sent in a later prompt are not counted in ``parts``: add them.
    reply_toks = {i: wl.jobs[i].max_tokens for j in wl.jobs for p in j.parts if isinstance(p, tuple) for i in [p[1]]}
    lens = [n + sum(reply_toks[p[1]] for p in j.parts if isinstance(p, tuple)) for n, j in zip(lens, wl.jobs)]
    if budget == "ample":
        total = sum(-(-n // bs) for n in lens)
        return total * (nf + nw) + 64
    mean = sum(lens) / len(lens)
    per_req = -(-int(mean) // bs) * nf + min(-(-int(mean) // bs), wblocks) * nw
    return int(pressure * wl.in_flight * per_req) + 1
