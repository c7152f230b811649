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

import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.host_index import HostBlockIndex
from vllm_kvmem.core.units import MiB, cdiv, gib
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


# ------------------------------------------------------------ metadata/stats


@dataclass
class LoadChunk:
    """Part of one request's host hits, copied in one step."""

    req_id: str
    slots: list[int]
    blocks: list[int]
    last: bool  # the request's loads are all handed out after this one
    # Loaded before this step's forward, which reads the blocks (the request
    # is in this step's batch); else in the background, reported when done.
    sync: bool = False


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies, in the order the workers issue them.

    Before the forward pass (``handle_preemptions``): wait for the background
    saves of ``fence`` blocks (the step may overwrite them), copy
    ``evict_saves`` synchronously (blocks evicted this step with no host copy
    yet), then start ``ahead_saves`` in the background. Then
    (``start_load_kv``, before the forward when any load is ``sync``, after
    its launch otherwise): start ``loads``.
    """

    seq: int = 0
    fence: list[int] = field(default_factory=list)
    evict_saves: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    ahead_saves: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    loads: list[LoadChunk] = field(default_factory=list)


@dataclass
class HostTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: every background save of the steps up to
    ``saved_through`` has completed on this worker (min over workers)."""

    saved_through: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HostTierWorkerMeta:
        theirs = getattr(other, "saved_through", self.saved_through)
        return HostTierWorkerMeta(min(self.saved_through, theirs))


#: Counters summed over an interval (and over workers, for the worker ones).
COUNTERS = (
    "lookup_tokens",
    "hit_tokens",
    "miss_tokens",
    "blocks_spilled",
    "blocks_loaded",
    "bytes_moved",
    "bytes_saved_ahead",
    "bytes_saved_at_eviction",
    "blocks_evicted_on_host",
    "blocks_evicted_dropped",
    "load_errors",
    "copy_wait_seconds",
)
#: Gauges: the value at the end of the interval.
GAUGES = ("host_bytes_in_use", "load_queue_blocks")


@dataclass
class HostTierStats(KVConnectorStats):
    """Counters over an interval plus gauges at its end."""

    def reset(self) -> None:
        # Gauges only from the scheduler side, which owns them: a worker's
        # stats must not overwrite them with zeros.
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> HostTierStats:
        if not self.data:
            self.reset()
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in GAUGES:
            if k in other.data:
                self.data[k] = other.data[k]
        return self

    def reduce(self) -> dict[str, int | float]:
        looked = self.data.get("lookup_tokens", 0)
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out["copy_wait_seconds"] = round(float(out["copy_wait_seconds"]), 4)
        for k in GAUGES:
            if k in self.data:
                out[k] = self.data[k]
        out["host_hit_rate"] = (
            round(self.data.get("hit_tokens", 0) / looked, 4) if looked else 0.0
        )
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)


METRIC_DOCS = {
    "lookup_tokens": "Prompt tokens looked up in the host KV tier.",
    "hit_tokens": "Prompt tokens found in the host KV tier (loaded).",
    "miss_tokens": "Prompt tokens looked up in the host KV tier and missed.",
    "blocks_spilled": "KV blocks copied to the host tier (ahead of or at eviction).",
    "blocks_loaded": "KV blocks copied back from the host tier on a hit.",
    "bytes_moved": "Bytes copied between device and host KV tiers.",
    "bytes_saved_ahead": "Bytes copied to the host tier in the background, before "
    "the device evicted the blocks.",
    "bytes_saved_at_eviction": "Bytes copied to the host tier synchronously, when "
    "the device evicted blocks whose background copy had not run.",
    "blocks_evicted_on_host": "Device evictions of blocks already held by the host "
    "tier (nothing copied).",
    "blocks_evicted_dropped": "Device evictions of blocks not yet on the host that "
    "were dropped (--kv-host-cache-late-spill drop).",
    "load_errors": "Host tier blocks that failed to load or verify (recomputed).",
    "copy_wait_seconds": "Seconds engine steps waited on host tier copies, summed "
    "over workers.",
}
GAUGE_DOCS = {
    "host_bytes_in_use": "Host memory holding KV blocks in the host tier.",
    "load_queue_blocks": "Host tier blocks waiting to be loaded or in flight.",
}


