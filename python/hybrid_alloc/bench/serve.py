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


def run_serve(shape: Any, manager: str, args: Any, window: int = 0) -> RunResult:
    """The closed loop on ``shape`` under ``manager``; ``window``: the scheduler's cache-aware
    admission window (0: off), from usage ``args.admission_threshold`` (None or absent: vLLM's)."""
    n = args.serve_clients
    stream = ServeRequests(
        args.serve_prompt_len, args.serve_output_len, args.serve_output_spread, args.serve_prefix_share
    )
    r = run_scenario(
        shape,
        manager,
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
    )
    r.extra["clients"] = n
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
