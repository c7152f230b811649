"""Contiguous cross-layer KV layout for connectors that opt in.

A connector opts in with one class-level method::

    class MyConnector(KVConnectorBase_V1):
        @classmethod
        def prefers_contiguous_kv_layout(cls, vllm_config) -> bool:
            return True

(or by inheriting :class:`ContiguousKVLayoutMixin`). The layout then resolves
to a block-outer layout (BLHNC: all layers of a block adjacent, so a block is
one contiguous region and moves in one copy) by vLLM's own rule for a layout
a connector asks for (``resolve_kv_cache_layout``): when every worker's
attention backends support it, judged on the KV specs vLLM judges. Hybrid
models qualify like any other: vLLM packs every KV cache group's pages of a
block together. Where a block-outer layout is unsafe although a backend
accepts it (MLA on CPU, see :func:`worker_layouts`), the plugin withholds it
from the worker's supported layouts, so neither the plugin nor vLLM can pick
it. Otherwise one log line names the failed condition and the layout vLLM
resolved. Connectors that do not opt in see no change.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.kvmem.layout")

OPT_IN_METHOD = "prefers_contiguous_kv_layout"
PREFERRED = "BLHNC"


class ContiguousKVLayoutMixin:
    """Inherit (before ``KVConnectorBase_V1``) to opt in to the layout."""

    @classmethod
    def prefers_contiguous_kv_layout(cls, vllm_config: Any) -> bool:
        return True


def connector_class(vllm_config: Any) -> type | None:
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_config is None or kv_config.kv_connector is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(kv_config)


def opted_in(vllm_config: Any) -> type | None:
    """The configured connector class if it asks for the contiguous layout."""
    cls = connector_class(vllm_config)
    method = getattr(cls, OPT_IN_METHOD, None)
    return cls if callable(method) and method(vllm_config) else None


@dataclass(frozen=True)
class LayoutChoice:
    """What :func:`choose_layout` decided, said once vLLM has resolved."""

    connector: str | None = None
    """The connector that asked for a block-outer layout (its class name)."""
    layout: str | None = None
    """The block-outer layout to record, or None for vLLM's own choice."""
    reason: str = ""
    """Why not, when a connector asked and ``layout`` is None."""
    asked: str = "asks for the contiguous KV layout"


def choose_layout(
    vllm_config: Any,
    supported_layouts: list[list[str]],
    kv_cache_specs: Iterable[Any] | None,
) -> LayoutChoice:
    """The block-outer layout to record before vLLM resolves, if any."""
    if vllm_config.cache_config.kv_cache_layout is not None:
        return LayoutChoice()  # already resolved (or set explicitly): vLLM keeps it
    if requested := os.environ.get("VLLM_KV_CACHE_LAYOUT"):
        # vLLM's order: the variable first, and then nothing else is asked;
        # the connector class is not even imported.
        kv_config = getattr(vllm_config, "kv_transfer_config", None)
        if kv_config is not None and kv_config.kv_connector is not None:
            logger.info(
                "VLLM_KV_CACHE_LAYOUT=%s is set explicitly; the contiguous KV "
                "layout opt-in of %s is not consulted.",
                requested,
                kv_config.kv_connector,
            )
        return LayoutChoice()
    specs = tuple(kv_cache_specs or ())
    cls = opted_in(vllm_config)
    if cls is None:
        # A connector that names a block-outer layout through vLLM's own
        # get_required_kvcache_layout() gets vLLM's resolution; it hears from
        # us only when we withheld that layout (MLA on CPU).
        cls = connector_class(vllm_config)
        required = _required_layout(cls, vllm_config)
        try:
            if required is None or not layout_named(required).is_block_outermost:
                return LayoutChoice()
        except KeyError:
            return LayoutChoice()  # vLLM refuses the name itself
        reason = _withheld_reason(supported_layouts, specs)
        if not reason:
            return LayoutChoice()
        return LayoutChoice(cls.__name__, None, reason, f"requires {required}")
    layout, reason = _block_outer_layout(supported_layouts, specs)
    return LayoutChoice(cls.__name__, layout, reason)


