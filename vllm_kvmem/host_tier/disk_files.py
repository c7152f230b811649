"""The disk tier's files: names, the header every block file starts with, the
fingerprint that keeps configurations apart, and the one door every system
call goes through.

vLLM-free and torch-free. One file holds one worker's slice of one block (a
host slot is a contiguous byte region per worker, every pipeline stage and TP
rank), so a block of a TP=2 engine is two files. Layout under the root::

    <root>/kv-<fingerprint digest>/manifest.json      what the digest means
    <root>/kv-<fingerprint digest>/<h[:2]>/<h>.<rank>.kvb   block files
    <root>/kv-<fingerprint digest>/<h[:2]>/.<h>.<rank>.<random>.tmp   writes

where ``h`` is the block hash in hex and ``rank`` a tag such as ``pp0-tp1``.
A write goes to a temp file in the block's own directory and is renamed over
the block's name when complete, so a reader never sees a partial block; temp
names never match a block name. The 256 subdirectories keep each directory
small enough to list and to look up in on any filesystem.

A block file is a 128-byte header and the payload. The header carries the
fingerprint digest, the block hash and rank (a file copied or renamed to the
wrong name is refused), the payload's length (a truncated file is refused
before reading it) and its CRC-32 (checked after reading it), and a CRC-32 of
itself. CRC-32 rather than BLAKE2b: it guards against torn writes and media
corruption, not against someone who can write the directory (no unkeyed
checksum would), and zlib's runs at 5.4 GiB/s here against BLAKE2b's
1.0 GiB/s (1 MiB buffers, 2026-11-28), both releasing the GIL.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAGIC = b"KVMEMBLK"
FORMAT_VERSION = 1
#: magic, version, hash length, rank length, fingerprint digest, rank, block
#: hash, payload length, payload CRC-32, padding, then the header's own CRC-32
#: over the 124 bytes before it.
_HEADER = struct.Struct("<8sHBB16s16s64sQI4x")
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size
assert HEADER_BYTES == 128

MAX_HASH_BYTES = 64
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
MANIFEST = "manifest.json"
DIR_PREFIX = "kv-"

_RANK_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,15}")
_BLOCK_RE = re.compile(r"([0-9a-f]{2,128})\.([a-z0-9][a-z0-9-]{0,15})\.kvb")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")


def rank_tag(pp_rank: int, tp_rank: int) -> str:
    """The tag naming one worker's slice of a block: ``pp0-tp1``."""
    return f"pp{pp_rank}-tp{tp_rank}"


def rank_tags(pp_size: int, tp_size: int) -> list[str]:
    """Every worker's tag, for asking whether a block is whole on disk."""
    return [rank_tag(p, t) for p in range(pp_size) for t in range(tp_size)]


def check_rank(rank: str) -> str:
    if not isinstance(rank, str) or not _RANK_RE.fullmatch(rank):
        raise ValueError(
            f"disk tier rank tag {rank!r}: use 1-16 characters of a-z, 0-9 and "
            f"'-', such as 'pp0-tp1'"
        )
    return rank


def check_block_hash(block_hash: bytes) -> bytes:
    if not isinstance(block_hash, bytes) or not 1 <= len(block_hash) <= 64:
        raise ValueError(
            f"disk tier block hash must be 1-64 bytes (vLLM's BlockHash); got "
            f"{type(block_hash).__name__} of length {len(block_hash)}"
        )
    return block_hash


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> bytes:
    """16 bytes naming a configuration: BLAKE2b of its canonical JSON (keys
    sorted, no whitespace), so the same dict gives the same digest in every
    process and Python version. Raises ``ValueError`` for values JSON cannot
    hold, rather than hashing a ``repr`` that may differ between runs."""
    try:
        text = json.dumps(
            dict(fingerprint), sort_keys=True, separators=(",", ":"), allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"disk tier fingerprint must be a dict of JSON values (str, int, "
            f"float, bool, None, lists, dicts): {e}"
        ) from None
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def fingerprint_dir(root: str, digest: bytes) -> str:
    return os.path.join(root, DIR_PREFIX + digest.hex())


def block_name(block_hash: bytes, rank: str) -> str:
    return f"{block_hash.hex()}.{rank}{BLOCK_SUFFIX}"


def block_path(fp_dir: str, block_hash: bytes, rank: str) -> str:
    h = block_hash.hex()
    return os.path.join(fp_dir, h[:2], f"{h}.{rank}{BLOCK_SUFFIX}")


def temp_path(fp_dir: str, block_hash: bytes, rank: str) -> str:
    """A fresh temp name beside the block's, unique across processes and
    threads; it starts with a dot and ends in ``.tmp``, so it is never read
    as a block."""
    h = block_hash.hex()
    tag = os.urandom(6).hex()
    return os.path.join(fp_dir, h[:2], f".{h}.{rank}.{tag}{TEMP_SUFFIX}")


