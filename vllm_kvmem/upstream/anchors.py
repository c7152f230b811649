"""Anchored edits of vLLM's own files: exact, or an error naming the place.

The repository holds no copy of vLLM's code. An edit names the file, a scope
in it (a class or function, found through the parsed module, so a scope is
never guessed) and an anchor: a short regular expression that must match
exactly once inside that scope. The new lines go before or after the match.
When vLLM moves, an anchor stops matching and the generator fails with the
patch, the file and the anchor named; it never applies fuzzily.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Literal


class AnchorError(LookupError):
    """An anchor that does not locate exactly one place in vLLM's file."""


@dataclass(frozen=True)
class Edit:
    """New lines at one anchored place of one vLLM file."""

    file: str
    """Path in the vLLM tree (``vllm/config/cache.py``)."""
    anchor: str
    """Regular expression (multi-line mode); must match exactly once in scope.
    The empty string means the end of the scope."""
    code: str
    """The lines to insert, dedented; indented like the anchor's first line
    (plus ``indent``)."""
    scope: str = ""
    """``Class``, ``func`` or ``Class.method`` whose source holds the anchor;
    empty for the whole file."""
    where: Literal["before", "after"] = "after"
    indent: str = ""

    def describe(self) -> str:
        scope = f" in {self.scope}" if self.scope else ""
        return f"{self.file}{scope}: anchor {self.anchor!r}"


def scope_span(text: str, scope: str, file: str) -> tuple[int, int]:
    """Character offsets ``(start, end)`` of ``scope`` in ``text``: from its
    first decorator's line to the end of its last line."""
    if not scope:
        return 0, len(text)
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for name in scope.split("."):
        found = [
            n
            for n in body
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == name
        ]
        if len(found) != 1:
            raise AnchorError(f"{file}: {len(found)} definitions of {scope!r}")
        node = found[0]
        body = node.body  # type: ignore[attr-defined]
    assert node is not None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # type: ignore[attr-defined]
    starts = _line_starts(text)
    return starts[first - 1], starts[node.end_lineno]  # type: ignore[attr-defined]


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for m in re.finditer("\n", text):
        starts.append(m.end())
    if starts[-1] != len(text):
        starts.append(len(text))
    return starts


def apply_edit(text: str, edit: Edit) -> str:
    """``text`` with ``edit`` applied; raises :class:`AnchorError`."""
    start, end = scope_span(text, edit.scope, edit.file)
    if not edit.anchor:
        pos, indent = end, ""
    else:
        matches = list(re.finditer(edit.anchor, text[start:end], re.MULTILINE))
        if len(matches) != 1:
            raise AnchorError(f"{len(matches)} matches (need exactly 1)")
        m = matches[0]
        line_start = text.rfind("\n", 0, start + m.start()) + 1
        indent = re.match(r"[ \t]*", text[line_start:]).group(0)  # type: ignore[union-attr]
        if edit.where == "before":
            pos = line_start
        else:
            pos = start + m.end()
            if text[pos - 1 : pos] != "\n":
                pos = text.find("\n", pos) + 1
    block = textwrap.indent(
        edit.code, indent + edit.indent, lambda ln: bool(ln.strip())
    )
    if not block.endswith("\n"):
        block += "\n"
    return text[:pos] + block + text[pos:]


def function_def_line(text: str, scope: str, file: str) -> tuple[int, str]:
    """Offset of the ``def`` line of ``scope`` (after its decorators) and its
    indentation: where a hook's decorator goes."""
    start, _ = scope_span(text, scope, file)
    body: list[ast.stmt] = ast.parse(text).body
    node: ast.AST | None = None
    for name in scope.split("."):
        node = next(
            n for n in body if getattr(n, "name", None) == name and hasattr(n, "body")
        )
        body = node.body  # type: ignore[attr-defined]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise AnchorError(f"{file}: {scope} is not a function")
    pos = _line_starts(text)[node.lineno - 1]
    indent = re.match(r"[ \t]*", text[pos:]).group(0)  # type: ignore[union-attr]
    return pos, indent
