"""The in-tree series' engine tests: the branch with no plugin, and the plugin
on unmodified vLLM, give the same results, on vLLM 0.32 and on 0.33.

The series adds its engine tests in vLLM's layout (``tests/v1/e2e/``), on a
model named as vLLM's tests name it (``hmellor/tiny-random-LlamaForCausalLM``);
here that name resolves, offline, to this project's random-weight tiny model
in a local Hugging Face cache. Each engine test runs twice per release, each
time in its own ``python -m pytest`` process:

- in-tree: the series' file on a copy of the release's vLLM with the series
  applied, no plugin (``VLLM_PLUGINS=""`` and a ``vllm_kvmem`` that raises on
  import first on the path);
- plugin: the same file (as the series leaves it), on the release's
  unmodified vLLM with vllm-kvmem loaded through its entry point.

Both must pass their own checks, and the reports they write
(``KV_CACHE_TEST_REPORT``: per-rank layers, blocks, page and KV bytes,
capacity, greedy tokens) must be equal field by field.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmem_tools.intree import series as intree
from tests.helpers import ROOT, engine_env, no_plugin_shim, run_pytest, site_033

MODEL_ID = "hmellor/tiny-random-LlamaForCausalLM"
#: Engine tests of the series: (file in vLLM's tree, test).
ENGINE_TESTS = {
    "pp": (
        "tests/v1/e2e/test_kv_cache_budget_engine.py",
        "test_pp_prop_kv_cache_splits_the_budget",
    ),
    "tokens": (
        "tests/v1/e2e/test_kv_cache_budget_engine.py",
        "test_kv_cache_tokens_sizes_the_cache",
    ),
    # The plugin registers the in-tree connector's name on unmodified vLLM.
    "host_tier": (
        "tests/v1/e2e/test_host_kv_tier_engine.py",
        "test_evicted_prefix_is_served_from_host_memory",
    ),
}


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory, model_8l) -> Path:
    """A Hugging Face cache in which :data:`MODEL_ID` is ``model_8l``."""
    cache = tmp_path_factory.mktemp("hf")
    repo = cache / f"models--{MODEL_ID.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_8l, repo / "snapshots" / commit)
    return cache


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def release(request, tmp_path_factory, hf_cache):
    """A release's interpreter, its vLLM with the series applied, and the
    environments of the in-tree and the plugin runs."""
    if request.param == "0.32":
        python, src = sys.executable, intree.installed_vllm_root()
    else:
        python = request.getfixturevalue("vllm033_python")
        src = site_033()
    tmp = tmp_path_factory.mktemp(f"intree{request.param.replace('.', '')}")
    _version, files = intree.write_series(tmp / "series", src)
    copy = intree.copy_tree(src, tmp / "vllm")
    intree.apply_series(copy, files)
    shim = no_plugin_shim(tmp / "shim")
    hf = dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_cache))
    base = {k: v for k, v in engine_env(**hf).items() if k != "VLLM_PLUGINS"}
    return dict(
        series=request.param,
        python=python,
        copy=copy,
        intree_env={
            **base,
            "PYTHONPATH": f"{copy}{os.pathsep}{shim}",
            "VLLM_PLUGINS": "",
        },
        plugin_env=base,
        reports=tmp,
    )


def _run(python: str, file: Path, test: str, env: dict, cwd: Path, out: Path) -> dict:
    env = {**env, "KV_CACHE_TEST_REPORT": str(out)}
    run_pytest(python, [f"{file}::{test}"], env, cwd)
    return json.loads((out / f"{test}.json").read_text())


_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


@pytest.fixture(scope="module", params=list(ENGINE_TESTS))
def runs(request, release) -> dict[str, Any]:
    path, test = ENGINE_TESTS[request.param]
    key = (release["series"], request.param)
    if key not in _RUNS:
        r = release
        _RUNS[key] = {
            "in-tree": _run(
                r["python"],
                r["copy"] / path,
                test,
                r["intree_env"],
                r["copy"],
                r["reports"] / f"intree-{request.param}",
            ),
            "plugin": _run(
                r["python"],
                r["copy"] / path,
                test,
                r["plugin_env"],
                ROOT,
                r["reports"] / f"plugin-{request.param}",
            ),
        }
    return _RUNS[key]


@pytest.mark.engine
def test_the_branch_without_plugin_equals_the_plugin(runs):
    a, b = runs["in-tree"], runs["plugin"]
    diffs = [
        f"{k}: in-tree {a.get(k)!r}, plugin {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    assert not diffs, "\n".join(diffs)
