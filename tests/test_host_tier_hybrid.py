"""The host tier on hybrid models, below the engine: which blocks a host hit
restores per KV cache group, and how one block's bytes are found when vLLM
overlays its groups.

The hit rule is checked against vLLM's own: the same blocks held by a real
vLLM ``BlockPool`` give vLLM's hybrid coordinator a hit of the same length
as the tier's lookup over its host index. The loads are checked on vLLM's
real ``KVCacheBlocks`` (null blocks where vLLM skips a sliding window's
blocks). Engine runs are in ``test_host_tier_engine.py``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.kv_region import PageGeometry, distinct_regions
from vllm_kvmem.host_tier.scheduler import HostTierScheduler
from vllm_kvmem.host_tier.support import GroupWindow, describe_groups

BS = 4  # tokens per block


def _spec(window: int | None):
    kw = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    if window is None:
        return FullAttentionSpec(**kw)
    return SlidingWindowSpec(**kw, sliding_window=window)


# Sliding windows of 5, 9 and 14 tokens and full attention, in vLLM's order
# for the engine tests' model (its sliding-window groups come first).
WINDOWS = (5, 9, None, 14)


def _vllm_coordinator(windows=WINDOWS, num_blocks=512):
    """vLLM's own hybrid coordinator (and its block pool) for these groups."""
    groups = [KVCacheGroupSpec([f"layer{i}"], _spec(w)) for i, w in enumerate(windows)]
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return get_kv_cache_coordinator(
        kv_cache_config=config,
        max_model_len=4096,
        max_in_flight_tokens=64,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )


def _tier(windows=WINDOWS, num_slots=512, step_bytes=1 << 30):
    return HostTierScheduler(
        HostTierConfig(step_bytes=step_bytes),
        SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=64)),
        reason="",
        num_slots=num_slots,
        pipeline_slot_bytes=1,
        block_size=BS,
        groups=tuple(GroupWindow(i, w) for i, w in enumerate(windows)),
    )


