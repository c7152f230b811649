"""Dropping files from the page cache, so that a read after it is the disk's
and not RAM's: ``sync`` (dirty pages are not dropped) and then
``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path


def drop_page_cache(paths: Iterable[str | os.PathLike]) -> int:
    """Drop each file's pages from the page cache; returns how many files.
    A file removed meanwhile is skipped."""
    os.sync()
    n = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def drop_tree(root: str | os.PathLike, pattern: str = "*.kvb") -> int:
    """:func:`drop_page_cache` for every file under ``root`` named ``pattern``."""
    return drop_page_cache(Path(root).rglob(pattern))


def filesystem_of(path: str | os.PathLike) -> str:
    """The filesystem a directory sits on, as ``df`` names it (source, type,
    mount point): the label a disk figure needs."""
    out = subprocess.run(
        ["df", "--output=source,fstype,target", str(path)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    return " ".join(out[-1].split()) if len(out) > 1 else "unknown"
