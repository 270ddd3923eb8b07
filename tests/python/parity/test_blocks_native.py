"""The adapter's ``NativeKVCacheBlocks`` against vLLM's own ``KVCacheBlocks`` holding the same
block ids: ``get_block_ids`` (``allow_none``, ``group_ids``, fresh lists, the same exception
for a bad ``group_ids``), ``+`` both ways, ``.blocks``, ``new_empty``; and the instance
``FastAllocate`` builds for a block-crossing decode step (``object.__new__`` and two
attributes set from Rust, no ``__init__``), which must be the same object as the Python
constructor's, and a bad crossing call, which raises what it raised before, state unchanged."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

import hybrid_alloc as ha  # noqa: E402
from api_helpers import EMPTY, FakeRequest, alloc, allocate, hashes  # noqa: E402
from hybrid_alloc._core import BlockIds, FastAllocate, GetBlockIds  # noqa: E402
from hybrid_alloc.vllm.blocks import NativeKVCacheBlocks  # noqa: E402

GROUPS = [([1, 2], [3]), ([], []), ([5], []), ([], [7, 8]), ([4, 9, 11],)]
SELECTIONS: list[Any] = [None, [0], [1], [-1], [1, 0], [0, 0], [], (0,), [True]]


def theirs(groups: tuple[list[int], ...]) -> KVCacheBlocks:
    return KVCacheBlocks(tuple([KVCacheBlock(b) for b in g] for g in groups))


def ours(groups: tuple[list[int], ...]) -> NativeKVCacheBlocks:
    return NativeKVCacheBlocks(alloc(num_blocks=16), groups)


def answer(f: Any) -> tuple[str, Any]:
    """What a call returns, or the class of what it raises."""
    try:
        return "value", f()
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return "raised", type(e)


@pytest.mark.parametrize("groups", GROUPS)
def test_get_block_ids_answers_as_vllms(groups: tuple[list[int], ...]) -> None:
    v, o = theirs(groups), ours(groups)
    assert isinstance(o, KVCacheBlocks)
    for sel in SELECTIONS:
        if sel is not None and any(not isinstance(g, int) or g >= len(groups) for g in sel):
            continue
        for allow_none in (False, True, 0, 1):
            kw: dict[str, Any] = {} if sel is None else {"group_ids": sel}
            want = v.get_block_ids(allow_none, **kw)
            assert o.get_block_ids(allow_none, **kw) == want, (sel, allow_none)
            assert o.get_block_ids(allow_none=allow_none, **kw) == want
            assert NativeKVCacheBlocks.get_block_ids(o, allow_none, **kw) == want  # the class's form
    assert o.get_block_ids() == v.get_block_ids() == groups


def test_get_block_ids_makes_fresh_lists() -> None:
    o = ours(([1, 2], [3]))
    first = o.get_block_ids()
    first[0].append(99)
    assert o.get_block_ids() == ([1, 2], [3])
    assert o.get_block_ids()[0] is not o.get_block_ids()[0]


@pytest.mark.parametrize("bad", [[2], [-3], [2**70], ["a"], [0.5], [None], 5, "0"])
def test_bad_group_ids_raise_what_vllm_raises(bad: Any) -> None:
    groups = ([1, 2], [3])
    want = answer(lambda: theirs(groups).get_block_ids(group_ids=bad))
    assert want[0] == "raised"
    assert answer(lambda: ours(groups).get_block_ids(group_ids=bad)) == want
    assert answer(lambda: ours(groups).get_block_ids(True, group_ids=bad)) == want


@pytest.mark.parametrize("groups", GROUPS)
def test_add_blocks_and_new_empty_match_vllms(groups: tuple[list[int], ...]) -> None:
    other = tuple([b + 100 for b in g] for g in groups)
    want = (theirs(groups) + theirs(other)).get_block_ids()
    assert (ours(groups) + theirs(other)).get_block_ids() == want
    assert (ours(groups) + ours(other)).get_block_ids() == want
    assert (theirs(groups) + ours(other)).get_block_ids() == want  # vLLM's __add__ reads .blocks
    o = ours(groups)
    assert [[b.block_id for b in g] for g in o.blocks] == [list(g) for g in groups]
    assert o.blocks is o.blocks  # made once
    e = o.new_empty()
    assert type(e) is KVCacheBlocks and e == theirs(groups).new_empty()
    assert e.get_block_ids(allow_none=True) is None


def test_block_ids_refuses_what_is_not_a_block_id() -> None:
    assert BlockIds([[1], []]).get_block_ids() == ([1], [])
    with pytest.raises(ha.InvalidBlockError):
        BlockIds([[1, -1]])
    with pytest.raises(TypeError):
        BlockIds([["x"]])


def test_get_block_ids_descriptor_needs_a_block_ids_source() -> None:
    class Odd:
        get_block_ids = GetBlockIds()
        _src = "not ids"

    with pytest.raises(TypeError):
        Odd().get_block_ids()
    with pytest.raises(AttributeError):
        type("NoSrc", (), {"get_block_ids": GetBlockIds()})().get_block_ids()


def crossing_setup() -> tuple[ha.Allocator, int, FakeRequest]:
    a = alloc()
    r = a.add_request()
    allocate(a, r, 20, new=hashes(1), tokens=20)
    return a, r, FakeRequest(r, 32, 33, hashes(1))


def test_fast_allocate_builds_the_class_without_init() -> None:
    a, r, req = crossing_setup()
    fa: FastAllocate[Any] = FastAllocate(a, EMPTY, lambda *x, **k: "slow", NativeKVCacheBlocks, None)
    out = fa(req, 1, num_lookahead_tokens=0)
    assert type(out) is NativeKVCacheBlocks and isinstance(out, KVCacheBlocks)
    assert out._alloc is a and type(out._src) is BlockIds
    assert out.get_block_ids(allow_none=True) == ([3],) == theirs(([3],)).get_block_ids(allow_none=True)
    assert out.get_block_ids(group_ids=[0]) == ([3],)
    assert [b.block_id for b in out.blocks[0]] == [3] and out.blocks[0][0].ref_cnt == 1
    assert out == NativeKVCacheBlocks(a, ([3],))  # the dataclass __eq__: the same blocks
    assert (out + theirs(([5],))).get_block_ids() == ([3, 5],)
    assert out.new_empty().get_block_ids() == ([],)
    req.num_computed_tokens, req.num_tokens = 33, 34
    assert fa(req, 1) is EMPTY
    a.check_invariants()


@pytest.mark.parametrize("make", ["class", "callable"])
def test_bad_crossing_call_raises_the_same_and_changes_nothing(make: str) -> None:
    a, r, req = crossing_setup()
    maker: Any = NativeKVCacheBlocks if make == "class" else (lambda g: NativeKVCacheBlocks(a, g))
    fa: FastAllocate[Any] = FastAllocate(a, EMPTY, lambda *x, **k: "slow", maker, None)
    before = (a.block_ids(r), a.num_free_blocks, a.num_hashes(r))
    req.block_hashes = "not a list"  # type: ignore[assignment]
    with pytest.raises(ha.OutOfRangeError):
        fa(req, 1)
    req.block_hashes = [b"x" * 40]
    with pytest.raises(ha.OutOfRangeError):
        fa(req, 1)
    assert (a.block_ids(r), a.num_free_blocks, a.num_hashes(r)) == before
    req.block_hashes = hashes(1)
    assert fa(req, 1).get_block_ids() == ([3],)
    a.check_invariants()
