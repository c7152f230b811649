"""vLLM's code style for the series: the files it adds are formatted as
vLLM's own tooling would leave them, and its one-line imports into vLLM's
files go where vLLM's import sorting wants them.

vLLM's settings, as adopted here (vLLM's ``pyproject.toml`` since the
``yapf`` -> ``ruff format`` migration, vllm-project/vllm#17657, finished for
``vllm/`` and ``tests/`` around v0.11; the per-directory ``pyproject.toml``
files of that migration said the same):

- ``[tool.ruff] line-length = 88``; the target is ``py311``, what vLLM 0.32's
  ``requires-python`` (``>=3.11``) makes ruff infer;
- ``[tool.ruff.lint] select = E, F, UP, B, ISC, SIM, I, G`` and ``ignore =
  F405, F403, E731, B905, B007, UP032``;
- ``[tool.ruff.format] docstring-code-format = true``;
- no ``[tool.ruff.lint.isort]`` section: ruff's defaults, with ``vllm`` and
  ``tests`` first-party because they are folders at vLLM's root (ruff's
  ``src = ["."]``). Here they are named (``known-first-party``) and ``src``
  is empty, so that nothing depends on the folder ruff runs in (run from
  site-packages, ruff's default would make torch first-party too).

Checked against the installed vLLM 0.32 with ruff 0.17.6: its ``vllm/``
sorts clean under these settings (outside ``vllm/third_party``, which vLLM
exempts) and 2615 of its 2628 files are formatted as they are; of the other
13, ten differ where ruff 0.17 formats lambdas unlike the ruff vLLM pins,
and three are the generated ``_version.py`` and two vendored kernels.

ruff runs isolated (``--isolated``: no configuration file, not even the
user's, is read) on stdin, so the result depends on the text, these
settings and ruff's version only (pinned in the ``upstream`` extra).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import subprocess
import sys

from vllm_kvmem.upstream import gitfmt

LINE_LENGTH = 88
FIRST_PARTY = ("vllm", "tests")
SETTINGS = (
    f"line-length = {LINE_LENGTH}",
    'target-version = "py311"',
    "src = []",
    f"lint.isort.known-first-party = {list(FIRST_PARTY)!r}".replace("'", '"'),
    "format.docstring-code-format = true",
)
"""vLLM's ruff settings, as ``--config`` overrides."""
LINT_SELECT = ("E", "F", "UP", "B", "ISC", "SIM", "I", "G")
LINT_IGNORE = ("F405", "F403", "E731", "B905", "B007", "UP032")
MISSING = (
    "kvmem upstream formats the files it adds with ruff, which is not "
    "installed: pip install 'vllm-kvmem[upstream]'"
)


class RuffMissing(RuntimeError):
    """ruff, which the series needs, is not installed."""


@functools.cache
def ruff_command() -> tuple[str, ...]:
    """How to run the ruff installed with this Python (its own binary)."""
    if importlib.util.find_spec("ruff") is None:
        raise RuffMissing(MISSING)
    try:
        from ruff import find_ruff_bin

        return (str(find_ruff_bin()),)
    except (ImportError, FileNotFoundError):
        return (sys.executable, "-m", "ruff")


def ruff_args(*args: str) -> list[str]:
    """A ruff command line with vLLM's settings and no configuration file."""
    out = [*ruff_command(), *args, "--isolated", "--no-cache"]
    for setting in SETTINGS:
        out += ["--config", setting]
    return out


