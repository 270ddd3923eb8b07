"""The ``serve`` workload of ``hybrid-alloc bench``: what a serving engine pays for its KV
cache manager, in a closed loop.

``clients`` requests are always in vLLM's real scheduler (prefix caching on): each finished
request is replaced at once by a new one, as a server under steady load sees. A request's
prompt is ``prompt_len`` tokens, the first ``prefix_share`` of them one system prompt that
every request shares (the rest random), and it generates an output length drawn uniformly
from ``output_len - output_spread`` to ``output_len + output_spread`` tokens, so finishes
(and arrivals) are staggered. The pool holds every client at its longest. Measuring starts
once half the clients have been replaced (the loop is in its steady state), then runs
``steps`` steps: half timed (KV time), half bare (the whole step).

Managers (``--managers``): ``vllm`` (vLLM's own), ``hybrid_alloc`` (ours, the policy
``HYBRID_ALLOC_POLICY`` names: exact by default), ``hit_aware`` (ours under hit-aware),
``floor`` (the probe), and ``hybrid_alloc+hints`` / ``hit_aware+hints``: the same with KV hints
on every request (:func:`serve_hints`: a retain at the high level, a pin lease on the shared
system prompt, a checkpoint at its end, and a session; TTLs of ``--serve-hints-ttl`` wall
seconds, so leases expire during the run), sent as vLLM's envelope or as ``vllm_xargs``
(``--serve-hints-via``). A ``+hints`` row gives, besides its ratios to vLLM's row, what the
hints add to its own row without them (``hints_kv_us_per_request_delta``): the cost target of
issue 38. ``two_level`` is ours (exact) over the two-level form of the same pool (issue 37:
attention blocks of ``--serve-small-block`` tokens, default 64, inside state-sized pages; the
capacity bench's construction, :func:`hybrid_alloc.bench.capacity_run.build_setup`), on a
state-space shape only; its row gives its KV time per running request over ``hybrid_alloc``'s
(``two_level_kv_per_request_x``, means and call p50s): issue 37's CPU target.

With ``--admission-window N`` (vLLM 0.34's ``--cache-aware-admission-window``; repeatable,
0 is off) the workload runs once per window, each its own scenario (``serve-1024``,
``serve-1024-window16``) paired against vLLM's manager under the same window: each step the
scheduler asks ``get_num_cached_tokens`` of the first N waiting requests once ``usage``
reaches ``--admission-threshold`` (vLLM's default 0.5), a call the KV time counts. The
arrivals share one system prompt and nothing else, so the probes find equal prefixes and the
order stays (ties keep arrival order): what the row shows is what the probes cost.

Every figure says which statistic it is. Means add up (a step's KV mean is the sum of its
calls' means per step), so the totals, shares and the zero-KV bound are means; medians are
given beside them where a reader asks "what does one call cost".
"""

from __future__ import annotations

import random
from typing import Any

from hybrid_alloc.bench.common import render_table, say, say_parts
from hybrid_alloc.bench.hits_report import window_label
from hybrid_alloc.bench.runner import RunResult, run_scenario

SERVE_MODELS = ("gemma-2-27b", "qwen3.5-style", "deepseek-v4-style")
#: The managers the serve workload runs (``--managers``): ``+hints`` is the manager before it
#: with KV hints on every request.
SERVE_MANAGERS = (
    "vllm",
    "hybrid_alloc",
    "floor",
    "hit_aware",
    "hybrid_alloc+hints",
    "hit_aware+hints",
    "two_level",
)
#: The small attention block of the ``two_level`` row when ``--serve-small-block`` is not given.
SERVE_SMALL_BLOCK = 64
# The calls told apart per call (``clock._classifiers``), in the order printed.
PER_CALL = (
    ("allocate_slots/no-op", "decode allocate_slots, no new block"),
    ("allocate_slots/crossing", "decode allocate_slots, a new block"),
    ("blocks.get_block_ids/empty", "get_block_ids on the empty result"),
    ("blocks.get_block_ids/ids", "get_block_ids on a result with blocks"),
    ("get_computed_blocks/all", "get_computed_blocks (lookup)"),
    ("allocate_slots/admission", "allocate_slots, admission"),
    ("allocate_slots/chunk", "allocate_slots, prefill chunk"),
    ("get_blocks/all", "get_blocks (NewRequestData)"),
    ("free/all", "free"),
    ("get_num_cached_tokens/all", "get_num_cached_tokens (admission probe)"),
)


