"""Write the in-tree series with git (``python -m kvmem_tools.intree``).

The vLLM files the series edits are copied from the tree given into a
scratch git repository and committed as they are; each patch's edits and new
files are applied and committed with its PR text as the message, and ``git
format-patch`` writes the series. So the diffs are computed against that
tree at run time, and what ``git am`` reads is what git itself wrote. Every
commit is authored and signed off (``git commit -s``, as vLLM's DCO asks)
by whoever runs the generator, from their ``git config user.name`` and
``user.email``; the generator refuses to run without them.

A patch module (``patches/<name>.py``, listed in :data:`ORDER`) defines
``PATCH``, an :class:`InTreePatch`. Its ``message`` is built with
``kvmem_tools.intree.pr_text.pr_text`` (vLLM 0.32's PR template: Overview,
Claims, Validation, Details and the checklist answered, with the
duplicate-work answer and the AI-assistance statement); its ``changes`` hold
one list of ``Edit``/``NewFile`` per release series it is written for
(``"0.32"``, ``"0.33"``). For any tree (a release, a dev build, main) each
patch takes the variant of the nearest release whose anchors all match the
tree as the patches before it left it; only when none does is the tree
refused, naming the patch, the file and the anchor. An edit of a file that
only a source checkout holds (``.buildkite/``) is left out, and said so, for
an installed package or a wheel, which have no such folder.

A PR's tests join vLLM's existing suites where one fits (vLLM's AGENTS.md:
extend existing test files): an ``Edit`` of ``tests/...`` (imports at their
anchors, the tests appended: ``edits.appended``). An installed package or a
wheel has no ``tests/``, so those files are read from the sdist of the
tree's release (``kvmem_tools.vllm_sdist``, fetched once and cached;
``tests_root``). To run such tests, ``copy_tests`` puts vLLM's tests beside
a ``copy_tree`` before ``apply_series``; without them, ``apply_series``
leaves those edits out (an engine run needs only the files a patch adds).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmem_tools import vllm_sdist
from kvmem_tools.intree.edits import AnchorError, Edit, NewFile
from kvmem_tools.vllm_sources import SourceTree

FILES = Path(__file__).resolve().parent / "files"
#: The patches, in series order (modules of ``kvmem_tools.intree.patches``).
ORDER = (
    "pp_kv_budget",
    "kv_cache_tokens",
    "cpu_attn_block_outer",
    "cpu_mla_kv_cache_layouts",
    "mrv2_preemptions_first",
    "simple_cpu_offload_late_spill",
)
#: The date of every commit: the series is the same bytes for the same tree
#: and the same submitter.
GIT_DATES = {
    "GIT_AUTHOR_DATE": "2026-11-25T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-11-25T00:00:00+00:00",
}
#: Top-level folders of vLLM's repository that a source checkout has and an
#: installed package or a wheel has not.
CHECKOUT_ONLY = (".buildkite",)


@dataclass(frozen=True)
class InTreePatch:
    """One PR of the series: its subject, its PR text, and its changes for
    each vLLM release series it is written for."""

    slug: str
    subject: str
    message: str
    changes: dict[str, list[Edit | NewFile]] = field(default_factory=dict)
    #: The PRs of the series this one is stacked on (it edits their code),
    #: written with it wherever it is written alone.
    builds_on: tuple[str, ...] = ()

    def for_series(self, series: str) -> list[Edit | NewFile]:
        if series not in self.changes:
            raise ValueError(f"patch {self.slug} is not written for vLLM {series}")
        return self.changes[series]

    def variants_for(self, series: str) -> list[str]:
        """The release series this patch is written for, nearest to
        ``series`` first (of two as near, the newer)."""
        target = _release_key(series)

        def distance(s: str) -> tuple[int, int]:
            key = _release_key(s)
            return (abs(key[0] - target[0]) * 1000 + abs(key[1] - target[1]), -key[1])

        return sorted(self.changes, key=distance)


def patches() -> list[InTreePatch]:
    return [
        importlib.import_module(f"kvmem_tools.intree.patches.{name}").PATCH
        for name in ORDER
    ]


def series_of(version: str) -> str:
    """The release series (``major.minor``) of a vLLM version, dev and local
    builds included (``0.34.0.dev0+g1234abc`` is ``0.34``); a version that
    names none (``main``) is returned as it is, and taken as the newest."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{found[1]}.{found[2]}" if found else version


def _release_key(series: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)$", series)
    return (int(found[1]), int(found[2])) if found else (1 << 10, 0)


def installed_vllm_root() -> Path:
    """The folder holding the installed ``vllm`` package."""
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


class IdentityError(ValueError):
    """The environment running the generator has no git identity to author
    and sign off the series with."""


def submitter() -> tuple[str, str]:
    """The name and email of ``git config user.name`` and ``user.email``
    where the generator runs: the person who submits the PRs authors and
    signs off every commit (the DCO's ``Signed-off-by``), never a project
    identity. Raises ``IdentityError`` when either is unset."""
    found = []
    for key in ("user.name", "user.email"):
        done = subprocess.run(["git", "config", key], capture_output=True, text=True)
        found.append(done.stdout.strip())
    if not all(found):
        raise IdentityError(
            "no git identity to sign off the series with (the DCO's "
            "Signed-off-by is the submitter's): set `git config user.name` and "
            "`git config user.email`"
        )
    return found[0], found[1]


