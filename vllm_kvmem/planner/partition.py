"""The layer partition that gives a heterogeneous pipeline the most KV.

Stages on GPUs of different memory: each holds weights and a reserve, and
what is left takes KV blocks; the search (:func:`best_partition`) finds the
split where the tightest stage holds the most, and the launch command.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from vllm_kvmem.core.units import cdiv, format_bytes, parse_positive_size, parse_size
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.costs import KVCosts
from vllm_kvmem.planner.model import ModelInfo, as_model
from vllm_kvmem.planner.setup import Options, Setup, resolve_setup

DEFAULT_RESERVE = "1G"


@dataclass(frozen=True)
class StageFit:
    """How one stage of a partition fills its device."""

    stage: int
    start: int
    end: int
    device_bytes: int
    weight_bytes: int  # per GPU
    free_bytes: int  # device - reserve - weights: what KV may use
    bytes_per_block: int
    max_blocks: int  # free_bytes // bytes_per_block

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PartitionFit:
    """A partition and the blocks every stage can hold under it."""

    partition: list[int]
    num_blocks: int  # min over stages: what the pipeline gets
    stages: list[StageFit]


@dataclass(frozen=True)
class PipelineCost:
    """What placing layers on a stage costs, for the partition search.

    ``bytes_per_block(start, end)``: KV bytes per block of layers [start, end);
    ``layer_weights[i]``: weight bytes of layer i (whole layer, before TP);
    ``first_stage_bytes`` / ``last_stage_bytes``: embedding, lm_head, norms.
    """

    num_layers: int
    bytes_per_block: Callable[[int, int], int]
    layer_weights: Sequence[int]
    first_stage_bytes: int
    last_stage_bytes: int
    tp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_prefix", [0, *accumulate(self.layer_weights)])

    def weights(self, stage: int, pp: int, start: int, end: int) -> int:
        """Weight bytes on one GPU of a stage (TP splits them evenly)."""
        prefix: list[int] = self._prefix  # type: ignore[attr-defined]
        total = prefix[end] - prefix[start]
        if stage == 0:
            total += self.first_stage_bytes
        if stage == pp - 1:
            total += self.last_stage_bytes
        return cdiv(total, self.tp)

    def fit(
        self, stage: int, start: int, end: int, device: int, reserve: int, pp: int
    ) -> StageFit:
        w = self.weights(stage, pp, start, end)
        free = device - reserve - w
        bpb = self.bytes_per_block(start, end)
        return StageFit(
            stage, start, end, device, w, free, bpb, free // bpb if free >= 0 else -1
        )


def evaluate_partition(
    cost: PipelineCost, partition: Sequence[int], devices: Sequence[int], reserve: int
) -> PartitionFit:
    """Blocks each stage can hold under ``partition``; the pipeline gets the least."""
    pp = len(devices)
    stages = [
        cost.fit(s, a, b, devices[s], reserve, pp)
        for s, (a, b) in enumerate(km.stage_ranges(partition))
    ]
    return PartitionFit(list(partition), min(f.max_blocks for f in stages), stages)


def best_partition(
    cost: PipelineCost, devices: Sequence[int], reserve: int
) -> PartitionFit:
    """The partition with the most KV blocks on every stage (exact).

    Maximises ``min over stages of floor(free_s / bytes_per_block_s)``; among
    partitions with that capacity, picks the smallest largest stage (pipeline
    balance), then the one closest to vLLM's even split. A stage's block count
    only falls as it takes more layers, so the layers a stage can take from a
    given start form a prefix; feasibility of a block count is then a
    reachability sweep over (stage, start layer), and the best count is found
    by bisection. Exact for any per-layer weights, O(pp * L log L) per probe.
    """
    pp, n = len(devices), cost.num_layers
    if n < pp:
        raise ValueError(
            f"{n} layers cannot fill {pp} pipeline stages; use at most {n} stages"
        )

    def blocks(s: int, a: int, b: int) -> int:
        return cost.fit(s, a, b, devices[s], reserve, pp).max_blocks

    if _reachable(blocks, pp, n, 0, n) is None:
        first, last = cost.first_stage_bytes, cost.last_stage_bytes
        weights = sum(cost.layer_weights) + first + last
        raise ValueError(
            f"the weights ({format_bytes(weights)}, over {cost.tp} GPU(s) per stage) "
            f"do not fit devices of {', '.join(format_bytes(d) for d in devices)} "
            f"with {format_bytes(reserve)} reserved on each, under any layer "
            "partition; use more or larger devices, a quantized checkpoint or a "
            "larger --tensor-parallel-size"
        )
    hi = max(blocks(s, a, a + 1) for s in range(pp) for a in range(n))
    lo = 0
    while lo < hi:  # largest N with a feasible partition
        mid = (lo + hi + 1) // 2
        if _reachable(blocks, pp, n, mid, n) is not None:
            lo = mid
        else:
            hi = mid - 1
    best_n = lo
    k_lo, k_hi = cdiv(n, pp), n
    while k_lo < k_hi:  # smallest largest-stage at that capacity
        mid = (k_lo + k_hi) // 2
        if _reachable(blocks, pp, n, best_n, mid) is not None:
            k_hi = mid
        else:
            k_lo = mid + 1
    reach = _reachable(blocks, pp, n, best_n, k_lo)
    assert reach is not None
    partition = _backtrack(blocks, reach, pp, n, best_n, k_lo)
    return evaluate_partition(cost, partition, devices, reserve)


def _reachable(
    blocks: Callable[[int, int, int], int], pp: int, n: int, need: int, max_layers: int
) -> list[list[bool]] | None:
    """``reach[s][a]``: stages before ``s`` can hold layers [0, a) with ``need``."""
    reach = [[False] * (n + 1) for _ in range(pp + 1)]
    reach[0][0] = True
    for s in range(pp):
        last = s == pp - 1
        for a in range(n):
            if not reach[s][a]:
                continue
            top = n if last else min(a + max_layers, n - (pp - 1 - s))
            if last:
                if top - a <= max_layers and blocks(s, a, n) >= need:
                    reach[s + 1][n] = True
                continue
            # blocks(s, a, b) falls as b grows: find the largest b that fits.
            lo, hi = a, top
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks(s, a, mid) >= need:
                    lo = mid
                else:
                    hi = mid - 1
            for b in range(a + 1, lo + 1):
                reach[s + 1][b] = True
    return reach if reach[pp][n] else None


def _backtrack(
    blocks: Callable[[int, int, int], int],
    reach: list[list[bool]],
    pp: int,
    n: int,
    need: int,
    max_layers: int,
) -> list[int]:
    """Walk back from the last stage, preferring boundaries near the even split."""
    even = [0, *accumulate(km.default_partition(n, pp))]
    end, parts = n, []
    for s in range(pp - 1, -1, -1):
        starts = [
            a
            for a in range(max(0, end - max_layers), end)
            if reach[s][a] and blocks(s, a, end) >= need
        ]
        a = min(starts, key=lambda x: (abs(x - even[s]), x))
        parts.append(end - a)
        end = a
    return parts[::-1]


@dataclass(frozen=True)
class Recommendation:
    """Best layer partition for a heterogeneous pipeline, and the even one."""

    device_memory: list[int]
    reserve_bytes: int
    best: PartitionFit
    even: PartitionFit
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
    cost = PipelineCost(
        num_layers=info.num_layers,
        bytes_per_block=costs.bytes_per_block,
        layer_weights=info.weights.per_layer,
        first_stage_bytes=first,
        last_stage_bytes=last,
        tp=setup.tp,
    )
    even = evaluate_partition(
        cost, km.default_partition(info.num_layers, setup.pp), devices, reserve
    )
    best = best_partition(cost, devices, reserve)
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
    info: ModelInfo, setup: Setup, best: PartitionFit, bpb: Sequence[int]
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
