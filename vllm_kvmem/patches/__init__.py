"""Every vLLM patch, one module each, one :class:`Patch` record per module.

``ALL_PATCHES`` is the order they are applied in; ``docs/patches.md`` is
generated from these records (``kvmem patches --markdown``).
"""

from __future__ import annotations

from vllm_kvmem.patches._registry import (
    Patch,
    apply_all,
    for_platform,
    for_series,
    is_applied,
    original_of,
)
from vllm_kvmem.patches.cpu_attn_layouts import PATCH as CPU_ATTN_LAYOUTS
from vllm_kvmem.patches.cpu_worker_memory import PATCH as CPU_WORKER_MEMORY
from vllm_kvmem.patches.engine_args_cli import PATCH as ENGINE_ARGS_CLI
from vllm_kvmem.patches.engine_args_config import PATCH as ENGINE_ARGS_CONFIG
from vllm_kvmem.patches.engine_args_from_cli import PATCH as ENGINE_ARGS_FROM_CLI
from vllm_kvmem.patches.engine_args_init import ASYNC_PATCH as ASYNC_ENGINE_ARGS_INIT
from vllm_kvmem.patches.engine_args_init import PATCH as ENGINE_ARGS_INIT
from vllm_kvmem.patches.engine_args_model_config import (
    PATCH as ENGINE_ARGS_MODEL_CONFIG,
)
from vllm_kvmem.patches.executor_device_limits import PATCH as EXECUTOR_DEVICE_LIMITS
from vllm_kvmem.patches.executor_kv_cache_init import PATCH as EXECUTOR_KV_CACHE_INIT
from vllm_kvmem.patches.gpu_worker_memory import PATCH as GPU_WORKER_MEMORY
from vllm_kvmem.patches.kv_cache_builder import PATCH as KV_CACHE_BUILDER
from vllm_kvmem.patches.kv_cache_configs import PATCH as KV_CACHE_CONFIGS
from vllm_kvmem.patches.kv_cache_layout import PATCH as KV_CACHE_LAYOUT
from vllm_kvmem.patches.worker_kv_cache_init import PATCH as WORKER_KV_CACHE_INIT

ALL_PATCHES: tuple[Patch, ...] = (
    ENGINE_ARGS_CLI,
    ENGINE_ARGS_FROM_CLI,
    ENGINE_ARGS_INIT,
    ASYNC_ENGINE_ARGS_INIT,
    ENGINE_ARGS_CONFIG,
    ENGINE_ARGS_MODEL_CONFIG,
    KV_CACHE_CONFIGS,
    KV_CACHE_BUILDER,
    GPU_WORKER_MEMORY,
    CPU_WORKER_MEMORY,
    EXECUTOR_DEVICE_LIMITS,
    EXECUTOR_KV_CACHE_INIT,
    WORKER_KV_CACHE_INIT,
    KV_CACHE_LAYOUT,
    CPU_ATTN_LAYOUTS,
)

__all__ = [
    "ALL_PATCHES",
    "Patch",
    "apply_all",
    "for_platform",
    "for_series",
    "is_applied",
    "original_of",
]
