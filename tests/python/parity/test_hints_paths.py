"""The two ways KV hints reach the manager (issue 38), through the installed vLLM's own code, with
no model: every step is vLLM's, except the socket between the engine's two processes (a list).

(a) The envelope: ``LLMEngine.add_request(..., kv_hints=)`` (vLLM's method, on an engine whose
input processor is vLLM's, built on the offline scheduler's config) -> the engine-core client's
``add_request`` (the multiprocess ``SyncMPClient``: msgpack-encoded as it sends it; or the
in-process ``InprocClient``) -> ``EngineCore.preprocess_add_request`` (the msgpack decoder of
the engine core's input thread first) -> ``EngineCore.add_request`` -> vLLM's real ``Scheduler``
with our manager (hit-aware), whose request carries ``kv_hints``; then a scheduler step.

(b) ``vllm_xargs``: an OpenAI completion or chat request body, parsed by the server's pydantic
model (``model_validate_json``, as the server parses it), turned into ``SamplingParams`` by its
``to_sampling_params`` (``vllm_xargs`` -> ``extra_args``) and its session by the server's
``_get_session_id``, then path (a) with those sampling params.

Each test asserts what ``hints_of`` reads of the scheduler's request, so a release that drops
a field on the way (msgpack, a copy of the sampling params, a renamed argument) fails here."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hybrid_alloc.vllm.hints import Hints, hints_of

pytestmark = pytest.mark.vllm

PROMPT = list(range(1, 100))  # 99 tokens


class _Socket:
    """The engine-core client's input socket: keeps what it sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send_multipart(self, msg: tuple[Any, ...], copy: bool = True) -> None:
        self.sent.append(msg)


class _Outputs:
    """The engine's output processor (detokenizing is not on the path)."""

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class EnginePath:
    """vLLM's request path from ``LLMEngine.add_request`` to the scheduler, in this process:
    vLLM's methods on objects holding just what they read (``object.__new__``, the engine's
    own attributes set by hand), and a real scheduler with our manager."""

    def __init__(self, multiprocess: bool) -> None:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.core_client import InprocClient, SyncMPClient
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.serial_utils import MsgpackEncoder

        from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup

        self.sched = SchedulerSetup(SHAPES["gemma-2-27b"], manager="hybrid_alloc", num_blocks=400).build()
        vc = self.sched.vllm_config
        core = object.__new__(EngineCore)
        core.vllm_config = vc
        core.scheduler = self.sched
        core.mm_receiver_cache = None
        core.structured_output_manager = None
        core.request_block_hasher = self.sched._hybrid_alloc_block_hasher
        core.prefix_hash_config = None  # 0.34: hashes computed in the engine, as without a frontend hasher
        self.core = core
        self.socket = _Socket()
        if multiprocess:
            client: Any = object.__new__(SyncMPClient)
            client.is_dp = False
            client.core_engine = b"\x00\x00"
            client.encoder = MsgpackEncoder()
            client.input_socket = self.socket
            client.ensure_alive = lambda: None
        else:
            client = object.__new__(InprocClient)
            client.engine_core = core
        self.multiprocess = multiprocess
        engine = object.__new__(LLMEngine)
        engine.input_processor = InputProcessor(vc)
        engine.model_config = vc.model_config
        engine.output_processor = _Outputs()
        engine.engine_core = client
        engine.get_supported_tasks = lambda: ("generate",)
        self.engine = engine

    def add(self, request_id: str, params: Any, prompt: Any = None, **kwargs: Any) -> Any:
        """``LLMEngine.add_request`` of ``prompt`` (default: ``PROMPT``'s tokens) with ``params``
        and ``kwargs`` (``kv_hints=``, ``session_id=``); returns the scheduler's ``Request``."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.serial_utils import MsgpackDecoder

        if prompt is None:
            prompt = TokensPrompt(prompt_token_ids=PROMPT)
        rid = self.engine.add_request(request_id, prompt, params, **kwargs)
        if self.multiprocess:
            # What the engine core's input thread does with the frames (process_input_sockets).
            _identity, type_frame, *frames = self.socket.sent.pop()
            assert EngineCoreRequestType(bytes(type_frame)) == EngineCoreRequestType.ADD
            ecr = MsgpackDecoder(EngineCoreRequest).decode(frames)
            req, wave = EngineCore.preprocess_add_request(self.core, ecr)
            EngineCore.add_request(self.core, req, wave)
        return self.sched.requests[rid]

    def stats(self) -> dict[str, int]:
        """The manager's hint counters (``hint_stats``)."""
        return self.sched.kv_cache_manager.hint_stats()

    def step(self) -> None:
        """One scheduler step and its fabricated output (the manager reads the hints there)."""
        from hybrid_alloc.bench.offline import fabricate_output

        so = self.sched.schedule()
        self.sched.update_from_output(so, fabricate_output(self.sched, so))
        self.sched.kv_cache_manager.check_invariants()

    def run_out(self) -> None:
        """Steps until every request has finished (each is freed, its hints' end applied)."""
        for _ in range(1000):
            if not self.sched.requests:
                return
            self.step()
        raise AssertionError("the requests did not finish")