def _git_env() -> dict[str, str]:
    """The environment of every git command on the scratch repository: the
    submitter as author and committer, the fixed dates, and none of the
    user's or the system's git configuration (``diff.noprefix``,
    ``format.signature``, ``commit.gpgsign`` would change the bytes)."""
    name, email = submitter()
    return {
        **os.environ,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        **GIT_DATES,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }


def _git(repo: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        ["git", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def tests_root(tree: Path, version: str) -> Path:
    """A folder holding vLLM's ``tests/`` for the tree ``tree`` of vLLM
    ``version``: the tree itself when it is a source checkout, else the
    sdist of its release (``kvmem_tools.vllm_sdist``: fetched once, cached;
    an installed package or a wheel has no tests)."""
    if (tree / "tests" / "conftest.py").is_file():
        return tree
    return vllm_sdist.tests_root(version)


def _has_vllm_tests(source: SourceTree) -> bool:
    """``source`` holds vLLM's ``tests/`` (a checkout, or a tree made like
    one), not an installed package or a wheel, whose tests are the sdist's
    (a ``tests/`` in ``site-packages`` is some other distribution's)."""
    if source.root.suffix == ".whl" or not source.has_folder("tests"):
        return False
    return not any(source.root.glob("vllm*.dist-info"))


def copy_tests(root: Path, dest: Path) -> Path:
    """vLLM's ``tests/`` under ``root`` at ``dest/tests``, for a patch to be
    applied to: Python files copied, every other file linked."""
    return _copy_folder(root, dest, "tests")


def _checkout_only(source: SourceTree, path: str) -> bool:
    """``path`` is a file only a source checkout holds, and ``source`` is
    not one (an installed package or a wheel)."""
    top = path.split("/", 1)[0]
    return top in CHECKOUT_ONLY and not source.has_folder(top)


def _fitting(
    patch: InTreePatch,
    series: str,
    repo: Path,
    source: SourceTree,
    notes: list[str],
    no_tests: str | None = None,
) -> list[Edit | NewFile]:
    """The changes of ``patch`` for the tree in ``repo``: those of the
    nearest release whose anchors all match there. Raises the nearest
    variant's ``AnchorError`` when none fits."""
    errors: list[AnchorError] = []
    for variant in patch.variants_for(series):
        changes, skipped = [], []
        texts: dict[str, str] = {}
        try:
            for change in patch.changes[variant]:
                if isinstance(change, NewFile):
                    changes.append(change)
                    continue
                if change.path not in texts:
                    file = repo / change.path
                    if not file.is_file():
                        if _checkout_only(source, change.path):
                            skipped.append(
                                (change.path, "the tree is no source checkout")
                            )
                            continue
                        if no_tests and change.path.startswith("tests/"):
                            skipped.append((change.path, no_tests))
                            continue
                        raise AnchorError(
                            f"patch {patch.slug}: {change.path}: no such file in "
                            f"the tree (anchor {change.anchor!r})"
                        )
                    texts[change.path] = file.read_text()
                texts[change.path] = change.edited(texts[change.path], patch.slug)
                changes.append(change)
        except AnchorError as e:
            errors.append(e)
            continue
        notes += [
            f"{patch.slug}: {path} left out ({why})"
            for path, why in sorted(set(skipped))
        ]
        return changes
    raise errors[0]


def write_series(
    out: Path,
    vllm_src: Path | None = None,
    notes: list[str] | None = None,
    only: Sequence[str] | None = None,
) -> tuple[str, list[Path]]:
    """Write the series for the vLLM tree ``vllm_src`` (a checkout, a folder
    holding ``vllm/``, or a wheel; default: the installed vLLM) into ``out``.
    ``only``: the patches (modules of :data:`ORDER`) to write, each then made
    against the tree as the patches it leaves out would not change it (one
    PR alone: ``only=[name]``, with the PRs it builds on). Returns the tree's
    vLLM version and the patch files, in order; what was left out goes to
    ``notes``."""
    notes = [] if notes is None else notes
    unknown = set(only or ()) - set(ORDER)
    if unknown:
        raise ValueError(f"--only {sorted(unknown)}: no such patch; one of {ORDER}")
    tree = Path(vllm_src) if vllm_src else installed_vllm_root()
    source = SourceTree(tree)
    version = source.version()
    if version is None:
        raise ValueError(f"{tree}: no vllm/_version.py")
    series = series_of(version)
    env = _git_env()
    wanted = set(only or ORDER)
    for name, p in reversed(list(zip(ORDER, patches()))):
        if name in wanted:
            wanted.update(p.builds_on)
    every = [p for name, p in zip(ORDER, patches()) if name in wanted]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvmem-intree-") as tmp:
        repo = Path(tmp)
        _git(repo, env, "init", "-q", "-b", "main")
        # Every file any variant edits, as far as the tree has it; vLLM's
        # test files from its tests (the sdist's, for a package or a wheel).
        tests: SourceTree | None = None
        no_tests = None
        for relpath in sorted(
            {
                c.path
                for p in every
                for cs in p.changes.values()
                for c in cs
                if isinstance(c, Edit)
            }
        ):
            data = source.read(relpath)
            if relpath.startswith("tests/") and not _has_vllm_tests(source):
                try:
                    tests = tests or SourceTree(tests_root(tree, version))
                except vllm_sdist.SdistUnavailable as e:
                    no_tests = f"vLLM's tests unavailable: {e}"
                data = tests.read(relpath) if tests else None
            if data is not None:
                (repo / relpath).parent.mkdir(parents=True, exist_ok=True)
                (repo / relpath).write_bytes(data)
        _git(repo, env, "add", "-A")
        _git(repo, env, "commit", "-q", "--allow-empty", "-m", f"vLLM {version}")
        base = _git(repo, env, "rev-parse", "HEAD").strip()
        for patch in every:
            for change in _fitting(patch, series, repo, source, notes, no_tests):
                change.apply(repo, patch.slug)
            _git(repo, env, "add", "-A")
            message = f"{patch.subject}\n\n{patch.message}"
            _git(repo, env, "commit", "-q", "-s", "-m", message)
        for old in out.glob("*.patch"):
            old.unlink()
        _git(repo, env, "format-patch", "-q", "--full-index", "-o", str(out), base)
    return version, sorted(out.glob("*.patch"))


def unit_tests(changes: Sequence[Edit | NewFile]) -> list[str]:
    """A patch's unit tests as pytest arguments: each test file it adds and
    each test function it appends to one of vLLM's test files (node ids,
    ``file::name``: the rest of vLLM's file is not the patch's to run). The
    engine tests (``tests/v1/e2e/``) are left to the engine harnesses. Run
    them on a ``copy_tree`` with ``copy_tests``, with ``--noconftest``:
    vLLM's ``tests/conftest.py`` needs vLLM's test requirements."""
    out: list[str] = []
    for c in changes:
        if not c.path.startswith("tests/") or c.path.startswith("tests/v1/e2e/"):
            continue
        if isinstance(c, Edit):
            names = re.findall(r"^def (test_\w+)\(", c.text, flags=re.M)
            out += [f"{c.path}::{n}" for n in names]
        else:
            out.append(c.path)
    return out


def absent_vllm_tests(root: Path, patch: Path) -> list[str]:
    """The test files of vLLM that ``patch`` edits (not adds) and the tree
    under ``root`` lacks (an installed package has no ``tests/``)."""
    edited = re.findall(
        r"^diff --git a/(tests/\S+) b/\S+\n(?!new file)",
        patch.read_text(),
        flags=re.M,
    )
    return [path for path in edited if not (root / path).is_file()]


def apply_series(root: Path, files: list[Path]) -> None:
    """``git apply`` each patch to the tree under ``root``, in order. Edits
    of vLLM's own test files are left out where the tree has none of them
    (``copy_tests`` puts them in)."""
    for patch in files:
        excluded = [f"--exclude={p}" for p in absent_vllm_tests(root, patch)]
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", *excluded, str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name}: {done.stderr.strip()}")


def copy_tree(src: Path, dest: Path) -> Path:
    """A copy of the vLLM package under ``src`` at ``dest/vllm``: Python files
    copied (the series edits them), every other file linked."""
    return _copy_folder(src, dest, "vllm")


def _copy_folder(src: Path, dest: Path, folder: str) -> Path:
    """``src/folder`` at ``dest/folder``: Python files copied (the series
    edits them), every other file linked."""
    for root, dirs, names in os.walk(src / folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        to = dest / Path(root).relative_to(src)
        to.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name.endswith(".py"):
                shutil.copy2(Path(root) / name, to / name)
            else:
                os.symlink(Path(root) / name, to / name)
    return dest


def added_lines(patch: Path) -> dict[str, list[str]]:
    """Lines each file gains in ``patch`` (a ``git format-patch`` file)."""
    out: dict[str, list[str]] = {}
    path = None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            path = line.removeprefix("+++ b/")
            out[path] = []
        elif line.startswith("+") and path is not None:
            out[path].append(line[1:])
    return out


def sizes(patch: Path) -> tuple[int, int]:
    """Lines ``patch`` adds outside tests and in tests (``tests/``)."""
    added = added_lines(patch)
    in_tests = sum(len(v) for f, v in added.items() if f.startswith("tests/"))
    return sum(map(len, added.values())) - in_tests, in_tests


def run(vllm_src: str | None, out: str, only: Sequence[str] | None = None) -> int:
    """Write the series, print each patch and its size."""
    notes: list[str] = []
    tree = Path(vllm_src) if vllm_src else None
    version, files = write_series(Path(out), tree, notes, only)
    print(f"vLLM {version}: {len(files)} patches in {out}")
    for patch in files:
        code, tests = sizes(patch)
        print(f"  {patch.name}: +{code + tests} lines ({code} outside tests)")
    for note in notes:
        print(f"  note: {note}")
    return 0
