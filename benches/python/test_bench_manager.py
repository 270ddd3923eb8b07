"""pytest-benchmark: one scheduler step's KV-manager calls on the identical call trace,
through vLLM 0.32.0's own KVCacheManager and through hybrid_alloc's, on the gemma-2-27b
shape (sliding window 4096 and full attention, block 16).

    pytest benches/python --benchmark-only --benchmark-group-by=param:n

- ``decode``: N running requests (1024-token contexts) each get ``allocate_slots(r, 1)``,
  as the scheduler's running loop calls it; the tokens advance between rounds.
- ``admit``: a 6144-token request resending a cached prompt (vLLM's default retention
  keeps the sliding-window tail at the prompt's replay boundary): the prefix lookup and
  the first allocation, then its free.
"""

from __future__ import annotations

import logging

import pytest

logging.disable(logging.WARNING)

vllm = pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_harness import Setup, full, swa  # noqa: E402

GEMMA2 = Setup("gemma2", [full(16), swa(4096, 16)], num_blocks=200000, max_model_len=8192, max_in_flight_tokens=8192)


def _manager(name: str):  # type: ignore[no-untyped-def]
    ref, ours = GEMMA2.build(events=False)
    return ref if name == "vllm" else ours


@pytest.mark.parametrize("n", [256, 1024])
@pytest.mark.parametrize("manager", ["vllm", "hybrid_alloc"])
def test_decode_step(benchmark, manager: str, n: int) -> None:  # type: ignore[no-untyped-def]
    m = _manager(manager)
    reqs = [GEMMA2.make_request(f"r{i}", list(range(1 + i, 1025 + i)), 100000) for i in range(n)]
    for r in reqs:
        assert m.allocate_slots(r, 1024) is not None
        r.num_computed_tokens = 1024
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids(7)

    def advance() -> None:
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)

    def step() -> None:
        for r in reqs:
            m.allocate_slots(r, 1, num_lookahead_tokens=0)

    benchmark.extra_info["running_requests"] = n
    benchmark.pedantic(step, setup=advance, rounds=96, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("manager", ["vllm", "hybrid_alloc"])
def test_admit_with_prefix_hit(benchmark, manager: str) -> None:  # type: ignore[no-untyped-def]
    m = _manager(manager)
    prompt = list(range(1, 6145))
    first = GEMMA2.make_request("first", prompt, 10)
    m.allocate_slots(first, first.num_tokens)
    counter = iter(range(10**9))

    def make():  # type: ignore[no-untyped-def]
        return (GEMMA2.make_request(f"a{next(counter)}", prompt, 10),), {}

    def admit(r) -> None:  # type: ignore[no-untyped-def]
        blocks, hit, _ = m.get_computed_blocks(r)
        assert hit == 6128
        m.allocate_slots(r, r.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        m.free(r)

    benchmark.pedantic(admit, setup=make, rounds=40, iterations=1, warmup_rounds=2)
