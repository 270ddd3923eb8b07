"""A pytest plugin that runs vLLM's own ``tests/v1/core/`` against hybrid_alloc's manager
(``scripts/vllm-tests.sh`` loads it with ``-p vllm_core_gate``; never imported by the package).

At ``pytest_configure``, before vLLM's test modules are imported:

- the vLLM plugin is applied as vLLM would apply it (``HYBRID_ALLOC=1``: ``register()``), so a
  ``Scheduler`` builds hybrid_alloc's manager through the plugin's factory;
- ``vllm.v1.core.kv_cache_manager.KVCacheManager`` is bound to the same factory, so a test
  that builds ``KVCacheManager(...)`` directly (it imports the name when collected) builds ours
  too. The factory falls back to vLLM's own manager, with one line, for what the core does not
  serve, as it does for a user;
- the factory is wrapped to count, per test, the managers built natively and by the fallback.

Exclusions: ``tests/vllm_core_exclusions.txt`` (see its header): each excluded test is
deselected, with its reason, and listed in the summary. An entry that matches no test of a file
the run collected fails the run (a stale exclusion must go).

At the end, a table per test file: passed, failed, skipped, excluded, and how many tests built
hybrid_alloc's manager, vLLM's (a fallback) or none. ``HYBRID_ALLOC_GATE_JSON=PATH`` writes it,
and each test's outcome, as JSON too.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

# HYBRID_ALLOC_GATE_BASELINE=1: the same run with vLLM's own manager (which tests fail here
# whatever the manager: the environment's failures).
BASELINE = os.environ.get("HYBRID_ALLOC_GATE_BASELINE") == "1"
EXCLUSIONS = Path(__file__).resolve().parents[2] / "vllm_core_exclusions.txt"

# The models vLLM's tests name, as config.json files made from the installed transformers' own
# config classes (model_type, and the fields that differ from its defaults, from each model's
# published config), reached through vLLM's VLLM_MODEL_REDIRECT_PATH: no hub is reachable here,
# and the scheduler reads nothing of a model but its config.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "facebook/opt-125m": ("opt", {"architectures": ["OPTForCausalLM"], "torch_dtype": "float16"}),
    "facebook/opt-350m": (
        "opt",
        {
            "architectures": ["OPTForCausalLM"],
            "torch_dtype": "float16",
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "ffn_dim": 4096,
            "word_embed_proj_dim": 512,
            "do_layer_norm_before": False,
        },
    ),
    "Qwen/Qwen1.5-7B": (
        "qwen2",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "torch_dtype": "bfloat16",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 32768,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    ),
    "Qwen/Qwen3-0.6B": (
        "qwen3",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "torch_dtype": "bfloat16",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
    ),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (
        "qwen3_next",
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "torch_dtype": "bfloat16",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "intermediate_size": 5120,
            "max_position_embeddings": 262144,
            "vocab_size": 151936,
        },
    ),
    "llava-hf/llava-1.5-7b-hf": (
        "llava",
        {
            "architectures": ["LlavaForConditionalGeneration"],
            "torch_dtype": "float16",
            "image_token_index": 32000,
            "pad_token_id": 32001,
            "projector_hidden_act": "gelu",
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "text_config": {
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-05,
                "vocab_size": 32064,
            },
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 1024,
                "image_size": 336,
                "intermediate_size": 4096,
                "num_attention_heads": 16,
                "num_hidden_layers": 24,
                "patch_size": 14,
                "projection_dim": 768,
            },
        },
    ),
    "Qwen/Qwen2.5-VL-3B-Instruct": (
        "qwen2_5_vl",
        {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "torch_dtype": "bfloat16",
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128000,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "image_token_id": 151655,
            "video_token_id": 151656,
            "vision_start_token_id": 151652,
            "vision_config": {
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "out_hidden_size": 2048,
                "num_heads": 16,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
            },
        },
    ),
}


def _tokenizer(vocab_size: int, specials: dict[str, int], **roles: str) -> Any:
    """A word-level tokenizer of ``vocab_size`` plain tokens (``t0``, ``t1``, ...) and
    ``specials`` at their ids: the multimodal processors need one to find their placeholder
    tokens, and a model's own tokenizer cannot be downloaded here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size) if i not in specials.values()}
    vocab.update(specials)
    t = Tokenizer(models.WordLevel(vocab, unk_token=roles.get("unk_token", next(iter(specials)))))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=t, **roles)


