"""Real architectures' shapes as model folders, with no weights to download.

vLLM's ``load_format="dummy"`` (``--load-format dummy``) builds a model from
``config.json`` alone and fills its weights with random values in memory. A
folder holding a published architecture's config.json and a tokenizer whose
ids fit its vocabulary therefore serves at that architecture's real cost and
KV geometry, offline. ``kvmem shape-model NAME OUTDIR`` writes such a folder
from the catalog below (each entry's values copied from the source model's
published config.json), with the project's locally trained tokenizer
(:mod:`vllm_kvmem.tiny_model`) and ``generation_config.json``, and no
weight files.

``--num-layers N`` keeps every per-layer dimension and cuts the depth to the
first N layers (a ``layer_types`` pattern to its first N entries), so that
an 8B or MoE shape's per-layer KV geometry runs in a CPU engine with 2
layers.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvmem.tiny_model import (
    BOS_ID,
    DTYPES,
    EOS_ID,
    PAD_ID,
    dump_json,
    write_generation_config,
    write_tokenizer,
)

#: The project tokenizer's size: ids 0..2047, below every catalog vocabulary.
#: Generated ids beyond it decode to nothing (tokenizers' DecodeStream).
TOKENIZER_VOCAB = 2048

#: The provenance file written beside config.json (vLLM ignores it).
SHAPE_FILE = "kvmem-shape.json"

#: config.json keys set to the project tokenizer's ids: the published ids
#: (e.g. Qwen's 151643) do not exist in a 2048-token tokenizer.
TOKEN_ID_KEYS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


@dataclass(frozen=True)
class Shape:
    """One catalog entry: a published config.json, less ``transformers_version``.

    ``source`` is the Hugging Face model id the values were copied from;
    ``role`` says what the shape exercises.
    """

    name: str
    source: str
    role: str
    config: Mapping[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def _gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    """transformers' Gemma3TextConfig rule: every ``pattern``-th layer is full."""
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(num_layers)
    ]


_SHAPES = [
    Shape(
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M",
        "small Llama: 3 KV heads of 64, 30 layers, tied embeddings",
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "hidden_act": "silu",
            "hidden_size": 576,
            "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536,
            "is_llama_config": True,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_interleaved": False,
            "rope_scaling": None,
            "rope_theta": 100000,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 49152,
        },
    ),
    Shape(
        "qwen2.5-0.5b",
        "Qwen/Qwen2.5-0.5B",
        "small Qwen2: 2 KV heads of 64, 24 layers, q/k/v biases, tied",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 896,
            "initializer_range": 0.02,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
    Shape(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        "the common 8B: 8 KV heads of 128, 32 layers, llama3 RoPE scaling",
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 128256,
        },
    ),
    Shape(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        "the common 70B: 8 KV heads of 128, 80 layers; planning only (no engine "
        "start here: config.json for kvmem plan and --load-format dummy on GPUs)",
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 8192,
            "initializer_range": 0.02,
            "intermediate_size": 28672,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 128256,
        },
    ),
    Shape(
        "qwen2.5-72b",
        "Qwen/Qwen2.5-72B",
        "Qwen2 72B: 8 KV heads of 128, 80 layers, q/k/v biases; planning only",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 8192,
            "initializer_range": 0.02,
            "intermediate_size": 29568,
            "max_position_embeddings": 131072,
            "max_window_layers": 80,
            "model_type": "qwen2",
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 152064,
        },
    ),
    Shape(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B",
        "Qwen2 7B: 4 KV heads of 128, 28 layers, untied embeddings",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 3584,
            "initializer_range": 0.02,
            "intermediate_size": 18944,
            "max_position_embeddings": 131072,
            "max_window_layers": 28,
            "model_type": "qwen2",
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
            "vocab_size": 152064,
        },
    ),
    Shape(
        "gemma-3-1b",
        "google/gemma-3-1b-pt",
        "the hybrid: 512-token sliding window on 5 of every 6 layers, 1 KV "
        "head of 256, so vLLM forms several KV cache groups",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "bos_token_id": 2,
            "cache_implementation": "hybrid",
            "eos_token_id": 1,
            "final_logit_softcapping": None,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "initializer_range": 0.02,
            "intermediate_size": 6912,
            # The published file carries only sliding_window_pattern; the
            # per-layer kinds transformers derives from it are written out.
            "layer_types": _gemma3_layer_types(26, 6),
            "max_position_embeddings": 32768,
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "pad_token_id": 0,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            # Gemma3TextConfig's default, written out: the planner reads it.
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 262144,
        },
    ),
    Shape(
        "qwen3-30b-a3b",
        "Qwen/Qwen3-30B-A3B",
        "the MoE: 128 experts (8 per token) on every layer, 4 KV heads of 128, "
        "48 layers",
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
]