def log_choice(choice: LayoutChoice, resolved: Any) -> None:
    """One line on what a connector that asked got, once vLLM has resolved
    ``resolved`` (a ``KVCacheLayout``), so that the line names the layout the
    tensors have."""
    if choice.connector is None:
        return
    if choice.layout is not None and resolved.name == choice.layout:
        logger.info(
            "Using %s KV cache layout: contiguous across layers (one copy per "
            "block), requested by %s.",
            resolved.name,
            choice.connector,
        )
        return
    logger.info(
        "%s %s, but %s; using vLLM's %s KV cache layout (%s).",
        choice.connector,
        choice.asked,
        choice.reason or f"vLLM resolved {resolved.name}",
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


def _required_layout(cls: type | None, vllm_config: Any) -> str | None:
    method = getattr(cls, "get_required_kvcache_layout", None)
    try:
        return method(vllm_config) if callable(method) else None
    except Exception:  # vLLM asks it again, and reports its own errors
        return None


def _block_outer_layout(
    supported_layouts: list[list[str]], specs: tuple[Any, ...]
) -> tuple[str | None, str]:
    """``(layout name, "")`` when the layout applies, else ``(None, reason)``."""
    layout, reason = None, _why_not(supported_layouts, specs)
    if not reason:
        names = _block_outer_candidates(supported_layouts)
        layout = PREFERRED if PREFERRED in names else names[0]
    return layout, reason


def _block_outer_candidates(supported_layouts: list[list[str]]) -> list[str]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    common = set(supported_layouts[0]).intersection(*map(set, supported_layouts[1:]))
    return [
        n
        for n in supported_layouts[0]
        if n in common
        and KVCacheLayout[n].is_block_outermost
        and KVCacheLayout[n].is_block_compact
    ]


def _why_not(supported_layouts: list[list[str]], specs: tuple[Any, ...]) -> str:
    """Why the contiguous layout cannot apply; empty when it can.

    vLLM's rule for a layout a connector asks for, on the specs vLLM judges
    (those with per-layer views): it must be in every worker's supported set.
    Mixed page shapes (hybrid models, Mamba state) narrow vLLM's candidates
    to block-compact layouts and DCP to block-outer ones, which a block-outer,
    block-compact layout always is; ``validate_kv_cache_layout`` accepts it
    for any mix of groups."""
    specs = tuple(s for s in specs if getattr(s, "has_layer_views", True))
    if not specs:
        return "the model has no attention KV cache"
    if not supported_layouts or not all(supported_layouts):
        return "no worker reported its supported KV cache layouts"
    if _block_outer_candidates(supported_layouts):
        return ""
    return _withheld_reason(supported_layouts, specs) or (
        "the attention backend in use supports only "
        f"{', '.join(supported_layouts[0])} (no block-outer layout)"
    )


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


def _withheld_reason(supported_layouts: list[list[str]], specs: tuple[Any, ...]) -> str:
    """Why no block-outer layout is offered where vllm-kvmem withheld it."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if supported_layouts and all(supported_layouts):
        if _block_outer_candidates(supported_layouts):
            return ""
    if current_platform.is_cpu() and any(
        isinstance(s, MLAAttentionSpec) for s in specs
    ):
        return MLA_ON_CPU
    return ""


def worker_layouts(vllm_config: Any, layouts: list[str]) -> list[str]:
    """The layouts a CPU worker reports, as vLLM computes them (``layouts``)
    with two changes, both only when a KV connector is configured:

    * MLA: vLLM's CPU MLA backends (:data:`CPU_MLA_BACKENDS`), while they
      declare no layouts, lose the block-outer ones (:data:`MLA_ON_CPU`), so
      that no connector, opted in or naming one through
      ``get_required_kvcache_layout()``, can have the first forward pass fail;
    * CPU_ATTN alone, for a connector that opts in: BLHNC is added after
      LBHNC (its kernel reads each page through the view's block stride).
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
    if "BLHNC" in layouts or "LBHNC" not in layouts or names != {CPU_ATTN}:
        return layouts
    return [*layouts, "BLHNC"] if opted_in(vllm_config) is not None else layouts


CPU_ATTN = "CPU_ATTN"
