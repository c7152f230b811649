"""The in-tree series' engine tests: on vLLM 0.32 the branch with no plugin
and the plugin on unmodified vLLM give the same results; on vLLM 0.33 the
0.33 series passes the same tests with no plugin and gives what the 0.32
branch gives.

The series adds its engine tests in vLLM's layout (``tests/v1/e2e/general/``),
on a model named as vLLM's tests name it
(``hmellor/tiny-random-LlamaForCausalLM``); here that name resolves, offline,
to this project's random-weight tiny model in a local Hugging Face cache. The
engine tests of one file run in one ``python -m pytest`` process, per release
and form:

- in-tree: the series' file on a copy of the release's vLLM with the series
  applied, no plugin (``VLLM_PLUGINS=""`` and a ``vllm_kvmem`` that raises on
  import first on the path), on 0.32 and on 0.33;
- plugin: the same file (as the series leaves it), on unmodified vLLM 0.32
  with vllm-kvmem loaded through its entry point (the plugin on 0.33 runs
  the project's own engine tests, ``test_vllm033_engine.py``).

Every run must pass its own checks. What each run did (per-rank layers,
blocks, page and KV bytes, capacity; greedy tokens) is recorded from the
outside by this project's pytest plugin
(``tests/intree_report/kvmem_intree_report.py``, loaded with
``PYTEST_PLUGINS``: the in-tree files carry no hook), and the records must
be equal field by field.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvmem_tools.intree import series as intree
from tests.helpers import (
    ROOT,
    assert_fields_equal,
    engine_env,
    no_plugin_shim,
    run_pytest,
    site_033,
)

MODEL_ID = "hmellor/tiny-random-LlamaForCausalLM"
#: Engine tests of the series: (file in vLLM's tree, test).
ENGINE_TESTS = {
    "pp": (
        "tests/v1/e2e/general/test_pp_kv_cache_budget.py",
        "test_pp_prop_kv_cache_splits_the_budget",
    ),
    "tokens": (
        "tests/v1/e2e/general/test_kv_cache_tokens_engine.py",
        "test_kv_cache_tokens_sizes_the_cache",
    ),
}
#: The pytest plugin that records each run (see the module docstring).
REPORTER = ROOT / "tests" / "intree_report"


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


def _release(series: str, python: str, src: Path, tmp_path_factory, hf_cache) -> dict:
    """A release's interpreter, its vLLM with the series applied, and the
    environments of the in-tree and the plugin runs."""
    tmp = tmp_path_factory.mktemp(f"intree{series.replace('.', '')}")
    _version, files = intree.write_series(tmp / "series", src)
    copy = intree.copy_tree(src, tmp / "vllm")
    intree.apply_series(copy, files)
    shim = no_plugin_shim(tmp / "shim")
    hf = dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_cache))
    base = {k: v for k, v in engine_env(**hf).items() if k != "VLLM_PLUGINS"}
    base["PYTEST_PLUGINS"] = "kvmem_intree_report"
    path = base.get("PYTHONPATH")
    return dict(
        series=series,
        python=python,
        copy=copy,
        intree_env={
            **base,
            "PYTHONPATH": os.pathsep.join(map(str, (copy, shim, REPORTER))),
            "VLLM_PLUGINS": "",
        },
        plugin_env={
            **base,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPORTER), path))),
        },
        reports=tmp,
    )


@pytest.fixture(scope="module")
def release_032(tmp_path_factory, hf_cache) -> dict:
    src = intree.installed_vllm_root()
    return _release("0.32", sys.executable, src, tmp_path_factory, hf_cache)


@pytest.fixture(scope="module")
def release_033(vllm033_python, tmp_path_factory, hf_cache) -> dict:
    return _release("0.33", vllm033_python, site_033(), tmp_path_factory, hf_cache)


@pytest.fixture(scope="module", params=list(ENGINE_TESTS))
def engine_test(request) -> str:
    return request.param


_RUNS: dict[tuple[str, str, str], dict[str, Any]] = {}


def _report(r: dict, name: str, form: str) -> dict[str, Any]:
    """The report of engine test ``name`` on release ``r``, ``form`` being
    "in-tree" (the branch, no plugin) or "plugin" (unmodified vLLM). The
    engine tests of one file run in one process (as vLLM's CI runs them),
    once per release and form per session."""
    key = (r["series"], name, form)
    if key not in _RUNS:
        path = ENGINE_TESTS[name][0]
        same_file = [n for n, (p, _t) in ENGINE_TESTS.items() if p == path]
        intree_form = form == "in-tree"
        env = {**r["intree_env" if intree_form else "plugin_env"]}
        out = r["reports"] / f"{form}-{Path(path).stem}"
        env["KVMEM_INTREE_REPORT"] = str(out)
        run_pytest(
            r["python"],
            [f"{r['copy'] / path}::{ENGINE_TESTS[n][1]}" for n in same_file],
            env,
            r["copy"] if intree_form else ROOT,
        )
        for n in same_file:
            report = out / f"{ENGINE_TESTS[n][1]}.json"
            _RUNS[(r["series"], n, form)] = json.loads(report.read_text())
    return _RUNS[key]


@pytest.mark.engine
def test_the_branch_without_plugin_equals_the_plugin(release_032, engine_test):
    """vLLM 0.32: the branch with no plugin and the plugin on unmodified vLLM.
    The two runs are independent processes (mostly single-threaded imports
    and compilation at startup): they run side by side."""
    with ThreadPoolExecutor(2) as pool:
        in_tree, plugin = [
            pool.submit(_report, release_032, engine_test, form)
            for form in ("in-tree", "plugin")
        ]
        assert_fields_equal(in_tree.result(), plugin.result(), ("in-tree", "plugin"))


@pytest.mark.engine
def test_the_033_branch_equals_the_032_branch(release_032, release_033, engine_test):
    """vLLM 0.33: the 0.33 series passes the same engine test with no plugin
    (its own checks ran in its process) and measures what the 0.32 branch
    measures, field by field (the plugin on 0.33 is test_vllm033_engine's)."""
    assert_fields_equal(
        _report(release_033, engine_test, "in-tree"),
        _report(release_032, engine_test, "in-tree"),
        ("0.33 branch", "0.32 branch"),
    )
