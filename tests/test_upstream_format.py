"""The series' form, checked against git and ruff themselves: ``gitfmt``
writes what ``git format-patch`` writes (blob ids, diffstat, folded
subjects) and ``git am`` applies it, the real series included; ``style``
formats the files the series adds as vLLM's ruff settings do, and places an
import in vLLM's files where vLLM's import sorting wants it.
"""

from __future__ import annotations

import difflib
import email
import email.policy
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.upstream_tree import copy_vllm
from vllm_kvmem.upstream import gitfmt, style
from vllm_kvmem.upstream import series as up

NAME, EMAIL = "vllm-kvmem", "vllm-kvmem@users.noreply.github.com"
GIT_DATE = "Thu, 1 Jan 2026 00:00:00 +0000"


@pytest.fixture(scope="module")
def git_env(tmp_path_factory) -> dict[str, str]:
    """git with no system or global configuration, author and committer set."""
    home = tmp_path_factory.mktemp("home")
    return {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": NAME,
        "GIT_AUTHOR_EMAIL": EMAIL,
        "GIT_AUTHOR_DATE": GIT_DATE,
        "GIT_COMMITTER_NAME": NAME,
        "GIT_COMMITTER_EMAIL": EMAIL,
        "GIT_COMMITTER_DATE": GIT_DATE,
    }


