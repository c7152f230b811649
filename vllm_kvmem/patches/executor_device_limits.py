"""Collect each worker's KV limit components in the engine core."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def determine_available_memory(self):
        # Each worker's figure: its device limit while a budget mode sizes
        # the cache (the worker patch), else vLLM's own.
        reported = original(self)
        from vllm_kvmem.budget.kv_budget import uses_device_limits

        if uses_device_limits(self.vllm_config):
            from vllm_kvmem import vllm_adapter as va
            from vllm_kvmem.budget import kv_builder
            from vllm_kvmem.budget.device_limits import collect_from_workers

            collect_from_workers(self)
            if va.plans_through_builder():
                from vllm_kvmem.budget.kv_budget import stash_plan

                kv_builder.check_selected(self.vllm_config)
                specs = self.get_kv_cache_specs()
                plan = stash_plan(self.vllm_config, specs, reported)
                # vLLM's planner, its auto-fit of --max-model-len auto and its
                # memory checks then work from each rank's planned bytes.
                return plan.bytes_for_vllm(reported)
        return reported

    return determine_available_memory


PATCH = Patch(
    name="executor_device_limits",
    target="vllm.v1.executor.abstract:Executor.determine_available_memory",
    make_replacement=_make,
    signature=("self",),
    processes=("engine core",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    native=("pp_kv_budget", "kv_cache_tokens"),
    why="A worker's KV limit is free memory less what is allocated after the KV "
    "cache (CUDA graphs, the host tier's staging buffers, pipeline receive "
    "buffers) and the GPU headroom; vLLM returns one "
    "integer per worker, so the engine core's refusal of a share could not say "
    "which component took the memory or what to change.",
    how="After vLLM's own call, only when the engine sizes the KV cache "
    "(`--enable-pp-prop-kv-cache` or `--kv-cache-tokens`), asks every worker "
    "(`collective_rpc`) for the components it measured and keeps them in the "
    "engine core's config (`budget.runtime.BudgetRuntime`) for the planner's "
    "error messages. On vLLM 0.33, whose planner takes its block counts from a "
    "`KVCacheConfigBuilder`, then plans the budget there from every worker's "
    "KV specs and these limits (`kv_budget.stash_plan`: the same shares, "
    "checks and errors as 0.32's planner patch) and returns each rank's "
    "planned bytes instead of its limit, so that vLLM's planner, its auto-fit "
    "of `--max-model-len auto` and its memory checks work from the budget, as "
    "0.32's planner patch makes them do. Elsewhere the integers are vLLM's.",
    upstream="None: part of the seed 000 feature.",
    remove_when="vLLM ships a pipeline-proportional KV budget.",
    idle="Returns vLLM's own figures; asks the workers nothing.",
)
