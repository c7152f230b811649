"""The code that goes into vLLM's tree, generated from the plugin's modules.

* Modules: the plugin's own modules (the vLLM-free core, the budget modes,
  the layout choice, the host tier) become ``vllm/v1/kv_mem/``, text for text,
  with every ``vllm_kvmem`` name rewritten to ``vllm.v1.kv_mem``.
* Hooks: each patch record's change (its ``make_replacement``) becomes a
  decorator in ``vllm/v1/kv_mem/hooks.py``, put on the record's target in
  vLLM's file by a one-line edit: the same code the plugin wraps vLLM with,
  now in vLLM.
* Options: the fields of ``KVMemConfig`` become ``CacheConfig`` fields with
  their docstrings, ``EngineArgs`` fields and parser flags.
* Blocks: lines between ``# in-tree: <patch>`` and ``# in-tree: end`` belong
  to that patch of the series (a hook or module that several patches extend);
  ``# in-tree: plugin-only`` lines never go in-tree (how the plugin carries
  the options in ``additional_config``). The markers themselves never do.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import vllm_kvmem
from vllm_kvmem.patches._registry import Patch
from vllm_kvmem.upstream.anchors import Edit

PKG = "vllm.v1.kv_mem"
PKG_DIR = "vllm/v1/kv_mem"
HOOKS_ALIAS = "kv_mem_hooks"
SRC = Path(vllm_kvmem.__file__).resolve().parent
TESTS = SRC.parent / "tests"

_NAME = re.compile(r"\bvllm_kvmem\b")


_PROJECT = re.compile(r"\bvllm-kvmem\b")


def rewrite(text: str) -> str:
    """Plugin source as in-tree source: ``vllm_kvmem`` becomes the new package,
    and the project's name in prose and messages (``vllm-kvmem``) the
    package's (``kv_mem``): in vLLM's tree there is no other project."""
    return _PROJECT.sub("kv_mem", _NAME.sub(PKG, text))


PLUGIN_ONLY = "plugin-only"
_MARK = re.compile(r"^[ \t]*# in-tree: (?P<tag>[\w-]+)[ \t]*\n", re.M)


def blocks_for(
    text: str,
    included: typing.Collection[str],
    known: typing.Collection[str],
    where: str,
) -> str:
    """``text`` as it stands once the patches ``included`` are applied: the
    blocks of other patches (and plugin-only blocks) removed, every marker
    removed. A marker naming no patch in ``known``, a nested block or one left
    open is an error naming ``where``."""
    out: list[str] = []
    pos, open_tag = 0, None
    for m in _MARK.finditer(text):
        tag = m["tag"]
        line = text.count("\n", 0, m.start()) + 1
        if tag == "end":
            if open_tag is None:
                raise ValueError(f"{where}:{line}: '# in-tree: end' closes no block")
            if open_tag in included:
                out.append(text[pos : m.start()])
            pos, open_tag = m.end(), None
            continue
        if tag != PLUGIN_ONLY and tag not in known:
            raise ValueError(
                f"{where}:{line}: '# in-tree: {tag}' names no patch of the series "
                f"({', '.join(known)}) nor {PLUGIN_ONLY}"
            )
        if open_tag is not None:
            raise ValueError(f"{where}:{line}: block {tag!r} inside block {open_tag!r}")
        out.append(text[pos : m.start()])
        pos, open_tag = m.end(), tag
    if open_tag is not None:
        raise ValueError(f"{where}: block {open_tag!r} is never closed")
    out.append(text[pos:])
    return "".join(out)


# ------------------------------------------------------------------ modules


def module_file(name: str) -> Path:
    """``core.units`` -> ``vllm_kvmem/core/units.py`` (or a package's
    ``__init__.py``)."""
    base = SRC.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def tree_path(name: str) -> str:
    rel = module_file(name).relative_to(SRC).as_posix()
    return f"{PKG_DIR}/{rel}"


def _imports(name: str, top_level_only: bool) -> set[str]:
    """Plugin modules ``name`` imports (relative names, packages included)."""
    tree = ast.parse(module_file(name).read_text())
    nodes = (
        [n for stmt in tree.body for n in ast.walk(stmt) if _is_top(stmt)]
        if top_level_only
        else list(ast.walk(tree))
    )
    found: set[str] = set()
    for node in nodes:
        mods: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        for mod in mods:
            if mod.startswith("vllm_kvmem."):
                rel = mod.removeprefix("vllm_kvmem.")
                if _exists(rel):
                    found.add(rel)
    return found


def _is_top(stmt: ast.stmt) -> bool:
    """Statements run at import (not function or class bodies)."""
    return not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)


def _exists(rel: str) -> bool:
    base = SRC.joinpath(*rel.split("."))
    return base.is_dir() or base.with_suffix(".py").is_file()


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def closure(roots: typing.Iterable[str], top_level_only: bool = True) -> list[str]:
    """``roots`` and every plugin module they import (at import time), with
    their packages; a package brings all its modules (its ``__init__`` imports
    them or they are its parts)."""
    seen: set[str] = set()
    todo = [m for r in roots for m in _with_parents(r)]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        if module_file(mod).name == "__init__.py" and mod != "core":
            todo += [
                f"{mod}.{p.stem}"
                for p in sorted(module_file(mod).parent.glob("*.py"))
                if p.stem != "__init__"
            ]
        for dep in _imports(mod, top_level_only):
            todo += _with_parents(dep)
    return sorted(seen)


def module_text(
    name: str, included: typing.Collection[str], known: typing.Collection[str]
) -> str:
    """Module ``name`` in-tree, as the patches ``included`` leave it."""
    path = module_file(name)
    text = blocks_for(path.read_text(), included, known, str(path.relative_to(SRC)))
    return rewrite(text)


PACKAGE_INIT = '''"""KV cache memory: pipeline-wide and token KV budgets, the startup
capacity table, the contiguous KV layout for connectors, and a host-memory KV
tier.

