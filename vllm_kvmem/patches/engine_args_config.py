"""Validate the vllm-kvmem options when vLLM builds its VllmConfig."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def create_engine_config(self, *args, **kwargs):
        from vllm_kvmem.host_tier import prepare_engine_args
        from vllm_kvmem.pp_prop import validate_engine_config

        prepare_engine_args(self)
        config = original(self, *args, **kwargs)
        validate_engine_config(config)
        return config

    return create_engine_config


PATCH = Patch(
    name="engine_args_config",
    target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
    make_replacement=_make,
    signature=("self", "usage_context", "headless"),
    processes=("API server / LLM process",),
    platforms=ALL_PLATFORMS,
    why="Bad vllm-kvmem options must fail at startup with a message naming the "
    "flag, before any worker starts; `--enable-pp-prop-kv-cache` without "
    "`--kv-cache-memory-bytes` is such an error. The check must see the final "
    "config (on CPU, `VLLM_CPU_KVCACHE_SPACE` sets `kv_cache_memory_bytes` "
    "while the VllmConfig is built).",
    how="Wraps the method: first turns `--kv-host-cache-bytes` into vLLM's own "
    "`kv_transfer_config` (the host tier connector) after checking host memory, "
    "then builds the VllmConfig as vLLM does, parses "
    "`additional_config['kvmem']` into `KVMemConfig` (normalised in place) and "
    "runs the cross-flag checks.",
    upstream="None (same as engine_args_cli).",
    remove_when="The options exist in vLLM's own CacheConfig with its own checks.",
)
