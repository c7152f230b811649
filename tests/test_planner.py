"""``kvmem plan`` and the KV arithmetic, checked against hand calculations.

No engine starts here: models are config.json files plus safetensors files
that hold only a header (the planner never reads tensor data), or tiny models
from ``build_tiny_model``. The hand calculations are written out in comments
so that a failure says which figure moved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_kvmem import planner
from vllm_kvmem.core import units
from vllm_kvmem.core.kv_arith import blocks_for_tokens
from vllm_kvmem.core.units import GiB, KiB, MiB, cdiv
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner import partition
from vllm_kvmem.tiny_model import build_tiny_model

QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 64,
}

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

_DT_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


# ------------------------------------------------------------- model files


def llama_tensors(
    cfg: dict[str, Any], *, fp8: bool = False
) -> list[tuple[str, str, tuple]]:
    """(name, safetensors dtype, shape) of a Llama/Qwen3-style checkpoint."""
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    lin = "F8_E4M3" if fp8 else "BF16"
    out = [("model.embed_tokens.weight", "BF16", (vocab, h))]
    for i in range(n):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", lin, (q, h)),
            (f"{p}.self_attn.k_proj.weight", lin, (kv, h)),
            (f"{p}.self_attn.v_proj.weight", lin, (kv, h)),
            (f"{p}.self_attn.o_proj.weight", lin, (h, q)),
            (f"{p}.mlp.gate_proj.weight", lin, (inter, h)),
            (f"{p}.mlp.up_proj.weight", lin, (inter, h)),
            (f"{p}.mlp.down_proj.weight", lin, (h, inter)),
            (f"{p}.input_layernorm.weight", "BF16", (h,)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
        ]
    out += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (vocab, h))]
    return out


def tensor_bytes(dtype: str, shape: tuple) -> int:
    return math.prod(shape) * _DT_BYTES[dtype]


def write_header_only(path: Path, tensors: list[tuple[str, str, tuple]]) -> int:
    """A safetensors file with its header and no data; returns the data size."""
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        size = tensor_bytes(dtype, shape)
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    return offset


def write_model(
    root: Path,
    cfg: dict[str, Any],
    *,
    shards: int = 4,
    with_shards: bool = True,
    fp8: bool = False,
) -> Path:
    """config.json + model.safetensors.index.json (+ header-only shards)."""
    root.mkdir(parents=True, exist_ok=True)
    if fp8:
        cfg = {**cfg, "quantization_config": {"quant_method": "fp8"}}
    (root / "config.json").write_text(json.dumps(cfg))
    tensors = llama_tensors(cfg, fp8=fp8)
    per = cdiv(len(tensors), shards)
    weight_map, total = {}, 0
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        chunk = tensors[k * per : (k + 1) * per]
        weight_map.update({t[0]: name for t in chunk})
        if with_shards:
            total += write_header_only(root / name, chunk)
        else:
            total += sum(tensor_bytes(d, s) for _, d, s in chunk)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen3-32b"), QWEN3_32B)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama3-8b"), LLAMA3_8B)


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvmem plan")
    planner.add_arguments(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text",
    ["5G", "512M", "1.5g", "400000", "25.6k", "1K", "1k", " 2T ", "+5", "1_000"]
    + ["1.5G", "lots", "5 GB", "1e3", "0x10", "5GiB", ""],
)
def test_parse_size_is_vllms_human_readable_int(text: str) -> None:
    """The one size parser accepts what vLLM's flag parser accepts, with the
    same value, and refuses what it refuses."""
    from argparse import ArgumentTypeError

    from vllm.utils.argparse_utils import human_readable_int

    try:
        expected = human_readable_int(text)
    except (ValueError, ArgumentTypeError):
        with pytest.raises(ValueError):
            units.parse_size(text)
    else:
        assert units.parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "hint"), [("1.5G", "1.5g"), ("lots", "5G"), ("5 GB", "5G")]
)
def test_parse_size_errors_say_what_works(text: str, hint: str) -> None:
    with pytest.raises(ValueError, match=hint) as e:
        units.parse_size(text, flag="--kv-cache-memory-bytes")
    assert "\n" not in str(e.value)


def test_a_token_count_error_speaks_of_tokens() -> None:
    with pytest.raises(ValueError, match="not a token count") as e:
        units.parse_size("abc", flag="--kv-cache-tokens")
    assert "5G" not in str(e.value) and "400k" in str(e.value)
    with pytest.raises(ValueError, match="e.g. 400k"):
        units.parse_positive_size("0", flag="--kv-cache-tokens")


# ----------------------------------------------------------- layer kinds


def test_full_attention_bytes_per_token_and_tp_replication() -> None:
    # Llama-3-8B: 8 KV heads x (128 K + 128 V) x 2 bytes = 4 KiB per token.
    spec = km.full_attention(8, 128, 2)
    assert spec.bytes_per_token() == 4096
    assert spec.page_bytes(16) == 64 * KiB
    assert spec.bytes_per_token(tp=2) == 2048  # 4 heads per rank
    assert spec.bytes_per_token(tp=8) == 512  # 1 head per rank
    assert spec.bytes_per_token(tp=16) == 512  # replicated: still 1 head
    assert km.full_attention(8, 128, 1).bytes_per_token() == 2 * KiB  # fp8


def test_mla_is_one_latent_not_split_by_tp() -> None:
    # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 per token.
    spec = km.mla(512, 64, 2)
    assert spec.bytes_per_token() == 576 * 2
    assert spec.bytes_per_token(tp=8) == 576 * 2
    assert km.mla(512, 64, 1, state_bytes=656).page_bytes(16) == 656 * 16


def test_sliding_window_blocks_per_request() -> None:
    # SlidingWindowSpec: cdiv(min(window - 1 + in_flight, max_len), block) + 1.
    spec = km.sliding_window(8, 128, 2, 4096)
    got = spec.blocks_per_request(
        block_size=16, max_model_len=32768, max_in_flight_tokens=2048
    )
    assert got == cdiv(4095 + 2048, 16) + 1 == 385
    short = spec.blocks_per_request(
        block_size=16, max_model_len=1000, max_in_flight_tokens=2048
    )
    assert short == 63 + 1
    full = km.full_attention(8, 128, 2)
    assert (
        full.blocks_per_request(
            block_size=16, max_model_len=1000, max_in_flight_tokens=2048
        )
        == 63
    )


def test_hybrid_groups_follow_vllm_uniform_page_size_grouping() -> None:
    # 8 sliding + 4 full layers: group size 4 (the smaller bucket), so two
    # sliding groups (layers[0::2], layers[1::2]) and one full group.
    pattern = [True, True, False] * 4
    layers = [
        km.sliding_window(4, 64, 2, 512) if sw else km.full_attention(4, 64, 2)
        for sw in pattern
    ]
    groups = km.kv_cache_groups(layers)
    assert [g.layers for g in groups] == [
        (0, 3, 6, 9),
        (1, 4, 7, 10),
        (2, 5, 8, 11),
    ]
    # Stage 0 = layers 0-5: two layers of each group -> 2 pages per block.
    page = 4 * 128 * 2 * 16
    assert km.stage_bytes_per_block(groups, 0, 6, block_size=16) == 2 * page
    assert km.stage_bytes_per_block(groups, 0, 7, block_size=16) == 3 * page
    need = km.request_blocks(
        groups, block_size=16, max_model_len=8192, max_in_flight_tokens=3 * 1024
    )
    assert need == 2 * (cdiv(511 + 3072, 16) + 1) + 8192 // 16 == 962
    # Hybrid manager off: everything is full attention, one group.
    assert len(km.kv_cache_groups(layers, hybrid=False)) == 1


# -------------------------------------------------------------- partitions


@pytest.mark.parametrize(
    ("layers", "pp", "parts"),
    [
        (64, 2, [32, 32]),
        (10, 4, [2, 3, 3, 2]),  # remainder 2 -> stages -2 and -3
        (11, 4, [3, 3, 3, 2]),  # remainder 3 -> every stage but the last
        (7, 4, [2, 2, 2, 1]),
        (5, 3, [2, 2, 1]),
        (32, 1, [32]),
    ],
)
def test_default_partition_mirrors_get_pp_indices(
    layers: int, pp: int, parts: list[int]
) -> None:
    assert km.default_partition(layers, pp) == parts


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("56,7", "adds up to 63 layers but the model has 64.*e.g. 32,32"),
        ("64", "has 1 stages but --pipeline-parallel-size is 2.*e.g. 32,32"),
        ("56,x", "comma-separated layer counts.*e.g. 32,32"),
        ("64,0", "at least one layer"),
    ],
)
def test_bad_partition_errors(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        km.parse_partition(text, 64, 2)


# ----------------------------------------------------- the seed's numbers


def test_seed_56_8_split_of_qwen3_32b(qwen: Path) -> None:
    """Seed 000: fp8 KV (2 KiB per token per layer), blocks of 16, 5 GiB.

    Bytes per block: stage 0 = 56 x 32 KiB = 1.75 MiB, stage 1 = 8 x 32 KiB.
    Without the split: 5 GiB // 1.75 MiB = 2,925 blocks = 46,800 tokens on
    rank 0 and 20,480 blocks = 327,680 tokens on rank 1; vLLM 0.32 cuts both
    to 2,925. With it: 5 GiB // 2 MiB = 2,560 blocks = 40,960 tokens on both
    ranks, from 4.375 + 0.625 GiB.
    """
    common = dict(
        pp=2,
        partition="56,8",
        budget_bytes="5G",
        kv_cache_dtype="fp8",
        block_size=16,
        max_model_len=40960,
        strict=False,
    )
    base = planner.plan_capacity(qwen, proportional=False, **common)
    assert [s.bytes_per_block for s in base.stages] == [56 * 32 * KiB, 8 * 32 * KiB]
    assert [s.handed_blocks for s in base.stages] == [2925, 20480]
    assert [s.handed_tokens for s in base.stages] == [46_800, 327_680]
    assert [round(s.handed_concurrency, 2) for s in base.stages] == [1.14, 8.0]
    assert base.num_blocks == 2925 and base.tokens == 46_800
    assert round(base.concurrency, 2) == 1.14
    assert base.fits

    split = planner.plan_capacity(qwen, proportional=True, **common)
    assert [s.num_blocks for s in split.stages] == [2560, 2560]
    assert split.tokens == 40_960 and split.concurrency == 1.0
    assert [s.kv_bytes for s in split.stages] == [int(4.375 * GiB), int(0.625 * GiB)]
    # vLLM 0.32 reserves a null block and checks memory - one block >= one
    # request: 2,560 blocks cannot start a 40,960-token request (needs 2,561).
    assert not split.fits
    assert split.usable_tokens == 2559 * 16
    assert split.min_budget == 5 * GiB + 2 * MiB
    with pytest.raises(ValueError, match=r"5122M .* or more") as e:
        planner.plan_capacity(qwen, proportional=True, **{**common, "strict": True})
    assert "null block" in str(e.value)

    # At 32,768 tokens per request the split starts: same 40,960 tokens, 1.25x.
    ok = planner.plan_capacity(
        qwen, proportional=True, **{**common, "max_model_len": 32768, "strict": True}
    )
    assert (ok.num_blocks, ok.tokens, ok.concurrency) == (2560, 40_960, 1.25)


@pytest.mark.parametrize("kind", ["full", "sliding", "mla"])
@pytest.mark.parametrize(
    ("num_blocks", "max_len"), [(2925, 40960), (100, 1000), (7, 4096)]
)
def test_capacity_is_vllms_get_kv_cache_capacity(
    kind: str, num_blocks: int, max_len: int
) -> None:
    """Page bytes, blocks per request, logged tokens and concurrency equal what
    vLLM computes from its own KV spec of the same layer (null block included)."""
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    shape = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    layer, spec = {
        "full": (km.full_attention(8, 128, 2), FullAttentionSpec(**shape)),
        "sliding": (
            km.sliding_window(8, 128, 2, 4096),
            SlidingWindowSpec(**shape, sliding_window=4096),
        ),
        "mla": (
            km.mla(512, 64, 2),
            MLAAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
            ),
        ),
    }[kind]
    in_flight = 2048
    vllm_config = SimpleNamespace(  # what the capacity functions read
        model_config=SimpleNamespace(max_model_len=max_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        max_in_flight_tokens=in_flight,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)],
    )
    bpr = km.request_blocks(
        km.kv_cache_groups([layer]),
        block_size=16,
        max_model_len=max_len,
        max_in_flight_tokens=in_flight,
    )
    assert layer.page_bytes(16) == spec.page_size_bytes
    assert km.vllm_capacity(num_blocks, bpr, max_len) == get_kv_cache_capacity(
        vllm_config, config
    )


# ---------------------------------------------------------- Llama-3-8B-like


def test_llama3_8b_per_token_and_budgets(llama: Path) -> None:
    # 32 layers x 4 KiB = 128 KiB per token; a 16-token block is 2 MiB.
    cap = planner.plan_capacity(llama, budget_bytes="16G", max_model_len=8192)
    assert cap.stages[0].kv_bytes_per_token == 128 * KiB
    assert cap.stages[0].bytes_per_block == 2 * MiB
    assert cap.num_blocks == 8192 and cap.tokens == 131_072
    assert cap.concurrency == 16.0

    # PP 2, even 16/16: 1 MiB per block per stage.
    base = planner.plan_capacity(llama, pp=2, budget_bytes="16G", max_model_len=8192)
    split = planner.plan_capacity(
        llama, pp=2, budget_bytes="16G", max_model_len=8192, proportional=True
    )
    assert base.num_blocks == 16384 and base.tokens == 262_144
    assert split.num_blocks == 8192 and split.total_kv_bytes == 16 * GiB

    # TP 2: 4 KV heads per rank, half the bytes per block.
    tp2 = planner.plan_capacity(llama, tp=2, budget_bytes="16G", max_model_len=8192)
    assert tp2.stages[0].bytes_per_block == MiB and tp2.num_blocks == 16384


def test_token_budget_gets_exact_blocks_on_every_stage(llama: Path) -> None:
    cap = planner.plan_capacity(
        llama, pp=2, budget_tokens="400000", max_model_len=8192, proportional=True
    )
    assert cap.num_blocks == 400_000 // 16 + 1 == 25_001  # and the null block
    assert [s.kv_bytes for s in cap.stages] == [25_001 * MiB, 25_001 * MiB]
    assert cap.tokens == 400_016  # what vLLM logs
    assert cap.usable_tokens == 400_000  # all but the null block: every token
    same = planner.plan_capacity(
        llama, pp=2, budget_tokens="400k", max_model_len=8192, proportional=False
    )
    assert same.num_blocks == cap.num_blocks


@pytest.mark.parametrize(("bpr", "max_len"), [(512, 8192), (63, 1000), (19, 2048)])
def test_token_budget_is_the_null_block_and_the_fewest_blocks_vllm_counts_enough(
    bpr: int, max_len: int
) -> None:
    # (19, 2048): a sliding window, whose logged tokens exceed its slots.
    def logged(blocks: int) -> int:
        return km.vllm_capacity(blocks, bpr, max_len)[0]

    for tokens in (1, 999, 1000, 1001, 40_000, 123_457):
        b = blocks_for_tokens(tokens, logged)
        assert logged(b - 1) >= tokens  # usable: all but the null block
        assert b == 2 or logged(b - 2) < tokens
        # A guess on either side of the answer finds the same count.
        assert blocks_for_tokens(tokens, logged, guess=b + 17) == b
        assert blocks_for_tokens(tokens, logged, guess=max(1, b // 3)) == b
    # The least that starts is one more token than bpr blocks log.
    assert blocks_for_tokens(km.min_tokens(bpr, max_len), logged) == bpr + 1


def test_target_concurrency_budget_both_ways(llama: Path) -> None:
    p = planner.plan(
        llama, pp=2, partition="20,12", max_model_len=8192, target_concurrency=4
    )
    t = p.target
    assert t is not None
    # 4 x 512 blocks usable + 1 null block; stage bytes per block 20 and 12
    # layers x 64 KiB.
    assert t.num_blocks == 2049
    assert t.per_gpu_bytes == 2049 * 20 * 64 * KiB
    assert t.proportional_bytes == 2049 * 32 * 64 * KiB
    cap = planner.plan_capacity(
        llama,
        pp=2,
        partition="20,12",
        max_model_len=8192,
        budget_bytes=t.proportional_bytes,
        proportional=True,
    )
    assert cap.usable_tokens >= 4 * 8192
    cap = planner.plan_capacity(
        llama, pp=2, partition="20,12", max_model_len=8192, budget_bytes=t.per_gpu_bytes
    )
    assert cap.usable_tokens >= 4 * 8192


# -------------------------------------------------------------- weights


def test_weights_from_header_only_shards(llama: Path) -> None:
    info = planner.load_model(llama)
    c = LLAMA3_8B
    h, inter, kv = c["hidden_size"], c["intermediate_size"], 8 * 128
    layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h)
    assert info.weights.exact
    assert info.weights.per_layer == (layer,) * 32
    assert info.weights.embed == info.weights.lm_head == 2 * 128256 * 4096
    assert info.weights.final_norm == 2 * h
    assert info.weights.stage_fixed_bytes(2) == (
        2 * 128256 * 4096,
        2 * 128256 * 4096 + 2 * h,
    )


def test_weights_from_index_total_size_when_shards_are_absent(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", LLAMA3_8B, with_shards=False)
    info = planner.load_model(root)
    exact = planner.load_model(write_model(tmp_path / "e", LLAMA3_8B))
    assert not info.weights.exact and "total_size" in info.weights.source
    assert abs(info.weights.total - exact.weights.total) < 32  # integer split
    assert info.weights.per_layer[0] == exact.weights.per_layer[0]


def test_weights_from_a_single_model_safetensors(tmp_path: Path) -> None:
    root = build_tiny_model(tmp_path / "tiny", num_layers=4, dtype="float32")
    info = planner.load_model(root)
    # Float32 on disk, bfloat16 in vLLM (--dtype auto downcasts): half the bytes.
    assert info.dtype == "bfloat16"
    on_disk = (root / "model.safetensors").stat().st_size
    assert info.weights.total < on_disk / 2 + 1
    assert info.weights.per_layer[0] == info.weights.per_layer[3] > 0
    # Header only: the planner does not read tensor data.
    header = planner.read_safetensors_header(root / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in header


# ------------------------------------------------------ per-layer kinds


def test_tiny_models_kinds_and_cpu_defaults(tmp_path: Path) -> None:
    sw = build_tiny_model(tmp_path / "sw", num_layers=4, sliding_window=256)
    p = planner.plan(sw, platform="cpu", max_model_len=4096, budget_bytes="64M")
    assert p.setup.block_size == 128  # vllm/platforms/cpu.py default
    assert p.setup.max_num_batched_tokens == 2048  # `vllm serve` on CPU, world 1
    [kind] = p.kinds
    assert kind.kind == "sliding_window" and kind.sliding_window == 256
    # in flight: 2048 tokens x 1 batch (CPU: no async scheduling), under 4096.
    assert kind.blocks_per_request == cdiv(255 + 2048, 128) + 1 == 19
    full = build_tiny_model(tmp_path / "full", num_layers=4)
    assert [k.kind for k in planner.plan(full).kinds] == ["full_attention"]


def test_qwen_sliding_window_rules(tmp_path: Path) -> None:
    base = {**QWEN3_32B, "num_hidden_layers": 4, "sliding_window": 4096}
    for name, extra, kinds in [
        ("off", {"use_sliding_window": False}, {"full_attention"}),
        (
            "all",
            {"use_sliding_window": True, "max_window_layers": 0},
            {"sliding_window"},
        ),
    ]:
        root = tmp_path / name
        root.mkdir()
        (root / "config.json").write_text(json.dumps({**base, **extra}))
        assert {k.kind for k in planner.plan(root).kinds} == kinds
    root = tmp_path / "some"
    root.mkdir()
    cfg = {**base, "use_sliding_window": True, "max_window_layers": 2}
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="some layers only"):
        planner.load_model(root)


def test_mla_config(tmp_path: Path) -> None:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 163840,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = planner.plan(tmp_path, tp=8, max_model_len=32768, budget_bytes="4G")
    [kind] = p.kinds
    assert (kind.kind, kind.bytes_per_token) == ("mla", 1152)
    assert p.stages[0].kv_bytes_per_token == 61 * 1152
    with pytest.raises(ValueError, match="weight sizes"):
        planner.plan(tmp_path, device_memory=["80G"])


# ------------------------------------------------------------ bad input


def write_config(root: Path, cfg: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize(
    ("cfg", "pattern"),
    [
        (
            {"architectures": ["FooForCausalLM"]},
            "unknown architecture.*LlamaForCausalLM",
        ),
        ({"architectures": ["JambaForCausalLM"]}, "Mamba layers.*supported: "),
        (
            {
                **LLAMA3_8B,
                "num_hidden_layers": 2,
                "layer_types": ["full_attention", "linear_attention"],
            },
            "'linear_attention' .* not supported: linear-attention",
        ),
    ],
)
def test_unsupported_models(tmp_path: Path, cfg: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as e:
        planner.load_model(write_config(tmp_path / "m", cfg))
    assert "\n" not in str(e.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json.*kvmem tiny-model"):
        planner.load_model(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        planner.load_model(tmp_path / "missing")


def test_budget_errors(llama: Path) -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        planner.plan_capacity(llama, budget_bytes="5G", budget_tokens=400000)
    with pytest.raises(ValueError, match="decimals are not allowed.*1.5g"):
        planner.plan_capacity(llama, budget_bytes="1.5G")
    # 8,192 tokens need 512 blocks + 1 null block of 2 MiB: 1026 MiB.
    with pytest.raises(ValueError, match="use at least 1026M per GPU") as e:
        planner.plan(llama, budget_bytes="1G", max_model_len=8192)
    assert "\n" not in str(e.value)
    # 8,176 tokens buy 511 usable blocks of 16; one request needs 512.
    with pytest.raises(ValueError, match="--kv-cache-tokens 8177 or more"):
        planner.plan_capacity(llama, budget_tokens=8176, max_model_len=8192)
    assert planner.plan_capacity(llama, budget_tokens=8177, max_model_len=8192)
    with pytest.raises(ValueError, match="fp8"):
        planner.plan_capacity(llama, budget_bytes="5G", kv_cache_dtype="nvfp4")


def test_cli_errors(llama: Path) -> None:
    args = cli(str(llama), "--kv-cache-memory-bytes", "5G", "--kv-cache-tokens", "4k")
    with pytest.raises(ValueError, match="mutually exclusive"):
        planner.run(args)
    with pytest.raises(ValueError, match="2 devices but --pipeline-parallel-size is 3"):
        planner.run(cli(str(llama), "-pp", "3", "--device-memory", "16G,32G"))


# ----------------------------------------------------------------- output


# The seed's run: Qwen3-32B split 56/8, 5 GiB, fp8 KV.
SEED_FLAGS = (
    "-pp 2 --pp-layer-partition 56,8 --kv-cache-memory-bytes 5G --kv-cache-dtype fp8"
).split()


def test_json_output_parses(qwen: Path, capsys: pytest.CaptureFixture) -> None:
    args = cli(
        str(qwen),
        *SEED_FLAGS,
        "--max-model-len",
        "32768",
        "--target-concurrency",
        "2",
        "--json",
    )
    assert planner.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["partition"] == [56, 8]
    assert out["kinds"][0]["bytes_per_token"] == 2048
    assert [s["bytes_per_block"] for s in out["stages"]] == [1835008, 262144]
    assert out["without_split"]["stages"][0]["handed_tokens"] == 46_800
    assert out["with_split"]["tokens"] == 40_960 and out["with_split"]["fits"]
    assert out["target"]["num_blocks"] == 2 * 2048 + 1


def test_human_table(qwen: Path, capsys: pytest.CaptureFixture) -> None:
    args = cli(str(qwen), *SEED_FLAGS)
    assert planner.run(args) == 0
    out = capsys.readouterr().out
    assert "46,800" in out and "327,680" in out and "40,960" in out
    assert "does not start" in out and "5122M" in out  # split at 40,960 tokens
    assert "not modelled: Mamba" in out


# ------------------------------------------------------ heterogeneous PP


def test_heterogeneous_16g_32g_beats_even(
    llama: Path, capsys: pytest.CaptureFixture
) -> None:
    p = planner.plan(llama, pp=2, device_memory=["16G", "32G"], max_model_len=8192)
    r = p.hetero
    assert r is not None
    assert r.best.partition[1] > r.best.partition[0]  # more layers on 32G
    assert r.even.partition == [16, 16]
    assert r.best.num_blocks > r.even.num_blocks
    assert p.setup.partition == r.best.partition  # the report uses it
    # Exact: no composition of 32 layers into 2 stages does better.
    info = planner.load_model(llama)
    arith = planner.KVCosts(info, p.setup)
    first, last = info.weights.stage_fixed_bytes(2)
    cost = partition.PipelineCost(
        32, arith.bytes_per_block, info.weights.per_layer, first, last
    )
    devices = [16 * GiB, 32 * GiB]
    brute = max(
        partition.evaluate_partition(cost, [a, 32 - a], devices, GiB).num_blocks
        for a in range(1, 32)
    )
    assert r.best.num_blocks == brute
    # Free KV memory on stage 0 = 16 GiB - 1 GiB reserve - its weights.
    st0 = r.best.stages[0]
    assert st0.free_bytes == 16 * GiB - GiB - st0.weight_bytes
    assert st0.max_blocks == st0.free_bytes // st0.bytes_per_block
    # The command reproduces the capacity: the pipeline-wide budget hands each
    # stage exactly its blocks.
    assert (
        r.env == f"VLLM_PP_LAYER_PARTITION={r.best.partition[0]},{r.best.partition[1]}"
    )
    budget = int(r.flags[-1].split()[-1])
    cap = planner.plan_capacity(
        llama,
        pp=2,
        partition=r.best.partition,
        budget_bytes=budget,
        max_model_len=8192,
        proportional=True,
    )
    assert cap.num_blocks == r.best.num_blocks
    assert "--enable-pp-prop-kv-cache" in r.flags


def test_heterogeneous_weights_that_do_not_fit(qwen: Path) -> None:
    # Qwen3-32B in bf16 is ~61 GiB of weights: two 24 GiB GPUs cannot hold it.
    with pytest.raises(ValueError, match="do not fit.*tensor-parallel-size"):
        planner.plan(qwen, device_memory=["24G", "24G"], max_model_len=32768)
    # With TP 2 (four GPUs) it does.
    p = planner.plan(
        qwen,
        tp=2,
        device_memory=["24G", "24G"],
        kv_cache_dtype="fp8",
        max_model_len=32768,
    )
    assert p.hetero is not None and p.hetero.best.partition == [32, 32]


def test_best_partition_is_exact_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(60):
        n, pp = rng.randint(2, 10), rng.randint(1, 3)
        pp = min(pp, n)
        layers = [
            km.sliding_window(2, 64, 2, 128)
            if rng.random() < 0.5
            else km.full_attention(2, 64, 2)
            for _ in range(n)
        ]
        groups = km.kv_cache_groups(layers)
        cost = partition.PipelineCost(
            n,
            km.bytes_per_block_fn(groups, n, block_size=16),
            [rng.randint(1, 100) * 1000 for _ in range(n)],
            rng.randint(0, 50_000),
            rng.randint(0, 50_000),
        )
        devices = [rng.randint(300, 900) * 1000 for _ in range(pp)]
        brute = max(
            partition.evaluate_partition(cost, parts, devices, 0).num_blocks
            for parts in _compositions(n, pp)
        )
        if brute < 0:
            with pytest.raises(ValueError):
                partition.best_partition(cost, devices, 0)
            continue
        assert partition.best_partition(cost, devices, 0).num_blocks == brute


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_best_partition_is_fast_for_128_layers_4_stages() -> None:
    layers = [km.full_attention(8, 128, 1)] * 128
    groups = km.kv_cache_groups(layers)
    cost = partition.PipelineCost(
        128,
        km.bytes_per_block_fn(groups, 128, block_size=16),
        [950 * MiB] * 128,
        GiB,
        GiB,
    )
    fit = partition.best_partition(cost, [24 * GiB, 40 * GiB, 80 * GiB, 32 * GiB], GiB)
    assert sum(fit.partition) == 128
    assert fit.partition[2] == max(fit.partition)  # the 80 GiB device


# ------------------------------------------------------------------ core


def test_host_and_disk_tiers_in_blocks_and_tokens(llama: Path) -> None:
    """--kv-host-cache-bytes per TP shard holds one slot per block for every
    stage; --kv-disk-cache-bytes covers every rank's file, header included."""
    p = planner.plan(
        llama, pp=2, budget_bytes="16G", max_model_len=8192,
        host_bytes="8G", disk_bytes="1G",
    )  # fmt: skip
    host, disk = p.tiers
    # Two stages of 1 MiB per block: a host slot is 2 MiB, 4,096 of them.
    assert (host.block_bytes, host.blocks, host.tokens) == (2 * MiB, 4096, 65_536)
    assert host.vs_device == pytest.approx(65_536 / 262_144)
    assert disk.block_bytes == 2 * MiB + 2 * 128 and disk.blocks == 511
    text = planner.format_plan(p)
    assert "--kv-disk-cache-bytes" in text and "65,536" in text
    assert planner.plan_to_dict(p)["tiers"][1]["blocks"] == 511
    with pytest.raises(ValueError, match="--kv-disk-cache-bytes='1G'.*host"):
        planner.plan(llama, max_model_len=8192, disk_bytes="1G")
