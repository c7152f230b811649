"""``kvmem plan``: how much KV cache a budget gives, and what a target needs.

Works offline from a local model directory: ``config.json`` for the layer
shapes and the safetensors headers (never the tensor data) for the weight
bytes per layer. The arithmetic is :mod:`vllm_kvmem.core.kv_math`, which
mirrors vLLM 0.32.0; this module reads models, assembles plans and prints them.
Nothing here imports vLLM, so tests can predict an engine's numbers cheaply:

    cap = plan_capacity(model_dir, pp=2, partition=[56, 8], budget_bytes=5 << 30,
                        max_model_len=32768, kv_cache_dtype="fp8", proportional=True)
    cap.num_blocks, cap.tokens, cap.concurrency, cap.stages[0].kv_bytes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_kvmem.core import kv_math as km
from vllm_kvmem.core.units import flag_size, gib, human_bytes

# Architectures whose KV caches the planner sizes, by the layer kinds they use.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "full attention (sliding window via layer_types)",
    "MistralForCausalLM": "full attention or sliding window",
    "Qwen2ForCausalLM": "full attention or sliding window",
    "Qwen3ForCausalLM": "full attention or sliding window",
    "Qwen2MoeForCausalLM": "full attention or sliding window",
    "Qwen3MoeForCausalLM": "full attention or sliding window",
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

PLATFORMS = ("cuda", "cpu")
DEFAULT_RESERVE = "1G"
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


# ----------------------------------------------------------------- model


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
    cfg = _read_config(path)
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
    refuses Qwen models that slide on some layers only. Other configs: a
    ``layer_types`` list decides per layer, else ``sliding_window`` applies to
    every layer (vLLM copies it into the cache config). A window of 0 is off.
    """
    if is_mla:
        return (km.LayerKind.MLA,) * n, None
    window = cfg.get("sliding_window") or None
    layer_types = cfg.get("layer_types")
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


# --------------------------------------------------------------- weights


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


def read_weights(path: Path, cfg: dict[str, Any], info: ModelInfo) -> WeightInfo:
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
    cfg: dict[str, Any], info: ModelInfo, index: dict[str, Any] | None, tied: bool
) -> WeightInfo:
    """Per-layer weights when the safetensors shards are not in the directory.

    With an index, its ``metadata.total_size`` less the embeddings is spread
    evenly over the layers; without one, a dense Llama-style layer is sized
    from config.json. MoE models without shards: unknown (zeros).
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
        return WeightInfo(
            (per,) * n,
            embed,
            head,
            norm,
            0,
            0,
            tied,
            "index metadata.total_size spread evenly over layers (shards absent)",
            False,
        )
    inter = int(cfg.get("intermediate_size") or 0)
    if cfg.get("num_experts") or cfg.get("n_routed_experts") or info.mla_dims:
        return WeightInfo(
            (0,) * n, 0, 0, 0, 0, 0, tied, "unknown (no safetensors found)", False
        )
    q = info.num_attention_heads * info.head_dim
    kv = info.num_kv_heads * info.head_dim
    per = (2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h) * nbytes
    return WeightInfo(
        (per,) * n,
        embed,
        head,
        norm,
        0,
        0,
        tied,
        "config.json shapes (estimate, no safetensors found)",
        False,
    )


# ------------------------------------------------------------------ plans


@dataclass(frozen=True)
class KindRow:
    """KV cost of one layer kind on one TP rank."""

    kind: str
    num_layers: int
    kv_heads_per_rank: int
    head_size: int
    head_size_v: int
    sliding_window: int | None
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_request: int


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage's KV cost (each TP rank of it)."""

    stage: int
    start: int
    end: int
    num_layers: int
    kv_bytes_per_token: int
    bytes_per_block: int


@dataclass(frozen=True)
class Setup:
    """The engine options a plan is for, with vLLM's defaults filled in."""

    tp: int
    pp: int
    partition: list[int]
    partition_source: str
    block_size: int
    kv_cache_dtype: str
    max_model_len: int
    max_num_batched_tokens: int
    max_concurrent_batches: int
    hybrid: bool
    platform: str


@dataclass
class Plan:
    """Everything ``kvmem plan`` reports."""

    model: dict[str, Any]
    setup: Setup
    kinds: list[KindRow]
    stages: list[StageRow]
    blocks_per_request: int
    min_budget_per_gpu: int
    min_budget_proportional: int
    budget: dict[str, Any] | None = None  # {"bytes": ..} or {"tokens": ..}
    without_split: km.Capacity | None = None
    with_split: km.Capacity | None = None
    tokens_capacity: km.Capacity | None = None
    target: km.BudgetNeed | None = None
    hetero: Recommendation | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Recommendation:
    """Best layer partition for a heterogeneous pipeline, and the even one."""

    device_memory: list[int]
    reserve_bytes: int
    best: km.PartitionFit
    even: km.PartitionFit
    best_tokens: int
    best_concurrency: float
    even_tokens: int
    even_concurrency: float
    env: str
    flags: list[str]
    plain_vllm_flags: list[str]
    weights_source: str


