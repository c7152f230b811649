"""The engine core's KV budget: bytes, pipeline-wide bytes, or tokens.

One entry point, :func:`plan_kv_cache_configs`, replaces vLLM's
``get_kv_cache_configs`` call in the engine core. It picks the budget mode,
lets vLLM's own planner build every worker's config, and logs one startup
table of what each rank got.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import pp_prop
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core import kv_math
from vllm_kvmem.core.table import BAR, render_table
from vllm_kvmem.core.units import gib, mib
from vllm_kvmem.device_limits import limits_for

logger = init_logger("vllm.kvmem.kv_budget")

TOKENS_FLAG = KVMemConfig.flag("kv_cache_tokens")


def uses_device_limits(vllm_config: Any) -> bool:
    """Whether workers report their device's KV limit instead of a budget."""
    return pp_prop.is_active(vllm_config) or tokens_budget(vllm_config) is not None


def tokens_budget(vllm_config: Any) -> int | None:
    return KVMemConfig.from_vllm_config(vllm_config).kv_cache_tokens


def plan_kv_cache_configs(
    original: Callable[..., list[Any]],
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
) -> list[Any]:
    if not any(kv_cache_specs):
        return original(vllm_config, kv_cache_specs, available_memory)
    extra: dict[str, list[str]] = {}
    trailer: list[str] = []
    if (tokens := tokens_budget(vllm_config)) is not None:
        configs = token_budget_configs(
            original, vllm_config, kv_cache_specs, available_memory, tokens
        )
        title = f"{TOKENS_FLAG} {tokens:,}"
    elif pp_prop.is_active(vllm_config):
        configs, extra, trailer = pp_prop.proportional_kv_cache_configs(
            original, vllm_config, kv_cache_specs, available_memory
        )
        title = (
            f"{pp_prop.FLAG}: {gib(vllm_config.cache_config.kv_cache_memory_bytes)}"
            " GiB pipeline-wide, split by KV bytes per block"
        )
    else:
        configs = original(vllm_config, kv_cache_specs, available_memory)
        budget = vllm_config.cache_config.kv_cache_memory_bytes
        title = (
            f"--kv-cache-memory-bytes {gib(budget)} GiB per rank"
            if budget is not None
            else "profiled memory"
        )
    log_startup_report(vllm_config, kv_cache_specs, configs, title, extra, trailer)
    from vllm_kvmem.host_tier import record_runtime

    record_runtime(vllm_config, configs)
    return configs


# ------------------------------------------------------------------- tokens


def pool_bytes_per_block(vllm_config: Any, groups: Sequence[Any]) -> int:
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block

    return _pool_bytes_per_block(vllm_config, list(groups))