def git(env: dict[str, str], cwd: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["git", "-c", f"user.name={NAME}", "-c", f"user.email={EMAIL}", *args],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return done.stdout


def write_tree(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(text.encode())


def repo(env: dict[str, str], root: Path, files: dict[str, str]) -> Path:
    """A git repository holding ``files`` in one commit."""
    root.mkdir(parents=True, exist_ok=True)
    git(env, root, "init", "-q")
    write_tree(root, files)
    git(env, root, "add", "-A")
    git(env, root, "commit", "-q", "--allow-empty", "-m", "base")
    return root


# ----------------------------------------------------------------- gitfmt

CODE = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(40))
BEFORE = {
    "vllm/core.py": CODE,
    "vllm/no_newline.py": "a = 1\nb = 2",
    "vllm/config/cache.py": "class CacheConfig:\n    block_size: int = 16\n",
}
AFTER = {
    # an edit in two places (two hunks, each with git's function line)
    "vllm/core.py": CODE.replace(
        "    return x + 3\n", "    return x + 3  # three\n"
    ).replace("def f30(x):\n", "def g(x):\n    return -x\n\n\ndef f30(x):\n"),
    "vllm/no_newline.py": "a = 1\nb = 3",  # no newline at the end, before or after
    "vllm/config/cache.py": "class CacheConfig:\n    block_size: int = 16\n"
    "    kv_cache_tokens: int | None = None\n",
    "vllm/v1/kv_mem/__init__.py": "",  # an empty new file
    "vllm/v1/kv_mem/deeply/nested/package/for/the/stat/to/cut/module.py": (
        "".join(f"X{i} = {i}\n" for i in range(120))
    ),
}
SUBJECT = "[Core] Add KV memory options to CacheConfig and the engine arguments"
MESSAGE = "Adds the options.\n\n## Purpose\n\nWhy, at length.\n"


def changes(before: dict[str, str], after: dict[str, str]) -> list[gitfmt.Change]:
    return [(path, before.get(path), text) for path, text in after.items()]


def test_blob_ids_are_git_hash_object(git_env, tmp_path):
    write_tree(tmp_path, AFTER)
    for path, text in AFTER.items():
        out = git(git_env, tmp_path, "hash-object", path).strip()
        assert gitfmt.blob_id(text) == out, path
    assert gitfmt.blob_id("") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


def test_diff_text_is_git_diff(git_env, tmp_path):
    root = repo(git_env, tmp_path / "r", BEFORE)
    write_tree(root, AFTER)
    git(git_env, root, "add", "-A")
    real = git(git_env, root, "diff", "--cached", "--full-index", "--no-color")
    ours = gitfmt.diff_text(changes(BEFORE, AFTER))
    assert ours == real
    empty = "vllm/v1/kv_mem/__init__.py"
    assert (
        f"diff --git a/{empty} b/{empty}\nnew file mode 100644\n"
        f"index {'0' * 40}..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n"
        "diff --git " in ours
    )


def format_patches(env: dict[str, str], root: Path, count: int) -> list[str]:
    """``git format-patch`` of the last ``count`` commits, one text each,
    without the first line (the commit's id)."""
    out = root / "out"
    signature = f"--signature={gitfmt.SIGNATURE}"
    git(
        env,
        root,
        "format-patch",
        "-q",
        "--full-index",
        signature,
        f"-{count}",
        "-o",
        str(out),
    )
    return [p.read_text().split("\n", 1)[1] for p in sorted(out.glob("*.patch"))]


def test_format_patch_is_git_format_patch(git_env, tmp_path):
    """Headers, folded subject, diffstat with git's scaling and cut names,
    ``create mode`` lines, diff and signature: all as git writes them, for a
    numbered pair and for a single patch."""
    root = repo(git_env, tmp_path / "r", BEFORE)
    second = {"vllm/no_newline.py": "a = 1\nb = 4\n"}
    second_subject = "Fix b, naïvely"
    second_message = "Non-ASCII in the message — and in the subject.\n"
    for files, subject, message in (
        (AFTER, SUBJECT, MESSAGE),
        (second, second_subject, second_message),
    ):
        write_tree(root, files)
        git(git_env, root, "add", "-A")
        commit = ["commit", "-q", "--cleanup=verbatim", "-F", "-"]
        git(git_env, root, *commit, stdin=f"{subject}\n\n{message}")
    real = format_patches(git_env, root, 2)
    after_first = {**BEFORE, **AFTER}
    ours = [
        gitfmt.format_patch(1, 2, SUBJECT, MESSAGE, changes(BEFORE, AFTER)),
        gitfmt.format_patch(
            2, 2, second_subject, second_message, changes(after_first, second)
        ),
    ]
    for mine, theirs in zip(ours, real):
        assert mine.split("\n", 1)[1] == theirs
    assert "\n create mode 100644 vllm/v1/kv_mem/__init__.py\n" in ours[0]
    assert (
        "\n .../package/for/the/stat/to/cut/module.py     | 120 +++" in ours[0]
    )  # a cut name
    (root / "out").rename(root / "pair")
    single = format_patches(git_env, root, 1)[0]
    path = "vllm/no_newline.py"
    change = [(path, after_first[path], second[path])]
    mine = gitfmt.format_patch(1, 1, second_subject, second_message, change)
    assert mine.split("\n", 1)[1] == single


def test_git_am_reproduces_the_tree(git_env, tmp_path):
    """``git apply --check`` and ``git am`` take the patch; the tree is the
    after-tree byte for byte, the commit has the author, date and subject
    (``[Core]`` kept by ``--keep-non-patch``)."""
    root = repo(git_env, tmp_path / "r", BEFORE)
    patch = tmp_path / "0001.patch"
    patch.write_text(
        gitfmt.format_patch(1, 1, SUBJECT, MESSAGE, changes(BEFORE, AFTER))
    )
    git(git_env, root, "apply", "--check", str(patch))
    git(git_env, root, "am", "--keep-non-patch", str(patch))
    for path, text in {**BEFORE, **AFTER}.items():
        assert (root / path).read_bytes() == text.encode(), path
    assert git(git_env, root, "status", "--porcelain") == ""
    log = git(git_env, root, "log", "-1", "--format=%an <%ae>%n%aD%n%s%n%b")
    assert log == f"{gitfmt.AUTHOR}\n{gitfmt.DATE}\n{SUBJECT}\n{MESSAGE}\n"


def test_git_am_3way_uses_the_index_lines(git_env, tmp_path):
    """The context moved under the patch: plain apply fails, ``git am
    --3way`` finds the preimage by its blob id and merges."""
    before = {"vllm/core.py": CODE}
    after = {"vllm/core.py": CODE.replace("    return x + 5\n", "    return x + 55\n")}
    patch = tmp_path / "0001.patch"
    patch.write_text(gitfmt.format_patch(1, 1, "Five", "", changes(before, after)))
    root = repo(git_env, tmp_path / "r", before)
    # a context line of the hunk changes, two lines away from the patch's edit
    moved = CODE.replace("    return x + 4\n\n", "    return x + 4\n# moved\n")
    write_tree(root, {"vllm/core.py": moved})
    git(git_env, root, "commit", "-q", "-am", "moved")
    check = subprocess.run(
        ["git", "apply", "--check", str(patch)],
        cwd=root,
        env=git_env,
        capture_output=True,
        timeout=60,
    )
    assert check.returncode != 0  # the context is gone
    git(git_env, root, "am", "--3way", str(patch))
    text = (root / "vllm/core.py").read_text()
    assert "\n# moved\n" in text and "    return x + 55\n" in text


def test_a_message_line_git_am_would_cut_at_is_refused():
    with pytest.raises(ValueError, match="git am would end the message"):
        gitfmt.format_patch(1, 1, "S", "Intro\n---\nmore\n", changes(BEFORE, AFTER))


def subject_of(patch: Path) -> str:
    """The patch's subject as ``git am --keep-non-patch`` reads it."""
    header = patch.read_text().split("\n\n", 1)[0].split("\n", 1)[1]
    value = email.message_from_string(header + "\n\n", policy=email.policy.default)
    return re.sub(r"^\[PATCH( \d+/\d+)?\] ", "", str(value["Subject"]))


def test_the_series_goes_in_with_git_am(git_env, tmp_path, series_032, patched_vllm):
    """The real series, ``git am`` patch by patch on a git repository of the
    installed vLLM: each commit's subject is its patch's, the tree equals
    the ``git apply``'d copy, and each patch's diffstat is git's own for
    the commit it made."""
    root = copy_vllm(tmp_path / "vllm032")
    git(git_env, root, "init", "-q")
    git(git_env, root, "add", "*.py")
    git(git_env, root, "commit", "-q", "-m", "vLLM")
    touched = set()
    for patch in series_032:
        git(git_env, root, "am", "--keep-non-patch", "--whitespace=nowarn", str(patch))
        subject = git(git_env, root, "log", "-1", "--format=%s").strip()
        assert subject == subject_of(patch), patch.name
        touched |= set(re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.M))
    for path in sorted(touched):
        assert (root / path).read_bytes() == (patched_vllm / path).read_bytes(), path
    real = format_patches(git_env, root, len(series_032))
    for patch, theirs in zip(series_032, real):
        ours = patch.read_text()
        stat = ours.split("\n---\n", 1)[1].split("\n\n", 1)[0]
        assert stat == theirs.split("\n---\n", 1)[1].split("\n\n", 1)[0], patch.name


