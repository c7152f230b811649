"""The connector vLLM loads (``kv_connector_module_path``): a thin shell that
hands each call of vLLM's connector API to this process's side of the tier,
:class:`HostTierScheduler` in the engine core, :class:`HostTierWorker` in a
worker (the shape of upstream's ``OffloadingConnector``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any, TypeVar

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.disk_tier import WorkerDisk, disk_serves
from vllm_kvmem.host_tier.kv_region import config_slot_bytes
from vllm_kvmem.host_tier.scheduler import HostTierScheduler
from vllm_kvmem.host_tier.stats import HostTierPromMetrics, HostTierStats, StepClock
from vllm_kvmem.host_tier.support import hit_groups, unsupported_reason
from vllm_kvmem.host_tier.worker import HostTierWorker

_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(*, ends_step: bool = False) -> Callable[[_F], _F]:
    """Add a call's time to this step's (``StepClock``); ``ends_step``: the
    last call of the side's step (``build_connector_meta`` in the engine
    core, ``build_connector_worker_meta`` in a worker)."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def timed(self: KVMemHostTierConnector, *args: Any, **kwargs: Any) -> Any:
            started = perf_counter_ns()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.clock.ns += perf_counter_ns() - started
                if ends_step:
                    self.clock.end_step()

        return timed  # type: ignore[return-value]

    return wrap


class KVMemHostTierConnector(KVConnectorBase_V1, SupportsHMA):
    """A host-memory KV tier for blocks the device prefix cache evicts,
    configured through ``kv_connector_extra_config`` (:class:`HostTierConfig`).

    ``SupportsHMA``: with it vLLM keeps its hybrid KV cache manager for models
    with several KV cache groups (sliding-window and full-attention layers),
    which the tier serves group by group; without it vLLM would turn that
    manager off for any model and give sliding-window layers full-attention
    memory."""

    # Hits come from host memory (vLLM's per-source prefix cache metrics).
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = HostTierConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        self.num_slots = self.config.num_host_blocks
        reason = unsupported_reason(kv_cache_config)
        self.pipeline_slot_bytes = 0
        if not reason:
            self.pipeline_slot_bytes = self.config.host_block_bytes or (
                config_slot_bytes(kv_cache_config)
            )
        if not reason and self.num_slots < 1:
            reason = "no host block: kv_connector_extra_config num_host_blocks is 0"
            if self.config.host_bytes:
                reason = (
                    f"{self.config.host_bytes:,} host bytes hold no whole block "
                    f"({self.pipeline_slot_bytes:,} bytes per block)"
                )
        self.enabled = not reason
        groups = kv_cache_config.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size if groups else 0
        self.connector_scheduler: HostTierScheduler | None = None
        self.connector_worker: HostTierWorker | None = None
        # The tier's own time per engine step on this side (the
        # vllm:kvmem_host_*_step_seconds histograms).
        self.clock = StepClock()
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HostTierScheduler(
                self.config,
                vllm_config,
                reason=reason,
                num_slots=self.num_slots,
                pipeline_slot_bytes=self.pipeline_slot_bytes,
                block_size=self.block_size,
                groups=hit_groups(kv_cache_config) if self.enabled else (),
            )
        else:
            # The disk tier behind the host, made once the rank is known.
            disk: Callable[[], WorkerDisk] | None = None
            if self.enabled and self.config.disk_path and disk_serves(kv_cache_config):
                disk = functools.partial(
                    WorkerDisk.for_this_rank, self.config, vllm_config
                )

            self.connector_worker = HostTierWorker(
                kv_cache_config,
                enabled=self.enabled,
                num_slots=self.num_slots,
                verify=self.config.verify,
                disk=disk,
                copy_thread=self.config.copy_thread,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # All layers of a block adjacent: a block is one copy. vLLM keeps its
        # own layout, with a warning, where the attention backends lack it;
        # the tier copies any layout.
        return "BLHNC"

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a later miss.
        return False

    @property
    def _scheduler(self) -> HostTierScheduler:
        assert self.connector_scheduler is not None
        return self.connector_scheduler

    @property
    def _worker(self) -> HostTierWorker:
        assert self.connector_worker is not None
        return self.connector_worker

    # ---------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._scheduler.bind_gpu_block_pool(gpu_block_pool)

    @_timed()
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed()
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @_timed(ends_step=True)
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    @_timed()
    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    @_timed()
    def request_finished(self, request: Any, block_ids: list[int]):
        return self._scheduler.request_finished(request, (block_ids,))

    @_timed()
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.connector_scheduler is None:
            return ()
        return self.connector_scheduler.take_events()

    def reset_cache(self) -> bool | None:
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.reset_cache()

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    @_timed()
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    @_timed()
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # The metadata vLLM bound for this step (bind_connector_metadata).
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        self._worker.start_load_kv(meta)

    @_timed()
    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    @_timed()
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    @_timed(ends_step=True)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ------------------------------------------------------------ both sides

    def shutdown(self) -> None:
        """Release the host pool when the engine shuts down; idempotent.

        vLLM calls this on the worker's connector from ``Worker.shutdown``
        (via ``ensure_kv_transfer_shutdown``) and on the scheduler's from
        ``Scheduler.shutdown``. Without it the pinned pool lives until the
        garbage collector finds the connector, so a second engine started in
        the same process would find the first one's memory still pinned.
        """
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    @_timed()
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self.enabled:
            return None
        if self.connector_scheduler is not None:
            stats = self.connector_scheduler.stats()
            key = "scheduler_step_us"
        else:
            stats = self._worker.stats()
            key = "worker_step_us"
        if (times := self.clock.take_due()) is not None:
            if stats is None:
                stats = self.build_kv_connector_stats()
            stats.data[key] = times
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
