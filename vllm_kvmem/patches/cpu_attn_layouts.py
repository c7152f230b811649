"""Let CPU_ATTN take the block-outer BLHNC layout, for a connector that
requires a block-outer layout, and keep vLLM's CPU MLA backends off
block-outer layouts, which they accept but cannot run."""

from __future__ import annotations

from vllm_kvmem.patches._registry import Patch


def _make(original):
    def get_supported_kv_cache_layouts(self):
        from vllm_kvmem.layout import worker_layouts

        return worker_layouts(self.vllm_config, original(self))

    return get_supported_kv_cache_layouts


PATCH = Patch(
    name="cpu_attn_layouts",
    target="vllm.v1.worker.worker_base:WorkerBase.get_supported_kv_cache_layouts",
    make_replacement=_make,
    signature=("self",),
    processes=("CPU workers",),
    versions=("0.32", "0.33"),
    platforms=("cpu",),
    native=("cpu_attn_block_outer", "cpu_mla_kv_cache_layouts"),
    why="CPU_ATTN declares only LBHNC, yet its kernel reads each layer's "
    "[H, N, C] block interior through the view's block stride, so it works on "
    "BLHNC views (block stride = layers x page). Without the declaration "
    "vLLM refuses a connector's `get_required_kvcache_layout()` of BLHNC on "
    "CPU (its fallback warning, LBHNC). The CPU MLA backends are "
    "the opposite: CPU_MLA and AMX_MLA declare no layouts, which vLLM reads as "
    "any, but view each layer's cache as contiguous rows (CPU_MLA's "
    "`do_kv_cache_update`, AMX_MLA's `forward_mqa`) and fail on a block-outer "
    "view at the first forward pass (vLLM bug), so a connector asking for "
    "BLHNC would crash an MLA model.",
    how="After vLLM's own list (the layouts every attention backend of the "
    "worker declares), only when a KV connector is configured: with a CPU MLA "
    "backend that declares no layouts, drops the block-outer layouts (vLLM "
    "then keeps the MLA model on LBNHC and refuses a connector's BLHNC with "
    "its own warning; the engine core's kv_cache_layout line says why); when "
    "every backend is CPU_ATTN and the connector's "
    "`get_required_kvcache_layout()` names a block-outer layout (read through "
    "vLLM's `get_kv_connector_cache_layout`), appends BLHNC after LBHNC, so "
    "LBHNC stays vLLM's first choice and vLLM's own rule gives BLHNC to a "
    "connector that requires it (any other block-outer layout gets vLLM's "
    "fallback: the kernel reads pages as [H, N, C]). Tests compare greedy "
    "output token for token between the two layouts, run a connector that "
    "requires BLNHC and an MLA model with a connector that requires BLHNC. "
    "(The worker's method rather than the "
    "backends' classmethods: only the worker knows its connector.)",
    upstream="None yet: one-line changes to CPUAttentionBackend (declare "
    "BLHNC) and CPUMLABackend and AMXMLABackend (declare their layer-outer "
    "layouts) upstream.",
    remove_when="vLLM's CPU_ATTN declares BLHNC itself and CPU_MLA and "
    "AMX_MLA declare the layouts they can use (the MLA part stops by itself "
    "once they declare any).",
    idle="Returns vLLM's own list unchanged: without a KV connector nothing "
    "is changed (CPU_ATTN declares LBHNC only, the CPU MLA backends any "
    "layout, and "
    "`VLLM_KV_CACHE_LAYOUT=BLHNC` is refused or taken by vLLM as without the "
    "plugin).",
)
