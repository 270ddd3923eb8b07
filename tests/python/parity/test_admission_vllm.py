"""vLLM 0.34's cache-aware admission and prefix-cache hit limit with our manager.

- ``get_num_cached_tokens`` (the probe admission asks of waiting requests): the seeded
  mini-scheduler of ``parity_driver`` drives vLLM's manager and ours, and between its
  operations both are probed for waiting, running and fresh requests (shared prefixes cut at
  and around block boundaries, a running request's own tokens, requests with a positive
  ``prefix_cache_hit_limit``, where vLLM's probe still answers for ``num_tokens - 1``, and
  with limit 0, where it answers 0). The answers must be vLLM's, and nothing of ours may
  change: free count, free queue order, pending events, prefix cache stats, registered
  requests, pending pins, the probed request's attributes; and since only ours is probed
  before each lookup, the trace itself proves the probe changed nothing vLLM would see.
  Under ``HYBRID_ALLOC_POLICY=hit-aware`` the reference is an unprobed hit-aware twin of
  ours, with a prefix pinned in both.
- Cache-aware admission (``cache_aware_admission_window``): vLLM's real Scheduler on a
  serving-shaped workload (arrivals replace finished requests, shared prefixes, a pool small
  enough that usage crosses the threshold, preemption) run with vLLM's manager and ours: the
  SchedulerOutputs, the waiting queue's order, every probe's answer, the events, usage and
  free counts are identical at every step; the window changes the schedule (a run without
  it differs); under hit-aware the run keeps the invariants after every step, finishes, and
  hits at least what vLLM's manager hits.
- Bounded prefix reuse for prompt-logprob requests (``prompt_logprob_start`` with
  ``skip_reading_prefix_cache=False``): the hit is capped at the start, rounded down to
  blocks, exactly as vLLM's manager caps it, through ``get_computed_blocks`` and through
  the real Scheduler; a default prompt-logprob request reads nothing and records no stats.

Each test skips, with the reason, on a vLLM without the feature (probed, not by version)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _require_probe() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if not hasattr(KVCacheManager, "get_num_cached_tokens"):
        pytest.skip("this vLLM's KVCacheManager has no get_num_cached_tokens (vLLM 0.34 added it)")


def _require_admission() -> None:
    from hybrid_alloc.bench.offline import CACHE_AWARE_ADMISSION

    if not CACHE_AWARE_ADMISSION:
        pytest.skip("this vLLM's SchedulerConfig has no cache_aware_admission_window (vLLM 0.34 added it)")


def _require_hit_limit() -> None:
    from hybrid_alloc.vllm import compat

    if not compat.PREFIX_CACHE_HIT_LIMIT:
        pytest.skip("this vLLM's Request has no prefix_cache_hit_limit / prompt_logprob_start (vLLM 0.34 added them)")


def _logprob_params(start: int | None) -> dict[str, Any]:
    """``SamplingParams`` arguments of a prompt-logprob request: with ``start``, one that may
    reuse the prefix cache up to ``start`` (limit ``start``); ``None``: vLLM's default, which
    skips reading the prefix cache (limit 0)."""
    if start is None:
        return {"prompt_logprobs": 1}
    return {"prompt_logprobs": 1, "prompt_logprob_start": start, "skip_reading_prefix_cache": False}


# ---- get_num_cached_tokens --------------------------------------------------------------


def _our_state(mgr: Any) -> tuple[Any, ...]:
    """Everything of our manager a probe could change."""
    a = mgr._alloc
    return (
        a.num_free_blocks,
        a.free_queue_order(),
        a.num_requests,
        a.has_events,
        len(mgr._event_log.events),
        sorted(mgr._reqs),
        mgr._hit_gen,
        mgr._fast.num_tracked,
        copy.deepcopy(vars(mgr.prefix_cache_stats)),
        [list(p) for p in mgr._pending_pins],
        mgr.usage,
    )


def _request_state(req: Any) -> dict[str, Any]:
    """Every attribute of a vLLM Request, copied (read-only list views as lists: they
    compare by identity)."""
    return {k: list(v) if type(v).__name__ == "ConstantList" else copy.copy(v) for k, v in vars(req).items()}


def _probe_run_cls() -> type[Any]:
    from hybrid_alloc.vllm.manager import HybridKVCacheManager
    from parity_driver import ParityRun

    class ProbeRun(ParityRun):
        """``ParityRun`` with probes: before every lookup of the trace our manager alone is
        probed for the request (the probe must equal the hit the lookup then finds), and
        between operations both managers are probed for many requests (the answers must be
        equal, ours must leave every piece of state alone). ``twin``: the reference is a
        second manager of ours, never probed (hit-aware, where vLLM's answers differ)."""

        def __init__(self, setup: Any, seed: int, twin: bool = False) -> None:
            super().__init__(setup, seed)
            self.twin = twin
            if twin:
                self.ref = HybridKVCacheManager(**setup.manager_kwargs(events=True))
                assert type(self.ref) is HybridKVCacheManager
            self.stats.update(
                probes=0, probe_hits=0, probe_zero=0, limited=0, limit_below_probe=0, no_read=0, lookup_checks=0
            )
            self.num_probe_reqs = 0
            ours = self.ours
            lookup = ours.get_computed_blocks

            def get_computed_blocks(request: Any, *bound: Any) -> Any:
                state, attrs = _our_state(ours), _request_state(request)
                probe = ours.get_num_cached_tokens(request)
                self.eq("our state after the probe before a lookup", state, _our_state(ours))
                self.eq("the request after the probe before a lookup", attrs, _request_state(request))
                out = lookup(request, *bound)
                if not bound:
                    self.eq(f"probe vs lookup of {request.request_id}", probe, out[1])
                    self.stats["lookup_checks"] += 1
                return out

            ours.get_computed_blocks = get_computed_blocks

        def fresh_requests(self) -> list[Any]:
            r = self.rng
            bs = self.setup.hash_block_size
            reqs: list[Any] = []

            def add(toks: list[int], **sampling: Any) -> None:
                self.num_probe_reqs += 1
                reqs.append(self.setup.make_request(f"probe{self.num_probe_reqs}", toks, **sampling))

            for _ in range(3):
                p = list(r.choice(self.prefixes))
                cut = r.choice([len(p), bs * (len(p) // bs), bs * (len(p) // bs) + 1, r.randrange(1, len(p) + 1)])
                tail = [r.randrange(1, 5000) for _ in range(r.randrange(0, 40))] if r.random() < 0.5 else []
                add(p[: max(cut, 1)] + tail)
            if self.running:
                src = r.choice(self.running)
                add(list(src.all_token_ids)[: r.randrange(1, src.num_tokens + 1)])
            p = list(r.choice(self.prefixes)) + [r.randrange(1, 5000) for _ in range(r.randrange(1, 60))]
            add(p, **_logprob_params(r.randrange(0, len(p) + 32)))
            add(p, **_logprob_params(None))
            return reqs

        def probe_round(self) -> None:
            for req in list(self.waiting) + list(self.running) + self.fresh_requests():
                self.check_probe(req)
            self.after_op()

        def check_probe(self, req: Any) -> None:
            state, attrs = _our_state(self.ours), _request_state(req)
            ours = self.ours.get_num_cached_tokens(req)
            self.eq(f"our state after probing {req.request_id}", state, _our_state(self.ours))
            self.eq(f"{req.request_id} after its probe", attrs, _request_state(req))
            if not self.twin:
                self.eq(f"get_num_cached_tokens({req.request_id})", self.ref.get_num_cached_tokens(req), ours)
            assert 0 <= ours <= req.num_tokens - 1, (req.request_id, ours, req.num_tokens)
            st = self.stats
            st["probes"] += 1
            st["probe_hits"] += ours > 0
            st["probe_zero"] += ours == 0
            limit = req.prefix_cache_hit_limit
            if limit == 0:
                assert ours == 0, f"{req.request_id}: a request that may not read the cache probed {ours}"
                st["no_read"] += self.setup.enable_caching
            elif limit is not None:
                st["limited"] += 1
                # vLLM's probe answers for num_tokens - 1, not the limit.
                st["limit_below_probe"] += ours > limit

        def misc(self) -> None:
            if self.rng.random() < 0.3:
                self.probe_round()
            super().misc()

        def full_check(self) -> None:
            if not self.twin:
                return super().full_check()
            for req in list(self.running) + list(self.waiting):
                rid = req.request_id
                self.eq(f"blocks of {rid}", self.ref.get_block_ids(rid), self.ours.get_block_ids(rid))
            self.eq("free queue order", self.ref._alloc.free_queue_order(), self.ours._alloc.free_queue_order())
            self.ref.check_invariants()
            self.ours.check_invariants()
            a, b = self.ref.make_prefix_cache_stats(), self.ours.make_prefix_cache_stats()
            self.eq("prefix cache stats", vars(a), vars(b))

    return ProbeRun


def _setup(name: str) -> Any:
    from mamba_harness import MAMBA_SETUPS
    from vllm_harness import SETUPS

    return next(s for s in SETUPS + MAMBA_SETUPS if s.name == name)


PROBE_SETUPS = [
    "full_bs16",
    "full_swa_bs16",
    "gemma3_full_swa_swa_bs16",
    "full_chunked_bs16",
    "swa_bs32_over_full_bs16",
    "full_swa_nocache_bs16",
    "qwen35_gdn_3to1_align",
    "nemotron_h_mamba2_align",
    "full_swa_mamba_align",
    # The EAGLE drop (``use_eagle``): a hybrid lookup matches one block past the bound.
    "eagle_drop_full_bs16",
    "eagle_drop_full_swa_bs16",
    "eagle_drop_swa_bs32_over_full_bs16",
]


@pytest.mark.parametrize("name", PROBE_SETUPS)
def test_get_num_cached_tokens_is_vllms_and_pure(name: str) -> None:
    _require_probe()
    setup = _setup(name)
    stats = _probe_run_cls()(setup, seed=3).run(1500)
    assert stats["probes"] > 200, stats
    assert stats["no_read"] > 0 or not setup.enable_caching, stats
    if setup.enable_caching:
        # Probes found hits and misses, bounded requests were probed past their limit, and
        # the lookups of the trace were preceded by probes.
        assert stats["probe_hits"] > 20 and stats["probe_zero"] > 20, stats
        assert stats["limit_below_probe"] > 0, stats
        assert stats["lookup_checks"] > 20 and stats["hit_tokens"] > 0, stats
    else:
        assert stats["probe_hits"] == 0, stats


@pytest.mark.parametrize("name", ["full_swa_bs16", "gemma3_full_swa_swa_bs16", "qwen35_gdn_3to1_align"])
def test_get_num_cached_tokens_pure_under_hit_aware(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hit-aware: our probed manager and an unprobed twin take the same trace identically
    (block ids, free queue order, events, stats, invariants), with a prefix pinned in both:
    the probe neither pins it nor moves anything; each probe equals the next lookup's hit."""
    _require_probe()
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    run = _probe_run_cls()(_setup(name), seed=5, twin=True)
    assert run.ours._alloc.policy == "hit-aware" and run.ref._alloc.policy == "hit-aware"
    for m in (run.ref, run.ours):
        m.pin_prefix(run.prefixes[0])
    stats = run.run(1500)
    assert stats["probes"] > 200 and stats["probe_hits"] > 20 and stats["limit_below_probe"] > 0, stats
    assert stats["lookup_checks"] > 20, stats
    # The pin was taken by a lookup, never by a probe (a probe would have diverged the twins).
    assert not run.ours._pending_pins and not run.ref._pending_pins


# ---- cache-aware admission through vLLM's real Scheduler --------------------------------


def _shapes() -> dict[str, Any]:
    import torch

    from hybrid_alloc.bench.offline import LayerKind, MambaState, ModelShape

    def tiny(name: str, layers: tuple[Any, ...], state: Any = None) -> Any:
        return ModelShape(
            name, layers, num_kv_heads=2, head_size=64, weight_bytes=0, max_model_len=2048, mamba_state=state
        )

    return {
        "gemma2": tiny(
            "tiny-gemma2", tuple(LayerKind("sliding_window", 64) if i % 2 == 0 else LayerKind("full") for i in range(4))
        ),
        "llama": tiny("tiny-llama", tuple(LayerKind("full") for _ in range(4))),
        # Nemotron-H-style Mamba2 + attention (prefix caching: Mamba cache mode "align").
        "nemotron": tiny(
            "tiny-nemotron-h",
            tuple(LayerKind("full") if i % 7 == 6 else LayerKind("mamba") for i in range(14)),
            MambaState(shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32), mamba_type="MAMBA2"),
        ),
    }


# (shape, pool blocks, threshold (None: vLLM's default 0.5), async scheduling). The pools are
# small enough that usage reaches the threshold; the 0.5 case's pool is one where usage
# crosses it both ways during the run.
ADMISSION_CASES: dict[str, tuple[str, int, float | None, bool]] = {
    "gemma2_w8_t0": ("gemma2", 250, 0.0, False),
    "gemma2_w8_default": ("gemma2", 400, None, False),
    "gemma2_w8_t0_async": ("gemma2", 300, 0.0, True),
    "llama_w8_t0": ("llama", 150, 0.0, False),
    "nemotron_w8_t0": ("nemotron", 300, 0.0, False),
}


def _admission_setup(case: str, window: int = 8) -> Any:
    from hybrid_alloc.bench.offline import SchedulerSetup

    shape, blocks, threshold, async_scheduling = ADMISSION_CASES[case]
    return SchedulerSetup(
        _shapes()[shape],
        num_blocks=blocks,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        kv_events=True,
        async_scheduling=async_scheduling,
        admission_window=window,
        admission_threshold=threshold,
    )


def _serve(setup: Any, **kw: Any) -> dict[str, Any]:
    from sched_driver import run_serving_workload

    return run_serving_workload(setup, seed=5, num_requests=60, concurrency=20, **kw)


@pytest.mark.parametrize("case", list(ADMISSION_CASES))
def test_admission_identical_to_vllm(case: str) -> None:
    from sched_driver import assert_same_run

    _require_admission()
    base = _admission_setup(case)
    ref = _serve(dataclasses.replace(base, manager="vllm"))
    ours = _serve(dataclasses.replace(base, manager="hybrid_alloc"))
    assert_same_run(case, ref, ours)
    for key in ("waiting", "probes", "free", "reordered_steps"):
        for i, (a, b) in enumerate(zip(ref[key], ours[key])):
            assert a == b, f"{case}: {key} differs at {i}"
        assert len(ref[key]) == len(ours[key]), key
    # The workload exercised admission: probes of cached and uncached waiting requests in
    # one step, reorders, preemption where the pool is that small.
    mixed = [s for s in ref["probes"] if any(n for _, n in s) and any(not n for _, n in s)]
    assert len(mixed) > 10, f"{case}: too few steps probing both cached and uncached requests"
    assert len(ref["reordered_steps"]) >= 5, ref["reordered_steps"]
    assert ref["aborted"] and ref["hits"] > 0
    threshold = ADMISSION_CASES[case][2]
    if threshold is None:
        # Below vLLM's default threshold (0.5) nothing is probed, however deep the queue.
        quiet = [
            i
            for i in range(1, len(ref["usage"]))
            if ref["usage"][i - 1] < 0.5 and len(ref["waiting"][i - 1]) >= 2 and not ref["probes"][i]
        ]
        assert quiet and any(ref["probes"]), "usage did not cross the threshold both ways"
    else:
        assert ref["preemptions"] > 0, f"{case}: no preemption; make the pool smaller"
    # The window reached the scheduler: without it, the same workload schedules otherwise.
    off = _serve(dataclasses.replace(base, manager="vllm", admission_window=0, admission_threshold=None))
    assert off["finished"] and not any(off["probes"])
    assert off["steps"] != ref["steps"]


@pytest.mark.parametrize("case", ["gemma2_w8_t0", "gemma2_w8_default", "nemotron_w8_t0"])
def test_admission_under_hit_aware(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hit-aware with the window on: the invariants hold after every step, every request
    finishes, and the hits are at least those of vLLM's manager on the same workload."""
    _require_admission()
    base = _admission_setup(case)
    ref = _serve(dataclasses.replace(base, manager="vllm"))
    monkeypatch.setenv("HYBRID_ALLOC_POLICY", "hit-aware")
    policies: list[str] = []

    def check(sched: Any) -> None:
        sched.kv_cache_manager.check_invariants()
        policies.append(sched.kv_cache_manager._alloc.policy)

    aware = _serve(dataclasses.replace(base, manager="hybrid_alloc"), after_step=check)
    assert aware["native"] == "HybridKVCacheManager" and set(policies) == {"hit-aware"}
    assert aware["finished"] and ref["finished"]
    assert any(aware["probes"]) and aware["reordered_steps"]
    assert aware["hits"] >= ref["hits"], (aware["hits"], ref["hits"])


# ---- bounded prefix reuse for prompt-logprob requests -----------------------------------


def _dense_cls() -> type[Any]:
    from hybrid_alloc.bench.offline import SchedulerSetup

    class Dense(SchedulerSetup):
        """Dense retention (``prefix_cache_retention_interval=None``): sliding-window and
        Mamba groups keep every block's content cached, so a hit may end anywhere."""

        def vllm_config(self) -> Any:
            vc = super().vllm_config()
            vc.cache_config.prefix_cache_retention_interval = None
            return vc

    return Dense


@pytest.mark.parametrize("name", ["full_bs16", "full_swa_bs16", "nemotron_h_mamba2_align_retention0"])
def test_prompt_logprob_start_caps_the_hit(name: str) -> None:
    """A cached 1000-token prompt re-sent with ``prompt_logprob_start=K`` (reading the cache)
    gets vLLM's hit, capped at K rounded down to blocks (K=500: 496 tokens with 16-token
    blocks); the probe still answers for the whole prompt; ``prompt_logprob_start=0`` and
    vLLM's default prompt-logprob request (limit 0) read nothing and record no stats."""
    import random

    _require_hit_limit()
    setup = _setup(name)
    ref, ours = setup.build(events=True)
    rng = random.Random(1)
    prompt = [rng.randrange(1, 30000) for _ in range(1000)]
    for m in (ref, ours):
        first = setup.make_request("first", prompt)
        assert m.allocate_slots(first, first.num_tokens) is not None
        first.num_computed_tokens = first.num_tokens
        m.cache_blocks(first, first.num_tokens)
        m.free(first)
    assert ref.take_events() == ours.take_events()
    bs = setup.hash_block_size
    capped = 0
    for i, start in enumerate([None, 0, 1, 15, 16, 17, 100, 500, 991, 992, 999, 1000, 5000]):
        got = []
        for m in (ref, ours):
            req = setup.make_request(f"again{i}", prompt, **_logprob_params(start))
            before = copy.deepcopy(vars(m.prefix_cache_stats))
            blocks, n, boundary = m.get_computed_blocks(req)
            m.record_prefix_cache_stats(req, n)
            recorded = vars(m.prefix_cache_stats) != before
            got.append((n, blocks.get_block_ids(), boundary, m.get_num_cached_tokens(req), recorded))
            m.free(req)  # the hit's blocks were not taken: nothing to give back
        assert got[0] == got[1], (start, got)
        n, _, _, probe, recorded = got[0]
        if not start:
            assert (n, probe, recorded) == (0, 0, False), (start, got[0])
            continue
        assert recorded and n <= min(start, 999) and n % bs == 0, (start, got[0])
        assert probe >= n
        if name == "full_bs16":
            assert n == min(start, 999) // bs * bs, (start, n)
            assert probe == 992
        capped += n < probe
    assert capped >= 5, "the limit capped too few hits"
    if name == "full_bs16":
        # The example of the 0.34 notes: 1000 cached tokens, start 500 -> 496; the probe 992.
        req = setup.make_request("example", prompt, **_logprob_params(500))
        assert ours.get_computed_blocks(req)[1] == 496 and ours.get_num_cached_tokens(req) == 992
    assert ref.take_events() == ours.take_events()


@pytest.mark.parametrize(
    "shape,dense", [("llama", False), ("gemma2", False), ("gemma2", True), ("nemotron", False), ("nemotron", True)]
)
def test_prompt_logprob_start_through_the_scheduler(shape: str, dense: bool) -> None:
    """Through vLLM's real Scheduler: a prompt served once, then re-sent with
    ``prompt_logprob_start`` values and as a default prompt-logprob request; the scheduled
    hits, the SchedulerOutputs, the events and the prefix-cache stats are vLLM's."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from hybrid_alloc.bench.offline import SchedulerSetup, fabricate_output, make_request
    from sched_driver import capture_events, digest

    _require_hit_limit()
    rng = random.Random(2)
    prompt = [rng.randrange(1, 30000) for _ in range(1000)]
    starts: list[int | None] = [500, None, 0, 37, 2000, 300]
    runs = []
    for manager in ("vllm", "hybrid_alloc"):
        sched = (_dense_cls() if dense else SchedulerSetup)(
            _shapes()[shape], manager=manager, num_blocks=400, max_num_seqs=4, max_num_batched_tokens=64, kv_events=True
        ).build()
        mgr = sched.kv_cache_manager
        # The scheduled hit of each request, each step's digest, the prefix-cache stats the
        # scheduler reports each step (requests, queries, hits).
        run: dict[str, Any] = dict(native=type(mgr).__name__, hits=[], steps=[], stats=[], bs=sched.block_size)
        run["events"] = capture_events(mgr)
        reqs = [make_request(sched, "first", prompt, 4)]
        for i, start in enumerate(starts):
            sp = SamplingParams(max_tokens=4, ignore_eos=True, **_logprob_params(start))
            reqs.append(Request(f"again{i}", list(prompt), sp, None, block_hasher=sched._hybrid_alloc_block_hasher))
        for req in reqs:  # one after another
            sched.add_request(req)
            while sched.get_num_unfinished_requests():
                so = sched.schedule()
                run["steps"].append(digest(so))
                run["hits"].extend((r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs)
                for out in sched.update_from_output(so, fabricate_output(sched, so)).values():
                    pcs = out.scheduler_stats.prefix_cache_stats
                    run["stats"].append((pcs.requests, pcs.queries, pcs.hits))
        runs.append(run)
    ref, ours = runs
    assert (ref["native"], ours["native"]) == ("KVCacheManager", "HybridKVCacheManager")
    assert ref["steps"] == ours["steps"] and ref["events"] == ours["events"] and ref["stats"] == ours["stats"]
    hit = dict(ref["hits"])
    assert hit == dict(ours["hits"])
    bs = ref["bs"]
    assert hit["again0"] <= 500 and hit["again3"] <= 37 and hit["again5"] <= 300, hit
    assert all(hit[f"again{i}"] % bs == 0 for i in range(len(starts))), hit
    # A limit of 0 (vLLM's default prompt-logprob request, or prompt_logprob_start=0).
    assert hit["again1"] == hit["again2"] == 0, hit
    # The bound: a limit at or past the prompt's end takes the unbounded hit (992: the last
    # token is recomputed); 500 and 300 round down to 496 and 288 where the content there is
    # cached: always for full attention, under dense retention for the sliding-window and
    # Mamba groups (vLLM's sparse default keeps their content only at the prompt's end).
    assert hit["again4"] == 992, hit
    if shape == "llama" or dense:
        assert (hit["again0"], hit["again5"]) == (496, 288), hit
    # The requests with limit 0 recorded no prefix-cache query; the others did.
    assert sum(r for r, _, _ in ref["stats"]) == 1 + len(starts) - 2, ref["stats"]
    assert sum(h for _, _, h in ref["stats"]) == sum(hit.values()), (ref["stats"], hit)
