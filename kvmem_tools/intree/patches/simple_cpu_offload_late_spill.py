"""[KV Offload] Late spills for lazy CPU offload.

Lazy offload copies a cached block when its cursor, walking the GPU free
queue at the end of a scheduling pass, reaches it. A cached block that
``BlockPool.get_new_blocks`` hands out in the same pass, before the walk,
loses its hash and is never copied. ``BlockPool`` gains eviction listeners
(called with each cached block it hands out, before its hashes go; nothing
on the allocation path while none is registered). Lazy mode registers one,
turns the recorded blocks into a store of their own, and the worker copies
them in ``handle_preemptions``, before the step writes them: on CUDA on the
store stream, ordered after the compute stream's queued work, with the
compute and load streams waiting for it, so the host never waits. The CPU
blocks get their keys (and KV events) when the copy completes, through the
store-completion path every lazy store takes.
"""

from kvmem_tools.intree.edits import Edit, appended
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "simple_cpu_offload_late_spill"
POOL = "vllm/v1/core/block_pool.py"
MANAGER = "vllm/v1/simple_kv_offload/manager.py"
METADATA = "vllm/v1/simple_kv_offload/metadata.py"
WORKER = "vllm/v1/simple_kv_offload/worker.py"
BACKEND = "vllm/v1/simple_kv_offload/copy_backend.py"
TESTS = "tests/v1/simple_kv_offload/"
SCHEDULER_TEST = TESTS + "test_scheduler.py"
EVENTS_TEST = TESTS + "test_kv_events.py"
WORKER_TEST = TESTS + "test_worker.py"

