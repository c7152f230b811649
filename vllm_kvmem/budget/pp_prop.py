"""`--enable-pp-prop-kv-cache`: one pipeline-wide KV budget, split by KV bytes.

Its flag, and the two places it runs outside the engine core's plan (the
split itself is ``kv_budget.plan_kv_budget``, its arithmetic
``core.kv_arith``):

* API server: :func:`check_flags` checks the flags at startup.
* Workers: :func:`log_rank_share` prints the seed's per-rank line (what each
  worker reports to the engine is ``kv_budget.report_device_limit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import gib

logger = init_logger("vllm.kvmem.pp_prop")

FLAG = KVMemConfig.flag("enable_pp_prop_kv_cache")
BUDGET_FLAG = "--kv-cache-memory-bytes"


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
    if KVMemConfig.from_vllm_config(vllm_config).budget_mode(vllm_config) != "split":
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
