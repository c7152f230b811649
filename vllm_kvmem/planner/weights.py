"""Weight bytes per decoder layer, from safetensors headers or config.json.

Only the headers are read, never tensor data, so that header-only files (and
``kvmem plan`` on a laptop) work; the heterogeneous-pipeline search needs
these bytes to know what memory each stage has left for KV.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vllm_kvmem.planner import kv_math as km

_SAFETENSORS_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SAFETENSORS_BYTES = {
    **_SAFETENSORS_FLOATS,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightInfo:
    """Weight bytes as vLLM loads them: per decoder layer, and the rest.

    ``embed`` sits on the first stage; ``lm_head`` and ``final_norm`` on the
    last. With tied embeddings and a pipeline, the last stage holds its own
    copy of the embedding for the lm_head (``lm_head`` is then 0, ``tied``).
    ``skipped``: tensors vLLM does not load by default (e.g. MTP layers).
    """

    per_layer: tuple[int, ...]
    embed: int
    lm_head: int
    final_norm: int
    other: int
    skipped: int
    tied: bool
    source: str
    exact: bool

    @property
    def total(self) -> int:
        return (
            sum(self.per_layer)
            + self.embed
            + self.lm_head
            + self.final_norm
            + self.other
        )

    def stage_fixed_bytes(self, pp: int) -> tuple[int, int]:
        """Bytes outside the decoder layers on the first and on the last stage."""
        head = self.lm_head or (self.embed if self.tied and pp > 1 else 0)
        return self.embed + self.other, head + self.final_norm


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8-byte little-endian length + JSON.

    Only the header is read, never the tensor data, so header-only files work.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than 8 bytes")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 2**20:
                raise ValueError(f"header length {size} is implausible")
            header = json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}); replace it or remove "
            "it so the planner estimates weights from config.json"
        ) from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _tensor_bytes(entry: dict[str, Any], model_dtype_bytes: int | None) -> int:
    """Bytes vLLM holds for one tensor: unquantized floats in the model dtype."""
    numel = math.prod(entry.get("shape") or [])
    dtype = entry.get("dtype", "")
    if model_dtype_bytes is not None and dtype in _SAFETENSORS_FLOATS:
        return numel * model_dtype_bytes
    start, end = (entry.get("data_offsets") or [0, 0])[:2]
    return end - start if end > start else numel * _SAFETENSORS_BYTES.get(dtype, 1)


def _classify(name: str, n: int) -> str | int:
    """Layer index, or where a non-layer tensor lives."""
    if m := _LAYER_RE.search(name):
        idx = int(m.group(1))
        return idx if idx < n else "skipped"
    if "embed_tokens" in name or name.endswith("wte.weight"):
        return "embed"
    if name.startswith("lm_head") or ".lm_head." in name:
        return "lm_head"
    if re.search(r"(^|\.)(model\.)?norm\.", name) and "layers" not in name:
        return "final_norm"
    return "other"


class ModelShape(Protocol):
    """The shape of a model that its weight bytes follow: what
    ``model.ModelInfo`` hands :func:`read_weights` (a protocol, because
    ``model`` imports this module)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def mla_dims(self) -> tuple[int, int] | None: ...


def read_weights(path: Path, cfg: dict[str, Any], info: ModelShape) -> WeightInfo:
    """Weight bytes per layer from safetensors headers, else an estimate."""
    n = info.num_layers
    quantized = "quantization_config" in cfg
    dtype_bytes = None if quantized else km.DTYPE_BYTES[info.dtype]
    tied = bool(cfg.get("tie_word_embeddings", False))
    files, index = _weight_files(path)
    if files is not None:
        sums: dict[str | int, int] = {}
        for f in files:
            for name, entry in read_safetensors_header(f).items():
                key = _classify(name, n)
                sums[key] = sums.get(key, 0) + _tensor_bytes(entry, dtype_bytes)
        return WeightInfo(
            per_layer=tuple(sums.get(i, 0) for i in range(n)),
            embed=sums.get("embed", 0),
            lm_head=sums.get("lm_head", 0),
            final_norm=sums.get("final_norm", 0),
            other=sums.get("other", 0),
            skipped=sums.get("skipped", 0),
            tied=tied and not sums.get("lm_head"),
            source=f"safetensors headers ({len(files)} file{'s' * (len(files) > 1)})",
            exact=True,
        )
    return _estimate_weights(cfg, info, index, tied)