MESSAGE = pr_text(
    overview="""\
In `lazy_offload` mode, `SimpleCPUOffloadConnector` loses every cached block
that the allocator hands out before the cursor's walk reaches it. This PR
stores those blocks too ("late spills"). `BlockPool` gains eviction
listeners, called with each cached block `get_new_blocks` hands out while
it still holds its hashes; lazy mode registers one and stores the recorded
blocks before the step writes them. Part of the RFC "Lazy CPU offload: what
it lacks"; on Model Runner V2 it needs the PR that calls
`handle_preemptions` before `update_requests` writes new blocks.
""",
    claims=[
        (
            "On a workload where finished requests' blocks are reused in the next "
            "scheduling pass, lazy offload's host hit rate on revisited prefixes goes"
            " from 50% to 100% (CPU engine, figure below), equal to an external host-"
            "tier connector that copies such blocks; greedy output unchanged."
        ),
        (
            "Each evicted block is stored once, under the keys it held; its CPU "
            "block gets them (and a CPU-medium `BlockStored` event when KV events "
            "are on) only when the copy has completed on every worker."
        ),
        (
            "On CUDA the copy is stream-ordered: after the work already queued on "
            "the compute stream, before the step's writes, with no host wait "
            "(unit test for CUDA below; not yet run on a GPU)."
        ),
        "Eager mode and the disk backend are unchanged.",
    ],
    validation=f"""\
- `pytest {SCHEDULER_TEST} -k "late_spill or eviction"`: 5 passed and
  `pytest {EVENTS_TEST} -k late_spill`: 1 passed (CPU build of vLLM
  0.32.0 and 0.33.0): a real `BlockPool` and `SimpleCPUOffloadScheduler`,
  no model. The 2 CUDA tests added to `{WORKER_TEST}` (the copy holds the
  block's KV although the compute stream overwrites it next;
  `handle_preemptions` returns while the compute stream is still busy)
  skip without a GPU: they run in the "V1 KV Offload" step and have not
  run yet.
- Engine, CPU build (random-weight 8-layer Llama, float32, 12-block device
  cache, 2 requests at a time; 4 prompts of 101 tokens, 4 others, the first
  4 again). The CPU build cannot run this connector as shipped (CUDA
  streams, `cudaHostRegister`), so this run used a test-only synchronous
  copy path in place of the CUDA one; it is not part of this PR. Cached
  tokens of the revisit, of 384 prompt tokens:

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
pass's allocations, so a finished request's cached blocks handed to a
waiting one first lose their hashes (`_maybe_evict_cached_block`) unseen.

Core: `BlockPool.add_eviction_listener(listener)`; `get_new_blocks` calls
each listener with every cached block it hands out, before the hashes go,
beside the reuse watchers: one list check per call while none is
registered, none per block; several connectors can listen. It follows the
API of #43946 (closed), not its copy on the compute stream, and not the
flag of #47235 (`consume_eviction_signal()`, open), which gives no block or
keys. It needs only the pool, so it fits #53067's scheduler context too.

Connector: the manager records each block's keys (its first record in a
step: the KV it holds) and stores the records not on CPU yet as a store
event of their own. `_process_store_completion` registers the keys and
emits `BlockStored` when every worker has reported it, freeing no GPU ref.
The worker copies in `handle_preemptions`; on CUDA,
`DmaCopyBackend.copy_before_overwrite` issues one `cuMemcpyBatchAsync` on
the store stream after `wait_stream(current)`, and the current and load
streams wait for its event: no host sync, index upload or temporary buffer.
Trade-off: the step's compute waits on the GPU for that copy.
""",
    duplicates="""\
#47235 (open) adds `BlockPool.consume_eviction_signal()` to re-store CPU
blocks whose entries the CPU pool evicted; this PR is about GPU blocks the
walk missed, and its listener could carry that signal too (see Details).
#43946 (closed) proposed `register_eviction_listener` with a gather on the
compute stream; this PR follows its API, not its copy. #46397 (open) adds KV
events to this connector; spills emit theirs through the same completion
path, so the two compose. #40332 (open) changes where lazy mode returns
stored blocks to the free queue; independent of the eviction path here.
#49048 (open) is the connector's docs page: a line on late spills belongs
there once both land. The `gh` searches of AGENTS.md are for the submitter
to rerun before opening.
""",
    design_fit=Answer(
        True,
        (
            "Core change: an eviction-listener list in `BlockPool`, next to its "
            "reuse watchers (one check per allocation while empty); the rest is "
            "in the connector."
        ),
    ),
    testing=Answer(
        False,
        (
            "Scheduler tests on a real `BlockPool` pass on CPU; the CUDA stream-"
            "ordering tests skip without a GPU and have not run; the engine figure "
            "needed a test-only CPU copy path."
        ),
    ),
    code_quality=Answer(
        False,
        "Code and comments: yes. Docs: this connector's page is #49048; not updated.",
    ),
    contents=Answer(
        True,
        "Root cause, design against #43946 / #47235, trade-off and the figure.",
    ),
)

_LISTENERS = """
        # Called with each cached block get_new_blocks hands out, before its
        # hashes are dropped (the block holds their KV until it is written).
        self._eviction_listeners: list[Callable[[KVCacheBlock], None]] = []
"""

_WATCHERS = """\
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
"""

_NOTIFY_REUSE = """\
        if self._reuse_watchers:
            self._notify_reuse(ret)
"""

_NOTIFY_EVICTION = """\
        if self._eviction_listeners and self.enable_caching:
            self._notify_eviction(ret)
"""

_LISTENER_API = '''\
    def add_eviction_listener(self, listener: Callable[[KVCacheBlock], None]) -> None:
        """Call ``listener`` with each cached block ``get_new_blocks`` hands
        out, before its hashes are dropped (e.g. a KV connector that stores
        it before its new owner's step overwrites it)."""
        self._eviction_listeners.append(listener)

    def _notify_eviction(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.block_hash is not None:
                for listener in self._eviction_listeners:
                    listener(block)

'''

_SPILL_FIELDS = """
    # Late spills: copied to their CPU blocks before this step writes them.
    spill_event: int = -1
    spill_gpu_blocks: list[int] = field(default_factory=list)
    spill_cpu_blocks: list[int] = field(default_factory=list)
"""

