"""Host-memory KV tier: blocks the device prefix cache evicts spill to host RAM
and come back on a later prefix hit instead of being recomputed.

Life of a block (see docs/host-kv-tier.md):

1. It is computed on the device and enters vLLM's prefix cache as usual; as
   long as it stays on the device the tier costs nothing.
2. When vLLM hands the freed, cached block to another request (eviction,
   ``BlockPool._maybe_evict_cached_block``), the scheduler gives its hash a host
   slot and queues ``(block, slot)``. The workers copy it to host memory at the
   start of the next step, before that step's forward pass can overwrite it.
3. A new request whose prefix misses on the device is looked up here by vLLM's
   own block hashes, in prefix order; the hits are copied into freshly
   allocated device blocks before the forward pass that reads them, and
   count as cached tokens.

The scheduler makes every decision; each worker (every pipeline stage and
tensor-parallel rank) holds its own slice of each host block and executes the
same copies, saves before loads, in step order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.host_index import HostBlockIndex
from vllm_kvmem.layout import ContiguousKVLayoutMixin

logger = init_logger("vllm.kvmem.host_tier")

CONNECTOR_NAME = "KVMemHostTierConnector"
MODULE_PATH = "vllm_kvmem.host_tier"
RUNTIME_KEY = "kvmem_runtime"
SIZE_FLAG = KVMemConfig.flag("kv_host_cache_bytes")

# The scheduler-side connector of this process, told about every eviction by
# the block_pool_evict patch (one engine core, one scheduler per process).
_evict_listener: Any = None


def notify_evicted(block: Any) -> None:
    """Called before vLLM drops a cached block's hash. Only a free block being
    handed out again (``ref_cnt == 0``, from ``get_new_blocks``) is spilled; the
    other callers evict blocks whose contents are not to be trusted."""
    if (
        _evict_listener is not None
        and block.block_hash is not None
        and block.ref_cnt == 0
    ):
        _evict_listener(block)


# ------------------------------------------------------------ startup


def prepare_engine_args(engine_args: Any) -> None:
    """Turn ``--kv-host-cache-bytes`` into vLLM's connector config (API server).

    Fails at startup, before any worker starts, on a size the host cannot hold
    or a conflicting connector.
    """
    from vllm.config import KVTransferConfig

    additional = engine_args.additional_config or {}
    cfg = KVMemConfig.parse(additional.get("kvmem"))
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
    gib = 1 << 30
    how = (
        f"{size / gib:.2f} GiB x {tp} TP x {dp_local} DP-local = "
        f"{total / gib:.2f} GiB on this node, limit {HOST_MEMORY_FRACTION:.0%} of "
        f"the {available / gib:.2f} GiB of host memory available = "
        f"{limit / gib:.2f} GiB"
    )
    if total > limit:
        raise ValueError(
            f"{SIZE_FLAG} {size:,} bytes does not fit this node: every "
            f"tensor-parallel rank of every local data-parallel rank holds its own "
            f"pool, pinned on CUDA so it cannot be swapped ({how}). Use "
            f"{SIZE_FLAG} {(limit // pools) >> 20}M or less."
        )
    logger.info("Host KV tier memory check: %s.", how)


# ------------------------------------------------------------ sizing helpers


def pipeline_slot_bytes(kv_cache_configs: list[Any]) -> int:
    """Host bytes of one block summed over pipeline stages (one TP shard).

    TP ranks of a stage hold the same layers, so stages are told apart by
    their layer sets; a slot on a stage holds every layer's page of a block.
    """
    per_stage: dict[frozenset[str], int] = {}
    for cfg in kv_cache_configs:
        layers = frozenset(n for g in cfg.kv_cache_groups for n in g.layer_names)
        per_stage[layers] = _slot_bytes(cfg)
    return sum(per_stage.values())


def _slot_bytes(cfg: Any) -> int:
    total = 0
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        if specs:
            total += sum(s.page_size_bytes for s in specs.values())
        else:
            total += spec.page_size_bytes * len(g.layer_names)
    return total


def record_runtime(vllm_config: Any, kv_cache_configs: list[Any]) -> None:
    """Store the host slot count, computed identically in every process."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if cfg.kv_host_cache_bytes is None or not kv_cache_configs:
        return
    slot_bytes = pipeline_slot_bytes(kv_cache_configs)
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