class ServeRequests:
    """The closed loop's request stream: request ``k`` is the same for every manager (its
    tokens and output length come from ``k`` and the seed alone)."""

    def __init__(self, prompt_len: int, output_len: int, output_spread: int, prefix_share: float, seed: int = 7):
        if not 0.0 <= prefix_share <= 1.0:
            raise SystemExit(f"--serve-prefix-share must be between 0 and 1, not {prefix_share}")
        if output_spread >= output_len:
            raise SystemExit(f"--serve-output-spread ({output_spread}) must be below --serve-output-len ({output_len})")
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.output_spread = output_spread
        self.seed = seed
        rng = random.Random(seed)
        self.prefix = rng.choices(range(1, 30000), k=int(prompt_len * prefix_share))

    def __call__(self, k: int) -> tuple[str, list[int], int]:
        rng = random.Random(self.seed * 1_000_003 + k)
        tail = rng.choices(range(1, 30000), k=self.prompt_len - len(self.prefix))
        out = rng.randint(self.output_len - self.output_spread, self.output_len + self.output_spread)
        return f"sv{k}", self.prefix + tail, out

    def max_tokens(self) -> int:
        return self.prompt_len + self.output_len + self.output_spread


def serve_pool_blocks(clients: int, max_tokens: int, block_size: int = 16) -> int:
    """Blocks for every client at its longest in two groups, with headroom (as the decode
    scenario sizes its pool)."""
    per_req = -(-(max_tokens + 64) // block_size) + 2
    return clients * per_req * 2 + 64


def serve_scenario(clients: int, window: int) -> str:
    """The scenario's name: ``serve-N``, and ``-windowW`` with a cache-aware admission window."""
    return f"serve-{clients}" + (f"-window{window}" if window else "")


def serve_hints(prefix_len: int, ttl_s: float, via: str) -> Any:
    """The KV hints every request of a ``+hints`` row carries, as more arguments of
    ``offline.make_request`` for a request ``(id, prompt)``: retain its prefix at the high level
    for ``ttl_s`` seconds, a pin lease of ``ttl_s`` on the shared system prompt (its
    ``prefix_len`` tokens) and a checkpoint at its end (both left out without one), in the
    request's own session (its id). ``via``: "envelope" (vLLM's ``KvHintsEnvelope``,
    ``Request.kv_hints``) or "xargs" (``SamplingParams.extra_args``, as the OpenAI server fills
    it from ``vllm_xargs``)."""
    from hybrid_alloc.bench.offline import hints_envelope

    if via not in ("envelope", "xargs"):
        raise SystemExit(f"--serve-hints-via takes envelope or xargs, not {via!r}")

    def hints(rid: str, toks: list[int]) -> dict[str, Any]:
        if via == "xargs":
            xargs: dict[str, Any] = {"kv_retain": "high", "kv_retain_ttl": ttl_s, "kv_session": rid}
            if prefix_len:
                xargs.update(kv_pin_ttl=ttl_s, kv_pin_tokens=prefix_len, kv_checkpoint=prefix_len)
            return {"extra_args": xargs}
        actions: list[tuple[str, dict[str, Any]]] = [
            ("kv.retain", {"priority": "high", "ttl_s": ttl_s, "session": rid})
        ]
        if prefix_len:
            actions += [
                ("kv.pin", {"ttl_s": ttl_s, "tokens": prefix_len}),
                ("kv.checkpoint", {"positions": [prefix_len]}),
            ]
        return {"kv_hints": hints_envelope(rid, actions)}

    return hints


def run_serve(shape: Any, manager: str, args: Any, window: int = 0) -> RunResult:
    """One serve row: ``manager`` is one of :data:`SERVE_MANAGERS`; ``window``: the scheduler's
    cache-aware admission window (0: off), from usage ``args.admission_threshold`` (None or
    absent: vLLM's)."""
    n = args.serve_clients
    stream = ServeRequests(
        args.serve_prompt_len, args.serve_output_len, args.serve_output_spread, args.serve_prefix_share
    )
    base = manager.removesuffix("+hints")
    small = (getattr(args, "serve_small_block", None) or SERVE_SMALL_BLOCK) if base == "two_level" else None
    hints = None
    if base != manager:
        ttl = getattr(args, "serve_hints_ttl", 5.0)
        hints = serve_hints(len(stream.prefix), ttl, getattr(args, "serve_hints_via", "envelope"))
    r = run_scenario(
        shape,
        "hybrid_alloc" if base in ("hit_aware", "two_level") else base,
        serve_scenario(n, window),
        [stream(k) for k in range(n)],
        num_blocks=serve_pool_blocks(n, stream.max_tokens()),
        kv_budget=None,
        max_num_seqs=n,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_steps=args.serve_steps,
        refill=stream,
        warmup_finished=n // 2,
        admission_window=window,
        admission_threshold=getattr(args, "admission_threshold", None) if window else None,
        policy="hit-aware" if base == "hit_aware" else None,
        hints=hints,
        label=manager,
        two_level_small=small,
    )
    r.extra["clients"] = n
    if small is not None:
        r.extra["small_block"] = small
    return r


def kv_from_medians(row: dict[str, Any]) -> float:
    """KV us per step from each kind of call's median times its calls per step (the kinds of
    ``PER_CALL``), plus the mean per step of the calls not told apart (a few per step):
    what the KV time per step is when no call is stretched by the machine preempting this
    process mid-call (on a busy machine, the mean's tail is mostly that)."""
    pc = row.get("per_call", {})
    told = {key.split("/")[0] for key in pc}
    total = sum(v["median_us"] * v["calls_per_step"] for v in pc.values())
    return total + sum(v["us_per_step"] for name, v in row.get("kv_breakdown", {}).items() if name not in told)


def serve_ratios(rows: list[dict[str, Any]]) -> None:
    """Adds to each ``serve`` row of ours its ratios to vLLM's row of the same model and
    scenario (the same admission window): KV (means per step), whole step (means, wall and
    CPU), and the zero-KV bound (vLLM's mean step minus vLLM's mean KV time per step)."""
    base = {
        (r["model"], r["scenario"]): r for r in rows if r["scenario"].startswith("serve") and r["manager"] == "vllm"
    }
    for r in rows:
        if not r["scenario"].startswith("serve"):
            continue
        r["kv_share_of_step"] = r["kv_us_mean"] / r["step_us_mean"] if r["step_us_mean"] else 0.0
        r["kv_us_from_medians"] = kv_from_medians(r)
        r["kv_us_per_request_from_medians"] = r["kv_us_from_medians"] / max(1.0, r["running_mean"])
        b = base.get((r["model"], r["scenario"]))
        if b is None or r is b:
            continue
        r["serve_kv_x"] = b["kv_us_mean"] / r["kv_us_mean"] if r["kv_us_mean"] else float("inf")
        r["serve_kv_x_from_medians"] = (
            b["kv_us_from_medians"] / r["kv_us_from_medians"] if r["kv_us_from_medians"] else float("inf")
        )
        r["serve_step_x"] = b["step_us_mean"] / r["step_us_mean"] if r["step_us_mean"] else float("inf")
        r["serve_step_cpu_x"] = b["step_cpu_us_mean"] / r["step_cpu_us_mean"] if r["step_cpu_us_mean"] else 0.0
        bound = b["step_us_mean"] - b["kv_us_mean"]
        r["zero_kv_bound_us"] = bound
        r["step_over_bound"] = r["step_us_mean"] / bound if bound > 0 else float("inf")
    hints_deltas(rows)
    two_level_ratios(rows)


def two_level_ratios(rows: list[dict[str, Any]]) -> None:
    """Adds to each ``two_level`` serve row its KV time per running request per step over the
    ``hybrid_alloc`` row's (same model and scenario: ours, today's layout): from the means
    (``two_level_kv_per_request_x``) and from the call medians
    (``two_level_kv_per_request_x_from_medians``). Issue 37's target: at most 1.10."""
    serve = [r for r in rows if r["scenario"].startswith("serve")]
    ours = {(r["model"], r["scenario"]): r for r in serve if r["manager"] == "hybrid_alloc"}
    for r in serve:
        b = ours.get((r["model"], r["scenario"]))
        if r["manager"] != "two_level" or b is None:
            continue
        if b["kv_us_per_running_request_mean"]:
            r["two_level_kv_per_request_x"] = r["kv_us_per_running_request_mean"] / b["kv_us_per_running_request_mean"]
        if b.get("kv_us_per_request_from_medians"):
            r["two_level_kv_per_request_x_from_medians"] = (
                r.get("kv_us_per_request_from_medians", 0.0) / b["kv_us_per_request_from_medians"]
            )


def hints_deltas(rows: list[dict[str, Any]]) -> None:
    """Adds to each ``+hints`` serve row what the hints add to the same manager's row without
    them (same model): KV time per running request per step, from the means
    (``hints_kv_us_per_request_delta``) and from the call medians
    (``hints_kv_us_per_request_delta_from_medians``)."""
    serve = [r for r in rows if r["scenario"].startswith("serve")]
    plain = {(r["model"], r["manager"]): r for r in serve if not r["manager"].endswith("+hints")}
    for r in serve:
        b = plain.get((r["model"], r["manager"].removesuffix("+hints")))
        if b is None or b is r:
            continue
        r["hints_kv_us_per_request_delta"] = r["kv_us_per_running_request_mean"] - b["kv_us_per_running_request_mean"]
        if "kv_us_per_request_from_medians" in r and "kv_us_per_request_from_medians" in b:
            r["hints_kv_us_per_request_delta_from_medians"] = (
                r["kv_us_per_request_from_medians"] - b["kv_us_per_request_from_medians"]
            )


def print_serve_table(rows: list[dict[str, Any]], release: str | None, wide: bool = False) -> None:
    """The headline table: one line per model and manager of the ``serve`` workload (and per
    admission window, in a ``window`` column, when some row ran with one). By default its main
    columns, which fit 80 columns; ``wide`` (``--wide``) every column."""
    serve = [r for r in rows if r["scenario"].startswith("serve") and r["manager"] != "no_hybrid"]
    if not serve:
        return
    windows = any(r.get("admission_window") for r in serve)
    for r in serve:
        r["window"] = window_label(r)
    cols = [
        ("model", "model", "{}"),
        ("manager", "manager", "{}"),
        ("clients", "clients", "{}"),
        ("running_mean", "running (mean)", "{:.0f}"),
        ("hit_rate", "hit rate", "{:.3f}"),
        ("kv_us_mean", "KV us/step (mean)", "{:.0f}"),
        ("kv_us_median", "KV us/step (p50)", "{:.0f}"),
        ("kv_us_per_running_request_mean", "KV us/req (mean)", "{:.3f}"),
        ("serve_kv_x", "KV x (means)", "{:.1f}"),
        ("kv_us_per_request_from_medians", "KV us/req (call p50s)", "{:.3f}"),
        ("serve_kv_x_from_medians", "KV x (call p50s)", "{:.1f}"),
        ("step_us_mean", "step us (mean, wall)", "{:.0f}"),
        ("step_cpu_us_mean", "step us (mean, CPU)", "{:.0f}"),
        ("serve_step_x", "step x (wall)", "{:.2f}"),
        ("kv_share_of_step", "KV share of step", "{:.1%}"),
        ("zero_kv_bound_us", "vLLM step - vLLM KV", "{:.0f}"),
        ("step_over_bound", "step / that bound", "{:.3f}"),
        ("waiting_mean", "waiting (mean)", "{:.1f}"),
    ]
    caption = None
    if not wide:
        cols = [
            ("model", "model", "{}"),
            ("manager", "manager", "{}"),
            ("kv_us_per_running_request_mean", "KV us/req", "{:.3f}"),
            ("serve_kv_x", "KV x", "{:.1f}"),
            ("serve_kv_x_from_medians", "KV x p50s", "{:.1f}"),
            ("step_us_mean", "step us", "{:.0f}"),
            ("serve_step_x", "step x", "{:.2f}"),
        ]
        caption = (
            "KV us/req: KV time per running request per step; x: vLLM's / ours; step: schedule() + "
            "update_from_output(), wall; every column (hit rate, CPU time, the zero-KV bound): --wide, or bench.json"
        )
    if windows:  # the window (N@threshold) beside the manager; with --wide, the steps that probed
        cols.insert(2, ("window", "window", "{}"))
        if wide:
            cols.append(("probe_steps", "steps that probed", "{:.0%}"))
    title = (
        f"serve: closed loop, vLLM {release} scheduler, prefix caching on; "
        "means per step over the measured steps (KV on timed steps, step on bare ones)"
    )
    render_table(title, cols, serve, caption, wide)
    say(
        "call p50s: each kind of call's median times its calls per step, plus the mean of the calls not told "
        "apart (robust to a busy machine, which stretches the means)",
        wide,
    )
    for r in serve:
        if "hints_kv_us_per_request_delta" in r:
            c = r.get("hint_counters") or {}
            say(
                f"hints, {r['model']} {r['manager']}: {r['hints_kv_us_per_request_delta']:+.3f} us per running request "
                f"per step (means), {r.get('hints_kv_us_per_request_delta_from_medians', float('nan')):+.3f} (call "
                f"p50s) against {r['manager'].removesuffix('+hints')}; hints received {c.get('received', '-')}, "
                f"applied {c.get('applied', '-')}, refused {c.get('refused', '-')}, expired {c.get('expired', '-')}",
                wide,
            )
    for r in serve:
        if "two_level_kv_per_request_x" in r:
            say(
                f"two-level pages, {r['model']}: KV us per running request per step {r['kv_us_per_running_request_mean']:.3f}"
                f" (means) / {r.get('kv_us_per_request_from_medians', float('nan')):.3f} (call p50s), "
                f"{r['two_level_kv_per_request_x']:.3f}x / {r.get('two_level_kv_per_request_x_from_medians', float('nan')):.3f}x"
                f" hybrid_alloc's ({r.get('slots_per_page', '?')} small blocks of {r.get('small_block', '?')} tokens "
                f"a page; {r['num_blocks']} pages)",
                wide,
            )
    say("per call, us (median / mean; calls per step):", wide)
    for r in serve:
        pc = r.get("per_call", {})
        parts = [
            f"{label} {pc[key]['median_us']:.2f} / {pc[key]['mean_us']:.2f} ({pc[key]['calls_per_step']:.1f})"
            for key, label in PER_CALL
            if key in pc
        ]
        head = f"{r['model']} {r['manager']}" + (f" window {r['window']}" if windows else "")
        say_parts(f"{head}: ", parts, "; ", wide, indent="  ")