_EVICTED_BLOCK = '''\
class EvictedBlock(NamedTuple):
    """The keys of a cached GPU block the allocator handed out, whose KV it
    holds until its new owner's step writes it."""

    block_hash: BlockHashWithGroupId
    num_tokens: int | None
    other_hashes: tuple[BlockHashWithGroupId, ...]


'''

_TRANSFER_META_END = """\
    block_meta: list[dict[BlockHashWithGroupId, BlockStoreMeta]] | None = None


@dataclass
class LoadRequestState:
"""

_TRANSFER_EVICTED = """\
    block_meta: list[dict[BlockHashWithGroupId, BlockStoreMeta]] | None = None
    # Late spills: the keys each GPU block held (no GPU ref is held).
    evicted: list[EvictedBlock] | None = None


@dataclass
class LoadRequestState:
"""

_RECORD_FIELD = """\
        # Late spills: cached GPU blocks handed out before the walk, by id.
        self._evicted_gpu_blocks: dict[int, EvictedBlock] = {}
"""

_LISTEN = """\
        if self._late_spills:
            gpu_block_pool.add_eviction_listener(self._on_gpu_block_evicted)
"""

_LATE_SPILLS_FLAG = """\
        # Lazy mode also stores blocks evicted before the walk (late spills).
        self._late_spills = lazy_offload and disk_capacity_bytes == 0
"""

_ON_EVICTED = '''\
    def _on_gpu_block_evicted(self, block: "KVCacheBlock") -> None:
        """Record a cached GPU block the allocator hands out. A block handed
        out twice in one step holds the KV of its first keys."""
        assert self._gpu_block_pool is not None and block.block_hash is not None
        if block.block_id not in self._evicted_gpu_blocks:
            other = self._gpu_block_pool.cached_block_hashes_by_block.get(
                block.block_id, ()
            )
            self._evicted_gpu_blocks[block.block_id] = EvictedBlock(
                block.block_hash, block.block_hash_num_tokens, tuple(other)
            )

    def _prepare_late_spills(self) -> TransferMeta | None:
        """Store the GPU blocks recorded since the last step that are not on
        CPU yet; their keys are registered when the copy completes."""
        evicted, self._evicted_gpu_blocks = self._evicted_gpu_blocks, {}
        cpu_pool = self.cpu_block_pool
        todo = [
            (block_id, e)
            for block_id, e in evicted.items()
            if cpu_pool.cached_block_hash_to_block.get_one_block(e.block_hash) is None
        ][: cpu_pool.get_num_free_blocks()]
        if not todo:
            return None
        cpu_blocks = cpu_pool.get_new_blocks(len(todo))
        return TransferMeta(
            [block_id for block_id, _ in todo],
            [b.block_id for b in cpu_blocks],
            evicted=[e for _, e in todo],
        )

'''

_SPILL_STEP = """\
        # --- Late spills, before stores claim CPU blocks ---
        spill_event = -1
        spill = self._prepare_late_spills() if self._evicted_gpu_blocks else None
        if spill is not None:
            spill_event = self._store_event_counter
            self._store_event_counter += 1
            self._store_event_to_blocks[spill_event] = spill

"""

_TO_WORKER = """\
            spill_event=spill_event,
            spill_gpu_blocks=spill.gpu_block_ids if spill is not None else [],
            spill_cpu_blocks=spill.cpu_block_ids if spill is not None else [],
"""

_COMPLETION_ARGS = """\
            transfer.block_meta,
            transfer.evicted,
        )
"""

_COMPLETION_SIGNATURE_OLD = """\
        block_meta: list[dict[BlockHashWithGroupId, BlockStoreMeta]] | None = None,
    ) -> None:
"""

_COMPLETION_SIGNATURE = """\
        block_meta: list[dict[BlockHashWithGroupId, BlockStoreMeta]] | None = None,
        evicted: list[EvictedBlock] | None = None,
    ) -> None:
"""