class HostTierPromMetrics(KVConnectorPromMetrics):
    """The tier's counters and gauges on vLLM's /metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(cls: Any, key: str, doc: str, **kw: Any) -> Any:
            name = f"vllm:kvmem_host_{key.removeprefix('host_')}"
            metric = cls(name=name, documentation=doc, labelnames=labelnames, **kw)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {
            k: per_engine(self._counter_cls, k, doc) for k, doc in METRIC_DOCS.items()
        }
        self._gauges = {
            k: per_engine(self._gauge_cls, k, doc, multiprocess_mode="mostrecent")
            for k, doc in GAUGE_DOCS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, per_engine in self._counters.items():
            if value := transfer_stats_data.get(k, 0):
                per_engine[engine_idx].inc(value)
        for k, per_engine in self._gauges.items():
            if k in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[k])


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


@dataclass
class _Load:
    """A request's host hits, handed to the workers a chunk per step."""

    req_id: str
    pairs: list[tuple[int, int]]  # (slot, block) not yet handed out
    slots: list[int]  # every slot of the load, pinned until it finishes
    cancelled: bool = False
    sent: dict[int, int] = field(default_factory=dict)  # block -> slot handed out


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
        self.step_bytes = self._cfg.kv_host_cache_step_bytes or default_step_bytes()
        # Counters since start (the stats objects are handed to vLLM and
        # replaced every step).
        self.totals: dict[str, int | float] = dict.fromkeys(COUNTERS, 0)
        self.verify = self._cfg.kv_host_cache_verify
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(reason, vllm_config)
        else:
            self._init_worker()

    # ---------------------------------------------------------- scheduler side

    def _init_scheduler(self, reason: str, vllm_config: Any) -> None:
        global _evict_listener
        self._seq = 0
        self._pool: Any = None  # vLLM's device BlockPool (bind_gpu_block_pool)
        self._evict_saves: list[tuple[int, int]] = []
        # req -> (first block, slots, load synchronously), until allocated
        self._matched: dict[str, tuple[int, list[int], bool]] = {}
        self._sync_loads: list[LoadChunk] = []  # this step's
        self._sync_blocks = 0
        self._lookups: dict[str, tuple[int, int]] = {}
        self._step_pins: list[int] = []  # slots of this step's saves
        self._load_queue: dict[str, _Load] = {}  # in arrival order
        self._inflight_loads: dict[str, _Load] = {}  # all handed out, not done
        # Background saves not yet known complete on every worker: block id ->
        # (block hash, step). The device block must not be overwritten first.
        self._ahead: dict[int, tuple[Any, int]] = {}
        self._saved_through = 0
        self._scan_state: tuple[int, int] | None = None
        sched = vllm_config.scheduler_config
        step_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 0)
        slot_bytes = max(1, self.pipeline_slot_bytes)
        self._budget_blocks = max(1, self.step_bytes // slot_bytes)
        # Blocks near the head of the free queue worth copying ahead: what the
        # next two steps could evict, and at least one step's budget.
        self._scan_window = max(
            self._budget_blocks, 2 * cdiv(step_tokens, self.block_size), 64
        )
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
            "Host KV tier: %d blocks of %d tokens (%s GiB per TP shard, %s "
            "eviction); background copies up to %d MiB per step each way, "
            "late spills %s.",
            self.num_slots,
            self.block_size,
            gib(self.num_slots * self.pipeline_slot_bytes),
            self._cfg.kv_host_cache_policy,
            self.step_bytes // MiB,
            "copied" if self._cfg.kv_host_cache_late_spill == "copy" else "dropped",
        )

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool

    def _on_evicted(self, block: Any) -> None:
        """vLLM hands a free cached block to another request (an eviction)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        covered = block.block_hash_num_tokens  # prefix tokens up to this block
        if covered is not None and covered % self.block_size:
            return  # a partial block: never looked up by full-block hashes
        key = get_block_hash(block.block_hash)
        if key in self.index:
            self.index.put(key)  # refresh its place in the host LRU
            self._count(blocks_evicted_on_host=1)
            return  # copied ahead (a fence waits for it if still in flight)
        if self._cfg.kv_host_cache_late_spill == "drop":
            self._count(blocks_evicted_dropped=1)
            return
        slot = self.index.put(key)
        if slot is not None:
            # Pinned until the workers get this step's saves: a later eviction
            # in the same step must not be given the same slot.
            self.index.pin([slot])
            self._step_pins.append(slot)
            self._evict_saves.append((block.block_id, slot))

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
        # A hit that fits what is left of this step's load budget is loaded
        # before this step's forward and the request runs in this very step:
        # the other requests wait for at most one budget of copies either
        # way, and the request saves the two steps of the asynchronous path.
        sync = len(slots) <= self._sync_room()
        self._matched[request.request_id] = (start, slots, sync)
        # Otherwise asynchronous: the request waits for its own blocks in
        # WAITING_FOR_REMOTE_KVS while every other request keeps running.
        return hit, not sync

    def _sync_room(self) -> int:
        """Blocks of this step's load budget not yet promised: queued
        asynchronous loads come first, so they are never starved."""
        queued = sum(len(x.pairs) for x in self._load_queue.values() if not x.cancelled)
        budget = self._budget_blocks
        return budget - self._sync_blocks - min(queued, budget)

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
        start, slots, sync = matched
        n = num_external_tokens // self.block_size
        self.index.unpin(slots[n:])
        if n == 0:
            return
        block_ids = blocks.get_block_ids()[0][start : start + n]
        if sync:
            # Pinned until the workers get this step's copies; a save into a
            # slot reused later waits for the load on the workers.
            self._sync_loads.append(
                LoadChunk(request.request_id, slots[:n], block_ids, True, sync=True)
            )
            self._sync_blocks += n
            self._step_pins += slots[:n]
            return
        self._load_queue[request.request_id] = _Load(
            request.request_id, list(zip(slots[:n], block_ids)), slots[:n]
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._seq += 1
        meta = HostTierMetadata(seq=self._seq)
        if not self.enabled:
            return meta
        meta.fence = self._fences()
        meta.evict_saves, self._evict_saves = self._evict_saves, []
        meta.ahead_saves = self._pick_ahead_saves()
        meta.loads = self._sync_loads + self._next_load_chunks(
            self._budget_blocks - self._sync_blocks
        )
        self._sync_loads, self._sync_blocks = [], 0
        # The workers issue this step's saves before any later step's copies:
        # the slots may be reused from the next step on.
        self.index.unpin(self._step_pins)
        self._step_pins = []
        loaded = sum(len(c.blocks) for c in meta.loads)
        saved = len(meta.evict_saves) + len(meta.ahead_saves)
        self.index.counters.loaded_blocks += loaded
        self._count(
            blocks_spilled=saved,
            blocks_loaded=loaded,
            bytes_moved=(saved + loaded) * self.pipeline_slot_bytes,
            bytes_saved_ahead=len(meta.ahead_saves) * self.pipeline_slot_bytes,
            bytes_saved_at_eviction=len(meta.evict_saves) * self.pipeline_slot_bytes,
        )
        return meta

    def _fences(self) -> list[int]:
        """Blocks with a background save in flight that this step may
        overwrite: no longer free, or no longer holding the hash saved."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        if not self._ahead or self._pool is None:
            return []
        fence = []
        for block_id, (key, _) in list(self._ahead.items()):
            block = self._pool.blocks[block_id]
            if (
                block.ref_cnt == 0
                and block.block_hash is not None
                and get_block_hash(block.block_hash) == key
            ):
                continue
            fence.append(block_id)
            del self._ahead[block_id]
        return fence

    def _pick_ahead_saves(self) -> list[tuple[int, int]]:
        """Cached blocks next in line for eviction with no host copy yet,
        copied in the background up to the step budget."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        queue = getattr(self._pool, "free_block_queue", None)
        if queue is None:
            return []
        head = queue.fake_free_list_head.next_free_block
        state = (queue.num_free_blocks, head.block_id if head else -1)
        if state == self._scan_state:
            return []  # same free queue as the last walk, which found it all saved
        picked: list[tuple[int, int]] = []
        node, scanned = head, 0
        while (
            node is not None
            and node.block_id >= 0
            and scanned < self._scan_window
            and len(picked) < self._budget_blocks
        ):
            scanned += 1
            block_hash = node.block_hash
            if block_hash is not None and node.block_id not in self._ahead:
                covered = node.block_hash_num_tokens
                key = get_block_hash(block_hash)
                if (covered is None or covered % self.block_size == 0) and (
                    key not in self.index
                ):
                    slot = self.index.put(key)
                    if slot is None:
                        break  # every host slot is pinned
                    self.index.pin([slot])
                    self._step_pins.append(slot)
                    picked.append((node.block_id, slot))
                    self._ahead[node.block_id] = (key, self._seq)
            node = node.next_free_block
        self._scan_state = None if len(picked) == self._budget_blocks else state
        return picked

    def _next_load_chunks(self, budget: int) -> list[LoadChunk]:
        """This step's share of the queued loads (up to ``budget`` blocks),
        oldest request first."""
        chunks: list[LoadChunk] = []
        for req_id in list(self._load_queue):
            load = self._load_queue[req_id]
            if load.cancelled:
                take: list[tuple[int, int]] = []
                load.pairs = []
            else:
                if budget <= 0:
                    break
                take, load.pairs = load.pairs[:budget], load.pairs[budget:]
                budget -= len(take)
                load.sent.update((b, s) for s, b in take)
            last = not load.pairs
            chunks.append(
                LoadChunk(req_id, [s for s, _ in take], [b for _, b in take], last)
            )
            if last:
                del self._load_queue[req_id]
                self._inflight_loads[req_id] = load
        return chunks

    def update_connector_output(self, connector_output: Any) -> None:
        if not self.enabled:
            return
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HostTierWorkerMeta) and meta.saved_through > (
            self._saved_through
        ):
            self._saved_through = meta.saved_through
            done = self._saved_through
            self._ahead = {b: v for b, v in self._ahead.items() if v[1] > done}
        if bad := connector_output.invalid_block_ids:
            self._drop_bad_copies(bad)
        for req_id in connector_output.finished_recving or ():
            load = self._inflight_loads.pop(req_id, None)
            if load is not None:
                self.index.unpin(load.slots)

    def _drop_bad_copies(self, block_ids: set[int]) -> None:
        """Blocks that failed to load: vLLM recomputes them, and their host
        copies are forgotten, so a retry cannot load the same bad bytes."""
        loads = list(self._inflight_loads.values()) + list(self._load_queue.values())
        dropped = 0
        for load in loads:
            for block_id in block_ids.intersection(load.sent):
                dropped += self.index.drop_slot(load.sent[block_id])
        if dropped:
            logger.warning(
                "Host KV tier: dropped %d host blocks that failed to load; their "
                "tokens are recomputed.",
                dropped,
            )

    def request_finished(self, request: Any, block_ids: list[int]):
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        matched = self._matched.pop(req_id, None)
        if matched is not None:
            self.index.unpin(matched[1])
        load = self._load_queue.get(req_id) if self.enabled else None
        if load is not None:
            # Aborted while its loads wait: the rest is not copied, and the
            # workers still report it finished (vLLM frees its blocks then).
            load.cancelled = True
        return False, None

    def reset_cache(self) -> bool | None:
        """Drop every host block (vLLM calls this on a prefix-cache reset, e.g.
        after a weight update): stale KV must never be served."""
        if self._role != KVConnectorRole.SCHEDULER or not self.enabled:
            return None
        self.index = HostBlockIndex(self.num_slots, self._cfg.kv_host_cache_policy)
        # Loads already promised to allocated blocks still run, so their slots
        # stay pinned until they finish; queued saves are dropped.
        self._evict_saves = []
        self._step_pins = []
        self._scan_state = None
        for load in self._load_queue.values():
            self.index.pin(load.slots)
        for load in self._inflight_loads.values():
            self.index.pin(load.slots)
        for _, slots, _ in self._matched.values():
            self.index.pin(slots)
        for chunk in self._sync_loads:  # this step's: unpinned once sent
            self.index.pin(chunk.slots)
            self._step_pins += chunk.slots
        logger.info("Host KV tier reset: all host blocks dropped.")
        return True

    def host_bytes_in_use(self) -> int:
        return len(self.index) * self.pipeline_slot_bytes if self.enabled else 0

    def load_queue_blocks(self) -> int:
        queued = sum(len(x.pairs) for x in self._load_queue.values())
        return queued + sum(len(x.slots) for x in self._inflight_loads.values())

    def _count(self, **values: int | float) -> None:
        for k, v in values.items():
            self._stats.data[k] += v
            self.totals[k] += v

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self.enabled:
            return None
        stats, self._stats = self._stats, HostTierStats()
        self._stats.reset()
        if self._role == KVConnectorRole.SCHEDULER:
            stats.data["host_bytes_in_use"] = self.host_bytes_in_use()
            stats.data["load_queue_blocks"] = self.load_queue_blocks()
        elif stats.is_empty():
            return None
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

    def _init_worker(self) -> None:
        self._engine: Any = None
        self._stats = HostTierStats()
        self._stats.reset()
        self._last_seq = 0
        # In-flight jobs (GPU only; CPU copies are complete when issued).
        # (job, blocks, slots) of saves still in flight
        self._save_jobs: list[tuple[Any, list[int], list[int]]] = []
        self._ahead_jobs: deque[tuple[int, Any]] = deque()  # (step, job)
        self._loads: dict[str, list[Any]] = {}  # req -> jobs
        # (job, slots) of loads still in flight: a save into a slot waits
        # for the load reading it.
        self._load_jobs: list[tuple[Any, list[int]]] = []
        self._load_pairs: dict[str, list[tuple[int, int]]] = {}  # for verify
        self._reportable: set[str] = set()
        self._load_errors: set[int] = set()
        self._checksums: dict[int, int] = {}  # slot -> crc32 (verify mode)

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
            "Host KV tier on this rank: %d slots x %d bytes = %s GiB of %s host "
            "memory.",
            self.num_slots,
            pool.slot_bytes,
            gib(pool.nbytes),
            "pinned" if pool.pinned else "pageable (pre-faulting in the background)",
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
            "Host KV tier released on this rank: %s GiB of %s host memory.",
            gib(nbytes),
            "pinned" if pinned else "pageable",
        )

    def _meta(self) -> HostTierMetadata | None:
        if self._engine is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, HostTierMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the step's forward pass: the saves it must not race."""
        meta = kv_connector_metadata
        if self._engine is None or not isinstance(meta, HostTierMetadata):
            return
        started = time.perf_counter()
        self._last_seq = meta.seq
        self._prune()
        fenced = set(meta.fence)
        for job, blocks, _ in self._save_jobs:
            if fenced.intersection(blocks):
                job.make_current_stream_wait()  # device-side; no host wait
        if meta.evict_saves:
            # These blocks belong to new requests from this step on: the
            # forward pass must not overwrite them before they are copied.
            job = self._save(meta.evict_saves)
            job.make_current_stream_wait()
        if meta.ahead_saves:
            job = self._save(meta.ahead_saves)
            if job.event is not None:
                self._ahead_jobs.append((meta.seq, job))
        self._count(copy_wait_seconds=time.perf_counter() - started)

    def _save(self, pairs: list[tuple[int, int]]) -> Any:
        blocks = [b for b, _ in pairs]
        slots = [s for _, s in pairs]
        taken = set(slots)
        after = [j for j, js in self._load_jobs if taken.intersection(js)]
        job = self._engine.save(blocks, slots, after)
        if job.event is not None:
            self._save_jobs.append((job, blocks, slots))
        if self.verify:
            job.wait()
            for slot in slots:
                self._checksums[slot] = _crc(self._engine.slot_image(slot))
        return job

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's loads. vLLM calls this before the forward pass when the
        step has synchronous loads (their requests are in the batch: the
        forward waits for those copies only), after its launch otherwise
        (requests waiting in WAITING_FOR_REMOTE_KVS: nothing waits)."""
        meta = self._meta()
        if meta is None or not meta.loads:
            return
        started = time.perf_counter()
        for chunk in meta.loads:
            job = self._load(chunk) if chunk.blocks else None
            if chunk.sync:
                if job is not None:
                    job.make_current_stream_wait()  # device-side; no host wait
                if self.verify:
                    if job is not None:
                        job.wait()
                    self._verify(chunk.req_id, list(zip(chunk.slots, chunk.blocks)))
                continue
            jobs = self._loads.setdefault(chunk.req_id, [])
            if job is not None:
                jobs.append(job)
            if self.verify:
                pairs = self._load_pairs.setdefault(chunk.req_id, [])
                pairs += zip(chunk.slots, chunk.blocks)
            if chunk.last:
                self._reportable.add(chunk.req_id)
        self._count(copy_wait_seconds=time.perf_counter() - started)

    def _load(self, chunk: LoadChunk) -> Any:
        """Start one chunk's copies after the saves they depend on; a failure
        marks its blocks for recompute (None)."""
        after = self._saves_touching(chunk.blocks, chunk.slots)
        try:
            job = self._engine.load(chunk.slots, chunk.blocks, after)
        except Exception:
            logger.exception(
                "Host KV tier: loading %d blocks for request %s failed; they will "
                "be recomputed.",
                len(chunk.blocks),
                chunk.req_id,
            )
            self._load_errors.update(chunk.blocks)
            return None
        if job.event is not None:
            self._load_jobs.append((job, chunk.slots))
        return job

    def _saves_touching(self, blocks: list[int], slots: list[int]) -> list[Any]:
        """In-flight saves a load must follow: from a slot it reads, or of a
        block it overwrites."""
        if not self._save_jobs:
            return []
        b, s = set(blocks), set(slots)
        return [
            job
            for job, jb, js in self._save_jobs
            if b.intersection(jb) or s.intersection(js)
        ]

    def _prune(self) -> None:
        self._save_jobs = [x for x in self._save_jobs if not x[0].done()]
        self._load_jobs = [x for x in self._load_jobs if not x[0].done()]
        while self._ahead_jobs and self._ahead_jobs[0][1].done():
            self._ahead_jobs.popleft()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        done = set()
        for req_id in list(self._reportable):
            jobs = self._loads.get(req_id, [])
            if not all(job.done() for job in jobs):
                continue
            self._reportable.discard(req_id)
            self._loads.pop(req_id, None)
            pairs = self._load_pairs.pop(req_id, [])
            if self.verify:
                self._verify(req_id, pairs)
            done.add(req_id)
        return None, done or None

    def _verify(self, req_id: str, pairs: list[tuple[int, int]]) -> None:
        bad = [
            block
            for slot, block in pairs
            if self._checksums.get(slot) != _crc(self._engine.block_image(block))
        ]
        if bad:
            logger.error(
                "Host KV tier: %d of %d blocks loaded for request %s fail their "
                "checksum; they will be recomputed.",
                len(bad),
                len(pairs),
                req_id,
            )
            self._load_errors.update(bad)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        self._count(load_errors=len(errors))
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._engine is None:
            return None
        self._prune()
        pending = self._ahead_jobs[0][0] - 1 if self._ahead_jobs else self._last_seq
        return HostTierWorkerMeta(saved_through=pending)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _crc(image: Any) -> int:
    """CRC-32 of a host tensor's bytes (integrity checks only)."""
    return zlib.crc32(image.contiguous().numpy())