@pytest.fixture(params=["multiprocess", "inproc"])
def path(request: pytest.FixtureRequest) -> Iterator[EnginePath]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
        p = EnginePath(multiprocess=request.param == "multiprocess")
    from hybrid_alloc.vllm.manager import HybridKVCacheManager

    assert isinstance(p.sched.kv_cache_manager, HybridKVCacheManager)
    yield p


def _envelope(*actions: tuple[str, dict[str, Any]]) -> Any:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(
        protocol_version="0.1",
        message_id="m1",
        actions=[
            KvHintAction(action_id=str(i), action_type=t, action_version="1", payload=p)
            for i, (t, p) in enumerate(actions)
        ],
    )


def _params(extra_args: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4, ignore_eos=True, extra_args=extra_args)


# ---- (a) the envelope ---------------------------------------------------------------------


def test_envelope_reaches_the_schedulers_request(path: EnginePath) -> None:
    env = _envelope(
        ("kv.retain", {"priority": "low", "ttl_s": 30, "tokens": 64}),
        ("kv.pin", {"ttl_s": 600, "tokens": 32}),
        ("kv.checkpoint", {"positions": [64, 40]}),
        ("kv.release", {}),
        ("kv.fetch", {"keys": ["x"]}),
    )
    req = path.add("r1", _params(), kv_hints=env, session_id="chat-1")
    assert req.kv_hints == env
    assert hints_of(req) == Hints(
        retain="low",
        retain_ttl_s=30.0,
        retain_tokens=64,
        pin_ttl_s=600.0,
        pin_tokens=32,
        session="chat-1",
        release="chat-1",
        checkpoints=(40, 64),
    )
    path.step()
    # The manager took them at the request's first lookup, in that step.
    stats = path.stats()
    assert (stats["received"], stats["applied"], stats["refused"], stats["requests"]) == (1, 1, 0, 1), stats


def test_bad_envelope_reaches_and_is_refused_not_raised(path: EnginePath) -> None:
    env = _envelope(("kv.demote", {}), ("kv.pin", {"ttl_s": -5}), ("kv.checkpoint", {"positions": [500]}))
    req = path.add("r1", _params(), kv_hints=env)
    assert hints_of(req) == Hints(errors=("unknown_action", "bad_ttl", "bad_position"))
    path.step()
    stats = path.stats()
    assert (stats["received"], stats["applied"], stats["refused"], stats["requests"]) == (1, 0, 3, 0), stats


def test_no_hint_is_none(path: EnginePath) -> None:
    req = path.add("r1", _params({"kv_transfer_params_like": 1}))
    assert req.kv_hints is None
    assert hints_of(req) is None
    path.step()
    assert path.stats()["received"] == 0


# ---- (b) vllm_xargs through the OpenAI server's request conversion ---------------------------


def _server_params(kind: str, body: dict[str, Any]) -> tuple[Any, str | None]:
    """The sampling params and the session the OpenAI server makes of a JSON ``body`` (its
    pydantic request model, ``to_sampling_params``, ``_get_session_id``)."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    if kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model

        body = {"model": "m", "prompt": PROMPT, **body}
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model

        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    assert "max_tokens" in body
    request = Model.model_validate_json(json.dumps(body))
    return request.to_sampling_params(8, {}), GenerateBaseServing._get_session_id(request, None)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_vllm_xargs_reach_the_schedulers_request(path: EnginePath, kind: str) -> None:
    xargs = {
        "kv_retain": "high",
        "kv_retain_ttl": 120,
        "kv_pin_ttl": 2.5,
        "kv_pin_tokens": 64,
        "kv_release": True,  # a JSON true: the server's pydantic model makes it 1
        "kv_checkpoint": 48,  # an int (a list below)
    }
    params, session = _server_params(kind, {"max_tokens": 4, "session_id": "agent-7", "vllm_xargs": xargs})
    assert params.extra_args["kv_release"] == 1 and session == "agent-7"
    req = path.add("r1", params, session_id=session)
    assert hints_of(req) == Hints(
        retain="high",
        retain_ttl_s=120.0,
        pin_ttl_s=2.5,
        pin_tokens=64,
        session="agent-7",
        release="agent-7",
        checkpoints=(48,),
    )
    path.step()
    stats = path.stats()
    assert (stats["received"], stats["applied"], stats["refused"]) == (1, 1, 0), stats


def test_vllm_xargs_named_session_list_checkpoint_and_release_by_name(path: EnginePath) -> None:
    xargs = {"kv_session": "s2", "kv_checkpoint": [32, 64], "kv_release": "s1", "other_component": "x"}
    params, session = _server_params("completion", {"max_tokens": 4, "vllm_xargs": xargs})
    req = path.add("r1", params, session_id=session)
    assert hints_of(req) == Hints(session="s2", release="s1", checkpoints=(32, 64))
    path.step()


def test_vllm_xargs_bad_values_are_refused(path: EnginePath) -> None:
    xargs = {"kv_retain": "urgent", "kv_retain_ttl": 5, "kv_pin_ttl": 10**9, "kv_checkpoint": [0, 1000, 16]}
    params, session = _server_params("chat", {"max_tokens": 4, "vllm_xargs": xargs})
    req = path.add("r1", params, session_id=session)
    assert hints_of(req) == Hints(checkpoints=(16,), errors=("bad_priority", "bad_ttl", "bad_position", "bad_position"))
    path.step()


# ---- the examples of docs/hit-aware.md ("KV hints") ---------------------------------------------

DOCS = Path(__file__).resolve().parents[3] / "docs" / "hit-aware.md"


def _doc_block(lang: str, needle: str) -> str:
    """The fenced ``lang`` block of the KV hints section that contains ``needle``."""
    text = DOCS.read_text()
    section = text[text.index("## KV hints") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"one {lang} block with {needle!r} in the KV hints section"
    return found[0]


class _Tokenizer:
    """A stand-in for the example's Hugging Face tokenizer: one id per character, a BOS first."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [5 + ord(c) % 400 for c in text]