def token_budget_configs(
    original: Callable[..., list[Any]],
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    limits: list[int],
    tokens: int,
) -> list[Any]:
    """Give every rank exactly the blocks ``tokens`` need, from its own specs."""
    groups = pp_prop.worker_groups(vllm_config, kv_cache_specs)
    # All ranks share one block table, so one block count; the largest count any
    # rank's groups need (they agree unless a stage lacks a group) wins.
    blocks = max(
        kv_math.blocks_for_tokens(tokens, partial(_tokens_in, vllm_config, g))
        for g in groups
        if g
    )
    if vllm_config.model_config.original_max_model_len != -1:
        _check_holds_a_sequence(vllm_config, groups, blocks, tokens)
    memory = [blocks * pool_bytes_per_block(vllm_config, g) if g else 0 for g in groups]
    described = limits_for(vllm_config, limits)
    for rank, (need, limit) in enumerate(zip(memory, limits)):
        if need > limit:
            bpb = pool_bytes_per_block(vllm_config, groups[rank])
            fit = _tokens_in(vllm_config, groups[rank], limit // bpb)
            raise ValueError(
                f"{TOKENS_FLAG} {tokens:,}: rank {rank} needs {blocks:,} blocks = "
                f"{mib(need)} of KV cache, more than its device can hold "
                f"({described[rank].describe()}). Use "
                f"{TOKENS_FLAG} {fit:,} or less."
            )
    logger.info(
        "%s %s: %d blocks on every rank, %s.",
        TOKENS_FLAG,
        f"{tokens:,}",
        blocks,
        ", ".join(f"rank {r} {mib(m)}" for r, m in enumerate(memory)),
    )
    return original(vllm_config, kv_cache_specs, memory)


def _check_holds_a_sequence(
    vllm_config: Any, groups: Sequence[Any], blocks: int, tokens: int
) -> None:
    """vLLM refuses a cache that cannot hold one max_model_len request next to
    its null block; say so in tokens, with the smallest budget that works."""
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups

    need = max(
        _max_memory_usage_bytes_from_groups(vllm_config, g)
        // pool_bytes_per_block(vllm_config, g)
        + 1
        for g in groups
        if g
    )
    if blocks >= need:
        return
    least = max(_tokens_in(vllm_config, g, need) for g in groups if g)
    max_len = vllm_config.model_config.max_model_len
    raise ValueError(
        f"{TOKENS_FLAG} {tokens:,} cannot hold one {max_len:,}-token sequence "
        f"(max_model_len) next to vLLM's null block: that needs {need:,} blocks. "
        f"Use {TOKENS_FLAG} {least:,} or more, or lower --max-model-len."
    )


def _tokens_in(vllm_config: Any, groups: Sequence[Any], blocks: int) -> int:
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_capacity,
        get_kv_cache_config_from_groups,
    )

    bpb = pool_bytes_per_block(vllm_config, groups)
    cfg = get_kv_cache_config_from_groups(vllm_config, list(groups), blocks * bpb)
    return get_kv_cache_capacity(vllm_config, cfg)[0]


# ------------------------------------------------------------- the report


def report_rows(vllm_config: Any, configs: Sequence[Any]) -> list[dict[str, Any]]:
    """Per rank: layers, KV bytes, blocks, tokens and concurrency (vLLM's math)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    stages: dict[frozenset[str], int] = {}
    rows = []
    for rank, cfg in enumerate(configs):
        layers = frozenset(n for g in cfg.kv_cache_groups for n in g.layer_names)
        tokens, conc = get_kv_cache_capacity(vllm_config, cfg)
        rows.append(
            dict(
                rank=rank,
                stage=stages.setdefault(layers, len(stages)),
                layers=len(layers),
                kv_bytes=max((t.size for t in cfg.kv_cache_tensors), default=0),
                blocks=cfg.num_blocks,
                tokens=tokens,
                concurrency=conc,
            )
        )
    return rows


def log_startup_report(
    vllm_config: Any,
    kv_cache_specs: Sequence[Any],
    configs: Sequence[Any],
    title: str,
    extra: dict[str, list[str]] | None = None,
    trailer: Sequence[str] = (),
) -> None:
    rows = report_rows(vllm_config, configs)
    extra = extra or {}
    max_len = vllm_config.model_config.max_model_len
    headers = ["rank", "stage", "layers", "KV GiB", "blocks", "tokens", "conc"]
    widths = [4, 5, 6, 8, 9, 11, 8]
    if extra:
        headers += [BAR, *extra]
        widths += [1, *(10 for _ in extra)]
    table = render_table(
        headers,
        [
            (
                r["rank"],
                r["stage"],
                r["layers"],
                gib(r["kv_bytes"], 3),
                f"{r['blocks']:,}",
                f"{r['tokens']:,}",
                f"{r['concurrency']:.2f}x",
                *(v[i] for v in extra.values()),
            )
            for i, r in enumerate(rows)
        ],
        widths=widths,
        left=0,
        sep=" ",
        indent="  ",
    )
    title = f"KV cache per rank ({title}; max_model_len {max_len:,}):"
    logger.info("\n".join([title, *table, *trailer]))
