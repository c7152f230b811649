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
    "only when the split is active, returns the device's KV limit (free device "
    "memory after profiling, or the NUMA node's available memory on CPU) "
    "instead of the budget. The engine core patch turns limits into shares."
)
UPSTREAM = "None: part of the seed 000 feature; upstream PR would add the limit."
REMOVE_WHEN = "vLLM ships a pipeline-proportional KV budget."


def make_replacement(original):
    def determine_available_memory(self):
        from vllm_kvmem.pp_prop import is_active, report_device_limit

        result = original(self)
        if not is_active(self.vllm_config):
            return result
        return report_device_limit(self, result)

    return determine_available_memory
