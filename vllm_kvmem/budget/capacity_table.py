"""The startup capacity table: one log line per engine of every rank's KV
cache (layers, bytes, blocks, tokens and concurrency, as vLLM counts them),
whichever budget sized it; with a pipeline-wide budget, each stage's share
next to what vLLM would have given it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget.pp_prop import BUDGET_FLAG, FLAG
from vllm_kvmem.budget.runtime import BudgetPlan
from vllm_kvmem.core import kv_arith
from vllm_kvmem.core.table import BAR, render_table
from vllm_kvmem.core.units import gib

logger = init_logger("vllm.kvmem.capacity_table")


def report_rows(vllm_config: Any, configs: Sequence[Any]) -> list[dict[str, Any]]:
    """Per rank: layers, KV bytes, blocks, tokens and concurrency (vLLM's math)."""
    stages = va.stages_of_configs(configs)
    rows = []
    for rank, cfg in enumerate(configs):
        tokens, conc = va.capacity(vllm_config, cfg)
        rows.append(
            dict(
                rank=rank,
                stage=stages[rank],
                layers=len(va.layer_names(cfg)),
                kv_bytes=va.reserved_bytes(cfg),
                blocks=cfg.num_blocks,
                tokens=tokens,
                concurrency=conc,
            )
        )
    return rows


def log_startup_report(
    vllm_config: Any, configs: Sequence[Any], plan: BudgetPlan
) -> None:
    """Log the table for the configs vLLM built from ``plan``; its title says
    which budget sized the cache, and a split plan adds each rank's share."""
    title = plan.title or _vllm_sized_title(vllm_config)
    rows = report_rows(vllm_config, configs)
    extra: dict[str, list[str]] = {}
    trailer: list[str] = []
    if plan.mode == "split" and plan.memory is not None:
        extra, trailer = comparison_columns(vllm_config, configs, plan)
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
    head = f"KV cache per rank ({title}; max_model_len {max_len:,}):"
    logger.info("\n".join([head, *table, *trailer]))


def _vllm_sized_title(vllm_config: Any) -> str:
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if budget is None:
        return "profiled memory"
    return f"{BUDGET_FLAG} {gib(budget)} GiB per rank"


def comparison_columns(
    vllm_config: Any, configs: Sequence[Any], plan: BudgetPlan
) -> tuple[dict[str, list[str]], list[str]]:
    """Startup-report columns of a split ``plan``: each rank's share, and what
    the same budget gives without the flag (every rank handed the whole
    budget, then cut by vLLM to the smallest block count, PR #25164). Bytes
    per block are the plan's: the configs were built from them."""
    budget = int(vllm_config.cache_config.kv_cache_memory_bytes)
    groups = [c.kv_cache_groups for c in configs]
    bpb = plan.bytes_per_block or []
    shares = plan.memory or []
    base_blocks = kv_arith.uniform_blocks(budget, bpb)
    cols: dict[str, list[str]] = {
        "share GiB": [],
        "w/o flag: KV GiB": [],
        "tokens": [],
        "conc": [],
    }
    base_bytes = []
    for g, b, share in zip(groups, bpb, shares):
        base = va.config_for_blocks(vllm_config, g, base_blocks)
        tokens, conc = va.capacity(vllm_config, base)
        base_bytes.append(base.num_blocks * b)
        cols["share GiB"].append(gib(share, 3))
        cols["w/o flag: KV GiB"].append(gib(base_bytes[-1], 3))
        cols["tokens"].append(f"{tokens:,}")
        cols["conc"].append(f"{conc:.2f}x")
    firsts = va.first_rank_of_each_stage(va.stages_of_configs(configs))  # one TP shard
    total = sum(configs[i].num_blocks * bpb[i] for i in firsts)
    base_total = sum(base_bytes[i] for i in firsts)
    trailer = [
        f"  total KV per TP shard: {gib(total)} GiB of the {gib(budget)} GiB "
        f"pipeline-wide budget (without {FLAG}: {gib(base_total)} GiB, every "
        f"rank handed {gib(budget)} GiB)"
    ]
    return cols, trailer
