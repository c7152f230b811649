"""The smallest connector that asks for the contiguous KV layout.

A test double, not shipped with the package: it moves no data, and exists to
show the request (vLLM's own ``get_required_kvcache_layout()``) and to let
tests check which layout the engine resolves and what the workers register.
From the repository root (where the tests start their engines) use it with::

    kv_transfer_config={
        "kv_connector": "ContiguousLayoutExampleConnector",
        "kv_connector_module_path": "tests.contiguous_example",
        "kv_role": "kv_both",
    }

It requires BLHNC; ``"kv_connector_extra_config": {"kv_cache_layout": X}``
makes it require X instead (null: no layout), as a connector's requirement
may depend on its configuration.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class ContiguousLayoutExampleConnector(KVConnectorBase_V1):
    """Requires BLHNC; records the KV tensors it is given; transfers nothing."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        kv_config = vllm_config.kv_transfer_config
        return kv_config.get_from_extra_config("kv_cache_layout", "BLHNC")

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    # worker side: nothing to load or save
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side: never has external tokens
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
