"""The disk tier's store (vLLM-free): files, replicas sharing a directory, the
budget, write-behind under pressure, and faults, real where this machine
allows (a tiny tmpfs fills for ENOSPC, a read-only remount gives EROFS) and
injected at the system-call boundary where it does not (EIO, a slow disk)."""

from __future__ import annotations

import ast
import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import VENV_033, site_033
from vllm_kvmem.host_tier import disk_files as df
from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.disk_store import (
    DISK_COUNTERS,
    DISK_GAUGES,
    DISK_METRIC_DOCS,
    FIXED_SEED_HASH_ALGOS,
    RANDOM_SEED_HASH_ALGOS,
    DiskStore,
    DiskStoreStats,
    block_hashes_reproducible,
    check_disk_config,
    hash_refusal,
)

FP = {
    "model": "tiny-llama",
    "dtype": "bfloat16",
    "block_size": 16,
    "layout": "LBHNC",
    "kv_shape": {"pp0-tp0": [2, 16, 4, 64], "pp0-tp1": [2, 16, 4, 64]},
}
R0, R1 = "pp0-tp0", "pp0-tp1"
N = 4096  # payload bytes of one slice in most tests


def bh(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int, n: int = N) -> bytes:
    return random.Random(i).randbytes(n)


@pytest.fixture
def stores() -> Iterator[list[DiskStore]]:
    """Stores made by a test, closed after it (writers stopped)."""
    made: list[DiskStore] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def make(stores, tmp_path):
    def make_store(
        root: Path | str = tmp_path,
        rank: str | None = R0,
        capacity: int = 1 << 30,
        fp: dict | None = None,
        **kw,
    ) -> DiskStore:
        kw.setdefault("rescan_seconds", 3600.0)  # tests rescan by hand
        s = DiskStore(str(root), FP if fp is None else fp, capacity, rank, **kw)
        stores.append(s)
        return s

    return make_store


@pytest.fixture
def warnings() -> Iterator[list[logging.LogRecord]]:
    """The disk store's log records (its logger may not propagate once vLLM
    has configured the ``vllm`` logger in this process)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("vllm.kvmem.disk_store")
    handler = Keep(logging.WARNING)
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def write(store: DiskStore, i: int, n: int = N) -> bool:
    """Submit block ``i`` and wait for the writer; whether it was written."""
    done: list[bool] = []
    assert store.submit(bh(i), payload(i, n), on_done=done.append)
    assert store.flush(timeout=30)
    assert len(done) == 1
    return done[0]


def read(store: DiskStore, i: int, n: int = N) -> bool:
    out = bytearray(n)
    ok = store.read_into(bh(i), out)
    if ok:
        assert bytes(out) == payload(i, n)
    return ok


def age(store: DiskStore, i: int, rank: str, seconds_ago: float) -> None:
    """Backdate a block file's mtime (kernel timestamps are too coarse to
    order files written within a few milliseconds)."""
    t = time.time() - seconds_ago
    os.utime(df.block_path(store.dir, bh(i), rank), (t, t))


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` mounted at ``path`` (True), or False when this
    process may not mount; always unmounted."""
    path.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            if subprocess.run(["umount", str(path)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(path)], check=True)


# -- files ---------------------------------------------------------------------


def test_a_block_round_trips_through_its_file_and_manifest(make):
    s = make()
    assert write(s, 1)
    assert read(s, 1)
    path = df.block_path(s.dir, bh(1), R0)
    raw = Path(path).read_bytes()
    header = df.unpack_header(raw[: df.HEADER_BYTES])
    assert header is not None and header.block_hash == bh(1) and header.rank == R0
    assert header.digest == df.fingerprint_digest(FP) and header.payload_len == N
    assert raw[df.HEADER_BYTES :] == payload(1)
    manifest = json.loads(Path(s.dir, df.MANIFEST).read_text())
    assert manifest["fingerprint"] == FP and manifest["digest"] == s.digest.hex()
    st = s.stats()
    assert (st.hits, st.misses, st.blocks_written) == (1, 0, 1)
    assert st.bytes_read == N and st.bytes_written == N + df.HEADER_BYTES
    assert st.bytes_in_use == N + df.HEADER_BYTES and not any(st.faults.values())


