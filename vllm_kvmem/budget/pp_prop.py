"""`--enable-pp-prop-kv-cache`: one pipeline-wide KV budget, split by KV bytes.

The integration half of the feature (the arithmetic is in
``pp_split``; vLLM's figures come from
``vllm_kvmem.vllm_adapter``). It runs in three places:

* API server: :func:`check_flags` checks the flags at startup.
* Workers: :func:`log_rank_share` prints the seed's per-rank line (what each
  worker reports to the engine is ``kv_budget.report_device_limit``).
* Engine core: :func:`proportional_shares` turns the budget into per-worker
  shares from the KV specs the workers report; vLLM's own planner builds the
  per-worker configs from those shares (``kv_budget``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget import pp_split
from vllm_kvmem.budget.device_limits import limits_for
from vllm_kvmem.budget.runtime import DeviceLimit
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import flag_size, gib, mib

logger = init_logger("vllm.kvmem.pp_prop")

FLAG = KVMemConfig.flag("enable_pp_prop_kv_cache")
BUDGET_FLAG = "--kv-cache-memory-bytes"


def is_active(vllm_config: Any, cfg: KVMemConfig) -> bool:
    """True when the split applies: flag on, a byte budget, more than one stage."""
    return (
        cfg.enable_pp_prop_kv_cache
        and cfg.kv_cache_tokens is None
        and vllm_config.cache_config.kv_cache_memory_bytes is not None
        and vllm_config.parallel_config.pipeline_parallel_size > 1
    )


def check_flags(vllm_config: Any) -> None:
    """Startup checks of the flag on the final VllmConfig (API server process);
    changes nothing. A token budget sizes the cache instead: nothing to check."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if not cfg.enable_pp_prop_kv_cache or cfg.kv_cache_tokens is not None:
        return
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if budget is None:
        raise ValueError(
            f"{FLAG} needs {BUDGET_FLAG}: it splits that pipeline-wide budget "
            f"across pipeline stages. Add e.g. `{BUDGET_FLAG} 5G` or drop {FLAG}."
        )
    if vllm_config.parallel_config.pipeline_parallel_size == 1:
        logger.warning(
            "%s has no effect with --pipeline-parallel-size 1: the single stage "
            "gets all of %s (%s GiB).",
            FLAG,
            BUDGET_FLAG,
            gib(budget),
        )


# --------------------------------------------------------------------- workers


def log_rank_share(
    vllm_config: Any, kv_cache_configs: Sequence[Any], rank: int
) -> None:
    """The seed's per-rank line, from the configs every worker receives."""
    if not is_active(vllm_config, KVMemConfig.from_vllm_config(vllm_config)):
        return
    layers = [va.layer_names(c) for c in kv_cache_configs]
    own = kv_cache_configs[rank]
    logger.info(
        "Reserved %s GiB for KV cache (proportionally split from %s GiB based on "
        "%d/%d layers on rank %d), %d blocks.",
        gib(va.reserved_bytes(own)),
        gib(vllm_config.cache_config.kv_cache_memory_bytes),
        len(layers[rank]),
        len(frozenset().union(*layers)),
        rank,
        own.num_blocks,
    )


# ----------------------------------------------------------------- engine core


