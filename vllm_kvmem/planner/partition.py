"""The layer partition that gives a heterogeneous pipeline the most KV.

Stages on GPUs of different memory: each holds weights and a reserve, and
what is left takes KV blocks; the search (``kv_math.best_partition``) finds
the split where the tightest stage holds the most, and the launch command.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_kvmem.core.units import parse_positive_size, parse_size
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.costs import KVCosts
from vllm_kvmem.planner.model import ModelInfo, as_model
from vllm_kvmem.planner.setup import Options, Setup, resolve_setup

DEFAULT_RESERVE = "1G"


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


def recommend_partition(
    model: str | os.PathLike[str] | ModelInfo,
    setup: Setup | None = None,
    *,
    device_memory: Sequence[int | str],
    reserve_memory: int | str = DEFAULT_RESERVE,
    **overrides: Any,
) -> Recommendation:
    """The layer partition that gives a heterogeneous pipeline the most KV.

    ``device_memory``: one GPU's memory per pipeline stage (every TP rank of a
    stage has that memory). Free KV memory of a stage = memory - reserve -
    its weights / TP; every stage must hold the same block count, so the
    pipeline gets ``min over stages of free // bytes_per_block``. Without a
    ``setup``, engine options as keywords (:class:`Options`) give one.
    """
    opts = replace(Options(), **overrides)
    info = as_model(model, opts.dtype)
    devices = [parse_positive_size(d, flag="--device-memory") for d in device_memory]
    if setup is None:
        pp = len(devices) if opts.pp is None else opts.pp
        setup = resolve_setup(info, replace(opts, pp=pp))
    if len(devices) != setup.pp:
        raise ValueError(
            f"--device-memory lists {len(devices)} devices but "
            f"--pipeline-parallel-size is {setup.pp}; give one size per pipeline "
            f"stage, e.g. {','.join(['24G'] * setup.pp)}"
        )
    reserve = parse_size(reserve_memory, flag="--reserve-memory")
    if reserve < 0:
        raise ValueError(f"--reserve-memory={reserve_memory!r}: must be >= 0, e.g. 1G")
    if not any(info.weights.per_layer):
        raise ValueError(
            f"no weight sizes for {info.path} ({info.weights.source}); "
            "--device-memory needs model.safetensors or model.safetensors.index.json "
            "(with its shards, or metadata.total_size) in the model directory"
        )
    costs = KVCosts(info, setup)
    first, last = info.weights.stage_fixed_bytes(setup.pp)
    cost = km.PipelineCost(
        num_layers=info.num_layers,
        bytes_per_block=costs.bytes_per_block,
        layer_weights=info.weights.per_layer,
        first_stage_bytes=first,
        last_stage_bytes=last,
        tp=setup.tp,
    )
    even = km.evaluate_partition(
        cost, km.default_partition(info.num_layers, setup.pp), devices, reserve
    )
    best = km.best_partition(cost, devices, reserve)
    need = km.min_blocks(costs.bpr)
    if best.num_blocks < need:
        raise ValueError(
            f"these devices cannot hold one {setup.max_model_len:,}-token request: "
            f"the best partition {as_csv(best.partition)} leaves room for "
            f"{best.num_blocks:,} blocks per stage, {need:,} are needed; lower "
            "--max-model-len, use fp8 KV (--kv-cache-dtype fp8), more memory or "
            "a larger --tensor-parallel-size"
        )
    best_tokens, best_conc = km.vllm_capacity(
        best.num_blocks, costs.bpr, setup.max_model_len
    )
    even_tokens, even_conc = km.vllm_capacity(
        max(even.num_blocks, 0), costs.bpr, setup.max_model_len
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


def as_csv(values: Sequence[int]) -> str:
    """``56,8``: a partition as VLLM_PP_LAYER_PARTITION spells it."""
    return ",".join(map(str, values))


def _launch(
    info: ModelInfo, setup: Setup, best: km.PartitionFit, bpb: Sequence[int]
) -> tuple[str, list[str], list[str]]:
    """The environment and flags that give every stage ``best.num_blocks``.

    With the split, the pipeline-wide budget ``blocks * sum(bytes_per_block)``
    hands stage ``s`` exactly ``blocks * bytes_per_block[s]``.
    """
    env = f"VLLM_PP_LAYER_PARTITION={as_csv(best.partition)}"
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
