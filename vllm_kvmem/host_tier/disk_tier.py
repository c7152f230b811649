"""The disk tier wired behind the host tier: blocks the host index evicts are
written to disk (demotion), and a prefix that misses on the device and in
host memory continues on disk, read back into host slots in the background
and loaded from there through the host tier's own load path.

The scheduler decides everything (:class:`SchedulerDisk`): which host victim
to write, which disk blocks a request reads into which host slot, when a
read is done on every worker. Each worker (:class:`WorkerDisk`) writes and
reads its own slice of each block (its rank tag, ``pp0-tp1``) through its
own :class:`DiskStore`; the scheduler's store has no rank and only answers
which blocks are whole on disk. Nothing here waits on the disk inside an
engine step: writes are queued (a full queue drops the block, counted) and
reads run on a loader thread per worker.

A block's file is named by the host index's key (vLLM's block hash with its
KV cache group), in a directory named by :func:`disk_fingerprint`, so only
an engine with the same model, dtype, block geometry and parallel layout
ever reads it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.disk_files import rank_tag, rank_tags
from vllm_kvmem.host_tier.disk_store import (
    DISK_COUNTERS,
    DiskStore,
    DiskStoreStats,
)

logger = init_logger("vllm.kvmem.host_tier")

#: Seconds a worker waits at shutdown for its queued writes: blocks demoted
#: just before a restart are what the next engine hits.
DRAIN_SECONDS = 10.0


def disk_fingerprint(vllm_config: Any, config: HostTierConfig) -> dict[str, Any]:
    """What a block file's bytes depend on, the same in the engine core and
    in every worker (and in another engine of the same configuration): the
    model, its dtypes, the block geometry, the parallel layout and vLLM's
    version. The directory is named by its digest."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    return {
        "format": "vllm-kvmem-host-slot-1",
        "vllm": str(getattr(vllm, "__version__", "")),
        "device": str(current_platform.device_type),
        "model": str(model.model),
        "revision": str(model.revision or ""),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": int(cache.block_size),
        "layers": int(model.hf_text_config.num_hidden_layers),
        "pp": int(par.pipeline_parallel_size),
        "tp": int(par.tensor_parallel_size),
        "pipeline_block_bytes": int(config.host_block_bytes),
        "hash_algo": str(cache.prefix_caching_hash_algo),
    }


def serves_groups(groups: Sequence[Any]) -> bool:
    """Whether the disk tier serves these hit groups (``GroupWindow``): one
    full-attention group, so that a hit is a plain prefix of blocks."""
    return len(groups) == 1 and groups[0].window is None


def disk_serves(kv_cache_config: Any) -> bool:
    """:func:`serves_groups` for a KV cache config (the workers' check; the
    scheduler asks it of the groups it matches)."""
    from vllm_kvmem.host_tier.support import hit_groups

    return serves_groups(hit_groups(kv_cache_config))


def _ranks(vllm_config: Any) -> list[str]:
    par = vllm_config.parallel_config
    return rank_tags(par.pipeline_parallel_size, par.tensor_parallel_size)


def _key_bytes(key: Hashable) -> bytes:
    """The host index's key (``BlockHashWithGroupId``, bytes) as a file's
    block hash."""
    assert isinstance(key, bytes), type(key)
    return key


