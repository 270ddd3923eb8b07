"""KV hints through the compiled core's typed API (issue 38): ``set_hints`` in one crossing,
the clock, a session's release and the counters; bad input raises under
``HybridAllocError`` and changes nothing; under exact every hint call is refused."""

from __future__ import annotations

import pytest

from api_helpers import alloc, allocate, hashes
from hybrid_alloc import Allocator, InvalidStateError, OutOfRangeError, UnknownRequestError, UnsupportedConfigError


def hit_aware(num_blocks: int = 64) -> Allocator:
    groups = [("full", 16, 0, 0, 0), ("sliding_window", 16, 1, 64, 0)]
    return Allocator(num_blocks, groups, 16, 16, 4096, 4096, True, True, 0, 0, policy="hit-aware")


def prompt(a: Allocator, h: int, n: int) -> None:
    """Looks `h` up and prefills its `n`-token prompt in one chunk."""
    a.get_computed_blocks(h, n - 1)
    assert allocate(a, h, n, prompt=n, tokens=n) is not None


def test_pin_lease_retain_and_release_through_the_binding() -> None:
    a = hit_aware()
    assert a.advance_clock(5_000) == (0, None)
    h = a.add_request()
    out = a.set_hints(h, block_hashes=hashes(1, 2, 3, 4), session=9, pin_ttl_ms=1_000, retain=3, retain_ttl_ms=2_000)
    assert out == (1, 0, 0)
    prompt(a, h, 70)
    a.free(h)
    st = a.hint_stats()
    # 4 full-attention blocks and the window's 4 (64 tokens at 16), leased and retained.
    assert (st["leases_applied"], st["leased_keys"], st["leased_free_blocks"]) == (1, 8, 8)
    assert (st["retains_applied"], st["retained_blocks"], st["live_holds"]) == (1, 8, 2)
    assert a.advance_clock(6_000) == (1, 7_000)
    assert a.release_session(9) == 1
    st = a.hint_stats()
    assert (st["leases_expired"], st["retains_released"], st["live_holds"], st["sessions_released"]) == (1, 1, 0, 1)
    a.check_invariants()


def test_hints_by_position_do_what_the_same_keywords_do() -> None:
    """The adapter passes ``set_hints``' arguments by position (no keyword for the binding to
    match); the keyword form and any mix of the two give the same state. Python's rules hold:
    at most 10 positionals, none given twice, ``handle`` required, no unknown name."""
    args = (hashes(1, 2, 3, 4), 9, 3, 2_000, 0, 1_000, 0, 0, (33,))
    names = (
        "block_hashes",
        "session",
        "retain",
        "retain_ttl_ms",
        "retain_tokens",
        "pin_ttl_ms",
        "pin_tokens",
        "release_session",
        "checkpoints",
    )
    states = []
    for split in (0, 4, 9):
        a = hit_aware()
        a.advance_clock(5_000)
        h = a.add_request()
        kw: dict[str, object] = dict(zip(names[split:], args[split:], strict=True))
        assert a.set_hints(h, *args[:split], **kw) == (1, 1, 0)  # type: ignore[arg-type]
        prompt(a, h, 70)
        a.free(h)
        a.check_invariants()
        states.append((a.hint_stats(), a.free_queue_order()))
    assert states[0] == states[1] == states[2]
    a = hit_aware()
    h = a.add_request()
    before = a.hint_stats()
    bad: list[tuple[tuple[object, ...], dict[str, object]]] = [
        ((h, None, 0, 0, 0, 0, 0, 0, 0, (), 1), {}),
        ((h, None, 9), {"session": 9}),
        ((), {"session": 9}),
        ((h,), {"sesion": 9}),
        ((h, None, "9"), {}),
    ]
    for pos, kws in bad:
        with pytest.raises(TypeError):
            a.set_hints(*pos, **kws)  # type: ignore[arg-type]
    assert a.hint_stats() == before
    assert a.set_hints(h, None, 0, 0, 0, 0, 1_000) == (1, 0, 0)
    a.check_invariants()


def test_checkpoints_are_rounded_refused_at_zero_and_moved_after_each_chunk() -> None:
    groups: list[tuple[str, int, int, int, int] | tuple[str, int, int, int, int, int]] = [
        ("full", 16, 0, 0, 0),
        ("mamba_align", 16, 1, 0, 0, 0),
    ]
    a = Allocator(64, groups, 16, 16, 4096, 4096, True, True, 0, 0, policy="hit-aware")
    h = a.add_request()
    assert a.set_hints(h, block_hashes=hashes(*range(1, 7)), checkpoints=[40, 10, 33]) == (0, 2, 1)
    hit, uncached, _ = a.get_computed_blocks(h, 99)
    assert (hit, uncached) == (0, 32)
    assert a.may_move_junction(h)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"pin_ttl_ms": -1}, OutOfRangeError),
        ({"pin_ttl_ms": 604_800_001}, OutOfRangeError),
        ({"retain": 4, "retain_ttl_ms": 10}, OutOfRangeError),
        ({"retain": 2, "retain_ttl_ms": 0}, OutOfRangeError),
        ({"session": -3}, OutOfRangeError),
        ({"checkpoints": [16] * 65}, OutOfRangeError),
        ({"checkpoints": [-16]}, OutOfRangeError),
        ({"checkpoints": [4_096]}, OutOfRangeError),
        ({"block_hashes": [b""]}, OutOfRangeError),
    ],
)
def test_bad_hints_raise_and_change_nothing(kwargs: dict[str, object], error: type[Exception]) -> None:
    a = hit_aware()
    h = a.add_request()
    a.set_block_hashes(h, hashes(1, 2))
    before = (a.hint_stats(), a.num_hashes(h), a.free_queue_order())
    with pytest.raises(error):
        a.set_hints(h, **kwargs)  # type: ignore[arg-type]
    assert (a.hint_stats(), a.num_hashes(h), a.free_queue_order()) == before
    a.check_invariants()


def test_hints_twice_unknown_handle_and_exact_are_refused() -> None:
    a = hit_aware()
    h = a.add_request()
    a.set_hints(h, pin_ttl_ms=10)
    with pytest.raises(InvalidStateError):
        a.set_hints(h, pin_ttl_ms=10)
    with pytest.raises(UnknownRequestError):
        a.set_hints(h + 1, pin_ttl_ms=10)
    with pytest.raises(OutOfRangeError):
        a.advance_clock(-1)
    e = alloc()
    h = e.add_request()
    with pytest.raises(UnsupportedConfigError):
        e.set_hints(h, pin_ttl_ms=10)
    with pytest.raises(UnsupportedConfigError):
        e.advance_clock(1)
    with pytest.raises(UnsupportedConfigError):
        e.release_session(1)
    assert set(e.hint_stats().values()) == {0}