def proportional_shares(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
) -> tuple[list[int], int] | None:
    """Each rank's share of the pipeline-wide budget, and the block count every
    stage gets from it; None where the split does not apply.

    ``available_memory`` holds what each worker's device can hold (reported by
    the worker patch); the shares replace it in vLLM's planner (0.32), or cap
    the builder's block count (0.33, ``kv_builder``).
    """
    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        logger.warning(
            "%s: --num-gpu-blocks-override decides the block count; the "
            "pipeline-wide split is not applied.",
            FLAG,
        )
        return None
    budget = int(vllm_config.cache_config.kv_cache_memory_bytes)
    groups = va.worker_groups(vllm_config, kv_cache_specs)
    stage = va.stage_of_each_rank(kv_cache_specs)
    bpb = [
        va.bytes_per_block(vllm_config, g) if specs else 0
        for g, specs in zip(groups, kv_cache_specs)
    ]
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
    stages = _Stages(stage, bpb, limits_for(vllm_config, available_memory))
    per_stage = pp_split.split_budget(budget, stages.bpb)
    _check_shares_fit_devices(stages, per_stage, budget)
    if vllm_config.model_config.original_max_model_len != -1:
        needs = [
            va.sequence_bytes(vllm_config, groups[r]) + bpb[r]
            for r in stages.first_rank
        ]
        _check_shares_hold_a_sequence(vllm_config, stages, per_stage, needs, budget)
    return [per_stage[s].share_bytes for s in stage], per_stage[0].num_blocks


class _Stages:
    """Per-stage view of per-worker figures (TP ranks of a stage are alike)."""

    def __init__(
        self, stage: list[int], bpb: list[int], described: list[DeviceLimit]
    ) -> None:
        n = max(stage) + 1
        self.first_rank = va.first_rank_of_each_stage(stage)
        self.bpb = [bpb[r] for r in self.first_rank]
        limits = [d.kv_bytes for d in described]
        # The tightest device of a stage bounds the stage.
        self.limit_rank = [
            min((r for r in range(len(stage)) if stage[r] == s), key=limits.__getitem__)
            for s in range(n)
        ]
        self.limits = [limits[r] for r in self.limit_rank]
        self.described = described


def _check_shares_fit_devices(
    stages: _Stages, per_stage: list[pp_split.StageShare], budget: int
) -> None:
    for s, (share, limit) in enumerate(zip(per_stage, stages.limits)):
        if share.share_bytes > limit:
            ok = pp_split.max_budget_for(stages.limits, stages.bpb)
            raise ValueError(
                f"{FLAG}: rank {stages.limit_rank[s]} (pipeline stage {s}) gets "
                f"{mib(share.share_bytes)} of the {mib(budget)} {BUDGET_FLAG} "
                f"budget, more than its device can hold "
                f"({stages.described[stages.limit_rank[s]].describe()}). Use "
                f"`{BUDGET_FLAG} {flag_size(ok, round_up=False)}` or "
                f"less, or move layers off this stage with VLLM_PP_LAYER_PARTITION."
            )


def _check_shares_hold_a_sequence(
    vllm_config: Any,
    stages: _Stages,
    per_stage: list[pp_split.StageShare],
    needs: list[int],
    budget: int,
) -> None:
    max_len = vllm_config.model_config.max_model_len
    for s, (share, need) in enumerate(zip(per_stage, needs)):
        if share.share_bytes < need:
            ok = pp_split.min_budget_for(needs, stages.bpb)
            raise ValueError(
                f"{FLAG}: rank {stages.first_rank[s]} (pipeline stage {s}) gets "
                f"{mib(share.share_bytes)} ({share.num_blocks} blocks) of the "
                f"{mib(budget)} {BUDGET_FLAG} budget, less than the {mib(need)} "
                f"({need // share.bytes_per_block} blocks, with vLLM's null block) "
                f"one {max_len:,}-token sequence needs there. Use "
                f"`{BUDGET_FLAG} {flag_size(ok)}` or more, or lower --max-model-len."
            )


def comparison_columns(
    vllm_config: Any, configs: Sequence[Any], shares: Sequence[int]
) -> tuple[dict[str, list[str]], list[str]]:
    """Startup-report columns: each rank's share, and what the same budget gives
    without the flag (every rank handed the whole budget, then cut by vLLM to
    the smallest block count, PR #25164)."""
    budget = int(vllm_config.cache_config.kv_cache_memory_bytes)
    groups = [c.kv_cache_groups for c in configs]
    bpb = [va.bytes_per_block(vllm_config, g) for g in groups]
    base_blocks = pp_split.uniform_blocks(budget, bpb)
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
