# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lazy offload's late spills on vLLM's own BlockPool, without a model: a cached
block the allocator hands out before the cursor reached it is stored to CPU
under the keys it held, once, registered when its copy completes; on CUDA the
worker's copy is ordered before the step's writes, with no host wait."""

import pytest
import torch
from transformers import LlamaConfig

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 8  # 7 usable: block 0 is the null block
PAGE_BYTES = 2 * BLOCK_SIZE * 64 * 2  # K and V, one head of 64, float16

init_none_hash(sha256)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory) -> VllmConfig:
    model = tmp_path_factory.mktemp("model")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        vocab_size=1024,
    ).save_pretrained(model)
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, max_model_len=256
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=256,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
    )


@pytest.fixture(scope="module")
def vllm_config_with_events(vllm_config) -> VllmConfig:
    return VllmConfig(
        model_config=vllm_config.model_config,
        cache_config=vllm_config.cache_config,
        scheduler_config=vllm_config.scheduler_config,
        device_config=vllm_config.device_config,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="null"
        ),
    )


def _kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * PAGE_BYTES,
                layers=["layer.0"],
                layer_stride=num_blocks * PAGE_BYTES,
                block_stride=PAGE_BYTES,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


def _manager(
    vllm_config: VllmConfig, lazy: bool = True
) -> tuple[SimpleCPUOffloadScheduler, BlockPool]:
    """A manager with room for 16 CPU blocks (lazy mode unless ``lazy`` is
    False), on a real BlockPool."""
    manager = SimpleCPUOffloadScheduler(
        vllm_config,
        _kv_cache_config(NUM_GPU_BLOCKS),
        cpu_capacity_bytes=16 * PAGE_BYTES,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        lazy_offload=lazy,
    )
    pool = BlockPool(NUM_GPU_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
    manager.bind_gpu_block_pool(pool)
    return manager, pool


def _request(tag: int, num_blocks: int = 3) -> Request:
    tokens = [tag * 1000 + i for i in range(num_blocks * BLOCK_SIZE + 1)]
    return Request(
        f"req-{tag}",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def _computed_and_freed(pool: BlockPool, request: Request) -> list[int]:
    """The request's full blocks, computed, cached and freed (tail first), as
    the scheduler leaves a finished request's prefix."""
    n = len(request.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(request, blocks, 0, n, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    return [b.block_id for b in blocks]


def _step(manager: SimpleCPUOffloadScheduler) -> SimpleCPUOffloadMetadata:
    return manager.build_connector_meta(SchedulerOutput.make_empty())


def _cpu_hit(manager: SimpleCPUOffloadScheduler, tag: int) -> int:
    hit, _ = manager.get_num_new_matched_tokens(_request(tag), 0)
    manager.request_finished(_request(tag), [])
    return hit or 0


def _complete(manager: SimpleCPUOffloadScheduler, event: int) -> None:
    """Every worker reports the store event done."""
    manager.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                completed_store_events={event: 1}
            )
        )
    )


