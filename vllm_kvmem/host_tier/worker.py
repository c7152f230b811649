"""The host tier's worker side: the copies. Each worker (every pipeline stage
and tensor-parallel rank) holds its own slice of each host block and runs the
copies the scheduler decided, saves before loads, in step order; on a GPU it
orders them with CUDA events so that no copy races the forward pass or
another copy of the same block or slot.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.utils.mem_utils import format_gib

from vllm_kvmem.host_tier.metadata import (
    HostTierMetadata,
    HostTierWorkerMeta,
    LoadChunk,
)
from vllm_kvmem.host_tier.stats import CountsStats, HostTierStats
from vllm_kvmem.host_tier.wait_timer import StreamWaitTimer

#: Longest a worker waits for its disk reads at the end of a step that
#: computed nothing: a cold 1.5 MiB block reads in about 2 ms here, and an
#: idle step only delays the next one.
IDLE_READ_WAIT_SECONDS = 0.005

logger = init_logger("vllm.kvmem.host_tier")


class HostTierWorker(CountsStats):
    """The worker-side half of the connector (one per worker process)."""

    def __init__(
        self,
        kv_cache_config: Any,
        *,
        enabled: bool,
        num_slots: int,
        verify: bool,
        disk: Callable[[], Any] | None = None,
        copy_thread: str = "auto",
    ) -> None:
        """``disk``: makes this rank's ``WorkerDisk`` (the disk tier behind
        the host), called once the rank's place in the pipeline is known;
        ``copy_thread``: ``auto``, ``on`` or ``off`` (:func:`use_copy_thread`)."""
        super().__init__()
        self.copy_thread = copy_thread
        self._make_disk = disk
        self._disk: Any = None
        self._idle = False  # this step computes nothing (HostTierMetadata.idle)
        self._kv_cache_config = kv_cache_config
        self.enabled = enabled
        self.num_slots = num_slots
        self.verify = verify
        self._engine: Any = None
        self._last_seq = 0
        # In-flight jobs (GPU, or CPU with a copy thread; other CPU copies
        # are complete when issued).
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
        # Failed saves: slots holding no good copy (never loaded from until a
        # save writes them again), and (slot, step) not yet reported.
        self._bad_slots: set[int] = set()
        self._failed_saves: list[tuple[int, int]] = []
        self._save_causes: set[str] = set()  # logged once each
        # The compute stream's waits on copies (timed on CUDA devices).
        self._waits = StreamWaitTimer(None)
        # CPU with a copy thread: each attention layer's unit in a load
        # (CopyJob.wait_unit), and the synchronous loads of this step, which
        # the layers wait for one by one.
        self._by_layer = False
        self._layer_units: dict[str, int] = {}
        self._step_loads: list[Any] = []

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not self.enabled:
            return
        import torch

        from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine
        from vllm_kvmem.host_tier.host_pool import HostBlockPool
        from vllm_kvmem.host_tier.kv_region import (
            KVRegion,
            distinct_regions,
            layer_page_bytes,
        )

        cfg = self._kv_cache_config
        pages = layer_page_bytes(cfg)
        regions = []
        for tensor in cfg.kv_cache_tensors:
            storage = kv_caches[tensor.layers[0]].untyped_storage()
            base = torch.empty(
                0, dtype=torch.uint8, device=kv_caches[tensor.layers[0]].device
            )
            base.set_(storage, 0, (storage.nbytes(),), (1,))
            page = pages[tensor.layers[0]]
            regions.append(
                KVRegion.from_kv_cache_tensor(base, tensor, page, cfg.num_blocks)
            )
        # Hybrid models overlay their KV cache groups: one block's bytes are
        # the union of the groups' pages, copied once (the same sum the
        # scheduler sized the host slots with, config_slot_bytes).
        regions = distinct_regions(regions)
        if self._engine is not None:
            # KV caches registered again (re-initialised): the old pool goes
            # first, so the host never holds two pools for one rank.
            self._engine.close()
            self._engine = None
        pool = HostBlockPool.for_regions(
            regions, self.num_slots, cudart=_pinning_runtime()
        )
        copy_thread = use_copy_thread(self.copy_thread, base.device.type)
        self._engine = BlockCopyEngine(
            regions, pool, device=base.device, copy_thread=copy_thread
        )
        self._layer_units = {}
        self._by_layer = copy_thread
        if copy_thread:
            unit_of = {
                start: i for i, start in enumerate(self._engine.layer_unit_starts())
            }
            for tensor in cfg.kv_cache_tensors:
                for i, name in enumerate(tensor.layers):
                    unit = unit_of.get(tensor.offset + i * tensor.layer_stride)
                    if unit is not None:  # else the layer waits for all units
                        self._layer_units[name] = unit
        if self._make_disk is not None and self._disk is None:
            self._disk = self._make_disk()
        self._waits = StreamWaitTimer(self._engine.device)
        logger.info(
            "Host KV tier on this rank: %d slots x %d bytes = %s GiB of %s host "
            "memory.%s",
            self.num_slots,
            pool.slot_bytes,
            format_gib(pool.nbytes),
            "pinned" if pool.pinned else "pageable (pre-faulting in the background)",
            " Copies run on a copy thread beside the forward pass; a loaded "
            "prefix is waited for layer by layer."
            if copy_thread
            else "",
        )

    def shutdown(self) -> None:
        """Release the host pool (see the connector's ``shutdown``); idempotent."""
        disk, self._disk = self._disk, None
        if disk is not None:
            disk.close()
        engine, self._engine = self._engine, None
        if engine is None:
            return
        nbytes, pinned = engine.pool.nbytes, engine.pool.pinned
        engine.close()
        logger.info(
            "Host KV tier released on this rank: %s GiB of %s host memory.",
            format_gib(nbytes),
            "pinned" if pinned else "pageable",
        )

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the step's forward pass: the saves it must not race."""
        meta = kv_connector_metadata
        if self._engine is None or not isinstance(meta, HostTierMetadata):
            return
        self._finish_step_loads()
        self._last_seq = meta.seq
        self._idle = meta.idle
        if meta.stale_slots:
            # The scheduler forgot them (their save raced the runner's write):
            # a load already queued from them is recomputed instead.
            self._bad_slots.update(meta.stale_slots)
            for slot in meta.stale_slots:
                self._checksums.pop(slot, None)
        if self._disk is not None and (meta.disk_saves or meta.disk_reads):
            self._disk_step(meta)
        if not (meta.fence or meta.evict_saves or meta.ahead_saves):
            return  # nothing to copy or wait for: most steps
        started = time.perf_counter()
        self._prune()
        fenced = set(meta.fence)
        waits = [job for job, blocks, _ in self._save_jobs if fenced & set(blocks)]
        if meta.evict_saves:
            # These blocks belong to new requests from this step on: the
            # forward pass must not overwrite them before they are copied.
            job = self._save(meta.evict_saves)
            if job is not None:
                waits.append(job)
        self._waits.wait(waits)  # device-side; no host wait
        self._reap_saves()  # a copy-thread save that failed: not on the host
        if meta.ahead_saves:
            job = self._save(meta.ahead_saves)
            if job is not None and job.asynchronous:
                self._ahead_jobs.append((meta.seq, job))
        self._count_waits(started)

    def _disk_step(self, meta: HostTierMetadata) -> None:
        """The disk tier's share of the step, before its saves reuse any
        slot: copy the slots whose blocks the host evicted (the writer takes
        the copies) and hand the reads to the loader thread. A copy still
        writing or reading such a slot (GPU) is waited for first."""
        slots = [s for s, _ in meta.disk_saves] + [s for s, _ in meta.disk_reads]
        self._prune()
        taken = set(slots)
        for job, _, js in self._save_jobs:
            if taken.intersection(js):
                job.wait()
        for job, js in self._load_jobs:
            if taken.intersection(js):
                job.wait()
        # A slot whose save failed holds nothing worth writing to disk.
        bad = set(self._bad_slots)
        for slot, _ in meta.disk_reads:
            # A read gives the slot new contents: the scheduler loads from it
            # once every worker's read is done.
            self._bad_slots.discard(slot)
            self._checksums.pop(slot, None)
        self._disk.step(
            meta.seq, meta.disk_saves, meta.disk_reads, self._engine.slot_image, bad
        )

    def _count_waits(self, started: float) -> None:
        """CPU: the copies ran in this call, so its host time is the wait.
        CUDA: the call only enqueues; the stalls come from the device."""
        if self._waits.timed:
            self._count(copy_wait_seconds=self._waits.collect())
        else:
            self._count(copy_wait_seconds=time.perf_counter() - started)

    def _save(self, pairs: list[tuple[int, int]]) -> Any:
        """Start one batch of saves after the loads still reading their
        slots. Returns the job to wait for before the blocks are reused
        (None when there is nothing to wait for)."""
        blocks = [b for b, _ in pairs]
        slots = [s for _, s in pairs]
        taken = set(slots)
        after = [j for j, js in self._load_jobs if taken.intersection(js)]
        try:
            job = self._engine.save(blocks, slots, after)
        except Exception as exc:
            return self._save_failed(exc, blocks, slots)
        self._bad_slots.difference_update(slots)
        if job.asynchronous:
            self._save_jobs.append((job, blocks, slots))
        if self.verify:
            job.wait()
            if not job.failed:
                for slot in slots:
                    self._checksums[slot] = _crc(self._engine.slot_image(slot))
        return job

    def _save_failed(self, exc: Exception, blocks: list[int], slots: list[int]) -> Any:
        """Contain a save that failed: the engine keeps serving, the blocks
        are not on the host (the scheduler is told and forgets them; until
        then no load reads these slots), and the copies it had queued are
        still waited for before the blocks or slots are reused."""
        self._note_failed_save(getattr(exc, "cause", exc), blocks, slots)
        partial = getattr(exc, "job", None)
        if partial is None or partial.event is None:
            return None
        self._save_jobs.append((partial, blocks, slots))
        return partial

    def _note_failed_save(
        self, cause: BaseException, blocks: list[int], slots: list[int]
    ) -> None:
        key = f"{type(cause).__name__}: {cause}"
        if key not in self._save_causes:
            self._save_causes.add(key)
            logger.error(
                "Host KV tier: saving %d blocks to host memory failed (%s); they are "
                "not kept on the host and serving continues. Further failures with "
                "this cause are counted in vllm:kvmem_host_save_errors, not logged.",
                len(blocks),
                key,
            )
        self._count(save_errors=len(blocks))
        self._bad_slots.update(slots)
        self._failed_saves += [(slot, self._last_seq) for slot in slots]
        for slot in slots:
            self._checksums.pop(slot, None)

    def _reap_saves(self) -> None:
        """Copy-thread saves that failed: their slots hold no good copy (the
        scheduler is told, as for a save that fails when issued)."""
        for job, blocks, slots in self._save_jobs:
            if job.failed and job.error is not None and job.done():
                cause, job.error = job.error, None  # noted once
                self._note_failed_save(cause, blocks, slots)

    def start_load_kv(self, meta: Any) -> None:
        """This step's loads (``meta``: the metadata vLLM bound to the
        connector for this step, if any). vLLM calls this before the forward
        pass when the step has synchronous loads (their requests are in the
        batch: the forward waits for those copies only), after its launch
        otherwise (requests waiting in WAITING_FOR_REMOTE_KVS: nothing waits)."""
        if (
            self._engine is None
            or not isinstance(meta, HostTierMetadata)
            or not meta.loads
        ):
            return
        started = time.perf_counter()
        waits = []
        for chunk in meta.loads:
            self._load_errors.update(chunk.invalid)  # no host copy: recomputed
            job = self._load(chunk) if chunk.blocks else None
            if chunk.sync:
                if job is not None:
                    # The forward reads these blocks: the compute stream
                    # waits for them, or (copy thread) each attention layer
                    # for its own unit (wait_for_layer_load).
                    (self._step_loads if self._by_layer else waits).append(job)
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
        self._waits.wait(waits)  # device-side; no host wait
        self._count_waits(started)

    def _load(self, chunk: LoadChunk) -> Any:
        """Start one chunk's copies after the saves they depend on; a failure
        marks its blocks for recompute (None), as does a slot whose save
        failed."""
        pairs = list(zip(chunk.slots, chunk.blocks))
        if self._bad_slots:
            self._load_errors.update(b for s, b in pairs if s in self._bad_slots)
            pairs = [(s, b) for s, b in pairs if s not in self._bad_slots]
            if not pairs:
                return None
        slots, blocks = [s for s, _ in pairs], [b for _, b in pairs]
        after = self._saves_touching(blocks, slots)
        try:
            job = self._engine.load(slots, blocks, after)
        except Exception as exc:
            logger.exception(
                "Host KV tier: loading %d blocks for request %s failed; they will "
                "be recomputed.",
                len(blocks),
                chunk.req_id,
            )
            self._load_errors.update(blocks)
            partial = getattr(exc, "job", None)
            if partial is not None and partial.event is not None:
                # Copies queued before the failure still write these blocks:
                # the recompute's kernels and later saves come after them.
                self._load_jobs.append((partial, slots))
                partial.make_current_stream_wait()
            return None
        if job.asynchronous:
            self._load_jobs.append((job, slots))
        return job

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before an attention layer runs (copy thread): its unit of this
        step's synchronous loads is in place."""
        if not self._step_loads:
            return
        started = time.perf_counter()
        unit = self._layer_units.get(layer_name)
        for job in self._step_loads:
            job.wait_unit(unit)
        self._count(copy_wait_seconds=time.perf_counter() - started)

    def _finish_step_loads(self) -> None:
        """After the forward (copy thread): this step's synchronous loads are
        done, and the blocks of any that failed are recomputed."""
        if not self._step_loads:
            return
        jobs, self._step_loads = self._step_loads, []
        for job in jobs:
            job.wait()
            if job.failed:
                self._load_failed(job)

    def _load_failed(self, job: Any) -> None:
        logger.error(
            "Host KV tier: loading %d blocks on the copy thread failed (%s: %s); "
            "they will be recomputed.",
            job.num_blocks,
            type(job.error).__name__,
            job.error,
        )
        self._load_errors.update(job.block_ids)

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
        self._reap_saves()
        self._save_jobs = [x for x in self._save_jobs if not x[0].done()]
        self._load_jobs = [x for x in self._load_jobs if not x[0].done()]
        while self._ahead_jobs and self._ahead_jobs[0][1].done():
            self._ahead_jobs.popleft()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        self._finish_step_loads()
        done = set()
        for req_id in list(self._reportable):
            jobs = self._loads.get(req_id, [])
            if not all(job.done() for job in jobs):
                continue
            for job in jobs:
                if job.failed and job.future is not None:
                    self._load_failed(job)
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
        if not self._load_errors:
            return set()
        errors, self._load_errors = self._load_errors, set()
        self._count(load_errors=len(errors))
        return errors

    def build_connector_worker_meta(self) -> HostTierWorkerMeta | None:
        if self._engine is None:
            return None
        self._prune()
        pending = self._ahead_jobs[0][0] - 1 if self._ahead_jobs else self._last_seq
        failed, self._failed_saves = tuple(self._failed_saves), []
        meta = HostTierWorkerMeta(saved_through=pending, failed_saves=failed)
        if self._disk is not None:
            if self._idle:
                # Nothing computed this step: give the loader thread the
                # GIL (measured on CPU: a 4-block disk hit took 60-95 ms
                # against 13-23 ms when the idle loop did not hold it).
                self._disk.wait_reads(IDLE_READ_WAIT_SECONDS)
            (
                meta.disk_read_through,
                meta.disk_failed_reads,
                meta.disk_written,
            ) = self._disk.report()
        return meta

    def stats(self) -> HostTierStats | None:
        """This interval's counters; None when nothing was counted (the gauges
        are the scheduler's)."""
        if self._disk is not None and (disk := self._disk.counters()):
            self._count(**disk)
        stats = self._take_stats()
        return None if stats is None or stats.is_empty() else stats


def use_copy_thread(setting: str, device_type: str) -> bool:
    """Whether a rank's copies run on a copy thread: CPU only (CUDA has copy
    streams); ``auto`` where the forward pass's OpenMP threads leave a CPU
    of this process unused, which the thread then has to itself."""
    if device_type != "cpu" or setting == "off":
        return False
    if setting == "on":
        return True
    import torch

    return len(os.sched_getaffinity(0)) > torch.get_num_threads()


def _pinning_runtime() -> Any:
    """vLLM's CUDA runtime wrapper, for pinning the host pool: unlike torch's
    bindings it has ``cudaGetLastError``, which clears what a failed pin
    leaves pending. None (the pool's own default) off CUDA or if it cannot
    load."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return None
    try:
        from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

        return CudaRTLibrary()
    except Exception:
        logger.debug("vLLM's CudaRTLibrary is unavailable", exc_info=True)
        return None


def _crc(image: Any) -> int:
    """CRC-32 of a host tensor's bytes (integrity checks only)."""
    return zlib.crc32(image.contiguous().numpy())
