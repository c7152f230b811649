"""Split a pipeline-wide KV budget across stages in the engine core."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        from vllm_kvmem.budget.kv_budget import plan_kv_cache_configs

        configs = plan_kv_cache_configs(
            original, vllm_config, kv_cache_specs, available_memory
        )
        from vllm_kvmem.host_tier_setup import size_host_tier

        size_host_tier(vllm_config, configs)
        return configs

    return get_kv_cache_configs


PATCH = Patch(
    name="kv_cache_configs",
    target="vllm.v1.core.kv_cache_utils:get_kv_cache_configs",
    make_replacement=_make,
    signature=("vllm_config", "kv_cache_specs", "available_memory"),
    processes=("engine core",),
    versions=("0.32",),
    platforms=ALL_PLATFORMS,
    why="vLLM hands every pipeline stage the same `--kv-cache-memory-bytes` and "
    "then cuts all stages to the smallest block count (PR #25164). With uneven "
    "stages the operator cannot give the pipeline one total budget; "
    "`--enable-pp-prop-kv-cache` makes the budget pipeline-wide.",
    how="Always logs one startup table of every rank's layers, KV bytes, blocks, "
    "tokens and concurrency. With `--kv-cache-tokens`: gives every rank exactly "
    "the blocks those tokens need (as vLLM counts capacity) from its own KV specs, "
    "checked against each worker's device limit. With the flag, a budget and "
    "pipeline size > 1: forms each worker's "
    "KV cache groups with vLLM's own functions, computes bytes per block per "
    "stage, gives stage s `T * bpb(s) / sum(bpb)` (so all stages hold "
    "`T // sum(bpb)` blocks), checks each share against the limit the worker "
    "reported and against one max_model_len sequence, then calls vLLM's "
    "original planner with the shares and logs a per-rank summary. Then sizes "
    "the host tier (its slot count) from the configs. Rebinds the "
    "name imported into `vllm.v1.engine.core`.",
    upstream="vLLM PR 'Add --enable-pp-prop-kv-cache' (seed 000, never merged).",
    remove_when="vLLM ships a pipeline-proportional KV budget.",
    native_note="Where vLLM has `--enable-pp-prop-kv-cache` and "
    "`--kv-cache-tokens` natively, its budget modes never run (the plugin "
    "carries neither option; vLLM's planner sizes the cache); the capacity "
    "table and the host tier's sizing stay.",
    idle="Returns vLLM's own configs, unchanged (same blocks and tensors), and "
    "logs the per-rank capacity table.",
)
