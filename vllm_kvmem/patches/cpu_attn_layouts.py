"""Let the CPU attention backend declare the block-outer BLHNC layout."""

from __future__ import annotations

from vllm_kvmem.patches._registry import Patch


def _make(original):
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layouts = tuple(original(cls))
        if KVCacheLayout.BLHNC not in layouts:
            layouts += (KVCacheLayout.BLHNC,)
        return layouts

    return supported_kv_cache_layouts


PATCH = Patch(
    name="cpu_attn_layouts",
    target="vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend."
    "supported_kv_cache_layouts",
    make_replacement=_make,
    signature=("cls",),
    processes=("engine core", "CPU workers"),
    platforms=("cpu",),
    why="CPU_ATTN declares only LBHNC, yet its kernel reads each layer's "
    "[H, N, C] block interior through the view's block stride, so it works on "
    "BLHNC views (block stride = layers x page). Without the declaration the "
    "contiguous layout can never be chosen on CPU.",
    how="Appends BLHNC after vLLM's own list, so LBHNC stays the default "
    "(first) choice and BLHNC is used only when asked for (a connector's opt-in "
    "or VLLM_KV_CACHE_LAYOUT=BLHNC). Tests compare greedy output token for "
    "token between the two layouts.",
    upstream="None yet: a one-line change to CPUAttentionBackend upstream.",
    remove_when="vLLM's CPU_ATTN declares BLHNC itself.",
)
