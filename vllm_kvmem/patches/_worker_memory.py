"""The shared wrapper of the GPU and CPU workers' ``determine_available_memory``."""

from __future__ import annotations

WHY = (
    "With `--enable-pp-prop-kv-cache` the budget is pipeline-wide, so the engine "
    "needs to know how much KV cache each device can actually hold, to refuse a "
    "share that does not fit (vLLM's explicit-budget path reports the budget "
    "itself and never checks it on GPUs)."
)
HOW = (
    "Runs vLLM's method unchanged (profile run or warm-up, vLLM's own checks); "
    "only when the split or a `--kv-cache-tokens` budget is active (the latter "
    "runs with a 1-byte placeholder `kv_cache_memory_bytes`, set at startup, so "
    "vLLM skips profiling and the CPU worker's memory-fraction check), returns "
    "the device's KV limit (free device "
    "memory after profiling, or the NUMA node's available memory on CPU) "
    "instead of the budget, less what the device allocates after the KV cache: "
    "vLLM's own CUDA graph estimate (`profile_cudagraph_memory`, where vLLM "
    "profiles graphs), the host tier's staging buffers (one per copy stream), "
    "the pipeline receive buffers of stages after the first, and vLLM's "
    "multimodal IPC reservation; on GPUs it also keeps 150 MiB of headroom, "
    "as vLLM's own budget suggestion does. The engine core patch turns limits "
    "into shares."
)
UPSTREAM = "None: part of the seed 000 feature; upstream PR would add the limit."
REMOVE_WHEN = "vLLM ships a pipeline-proportional KV budget."
#: The budget modes it measures the limit for, both in vLLM with the series.
NATIVE = ("pp_kv_budget", "kv_cache_tokens")
IDLE = (
    "Returns vLLM's own figure from vLLM's own method (the limit is measured "
    "only with `--enable-pp-prop-kv-cache` or `--kv-cache-tokens`)."
)


def make_replacement(original):
    def determine_available_memory(self):
        from vllm_kvmem.budget import device_limits
        from vllm_kvmem.budget.kv_budget import report_device_limit, uses_device_limits

        if not uses_device_limits(self.vllm_config):
            return original(self)
        return report_device_limit(self, device_limits.measure(self, original))

    return determine_available_memory