def test_reads_into_numpy_and_torch_buffers(make):
    torch = pytest.importorskip("torch")
    s = make()
    assert write(s, 2)
    arr = np.zeros(N, dtype=np.uint8)
    assert s.read_into(bh(2), arr) and arr.tobytes() == payload(2)
    t = torch.zeros(N, dtype=torch.uint8)
    assert s.read_into(bh(2), t) and t.numpy().tobytes() == payload(2)
    # and writes from them, without a copy the caller makes
    assert s.submit(bh(3), torch.frombuffer(bytearray(payload(3)), dtype=torch.uint8))
    assert s.flush(timeout=30) and read(s, 3)


def test_fingerprint_is_canonical_and_refuses_what_json_cannot_hold():
    shuffled = dict(reversed(list(FP.items())))
    assert df.fingerprint_digest(shuffled) == df.fingerprint_digest(FP)
    assert df.fingerprint_digest({**FP, "dtype": "float16"}) != df.fingerprint_digest(
        FP
    )
    with pytest.raises(ValueError, match="JSON"):
        df.fingerprint_digest({"dtype": object()})


def test_names_temp_files_never_match_blocks():
    name = df.block_name(bh(1), "pp1-tp3")
    assert df.parse_block_name(name) == (bh(1), "pp1-tp3")
    tmp = os.path.basename(df.temp_path("/x", bh(1), "pp1-tp3"))
    assert df.is_temp_name(tmp) and df.parse_block_name(tmp) is None
    assert df.parse_block_name(df.MANIFEST) is None
    assert df.rank_tags(2, 2) == ["pp0-tp0", "pp0-tp1", "pp1-tp0", "pp1-tp1"]
    with pytest.raises(ValueError, match="rank tag"):
        df.check_rank("PP0/TP1")


# -- replicas, restarts, fingerprints ------------------------------------------


def test_two_replicas_share_a_directory(make):
    a, b = make(), make()
    assert write(a, 1)
    # b's index is as of its last scan: bounded staleness, no system call
    assert not b.contains(bh(1), [R0])
    assert read(b, 1)  # the file is there all the same
    b.refresh()
    assert b.contains(bh(1), [R0])
    assert b.stats().bytes_in_use == a.stats().bytes_in_use == N + df.HEADER_BYTES
    # b does not write again what a wrote
    done: list[bool] = []
    assert b.submit(bh(1), payload(1), on_done=done.append) and done == [True]
    assert b.stats().blocks_written == 0


def test_a_rename_refused_over_another_replicas_file_counts_as_stored(make):
    """Some shared filesystems answer EEXIST to a rename over a file another
    replica has just renamed into place (vLLM 0.33's fs tier treats it the
    same): the block is stored, no fault, no temp file left."""
    import errno

    a = make()
    assert write(a, 1)

    def refuse(op: str, path: str) -> None:
        if op == "replace" and os.path.exists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path)

    b = make(fault_hook=refuse)
    done: list[bool] = []
    assert b.submit(bh(1), payload(1), on_done=done.append)
    assert b.flush(timeout=10) and done == [True]
    assert not any(b.stats().faults.values())
    assert b.contains(bh(1), [R0]) and read(b, 1)
    assert not [p for p in Path(b.dir).rglob("*") if df.is_temp_name(p.name)]


