"""A patched copy of the installed vLLM, for the in-tree series' tests.

The copy has vLLM's Python files copied (the series edits them) and every
other file linked (400 MB of binaries the series never touches); the series
is applied with ``git apply``, patch by patch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from vllm_kvmem.upstream import series as up


def apply_series(root: Path, patches: list[Path]) -> None:
    """``git apply`` each patch in order (each sees the tree its predecessors
    left)."""
    for patch in patches:
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"


def copy_vllm(dest: Path) -> Path:
    """A copy of the installed vLLM package under ``dest/vllm``."""
    src = up.vllm_root() / "vllm"
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dest / "vllm" / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".py"):
                shutil.copy2(Path(root) / name, out / name)
            else:
                os.symlink(Path(root) / name, out / name)
    return dest


def no_plugin_env(root: Path, shim: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that runs the vLLM copy under ``root``
    with no plugin: the copy and ``shim`` (:func:`no_plugin_shim`) first on
    the path, and ``VLLM_PLUGINS`` empty, so vllm-kvmem's entry point is
    skipped."""
    from vllm_kvmem.demo_engine import engine_env

    return engine_env(PYTHONPATH=f"{root}{os.pathsep}{shim}", VLLM_PLUGINS="", **extra)


def no_plugin_shim(folder: Path) -> Path:
    """A folder whose ``vllm_kvmem`` raises on import: first on the path of a
    process that must run the in-tree vLLM without the plugin."""
    (folder / "vllm_kvmem").mkdir(parents=True)
    (folder / "vllm_kvmem" / "__init__.py").write_text(
        "raise ImportError('the in-tree vLLM imported vllm_kvmem')\n"
    )
    return folder
