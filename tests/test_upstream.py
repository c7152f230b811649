"""The in-tree form (``kvmem upstream``): the series applies to vLLM 0.32 and
0.33, holds no ``vllm_kvmem``, fails by name when an anchor moves, and the
patched vLLM 0.32 runs our features with no plugin at all.

One patched copy of the installed vLLM per session: its Python files copied,
its binaries linked, the series applied with ``git apply`` patch by patch.
The engine check starts one pipeline of 2 (split, layout, host tier) and one
single-stage engine (token budget) on that copy, in processes where
``vllm_kvmem`` cannot be imported (a stand-in package that raises comes first
on the path) and ``VLLM_PLUGINS`` excludes the plugin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_kvmem.core import pp_split
from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import PP_COMPILATION, engine_env
from vllm_kvmem.upstream import AnchorError, generate, write_series
from vllm_kvmem.upstream import series as up
from vllm_kvmem.upstream.anchors import Edit, apply_edit

ENGINE_TIMEOUT_S = 420


def _apply(root: Path, patches: list[Path]) -> None:
    """``git apply`` each patch in order (each sees the tree its predecessors
    left)."""
    for patch in patches:
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"


def _copy_vllm(dest: Path) -> Path:
    """A copy of the installed vLLM package under ``dest/vllm``: Python files
    copied (the series edits them), everything else linked (400 MB of
    binaries the series never touches)."""
    src = up.vllm_root() / "vllm"
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dest / "vllm" / Path(root).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".py"):
                shutil.copy2(Path(root) / name, out / name)
            else:
                os.symlink(Path(root) / name, out / name)
    return dest


@pytest.fixture(scope="session")
def series_032(tmp_path_factory) -> list[Path]:
    _version, files = write_series(tmp_path_factory.mktemp("series032"))
    return files


@pytest.fixture(scope="session")
def patched_vllm(tmp_path_factory, series_032) -> Path:
    """The installed vLLM 0.32 with the series applied (a folder holding vllm/)."""
    root = _copy_vllm(tmp_path_factory.mktemp("vllm032"))
    _apply(root, series_032)
    return root


@pytest.fixture(scope="session")
def no_plugin(tmp_path_factory, patched_vllm) -> tuple[dict[str, str], Path]:
    """Environment and working folder of a process that runs the patched vLLM
    and cannot import ``vllm_kvmem``."""
    shim = tmp_path_factory.mktemp("no_plugin")
    (shim / "vllm_kvmem").mkdir()
    (shim / "vllm_kvmem" / "__init__.py").write_text(
        "raise ImportError('the in-tree vLLM imported vllm_kvmem')\n"
    )
    env = engine_env(
        PYTHONPATH=f"{patched_vllm}{os.pathsep}{shim}",
        VLLM_PLUGINS="",  # no general plugin: vllm-kvmem's entry point is skipped
        VLLM_LOGGING_LEVEL="INFO",
    )
    return env, shim


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
    _apply(tree, files)
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


# ------------------------------------------------------------- engines

_ENGINE = r"""
import dataclasses, json, sys
from vllm import LLM, SamplingParams

kw, work = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**kw)
params = SamplingParams(max_tokens=work["max_tokens"], temperature=0.0)
rounds = []
for _ in range(work["rounds"]):
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    rounds.append({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens or 0 for o in outs]})

def report(worker):
    import sys
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    cfg = worker.model_runner.kv_cache_config
    fewer = dataclasses.replace(cfg, num_blocks=cfg.num_blocks - 1)
    return {
        "rank": worker.rank,
        "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
        "num_blocks": cfg.num_blocks,
        "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "layout": cfg.kv_cache_layout,
        "tokens": get_kv_cache_capacity(worker.vllm_config, cfg)[0],
        "tokens_one_block_less": get_kv_cache_capacity(worker.vllm_config, fewer)[0],
        "plugin_modules": sorted(m for m in sys.modules if m.startswith("vllm_kvmem")),
    }

ranks = sorted(llm.collective_rpc(report), key=lambda r: r["rank"])
mods = sorted(m for m in sys.modules if m.startswith("vllm_kvmem"))
out = {"rounds": rounds, "ranks": ranks, "plugin_modules": mods}
print("REPORT " + json.dumps(out))
"""


def _run(no_plugin, kwargs: dict, work: dict, **env: str) -> tuple[dict, str]:
    base, shim = no_plugin
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE, json.dumps(kwargs), json.dumps(work)],
        cwd=shim,  # not the repository: its vllm_kvmem must stay out of reach
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, log[-6000:]
    return json.loads(lines[-1].removeprefix("REPORT ")), log


BUDGET = 24 << 20  # pipeline-wide: 24 blocks of 128 tokens of model_8l in float32
HOST = 256 << 20


@pytest.mark.engine
def test_patched_vllm_splits_lays_out_and_hits_the_host_tier_without_plugin(
    no_plugin, model_8l
):
    kwargs = dict(
        model=str(model_8l),
        pipeline_parallel_size=2,
        compilation_config=PP_COMPILATION,
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        kv_host_cache_bytes=HOST,
        max_model_len=2048,
        max_num_seqs=2,
        dtype="float32",
    )
    # 6 documents of 8 blocks: twice the 24-block device cache on each stage.
    work = {"prompts": documents(6), "max_tokens": 4, "rounds": 2}
    report, log = _run(no_plugin, kwargs, work, VLLM_PP_LAYER_PARTITION="5,3")
    assert report["plugin_modules"] == []
    ranks = report["ranks"]
    assert all(r["plugin_modules"] == [] for r in ranks)
    assert "vllm-kvmem patches applied" not in log
    # The split, as the plugin's arithmetic gives it for these stages.
    bpb = [r["layers"] * r["page_bytes"] for r in ranks]
    shares = pp_split.split_budget(BUDGET, bpb)
    assert [r["layers"] for r in ranks] == [5, 3]
    assert [r["num_blocks"] for r in ranks] == [s.num_blocks for s in shares]
    assert "KV cache per rank (--enable-pp-prop-kv-cache" in log
    # The layout the host tier's connector asks for, which CPU_ATTN accepts.
    from vllm_kvmem.layout import PREFERRED

    assert [r["layout"] for r in ranks] == [PREFERRED, PREFERRED]
    # Host hits, identical greedy output.
    first, second = report["rounds"]
    assert second["token_ids"] == first["token_ids"]
    assert sum(second["cached"]) >= 4 * max(1, sum(first["cached"]))
    assert "Host KV tier: " in log


@pytest.mark.engine
def test_patched_vllm_token_budget_without_plugin(no_plugin, model_8l):
    tokens = 3000
    kwargs = dict(
        model=str(model_8l),
        kv_cache_tokens=tokens,
        max_model_len=2048,
        max_num_seqs=2,
        enforce_eager=True,
    )
    work = {"prompts": ["The KV cache"], "max_tokens": 4, "rounds": 1}
    report, log = _run(no_plugin, kwargs, work, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert report["plugin_modules"] == []
    (rank,) = report["ranks"]
    # Exactly the blocks the tokens need, as vLLM counts capacity.
    assert rank["tokens"] >= tokens > rank["tokens_one_block_less"]
    assert f"--kv-cache-tokens {tokens:,}" in log