def _hashes(n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") * 4 for i in range(1, n + 1)]


def _request(hashes, num_tokens, req_id="r"):
    return SimpleNamespace(
        request_id=req_id, block_hashes=hashes, num_tokens=num_tokens
    )


def _hold(tier, coordinator, hashes, held, first_block=1):
    """The blocks ``held`` ((group, position) pairs) on the host tier and, the
    same blocks, in vLLM's block pool (its blocks from ``first_block`` on)."""
    pool = coordinator.block_pool
    for n, (gid, pos) in enumerate(sorted(held)):
        key = make_block_hash_with_group_id(hashes[pos], gid)
        tier.index.put(key)
        block = pool.blocks[first_block + n]
        block.set_block_hash(key, (pos + 1) * BS)
        pool.cached_block_hash_to_block.insert(key, block)


@pytest.mark.parametrize("seed", range(200))
def test_hit_is_the_one_vllms_hybrid_coordinator_finds(seed):
    """For random host contents, and a random local prefix (blocks vLLM's
    device cache hit before asking the tier), the tier's hit ends where
    vLLM's own hybrid coordinator ends a hit on the same blocks."""
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    hashes = _hashes(n)
    num_tokens = n * BS + rng.randint(0, BS)  # the last token is recomputed
    stop = min(n, (num_tokens - 1) // BS)
    start = rng.randint(0, max(0, stop - 1)) if rng.random() < 0.4 else 0
    density = rng.choice([0.5, 0.8, 0.95, 1.0])
    held = {
        (g, pos)
        for g in range(len(WINDOWS))
        for pos in range(start, n)
        if rng.random() < density
    }
    tier, coordinator = _tier(), _vllm_coordinator()
    _hold(tier, coordinator, hashes, held)
    # The local prefix: vLLM's device blocks before ``start``, every group.
    local = {(g, p) for g in range(len(WINDOWS)) for p in range(start)}
    _hold(_tier(), coordinator, hashes, local, first_block=len(held) + 1)
    _, vllm_hit, _ = coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
    got, _ = tier.get_num_new_matched_tokens(_request(hashes, num_tokens), start * BS)
    if vllm_hit <= start * BS:
        assert got == 0
    else:
        assert start * BS + got == vllm_hit


def test_sliding_window_hit_loads_only_the_window_vllm_allocates():
    """Full attention restores every block of the hit, a sliding window only
    the blocks vLLM gives real blocks (the others are vLLM's null block), and
    the tier pins exactly the slots it loads from."""
    windows = (None, 9)  # 9 tokens: the next token attends to 3 blocks of 4
    hashes = _hashes(8)
    tier = _tier(windows)
    held = {(0, p) for p in range(8)} | {(1, p) for p in range(8)}
    _hold(tier, _vllm_coordinator(windows), hashes, held)
    request = _request(hashes, 8 * BS + 1)
    got, load_async = tier.get_num_new_matched_tokens(request, 0)
    assert (got, load_async) == (8 * BS, False)  # fits the step: synchronous
    # vLLM's allocation for the hit: a block per position for full attention;
    # for the window, nulls before its first needed block (8 * 4 - 9 + 1 = 24
    # tokens skipped: 6 blocks).
    pool = _vllm_coordinator(windows).block_pool
    full = [pool.blocks[10 + i] for i in range(8)]
    window = [pool.null_block] * 6 + [pool.blocks[30], pool.blocks[31]]
    tier.update_state_after_alloc(request, KVCacheBlocks((full, window)), got)
    (chunk,) = tier.loads.sync_loads
    assert chunk.blocks == [b.block_id for b in full] + [30, 31]
    slot = {
        (g, p): tier.index.slot_of(make_block_hash_with_group_id(hashes[p], g))
        for g, p in held
    }
    assert chunk.slots == [slot[0, p] for p in range(8)] + [slot[1, 6], slot[1, 7]]
    assert chunk.invalid == []
    assert tier.index.pinned_slots == 10  # only what is loaded


def test_shorter_hit_than_offered_loads_its_own_window():
    """vLLM takes a shorter hit than offered: the window then ends earlier and
    needs earlier blocks. Those the host holds are loaded (and pinned); those
    it does not are reported as failed loads, which vLLM recomputes, never
    left holding garbage."""
    windows = (None, 9)
    hashes = _hashes(8)
    tier = _tier(windows)
    held = {(0, p) for p in range(8)} | {(1, p) for p in (5, 6, 7)}
    _hold(tier, _vllm_coordinator(windows), hashes, held)
    request = _request(hashes, 8 * BS + 1)
    assert tier.get_num_new_matched_tokens(request, 0)[0] == 8 * BS
    pool = _vllm_coordinator(windows).block_pool
    full = [pool.blocks[10 + i] for i in range(6)]
    # A 6-block hit: the window needs blocks 3..5; the host holds only 5.
    window = [pool.null_block] * 3 + [pool.blocks[40], pool.blocks[41], pool.blocks[42]]
    tier.update_state_after_alloc(request, KVCacheBlocks((full, window)), 6 * BS)
    (chunk,) = tier.loads.sync_loads
    assert chunk.invalid == [40, 41]
    assert chunk.blocks == [b.block_id for b in full] + [42]
    assert tier.index.pinned_slots == len(chunk.slots) == 7


def test_keys_carry_the_group():
    """The same prefix in two groups is two host blocks: a hit on one group's
    copy never serves the other group."""
    windows = (None, 9)
    hashes = _hashes(4)
    tier = _tier(windows)
    _hold(tier, _vllm_coordinator(windows), hashes, {(0, p) for p in range(4)})
    assert tier.get_num_new_matched_tokens(_request(hashes, 4 * BS + 1), 0)[0] == 0


def test_describe_groups():
    assert describe_groups((GroupWindow(0),)) == "1 KV cache group (full attention)"
    groups = tuple(GroupWindow(i, w) for i, w in enumerate((256, None, 256, 512)))
    assert describe_groups(groups) == (
        "4 KV cache groups (2 sliding window of 256 tokens, 1 full attention, "
        "1 sliding window of 512 tokens)"
    )


# -- one block's bytes when vLLM overlays its groups ---------------------------


def test_overlaid_groups_are_copied_once():
    """vLLM's hybrid groups alias from byte 0 (one tensor per group, same
    geometry); a group with fewer layers is covered by a larger one."""
    page, blocks = 100, 10
    per_layer = dict(page_bytes=page, layer_stride=page * blocks, block_stride=page)
    two = PageGeometry(offset=0, num_layers=2, **per_layer)
    one = PageGeometry(offset=0, num_layers=1, **per_layer)
    assert distinct_regions([one, two, two]) == [two]
    # BLHNC: every group packs its pages at the front of the block.
    packed = dict(page_bytes=page, layer_stride=page, block_stride=2 * page)
    a, b = PageGeometry(0, 2, **packed), PageGeometry(0, 1, **packed)
    assert distinct_regions([a, b]) == [a]
    # Regions side by side (one group of two specs) are both kept.
    c = PageGeometry(offset=2 * page * blocks, num_layers=2, **per_layer)
    assert distinct_regions([two, c]) == [two, c]


def test_partial_overlap_is_refused():
    geometry = dict(page_bytes=100, layer_stride=1000, block_stride=100)
    with pytest.raises(ValueError, match="overlap only in part"):
        distinct_regions(
            [PageGeometry(0, 2, **geometry), PageGeometry(50, 1, **geometry)]
        )
