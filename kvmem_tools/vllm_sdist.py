"""vLLM's own tests, from the release's source distribution.

An installed vLLM and its wheel hold no ``tests/`` folder; the sdist on PyPI
(``vllm-<version>.tar.gz``) does. The in-tree series edits some of vLLM's
test files (a PR adds its tests to the suite that already covers the code),
so the generator reads those files, and the tests run them, from the sdist
of the tree's release: fetched once, checked against its sha256, and kept
under ``$XDG_CACHE_HOME/vllm-kvmem`` (``~/.cache/vllm-kvmem``).

``pip download --no-binary :all: vllm==X`` would fetch it, but only after
building its metadata, which installs vLLM's build requirements (CUDA torch);
so the file is taken from PyPI's simple index (the JSON form pip reads), by
its exact name, and its hash checked against the index's and the pinned one.

``python -m kvmem_tools.vllm_sdist 0.32.0 0.33.0`` fetches ahead of time
(``make setup`` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple/vllm/"
#: The sdists the series is written and tested against.
PINNED = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}


class SdistUnavailable(ValueError):
    """The sdist of a vLLM version cannot be had (no such release, or no
    network and nothing cached)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-kvmem"


def release_of(version: str) -> str:
    """The PyPI release a tree's version is built from: ``0.32.0+cpu`` (the
    CPU build) is ``0.32.0``. A dev build or main has none."""
    found = re.fullmatch(r"(\d+\.\d+\.\d+)(\+[\w.]+)?", version)
    if not found:
        raise SdistUnavailable(
            f"vLLM {version} is no release, so it has no sdist to take vLLM's "
            "tests from: pass a source checkout holding tests/ (--vllm-src)"
        )
    return found[1]


def _fetch(release: str, dest: Path) -> None:
    name = f"vllm-{release}.tar.gz"
    request = urllib.request.Request(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            files = json.load(answer)["files"]
        (entry,) = [f for f in files if f["filename"] == name]
        with urllib.request.urlopen(entry["url"], timeout=600) as answer:
            data = answer.read()
    except (OSError, ValueError) as e:
        raise SdistUnavailable(
            f"cannot fetch {name} from PyPI ({e}); vLLM's tests are read from it "
            f"(run `python -m kvmem_tools.vllm_sdist {release}` where PyPI is "
            f"reachable, or place the file at {dest})"
        ) from e
    digest = hashlib.sha256(data).hexdigest()
    if digest not in (entry["hashes"].get("sha256"), PINNED.get(release, digest)):
        raise SdistUnavailable(f"{name}: sha256 {digest} is not the published one")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(dest)


def extract(version: str, paths: tuple[str, ...], dest: Path) -> Path:
    """The files of the release ``version`` is built from whose sdist paths
    (relative to its top folder) equal or lie under one of ``paths``, at the
    same relative paths under ``dest``; the sdist is fetched once."""
    release = release_of(version)
    tarball = cache_dir() / f"vllm-{release}.tar.gz"
    if not tarball.is_file():
        _fetch(release, tarball)
    elif release in PINNED:
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != PINNED[release]:
            raise SdistUnavailable(f"{tarball}: sha256 {digest} is not {release}'s")
    prefix = f"vllm-{release}/"
    with tarfile.open(tarball) as sdist:
        members = []
        for m in sdist.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.isfile() and any(rel == p or rel.startswith(p + "/") for p in paths):
                m.name = rel
                members.append(m)
        sdist.extractall(dest, members=members, filter="data")
    return dest


def tests_root(version: str) -> Path:
    """A folder holding ``tests/`` (and ``pyproject.toml``) of the release
    ``version`` is built from, extracted from its sdist (fetched once)."""
    release = release_of(version)
    root = cache_dir() / f"vllm-{release}"
    if (root / "tests").is_dir() and (root / ".complete").is_file():
        return root
    extract(version, ("tests", "pyproject.toml"), root)
    (root / ".complete").write_text(release + "\n")
    return root


def main(argv: list[str]) -> int:
    for version in argv or sorted(PINNED):
        try:
            print(tests_root(version))
        except SdistUnavailable as e:
            print(f"python -m kvmem_tools.vllm_sdist: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
