"""The GPU side of a decode step: Gemma-2-27b-shaped attention (random weights) over a paged
KV cache laid out by hybrid_alloc's block tables, checked against dense attention.

    python benches/gpu/paged_attention.py                      # GPU: 256 and 1024 running
    python benches/gpu/paged_attention.py --device cpu --running 4 --context 96 --window 32 \\
        --steps 24 --layer-pairs 1                             # CPU smoke run (the test does this)

What runs:
- hybrid_alloc's native allocator (``hybrid_alloc.Allocator``, no vLLM) serves N requests the
  way vLLM's scheduler drives it for gemma-2-27b: two KV cache groups, sliding window
  (``--window``, 4096) and full attention, block size 16, one pool. Each decode step makes
  one ``allocate_slots`` call per request (and reads its new no-op limits), except the steps
  the allocator's no-op limits prove change nothing (as the vLLM adapter's FastAllocate
  does), and the new block ids are appended to
  per-group block tables, as vLLM's worker does with ``new_block_ids``. The pool is sized
  tightly, so the sliding-window blocks that leave the window are recycled to other
  requests, which overwrite them.
- Per layer pair (one sliding-window layer and one full layer, sharing one KV tensor of
  ``num_blocks x 16`` slots, as vLLM lays out a hybrid model's pool), on the device: q/k/v
  projections of a random hidden state (hidden 4608, 32 query heads, 16 KV heads of 128),
  the new token's k/v written to the slot its block table names, paged attention that
  gathers each request's blocks by block table (full layer: every token; sliding-window
  layer: the last ``window`` tokens, Gemma-2's logit soft-cap 50 and query scale 144^-0.5),
  and the output projection.
- Check: for a subset of requests (``--check``), dense attention over the same tokens,
  built without any block table (a prompt token's k/v is a deterministic function of
  request, position and layer; a decode token's is recomputed from its hidden state), must
  match the paged result. ``--self-test`` then corrupts one block id of a full-attention
  table and points one in-window sliding-window entry at a block this request held before it
  left the window (recycled since), and checks that each shows as a mismatch.

Reports GPU time per decode step (all layer pairs run, and scaled to gemma-2-27b's 23 pairs)
next to the CPU time hybrid_alloc's calls took for the same step. The figure of the whole
scheduler step comes from ``hybrid-alloc bench`` (``decode-N``), which needs vLLM; this script
needs only torch and hybrid_alloc's wheel. Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_alloc import Allocator

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4608, 32, 16, 128
GEMMA2_LAYER_PAIRS = 23
SOFTCAP = 50.0
SCALE = 144**-0.5
BLOCK = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Batch:
    """N decoding requests served by hybrid_alloc's allocator, and their block tables as the
    worker keeps them (new block ids appended; ids the sliding window released stay in the
    table, as in vLLM's worker, and must never be read)."""

    n: int
    context: int
    window: int
    steps: int
    alloc: Allocator = field(init=False)
    handles: list[int] = field(init=False)
    lengths: list[int] = field(init=False)  # tokens with a slot (k/v written)
    prompt: list[int] = field(init=False)
    tables: list[list[list[int]]] = field(init=False)  # [group][request] -> block ids
    limits: list[tuple[int, int, int]] = field(init=False)
    released: list[dict[int, int]] = field(init=False)  # request -> {block id: table index} left the window
    owners: dict[int, set[int]] = field(init=False)  # sliding-window block id -> requests that held it
    cpu_ns: list[int] = field(default_factory=list)
    crossings: int = 0

    SWA, FULL = 0, 1

    def __post_init__(self) -> None:
        self.prompt = [self.context + (i * 5) % BLOCK for i in range(self.n)]
        top = max(self.prompt) + self.steps + 1
        per_req = cdiv(top, BLOCK) + min(cdiv(top, BLOCK), cdiv(self.window, BLOCK) + 2)
        # Tight: what the requests hold at the end, plus one prompt's transient
        # sliding-window blocks (released right after its prefill).
        num_blocks = self.n * per_req + cdiv(top, BLOCK) + 16
        self.alloc = Allocator(
            num_blocks=num_blocks,
            groups=[("sliding_window", BLOCK, 0, self.window, 0), ("full", BLOCK, 1, 0, 0)],
            hash_block_size=BLOCK,
            scheduler_block_size=BLOCK,
            max_model_len=top + BLOCK,
            max_in_flight_tokens=top + BLOCK,
            enable_caching=False,
        )
        self.handles, self.lengths, self.limits, self.released = [], [], [], []
        self.tables = [[], []]
        self.owners = {}

    def admit(self, i: int) -> None:
        """Request i's prefill allocation (its whole prompt)."""
        p = self.prompt[i]
        h = self.alloc.add_request()
        res = self.alloc.allocate_slots(h, p, num_computed_tokens=0, num_prompt_tokens=p, num_tokens=p)
        if res is None:
            raise RuntimeError(f"request {i}: the prompt does not fit")
        self.handles.append(h)
        self.lengths.append(0)
        self.limits.append(self.alloc.noop_limits(h))
        self.released.append({})
        for g in (self.SWA, self.FULL):
            self.tables[g].append(list(res[g]))
            for b in res[g]:
                self.owners.setdefault(b, set()).add(i)

    def after_prefill(self, i: int) -> None:
        """What the request's next ``allocate_slots`` does first: the sliding window lets go of
        the blocks before it (they return to the pool, for other requests to reuse)."""
        h = self.handles[i]
        self.lengths[i] = self.prompt[i]
        self.alloc.remove_skipped_blocks(h, self.prompt[i])
        self.limits[i] = self.alloc.noop_limits(h)

    def decode_step(self) -> list[int]:
        """One scheduler step's allocation for every request (one new token each); returns the
        position of each request's new token. CPU time of the allocator calls is recorded."""
        pc = time.perf_counter_ns
        t0 = pc()
        new_pos = []
        for i, h in enumerate(self.handles):
            pos = self.lengths[i]
            computed = pos  # tokens whose k/v exist; this step adds the token at ``pos``
            slots, processed = self.limits[i][:2]
            if computed + 1 <= slots and computed < processed:
                new_pos.append(pos)  # nothing to allocate or free: no crossing (as FastAllocate)
                continue
            res = self.alloc.allocate_slots(
                h, 1, num_computed_tokens=computed, num_prompt_tokens=self.prompt[i], num_tokens=pos + 1
            )
            self.crossings += 1
            self.limits[i] = self.alloc.noop_limits(h)
            if res is None:
                raise RuntimeError(f"request {i}: out of blocks at position {pos}")
            for g in (self.SWA, self.FULL):
                self.tables[g][i].extend(res[g])
                for b in res[g]:
                    self.owners.setdefault(b, set()).add(i)
            new_pos.append(pos)
        self.cpu_ns.append(pc() - t0)
        return new_pos

    def note_released(self) -> None:
        """Which sliding-window blocks left each request's window (freed by the allocator): the
        core's table (null there now) against the worker's."""
        for i, h in enumerate(self.handles):
            live = self.alloc.block_ids(h)[self.SWA]
            for j, b in enumerate(self.tables[self.SWA][i]):
                if j < len(live) and live[j] == 0 and b != 0:
                    self.released[i].setdefault(b, j)

    def recycled(self) -> int:
        """Blocks held by more than one request over the run (sliding-window blocks reused)."""
        return sum(1 for reqs in self.owners.values() if len(reqs) > 1)


def token_kv(
    layer: int, req: torch.Tensor, pos: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k and v of prompt token ``pos`` of request ``req`` in ``layer``: a deterministic
    function (no table), different for every (layer, request, position)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + layer)
    freq = (torch.rand(2, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64) * 2 + 0.5).to(device)
    phase = (torch.rand(2, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64) * 6.283).to(device)
    tok = (req.to(torch.float64) * 1.0e4 + pos.to(torch.float64) * 1.37 + 0.5)[:, None, None]
    k = torch.sin(tok * freq[0] + phase[0])
    v = torch.cos(tok * freq[1] + phase[1])
    return k.to(dtype), v.to(dtype)


class Model:
    """Random weights for ``pairs`` (sliding-window layer, full layer) pairs, and one KV tensor per
    pair (``[2, num_blocks * 16, 16, 128]``) that both layers' blocks live in."""

    def __init__(self, pairs: int, num_blocks: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.device, self.dtype, self.pairs = device, dtype, pairs

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[0])).to(device=device, dtype=dtype)

        self.layers = [
            {
                "wq": w(HIDDEN, HEADS * HEAD_DIM),
                "wk": w(HIDDEN, KV_HEADS * HEAD_DIM),
                "wv": w(HIDDEN, KV_HEADS * HEAD_DIM),
                "wo": w(HEADS * HEAD_DIM, HIDDEN),
            }
            for _ in range(2 * pairs)
        ]
        self.kv = [
            torch.zeros(2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(pairs)
        ]

    def hidden(self, layer: int, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The hidden state entering ``layer`` for the token at ``pos`` (deterministic)."""
        x = torch.sin(
            (req.to(torch.float64) * 7.1 + pos.to(torch.float64) * 0.173 + layer)[:, None]
            * torch.arange(1, HIDDEN + 1, device=req.device, dtype=torch.float64)
            * 1e-3
        )
        return x.to(device=self.device, dtype=self.dtype)


def slots_of(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Slot of token ``pos[i]`` of request i, through its block table row ``table[i]``."""
    return table.gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    length: torch.Tensor,
    start: torch.Tensor,
    max_blocks: int,
    chunk: int = 256,
) -> torch.Tensor:
    """softmax(q k^T) v over tokens ``start[i] <= t < length[i]`` of request i, gathering its
    blocks ``start // 16 ..`` (at most ``max_blocks`` of them) through ``table``. q:
    ``[B, 32, 128]``; returns ``[B, 32, 128]`` in float32."""
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    groups = HEADS // KV_HEADS
    # About 512 MiB of gathered float32 keys per chunk of requests.
    chunk = max(1, min(chunk, (1 << 29) // (max_blocks * BLOCK * KV_HEADS * HEAD_DIM * 4)))
    ar = torch.arange(max_blocks, device=q.device)
    offs = torch.arange(BLOCK, device=q.device)
    for s in range(0, q.shape[0], chunk):
        e = min(s + chunk, q.shape[0])
        first = start[s:e] // BLOCK
        idx = (first[:, None] + ar).clamp(max=table.shape[1] - 1)
        blocks = table[s:e].gather(1, idx)  # [b, nb]
        slot = (blocks[:, :, None] * BLOCK + offs).reshape(e - s, -1)  # [b, nb*16]
        pos = ((first[:, None] + ar)[:, :, None] * BLOCK + offs).reshape(e - s, -1)
        k = kv[0][slot].float()  # [b, T, 16, 128]
        v = kv[1][slot].float()
        qq = q[s:e].float().view(e - s, KV_HEADS, groups, HEAD_DIM)
        scores = torch.einsum("bhgd,bthd->bhgt", qq, k) * SCALE
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
        valid = (pos >= start[s:e, None]) & (pos < length[s:e, None])
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("bhgt,bthd->bhgd", p, v).reshape(e - s, HEADS, HEAD_DIM)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: the same attention over one request's tokens given densely. q ``[32, 128]``,
    k/v ``[T, 16, 128]``."""
    groups = HEADS // KV_HEADS
    qq = q.float().view(KV_HEADS, groups, HEAD_DIM)
    scores = torch.einsum("hgd,thd->hgt", qq, k.float()) * SCALE
    scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
    return torch.einsum("hgt,thd->hgd", torch.softmax(scores, dim=-1), v.float()).reshape(HEADS, HEAD_DIM)


class Runner:
    def __init__(self, args: argparse.Namespace, n: int) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.batch = Batch(n, args.context, args.window, args.steps)
        self.model = Model(args.layer_pairs, self.batch.alloc.num_blocks, self.device, self.dtype)
        self.n = n
        self.check_ids = list(range(0, n, max(1, n // args.check)))[: args.check]
        # Decode tokens' hidden states are recomputed by the reference; prompt tokens' k/v are token_kv.
        self._fill_prompts()

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for g in (Batch.SWA, Batch.FULL):
            rows = self.batch.tables[g]
            width = max(len(r) for r in rows)
            t = torch.zeros(len(rows), width, dtype=torch.long)
            for i, r in enumerate(rows):
                t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            out.append(t.to(self.device))
        return out[0], out[1]

    def _fill_prompts(self) -> None:
        """Admits the requests one by one: allocation, the prefill's k/v writes through the
        block tables, then the sliding window's release (so later requests reuse those blocks)."""
        for i in range(self.n):
            self.batch.admit(i)
            p = self.batch.prompt[i]
            pos = torch.arange(p, device=self.device)
            req = torch.full((p,), i, device=self.device)
            for pair in range(self.model.pairs):
                for li, g in ((2 * pair, Batch.SWA), (2 * pair + 1, Batch.FULL)):
                    row = torch.tensor(self.batch.tables[g][i], device=self.device)
                    k, v = token_kv(li, req, pos, self.device, self.dtype)
                    slots = row[pos // BLOCK] * BLOCK + pos % BLOCK
                    self.model.kv[pair][0][slots] = k
                    self.model.kv[pair][1][slots] = v
            self.batch.after_prefill(i)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, check: bool) -> tuple[float, float]:
        """One decode step; returns (device seconds, max abs error on the checked requests)."""
        pos_list = self.batch.decode_step()
        swa, fullt = self._tables()
        self._sync()
        t0 = time.perf_counter()
        req = torch.arange(self.n, device=self.device)
        pos = torch.tensor(pos_list, device=self.device)
        length = pos + 1
        swa_start = (length - self.args.window).clamp(min=0)
        zero = torch.zeros_like(length)
        swa_blocks = cdiv(self.args.window, BLOCK) + 1
        full_blocks = cdiv(int(length.max().item()), BLOCK)
        outs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for pair in range(self.model.pairs):
            kv = self.model.kv[pair]
            for li, table, start, nb in (
                (2 * pair, swa, swa_start, swa_blocks),
                (2 * pair + 1, fullt, zero, full_blocks),
            ):
                w = self.model.layers[li]
                x = self.model.hidden(li, req, pos)
                q = (x @ w["wq"]).view(self.n, HEADS, HEAD_DIM)
                k = (x @ w["wk"]).view(self.n, KV_HEADS, HEAD_DIM)
                v = (x @ w["wv"]).view(self.n, KV_HEADS, HEAD_DIM)
                slots = slots_of(table, pos)
                kv[0][slots] = k
                kv[1][slots] = v
                a = paged_attention(q, kv, table, length, start, nb)
                _ = a.to(self.dtype).reshape(self.n, HEADS * HEAD_DIM) @ w["wo"]
                if check:
                    outs.append((li, q, a))
        self._sync()
        dt = time.perf_counter() - t0
        for i in range(self.n):
            self.batch.lengths[i] = pos_list[i] + 1
        err = 0.0
        if check:
            for li, q, a in outs:
                for i in self.check_ids:
                    ref = dense_attention(q[i], *self.dense_kv(li, i))
                    err = max(err, (ref - a[i]).abs().max().item())
        return dt, err

    def dense_kv(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's k/v in ``layer`` over the tokens the layer attends to, built without any
        block table."""
        n = self.batch.lengths[i]
        lo = max(0, n - self.args.window) if layer % 2 == 0 else 0
        p = self.batch.prompt[i]
        ks, vs = [], []
        if lo < p:
            pos = torch.arange(lo, p, device=self.device)
            k, v = token_kv(layer, torch.full_like(pos, i), pos, self.device, self.dtype)
            ks.append(k)
            vs.append(v)
        if n > p:
            pos = torch.arange(max(lo, p), n, device=self.device)
            x = self.model.hidden(layer, torch.full_like(pos, i), pos)
            w = self.model.layers[layer]
            ks.append((x @ w["wk"]).view(-1, KV_HEADS, HEAD_DIM))
            vs.append((x @ w["wv"]).view(-1, KV_HEADS, HEAD_DIM))
        return torch.cat(ks), torch.cat(vs)

    def recheck(self) -> float:
        """Paged against dense attention for the checked requests, with the current tables,
        queries at each request's last position (no allocation, no write)."""
        swa, fullt = self._tables()
        err = 0.0
        ids = torch.tensor(self.check_ids, device=self.device)
        length = torch.tensor([self.batch.lengths[i] for i in self.check_ids], device=self.device)
        for pair in range(self.model.pairs):
            for li, table in ((2 * pair, swa), (2 * pair + 1, fullt)):
                start = (length - self.args.window).clamp(min=0) if li % 2 == 0 else torch.zeros_like(length)
                nb = cdiv(self.args.window, BLOCK) + 1 if li % 2 == 0 else cdiv(int(length.max().item()), BLOCK)
                x = self.model.hidden(li, ids, length - 1)
                q = (x @ self.model.layers[li]["wq"]).view(len(self.check_ids), HEADS, HEAD_DIM)
                a = paged_attention(q, self.model.kv[pair], table[ids], length, start, nb)
                for j, i in enumerate(self.check_ids):
                    ref = dense_attention(q[j], *self.dense_kv(li, i))
                    err = max(err, (ref - a[j]).abs().max().item())
        return err

    def self_test(self) -> dict[str, Any]:
        """Corrupts one block id at a time and checks that the mismatch shows."""
        out: dict[str, Any] = {}
        i = self.check_ids[0]
        full_row = self.batch.tables[Batch.FULL][i]
        other = (
            next(b for r, row in enumerate(self.batch.tables[Batch.FULL]) if r != i for b in row if b not in full_row)
            if self.n > 1
            else max(full_row) + 1
        )
        j = len(full_row) // 2
        saved = full_row[j]
        full_row[j] = other
        out["wrong_full_block_error"] = self.recheck()
        full_row[j] = saved
        self.batch.note_released()
        swa_row = self.batch.tables[Batch.SWA][i]
        n = self.batch.lengths[i]
        in_window = [jj for jj in range((max(0, n - self.args.window)) // BLOCK, cdiv(n, BLOCK)) if jj < len(swa_row)]
        recycled = [b for b in self.batch.released[i] if len(self.batch.owners.get(b, ())) > 1]
        if recycled and in_window:
            jj = in_window[len(in_window) // 2]
            saved = swa_row[jj]
            swa_row[jj] = recycled[0]
            out["recycled_window_block_error"] = self.recheck()
            swa_row[jj] = saved
        else:
            out["recycled_window_block_error"] = None
        out["restored_error"] = self.recheck()
        return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in args.running:
        r = Runner(args, n)
        gpu, errs = [], []
        for s in range(args.steps):
            check = s % args.check_every == 0 or s == args.steps - 1
            dt, err = r.step(check)
            if s >= args.warmup:
                gpu.append(dt)
            if check:
                errs.append(err)
        row: dict[str, Any] = {
            "running": n,
            "context": args.context,
            "window": args.window,
            "layer_pairs": args.layer_pairs,
            "device": str(r.device),
            "dtype": args.dtype,
            "num_blocks": r.batch.alloc.num_blocks,
            "device_ms_per_step": statistics.median(gpu) * 1e3 if gpu else float("nan"),
            "device_ms_per_step_gemma2_27b": (statistics.median(gpu) * 1e3 * GEMMA2_LAYER_PAIRS / args.layer_pairs)
            if gpu
            else float("nan"),
            "cpu_us_per_step_allocator": statistics.median(r.batch.cpu_ns[args.warmup :] or r.batch.cpu_ns) / 1e3,
            "allocator_calls_per_step": r.batch.crossings / args.steps,
            "max_abs_error": max(errs) if errs else float("nan"),
            "recycled_window_blocks": r.batch.recycled(),
        }
        row["cpu_us_per_running_request"] = row["cpu_us_per_step_allocator"] / n
        row["check_ok"] = row["max_abs_error"] <= args.tolerance
        if args.self_test:
            st = r.self_test()
            row.update({f"selftest_{k}": v for k, v in st.items()})
            row["selftest_ok"] = (
                st["wrong_full_block_error"] > args.tolerance
                and (st["recycled_window_block_error"] is None or st["recycled_window_block_error"] > args.tolerance)
                and st["restored_error"] <= args.tolerance
            )
        rows.append(row)
        del r
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--running", type=int, nargs="+", default=[256, 1024], help="decode batch sizes")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens (request i gets (5 i) %% 16 more)")
    p.add_argument("--window", type=int, default=4096, help="sliding window (gemma-2: 4096)")
    p.add_argument("--steps", type=int, default=40, help="decode steps")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument(
        "--layer-pairs",
        type=int,
        default=1,
        help="(sliding-window, full) layer pairs run; the time is also scaled to gemma-2-27b's 23",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--check", type=int, default=4, help="requests checked against dense attention")
    p.add_argument("--check-every", type=int, default=8, help="check every this many steps (and the last)")
    p.add_argument("--tolerance", type=float, default=None, help="max abs error (default 2e-2 bf16/fp16, 1e-4 fp32)")
    p.add_argument("--self-test", action="store_true", help="corrupt block ids and check that the mismatch shows")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    if a.dtype is None:
        a.dtype = "bf16" if a.device.startswith("cuda") else "fp32"
    if a.tolerance is None:
        a.tolerance = 1e-4 if a.dtype == "fp32" else 2e-2
    if a.device.startswith("cuda"):
        a.device = "cuda"
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    cols = [
        "running",
        "context",
        "layer_pairs",
        "device_ms_per_step",
        "device_ms_per_step_gemma2_27b",
        "cpu_us_per_step_allocator",
        "cpu_us_per_running_request",
        "allocator_calls_per_step",
        "max_abs_error",
        "recycled_window_blocks",
        "check_ok",
    ] + (["selftest_ok"] if args.self_test else [])
    print(
        f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), dtype {args.dtype}, "
        f"window {args.window}, {args.steps} steps"
    )
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    ok = all(r["check_ok"] and r.get("selftest_ok", True) for r in rows)
    if not ok:
        print(
            "MISMATCH: paged attention through hybrid_alloc's block tables differs from dense attention",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
