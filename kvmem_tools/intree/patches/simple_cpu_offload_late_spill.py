"""[KV Offload] Late spills in SimpleCPUOffloadConnector's lazy mode.

Lazy offload copies a cached block when its cursor, walking the GPU free
queue at the end of a scheduling pass, reaches it. A cached block that
``BlockPool.get_new_blocks`` hands out in the same pass, before the walk,
loses its hash and is never copied. ``BlockPool`` gains an opt-in record of
the cached blocks it evicts (block id and the keys it held); lazy mode turns
it on, drains it when it builds the step's metadata, registers a CPU block
under those keys at once, and the worker copies the block in
``handle_preemptions``, before that step's forward writes it. The RFC is
docs/rfc-host-kv-tier.md.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.patches.simple_cpu_offload_cpu import BACKEND_FIELD
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "simple_cpu_offload_late_spill"
POOL = "vllm/v1/core/block_pool.py"
MANAGER = "vllm/v1/simple_kv_offload/manager.py"
METADATA = "vllm/v1/simple_kv_offload/metadata.py"
WORKER = "vllm/v1/simple_kv_offload/worker.py"

MESSAGE = pr_text(
    overview="""\
In `lazy_offload` mode, `SimpleCPUOffloadConnector` loses every cached block
that the allocator hands out before the cursor's walk reaches it. This PR
stores those blocks too ("late spills"): `BlockPool` keeps an opt-in record
of the cached blocks `get_new_blocks` evicts, and the worker copies them out
in `handle_preemptions`, before the forward overwrites them. Second PR of
the series (RFC: "Lazy CPU offload: what it lacks"), stacked on the
CPU-platform PR: it extends that PR's worker code, and its CPU validation
runs on it.
""",
    claims=[
        (
            "On a workload where finished requests' blocks are reused in the next "
            "scheduling pass, lazy offload's host hit rate on revisited prefixes goes"
            " from 50% to 100% (CPU build, figure below), equal to an external host-"
            "tier connector that copies such blocks; greedy output unchanged."
        ),
        (
            "Each evicted block is stored once, under the keys it held (primary and "
            "secondary hashes), and no GPU or CPU block is held for it."
        ),
        (
            "Off unless lazy mode is on; eager mode, the disk backend and KV events "
            "are unchanged (late spills are skipped when KV events are enabled)."
        ),
    ],
    validation="""\
- `pytest tests/v1/simple_kv_offload/test_late_spills.py`: 5 passed (CPU
  build of vLLM 0.32.0 and 0.33.0): a real `BlockPool` and
  `SimpleCPUOffloadScheduler`, no model.
- Engine, CPU build (random-weight 8-layer Llama, float32, 12-block device
  cache, 2 requests at a time; 4 prompts of 101 tokens, 4 others, the first
  4 again). Cached tokens of the revisit, of 384 prompt tokens:

  | arm | revisit hit | output = no offload |
  | --- | --- | --- |
  | no offload | 0 | - |
  | lazy, before this PR | 192 (50%) | yes |
  | lazy, this PR | 384 (100%) | yes |
  | external host-tier connector (same workload) | 384 (100%) | yes |

  The same on vLLM 0.32.0 and 0.33.0. On an H200, before this PR, lazy
  offload's host hit rate was 0.64 / 0.55 against 0.71 / 0.70 for a
  connector with late spills (concurrency 4 / 8, one repeat).
""",
    details="""\
Why blocks are lost: the walk runs in `build_connector_meta`, after this
pass's allocations. When a request finishes and the next pass admits a
waiting one, `get_new_blocks` can take the finished request's cached blocks
from the free queue first, and `_maybe_evict_cached_block` drops their
hashes before the walk sees them.

The change: `BlockPool.evicted_cached_blocks` (None unless a reader turns it
on) gets `(block_id, hash, num_tokens, other hashes)` for each cached block
`get_new_blocks` evicts. The manager drains it in `build_connector_meta`,
before the lazy walk claims CPU blocks; for each block not already on CPU
it allocates a CPU block, registers the recorded hashes at once and frees
it (no reference held). `SimpleCPUOffloadMetadata` carries the pairs; the
worker copies them synchronously in `handle_preemptions`, which runs before
`_update_states` (block zeroing) and the forward. Registering before the
copy is safe because every worker runs that copy before any transfer of a
later step, and a free CPU block has no transfer in flight.

