"""The engine's KV budget: bytes per rank, pipeline-wide bytes, or tokens.

* Engine core: :func:`plan_kv_budget` is the one plan. It takes vLLM's config,
  every worker's KV specs and device limit, reads vLLM's figures once
  (``vllm_adapter.kv_figures``) and returns every rank's blocks and bytes,
  checked against its device and one max_model_len sequence, with the title
  that says which budget sized the cache (a :class:`BudgetPlan`).
* Its hooks only call it, then say what it planned. On vLLM 0.32
  :func:`plan_kv_cache_configs` replaces the ``get_kv_cache_configs`` call and
  hands vLLM's own planner the planned bytes; on 0.33 :func:`stash_plan`
  keeps the plan for vllm-kvmem's ``KVCacheConfigBuilder``
  (:func:`planned_blocks`) and :func:`configs_ready` runs when vLLM's planner
  is done. Either way one startup table says what each rank got
  (``capacity_table``).
* Workers: :func:`report_device_limit` is what each worker reports to the
  engine when the engine sizes the cache, instead of a budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget.capacity_table import log_startup_report
from vllm_kvmem.budget.pp_prop import BUDGET_FLAG, FLAG
from vllm_kvmem.budget.runtime import BudgetPlan, BudgetRuntime, DeviceLimit
from vllm_kvmem.budget.token_budget import TOKENS_FLAG, TOKENS_PLACEHOLDER_BYTES
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core import kv_arith
from vllm_kvmem.core.units import flag_size, gib, mib

logger = init_logger("vllm.kvmem.kv_budget")


def uses_device_limits(vllm_config: Any) -> bool:
    """Whether a budget mode sizes the cache, so that workers report their
    device's KV limit instead of a budget."""
    return (
        KVMemConfig.from_vllm_config(vllm_config).budget_mode(vllm_config) is not None
    )


# ------------------------------------------------------------ the plan


def plan_kv_budget(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], limits: list[int]
) -> BudgetPlan:
    """Every rank's KV cache under the budget mode, checked against its device
    limit (``limits``, each worker's, as it reported them) and against one
    max_model_len sequence; an empty plan where vLLM sizes the cache.

    vLLM's figures are read once (``vllm_adapter.kv_figures``); the rest is
    arithmetic over ints (``core.kv_arith``), so that the errors name exact
    figures. A token budget buys every rank the same blocks; a pipeline-wide
    budget is split so that every stage holds the same blocks.
    """
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    mode = cfg.budget_mode(vllm_config)
    if mode is None:
        return BudgetPlan()
    devices = BudgetRuntime.from_vllm_config(vllm_config).limits_for(limits)
    if mode == "tokens":
        title = f"{TOKENS_FLAG} {cfg.kv_cache_tokens:,}"
    else:
        title = f"{FLAG}: {gib(budget)} GiB pipeline-wide, split by KV bytes per block"
        if vllm_config.cache_config.num_gpu_blocks_override is not None:
            logger.warning(
                "%s: --num-gpu-blocks-override decides the block count; the "
                "pipeline-wide split is not applied.",
                FLAG,
            )
            return BudgetPlan(title)
    kv = va.kv_figures(vllm_config, kv_cache_specs)
    max_len = vllm_config.model_config.max_model_len
    if mode == "tokens":
        # The most blocks any rank's groups need (they agree unless a stage
        # lacks a group): all ranks share one block table.
        tokens = cfg.kv_cache_tokens
        blocks = max(
            kv_arith.blocks_for_tokens(tokens, partial(kv.tokens_in, r))
            for r in kv.ranks_with_kv
        )
        _check_token_blocks(kv, devices, tokens, blocks, max_len)
    else:
        blocks = _split_blocks(kv, devices, int(budget), max_len)
        if blocks is None:
            return BudgetPlan(title)
    memory = [blocks * b for b in kv.bytes_per_block]
    return BudgetPlan(title, mode, blocks, memory, kv.bytes_per_block)