def resolve_setup(
    model: ModelInfo,
    *,
    tp: int = 1,
    pp: int = 1,
    partition: str | Sequence[int] | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int | None = None,
    max_concurrent_batches: int | None = None,
    hybrid: bool = True,
    platform: str = "cuda",
) -> Setup:
    """Fill in vLLM's defaults and check the options against the model."""
    if platform not in PLATFORMS:
        raise ValueError(f"--platform={platform!r}: use one of {', '.join(PLATFORMS)}")
    for flag, value in (
        ("--tensor-parallel-size", tp),
        ("--pipeline-parallel-size", pp),
    ):
        if value < 1:
            raise ValueError(f"{flag}={value}: must be at least 1")
    if pp > model.num_layers:
        raise ValueError(
            f"--pipeline-parallel-size={pp} exceeds the model's {model.num_layers} "
            f"layers; use at most {model.num_layers}"
        )
    source = "vLLM's default split"
    if partition is None:
        parts = km.default_partition(model.num_layers, pp)
    else:
        parts = km.parse_partition(partition, model.num_layers, pp)
        source = "given"
    if block_size is None:
        # platforms/cpu.py: 128 unless set; the reference CPU MLA kernel needs 16.
        block_size = 128 if platform == "cpu" and not model.mla_dims else 16
    if block_size < 1:
        raise ValueError(f"--block-size={block_size}: must be positive, e.g. 16")
    if max_model_len is None:
        if not model.max_position_embeddings:
            raise ValueError(
                "config.json has no max_position_embeddings; pass --max-model-len"
            )
        max_model_len = int(model.max_position_embeddings)
    if max_model_len < 1:
        raise ValueError(f"--max-model-len={max_model_len}: must be positive")
    if max_num_batched_tokens is None:
        # engine/arg_utils.py get_batch_defaults, `vllm serve` usage context.
        max_num_batched_tokens = 2048 * (tp * pp if platform == "cpu" else 1)
    if max_concurrent_batches is None:
        max_concurrent_batches = km.default_max_concurrent_batches(pp, platform)
    model.layers(kv_cache_dtype)  # validates the dtype
    return Setup(
        tp=tp,
        pp=pp,
        partition=parts,
        partition_source=source,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_concurrent_batches=max_concurrent_batches,
        hybrid=hybrid,
        platform=platform,
    )


class _Arith:
    """The per-setup numbers every report section shares."""

    def __init__(self, model: ModelInfo, setup: Setup) -> None:
        self.model, self.setup = model, setup
        self.layers = model.layers(setup.kv_cache_dtype)
        self.groups = km.kv_cache_groups(self.layers, hybrid=setup.hybrid)
        self.bpr = km.request_blocks(
            self.groups,
            block_size=setup.block_size,
            max_model_len=setup.max_model_len,
            max_in_flight_tokens=km.max_in_flight_tokens(
                setup.max_num_batched_tokens, setup.max_concurrent_batches
            ),
        )
        self._bpb = km.bytes_per_block_fn(
            self.groups, model.num_layers, block_size=setup.block_size, tp=setup.tp
        )
        self.ranges = km.stage_ranges(setup.partition)
        self.bpb = [self.bytes_per_block(a, b) for a, b in self.ranges]
        self.bpt = [
            km.stage_bytes_per_token(self.layers, a, b, setup.tp)
            for a, b in self.ranges
        ]

    def bytes_per_block(self, start: int, end: int) -> int:
        return self._bpb(start, end)

    def capacity(self, budget_bytes: int, proportional: bool) -> km.Capacity:
        return km.capacity_for_budget(
            self.bpb,
            budget_bytes=budget_bytes,
            blocks_per_request=self.bpr,
            max_model_len=self.setup.max_model_len,
            block_size=self.setup.block_size,
            proportional=proportional,
            ranges=self.ranges,
            bytes_per_token=self.bpt,
        )

    def token_capacity(self, tokens: int) -> km.Capacity:
        return km.capacity_for_tokens(
            self.bpb,
            tokens=tokens,
            blocks_per_request=self.bpr,
            max_model_len=self.setup.max_model_len,
            block_size=self.setup.block_size,
            ranges=self.ranges,
            bytes_per_token=self.bpt,
        )

    def kind_rows(self) -> list[KindRow]:
        rows: dict[km.LayerKV, int] = {}
        for spec in self.layers:
            rows[spec] = rows.get(spec, 0) + 1
        # How each layer is sized (sliding as full with the hybrid manager off).
        sized = {i: g.spec for g in self.groups for i in g.layers}
        first = {spec: self.layers.index(spec) for spec in rows}
        s = self.setup
        inflight = km.max_in_flight_tokens(
            s.max_num_batched_tokens, s.max_concurrent_batches
        )
        return [
            KindRow(
                kind=spec.kind.value,
                num_layers=count,
                kv_heads_per_rank=spec.kv_heads_per_rank(s.tp),
                head_size=spec.head_size,
                head_size_v=spec.head_size_v,
                sliding_window=spec.sliding_window,
                bytes_per_token=spec.bytes_per_token(s.tp),
                bytes_per_block=spec.page_bytes(s.block_size, s.tp),
                blocks_per_request=sized[first[spec]].blocks_per_request(
                    block_size=s.block_size,
                    max_model_len=s.max_model_len,
                    max_in_flight_tokens=inflight,
                ),
            )
            for spec, count in rows.items()
        ]

    def stage_rows(self) -> list[StageRow]:
        return [
            StageRow(i, a, b, b - a, t, p)
            for i, ((a, b), t, p) in enumerate(zip(self.ranges, self.bpt, self.bpb))
        ]


