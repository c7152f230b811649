"""The series on disk, in ``git format-patch`` form: what ``git am`` reads.

A change is ``(path, text before or None for a new file, text after)``; the
diffs are computed here, at run time, against the tree given. The output
follows git's own (``diff.c``, ``pretty.c``) so that a reviewer sees what a
``git format-patch`` of the same commits would show:

- ``index <old>..<new> 100644`` lines with full blob ids (``--full-index``),
  computed as git does, so that ``git am --3way`` finds the preimage in a
  vLLM clone and merges when the context has moved;
- the diffstat at format-patch's width (72 columns, graph scaled as git
  scales it) with ``create mode`` lines;
- a long subject folded at 78 columns as git folds it (``git am`` unfolds);
  ``MIME-Version``/``Content-Type`` headers when the message is not ASCII.

Lines are split on ``\\n`` only, as git splits them (``str.splitlines`` would
also split on form feeds and other separators that Python files may hold).
"""

from __future__ import annotations

import difflib
import hashlib
import re

AUTHOR = "vllm-kvmem <vllm-kvmem@users.noreply.github.com>"
DATE = "Thu, 1 Jan 2026 00:00:00 +0000"
SIGNATURE = "kvmem upstream"

Change = tuple[str, str | None, str]

NULL_ID = "0" * 40
STAT_WIDTH = 72  # format-patch's stat width (MAIL_DEFAULT_WRAP)
SUBJECT_WIDTH = 78  # RFC 2822 line length, where git folds the subject
CONTEXT = 3


def blob_id(text: str) -> str:
    """Git's object id of a file holding ``text`` (UTF-8): what
    ``git hash-object`` prints."""
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def split_lines(text: str) -> list[str]:
    """``text`` split after each ``\\n`` (the last line may lack one)."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def _range(start: int, length: int) -> str:
    """A hunk header's range, as ``diff -u`` and git write it."""
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def _funcname(line: str) -> str | None:
    """git's default hunk-header function line (xdiff's ``def_ff``): a line
    that starts with a letter, ``_`` or ``$``, cut to 80 bytes."""
    if not line or not (line[0].isascii() and (line[0].isalpha() or line[0] in "_$")):
        return None
    return line.encode()[:80].decode(errors="ignore").rstrip(" \t\n\v\f\r")


class _Matcher(difflib.SequenceMatcher):
    """difflib's matcher with each pure insertion or deletion slid down as
    far as equal lines allow, as git's ``xdl_change_compact`` does: an added
    block then reads from its first line to its last (``f(`` .. ``)``), not
    from a closing line of the code above it."""

    def get_opcodes(self) -> list[tuple[str, int, int, int, int]]:
        ops = [list(op) for op in super().get_opcodes()]
        out: list[list] = []
        for k, (tag, i1, i2, j1, j2) in enumerate(ops):
            nxt = ops[k + 1] if k + 1 < len(ops) else None
            shift = 0
            if tag in ("insert", "delete") and nxt is not None and nxt[0] == "equal":
                seq, lo, hi = (self.b, j1, j2) if tag == "insert" else (self.a, i1, i2)
                room = nxt[2] - nxt[1] - 1  # leave one equal line after it
                while shift < room and seq[lo + shift] == seq[hi + shift]:
                    shift += 1
            if shift:
                if out and out[-1][0] == "equal":
                    out[-1][2] += shift
                    out[-1][4] += shift
                else:
                    out.append(["equal", i1, i1 + shift, j1, j1 + shift])
                nxt[1] += shift
                nxt[3] += shift
            out.append([tag, i1 + shift, i2 + shift, j1 + shift, j2 + shift])
        return [tuple(op) for op in out]


