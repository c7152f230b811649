# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HostTierWorker on a real KV cache allocation (CPU): blocks saved to host
slots and loaded into other blocks come back byte for byte, in a layer-outer
and a block-outer layout."""

import pytest
import torch

from vllm.v1.host_kv_tier.metadata import HostTierMetadata, LoadChunk
from vllm.v1.host_kv_tier.worker import HostTierWorker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

NUM_BLOCKS = 8
LAYERS = ["layers.0", "layers.1", "layers.2"]


def _config(block_outer: bool) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32
    )
    page = spec.page_size_bytes
    size = page * NUM_BLOCKS * len(LAYERS)
    if block_outer:  # BLHNC: a block's pages of every layer are adjacent
        tensor = KVCacheTensor(size, LAYERS, page, page * len(LAYERS))
    else:  # LBHNC: each layer's blocks are adjacent
        tensor = KVCacheTensor(size, LAYERS, page * NUM_BLOCKS, page)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


def _pages(buf: torch.Tensor, tensor: KVCacheTensor, page: int, block: int):
    starts = (i * tensor.layer_stride + block * tensor.block_stride for i in range(3))
    return [buf[s : s + page].clone() for s in starts]


@pytest.mark.parametrize("block_outer", [False, True])
def test_saved_blocks_load_back_into_other_blocks(block_outer):
    config = _config(block_outer)
    tensor = config.kv_cache_tensors[0]
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    buf = torch.randint(0, 256, (tensor.size,), dtype=torch.uint8)
    worker = HostTierWorker(config, enabled=True, num_slots=4, verify=True)
    worker.register_kv_caches({name: buf for name in LAYERS})
    before = {b: _pages(buf, tensor, page, b) for b in (1, 2)}

    # Blocks 1 and 2 are evicted: copied to slots 3 and 0 before the forward.
    worker.handle_preemptions(HostTierMetadata(seq=1, evict_saves=[(1, 3), (2, 0)]))
    buf.zero_()
    # A later request hits them: loaded into blocks 6 and 5 in its step.
    chunk = LoadChunk("r", slots=[3, 0], blocks=[6, 5], last=True, sync=True)
    worker.start_load_kv(HostTierMetadata(seq=2, loads=[chunk]))

    for src, dst in ((1, 6), (2, 5)):
        assert all(
            torch.equal(a, b)
            for a, b in zip(before[src], _pages(buf, tensor, page, dst))
        )
    assert worker.get_block_ids_with_load_errors() == set()
    # Nothing else was written.
    for block in (0, 1, 2, 3, 4, 7):
        assert all(p.count_nonzero() == 0 for p in _pages(buf, tensor, page, block))
    worker.shutdown()
