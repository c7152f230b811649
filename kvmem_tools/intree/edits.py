"""Anchored edits of vLLM's files, and the files a patch adds.

An anchor is exact text that must occur exactly once in the file: a moved or
changed anchor fails naming the patch, the file and the anchor, never fuzzes.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
#: ruff as vLLM's pre-commit runs it on new files: imports sorted with
#: ``vllm`` first-party, then formatted.
RUFF_VLLM = (
    "--isolated",
    "--line-length=88",
    "--target-version=py310",
    "--config=lint.isort.known-first-party=['vllm']",
)


class AnchorError(ValueError):
    """An edit's anchor is not in its file exactly once."""


@dataclass(frozen=True)
class Edit:
    """Insert ``text`` after (or before) ``anchor`` in ``path``, or replace it;
    ``where="end"``: append it to the file (``anchor`` empty), as a test added
    to an existing suite of vLLM is."""

    path: str
    anchor: str
    text: str
    where: Literal["after", "before", "replace", "end"] = "after"

    def edited(self, source: str, patch: str) -> str:
        """``source`` with this edit made; raises ``AnchorError`` naming the
        patch, the file and the anchor unless the anchor occurs once."""
        if self.where == "end":
            if self.anchor:
                raise ValueError(f"patch {patch}: {self.path}: an append has no anchor")
            return source + self.text
        count = source.count(self.anchor)
        if count != 1:
            raise AnchorError(
                f"patch {patch}: {self.path}: anchor {self.anchor!r}: {count} "
                f"matches (need exactly 1)"
            )
        at = source.index(self.anchor)
        end = at + len(self.anchor)
        if self.where == "after":
            return source[:end] + self.text + source[end:]
        if self.where == "before":
            return source[:at] + self.text + source[at:]
        return source[:at] + self.text + source[end:]

    def apply(self, root: Path, patch: str) -> None:
        file = root / self.path
        file.write_text(self.edited(file.read_text(), patch))


def appended(
    path: str, source: Path, renames: tuple[tuple[str, str], ...] = ()
) -> Edit:
    """The tests in ``source`` appended to vLLM's test file ``path`` (after
    two blank lines): a PR's tests join the suite that covers its code.
    ``renames``: ``(text in source, text here)`` pairs, for another release."""
    text = source.read_text()
    for old, new in renames:
        if old not in text:
            raise ValueError(f"{source}: no {old!r}")
        text = text.replace(old, new)
    return Edit(path, "", "\n\n" + text, where="end")


@dataclass(frozen=True)
class NewFile:
    """A file the patch adds, at ``path`` in vLLM's tree, from ``source``
    (written for vLLM 0.33), with ``renames`` of what sits elsewhere in
    another release or tree (``(source text, text here)`` pairs).

    ``prefix`` goes before the source (the SPDX header of a module shared
    with the plugin); ``tidy`` runs ruff on the result as vLLM's pre-commit
    would (renamed imports regroup)."""

    path: str
    source: Path
    renames: tuple[tuple[str, str], ...] = ()
    prefix: str = ""
    tidy: bool = False

    def apply(self, root: Path, patch: str) -> None:
        text = self.source.read_text()
        for old, new in self.renames:
            if old not in text:
                raise ValueError(f"patch {patch}: {self.path}: no {old!r}")
            text = text.replace(old, new)
        text = self.prefix + text
        if not text.startswith(SPDX):
            raise ValueError(f"patch {patch}: {self.path}: no SPDX header")
        out = root / self.path
        if out.exists():
            raise ValueError(f"patch {patch}: {self.path} exists in the tree")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if self.tidy:
            ruff = [sys.executable, "-m", "ruff"]
            for cmd in (
                [*ruff, "check", "--fix", "--select=I", *RUFF_VLLM, str(out)],
                [*ruff, "format", *RUFF_VLLM[:3], str(out)],
            ):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise ValueError(f"patch {patch}: {self.path}: {done.stdout}")