# ------------------------------------------------------------ metadata/stats


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies: saves run before loads."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, block)


COUNTERS = (
    "lookup_tokens",
    "hit_tokens",
    "miss_tokens",
    "blocks_spilled",
    "blocks_loaded",
    "bytes_moved",
)


@dataclass
class HostTierStats(KVConnectorStats):
    """Counters over an interval plus the host bytes in use at its end."""

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS} | {"host_bytes_in_use": 0}

    def aggregate(self, other: KVConnectorStats) -> HostTierStats:
        if not self.data:
            self.reset()
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        self.data["host_bytes_in_use"] = other.data.get(
            "host_bytes_in_use", self.data.get("host_bytes_in_use", 0)
        )
        return self

    def reduce(self) -> dict[str, int | float]:
        looked = self.data.get("lookup_tokens", 0)
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out["host_bytes_in_use"] = self.data.get("host_bytes_in_use", 0)
        out["host_hit_rate"] = (
            round(self.data.get("hit_tokens", 0) / looked, 4) if (looked) else 0.0
        )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)


class HostTierPromMetrics(KVConnectorPromMetrics):
    """The tier's counters on vLLM's /metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        docs = {
            "lookup_tokens": "Prompt tokens looked up in the host KV tier.",
            "hit_tokens": "Prompt tokens found in the host KV tier (loaded).",
            "miss_tokens": "Prompt tokens looked up in the host KV tier and missed.",
            "blocks_spilled": "KV blocks copied to the host tier on device eviction.",
            "blocks_loaded": "KV blocks copied back from the host tier on a hit.",
            "bytes_moved": "Bytes copied between device and host KV tiers.",
        }
        self._counters = {
            k: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvmem_host_{k}",
                    documentation=doc,
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for k, doc in docs.items()
        }
        self._in_use = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:kvmem_host_bytes_in_use",
                documentation="Host memory holding KV blocks in the host tier.",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, per_engine in self._counters.items():
            if value := transfer_stats_data.get(k, 0):
                per_engine[engine_idx].inc(value)
        if "host_bytes_in_use" in transfer_stats_data:
            self._in_use[engine_idx].set(transfer_stats_data["host_bytes_in_use"])


# ------------------------------------------------------------ the connector


class KVMemHostTierConnector(ContiguousKVLayoutMixin, KVConnectorBase_V1):
    """vllm-kvmem's host tier, configured by ``--kv-host-cache-bytes``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self._cfg = KVMemConfig.from_vllm_config(vllm_config)
        runtime = vllm_config.additional_config.get(RUNTIME_KEY, {})
        self.num_slots = int(runtime.get("host_num_slots", 0))
        self.pipeline_slot_bytes = int(runtime.get("host_slot_bytes", 0))
        reason = unsupported_reason(kv_cache_config)
        if not reason and self.num_slots < 1:
            reason = (
                f"{SIZE_FLAG} {self._cfg.kv_host_cache_bytes} holds no whole block "
                f"({self.pipeline_slot_bytes} bytes per block)"
            )
        self.enabled = not reason
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(reason)
        else:
            self._engine: Any = None
            self._last_jobs: list[Any] = []

    # ---------------------------------------------------------- scheduler side

    def _init_scheduler(self, reason: str) -> None:
        global _evict_listener
        self._pending_saves: list[tuple[int, int]] = []
        self._pending_loads: list[tuple[int, int]] = []
        self._matched: dict[str, tuple[int, list[int]]] = {}
        self._step_pins: list[int] = []  # slots of this step's saves and loads
        self._lookups: dict[str, tuple[int, int]] = {}
        self._stats = HostTierStats()
        self._stats.reset()
        if not self.enabled:
            logger.warning(
                "Host KV tier off: %s; serving continues without it.", reason
            )
            _evict_listener = None
            return
        self.index = HostBlockIndex(self.num_slots, self._cfg.kv_host_cache_policy)
        _evict_listener = self._on_evicted
        logger.info(
            "Host KV tier: %d blocks of %d tokens (%.2f GiB per TP shard, %s "
            "eviction).",
            self.num_slots,
            self.block_size,
            self.num_slots * self.pipeline_slot_bytes / (1 << 30),
            self._cfg.kv_host_cache_policy,
        )

    def _on_evicted(self, block: Any) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash

        covered = block.block_hash_num_tokens  # prefix tokens up to this block
        if covered is not None and covered % self.block_size:
            return  # a partial block: never looked up by full-block hashes
        slot = self.index.put(get_block_hash(block.block_hash))
        if slot is not None:
            # Pinned until the workers get this step's saves: a later eviction
            # in the same step must not be given the same slot.
            self.index.pin([slot])
            self._step_pins.append(slot)
            self._pending_saves.append((block.block_id, slot))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        start = num_computed_tokens // self.block_size
        # Leave the last prompt token to compute, as vLLM needs one new token.
        stop = min(
            len(request.block_hashes), (request.num_tokens - 1) // self.block_size
        )
        if stop <= start:
            return 0, False
        keys = request.block_hashes[start:stop]
        slots = self.index.match_prefix(keys)
        hit, looked = len(slots) * self.block_size, len(keys) * self.block_size
        # Counted once the request is allocated: a waiting request is looked up
        # again every step.
        self._lookups[request.request_id] = (looked, hit)
        old = self._matched.pop(request.request_id, None)
        if old:
            self.index.unpin(old[1])
        if not slots:
            return 0, False
        self.index.pin(slots)
        self._matched[request.request_id] = (start, slots)
        return hit, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        looked, hit = self._lookups.pop(request.request_id, (0, 0))
        if looked:
            self._count(
                lookup_tokens=looked,
                hit_tokens=min(hit, num_external_tokens),
                miss_tokens=looked - min(hit, num_external_tokens),
            )
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        start, slots = matched
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][start : start + n]
        self._pending_loads.extend(zip(slots[:n], block_ids))
        # Pins of the loads stay until the metadata is built; unused ones go now.
        self.index.unpin(slots[n:])
        self._step_pins += slots[:n]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = HostTierMetadata()
        if not self.enabled:
            return meta
        meta.saves, self._pending_saves = self._pending_saves, []
        meta.loads, self._pending_loads = self._pending_loads, []
        if meta.saves or meta.loads:
            # Workers must copy before this step's forward pass: saved blocks are
            # about to be overwritten, loaded ones are about to be read. vLLM
            # otherwise starts connector loads after the forward launch.
            scheduler_output.has_sync_kv_loads = True
        # Once handed to the workers, saves and loads run in step order, so the
        # slots of this step's loads may be reused by the next step's saves.
        self.index.unpin(self._step_pins)
        self._step_pins = []
        moved = (len(meta.saves) + len(meta.loads)) * self.pipeline_slot_bytes
        self.index.counters.loaded_blocks += len(meta.loads)
        self._count(
            blocks_spilled=len(meta.saves),
            blocks_loaded=len(meta.loads),
            bytes_moved=moved,
        )
        return meta

    def request_finished(self, request: Any, block_ids: list[int]):
        self._lookups.pop(request.request_id, None)
        matched = self._matched.pop(request.request_id, None)
        if matched is not None:
            self.index.unpin(matched[1])
        return False, None

    def reset_cache(self) -> bool | None:
        """Drop every host block (vLLM calls this on a prefix-cache reset, e.g.
        after a weight update): stale KV must never be served."""
        if self._role != KVConnectorRole.SCHEDULER or not self.enabled:
            return None
        self.index = HostBlockIndex(self.num_slots, self._cfg.kv_host_cache_policy)
        # Loads already promised to allocated blocks still run (their slots stay
        # pinned until the workers get them); queued saves are dropped.
        self._pending_saves = []
        self._step_pins = [slot for slot, _ in self._pending_loads]
        self.index.pin(self._step_pins)
        for _, slots in self._matched.values():
            self.index.pin(slots)
        logger.info("Host KV tier reset: all host blocks dropped.")
        return True

    def host_bytes_in_use(self) -> int:
        return len(self.index) * self.pipeline_slot_bytes if self.enabled else 0

    def _count(self, **values: int) -> None:
        for k, v in values.items():
            self._stats.data[k] += v

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self.enabled or self._role != KVConnectorRole.SCHEDULER:
            return None  # all counters live on the scheduler side
        stats, self._stats = self._stats, HostTierStats()
        self._stats.reset()
        stats.data["host_bytes_in_use"] = self.host_bytes_in_use()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        stats = HostTierStats()
        stats.reset()
        if data:
            stats.data.update(data)
        return stats

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ):
        return HostTierPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self.enabled:
            return
        import torch

        from vllm_kvmem.core.copy_engine import BlockCopyEngine, HostBlockPool, KVRegion

        cfg = self._kv_cache_config
        spec = cfg.kv_cache_groups[0].kv_cache_spec
        regions = []
        for tensor in cfg.kv_cache_tensors:
            storage = kv_caches[tensor.layers[0]].untyped_storage()
            base = torch.empty(
                0, dtype=torch.uint8, device=kv_caches[tensor.layers[0]].device
            )
            base.set_(storage, 0, (storage.nbytes(),), (1,))
            regions.append(
                KVRegion.from_kv_cache_tensor(
                    base, tensor, spec.page_size_bytes, cfg.num_blocks
                )
            )
        if self._engine is not None:
            # KV caches registered again (re-initialised): the old pool goes
            # first, so the host never holds two pools for one rank.
            self._engine.close()
            self._engine = None
        pool = HostBlockPool.for_regions(regions, self.num_slots)
        self._engine = BlockCopyEngine(regions, pool, device=base.device)
        logger.info(
            "Host KV tier on this rank: %d slots x %d bytes = %.2f GiB of %s host "
            "memory.",
            self.num_slots,
            pool.slot_bytes,
            pool.nbytes / (1 << 30),
            "pinned" if pool.pinned else "pageable",
        )

    def shutdown(self) -> None:
        """Release the host pool when the engine shuts down; idempotent.

        vLLM calls this on the worker's connector from ``Worker.shutdown``
        (via ``ensure_kv_transfer_shutdown``) and on the scheduler's from
        ``Scheduler.shutdown``. Without it the pinned pool lives until the
        garbage collector finds the connector, so a second engine started in
        the same process would find the first one's memory still pinned.
        """
        global _evict_listener
        if self._role == KVConnectorRole.SCHEDULER:
            if _evict_listener == self._on_evicted:
                _evict_listener = None  # stop spilling for a stopped scheduler
            return
        engine, self._engine = self._engine, None
        if engine is None:
            return
        nbytes, pinned = engine.pool.nbytes, engine.pool.pinned
        engine.close()
        logger.info(
            "Host KV tier released on this rank: %.2f GiB of %s host memory.",
            nbytes / (1 << 30),
            "pinned" if pinned else "pageable",
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._engine is None or not isinstance(meta, HostTierMetadata):
            return
        jobs = []
        if meta.saves:
            blocks, slots = zip(*meta.saves)
            jobs.append(self._engine.save(list(blocks), list(slots)))
        if meta.loads:
            slots, blocks = zip(*meta.loads)
            jobs.append(self._engine.load(list(slots), list(blocks)))
        # The forward pass may overwrite saved blocks and reads loaded ones: make
        # the compute stream wait for both (a no-op on CPU, where copies are done).
        for job in jobs:
            job.make_current_stream_wait()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