_KEYS_FROM_GPU = """\
            gpu_block = self._gpu_block_pool.blocks[gpu_block_id]
            primary_hash = gpu_block.block_hash
            assert primary_hash is not None
            self.cpu_block_pool._insert_block_hash(
                primary_hash,
                cpu_block,
                num_tokens=gpu_block.block_hash_num_tokens,
            )
            secondary_hashes = self._gpu_block_pool.cached_block_hashes_by_block.get(
                gpu_block_id, ()
            )
"""

_KEYS = """\
            if evicted is not None:  # a late spill: the block's keys are gone
                primary_hash, num_tokens, secondary_hashes = evicted[i]
            else:
                gpu_block = self._gpu_block_pool.blocks[gpu_block_id]
                primary_hash = gpu_block.block_hash
                num_tokens = gpu_block.block_hash_num_tokens
                secondary_hashes = (
                    self._gpu_block_pool.cached_block_hashes_by_block.get(
                        gpu_block_id, ()
                    )
                )
            assert primary_hash is not None
            self.cpu_block_pool._insert_block_hash(
                primary_hash, cpu_block, num_tokens=num_tokens
            )
"""

_FREE_GPU = """\
        self.cpu_block_pool.free_blocks(cpu_blocks)
        self._gpu_block_pool.free_blocks(
            self._gpu_block_pool.blocks[bid] for bid in gpu_block_ids
        )
"""

_FREE_GPU_UNLESS_SPILLED = """\
        self.cpu_block_pool.free_blocks(cpu_blocks)
        if evicted is None:
            self._gpu_block_pool.free_blocks(
                self._gpu_block_pool.blocks[bid] for bid in gpu_block_ids
            )
"""

_RELEASE = """\
        self._gpu_block_pool.free_blocks(
            self._gpu_block_pool.blocks[bid] for bid in transfer.gpu_block_ids
        )
"""

_RELEASE_UNLESS_SPILLED = """\
        if transfer.evicted is None:
            self._gpu_block_pool.free_blocks(
                self._gpu_block_pool.blocks[bid] for bid in transfer.gpu_block_ids
            )
"""

_RESET = """\
        # Evicted before the reset: their KV is no longer valid.
        self._evicted_gpu_blocks.clear()
"""

_SPILL_PARAMS_FIELD = """\
        self._spill_params: BatchMemcpyParams | None = None
"""

_SPILL_PARAMS = """\
        # Late spills are issued from the worker's thread: params of their own.
        self._spill_params = build_params(
            gpu_caches,
            cpu_caches,
            store_stream,
            src_access_order=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        )
"""

_COPY_BEFORE_OVERWRITE = '''\
    def copy_before_overwrite(
        self, src_blocks: list[int], dst_blocks: list[int]
    ) -> torch.Event:
        """Store blocks the current stream is about to overwrite: after its
        queued work, before its (and the load stream's) next; no host wait."""
        assert self._spill_params is not None
        assert self._store_stream is not None and self._load_stream is not None
        current = torch.cuda.current_stream()
        self._store_stream.wait_stream(current)
        copy_blocks(src_blocks, dst_blocks, self._spill_params)
        event = torch.Event()
        event.record(self._store_stream)
        current.wait_event(event)
        self._load_stream.wait_event(event)
        return event

'''

_SPILL_EVENTS = """\
        self._spill_events: list[tuple[int, torch.Event]] = []
"""

_PREEMPTIONS = '''\
    def handle_preemptions(
        self, kv_connector_metadata: SimpleCPUOffloadMetadata
    ) -> None:
        """Sync all in-flight transfers before preempted blocks are reused."""
        if not kv_connector_metadata.need_flush:
'''

_SPILL = '''\
    def handle_preemptions(
        self, kv_connector_metadata: SimpleCPUOffloadMetadata
    ) -> None:
        """Before the step writes its new blocks: copy out the blocks evicted
        before they were stored (lazy mode), and sync in-flight transfers
        before preempted blocks are reused."""
        if kv_connector_metadata.spill_gpu_blocks:
            assert self._backend is not None
            event = self._backend.copy_before_overwrite(
                kv_connector_metadata.spill_gpu_blocks,
                kv_connector_metadata.spill_cpu_blocks,
            )
            self._spill_events.append((kv_connector_metadata.spill_event, event))
        if not kv_connector_metadata.need_flush:
'''