Trade-off: on CUDA the spill copy blocks the host for those blocks (the
compute stream must not overwrite them); it only happens when a cached block
the walk missed is evicted. KV events for spilled blocks are left to a
follow-up, so spills are off with KV events enabled.
""",
    duplicates="""\
lazy mode's walk (`_prepare_lazy_store_specs`) is reused
unchanged; `unpin_blocks`' reuse watchers cover only blocks a caller
released, not ordinary cached blocks, so they cannot see these evictions.
No open PR records evicted blocks for connectors.
""",
    design_fit=Answer(
        True,
        (
            "Core change: an opt-in list in `BlockPool` (off by default, one branch "
            "in `get_new_blocks`); the rest is in the connector."
        ),
    ),
    testing=Answer(
        True,
        (
            "Scheduler-level tests on a real `BlockPool`; the engine figure ran "
            "outside CI (CPU build); CUDA not run."
        ),
    ),
    code_quality=Answer(
        False,
        "Code and comments: yes. Docs: no page for this connector yet; none updated.",
    ),
    contents=Answer(
        True,
        "Root cause, design, trade-offs and the figure above.",
    ),
)

_EVICTED_BLOCK = '''\
class EvictedBlock(NamedTuple):
    """A cached block that ``BlockPool.get_new_blocks`` handed out. It holds the
    KV of ``block_hash`` until its new owner's forward writes it."""

    block_id: int
    block_hash: BlockHashWithGroupId
    num_tokens: int | None
    other_hashes: tuple[BlockHashWithGroupId, ...]


'''

_RECORD = """
        # Opt-in record (None: off) of the cached blocks get_new_blocks evicts,
        # drained by its reader: a KV connector can copy such a block out under
        # the keys it held before its new owner's forward overwrites it.
        self.evicted_cached_blocks: list[EvictedBlock] | None = None
"""

_RECORD_EVICTION = """\
            for block in ret:
                if self.evicted_cached_blocks is not None and block.block_hash:
                    other = self.cached_block_hashes_by_block.get(block.block_id, ())
                    self.evicted_cached_blocks.append(
                        EvictedBlock(
                            block.block_id,
                            block.block_hash,
                            block.block_hash_num_tokens,
                            tuple(other),
                        )
                    )
                self._maybe_evict_cached_block(block)
"""

_PREPARE_LATE_SPILLS = '''\
    def _prepare_late_spills(self) -> tuple[list[int], list[int]]:
        """Lazy mode: store the cached GPU blocks handed out since the last
        step before the cursor reached them.

        Such a block still holds the KV of the keys it had until this step's
        forward writes it; the worker copies it in ``handle_preemptions``,
        before that forward. The copy is synchronous and every worker makes it
        before any later step's transfer, so the CPU block is registered under
        those keys now and no block is held.
        """
        gpu_pool = self._gpu_block_pool
        if gpu_pool is None or not gpu_pool.evicted_cached_blocks:
            return [], []
        # A block handed out twice in one step holds the KV of its first keys.
        evicted = {e.block_id: e for e in reversed(gpu_pool.evicted_cached_blocks)}
        gpu_pool.evicted_cached_blocks.clear()
        cpu_pool = self.cpu_block_pool
        todo = [
            e
            for e in evicted.values()
            if cpu_pool.cached_block_hash_to_block.get_one_block(e.block_hash) is None
        ][: cpu_pool.get_num_free_blocks()]
        cpu_blocks = cpu_pool.get_new_blocks(len(todo))
        for e, cpu_block in zip(todo, cpu_blocks):
            cpu_pool._insert_block_hash(e.block_hash, cpu_block, e.num_tokens)
            for block_hash in e.other_hashes:
                cpu_pool._insert_block_hash(block_hash, cpu_block, None)
        cpu_pool.free_blocks(cpu_blocks)
        return [e.block_id for e in todo], [b.block_id for b in cpu_blocks]

'''

_SPILL = '''\
    def handle_preemptions(
        self, kv_connector_metadata: SimpleCPUOffloadMetadata
    ) -> None:
        """Before the step's forward: copy out the blocks evicted this step
        (lazy mode), and sync in-flight transfers before preempted blocks are
        reused."""
        if kv_connector_metadata.spill_gpu_blocks:
            # Synchronous: the scheduler has registered the CPU blocks already.
            assert self._spill_backend is not None
            self._spill_backend.copy_blocks(
                kv_connector_metadata.spill_gpu_blocks,
                kv_connector_metadata.spill_cpu_blocks,
                is_store=True,
            )
        if not kv_connector_metadata.need_flush:
