"""The series on disk, in ``git format-patch`` form: what ``git am`` reads.

A change is ``(path, text before or None for a new file, text after)``; the
diffs are computed here, at run time, against the tree given.
"""

from __future__ import annotations

import difflib
import hashlib

AUTHOR = "vllm-kvmem <vllm-kvmem@users.noreply.github.com>"
DATE = "Thu, 1 Jan 2026 00:00:00 +0000"


def diff_text(changes: list[tuple[str, str | None, str]]) -> str:
    """``git diff`` form of the changes (new files with ``new file mode``)."""
    out = []
    for path, before, after in changes:
        a = (before or "").splitlines(keepends=True)
        b = after.splitlines(keepends=True)
        out.append(f"diff --git a/{path} b/{path}\n")
        if before is None:
            out.append("new file mode 100644\n")
        hunks = list(
            difflib.unified_diff(
                a,
                b,
                "/dev/null" if before is None else f"a/{path}",
                f"b/{path}",
                n=3,
            )
        )
        if not hunks:  # an empty new file
            continue
        for line in hunks:
            out.append(
                line
                if line.endswith("\n")
                else line + "\n\\ No newline at end of file\n"
            )
    return "".join(out)


def diffstat(changes: list[tuple[str, str | None, str]]) -> str:
    """``git format-patch``'s summary of the files changed."""
    rows = []
    for path, before, after in changes:
        diff = difflib.unified_diff(
            (before or "").splitlines(), after.splitlines(), lineterm="", n=0
        )
        add = rem = 0
        for line in diff:
            if line.startswith(("+++", "---")):
                continue
            add += line.startswith("+")
            rem += line.startswith("-")
        rows.append((path, add, rem))
    width = max(len(p) for p, _, _ in rows)
    lines = [
        f" {p.ljust(width)} | {a + r:4} {'+' * min(a, 40)}{'-' * min(r, 40)}"
        for p, a, r in rows
    ]
    add = sum(a for _, a, _ in rows)
    rem = sum(r for _, _, r in rows)
    lines.append(f" {len(rows)} files changed, {add} insertions(+), {rem} deletions(-)")
    return "\n".join(lines)


def format_patch(
    number: int,
    total: int,
    subject: str,
    message: str,
    changes: list[tuple[str, str | None, str]],
) -> str:
    """One patch in ``git format-patch`` form (``git am`` reads it)."""
    diff = diff_text(changes)
    sha = hashlib.sha1((message + diff).encode()).hexdigest()
    subject = f"[PATCH {number}/{total}] {subject}"
    return (
        f"From {sha} Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {DATE}\n"
        f"Subject: {subject}\n\n"
        f"{message}---\n{diffstat(changes)}\n\n{diff}-- \nkvmem upstream\n\n"
    )
