# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU MLA backends declare the layer-outer KV cache layouts they serve."""

import pytest
import torch

from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="CPU attention backends"
)

MLA_SPEC = MLAAttentionSpec(
    block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
)


class _RequiresBLHNC(KVConnectorBase_V1):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "BLHNC"


def _resolve(backend, connector: bool = False) -> KVCacheLayout:
    kv_transfer_config = None
    if connector:
        kv_transfer_config = KVTransferConfig(
            kv_connector=_RequiresBLHNC.__name__,
            kv_connector_module_path=__name__,
            kv_role="kv_both",
        )
    vllm_config = VllmConfig(kv_transfer_config=kv_transfer_config)
    names = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    return resolve_kv_cache_layout(vllm_config, [names], [MLA_SPEC])


@pytest.mark.parametrize("backend", [CPUMLABackend, AMXMLABackend])
def test_cpu_mla_never_resolves_to_a_block_outer_layout(backend, monkeypatch):
    # Its cache update and kernels view a layer's blocks as contiguous rows.
    declared = backend.supported_kv_cache_layouts()
    assert declared is not None
    assert all(layout.is_layer_compact for layout in declared)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert _resolve(backend) == KVCacheLayout.LBNHC
    # A connector asking for BLHNC gets the backend's layout, with a warning.
    assert _resolve(backend, connector=True) == KVCacheLayout.LBNHC
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=BLHNC"):
        _resolve(backend)