'''


_WATCHERS = """\
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
"""

_EVICT = """\
            for block in ret:
                self._maybe_evict_cached_block(block)
"""

_SPILL_FIELDS = """
    # Lazy mode: cached GPU blocks evicted this step, copied to their CPU
    # blocks before this step's forward overwrites them.
    spill_gpu_blocks: list[int] = field(default_factory=list)
    spill_cpu_blocks: list[int] = field(default_factory=list)
"""

_LATE_SPILLS_FLAG = """\
        # Lazy mode also stores cached blocks evicted before the cursor
        # reached them (CPU backend, without KV events).
        self._late_spills = (
            lazy_offload
            and disk_capacity_bytes == 0
            and not self.enable_kv_cache_events
        )
"""

_TURN_ON = """\
        if self._late_spills:
            gpu_block_pool.evicted_cached_blocks = []
"""

_DRAIN = """\
        # --- Late spills, before stores claim CPU blocks ---
        spill_gpu, spill_cpu = self._prepare_late_spills()

"""

_TO_WORKER = """\
            spill_gpu_blocks=spill_gpu,
            spill_cpu_blocks=spill_cpu,
"""

_RESET = """\
        if self._gpu_block_pool is not None and self._late_spills:
            # Evicted before the reset: their KV is no longer valid.
            self._gpu_block_pool.evicted_cached_blocks = []
"""

_SPILL_BACKEND_FIELD = """\
        # Lazy mode's late spills, copied synchronously on every platform.
        self._spill_backend: SyncCopyBackend | None = None
"""

_SPILL_BACKEND = """\
        self._spill_backend = SyncCopyBackend()
        self._spill_backend.init(unique_gpu_caches, self.cpu_kv_caches)
"""

_PREEMPTIONS = '''\
    def handle_preemptions(
        self, kv_connector_metadata: SimpleCPUOffloadMetadata
    ) -> None:
        """Sync all in-flight transfers before preempted blocks are reused."""
        if not kv_connector_metadata.need_flush:
'''


def _changes() -> list:
    test = "tests/v1/simple_kv_offload/test_late_spills.py"
    return [
        Edit(
            POOL,
            "from typing import Any\n",
            "from typing import Any, NamedTuple\n",
            where="replace",
        ),
        Edit(POOL, "class BlockPool:\n", _EVICTED_BLOCK, where="before"),
        Edit(POOL, _WATCHERS, _RECORD),
        Edit(POOL, _EVICT, _RECORD_EVICTION, where="replace"),
        Edit(
            METADATA,
            "    store_cpu_blocks: list[int] = field(default_factory=list)\n",
            _SPILL_FIELDS,
        ),
        Edit(MANAGER, "        self._lazy_mode = lazy_offload\n", _LATE_SPILLS_FLAG),
        Edit(MANAGER, "        self._gpu_block_pool = gpu_block_pool\n", _TURN_ON),
        Edit(
            MANAGER,
            "        # --- Stores ---\n        store_event = -1\n",
            _DRAIN,
            where="before",
        ),
        Edit(
            MANAGER,
            "            need_flush=bool(scheduler_output.preempted_req_ids),\n",
            _TO_WORKER,
        ),
        Edit(MANAGER, "    def prepare_store_specs(\n", _PREPARE_LATE_SPILLS, "before"),
        Edit(
            MANAGER,
            "        self._cursor = None\n        # Seed the fresh counters",
            _RESET,
            where="before",
        ),
        Edit(WORKER, BACKEND_FIELD, _SPILL_BACKEND_FIELD),
        Edit(
            WORKER,
            "        if on_cpu:\n            self._backend = SyncCopyBackend()\n",
            _SPILL_BACKEND,
            where="before",
        ),
        Edit(WORKER, _PREEMPTIONS, _SPILL, where="replace"),
        NewFile(test, FILES / SLUG / test),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[KV Offload] Late spills for lazy CPU offload",
    message=MESSAGE,
    changes={"0.32": _changes(), "0.33": _changes()},
    builds_on=("simple_cpu_offload_cpu",),
)
