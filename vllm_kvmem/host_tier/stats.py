"""The host tier's metrics: counters and gauges reported through vLLM's
connector stats (logged, and on /metrics), and the counting both sides share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvmem.host_tier.disk_store import (
    DISK_COUNTERS,
    DISK_GAUGES,
    DISK_METRIC_DOCS,
)

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
    "spills_skipped_overwritten",
    "load_errors",
    "save_errors",
    "copy_wait_seconds",
    # The disk tier behind the host tier: the workers' store counters (block
    # slices, summed over workers) and the scheduler's failed reads (blocks).
    *DISK_COUNTERS,
    "disk_read_failures",
)
#: Gauges: the value at the end of the interval.
GAUGES = ("host_bytes_in_use", "load_queue_blocks", *DISK_GAUGES)
#: The tier's own time in each engine step, one list per side, microseconds
#: (the scheduler's in the engine core; the workers', one entry per worker
#: and step).
STEP_TIMES = ("scheduler_step_us", "worker_step_us")
#: Histogram buckets of those step times, seconds: the goal is 50 us idle.
STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)


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
        for k in STEP_TIMES:
            if k in other.data:
                self.data[k] = [*self.data.get(k, ()), *other.data[k]]
        for k in GAUGES:
            if k in other.data:
                self.data[k] = other.data[k]
        return self

    def reduce(self) -> dict[str, int | float]:
        looked = self.data.get("lookup_tokens", 0)
        # The disk tier's counters only when it counted something: a host
        # tier without one keeps its short log line.
        out: dict[str, int | float] = {
            k: self.data.get(k, 0)
            for k in COUNTERS
            if not k.startswith("disk_") or self.data.get(k, 0)
        }
        out["copy_wait_seconds"] = round(float(out["copy_wait_seconds"]), 4)
        for k in GAUGES:
            if k in self.data:
                out[k] = self.data[k]
        out["host_hit_rate"] = (
            round(self.data.get("hit_tokens", 0) / looked, 4) if looked else 0.0
        )
        for k in STEP_TIMES:
            if times := sorted(self.data.get(k, ())):
                out[f"{k}_p50"] = round(times[len(times) // 2], 1)
                out[f"{k}_max"] = round(times[-1], 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS) and not any(
            self.data.get(k) for k in STEP_TIMES
        )


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
    "were dropped (late_spill 'drop').",
    "spills_skipped_overwritten": "Blocks not kept on the host tier because the "
    "V2 model runner zeroes or copy-on-write-fills them before the connector "
    "can copy them (late spills not sent, in-flight saves forgotten).",
    "load_errors": "Host tier blocks that failed to load or verify (recomputed).",
    "save_errors": "Blocks whose copy to the host tier failed (not kept on the "
    "host; served from the device or recomputed).",
    "copy_wait_seconds": "Seconds engine steps waited on host tier copies, summed "
    "over workers (on GPUs the compute stream's stalls on copy events, timed on "
    "the device and sampled; on CPU the copies themselves).",
    **{k: DISK_METRIC_DOCS[k] for k in DISK_COUNTERS},
    "disk_read_failures": "KV blocks whose read back from the disk tier failed on "
    "some worker (recomputed).",
}
STEP_DOCS = {
    "scheduler_step_us": "Seconds the host tier's scheduler side spent in one "
    "engine step (lookups, allocation updates, build_connector_meta, the free "
    "queue walk, finished requests).",
    "worker_step_us": "Seconds the host tier's worker side spent in one engine "
    "step, per worker (saves, load starts, get_finished; on CPU the copies).",
}
GAUGE_DOCS = {
    "host_bytes_in_use": "Host memory holding KV blocks in the host tier.",
    "load_queue_blocks": "Host tier blocks waiting to be loaded or in flight.",
    **{k: DISK_METRIC_DOCS[k] for k in DISK_GAUGES},
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
        self._step_times = {
            k: per_engine(
                self._histogram_cls,
                k.replace("_us", "_seconds"),
                doc,
                buckets=list(STEP_BUCKETS),
            )
            for k, doc in STEP_DOCS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, per_engine in self._counters.items():
            if value := transfer_stats_data.get(k, 0):
                per_engine[engine_idx].inc(value)
        for k, per_engine in self._gauges.items():
            if k in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[k])
        for k, per_engine in self._step_times.items():
            for us in transfer_stats_data.get(k, ()):
                per_engine[engine_idx].observe(us / 1e6)


class CountsStats:
    """Counting on either side (scheduler or worker): into this interval's
    stats, handed to vLLM and replaced, and into ``totals``."""

    def __init__(self) -> None:
        self._stats = HostTierStats()
        self._stats.reset()
        # Counters since start (the stats objects are handed to vLLM and
        # replaced every step).
        self.totals: dict[str, int | float] = dict.fromkeys(COUNTERS, 0)
        self._counted = False  # anything counted this interval

    def _count(self, **values: int | float) -> None:
        self._counted = True
        for k, v in values.items():
            self._stats.data[k] += v
            self.totals[k] += v

    def _take_stats(self) -> HostTierStats | None:
        """This interval's stats, a fresh interval started; None (and the
        same interval on) when nothing was counted, as in most steps."""
        if not self._counted:
            return None
        stats, self._stats = self._stats, HostTierStats()
        self._stats.reset()
        self._counted = False
        return stats


class StepClock:
    """The tier's own time in the current engine step on one side, and the
    steps not yet reported.

    Step times go to vLLM in batches (every ``FLUSH_STEPS`` steps or
    ``FLUSH_SECONDS``), so that an idle tier does not add a stats object to
    every step's output."""

    FLUSH_STEPS = 64
    FLUSH_SECONDS = 1.0

    def __init__(self) -> None:
        self.ns = 0  # this step's so far
        self.last_us = 0.0  # the last finished step's
        self.steps = 0
        self._pending: list[float] = []
        self._flushed = time.monotonic()

    def end_step(self) -> None:
        self.last_us = self.ns / 1e3
        self._pending.append(self.last_us)
        self.steps += 1
        self.ns = 0

    def take_due(self) -> list[float] | None:
        """The unreported step times, if a batch is due."""
        if not self._pending:
            return None
        now = time.monotonic()
        if len(self._pending) < self.FLUSH_STEPS and (
            now - self._flushed < self.FLUSH_SECONDS
        ):
            return None
        times, self._pending, self._flushed = self._pending, [], now
        return times
