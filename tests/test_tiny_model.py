"""Tests for the offline tiny-model builder (``vllm_kvmem.tiny_model``)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from vllm_kvmem import tiny_model
from vllm_kvmem.tiny_model import (
    DEFAULTS,
    TinyModelOptions,
    add_arguments,
    build_tiny_model,
    run,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
SMALL = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}


def digests(path: pathlib.Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
    }


def test_every_option_is_a_flag_and_a_checked_keyword(tmp_path: pathlib.Path) -> None:
    """The options are declared once; each is a CLI flag with that default, and
    a misspelt keyword is an error rather than silently ignored."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for f in dataclasses.fields(TinyModelOptions):
        action = parser._option_string_actions[TinyModelOptions.flag(f.name)]
        assert (action.dest, action.default) == (f.name, f.default)
    with pytest.raises(TypeError, match="num_layer"):
        build_tiny_model(tmp_path / "m", num_layer=2)
    assert not (tmp_path / "m").exists()


def test_build_is_byte_identical(tmp_path: pathlib.Path) -> None:
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert set(digests(a)) == FILES
    assert digests(a) == digests(b)


def test_seed_changes_only_the_weights(tmp_path: pathlib.Path) -> None:
    a = digests(build_tiny_model(tmp_path / "a", **SMALL, seed=0))
    b = digests(build_tiny_model(tmp_path / "b", **SMALL, seed=1))
    assert a["model.safetensors"] != b["model.safetensors"]
    del a["model.safetensors"], b["model.safetensors"]
    assert a == b


def test_same_bytes_in_a_fresh_single_threaded_process(tmp_path: pathlib.Path) -> None:
    """Tokenizer training and RNG must not depend on thread count or process."""
    here = build_tiny_model(tmp_path / "here", **SMALL)
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    code = (
        "import sys; from vllm_kvmem.tiny_model import build_tiny_model; "
        f"build_tiny_model(sys.argv[1], **{SMALL!r})"
    )
    there = tmp_path / "there"
    subprocess.run([sys.executable, "-c", code, str(there)], env=env, check=True)
    assert digests(here) == digests(there)


def test_config_is_what_transformers_would_build(tmp_path: pathlib.Path) -> None:
    from transformers import AutoConfig, LlamaConfig

    out = build_tiny_model(tmp_path / "m", **SMALL, head_dim=32, dtype="float16")
    loaded = AutoConfig.from_pretrained(out)
    assert type(loaded) is LlamaConfig
    reference = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="float16",
    ).to_dict()
    got = loaded.to_dict()
    for key in set(reference) - {"transformers_version", "_name_or_path"}:
        assert got[key] == reference[key], key
    raw = json.loads((out / "config.json").read_text())
    assert raw["torch_dtype"] == raw["dtype"] == "float16"
    assert raw["tie_word_embeddings"] is False


def test_sliding_window_writes_a_mistral_config(tmp_path: pathlib.Path) -> None:
    from transformers import AutoConfig, MistralConfig

    out = build_tiny_model(tmp_path / "m", **SMALL, sliding_window=64)
    loaded = AutoConfig.from_pretrained(out)
    assert type(loaded) is MistralConfig
    assert loaded.architectures == ["MistralForCausalLM"]
    assert loaded.sliding_window == 64
    # No layer_types: vLLM then applies the window to every layer.
    assert getattr(loaded, "layer_types", None) is None


