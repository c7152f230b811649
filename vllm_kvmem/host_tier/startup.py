"""What the host tier settles before it runs: the flag turned into vLLM's
connector config (API server), the host memory check, the tier's size (engine
core and every worker, on the same configs) and whether a model can use it."""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import MiB, gib

logger = init_logger("vllm.kvmem.host_tier")

CONNECTOR_NAME = "KVMemHostTierConnector"
MODULE_PATH = "vllm_kvmem.host_tier"
RUNTIME_KEY = "kvmem_runtime"
SIZE_FLAG = KVMemConfig.flag("kv_host_cache_bytes")


# ------------------------------------------------------------ startup


def add_connector_config(engine_args: Any) -> None:
    """Turn ``--kv-host-cache-bytes`` into vLLM's connector config (API server;
    changes ``engine_args``).

    Fails at startup, before any worker starts, on a size the host cannot hold
    or a conflicting connector.
    """
    from vllm.config import KVTransferConfig

    cfg = KVMemConfig.from_vllm_config(engine_args)  # same field on EngineArgs
    if cfg.kv_host_cache_bytes is None:
        return
    size = cfg.kv_host_cache_bytes
    existing = engine_args.kv_transfer_config
    other = (
        existing.get("kv_connector")
        if isinstance(existing, dict)
        else getattr(existing, "kv_connector", None)
    )
    if other not in (None, CONNECTOR_NAME):
        raise ValueError(
            f"{SIZE_FLAG} {size:,} runs vllm-kvmem's own KV connector and cannot be "
            f"combined with --kv-transfer-config (kv_connector={other}); drop one "
            f"of them."
        )
    if getattr(engine_args, "kv_offloading_size", None) is not None:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} and --kv-offloading-size "
            f"{engine_args.kv_offloading_size} both add a host KV tier; use one: "
            f"vllm-kvmem's spills only evicted blocks, vLLM's stores every block."
        )
    if engine_args.enable_prefix_caching is False:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} keeps blocks evicted from the prefix cache, so it "
            f"needs prefix caching: drop --no-enable-prefix-caching."
        )
    _check_host_memory(engine_args, size)
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=MODULE_PATH,
        kv_role="kv_both",
        # A host block that fails to load (or to verify) is recomputed, never
        # served and never fatal to the request.
        kv_load_failure_policy="recompute",
    )


#: Share of the host memory available at startup that the tier may pin on a
#: node. Pinned pages cannot be swapped out, so the rest stays for the OS, the
#: API server, the engine processes and the page cache.
HOST_MEMORY_FRACTION = 0.8


def _pools_per_node(engine_args: Any) -> tuple[int, int]:
    """``(tp, dp_local)``: every tensor-parallel rank of every data-parallel
    rank on this node pins its own pool of the full size (pipeline stages
    share one size between them)."""
    tp = max(1, int(engine_args.tensor_parallel_size or 1))
    if (
        engine_args.data_parallel_external_lb
        or engine_args.data_parallel_rank is not None
    ):
        dp_local = 1  # external load balancing: this process is one DP rank
    else:
        dp_local = (
            engine_args.data_parallel_size_local or engine_args.data_parallel_size
        )
    return tp, max(1, int(dp_local or 1))


def _check_host_memory(engine_args: Any, size: int) -> None:
    """Refuse a size whose node-wide pinned total would not leave headroom."""
    import psutil

    tp, dp_local = _pools_per_node(engine_args)
    pools = tp * dp_local
    total = size * pools
    available = psutil.virtual_memory().available
    limit = int(available * HOST_MEMORY_FRACTION)
    how = (
        f"{gib(size)} GiB x {tp} TP x {dp_local} DP-local = "
        f"{gib(total)} GiB on this node, limit {HOST_MEMORY_FRACTION:.0%} of "
        f"the {gib(available)} GiB of host memory available = "
        f"{gib(limit)} GiB"
    )
    if total > limit:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} bytes does not fit this node: every "
            f"tensor-parallel rank of every local data-parallel rank holds its own "
            f"pool, pinned on CUDA so it cannot be swapped ({how}). Use "
            f"{SIZE_FLAG} {(limit // pools) // MiB}M or less."
        )
    logger.info("Host KV tier memory check: %s.", how)


# ------------------------------------------------------------ sizing


def size_host_tier(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """Size the host tier from every rank's KV cache config: the number of
    host slots, and the bytes of one slot over the pipeline (one TP shard).

    Runs in the engine core (after the budget) and in every worker (before
    its KV cache is allocated) on the same configs, so all processes agree;
    the connector reads the result from ``additional_config``.
    """
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if cfg.kv_host_cache_bytes is None or not kv_cache_configs:
        return
    slot_bytes = va.pipeline_host_slot_bytes(kv_cache_configs)
    runtime = vllm_config.additional_config.setdefault(RUNTIME_KEY, {})
    runtime["host_num_slots"] = (
        cfg.kv_host_cache_bytes // slot_bytes if slot_bytes else 0
    )
    runtime["host_slot_bytes"] = slot_bytes


def unsupported_reason(kv_cache_config: Any) -> str:
    """Why the tier cannot serve this model/backend; empty when it can."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"the model has {len(groups)} KV cache groups (hybrid attention)"
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec):
        return "the model uses MLA"
    if type(spec) is not FullAttentionSpec:
        return f"its layers use {type(spec).__name__}, not full attention"
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        return "vLLM zeroes new blocks of this model before connectors run"
    hash_bs = kv_cache_config.hash_block_size
    if hash_bs not in (None, spec.block_size):
        return f"prefix hashes cover {hash_bs} tokens, blocks {spec.block_size}"
    return ""


#: Default per-step copy budget (each direction). On CPU the copies run inside
#: the step at memory speed (~8 GB/s here): 256 MiB holds a step up ~32 ms,
#: about one decode step of a small model, and a hit that size (2k tokens of
#: a 128 KiB/token model) loads synchronously and joins the batch in the step
#: it is admitted. On a GPU the copies run on side streams; 512 MiB is ~10 ms
#: of PCIe 5 traffic.
DEFAULT_STEP_BYTES = {"cpu": 256 << 20, "gpu": 512 << 20}


def default_step_bytes() -> int:
    from vllm.platforms import current_platform

    return DEFAULT_STEP_BYTES["cpu" if current_platform.is_cpu() else "gpu"]