# ------------------------------------------------------------------ style

RUFF_LINT = ("--select", "E,F,I,UP", "--ignore", ",".join(style.LINT_IGNORE))


def ruff(*args: str, path: str, text: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*style.ruff_args(*args), "--stdin-filename", path, "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )


def import_problems(path: str, text: str) -> list[str]:
    """ruff's ``I`` findings for ``text`` (vLLM's settings), locations dropped."""
    args = ("check", "--select", "I", "--output-format", "concise", "--exit-zero")
    done = ruff(*args, path=path, text=text)
    return sorted(re.findall(r"I\d{3}.*", done.stdout))


def formatted(path: str, text: str) -> bool:
    return ruff("format", "--check", path=path, text=text).returncode == 0


MESSY = '''"""A module."""
from vllm.v1.kv_mem.core import units
import torch
from vllm.config import CacheConfig
import os


def f(first_argument, second_argument, third_argument, fourth_argument, fifth):
    return {'a':first_argument,'b':second_argument}
'''
TIDY = '''"""A module."""

import os

import torch

from vllm.config import CacheConfig
from vllm.v1.kv_mem.core import units


def f(first_argument, second_argument, third_argument, fourth_argument, fifth):
    return {"a": first_argument, "b": second_argument}
'''


def test_format_python_sorts_imports_and_formats():
    assert style.format_python("vllm/v1/kv_mem/m.py", MESSY) == TIDY
    long = "x = [" + ", ".join(f"item_{i}" for i in range(20)) + "]\n"
    out = style.format_python("vllm/v1/kv_mem/m.py", long)
    assert (
        out.startswith("x = [\n    item_0,\n") and max(map(len, out.split("\n"))) <= 88
    )
    assert style.format_python("vllm/v1/kv_mem/notes.md", MESSY) == MESSY


def test_format_python_is_deterministic_and_idempotent():
    text = Path(up.__file__).read_text().replace("vllm_kvmem", "vllm.v1.kv_mem")
    path = "vllm/v1/kv_mem/upstream/series.py"
    once = style.format_python(path, text)
    assert style.format_python(path, text) == once
    assert style.format_python(path, once) == once
    assert formatted(path, once) and import_problems(path, once) == []


def test_missing_ruff_says_how_to_install_it(monkeypatch):
    real = style.importlib.util.find_spec
    monkeypatch.setattr(
        style.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ruff" else real(name, *a),
    )
    style.ruff_command.cache_clear()
    try:
        with pytest.raises(style.RuffMissing) as err:
            style.format_python("vllm/v1/kv_mem/m.py", MESSY)
    finally:
        style.ruff_command.cache_clear()
    assert str(err.value) == (
        "kvmem upstream formats the files it adds with ruff, which is not "
        "installed: pip install 'vllm-kvmem[upstream]'"
    )


HOOKS = "from vllm.v1.kv_mem import hooks as kv_mem_hooks\n"


def added_lines(before: str, after: str) -> list[str]:
    diff = difflib.ndiff(before.split("\n"), after.split("\n"))
    return [line for line in diff if line[:1] in "+-"]


@pytest.mark.parametrize(
    "path",
    [
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/engine/arg_utils.py",
        "vllm/v1/worker/gpu_worker.py",
        "vllm/config/cache.py",
        "vllm/v1/core/block_pool.py",
    ],
)
def test_place_import_in_vllm_files(path):
    """One line added, where vLLM's import sorting has nothing to say."""
    text = (up.vllm_root() / path).read_text()
    out = style.place_import(text, HOOKS)
    assert added_lines(text, out) == ["+ " + HOOKS.rstrip("\n")]
    assert import_problems(path, out) == import_problems(path, text)
    assert style.place_import(out, HOOKS) == out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # __future__, a TYPE_CHECKING block (ignored) and a block cut by code:
        # the import joins the first block's vllm imports, sorted (a late
        # block after code would bind the name after the defs that use it)
        (
            "from __future__ import annotations\n\nimport os\n"
            "from typing import TYPE_CHECKING\n\nfrom vllm.config import A\n"
            "from vllm.v1.worker import W\n\nif TYPE_CHECKING:\n"
            "    from vllm.zzz import Z\n\nlogger = 1\n\n"
            "from vllm.logger import init_logger  # noqa: E402\n"
            "from vllm.v1.request import R  # noqa: E402\n",
            "from __future__ import annotations\n\nimport os\n"
            "from typing import TYPE_CHECKING\n\nfrom vllm.config import A\n"
            "from vllm.v1.kv_mem import hooks as kv_mem_hooks\n"
            "from vllm.v1.worker import W\n\nif TYPE_CHECKING:\n"
            "    from vllm.zzz import Z\n\nlogger = 1\n\n"
            "from vllm.logger import init_logger  # noqa: E402\n"
            "from vllm.v1.request import R  # noqa: E402\n",
        ),
        # straight imports come first; a comment stays with its import
        (
            "import torch\n\nimport vllm.envs as envs\n\n# the config\n"
            "from vllm.wx import B\n",
            "import torch\n\nimport vllm.envs as envs\n"
            "from vllm.v1.kv_mem import hooks as kv_mem_hooks\n\n# the config\n"
            "from vllm.wx import B\n",
        ),
        # first of its section, above a commented import: a blank line between
        (
            "import os\n\n# the config\nfrom vllm.wx import B\n",
            "import os\n\nfrom vllm.v1.kv_mem import hooks as kv_mem_hooks\n\n"
            "# the config\nfrom vllm.wx import B\n",
        ),
        # below a file's header comments
        (
            "# SPDX-License-Identifier: Apache-2.0\nfrom vllm.wx import (\n    B,\n)\n",
            "# SPDX-License-Identifier: Apache-2.0\n"
            "from vllm.v1.kv_mem import hooks as kv_mem_hooks\nfrom vllm.wx import (\n"
            "    B,\n)\n",
        ),
        # last of the section, before relative imports
        (
            "import os\n\nfrom vllm.config import A\n\nfrom .x import y\n",
            "import os\n\nfrom vllm.config import A\n"
            "from vllm.v1.kv_mem import hooks as kv_mem_hooks\n\nfrom .x import y\n",
        ),
        # no first-party import yet: a section of its own
        (
            '"""Doc."""\n\nimport os\n\nX = 1\n',
            '"""Doc."""\n\nimport os\n\nfrom vllm.v1.kv_mem import hooks as '
            "kv_mem_hooks\n\nX = 1\n",
        ),
    ],
)
def test_place_import_cases(text, expected):
    out = style.place_import(text, HOOKS)
    assert out == expected
    assert import_problems("vllm/m.py", text) == []
    assert import_problems("vllm/m.py", out) == []


