"""Read a vLLM source tree without importing it.

A vLLM release that is not installed (vLLM 0.33.0's CUDA wheel, as released)
can still be checked: its wheel holds the Python sources, and the parameters of every
function a patch wraps can be read from them. ``SourceTree`` answers, for a
``module:Class.attr`` target, whether it exists and which parameters it has,
from a directory (an installed ``site-packages``) or straight from a wheel.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: Decorators that generate ``__init__`` from the class's annotated fields
#: (vLLM's ``@config`` is a pydantic dataclass).
_DATACLASS_DECORATORS = {"dataclass", "config"}


@dataclass(frozen=True)
class SourceTree:
    """Python sources of one vLLM release: a folder holding ``vllm/``, or a
    wheel (``.whl``) read in place."""

    root: Path

    def read(self, relpath: str) -> bytes | None:
        """The bytes of ``relpath`` (``vllm/...``), or None if the tree lacks it."""
        if self.root.suffix == ".whl":
            with zipfile.ZipFile(self.root) as wheel:
                try:
                    return wheel.read(relpath)
                except KeyError:
                    return None
        path = self.root / relpath
        return path.read_bytes() if path.is_file() else None

    def has_folder(self, name: str) -> bool:
        """The tree has a top-level folder ``name`` (``.buildkite``: only a
        source checkout has it, an installed package or a wheel has not)."""
        if self.root.suffix == ".whl":
            with zipfile.ZipFile(self.root) as wheel:
                return any(n.startswith(f"{name}/") for n in wheel.namelist())
        return (self.root / name).is_dir()

    @cache  # noqa: B019 - a tree is read once per process; trees are few
    def _text(self, relpath: str) -> str | None:
        data = self.read(relpath)
        return None if data is None else data.decode()

    def module(self, name: str) -> ast.Module | None:
        """The parsed module ``name`` (dotted), or None if the tree lacks it."""
        base = name.replace(".", "/")
        for relpath in (f"{base}.py", f"{base}/__init__.py"):
            if (text := self._text(relpath)) is not None:
                return ast.parse(text)
        return None

    def version(self) -> str | None:
        """The release's version, as its ``vllm/_version.py`` states it."""
        tree = self.module("vllm._version")
        for node in ast.walk(tree) if tree else ():
            if (
                isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__version__" for t in node.targets)
                and isinstance(node.value, ast.Constant)
            ):
                return str(node.value.value)
        return None

    def parameters(self, target: str) -> tuple[str, ...]:
        """Parameter names of ``module:attr`` or ``module:Class.attr``.

        Raises ``LookupError`` naming what is missing. A dataclass's
        generated ``__init__`` is ``self`` and its fields, in order (inherited
        fields first, where the base class is in the same module)."""
        func, tree, owner = self._lookup(target)
        if func is not None:
            return _arg_names(func.args)
        if owner is not None and _is_dataclass(owner):
            return ("self", *_fields(tree, owner))
        raise LookupError(f"{target}: no function {target.rsplit('.', 1)[-1]}")

    def calls(self, target: str) -> dict[str, list[int]]:
        """What the function ``target`` calls: each callee as written
        (``builder.get_kv_cache_config_from_groups``), with the number of
        arguments of each call, in the order the source first makes them. A
        planning flow's shape, read from source."""
        func, _tree, _owner = self._lookup(target)
        if func is None:
            raise LookupError(f"{target}: no function")
        out: dict[str, list[int]] = {}
        nodes = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            name = ast.unparse(node.func)
            out.setdefault(name, []).append(len(node.args) + len(node.keywords))
        return out

    def _lookup(
        self, target: str
    ) -> tuple[ast.FunctionDef | None, ast.Module, ast.ClassDef | None]:
        """``(function or None, module, owning class or None)``; raises
        ``LookupError`` for a missing module or class, or a missing function
        that is not a dataclass's generated ``__init__``."""
        mod_name, attr = target.split(":", 1)
        tree = self.module(mod_name)
        if tree is None:
            raise LookupError(f"{target}: no module {mod_name}")
        *classes, name = attr.split(".")
        body, owner = tree.body, None
        for cls_name in classes:
            owner = _find(body, cls_name, ast.ClassDef)
            if owner is None:
                raise LookupError(f"{target}: no class {cls_name} in {mod_name}")
            body = owner.body
        func = _find(body, name, ast.FunctionDef)
        if func is not None:
            return func, tree, owner  # type: ignore[return-value]
        if name == "__init__" and owner is not None and _is_dataclass(owner):
            return None, tree, owner
        raise LookupError(f"{target}: no function {name}")


def _find(body: list[ast.stmt], name: str, kind: type) -> ast.AST | None:
    """The last definition of ``name`` in ``body`` (the one that wins)."""
    found = None
    for node in body:
        is_func = kind is ast.FunctionDef and isinstance(node, ast.AsyncFunctionDef)
        if (isinstance(node, kind) or is_func) and node.name == name:
            found = node
    return found


def _arg_names(args: ast.arguments) -> tuple[str, ...]:
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append(args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(args.kwarg.arg)
    return tuple(names)


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        node = dec.func if isinstance(dec, ast.Call) else dec
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name in _DATACLASS_DECORATORS:
            return True
    return False


def _fields(tree: ast.Module, cls: ast.ClassDef) -> list[str]:
    """Annotated fields of ``cls`` and of its bases defined in ``tree``."""
    out: list[str] = []
    for base in cls.bases:
        parent = _find(tree.body, getattr(base, "id", ""), ast.ClassDef)
        if parent is not None:
            out += [f for f in _fields(tree, parent) if f not in out]
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if "ClassVar" not in annotation and node.target.id not in out:
                out.append(node.target.id)
    return out
