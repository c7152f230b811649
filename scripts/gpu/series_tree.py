"""A copy of the installed vLLM with the in-tree series applied, for the GPU
scripts' arms that run vLLM's own lazy offload with the late-spills PR.

``late_spill.py`` (stage 2's item i) and ``real_size.py``'s
``simple_lazy_series`` arm run vLLM's ``SimpleCPUOffloadConnector`` on a
vLLM that carries the project's in-tree series, with no plugin. That vLLM is
built on the machine from the vLLM it has (``.gpu-site`` on the lent
machine, ``site-packages`` elsewhere): ``kvmem_tools.intree``'s generator
writes the series for that tree (``write_series``: the diffs are computed
against it, so a release whose files moved fails by name instead of
applying wrong), ``copy_tree`` copies its Python files, and the patches are
applied in series order. Which PRs the series holds is the generator's
business (``ORDER``); this module only checks that the late-spills PR
(``simple_cpu_offload_late_spill``) is one of them, and writes a folder
whose ``vllm`` goes first on an arm's ``PYTHONPATH``.

The generator needs ``git`` (``git init``/``commit``/``format-patch``), and
``apply_series`` runs ``git apply``. The lent machine's image has not been
seen with or without git, so this does not depend on it: ``prepare`` (here,
where git is) writes the patches into ``.gpu-site-intree/series``, a call
carries that folder, and without git the patches are applied by
:func:`python_apply` (exact context, nearest position, refused otherwise).
The carried folder is copied to ``/tmp/kvmem-series`` at once, since the
next call's carried path replaces its top-level folder in the checkout.

The built tree stays in ``/tmp/kvmem-intree`` while the machine is warm;
its manifest (``kvmem-series.json``) names the vLLM tree, the patches and
a digest of the generator's sources, so a later call reuses it only when
all three are the same.

Command line (standard library only at import; ``kvmem_tools`` from the
checkout)::

    python scripts/gpu/series_tree.py prepare    # here: the patches to carry
    python scripts/gpu/series_tree.py take       # there: copy them to /tmp
    python scripts/gpu/series_tree.py build [--dest DIR] [--only PATCH]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
#: The late-spills PR: the one PR name these scripts rely on.
LATE_SPILL = "simple_cpu_offload_late_spill"
#: Where ``prepare`` writes the patches (ignored by git: ``/.gpu-site-*/``),
#: for a call to carry when the machine has no git.
CARRIED = ROOT / ".gpu-site-intree" / "series"
#: Where a call copies the carried patches out of the checkout.
STORE = Path("/tmp/kvmem-series")
#: Where the patched copy is built on the machine (kept while it is warm).
TREE = Path("/tmp/kvmem-intree")
MANIFEST = "kvmem-series.json"


def vllm_root() -> Path:
    """The folder holding the ``vllm`` package this Python would import,
    found without importing it (the scripts' parents never import vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no vllm package on this Python's path")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def _intree() -> Any:
    """``kvmem_tools.intree.series`` from the checkout (not in the wheel)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from kvmem_tools.intree import series

    return series


def generator_digest() -> str:
    """sha256 over the generator's sources (``kvmem_tools/intree``): the same
    digest, the same series for the same vLLM tree."""
    h = hashlib.sha256()
    base = ROOT / "kvmem_tools"
    for path in sorted(base.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(base)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def has_git() -> bool:
    return shutil.which("git") is not None


def pythonpath(tree: Path, current: str | None = None) -> str:
    """An arm's ``PYTHONPATH``: the patched ``vllm`` first, then the current
    entries (vLLM's dependencies) without the checkout, so nothing of the
    plugin is importable in that arm."""
    current = os.environ.get("PYTHONPATH", "") if current is None else current
    keep = [p for p in current.split(os.pathsep) if p and Path(p).resolve() != ROOT]
    return os.pathsep.join([str(tree), *keep])


# -- patches without git -------------------------------------------------------------

HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class FilePatch:
    """One file's part of a ``git format-patch`` file."""

    old: str | None = None  # None: a new file
    new: str | None = None  # None: a deleted file
    hunks: list[tuple[int, list[tuple[str, str]]]] = field(default_factory=list)


def parse_patch(text: str) -> list[FilePatch]:
    """The files and hunks of a unified diff as ``git format-patch`` writes
    it (headers and the signature after the last hunk are skipped)."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("diff --git "):
            files.append(FilePatch())
        elif not files:
            continue
        elif line.startswith("--- "):
            path = line[4:].rstrip("\n")
            files[-1].old = None if path == "/dev/null" else path.removeprefix("a/")
        elif line.startswith("+++ "):
            path = line[4:].rstrip("\n")
            files[-1].new = None if path == "/dev/null" else path.removeprefix("b/")
        elif m := HUNK.match(line):
            old_n = int(m[2]) if m[2] is not None else 1
            new_n = int(m[4]) if m[4] is not None else 1
            body: list[tuple[str, str]] = []
            o = n = 0
            while (
                o < old_n or n < new_n or (i < len(lines) and lines[i].startswith("\\"))
            ):
                text_line = lines[i]
                i += 1
                if text_line.startswith("\\"):  # "\ No newline at end of file"
                    tag, last = body[-1]
                    body[-1] = (tag, last.removesuffix("\n"))
                    continue
                tag, rest = text_line[:1], text_line[1:]
                if tag == "\n" or tag == "":  # an empty context line
                    tag, rest = " ", "\n"
                if tag not in " +-":
                    raise ValueError(f"bad hunk line {text_line!r}")
                body.append((tag, rest))
                o += tag in " -"
                n += tag in " +"
            files[-1].hunks.append((int(m[1]), body))
    return files


def _find(lines: list[str], block: list[str], near: int) -> int:
    """Where ``block`` occurs in ``lines``, nearest to ``near`` (as ``git
    apply`` looks for a hunk that moved); -1 when nowhere."""
    if not block:
        return min(max(near, 0), len(lines))
    best = -1
    for start in range(len(lines) - len(block) + 1):
        if lines[start : start + len(block)] == block and (
            best < 0 or abs(start - near) < abs(best - near)
        ):
            best = start
    return best


def python_apply(root: Path, patch: Path, exclude: Sequence[str] = ()) -> list[str]:
    """Apply one ``git format-patch`` file under ``root`` without git: each
    hunk where its old lines are exactly (context and removed lines), the
    nearest such place to its line number; a hunk found nowhere refuses the
    patch before any file is written. ``exclude``: files left out, as
    ``git apply --exclude``. Returns the files written."""
    outputs: dict[Path, str | None] = {}
    for fp in parse_patch(patch.read_text()):
        if (fp.old or fp.new) in exclude:
            continue
        src = root / fp.old if fp.old else None
        if src is not None and not src.is_file():
            raise RuntimeError(f"{patch.name}: {fp.old} is not in the tree")
        lines = src.read_text().splitlines(keepends=True) if src else []
        shift = 0
        for start, body in fp.hunks:
            old = [t for tag, t in body if tag in " -"]
            new = [t for tag, t in body if tag in " +"]
            at = _find(lines, old, start - 1 + shift if old else start + shift)
            if at < 0:
                raise RuntimeError(
                    f"{patch.name}: {fp.old}: a hunk at line {start} does not match"
                )
            lines[at : at + len(old)] = new
            shift += len(new) - len(old)
        if fp.new is None:
            outputs[root / str(fp.old)] = None
        else:
            outputs[root / fp.new] = "".join(lines)
    for path, text in outputs.items():
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return [str(p.relative_to(root)) for p in outputs]


# -- the series and the tree ---------------------------------------------------------


def prepare(out: Path = CARRIED, src: Path | None = None) -> dict[str, Any]:
    """Here (git): write the series for ``src`` (default: this Python's
    vLLM) into ``out``, with a manifest, for a call to carry."""
    series = _intree()
    src = src or vllm_root()
    version, files = series.write_series(out, src)
    manifest = {
        "vllm_version": version,
        "vllm_src": str(src),
        "order": list(series.ORDER),
        "patches": [f.name for f in files],
        "generator_digest": generator_digest(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def take_carried(carried: Path = CARRIED, store: Path = STORE) -> Path | None:
    """Copy a carried series out of the checkout (a later call's carried
    path replaces its folder); the store, or None when none ever came."""
    if (carried / MANIFEST).is_file():
        if store.exists():
            shutil.rmtree(store)
        shutil.copytree(carried, store)
    return store if (store / MANIFEST).is_file() else None


def build(
    dest: Path = TREE,
    src: Path | None = None,
    only: Sequence[str] | None = None,
    cpu_scaffolding: bool = False,
    use_git: bool | None = None,
    store: Path = STORE,
    carried: Path = CARRIED,
) -> dict[str, Any]:
    """``dest/vllm``: the vLLM under ``src`` (default: this Python's) with
    the series (``only``: those PRs and what they build on, as the
    generator's ``--only`` writes them) applied; on the CPU platform also the
    generator's CPU scaffolding (the copy path vLLM's connector lacks there;
    never on CUDA). Reused when its manifest matches. Returns the manifest."""
    series = _intree()
    if LATE_SPILL not in series.ORDER:
        raise RuntimeError(f"the series has no {LATE_SPILL} PR: {series.ORDER}")
    src = (src or vllm_root()).resolve()
    use_git = has_git() if use_git is None else use_git
    want = {
        "vllm_src": str(src),
        "only": sorted(only) if only else None,
        "cpu_scaffolding": cpu_scaffolding,
        "generator_digest": generator_digest(),
    }
    manifest_path = dest / MANIFEST
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if all(old.get(k) == v for k, v in want.items()):
            return {**old, "reused": True}
    if dest.exists():
        shutil.rmtree(dest)
    patch_dir = dest.with_name(dest.name + "-patches")
    if use_git:
        version, files = series.write_series(patch_dir, src, only=only)
        how = "git: write_series and apply_series on this machine"
    else:
        carried_store = take_carried(carried, store)
        if carried_store is None:
            raise RuntimeError(
                "no git on this machine and no carried series: run "
                "`python scripts/gpu/series_tree.py prepare` where git is and "
                "carry .gpu-site-intree"
            )
        made = json.loads((carried_store / MANIFEST).read_text())
        if made["generator_digest"] != want["generator_digest"]:
            raise RuntimeError(
                "the carried series was written by another generator "
                f"({made['generator_digest']}, here {want['generator_digest']}): "
                "prepare it again"
            )
        if only:
            raise RuntimeError("--only needs git (the carried series is whole)")
        version, files = (
            made["vllm_version"],
            [carried_store / name for name in made["patches"]],
        )
        how = "python: the carried patches, python_apply (no git here)"
    series.copy_tree(src, dest)
    if use_git:
        series.apply_series(dest, files)
    else:
        for patch in files:
            python_apply(dest, patch, series.absent_vllm_tests(dest, patch))
    if cpu_scaffolding:
        from kvmem_tools.intree import cpu_scaffolding as scaffolding

        scaffolding.apply(dest)
    manifest = {
        **want,
        "vllm_version": version,
        "order": list(series.ORDER),
        "patches": [f.name for f in files],
        "applied_with": how,
        "tree": str(dest),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return {**manifest, "reused": False}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="write the patches to carry (needs git)")
    prep.add_argument("--out", type=Path, default=CARRIED)
    prep.add_argument("--vllm-src", type=Path)
    sub.add_parser("take", help="copy carried patches out of the checkout")
    b = sub.add_parser("build", help="build the patched vLLM copy")
    b.add_argument("--dest", type=Path, default=TREE)
    b.add_argument("--vllm-src", type=Path)
    b.add_argument("--only", action="append")
    b.add_argument("--cpu-scaffolding", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.out, args.vllm_src)))
    elif args.cmd == "take":
        store = take_carried()
        print(f"series store: {store or 'none carried'}")
    else:
        print(
            json.dumps(build(args.dest, args.vllm_src, args.only, args.cpu_scaffolding))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
