"""The disk tier's store on this machine's disk: write and read MiB/s of KV
block slices through ``DiskStore`` (header, CRC-32, temp file and rename
included), writes with and without fsync, reads from the page cache and with
it dropped (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file after a
``sync``, so the pages are clean and do go).

Run under the bench lock on a shared machine::

    flock /tmp/kvmem-bench.lock .venv/bin/python benchmarks/disk_store_bench.py
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import zlib

from _page_cache import drop_page_cache

from vllm_kvmem.host_tier import disk_files as df
from vllm_kvmem.host_tier.disk_store import DiskStore

FP = {"bench": "disk_store_bench"}
RANK = "pp0-tp0"


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(f"bench {i}".encode()).digest() for i in range(n)]


def _write(root: str, blocks: int, size: int, fsync: bool) -> tuple[float, DiskStore]:
    payloads = [os.urandom(size) for _ in range(8)]
    store = DiskStore(root, FP, 1 << 50, RANK, queue_bytes=blocks * size, fsync=fsync)
    started = time.perf_counter()
    for i, h in enumerate(_hashes(blocks)):
        assert store.submit(h, payloads[i % len(payloads)])
    assert store.flush()
    seconds = time.perf_counter() - started
    st = store.stats()
    assert st.blocks_written == blocks and not any(st.faults.values()), st
    return seconds, store


def _read(store: DiskStore, blocks: int, size: int, cold: bool) -> float:
    hashes = _hashes(blocks)
    if cold:
        drop_page_cache(df.block_path(store.dir, h, RANK) for h in hashes)
    out = bytearray(size)
    started = time.perf_counter()
    for h in hashes:
        assert store.read_into(h, out)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="filesystem to measure")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-mib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    size = int(args.block_mib * (1 << 20))
    mib = args.blocks * size / (1 << 20)
    print(subprocess.run(["df", args.dir], capture_output=True, text=True).stdout)
    buf = os.urandom(size)
    t = time.perf_counter()
    for _ in range(64):
        zlib.crc32(buf)
    crc = 64 * size / (1 << 20) / (time.perf_counter() - t)
    print(f"crc32 alone: {crc:,.0f} MiB/s")
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for fsync in (False, True):
            root = tempfile.mkdtemp(prefix="kvmem-disk-bench-", dir=args.dir)
            try:
                seconds, store = _write(root, args.blocks, size, fsync)
                rows.setdefault(f"write fsync={fsync}", []).append(mib / seconds)
                if not fsync:
                    for cold in (False, True):
                        s = _read(store, args.blocks, size, cold)
                        key = "read, page cache dropped" if cold else "read, cached"
                        rows.setdefault(key, []).append(mib / s)
                store.close()
            finally:
                shutil.rmtree(root)
    print(
        f"{args.blocks} blocks of {size:,} bytes ({mib:.0f} MiB), median of "
        f"{args.repeats} (min-max), MiB/s:"
    )
    for key, values in rows.items():
        values.sort()
        print(
            f"  {key:28s} {values[len(values) // 2]:8.0f}  "
            f"({values[0]:.0f}-{values[-1]:.0f})"
        )


if __name__ == "__main__":
    main()
