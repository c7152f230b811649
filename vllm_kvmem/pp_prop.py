"""`--enable-pp-prop-kv-cache`: one pipeline-wide KV budget, split by KV bytes.

The integration half of the feature (the arithmetic is in
``vllm_kvmem.core.pp_split``). It runs in three places:

* API server: :func:`validate_engine_config` checks the flags at startup.
* Workers: :func:`device_kv_limit` is what each worker reports to the engine
  instead of the (pipeline-wide) budget, so the engine can refuse a share the
  device cannot hold; :func:`log_rank_share` prints the seed's per-rank line.
* Engine core: :func:`proportional_kv_cache_configs` turns the budget into
  per-worker shares from the KV specs the workers report, then lets vLLM's own
  planner build the per-worker configs from those shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.config import ADDITIONAL_CONFIG_KEY, KVMemConfig
from vllm_kvmem.core import pp_split
from vllm_kvmem.core.units import flag_size, gib, mib
from vllm_kvmem.device_limits import DeviceLimit, limits_for

logger = init_logger("vllm.kvmem.pp_prop")

FLAG = KVMemConfig.flag("enable_pp_prop_kv_cache")
BUDGET_FLAG = "--kv-cache-memory-bytes"


# A token budget has no byte figure until the engine sees the KV specs. Until
# then vLLM's explicit-budget path runs with this placeholder (no profiling, and
# the CPU worker's startup memory check is skipped); our patches replace it.
TOKENS_PLACEHOLDER_BYTES = 1


def is_active(vllm_config: Any) -> bool:
    """True when the split applies: flag on, a byte budget, more than one stage."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    return (
        cfg.enable_pp_prop_kv_cache
        and cfg.kv_cache_tokens is None
        and vllm_config.cache_config.kv_cache_memory_bytes is not None
        and vllm_config.parallel_config.pipeline_parallel_size > 1
    )


def validate_engine_config(vllm_config: Any) -> KVMemConfig:
    """Startup checks on a freshly built VllmConfig (API server process)."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    additional = vllm_config.additional_config
    if ADDITIONAL_CONFIG_KEY in additional:
        additional[ADDITIONAL_CONFIG_KEY] = cfg.model_dump(exclude_unset=True)
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if cfg.kv_cache_tokens is not None:
        if budget not in (None, TOKENS_PLACEHOLDER_BYTES):
            raise ValueError(
                f"--kv-cache-tokens {cfg.kv_cache_tokens:,} and {BUDGET_FLAG} "
                f"{budget:,} both size the KV cache; give one of them (on CPU, "
                f"VLLM_CPU_KVCACHE_SPACE also sets {BUDGET_FLAG})."
            )
        vllm_config.cache_config.kv_cache_memory_bytes = TOKENS_PLACEHOLDER_BYTES
        return cfg
    if not cfg.enable_pp_prop_kv_cache:
        return cfg
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
            gib(vllm_config.cache_config.kv_cache_memory_bytes),
        )
    return cfg


# --------------------------------------------------------------------- workers


def device_kv_limit(worker: Any) -> int:
    """Bytes of KV cache this worker's device can still hold, after profiling.

    CPU: the available memory of the worker's NUMA node (what vLLM's CPU worker
    checks). Accelerators: the free device memory right now, after vLLM's
    profile run, as reported by torch.
    """
    import torch

    device = getattr(worker, "device", None)
    if device is None or torch.device(device).type == "cpu":
        from vllm.utils.cpu_resource_utils import (
            get_allowed_cpu_list,
            get_memory_node_info,
        )

        node = get_allowed_cpu_list()[0].numa_node
        return int(get_memory_node_info(node).available_memory)
    free, _total = torch.accelerator.get_memory_info(device)
    return int(free)


def report_device_limit(worker: Any, limit: DeviceLimit) -> int:
    """What a worker returns from ``determine_available_memory`` when the engine
    sizes the KV cache (pipeline-wide budget or token budget): free memory
    less what is allocated after the KV cache (``DeviceLimit``)."""
    budget = worker.cache_config.kv_cache_memory_bytes
    how = (
        f"KV cache budget {gib(budget)} GiB ({BUDGET_FLAG}) is pipeline-wide with "
        f"{FLAG}"
        if budget != TOKENS_PLACEHOLDER_BYTES
        else "KV cache is sized in tokens (--kv-cache-tokens)"
    )
    logger.info(
        "%s; this rank's device can hold up to %s GiB of KV cache (%s); the "
        "engine assigns this rank's share.",
        how,
        gib(limit.kv_bytes),
        limit.describe(),
    )
    return limit.kv_bytes


def _stage_layers(kv_cache_configs: Sequence[Any]) -> list[frozenset[str]]:
    return [
        frozenset(n for g in c.kv_cache_groups for n in g.layer_names)
        for c in kv_cache_configs
    ]


def log_rank_share(
    vllm_config: Any, kv_cache_configs: Sequence[Any], rank: int
) -> None:
    """The seed's per-rank line, from the configs every worker receives."""
    if not is_active(vllm_config):
        return
    layers = _stage_layers(kv_cache_configs)
    total_layers = len(frozenset().union(*layers))
    own = kv_cache_configs[rank]
    reserved = max((t.size for t in own.kv_cache_tensors), default=0)
    logger.info(
        "Reserved %s GiB for KV cache (proportionally split from %s GiB based on "
        "%d/%d layers on rank %d), %d blocks.",
        gib(reserved),
        gib(vllm_config.cache_config.kv_cache_memory_bytes),
        len(layers[rank]),
        total_layers,
        rank,
        own.num_blocks,
    )


# ----------------------------------------------------------------- engine core


