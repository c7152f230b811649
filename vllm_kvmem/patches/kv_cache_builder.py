"""vLLM 0.33: select vllm-kvmem's KV cache config builder while a budget
mode sizes the cache (the extension point that replaces the planner patch)."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def get_kv_cache_config_builder_cls(cls, vllm_config):
        from vllm_kvmem.budget.kv_builder import select_builder

        return select_builder(original, cls, vllm_config)

    return get_kv_cache_config_builder_cls


PATCH = Patch(
    name="kv_cache_builder",
    target="vllm.platforms.interface:Platform.get_kv_cache_config_builder_cls",
    make_replacement=_make,
    signature=("cls", "vllm_config"),
    processes=("engine core", "every worker"),
    versions=("0.33",),
    platforms=ALL_PLATFORMS,
    native=("pp_kv_budget", "kv_cache_tokens"),
    why="vLLM 0.33 plans the KV cache in a Core-owned flow and takes the groups "
    "and each worker's config from a `KVCacheConfigBuilder` the platform names "
    "(upstream PR #53558); the flow hands every worker `limit // bytes per "
    "block` blocks, so neither a pipeline-wide budget nor a token budget can "
    "apply without choosing the block count.",
    how="Only while `--enable-pp-prop-kv-cache` (with a budget and pipeline "
    "size > 1) or `--kv-cache-tokens` sizes the cache, names "
    "`vllm_kvmem.budget.kv_builder.KVMemKVCacheConfigBuilder`. That builder "
    "asks the builder the platform itself names for groups, bytes per block "
    "and configs, "
    "and only caps the block count at the engine core's plan "
    "(`kv_budget.stash_plan`, the same arithmetic and errors as on 0.32); "
    "outside the engine core's planning (profiling, workers) it passes vLLM's "
    "count through. A platform that overrides the hook itself is refused "
    "with those flags, by name.",
    upstream="The builder is vLLM's extension point; an upstream PR would add "
    "the budget modes to `DefaultKVCacheConfigBuilder`'s planning flow.",
    remove_when="vLLM ships a pipeline-proportional KV budget and token budgets.",
    idle="Returns the platform's own builder (vLLM's default), unchanged.",
)
