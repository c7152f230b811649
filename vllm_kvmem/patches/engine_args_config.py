"""Check the vllm-kvmem options, and set up what they need, when vLLM builds
its VllmConfig."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def create_engine_config(self, *args, **kwargs):
        from vllm_kvmem.host_tier_setup import add_connector_config
        from vllm_kvmem.patches._native import refuse_native_options

        refuse_native_options(self.additional_config)
        add_connector_config(self)
        config = original(self, *args, **kwargs)
        from vllm_kvmem.patches._native import log_once

        log_once()  # vLLM's logging is configured now
        from vllm_kvmem.config import check_options

        check_options(config)
        from vllm_kvmem.budget import token_budget

        token_budget.check_budget_flags(config)
        from vllm_kvmem.budget import pp_prop

        pp_prop.check_flags(config)
        token_budget.set_tokens_placeholder(config)
        return config

    return create_engine_config


PATCH = Patch(
    name="engine_args_config",
    target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
    make_replacement=_make,
    signature=("self", "usage_context", "headless"),
    processes=("API server / LLM process",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="Bad vllm-kvmem options must fail at startup with a message naming the "
    "flag, before any worker starts; `--enable-pp-prop-kv-cache` without "
    "`--kv-cache-memory-bytes` is such an error. The check must see the final "
    "config (on CPU, `VLLM_CPU_KVCACHE_SPACE` sets `kv_cache_memory_bytes` "
    "while the VllmConfig is built).",
    how="Wraps the method: first turns `--kv-host-cache-bytes` into vLLM's own "
    "`kv_transfer_config` (the host tier connector) after checking host memory "
    "(`engine_args_model_config` drops it for a model the tier cannot serve), "
    "then builds the VllmConfig as vLLM does, validates the options (under the "
    "plugin also storing `additional_config['kvmem']` normalised), runs the "
    "cross-flag checks of the token budget and of `--enable-pp-prop-kv-cache`, "
    "and with `--kv-cache-tokens` sets the 1-byte placeholder budget.",
    upstream="None (same as engine_args_cli).",
    remove_when="The options exist in vLLM's own CacheConfig with its own checks.",
    native_options=True,
    native_note="An option vLLM has natively that is given in "
    "`additional_config['kvmem']` is refused, naming vLLM's own option.",
    idle="Calls vLLM's method; the flag checks find nothing to check, no "
    "connector is added and no placeholder is set: the config is vLLM's.",
)