def _hunks(a: list[str], b: list[str]) -> list[str]:
    """Unified hunks of ``a`` -> ``b``, each header with git's function line
    (the nearest such line above the hunk; the previous hunk's when none is
    between). No autojunk: difflib's default treats lines frequent in a long
    file (blank lines, ``)``) as junk and then writes larger diffs than
    git's for the same edit."""
    out: list[str] = []
    func, searched_to = "", -1
    matcher = _Matcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(CONTEXT):
        a1, a2, b1, b2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        for i in range(a1 - 1, searched_to, -1):
            if (found := _funcname(a[i])) is not None:
                func = found
                break
        searched_to = a1 - 1
        head = f"@@ -{_range(a1, a2 - a1)} +{_range(b1, b2 - b1)} @@"
        out.append(f"{head} {func}\n" if func else head + "\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + line for line in a[i1:i2]]
                continue
            out += ["-" + line for line in a[i1:i2]]
            out += ["+" + line for line in b[j1:j2]]
    return [
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in out
    ]


def _sorted(changes: list[Change]) -> list[Change]:
    """The changes in git's order (by path), without unchanged files."""
    paths = [path for path, _, _ in changes]
    if len(set(paths)) != len(paths):
        raise ValueError(f"a path is changed twice: {sorted(paths)}")
    kept = [c for c in changes if c[1] is None or c[1] != c[2]]
    return sorted(kept, key=lambda c: c[0].encode())


def counts(before: str | None, after: str) -> tuple[int, int]:
    """Lines added and removed, as the diff of this module shows them."""
    hunk = _hunks(split_lines(before or ""), split_lines(after))
    add = sum(line.startswith("+") for line in hunk)
    rem = sum(line.startswith("-") for line in hunk)
    return add, rem


def diff_text(changes: list[Change]) -> str:
    """``git diff --full-index`` form of the changes."""
    out = []
    for path, before, after in _sorted(changes):
        out.append(f"diff --git a/{path} b/{path}\n")
        new = blob_id(after)
        if before is None:
            out.append(f"new file mode 100644\nindex {NULL_ID}..{new}\n")
        else:
            out.append(f"index {blob_id(before)}..{new} 100644\n")
        hunks = _hunks(split_lines(before or ""), split_lines(after))
        if not hunks:  # an empty new file: git shows no ---/+++ lines
            continue
        out.append("--- /dev/null\n" if before is None else f"--- a/{path}\n")
        out.append(f"+++ b/{path}\n")
        out += hunks
    return "".join(out)


def _scale(it: int, width: int, max_change: int) -> int:
    """git's ``scale_linear``: at least one column for any change."""
    return 0 if not it else 1 + (it * (width - 1) // max_change)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def diffstat(changes: list[Change]) -> str:
    """``git format-patch``'s ``--stat --summary`` of the changes (no
    trailing newline): git's ``show_stats`` at width 72."""
    rows = [(path, *counts(before, after)) for path, before, after in _sorted(changes)]
    if not rows:
        return " 0 files changed"
    max_len = max(len(p) for p, _, _ in rows)
    max_change = max(a + r for _, a, r in rows)
    width = STAT_WIDTH
    number_width = len(str(max_change))
    width = max(width, 16 + 6 + number_width)
    graph_width = max_change
    name_width = max_len
    if name_width + number_width + 6 + graph_width > width:
        if graph_width > width * 3 // 8 - number_width - 6:
            graph_width = max(width * 3 // 8 - number_width - 6, 6)
        if name_width > width - number_width - 6 - graph_width:
            name_width = width - number_width - 6 - graph_width
        else:
            graph_width = width - number_width - 6 - name_width
    lines = []
    for path, added, deleted in rows:
        prefix, name, length = "", path, name_width
        if name_width < len(path):
            prefix, length = "...", max(name_width - 3, 0)
            name = path[len(path) - length :]
            slash = name.find("/")
            if slash >= 0:
                name = name[slash:]
        add, rem = added, deleted
        if graph_width <= max_change:
            total = _scale(add + rem, graph_width, max_change)
            if total < 2 and add and rem:
                total = 2
            if add < rem:
                add = _scale(add, graph_width, max_change)
                rem = total - add
            else:
                rem = _scale(rem, graph_width, max_change)
                add = total - rem
        count = f"{added + deleted:>{number_width}}"
        gap = " " if added + deleted else ""
        pad = " " * max(length - len(name), 0)
        lines.append(f" {prefix}{name}{pad} | {count}{gap}{'+' * add}{'-' * rem}")
    adds = sum(a for _, a, _ in rows)
    dels = sum(r for _, _, r in rows)
    total = " " + _plural(len(rows), "file changed", "files changed")
    if adds or not dels:
        total += ", " + _plural(adds, "insertion(+)", "insertions(+)")
    if dels or not adds:
        total += ", " + _plural(dels, "deletion(-)", "deletions(-)")
    lines.append(total)
    lines += [
        f" create mode 100644 {path}"
        for path, before, _ in _sorted(changes)
        if before is None
    ]
    return "\n".join(lines)


def fold_subject(header: str, subject: str) -> str:
    """``header + subject`` folded at 78 columns as git's
    ``strbuf_add_wrapped_text`` folds it (continuation lines start with one
    space; ``git am`` joins them back with one space)."""
    lines: list[str] = []
    line, fresh = header, True
    for word in subject.split(" "):
        candidate = line + word if fresh else f"{line} {word}"
        fresh = False
        if len(candidate) <= SUBJECT_WIDTH:
            line = candidate
        else:  # the word opens the next line, however long it is
            lines.append(line)
            line = " " + word
    lines.append(line)
    return "\n".join(lines)


def rfc2047_subject(header: str, subject: str) -> str:
    """``header`` + a non-ASCII ``subject`` as RFC 2047 encoded words, as
    git's ``add_rfc2047`` writes them (``q`` encoding, every byte of a
    non-ASCII character and every space, ``=``, ``?``, ``_`` as ``=XX``,
    words of at most 76 columns)."""
    out = [header, "=?UTF-8?q?"]
    column = len(header) + len("UTF-8") + 5
    for char in subject:
        data = char.encode()
        special = len(data) > 1 or not char.isprintable() or char in " \t=?_"
        word = "".join(f"={byte:02X}" for byte in data) if special else char
        if column + len(word) + 2 > 76:
            out.append("?=\n =?UTF-8?q?")
            column = len("UTF-8") + 5 + 1
        out.append(word)
        column += len(word)
    out.append("?=")
    return "".join(out)


# A message line that ``git am`` (mailinfo's patchbreak) takes as the start of
# the patch: the rest of the message would be lost.
_PATCHBREAK = re.compile(r"^(diff -|Index: |---[ \t]*$|--- \S)", re.MULTILINE)


def format_patch(
    number: int,
    total: int,
    subject: str,
    message: str,
    changes: list[Change],
) -> str:
    """One patch in ``git format-patch`` form. ``git am --keep-non-patch``
    keeps a subject's ``[Tag]`` prefix; plain ``git am`` drops it, as it
    drops ``[PATCH n/m]``."""
    if "\n" in subject or not subject.strip():
        raise ValueError(f"a subject is one non-empty line: {subject!r}")
    body = message.strip("\n")
    body = body + "\n" if body else ""
    if (hit := _PATCHBREAK.search(body)) is not None:
        line = body[hit.start() : body.index("\n", hit.start())]
        raise ValueError(
            f"patch {number} ({subject}): git am would end the message at "
            f"the line {line!r}"
        )
    diff = diff_text(changes)
    sha = hashlib.sha1((subject + "\n" + body + diff).encode()).hexdigest()
    tag = f"[PATCH {number}/{total}] " if total > 1 else "[PATCH] "
    if subject.isascii():
        title = fold_subject("Subject: " + tag, subject)
    else:
        title = rfc2047_subject("Subject: " + tag, subject)
    mime = (
        ""
        if (subject + body).isascii()
        else "MIME-Version: 1.0\nContent-Type: text/plain; charset=UTF-8\n"
        "Content-Transfer-Encoding: 8bit\n"
    )
    return (
        f"From {sha} Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {DATE}\n"
        f"{title}\n{mime}\n"
        f"{body}---\n{diffstat(changes)}\n\n{diff}-- \n{SIGNATURE}\n\n"
    )
