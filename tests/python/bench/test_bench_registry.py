"""The one shape registry (``hybrid_alloc.bench.shapes``): ``hybrid-alloc bench``, ``hybrid-alloc
hits``, the offline scheduler and the tests read it, so its names hold together: each key is its
shape's name, each alias names a shape, every name the hits bench takes is there, and
``hybrid-alloc bench --help`` lists them all. And the block size the offline scheduler builds is
the one vLLM picks on a Hopper GPU, for every shape. Needs torch (the shapes' dtypes), not vLLM."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from hybrid_alloc.bench.hits_workloads import DEFAULT_PRESSURE, DEFAULT_SHAPES, SHAPE_NAMES, shapes  # noqa: E402
from hybrid_alloc.bench.shapes import ALIASES, SHAPES, LayerKind, by_name, hopper_block_size  # noqa: E402


def test_every_key_is_its_shapes_name_and_every_alias_names_a_shape() -> None:
    assert [k for k, s in SHAPES.items() if k != s.name] == []
    assert {a: n for a, n in ALIASES.items() if a in SHAPES or n not in SHAPES} == {}
    assert by_name("gptoss") is SHAPES["gpt-oss-120b"] and by_name("qwen35") is SHAPES["qwen35"]
    with pytest.raises(KeyError):
        by_name("no-such-shape")


def test_offline_block_size_is_vllms_hopper_block_size_for_every_shape() -> None:
    """``ModelShape.attention_block_size`` (what the offline scheduler builds) and
    ``hopper_block_size`` (vLLM's rule, written out) agree on every shape."""
    assert {n: s.attention_block_size(16) for n, s in SHAPES.items()} == {
        n: hopper_block_size(s) for n, s in SHAPES.items()
    }
    assert sum(1 for x in SHAPES["gemma3"].layers if x == LayerKind("full")) == 8


def test_every_shape_the_hits_bench_takes_is_in_the_registry() -> None:
    assert set(DEFAULT_SHAPES) <= set(SHAPE_NAMES)
    assert {size: set(by_shape) for size, by_shape in DEFAULT_PRESSURE.items()} == {
        "small": set(SHAPE_NAMES),
        "full": set(SHAPE_NAMES),
    }
    assert {n: s.name for n, s in shapes().items()} == {n: SHAPES[ALIASES.get(n, n)].name for n in SHAPE_NAMES}


def test_bench_help_lists_every_shape_and_alias() -> None:
    env = {**os.environ, "COLUMNS": "1000"}  # one line per option: argparse would break names at hyphens
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_alloc.cli", "bench", "--help"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    missing = [n for n in [*SHAPES, *ALIASES] if not re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", out.stdout)]
    assert missing == []
