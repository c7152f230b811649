"""A model directory as the planner sees it: its config.json and weights.

Layer shapes and kinds come from ``config.json``, decided the way vLLM's
model code decides them; weight bytes come from :mod:`.weights`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.weights import WeightInfo, read_weights

# Architectures whose KV caches the planner sizes, by the layer kinds they use.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "full attention (sliding window via layer_types)",
    "MistralForCausalLM": "full attention or sliding window",
    "Qwen2ForCausalLM": "full attention or sliding window",
    "Qwen3ForCausalLM": "full attention or sliding window",
    "Qwen2MoeForCausalLM": "full attention or sliding window",
    "Qwen3MoeForCausalLM": "full attention or sliding window",
    "Gemma3ForCausalLM": "sliding window and full attention (layer_types)",
    "DeepseekV2ForCausalLM": "MLA",
    "DeepseekV3ForCausalLM": "MLA",
}

# Architectures known to need caches the planner does not model, and why.
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "JambaForCausalLM": "Mamba layers",
    "MambaForCausalLM": "Mamba layers",
    "Mamba2ForCausalLM": "Mamba layers",
    "BambaForCausalLM": "Mamba layers",
    "FalconH1ForCausalLM": "Mamba layers",
    "NemotronHForCausalLM": "Mamba layers",
    "Zamba2ForCausalLM": "Mamba layers",
    "GraniteMoeHybridForCausalLM": "Mamba layers",
    "Qwen3NextForCausalLM": "linear-attention (Gated DeltaNet) layers",
    "MiniMaxText01ForCausalLM": "linear-attention layers",
    "MllamaForConditionalGeneration": "cross-attention layers",
    "WhisperForConditionalGeneration": "cross-attention layers",
    "Llama4ForConditionalGeneration": "chunked local attention layers",
    "DeepseekV32ForCausalLM": "a sparse-attention indexer cache",
}

NOT_SUPPORTED_NOTE = (
    "not modelled: Mamba / linear-attention state, cross attention, chunked "
    "local attention, sparse-MLA indexer caches, sub-byte KV dtypes"
)


@dataclass(frozen=True)
class ModelInfo:
    """What the planner knows about a model directory."""

    path: str
    architecture: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    config_dtype: str | None
    dtype: str  # what vLLM runs it in
    max_position_embeddings: int | None
    sliding_window: int | None
    layer_kinds: tuple[km.LayerKind, ...]
    mla_dims: tuple[int, int] | None  # kv_lora_rank, qk_rope_head_dim
    weights: WeightInfo

    def layers(self, kv_cache_dtype: str = "auto") -> list[km.LayerKV]:
        """Each layer's KV spec for a ``--kv-cache-dtype``."""
        if kv_cache_dtype == "fp8_ds_mla" and not self.mla_dims:
            raise ValueError(
                "--kv-cache-dtype fp8_ds_mla is for MLA (DeepSeek) models only; use "
                f"one of {', '.join(km.KV_CACHE_DTYPES)}"
            )
        if self.mla_dims:
            state = km.FP8_DS_MLA_BYTES if kv_cache_dtype == "fp8_ds_mla" else None
            nbytes = 1 if state else km.kv_dtype_bytes(kv_cache_dtype, self.dtype)
            spec = km.mla(*self.mla_dims, nbytes, state_bytes=state)
            return [spec] * self.num_layers
        nbytes = km.kv_dtype_bytes(kv_cache_dtype, self.dtype)
        full = km.full_attention(self.num_kv_heads, self.head_dim, nbytes)
        out = []
        for kind in self.layer_kinds:
            if kind is km.LayerKind.SLIDING:
                assert self.sliding_window is not None
                out.append(
                    km.sliding_window(
                        self.num_kv_heads, self.head_dim, nbytes, self.sliding_window
                    )
                )
            else:
                out.append(full)
        return out


def load_model(model_dir: str | os.PathLike[str], *, dtype: str = "auto") -> ModelInfo:
    """Read ``config.json`` and the safetensors headers of a local model."""
    path = Path(model_dir)
    return model_from_config(_read_config(path), path, dtype=dtype)