def test_the_scheduler_sees_a_block_only_when_every_rank_wrote_it(make):
    w0, w1, sched = make(rank=R0), make(rank=R1), make(rank=None)
    for i in range(3):
        assert write(w0, i)
    for i in range(2):
        assert write(w1, i)
    hashes = [bh(0), bh(1), bh(2), bh(3)]
    assert sched.lookup(hashes, [R0, R1]) == 0  # not rescanned yet
    sched.refresh()
    assert sched.lookup(hashes, [R0, R1]) == 2
    assert sched.lookup(hashes, [R0]) == 3
    assert sched.on_disk(bh(1), [R0, R1]) and not sched.on_disk(bh(2), [R0, R1])
    sched.note_written(bh(2), R1, N)  # a worker's report, before any rescan
    assert sched.lookup(hashes, [R0, R1]) == 3
    with pytest.raises(ValueError, match="only looks blocks up"):
        sched.submit(bh(9), payload(9))


def test_changes_made_during_a_rescan_survive_it(make):
    store: list[DiskStore] = []

    def during_scan(op: str, path: str) -> None:
        if op == "scandir" and store:
            store[0].note_written(bh(5), R1, N)  # lands while the scan runs

    s = make(fault_hook=during_scan)
    store.append(s)
    s.refresh()
    assert s.contains(bh(5), [R1]) and s.bytes_in_use == N + df.HEADER_BYTES


def test_the_writer_rescans_when_due(make):
    now = [0.0]
    scanned = threading.Event()

    def hook(op: str, path: str) -> None:
        if op == "scandir" and now[0] > 0:
            scanned.set()

    s = make(fault_hook=hook, clock=lambda: now[0], rescan_seconds=30.0)
    other = make()
    assert write(other, 1)
    now[0] = 31.0
    assert write(s, 2)  # wakes the writer, which finds the rescan due
    assert scanned.wait(30)
    s.flush(timeout=30)
    with s._scan_lock:  # the rescan has finished
        assert s.contains(bh(1), [R0])


def test_a_restart_finds_old_blocks(make, tmp_path):
    a = make()
    for i in range(3):
        assert write(a, i)
    a.close()
    again = make()
    assert again.lookup([bh(0), bh(1), bh(2)], [R0]) == 3
    assert again.stats().bytes_in_use == 3 * (N + df.HEADER_BYTES)
    assert all(read(again, i) for i in range(3))


def test_another_fingerprint_never_reads_them(make):
    a = make()
    assert write(a, 1)
    b = make(fp={**FP, "dtype": "float16"})
    assert b.dir != a.dir and not b.contains(bh(1), [R0])
    assert not read(b, 1) and b.stats().misses == 1
    # a file placed under b's name by hand is refused by its header, and removed
    target = Path(df.block_path(b.dir, bh(1), R0))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(Path(df.block_path(a.dir, bh(1), R0)).read_bytes())
    assert not read(b, 1)
    assert b.stats().faults["header"] == 1 and not target.exists()
    assert read(a, 1)


# -- torn writes and files changing under the reader ---------------------------


def test_a_torn_write_is_never_returned(make):
    s = make()
    # a crashed writer's temp file, complete or not, is never a block
    tmp = Path(df.temp_path(s.dir, bh(1), R0))
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(df.pack_header(s.digest, bh(1), R0, N, 0) + payload(1))
    Path(df.block_path(s.dir, bh(2), R0)).mkdir(parents=True)  # not a file
    s.refresh()
    assert not s.contains(bh(1), [R0]) and not s.contains(bh(2), [R0])
    assert not read(s, 1) and s.stats().misses == 1
    assert tmp.exists()  # recent: perhaps a write in progress
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    s.refresh()
    assert not tmp.exists()  # stale: cleaned


