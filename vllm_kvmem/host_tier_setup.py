"""The plugin's set-up of the host KV tier (``host_tier/``), beside its config:
what the tier settles before it runs. The flag turned into vLLM's connector
config (API server), the host memory check, the tier's size (engine core and
every worker, on the same configs) and whether a model can use it.

Here rather than in ``host_tier/``, which imports only vLLM and itself (a KV
connector vLLM loads by module path): this module reads the plugin's flags
(:class:`KVMemConfig`) and its pipeline figures (``vllm_adapter``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import MiB, gib
from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.kv_region import config_slot_bytes
from vllm_kvmem.host_tier.support import unsupported_reason

logger = init_logger("vllm.kvmem.host_tier")

CONNECTOR_NAME = "KVMemHostTierConnector"
MODULE_PATH = "vllm_kvmem.host_tier.connector"
#: A short name for the connector in vLLM's connector factory, for a
#: ``kv_transfer_config`` written by hand (docs/host-kv-tier.md,
#: ``benchmarks/tier_step_bench.py``) rather than by ``--kv-host-cache-bytes``.
SHORT_NAME = "HostTierConnector"
SIZE_FLAG = KVMemConfig.flag("kv_host_cache_bytes")
PATH_FLAG = KVMemConfig.flag("kv_disk_cache_path")
DISK_SIZE_FLAG = KVMemConfig.flag("kv_disk_cache_bytes")


# ------------------------------------------------------------ startup


def add_connector_config(engine_args: Any) -> None:
    """Turn ``--kv-host-cache-bytes`` into vLLM's connector config (API server;
    changes ``engine_args``).

    Fails at startup, before any worker starts, on a size the host cannot hold
    or a conflicting connector; a model the tier cannot serve drops the
    connector again once vLLM knows it (:func:`refuse_unservable_model`).
    """
    from vllm.config import KVTransferConfig

    cfg = KVMemConfig.from_vllm_config(engine_args)  # same field on EngineArgs
    disk_path, disk_bytes = _check_disk_options(engine_args, cfg)
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
            f"{engine_args.kv_offloading_size} both add a host KV tier; use one "
            f"of them (docs/host-kv-tier.md compares the two)."
        )
    if engine_args.enable_prefix_caching is False:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} keeps blocks evicted from the prefix cache, so it "
            f"needs prefix caching: drop --no-enable-prefix-caching."
        )
    _check_executor(engine_args, size)
    _check_host_memory(engine_args, size)
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=MODULE_PATH,
        kv_role="kv_both",
        kv_connector_extra_config=HostTierConfig(
            host_bytes=size,
            eviction_policy=cfg.kv_host_cache_policy,
            step_bytes=cfg.kv_host_cache_step_bytes or 0,
            late_spill=cfg.kv_host_cache_late_spill,
            verify=cfg.kv_host_cache_verify,
            copy_thread=cfg.kv_host_cache_copy_thread,
            disk_path=disk_path,
            disk_bytes=disk_bytes,
        ).to_extra_config(),
        # A host block that fails to load (or to verify) is recomputed, never
        # served and never fatal to the request.
        kv_load_failure_policy="recompute",
    )


def _check_disk_options(engine_args: Any, cfg: KVMemConfig) -> tuple[str, int]:
    """Refuse a disk tier setting that cannot work, in one line naming the
    flag, the value and what would work; its (path, bytes), ("", 0) when
    off. The disk tier sits behind the host tier, whose evictions fill it."""
    from vllm_kvmem.host_tier.disk_store import check_disk_config

    path, size = cfg.kv_disk_cache_path, cfg.kv_disk_cache_bytes
    if path is None and size is None:
        return "", 0
    if cfg.kv_host_cache_bytes is None:
        given = PATH_FLAG if path is not None else DISK_SIZE_FLAG
        value = path if path is not None else f"{size:,}"
        raise ValueError(
            f"{given} {value} adds a disk tier behind the host KV tier, which is "
            f"off: add {SIZE_FLAG} (e.g. {SIZE_FLAG} 8G)."
        )
    hash_algo = str(getattr(engine_args, "prefix_caching_hash_algo", "sha256"))
    check_disk_config(path or "", size or 0, hash_algo=hash_algo)
    return path or "", size or 0


def register_connector_name() -> None:
    """Register :data:`SHORT_NAME` with vLLM's connector factory (its
    extension point for out-of-tree connectors), unless the name is taken."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    try:
        KVConnectorFactory.register_connector(SHORT_NAME, MODULE_PATH, CONNECTOR_NAME)
    except ValueError:
        pass  # registered already (the plugin loads again), or a vLLM connector