#: The catalog, by name.
CATALOG: dict[str, Shape] = {s.name: s for s in _SHAPES}


def get_shape(name: str, flag: str = "NAME") -> Shape:
    """The catalog entry ``name``; a ``ValueError`` naming ``flag`` and
    listing the names if none."""
    if name not in CATALOG:
        raise ValueError(
            f"{flag}={name!r} is not in the shape catalog; use one of "
            f"{', '.join(CATALOG)} (`kvmem shape-model --list` shows them)"
        )
    return CATALOG[name]


def shape_config(
    name: str, num_layers: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The config.json content: the published values, depth cut to
    ``num_layers``, ``torch_dtype`` set to ``dtype``, token ids set to the
    project tokenizer's."""
    shape = get_shape(name)
    config = {k: _copy(v) for k, v in shape.config.items()}
    if num_layers is not None:
        _check_num_layers(shape, num_layers)
        config["num_hidden_layers"] = num_layers
        if config.get("layer_types") is not None:
            config["layer_types"] = config["layer_types"][:num_layers]
        if config.get("mlp_only_layers"):
            config["mlp_only_layers"] = [
                i for i in config["mlp_only_layers"] if i < num_layers
            ]
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype={dtype!r}: use one of {', '.join(DTYPES)}")
        config["torch_dtype"] = dtype
    config.update(TOKEN_ID_KEYS)
    return config


def _copy(value: Any) -> Any:
    return (
        list(value)
        if isinstance(value, list)
        else (dict(value) if isinstance(value, dict) else value)
    )


def _check_num_layers(shape: Shape, num_layers: Any) -> None:
    full = shape.num_layers
    if (
        isinstance(num_layers, bool)
        or not isinstance(num_layers, int)
        or not 1 <= num_layers <= full
    ):
        raise ValueError(
            f"--num-layers={num_layers!r}: {shape.name} has {full} layers; use 1 "
            f"to {full} (keeps the first N layers, every per-layer dimension as "
            "published), or leave it out for the published depth"
        )


def shape_info(
    name: str, num_layers: int | None = None, dtype: str | None = None
) -> Any:
    """The planner's :class:`~vllm_kvmem.planner.model.ModelInfo` of a shape,
    without writing a folder (weights estimated from the config)."""
    from vllm_kvmem.planner.model import model_from_config

    config = shape_config(name, num_layers, dtype)
    return model_from_config(config, f"<shape {name}>")


def kv_bytes_per_token(info: Any, kv_cache_dtype: str = "auto") -> int:
    """K and V bytes one token costs over all layers (one rank, no TP)."""
    return sum(layer.bytes_per_token() for layer in info.layers(kv_cache_dtype))


def build_shape_model(
    name: str,
    outdir: str | os.PathLike[str],
    *,
    num_layers: int | None = None,
    dtype: str | None = None,
) -> pathlib.Path:
    """Write the model folder (config, tokenizer, generation config, no
    weights) and return its path; serve it with ``load_format="dummy"``.

    Raises ``ValueError`` naming NAME, ``--num-layers`` or ``--dtype`` on bad
    input, before anything is written.
    """
    shape = get_shape(name)
    config = shape_config(name, num_layers, dtype)
    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    dump_json(out / "config.json", config)
    write_generation_config(out)
    write_tokenizer(out, TOKENIZER_VOCAB, int(config["max_position_embeddings"]))
    dump_json(
        out / SHAPE_FILE,
        {
            "name": shape.name,
            "source": shape.source,
            "num_layers": config["num_hidden_layers"],
            "published_num_layers": shape.num_layers,
            "torch_dtype": config["torch_dtype"],
            "replaced": {
                key: {"published": shape.config.get(key), "written": value}
                for key, value in TOKEN_ID_KEYS.items()
            },
            "weights": 'none: serve with load_format="dummy" (--load-format dummy)',
        },
    )
    return out


# -------------------------------------------------------------------- CLI


def _params(info: Any) -> str:
    from vllm_kvmem.planner import kv_math as km

    n = info.weights.total / km.DTYPE_BYTES[info.dtype]
    return f"{n / 1e9:.2f}B" if n >= 999.5e6 else f"{n / 1e6:.0f}M"


def _kinds(info: Any) -> str:
    from vllm_kvmem.planner import kv_math as km

    sliding = sum(k is km.LayerKind.SLIDING for k in info.layer_kinds)
    if not sliding:
        return "full"
    return (
        f"{sliding} sliding ({info.sliding_window}) + {info.num_layers - sliding} full"
    )


def format_catalog() -> str:
    """The catalog as a table: parameters (estimated from the config),
    layers, KV heads x head size, attention kinds and KV bytes per token."""
    from vllm_kvmem.core.table import render_table

    rows, kinds = [], ["attention"]
    for name, shape in CATALOG.items():
        info = shape_info(name)
        rows.append(
            [
                name,
                shape.source,
                shape.config["architectures"][0],
                _params(info),
                info.num_layers,
                f"{info.num_kv_heads} x {info.head_dim}",
                f"{kv_bytes_per_token(info):,}",
            ]
        )
        kinds.append(_kinds(info))
    table = render_table(
        ["name", "source", "architecture", "params", "layers", "KV heads"]
        + ["KV B/token"],
        rows,
        left=3,
    )
    lines = [f"{line}  {kind}" for line, kind in zip(table, kinds, strict=True)]
    return "\n".join(
        [
            *lines,
            "params: estimated from config.json; KV B/token: K and V of every "
            "layer in the config's dtype (bfloat16), one rank (sliding layers "
            "keep at most their window of tokens).",
            "Build: kvmem shape-model NAME OUTDIR [--num-layers N]; serve it with "
            "--load-format dummy.",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help=f"catalog shape: {', '.join(CATALOG)} (leave out to list them)",
    )
    parser.add_argument(
        "outdir", nargs="?", metavar="OUTDIR", help="directory to write the model into"
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="keep only the first N decoder layers (a layer_types pattern: its "
        "first N entries) and every per-layer dimension as published, so an 8B "
        "or MoE shape's per-layer KV geometry runs in a CPU engine with e.g. 2 "
        "layers (default: the published depth)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="torch_dtype written into config.json (default: the published one, "
        "bfloat16 for every shape)",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the catalog and exit"
    )


def run(args: argparse.Namespace) -> int:
    """Print the catalog, or build one shape and print a one-line summary."""
    if args.list or args.name is None:
        print(format_catalog())
        return 0
    get_shape(args.name)
    if args.outdir is None:
        raise ValueError(
            f"OUTDIR missing: kvmem shape-model {args.name} OUTDIR writes the "
            "model folder there"
        )
    info = shape_info(args.name, args.num_layers, args.dtype)
    out = build_shape_model(
        args.name, args.outdir, num_layers=args.num_layers, dtype=args.dtype
    )
    shape = CATALOG[args.name]
    depth = f"{info.num_layers} layers"
    if info.num_layers != shape.num_layers:
        depth += f" of {shape.num_layers}"
    print(
        f"wrote {out}: {args.name} ({shape.source}), {info.architecture}, {depth}, "
        f"~{_params(info)} params ({info.dtype}), KV "
        f"{kv_bytes_per_token(info):,} B/token; no weights: serve it with "
        '--load-format dummy (LLM(..., load_format="dummy"))'
    )
    return 0