def _as_model(model: str | os.PathLike[str] | ModelInfo, dtype: str) -> ModelInfo:
    return model if isinstance(model, ModelInfo) else load_model(model, dtype=dtype)


def plan_capacity(
    model: str | os.PathLike[str] | ModelInfo,
    *,
    tp: int = 1,
    pp: int = 1,
    partition: str | Sequence[int] | None = None,
    budget_bytes: int | str | None = None,
    budget_tokens: int | str | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
    proportional: bool = False,
    dtype: str = "auto",
    max_num_batched_tokens: int | None = None,
    max_concurrent_batches: int | None = None,
    hybrid: bool = True,
    platform: str = "cuda",
    strict: bool = True,
) -> km.Capacity:
    """Predict what an engine allocates for one budget (the engine-agreement API).

    Exactly one of ``budget_bytes`` (``--kv-cache-memory-bytes``) and
    ``budget_tokens`` (``--kv-cache-tokens``). ``proportional`` is
    ``--enable-pp-prop-kv-cache``. ``strict``: raise, with the minimum, when
    the budget cannot start (one max_model_len request plus the null block).
    ``block_size=None`` is the platform's default (16 on CUDA, 128 on CPU);
    for an engine's numbers pass ``platform="cpu"`` or the values it used
    (block size, max_num_batched_tokens, max_concurrent_batches).
    """
    info = _as_model(model, dtype)
    setup = resolve_setup(
        info,
        tp=tp,
        pp=pp,
        partition=partition,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_concurrent_batches=max_concurrent_batches,
        hybrid=hybrid,
        platform=platform,
    )
    arith = _Arith(info, setup)
    kind, value = _one_budget(budget_bytes, budget_tokens)
    if kind == "tokens":
        cap = arith.token_capacity(value)
    else:
        cap = arith.capacity(value, proportional)
    if strict and not cap.fits:
        raise ValueError(_too_small(cap, setup, proportional))
    return cap


def _one_budget(
    budget_bytes: int | str | None, budget_tokens: int | str | None
) -> tuple[str, int]:
    if budget_bytes is not None and budget_tokens is not None:
        raise ValueError(
            "--kv-cache-memory-bytes and --kv-cache-tokens are mutually exclusive: "
            "give the KV budget in bytes (e.g. 5G) or in tokens (e.g. 400000), "
            "not both"
        )
    if budget_tokens is not None:
        return "tokens", km.parse_positive_size(budget_tokens, flag="--kv-cache-tokens")
    if budget_bytes is not None:
        return "bytes", km.parse_positive_size(
            budget_bytes, flag="--kv-cache-memory-bytes"
        )
    raise ValueError(
        "no KV budget: pass --kv-cache-memory-bytes (e.g. 5G) or --kv-cache-tokens "
        "(e.g. 400000)"
    )


def _too_small(cap: km.Capacity, setup: Setup, proportional: bool) -> str:
    need = km.min_blocks(cap.blocks_per_request)
    head = (
        f"a {setup.max_model_len:,}-token request needs {need:,} blocks per stage "
        f"({cap.blocks_per_request:,} + vLLM's null block) but the budget gives "
        f"{cap.num_blocks:,}"
    )
    if cap.mode == "tokens":
        return (
            f"--kv-cache-tokens is too small for one sequence: {head}; use "
            f"--kv-cache-tokens {cap.min_budget} or more, or lower --max-model-len"
        )
    flag = " with --enable-pp-prop-kv-cache" if proportional else ""
    return (
        f"--kv-cache-memory-bytes {human_bytes(cap.budget_bytes)} is too small for "
        f"one sequence{flag}: {head}; use --kv-cache-memory-bytes "
        f"{flag_size(cap.min_budget)} ({cap.min_budget} bytes) or more, or lower "
        "--max-model-len"
    )