def installed(vllm_config: Any) -> bool:
    """Whether the host tier's connector is configured (``--kv-host-cache-bytes``
    given and the model not refused at startup)."""
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(kv_config, "kv_connector", None) == CONNECTOR_NAME


def refuse_unservable_model(engine_args: Any, model_config: Any) -> None:
    """Drop the connector :func:`add_connector_config` added for a model the
    tier cannot serve (changes ``engine_args``); vLLM has just built the
    model's config and has not yet built the VllmConfig (patch
    ``engine_args_model_config``).

    The VllmConfig picks the KV cache manager from the configured connector
    (``SupportsHMA``), so the decision must come first: refused here, the
    model runs exactly as without the flag (one log line says why). A
    connector named by hand in ``--kv-transfer-config`` is left as given."""
    if not installed(engine_args):
        return
    if KVMemConfig.from_vllm_config(engine_args).kv_host_cache_bytes is None:
        return
    if reason := unsupported_model_reason(model_config):
        logger.warning("Host KV tier off: %s; serving continues without it.", reason)
        engine_args.kv_transfer_config = None


def _check_executor(engine_args: Any, size: int) -> None:
    """Refuse vLLM 0.32's legacy Ray executor with a pipeline: it collects
    outputs (connector outputs included) from the last stage's workers only
    (``RayDistributedExecutor._compiled_ray_dag``: the compiled graph's
    outputs are the last stage's; earlier stages hand on their intermediate
    tensors), so the loads earlier stages finish would never be reported and
    their requests would wait forever. vLLM's default Ray executor
    (``RayExecutorV2``, the only one in 0.33) and the multiprocessing one
    collect every worker's output."""
    import importlib.util

    from vllm import envs

    pp = int(engine_args.pipeline_parallel_size or 1)
    if (
        pp > 1
        and engine_args.distributed_executor_backend == "ray"
        and not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND
        and importlib.util.find_spec("vllm.v1.executor.ray_executor") is not None
    ):
        raise ValueError(
            f"{SIZE_FLAG} {size:,} with --pipeline-parallel-size {pp} cannot run "
            f"on vLLM's legacy Ray executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0): "
            f"it returns only the last pipeline stage's connector output, so host "
            f"loads finished by earlier stages would never complete. Unset "
            f"VLLM_USE_RAY_V2_EXECUTOR_BACKEND (vLLM's default Ray executor) or "
            f"use --distributed-executor-backend mp."
        )


#: Share of the host memory available at startup that the tier may pin on a
#: node. Pinned pages cannot be swapped out, so the rest stays for the OS, the
#: API server, the engine processes and the page cache.
HOST_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class NodePools:
    """The host tier's pools on this node: one per tensor-parallel rank of
    each data-parallel rank here, each of the full size at most (a pipeline's
    stages share one size between them)."""

    tp: int
    """Tensor-parallel ranks of one DP rank on this node."""
    dp: int
    """DP ranks (engines) with workers on this node."""
    node_rank: int = 0
    nnodes: int = 1
    ranks_here: int = 0
    """Workers of one DP rank on this node (multi-node launcher only)."""
    ranks_per_dp: int = 0

    @property
    def pools(self) -> int:
        return self.tp * self.dp

    def where(self) -> str:
        """``this node`` and, across nodes, which one and what it holds."""
        if self.nnodes == 1:
            return "this node"
        return (
            f"this node (--node-rank {self.node_rank} of --nnodes {self.nnodes}, "
            f"with {self.ranks_here}/{self.ranks_per_dp} of each DP rank's workers)"
        )


