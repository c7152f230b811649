"""The host tier's block index (vLLM-free): prefix matching, eviction, pins."""

from __future__ import annotations

import pytest

from vllm_kvmem.host_tier.host_index import HostBlockIndex


def test_prefix_match_stops_at_the_first_miss():
    idx = HostBlockIndex(8)
    for k in "abd":
        idx.put(k)
    assert len(idx.match_prefix(list("abcd"))) == 2
    assert idx.counters.lookup_blocks == 4 and idx.counters.hit_blocks == 2


def test_put_twice_copies_once():
    idx = HostBlockIndex(4)
    assert idx.put("a") is not None
    assert idx.put("a") is None  # already held: nothing to copy
    assert idx.counters.spilled_blocks == 1


@pytest.mark.parametrize("policy,survivor", [("lru", "a"), ("fifo", "b")])
def test_eviction_policy(policy, survivor):
    idx = HostBlockIndex(2, policy)
    idx.put("a")
    idx.put("b")
    idx.match_prefix(["a"])  # a hit refreshes "a" under LRU only
    idx.put("c")
    assert survivor in idx and "c" in idx and len(idx) == 2
    assert idx.counters.dropped_blocks == 1


def test_pinned_slots_are_never_reused():
    idx = HostBlockIndex(2)
    sa, sb = idx.put("a"), idx.put("b")
    idx.pin([sa, sb])
    assert idx.put("c") is None  # every slot pinned: the block is not spilled
    idx.unpin([sa])
    assert idx.put("c") == sa and "a" not in idx
    idx.unpin([sb])
    assert idx.pinned_slots == 0


def test_slots_are_distinct_and_bounded():
    idx = HostBlockIndex(3)
    slots = {idx.put(k) for k in "abcdef"}
    assert slots == {0, 1, 2}


@pytest.mark.parametrize(
    "n,policy,match", [(0, "lru", "at least one"), (2, "mru", "mru")]
)
def test_bad_arguments(n, policy, match):
    with pytest.raises(ValueError, match=match):
        HostBlockIndex(n, policy)


def test_drop_slot_forgets_the_block_and_frees_the_slot_once_unpinned():
    index = HostBlockIndex(2)
    a, b = index.put("a"), index.put("b")
    index.pin([a])
    assert index.drop_slot(a) and not index.drop_slot(a)
    assert "a" not in index and index.match_prefix(["a"]) == []
    # Still pinned by a pending load: not handed to a new block yet.
    assert index.put("c") == b  # evicts "b" instead
    index.unpin([a])
    assert index.put("d") == a
