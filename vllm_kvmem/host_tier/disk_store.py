"""The disk tier's store: one worker's slices of KV blocks in files on a local
disk or a shared filesystem, behind the host tier.

vLLM-free and torch-free. Every worker (each pipeline stage and TP rank)
holds one :class:`DiskStore` with its rank tag and writes and reads its own
slice file of each block; the scheduler holds one without a rank and only asks
which blocks are whole on disk (:meth:`DiskStore.lookup`). The file format and
the system calls are ``disk_files``.

Threading. Each store runs one daemon thread, the writer: it writes the
queued blocks (temp file, then rename), evicts when the directory is over
budget and rescans the directory every ``rescan_seconds`` to see what other
replicas and earlier runs wrote or evicted. :meth:`submit` only queues (the
engine step never waits on the disk), and drops the block when the queue is
full. :meth:`read_into` runs on the caller's thread (the loader, a background
thread of its own) and reads straight into the caller's buffer. Lookups read
an in-memory index and make no system call.

Faults never raise into the caller: a failed read returns False (the caller
recomputes), a failed write is dropped; each is counted by kind and the first
of each kind logged. The directory is shared: files vanish (another replica
evicted them), appear (another replica wrote them) and are touched by other
processes at any time, and each such race ends in a miss, never in wrong
bytes: a block is returned only when its header names this fingerprint, hash
and rank, and its length and CRC-32 match.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_kvmem.host_tier import disk_files as df
from vllm_kvmem.host_tier.disk_files import DiskOps, FaultHook

logger = logging.getLogger("vllm.kvmem.disk_store")

#: What can go wrong, by kind; each is counted, and logged the first time.
FAULT_DOCS = {
    "disk_full": "the disk or quota is full (ENOSPC, EDQUOT): the block is not written",
    "read_only": "the directory is read-only or not permitted (EROFS, EACCES, "
    "EPERM): nothing more is written there",
    "io_error": "the disk reported an I/O error (EIO)",
    "missing": "a block file listed in the index was gone when read (another "
    "replica evicted it)",
    "truncated": "a block file is shorter than its header says",
    "checksum": "a block's payload does not match its CRC-32",
    "header": "a block file's header is not one of this fingerprint, hash, rank "
    "and size",
    "slow": "a read took longer than the read deadline",
    "other": "any other OS error",
}
FAULT_KINDS = tuple(FAULT_DOCS)

#: Counters, named to sit beside the host tier's (``stats.COUNTERS``): summed
#: over an interval and over workers.
DISK_COUNTERS = (
    "disk_hits",
    "disk_misses",
    "disk_bytes_read",
    "disk_bytes_written",
    "disk_blocks_written",
    "disk_write_drops",
    "disk_evicted_bytes",
    *(f"disk_faults_{k}" for k in FAULT_KINDS),
)
#: Gauges: the value at the end of the interval.
DISK_GAUGES = ("disk_bytes_in_use",)
DISK_METRIC_DOCS = {
    "disk_hits": "KV block slices read from the disk tier and verified.",
    "disk_misses": "KV block slices asked of the disk tier with no file there.",
    "disk_bytes_read": "Bytes read from the disk tier (payloads).",
    "disk_bytes_written": "Bytes written to the disk tier (files, headers in).",
    "disk_blocks_written": "KV block slices written to the disk tier.",
    "disk_write_drops": "KV block slices not written because the write queue "
    "was full (or the store closing).",
    "disk_evicted_bytes": "Bytes of block files this process evicted from the "
    "disk tier's directory (its own or another replica's).",
    **{
        f"disk_faults_{k}": f"Disk tier faults: {doc}." for k, doc in FAULT_DOCS.items()
    },
    "disk_bytes_in_use": "Bytes of block files in the disk tier's directory "
    "(all ranks and replicas), as last seen.",
}

#: A read is checked against its deadline between chunks of this size.
READ_CHUNK_BYTES = 8 << 20
#: Evicted down to this share of the budget, so that eviction (a sort of the
#: index) runs once per many writes rather than on every one.
EVICT_TO = 0.9
#: A block whose size is not the reader's buffer's: counted as "header", but
#: the file is kept (the reader is the odd one out).
_WRONG_SIZE = "wrong_size"
#: Another process's touch is believed when it moved the mtime by more.
_MTIME_SLACK = 1.0


_COUNTER_FIELDS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "blocks_written",
    "write_drops",
    "evicted_bytes",
)


@dataclass
class DiskStoreStats:
    """One store's counters since it started, and its bytes-in-use gauge.
    Reads: ``hits + misses + read faults`` is every :meth:`DiskStore.read_into`
    call."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_drops: int = 0
    evicted_bytes: int = 0
    faults: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0)
    )
    bytes_in_use: int = 0

    def copy(self) -> DiskStoreStats:
        return DiskStoreStats(**{**self.__dict__, "faults": dict(self.faults)})

    def since(self, earlier: DiskStoreStats) -> DiskStoreStats:
        """The counters' growth since ``earlier`` (an interval's worth), with
        this gauge."""
        out = self.copy()
        for k in _COUNTER_FIELDS:
            setattr(out, k, getattr(self, k) - getattr(earlier, k))
        out.faults = {k: self.faults[k] - earlier.faults[k] for k in FAULT_KINDS}
        return out

    def as_metrics(self) -> dict[str, int]:
        """Flat, under the names of :data:`DISK_COUNTERS` and
        :data:`DISK_GAUGES`."""
        out = {
            f"disk_{k}": getattr(self, k) for k in (*_COUNTER_FIELDS, "bytes_in_use")
        }
        out.update({f"disk_faults_{k}": v for k, v in self.faults.items()})
        return out


