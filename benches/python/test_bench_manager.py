"""pytest-benchmark: what the scheduler pays for the KV cache manager, on the identical call
trace, through vLLM's own KVCacheManager and through hybrid_alloc's, in the same run.

    pytest benches/python --benchmark-only [--benchmark-timer time.process_time]

The terminal summary pairs each of our figures with vLLM's (median of each, and the ratio).

- ``test_decode_step``: gemma-2-27b shape (sliding window 4096 and full attention, block 16),
  N running requests (N = 256, 1024) with 2048-2063-token contexts (request i has i % 16 more
  tokens, so about one in 16 crosses a block boundary each step). One round is one scheduler
  step's per-request work: ``allocate_slots(r, 1, num_lookahead_tokens=0)`` as the running
  loop calls it, then ``get_block_ids(allow_none=True)`` on what it returned, as
  ``_make_cached_request_data`` does. The tokens advance between rounds (untimed).
- ``test_admission``: one request's admission and finish, phase by phase, as the scheduler
  calls them: ``lookup`` (``get_computed_blocks``), ``allocate`` (the admission
  ``allocate_slots`` with the scheduler's keywords, the whole prompt in one chunk),
  ``block_table`` (``get_blocks(id).get_block_ids()`` for ``NewRequestData``) and ``free``
  (after one decode step, so sliding-window blocks out of the window are gone, as at a
  finish). Shapes: gemma-2-27b with a 6144-token prompt, and a 128k-context Gemma-3-style
  shape (window 1024, five sliding-window groups per full one) with a 131040-token prompt.
  ``cold``: a new random prompt each round (no hit); ``warm``: the same prompt again (a
  cache hit of all but the last block).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest

logging.disable(logging.WARNING)

vllm = pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_harness import Setup, full, swa  # noqa: E402

GEMMA2 = Setup("gemma2", [full(16), swa(4096, 16)], num_blocks=300000, max_model_len=8192, max_in_flight_tokens=8192)
GEMMA3_128K = Setup(
    "gemma3_128k",
    [full(16)] + [swa(1024, 16) for _ in range(5)],
    num_blocks=120000,
    max_model_len=131072,
    max_in_flight_tokens=131072,
)
ADMISSION = {"gemma2-6144": (GEMMA2, 6144), "gemma3-128k": (GEMMA3_128K, 131040)}

# (test, params without the manager) -> manager -> median seconds; read by conftest's summary.
RESULTS: dict[tuple[str, str], dict[str, float]] = {}


def _record(benchmark: Any, key: tuple[str, str], manager: str) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None:
        RESULTS.setdefault(key, {})[manager] = stats.stats.median


def _timer_overhead_ns() -> float:
    """The cost of one timer read pair, which pytest-benchmark's pedantic rounds include once
    per round (reported; a round here is 100 us or more)."""
    pc = time.perf_counter
    best = float("inf")
    for _ in range(5):
        t = pc()
        for _ in range(10000):
            pc()
            pc()
        best = min(best, (pc() - t) / 10000 * 1e9)
    return best


def _manager(setup: Setup, name: str):  # type: ignore[no-untyped-def]
    ref, ours = setup.build(events=False)
    return ref if name == "vllm" else ours


@pytest.mark.parametrize("n", [256, 1024])
@pytest.mark.parametrize("manager", ["vllm", "hybrid_alloc"])
def test_decode_step(benchmark, manager: str, n: int) -> None:  # type: ignore[no-untyped-def]
    m = _manager(GEMMA2, manager)
    rng = random.Random(n)
    reqs = [
        GEMMA2.make_request(f"r{i}", [rng.randrange(1, 30000) for _ in range(2048 + i % 16)], 100000) for i in range(n)
    ]
    for r in reqs:
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids(7)

    def advance() -> None:
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)

    def step() -> None:
        for r in reqs:
            m.allocate_slots(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)

    benchmark.group = f"decode step, {n} running"
    benchmark.extra_info["running_requests"] = n
    benchmark.extra_info["timer_overhead_ns_per_round"] = _timer_overhead_ns()
    benchmark.pedantic(step, setup=advance, rounds=96, iterations=1, warmup_rounds=2)
    _record(benchmark, ("decode_step", f"n={n}"), manager)
    if benchmark.stats is not None:
        benchmark.extra_info["us_per_running_request"] = benchmark.stats.stats.median / n * 1e6
    if manager == "hybrid_alloc":
        m.check_invariants()


class _Admission:
    """One request at a time through lookup, admission, block table and free."""

    def __init__(self, setup: Setup, manager: str, prompt_len: int, case: str) -> None:
        self.setup = setup
        self.m = _manager(setup, manager)
        self.prompt_len = prompt_len
        self.case = case
        self.rng = random.Random(prompt_len)
        self.prompt = self._tokens()
        self.counter = 0
        self.live: Any = None
        self.blocks: Any = None
        self.hit = 0
        # The warm case's prompt, cached by a first request.
        self._admit(self._new(), decode=True)
        self.finish()

    def _tokens(self) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(self.prompt_len)]

    def _new(self) -> Any:
        self.counter += 1
        toks = self.prompt if self.case == "warm" or self.counter == 1 else self._tokens()
        r = self.setup.make_request(f"a{self.counter}", toks, 16)
        self.live = r
        return r

    def lookup(self, r: Any) -> None:
        self.blocks, self.hit, _ = self.m.get_computed_blocks(r)

    def allocate(self, r: Any) -> None:
        out = self.m.allocate_slots(
            r,
            r.num_tokens - self.hit,
            num_new_computed_tokens=self.hit,
            new_computed_blocks=self.blocks,
            num_lookahead_tokens=0,
            num_external_computed_tokens=0,
            delay_cache_blocks=False,
            skip_zeroing_group_ids=(),
            num_encoder_tokens=0,
            full_sequence_must_fit=True,
            reserved_blocks=0,
            has_scheduled_reqs=False,
        )
        assert out is not None

    def block_table(self, r: Any) -> None:
        self.m.get_blocks(r.request_id).get_block_ids()

    def decode_once(self, r: Any) -> None:
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)
        assert self.m.allocate_slots(r, 1, num_lookahead_tokens=0) is not None
        r.num_computed_tokens += 1

    def _admit(self, r: Any, decode: bool = False) -> None:
        self.lookup(r)
        self.allocate(r)
        if decode:
            self.decode_once(r)

    def finish(self) -> None:
        if self.live is not None:
            self.m.free(self.live)
            self.live = None

    def setup_for(self, phase: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.finish()
        r = self._new()
        if phase in ("allocate", "block_table", "free"):
            self.lookup(r)
            assert (self.hit > 0) == (self.case == "warm")
        if phase in ("block_table", "free"):
            self.allocate(r)
        if phase == "free":
            self.decode_once(r)
        return (r,), {}


@pytest.mark.parametrize("case", ["cold", "warm"])
@pytest.mark.parametrize("phase", ["lookup", "allocate", "block_table", "free"])
@pytest.mark.parametrize("shape", list(ADMISSION))
@pytest.mark.parametrize("manager", ["vllm", "hybrid_alloc"])
def test_admission(benchmark, manager: str, shape: str, phase: str, case: str) -> None:  # type: ignore[no-untyped-def]
    setup, prompt_len = ADMISSION[shape]
    a = _Admission(setup, manager, prompt_len, case)
    target = {"lookup": a.lookup, "allocate": a.allocate, "block_table": a.block_table, "free": a.m.free}[phase]

    def run(r: Any) -> None:
        target(r)
        if phase == "free":
            a.live = None

    rounds = 12 if prompt_len > 100000 else 40
    benchmark.group = f"admission {shape} {case}: {phase}"
    benchmark.extra_info["prompt_tokens"] = prompt_len
    benchmark.extra_info["timer_overhead_ns_per_round"] = _timer_overhead_ns()
    benchmark.pedantic(run, setup=lambda: a.setup_for(phase), rounds=rounds, iterations=1, warmup_rounds=1)
    a.finish()
    _record(benchmark, ("admission", f"{shape} {case} {phase}"), manager)
    if manager == "hybrid_alloc":
        a.m.check_invariants()