def _ruff(args: list[str], path: str, text: str) -> str:
    done = subprocess.run(
        [*args, "--stdin-filename", path, "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        verb = args[len(ruff_command())]
        raise RuntimeError(f"ruff {verb} on {path} failed: {done.stderr}")
    return done.stdout


def format_python(path: str, text: str) -> str:
    """``text`` of the new file ``path`` as vLLM's tooling leaves it: imports
    sorted (ruff's ``I`` rules), then ``ruff format``. Other files are
    returned as they are."""
    if not path.endswith((".py", ".pyi")):
        return text
    check = ruff_args("check", "--select", "I", "--fix", "--exit-zero", "--quiet")
    text = _ruff(check, path, text)
    return _ruff(ruff_args("format"), path, text)


# ---------------------------------------------------------- place_import


def _natural(text: str) -> tuple[tuple[int, int], ...]:
    """Sort key of ruff's natural order (``natord``): runs of digits compare
    as numbers, every other character by its code point."""
    return tuple(
        (48, int(run)) if run[0].isdigit() else (ord(run), 0)
        for run in re.findall(r"[0-9]+|[^0-9]", text)
    )


def _name_key(name: str) -> tuple:
    return (_natural(name.lower()), _natural(name))


def _member_key(alias: ast.alias) -> tuple:
    """ruff's ``MemberKey`` with its defaults (``order-by-type``: constants,
    classes, then variables)."""
    name = alias.name
    if len(name) > 1 and name.isupper():
        kind = 0
    elif name[:1].isupper():
        kind = 1
    else:
        kind = 2
    return (name != "*", kind, *_name_key(name), _natural(alias.asname or ""))


def _import_key(node: ast.Import | ast.ImportFrom) -> tuple:
    """ruff's ``ModuleKey`` of one statement within its section: straight
    imports (``import x``) first, then ``from`` imports, each by module."""
    if isinstance(node, ast.Import):
        alias = node.names[0]
        return (0, 0, *_name_key(alias.name), (), _natural(alias.asname or ""))
    first = min(_member_key(alias) for alias in node.names)
    return (1, node.level, *_name_key(node.module or ""), first, ())


def _first_party(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return False
    return all(name.split(".")[0] in FIRST_PARTY for name in names)


def _import_blocks(tree: ast.Module) -> list[list[ast.Import | ast.ImportFrom]]:
    """Runs of top-level import statements with no other statement between
    (what isort sorts as one block; imports under ``if TYPE_CHECKING:`` or in
    functions are not top-level)."""
    blocks: list[list[ast.Import | ast.ImportFrom]] = [[]]
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            blocks[-1].append(node)
        elif blocks[-1]:
            blocks.append([])
    return [block for block in blocks if block]


def place_import(text: str, line: str) -> str:
    """``text`` (an existing vLLM module) with the import statement ``line``
    added where isort puts it among the module's top-level first-party
    imports, no other line changed: in the first run of top-level imports
    that holds ``vllm`` imports (the module's opening imports: the name must
    be bound before any ``def`` below uses it; a late import after the
    classes, such as ``vllm/v1/executor/abstract.py``'s, would come too late),
    at its sorted place there. Unchanged when
    the module already has the line.

    A blank line comes with it only where ruff's sorting needs one: before
    a comment that heads the next import when ours opens the section, and
    when the module has no first-party import yet (ours then gets a section
    of its own, at the end of its first import block, before relative
    imports)."""
    line = line.rstrip("\n") + "\n"
    statement = ast.parse(line).body
    if len(statement) != 1 or not _first_party(statement[0]):
        raise ValueError(f"not one first-party import statement: {line!r}")
    if len(line) - 1 > LINE_LENGTH:
        raise ValueError(f"longer than {LINE_LENGTH} columns: {line!r}")
    lines = gitfmt.split_lines(text)
    if line in lines or line.rstrip("\n") in lines:
        return text
    key = _import_key(statement[0])
    blocks = _import_blocks(ast.parse(text))
    if not blocks:
        raise ValueError("the module has no top-level import to join")
    ours = [b for b in blocks if any(_first_party(n) for n in b)]
    if ours:
        block = ours[0]
        section = [n for n in block if _first_party(n)]
        later = [n for n in section if _import_key(n) > key]
        if later:
            at, new = _before(lines, block, later[0], line)
        else:
            at, new = section[-1].end_lineno or section[-1].lineno, line
    else:
        block = next((b for b in blocks if not _future_only(b)), blocks[0])
        relative = [n for n in block if isinstance(n, ast.ImportFrom) and n.level]
        if relative:
            at, new = _before(lines, block, relative[0], line + "\n")
        else:
            at, new = block[-1].end_lineno or block[-1].lineno, "\n" + line
    return "".join([*lines[:at], new, *lines[at:]])


def _future_only(block: list[ast.Import | ast.ImportFrom]) -> bool:
    return all(getattr(node, "module", None) == "__future__" for node in block)


def _before(
    lines: list[str], block: list[ast.Import | ast.ImportFrom], node: ast.stmt, new: str
) -> tuple[int, str]:
    """Where ``new`` goes to come right before ``node`` (index into
    ``lines``, text). Comment lines right above an import belong to it, and
    ruff wants a blank line above them unless they open the section: so
    ``new`` goes after the import before ``node`` when that one is in the
    same section, above the comments with a blank line when ``node`` opens
    the section, and below them when they head the block (a file header)."""
    at = node.lineno - 1
    top = at
    while top > 0 and lines[top - 1].lstrip().startswith("#"):
        top -= 1
    position = block.index(node)
    if top == at or position == 0:
        return at, new
    previous = block[position - 1]
    if _first_party(previous) and _first_party(node):
        return previous.end_lineno or previous.lineno, new
    return top, new if new.endswith("\n\n") else new + "\n"
