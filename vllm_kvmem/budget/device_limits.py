"""How much KV cache a worker's device can really hold, component by component.

When the engine sizes the KV cache itself (``--enable-pp-prop-kv-cache`` or
``--kv-cache-tokens``) every worker reports a limit instead of a budget, and
the engine refuses a share above it. vLLM's explicit-budget path measures
free memory after the profile run, but two things are allocated later on the
device and must come off that figure, or a share the engine accepts runs out
of memory after startup:

* CUDA graphs, captured in ``compile_or_warm_up_model``: vLLM's own estimate
  (``model_runner.profile_cudagraph_memory()``, the figure vLLM subtracts on
  its profiled path) on the platforms where vLLM profiles graphs.
* The host tier copy engine's staging buffers (its per-transfer cap, once per
  copy stream: PyTorch's caching allocator keeps a pool per stream), unless
  the layout lets it copy blocks directly.
* The pipeline receive buffers of every stage after the first
  (``vllm_adapter.pp_receive_bytes``, vLLM's own shapes).

On GPUs a headroom of 150 MiB stays free as well: the margin vLLM's own
``--kv-cache-memory-bytes`` suggestion keeps, because profiling slightly
underestimates (it also covers allocations nobody reports, such as NCCL's
buffers for the first pipeline send).

vLLM's multimodal IPC reservation (``reserve_mm_ipc_gpu_memory``) also comes
off, as on vLLM's own paths. Each worker keeps its components; the engine core
collects them (``collect_from_workers``) so that its errors can name them.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, replace
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.budget.runtime import BudgetRuntime, DeviceLimit
from vllm_kvmem.core.units import gib

logger = init_logger("vllm.kvmem.device_limits")

_WORKER_ATTR = "_kvmem_device_limit"


# ------------------------------------------------------------------- workers


def _profiles_device_memory() -> bool:
    """Whether vLLM profiles device memory on this platform (CUDA, ROCm,
    XPU); the CPU worker's limit is the NUMA node's available memory."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike() or current_platform.is_xpu()


def cuda_graph_estimate_bytes(worker: Any) -> int:
    """vLLM's estimate of the CUDA graph memory this worker will capture, where
    vLLM itself profiles it (``Worker.determine_available_memory``); 0 where no
    graph is captured or the estimate is switched off."""
    from vllm import envs
    from vllm.config import CUDAGraphMode

    config = worker.vllm_config.compilation_config
    if not _profiles_device_memory():
        return 0
    if config.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    estimate = int(worker.model_runner.profile_cudagraph_memory())
    # vLLM compares this with the memory graph capture really takes.
    worker.cudagraph_memory_estimate = estimate
    if not envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS:
        logger.warning(
            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: the %s GiB that CUDA "
            "graphs are estimated to take is not kept off the KV cache limit.",
            gib(estimate),
        )
        return 0
    return estimate


#: Kept free on GPUs: vLLM's ``redundancy_buffer_memory`` (the margin of its
#: ``--kv-cache-memory-bytes`` suggestion, ``Worker.compile_or_warm_up_model``).
GPU_HEADROOM_BYTES = 150 << 20


def headroom_bytes() -> int:
    """:data:`GPU_HEADROOM_BYTES` where vLLM profiles device memory; 0 on CPU,
    whose limit is the NUMA node's available memory, not a profiled figure."""
    return GPU_HEADROOM_BYTES if _profiles_device_memory() else 0


def staging_reserve_bytes(vllm_config: Any) -> int:
    """The host tier's device staging buffers, when the tier is on: the copy
    engine's cap once per copy stream, since each stream's buffer stays in
    that stream's pool of PyTorch's caching allocator. A block-then-layer
    layout such as BLHNC, which the tier opts in to, is copied directly, but
    on CUDA a step of many small scattered blocks is gathered (measured
    faster below 2 MiB blocks), through a smaller staging buffer."""
    from vllm_kvmem.config import KVMemConfig

    if KVMemConfig.from_vllm_config(vllm_config).kv_host_cache_bytes is None:
        return 0
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_kvmem.host_tier.copy_strategy import (
        AUTO_GATHER_MAX_STAGING_BYTES,
        staging_reserve,
    )

    layout = vllm_config.cache_config.kv_cache_layout
    # B outermost, then L (BLHNC, BLNHC): every layer of a block is adjacent.
    block_then_layer = KVCacheLayout.BLHNC.value[:2]
    if layout is not None and KVCacheLayout[layout].value[:2] == block_then_layer:
        return staging_reserve(AUTO_GATHER_MAX_STAGING_BYTES)
    return staging_reserve()


def measure(worker: Any, original: Any) -> DeviceLimit:
    """Run vLLM's ``determine_available_memory`` (profile run, vLLM's checks),
    then measure this worker's limit."""
    from vllm_kvmem.vllm_adapter import (
        free_device_bytes,
        mm_reservation_bytes,
        pp_receive_bytes,
    )

    config = worker.cache_config
    mm = mm_reservation_bytes(worker.vllm_config)
    # A token budget runs vLLM's explicit path with a placeholder smaller than
    # the multimodal reservation, which vLLM would refuse; let it through.
    with _budget_at_least(config, mm + 1):
        held_back = config.kv_cache_memory_bytes - original(worker)
    staging = 0
    staging = staging_reserve_bytes(worker.vllm_config)
    limit = DeviceLimit(
        free=free_device_bytes(worker),
        mm_reserved=max(0, held_back),
        cuda_graphs=cuda_graph_estimate_bytes(worker),
        staging=staging,
        pp_buffers=pp_receive_bytes(worker),
        headroom=headroom_bytes(),
    )
    setattr(worker, _WORKER_ATTR, limit)
    return limit


@contextlib.contextmanager
def _budget_at_least(cache_config: Any, floor: int):
    saved = cache_config.kv_cache_memory_bytes
    if saved < floor:
        cache_config.kv_cache_memory_bytes = floor
    try:
        yield
    finally:
        cache_config.kv_cache_memory_bytes = saved


# --------------------------------------------------------------- engine core


def _limit_of(wrapper: Any) -> dict[str, int] | None:
    """Runs on each worker (``collective_rpc``): its measured components."""
    worker = getattr(wrapper, "worker", wrapper)
    limit = getattr(worker, _WORKER_ATTR, None)
    return asdict(limit) if limit is not None else None


def collect_from_workers(executor: Any) -> None:
    """Store every worker's components where the engine core's planner finds
    them (the engine core's own ``VllmConfig``)."""
    parts = executor.collective_rpc(_limit_of)
    runtime = BudgetRuntime.from_vllm_config(executor.vllm_config)
    limits = [DeviceLimit(**p) if p else None for p in parts]
    replace(runtime, device_limits=limits).store(executor.vllm_config)
    logger.info(
        "KV cache limit per rank: %s.",
        "; ".join(
            f"rank {r}: {d.describe()}" if d else f"rank {r}: n/a"
            for r, d in enumerate(limits)
        ),
    )