# -- hashing and config checks -------------------------------------------------

#: vLLM's ``prefix_caching_hash_algo`` values (``PrefixCachingHashAlgo``,
#: vllm/config/cache.py, 0.32 and 0.33) whose first block's parent hash
#: (``NONE_HASH``) is seeded with a fixed string unless PYTHONHASHSEED is set:
#: the same tokens hash the same in every process.
FIXED_SEED_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
#: The ones vLLM seeds with fresh random bytes per process unless
#: PYTHONHASHSEED is set (``_NON_CRYPTO_HASH_FUNCTIONS`` in
#: vllm/v1/core/kv_cache_utils.py, ``resolve_none_hash_seed``).
RANDOM_SEED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def block_hashes_reproducible(hash_algo: str, pythonhashseed: str | None) -> bool:
    """Whether vLLM's block hashes come out the same in another process (a
    replica, a restart) given the same tokens.

    vLLM takes PYTHONHASHSEED, whenever it is set (even empty), as the seed
    of every algorithm; otherwise sha256 and sha256_cbor use a fixed seed and
    xxhash and xxhash_cbor a random one. With PYTHONHASHSEED, processes agree
    only if they share its value; ones that do not simply never match each
    other's blocks. An algorithm this does not know is taken as random."""
    if pythonhashseed is not None:
        return True
    return hash_algo in FIXED_SEED_HASH_ALGOS


