"""vLLM 0.33: when the engine core's KV cache configs are final, log the
startup table and size the host tier (on 0.32 the planner patch does both)."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def initialize_from_config(self, kv_cache_configs):
        from vllm_kvmem.budget.kv_budget import configs_ready

        configs_ready(self.vllm_config, kv_cache_configs)
        from vllm_kvmem.host_tier_setup import size_host_tier

        size_host_tier(self.vllm_config, kv_cache_configs)
        original(self, kv_cache_configs)

    return initialize_from_config


PATCH = Patch(
    name="executor_kv_cache_init",
    target="vllm.v1.executor.abstract:Executor.initialize_from_config",
    make_replacement=_make,
    signature=("self", "kv_cache_configs"),
    processes=("engine core",),
    versions=("0.33",),
    platforms=ALL_PLATFORMS,
    why="On vLLM 0.33 the planner is Core-owned and its builder sees one "
    "worker at a time, so the per-rank capacity table and the host tier's "
    "size (which depend on every rank's config) need the first place where "
    "the engine core holds all final configs: handing them to the workers, "
    "before the scheduler (and the tier's scheduler side) is built.",
    how="Before vLLM's method: logs the startup table of every rank's layers, "
    "KV bytes, blocks, tokens and concurrency (with the pipeline-wide split's "
    "columns when it applied), ends the budget plan, and sizes the host tier "
    "from the configs, as every worker does again on receiving them.",
    upstream="Part of the startup-table and host-tier PRs.",
    remove_when="vLLM logs per-rank KV capacity and ships a host KV tier.",
    native_note="Where vLLM has the budget options natively, the plan it "
    "ends is empty; the capacity table and the host tier's sizing stay.",
    idle="Logs the per-rank capacity table; calls vLLM's method with the same configs.",
)
