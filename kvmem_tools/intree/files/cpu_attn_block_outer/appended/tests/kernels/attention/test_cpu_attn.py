def _block_outer_layer(
    layout: str, num_blocks: int, num_heads: int, block_size: int, dim: int, dtype
) -> torch.Tensor:
    # The last of three layers in one allocation, as the worker views a layer
    # in a block-outer layout: [num_blocks, num_heads, block_size, dim], each
    # head's [block_size, dim] interior dense, with wider block (and, for
    # BHLNC, head) strides.
    if layout == "BLHNC":
        shape = (num_blocks, 3, num_heads, block_size, dim)
        return torch.empty(shape, dtype=dtype)[:, -1]
    assert layout == "BHLNC"
    shape = (num_blocks, num_heads, 3, block_size, dim)
    return torch.empty(shape, dtype=dtype)[:, :, -1]


# As _get_attn_isa: the AVX2 build of the vec kernels has no FP8 KV cache.
_skip_no_fp8_kv_cache = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
)


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
@pytest.mark.parametrize(
    "isa,head_size,dtype,kv_cache_dtype",
    [
        ("vec", 128, torch.bfloat16, "auto"),
        ("vec", 128, torch.float32, "auto"),
        pytest.param(
            "vec", 128, torch.bfloat16, "fp8_e4m3", marks=_skip_no_fp8_kv_cache
        ),
        ("vec16", 80, torch.bfloat16, "auto"),
    ],
)
def test_varlen_with_paged_kv_block_outer(
    layout: str, isa: str, head_size: int, dtype: torch.dtype, kv_cache_dtype: str
) -> None:
    # CPU_ATTN declares block-outer layouts for the vec kernels: the output
    # must be the same bits as with one layer per allocation.
    kwargs = dict(
        seq_lens=SEQ_LENS[2],
        num_heads=(8, 2),
        head_size=head_size,
        sliding_window=None,
        dtype=dtype,
        block_size=128,
        soft_cap=None,
        num_blocks=128,
        use_alibi=False,
        use_sink=False,
        isa=isa,
        kv_cache_dtype=kv_cache_dtype,
    )
    # Fresh random inputs for each run, so that both draw the same ones.
    tensor_cache.cache_clear()
    per_layer = varlen_with_paged_kv(**kwargs)
    tensor_cache.cache_clear()
    block_outer = varlen_with_paged_kv(**kwargs, block_outer_layout=layout)
    assert torch.equal(block_outer, per_layer)


class _RequiresBLHNC(KVConnectorBase_V1):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "BLHNC"


@pytest.mark.parametrize(
    "arch,amx,block_outer",
    [
        (CpuArchEnum.X86, False, True),
        (CpuArchEnum.X86, True, False),
        (CpuArchEnum.ARM, False, False),
        (CpuArchEnum.POWERPC, False, False),
        (CpuArchEnum.S390X, False, False),
        (CpuArchEnum.RISCV, False, False),
    ],
)
def test_cpu_attn_kv_cache_layouts(monkeypatch, arch, amx, block_outer) -> None:
    # Block-outer layouts only where _get_attn_isa picks the vec and vec16
    # kernels alone, and only when a connector or the env var asks for one.
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: arch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    expected = [KVCacheLayout.LBHNC]
    if block_outer:
        expected += [KVCacheLayout.BLHNC, KVCacheLayout.BHLNC]
    assert list(CPUAttentionBackend.supported_kv_cache_layouts()) == expected

    backends = [CPUAttentionBackend]
    names = [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    connector = KVTransferConfig(
        kv_connector=_RequiresBLHNC.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
    )
    asked = KVCacheLayout.BLHNC if block_outer else KVCacheLayout.LBHNC
    for kv_transfer_config, layout in ((None, KVCacheLayout.LBHNC), (connector, asked)):
        vllm_config = VllmConfig(kv_transfer_config=kv_transfer_config)
        assert resolve_kv_cache_layout(vllm_config, names, [spec]) == layout
