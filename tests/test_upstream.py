"""The in-tree form (``kvmem upstream``): the series applies to vLLM 0.32 and
0.33, holds no ``vllm_kvmem``, fails by name when an anchor moves, and the
in-tree unit tests pass on the patched vLLM 0.32 (one patched copy of the
installed vLLM per session, ``tests/upstream_tree.py``). The engines on that
copy are in ``test_upstream_engines.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.upstream_tree import apply_series
from vllm_kvmem.upstream import AnchorError, generate, write_series
from vllm_kvmem.upstream import series as up
from vllm_kvmem.upstream.anchors import Edit, apply_edit


def test_series_032_applies_and_names_its_patches(series_032, patched_vllm):
    names = [p.name for p in series_032]
    assert names == [f"{i:04d}-{p.slug}.patch" for i, p in enumerate(up.PATCHES, 1)]
    first = series_032[0].read_text()
    assert first.startswith("From ") and "\nSubject: [PATCH 1/5] " in first
    assert (patched_vllm / "vllm/v1/kv_mem/hooks.py").is_file()
    hooked = (patched_vllm / "vllm/v1/core/kv_cache_utils.py").read_text()
    assert "@kv_mem_hooks.kv_cache_configs\ndef get_kv_cache_configs(" in hooked


def test_in_tree_code_never_imports_the_plugin(patched_vllm):
    for path in (patched_vllm / "vllm").rglob("*.py"):
        if path.is_symlink():
            continue
        assert "vllm_kvmem" not in path.read_text(), path
    for path in (patched_vllm / "tests").rglob("*.py"):
        assert "vllm_kvmem" not in path.read_text(), path


def test_every_patch_message_is_a_pr_description(series_032):
    for path in series_032:
        text = path.read_text()
        body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
        for section in ("## Design", "## Test plan"):
            assert section in body, (path.name, section)
    budgets = series_032[1].read_text()
    assert "## Measured results (CPU" in budgets
    assert "T // sum(bytes_per_block)" in budgets  # from docs/


def _extract(wheel: Path, dest: Path, paths: set[str]) -> None:
    with zipfile.ZipFile(wheel) as whl:
        for name in paths:
            try:
                data = whl.read(name)
            except KeyError:
                continue
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)


def test_series_033_generates_and_applies_to_the_wheel(wheel_033, tmp_path):
    """Generated from 0.33.0's wheel and applied to its sources (not run)."""
    version, files = write_series(tmp_path / "series", wheel_033.root)
    assert version == "0.33.0"
    touched = set()
    for f in files:
        for line in f.read_text().splitlines():
            if line.startswith("--- a/"):
                touched.add(line.removeprefix("--- a/"))
    tree = tmp_path / "tree"
    _extract(wheel_033.root, tree, touched)
    apply_series(tree, files)
    hooked = (tree / "vllm/platforms/interface.py").read_text()
    assert "@kv_mem_hooks.kv_cache_builder\n" in hooked
    assert (tree / "vllm/v1/kv_mem/kv_builder.py").is_file()


def test_a_moved_anchor_fails_naming_patch_file_and_anchor(tmp_path):
    """Copy the installed vLLM's sources the options patch edits, move one
    anchor, and generate: the error names all three; nothing is written."""
    src = up.vllm_root()
    tree = tmp_path / "src"
    for rel in ("vllm/_version.py", "vllm/config/cache.py", "vllm/engine/arg_utils.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, tree / rel)
    cache = tree / "vllm/config/cache.py"
    cache.write_text(
        cache.read_text().replace("def compute_hash(self)", "def hash_factors(self)")
    )
    with pytest.raises(AnchorError) as err:
        generate(tree)
    msg = str(err.value)
    assert "patch kv-mem-options" in msg
    assert "vllm/config/cache.py in CacheConfig" in msg
    assert "compute_hash" in msg and "0 matches" in msg


def test_an_anchor_matching_twice_is_refused():
    edit = Edit("f.py", r"^x = 1\n", "y = 2\n")
    with pytest.raises(AnchorError, match="2 matches"):
        apply_edit("x = 1\nx = 1\n", edit)


def test_in_tree_unit_tests_pass_on_the_patched_copy(no_plugin, patched_vllm):
    """The tests patch's modules on the patched copy, without the plugin: all
    of the split, host index and wait timer tests, and the CPU copy engine's
    single-block round trips (the full copy engine suite is ours already)."""
    env, shim = no_plugin
    folder = patched_vllm / "tests/v1/kv_mem"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *(str(folder / f"test_{n}.py") for n in ("pp_split", "host_index")),
            str(folder / "test_wait_timer.py"),
            str(folder / "test_copy_engine.py"),
            *("-k", "not test_copy_engine or single_block"),
        ],
        cwd=patched_vllm,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " error" not in done.stdout
