"""The release wheel as a user gets it: ``pip install`` of the wheel file into a fresh venv that
sees an installed vLLM (scripts/release-smoke.sh; ``HYBRID_ALLOC_WHEEL`` names the file). The
package, its compiled core, its metadata, the plugin's entry point and the ``hybrid-alloc``
console script all come from that venv; vLLM's plugin loader finds the plugin and vLLM's real
Scheduler, with ``HYBRID_ALLOC=1``, schedules through our manager."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import hybrid_alloc
from hybrid_alloc import _core

WHEEL = Path(os.environ["HYBRID_ALLOC_WHEEL"])
SITE = Path(sysconfig.get_paths()["purelib"])


def test_package_and_core_come_from_the_fresh_venv() -> None:
    assert Path(hybrid_alloc.__file__).parent == SITE / "hybrid_alloc"
    assert Path(_core.__file__) == SITE / "hybrid_alloc" / "_core.abi3.so"
    # The release build leaves out the bench's probe (cargo feature bench-probe).
    assert not hasattr(_core, "DecodeFloor")
    import vllm

    # vLLM sits beside it, in its own environment.
    assert not Path(vllm.__file__).is_relative_to(sys.prefix)


def test_installed_metadata_is_the_wheel_file() -> None:
    dist = importlib.metadata.distribution("hybrid-alloc")
    assert Path(str(dist.locate_file(""))) == SITE
    wheel_meta = dist.read_text("WHEEL") or ""
    tag = WHEEL.name[: -len(".whl")].split("-", 2)[2]
    assert [ln for ln in wheel_meta.splitlines() if ln.startswith("Tag: ")] == [f"Tag: {t}" for t in _expand(tag)]
    assert dist.read_text("INSTALLER") == "pip\n"


def _expand(tag: str) -> list[str]:
    py, abi, plats = tag.split("-")
    return [f"{py}-{abi}-{p}" for p in plats.split(".")]


def test_plugin_entry_point_and_console_script_are_registered() -> None:
    plugins = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    ep = plugins["hybrid_alloc"]
    assert ep.value == "hybrid_alloc.vllm.plugin:register"
    assert ep.dist is not None and ep.dist.name == "hybrid-alloc"
    from hybrid_alloc.vllm.plugin import register

    assert ep.load() is register
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["hybrid-alloc"] == "hybrid_alloc.cli:main"


def test_console_script_prints_its_help() -> None:
    script = Path(sys.prefix) / "bin" / "hybrid-alloc"
    # The venv's interpreter runs it (a path over 127 bytes gets pip's /bin/sh preamble instead).
    assert sys.executable in "\n".join(script.read_text().splitlines()[:3])
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: hybrid-alloc bench [options]")


# What every vLLM process does first (load the general plugins), then vLLM's real Scheduler for a
# small sliding-window + full model, one step with one request (checked), then the request to its
# end and a second one with the same prompt, which the first left in the prefix cache.
_STEP = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from hybrid_alloc.vllm import plugin
from hybrid_alloc.bench.offline import LayerKind, ModelShape, SchedulerSetup, fabricate_output, make_request
shape = ModelShape("tiny", (LayerKind("sliding_window", 64), LayerKind("full")), num_kv_heads=2, head_size=64,
                   weight_bytes=0, max_model_len=512)
sched = SchedulerSetup(shape, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=256).build_with_installed_manager()
prompt = list(range(1, 200))
sched.add_request(make_request(sched, "r0", prompt, 4))
so = sched.schedule()
groups = so.scheduled_new_reqs[0].block_ids
print("STEP", dict(so.num_scheduled_tokens), [len(g) for g in groups])
sched.update_from_output(so, fabricate_output(sched, so))
for _ in range(10):
    so = sched.schedule()
    sched.update_from_output(so, fabricate_output(sched, so))
sched.add_request(make_request(sched, "r1", prompt, 4))
so = sched.schedule()
print("HIT", sched.requests["r1"].num_computed_tokens)
m = sched.kv_cache_manager
print("MANAGER", type(m).__module__ + "." + type(m).__name__, plugin.applied())
"""


def test_one_scheduler_step_runs_through_the_plugin() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRID_ALLOC")}
    env["HYBRID_ALLOC"] = "1"
    out = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = dict(
        ln.split(" ", 1) for ln in out.stdout.splitlines() if ln.split(" ", 1)[0] in ("STEP", "HIT", "MANAGER")
    )
    assert lines["MANAGER"] == "hybrid_alloc.vllm.manager.HybridKVCacheManager True"
    # The whole 199-token prompt in one step, in 13 blocks of 16 tokens in each group.
    assert lines["STEP"] == "{'r0': 199} [13, 13]"
    assert int(lines["HIT"]) > 0
