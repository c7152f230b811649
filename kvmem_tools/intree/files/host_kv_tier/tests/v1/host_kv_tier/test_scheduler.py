# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HostTierScheduler on vLLM's own BlockPool, without a model: what it copies
ahead, what it spills late and with which hash, and how hits load."""

from types import SimpleNamespace

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.host_kv_tier.config import HostTierConfig
from vllm.v1.host_kv_tier.scheduler import HostTierScheduler

BLOCK_SIZE = 4
BLOCK_BYTES = 1024


def _tier(pool: BlockPool, host_blocks: int = 8, step_blocks: int = 2):
    config = HostTierConfig(
        num_host_blocks=host_blocks, step_bytes=step_blocks * BLOCK_BYTES
    )
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8, max_num_seqs=2)
    )
    tier = HostTierScheduler(
        config,
        vllm_config,
        reason="",
        num_slots=host_blocks,
        pipeline_slot_bytes=BLOCK_BYTES,
        block_size=BLOCK_SIZE,
    )
    tier.bind_gpu_block_pool(pool)
    return tier


def _request(tag: str, num_blocks: int) -> SimpleNamespace:
    hashes = [BlockHash(f"{tag}{i}".encode()) for i in range(num_blocks)]
    return SimpleNamespace(
        request_id=tag,
        block_hashes=hashes,
        num_tokens=num_blocks * BLOCK_SIZE + 1,
    )


def _computed(pool: BlockPool, request) -> list:
    """Blocks of ``request``'s prefix, computed and cached (still in use)."""
    n = len(request.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(request, blocks, 0, n, BLOCK_SIZE, 0)
    return blocks


def _free(pool: BlockPool, blocks: list) -> None:
    pool.free_blocks(reversed(blocks))  # vLLM frees a request's tail first


def _pass(tier: HostTierScheduler, handed_out: list = ()):
    """The connector's metadata for one scheduling pass, whose scheduler
    output reports the blocks it handed to a running request."""
    output = SchedulerOutput.make_empty()
    if handed_out:
        output.scheduled_cached_reqs.req_ids.append("running")
        output.scheduled_cached_reqs.new_block_ids.append(
            ([b.block_id for b in handed_out],)
        )
    return tier.build_connector_meta(output)


def _keys(request) -> list:
    return [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]


def test_copies_ahead_only_cached_blocks_within_the_budget():
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    tier = _tier(pool)
    a = _request("a", 4)
    blocks = _computed(pool, a)
    assert _pass(tier).ahead_saves == []  # in use
    _free(pool, blocks)
    meta = _pass(tier)
    # The head of the free queue holds uncached blocks; then a's, tail first.
    assert [b for b, _ in meta.ahead_saves] == [blocks[3].block_id, blocks[2].block_id]
    assert meta.evict_saves == []


def test_block_evicted_before_its_copy_is_spilled_with_its_hash():
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    tier = _tier(pool)
    a = _request("a", 4)
    blocks = _computed(pool, a)
    _free(pool, blocks)
    ahead = _pass(tier).ahead_saves
    # Handing out every free block evicts every cached one.
    meta = _pass(tier, pool.get_new_blocks(pool.get_num_free_blocks()))
    # a's first two blocks had no copy: spilled before the forward, once.
    assert [b for b, _ in meta.evict_saves] == [blocks[1].block_id, blocks[0].block_id]
    # The two copied ahead may still be in flight: the forward waits for them.
    assert sorted(meta.fence) == sorted(b for b, _ in ahead)
    assert all(key in tier.index for key in _keys(a))
    assert _pass(tier).evict_saves == []


def test_prefix_cache_reset_spills_nothing():
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    tier = _tier(pool, step_blocks=1)
    blocks = _computed(pool, _request("a", 4))
    _free(pool, blocks)
    _pass(tier)
    assert pool.reset_prefix_cache()
    assert tier.reset_cache()
    meta = _pass(tier, pool.get_new_blocks(pool.get_num_free_blocks()))
    assert meta.evict_saves == [] and meta.ahead_saves == []
    assert len(tier.index) == 0


def test_finished_request_evicted_in_the_next_pass_is_spilled():
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=4)
    tier = _tier(pool, step_blocks=1)
    _pass(tier)
    a = _request("a", 4)
    blocks = _computed(pool, a)
    tier.request_finished(a, ([b.block_id for b in blocks],))
    _free(pool, blocks)
    # The next scheduling pass evicts them before any walk saw them free.
    meta = _pass(tier, pool.get_new_blocks(pool.get_num_free_blocks()))
    assert sorted(b for b, _ in meta.evict_saves) == sorted(b.block_id for b in blocks)
    assert all(key in tier.index for key in _keys(a))


def test_host_hit_loads_in_budget_sized_chunks():
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=4)
    tier = _tier(pool, step_blocks=2)
    a = _request("a", 4)
    _free(pool, _computed(pool, a))
    _pass(tier)
    _pass(tier, pool.get_new_blocks(pool.get_num_free_blocks()))  # a leaves
    pool.free_blocks(pool.blocks[1:])

    hit, is_async = tier.get_num_new_matched_tokens(a, 0)
    assert (hit, is_async) == (4 * BLOCK_SIZE, True)  # 4 blocks > 2 per step
    new = pool.get_new_blocks(4)
    tier.update_state_after_alloc(a, SimpleNamespace(blocks=(new,)), hit)
    chunks = [_pass(tier).loads for _ in range(2)]
    assert [[c.blocks for c in step] for step in chunks] == [
        [[b.block_id for b in new[:2]]],
        [[b.block_id for b in new[2:]]],
    ]
    assert [step[0].last for step in chunks] == [False, True]
    # A request with no host copy misses.
    assert tier.get_num_new_matched_tokens(_request("b", 4), 0) == (0, False)