Hooks into vLLM's own functions are in ``hooks``; each names the function it
decorates and why.
"""
'''


# -------------------------------------------------------------------- hooks


HOOKS_HEADER = '''"""Where vLLM calls into kv_mem: one decorator per changed function.

Each decorator receives vLLM's function and returns it extended; the function
it decorates and the reason are in its docstring. Everything is imported
when the hook runs, so importing this module costs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def _hook(make: Callable[[Callable[..., Any]], Callable[..., Any]], doc: str):
    def decorator(original: Callable[..., Any]) -> Callable[..., Any]:
        replacement = make(original)
        functools.update_wrapper(replacement, original)
        return replacement

    decorator.__doc__ = doc
    return decorator
'''


def _globals_used(func: types.FunctionType) -> dict[str, Any]:
    """Module-level names ``func`` (and functions nested in it) read."""
    names: set[str] = set()
    todo = [func.__code__]
    while todo:
        code = todo.pop()
        names |= set(code.co_names)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return {n: func.__globals__[n] for n in names if n in func.__globals__}


def hook_source(
    record: Patch, included: typing.Collection[str], known: typing.Collection[str]
) -> str:
    """The record's ``make_replacement`` as a hook in ``hooks.py``, as the
    patches ``included`` leave it."""
    func = record.make_replacement
    src = blocks_for(
        textwrap.dedent(inspect.getsource(func)), included, known, record.name
    )
    maker = f"_make_{record.name}"
    src = re.sub(rf"^def {func.__name__}\(", f"def {maker}(", src, count=1)
    consts = []
    for name, value in sorted(_globals_used(func).items()):
        if isinstance(value, types.ModuleType):
            continue
        if not isinstance(value, str | int | float | tuple):
            raise ValueError(
                f"patch {record.name}: its replacement reads {name!r} at module "
                f"level ({type(value).__name__}); only constants can move in-tree"
            )
        consts.append(f"{name} = {value!r}")
    doc = _string_lines(f"{record.target}: {record.why}", "    ")
    lines = [*consts, "" if consts else None, src.rstrip(), ""]
    lines.append(f"{record.name} = _hook(\n    {maker},\n{doc},\n)")
    return rewrite("\n".join(ln for ln in lines if ln is not None)) + "\n"


def _string_lines(text: str, indent: str, width: int = 88) -> str:
    """``text`` as a parenthesised run of string literals, each line within
    ``width`` (ruff cannot split one long literal)."""
    room = width - len(indent) - 4 - 2  # the inner indent, the quotes
    chunks = textwrap.wrap(text, room, drop_whitespace=False, break_on_hyphens=False)
    if any(len(repr(c)) > room + 2 for c in chunks):  # escapes: one per line
        raise ValueError(f"cannot fit {text[:40]!r}... at {width} columns")
    body = "\n".join(f"{indent}    {c!r}" for c in chunks)
    return f"{indent}(\n{body}\n{indent})"


def hook_target(record: Patch) -> tuple[str, str]:
    """``(file in the vLLM tree, scope)`` of a record's target."""
    module, attr = record.target.split(":", 1)
    return module.replace(".", "/") + ".py", attr


# ------------------------------------------------------------------ options


def _annotation(ann: Any) -> str:
    """vLLM-style annotation text for a ``KVMemConfig`` field's type."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _annotation(typing.get_args(ann)[0])
    if origin is typing.Literal:
        return "Literal[" + ", ".join(f'"{a}"' for a in typing.get_args(ann)) + "]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_annotation(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "None"
    return ann.__name__


def _docstring(text: str, indent: str) -> str:
    text = " ".join(text.split()).replace("``", "`")
    lines = textwrap.wrap(text, 80 - len(indent) - 3, break_on_hyphens=False)
    body = f"\n{indent}".join(lines)
    return f'{indent}"""{body}"""'


def option_fields() -> list[tuple[str, str, str, str, bool]]:
    """``(name, annotation, default, docstring, human-readable int)`` of each
    option, from ``KVMemConfig``."""
    from vllm_kvmem.config import KVMemConfig

    out = []
    for name, field in KVMemConfig.model_fields.items():
        ann = _annotation(field.annotation)
        sized = "int" in ann.split(" | ")
        default = (
            json.dumps(field.default)
            if isinstance(field.default, str)
            else repr(field.default)
        )
        out.append((name, ann, default, field.description or "", sized))
    return out


def _field_line(name: str, annotation: str) -> str:
    """An ``EngineArgs`` field defaulting to ``CacheConfig``'s, as ruff writes
    it (wrapped in parentheses past 88 columns, at the class's indent)."""
    line = f"{name}: {annotation} = CacheConfig.{name}"
    if len(line) + 4 <= 88:
        return line
    return f"{name}: {annotation} = (\n    CacheConfig.{name}\n)"


def option_edits() -> list[Edit]:
    """``CacheConfig`` fields (left out of its hash: no option changes the
    compiled graph), ``EngineArgs`` fields, parser flags, the ``CacheConfig``
    the engine builds, and human-readable sizes."""
    fields = option_fields()
    cache = "\n".join(
        f"{n}: {a} = {d}\n{_docstring(doc, '')}\n" for n, a, d, doc, _ in fields
    )
    args = "\n".join(_field_line(n, a) for n, a, _, _, _ in fields)
    flags = []
    for name, *_ in fields:
        flag = "--" + name.replace("_", "-")
        one = f'cache_group.add_argument("{flag}", **cache_kwargs["{name}"])'
        flags.append(
            one
            if len(one) <= 80
            else f'cache_group.add_argument(\n    "{flag}", **cache_kwargs["{name}"]\n)'
        )
    passed = "\n".join(f"{n}=self.{n}," for n, *_ in fields)
    sized = "\n".join(f'"{n}",' for n, *_, s in fields if s)
    return [
        Edit(
            "vllm/config/cache.py",
            r"^    def compute_hash\(self\) -> str:",
            cache + "\n",
            scope="CacheConfig",
            where="before",
        ),
        Edit(
            "vllm/config/cache.py",
            r'^\s+"kv_cache_memory_bytes",\n',
            "# KV memory options: budgets and the host tier, not the graph\n"
            + "\n".join(f'"{n}",' for n, *_ in fields),
            scope="CacheConfig.compute_hash",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            r"^    kv_cache_memory_bytes: int \| None = "
            r"CacheConfig\.kv_cache_memory_bytes\n",
            args,
            scope="EngineArgs",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            r"^\s+cache_group\.add_argument\(\n"
            r'\s+"--kv-cache-memory-bytes", '
            r'\*\*cache_kwargs\["kv_cache_memory_bytes"\]\n\s*\)\n',
            "\n".join(flags),
            scope="EngineArgs.add_cli_args",
            indent="",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            r"^\s+kv_cache_memory_bytes=self\.kv_cache_memory_bytes,\n",
            passed,
            scope="EngineArgs.create_engine_config",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            r'^\s+"kv_cache_memory_bytes",\n',
            sized,
            scope="_compute_kwargs",
        ),
    ]


# -------------------------------------------------------------------- tests

TESTS_DIR = "tests/v1/kv_mem"


def test_names(entry: str | tuple[str, str]) -> tuple[str, str]:
    """``(our file in tests/, its name in TESTS_DIR)``: one name for both, or a
    ``(source, target)`` pair for a file renamed in vLLM's layout."""
    return (entry, entry) if isinstance(entry, str) else entry


def test_text(name: str | tuple[str, str]) -> str:
    source, _target = test_names(name)
    text = (TESTS / source).read_text()
    text = re.sub(r"\btests\.(\w+)\b", r"tests.v1.kv_mem.\1", text)
    return rewrite(text)