def parse_block_name(name: str) -> tuple[bytes, str] | None:
    """(block hash, rank) of a block file's name; None for anything else
    (temp files, the manifest, strangers)."""
    m = _BLOCK_RE.fullmatch(name)
    if m is None or len(m.group(1)) % 2:
        return None
    return bytes.fromhex(m.group(1)), m.group(2)


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def is_fanout_name(name: str) -> bool:
    return _FANOUT_RE.fullmatch(name) is not None


def payload_checksum(payload: memoryview) -> int:
    return zlib.crc32(payload)


def pack_header(
    digest: bytes, block_hash: bytes, rank: str, payload_len: int, payload_crc: int
) -> bytes:
    body = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        len(block_hash),
        len(rank),
        digest,
        rank.encode(),
        block_hash,
        payload_len,
        payload_crc,
    )
    return body + _HEADER_CRC.pack(zlib.crc32(body))


@dataclass(frozen=True)
class Header:
    digest: bytes
    block_hash: bytes
    rank: str
    payload_len: int
    payload_crc: int


def unpack_header(raw: bytes) -> Header | None:
    """The header in ``raw``; None when it is not one of ours in this format
    (wrong magic or version, a header that fails its own CRC)."""
    if len(raw) != HEADER_BYTES:
        return None
    body = raw[: _HEADER.size]
    (crc,) = _HEADER_CRC.unpack(raw[_HEADER.size :])
    if zlib.crc32(body) != crc:
        return None
    magic, version, hlen, rlen, digest, rank, block_hash, plen, pcrc = _HEADER.unpack(
        body
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if not 1 <= hlen <= MAX_HASH_BYTES or not 1 <= rlen <= 16:
        return None
    return Header(digest, block_hash[:hlen], rank[:rlen].decode(), plen, pcrc)


def manifest_text(fingerprint: Mapping[str, Any], digest: bytes) -> str:
    """What a human reads to learn what a ``kv-<digest>`` directory holds."""
    doc = {
        "what": "vllm-kvmem disk KV tier: one file per block and worker",
        "format_version": FORMAT_VERSION,
        "digest": digest.hex(),
        "checksum": "crc32",
        "header_bytes": HEADER_BYTES,
        "fingerprint": dict(fingerprint),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


#: errno -> fault kind for what the disk itself refused.
_ERRNO_KINDS = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EROFS: "read_only",
    errno.EACCES: "read_only",
    errno.EPERM: "read_only",
    errno.EIO: "io_error",
    errno.ENOENT: "missing",
}


def fault_kind(exc: OSError) -> str:
    return _ERRNO_KINDS.get(exc.errno or 0, "other")


#: ``hook(op, path)`` runs just before each system call of that op (``open``,
#: ``read``, ``write``, ``fsync``, ``replace``, ``unlink``, ``stat``,
#: ``utime``, ``scandir``, ``mkdir``); it may raise ``OSError`` (taken as the
#: call's own error) or stall. For faults a test cannot produce for real.
FaultHook = Callable[[str, str], None]


class DiskOps:
    """Every system call the disk tier makes, each behind the fault hook, so
    an injected error takes the same path as a real one."""

    def __init__(self, hook: FaultHook | None = None) -> None:
        self.hook = hook

    def _at(self, op: str, path: str) -> None:
        if self.hook is not None:
            self.hook(op, path)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._at("open", path)
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, n: int, offset: int, path: str) -> bytes:
        self._at("read", path)
        return os.pread(fd, n, offset)

    def preadv(self, fd: int, buf: memoryview, offset: int, path: str) -> int:
        self._at("read", path)
        return os.preadv(fd, [buf], offset)

    def write_all(self, fd: int, parts: Sequence[memoryview], path: str) -> int:
        """Write every part, resuming short writes; the bytes written."""
        total = 0
        for part in parts:
            view = part
            while view.nbytes:
                self._at("write", path)
                n = os.write(fd, view)
                total += n
                view = view[n:]
        return total

    def fsync(self, fd: int, path: str) -> None:
        self._at("fsync", path)
        os.fsync(fd)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def replace(self, src: str, dst: str) -> None:
        self._at("replace", dst)
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        self._at("unlink", path)
        os.unlink(path)

    def stat(self, path: str) -> os.stat_result:
        self._at("stat", path)
        return os.stat(path)

    def utime(self, path: str) -> None:
        self._at("utime", path)
        os.utime(path)

    def mkdir(self, path: str) -> None:
        self._at("mkdir", path)
        os.makedirs(path, exist_ok=True)

    def scandir(self, path: str) -> Iterator[os.DirEntry[str]]:
        self._at("scandir", path)
        with os.scandir(path) as it:
            yield from it

    def fsync_dir(self, path: str) -> None:
        self._at("fsync", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