def test_sliding_window_pattern_writes_interleaved_layers(tmp_path: pathlib.Path):
    """Every Nth layer full attention, the others sliding: transformers reads
    a Ministral config with per-layer types, vLLM serves it as Mistral with
    each layer's window from layer_types (tests/test_host_tier_engine.py)."""
    from transformers import AutoConfig, MinistralConfig

    out = build_tiny_model(
        tmp_path / "m", **{**SMALL, "num_layers": 6}, sliding_window=64,
        sliding_window_pattern=3,
    )  # fmt: skip
    loaded = AutoConfig.from_pretrained(out)
    assert type(loaded) is MinistralConfig
    assert loaded.architectures == ["MistralForCausalLM"]
    assert loaded.sliding_window == 64
    slide, full = "sliding_attention", "full_attention"
    assert loaded.layer_types == [slide, slide, full, slide, slide, full]
    # Same tensors as without the pattern: only config.json differs.
    plain = build_tiny_model(
        tmp_path / "p", **{**SMALL, "num_layers": 6}, sliding_window=64
    )
    a, b = digests(out), digests(plain)
    assert a.pop("config.json") != b.pop("config.json") and a == b


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": "float32", "num_kv_heads": 4, "head_dim": 32},
        {
            "dtype": "float16",
            "num_layers": 3,
            "hidden_size": 96,
            "num_heads": 6,
            "num_kv_heads": 1,
            "head_dim": 80,
            "vocab_size": 300,
            "intermediate_size": 200,
        },
    ],
)
def test_weights_match_options(tmp_path: pathlib.Path, options: dict) -> None:
    import torch
    from safetensors import safe_open

    o = {**DEFAULTS, **options}
    inter = o["intermediate_size"] or 2 * o["hidden_size"]
    h, q, kv = o["hidden_size"], o["num_heads"] * o["head_dim"], o["num_kv_heads"]
    kv *= o["head_dim"]
    expected = {
        "model.embed_tokens.weight": (o["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (o["vocab_size"], h),
    }
    for i in range(o["num_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    out = build_tiny_model(tmp_path / "m", **options)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected)
        for name, shape in expected.items():
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == shape, name
            assert tensor.dtype == getattr(torch, o["dtype"]), name
            if len(shape) == 1:
                assert torch.all(tensor == 1), name
        std = f.get_tensor("model.embed_tokens.weight").float().std().item()
        assert 0.018 < std < 0.022
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == o["num_layers"]
    assert config["intermediate_size"] == inter
    assert config["head_dim"] == o["head_dim"]


@pytest.mark.parametrize("vocab_size", [300, 2048])
def test_tokenizer_round_trips(tmp_path: pathlib.Path, vocab_size: int) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = build_tiny_model(tmp_path / "m", **SMALL, vocab_size=vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) <= vocab_size
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.pad_token_id == 3
    text = "Hello world, the KV cache is full!\n  naïve café, 日本語 🙂 x86_64"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    if vocab_size >= 2048:  # merges were learned: common words are one token
        assert tok.tokenize("The cache") == ["The", "Ġcache"]


def test_default_tokenizer_fills_the_vocab(tmp_path: pathlib.Path) -> None:
    """Every id the model can emit decodes to text."""
    from tokenizers import Tokenizer

    out = build_tiny_model(tmp_path / "m", **SMALL)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == DEFAULTS["vocab_size"]


@pytest.mark.parametrize(
    ("options", "flag", "hint"),
    [
        ({"num_layers": 0}, "--num-layers=0", "positive"),
        ({"hidden_size": -8}, "--hidden-size=-8", "positive"),
        ({"head_dim": 0}, "--head-dim=0", "positive"),
        ({"intermediate_size": 0}, "--intermediate-size=0", "positive"),
        ({"max_position_embeddings": 0}, "--max-position-embeddings=0", "positive"),
        ({"sliding_window": 0}, "--sliding-window=0", "positive"),
        ({"num_heads": 3}, "--num-heads=3", "use one of [1, 2, 4, 8, 16, 32, 64]"),
        ({"num_kv_heads": 3}, "--num-kv-heads=3", "use one of [1, 2, 4]"),
        ({"head_dim": 63}, "--head-dim=63", "even"),
        ({"vocab_size": 100}, "--vocab-size=100", "at least 260"),
        ({"dtype": "int8"}, "--dtype='int8'", "bfloat16, float16, float32"),
        ({"seed": -1}, "--seed=-1", "[0, 2**63)"),
        (
            {"sliding_window_pattern": 2},
            "--sliding-window-pattern=2",
            "add --sliding-window",
        ),
        (
            {"sliding_window": 64, "sliding_window_pattern": 1},
            "--sliding-window-pattern=1",
            "use 2 to --num-layers=8",
        ),
        (
            {"sliding_window": 64, "sliding_window_pattern": 9},
            "--sliding-window-pattern=9",
            "use 2 to --num-layers=8",
        ),
    ],
)
def test_bad_values_name_the_flag(
    tmp_path: pathlib.Path, options: dict, flag: str, hint: str
) -> None:
    with pytest.raises(ValueError) as info:
        build_tiny_model(tmp_path / "m", **options)
    assert flag in str(info.value)
    assert hint in str(info.value)
    assert not (tmp_path / "m").exists()


def test_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args(["x"]))
    assert {k: defaults[k] for k in DEFAULTS} == DEFAULTS
    args = parser.parse_args([str(tmp_path / "m"), "--num-layers", "2", "--seed", "7"])
    assert run(args) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert str(tmp_path / "m") in line and "2 layers" in line and "MiB" in line
    bad = parser.parse_args([str(tmp_path / "n"), "--num-kv-heads", "3"])
    with pytest.raises(ValueError, match="--num-kv-heads=3"):
        run(bad)


def test_corpus_is_fixed() -> None:
    """The tokenizer corpus must not drift, or every tokenizer changes."""
    text = "\n".join(tiny_model._corpus())
    assert text.startswith("Green blue short across must 2024 x86_64 first budget!")
    assert 50_000 < len(text.encode()) < 100_000


@pytest.mark.engine
def test_vllm_serves_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    out = build_tiny_model(tmp_path / "m")
    llm = LLM(
        model=str(out),
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=512,
        enforce_eager=True,
        dtype="bfloat16",
    )
    try:
        result = llm.generate(
            ["hello world"], SamplingParams(max_tokens=8, temperature=0)
        )
        assert len(result[0].outputs[0].token_ids) == 8
    finally:
        del llm
