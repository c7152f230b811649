"""What a worker reports to the engine when the split is active.

The GPU branch is exercised with torch's device-memory query replaced, since
this machine has no GPU (the only thing mocked); the CPU branch is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_kvmem import vllm_adapter
from vllm_kvmem.budget import kv_budget
from vllm_kvmem.budget.runtime import DeviceLimit
from vllm_kvmem.host_tier.copy_strategy import AUTO_GATHER_MAX_STAGING_BYTES


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
    assert vllm_adapter.free_device_bytes(worker) == 7 << 30
    assert seen == [torch.device("cuda:0")]
    # vLLM held 64 MiB of the budget back (multimodal IPC): hold it back here too.
    limit = DeviceLimit(
        free=vllm_adapter.free_device_bytes(worker), mm_reserved=64 << 20
    )
    assert kv_budget.report_device_limit(worker, limit) == (7 << 30) - (64 << 20)


def test_cpu_limit_is_the_numa_nodes_available_memory():
    import psutil

    limit = vllm_adapter.free_device_bytes(_worker("cpu"))
    assert 0 < limit <= psutil.virtual_memory().total


# ---------------------------------------------------------------- components


def _vllm_config(model, **kw):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvmem import register

    register()
    cfg = EngineArgs(model=str(model), max_model_len=512, **kw).create_engine_config()
    # What a GPU platform would have set (the CPU platform turns graphs off).
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    return cfg


def _explicit_path_tail(worker):
    """vLLM's explicit-budget ``determine_available_memory`` after the profile
    run (which needs a GPU): its real multimodal reservation."""
    from vllm.multimodal.gpu_ipc_memory import reserve_mm_ipc_gpu_memory

    return reserve_mm_ipc_gpu_memory(
        worker.cache_config.kv_cache_memory_bytes,
        worker.vllm_config.model_config.multimodal_config,
        1,
    )


def _gpu_worker(cfg, graph_bytes):
    # The model runner's graph profiler stands in for a GPU capture.
    runner = SimpleNamespace(profile_cudagraph_memory=lambda: graph_bytes)
    return SimpleNamespace(
        device=torch.device("cuda:0"),
        vllm_config=cfg,
        cache_config=cfg.cache_config,
        model_runner=runner,
    )


def _on_a_gpu_platform(monkeypatch):
    """The platform answers as CUDA and the device reports 7 GiB free: the two
    things this machine lacks."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    monkeypatch.setattr(
        torch.accelerator, "get_memory_info", lambda device: (7 << 30, 80 << 30)
    )


def test_gpu_limit_takes_off_cuda_graphs_and_the_host_tier_staging(
    model_8l, monkeypatch
):
    from vllm_kvmem.budget import device_limits
    from vllm_kvmem.host_tier.copy_strategy import DEFAULT_MAX_STAGING_BYTES

    headroom = device_limits.GPU_HEADROOM_BYTES
    staging = 2 * DEFAULT_MAX_STAGING_BYTES  # one buffer per copy stream

    cfg = _vllm_config(
        model_8l,
        kv_cache_memory_bytes=1 << 30,
        pipeline_parallel_size=1,
        enable_pp_prop_kv_cache=True,
        kv_host_cache_bytes=64 << 20,
    )
    _on_a_gpu_platform(monkeypatch)
    worker = _gpu_worker(cfg, graph_bytes=300 << 20)
    limit = device_limits.measure(worker, _explicit_path_tail)
    assert limit.free == 7 << 30
    assert limit.cuda_graphs == 300 << 20
    assert worker.cudagraph_memory_estimate == 300 << 20  # vLLM compares later
    assert limit.staging == staging
    assert (limit.pp_buffers, limit.headroom) == (0, headroom)  # no pipeline
    assert limit.kv_bytes == (7 << 30) - (300 << 20) - staging - headroom
    assert kv_budget.report_device_limit(worker, limit) == limit.kv_bytes
    assert limit.describe() == (
        "7,168.00 MiB free after loading the model, less 300.00 MiB for vLLM's "
        "CUDA graph estimate, less 512.00 MiB for the host KV tier's staging "
        "buffers, less 150.00 MiB for headroom: 6,206.00 MiB"
    )
    # The tier's opt-in layout (BLHNC) copies blocks directly, but gathers a
    # step of many small blocks on CUDA: the smaller cap, per copy stream.
    cfg.cache_config.kv_cache_layout = "BLHNC"
    assert device_limits.staging_reserve_bytes(cfg) == 2 * AUTO_GATHER_MAX_STAGING_BYTES
    cfg.cache_config.kv_cache_layout = "LBHNC"
    assert device_limits.staging_reserve_bytes(cfg) == staging


def test_gpu_limit_without_graphs_or_tier_is_free_memory(model_8l, monkeypatch):
    from vllm.config import CUDAGraphMode

    from vllm_kvmem.budget import device_limits

    cfg = _vllm_config(model_8l, kv_cache_tokens=4096)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE  # enforce_eager
    _on_a_gpu_platform(monkeypatch)
    worker = _gpu_worker(cfg, graph_bytes=300 << 20)
    limit = device_limits.measure(worker, _explicit_path_tail)
    assert (limit.cuda_graphs, limit.staging, limit.mm_reserved) == (0, 0, 0)
    assert limit.kv_bytes == (7 << 30) - device_limits.GPU_HEADROOM_BYTES


def test_token_budget_with_multimodal_ipc_reservation_starts(model_8l, monkeypatch):
    """``--kv-cache-tokens`` runs vLLM's explicit path with a 1-byte placeholder;
    vLLM's multimodal reservation refuses that budget. The limit takes the
    reservation off instead."""
    from vllm.config.multimodal import MultiModalConfig

    from vllm_kvmem.budget import device_limits

    cfg = _vllm_config(model_8l, kv_cache_tokens=4096)
    cfg.model_config.multimodal_config = MultiModalConfig(mm_ipc_gpu_memory_gb=0.25)
    _on_a_gpu_platform(monkeypatch)
    worker = _gpu_worker(cfg, graph_bytes=0)
    with pytest.raises(ValueError):  # the hazard is real: vLLM alone refuses
        _explicit_path_tail(worker)
    limit = device_limits.measure(worker, _explicit_path_tail)
    assert limit.mm_reserved == 256 << 20
    assert limit.kv_bytes == (7 << 30) - (256 << 20) - device_limits.GPU_HEADROOM_BYTES
    assert cfg.cache_config.kv_cache_memory_bytes == 1  # placeholder restored