def _weight_files(path: Path) -> tuple[list[Path] | None, dict[str, Any] | None]:
    """Safetensors files to read, or ``None`` and the index when shards are absent."""
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(
                f"{index_path} is not a safetensors index ({e}); it needs a "
                '"weight_map" object of tensor name -> file'
            ) from e
        shards = [path / name for name in names]
        if shards and all(p.is_file() for p in shards):
            return shards, index
        return None, index
    found = sorted(path.glob("*.safetensors"))
    return (found or None), None


def _estimate_weights(
    cfg: dict[str, Any], info: ModelShape, index: dict[str, Any] | None, tied: bool
) -> WeightInfo:
    """Per-layer weights when the safetensors shards are not in the directory.

    With an index, its ``metadata.total_size`` less the embeddings is spread
    evenly over the layers; without one (a config-only folder, such as
    ``kvmem shape-model`` writes for ``--load-format dummy``), each layer is
    sized from config.json (:func:`_layer_params`). MLA models without
    shards: unknown (zeros).
    """
    n, h = info.num_layers, info.hidden_size
    nbytes = km.DTYPE_BYTES[info.dtype]
    vocab = int(cfg.get("vocab_size") or 0)
    embed = vocab * h * nbytes
    head = 0 if tied else embed
    norm = h * nbytes
    total = ((index or {}).get("metadata") or {}).get("total_size")
    if isinstance(total, int) and total > 0:
        per = max(0, total - embed - head - norm) // n
        how = "index metadata.total_size spread evenly over layers (shards absent)"
        return _even(n, per, embed, head, norm, tied, how)
    if info.mla_dims or cfg.get("n_routed_experts"):
        return _even(n, 0, 0, 0, 0, tied, "unknown (no safetensors found)")
    per_layer = tuple(_layer_params(cfg, info, i) * nbytes for i in range(n))
    how = "config.json shapes (estimate, no safetensors found)"
    return WeightInfo(per_layer, embed, head, norm, 0, 0, tied, how, False)


def _layer_params(cfg: dict[str, Any], info: ModelShape, i: int) -> int:
    """Parameters of decoder layer ``i`` from config.json (vLLM's tensors).

    Attention: q/k/v/o projections from the heads and ``head_dim`` (Gemma's
    ``heads x head_dim`` differs from the width), their biases (Qwen2's q/k/v,
    ``attention_bias``), per-head q/k norms (Qwen3, Gemma 3). MLP: a gated
    dense MLP of ``intermediate_size``, or on MoE layers (Qwen2/Qwen3 MoE:
    ``decoder_sparse_step``, ``mlp_only_layers``) ``num_experts`` experts of
    ``moe_intermediate_size``, the router, and Qwen2-MoE's shared expert.
    RMSNorm scales: two per layer, four for Gemma 2/3.
    """
    h, head_dim = info.hidden_size, info.head_dim
    model_type = str(cfg.get("model_type", ""))
    q = info.num_attention_heads * head_dim
    kv = info.num_kv_heads * head_dim
    params = 2 * h * q + 2 * h * kv
    if cfg.get("attention_bias"):
        params += q + 2 * kv + h
    elif model_type.startswith("qwen2"):
        params += q + 2 * kv  # Qwen2 (and Qwen2-MoE) have q/k/v biases
    if model_type.startswith(("qwen3", "gemma3")):
        params += 2 * head_dim
    params += (4 if model_type.startswith(("gemma2", "gemma3")) else 2) * h
    experts = int(cfg.get("num_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    sparse = (
        experts > 0
        and i not in (cfg.get("mlp_only_layers") or [])
        and (i + 1) % step == 0
    )
    if not sparse:
        return params + 3 * h * int(cfg.get("intermediate_size") or 0)
    moe = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    params += experts * 3 * h * moe + h * experts
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared:
        params += 3 * h * shared + h  # the shared expert and its gate
    return params


def _even(
    n: int, per: int, embed: int, head: int, norm: int, tied: bool, source: str
) -> WeightInfo:
    """An estimate: the same bytes for each of ``n`` layers."""
    return WeightInfo((per,) * n, embed, head, norm, 0, 0, tied, source, False)
