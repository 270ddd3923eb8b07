"""The typed Python API over the compiled core: results, bad input (a clear exception
under HybridAllocError, state unchanged), and that ``import hybrid_alloc`` needs no vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hybrid_alloc as ha
from hybrid_alloc import Allocator

H = 32  # hash length (sha256)


def hashes(*xs: int) -> list[bytes]:
    return [x.to_bytes(H, "big") for x in xs]


def alloc(kind: str = "full", window: int = 0, num_blocks: int = 16, caching: bool = True) -> Allocator:
    groups = [("full", 16, 0, 0, 0)]
    if kind == "swa":
        groups.append(("sliding_window", 16, 1, window, 0))
    return Allocator(num_blocks, groups, 16, 16, 4096, 4096, caching, True, 0, 0)


def allocate(a: Allocator, h: int, n: int, *, computed: int = 0, hit: int = 0, mode: int = 0, new: list[bytes] | None = None,
             prompt: int = 0, tokens: int = 0):  # type: ignore[no-untyped-def]
    return a.allocate_slots(h, new, n, hit, mode, None, None, 0, 0, False, 0, False, 0, False,
                            computed, 0, prompt or n, tokens or (computed + hit + n), 0)[0]


def snapshot(a: Allocator, handles: list[int]) -> tuple:  # type: ignore[type-arg]
    return (a.num_free_blocks, a.usage, a.free_queue_order(), [a.block_ids(h) for h in handles], a.num_requests)


def test_allocate_prefix_hit_and_free_order() -> None:
    a = alloc()
    r1 = a.add_request()
    assert allocate(a, r1, 40, new=hashes(1, 2), prompt=40, tokens=40) == ([1, 2, 3],)
    assert a.num_free_blocks == 12
    r2 = a.add_request()
    hit, uncached, ids, counts = a.get_computed_blocks(r2, hashes(1, 2), 39)
    assert (hit, uncached, ids, counts) == (32, 0, [1, 2], [2])
    assert allocate(a, r2, 8, hit=32, mode=1, prompt=40, tokens=40) == ([4],)
    assert a.ref_cnt(1) == 2 and a.block_ids(r2) == ([1, 2, 4],)
    a.free(r1)
    a.free(r2)
    # Unhashed tails first (r2's then r1's), then cached blocks, tail first.
    assert a.free_queue_order()[:2] == [4, 3]
    assert a.block_hash(1) == ((1).to_bytes(H, "big"), 0)
    a.check_invariants()


def test_sliding_window_recycles_and_keeps_positions() -> None:
    a = alloc("swa", window=32, num_blocks=32)
    r = a.add_request()
    allocate(a, r, 64, new=hashes(1, 2, 3, 4), prompt=64, tokens=64)
    before = a.num_free_blocks
    allocate(a, r, 1, computed=64, prompt=64, tokens=65)
    full, swa = a.block_ids(r)
    assert len(full) == 5 and len(swa) == 5
    assert swa[:2] == [0, 0]  # out-of-window blocks became the null block
    assert a.num_free_blocks == before - 2 + 2
    a.check_invariants()


def test_unknown_request_and_double_free_raise() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, prompt=20)
    a.free(r)
    snap = snapshot(a, [])
    with pytest.raises(ha.UnknownRequestError):
        a.free(r)
    with pytest.raises(ha.UnknownRequestError):
        a.block_ids(12345)
    with pytest.raises(ha.UnknownRequestError):
        a.free(-1)
    assert snapshot(a, []) == snap


def test_bad_counts_raise_and_leave_state() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(9), prompt=20)
    snap = snapshot(a, [r])
    n_hashes = a.num_hashes(r)
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 0, computed=20, new=hashes(9, 10))  # nothing to compute or adopt
    assert a.num_hashes(r) == n_hashes  # the hashes sent with the failed call were dropped
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, -5)
    with pytest.raises(ha.OutOfRangeError):
        a.append_hashes(r, b"x" * 33, 32)
    with pytest.raises(ha.OutOfRangeError):
        a.allocate_slots(r, None, 1, 0, 7, None, None, 0, 0, False, 0, False, 0, False, 20, 0, 20, 21, 0)
    with pytest.raises(ha.OutOfRangeError):
        a.allocate_slots(r, None, 1, 16, 2, [1, 2], [5], 0, 0, False, 0, False, 0, False, 0, 0, 20, 21, 0)
    with pytest.raises(ha.OutOfRangeError):
        allocate(a, r, 1, computed=20, new=hashes(9, 10) + ["not bytes"])  # type: ignore[list-item]
    assert a.num_hashes(r) == n_hashes
    assert snapshot(a, [r]) == snap
    a.check_invariants()


def test_invalid_blocks_raise_and_leave_state() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, prompt=20)
    snap = snapshot(a, [r])
    with pytest.raises(ha.InvalidBlockError):
        a.evict_blocks([1, 99])
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([1, 1])  # block 1 holds one reference
    with pytest.raises(ha.InvalidBlockError):
        a.free_block_ids([5])  # a free block
    with pytest.raises(ha.InvalidBlockError):
        a.ref_cnt(16)
    assert snapshot(a, [r]) == snap
    a.check_invariants()


def test_pop_blocks_for_free_then_free_block_ids() -> None:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 40, prompt=40)
    blocks = a.pop_blocks_for_free(r)
    assert blocks == [1, 2, 3] and a.num_requests == 0
    a.check_invariants(exact_refs=False)
    a.free_block_ids(list(reversed(blocks)))
    assert a.num_free_blocks == 15
    a.check_invariants()


@pytest.mark.parametrize(
    "groups, err",
    [
        ([], ha.InvalidConfigError),
        ([("full", 0, 0, 0, 0)], ha.InvalidConfigError),
        ([("mamba", 16, 0, 0, 0)], ha.UnsupportedConfigError),
        ([("full", 16, 0, 0, 0), ("cross", 16, 1, 0, 0)], ha.UnsupportedConfigError),
        ([("sliding_window", 16, 0, 0, 0)], ha.InvalidConfigError),
        ([("full", 16, 0, 0, 0), ("sliding_window", 48, 1, 64, 0)], ha.InvalidConfigError),
    ],
)
def test_invalid_config_raises(groups: list, err: type) -> None:  # type: ignore[type-arg]
    with pytest.raises(err):
        Allocator(16, groups, 16, 16, 4096)


def test_out_of_range_config_values_raise() -> None:
    with pytest.raises(ha.OutOfRangeError):
        Allocator(-1, [("full", 16, 0, 0, 0)], 16, 16, 4096)
    with pytest.raises(ha.InvalidConfigError):
        Allocator(0, [("full", 16, 0, 0, 0)], 16, 16, 4096)


def test_errors_share_one_base() -> None:
    for cls in (ha.InvalidConfigError, ha.UnsupportedConfigError, ha.UnknownRequestError, ha.OutOfRangeError,
                ha.InvalidBlockError, ha.InvariantError):
        assert issubclass(cls, ha.HybridAllocError)


def test_events_stored_removed_cleared() -> None:
    a = alloc(num_blocks=3)
    r = a.add_request()
    allocate(a, r, 32, new=hashes(1, 2), prompt=33, tokens=33)
    ev = a.take_events()
    assert ev == [("stored", r, 0, 16, 0, 32, None, [(1).to_bytes(H, "big"), (2).to_bytes(H, "big")], [0, 1])]
    a.free(r)
    r2 = a.add_request()
    allocate(a, r2, 16, prompt=16)  # evicts the tail block's hash (block 2)
    assert a.take_events() == [("removed", (2).to_bytes(H, "big"), 0)]
    a.free(r2)
    assert a.reset_prefix_cache()
    assert a.take_events() == [("cleared",)]


def test_import_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import hybrid_alloc\n"
        "a = hybrid_alloc.Allocator(8, [('full', 16, 0, 0, 0)], 16, 16, 128)\n"
        "assert 'vllm' not in [m for m in sys.modules if sys.modules[m] is not None and m.startswith('vllm')]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_threads_misuse_is_an_error_not_a_crash() -> None:
    """Concurrent calls on one allocator either serialise (GIL) or raise; never corrupt."""
    import threading

    a = alloc(num_blocks=64)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                h = a.add_request()
                allocate(a, h, 17, prompt=17)
                a.free(h)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(isinstance(e, RuntimeError) for e in errors)
    a.check_invariants()
    assert a.num_free_blocks == 63