def worker_groups(vllm_config: Any, kv_cache_specs: Sequence[dict[str, Any]]) -> list:
    """Each worker's KV cache groups, exactly as vLLM's planner will form them.

    Mirrors the first steps of ``get_kv_cache_configs`` with vLLM's own
    functions on a copy of the specs, so that bytes per block and the bytes one
    max_model_len sequence needs are vLLM's numbers, hybrid models included.
    """
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    merged: dict[str, Any] = {}
    for specs in kv_cache_specs:
        for name, spec in specs.items():
            merged.setdefault(name, spec)
    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    for name, spec in merged.items():
        if isinstance(spec, SlidingWindowSpec):
            merged[name] = replace(spec, extra_retained_tokens=extra)
    groups = ku.get_kv_cache_groups(vllm_config, merged)
    return [ku._project_kv_cache_groups_to_worker(groups, w) for w in kv_cache_specs]


def _stage_of_each_worker(kv_cache_specs: Sequence[dict[str, Any]]) -> list[int]:
    """Pipeline stage of each worker: TP ranks of a stage share its layers."""
    keys: dict[frozenset[str], int] = {}
    return [keys.setdefault(frozenset(s), len(keys)) for s in kv_cache_specs]


def proportional_kv_cache_configs(
    original: Callable[..., list[Any]],
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    available_memory: list[int],
) -> tuple[list[Any], dict[str, list[str]], list[str]]:
    """``get_kv_cache_configs`` with the pipeline-wide budget split by stage.

    ``available_memory`` holds what each worker's device can hold (reported by
    the worker patch); the shares replace it. Also returns the startup
    report's extra columns and trailer lines.
    """
    from vllm.v1.core import kv_cache_utils as ku

    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        logger.warning(
            "%s: --num-gpu-blocks-override decides the block count; the "
            "pipeline-wide split is not applied.",
            FLAG,
        )
        return original(vllm_config, kv_cache_specs, available_memory), {}, []
    budget = int(vllm_config.cache_config.kv_cache_memory_bytes)
    groups = worker_groups(vllm_config, kv_cache_specs)
    if not all(groups):
        logger.info("%s: a stage has no KV cache layers; split not applied.", FLAG)
        return original(vllm_config, kv_cache_specs, available_memory), {}, []
    bpb = [ku._pool_bytes_per_block(vllm_config, g) for g in groups]
    stage = _stage_of_each_worker(kv_cache_specs)
    stages = _Stages(stage, bpb, available_memory)
    stages.described = limits_for(vllm_config, available_memory)
    per_stage = pp_split.split_budget(budget, stages.bpb)
    shares = [per_stage[s].share_bytes for s in stage]

    _check_shares_fit_devices(stages, per_stage, budget)
    if vllm_config.model_config.original_max_model_len != -1:
        needs = [
            ku._max_memory_usage_bytes_from_groups(vllm_config, groups[r]) + bpb[r]
            for r in stages.first_rank
        ]
        _check_shares_hold_a_sequence(vllm_config, stages, per_stage, needs, budget)

    configs = original(vllm_config, kv_cache_specs, shares)
    extra, trailer = comparison_columns(
        vllm_config, configs, groups, bpb, shares, stage, budget
    )
    return configs, extra, trailer


class _Stages:
    """Per-stage view of per-worker figures (TP ranks of a stage are alike)."""

    def __init__(self, stage: list[int], bpb: list[int], limits: list[int]) -> None:
        n = max(stage) + 1
        self.first_rank = [stage.index(s) for s in range(n)]
        self.bpb = [bpb[r] for r in self.first_rank]
        # The tightest device of a stage bounds the stage.
        self.limit_rank = [
            min((r for r in range(len(stage)) if stage[r] == s), key=limits.__getitem__)
            for s in range(n)
        ]
        self.limits = [limits[r] for r in self.limit_rank]
        self.described: list[DeviceLimit] = [DeviceLimit(free=x) for x in limits]


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
    vllm_config: Any,
    configs: Sequence[Any],
    groups: Sequence[Any],
    bpb: Sequence[int],
    shares: Sequence[int],
    stage: Sequence[int],
    budget: int,
) -> tuple[dict[str, list[str]], list[str]]:
    """Startup-report columns: each rank's share, and what the same budget gives
    without the flag (every rank handed the whole budget, then cut by vLLM to
    the smallest block count, PR #25164)."""
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_capacity,
        get_kv_cache_config_from_groups,
    )

    base_blocks = pp_split.uniform_blocks(budget, bpb)
    cols: dict[str, list[str]] = {
        "share GiB": [],
        "w/o flag: KV GiB": [],
        "tokens": [],
        "conc": [],
    }
    base_bytes = []
    for g, b, share in zip(groups, bpb, shares):
        base = get_kv_cache_config_from_groups(vllm_config, g, base_blocks * b)
        tokens, conc = get_kv_cache_capacity(vllm_config, base)
        base_bytes.append(base.num_blocks * b)
        cols["share GiB"].append(gib(share, 3))
        cols["w/o flag: KV GiB"].append(gib(base_bytes[-1], 3))
        cols["tokens"].append(f"{tokens:,}")
        cols["conc"].append(f"{conc:.2f}x")
    firsts = [list(stage).index(s) for s in sorted(set(stage))]  # one TP shard
    total = sum(configs[i].num_blocks * bpb[i] for i in firsts)
    base_total = sum(base_bytes[i] for i in firsts)
    trailer = [
        f"  total KV per TP shard: {gib(total)} GiB of the {gib(budget)} GiB "
        f"pipeline-wide budget (without {FLAG}: {gib(base_total)} GiB, every "
        f"rank handed {gib(budget)} GiB)"
    ]
    return cols, trailer
