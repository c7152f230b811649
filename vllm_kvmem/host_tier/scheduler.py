"""The host tier's scheduler side: every decision. Which evicted block gets a
host slot, which cached blocks are copied ahead of eviction, which prefix hits
load (now or in the background) and in what chunks, and when a slot may be
reused. The workers execute what :class:`HostTierMetadata` says, in step order.

:class:`HostTierScheduler` is the connector's scheduler side; it composes one
part per concern, each in its own module: the prefix hits (``matching``), the
view of vLLM's free queue (``free_queue``), the loads (``load_queue``) and the
saves (``spill_queue``), over one owner of the host slots' life (``slots``),
whose notes become KV events (``kv_events``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.utils.mem_constants import MiB_bytes
from vllm.utils.mem_utils import format_gib

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.disk_tier import SchedulerDisk, serves_groups
from vllm_kvmem.host_tier.free_queue import FreeQueueShadow
from vllm_kvmem.host_tier.host_index import HostBlockIndex
from vllm_kvmem.host_tier.kv_events import HostKVEvents
from vllm_kvmem.host_tier.load_queue import LoadQueue
from vllm_kvmem.host_tier.matching import HostMatcher
from vllm_kvmem.host_tier.metadata import HostTierMetadata, HostTierWorkerMeta
from vllm_kvmem.host_tier.slots import HostSlots
from vllm_kvmem.host_tier.spill_queue import SpillQueue
from vllm_kvmem.host_tier.stats import CountsStats, HostTierStats
from vllm_kvmem.host_tier.support import GroupWindow, describe_groups

logger = init_logger("vllm.kvmem.host_tier")


class HostTierScheduler(CountsStats):
    """The scheduler-side half of the connector (one per engine core): vLLM's
    calls, each handed to the parts that own its state."""

    def __init__(
        self,
        config: HostTierConfig,
        vllm_config: Any,
        *,
        reason: str,
        num_slots: int,
        pipeline_slot_bytes: int,
        block_size: int,
        groups: tuple[GroupWindow, ...] = (GroupWindow(0),),
    ) -> None:
        """``reason``: why the tier is off (empty when on); ``groups``: the
        KV cache groups a hit restores (all of vLLM's, in its order)."""
        super().__init__()
        self.config = config
        self.enabled = not reason
        self.num_slots = num_slots
        self.pipeline_slot_bytes = pipeline_slot_bytes
        self.block_size = block_size
        self.step_bytes = config.copy_budget_bytes
        # Full-attention groups first: their hit is a plain prefix, which
        # bounds the search in the sliding-window ones.
        self.groups = tuple(sorted(groups, key=lambda g: g.window is not None))
        self._seq = 0
        self._pool: Any = None  # vLLM's device BlockPool (bind_gpu_block_pool)
        self.events = HostKVEvents(block_size)
        # Model Runner V2 (CUDA's default) writes into new blocks before the
        # connector's handle_preemptions, V1 after (docs/host-kv-tier.md,
        # "Writes into new blocks before the forward, per runner"); vLLM's
        # scheduler reads the same property.
        self.runner_writes_first = bool(
            getattr(vllm_config, "use_v2_model_runner", False)
        )
        if not self.enabled:
            logger.warning(
                "Host KV tier off: %s; serving continues without it.", reason
            )
            return
        sched = vllm_config.scheduler_config
        step_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 0)
        slot_bytes = max(1, self.pipeline_slot_bytes)
        budget_blocks = max(1, self.step_bytes // slot_bytes)
        # Blocks near the head of the free queue worth copying ahead: what the
        # next two steps could evict.
        scan_window = max(2 * cdiv(step_tokens, self.block_size), 64)
        # Blocks one scheduling pass can evict: every group's share of the
        # step's tokens, plus a block boundary per scheduled request.
        max_seqs = int(getattr(sched, "max_num_seqs", 0) or 0)
        per_group = cdiv(step_tokens, self.block_size) + max_seqs + 1
        self.slots = HostSlots(self.num_slots, config.eviction_policy)
        self.spills = SpillQueue(
            self.slots,
            block_size=block_size,
            late_spill=config.late_spill,
            count=self._count,
        )
        self.free_queue = FreeQueueShadow(
            self.slots,
            block_size=block_size,
            budget_blocks=budget_blocks,
            scan_window=scan_window,
            shadow_window=max(scan_window, per_group * len(self.groups)),
        )
        self.loads = LoadQueue(self.slots, budget_blocks)
        self.disk: SchedulerDisk | None = None
        if config.disk_path:
            if serves_groups(self.groups):
                self.disk = SchedulerDisk(config, vllm_config)
                self.slots.index.on_evict = self.disk.demote
            else:
                logger.warning(
                    "Disk KV tier off: it serves models with one full-attention "
                    "KV cache group only (this one has %s); the host tier runs "
                    "without it.",
                    describe_groups(self.groups),
                )
        self.matcher = HostMatcher(
            self.slots, self.groups, block_size, self.loads, self._count, self.disk
        )
        #: What the eviction check calls with each evicted block (block id,
        #: hash held, tokens covered): a late spill. An attribute, read at
        #: every step, so that one wrapped on this object is the one called.
        self._on_evicted = self.spills.late_spill
        logger.info(
            "Host KV tier: %d blocks of %d tokens (%s GiB per TP shard, %s "
            "eviction) for %s; background copies up to %d MiB per step each "
            "way, late spills %s.",
            self.num_slots,
            self.block_size,
            format_gib(self.num_slots * self.pipeline_slot_bytes),
            config.eviction_policy,
            describe_groups(self.groups),
            self.step_bytes // MiB_bytes,
            "copied" if config.late_spill == "copy" else "dropped",
        )
        if self.disk is not None:
            logger.info(
                "Disk KV tier behind it: %s, up to %s GiB (all ranks and "
                "replicas), blocks evicted from host memory written there.",
                self.disk.store.dir,
                format_gib(config.disk_bytes),
            )

    @property
    def index(self) -> HostBlockIndex:
        return self.slots.index

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool
        if self.enabled:
            self.free_queue.pool = gpu_block_pool
            if self.events.bind(gpu_block_pool):
                self.slots.record_notes()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        return self.matcher.match(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if not self.enabled:
            return
        if self._pool is not None:  # read at the next meta
            self.free_queue.note_allocated(blocks)
        self.matcher.claim(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._seq += 1
        meta = HostTierMetadata(seq=self._seq)
        if not self.enabled:
            return meta
        spills, slots = self.spills, self.slots
        self.events.observe()
        spills.overwritten = self._written_before_hooks(scheduler_output)
        if self._pool is not None:
            self.free_queue.find_evictions(scheduler_output, self._on_evicted)
        meta.fence, meta.stale_slots = spills.fences(self._pool)
        meta.evict_saves = spills.take()
        meta.ahead_saves = self.free_queue.walk(self._seq)
        meta.loads = self.loads.step_loads()
        if self.disk is not None:
            # After every eviction of this step (saves, hits): the workers
            # write the victims before the step's copies reuse their slots.
            meta.disk_saves, meta.disk_reads = self.disk.take(self._seq)
            meta.idle = not scheduler_output.total_num_scheduled_tokens
        slots.sent(self._seq, meta.evict_saves + meta.ahead_saves)
        slots.end_step()
        self.events.add(slots.take_notes())
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

    def _written_before_hooks(self, scheduler_output: Any) -> frozenset[int]:
        """The blocks the workers' model runner writes this step before the
        connector's handle_preemptions: on Model Runner V2, update_requests
        zeroes ``new_block_ids_to_zero`` and applies the copy-on-write
        ``kv_cache_block_copies`` first. None on V1, which calls the hook
        first: its saves precede those writes."""
        if not self.runner_writes_first:
            return frozenset()
        zeroed = scheduler_output.new_block_ids_to_zero
        copies = scheduler_output.kv_cache_block_copies
        if not zeroed and not copies:
            return frozenset()
        return frozenset(zeroed or ()).union(c.dst_block_id for c in copies or ())

    def update_connector_output(self, connector_output: Any) -> None:
        if not self.enabled:
            return
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HostTierWorkerMeta):
            self.slots.reported(meta.saved_through, meta.failed_saves)
            if self.disk is not None:
                self._disk_reported(meta)
        if bad := connector_output.invalid_block_ids:
            self.loads.drop_bad_copies(bad)
        self.loads.finished(connector_output.finished_recving)
        self.events.observe()
        self.events.add(self.slots.take_notes())

    def _disk_reported(self, meta: HostTierWorkerMeta) -> None:
        """The workers' disk news: slices written (listed for lookups, and a
        KV event once every rank's is), reads done or failed (their loads go
        ahead, or their blocks are recomputed)."""
        assert self.disk is not None
        self.disk.written(meta.disk_written)
        self.events.stored_on_disk(self.disk.take_stored())
        done, failed = self.disk.reported(
            meta.disk_read_through, meta.disk_failed_reads
        )
        for slot in done:
            self.slots.filled(slot)
            self.loads.disk_read_done(slot, True)
        for slot in failed:
            self.slots.unfill(slot)
            self.loads.disk_read_done(slot, False)
        if failed:
            self._count(disk_read_failures=len(failed))
            # Once: the workers' stores log each fault kind once, and the
            # count goes on in vllm:kvmem_host_disk_read_failures_total.
            logger.warning_once(
                "Disk KV tier: blocks failed to read back from disk; their "
                "tokens are recomputed (counted in "
                "vllm:kvmem_host_disk_read_failures_total)."
            )

    def take_events(self) -> list[Any]:
        """The host blocks' KV events since the last call (vLLM's scheduler
        publishes them with the device's, once a step)."""
        return self.events.take() if self.enabled else []

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The tier never holds a finished request's blocks (``False``); it
        shadows the cached ones, which vLLM frees now and may evict in the
        next scheduling pass, before a walk of the free queue saw them."""
        if not self.enabled:
            return False, None
        if self._pool is not None:
            self.free_queue.shadow_blocks(block_ids)
        self.matcher.forget(request.request_id)
        self.loads.cancel(request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        """Drop every host block (vLLM calls this on a prefix-cache reset, e.g.
        after a weight update): stale KV must never be served."""
        if not self.enabled:
            return None
        # Loads already promised to allocated blocks still run: their slots
        # stay pinned until they finish.
        self.slots.reset()
        self.free_queue.reset()
        self.events.add(self.slots.take_notes())
        logger.info("Host KV tier reset: all host blocks dropped.")
        if self.disk is not None and self.disk.active:
            # The files cannot be told apart from ones written after the
            # reset, nor removed under other engines sharing the directory.
            self.disk.active = False
            logger.warning(
                "Disk KV tier stopped after the prefix-cache reset: blocks on "
                "disk may hold KV of the weights before it, so this engine no "
                "longer reads or writes them (restart to use it again)."
            )
        return True

    def host_bytes_in_use(self) -> int:
        return len(self.index) * self.pipeline_slot_bytes if self.enabled else 0

    def load_queue_blocks(self) -> int:
        return self.loads.blocks() if self.enabled else 0

    def stats(self) -> HostTierStats | None:
        """This interval's counters, plus the gauges: only the scheduler side
        owns them. None when nothing was counted (vLLM drops empty stats)."""
        stats = self._take_stats()
        if stats is None:
            return None
        stats.data["host_bytes_in_use"] = self.host_bytes_in_use()
        stats.data["load_queue_blocks"] = self.load_queue_blocks()
        if self.disk is not None:
            stats.data["disk_bytes_in_use"] = self.disk.bytes_in_use()
        return stats

    def shutdown(self) -> None:
        if self.enabled:
            self.free_queue.shadow = {}
        if self.disk is not None:
            self.disk.close()