def _pools_per_node(engine_args: Any) -> NodePools:
    """Count only the ranks that run on this node.

    One node (``--nnodes 1``, also every Ray or external-launcher run): every
    TP rank of every local DP rank. vLLM's multi-node launcher (``--nnodes N
    --node-rank R``) gives each node a contiguous block of global ranks, TP
    innermost: a DP rank spanning several nodes leaves ``world / nodes`` of its
    workers here, and at most ``tp`` of them are distinct TP ranks (each holds
    one pool; its other stages here share that pool's size). The local DP
    count is inferred as vLLM infers it; ``data_parallel_size_local`` is still
    unset when this runs (before the VllmConfig is built).
    """
    tp = max(1, int(engine_args.tensor_parallel_size or 1))
    dp = max(1, int(engine_args.data_parallel_size or 1))
    world_per_dp = (
        tp
        * max(1, int(engine_args.pipeline_parallel_size or 1))
        * max(1, int(getattr(engine_args, "prefill_context_parallel_size", 1) or 1))
    )
    nnodes = max(1, int(getattr(engine_args, "nnodes", 1) or 1))
    external = (
        engine_args.data_parallel_external_lb
        or engine_args.data_parallel_rank is not None
    )
    if external:
        dp_local = 1  # external load balancing: this process is one DP rank
    elif engine_args.data_parallel_size_local:
        dp_local = int(engine_args.data_parallel_size_local)
    elif nnodes > 1:  # vLLM's inference (EngineArgs.create_engine_config)
        dp_local = max(dp * world_per_dp // nnodes // world_per_dp, 1)
    else:
        dp_local = dp
    dp_local = max(1, dp_local)
    if nnodes == 1:
        return NodePools(tp=tp, dp=dp_local)
    # ParallelConfig.nnodes_within_dp: how many nodes one DP rank spans.
    nodes_per_dp = max(nnodes // max(dp // dp_local, 1), 1)
    ranks_here = max(world_per_dp // nodes_per_dp, 1)
    return NodePools(
        tp=min(tp, ranks_here),
        dp=dp_local,
        node_rank=int(getattr(engine_args, "node_rank", 0) or 0),
        nnodes=nnodes,
        ranks_here=ranks_here,
        ranks_per_dp=world_per_dp,
    )


def _check_host_memory(engine_args: Any, size: int) -> None:
    """Refuse a size whose pinned total on this node would not leave headroom.

    Runs wherever vLLM builds the engine config: the API server or ``LLM``
    process, and every headless node of the multi-node launcher, each against
    its own host memory."""
    import psutil

    here = _pools_per_node(engine_args)
    total = size * here.pools
    available = psutil.virtual_memory().available
    limit = int(available * HOST_MEMORY_FRACTION)
    how = (
        f"{gib(size)} GiB x {here.tp} TP x {here.dp} DP-local = "
        f"{gib(total)} GiB on {here.where()}, limit {HOST_MEMORY_FRACTION:.0%} of "
        f"the {gib(available)} GiB of host memory available = "
        f"{gib(limit)} GiB"
    )
    if total > limit:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} bytes does not fit this node: every "
            f"tensor-parallel rank of every local data-parallel rank holds its own "
            f"pool{_pool_memory()} ({how}). Use "
            f"{SIZE_FLAG} {(limit // here.pools) // MiB}M or less."
        )
    logger.info("Host KV tier memory check: %s.", how)


def _pool_memory() -> str:
    """How this platform's pools hold their memory, for the refusal."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return ", pinned so that it cannot be swapped"
    return f", in {current_platform.device_type.upper()} host memory"


# ------------------------------------------------------------ sizing


def pipeline_block_bytes(kv_cache_configs: list[Any]) -> int:
    """Host bytes of one block summed over pipeline stages (one TP shard)."""
    stage = va.stages_of_configs(kv_cache_configs)
    return sum(
        config_slot_bytes(kv_cache_configs[r])
        for r in va.first_rank_of_each_stage(stage)
    )


def size_host_tier(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """Count the host blocks from every rank's KV cache config, into the
    connector's ``kv_connector_extra_config`` (``num_host_blocks``, and
    ``host_block_bytes``: one block over the pipeline, one TP shard).

    Runs in the engine core (after the budget) and in every worker (before
    its KV cache is allocated) on the same configs, so all processes agree.
    """
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if cfg.kv_host_cache_bytes is None or not kv_cache_configs:
        return
    if not installed(vllm_config) or unsupported_reason(kv_cache_configs[0]):
        return  # refused at startup, or off once the connector starts
    block_bytes = pipeline_block_bytes(kv_cache_configs)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["num_host_blocks"] = (
        cfg.kv_host_cache_bytes // block_bytes if block_bytes else 0
    )
    extra["host_block_bytes"] = block_bytes


def unsupported_model_reason(model_config: Any) -> str:
    """Why the tier cannot serve a model, from its config alone; empty when
    it may (the KV cache groups are checked again once vLLM forms them)."""
    if model_config.is_attention_free:
        return "the model has no attention KV cache"
    if model_config.is_hybrid:
        return (
            "the model keeps Mamba or linear-attention state, which the tier "
            "does not copy"
        )
    if model_config.use_mla:
        return "the model uses MLA"
    if model_config.is_encoder_decoder:
        return "the model is an encoder-decoder (per-request cross-attention KV)"
    return ""
