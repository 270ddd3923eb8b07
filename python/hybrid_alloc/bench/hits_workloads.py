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
| ``chat_workload`` ... ``shortsys_workload``, ``workloads`` | the seven workloads, and each at a size |
| ``agent_churn`` | the agent workload's other traffic, one request at a time |
| ``HINT_POLICIES`` | the hint policies: hit-aware with a workload's hints attached |
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
- ``agent`` (issue 38; asked for by name; ``pressure`` only): agent sessions whose turns are
  separated by tool pauses of simulated time (5-120 s at the full size), each turn re-sending the
  session's context (a shared tool-definition prompt, the task, every earlier reply and tool
  output) plus the new tool output, while other traffic (unique prompts, :func:`agent_churn`)
  keeps the cache churning. Hint policies ``retain`` (every turn retains its context at the high
  level for 300 s; the last one releases the session) and ``pin`` (every turn leases its prompt
  for 300 s; the last one releases the session). Time is simulated (``Workload.step_s``).
- ``shortsys`` (issue 38; asked for by name): short shared system prompts of 100-2000 tokens off
  every grid (none a multiple of 16), each request one of them and a unique suffix, each
  prompt's sightings one after another (the next waits for the previous to finish), the prompts
  round-robin. Hint policy ``checkpoint``: every request asks a checkpoint at its system
  prompt's end.