def hash_refusal(
    hash_algo: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """The one line refusing a disk directory when block hashes are not
    reproducible across processes (None when they are)."""
    env = os.environ if environ is None else environ
    if block_hashes_reproducible(hash_algo, env.get("PYTHONHASHSEED")):
        return None
    return (
        f"--kv-disk-cache-path keeps blocks by vLLM's block hashes, which "
        f"--prefix-caching-hash-algo {hash_algo} seeds randomly in every process, "
        f"so no other process or restart could find them: use "
        f"--prefix-caching-hash-algo sha256, or set PYTHONHASHSEED to the same "
        f"value for every engine using the directory."
    )


def check_disk_config(
    path: str,
    capacity_bytes: int,
    *,
    hash_algo: str = "sha256",
    block_bytes: int = 0,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Refuse a disk tier setting that cannot work, with one line naming the
    option and the fix (``ValueError``). ``path=""`` with ``capacity_bytes=0``
    is the tier off. ``block_bytes``: one block's bytes over every worker,
    when known, so a budget too small for one block is refused."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ValueError(
            f"--kv-disk-cache-bytes {capacity_bytes!r}: use a number of bytes"
        )
    if not path and not capacity_bytes:
        return
    if not path:
        raise ValueError(
            f"--kv-disk-cache-bytes {capacity_bytes:,} needs --kv-disk-cache-path "
            f"DIR, the directory to keep the blocks in."
        )
    if capacity_bytes <= 0:
        raise ValueError(
            f"--kv-disk-cache-path {path} needs --kv-disk-cache-bytes N > 0, the "
            f"bytes the directory may hold (all ranks and replicas)."
        )
    if not os.path.isabs(path):
        raise ValueError(
            f"--kv-disk-cache-path {path}: use an absolute path (every worker "
            f"process must name the same directory)."
        )
    probe = path
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"--kv-disk-cache-path {path}: {probe} is not a directory.")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"--kv-disk-cache-path {path}: {probe} is not writable by this user."
        )
    if block_bytes and capacity_bytes < block_bytes + df.HEADER_BYTES:
        raise ValueError(
            f"--kv-disk-cache-bytes {capacity_bytes:,} holds no KV block "
            f"({block_bytes:,} bytes each over all workers); give at least "
            f"{block_bytes + df.HEADER_BYTES:,}."
        )
    if line := hash_refusal(hash_algo, environ):
        raise ValueError(line)


# -- the store -----------------------------------------------------------------


def _byte_view(obj: Any, writable: bool) -> memoryview:
    """A flat byte view of ``obj`` without copying it: bytes, bytearray,
    memoryview, a numpy array or a CPU torch tensor (through ``.numpy()``),
    contiguous."""
    try:
        view = memoryview(obj)
    except TypeError:
        to_numpy = getattr(obj, "numpy", None)
        if to_numpy is None:
            raise TypeError(
                f"disk tier buffers must support the buffer protocol or "
                f".numpy(); got {type(obj).__name__}"
            ) from None
        view = memoryview(to_numpy())
    if not view.c_contiguous:
        raise ValueError("disk tier buffers must be contiguous")
    if writable and view.readonly:
        raise ValueError("disk tier read buffers must be writable")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


@dataclass
class _Write:
    block_hash: bytes
    payload: memoryview
    callbacks: list[Callable[[bool], None]]


#: Index entry of one file: (bytes, mtime).
_File = tuple[int, float]