def _too_small_both(caps: Sequence[km.Capacity], setup: Setup) -> str:
    """Neither mode starts: name both minimums."""
    if len(caps) == 1:
        return _too_small(caps[0], setup, False)
    per_gpu, prop = caps
    return (
        f"--kv-cache-memory-bytes {human_bytes(per_gpu.budget_bytes)} is too small "
        f"for one {setup.max_model_len:,}-token request "
        f"({per_gpu.blocks_per_request + 1:,} blocks per stage with vLLM's null "
        f"block); use at least {flag_size(per_gpu.min_budget)} per GPU, or "
        f"{flag_size(prop.min_budget)} pipeline-wide with --enable-pp-prop-kv-cache, "
        "or lower --max-model-len"
    )


def plan(
    model: str | os.PathLike[str] | ModelInfo,
    *,
    tp: int = 1,
    pp: int | None = None,
    partition: str | Sequence[int] | None = None,
    budget_bytes: int | str | None = None,
    budget_tokens: int | str | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    target_concurrency: float | None = None,
    device_memory: Sequence[int | str] | None = None,
    reserve_memory: int | str = DEFAULT_RESERVE,
    max_num_batched_tokens: int | None = None,
    max_concurrent_batches: int | None = None,
    hybrid: bool = True,
    platform: str = "cuda",
) -> Plan:
    """The whole report: KV costs, both budget modes, a target, a partition.

    ``pp`` defaults to the number of ``device_memory`` entries, else 1.
    """
    if pp is None:
        pp = len(device_memory) if device_memory else 1
    info = _as_model(model, dtype)
    setup = resolve_setup(
        info,
        tp=tp,
        pp=pp,
        partition=partition,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_concurrent_batches=max_concurrent_batches,
        hybrid=hybrid,
        platform=platform,
    )
    hetero = None
    if device_memory is not None:
        hetero = recommend_partition(
            info, setup, device_memory=device_memory, reserve_memory=reserve_memory
        )
        if partition is None:
            setup = replace(
                setup,
                partition=hetero.best.partition,
                partition_source="recommended for --device-memory",
            )
    arith = _Arith(info, setup)
    out = Plan(
        model=_model_summary(info),
        setup=setup,
        kinds=arith.kind_rows(),
        stages=arith.stage_rows(),
        blocks_per_request=arith.bpr,
        min_budget_per_gpu=km.min_budget(arith.bpb, arith.bpr, proportional=False),
        min_budget_proportional=km.min_budget(arith.bpb, arith.bpr, proportional=True),
    )
    if budget_bytes is not None or budget_tokens is not None:
        kind, value = _one_budget(budget_bytes, budget_tokens)
        out.budget = {kind: value}
        if kind == "tokens":
            out.tokens_capacity = arith.token_capacity(value)
            caps = [out.tokens_capacity]
        else:
            out.without_split = arith.capacity(value, proportional=False)
            out.with_split = arith.capacity(value, proportional=True)
            caps = [out.without_split, out.with_split]
        if not any(c.fits for c in caps):
            raise ValueError(_too_small_both(caps, setup))
    if target_concurrency is not None:
        out.target = km.budget_for_concurrency(
            arith.bpb,
            concurrency=target_concurrency,
            blocks_per_request=arith.bpr,
            max_model_len=setup.max_model_len,
        )
    out.hetero = hetero
    if any(k.kind == km.LayerKind.SLIDING for k in out.kinds):
        out.notes.append(
            "sliding-window blocks per request depend on max_num_batched_tokens "
            f"({setup.max_num_batched_tokens:,}) x max_concurrent_batches "
            f"({setup.max_concurrent_batches}); pass the values vLLM uses "
            "(--max-num-batched-tokens, --max-concurrent-batches)"
        )
    return out


def _model_summary(info: ModelInfo) -> dict[str, Any]:
    w = info.weights
    return {
        "path": info.path,
        "architecture": info.architecture,
        "num_layers": info.num_layers,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "dtype": info.dtype,
        "sliding_window": info.sliding_window,
        "mla": list(info.mla_dims) if info.mla_dims else None,
        "max_position_embeddings": info.max_position_embeddings,
        "weight_bytes": w.total,
        "weights_source": w.source,
        "weights_exact": w.exact,
    }


