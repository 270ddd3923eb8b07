"""The typed boundary of the compiled core: events are the NamedTuples of
``hybrid_alloc.events`` (named fields, still equal to the old tuples), groups are accepted as
named specs read by attribute (beside the legacy tuples), and ``noop_limits`` returns a
``NoopLimits`` that reads by name and still unpacks as a 4-tuple.

The named specs are ``hybrid_alloc.specs``'s own classes (the adapter builds them too); any
object with the same attributes reads the same."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import hybrid_alloc as ha
from hybrid_alloc import Allocator
from hybrid_alloc._core import NoopLimits
from hybrid_alloc.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybrid_alloc.specs import ChunkedLocal, FullAttention, MambaAlign, SlidingWindow

H = 32


def hashes(*xs: int) -> list[bytes]:
    return [x.to_bytes(H, "big") for x in xs]


def run(groups: list[Any]) -> tuple[object, ...]:
    """What a short sequence of calls observes: block tables, limits, free blocks, events."""
    a = Allocator(64, groups, 16, 16, 4096, 4096, True, True, 0, 0)
    r = a.add_request()
    a.allocate_slots(r, 40, block_hashes=hashes(1, 2), num_tokens=40)
    a.cache_blocks(r, 40, block_hashes=hashes(1, 2))
    a.allocate_slots(r, 30, num_computed_tokens=40, block_hashes=hashes(1, 2, 3, 4), num_tokens=70)
    events = [e._replace(handle=0) if isinstance(e, BlockStored) else e for e in a.take_events()]  # handles differ
    out = (a.block_ids(r), a.noop_limits(r), a.num_free_blocks, events)
    a.free(r)
    a.check_invariants()
    return out


def test_named_specs_equal_legacy_tuples() -> None:
    named: list[Any] = [FullAttention(block_size=16), SlidingWindow(block_size=16, spec_key=1, window=32)]
    assert run(named) == run([("full", 16, 0, 0, 0), ("sliding_window", 16, 1, 32, 0)])
    named = [FullAttention(block_size=16), ChunkedLocal(block_size=16, spec_key=1, chunk=32)]
    assert run(named) == run([("full", 16, 0, 0, 0), ("chunked_local", 16, 1, 32, 0)])
    mixed: list[Any] = [
        ("full", 16, 0, 0, 0),
        SlidingWindow(block_size=16, spec_key=1, window=48, extra_retained_tokens=16),
    ]
    assert run(mixed) == run([("full", 16, 0, 0, 0), ("sliding_window", 16, 1, 48, 16)])


def test_named_spec_by_attribute_on_any_object() -> None:
    obj = SimpleNamespace(kind="sliding_window", block_size=16, window=32)  # spec_key, extra default to 0
    assert run([obj]) == run([("sliding_window", 16, 0, 32, 0)])
    a = Allocator(64, [MambaAlign(block_size=16, rekey_cached_tail=True, checkpoint_alignment=16)], 16, 16, 4096)
    assert a.num_groups == 1


def test_bad_named_spec_raises_clear_errors() -> None:
    with pytest.raises(ha.UnsupportedConfigError, match="linear"):
        Allocator(16, [SimpleNamespace(kind="linear", block_size=16)], 16, 16, 4096)
    with pytest.raises(ha.InvalidConfigError, match=r"groups\[1\].*SimpleNamespace.*window"):
        Allocator(
            16, [FullAttention(block_size=16), SimpleNamespace(kind="sliding_window", block_size=16)], 16, 16, 4096
        )
    with pytest.raises(ha.InvalidConfigError, match="block_size"):
        Allocator(16, [SimpleNamespace(kind="full")], 16, 16, 4096)
    with pytest.raises(ha.InvalidConfigError, match="window must be an int"):
        Allocator(16, [SimpleNamespace(kind="rswa", block_size=16, window="64")], 16, 16, 4096)
    with pytest.raises(ha.InvalidConfigError, match="kind must be a str"):
        Allocator(16, [SimpleNamespace(kind=3, block_size=16)], 16, 16, 4096)
    with pytest.raises(ha.OutOfRangeError):
        Allocator(16, [SlidingWindow(block_size=16, window=-1)], 16, 16, 4096)
    with pytest.raises(TypeError):
        Allocator(16, [["full", 16, 0, 0, 0]], 16, 16, 4096)  # type: ignore[list-item]  # neither spec nor tuple


def test_events_are_typed_and_equal_old_tuples() -> None:
    a = Allocator(16, [("full", 16, 0, 0, 0)], 16, 16, 4096, 4096, True, True, 0, 0)
    r = a.add_request()
    a.allocate_slots(r, 32, block_hashes=hashes(1, 2), num_tokens=32)
    a.cache_blocks(r, 32, block_hashes=hashes(1, 2))
    (ev,) = a.take_events()
    assert type(ev) is BlockStored
    assert ev.kind == "stored" and ev.handle == r and ev.group == 0 and ev.block_size == 16
    assert (ev.start_token, ev.end_token, ev.parent_hash) == (0, 32, None)
    assert ev.block_hashes == hashes(1, 2) and ev.block_indices == [0, 1]
    assert ev == ("stored", r, 0, 16, 0, 32, None, hashes(1, 2), [0, 1])
    a.free(r)
    a.evict_blocks([2])
    (ev,) = a.take_events()
    assert type(ev) is BlockRemoved and ev == BlockRemoved("removed", hashes(2)[0], 0)
    assert (ev.block_hash, ev.group) == (hashes(2)[0], 0) and ev == ("removed", hashes(2)[0], 0)
    assert a.reset_prefix_cache()
    (ev,) = a.take_events()
    assert type(ev) is AllBlocksCleared and ev.kind == "cleared" and ev == ("cleared",)


def test_noop_limits_reads_by_name_and_unpacks() -> None:
    a = Allocator(16, [("full", 16, 0, 0, 0)], 16, 16, 4096)
    r = a.add_request()
    a.allocate_slots(r, 20, num_tokens=20)
    lim = a.noop_limits(r)
    assert isinstance(lim, NoopLimits)
    slots, processed, cached, new_tokens = lim
    assert (lim.slots, lim.processed, lim.cached, lim.new_tokens) == (slots, processed, cached, new_tokens)
    assert lim == (slots, processed, cached, new_tokens) and lim == a.noop_limits(r)
    assert lim.slots == 32 and lim[0] == 32 and lim[-1] == new_tokens and lim[:2] == (slots, processed)
    assert len(lim) == 4 and hash(lim) == hash(tuple(lim)) and "slots=32" in repr(lim)
    assert lim != (0, 0, 0, 0)


def test_optional_arguments_follow_pythons_rules() -> None:
    """The constructor, ``allocate_slots`` and ``get_num_blocks_to_allocate`` read their options by
    name (``rust/py/kwargs.rs``): positionals in the declared order, each at most once, no unknown
    name, a wrong type named in the message; a refused call changes nothing; the signature the
    stub declares is the one ``inspect`` reads."""
    import inspect

    full = [("full", 16, 0, 0, 0)]
    # Positionally and by name: the same allocator (retention_interval=None means none).
    a = Allocator(16, full, 16, 16, 4096, 4096, True, True, 0, None, "exact")
    b = Allocator(16, full, 16, 16, 4096, enable_events=True, retention_interval=None, max_in_flight_tokens=4096)
    got: list[Any] = []
    for x in (a, b):
        r = x.add_request()
        got.append((x.allocate_slots(r, 20, num_tokens=20), x.noop_limits(r), x.num_free_blocks))
    assert got[0] == got[1] and len(got[0][0][0]) == 2 and got[0][2] == 13
    with pytest.raises(TypeError, match="at most 10 optional positional"):
        Allocator(16, full, 16, 16, 4096, None, True, False, 0, 0, "exact", False, 0, False, False, 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'max_in_flight_tokens'"):
        Allocator(16, full, 16, 16, 4096, 4096, max_in_flight_tokens=4096)  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'caching'"):
        Allocator(16, full, 16, 16, 4096, caching=True)  # type: ignore[call-arg]
    with pytest.raises(ha.InvalidConfigError):
        Allocator(16, full, 16, 16, 4096, policy="fastest")
    c = Allocator(16, full, 16, 16, 4096)
    r = c.add_request()
    free = c.num_free_blocks
    with pytest.raises(TypeError, match="unexpected keyword argument 'lookahead'"):
        c.allocate_slots(r, 20, lookahead=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="argument 'num_lookahead_tokens'"):
        c.allocate_slots(r, 20, num_lookahead_tokens="1")  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        c.allocate_slots(r, 20, None)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefill'"):
        c.get_num_blocks_to_allocate(r, 20, prefill=0)  # type: ignore[call-arg]
    assert c.num_free_blocks == free and c.block_ids(r) == ([],)
    assert c.get_num_blocks_to_allocate(r, 20, num_tokens_main_model=None) == 2
    sig = inspect.signature(Allocator.allocate_slots)
    assert sig.parameters["num_lookahead_tokens"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(Allocator).parameters)[5:7] == ["max_in_flight_tokens", "enable_caching"]
