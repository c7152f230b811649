# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SimpleCPUOffloadWorker on a KV cache in host memory (vLLM's CPU platform):
stores and loads are synchronous tensor copies, reported through the same
event bookkeeping as on CUDA. Runs on any platform."""

import pytest
import torch

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.simple_kv_offload.copy_backend import SyncCopyBackend
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

NUM_BLOCKS = 8
PAGE_BYTES = 256
LAYERS = ["layer.0", "layer.1"]


def _worker(
    num_cpu_blocks: int, **kwargs
) -> tuple[SimpleCPUOffloadWorker, torch.Tensor]:
    """A worker on a layer-outermost KV cache of two layers, and that cache."""
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=len(LAYERS) * NUM_BLOCKS * PAGE_BYTES,
                layers=LAYERS,
                layer_stride=NUM_BLOCKS * PAGE_BYTES,
                block_stride=PAGE_BYTES,
            )
        ],
        kv_cache_groups=[],
    )
    cpu_bytes = num_cpu_blocks * len(LAYERS) * PAGE_BYTES
    worker = SimpleCPUOffloadWorker(None, config, cpu_bytes, **kwargs)
    cache = torch.randint(-128, 127, (len(LAYERS) * NUM_BLOCKS * PAGE_BYTES,)).to(
        torch.int8
    )
    worker.register_kv_caches({name: cache for name in LAYERS})
    return worker, cache.view(len(LAYERS), NUM_BLOCKS, PAGE_BYTES)


def test_store_then_load_round_trip():
    worker, kv = _worker(num_cpu_blocks=4)
    assert isinstance(worker._backend, SyncCopyBackend)
    assert worker.num_cpu_blocks == 4 and worker.load_stream is None
    stored = kv[:, [3, 5]].clone()

    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(
            store_event=0, store_gpu_blocks=[3, 5], store_cpu_blocks=[2, 0]
        )
    )
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.completed_store_events == {0: 1}
    worker.clear_connector_metadata()

    kv[:, 6:8] = 0
    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(
            load_event=0,
            load_gpu_blocks=[6, 7],
            load_cpu_blocks=[2, 0],
            load_event_to_reqs={0: ["req"]},
            need_flush=True,
        )
    )
    worker.handle_preemptions(worker._connector_metadata)
    worker.start_load_kv()
    assert worker.get_finished(set()) == (None, {"req"})
    assert torch.equal(kv[:, 6:8], stored)
    assert worker.build_connector_worker_meta() is None


def test_disk_backend_is_refused_on_cpu(tmp_path):
    with pytest.raises(ValueError, match='kv_offload_backend="cpu"'):
        _worker(
            num_cpu_blocks=4,
            kv_offload_backend="disk",
            disk_path=str(tmp_path / "kv"),
            disk_capacity_bytes=1 << 20,
        )