def recommend_partition(
    model: str | os.PathLike[str] | ModelInfo,
    setup: Setup | None = None,
    *,
    device_memory: Sequence[int | str],
    reserve_memory: int | str = DEFAULT_RESERVE,
    **setup_options: Any,
) -> Recommendation:
    """The layer partition that gives a heterogeneous pipeline the most KV.

    ``device_memory``: one GPU's memory per pipeline stage (every TP rank of a
    stage has that memory). Free KV memory of a stage = memory - reserve -
    its weights / TP; every stage must hold the same block count, so the
    pipeline gets ``min over stages of free // bytes_per_block``.
    """
    info = _as_model(model, setup_options.pop("dtype", "auto"))
    devices = [km.parse_positive_size(d, flag="--device-memory") for d in device_memory]
    if setup is None:
        setup_options.setdefault("pp", len(devices))
        setup = resolve_setup(info, **setup_options)
    if len(devices) != setup.pp:
        raise ValueError(
            f"--device-memory lists {len(devices)} devices but "
            f"--pipeline-parallel-size is {setup.pp}; give one size per pipeline "
            f"stage, e.g. {','.join(['24G'] * setup.pp)}"
        )
    reserve = km.parse_size(reserve_memory, flag="--reserve-memory")
    if reserve < 0:
        raise ValueError(f"--reserve-memory={reserve_memory!r}: must be >= 0, e.g. 1G")
    if not any(info.weights.per_layer):
        raise ValueError(
            f"no weight sizes for {info.path} ({info.weights.source}); "
            "--device-memory needs model.safetensors or model.safetensors.index.json "
            "(with its shards, or metadata.total_size) in the model directory"
        )
    arith = _Arith(info, setup)
    first, last = info.weights.stage_fixed_bytes(setup.pp)
    cost = km.PipelineCost(
        num_layers=info.num_layers,
        bytes_per_block=arith.bytes_per_block,
        layer_weights=info.weights.per_layer,
        first_stage_bytes=first,
        last_stage_bytes=last,
        tp=setup.tp,
    )
    even = km.evaluate_partition(
        cost, km.default_partition(info.num_layers, setup.pp), devices, reserve
    )
    best = km.best_partition(cost, devices, reserve)
    need = km.min_blocks(arith.bpr)
    if best.num_blocks < need:
        raise ValueError(
            f"these devices cannot hold one {setup.max_model_len:,}-token request: "
            f"the best partition {_csv(best.partition)} leaves room for "
            f"{best.num_blocks:,} blocks per stage, {need:,} are needed; lower "
            "--max-model-len, use fp8 KV (--kv-cache-dtype fp8), more memory or "
            "a larger --tensor-parallel-size"
        )
    best_tokens, best_conc = km.vllm_capacity(
        best.num_blocks, arith.bpr, setup.max_model_len
    )
    even_tokens, even_conc = km.vllm_capacity(
        max(even.num_blocks, 0), arith.bpr, setup.max_model_len
    )
    best_bpb = [s.bytes_per_block for s in best.stages]
    env, flags, plain = _launch(info, setup, best, best_bpb)
    return Recommendation(
        device_memory=devices,
        reserve_bytes=reserve,
        best=best,
        even=even,
        best_tokens=best_tokens,
        best_concurrency=best_conc,
        even_tokens=even_tokens,
        even_concurrency=even_conc,
        env=env,
        flags=flags,
        plain_vllm_flags=plain,
        weights_source=info.weights.source,
    )


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _launch(
    info: ModelInfo, setup: Setup, best: km.PartitionFit, bpb: Sequence[int]
) -> tuple[str, list[str], list[str]]:
    """The environment and flags that give every stage ``best.num_blocks``.

    With the split, the pipeline-wide budget ``blocks * sum(bytes_per_block)``
    hands stage ``s`` exactly ``blocks * bytes_per_block[s]``.
    """
    env = f"VLLM_PP_LAYER_PARTITION={_csv(best.partition)}"
    common = [f"--pipeline-parallel-size {setup.pp}"]
    if setup.tp > 1:
        common.append(f"--tensor-parallel-size {setup.tp}")
    common.append(f"--max-model-len {setup.max_model_len}")
    common.append(f"--block-size {setup.block_size}")
    if setup.kv_cache_dtype != "auto":
        common.append(f"--kv-cache-dtype {setup.kv_cache_dtype}")
    flags = [
        *common,
        "--enable-pp-prop-kv-cache",
        f"--kv-cache-memory-bytes {best.num_blocks * sum(bpb)}",
    ]
    plain = [*common, f"--kv-cache-memory-bytes {best.num_blocks * max(bpb)}"]
    return env, flags, plain


# ----------------------------------------------------------------- output


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """JSON-ready plan: plain ints and floats, capacities with their stages."""

    def cap(c: km.Capacity | None) -> dict[str, Any] | None:
        if c is None:
            return None
        d = asdict(c)
        d["fits"] = c.fits
        d["total_kv_bytes"] = c.total_kv_bytes
        return d

    out: dict[str, Any] = {
        "model": p.model,
        "setup": asdict(p.setup),
        "kinds": [asdict(k) for k in p.kinds],
        "stages": [asdict(s) for s in p.stages],
        "blocks_per_request": p.blocks_per_request,
        "min_budget_per_gpu": p.min_budget_per_gpu,
        "min_budget_proportional": p.min_budget_proportional,
        "budget": p.budget,
        "without_split": cap(p.without_split),
        "with_split": cap(p.with_split),
        "tokens_capacity": cap(p.tokens_capacity),
        "target": asdict(p.target) if p.target else None,
        "heterogeneous": None,
        "not_supported": NOT_SUPPORTED_NOTE,
        "notes": p.notes,
    }
    if p.hetero:
        h = asdict(p.hetero)
        h["command"] = _command(p, p.hetero)
        out["heterogeneous"] = h
    return out