def test_pool_tells_listeners_of_cached_blocks_it_hands_out():
    pool = BlockPool(NUM_GPU_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
    cached = _computed_and_freed(pool, _request(7))
    seen: list[list[tuple[int, bool]]] = [[], []]
    for record in seen:
        pool.add_eviction_listener(
            lambda b, record=record: record.append((b.block_id, b.block_hash is not None))
        )
    pool.get_new_blocks(pool.get_num_free_blocks())
    # Each listener, each cached block once, while it still holds its hash;
    # never an uncached block.
    assert seen[0] == seen[1] and all(had_hash for _, had_hash in seen[0])
    assert sorted(b for b, _ in seen[0]) == sorted(cached)


def test_block_evicted_before_the_cursor_is_spilled_with_its_keys(vllm_config):
    manager, pool = _manager(vllm_config)
    evicted = _computed_and_freed(pool, _request(1))
    # Allocated in the same pass, before the walk: all of request 1's blocks.
    pool.get_new_blocks(pool.get_num_free_blocks())
    meta = _step(manager)
    assert sorted(meta.spill_gpu_blocks) == sorted(evicted)
    assert len(set(meta.spill_cpu_blocks)) == 3 and meta.store_gpu_blocks == []
    assert meta.spill_event >= 0
    # Not findable before every worker has copied it.
    assert _cpu_hit(manager, 1) == 0
    _complete(manager, meta.spill_event)
    # Then under the keys the GPU blocks held; no ref is left on either pool.
    assert _cpu_hit(manager, 1) == 3 * BLOCK_SIZE
    cpu_pool = manager.cpu_block_pool
    assert cpu_pool.get_num_free_blocks() == cpu_pool.num_gpu_blocks - 1
    assert all(pool.blocks[b].ref_cnt == 1 for b in evicted)  # the new owner's
    assert _step(manager).spill_gpu_blocks == []  # drained: spilled once


def test_spills_emit_cpu_block_stored_events(vllm_config_with_events):
    manager, pool = _manager(vllm_config_with_events)
    _computed_and_freed(pool, _request(4))
    pool.get_new_blocks(pool.get_num_free_blocks())
    meta = _step(manager)
    assert list(manager.take_events()) == []  # nothing before the copy completes
    _complete(manager, meta.spill_event)
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 3 and {e.medium for e in stored} == {MEDIUM_CPU}


def test_blocks_the_cursor_stored_are_not_spilled_again(vllm_config):
    manager, pool = _manager(vllm_config)
    stored = _computed_and_freed(pool, _request(2))
    meta = _step(manager)  # the walk reaches them
    assert sorted(meta.store_gpu_blocks) == sorted(stored)
    _complete(manager, meta.store_event)
    pool.get_new_blocks(pool.get_num_free_blocks())  # now they are evicted
    assert _step(manager).spill_gpu_blocks == []  # already on CPU
    assert _cpu_hit(manager, 2) == 3 * BLOCK_SIZE


def test_reset_drops_recorded_evictions(vllm_config):
    manager, pool = _manager(vllm_config)
    _computed_and_freed(pool, _request(3))
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert manager.reset()
    assert _step(manager).spill_gpu_blocks == []
    assert _cpu_hit(manager, 3) == 0


def test_eager_mode_listens_to_nothing(vllm_config):
    _, pool = _manager(vllm_config, lazy=False)
    assert pool._eviction_listeners == []


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="stream ordering needs a CUDA device"
)


def _cuda_worker() -> tuple[SimpleCPUOffloadWorker, torch.Tensor, torch.Tensor]:
    config = _kv_cache_config(NUM_GPU_BLOCKS)
    worker = SimpleCPUOffloadWorker(None, config, 4 * PAGE_BYTES)
    kv = torch.zeros(NUM_GPU_BLOCKS * PAGE_BYTES, dtype=torch.int8, device="cuda")
    worker.register_kv_caches({"layer.0": kv})
    assert worker.cpu_kv_caches is not None
    return worker, kv.view(NUM_GPU_BLOCKS, PAGE_BYTES), worker.cpu_kv_caches["layer.0"]


@requires_cuda
def test_spill_copies_the_block_before_the_step_overwrites_it():
    worker, kv, cpu = _cuda_worker()
    kv[5].fill_(7)
    worker.handle_preemptions(
        SimpleCPUOffloadMetadata(
            spill_event=0, spill_gpu_blocks=[5], spill_cpu_blocks=[3]
        )
    )
    kv[5].fill_(-1)  # the step's write, queued right after on the compute stream
    torch.cuda.synchronize()
    assert bool((cpu[3] == 7).all())


@requires_cuda
def test_spill_does_not_wait_on_the_host():
    worker, kv, _ = _cuda_worker()
    torch.cuda._sleep(1 << 30)  # keeps the compute stream busy
    worker.handle_preemptions(
        SimpleCPUOffloadMetadata(
            spill_event=0, spill_gpu_blocks=[2], spill_cpu_blocks=[0]
        )
    )
    # Back on the host while the copy still waits for the compute stream.
    assert worker._spill_events and not worker._spill_events[0][1].query()
    torch.cuda.synchronize()
    assert worker.get_finished(set()) == (None, None)
    assert worker.build_connector_worker_meta().completed_store_events == {0: 1}
