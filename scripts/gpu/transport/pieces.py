"""Cut files into pieces that fit one device call, and put them back together.

The GPU machine has no network: a wheel reaches it only inside the working
tree a call sends, 64 MiB per call in all. So the wheels are concatenated in a
fixed order into one byte stream, cut into pieces of at most ``piece_bytes``,
and each piece gets a folder of its own (``p001/``, ``p002/``...) so that one
call can carry exactly one folder and the folders carried by earlier calls
stay on the warm machine. Every piece folder also holds the manifest, so
whichever pieces have arrived can be checked without the others.

Standard library only: this module runs on the GPU machine too (from
``install_pieces.py``), where nothing can be installed first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1024**2
GIB = 1024**3
#: Largest piece: a call carries 64 MiB in all, and the working tree (3.5 MiB
#: on 2026-11-25) and the manifest travel with it. 58 MiB leaves the tree 6
#: MiB and still cuts the torch211 plan (344 MiB) into 6 pieces.
DEFAULT_PIECE_BYTES = 58 * MIB
MANIFEST = "manifest.json"
_CHUNK = 4 * MIB


@dataclass(frozen=True)
class FileEntry:
    """One file of the stream: where it starts and how to check it."""

    name: str
    size: int
    sha256: str
    offset: int


@dataclass(frozen=True)
class PieceEntry:
    """One piece of the stream, in the folder ``folder`` of the pieces root."""

    index: int
    folder: str
    file: str
    size: int
    sha256: str
    offset: int


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (wheels are hundreds of MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def piece_folder(index: int) -> str:
    """``p001`` for piece 1: sorts in order, one call carries one folder."""
    return f"p{index:03d}"


def _stream(paths: Sequence[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                yield block


def split(
    files: Sequence[Path],
    out_dir: Path,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    meta: dict | None = None,
) -> dict:
    """Write ``files`` as pieces under ``out_dir`` (emptied first) and return
    the manifest, which is also written into every piece folder."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
    names = [p.name for p in files]
    if len(set(names)) != len(names):
        raise ValueError("two files share a name; the manifest keys them by name")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    entries, offset = [], 0
    for path in files:
        size = path.stat().st_size
        entries.append(FileEntry(path.name, size, sha256_file(path), offset))
        offset += size
    total = offset

    pieces: list[PieceEntry] = []
    current = None
    h = None
    written = 0
    start = 0

    def close_piece() -> None:
        nonlocal current, h, written
        if current is None:
            return
        current.close()
        index = len(pieces) + 1
        folder = piece_folder(index)
        pieces.append(
            PieceEntry(
                index,
                folder,
                f"piece-{index:03d}.bin",
                written,
                h.hexdigest(),
                start,
            )
        )
        current, h, written = None, None, 0

    position = 0
    for block in _stream(files):
        view = memoryview(block)
        while view:
            if current is None:
                index = len(pieces) + 1
                folder = out_dir / piece_folder(index)
                folder.mkdir()
                current = open(folder / f"piece-{index:03d}.bin", "wb")
                h = hashlib.sha256()
                start = position
            take = min(len(view), piece_bytes - written)
            current.write(view[:take])
            h.update(view[:take])
            written += take
            position += take
            view = view[take:]
            if written == piece_bytes:
                close_piece()
    close_piece()
    manifest = {
        "format": 1,
        "piece_bytes": piece_bytes,
        "total_bytes": total,
        "files": [asdict(e) for e in entries],
        "pieces": [asdict(p) for p in pieces],
        **(meta or {}),
    }
    text = json.dumps(manifest, indent=1) + "\n"
    (out_dir / MANIFEST).write_text(text)
    for p in pieces:
        (out_dir / p.folder / MANIFEST).write_text(text)
    return manifest


def find_manifest(root: Path) -> dict:
    """The manifest from the pieces root or any piece folder that arrived."""
    candidates = [root / MANIFEST] + sorted(root.glob(f"p*/{MANIFEST}"))
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"no {MANIFEST} under {root} (no piece has arrived)")


@dataclass
class PieceStatus:
    index: int
    folder: str
    state: str  # "ok", "missing", "bad size", "bad sha256"


def check_pieces(
    root: Path, manifest: dict, *, hash_them: bool = True
) -> list[PieceStatus]:
    """The state of every piece the manifest names, as found under ``root``."""
    out = []
    for p in manifest["pieces"]:
        path = root / p["folder"] / p["file"]
        if not path.is_file():
            state = "missing"
        elif path.stat().st_size != p["size"]:
            state = "bad size"
        elif hash_them and sha256_file(path) != p["sha256"]:
            state = "bad sha256"
        else:
            state = "ok"
        out.append(PieceStatus(p["index"], p["folder"], state))
    return out


def _read_range(root: Path, manifest: dict, offset: int, size: int) -> Iterator[bytes]:
    """The stream's bytes ``[offset, offset + size)``, read from the pieces."""
    end = offset + size
    for p in manifest["pieces"]:
        lo, hi = p["offset"], p["offset"] + p["size"]
        if hi <= offset or lo >= end:
            continue
        with open(root / p["folder"] / p["file"], "rb") as f:
            f.seek(max(offset, lo) - lo)
            left = min(end, hi) - max(offset, lo)
            while left:
                block = f.read(min(_CHUNK, left))
                if not block:
                    raise ValueError(f"{p['folder']}/{p['file']} is short")
                left -= len(block)
                yield block


def complete_files(manifest: dict, ok: set[int]) -> list[dict]:
    """The files whose every byte lies in the pieces numbered in ``ok``."""
    out = []
    for entry in manifest["files"]:
        lo, hi = entry["offset"], entry["offset"] + entry["size"]
        needed = {
            p["index"]
            for p in manifest["pieces"]
            if p["offset"] < hi and p["offset"] + p["size"] > lo
        }
        if needed <= ok:
            out.append(entry)
    return out


def join(
    root: Path, out_dir: Path, manifest: dict | None = None, partial: bool = False
) -> list[Path]:
    """Rebuild the files from the pieces under ``root`` into ``out_dir``.

    Every piece is checked first (size and sha256), then every rebuilt file
    (sha256); a mismatch raises and names the piece or file. Without
    ``partial`` every piece must be there; with it, the files whose bytes
    have all arrived are rebuilt (the smaller plans come first in the
    stream, so they can be installed before the rest arrives)."""
    manifest = manifest or find_manifest(root)
    states = check_pieces(root, manifest)
    bad = [s for s in states if s.state not in ("ok", "missing")]
    missing = [s for s in states if s.state == "missing"]
    if bad or (missing and not partial):
        raise ValueError(
            "pieces not ready: "
            + ", ".join(f"{s.folder} ({s.state})" for s in bad + missing)
            + f"; {len(states) - len(bad) - len(missing)} of {len(states)} are"
        )
    ok = {s.index for s in states if s.state == "ok"}
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for entry in complete_files(manifest, ok):
        target = out_dir / entry["name"]
        h = hashlib.sha256()
        with open(target, "wb") as f:
            for block in _read_range(root, manifest, entry["offset"], entry["size"]):
                f.write(block)
                h.update(block)
        if h.hexdigest() != entry["sha256"]:
            raise ValueError(f"{entry['name']}: sha256 mismatch after reassembly")
        written.append(target)
    return written


def free_bytes(path: Path) -> int:
    """Free disk space where ``path`` lives (reassembly needs the wheels' size)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