def _command(p: Plan, r: Recommendation) -> str:
    return f"{r.env} vllm serve {p.model['path']} " + " ".join(r.flags)


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  "
) -> list[str]:
    """Right-aligned columns, first column left-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [
            r[i].ljust(widths[i]) if i == 0 else r[i].rjust(widths[i])
            for i in range(len(r))
        ]
        lines.append(indent + "  ".join(parts).rstrip())
    return lines


def _g(n: int | float) -> str:
    return gib(n)


def _weights_text(m: dict[str, Any]) -> str:
    if not m["weight_bytes"]:
        return m["weights_source"]
    return f"{human_bytes(m['weight_bytes'])} from {m['weights_source']}"


def format_plan(p: Plan) -> str:
    """The human report."""
    s, m = p.setup, p.model
    lines = [
        f"kvmem plan: {m['path']}",
        f"  model: {m['architecture']}, {m['num_layers']} layers, {m['dtype']}, "
        f"weights {_weights_text(m)}",
        f"  KV cache dtype {s.kv_cache_dtype}, block size {s.block_size} tokens, "
        f"TP {s.tp}, PP {s.pp}, max_model_len {s.max_model_len:,}",
        "",
        "KV bytes per token, per layer, on one TP rank:",
    ]
    lines += _table(
        [
            "kind",
            "layers",
            "heads x (K+V)",
            "window",
            "bytes/token",
            "bytes/block",
            "blocks/request",
        ],
        [
            (
                k.kind,
                k.num_layers,
                f"{k.kv_heads_per_rank} x ({k.head_size}+{k.head_size_v})",
                f"{k.sliding_window:,}" if k.sliding_window else "-",
                f"{k.bytes_per_token:,}",
                f"{k.bytes_per_block:,}",
                f"{k.blocks_per_request:,}",
            )
            for k in p.kinds
        ],
    )
    lines.append(f"  {NOT_SUPPORTED_NOTE}")
    lines += [
        "",
        f"Pipeline stages (partition {_csv(s.partition)}, {s.partition_source}):",
    ]
    lines += _table(
        ["stage", "layers", "range", "KV bytes/token", "bytes/block", ""],
        [
            (
                st.stage,
                st.num_layers,
                f"{st.start}-{st.end - 1}",
                f"{st.kv_bytes_per_token:,}",
                f"{st.bytes_per_block:,}",
                human_bytes(st.bytes_per_block),
            )
            for st in p.stages
        ],
    )
    lines.append(
        f"  a {s.max_model_len:,}-token request takes {p.blocks_per_request:,} blocks "
        f"on every stage; vLLM starts with at least {p.blocks_per_request + 1:,} "
        "(one null block)"
    )
    least = (
        "  least --kv-cache-memory-bytes that starts: "
        f"{flag_size(p.min_budget_per_gpu)} per GPU"
    )
    if s.pp > 1:
        least += (
            f", or {flag_size(p.min_budget_proportional)} pipeline-wide with "
            "--enable-pp-prop-kv-cache"
        )
    lines.append(least)
    if p.without_split and s.pp == 1:
        b = p.budget["bytes"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-memory-bytes {b} ({human_bytes(b)}):"]
        lines += _capacity_lines(
            p.without_split, s, "one stage: --enable-pp-prop-kv-cache changes nothing"
        )
    elif p.without_split and p.with_split:
        b = p.budget["bytes"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-memory-bytes {b} ({human_bytes(b)}):"]
        lines += _capacity_lines(
            p.without_split,
            s,
            f"without --enable-pp-prop-kv-cache: every GPU is handed {human_bytes(b)}, "
            "vLLM cuts every stage to the smallest block count",
        )
        lines += _capacity_lines(
            p.with_split,
            s,
            f"with --enable-pp-prop-kv-cache: {human_bytes(b)} for the whole pipeline "
            "(per TP shard), split by bytes per block",
        )
    if p.tokens_capacity:
        t = p.budget["tokens"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-tokens {t:,}:"]
        lines += _capacity_lines(
            p.tokens_capacity,
            s,
            "every stage gets the bytes of exactly those blocks (the same with "
            "and without --enable-pp-prop-kv-cache)",
        )
    if p.target:
        lines += _target_lines(p.target, s)
    if p.hetero:
        lines += _hetero_lines(p, p.hetero)
    for note in p.notes:
        lines += ["", f"note: {note}"]
    return "\n".join(lines)


def _capacity_lines(c: km.Capacity, s: Setup, title: str) -> list[str]:
    lines = [f"  {title}:"]
    lines += _table(
        [
            "stage",
            "handed",
            "blocks",
            "tokens",
            "concurrency",
            "kept blocks",
            "KV kept",
        ],
        [
            (
                st.stage,
                human_bytes(st.budget_bytes),
                f"{st.handed_blocks:,}",
                f"{st.handed_tokens:,}",
                f"{st.handed_concurrency:.2f}x",
                f"{st.num_blocks:,}",
                human_bytes(st.kv_bytes),
            )
            for st in c.stages
        ],
        indent="    ",
    )
    if c.fits:
        lines.append(
            f"    vLLM logs: KV cache size {c.tokens:,} tokens, maximum concurrency "
            f"{c.concurrency:.2f}x for {s.max_model_len:,} tokens per request; "
            f"usable {c.usable_tokens:,} token slots (null block excluded); KV "
            f"allocated {human_bytes(c.total_kv_bytes)} per TP shard"
        )
    else:
        unit = (
            f"--kv-cache-tokens {c.min_budget}"
            if c.mode == "tokens"
            else f"--kv-cache-memory-bytes {flag_size(c.min_budget)}"
        )
        lines.append(
            f"    does not start: a {s.max_model_len:,}-token request needs "
            f"{c.blocks_per_request + 1:,} blocks per stage with the null block, "
            f"the budget gives {c.num_blocks:,}; use {unit} or more"
        )
    return lines


def _target_lines(t: km.BudgetNeed, s: Setup) -> list[str]:
    lines = [
        "",
        f"Budget for {t.concurrency:g} concurrent {s.max_model_len:,}-token requests "
        f"({t.num_blocks:,} blocks per stage, null block included):",
        f"  {'without the split: ' if s.pp > 1 else ''}--kv-cache-memory-bytes "
        f"{flag_size(t.per_gpu_bytes)} per GPU ({t.per_gpu_bytes} bytes)",
    ]
    if s.pp > 1:
        lines.append(
            f"  with --enable-pp-prop-kv-cache: --kv-cache-memory-bytes "
            f"{flag_size(t.proportional_bytes)} pipeline-wide "
            f"({t.proportional_bytes} bytes)"
        )
    lines.append(
        f"  or --kv-cache-tokens {t.tokens}; KV allocated "
        f"{human_bytes(t.allocated_bytes)} per TP shard"
    )
    return lines


def _even_verdict(p: Plan, r: Recommendation) -> str:
    """The even split's capacity, or why it cannot start."""
    for st in r.even.stages:
        if st.free_bytes < 0:
            return (
                f"does not start: stage {st.stage}'s weights "
                f"({_g(st.weight_bytes)} GiB) plus the reserve exceed its "
                f"{_g(st.device_bytes)} GiB"
            )
    if r.even.num_blocks < km.min_blocks(p.blocks_per_request):
        return (
            f"does not start: {r.even.num_blocks:,} blocks per stage, "
            f"{km.min_blocks(p.blocks_per_request):,} needed for one request"
        )
    return (
        f"{r.even.num_blocks:,} blocks = {r.even_tokens:,} tokens, "
        f"{r.even_concurrency:.2f}x concurrency"
    )


