"""What a real engine computed, read from its scheduler and its KV cache tensors, so that engine
tests compare two runs without depending on the host's arithmetic (``engine_run.py --record``).

Greedy tokens are equal between two runs only where both computed the same thing the same way.
Two runs that take different prefix-cache hits, or cut a prefill into different chunks, compute
the same prompt along different paths (a hit's state from an earlier turn's decode against the
same tokens' prefill, a chunk of 160 against one of 320): the results differ in their last bits
(bfloat16 Gated DeltaNet states: 0.4-0.6% relative, measured on the tiny Qwen3-Next-style model),
and where the top two logits are within that, the next token can differ. Which way such a
near-tie goes depends on the host's kernels (their instruction sets, their reduction orders). So a
test asks two host-independent questions instead:

- *Computed alike, sampled alike* (``steps_computed_alike``). Each engine step is recorded as
  its rows (per scheduled request: its number, tokens computed before the step, tokens
  scheduled, and for a request's first step a digest of its prompt and of the bytes of every
  block its hit hands over) and the tokens it sampled. While two runs' steps have the same rows,
  from the start of a phase (the engine's start, or a prefix-cache reset with nothing running),
  they ran the same computation on the same inputs, so they must sample the same tokens, on
  any host.
- *Provenance* (``Recorder.provenance``). Every block a hit hands over (each group's blocks that
  cover the hit; in a Mamba group, the one state block) is compared with a reference: the same
  blocks after a clean prefill of exactly the hit's tokens (``prompt[:k]``, after a prefix-cache
  reset, in the same engine). A right state is the reference up to rounding (``err``, the
  largest relative Frobenius distance over the groups' layers and tensors). A state of any
  other tokens is far: the same distance to a clean prefill of the prompt shifted by one token
  (``prompt[1:k+1]``) is ``other``, which shows the check can tell them apart.

Measured on the tiny Qwen3-Next-style model (bfloat16 model and SSM state), 2026-12-06, AMD EPYC
with AVX-512 BF16: ``err`` 0 where the hit's state was computed along the reference's path and
at most 0.0062 where it came from a decode (hit-aware's chat turns); a state of one token fewer
is 1.33-1.69 away, the shifted prompt's 1.43-1.77. On the float32 Gemma-2-style model: ``err``
at most 3.5e-7, ``other`` 0.91-1.42. ``PROVENANCE_TOL`` (0.05) sits 8 times above the largest
rounding and 18 times below the nearest other prefix. The check is also the stronger one: with another
conversation's state copied into a chat turn's hit block before the step (a planted wrong
state), every greedy token of the chat stayed exact's on this tiny random model, and the check
failed (``err`` 1.60).

An attention block the hit covers only in part (a partial hash hit's tail) holds the source
request's later tokens past the hit, and how slots sit inside a block is the CPU kernel's
business (it depends on the ISA). So only the reference's written elements are compared: vLLM
zeroes an attention block when it is allocated, and the clean prefill writes only the hit's
slots, so its nonzero elements are those slots' keys and values whatever the layout (checked:
at most the covered share of the block is nonzero, and at least half of it).

The recorder reads the engine core in this process: it needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
Cost: a copy of the hit blocks per hit; two reference prefills per distinct hit prefix.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Largest relative distance of a handed-over block from its reference that is rounding (see
#: the module docstring for the measurements behind it).
PROVENANCE_TOL = 0.05


#: A recorded hit: (phase, request number, prompt, hit length, {(group, block index): (the
#: block's tensors before the step, after it)}).
HitRecord = tuple[int, int, list[int], int, dict[tuple[int, int], tuple[list[Any], list[Any]]]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def steps_computed_alike(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, int]:
    """Walks two runs' steps of one phase in order while their rows are equal (the same requests,
    counts, prompts and hit blocks), asserts each such step sampled the same tokens in both, and
    returns how many steps and sampled tokens it compared."""
    steps = tokens = 0
    for x, y in zip(a, b):
        if x["rows"] != y["rows"]:
            break
        assert x["tokens"] == y["tokens"], f"step {steps} computed alike but sampled {x['tokens']} and {y['tokens']}"
        steps += 1
        tokens += sum(len(t) - 1 for t in x["tokens"])
    return steps, tokens


def _digest(values: list[Any]) -> str:
    """A short digest of tensors' bytes."""
    import torch

    h = hashlib.sha1()
    for v in values:
        h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _rel(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Recorder:
    """Wraps the in-process engine's scheduler to record steps and hit blocks (module docstring)."""

    def __init__(self, llm: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        self.llm = llm
        core = llm.llm_engine.engine_core.engine_core
        self.sched = core.scheduler
        runner = core.model_executor.driver_worker.worker.model_runner
        ctx = runner.compilation_config.static_forward_context
        #: Per KV cache group: (block size, is a Mamba group, the layers' cache tensors, each
        #: indexed by block id).
        self.groups: list[tuple[int, bool, list[Any]]] = []
        for g in runner.kv_cache_config.kv_cache_groups:
            tensors: list[Any] = []
            for name in g.layer_names:
                kv = ctx[name].kv_cache
                tensors += list(kv) if isinstance(kv, (list, tuple)) else [kv]
            self.groups.append((g.kv_cache_spec.block_size, isinstance(g.kv_cache_spec, MambaSpec), tensors))
        #: Each phase's steps: ``{"rows": [[n, computed, scheduled, digest], ...], "tokens": [[n, tok, ...]]}``.
        self.phases: list[list[dict[str, Any]]] = [[]]
        #: Every hit, in the order they were scheduled.
        self.hits: list[HitRecord] = []
        self._numbers: dict[str, int] = {}
        #: The step being run: its rows, and per hit (its row, its hit entry, its block ids).
        self._pending: tuple[list[list[Any]], list[tuple[list[Any], HitRecord, dict[tuple[int, int], int]]]] | None = (
            None
        )
        #: While computing references: the blocks of each request whose prompt just finished.
        self._ends: dict[str, dict[tuple[int, int], list[Any]]] | None = None
        schedule, update = self.sched.schedule, self.sched.update_from_output

        def recorded_schedule(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self._scheduled(out)
            return out

        def recorded_update(scheduler_output: Any, model_output: Any) -> Any:
            reqs = {rid: self.sched.requests[rid] for rid in scheduler_output.num_scheduled_tokens}
            before = {rid: len(r.output_token_ids) for rid, r in reqs.items()}
            self._ran(reqs)
            result = update(scheduler_output, model_output)
            if self._pending is not None:
                rows, _ = self._pending
                sampled = [[self._numbers[rid], *r.output_token_ids[before[rid] :]] for rid, r in reqs.items()]
                self.phases[-1].append({"rows": rows, "tokens": sorted(t for t in sampled if len(t) > 1)})
                self._pending = None
            return result

        self.sched.schedule = recorded_schedule
        self.sched.update_from_output = recorded_update

    def new_phase(self) -> None:
        """Starts a new phase (call after a prefix-cache reset, with nothing running)."""
        self.phases.append([])

    def _block_ids(self, block_ids: Any, num_tokens: int, copies: dict[int, int]) -> dict[tuple[int, int], int]:
        """The blocks covering the first ``num_tokens`` tokens, per group and block index (null
        blocks left out; a block a copy-on-write fills this step named by its source)."""
        out: dict[tuple[int, int], int] = {}
        for gi, (bs, _mamba, _tensors) in enumerate(self.groups):
            ids = block_ids[gi]
            for idx in range(min(cdiv(num_tokens, bs), len(ids))):
                if ids[idx] != 0:  # 0: vLLM's null block
                    out[(gi, idx)] = copies.get(ids[idx], ids[idx])
        return out

    def _read(self, ids: dict[tuple[int, int], int]) -> dict[tuple[int, int], list[Any]]:
        """Copies of the blocks ``ids`` names, one tensor per layer and cache tensor."""
        return {(gi, idx): [t[bid].clone() for t in self.groups[gi][2]] for (gi, idx), bid in ids.items()}

    def _scheduled(self, out: Any) -> None:
        """After ``schedule``: the step's rows, and each hit's blocks before the step."""
        if self._ends is not None:
            assert all(nr.num_computed_tokens == 0 for nr in out.scheduled_new_reqs), "a reference took a hit"
            return
        if not out.num_scheduled_tokens:
            return
        assert not out.scheduled_cached_reqs.resumed_req_ids, (
            "a request was preempted: the recorder covers no resumption"
        )
        copies = {c.dst_block_id: c.src_block_id for c in out.kv_cache_block_copies or []}
        rows: list[list[Any]] = []
        hits = []
        for nr in out.scheduled_new_reqs:
            n = self._numbers.setdefault(nr.req_id, len(self._numbers))
            prompt = list(nr.prompt_token_ids)
            k = nr.num_computed_tokens
            row = [n, k, out.num_scheduled_tokens[nr.req_id], hashlib.sha1(repr(prompt).encode()).hexdigest()[:16]]
            if k:
                ids = self._block_ids(nr.block_ids, k, copies)
                hit: HitRecord = (
                    len(self.phases) - 1,
                    n,
                    prompt,
                    k,
                    {key: (b, []) for key, b in self._read(ids).items()},
                )
                self.hits.append(hit)
                hits.append((row, hit, ids))
            rows.append(row)
        c = out.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens, strict=True):
            rows.append([self._numbers[rid], computed, out.num_scheduled_tokens[rid], ""])
        self._pending = (sorted(rows), hits)

    def _ran(self, reqs: dict[str, Any]) -> None:
        """After the step's forward: each hit's blocks after it (and their digest in its row),
        or while computing references, the blocks of a prompt just computed."""
        if self._ends is not None:
            for rid, r in reqs.items():
                if r.num_computed_tokens == r.num_prompt_tokens and rid not in self._ends:
                    ids = self.sched.kv_cache_manager.get_block_ids(rid)
                    self._ends[rid] = self._read(self._block_ids(ids, r.num_computed_tokens, {}))
            return
        if self._pending is None:
            return
        for row, hit, ids in self._pending[1]:
            blocks = hit[4]
            for key, after in self._read(ids).items():
                blocks[key][1].extend(after)
            row[3] += ":" + _digest([t for key in sorted(blocks) for pair in blocks[key] for t in pair])

    def _distance(
        self, k: int, blocks: dict[tuple[int, int], tuple[list[Any], list[Any]]], ref: dict[tuple[int, int], list[Any]]
    ) -> float:
        """The largest relative distance of a hit's blocks (of ``k`` tokens) from a reference's.
        A Mamba state is compared as it was before the step and after it (it must be final
        before the step, which reads it, and nothing may write it); an attention block after
        the step (another request may write it in the same step, before any layer reads it),
        on the reference's written elements where the hit covers it in part."""
        missing = set(blocks) - set(ref)
        assert not missing, f"the reference lacks blocks {sorted(missing)}"
        worst = 0.0
        for (gi, idx), (before, after) in blocks.items():
            bs, mamba, _ = self.groups[gi]
            slots = min(bs, k - idx * bs)
            for i, b in enumerate(ref[(gi, idx)]):
                seen = [before[i], after[i]] if mamba else [after[i]]
                if not mamba and slots < bs:
                    written = b != 0
                    share = b.numel() * slots // bs
                    assert share // 2 <= int(written.sum()) <= share, (
                        f"group {gi} block {idx}: {int(written.sum())} elements written for {slots} of {bs} slots"
                    )
                    seen, b = [a[written] for a in seen], b[written]
                worst = max([worst, *(_rel(a, b) for a in seen)])
        return worst

    def provenance(self) -> list[dict[str, Any]]:
        """For every recorded hit: its phase, request number, length, number of blocks compared,
        ``err`` (the largest relative distance from the reference of its tokens) and ``other``
        (the same from the reference of the prompt shifted by one token). Runs the references
        in this engine after a prefix-cache reset each; call after the workload."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        refs: dict[tuple[int, ...], dict[tuple[int, int], list[Any]]] = {}

        def reference(tokens: list[int]) -> dict[tuple[int, int], list[Any]]:
            key = tuple(tokens)
            if key not in refs:
                assert self.llm.reset_prefix_cache()
                self._ends = {}
                try:
                    self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
                    (refs[key],) = self._ends.values()
                finally:
                    self._ends = None
            return refs[key]

        rows = []
        for phase, n, prompt, k, blocks in self.hits:
            rows.append(
                {
                    "phase": phase,
                    "req": n,
                    "k": k,
                    "blocks": len(blocks),
                    "err": self._distance(k, blocks, reference(prompt[:k])),
                    "other": self._distance(k, blocks, reference(prompt[1 : k + 1])),
                }
            )
        return rows


def assert_provenance(rows: list[dict[str, Any]], hits_per_phase: list[int]) -> None:
    """Asserts that ``rows`` (``Recorder.provenance``) cover every hit (their lengths add up to
    each phase's prefix-cache hits, vLLM's counter), that every hit handed over the blocks of
    exactly its tokens (``err`` below ``PROVENANCE_TOL``), and that each would have failed with
    another prefix's blocks (``other`` at least 10 times ``PROVENANCE_TOL``)."""
    for phase, hits in enumerate(hits_per_phase):
        assert sum(r["k"] for r in rows if r["phase"] == phase) == hits, (phase, hits, rows)
    wrong = [r for r in rows if not r["err"] < PROVENANCE_TOL]
    assert not wrong, f"hits handed over blocks of other tokens: {wrong}"
    blind = [r for r in rows if not r["other"] >= 10 * PROVENANCE_TOL]
    assert not blind, f"the check cannot tell these hits' blocks from another prefix's: {blind}"
