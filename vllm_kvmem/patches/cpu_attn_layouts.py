"""Let CPU_ATTN take the block-outer BLHNC layout, for connectors that opt in."""

from __future__ import annotations

from vllm_kvmem.patches._registry import Patch

CPU_ATTN = "CPU_ATTN"


def _make(original):
    def get_supported_kv_cache_layouts(self):
        layouts = original(self)
        if "BLHNC" in layouts or "LBHNC" not in layouts:
            return layouts
        from vllm_kvmem.layout import opted_in

        if opted_in(self.vllm_config) is None:
            return layouts  # no opt-in: vLLM's declaration, unchanged
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backends,
        )

        names = {b.get_name() for b in get_current_attn_backends(self.vllm_config)}
        return [*layouts, "BLHNC"] if names == {CPU_ATTN} else layouts

    return get_supported_kv_cache_layouts


PATCH = Patch(
    name="cpu_attn_layouts",
    target="vllm.v1.worker.worker_base:WorkerBase.get_supported_kv_cache_layouts",
    make_replacement=_make,
    signature=("self",),
    processes=("CPU workers",),
    versions=("0.32", "0.33"),
    platforms=("cpu",),
    why="CPU_ATTN declares only LBHNC, yet its kernel reads each layer's "
    "[H, N, C] block interior through the view's block stride, so it works on "
    "BLHNC views (block stride = layers x page). Without the declaration the "
    "contiguous layout can never be chosen on CPU.",
    how="After vLLM's own list (the layouts every attention backend of the "
    "worker declares): when the configured KV connector opts in to the "
    "contiguous layout and every backend is CPU_ATTN, appends BLHNC after "
    "LBHNC, so LBHNC stays vLLM's first choice and BLHNC is taken only through "
    "the opt-in. Tests compare greedy output token for token between the two "
    "layouts. (The worker's method rather than CPU_ATTN's classmethod: only "
    "the worker knows its connector.)",
    upstream="None yet: a one-line change to CPUAttentionBackend upstream.",
    remove_when="vLLM's CPU_ATTN declares BLHNC itself.",
    idle="Returns vLLM's own list unchanged: without a connector that opts in, "
    "CPU_ATTN declares LBHNC only, and `VLLM_KV_CACHE_LAYOUT=BLHNC` is refused "
    "by vLLM as without the plugin.",
)
