"""The engine's KV budget: bytes per rank, pipeline-wide bytes, or tokens.

* Workers: :func:`report_device_limit` is what each worker reports to the
  engine when the engine sizes the cache, instead of a budget.
* Engine core: :func:`plan_budget` picks the budget mode and plans each rank's
  blocks, checked against its device. On vLLM 0.32
  :func:`plan_kv_cache_configs` replaces the ``get_kv_cache_configs`` call and
  hands vLLM's own planner those bytes; on 0.33 :func:`stash_plan` keeps the
  plan for vllm-kvmem's ``KVCacheConfigBuilder`` (:func:`planned_blocks`) and
  :func:`configs_ready` runs when vLLM's planner is done. Either way one
  startup table says what each rank got (``capacity_table``).

The token budget (``token_budget``) is one more mode of the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.budget import pp_prop
from vllm_kvmem.budget.capacity_table import log_startup_report
from vllm_kvmem.budget.pp_prop import BUDGET_FLAG
from vllm_kvmem.budget.runtime import BudgetPlan, BudgetRuntime, DeviceLimit
from vllm_kvmem.budget.token_budget import (
    TOKENS_FLAG,
    TOKENS_PLACEHOLDER_BYTES,
    token_budget_memory,
)
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import gib

logger = init_logger("vllm.kvmem.kv_budget")


# ------------------------------------------------------------ workers


def uses_device_limits(vllm_config: Any) -> bool:
    """Whether workers report their device's KV limit instead of a budget."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if cfg.kv_cache_tokens is not None:
        return True
    return pp_prop.is_active(vllm_config, cfg)


def report_device_limit(worker: Any, limit: DeviceLimit) -> int:
    """What a worker returns from ``determine_available_memory`` when the engine
    sizes the KV cache (pipeline-wide budget or token budget): free memory
    less what is allocated after the KV cache (``DeviceLimit``)."""
    budget = worker.cache_config.kv_cache_memory_bytes
    how = (
        f"KV cache budget {gib(budget)} GiB ({BUDGET_FLAG}) is pipeline-wide with "
        f"{pp_prop.FLAG}"
    )
    if budget == TOKENS_PLACEHOLDER_BYTES:
        how = f"KV cache is sized in tokens ({TOKENS_FLAG})"
    logger.info(
        "%s; this rank's device can hold up to %s GiB of KV cache (%s); the "
        "engine assigns this rank's share.",
        how,
        gib(limit.kv_bytes),
        limit.describe(),
    )
    return limit.kv_bytes


# ------------------------------------------------------------ engine core


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
    log_startup_report(vllm_config, configs, plan.title, plan.shares)
    return configs


# ------------------------------------------- engine core, vLLM 0.33 (builder)


def stash_plan(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], limits: list[int]
) -> list[int] | None:
    """vLLM 0.33: plan the budget where the engine core has every worker's
    specs and limits (after they are measured, before vLLM plans), for
    vllm-kvmem's ``KVCacheConfigBuilder`` to apply (changes ``vllm_config``'s
    ``additional_config``: :class:`BudgetRuntime`). The same checks and
    errors as on 0.32. Returns each rank's planned bytes, for vLLM's planner
    to plan from as on 0.32 (``--max-model-len auto`` is then fitted to the
    budget), or None where vLLM's own figures stand."""
    plan = plan_budget(vllm_config, kv_cache_specs, limits)
    runtime = BudgetRuntime.from_vllm_config(vllm_config)
    replace(runtime, plan=plan).store(vllm_config)
    return plan.memory


def planned_blocks(vllm_config: Any, num_blocks: int) -> int:
    """The block count vllm-kvmem's builder gives for vLLM's ``num_blocks``: the
    plan's, never more than vLLM's (what the device holds), and vLLM's own
    outside the engine core's planning (profiling, workers)."""
    plan = BudgetRuntime.from_vllm_config(vllm_config).plan
    if plan is None or plan.blocks is None:
        return num_blocks
    return min(num_blocks, plan.blocks)


def configs_ready(vllm_config: Any, kv_cache_configs: list[Any]) -> BudgetPlan:
    """vLLM 0.33: the engine core's configs are final; end the plan (later
    builder calls get vLLM's own block counts), log the startup table and
    return the plan that was applied."""
    runtime = BudgetRuntime.from_vllm_config(vllm_config)
    plan = runtime.plan
    if plan is None:
        plan = BudgetPlan(_vllm_sized_title(vllm_config))
    else:
        replace(runtime, plan=None).store(vllm_config)
    if any(c.kv_cache_groups for c in kv_cache_configs):
        log_startup_report(vllm_config, kv_cache_configs, plan.title, plan.shares)
    return plan