def _hetero_lines(p: Plan, r: Recommendation) -> list[str]:
    devs = ",".join(_g(d) for d in r.device_memory)
    lines = [
        "",
        f"Heterogeneous pipeline: GPUs of {devs} GiB for stages "
        f"0-{p.setup.pp - 1}, {p.setup.tp} per stage; {_g(r.reserve_bytes)} GiB "
        "reserved per GPU for activations and runtime (an assumption, "
        "--reserve-memory); weights per GPU from "
        f"{r.weights_source}:",
    ]
    rows = []
    for label, fit in (("recommended", r.best), ("even (vLLM)", r.even)):
        for st in fit.stages:
            rows.append(
                (
                    f"{label} {_csv(fit.partition)}" if st.stage == 0 else "",
                    st.stage,
                    st.num_layers,
                    _g(st.device_bytes),
                    _g(st.weight_bytes),
                    _g(st.free_bytes),
                    f"{st.bytes_per_block:,}",
                    f"{st.max_blocks:,}"
                    if st.max_blocks >= 0
                    else "weights do not fit",
                )
            )
    lines += _table(
        [
            "partition",
            "stage",
            "layers",
            "device GiB",
            "weights GiB",
            "free GiB",
            "bytes/block",
            "blocks",
        ],
        rows,
    )
    lines.append(
        f"  recommended {_csv(r.best.partition)}: {r.best.num_blocks:,} blocks per "
        f"stage = {r.best_tokens:,} tokens, {r.best_concurrency:.2f}x concurrency"
    )
    lines.append(f"  even {_csv(r.even.partition)}: {_even_verdict(p, r)}")
    lines += [
        "  run with vllm-kvmem:",
        f"    {r.env} vllm serve {p.model['path']} \\",
        "      " + " \\\n      ".join(r.flags),
        "  or without the flag (CUDA): hand every GPU the fattest stage's bytes; "
        "vLLM trims each stage to the same block count before allocating:",
        f"    {r.env} vllm serve {p.model['path']} " + " ".join(r.plain_vllm_flags),
    ]
    return lines