class _Engine:
    """A stand-in ``AsyncLLM``: ``generate`` binds its arguments to the installed
    ``AsyncLLM.generate``'s signature, then sends them down vLLM's request path (``EnginePath``)
    and runs the scheduler until the request finishes."""

    def __init__(self, path: EnginePath) -> None:
        self.path = path
        self.hints: list[Hints | None] = []
        self.shut = False

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        import inspect

        from vllm.v1.engine.async_llm import AsyncLLM

        bound = inspect.signature(AsyncLLM.generate).bind(self, *args, **kwargs).arguments
        req = self.path.add(
            bound["request_id"],
            bound["sampling_params"],
            prompt=bound["prompt"],
            kv_hints=bound.get("kv_hints"),
            session_id=bound.get("session_id"),
        )
        self.hints.append(hints_of(req))
        tokens = [7] * 3
        self.path.run_out()
        yield SimpleNamespace(outputs=[SimpleNamespace(text="ls *.py", token_ids=tokens)])

    def shutdown(self) -> None:
        self.shut = True


def test_docs_python_example_runs_through_vllms_request_path(path: EnginePath, monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    import transformers
    import vllm.engine.arg_utils
    from vllm.v1.engine.async_llm import AsyncLLM

    code = _doc_block("python", "AsyncLLM")
    engine = _Engine(path)
    real_args = vllm.engine.arg_utils.AsyncEngineArgs

    def engine_args(*args: Any, **kwargs: Any) -> Any:
        # Its arguments checked against the installed AsyncEngineArgs (which would look the model up).
        inspect.signature(real_args).bind(*args, **kwargs)
        return SimpleNamespace(**kwargs)

    def from_engine_args(cls: Any, engine_args: Any, *args: Any, **kwargs: Any) -> _Engine:
        inspect.signature(AsyncLLM.from_engine_args).bind(engine_args, *args, **kwargs)
        return engine

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(vllm.engine.arg_utils, "AsyncEngineArgs", engine_args)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(from_engine_args))
    for var in ("HYBRID_ALLOC", "HYBRID_ALLOC_POLICY"):  # the example sets them; put them back after
        monkeypatch.setenv(var, "")
    exec(compile(code, str(DOCS), "exec"), {"__name__": "__docs__"})
    system_len = len(_Tokenizer().encode("You are a coding agent. Answer with one shell command per line."))
    turn = Hints(retain="high", retain_ttl_s=120.0, session="agent-7", checkpoints=(system_len,))
    assert engine.hints == [turn, dataclasses.replace(turn, release="agent-7")]
    assert engine.shut


@pytest.mark.parametrize("last", [False, True])
def test_docs_curl_example_through_the_servers_request_model(path: EnginePath, last: bool) -> None:
    code = _doc_block("bash", "curl")
    assert "/v1/chat/completions" in code
    body = json.loads(code[code.index("-d '") + 4 : code.rindex("'")])
    if last:  # "The session's last turn adds "kv_release": true to vllm_xargs."
        body["vllm_xargs"]["kv_release"] = True
    params, session = _server_params("chat", body)
    req = path.add("r1", params, session_id=session)
    assert hints_of(req) == Hints(
        retain="high",
        retain_ttl_s=120.0,
        session="agent-7",
        release="agent-7" if last else None,
        checkpoints=(17,),
    )
    path.run_out()
