"""The engine options a plan is for: as given, and with vLLM's defaults in.

:class:`Options` is the one declaration of the options every planner entry
point takes (``plan``, ``plan_capacity``, ``recommend_partition``); they
resolve it once, against the model, into a :class:`Setup`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.model import ModelInfo

PLATFORMS = ("cuda", "cpu")


@dataclass(frozen=True)
class Options:
    """Engine options as given; ``None`` is vLLM's default for the model.

    ``pp=None`` is the number of ``--device-memory`` entries, else 1;
    ``block_size=None`` the platform's (16 on CUDA, 128 on CPU); for an
    engine's numbers pass ``platform="cpu"`` or the values it used.
    """

    tp: int = 1
    pp: int | None = None
    partition: str | Sequence[int] | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_concurrent_batches: int | None = None
    hybrid: bool = True
    platform: str = "cuda"


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


def resolve_setup(model: ModelInfo, options: Options) -> Setup:
    """Fill in vLLM's defaults and check the options against the model."""
    o = options
    pp = 1 if o.pp is None else o.pp
    if o.platform not in PLATFORMS:
        raise ValueError(
            f"--platform={o.platform!r}: use one of {', '.join(PLATFORMS)}"
        )
    for flag, value in (
        ("--tensor-parallel-size", o.tp),
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
    if o.partition is None:
        parts = km.default_partition(model.num_layers, pp)
    else:
        parts = km.parse_partition(o.partition, model.num_layers, pp)
        source = "given"
    block_size = o.block_size
    if block_size is None:
        # platforms/cpu.py: 128 unless set; the reference CPU MLA kernel needs 16.
        block_size = 128 if o.platform == "cpu" and not model.mla_dims else 16
    if block_size < 1:
        raise ValueError(f"--block-size={block_size}: must be positive, e.g. 16")
    max_model_len = o.max_model_len
    if max_model_len is None:
        if not model.max_position_embeddings:
            raise ValueError(
                "config.json has no max_position_embeddings; pass --max-model-len"
            )
        max_model_len = int(model.max_position_embeddings)
    if max_model_len < 1:
        raise ValueError(f"--max-model-len={max_model_len}: must be positive")
    batched = o.max_num_batched_tokens
    if batched is None:
        # engine/arg_utils.py get_batch_defaults, `vllm serve` usage context.
        batched = 2048 * (o.tp * pp if o.platform == "cpu" else 1)
    batches = o.max_concurrent_batches
    if batches is None:
        batches = km.default_max_concurrent_batches(pp, o.platform)
    model.layers(o.kv_cache_dtype)  # validates the dtype
    return Setup(
        tp=o.tp,
        pp=pp,
        partition=parts,
        partition_source=source,
        block_size=block_size,
        kv_cache_dtype=o.kv_cache_dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        max_concurrent_batches=batches,
        hybrid=o.hybrid,
        platform=o.platform,
    )
