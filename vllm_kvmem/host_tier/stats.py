"""The host tier's metrics: counters and gauges reported through vLLM's
connector stats (logged, and on /metrics), and the counting both sides share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
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
    "load_errors",
    "save_errors",
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
    "were dropped (late_spill 'drop').",
    "load_errors": "Host tier blocks that failed to load or verify (recomputed).",
    "save_errors": "Blocks whose copy to the host tier failed (not kept on the "
    "host; served from the device or recomputed).",
    "copy_wait_seconds": "Seconds engine steps waited on host tier copies, summed "
    "over workers (on GPUs the compute stream's stalls on copy events, timed on "
    "the device and sampled; on CPU the copies themselves).",
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


class CountsStats:
    """Counting on either side (scheduler or worker): into this interval's
    stats, handed to vLLM and replaced, and into ``totals``."""

    def __init__(self) -> None:
        self._stats = HostTierStats()
        self._stats.reset()
        # Counters since start (the stats objects are handed to vLLM and
        # replaced every step).
        self.totals: dict[str, int | float] = dict.fromkeys(COUNTERS, 0)

    def _count(self, **values: int | float) -> None:
        for k, v in values.items():
            self._stats.data[k] += v
            self.totals[k] += v

    def _take_stats(self) -> HostTierStats:
        """This interval's stats, a fresh interval started."""
        stats, self._stats = self._stats, HostTierStats()
        self._stats.reset()
        return stats
