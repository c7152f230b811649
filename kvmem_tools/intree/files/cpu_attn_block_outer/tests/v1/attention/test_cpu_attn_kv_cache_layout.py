# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache layouts the CPU attention backends declare, and what they serve."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.platforms import CpuArchEnum, current_platform
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.worker.utils import allocate_kv_cache

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="CPU attention backends"
)
# Block-outer layouts are declared where _get_attn_isa picks only the vec and
# vec16 kernels: x86 without AMX tiles.
VEC_ONLY_HOST = (
    current_platform.is_cpu()
    and current_platform.get_cpu_architecture() == CpuArchEnum.X86
    and not torch.cpu._is_amx_tile_supported()
)

NUM_LAYERS = 3
NUM_BLOCKS = 16
BLOCK_SIZE = 32
NUM_HEADS = 4
NUM_KV_HEADS = 2
# Three requests: a prefill, a decode and a chunked prefill over cached tokens.
SEQ_LENS = [45, 70, 100]
QUERY_LENS = [45, 1, 7]
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def _kv_caches(spec, layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """One backing allocation for every layer, viewed as vLLM's worker views
    it: block-outer layouts give each layer's view a block stride of
    layers x page."""
    layer_stride, block_stride = compute_layout_strides(
        spec, NUM_BLOCKS, NUM_LAYERS, layout
    )[:2]
    tensor = KVCacheTensor(
        size=NUM_LAYERS * NUM_BLOCKS * spec.page_size_bytes,
        layers=LAYERS,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )
    return allocate_kv_cache(config, torch.device("cpu"), layout)


def _run(layout, dtype, head_size, kv_cache_dtype, isa):
    """Write every layer's K/V through the backend, then attend; returns the
    caches and each layer's output."""
    cache_dtype = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        head_size=head_size,
        dtype=cache_dtype,
    )
    kv_caches = _kv_caches(spec, layout)

    generator = torch.Generator().manual_seed(0)
    num_blocks = [-(-seq_len // BLOCK_SIZE) for seq_len in SEQ_LENS]
    blocks = torch.randperm(NUM_BLOCKS, generator=generator).to(torch.int32)
    block_table = torch.zeros(len(SEQ_LENS), max(num_blocks), dtype=torch.int32)
    for i, n in enumerate(num_blocks):
        block_table[i, :n] = blocks[sum(num_blocks[:i]) : sum(num_blocks[: i + 1])]
    slot_mapping = torch.cat(
        [
            block_table[i, torch.arange(seq_len) // BLOCK_SIZE].long() * BLOCK_SIZE
            + torch.arange(seq_len) % BLOCK_SIZE
            for i, seq_len in enumerate(SEQ_LENS)
        ]
    )
    query_start_loc = torch.tensor([0, *QUERY_LENS], dtype=torch.int32).cumsum(
        0, dtype=torch.int32
    )
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    metadata = CPUAttentionMetadata(
        num_actual_tokens=sum(QUERY_LENS),
        max_query_len=max(QUERY_LENS),
        query_start_loc=query_start_loc,
        max_seq_len=max(SEQ_LENS),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(SEQ_LENS),
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=head_size,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=False,
            kv_cache_dtype=kv_cache_dtype,
        ),
    )
    model_config = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
    with mock.patch.object(cpu_attn, "get_current_vllm_config", lambda: model_config):
        impl = CPUAttentionBackendImpl(
            num_heads=NUM_HEADS,
            head_size=head_size,
            scale=head_size**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype=kv_cache_dtype,
        )
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)

    outputs = []
    for name in LAYERS:
        key, value = torch.randn(
            2, len(slot_mapping), NUM_KV_HEADS, head_size, generator=generator
        ).to(dtype)
        impl.do_kv_cache_update(layer, key, value, kv_caches[name], slot_mapping)
    for name in LAYERS:
        query = torch.randn(
            sum(QUERY_LENS), NUM_HEADS, head_size, generator=generator
        ).to(dtype)
        output = torch.empty(sum(QUERY_LENS), NUM_HEADS * head_size, dtype=dtype)
        impl.forward(layer, query, None, None, kv_caches[name], metadata, output)
        outputs.append(output)
    return kv_caches, outputs


@pytest.mark.parametrize("layout", [KVCacheLayout.BLHNC, KVCacheLayout.BHLNC])
@pytest.mark.parametrize(
    "dtype,head_size,kv_cache_dtype",
    [
        (torch.bfloat16, 64, "auto"),
        (torch.float32, 128, "auto"),
        (torch.bfloat16, 80, "auto"),  # vec16 kernels
        (torch.bfloat16, 128, "fp8"),
    ],
)
def test_block_outer_layouts_give_bitwise_equal_attention(
    layout, dtype, head_size, kv_cache_dtype
):
    # Any host runs the cases its _get_attn_isa gives to the vec kernels.
    try:
        isa = cpu_attn._get_attn_isa(dtype, BLOCK_SIZE, head_size, kv_cache_dtype)
    except NotImplementedError as e:
        pytest.skip(str(e))
    if isa not in ("vec", "vec16"):
        pytest.skip(f"{isa} kernels: block-outer layouts are not declared for them")
    ref_caches, ref_outputs = _run(
        KVCacheLayout.LBHNC, dtype, head_size, kv_cache_dtype, isa
    )
    kv_caches, outputs = _run(layout, dtype, head_size, kv_cache_dtype, isa)
    for name, output, ref_output in zip(LAYERS, outputs, ref_outputs):
        page_size = kv_caches[name][0].numel() * kv_caches[name].element_size()
        block_stride = kv_caches[name].stride(0) * kv_caches[name].element_size()
        assert block_stride == NUM_LAYERS * page_size
        assert torch.equal(kv_caches[name], ref_caches[name])
        assert torch.isfinite(output.float()).all() and output.abs().sum() > 0
        assert torch.equal(output, ref_output)


def test_block_interiors_stay_head_major():
    # The kernels read [N, C] per head: token-major interiors cannot be viewed.
    declared = CPUAttentionBackend.supported_kv_cache_layouts()
    assert declared[0] == KVCacheLayout.LBHNC
    if VEC_ONLY_HOST:
        assert {KVCacheLayout.BLHNC, KVCacheLayout.BHLNC} <= set(declared)
    else:
        assert declared == (KVCacheLayout.LBHNC,)
    assert not {KVCacheLayout.LBNHC, KVCacheLayout.BLNHC} & set(declared)


@pytest.mark.parametrize(
    "arch,amx",
    [
        (CpuArchEnum.X86, True),
        (CpuArchEnum.ARM, False),
        (CpuArchEnum.POWERPC, False),
        (CpuArchEnum.S390X, False),
        (CpuArchEnum.RISCV, False),
    ],
)
def test_hosts_with_other_kernels_keep_lbhnc(monkeypatch, arch, amx):
    # AMX, NEON, VSX, VXE and RVV kernels are not validated on block-outer views.
    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: arch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)


class _RequiresBLHNC(KVConnectorBase_V1):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return "BLHNC"


def _resolve(backend, spec, connector: bool = False) -> KVCacheLayout:
    kv_transfer_config = None
    if connector:
        kv_transfer_config = KVTransferConfig(
            kv_connector=_RequiresBLHNC.__name__,
            kv_connector_module_path=__name__,
            kv_role="kv_both",
        )
    vllm_config = VllmConfig(kv_transfer_config=kv_transfer_config)
    names = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    return resolve_kv_cache_layout(vllm_config, [names], [spec])


ATTN_SPEC = FullAttentionSpec(
    block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
)


def test_cpu_attn_keeps_lbhnc_by_default(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert _resolve(CPUAttentionBackend, ATTN_SPEC) == KVCacheLayout.LBHNC


@pytest.mark.skipif(not VEC_ONLY_HOST, reason="LBHNC alone is declared here")
def test_cpu_attn_takes_blhnc_when_asked(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert (
        _resolve(CPUAttentionBackend, ATTN_SPEC, connector=True) == KVCacheLayout.BLHNC
    )
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    assert _resolve(CPUAttentionBackend, ATTN_SPEC) == KVCacheLayout.BLHNC
