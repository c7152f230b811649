class _RequiresBLHNC(KVConnectorBase_V1):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "BLHNC"


@pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU only")
@pytest.mark.parametrize("backend", [CPUMLABackend, AMXMLABackend])
def test_cpu_mla_kv_cache_layout_is_layer_compact(backend, monkeypatch) -> None:
    # The backends view a layer's cache as contiguous [num_blocks * block_size,
    # head_size] rows, so no block-outer layout may be resolved for them.
    declared = backend.supported_kv_cache_layouts()
    assert declared is not None
    assert all(layout.is_layer_compact for layout in declared)
    names = [[layout.name for layout in get_supported_kv_cache_layouts([backend])]]
    spec = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )

    def resolve(kv_transfer_config=None) -> KVCacheLayout:
        vllm_config = VllmConfig(kv_transfer_config=kv_transfer_config)
        return resolve_kv_cache_layout(vllm_config, names, [spec])

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert resolve() == KVCacheLayout.LBNHC
    # A connector asking for BLHNC gets the backend's layout, with a warning.
    connector = KVTransferConfig(
        kv_connector=_RequiresBLHNC.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
    )
    assert resolve(connector) == KVCacheLayout.LBNHC
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=BLHNC"):
        resolve()