def series_files(patches: list[Path]) -> tuple[set[str], set[str]]:
    """(files the series adds, vLLM files it edits)."""
    added, edited = set(), set()
    for patch in patches:
        text = patch.read_text()
        added |= set(re.findall(r"^diff --git a/(\S+) .*\nnew file mode", text, re.M))
        edited |= set(re.findall(r"^--- a/(\S+)$", text, re.M))
    return added, edited - added  # a later patch may edit a file an earlier adds


def test_the_series_is_in_vllm_style(series_032, patched_vllm):
    """Every Python file the series adds is formatted and lint-clean (E, F, I,
    UP) under vLLM's settings; every vLLM file it edits stays formatted if
    it was and gains no import-sorting finding."""
    added, edited = series_files(series_032)
    assert added and edited
    failures = []
    for path in sorted(p for p in added if p.endswith(".py")):
        text = (patched_vllm / path).read_text()
        if not formatted(path, text):
            failures.append(f"{path}: not formatted")
        lint = ruff(
            "check", *RUFF_LINT, "--output-format=concise", path=path, text=text
        )
        if lint.returncode != 0:
            failures.append(f"{path}: {lint.stdout.strip()}")
    root = up.vllm_root()
    for path in sorted(edited):
        original, text = (root / path).read_text(), (patched_vllm / path).read_text()
        if formatted(path, original) and not formatted(path, text):
            failures.append(f"{path}: no longer formatted")
        if len(import_problems(path, text)) > len(import_problems(path, original)):
            failures.append(f"{path}: imports no longer sorted")
    assert not failures, "\n".join(failures)