def model_from_config(
    cfg: dict[str, Any], path: str | os.PathLike[str], *, dtype: str = "auto"
) -> ModelInfo:
    """A model from its config.json content; weights from the safetensors
    headers in ``path`` if it holds any, else estimated from ``cfg`` (so
    ``kvmem shape-model --list`` sizes its catalog without writing a folder).
    """
    path = Path(path)
    arch = _architecture(cfg, path)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    cfg = {**cfg, **(text or {})}
    model_type = str(cfg.get("model_type", ""))
    n = _positive_int(cfg, "num_hidden_layers", path)
    heads = _positive_int(cfg, "num_attention_heads", path)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = _positive_int(cfg, "hidden_size", path)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    config_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    run_dtype = km.resolve_model_dtype(config_dtype, dtype)
    mla_dims = _mla_dims(cfg, arch, path)
    kinds, window = _layer_kinds(cfg, model_type, n, mla_dims is not None, path)
    info = ModelInfo(
        path=str(path),
        architecture=arch,
        model_type=model_type,
        num_layers=n,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        config_dtype=config_dtype,
        dtype=run_dtype,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        sliding_window=window,
        layer_kinds=kinds,
        mla_dims=mla_dims,
        weights=WeightInfo((0,) * n, 0, 0, 0, 0, 0, False, "none", False),
    )
    return replace(info, weights=read_weights(path, cfg, info))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a directory; pass a local model directory that "
            "contains config.json (kvmem plan works offline and downloads nothing)"
        )
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"{path} has no config.json; pass a model directory with config.json "
            "and its safetensors files, e.g. a Hugging Face snapshot or one written "
            "by `kvmem tiny-model DIR`"
        )
    try:
        cfg = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config} is not valid JSON ({e}); fix or replace it") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{config} must hold a JSON object with the model config")
    return cfg


def _architecture(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else f"model_type={cfg.get('model_type')!r}"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if arch in UNSUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{arch} ({path}) is not supported: it has "
            f"{UNSUPPORTED_ARCHITECTURES[arch]}, whose cache the planner does not "
            f"model; supported: {supported}"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {arch} in {path / 'config.json'}; supported: "
            f"{supported}"
        )
    return arch


def _positive_int(cfg: dict[str, Any], key: str, path: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{path / 'config.json'}: {key}={value!r}; it must be a positive integer"
        )
    return value


def _mla_dims(cfg: dict[str, Any], arch: str, path: Path) -> tuple[int, int] | None:
    """DeepSeek-style MLA: one latent of kv_lora_rank + qk_rope_head_dim."""
    if not arch.startswith("Deepseek"):
        return None
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if not rank or not rope:
        raise ValueError(
            f"{arch} without kv_lora_rank/qk_rope_head_dim in {path / 'config.json'} "
            "(non-MLA DeepSeek attention) is not supported; the planner sizes "
            "DeepSeek models with MLA only"
        )
    return int(rank), int(rope)


def _layer_kinds(
    cfg: dict[str, Any], model_type: str, n: int, is_mla: bool, path: Path
) -> tuple[tuple[km.LayerKind, ...], int | None]:
    """Full or sliding per layer, as vLLM's model code decides it.

    Qwen2/Qwen3 configs only slide when ``use_sliding_window`` is true, and then
    on layers ``>= max_window_layers`` (transformers' Qwen configs); vLLM
    refuses Qwen models that slide on some layers only. Gemma 3 without
    ``layer_types``: its ``sliding_window_pattern``, as transformers reads it.
    Other configs: a ``layer_types`` list decides per layer, else
    ``sliding_window`` applies to every layer (vLLM copies it into the cache
    config). A window of 0 is off.
    """
    if is_mla:
        return (km.LayerKind.MLA,) * n, None
    window = cfg.get("sliding_window") or None
    layer_types = cfg.get("layer_types")
    if layer_types is None and model_type.startswith("gemma3"):
        # Hub configs of Gemma 3 carry only the pattern; transformers' config
        # derives layer_types from it (default 6: five sliding, one full).
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n)
        ]
    is_qwen = model_type.startswith(("qwen2", "qwen3"))
    if is_qwen:
        window = window if cfg.get("use_sliding_window") else None
        if layer_types is None:
            first_sliding = int(cfg.get("max_window_layers", 28))
            layer_types = [
                "sliding_attention"
                if window is not None and i >= first_sliding
                else "full_attention"
                for i in range(n)
            ]
    if not layer_types:
        kind = km.LayerKind.SLIDING if window else km.LayerKind.FULL
        return (kind,) * n, window
    if len(layer_types) != n:
        raise ValueError(
            f"{path / 'config.json'}: layer_types has {len(layer_types)} entries "
            f"but num_hidden_layers is {n}; they must match"
        )
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            why = km.UNSUPPORTED_KINDS.get(t, "the planner does not model it")
            raise ValueError(
                f"layer kind {t!r} in {path / 'config.json'} is not supported: "
                f"{why}; supported kinds: full_attention, sliding_attention, MLA"
            )
    kinds = tuple(
        km.LayerKind.SLIDING
        if t == "sliding_attention" and window
        else km.LayerKind.FULL
        for t in layer_types
    )
    if is_qwen and len(set(kinds)) > 1:
        raise ValueError(
            f"{path}: sliding window on some layers only (max_window_layers="
            f"{cfg.get('max_window_layers')}) is refused by vLLM's Qwen2/Qwen3 "
            "models; set use_sliding_window false or max_window_layers 0"
        )
    return kinds, window if km.LayerKind.SLIDING in kinds else None


def as_model(model: str | os.PathLike[str] | ModelInfo, dtype: str) -> ModelInfo:
    """A loaded model, or the one in the directory ``model``."""
    return model if isinstance(model, ModelInfo) else load_model(model, dtype=dtype)