Cost: a workload is built once per command, O(its tokens); a budget is O(its jobs' parts).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("chat", "shared", "resend", "sightings", "sysprompt", "agent", "shortsys")
#: The hint policies (``--policy``): hit-aware with the hints a workload's jobs carry for that
#: policy (``Job.hints``) attached to their requests as vLLM's ``KvHintsEnvelope``; a workload
#: says which it has (``Workload.hint_policies``).
HINT_POLICIES = ("retain", "pin", "checkpoint")
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
    #: Simulated seconds after ``after`` finished (or, with no ``after``, after the run's start)
    #: before the job arrives: an agent's tool pause. Only a workload with ``step_s`` has time.
    pause_s: float = 0.0
    #: Whether the job resumes the context of ``after`` (an agent's next turn): its hit is
    #: reported as a share of that context (``extra["resumed_share"]``).
    resumes: bool = False
    #: The hint actions each hint policy attaches: policy -> [(action_type, payload), ...].
    hints: dict[str, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)


@dataclass
class Workload:
    name: str
    jobs: list[Job]
    in_flight: int
    #: Token-id prefixes policy ``pinned`` pins (``HYBRID_ALLOC_PIN_PREFIXES``).
    pins: list[list[int]] = field(default_factory=list)
    #: The hint policies its jobs carry hints for (of :data:`HINT_POLICIES`).
    hint_policies: tuple[str, ...] = ()
    #: The budgets it runs under (``ample``: nothing is ever evicted).
    budgets: tuple[str, ...] = ("ample", "pressure")
    #: Simulated time (None: none): a step lasts ``step_s[0] + step_s[1] * scheduled tokens``
    #: seconds; jobs arrive by ``Job.pause_s``, in any order their ``after`` allows.
    step_s: tuple[float, float] | None = None
    #: Other traffic: ``churn(i)`` is its ``i``-th request; they arrive at ``churn_rate`` prompt
    #: tokens per simulated second (each one its prompt's length over the rate after the one
    #: before it), at most ``churn_in_flight`` in flight (an arrival beyond waits), while a job
    #: is left.
    churn: Callable[[int], Job] | None = None
    churn_in_flight: int = 0
    churn_rate: float = 0.0
    #: The token lengths live at once, for the pressure budget (None: ``in_flight`` requests of
    #: the jobs' mean length).
    live: list[int] | None = None
    #: The pressure multiple it takes when ``--pressure`` is not given (None: :data:`DEFAULT_PRESSURE`).
    pressure: float | None = None


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
    return Workload("sightings", jobs, 1, pins=[system], budgets=("ample",))


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


def agent_churn(prompt: tuple[int, int], reply: tuple[int, int], seed: int = 31) -> Callable[[int], Job]:
    """The agent workload's other traffic: request ``i`` is a unique prompt of a length drawn in
    ``prompt`` and a reply drawn in ``reply``, the same for every run (from ``i`` and the seed)."""

    def churn(i: int) -> Job:
        rng = random.Random(seed * 1_000_003 + i)
        return Job(f"churn-{i}", [_toks(rng, rng.randint(*prompt))], rng.randint(*reply))

    return churn


def agent_workload(
    sessions: int,
    turns: int,
    tools_len: int,
    task: tuple[int, int],
    tool: tuple[int, int],
    reply: tuple[int, int],
    pause: tuple[float, float],
    churn_in_flight: int,
    churn_prompt: tuple[int, int],
    churn_reply: tuple[int, int],
    churn_x: float = 3.0,
    ttl_s: float = 300.0,
    step_s: tuple[float, float] = (0.025, 5e-5),
    seed: int = 23,
) -> Workload:
    """Agent sessions with tool pauses, in simulated time, while other traffic churns the cache.

    Session ``s`` opens with a shared tool-definition prompt (``tools_len`` tokens) and its own
    task (drawn in ``task``); each turn's prompt is the session's context so far (its last
    prompt and reply) plus a tool output (drawn in ``tool``; none on the first turn), its reply
    is drawn in ``reply``; the next turn arrives a tool pause (drawn in ``pause``, simulated
    seconds) after the turn finished. The sessions start spread over the first pause. Every
    session is live at once (``in_flight`` = ``sessions``). The live working set (the pressure
    budget's) is every session at its mean context and ``churn_in_flight`` requests of the
    other traffic at their mean length. The other traffic (:func:`agent_churn`: unique prompts
    drawn in ``churn_prompt``, replies in ``churn_reply``) arrives at ``churn_x`` times the live
    working set per mean pause (in prompt tokens), at most ``churn_in_flight`` in flight.

    Hints: policy ``retain`` asks each turn but the last to retain its context at the high
    level for ``ttl_s``, and the last to release the session; ``pin`` asks each turn but the
    last for a lease of ``ttl_s`` on its prompt, and the last to release the session. A step
    lasts ``step_s[0]`` seconds plus ``step_s[1]`` per scheduled token (by default 25 ms plus
    50 us a token: a decode step of 16 requests 26 ms, a prefill chunk of 8192 tokens 0.43 s)."""
    rng = random.Random(seed)
    tools = _toks(rng, tools_len)
    history: dict[int, list[Any]] = {s: [tools, _toks(rng, rng.randint(*task))] for s in range(sessions)}
    # Each session's context in tokens, turn by turn (its prompt and reply): the live working set.
    sizes: dict[int, list[int]] = {s: [] for s in range(sessions)}
    jobs: list[Job] = []
    last: dict[int, int] = {}
    for t in range(turns):
        for s in range(sessions):
            parts = history[s] + ([_toks(rng, rng.randint(*tool))] if t else [])
            session = f"agent-{s}"
            hints: dict[str, list[tuple[str, dict[str, Any]]]]
            if t == turns - 1:
                release: list[tuple[str, dict[str, Any]]] = [("kv.release", {"session": session})]
                hints = {"retain": release, "pin": release}
            else:
                hints = {
                    "retain": [("kv.retain", {"priority": "high", "ttl_s": ttl_s, "session": session})],
                    "pin": [("kv.pin", {"ttl_s": ttl_s, "session": session})],
                }
            idx = len(jobs)
            job = Job(
                f"agent-s{s}-t{t}",
                parts,
                rng.randint(*reply),
                after=last.get(s, -1),
                pause_s=rng.uniform(*pause) if t else rng.uniform(0.0, pause[1]),
                resumes=t > 0,
                hints=hints,
            )
            jobs.append(job)
            prompt = sum(len(p) if isinstance(p, list) else jobs[p[1]].max_tokens for p in parts)
            sizes[s].append(prompt + job.max_tokens)
            history[s] = parts + [("reply", idx)]
            last[s] = idx
    churn_len = (sum(churn_prompt) + sum(churn_reply)) // 2
    live = [sum(v) // len(v) for v in sizes.values()] + [churn_len] * churn_in_flight
    pauses = [j.pause_s for j in jobs if j.resumes]
    rate = churn_x * sum(live) / (sum(pauses) / len(pauses)) if pauses else 0.0
    return Workload(
        "agent",
        jobs,
        sessions,
        hint_policies=("retain", "pin"),
        budgets=("pressure",),
        step_s=step_s,
        churn=agent_churn(churn_prompt, churn_reply),
        churn_in_flight=churn_in_flight,
        churn_rate=rate,
        live=live,
        pressure=3.0,
    )


def shortsys_workload(
    lens: list[int], rounds: int, suffix: tuple[int, int], out_len: int = 64, seed: int = 29
) -> Workload:
    """Short shared system prompts of the lengths ``lens`` (none a multiple of 16), ``rounds``
    sightings of each with a unique suffix; round-robin over the prompts, each sighting waits
    for the prompt's previous one to finish (so the 2nd sighting is the first that can hit), as
    many in flight as prompts. Hint policy ``checkpoint``: every request asks a checkpoint at its
    system prompt's end (``kv.checkpoint``)."""
    if any(n % 16 == 0 for n in lens):
        raise ValueError(f"shortsys: prompt lengths must be off every grid (not a multiple of 16): {lens}")
    rng = random.Random(seed)
    prompts = [_toks(rng, n) for n in lens]
    jobs: list[Job] = []
    last: dict[int, int] = {}
    for r in range(rounds):
        for k, n in enumerate(lens):
            last_k = last.get(k, -1)
            last[k] = len(jobs)
            jobs.append(
                Job(
                    f"shortsys-r{r}-p{k}",
                    [prompts[k], _toks(rng, rng.randint(*suffix))],
                    out_len,
                    after=last_k,
                    shared_key=k,
                    shared_len=n,
                    hints={"checkpoint": [("kv.checkpoint", {"positions": [n]})]},
                )
            )
    return Workload("shortsys", jobs, len(lens), hint_policies=("checkpoint",), budgets=("ample",))


#: The short system prompts' lengths (``shortsys``): 100-2000 tokens, none a multiple of 16.
SHORTSYS_LENS = {"full": [100, 157, 333, 517, 801, 1100, 1433, 1999], "small": [100, 333, 801, 1999]}


def workloads(size: str) -> list[Workload]:
    if size == "full":
        return [
            chat_workload(48, 6, 1024, 16),
            shared_workload(8, 2048, 256, (300, 800), 16),
            resend_workload(16, (5000, 6000), 4, (16, 64), 16),
            sightings_workload(6, 2500, (300, 800), out_len=64),
            sysprompt_workload(6, (300, 2000), 256, (50, 400), 16),
            agent_workload(
                16,
                6,
                1024,
                task=(300, 800),
                tool=(100, 700),
                reply=(64, 256),
                pause=(5.0, 120.0),
                churn_in_flight=8,
                churn_prompt=(1000, 4000),
                churn_reply=(64, 256),
            ),
            shortsys_workload(SHORTSYS_LENS["full"], 8, (50, 400)),
        ]
    return [
        chat_workload(8, 3, 1024, 4, user=(32, 96), reply=(48, 96)),
        shared_workload(2, 1024, 12, (100, 300), 4, out_len=32),
        resend_workload(4, (1500, 2000), 3, (16, 48), 4, out_len=16),
        sightings_workload(4, 2500, (300, 800), out_len=8),
        sysprompt_workload(3, (300, 2000), 16, (50, 200), 4, out_len=16),
        agent_workload(
            4,
            3,
            512,
            task=(200, 600),
            tool=(100, 400),
            reply=(16, 48),
            pause=(5.0, 30.0),
            churn_in_flight=3,
            churn_prompt=(400, 1200),
            churn_reply=(16, 48),
        ),
        shortsys_workload(SHORTSYS_LENS["small"], 3, (50, 200), out_len=16),
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
    (``in_flight`` requests of the mean length, or the lengths ``Workload.live`` gives, window
    groups capped at their window, Mamba groups at one state). A workload's other traffic
    (``Workload.churn``) is not in ``ample``: it never hits."""
    from hybrid_alloc.bench.shapes import hopper_block_size

    bs = bs or hopper_block_size(shape)
    nf, nw, wblocks = _window_blocks(shape, bs)
    if wl.live is not None and budget == "pressure":  # what is live at once, given (the agent workload's)
        return int(pressure * sum(-(-n // bs) * nf + min(-(-n // bs), wblocks) * nw for n in wl.live)) + 1
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