_POLL_SPILLS = """\
        while self._spill_events and self._spill_events[0][1].query():
            event_idx, _ = self._spill_events.pop(0)
            self._completed_store_events[event_idx] = 1

        return None, finished_recving or None
"""


def _changes() -> list:
    return [
        Edit(POOL, _WATCHERS, _LISTENERS),
        Edit(POOL, _NOTIFY_REUSE, _NOTIFY_EVICTION),
        Edit(POOL, "    def _notify_reuse(", _LISTENER_API, where="before"),
        Edit(
            METADATA,
            "    store_cpu_blocks: list[int] = field(default_factory=list)\n",
            _SPILL_FIELDS,
        ),
        Edit(
            MANAGER,
            "from typing import TYPE_CHECKING, Any\n",
            "from typing import TYPE_CHECKING, Any, NamedTuple\n",
            where="replace",
        ),
        Edit(MANAGER, "@dataclass\nclass TransferMeta:\n", _EVICTED_BLOCK, "before"),
        Edit(MANAGER, _TRANSFER_META_END, _TRANSFER_EVICTED, where="replace"),
        Edit(MANAGER, "        self._lazy_mode = lazy_offload\n", _LATE_SPILLS_FLAG),
        Edit(
            MANAGER,
            "        self._cursor: KVCacheBlock | None = None\n",
            _RECORD_FIELD,
        ),
        Edit(MANAGER, "        self._gpu_block_pool = gpu_block_pool\n", _LISTEN),
        Edit(MANAGER, "    def get_num_new_matched_tokens(", _ON_EVICTED, "before"),
        Edit(
            MANAGER,
            "        # --- Stores ---\n        store_event = -1\n",
            _SPILL_STEP,
            where="before",
        ),
        Edit(
            MANAGER,
            "            need_flush=bool(scheduler_output.preempted_req_ids),\n",
            _TO_WORKER,
        ),
        Edit(
            MANAGER,
            "            transfer.block_meta,\n        )\n",
            _COMPLETION_ARGS,
            where="replace",
        ),
        Edit(MANAGER, _COMPLETION_SIGNATURE_OLD, _COMPLETION_SIGNATURE, "replace"),
        Edit(MANAGER, _KEYS_FROM_GPU, _KEYS, where="replace"),
        Edit(MANAGER, _FREE_GPU, _FREE_GPU_UNLESS_SPILLED, where="replace"),
        Edit(MANAGER, _RELEASE, _RELEASE_UNLESS_SPILLED, where="replace"),
        Edit(
            MANAGER,
            "        self._cursor = None\n        # Seed the fresh counters",
            _RESET,
            where="before",
        ),
        Edit(
            BACKEND,
            "        self._load_params: BatchMemcpyParams | None = None\n",
            _SPILL_PARAMS_FIELD,
        ),
        Edit(
            BACKEND,
            "\n        self._queue = queue.SimpleQueue()\n",
            "\n" + _SPILL_PARAMS,
            where="before",
        ),
        Edit(
            BACKEND,
            "    def shutdown(self) -> None:\n",
            _COPY_BEFORE_OVERWRITE,
            "before",
        ),
        Edit(
            WORKER,
            "        self._store_events: list[tuple[int, torch.Event]] = []\n",
            _SPILL_EVENTS,
        ),
        Edit(WORKER, _PREEMPTIONS, _SPILL, where="replace"),
        Edit(
            WORKER,
            "\n        return None, finished_recving or None\n",
            "\n" + _POLL_SPILLS,
            where="replace",
        ),
        *(
            appended(test, FILES / SLUG / "appended" / test)
            for test in (SCHEDULER_TEST, EVENTS_TEST, WORKER_TEST)
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[KV Offload] Late spills for lazy CPU offload",
    message=MESSAGE,
    changes={"0.32": _changes(), "0.33": _changes()},
)
