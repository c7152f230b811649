"""Host-memory KV tier: blocks the device prefix cache evicts spill to host RAM
and come back on a later prefix hit instead of being recomputed.

Life of a block (see docs/host-kv-tier.md):

1. It is computed on the device and enters vLLM's prefix cache as usual; as
   long as it stays on the device the tier costs nothing.
2. Once it is free and cached near the head of vLLM's free queue (next in
   line for eviction), the scheduler gives its hash a host slot and the
   workers copy it to host memory in the background. A block vLLM evicts
   before that copy ran is copied before the forward pass that would
   overwrite it: the scheduler finds it in its shadow of the free queue's
   head (vLLM's block pool, handed over by ``bind_gpu_block_pool``).
3. A new request whose prefix misses on the device is looked up here by vLLM's
   own block hashes, in prefix order; the hits are copied into freshly
   allocated device blocks before the forward pass that reads them, and
   count as cached tokens.

The scheduler makes every decision; each worker (every pipeline stage and
tensor-parallel rank) holds its own slice of each host block and executes the
same copies, saves before loads, in step order.

Where each part lives:

- ``connector``: :class:`KVMemHostTierConnector`, the class vLLM loads
  (``kv_connector_module_path``), which hands each call to one of
- ``scheduler``: :class:`HostTierScheduler`, every decision, made by its
  parts: ``matching`` (prefix hits in the host index), ``free_queue`` (the
  walk of vLLM's free queue, its shadow, the evictions found in it),
  ``load_queue`` (loads, a budget per step) and ``spill_queue`` (late
  spills, saves in flight, failed saves);
- ``worker``: :class:`HostTierWorker`, the copies;
- ``config``: its settings, from vLLM's ``kv_connector_extra_config``;
  ``support``: which KV cache configs it serves and what a hit restores;
- ``metadata``: what the scheduler tells the workers each step and what they
  answer; ``stats``: the counters and gauges, and their /metrics names;
- free of vLLM: ``host_index`` (slots by block hash), ``copy_engine`` (block
  copies), ``copy_strategy`` (direct or gather, and its staging),
  ``block_views`` (the views the copies read and write),
  ``host_pool`` (pinned host memory), ``kv_region`` (where a block's bytes
  live), ``wait_timer`` (the compute stream's waits on copies);
  ``disk_store`` and ``disk_files``: the file store of a second tier behind
  host memory (fingerprinted, checksummed, atomic block files with a byte
  budget);
- ``disk_tier``: that store wired in: the host index's victims written to
  disk, disk hits read into host slots on each worker's loader thread and
  loaded from there (``--kv-disk-cache-path``).

The folder imports only vLLM and itself. The plugin's set-up of the tier
(``--kv-host-cache-*`` turned into the connector's config, the host memory
check, the block count) is the plugin's ``host_tier_setup`` module, beside
its config.
"""
