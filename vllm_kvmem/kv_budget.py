"""The engine's KV budget: bytes per rank, pipeline-wide bytes, or tokens.

* API server: :func:`check_budget_flags` refuses two budgets at once, and
  :func:`set_tokens_placeholder` stands in for a token budget's bytes until
  the engine sees the KV specs.
* Workers: :func:`report_device_limit` is what each worker reports to the
  engine when the engine sizes the cache, instead of a budget.
* Engine core: :func:`plan_budget` picks the budget mode and plans each rank's
  blocks, checked against its device. On vLLM 0.32
  :func:`plan_kv_cache_configs` replaces the ``get_kv_cache_configs`` call and
  hands vLLM's own planner those bytes; on 0.33 :func:`stash_plan` keeps the
  plan for vllm-kvmem's ``KVCacheConfigBuilder`` (:func:`planned_blocks`) and
  :func:`configs_ready` runs when vLLM's planner is done. Either way one
  startup table says what each rank got.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import pp_prop
from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core import kv_math
from vllm_kvmem.core.table import BAR, render_table
from vllm_kvmem.core.units import gib, mib
from vllm_kvmem.device_limits import RUNTIME_KEY, DeviceLimit, limits_for

logger = init_logger("vllm.kvmem.kv_budget")

TOKENS_FLAG = KVMemConfig.flag("kv_cache_tokens")
BUDGET_FLAG = pp_prop.BUDGET_FLAG

# A token budget has no byte figure until the engine sees the KV specs. Until
# then vLLM's explicit-budget path runs with this placeholder (no profiling, and
# the CPU worker's startup memory check is skipped); our patches replace it.
TOKENS_PLACEHOLDER_BYTES = 1


# ------------------------------------------------------------ API server


def check_budget_flags(vllm_config: Any, cfg: KVMemConfig) -> None:
    """A token budget and a byte budget cannot both size the cache; changes
    nothing."""
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if cfg.kv_cache_tokens is not None and budget not in (
        None,
        TOKENS_PLACEHOLDER_BYTES,
    ):
        raise ValueError(
            f"{TOKENS_FLAG} {cfg.kv_cache_tokens:,} and {BUDGET_FLAG} "
            f"{budget:,} both size the KV cache; give one of them (on CPU, "
            f"VLLM_CPU_KVCACHE_SPACE also sets {BUDGET_FLAG})."
        )


def set_tokens_placeholder(vllm_config: Any, cfg: KVMemConfig) -> None:
    """With a token budget, set vLLM's byte budget to the placeholder (changes
    ``vllm_config``): vLLM then skips profiling and the engine sizes the cache."""
    if cfg.kv_cache_tokens is not None:
        vllm_config.cache_config.kv_cache_memory_bytes = TOKENS_PLACEHOLDER_BYTES


# ------------------------------------------------------------ workers


def uses_device_limits(vllm_config: Any) -> bool:
    """Whether workers report their device's KV limit instead of a budget."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    return cfg.kv_cache_tokens is not None or pp_prop.is_active(vllm_config, cfg)


def report_device_limit(worker: Any, limit: DeviceLimit) -> int:
    """What a worker returns from ``determine_available_memory`` when the engine
    sizes the KV cache (pipeline-wide budget or token budget): free memory
    less what is allocated after the KV cache (``DeviceLimit``)."""
    budget = worker.cache_config.kv_cache_memory_bytes
    how = (
        f"KV cache budget {gib(budget)} GiB ({BUDGET_FLAG}) is pipeline-wide with "
        f"{pp_prop.FLAG}"
        if budget != TOKENS_PLACEHOLDER_BYTES
        else f"KV cache is sized in tokens ({TOKENS_FLAG})"
    )
    logger.info(
        "%s; this rank's device can hold up to %s GiB of KV cache (%s); the "
        "engine assigns this rank's share.",
        how,
        gib(limit.kv_bytes),
        limit.describe(),
    )
    return limit.kv_bytes


# ------------------------------------------------------------ engine core


@dataclass(frozen=True)
class BudgetPlan:
    """What the engine's budget mode decides before vLLM builds the configs."""

    title: str
    """The startup table's title: which budget sized the cache."""
    blocks: int | None = None
    """The block count every rank gets; None: vLLM's own count."""
    memory: list[int] | None = None
    """Per-rank bytes for vLLM's planner (``blocks`` of each rank's groups)."""
    shares: list[int] | None = None
    """Per-rank shares of a pipeline-wide budget (the table's extra columns)."""


def plan_budget(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
) -> BudgetPlan:
    """The budget mode's per-rank figures, checked against each worker's device
    limit (``available_memory``) and against one max_model_len sequence."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if (tokens := cfg.kv_cache_tokens) is not None:
        blocks, memory = token_budget_memory(
            vllm_config, kv_cache_specs, available_memory, tokens
        )
        return BudgetPlan(f"{TOKENS_FLAG} {tokens:,}", blocks, memory)
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if pp_prop.is_active(vllm_config, cfg):
        title = (
            f"{pp_prop.FLAG}: {gib(budget)} GiB pipeline-wide, split by KV bytes "
            "per block"
        )
        split = pp_prop.proportional_shares(
            vllm_config, kv_cache_specs, available_memory
        )
        if split is None:
            return BudgetPlan(title)
        shares, blocks = split
        return BudgetPlan(title, blocks, shares, shares)
    return BudgetPlan(_vllm_sized_title(vllm_config))


def _vllm_sized_title(vllm_config: Any) -> str:
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    return (
        f"{BUDGET_FLAG} {gib(budget)} GiB per rank"
        if budget is not None
        else "profiled memory"
    )


def plan_kv_cache_configs(
    original: Callable[..., list[Any]],
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
) -> list[Any]:
    """vLLM 0.32's ``get_kv_cache_configs`` under the budget mode: vLLM's own
    planner gets each rank's planned bytes instead of its device limit."""
    if not any(kv_cache_specs):
        return original(vllm_config, kv_cache_specs, available_memory)
    plan = plan_budget(vllm_config, kv_cache_specs, available_memory)
    configs = original(vllm_config, kv_cache_specs, plan.memory or available_memory)
    log_startup_report(vllm_config, configs, plan)
    return configs


