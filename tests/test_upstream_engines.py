"""The patched vLLM 0.32 (``kvmem upstream``'s series applied to a copy of
the installed vLLM) runs our features with no plugin at all, with results
equal to the plugin's. The engine tests are the series' own
``tests/v1/kv_mem/test_engine.py`` (``tests/kv_mem_engine.py`` here, a vLLM
test: vLLM's API only). Each of its two engine tests (a pipeline of 2 with
split, layout and host tier; a single-stage engine with a token budget) runs
twice, each time in its own ``python -m pytest`` process:

- in-tree: the series' copy of the file on the patched copy of vLLM, first on
  the path, in processes where ``vllm_kvmem`` cannot be imported (a stand-in
  package that raises comes first on the path) and ``VLLM_PLUGINS`` excludes
  the plugin;
- plugin: this repository's file on the installed, unmodified vLLM with
  vllm-kvmem loaded through its ``vllm.general_plugins`` entry point.

Both runs must pass (the test's absolute checks: the proportional split,
BLHNC, host hits, the token budget's bounds, one capacity table agreeing
with the ranks), and then the reports they write (``KV_MEM_TEST_REPORT``)
must be equal field by field: per rank blocks, layers, page size, layout and
capacity, every round's greedy tokens and cached tokens, and the startup
capacity table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import RANK_FIELDS, ROOT, Run, assert_runs_equal, run_engine_test
from tests.helpers import engine_env as plugin_engine_env
from vllm_kvmem.upstream import intree
from vllm_kvmem.upstream.series import ENGINE_TESTS

PLUGIN_FILE = ROOT / "tests" / ENGINE_TESTS[0]
INTREE_FILE = f"{intree.TESTS_DIR}/{ENGINE_TESTS[1]}"

# ------------------------------------------------------------------ runs


@dataclass(frozen=True)
class Pair:
    """One engine test run in-tree (patched copy, no plugin) and with the
    plugin (unmodified vLLM)."""

    intree: Run
    plugin: Run


def _both(no_plugin, patched_vllm: Path, model: Path, test: str, reports) -> Pair:
    """The engine test in-tree, then with the plugin."""
    base, shim = no_plugin
    # cwd: the shim, not the repository: its vllm_kvmem must stay out of reach.
    intree_run = run_engine_test(
        patched_vllm / INTREE_FILE, test, base, shim, model, reports("intree")
    )
    # The plugin's environment: the installed vLLM (no PYTHONPATH of ours),
    # every general plugin loaded (VLLM_PLUGINS unset), as tests.helpers runs
    # plugin engines.
    plugin_env = {k: v for k, v in plugin_engine_env().items() if k != "VLLM_PLUGINS"}
    plugin_run = run_engine_test(
        PLUGIN_FILE, test, plugin_env, ROOT, model, reports("plugin")
    )
    return Pair(intree_run, plugin_run)


# ------------------------------------------------------------- comparisons


def assert_equal_runs(pair: Pair) -> None:
    assert_runs_equal(pair.intree, pair.plugin, ("in-tree", "plugin"))


def test_a_difference_names_its_field():
    rank = dict.fromkeys(RANK_FIELDS, 1) | {"rank": 0}
    rounds = [{"token_ids": [[5, 6]], "cached": [0]}]
    tables = [["KV cache per rank (t):", "  rank", "     0    24"]]
    report = {"ranks": [rank], "rounds": rounds, "capacity_tables": tables}
    a = Run(report, "")
    assert_equal_runs(Pair(a, a))
    tables_b = [[*tables[0][:2], "     0    245"]]
    b = Run(
        {**report, "ranks": [rank | {"num_blocks": 2}], "capacity_tables": tables_b},
        "",
    )
    with pytest.raises(AssertionError) as err:
        assert_equal_runs(Pair(a, b))
    lines = [ln.strip() for ln in str(err.value).splitlines()]
    assert lines[0] == "the in-tree run differs from the plugin run:"
    assert lines[1:7] == [
        "rank 0 num_blocks:",
        "in-tree 1",
        "plugin  2",
        "capacity table 0 line 2:",
        "in-tree '     0    24'",
        "plugin  '     0    245'",
    ]


def assert_sources(pair: Pair, patched_vllm: Path) -> None:
    """The in-tree run: the patched copy, no ``vllm_kvmem`` in the test's
    process nor any worker; the plugin run: the installed vLLM, the plugin
    loaded in every one."""
    root = str(patched_vllm.resolve())
    intree_run, plugin_run = pair.intree, pair.plugin
    for proc in [intree_run.report, *intree_run.ranks]:
        assert "vllm_kvmem" not in proc["packages"], proc
        assert str(Path(proc["vllm_file"]).resolve()).startswith(root), proc
    for proc in [plugin_run.report, *plugin_run.ranks]:
        assert "vllm_kvmem" in proc["packages"], proc
        assert not str(Path(proc["vllm_file"]).resolve()).startswith(root), proc


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return lambda world: tmp_path_factory.mktemp(f"kv_mem_engine_{world}")


# ------------------------------------------------------------ the engines

#: The engine tests of ``tests/kv_mem_engine.py``, by the id pytest shows: a
#: pipeline of 2 with the split, the layout and the host tier; a single
#: stage sized in tokens.
ENGINES = {
    "pp": "test_pp_prop_budget_layout_and_host_tier",
    "tokens": "test_kv_cache_tokens_sizes_the_cache",
}


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(request, no_plugin, patched_vllm, model_8l, reports) -> Pair:
    return _both(no_plugin, patched_vllm, model_8l, ENGINES[request.param], reports)


@pytest.mark.engine
def test_runs_in_tree_without_plugin_and_with_it_on_unmodified_vllm(runs, patched_vllm):
    assert_sources(runs, patched_vllm)


@pytest.mark.engine
def test_patched_vllm_results_equal_the_plugins(runs):
    assert_equal_runs(runs)


def test_the_engine_tests_read_the_demos_documents():
    """The in-tree engine test writes the demo's documents out (it may import
    nothing of ours); they must stay the same documents."""
    from tests import kv_mem_engine
    from vllm_kvmem.demo import WORDS as demo_words
    from vllm_kvmem.demo import documents

    assert kv_mem_engine.documents(6) == documents(6)
    assert kv_mem_engine.WORDS == demo_words