def _llava_processor(folder: Path) -> None:
    """llava-1.5's processor: CLIP's image processor at 336 px, ``<image>`` = 32000."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = _tokenizer(
        32000,
        {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 32000, "<pad>": 32001},
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    image = CLIPImageProcessor(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    LlavaProcessor(
        image_processor=image,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    ).save_pretrained(folder)


def _qwen25_vl_processor(folder: Path) -> None:
    """Qwen2.5-VL's processor: Qwen2-VL's image and video processors (their defaults are the
    model's), its vision and chat special tokens at their ids."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tok = _tokenizer(
        151643,
        {
            "<|endoftext|>": 151643,
            "<|im_start|>": 151644,
            "<|im_end|>": 151645,
            "<|vision_start|>": 151652,
            "<|vision_end|>": 151653,
            "<|image_pad|>": 151655,
            "<|video_pad|>": 151656,
        },
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=tok, video_processor=Qwen2VLVideoProcessor()
    ).save_pretrained(folder)


PROCESSORS = {"llava-hf/llava-1.5-7b-hf": _llava_processor, "Qwen/Qwen2.5-VL-3B-Instruct": _qwen25_vl_processor}


def write_models(root: Path) -> Path:
    """Writes each of :data:`MODELS`' config.json below ``root`` (and, for the multimodal
    ones, a processor where the environment can build it: :data:`PROCESSORS`) and the redirect file naming them (vLLM's
    ``VLLM_MODEL_REDIRECT_PATH`` format, JSON); returns the redirect file."""
    from transformers import AutoConfig

    redirect = {}
    for name, (model_type, fields) in MODELS.items():
        folder = root / name.replace("/", "--")
        AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
        if name in PROCESSORS:
            try:
                PROCESSORS[name](folder)
            except ImportError:
                # The environment lacks what the processor needs (0.32.0's: torchvision, which
                # breaks vLLM's CPU build): the tests naming the model fail with any manager.
                pass
        redirect[name] = str(folder)
    path = root / "redirect.json"
    path.write_text(json.dumps(redirect, indent=1))
    return path


