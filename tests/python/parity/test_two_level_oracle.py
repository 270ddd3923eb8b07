"""Two-level pages (issue 37), the content oracle at the scheduler level: vLLM's real Scheduler
with our manager over a two-level configuration (``capacity_run.build``: the ``qwen36`` shape,
one full-attention group of 64-token slots and three GDN state groups of 1088-token pages, 17
slots a page; and ``falconh1``, one attention group and one Mamba2 group of 1600-token pages,
25 slots a page, whose layers write prefill checkpoints), a pool of about 16 pages, small
enough that requests are preempted and cached blocks evicted, prefix caching on, prompts
sharing prefixes so hits happen, fabricated model outputs.

After every step the test models what the workers would write into the KV memory and read
from it, page by page (:class:`Memory`), from the tables the manager hands out:

- attention: the step's tokens ``c .. t-1`` of a request (``c`` computed before the step, ``t``
  after) are written to slot ``table[pos // small]``, offset ``pos % small``, as the pair
  (hash of the token ids ``0 .. pos``, ``pos``); then every position ``0 .. t-1`` the step reads
  must hold that pair for the request's own tokens (by token ids, not by request: a hit reads
  what another request with the same prefix wrote);
- state (vLLM's align mode, the workers' ``preprocess_mamba_align``: the running state moves to
  block ``cdiv(t, B) - 1`` and is read from block ``cdiv(c, B) - 1``): before the step the block
  ``cdiv(c, B) - 1`` of each state group must hold the state of exactly ``tokens[:c]`` (for a
  request admitted with a hit, the state the hit hands over, and a hit ends at a state block);
  after it the block ``cdiv(t, B) - 1`` holds the state of ``tokens[:t]``, and a Mamba2 group's
  prefill checkpoint the state of the chunk's last aligned boundary where vLLM's
  ``compute_mamba_prefill_checkpoints`` puts it;
- a page's bytes are either one state or ``k`` slots: writing a state destroys the page's
  slots' content, writing a slot destroys the page's state, so a page handed to a state and an
  attention slot at once shows up as a wrong read; and, from the manager's tables, no page of a
  live request's state table is the page of a slot in any live request's attention table.

With a ``prefix_match_unit`` (vLLM's ``--prefix-match-unit``, equal to the small block: the unit
two-level pages serve) hits may end at any unit boundary inside a state block: the workers first
run the step's copies (``SchedulerOutput.kv_cache_block_copies``, page to page as vLLM's
``copy_kv_cache_blocks_inplace`` copies a block of every view), and the state a hit hands over
must still be the state of exactly the hit's tokens, read from the table's block ``cdiv(c, B) - 1``.

Each run also counts what it exercised (hits, preemptions, content overwritten by another
prefix, checkpoints) and asserts the workload reached each. ``test_oracle_catches_a_planted_bug``
checks that the oracle fails when one table entry is wrong. The same oracle runs with two-level
pages off (our manager over vLLM's layout: ``k = 1``, attention blocks of the state block)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

SMALL = 64
#: Pages of the pool (about): six clients, each request one or two state pages and its slots, need more.
PAGES = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Memory:
    """The KV memory as the workers see it. ``slots[s] = (group, [key per offset])``,
    ``states[p] = (group, key)``; a key is ``(prefix hash, position)``."""

    k: int
    small: int
    slots: dict[int, tuple[int, list[Any]]] = field(default_factory=dict)
    states: dict[int, tuple[int, Any]] = field(default_factory=dict)
    #: Writes over content of another prefix (a slot or page reused after eviction or free).
    overwrites: int = 0

    def write_token(self, group: int, slot: int, off: int, key: Any) -> None:
        assert slot != 0 and slot // self.k != 0, f"attention write into the null page (slot {slot})"
        self.states.pop(slot // self.k, None)
        cur = self.slots.get(slot)
        if cur is None or cur[0] != group:
            cur = (group, [None] * self.small)
            self.slots[slot] = cur
        if cur[1][off] is not None and cur[1][off] != key:
            self.overwrites += 1
        cur[1][off] = key

    def write_state(self, group: int, page: int, key: Any) -> None:
        assert page != 0, "state write into the null page"
        for s in range(page * self.k, page * self.k + self.k):
            self.slots.pop(s, None)
        old = self.states.get(page)
        if old is not None and old != (group, key):
            self.overwrites += 1
        self.states[page] = (group, key)

    def copy_page(self, src: int, dst: int) -> None:
        """The workers' copy of block ``src`` to ``dst`` (a page: every view, attention slots
        included, is copied at the scheduler's block, ``num_blocks`` pages)."""
        assert dst != 0, "a copy into the null page"
        self.states.pop(dst, None)
        if src in self.states:
            self.states[dst] = self.states[src]
        for j in range(self.k):
            self.slots.pop(dst * self.k + j, None)
            if (cur := self.slots.get(src * self.k + j)) is not None:
                self.slots[dst * self.k + j] = (cur[0], list(cur[1]))

    def block(self, group: int, slot: int, n: int) -> list[Any] | None:
        """The keys at offsets ``0 .. n-1`` of ``slot`` as ``group`` wrote them."""
        cur = self.slots.get(slot)
        return None if cur is None or cur[0] != group else cur[1][:n]


