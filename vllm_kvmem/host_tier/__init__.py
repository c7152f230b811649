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

Where each part lives:

- ``startup``: the flag turned into vLLM's connector config, the host memory
  check, the tier's size, which models it serves;
- ``connector``: :class:`KVMemHostTierConnector`, the class vLLM loads from
  this package (``MODULE_PATH``), which hands each call to one of
- ``scheduler``: :class:`HostTierScheduler`, every decision (and the eviction
  listener the ``block_pool_evict`` patch calls);
- ``worker``: :class:`HostTierWorker`, the copies;
- ``metadata``: what the scheduler tells the workers each step and what they
  answer; ``stats``: the counters and gauges, and their /metrics names.
"""

from vllm_kvmem.host_tier.connector import KVMemHostTierConnector
from vllm_kvmem.host_tier.metadata import (
    HostTierMetadata,
    HostTierWorkerMeta,
    LoadChunk,
)
from vllm_kvmem.host_tier.scheduler import HostTierScheduler, notify_evicted
from vllm_kvmem.host_tier.startup import (
    CONNECTOR_NAME,
    DEFAULT_STEP_BYTES,
    HOST_MEMORY_FRACTION,
    MODULE_PATH,
    RUNTIME_KEY,
    SIZE_FLAG,
    add_connector_config,
    default_step_bytes,
    size_host_tier,
    unsupported_reason,
)
from vllm_kvmem.host_tier.stats import (
    COUNTERS,
    GAUGE_DOCS,
    GAUGES,
    METRIC_DOCS,
    HostTierPromMetrics,
    HostTierStats,
)
from vllm_kvmem.host_tier.worker import HostTierWorker

__all__ = [
    "COUNTERS",
    "CONNECTOR_NAME",
    "DEFAULT_STEP_BYTES",
    "GAUGES",
    "GAUGE_DOCS",
    "HOST_MEMORY_FRACTION",
    "METRIC_DOCS",
    "MODULE_PATH",
    "RUNTIME_KEY",
    "SIZE_FLAG",
    "HostTierMetadata",
    "HostTierPromMetrics",
    "HostTierScheduler",
    "HostTierStats",
    "HostTierWorker",
    "HostTierWorkerMeta",
    "KVMemHostTierConnector",
    "LoadChunk",
    "add_connector_config",
    "default_step_bytes",
    "notify_evicted",
    "size_host_tier",
    "unsupported_reason",
]