def token_budget_memory(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    limits: list[int],
    tokens: int,
) -> tuple[int, list[int]]:
    """Every rank gets exactly the blocks ``tokens`` need, from its own specs:
    ``(blocks, bytes per rank)``."""
    groups = va.worker_groups(vllm_config, kv_cache_specs)
    # All ranks share one block table, so one block count; the largest count any
    # rank's groups need (they agree unless a stage lacks a group) wins.
    blocks = max(
        kv_math.blocks_for_tokens(tokens, partial(va.tokens_in, vllm_config, g))
        for g in groups
        if g
    )
    if vllm_config.model_config.original_max_model_len != -1:
        _check_holds_a_sequence(vllm_config, groups, blocks, tokens)
    bpb = [va.bytes_per_block(vllm_config, g) if g else 0 for g in groups]
    memory = [blocks * b for b in bpb]
    described = limits_for(vllm_config, limits)
    for rank, (need, limit) in enumerate(zip(memory, limits)):
        if need > limit:
            fit = va.tokens_in(vllm_config, groups[rank], limit // bpb[rank])
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
    return blocks, memory


# ------------------------------------------- engine core, vLLM 0.33 (builder)

_PLAN_KEY = "kv_plan"


def stash_plan(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], limits: list[int]
) -> None:
    """vLLM 0.33: plan the budget where the engine core has every worker's
    specs and limits (after they are measured, before vLLM plans), for
    vllm-kvmem's ``KVCacheConfigBuilder`` to apply (changes ``vllm_config``'s
    ``additional_config``). The same checks and errors as on 0.32."""
    if vllm_config.model_config.original_max_model_len == -1:
        cfg = KVMemConfig.from_vllm_config(vllm_config)
        flag = TOKENS_FLAG if cfg.kv_cache_tokens is not None else pp_prop.FLAG
        raise ValueError(
            f"{flag} with --max-model-len auto (-1) is not supported on vLLM 0.33 "
            f"yet: vLLM 0.33 fits max_model_len to the device's memory before "
            f"vllm-kvmem's budget applies. Give --max-model-len explicitly."
        )
    plan = plan_budget(vllm_config, kv_cache_specs, limits)
    runtime = vllm_config.additional_config.setdefault(RUNTIME_KEY, {})
    runtime[_PLAN_KEY] = asdict(plan)


def planned_blocks(vllm_config: Any, num_blocks: int) -> int:
    """The block count vllm-kvmem's builder gives for vLLM's ``num_blocks``: the
    plan's, never more than vLLM's (what the device holds), and vLLM's own
    outside the engine core's planning (profiling, workers)."""
    runtime = (vllm_config.additional_config or {}).get(RUNTIME_KEY, {})
    plan = runtime.get(_PLAN_KEY)
    if plan is None or plan["blocks"] is None:
        return num_blocks
    return min(num_blocks, plan["blocks"])


def configs_ready(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """vLLM 0.33: the engine core's configs are final; log the startup table
    and end the plan (later builder calls get vLLM's own block counts)."""
    runtime = (vllm_config.additional_config or {}).get(RUNTIME_KEY, {})
    stashed = runtime.pop(_PLAN_KEY, None)
    if not any(c.kv_cache_groups for c in kv_cache_configs):
        return
    plan = (
        BudgetPlan(**stashed) if stashed else BudgetPlan(_vllm_sized_title(vllm_config))
    )
    log_startup_report(vllm_config, kv_cache_configs, plan)


def _check_holds_a_sequence(
    vllm_config: Any, groups: Sequence[Any], blocks: int, tokens: int
) -> None:
    """vLLM refuses a cache that cannot hold one max_model_len request next to
    its null block; say so in tokens, with the smallest budget that works."""
    need = max(
        va.sequence_bytes(vllm_config, g) // va.bytes_per_block(vllm_config, g) + 1
        for g in groups
        if g
    )
    if blocks >= need:
        return
    least = max(va.tokens_in(vllm_config, g, need) for g in groups if g)
    max_len = vllm_config.model_config.max_model_len
    raise ValueError(
        f"{TOKENS_FLAG} {tokens:,} cannot hold one {max_len:,}-token sequence "
        f"(max_model_len) next to vLLM's null block: that needs {need:,} blocks. "
        f"Use {TOKENS_FLAG} {least:,} or more, or lower --max-model-len."
    )


# ------------------------------------------------------------- the report


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
    rows = report_rows(vllm_config, configs)
    extra: dict[str, list[str]] = {}
    trailer: list[str] = []
    if plan.shares is not None:
        extra, trailer = pp_prop.comparison_columns(vllm_config, configs, plan.shares)
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
    title = f"KV cache per rank ({plan.title}; max_model_len {max_len:,}):"
    logger.info("\n".join([title, *table, *trailer]))
