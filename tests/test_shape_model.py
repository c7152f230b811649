"""Tests for ``kvmem shape-model`` (``vllm_kvmem.shape_model``): published
architectures' configs with the project tokenizer and no weights. No engine:
the planner's agreement with vLLM on these shapes is in
tests/test_planner_agreement.py."""

from __future__ import annotations

import json
import pathlib

import pytest

from vllm_kvmem import planner
from vllm_kvmem.cli import main
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.shape_model import (
    CATALOG,
    SHAPE_FILE,
    TOKENIZER_VOCAB,
    build_shape_model,
    shape_config,
    shape_info,
)
from vllm_kvmem.tiny_model import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID

# name: (transformers config class, layers, KV heads, head size, vocab, tied,
# parameters as published (the checkpoints' safetensors totals))
PUBLISHED = {
    "smollm2-135m": ("LlamaConfig", 30, 3, 64, 49152, True, 134_515_008),
    "qwen2.5-0.5b": ("Qwen2Config", 24, 2, 64, 151936, True, 494_032_768),
    "llama-3.1-8b": ("LlamaConfig", 32, 8, 128, 128256, False, 8_030_261_248),
    "llama-3.1-70b": ("LlamaConfig", 80, 8, 128, 128256, False, 70_553_706_496),
    "qwen2.5-72b": ("Qwen2Config", 80, 8, 128, 152064, False, 72_706_203_648),
    "qwen2.5-7b": ("Qwen2Config", 28, 4, 128, 152064, False, 7_615_616_512),
    "gemma-3-1b": ("Gemma3TextConfig", 26, 1, 256, 262144, True, 999_885_952),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", 48, 4, 128, 151936, False, 30_532_122_624),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Every catalog shape at its published depth (a second or so in all)."""
    root = tmp_path_factory.mktemp("shapes")
    return {name: build_shape_model(name, root / name) for name in CATALOG}


def test_catalog_is_the_published_shapes() -> None:
    assert set(CATALOG) == set(PUBLISHED)
    for shape in CATALOG.values():
        assert "/" in shape.source and shape.config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("name", PUBLISHED)
def test_config_loads_as_the_architectures_class(shapes, name: str) -> None:
    from transformers import AutoConfig

    cls, layers, kv_heads, head_dim, vocab, tied, _ = PUBLISHED[name]
    cfg = AutoConfig.from_pretrained(shapes[name])
    assert type(cfg).__name__ == cls
    assert cfg.architectures == list(CATALOG[name].config["architectures"])
    assert cfg.num_hidden_layers == layers
    assert cfg.num_key_value_heads == kv_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head == head_dim
    assert cfg.vocab_size == vocab
    assert cfg.tie_word_embeddings is tied
    assert str(cfg.dtype) == "torch.bfloat16"
    # Token ids are the project tokenizer's, not the published ones.
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 3)


def test_published_details_survive_transformers(shapes) -> None:
    from transformers import AutoConfig

    llama = AutoConfig.from_pretrained(shapes["llama-3.1-8b"])
    assert llama.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama.max_position_embeddings == 131072
    gemma = AutoConfig.from_pretrained(shapes["gemma-3-1b"])
    assert gemma.sliding_window == 512 and gemma.query_pre_attn_scalar == 256
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1000000
    full = [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23]
    moe = AutoConfig.from_pretrained(shapes["qwen3-30b-a3b"])
    assert (moe.num_experts, moe.num_experts_per_tok) == (128, 8)
    assert moe.moe_intermediate_size == 768 and moe.norm_topk_prob is True
    qwen = AutoConfig.from_pretrained(shapes["qwen2.5-0.5b"])
    assert (
        qwen.use_sliding_window is False and qwen.rope_parameters["rope_theta"] == 1e6
    )


@pytest.mark.parametrize("name", PUBLISHED)
def test_no_weights_and_a_tokenizer_that_fits(shapes, name: str) -> None:
    from tokenizers import Tokenizer

    out = shapes[name]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            SHAPE_FILE,
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert tok.get_vocab_size() == TOKENIZER_VOCAB < vocab
    assert max(tok.encode("The KV cache of a café, 42 times.").ids) < vocab
    for token, token_id in ((BOS, BOS_ID), (EOS, EOS_ID), (PAD, PAD_ID)):
        assert tok.token_to_id(token) == token_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    meta = json.loads((out / SHAPE_FILE).read_text())
    assert meta["source"] == CATALOG[name].source