# -------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvmem plan``; names follow vLLM's where one exists."""
    parser.add_argument("model_dir", help="local model directory with config.json")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="TP size: KV heads are split across TP ranks, replicated when fewer "
        "heads than ranks (default %(default)s)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        help="PP size (default 1, or the number of --device-memory entries)",
    )
    parser.add_argument(
        "--pp-layer-partition",
        default=os.environ.get("VLLM_PP_LAYER_PARTITION"),
        help="layers per stage like VLLM_PP_LAYER_PARTITION, e.g. 56,8 (default: "
        "$VLLM_PP_LAYER_PARTITION, else vLLM's even split)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        help="KV budget in bytes: 5G, 512M, 1.5g, 400000 (vLLM's syntax); per GPU, "
        "or pipeline-wide with --enable-pp-prop-kv-cache (both are reported)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        help="KV budget in tokens (e.g. 400000 or 400k) instead of bytes; not with "
        "--kv-cache-memory-bytes",
    )
    parser.add_argument(
        "--max-model-len",
        help="tokens per request (default: config's max_position_embeddings); 32k, "
        "32K and 32768 are read as vLLM reads them",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default 16; with --platform cpu vLLM uses 128, "
        "16 for MLA: vllm/platforms/cpu.py)",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cuda",
        help="whose defaults to use for the block size and batch sizes "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model dtype as vLLM's --dtype (default auto: config dtype, float32 "
        "downcast to 16 bits)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help=f"one of {', '.join(km.KV_CACHE_DTYPES)}, fp8_ds_mla (MLA); auto = "
        "model dtype, fp8 = 1 byte (default auto)",
    )
    parser.add_argument(
        "--target-concurrency",
        type=float,
        default=None,
        help="print the budget for this many concurrent max-model-len requests",
    )
    parser.add_argument(
        "--device-memory",
        help="memory of one GPU per pipeline stage, e.g. 16G,32G: recommends the "
        "layer partition with the most KV capacity and prints the command",
    )
    parser.add_argument(
        "--reserve-memory",
        default=DEFAULT_RESERVE,
        help="per-GPU memory neither weights nor KV may use (activations, CUDA "
        "graphs, NCCL, runtime); an assumption, measure yours (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        default=None,
        help="vLLM's max_num_batched_tokens, which sizes sliding-window caches "
        "(default: `vllm serve`'s, 2048; x TP x PP on CPU)",
    )
    parser.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=None,
        help="batches in flight (vLLM: PP size, +1 with async scheduling, the CUDA "
        "default; CPU: PP size); sizes sliding-window caches",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="as vLLM's flag: size sliding-window layers like full attention when "
        "mixed with full-attention layers",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    """``kvmem plan``: print the report; ValueErrors carry the one-line error."""
    devices = _device_list(args.device_memory)
    pp = args.pipeline_parallel_size or (len(devices) if devices else 1)
    max_len = (
        km.parse_positive_size(args.max_model_len, flag="--max-model-len")
        if args.max_model_len is not None
        else None
    )
    batched = (
        km.parse_positive_size(
            args.max_num_batched_tokens, flag="--max-num-batched-tokens"
        )
        if args.max_num_batched_tokens is not None
        else None
    )
    result = plan(
        args.model_dir,
        tp=args.tensor_parallel_size,
        pp=pp,
        partition=args.pp_layer_partition or None,
        budget_bytes=args.kv_cache_memory_bytes,
        budget_tokens=args.kv_cache_tokens,
        max_model_len=max_len,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        target_concurrency=args.target_concurrency,
        device_memory=devices,
        reserve_memory=args.reserve_memory,
        max_num_batched_tokens=batched,
        max_concurrent_batches=args.max_concurrent_batches,
        hybrid=not args.disable_hybrid_kv_cache_manager,
        platform=args.platform,
    )
    if args.json:
        print(json.dumps(plan_to_dict(result), indent=2))
    else:
        print(format_plan(result))
    return 0


def _device_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(
            f"--device-memory={text!r}: give one size per stage, e.g. 16G,32G"
        )
    return items


__all__ = [
    "ModelInfo",
    "Plan",
    "Recommendation",
    "Setup",
    "WeightInfo",
    "add_arguments",
    "format_plan",
    "load_model",
    "plan",
    "plan_capacity",
    "plan_to_dict",
    "read_safetensors_header",
    "recommend_partition",
    "resolve_setup",
    "run",
]
