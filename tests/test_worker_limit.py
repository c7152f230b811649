"""What a worker reports to the engine when the split is active.

The GPU branch is exercised with torch's device-memory query replaced, since
this machine has no GPU (the only thing mocked); the CPU branch is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_kvmem import pp_prop


def _worker(device, budget=1 << 30):
    return SimpleNamespace(
        device=torch.device(device),
        cache_config=SimpleNamespace(kv_cache_memory_bytes=budget),
    )


def test_gpu_limit_is_free_device_memory_after_profiling(monkeypatch):
    seen = []

    def fake_memory_info(device):  # stands in for the GPU this machine lacks
        seen.append(device)
        return (7 << 30, 80 << 30)

    monkeypatch.setattr(torch.accelerator, "get_memory_info", fake_memory_info)
    worker = _worker("cuda:0")
    assert pp_prop.device_kv_limit(worker) == 7 << 30
    assert seen == [torch.device("cuda:0")]
    # vLLM held 64 MiB of the budget back (multimodal IPC): hold it back here too.
    limit = pp_prop.report_device_limit(worker, held_back=64 << 20)
    assert limit == (7 << 30) - (64 << 20)


def test_cpu_limit_is_the_numa_nodes_available_memory():
    import psutil

    limit = pp_prop.device_kv_limit(_worker("cpu"))
    assert 0 < limit <= psutil.virtual_memory().total
