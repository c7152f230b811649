"""A plan: what a budget gives, what a target needs, for one model and setup.

``plan`` assembles the whole ``kvmem plan`` report; ``plan_capacity`` is the
one-budget prediction the engine-agreement tests compare with real engines.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_kvmem.core.units import flag_size, format_bytes, parse_positive_size
from vllm_kvmem.host_tier.disk_files import HEADER_BYTES
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.costs import KindRow, KVCosts, StageRow
from vllm_kvmem.planner.model import ModelInfo, as_model
from vllm_kvmem.planner.partition import (
    DEFAULT_RESERVE,
    Recommendation,
    recommend_partition,
)
from vllm_kvmem.planner.setup import Options, Setup, resolve_setup


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
    tiers: list[TierRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class TierRow:
    """What ``--kv-host-cache-bytes`` or ``--kv-disk-cache-bytes`` holds, in
    the units the device KV cache is reported in."""

    tier: str  # "host" or "disk"
    flag: str
    bytes: int
    block_bytes: int  # one block in that tier, as its flag counts it
    blocks: int
    tokens: int
    vs_device: float | None  # tokens over the device KV cache's
    scope: str


def plan_capacity(
    model: str | os.PathLike[str] | ModelInfo,
    options: Options | None = None,
    *,
    budget_bytes: int | str | None = None,
    budget_tokens: int | str | None = None,
    proportional: bool = False,
    strict: bool = True,
    **overrides: Any,
) -> km.Capacity:
    """Predict what an engine allocates for one budget (the engine-agreement API).

    Exactly one of ``budget_bytes`` (``--kv-cache-memory-bytes``) and
    ``budget_tokens`` (``--kv-cache-tokens``). ``proportional`` is
    ``--enable-pp-prop-kv-cache``. ``strict``: raise, with the minimum, when
    the budget cannot start (one max_model_len request plus the null block).
    Engine options: ``options``, or its fields as keywords (:class:`Options`).
    """
    opts = replace(options or Options(), **overrides)
    info = as_model(model, opts.dtype)
    setup = resolve_setup(info, opts)
    costs = KVCosts(info, setup)
    kind, value = _one_budget(budget_bytes, budget_tokens)
    if kind == "tokens":
        cap = costs.token_capacity(value)
    else:
        cap = costs.capacity(value, proportional)
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
        return "tokens", parse_positive_size(budget_tokens, flag="--kv-cache-tokens")
    if budget_bytes is not None:
        return "bytes", parse_positive_size(
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
        f"--kv-cache-memory-bytes {format_bytes(cap.budget_bytes)} is too small for "
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
        f"--kv-cache-memory-bytes {format_bytes(per_gpu.budget_bytes)} is too small "
        f"for one {setup.max_model_len:,}-token request "
        f"({per_gpu.blocks_per_request + 1:,} blocks per stage with vLLM's null "
        f"block); use at least {flag_size(per_gpu.min_budget)} per GPU, or "
        f"{flag_size(prop.min_budget)} pipeline-wide with --enable-pp-prop-kv-cache, "
        "or lower --max-model-len"
    )


def plan(
    model: str | os.PathLike[str] | ModelInfo,
    options: Options | None = None,
    *,
    budget_bytes: int | str | None = None,
    budget_tokens: int | str | None = None,
    target_concurrency: float | None = None,
    device_memory: Sequence[int | str] | None = None,
    reserve_memory: int | str = DEFAULT_RESERVE,
    host_bytes: int | str | None = None,
    disk_bytes: int | str | None = None,
    **overrides: Any,
) -> Plan:
    """The whole report: KV costs, both budget modes, a target, a partition,
    and the host and disk tiers' capacity (``--kv-host-cache-bytes``,
    ``--kv-disk-cache-bytes``).

    Engine options: ``options``, or its fields as keywords (:class:`Options`);
    ``pp`` defaults to the number of ``device_memory`` entries, else 1.
    """
    opts = replace(options or Options(), **overrides)
    if opts.pp is None:
        opts = replace(opts, pp=len(device_memory) if device_memory else 1)
    info = as_model(model, opts.dtype)
    setup = resolve_setup(info, opts)
    hetero = None
    if device_memory is not None:
        hetero = recommend_partition(
            info, setup, device_memory=device_memory, reserve_memory=reserve_memory
        )
        if opts.partition is None:
            setup = replace(
                setup,
                partition=hetero.best.partition,
                partition_source="recommended for --device-memory",
            )
    costs = KVCosts(info, setup)
    out = Plan(
        model=_model_summary(info),
        setup=setup,
        kinds=costs.kind_rows(),
        stages=costs.stage_rows(),
        blocks_per_request=costs.bpr,
        min_budget_per_gpu=km.min_budget(costs.bpb, costs.bpr, proportional=False),
        min_budget_proportional=km.min_budget(costs.bpb, costs.bpr, proportional=True),
    )
    if budget_bytes is not None or budget_tokens is not None:
        kind, value = _one_budget(budget_bytes, budget_tokens)
        out.budget = {kind: value}
        if kind == "tokens":
            out.tokens_capacity = costs.token_capacity(value)
            caps = [out.tokens_capacity]
        else:
            out.without_split = costs.capacity(value, proportional=False)
            out.with_split = costs.capacity(value, proportional=True)
            caps = [out.without_split, out.with_split]
        if not any(c.fits for c in caps):
            raise ValueError(_too_small_both(caps, setup))
    if target_concurrency is not None:
        out.target = km.budget_for_concurrency(
            costs.bpb,
            concurrency=target_concurrency,
            blocks_per_request=costs.bpr,
            max_model_len=setup.max_model_len,
        )
    out.hetero = hetero
    out.tiers = tier_rows(out, host_bytes, disk_bytes)
    if any(k.kind == km.LayerKind.SLIDING for k in out.kinds):
        out.notes.append(
            "sliding-window blocks per request depend on max_num_batched_tokens "
            f"({setup.max_num_batched_tokens:,}) x max_concurrent_batches "
            f"({setup.max_concurrent_batches}); pass the values vLLM uses "
            "(--max-num-batched-tokens, --max-concurrent-batches)"
        )
    return out


def tier_rows(
    p: Plan, host_bytes: int | str | None, disk_bytes: int | str | None
) -> list[TierRow]:
    """The host tier holds one slot per block for every stage's layers of one
    TP shard (``--kv-host-cache-bytes`` is per TP shard); the disk tier's
    budget covers its whole directory: a file per block for every rank, each
    with a header."""
    if disk_bytes is not None and host_bytes is None:
        raise ValueError(
            f"--kv-disk-cache-bytes={disk_bytes!r}: the disk tier sits behind the "
            "host tier; give --kv-host-cache-bytes too"
        )
    s = p.setup
    device = _device_tokens(p)
    slot = sum(st.bytes_per_block for st in p.stages)
    specs = []
    if host_bytes is not None:
        n = parse_positive_size(host_bytes, flag="--kv-host-cache-bytes")
        specs.append(("host", "--kv-host-cache-bytes", n, slot, "per TP shard"))
    if disk_bytes is not None:
        n = parse_positive_size(disk_bytes, flag="--kv-disk-cache-bytes")
        files = s.tp * s.pp
        specs.append(
            (
                "disk",
                "--kv-disk-cache-bytes",
                n,
                s.tp * slot + files * HEADER_BYTES,
                f"the whole directory: {files} file(s) per block (every TP and "
                f"PP rank), {HEADER_BYTES}-byte headers included; over budget "
                "it evicts down to 90%",
            )
        )
    rows = []
    for tier, flag, n, block_bytes, scope in specs:
        blocks = n // block_bytes
        tokens = blocks * s.block_size
        rows.append(
            TierRow(
                tier=tier,
                flag=flag,
                bytes=n,
                block_bytes=block_bytes,
                blocks=blocks,
                tokens=tokens,
                vs_device=tokens / device if device else None,
                scope=scope,
            )
        )
    return rows


def _device_tokens(p: Plan) -> int | None:
    """The device KV cache's tokens for the budget given (per-GPU mode)."""
    for cap in (p.without_split, p.tokens_capacity):
        if cap is not None and cap.fits:
            return cap.tokens
    return None


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
