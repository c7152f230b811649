"""Say why a connector's block-outer KV layout was or was not resolved."""

from __future__ import annotations

from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def resolve_kv_cache_layout(vllm_config, supported_layouts, kv_cache_specs=None):
        from vllm_kvmem.layout import connector_consulted, log_resolution

        specs = list(kv_cache_specs) if kv_cache_specs is not None else None
        consulted = connector_consulted(vllm_config)  # before vLLM records one
        layout = original(vllm_config, supported_layouts, specs)
        if consulted:
            log_resolution(vllm_config, supported_layouts, specs, layout)
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
    why="A connector asks for a block-outer layout (BLHNC: one copy per block) "
    "through vLLM's `get_required_kvcache_layout()`, and vLLM resolves it. When "
    "the layout cannot be met, vLLM's warning lists the valid layouts but not "
    "why: the backends' declaration, the model's mixed page shapes, or MLA on "
    "CPU, where vllm-kvmem withholds block-outer layouts (cpu_attn_layouts). "
    "Nor does vLLM's `Using X KV cache layout.` say that the connector's "
    "request was met.",
    how="Calls vLLM's `resolve_kv_cache_layout` with the same arguments and "
    "returns its layout unchanged; it decides nothing. Afterwards, when vLLM "
    "consulted the connector (no layout was recorded before and "
    "VLLM_KV_CACHE_LAYOUT is unset: vLLM's order, so the connector class is "
    "not even imported otherwise) and the configured connector's "
    "`get_required_kvcache_layout()` names a block-outer layout, logs one info "
    "line: the layout the tensors get and who asked, or, beside vLLM's own "
    "warning, why the request was not met. Rebinds the name imported into "
    "`vllm.v1.engine.core`.",
    upstream="None: the reasons could go into vLLM's fallback warning in "
    "`resolve_kv_cache_layout`.",
    remove_when="vLLM's fallback warning for a connector's layout says why it "
    "is not in the supported set, and the plugin withholds no layout.",
    idle="Logs nothing: without a connector whose `get_required_kvcache_layout()` "
    "names a block-outer layout, or with VLLM_KV_CACHE_LAYOUT set, vLLM's "
    "resolution is returned as is, with no extra line.",
)