@pytest.mark.parametrize(
    "damage,kind",
    [
        ("truncate_payload", "truncated"),
        ("truncate_header", "truncated"),
        ("flip_payload", "checksum"),
        ("flip_header", "header"),
        ("append", "header"),
    ],
)
def test_a_damaged_file_is_refused_counted_and_removed(make, damage, kind):
    s = make()
    assert write(s, 1)
    path = Path(df.block_path(s.dir, bh(1), R0))
    raw = bytearray(path.read_bytes())
    if damage == "truncate_payload":
        raw = raw[: df.HEADER_BYTES + N // 2]
    elif damage == "truncate_header":
        raw = raw[: df.HEADER_BYTES // 2]
    elif damage == "flip_payload":
        raw[df.HEADER_BYTES + 100] ^= 1
    elif damage == "flip_header":
        raw[20] ^= 1
    else:
        raw += b"x"
    path.write_bytes(raw)
    out = bytearray(N)
    assert not s.read_into(bh(1), out)
    st = s.stats()
    assert st.faults[kind] == 1 and st.hits == 0
    assert sum(st.faults.values()) == 1
    assert not path.exists() and not s.contains(bh(1), [R0])


def test_a_buffer_of_the_wrong_size_fails_but_keeps_the_file(make):
    s = make()
    assert write(s, 1)
    assert not s.read_into(bh(1), bytearray(N + 1))
    assert s.stats().faults["header"] == 1
    assert read(s, 1)


def test_a_file_deleted_under_the_reader_is_a_counted_miss(make, warnings):
    a, b = make(), make()
    for i in range(3):
        assert write(a, i)
    b.refresh()
    for i in range(3):
        os.unlink(df.block_path(a.dir, bh(i), R0))  # another replica evicted them
    assert not any(read(b, i) for i in range(3))
    assert not read(b, 7)  # never there: a plain miss
    st = b.stats()
    assert st.faults["missing"] == 3 and st.misses == 1 and st.hits == 0
    assert not b.contains(bh(0), [R0]) and b.stats().bytes_in_use == 0
    assert len([r for r in warnings if "'missing'" in r.getMessage()]) == 1


# -- the budget ----------------------------------------------------------------


def test_the_budget_evicts_the_least_recently_used_of_any_replica(make):
    size = N + df.HEADER_BYTES
    a = make(capacity=4 * size)
    b = make(capacity=4 * size, touch_seconds=60)
    for i in range(4):
        assert write(b, i)
    for i, seconds_ago in enumerate((400, 300, 200, 100)):
        age(b, i, R0, seconds_ago)
    assert read(b, 0)  # a hit: block 0 is now the most recently used
    a.refresh()
    assert a.stats().bytes_in_use == 4 * size and not a.stats().evicted_bytes
    assert write(a, 10)  # over budget: down to 90% of it, oldest first
    assert a.stats().bytes_in_use <= 4 * size * 0.9
    assert [a.on_disk(bh(i), [R0]) for i in (0, 1, 2, 3, 10)] == [
        True,
        False,
        False,
        True,
        True,
    ]
    assert a.stats().evicted_bytes == 2 * size
    # b learns of it by rescanning; its reads of the evicted blocks miss meanwhile
    assert not read(b, 1) and b.stats().faults["missing"] == 1
    b.refresh()
    assert b.stats().bytes_in_use == a.stats().bytes_in_use == 3 * size


def test_eviction_takes_every_rank_of_a_block_and_tolerates_vanished_files(make):
    size = N + df.HEADER_BYTES
    w0, w1 = make(rank=R0, capacity=5 * size), make(rank=R1, capacity=5 * size)
    for i in range(2):
        assert write(w0, i) and write(w1, i)
        age(w0, i, R0, 500 - i)
        age(w1, i, R1, 500 - i)
    w0.refresh()
    os.unlink(df.block_path(w0.dir, bh(0), R1))  # gone under w0's index
    assert write(w0, 5) and write(w0, 6)  # over budget twice
    assert not w0.on_disk(bh(0), [R0]) and not w0.on_disk(bh(0), [R1])
    assert w0.on_disk(bh(1), [R0, R1])
    assert not any(w0.stats().faults.values())


def test_a_block_another_replica_just_read_is_not_evicted(make):
    size = N + df.HEADER_BYTES
    a = make(capacity=2 * size)
    b = make(capacity=2 * size, touch_seconds=60)
    for i in range(2):
        assert write(a, i)
        age(a, i, R0, 1000 - i)
    a.refresh()  # a's index: block 0 oldest
    assert read(b, 0)  # b's hit touches block 0 after a's scan
    assert write(a, 2)
    assert a.on_disk(bh(0), [R0]) and not a.on_disk(bh(1), [R0])


# -- write-behind --------------------------------------------------------------


def test_submit_with_no_queue_room_drops_and_counts(make):
    s = make(queue_bytes=0)
    done: list[bool] = []
    assert s.submit(bh(1), payload(1), on_done=done.append) is False
    assert s.flush(timeout=30)
    st = s.stats()
    assert st.write_drops == 1 and st.blocks_written == 0 and done == []
    assert not s.on_disk(bh(1), [R0])


def test_a_stalled_disk_fills_the_queue_and_submit_drops_without_waiting(make):
    entered, release = threading.Event(), threading.Event()

    def stall(op: str, path: str) -> None:
        if op == "open" and path.endswith(df.TEMP_SUFFIX):
            entered.set()
            release.wait(30)

    s = make(queue_bytes=2 * N, fault_hook=stall)
    try:
        assert s.submit(bh(1), payload(1))
        assert entered.wait(30)  # the writer is stuck inside block 1's write
        assert s.submit(bh(2), payload(2))
        assert s.submit(bh(2), payload(2))  # queued already: not twice
        assert s.submit(bh(3), payload(3)) is False  # 2 blocks' bytes queued
        assert s.stats().write_drops == 1 and s.queued_bytes == 2 * N
    finally:
        release.set()
    assert s.flush(timeout=30) and s.queued_bytes == 0
    assert s.stats().blocks_written == 2 and read(s, 1) and read(s, 2)


def test_close_drops_what_is_still_queued(make):
    entered, release = threading.Event(), threading.Event()

    def stall(op: str, path: str) -> None:
        if op == "open" and path.endswith(df.TEMP_SUFFIX):
            entered.set()
            release.wait(30)

    s = make(fault_hook=stall)
    done: list[bool] = []

    def second(ok: bool) -> None:
        done.append(ok)
        release.set()  # close dropped it: now let block 1's write finish

    try:
        assert s.submit(bh(1), payload(1), on_done=done.append)
        assert entered.wait(30)
        assert s.submit(bh(2), payload(2), on_done=second)
    except BaseException:
        release.set()
        raise
    s.close()
    assert done == [False, True] and s.queued_bytes == 0
    assert s.stats().write_drops == 1 and s.stats().blocks_written == 1
    assert s.submit(bh(3), payload(3)) is False


# -- faults --------------------------------------------------------------------


def test_a_full_disk_drops_writes_and_keeps_serving(make, tmp_path, warnings):
    """ENOSPC from a 2 MiB tmpfs that fills, or from /dev/full through the hook
    where this process may not mount."""
    mnt = tmp_path / "small"
    with tmpfs(mnt, "2m") as mounted:
        hook = None
        if not mounted:
            full = os.open("/dev/full", os.O_WRONLY)
            opened: list[str] = []

            def hook(op: str, path: str) -> None:
                if op == "open" and df.is_temp_name(os.path.basename(path)):
                    opened.append(path)
                if op == "write" and len(opened) > 1:  # all but the first block
                    os.write(full, b"x")  # the kernel's own ENOSPC

        s = make(root=mnt, fault_hook=hook)
        n = 700 << 10
        results = [write(s, i, n) for i in range(4)]
        s.close()
        assert results[0] and not all(results)
        st = s.stats()
        assert st.faults["disk_full"] == results.count(False) >= 1
        assert sum(st.faults.values()) == st.faults["disk_full"]
        assert st.blocks_written == results.count(True)
        leftovers = [p for p in mnt.rglob("*") if df.is_temp_name(p.name)]
        assert leftovers == []  # failed writes leave no temp file behind
        again = make(root=mnt)
        for i, ok in enumerate(results):
            assert read(again, i, n) == ok
        assert len([r for r in warnings if "full" in r.getMessage()]) == 1
        again.close()
        if not mounted:
            os.close(full)


def test_a_read_only_directory_refuses_writes_and_still_serves_reads(make, tmp_path):
    mnt = tmp_path / "ro"
    with tmpfs(mnt, "4m") as mounted:
        if not mounted:
            pytest.skip("mount is not permitted here: no real read-only filesystem")
        s = make(root=mnt, touch_seconds=0)
        assert write(s, 1)
        age(s, 1, R0, 100)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        try:
            assert not write(s, 2)
            assert s.stats().faults["read_only"] == 1
            assert read(s, 1)  # the touch fails; the hit does not
            ro = make(root=mnt, fp={**FP, "block_size": 32})  # cannot even mkdir
            assert ro.stats().faults["read_only"] == 1
            assert not read(ro, 1)
            s.close()
            ro.close()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)


def test_eio_is_counted_and_never_raised(make, warnings):
    fail_reads = fail_writes = True

    def eio(op: str, path: str) -> None:
        if (op == "read" and fail_reads) or (op == "write" and fail_writes):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    s = make(fault_hook=eio)
    assert not write(s, 1)
    assert not list(Path(s.dir).rglob("*.tmp")) and not s.on_disk(bh(1), [R0])
    fail_writes = False
    assert write(s, 1)
    assert not read(s, 1) and not read(s, 1)
    fail_reads = False
    assert read(s, 1)  # an EIO read does not remove the file
    st = s.stats()
    assert st.faults["io_error"] == 3 and st.hits == 1
    assert len([r for r in warnings if "EIO" in r.getMessage()]) == 1


def test_a_read_past_its_deadline_fails_as_slow(make):
    now = [1000.0]
    slow = True

    def stall(op: str, path: str) -> None:
        if op == "read" and slow:
            now[0] += 5.0  # the disk took 5 s: the clock says so, no sleep

    s = make(fault_hook=stall, clock=lambda: now[0], read_deadline_seconds=2.0)
    assert write(s, 1)
    assert not read(s, 1)
    assert s.stats().faults["slow"] == 1
    slow = False
    assert read(s, 1)  # the file is fine and kept


def test_each_fault_kind_is_logged_once(make, warnings):
    s = make()
    for i in range(3):
        assert write(s, i)
        raw = bytearray(Path(df.block_path(s.dir, bh(i), R0)).read_bytes())
        raw[-1] ^= 0xFF
        Path(df.block_path(s.dir, bh(i), R0)).write_bytes(raw)
    assert not any(read(s, i) for i in range(3))
    assert s.stats().faults["checksum"] == 3
    assert len(warnings) == 1 and "CRC-32" in warnings[0].getMessage()


# -- stats ---------------------------------------------------------------------


def test_stats_intervals_and_metric_names(make):
    s = make()
    assert write(s, 1)
    before = s.stats()
    assert read(s, 1) and not read(s, 2)
    interval = s.stats().since(before)
    assert (interval.hits, interval.misses, interval.blocks_written) == (1, 1, 0)
    assert interval.bytes_in_use == N + df.HEADER_BYTES
    flat = interval.as_metrics()
    assert set(flat) == set(DISK_COUNTERS) | set(DISK_GAUGES) == set(DISK_METRIC_DOCS)
    assert flat["disk_hits"] == 1 and flat["disk_faults_checksum"] == 0
    assert isinstance(DiskStoreStats().faults, dict)


# -- hashing and config --------------------------------------------------------


def test_block_hashes_are_reproducible_only_with_a_fixed_seed():
    assert block_hashes_reproducible("sha256", None)
    assert block_hashes_reproducible("sha256_cbor", None)
    assert not block_hashes_reproducible("xxhash", None)
    assert not block_hashes_reproducible("xxhash_cbor", None)
    assert block_hashes_reproducible("xxhash", "0")
    assert block_hashes_reproducible("xxhash", "")  # vLLM: set, even empty
    assert not block_hashes_reproducible("some_future_algo", None)
    assert hash_refusal("sha256", {}) is None
    assert hash_refusal("xxhash", {"PYTHONHASHSEED": "7"}) is None
    line = hash_refusal("xxhash_cbor", {})
    assert line is not None and "\n" not in line
    assert "--prefix-caching-hash-algo sha256" in line and "PYTHONHASHSEED" in line


def _vllm_sources() -> list[Path]:
    spec = importlib.util.find_spec("vllm")  # located, not imported (7 s)
    found = [Path(next(iter(spec.submodule_search_locations)))] if spec else []
    if VENV_033.exists():
        found.append(site_033() / "vllm")
    return found


@pytest.mark.parametrize("vllm_dir", _vllm_sources(), ids=lambda p: str(p.parents[3]))
def test_the_algorithm_table_matches_vllms_source(vllm_dir):
    """Read vLLM's own source (0.32 and 0.33): which algorithms get a random
    per-process seed, the names they go by, and that PYTHONHASHSEED wins."""
    utils = (vllm_dir / "v1/core/kv_cache_utils.py").read_text()
    tree = ast.parse(utils)
    random_fns = next(
        {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} - {"frozenset"}
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "_NON_CRYPTO_HASH_FUNCTIONS"
    )
    seed_fn = next(
        ast.get_source_segment(utils, n)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "resolve_none_hash_seed"
    )
    assert 'os.getenv("PYTHONHASHSEED")' in seed_fn and "is not None" in seed_fn
    assert "os.urandom" in seed_fn
    hashing = ast.parse((vllm_dir / "utils/hashing.py").read_text())
    by_name = {
        node.test.comparators[0].value: node.body[0].value.id
        for node in ast.walk(hashing)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and getattr(node.test.left, "id", "") == "hash_fn_name"
    }
    cache = (vllm_dir / "config/cache.py").read_text()
    literal = next(
        node.value
        for node in ast.walk(ast.parse(cache))
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "PrefixCachingHashAlgo"
    )
    algos = {e.value for e in literal.slice.elts}
    assert algos == set(by_name) == FIXED_SEED_HASH_ALGOS | RANDOM_SEED_HASH_ALGOS
    assert {a for a in algos if by_name[a] in random_fns} == RANDOM_SEED_HASH_ALGOS


def test_disk_config_is_checked_with_one_line_naming_the_fix(tmp_path):
    check_disk_config("", 0)  # off
    check_disk_config(str(tmp_path / "new" / "dir"), 1 << 30, environ={})
    cases = [
        ("", 1 << 30, {}, "needs --kv-disk-cache-path"),
        (str(tmp_path), 0, {}, "needs --kv-disk-cache-bytes"),
        ("relative/dir", 1 << 30, {}, "absolute path"),
        (str(tmp_path), 1000, {"block_bytes": 4096}, "holds no KV block"),
        (str(tmp_path), 1 << 30, {"hash_algo": "xxhash"}, "--prefix-caching-hash"),
    ]
    for path, size, kw, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            check_disk_config(path, size, environ={}, **kw)
        assert "\n" not in str(e.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        check_disk_config(str(tmp_path / "file" / "x"), 1 << 30, environ={})


def test_host_tier_config_carries_the_disk_settings():
    cfg = HostTierConfig.from_extra_config({"disk_path": "/d", "disk_bytes": 1 << 30})
    assert (cfg.disk_path, cfg.disk_bytes) == ("/d", 1 << 30)
    assert HostTierConfig.from_extra_config(cfg.to_extra_config()) == cfg
    assert HostTierConfig().disk_path == "" and HostTierConfig().disk_bytes == 0
    for bad, message in [
        ({"disk_path": 3, "disk_bytes": 1}, "directory path"),
        ({"disk_path": "/d"}, "go together"),
        ({"disk_bytes": 1 << 30}, "go together"),
        ({"disk_path": "/d", "disk_bytes": -1}, "non-negative"),
    ]:
        with pytest.raises(ValueError, match=message):
            HostTierConfig.from_extra_config(bad)
