"""The startup capacity table: one log line per engine of every rank's KV
cache (layers, bytes, blocks, tokens and concurrency, as vLLM counts them),
whichever budget sized it; with a pipeline-wide budget, each stage's share
next to what vLLM would have given it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget import pp_prop
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
    vllm_config: Any,
    configs: Sequence[Any],
    title: str,
    shares: Sequence[int] | None = None,
) -> None:
    """Log the table; ``title`` says which budget sized the cache, ``shares``
    are the per-rank bytes of a pipeline-wide budget."""
    rows = report_rows(vllm_config, configs)
    extra: dict[str, list[str]] = {}
    trailer: list[str] = []
    if shares is not None:
        extra, trailer = pp_prop.comparison_columns(vllm_config, configs, shares)
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