def test_num_layers_truncates_depth_only(tmp_path: pathlib.Path) -> None:
    from transformers import AutoConfig

    full = shape_config("llama-3.1-8b")
    two = shape_config("llama-3.1-8b", num_layers=2)
    assert two.pop("num_hidden_layers") == 2 and full.pop("num_hidden_layers") == 32
    assert two == full
    gemma = build_shape_model("gemma-3-1b", tmp_path / "g", num_layers=8)
    cfg = AutoConfig.from_pretrained(gemma)
    published = CATALOG["gemma-3-1b"].config["layer_types"]
    assert cfg.num_hidden_layers == 8 and cfg.layer_types == published[:8]
    assert json.loads((gemma / SHAPE_FILE).read_text())["published_num_layers"] == 26
    assert shape_config("qwen2.5-0.5b", dtype="float16")["torch_dtype"] == "float16"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="llama-8b"), r"NAME='llama-8b' is not in the shape catalog; "
         r"use one of smollm2-135m, qwen2.5-0.5b, llama-3.1-8b, llama-3.1-70b, "
         r"qwen2.5-72b, qwen2.5-7b, gemma-3-1b, qwen3-30b-a3b"),
        (dict(num_layers=0), r"--num-layers=0: llama-3.1-8b has 32 layers; "
         r"use 1 to 32"),
        (dict(num_layers=33), r"--num-layers=33: .* use 1 to 32"),
        (dict(num_layers=True), r"--num-layers=True"),
        (dict(num_layers="2"), r"--num-layers='2'"),
        (dict(dtype="fp8"), r"--dtype='fp8': use one of bfloat16, float16, float32"),
    ],
)  # fmt: skip
def test_bad_input_names_the_flag(tmp_path: pathlib.Path, kwargs, match) -> None:
    name = kwargs.pop("name", "llama-3.1-8b")
    with pytest.raises(ValueError, match=match):
        build_shape_model(name, tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli(tmp_path: pathlib.Path, capsys) -> None:
    assert main(["shape-model", "--list"]) == 0
    listing = capsys.readouterr().out
    assert main(["shape-model"]) == 0
    assert capsys.readouterr().out == listing
    for name in CATALOG:
        assert name in listing and CATALOG[name].source in listing
    assert "131,072" in listing and "22 sliding (512) + 4 full" in listing
    assert "30.53B" in listing and "8.03B" in listing

    out = tmp_path / "moe"
    assert main(["shape-model", "qwen3-30b-a3b", str(out), "--num-layers", "2"]) == 0
    said = capsys.readouterr().out
    assert "2 layers of 48" in said and "KV 4,096 B/token" in said
    assert "--load-format dummy" in said
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2

    assert main(["shape-model", "qwen3-30b", str(tmp_path / "x")]) == 2
    assert "NAME='qwen3-30b'" in capsys.readouterr().err
    assert (
        main(["shape-model", "gemma-3-1b", str(tmp_path / "x"), "--num-layers", "-1"])
        == 2
    )
    assert "--num-layers=-1" in capsys.readouterr().err
    assert main(["shape-model", "gemma-3-1b"]) == 2
    assert "OUTDIR missing" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# Hand computation: layers x (K, V) x KV heads x head size x 2 bytes (bf16).
KV_BYTES_PER_TOKEN = {
    "smollm2-135m": 30 * 2 * 3 * 64 * 2,  # 23,040
    "qwen2.5-0.5b": 24 * 2 * 2 * 64 * 2,  # 12,288
    "llama-3.1-8b": 32 * 2 * 8 * 128 * 2,  # 131,072
    "llama-3.1-70b": 80 * 2 * 8 * 128 * 2,  # 327,680
    "qwen2.5-72b": 80 * 2 * 8 * 128 * 2,  # 327,680
    "qwen2.5-7b": 28 * 2 * 4 * 128 * 2,  # 57,344
    "gemma-3-1b": 26 * 2 * 1 * 256 * 2,  # 26,624
    "qwen3-30b-a3b": 48 * 2 * 4 * 128 * 2,  # 98,304
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_planner_kv_bytes_per_token_by_hand(shapes, name: str) -> None:
    cap = planner.plan_capacity(
        shapes[name], budget_bytes="4G", max_model_len=4096, platform="cpu"
    )
    assert cap.stages[0].kv_bytes_per_token == KV_BYTES_PER_TOKEN[name]
    # Two layers keep each layer's geometry: 2/N of the bytes.
    two = shape_info(name, num_layers=2)
    layers = PUBLISHED[name][1]
    assert sum(x.bytes_per_token() for x in two.layers()) * layers == (
        2 * KV_BYTES_PER_TOKEN[name]
    )


@pytest.mark.parametrize("name", PUBLISHED)
def test_planner_estimates_the_published_parameter_count(shapes, name: str) -> None:
    """No safetensors: weights from config.json, which must count tied
    embeddings once, every MoE expert and Gemma's 256-wide heads."""
    info = planner.load_model(shapes[name])
    assert not info.weights.exact and "config.json" in info.weights.source
    assert info.weights.total == 2 * PUBLISHED[name][6]
    assert info.weights.tied is PUBLISHED[name][5]


def test_gemma3_is_a_hybrid_for_the_planner(shapes, tmp_path: pathlib.Path) -> None:
    info = planner.load_model(shapes["gemma-3-1b"])
    assert info.architecture == "Gemma3ForCausalLM" and info.sliding_window == 512
    kinds = [k is km.LayerKind.SLIDING for k in info.layer_kinds]
    assert kinds.count(False) == 4 and kinds.count(True) == 22
    groups = km.kv_cache_groups(info.layers())
    # 22 sliding layers in groups of 4 (the 4 full layers' bucket): 6 + 1.
    assert len(groups) == 7 and max(len(g.layers) for g in groups) == 4
    # A hub config without layer_types: the planner derives them as
    # transformers does, from sliding_window_pattern.
    cfg = shape_config("gemma-3-1b")
    del cfg["layer_types"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(cfg))
    assert planner.load_model(bare).layer_kinds == info.layer_kinds


def test_demo_table_compares_planner_and_engine(shapes) -> None:
    from vllm_kvmem.demo import SHAPE_BUDGET, SHAPE_MAX_LEN, format_shape_table

    cap = planner.plan_capacity(
        shapes["qwen2.5-0.5b"],
        budget_bytes=SHAPE_BUDGET,
        max_model_len=SHAPE_MAX_LEN,
        platform="cpu",
    )
    # What the engine allocated in tests/test_planner_agreement.py.
    rank = dict(
        layers=24, num_blocks=42, kv_bytes=66_060_288, tokens=5376, concurrency=2.625
    )
    table = format_shape_table("qwen2.5-0.5b", rank, cap)
    assert "12,288 KV bytes/token" in table and "66,060,288" in table
    assert table.endswith("planner and engine agree: True")
    table = format_shape_table("qwen2.5-0.5b", dict(rank, num_blocks=41), cap)
    assert table.endswith("planner and engine agree: False")