def _check_token_blocks(
    kv: va.KVFigures, devices: list[DeviceLimit], tokens: int, blocks: int, max_len: int
) -> None:
    """Refuse a token budget whose blocks cannot hold one max_model_len
    sequence beside vLLM's null block (vLLM would), or do not fit a device;
    say so in tokens, with a budget that works."""
    bpb = kv.bytes_per_block
    if kv.sequence_bytes is not None:
        need = max(kv.sequence_bytes[r] // bpb[r] + 1 for r in kv.ranks_with_kv)
        if blocks < need:
            # The least budget that buys need blocks: one token more than
            # need - 2 hold.
            least = max(kv.tokens_in(r, need - 2) for r in kv.ranks_with_kv) + 1
            raise ValueError(
                f"{TOKENS_FLAG} {tokens:,} cannot hold one {max_len:,}-token "
                f"sequence (max_model_len) next to vLLM's null block: that needs "
                f"{need:,} blocks. Use {TOKENS_FLAG} {least:,} or more, or lower "
                "--max-model-len."
            )
    for rank in kv.ranks_with_kv:
        need, limit = blocks * bpb[rank], devices[rank]
        if need > limit.kv_bytes:
            # The null block is one of the blocks that fit.
            fit = kv.tokens_in(rank, limit.kv_bytes // bpb[rank] - 1)
            raise ValueError(
                f"{TOKENS_FLAG} {tokens:,}: rank {rank} needs {blocks:,} blocks = "
                f"{mib(need)} of KV cache, more than its device can hold "
                f"({limit.describe()}). Use {TOKENS_FLAG} {fit:,} or less."
            )


def _split_blocks(
    kv: va.KVFigures, devices: list[DeviceLimit], budget: int, max_len: int
) -> int | None:
    """The blocks every stage holds from its share of the pipeline-wide
    ``budget`` (``kv_arith.split_kv_budget``), refused where a share does not
    fit its stage's tightest device or cannot hold one max_model_len
    sequence; None for a model without KV cache layers."""
    bpb, stage, first = kv.bytes_per_block, kv.stage, kv.first_rank_of_each_stage
    if not any(bpb):
        logger.info("%s: the model has no KV cache layers; nothing to split.", FLAG)
        return None
    if not all(bpb):
        empty = [r for r, b in enumerate(bpb) if not b]
        raise ValueError(
            f"{FLAG}: pipeline stage "
            f"{', '.join(str(s) for s in sorted({stage[r] for r in empty}))} "
            f"(rank {', '.join(map(str, empty))}) holds no KV cache layers, so "
            f"the {BUDGET_FLAG} budget cannot be split by KV bytes. Give every "
            f"stage attention layers with VLLM_PP_LAYER_PARTITION, or drop {FLAG}."
        )
    stage_bpb = [bpb[r] for r in first]  # the TP ranks of a stage are alike
    # The tightest device of a stage bounds the stage.
    tightest = [
        min(
            (r for r in range(len(stage)) if stage[r] == s),
            key=lambda r: devices[r].kv_bytes,
        )
        for s in range(len(first))
    ]
    stage_limits = [devices[r].kv_bytes for r in tightest]
    shares = kv_arith.split_budget(budget, stage_bpb)
    for s, (share, rank) in enumerate(zip(shares, tightest)):
        if share.share_bytes > stage_limits[s]:
            ok = kv_arith.max_budget_for(stage_limits, stage_bpb)
            raise ValueError(
                f"{FLAG}: rank {rank} (pipeline stage {s}) gets "
                f"{mib(share.share_bytes)} of the {mib(budget)} {BUDGET_FLAG} "
                f"budget, more than its device can hold "
                f"({devices[rank].describe()}). Use "
                f"`{BUDGET_FLAG} {flag_size(ok, round_up=False)}` or "
                f"less, or move layers off this stage with VLLM_PP_LAYER_PARTITION."
            )
    if kv.sequence_bytes is not None:
        needs = [kv.sequence_bytes[r] + bpb[r] for r in first]
        for s, (share, need) in enumerate(zip(shares, needs)):
            if share.share_bytes < need:
                ok = kv_arith.min_budget_for(needs, stage_bpb)
                raise ValueError(
                    f"{FLAG}: rank {first[s]} (pipeline stage {s}) gets "
                    f"{mib(share.share_bytes)} ({share.num_blocks} blocks) of the "
                    f"{mib(budget)} {BUDGET_FLAG} budget, less than the "
                    f"{mib(need)} ({need // share.bytes_per_block} blocks, with "
                    f"vLLM's null block) one {max_len:,}-token sequence needs "
                    f"there. Use `{BUDGET_FLAG} {flag_size(ok)}` or more, or "
                    "lower --max-model-len."
                )
    return shares[0].num_blocks


def _say(plan: BudgetPlan) -> None:
    """The token budget's line, once the plan is made."""
    if plan.mode == "tokens" and plan.memory is not None:
        logger.info(
            "%s: %d blocks on every rank, %s.",
            plan.title,
            plan.blocks,
            ", ".join(f"rank {r} {mib(m)}" for r, m in enumerate(plan.memory)),
        )


# ------------------------------------------------- engine core, vLLM 0.32


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
    plan = plan_kv_budget(vllm_config, kv_cache_specs, available_memory)
    _say(plan)
    memory = plan.bytes_for_vllm(available_memory)
    configs = original(vllm_config, kv_cache_specs, memory)
    log_startup_report(vllm_config, configs, plan)
    return configs


# ------------------------------------------- engine core, vLLM 0.33 (builder)


def stash_plan(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], limits: list[int]
) -> BudgetPlan:
    """vLLM 0.33: plan the budget where the engine core has every worker's
    specs and limits (after they are measured, before vLLM plans), and keep
    the plan for vllm-kvmem's ``KVCacheConfigBuilder`` to apply (changes
    ``vllm_config``'s ``additional_config``: :class:`BudgetRuntime`). The
    same checks and errors as on 0.32."""
    plan = plan_kv_budget(vllm_config, kv_cache_specs, limits)
    _say(plan)
    runtime = BudgetRuntime.from_vllm_config(vllm_config)
    replace(runtime, plan=plan).store(vllm_config)
    return plan


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
    return the plan that was applied (vLLM's own sizing where none was
    kept)."""
    runtime = BudgetRuntime.from_vllm_config(vllm_config)
    plan = runtime.plan
    if plan is None:
        plan = BudgetPlan()
    else:
        replace(runtime, plan=None).store(vllm_config)
    if any(c.kv_cache_groups for c in kv_cache_configs):
        log_startup_report(vllm_config, kv_cache_configs, plan)
    return plan


# ------------------------------------------------------------ workers


def report_device_limit(worker: Any, limit: DeviceLimit) -> int:
    """What a worker returns from ``determine_available_memory`` when the engine
    sizes the KV cache (pipeline-wide budget or token budget): free memory
    less what is allocated after the KV cache (``DeviceLimit``)."""
    budget = worker.cache_config.kv_cache_memory_bytes
    how = (
        f"KV cache budget {gib(budget)} GiB ({BUDGET_FLAG}) is pipeline-wide with "
        f"{FLAG}"
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
