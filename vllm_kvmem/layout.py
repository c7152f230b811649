"""Contiguous cross-layer KV layout for connectors that opt in.

A connector opts in with one class-level method::

    class MyConnector(KVConnectorBase_V1):
        @classmethod
        def prefers_contiguous_kv_layout(cls, vllm_config) -> bool:
            return True

(or by inheriting :class:`ContiguousKVLayoutMixin`). The layout then resolves
to a block-outer layout (BLHNC: all layers of a block adjacent, so a block is
one contiguous region and moves in one copy) if and only if the model has one
uniform KV cache group (no hybrid groups, no MLA) and every attention backend
in use supports it. Otherwise one log line names the failed condition and
vLLM's per-layer layout is used. Connectors that do not opt in see no change.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
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


def choose_layout(
    vllm_config: Any,
    supported_layouts: list[list[str]],
    kv_cache_specs: Iterable[Any] | None,
) -> str | None:
    """The block-outer layout to record, or None to leave vLLM's choice alone."""
    if vllm_config.cache_config.kv_cache_layout is not None:
        return None  # already resolved (or set explicitly): vLLM keeps it
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
        return None
    cls = opted_in(vllm_config)
    if cls is None:
        return None
    name = cls.__name__
    layout, reason = _block_outer_layout(supported_layouts, tuple(kv_cache_specs or ()))
    if layout is None:
        logger.info(
            "%s asks for the contiguous KV layout, but %s; using the per-layer layout.",
            name,
            reason,
        )
        return None
    logger.info(
        "Using %s KV cache layout: contiguous across layers (one copy per block), "
        "requested by %s.",
        layout,
        name,
    )
    return layout


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
    """Why the contiguous layout cannot apply; empty when it can."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    specs = tuple(s for s in specs if getattr(s, "has_layer_views", True))
    if not specs:
        return "the model has no attention KV cache"
    if any(isinstance(s, MLAAttentionSpec) for s in specs):
        return "the model uses MLA (latent KV), which has no per-head block layout"
    if any(not isinstance(s, AttentionSpec) for s in specs):
        kinds = sorted({type(s).__name__ for s in specs})
        return f"the model has non-attention KV state ({', '.join(kinds)})"
    if len(set(specs)) > 1:
        kinds = sorted({type(s).__name__ for s in specs})
        return (
            f"its layers have {len(set(specs))} different KV specs "
            f"({', '.join(kinds)}): not one uniform KV cache group"
        )
    if not supported_layouts or not all(supported_layouts):
        return "no worker reported its supported KV cache layouts"
    if not _block_outer_candidates(supported_layouts):
        return (
            "the attention backend in use supports only "
            f"{', '.join(supported_layouts[0])} (no block-outer layout)"
        )
    return ""