class SchedulerDisk:
    """The scheduler's side of the disk tier (one per engine core)."""

    def __init__(
        self,
        config: HostTierConfig,
        vllm_config: Any,
        *,
        store: DiskStore | None = None,
        ranks: Sequence[str] | None = None,
    ) -> None:
        """``store`` and ``ranks``: given instead of made from the configs
        (tests)."""
        self.store = store or DiskStore(
            config.disk_path,
            disk_fingerprint(vllm_config, config),
            config.disk_bytes,
            rank=None,
        )
        self.ranks = list(ranks) if ranks is not None else _ranks(vllm_config)
        self.saves: list[tuple[int, bytes]] = []  # this step's demotions
        self.reads: list[tuple[int, bytes]] = []  # this step's reads
        # slot -> (step its read was sent in, block key)
        self.pending: dict[int, tuple[int, bytes]] = {}
        # Blocks a worker failed to read: never offered again (the index of
        # files may still list them until a rescan, or the file stays, e.g.
        # a slow disk), until a worker writes them anew.
        self.refused: set[bytes] = set()
        self.read_through = 0
        # Blocks whose every rank's file a worker reported written, not yet
        # taken as KV events.
        self.stored: list[bytes] = []
        self._partial: dict[bytes, set[str]] = {}
        # False after a prefix-cache reset: no new reads or writes (reads in
        # flight still finish and are reported).
        self.active = True

    def demote(self, key: Hashable, slot: int) -> None:
        """The host index evicted ``key`` from ``slot``: the workers write the
        slot to disk before this step's copies reuse it (nothing to write if
        the block is whole on disk already)."""
        key = _key_bytes(key)
        if self.active and not self.store.contains(key, self.ranks):
            self.saves.append((slot, key))

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, in prefix order, are whole on disk (and not
        refused by a failed read)."""
        if not self.active:
            return 0
        names = [_key_bytes(k) for k in keys]
        n = self.store.lookup(names, self.ranks)
        if self.refused:
            for i, name in enumerate(names[:n]):
                if name in self.refused:
                    return i
        return n

    def read(self, slot: int, key: Hashable) -> None:
        """Read ``key`` from disk into host slot ``slot`` (sent this step)."""
        self.reads.append((slot, _key_bytes(key)))

    def take(self, seq: int) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """Step ``seq``'s demotions and reads, for the workers."""
        saves, reads = self.saves, self.reads
        self.saves, self.reads = [], []
        for slot, key in reads:
            self.pending[slot] = (seq, key)
        return saves, reads

    def reported(
        self, read_through: int, failed: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """The workers' answer: every read sent in the steps up to
        ``read_through`` is done on every worker, and ``failed`` ones,
        ``(slot, step)``, failed on at least one. Returns the slots now
        filled and those whose read failed."""
        bad = {
            slot
            for slot, step in failed
            if slot in self.pending and self.pending[slot][0] == step
        }
        self.read_through = max(self.read_through, read_through)
        done, failed_slots = [], []
        for slot, (step, key) in list(self.pending.items()):
            if slot in bad:
                del self.pending[slot]
                failed_slots.append(slot)
                self.refused.add(key)
            elif step <= self.read_through:
                del self.pending[slot]
                done.append(slot)
        return done, failed_slots

    def written(self, files: Sequence[tuple[bytes, str, int]]) -> None:
        """Slices the workers wrote: listed for lookups before the next
        rescan; a block whose every rank is written is noted for KV events."""
        for key, rank, nbytes in files:
            self.store.note_written(key, rank, nbytes)
            self.refused.discard(key)
            ranks = self._partial.setdefault(key, set())
            ranks.add(rank)
            if ranks.issuperset(self.ranks):
                del self._partial[key]
                self.stored.append(key)

    def take_stored(self) -> list[bytes]:
        stored, self.stored = self.stored, []
        return stored

    def bytes_in_use(self) -> int:
        return self.store.bytes_in_use

    def close(self) -> None:
        self.store.close()


class WorkerDisk:
    """One worker's side of the disk tier: its slice of each demoted block
    written, its slice of each disk hit read into the host slot, on a loader
    thread of its own."""

    def __init__(
        self,
        config: HostTierConfig,
        vllm_config: Any,
        rank: str,
        *,
        store: DiskStore | None = None,
    ) -> None:
        self.rank = rank
        self.store = store or DiskStore(
            config.disk_path,
            disk_fingerprint(vllm_config, config),
            config.disk_bytes,
            rank=rank,
        )
        self._lock = threading.Lock()
        self._reads_done = threading.Condition(self._lock)
        self._written: list[tuple[bytes, str, int]] = []
        self._failed: list[tuple[int, int]] = []  # (slot, step)
        self._open: dict[int, int] = {}  # step -> reads not yet done
        self._last_seq = 0
        self._reported = DiskStoreStats()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loader = threading.Thread(
            target=self._load_loop, name=f"kvmem-disk-load-{rank}", daemon=True
        )
        self._loader.start()

    @staticmethod
    def for_this_rank(config: HostTierConfig, vllm_config: Any) -> WorkerDisk:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tag = rank_tag(get_pp_group().rank_in_group, get_tp_group().rank_in_group)
        return WorkerDisk(config, vllm_config, tag)

    def step(
        self,
        seq: int,
        saves: Sequence[tuple[int, bytes]],
        reads: Sequence[tuple[int, bytes]],
        slot_image: Callable[[int], Any],
        bad_slots: set[int],
    ) -> None:
        """Step ``seq``: copy each demoted slot (the step's saves reuse it
        next) and hand the copy to the writer; queue the reads. Runs before
        the step's own copies; never waits on the disk."""
        self._last_seq = seq
        for slot, key in saves:
            if slot in bad_slots:
                continue  # no good copy on this rank: nothing to keep
            payload = slot_image(slot).clone()
            self.store.submit(key, payload, self._on_written(key, payload.nbytes))
        if reads:
            with self._lock:
                self._open[seq] = len(reads)
            self._jobs.put((seq, list(reads), slot_image))

    def _on_written(self, key: bytes, nbytes: int) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            if ok:
                with self._lock:
                    self._written.append((key, self.rank, nbytes))

        return done

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq, reads, slot_image = job
            for slot, key in reads:
                try:
                    ok = self.store.read_into(key, slot_image(slot))
                except Exception:  # a bug, not a fault: the block is recomputed
                    logger.exception("Disk KV tier: reading a block failed")
                    ok = False
                with self._lock:
                    if not ok:
                        self._failed.append((slot, seq))
                    self._open[seq] -= 1
                    if not self._open[seq]:
                        del self._open[seq]
                        self._reads_done.notify_all()

    def report(
        self,
    ) -> tuple[int, tuple[tuple[int, int], ...], tuple[tuple[bytes, str, int], ...]]:
        """Every read of the steps through the first value is done here;
        the reads that failed, ``(slot, step)``; the slices written since
        the last report."""
        with self._lock:
            through = min(self._open) - 1 if self._open else self._last_seq
            failed, self._failed = tuple(self._failed), []
            written, self._written = tuple(self._written), []
        return through, failed, written

    def wait_reads(self, timeout: float | None = None) -> bool:
        """Wait until every queued read is done; False if ``timeout`` passed
        first (tests, and nothing on the engine's path)."""
        with self._reads_done:
            return self._reads_done.wait_for(lambda: not self._open, timeout)

    def counters(self) -> dict[str, int]:
        """The store's counters since the last call (non-zero ones only)."""
        now = self.store.stats()
        delta = now.since(self._reported).as_metrics()
        self._reported = now
        return {k: v for k, v in delta.items() if k in DISK_COUNTERS and v}

    def close(self) -> None:
        """Stop the loader; finish queued writes (up to ``DRAIN_SECONDS``)."""
        self._jobs.put(None)
        self.store.close(drain=True, timeout=DRAIN_SECONDS)
