"""The in-tree form (``kvmem upstream``): the series applies to vLLM 0.32 and
0.33, holds no ``vllm_kvmem``, fails by name when an anchor moves, and the
in-tree unit tests pass on the patched vLLM 0.32 (one patched copy of the
installed vLLM per session, ``tests/upstream_tree.py``). The engines on that
copy are in ``test_upstream_engines.py``.
"""

from __future__ import annotations

import json
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


# ------------------------------------------------- each patch on its own

_PREFIX_CHECK = r"""
import importlib, json, pkgutil, sys

model = sys.argv[1]
import vllm.v1.kv_mem as pkg

found = pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
modules = sorted(m.name for m in found)
for name in modules:
    importlib.import_module(name)
from vllm.engine.arg_utils import EngineArgs


def outcome(**kw):
    try:
        config = EngineArgs(model=model, **kw).create_engine_config()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    transfer = config.kv_transfer_config
    return {
        "connector": transfer.kv_connector if transfer else None,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
    }


cases = {
    "bad_value": dict(kv_cache_tokens=0),
    "pp_without_budget": dict(enable_pp_prop_kv_cache=True),
    "tokens_and_bytes": dict(kv_cache_tokens=4096, kv_cache_memory_bytes=64 << 20),
    "tokens": dict(kv_cache_tokens=4096),
    "host_tier": dict(kv_host_cache_bytes=64 << 20),
}
out = {"modules": modules, "cases": {n: outcome(**kw) for n, kw in cases.items()}}
print("REPORT " + json.dumps(out))
"""


def test_each_patch_runs_on_its_own(tmp_path, series_032, model_8l):
    """Apply the series one patch at a time to one copy of vLLM; after each,
    with no plugin: every in-tree module imports, and the options have exactly
    the effects of the patches applied so far (a patch's check is live from
    that patch on, and inert before it)."""
    from tests.upstream_tree import copy_vllm, no_plugin_env, no_plugin_shim

    root = copy_vllm(tmp_path / "tree")
    shim = no_plugin_shim(tmp_path / "shim")
    env = no_plugin_env(root, shim)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    seen = []
    for patch, up_patch in zip(series_032, up.PATCHES, strict=True):
        apply_series(root, [patch])
        done = subprocess.run(
            [sys.executable, "-c", _PREFIX_CHECK, str(model_8l)],
            cwd=shim,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
        assert done.returncode == 0 and lines, (patch.name, done.stderr[-4000:])
        seen.append((up_patch.slug, json.loads(lines[-1].removeprefix("REPORT "))))
    by = dict(seen)
    slugs = [s for s, _ in seen]
    assert slugs == list(up.SLUGS)

    def since(slug: str, case: str, applied, inert) -> None:
        first = slugs.index(slug)
        for i, s in enumerate(slugs):
            got = by[s]["cases"][case]
            assert (applied if i >= first else inert)(got), (s, case, got)

    def error(*words: str):
        return lambda got: all(w in got.get("error", "") for w in words)

    def ok(got) -> bool:
        return "error" not in got

    since(
        "kv-mem-options", "bad_value", error("--kv-cache-tokens", "invalid value 0"), ok
    )
    since(
        "pp-kv-budget",
        "pp_without_budget",
        error("--enable-pp-prop-kv-cache needs --kv-cache-memory-bytes"),
        ok,
    )
    since(
        "kv-token-budget",
        "tokens_and_bytes",
        error("--kv-cache-tokens 4,096", "both size the KV cache"),
        ok,
    )
    since(
        "kv-token-budget",
        "tokens",
        lambda got: got.get("kv_cache_memory_bytes") == 1,  # the placeholder
        lambda got: got.get("kv_cache_memory_bytes") is None,
    )
    since(
        "host-kv-tier",
        "host_tier",
        lambda got: got.get("connector") == "KVMemHostTierConnector",
        lambda got: got.get("connector") is None,
    )
    # Each patch's modules import on their own: the package grows patch by patch.
    sizes = [len(by[s]["modules"]) for s in slugs]
    assert sizes == sorted(sizes) and sizes[0] >= 2, sizes


def test_in_tree_blocks_belong_to_their_patch():
    """``# in-tree: <patch>`` blocks appear from their patch on; plugin-only
    blocks never; markers never; a bad marker fails naming the place."""
    from vllm_kvmem.upstream.intree import blocks_for

    text = (
        "a\n# in-tree: p2\nb\n# in-tree: end\n"
        "    # in-tree: plugin-only\n    c\n    # in-tree: end\nd\n"
    )
    known = ("p1", "p2")
    assert blocks_for(text, ("p1",), known, "f.py") == "a\nd\n"
    assert blocks_for(text, ("p1", "p2"), known, "f.py") == "a\nb\nd\n"
    with pytest.raises(ValueError, match=r"f\.py:2: '# in-tree: p3' names no patch"):
        blocks_for(text.replace("p2", "p3"), ("p1",), known, "f.py")
    with pytest.raises(ValueError, match="inside block 'p2'"):
        blocks_for("# in-tree: p2\n# in-tree: p1\n", known, known, "f.py")
    with pytest.raises(ValueError, match="never closed"):
        blocks_for("# in-tree: p2\nx\n", known, known, "f.py")
    with pytest.raises(ValueError, match="closes no block"):
        blocks_for("x\n# in-tree: end\n", known, known, "f.py")
