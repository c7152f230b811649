"""Resolve a block-outer KV layout for connectors that opt in."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def resolve_kv_cache_layout(vllm_config, supported_layouts, kv_cache_specs=None):
        from vllm_kvmem.layout import choose_layout, log_choice

        specs = list(kv_cache_specs) if kv_cache_specs is not None else None
        choice = choose_layout(vllm_config, supported_layouts, specs)
        if choice.layout is not None:
            vllm_config.cache_config.kv_cache_layout = choice.layout
        layout = original(vllm_config, supported_layouts, specs)
        log_choice(choice, layout)
        return layout

    return resolve_kv_cache_layout


PATCH = Patch(
    name="kv_cache_layout",
    target="vllm.v1.attention.backends.utils:resolve_kv_cache_layout",
    make_replacement=_make,
    signature=("vllm_config", "supported_layouts", "kv_cache_specs"),
    processes=("engine core",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="A connector that moves blocks wants all layers of a block adjacent (one "
    "copy per block instead of one per layer), but only when the model and the "
    "backends allow it; `get_required_kvcache_layout()` names one fixed layout "
    "and vLLM drops it with a warning when unsupported, with no condition on "
    "the model (seed 002).",
    how="Before vLLM resolves the layout, in vLLM's order: when no layout is "
    "set yet and VLLM_KV_CACHE_LAYOUT is unset (read first, so the connector "
    "is not consulted when it is set), and the configured connector class "
    "returns True from `prefers_contiguous_kv_layout(vllm_config)`, applies "
    "vLLM's own rule for a layout a connector asks for, on the specs vLLM "
    "judges: a block-outer, block-compact layout in every worker's supported "
    "set (hybrid models included; MLA on CPU never qualifies, see "
    "cpu_attn_layouts); records BLHNC (or the first such layout) on "
    "`cache_config.kv_cache_layout`, which vLLM then keeps. After vLLM has "
    "resolved, logs one line naming the layout the tensors get, and, when "
    "the contiguous one was not chosen, why. Rebinds the name imported into "
    "`vllm.v1.engine.core`.",
    upstream="RFC #42082 (KV cache layouts); seed 002's proposal; no PR yet.",
    remove_when="vLLM resolves a conditional contiguous layout for connectors.",
    idle="vLLM's own resolution: with VLLM_KV_CACHE_LAYOUT set nothing else is "
    "consulted (vLLM's order), and a connector that does not opt in changes"
    " nothing.",
)
