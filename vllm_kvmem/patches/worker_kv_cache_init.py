"""Each worker sizes the host tier before its KV cache is allocated, and logs
the share of the pipeline-wide budget it received after."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def initialize_from_config(self, kv_cache_configs):
        from vllm_kvmem.host_tier_setup import size_host_tier

        size_host_tier(self.vllm_config, kv_cache_configs)
        original(self, kv_cache_configs)
        from vllm_kvmem.budget.pp_prop import log_rank_share

        log_rank_share(self.vllm_config, kv_cache_configs, self.global_rank)

    return initialize_from_config


PATCH = Patch(
    name="worker_kv_cache_init",
    target="vllm.v1.worker.worker_base:WorkerWrapperBase.initialize_from_config",
    make_replacement=_make,
    signature=("self", "kv_cache_configs"),
    processes=("every worker",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="The host tier's worker-side connector, created while vLLM allocates "
    "the KV cache, needs the tier's slot count, which depends on every rank's "
    "KV cache config. Operators read each rank's KV reservation in that rank's "
    "own log, in the seed's form: `reserved 4.38 GiB for KV cache "
    "(proportionally split from 5.00 GiB based on 56/64 layers on rank 0)`.",
    how="Before vLLM allocates the KV cache, sizes the host tier "
    "(`host_tier.size_host_tier`, the same step as in the engine core, on the "
    "same configs); after, logs the rank's allocation from the list of all "
    "ranks' configs that every worker receives (layers counted over the union "
    "of all stages). Logs nothing unless the split is active.",
    upstream="None (log line of the seed 000 PR).",
    remove_when="vLLM ships a pipeline-proportional KV budget.",
    native_note="Where vLLM has `--enable-pp-prop-kv-cache` natively the "
    "rank's share line is vLLM's (the plugin's split never runs); the host "
    "tier's sizing stays.",
    idle="Calls vLLM's method with the same configs; sizes and logs nothing.",
)
