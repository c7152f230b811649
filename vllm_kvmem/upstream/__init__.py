"""The in-tree form of vllm-kvmem: a patch series for vLLM, generated from
the plugin's own modules (``kvmem upstream``, docs/upstream.md)."""

from __future__ import annotations

from vllm_kvmem.upstream.anchors import AnchorError, Edit
from vllm_kvmem.upstream.series import PATCHES, generate, write_series

__all__ = ["PATCHES", "AnchorError", "Edit", "generate", "write_series"]