def use_test_platform() -> None:
    """Where vLLM finds no platform (its CUDA wheel on a machine without a GPU: 0.33.0 and
    0.34.0 here; 0.32.0's CPU build has its own), a platform that answers what the scheduler
    asks as vLLM's GPU platforms do: device type ``cpu`` (vLLM's ``DeviceConfig("auto")``
    raises on the empty one) and hybrid KV cache groups supported (so ``VllmConfig`` keeps
    sliding-window and Mamba layers in their own groups, as on a GPU). Set before any vLLM
    module binds ``current_platform``."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    if platforms.resolve_current_platform_cls_qualname() != "vllm.platforms.interface.UnspecifiedPlatform":
        return

    class TestPlatform(UnspecifiedPlatform):
        device_type = "cpu"
        device_name = "cpu"
        dispatch_key = "CPU"

        @classmethod
        def support_hybrid_kv_cache(cls) -> bool:
            return True

    platforms._current_platform = TestPlatform()


def vllm_release() -> str:
    from hybrid_alloc.vllm.plugin import vllm_release as release

    r = release()
    assert r is not None, "vLLM is not installed"
    return r


def read_exclusions(path: Path, release: str) -> list[tuple[str, str]]:
    """The ``(pattern, reason)`` pairs of ``path`` that apply to ``release``.

    Format: a ``# ...`` line is a comment; ``[RELEASES]`` (space-separated, or ``*``) starts a
    section; in it, a line ``PATTERN  -- REASON`` excludes the tests whose node id (below
    ``tests/v1/core/``) matches PATTERN (``fnmatch``; ``[`` in a parametrized id is matched
    literally). A pattern without a reason is an error."""
    out: list[tuple[str, str]] = []
    applies = False
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            releases = line[1:-1].split()
            applies = "*" in releases or release in releases
            continue
        pattern, sep, reason = line.partition(" -- ")
        if not sep or not reason.strip() or not pattern.strip():
            raise pytest.UsageError(f"{path}:{n}: an exclusion is 'PATTERN -- REASON': {raw!r}")
        if applies:
            out.append((pattern.strip(), reason.strip()))
    return out


def _match(nodeid: str, pattern: str) -> bool:
    # fnmatch reads [..] as a character class; parametrized ids are matched literally there.
    return fnmatch.fnmatchcase(nodeid, pattern.replace("[", "[[]"))


class Gate:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.release = vllm_release()
        wanted = os.environ.get("HYBRID_ALLOC_REQUIRE_VLLM", "")
        if wanted and wanted != self.release:
            raise pytest.UsageError(f"HYBRID_ALLOC_REQUIRE_VLLM={wanted} but the installed vLLM is {self.release}")
        self.exclusions = read_exclusions(EXCLUSIONS, self.release)
        self.used: Counter[str] = Counter()
        self.excluded: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self.built: dict[str, Counter[str]] = defaultdict(Counter)
        self.current: str | None = None
        use_test_platform()
        models = Path(tempfile.mkdtemp(prefix="hybrid_alloc-gate-models-"))
        config.add_cleanup(lambda: shutil.rmtree(models, ignore_errors=True))
        os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(write_models(models))
        self._patch()

    def _patch(self) -> None:
        if BASELINE:
            # vLLM's own manager in the same environment (vLLM loads hybrid_alloc's entry
            # point itself where it loads plugins: the flag keeps it off).
            os.environ["HYBRID_ALLOC"] = "0"
            return
        os.environ["HYBRID_ALLOC"] = "1"
        from vllm.v1.core import kv_cache_manager as kvm
        from vllm.v1.core.sched import scheduler as sched_mod

        from hybrid_alloc.vllm import plugin
        from hybrid_alloc.vllm.manager import HybridKVCacheManager

        plugin.register()
        if not plugin.applied():
            raise pytest.UsageError("hybrid_alloc's vLLM plugin did not apply (see the log line above)")
        factory = sched_mod.KVCacheManager

        def KVCacheManager(*args: Any, **kwargs: Any) -> Any:
            m = factory(*args, **kwargs)
            if self.current is not None:
                self.built[self.current]["native" if isinstance(m, HybridKVCacheManager) else "vllm"] += 1
            return m

        sched_mod.KVCacheManager = KVCacheManager
        kvm.KVCacheManager = KVCacheManager  # type: ignore[misc]

    def modifyitems(self, items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            nodeid = item.nodeid.removeprefix("tests/v1/core/")
            reason = None
            for pattern, why in self.exclusions:
                if _match(nodeid, pattern):
                    self.used[pattern] += 1
                    reason = why if reason is None else reason
            if reason is None:
                keep.append(item)
            else:
                self.excluded[item.nodeid] = reason
                drop.append(item)
        # Stale: an entry matching no test of a file this run collected (a run of some files
        # only checks their entries).
        files = {item.nodeid.removeprefix("tests/v1/core/").split("::")[0] for item in items}
        stale = [
            p
            for p, _ in self.exclusions
            if not self.used[p] and any(fnmatch.fnmatchcase(f, p.split("::")[0]) for f in files)
        ]
        if stale:
            raise pytest.UsageError(f"exclusions matching no test of vLLM {self.release}: {stale}")
        if drop:
            self.config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def summary(self, tr: Any) -> None:
        files: dict[str, Counter[str]] = defaultdict(Counter)
        for nodeid, outcome in self.outcome.items():
            f = files[nodeid.split("::")[0]]
            f[outcome] += 1
            b = self.built.get(nodeid, Counter())
            f["built native" if b["native"] else "built vllm" if b["vllm"] else "built none"] += 1
        for nodeid in self.excluded:
            files[nodeid.split("::")[0]]["excluded"] += 1
        cols = ["passed", "failed", "skipped", "excluded", "built native", "built vllm", "built none"]
        tr.section(f"vLLM {self.release}'s tests/v1/core against hybrid_alloc")
        tr.write_line(f"{'file':60} " + " ".join(f"{c:>12}" for c in cols))
        total: Counter[str] = Counter()
        for name in sorted(files):
            total.update(files[name])
            tr.write_line(f"{name.removeprefix('tests/v1/core/'):60} " + " ".join(f"{files[name][c]:12}" for c in cols))
        tr.write_line(f"{'total':60} " + " ".join(f"{total[c]:12}" for c in cols))
        if self.excluded:
            tr.write_line("excluded:")
            for nodeid, reason in sorted(self.excluded.items()):
                tr.write_line(f"  {nodeid}: {reason}")
        out = os.environ.get("HYBRID_ALLOC_GATE_JSON")
        if out:
            data = {
                "release": self.release,
                "files": {k: dict(v) for k, v in sorted(files.items())},
                "tests": self.outcome,
                "built": {k: dict(v) for k, v in self.built.items()},
                "excluded": self.excluded,
            }
            Path(out).write_text(json.dumps(data, indent=1, sort_keys=True))


_gate: Gate | None = None


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own fixture (its tests/conftest.py, which the gate does not load)."""
    import logging

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture) -> Any:
    """vLLM's own fixture (its tests/conftest.py, which the gate does not load)."""
    import logging

    with caplog.at_level(logging.INFO):
        yield caplog


def pytest_configure(config: pytest.Config) -> None:
    global _gate
    _gate = Gate(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    assert _gate is not None
    _gate.modifyitems(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    assert _gate is not None
    _gate.current = item.nodeid
    try:
        return (yield)
    finally:
        _gate.current = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    assert _gate is not None
    if report.when == "call" or report.outcome != "passed":
        prev = _gate.outcome.get(report.nodeid)
        if prev != "failed":  # a failed setup or teardown makes the test failed
            _gate.outcome[report.nodeid] = "failed" if report.outcome == "failed" else report.outcome
    elif report.nodeid not in _gate.outcome:
        _gate.outcome[report.nodeid] = "passed"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    assert _gate is not None
    _gate.summary(terminalreporter)