class Oracle:
    """Checks one scheduler run step by step (see the module doc)."""

    def __init__(self, sched: Any, tables: Any = None) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec

        from hybrid_alloc.vllm.pages import slots_per_page

        self.sched = sched
        mgr = sched.kv_cache_manager
        kvc = mgr.kv_cache_config
        self.k = slots_per_page(kvc) or 1
        self.pages = kvc.num_blocks
        specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
        self.state_groups = [i for i, s in enumerate(specs) if isinstance(s, MambaSpec)]
        self.attn_groups = [i for i, s in enumerate(specs) if not isinstance(s, MambaSpec)]
        (self.small,) = {specs[g].block_size for g in self.attn_groups}
        (self.state_block,) = {specs[g].block_size for g in self.state_groups}
        assert all(specs[g].mamba_cache_mode == "align" for g in self.state_groups)
        # State groups whose layers write a prefill checkpoint (MambaMixer2): group -> alignment.
        self.checkpoints = {
            g: specs[g].prefill_checkpoint_alignment
            for g in self.state_groups
            if getattr(specs[g], "num_prefill_checkpoint_blocks", 0) > 0
        }
        self.hash_block = sched.hash_block_size
        self.hit_alignment = kvc.cache_hit_alignment_tokens
        # Where the tables come from: the manager's (a planted bug swaps it).
        self.tables = tables or mgr.get_block_ids
        self.mem = Memory(self.k, self.small)
        self.keys: dict[str, list[Any]] = {}  # request -> prefix key per position
        self.progress: dict[str, int] = {}  # request -> tokens computed after its last step
        self.hits = 0  # admissions with computed tokens (a hit)
        self.hit_tokens = 0
        self.checkpoint_writes = 0
        self.copies = 0  # copies run (partial hash hits only)
        self.inside = 0  # hits ending inside a state block
        #: This step's admissions with a hit: request -> hit tokens.
        self.admitted: dict[str, int] = {}
        self.steps = 0

    def _keys(self, req: Any, n: int) -> list[Any]:
        ks = self.keys.setdefault(req.request_id, [])
        toks = req.all_token_ids
        h = ks[-1][0] if ks else 0
        for pos in range(len(ks), n):
            h = hash((h, toks[pos]))
            ks.append((h, pos))
        return ks

    def check_layout(self) -> None:
        """No page is a live request's state page and holds a live request's slot."""
        state_pages: set[int] = set()
        slot_pages: set[int] = set()
        for rid in self.sched.requests:
            ids = self.tables(rid)
            for g in self.state_groups:
                for p in ids[g]:
                    assert 0 <= p < self.pages, f"{rid}: state page {p} out of the pool"
                    if p:
                        state_pages.add(p)
            for g in self.attn_groups:
                for s in ids[g]:
                    assert 0 <= s < self.pages * self.k, f"{rid}: slot {s} out of the pool"
                    if s:
                        assert s // self.k, f"{rid}: slot {s} in the null page"
                        slot_pages.add(s // self.k)
        both = state_pages & slot_pages
        assert not both, f"pages both a state and holding slots: {sorted(both)[:8]}"

    def step(self, so: Any) -> None:
        """The step the scheduler just planned (``so``), as the workers would run it."""
        self.steps += 1
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        mem, bs = self.mem, self.state_block
        # (request, computed before the step, after it); the scheduler already advanced it.
        spans = []
        for rid, n in so.num_scheduled_tokens.items():
            t = self.sched.requests[rid].num_computed_tokens
            spans.append((rid, t - n, t))
        # A request that starts from computed tokens it did not compute in its last step: a hit.
        self.admitted = {rid: c for rid, c, _ in spans if c > 0 and self.progress.get(rid) != c}
        # The hit alignment: the state block, or the unit with partial hash hits.
        assert all(c % self.hit_alignment == 0 for c in self.admitted.values()), (
            f"a hit off the {self.hit_alignment}-token grid: {self.admitted}"
        )
        self.inside += sum(c % self.state_block != 0 for c in self.admitted.values())
        self.hits += len(self.admitted)
        # The step's copies (a hit or a prompt tail inside a state block, made private), run by
        # the workers before the forward.
        for cp in so.kv_cache_block_copies or ():
            self.copies += 1
            mem.copy_page(cp.src_block_id, cp.dst_block_id)
        self.hit_tokens += sum(self.admitted.values())
        self.check_layout()
        work = [(rid, c, t, self._keys(self.sched.requests[rid], t), self.tables(rid)) for rid, c, t in spans]
        # Reads before the step: the state each request continues from.
        for rid, c, _, keys, ids in work:
            if c == 0:
                continue
            for g in self.state_groups:
                page = ids[g][_cdiv(c, bs) - 1]
                got = mem.states.get(page)
                assert got == (g, keys[c - 1]), (
                    f"step {self.steps}: {rid} continues from {c} tokens; group {g}'s state page {page} "
                    f"holds {'nothing' if got is None else 'another state'}"
                )
        # Writes: every request's tokens, then its new running state.
        for _, c, t, keys, ids in work:
            for g in self.attn_groups:
                table = ids[g]
                for pos in range(c, t):
                    mem.write_token(g, table[pos // self.small], pos % self.small, keys[pos])
            for g in self.state_groups:
                mem.write_state(g, ids[g][_cdiv(t, bs) - 1], keys[t - 1])
            for g, align in self.checkpoints.items():
                # The workers' rule, vLLM's own function: the state at the chunk's last aligned
                # boundary, into column cdiv(t, B) - 2 (the null block, not kept, if unreserved).
                (off,), (col,) = compute_mamba_prefill_checkpoints(
                    [t], [t - c], self.hash_block, bs, align, False, self.hit_alignment
                )
                if col >= 0 and ids[g][col]:
                    self.checkpoint_writes += 1
                    mem.write_state(g, ids[g][col], keys[c + off - 1])
        # Reads of the step: every position attention reads, and the state just written.
        for rid, _, t, keys, ids in work:
            for g in self.attn_groups:
                for b in range(_cdiv(t, self.small)):
                    lo, hi = b * self.small, min(t, (b + 1) * self.small)
                    held = mem.block(g, ids[g][b], hi - lo)
                    assert held == keys[lo:hi], (
                        f"step {self.steps}: {rid} reads positions {lo}..{hi - 1} of {t} from slot "
                        f"{ids[g][b]}: {'nothing' if held is None else 'other tokens'}"
                    )
            for g in self.state_groups:
                assert mem.states.get(ids[g][_cdiv(t, bs) - 1]) == (g, keys[t - 1]), (
                    f"step {self.steps}: {rid}'s state of {t} tokens was overwritten in the step"
                )
            self.progress[rid] = t


def _prompts(seed: int, block: int, turns: bool = False) -> list[list[tuple[list[int], int]]]:
    """Six clients, three requests each: prompts that start with one of three prefixes of two
    state blocks (``block`` tokens each), cut at one or two blocks, and end with 40-900 tokens
    of their own; some repeat an earlier prompt exactly. Outputs 30-250 tokens (decodes that
    grow into new pages). With ``turns`` half the prompts are instead an earlier prompt
    followed by 40-400 tokens of its own (a chat's next turn: a hit at the earlier prompt's
    last unit, inside a state block)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 30000) for _ in range(2 * block)] for _ in range(3)]
    made: list[list[int]] = []
    out = []
    for _ in range(6):
        reqs = []
        for _ in range(3):
            if turns and made and rng.random() < 0.5:
                prompt = list(rng.choice(made)) + [rng.randrange(1, 30000) for _ in range(rng.randint(40, 400))]
                made.append(prompt)
            elif made and rng.random() < 0.25:
                prompt = list(rng.choice(made))
            else:
                cut = rng.choice((block, 2 * block))
                prompt = rng.choice(bases)[:cut] + [rng.randrange(1, 30000) for _ in range(rng.randint(40, 900))]
                made.append(prompt)
            reqs.append((prompt, rng.randint(30, 250)))
        out.append(reqs)
    return out


def _build(
    name: str,
    two_level: bool,
    unit: int | None = None,
    pages: int = PAGES,
    headroom: int | None = 0,
    policy: str = "exact",
) -> Any:
    """vLLM's Scheduler over about ``pages`` pages of ``name`` under ``policy``; two-level with
    the admission headroom ``headroom`` (slots per running request; 0, the default here, keeps
    the pressure these workloads were sized for: admissions to the last page, then preemptions;
    None: the layout's default)."""
    from hybrid_alloc.bench.capacity_run import build_setup
    from hybrid_alloc.bench.offline import SHAPES, SchedulerSetup

    shape = SHAPES[name]
    # The bytes of about PAGES of vLLM's pages (the two-level plan keeps qwen36's page, 17 x 64
    # tokens, and grows Falcon-H1's by 2%: 25 x 64 tokens).
    setup = SchedulerSetup(shape, kv_budget_bytes=1 << 30)
    kvc = setup.kv_cache_config(setup.vllm_config())
    # Groups share the tensors: a page is one layer of each tensor, the layers of one group.
    per_page = max(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kvc.kv_cache_groups)
    # ``capacity_run.build``'s setup, with the unit.
    run_setup = SchedulerSetup(
        shape,
        manager="hybrid_alloc",
        kv_budget_bytes=pages * per_page,
        max_num_seqs=8,
        max_num_batched_tokens=8192,
        prefix_match_unit=unit,
    )
    return build_setup(
        run_setup, SMALL if two_level else None, "two-level" if two_level else "ours", headroom=headroom, policy=policy
    )


def _run(sched: Any, oracle: Oracle, seed: int = 0, turns: bool = False, hints: bool = False) -> Any:
    from hybrid_alloc.bench.offline import fabricate_output, make_request

    todo = _prompts(seed, oracle.state_block, turns)
    nxt = [0] * len(todo)
    live: dict[str, tuple[int, Any]] = {}
    reqs = []

    def submit(c: int) -> None:
        if nxt[c] < len(todo[c]):
            prompt, out = todo[c][nxt[c]]
            r = make_request(sched, f"c{c}-{nxt[c]}", prompt, out)
            if hints and nxt[c] % 2 == 0:
                # KV hints (``SamplingParams.extra_args``): a session, a checkpoint inside the
                # prompt, and (on every other client) a pin and a retain.
                x: dict[str, Any] = {"kv_session": f"s{c}", "kv_checkpoint": len(prompt) // 2}
                if c % 2 == 0:
                    x.update(kv_pin_ttl=60, kv_retain="high", kv_retain_ttl=60)
                r.sampling_params.extra_args = x
            nxt[c] += 1
            reqs.append(r)
            live[r.request_id] = (c, r)
            sched.add_request(r)

    for c in range(len(todo)):
        submit(c)
    while live:
        assert oracle.steps < 5000, "the run does not finish"
        so = sched.schedule()
        oracle.step(so)
        sched.update_from_output(so, fabricate_output(sched, so))
        for rid, (c, r) in list(live.items()):
            if r.is_finished():
                del live[rid]
                submit(c)
    return reqs


@pytest.mark.parametrize(
    "name, two_level, layout",
    [
        # (k, small block, state block); Falcon-H1's Mamba2 layers write prefill checkpoints.
        ("qwen36", True, (17, 64, 1088)),
        ("qwen36", False, (1, 1088, 1088)),
        ("falconh1", True, (25, 64, 1600)),
        ("falconh1", False, (1, 1568, 1568)),
    ],
    ids=["qwen36-two-level", "qwen36-off", "falconh1-two-level", "falconh1-off"],
)
def test_content_oracle_under_pressure(name: str, two_level: bool, layout: tuple[int, int, int]) -> None:
    sched = _build(name, two_level)
    oracle = Oracle(sched)
    assert (oracle.k, oracle.small, oracle.state_block) == layout
    assert (
        oracle.hit_alignment == oracle.state_block and not sched.kv_cache_manager.coordinator.enable_partial_hash_hits
    )
    assert bool(oracle.checkpoints) == (name == "falconh1")
    reqs = _run(sched, oracle)
    preemptions = sum(getattr(r, "num_preemptions", 0) for r in reqs)
    # What the run exercised: hits, preemptions, memory reused by other prefixes, checkpoints.
    assert oracle.hits >= 5 and oracle.hit_tokens >= 5 * oracle.state_block, (oracle.hits, oracle.hit_tokens)
    assert not oracle.checkpoints or oracle.checkpoint_writes > 0
    assert preemptions >= 2, preemptions
    assert oracle.mem.overwrites > 0
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert oracle.copies == oracle.inside == 0


@pytest.mark.parametrize("name", ["qwen36", "falconh1"])
def test_content_oracle_with_the_admission_headroom(name: str) -> None:
    """The same workload with the layout's default admission headroom (1 slot per running
    request): every slot and state still reads back right, and it preempts no more than
    without the headroom."""
    bare = _build(name, True)
    bare_reqs = _run(bare, Oracle(bare))
    sched = _build(name, True, headroom=None)
    assert sched.kv_cache_manager._headroom
    oracle = Oracle(sched)
    reqs = _run(sched, oracle)
    assert oracle.hits >= 5, oracle.hits
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    preempted = [sum(getattr(r, "num_preemptions", 0) for r in rs) for rs in (reqs, bare_reqs)]
    assert preempted[0] <= preempted[1], preempted


@pytest.mark.parametrize(
    "name, two_level, layout, pages, seed",
    [
        # Pool and seed where the run hits inside state blocks (qwen36's three state groups
        # leave few cached states in 16 pages).
        ("qwen36", True, (17, 64, 1088), 24, 2),
        ("qwen36", False, (1, 1088, 1088), 24, 2),
        ("falconh1", True, (25, 64, 1600), PAGES, 0),
    ],
    ids=["qwen36-two-level", "qwen36-off", "falconh1-two-level"],
)
def test_content_oracle_with_a_prefix_match_unit(
    name: str, two_level: bool, layout: tuple[int, int, int], pages: int, seed: int
) -> None:
    """``prefix_match_unit`` = the small block (64): partial hash hits, under two-level pages as
    with vLLM's layout (``off``; Falcon-H1's vLLM block, 1568, is no multiple of 64, so vLLM
    refuses that unit there). Hits end inside state blocks, their states are copied on write
    (and prompt tails keyed inside their block are), and every state a hit hands over is the
    state of exactly the hit's tokens."""
    sched = _build(name, two_level, unit=SMALL, pages=pages)
    oracle = Oracle(sched)
    assert (oracle.k, oracle.small, oracle.state_block) == layout
    assert sched.kv_cache_manager.coordinator.enable_partial_hash_hits
    assert oracle.hash_block == oracle.hit_alignment == SMALL
    reqs = _run(sched, oracle, seed, turns=True)
    preemptions = sum(getattr(r, "num_preemptions", 0) for r in reqs)
    assert oracle.hits >= 4 and oracle.inside >= 2 and oracle.copies >= 3, (oracle.hits, oracle.inside, oracle.copies)
    assert not oracle.checkpoints or oracle.checkpoint_writes > 0
    assert preemptions >= 1, preemptions
    assert oracle.mem.overwrites > 0
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)


@pytest.mark.parametrize(
    "name, unit, pages, seed",
    [("qwen36", None, PAGES, 0), ("falconh1", None, PAGES, 0), ("qwen36", SMALL, 24, 2), ("falconh1", SMALL, PAGES, 0)],
    ids=["qwen36", "falconh1", "qwen36-unit", "falconh1-unit"],
)
def test_content_oracle_under_hit_aware(name: str, unit: int | None, pages: int, seed: int) -> None:
    """The same oracle with ``HYBRID_ALLOC_POLICY=hit-aware`` over two-level pages (each pool
    with its own levels, junctions at first-sighting stops and, with a unit, at the prefixes
    other prompts went on past): the policy changes which keys stay and where prefill chunks
    stop, never what a key holds. Hits, preemptions and memory reused by other prefixes
    happen; with a unit, hits inside state blocks and copies too. Half the requests carry KV
    hints: checkpoints are served, pins and retains dropped (counted)."""
    sched = _build(name, True, unit=unit, pages=pages, policy="hit-aware")
    mgr = sched.kv_cache_manager
    assert (mgr._alloc.policy, mgr._alloc.slots_per_page) == ("hit-aware", 17 if name == "qwen36" else 25)
    oracle = Oracle(sched)
    reqs = _run(sched, oracle, seed, turns=unit is not None, hints=True)
    preemptions = sum(getattr(r, "num_preemptions", 0) for r in reqs)
    # The hints' checkpoints are taken; their pins and retains dropped and counted.
    counters = mgr._hint_counters.as_dict()
    assert counters["applied"] > 0 and counters.get("refused.not_served_over_pages", 0) > 0, counters
    assert oracle.hits >= 4 and oracle.hit_tokens >= 4 * (unit or oracle.state_block), (oracle.hits, oracle.hit_tokens)
    # Falcon-H1's Mamba2 prefill checkpoints: written without a unit; with one, this run's chunks
    # (stopped at junctions, checkpoints and unit tails) end where no checkpoint is due.
    assert not oracle.checkpoints or unit is not None or oracle.checkpoint_writes > 0
    assert preemptions >= 1, preemptions
    assert oracle.mem.overwrites > 0
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert unit is None or (oracle.inside >= 1 and oracle.copies >= 1), (oracle.inside, oracle.copies)
    print(f"{name} unit={unit}: hits {oracle.hits}, hit tokens {oracle.hit_tokens}, preemptions {preemptions}")


@pytest.mark.parametrize(
    "plant, message",
    [("slot", "other tokens"), ("state", "another state"), ("overlap", "both a state and holding slots")],
)
def test_oracle_catches_a_planted_bug(plant: str, message: str) -> None:
    """The oracle fails on one wrong table entry. ``slot``: from the second step on, a request's
    second attention slot is another running request's first (a double allocation); ``state``:
    the first request admitted with a hit is handed, for the hit's state, a page holding
    another state (of another prefix) instead of the hit's page; ``overlap``: from the second
    step on, a request's first state page is the page of another running request's slot."""
    sched = _build("qwen36", True)
    mgr = sched.kv_cache_manager
    planted: dict[tuple[str, int, int], int] = {}
    oracle: Oracle

    def tables(rid: str) -> Any:
        ids = tuple(list(x) for x in mgr.get_block_ids(rid))
        if not planted and oracle.steps >= 2:
            if plant == "slot" and len(ids[g := oracle.attn_groups[0]]) >= 2:
                others = [x for r in sched.running if r.request_id != rid for x in mgr.get_block_ids(r.request_id)[g]]
                if others:
                    planted[(rid, g, 1)] = others[0]
            if plant == "overlap" and any(ids[g := oracle.state_groups[0]]):
                a = oracle.attn_groups[0]
                slots = [
                    x for r in sched.running if r.request_id != rid for x in mgr.get_block_ids(r.request_id)[a] if x
                ]
                if slots:
                    planted[(rid, g, next(i for i, p in enumerate(ids[g]) if p))] = slots[0] // oracle.k
            hit = oracle.admitted.get(rid, 0)
            if plant == "state" and hit:
                g, i = oracle.state_groups[0], _cdiv(hit, oracle.state_block) - 1
                want = (g, oracle._keys(sched.requests[rid], hit)[hit - 1])
                wrong = [p for p, got in oracle.mem.states.items() if got[0] == g and got != want]
                if wrong:
                    planted[(rid, g, i)] = wrong[0]
        for (r, g, i), x in planted.items():
            if r == rid and i < len(ids[g]):
                ids[g][i] = x
        return ids

    oracle = Oracle(sched, tables)
    with pytest.raises(AssertionError, match=message):
        _run(sched, oracle)
    assert planted


def test_oracle_with_a_unit_catches_copies_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a unit, workers that skip the step's copies leave a hit (or a request continuing
    past its prompt tail) reading a page that holds no state: the oracle fails."""
    monkeypatch.setattr(Memory, "copy_page", lambda self, src, dst: None)
    sched = _build("qwen36", True, unit=SMALL, pages=24)
    with pytest.raises(AssertionError, match="holds nothing|another state"):
        _run(sched, Oracle(sched), 2, turns=True)
