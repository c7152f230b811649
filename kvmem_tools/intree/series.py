"""``kvmem upstream``: write the in-tree series with git.

The vLLM files the series edits are copied from the tree given into a
scratch git repository and committed as they are; each patch's edits and new
files are applied and committed with its PR text as the message; ``git
format-patch`` writes the series. So the diffs are computed against that
tree at run time, and what ``git am`` reads is what git itself wrote.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.vllm_sources import SourceTree

FILES = Path(__file__).resolve().parent / "files"
#: The patches, in series order (modules of ``kvmem_tools.intree.patches``).
ORDER = (
    "pp_kv_budget",
    "kv_cache_tokens",
    "cpu_attn_block_outer",
    "simple_cpu_offload_cpu",
    "simple_cpu_offload_late_spill",
)
#: Author and date of every commit: the series is the same bytes for the same
#: tree.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "vllm-kvmem",
    "GIT_AUTHOR_EMAIL": "vllm-kvmem@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-11-25T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "vllm-kvmem",
    "GIT_COMMITTER_EMAIL": "vllm-kvmem@users.noreply.github.com",
    "GIT_COMMITTER_DATE": "2026-11-25T00:00:00+00:00",
}


@dataclass(frozen=True)
class InTreePatch:
    """One PR of the series: its subject, its PR text, and its changes for
    each vLLM release series it is written for."""

    slug: str
    subject: str
    message: str
    changes: dict[str, list[Edit | NewFile]] = field(default_factory=dict)

    def for_series(self, series: str) -> list[Edit | NewFile]:
        if series not in self.changes:
            raise ValueError(f"patch {self.slug} is not written for vLLM {series}")
        return self.changes[series]


def patches() -> list[InTreePatch]:
    return [
        importlib.import_module(f"kvmem_tools.intree.patches.{name}").PATCH
        for name in ORDER
    ]


def series_of(version: str) -> str:
    major_minor = ".".join(version.split(".")[:2])
    if major_minor not in ("0.32", "0.33"):
        raise ValueError(
            f"the in-tree series is written for vLLM 0.32 and 0.33, not {version}"
        )
    return major_minor


def installed_vllm_root() -> Path:
    """The folder holding the installed ``vllm`` package."""
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **GIT_ENV},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def write_series(out: Path, vllm_src: Path | None = None) -> tuple[str, list[Path]]:
    """Write the series for the vLLM tree ``vllm_src`` (a folder holding
    ``vllm/``, or a wheel; default: the installed vLLM) into ``out``.
    Returns the tree's vLLM version and the patch files, in order."""
    tree = Path(vllm_src) if vllm_src else installed_vllm_root()
    source = SourceTree(tree)
    version = source.version()
    if version is None:
        raise ValueError(f"{tree}: no vllm/_version.py")
    series = series_of(version)
    todo = [(p, p.for_series(series)) for p in patches()]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvmem-intree-") as tmp:
        repo = Path(tmp)
        _git(repo, "init", "-q", "-b", "main")
        added = {c.path for _, cs in todo for c in cs if isinstance(c, NewFile)}
        seeded = sorted(
            {c.path for _, cs in todo for c in cs if isinstance(c, Edit)} - added
        )
        for relpath in seeded:
            data = source.read(relpath)
            if data is None:
                raise ValueError(f"{tree}: no {relpath} (vLLM {version})")
            (repo / relpath).parent.mkdir(parents=True, exist_ok=True)
            (repo / relpath).write_bytes(data)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"vLLM {version}")
        base = _git(repo, "rev-parse", "HEAD").strip()
        for patch, changes in todo:
            for change in changes:
                change.apply(repo, patch.slug)
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{patch.subject}\n\n{patch.message}")
        for old in out.glob("*.patch"):
            old.unlink()
        _git(repo, "format-patch", "-q", "--full-index", "-o", str(out), base)
    return version, sorted(out.glob("*.patch"))


def apply_series(root: Path, files: list[Path]) -> None:
    """``git apply`` each patch to the tree under ``root``, in order."""
    for patch in files:
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name}: {done.stderr.strip()}")


def copy_tree(src: Path, dest: Path) -> Path:
    """A copy of the vLLM package under ``src`` at ``dest/vllm``: Python files
    copied (the series edits them), every other file linked."""
    for root, dirs, names in os.walk(src / "vllm"):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        to = dest / "vllm" / Path(root).relative_to(src / "vllm")
        to.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name.endswith(".py"):
                shutil.copy2(Path(root) / name, to / name)
            else:
                os.symlink(Path(root) / name, to / name)
    return dest


def run(args) -> int:
    """``kvmem upstream``: write the series, print each patch and its size."""
    version, files = write_series(Path(args.out), args.vllm_src)
    print(f"vLLM {version}: {len(files)} patches in {args.out}")
    for patch in files:
        lines = patch.read_text().splitlines()
        added = [ln for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
        print(f"  {patch.name}: +{len(added)} lines")
    return 0