class DiskStore:
    """One worker's view of one fingerprint's directory (or, without a rank,
    the scheduler's).

    ``fingerprint``: whatever identifies the KV layout (model, dtype, block
    size, layout, the KV shape per rank, the vLLM version...), a dict of JSON
    values; configurations with different fingerprints never share a
    directory. ``capacity_bytes``: the budget of the whole fingerprint
    directory, all ranks and replicas. ``queue_bytes``: payload bytes that
    may wait for the writer. ``fsync``: make each write durable before it is
    visible (a crash without it can lose blocks, never corrupt a read: the
    length and CRC checks refuse a torn file). ``read_deadline_seconds``: a
    read taking longer fails as ``slow``. ``fault_hook``: see
    :data:`disk_files.FaultHook`. ``clock``: the monotonic clock deadlines and
    rescans are timed with.
    """

    def __init__(
        self,
        root: str,
        fingerprint: Mapping[str, Any],
        capacity_bytes: int,
        rank: str | None = None,
        *,
        queue_bytes: int = 256 << 20,
        fsync: bool = False,
        rescan_seconds: float = 30.0,
        read_deadline_seconds: float = 2.0,
        stale_temp_seconds: float = 600.0,
        touch_seconds: float = 60.0,
        fault_hook: FaultHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes: {capacity_bytes}")
        if queue_bytes < 0:
            raise ValueError(f"disk tier queue_bytes must be >= 0: {queue_bytes}")
        self.rank = None if rank is None else df.check_rank(rank)
        self.fingerprint = dict(fingerprint)
        self.digest = df.fingerprint_digest(fingerprint)
        self.root = root
        self.dir = df.fingerprint_dir(root, self.digest)
        self.capacity_bytes = capacity_bytes
        self.queue_bytes = queue_bytes
        self.fsync = fsync
        self.rescan_seconds = rescan_seconds
        self.read_deadline_seconds = read_deadline_seconds
        self.stale_temp_seconds = stale_temp_seconds
        self.touch_seconds = touch_seconds
        self.ops = DiskOps(fault_hook)
        self._clock = clock

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._scan_lock = threading.Lock()  # one rescan at a time
        # block hash -> rank -> (bytes, mtime): every block file in the
        # directory, as of the last scan plus this process's changes since.
        self._index: dict[bytes, dict[str, _File]] = {}
        self._bytes = 0
        # This process's index changes while a scan runs, replayed on its
        # result (the scan may have listed a directory before them).
        self._journal: list[tuple[bytes, str, _File | None]] | None = None
        self._queue: deque[_Write] = deque()
        self._pending: dict[bytes, _Write] = {}
        self._queued_bytes = 0
        self._writing = False
        self._closed = False
        self._stats = DiskStoreStats()
        self._logged: set[str] = set()
        self._made_dirs: set[str] = set()
        self._next_scan = 0.0
        self._evicting = threading.Lock()  # one eviction at a time

        self._prepare()
        self.refresh()
        self._thread = threading.Thread(
            target=self._run, name=f"kvmem-disk-{rank or 'index'}", daemon=True
        )
        self._thread.start()

    # -- the scheduler's questions -------------------------------------------------

    def contains(self, block_hash: bytes, ranks: Sequence[str]) -> bool:
        """Whether every rank's slice of the block is in the index (as of the
        last rescan, at most ``rescan_seconds`` old, plus this process's own
        writes and evictions). No system call: a stale yes ends in a failed
        read (a miss, recomputed), a stale no in a recompute."""
        with self._lock:
            have = self._index.get(block_hash)
            return have is not None and all(r in have for r in ranks)

    def lookup(self, block_hashes: Sequence[bytes], ranks: Sequence[str]) -> int:
        """How many of ``block_hashes``, in prefix order, are whole in the
        index (stops at the first that is not)."""
        n = 0
        with self._lock:
            for h in block_hashes:
                have = self._index.get(h)
                if have is None or not all(r in have for r in ranks):
                    break
                n += 1
        return n

    def on_disk(self, block_hash: bytes, ranks: Sequence[str]) -> bool:
        """Whether every rank's slice file exists now: one ``stat`` per rank,
        exact but paid in system calls (network round trips on NFS)."""
        for r in ranks:
            try:
                self.ops.stat(df.block_path(self.dir, block_hash, r))
            except FileNotFoundError:
                return False
            except OSError as e:
                self._fault(df.fault_kind(e), e)
                return False
        return True

    def note_written(self, block_hash: bytes, rank: str, nbytes: int) -> None:
        """Record a slice another process of this engine reported written
        (the scheduler, told by a worker), so lookups see it before the next
        rescan. ``nbytes``: its payload."""
        with self._lock:
            self._put(block_hash, rank, (nbytes + df.HEADER_BYTES, time.time()))

    # -- the worker's writes -------------------------------------------------------

    def submit(
        self,
        block_hash: bytes,
        payload: Any,
        on_done: Callable[[bool], None] | None = None,
    ) -> bool:
        """Queue this worker's slice of a block for writing; never waits on
        the disk. ``payload`` is referenced, not copied: it must not change
        until ``on_done(ok)`` runs (on the writer thread; or in here when the
        index lists the block, which may be stale by up to a rescan, already).
        False (counted as a write drop, no ``on_done``) when the queue has no
        room for it or the store is closed."""
        if self.rank is None:
            raise ValueError("a DiskStore without a rank only looks blocks up")
        df.check_block_hash(block_hash)
        view = _byte_view(payload, writable=False)
        with self._cond:
            if self._closed:
                self._stats.write_drops += 1
                return False
            queued = self._pending.get(block_hash)
            if queued is not None:  # on its way already
                if on_done is not None:
                    queued.callbacks.append(on_done)
                return True
            if self.rank not in self._index.get(block_hash, ()):
                if self._queued_bytes + view.nbytes > self.queue_bytes:
                    self._stats.write_drops += 1
                    return False
                item = _Write(block_hash, view, [on_done] if on_done else [])
                self._queue.append(item)
                self._pending[block_hash] = item
                self._queued_bytes += view.nbytes
                self._cond.notify_all()
                return True
        if on_done is not None:
            on_done(True)  # on disk already (as of the index): nothing to write
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (written or failed); False
        if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._writing, timeout
            )

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the writer; queued writes are written first with ``drain``,
        otherwise dropped (counted, ``on_done(False)``)."""
        with self._cond:
            self._closed = True
            dropped = [] if drain else list(self._queue)
            if not drain:
                self._queue.clear()
                for item in dropped:
                    del self._pending[item.block_hash]
                    self._queued_bytes -= item.payload.nbytes
                self._stats.write_drops += len(dropped)
            self._cond.notify_all()
        for item in dropped:
            self._done(item, False)
        self._thread.join(timeout)

    # -- the worker's reads --------------------------------------------------------

    def read_into(self, block_hash: bytes, out: Any) -> bool:
        """Read this worker's slice of the block into ``out`` (a writable,
        contiguous buffer of exactly the slice's size: a memoryview, bytearray,
        numpy array or CPU uint8 tensor). True when ``out`` holds the verified
        slice; False on a miss or any fault (``out`` may then hold anything).
        Thread-safe; blocks the calling thread for the read."""
        if self.rank is None:
            raise ValueError("a DiskStore without a rank only looks blocks up")
        view = _byte_view(out, writable=True)
        rank = self.rank
        path = df.block_path(self.dir, block_hash, rank)
        started = self._clock()
        st: os.stat_result | None = None
        try:
            fd = self.ops.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            with self._lock:
                listed = rank in self._index.get(block_hash, ())
                if listed:
                    self._drop(block_hash, rank)
                else:
                    self._stats.misses += 1
            if listed:
                self._fault("missing", e)
            return False
        except OSError as e:
            self._fault(df.fault_kind(e), e)
            return False
        try:
            st = self.ops.fstat(fd)
            kind = self._read_payload(fd, st, path, block_hash, view, started)
        except OSError as e:
            kind = df.fault_kind(e)
        finally:
            self.ops.close(fd)
        if kind is not None:
            if kind == _WRONG_SIZE:
                kind = "header"  # the caller's buffer, not the file, is wrong
            elif kind in ("truncated", "checksum", "header"):
                self._discard(path, st, block_hash, rank)
            self._fault(kind, path)
            return False
        assert st is not None
        mtime = st.st_mtime
        if time.time() - mtime > self.touch_seconds:
            # A hit is recent use: the LRU order of every replica is mtime.
            try:
                self.ops.utime(path)
                mtime = time.time()
            except OSError:
                pass  # read-only, or evicted meanwhile: the order is a hint
        with self._lock:
            self._put(block_hash, rank, (st.st_size, mtime))
            self._stats.hits += 1
            self._stats.bytes_read += view.nbytes
        return True

    def read_blocks(
        self, block_hashes: Sequence[bytes], outs: Sequence[Any]
    ) -> list[bool]:
        """:meth:`read_into` for each block: success per block."""
        return [self.read_into(h, out) for h, out in zip(block_hashes, outs)]

    def _read_payload(
        self,
        fd: int,
        st: os.stat_result,
        path: str,
        block_hash: bytes,
        view: memoryview,
        started: float,
    ) -> str | None:
        """The fault kind reading this file into ``view``; None when done."""
        raw = self.ops.pread(fd, df.HEADER_BYTES, 0, path)
        if len(raw) < df.HEADER_BYTES:
            return "truncated"
        header = df.unpack_header(raw)
        if (
            header is None
            or header.digest != self.digest
            or header.block_hash != block_hash
            or header.rank != self.rank
        ):
            return "header"
        if header.payload_len != view.nbytes:
            return _WRONG_SIZE
        expected = df.HEADER_BYTES + header.payload_len
        if st.st_size < expected:
            return "truncated"
        if st.st_size > expected:
            return "header"
        pos = 0
        while pos < view.nbytes:
            if self._clock() - started > self.read_deadline_seconds:
                return "slow"
            chunk = view[pos : pos + READ_CHUNK_BYTES]
            got = self.ops.preadv(fd, chunk, df.HEADER_BYTES + pos, path)
            if got <= 0:
                return "truncated"  # cut short since the fstat
            pos += got
        if self._clock() - started > self.read_deadline_seconds:
            return "slow"
        if df.payload_checksum(view) != header.payload_crc:
            return "checksum"
        return None

    def _discard(
        self, path: str, st: os.stat_result | None, block_hash: bytes, rank: str
    ) -> None:
        """Remove a bad block file, so that it is not read and refused again;
        only the file that was read, not one another replica has just renamed
        over it."""
        with self._lock:
            self._drop(block_hash, rank)
        if st is None:
            return
        try:
            now = self.ops.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self.ops.unlink(path)
        except OSError:
            pass

    # -- the writer thread ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    wait = self._next_scan - self._clock()
                    if wait <= 0:
                        break
                    self._cond.wait(min(wait, 3600.0))
                if not self._queue and self._closed:
                    return
                item = self._queue.popleft() if self._queue else None
                self._writing = item is not None
            if item is not None:
                ok = False
                try:
                    ok = self._write(item)
                except Exception:  # a bug, not a fault: never kill the writer
                    logger.exception("disk KV tier: writing a block failed")
                finally:
                    with self._cond:
                        self._queued_bytes -= item.payload.nbytes
                        self._pending.pop(item.block_hash, None)
                self._done(item, ok)
                if ok:
                    self._enforce_budget()
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()
            if self._clock() >= self._next_scan and not self._closed:
                try:
                    self.refresh()
                except Exception:
                    logger.exception("disk KV tier: rescanning %s failed", self.dir)

    def _done(self, item: _Write, ok: bool) -> None:
        for callback in item.callbacks:
            try:
                callback(ok)
            except Exception:
                logger.exception("disk KV tier: a write's on_done raised")

    def _write(self, item: _Write) -> bool:
        """Write one slice: a temp file beside its final name, renamed over
        it once whole. False on a fault (counted; the temp file removed)."""
        assert self.rank is not None
        block_hash, payload = item.block_hash, item.payload
        path = df.block_path(self.dir, block_hash, self.rank)
        parent = os.path.dirname(path)
        tmp = df.temp_path(self.dir, block_hash, self.rank)
        header = df.pack_header(
            self.digest,
            block_hash,
            self.rank,
            payload.nbytes,
            df.payload_checksum(payload),
        )
        fd = None
        try:
            if parent not in self._made_dirs:
                self.ops.mkdir(parent)
                self._made_dirs.add(parent)
            fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            size = self.ops.write_all(fd, [memoryview(header), payload], tmp)
            if self.fsync:
                self.ops.fsync(fd, tmp)
            mtime = self.ops.fstat(fd).st_mtime
            self.ops.close(fd)
            fd = None
            try:
                self.ops.replace(tmp, path)
            except FileExistsError:
                # Some shared filesystems refuse to rename over a file another
                # replica has just renamed into place: the block is stored.
                os.unlink(tmp)
                st = self.ops.stat(path)
                size, mtime = st.st_size, st.st_mtime
            if self.fsync:
                self.ops.fsync_dir(parent)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass  # never created, or the disk refuses even this
            kind = df.fault_kind(e)
            if kind == "missing":  # the directory went away (removed by hand)
                self._made_dirs.clear()
                kind = "other"
            self._fault(kind, e)
            return False
        with self._lock:
            self._put(block_hash, self.rank, (size, mtime))
            self._stats.bytes_written += size
            self._stats.blocks_written += 1
        return True

    # -- the directory: scans, budget, index ---------------------------------------

    def _prepare(self) -> None:
        """Create the fingerprint's directory and its manifest, if missing. A
        read-only directory is a fault (counted), not an error: blocks other
        processes wrote may still be read."""
        manifest = os.path.join(self.dir, df.MANIFEST)
        tmp = os.path.join(self.dir, f".manifest.{os.urandom(6).hex()}.tmp")
        try:
            self.ops.mkdir(self.dir)
            if os.path.exists(manifest):
                return
            with open(tmp, "w") as f:
                f.write(df.manifest_text(self.fingerprint, self.digest))
            self.ops.replace(tmp, manifest)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._fault(df.fault_kind(e), e)

    def refresh(self) -> None:
        """Rescan the directory now: see other processes' writes and
        evictions, count the bytes in use, remove temp files older than
        ``stale_temp_seconds`` (writes that crashed), and evict if over
        budget. The writer thread calls this every ``rescan_seconds``; it may
        also be called from any thread."""
        with self._scan_lock:
            with self._lock:
                self._journal = []
            scanned = None
            try:
                scanned = self._scan()
                if scanned is not None:
                    index, stale = scanned
                    total = sum(s for r in index.values() for s, _ in r.values())
            finally:
                with self._lock:
                    # Changes made while the scan ran, up to this swap.
                    journal, self._journal = self._journal or [], None
                    self._next_scan = self._clock() + self.rescan_seconds
                    if scanned is not None:
                        for block_hash, rank, entry in journal:
                            total += _apply(index, block_hash, rank, entry)
                        self._index = index
                        self._bytes = total
            if scanned is None:
                return
            for path in stale:
                try:
                    self.ops.unlink(path)
                except OSError:
                    pass  # another replica cleaned it first
        self._enforce_budget()

    def _scan(self) -> tuple[dict[bytes, dict[str, _File]], list[str]] | None:
        index: dict[bytes, dict[str, _File]] = {}
        stale: list[str] = []
        oldest = time.time() - self.stale_temp_seconds
        try:
            tops = [
                e
                for e in self.ops.scandir(self.dir)
                if df.is_fanout_name(e.name) and e.is_dir(follow_symlinks=False)
            ]
        except FileNotFoundError:
            return index, stale  # removed by hand: nothing on disk
        except OSError as e:
            self._fault(df.fault_kind(e), e)
            return None
        for top in tops:
            try:
                entries = list(self.ops.scandir(top.path))
            except FileNotFoundError:
                continue
            except OSError as e:
                self._fault(df.fault_kind(e), e)
                continue
            for entry in entries:
                parsed = df.parse_block_name(entry.name)
                if parsed is None and not df.is_temp_name(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished since the listing
                if not stat.S_ISREG(st.st_mode):
                    continue
                if parsed is None:
                    if st.st_mtime < oldest:
                        stale.append(entry.path)
                    continue
                block_hash, rank = parsed
                index.setdefault(block_hash, {})[rank] = (st.st_size, st.st_mtime)
        return index, stale

    def _enforce_budget(self) -> None:
        """Over budget: remove the least recently used blocks (every rank's
        file of a block together, a block's age its newest file's mtime),
        whoever wrote them, down to ``EVICT_TO`` of the budget. A block
        another process touched since this one looked is kept."""
        if not self._evicting.acquire(blocking=False):
            return  # another thread is at it
        try:
            self._evict()
        finally:
            self._evicting.release()

    def _evict(self) -> None:
        with self._lock:
            if self._bytes <= self.capacity_bytes:
                return
            excess = self._bytes - int(self.capacity_bytes * EVICT_TO)
            # Entries are never changed in place (``_apply``): a shallow copy
            # is a snapshot, and the sort runs without the lock that submit
            # takes.
            snapshot = list(self._index.items())
        snapshot.sort(key=lambda item: max(m for _, m in item[1].values()))
        victims: list[tuple[bytes, dict[str, _File]]] = []
        for h, files in snapshot:
            if excess <= 0:
                break
            victims.append((h, files))
            excess -= sum(s for s, _ in files.values())
        for h, files in victims:
            touched = False
            for rank, (_, mtime) in files.items():
                try:
                    st = self.ops.stat(df.block_path(self.dir, h, rank))
                except FileNotFoundError:
                    continue
                except OSError as e:
                    self._fault(df.fault_kind(e), e)
                    continue
                if st.st_mtime > mtime + _MTIME_SLACK:
                    touched = True
                    with self._lock:
                        self._put(h, rank, (st.st_size, st.st_mtime))
            if touched:
                continue
            for rank, (size, _) in files.items():
                try:
                    self.ops.unlink(df.block_path(self.dir, h, rank))
                except FileNotFoundError:
                    size = 0  # another replica evicted it first
                except OSError as e:
                    self._fault(df.fault_kind(e), e)
                    continue
                with self._lock:
                    self._drop(h, rank)
                    self._stats.evicted_bytes += size

    def _put(self, block_hash: bytes, rank: str, entry: _File) -> None:
        """Under the lock."""
        self._bytes += _apply(self._index, block_hash, rank, entry)
        if self._journal is not None:
            self._journal.append((block_hash, rank, entry))

    def _drop(self, block_hash: bytes, rank: str) -> None:
        """Under the lock."""
        self._bytes += _apply(self._index, block_hash, rank, None)
        if self._journal is not None:
            self._journal.append((block_hash, rank, None))

    # -- counting ------------------------------------------------------------------

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting for the writer or being written."""
        with self._lock:
            return self._queued_bytes

    def stats(self) -> DiskStoreStats:
        """The counters since start, and the bytes in use now."""
        with self._lock:
            out = self._stats.copy()
            out.bytes_in_use = self._bytes
            return out

    def _fault(self, kind: str, detail: object) -> None:
        with self._lock:
            self._stats.faults[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(
                "Disk KV tier at %s: %s (%s). Blocks affected are recomputed or "
                "not written; further '%s' faults are counted, not logged.",
                self.dir,
                FAULT_DOCS[kind],
                detail,
                kind,
            )


def _apply(
    index: dict[bytes, dict[str, _File]],
    block_hash: bytes,
    rank: str,
    entry: _File | None,
) -> int:
    """Set (or, with None, remove) one file's entry; the change in bytes. A
    block's entry is replaced, never changed in place, so a copy of the index
    made under the lock can be read without it."""
    files = index.get(block_hash)
    old = files.get(rank) if files else None
    delta = -old[0] if old else 0
    if entry is None:
        if files is not None and old is not None:
            rest = {r: f for r, f in files.items() if r != rank}
            if rest:
                index[block_hash] = rest
            else:
                del index[block_hash]
        return delta
    index[block_hash] = {**files, rank: entry} if files else {rank: entry}
    return delta + entry[0]
