"""The contiguous cross-layer KV layout, asked for through vLLM's connector API.

A connector asks for it the way vLLM asks every connector for its layout::

    class MyConnector(KVConnectorBase_V1):
        @classmethod
        def get_required_kvcache_layout(cls, vllm_config) -> str | None:
            return "BLHNC"

BLHNC is block-outer: all layers of a block adjacent, so a block is one
contiguous region and moves in one copy. vLLM itself resolves the request
(``resolve_kv_cache_layout``): the layout is taken when it is in every
worker's supported set after vLLM's narrowing for the model's KV specs;
otherwise vLLM warns and uses its first candidate. vllm-kvmem adds only what
vLLM lacks:

* CPU workers (:func:`worker_layouts`): CPU_ATTN, whose kernel reads pages
  through the view's block stride, gains BLHNC when the configured connector
  requires a block-outer layout; vLLM's CPU MLA backends, which accept
  block-outer layouts but fail on them, lose them whenever a connector is
  configured;
* the engine core (:func:`log_resolution`): one line for a connector that
  required a block-outer layout, naming the layout its tensors got and, when
  it is not the one asked for, why (beside vLLM's own warning).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.kvmem.layout")

CPU_ATTN = "CPU_ATTN"
#: The block-outer layout CPU_ATTN serves: its kernel reads each page as
#: [H, N, C], so BLNHC and BHLNC are not offered.
CPU_ATTN_BLOCK_OUTER = "BLHNC"


def required_block_outer(vllm_config: Any) -> Any | None:
    """The block-outer ``KVCacheLayout`` the configured connector requires
    through vLLM's ``get_required_kvcache_layout()``, or None (no connector,
    no requirement, a layer-outer one, or a name vLLM itself will refuse)."""
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_config is None or kv_config.kv_connector is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        get_kv_connector_cache_layout,
    )

    name = get_kv_connector_cache_layout(vllm_config)
    try:
        layout = layout_named(name) if name is not None else None
    except KeyError:
        return None  # vLLM refuses the name with its own error
    return layout if layout is not None and layout.is_block_outermost else None


def connector_consulted(vllm_config: Any) -> bool:
    """Whether vLLM's resolution will ask the connector, by vLLM's order: not
    when a layout is already recorded or ``VLLM_KV_CACHE_LAYOUT`` is set."""
    import vllm.envs as envs

    return (
        vllm_config.cache_config.kv_cache_layout is None
        and envs.VLLM_KV_CACHE_LAYOUT is None
    )


def log_resolution(
    vllm_config: Any,
    supported_layouts: list[list[str]],
    kv_cache_specs: list[Any] | None,
    resolved: Any,
) -> None:
    """One line for a connector that required a block-outer layout, once vLLM
    has resolved ``resolved`` (a ``KVCacheLayout``): so the line names the
    layout the tensors have, and why it is not the one asked for."""
    required = required_block_outer(vllm_config)
    if required is None:
        return
    connector = vllm_config.kv_transfer_config.kv_connector
    if resolved == required:
        logger.info(
            "Using %s KV cache layout: %s (one copy per block), requested by %s.",
            resolved.name,
            describe(resolved),
            connector,
        )
        return
    logger.info(
        "%s requires the %s KV cache layout, but %s; using vLLM's %s KV cache "
        "layout (%s).",
        connector,
        required.name,
        _why_not(required, supported_layouts, tuple(kv_cache_specs or ()), resolved),
        resolved.name,
        describe(resolved),
    )


def describe(layout: Any) -> str:
    """How a ``KVCacheLayout`` lays out the blocks of a layer, in words."""
    if layout.is_block_outermost and layout.is_block_compact:
        return "contiguous across layers"
    if layout.is_block_outermost:
        return "block-outer"
    return "per layer"


def layout_named(name: str) -> Any:
    """vLLM's ``KVCacheLayout`` for a name, with the legacy FlashInfer names
    (``NHD``, ``HND``) as vLLM reads them."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    legacy = {"NHD": "LBNHC", "HND": "LBHNC"}
    return KVCacheLayout[legacy.get(name, name)]


def _why_not(
    required: Any,
    supported_layouts: list[list[str]],
    specs: tuple[Any, ...],
    resolved: Any,
) -> str:
    """Why vLLM did not take ``required``, the block-outer layout a connector
    asked for: the two ways vLLM's rule drops one, and the case vllm-kvmem
    withholds."""
    supported = supported_layouts[0] if supported_layouts else []
    if required.name not in supported:
        if _mla_on_cpu(specs):
            return MLA_ON_CPU
        return f"the attention backends in use support only {', '.join(supported)}"
    if not required.is_block_compact:
        return (
            "the model's layers have different page shapes, which vLLM lays out "
            f"only in block-compact layouts ({required.name} is not one)"
        )
    return f"vLLM resolved {resolved.name}"


#: vLLM's CPU MLA backends declare no layouts, which vLLM reads as "any", but
#: address the cache as rows of one layer's contiguous view, which fails on a
#: block-outer view ("view size is not compatible with input tensor's size and
#: stride") at the first forward pass: CPU_MLA in ``do_kv_cache_update``
#: (``kv_cache.view(-1, kv_lora_rank + pe_dim)``, ``mla/cpu_mla.py``), AMX_MLA,
#: which vLLM prefers on CPUs with AMX tiles, in ``forward_mqa``
#: (``kv_c_and_k_pe_cache.view(-1, 1, head_size)``, ``mla/amx_mla.py``). A vLLM
#: bug in 0.32 and 0.33, plugin or not.
CPU_MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")
MLA_ON_CPU = (
    "the model uses MLA on CPU, where vLLM's CPU MLA backends accept block-outer "
    "layouts but fail on them (cpu_mla.py do_kv_cache_update, amx_mla.py "
    "forward_mqa: a vLLM bug), so vllm-kvmem withholds them"
)


def _mla_on_cpu(specs: tuple[Any, ...]) -> bool:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return current_platform.is_cpu() and any(
        isinstance(s, MLAAttentionSpec) for s in specs
    )


def worker_layouts(vllm_config: Any, layouts: list[str]) -> list[str]:
    """The layouts a CPU worker reports, as vLLM computes them (``layouts``)
    with two changes, both only when a KV connector is configured:

    * MLA: vLLM's CPU MLA backends (:data:`CPU_MLA_BACKENDS`), while they
      declare no layouts, lose the block-outer ones (:data:`MLA_ON_CPU`), so
      that no connector can have the first forward pass fail;
    * CPU_ATTN alone, for a connector whose ``get_required_kvcache_layout()``
      names a block-outer layout: BLHNC is added after LBHNC (its kernel reads
      each page through the view's block stride), so LBHNC stays vLLM's
      first choice and vLLM's own rule gives BLHNC to the connector.
    """
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_config is None or kv_config.kv_connector is None:
        return layouts  # no connector: vLLM's list, unchanged
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        get_current_attn_backends,
    )

    backends = get_current_attn_backends(vllm_config)
    names = {b.get_name() for b in backends}
    mla = [b for b in backends if b.get_name() in CPU_MLA_BACKENDS]
    if any(b.supported_kv_cache_layouts() is None for b in mla):
        return [n for n in layouts if not layout_named(n).is_block_outermost]
    if (
        CPU_ATTN_BLOCK_OUTER in layouts
        or "LBHNC" not in layouts
        or names != {CPU_ATTN}
        or required_block_outer(vllm_config) is None
    ):
        return layouts
    return [*layouts, CPU_ATTN_BLOCK_OUTER]
