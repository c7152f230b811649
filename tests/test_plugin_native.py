"""The plugin stands down where vLLM already has the feature.

On a vLLM built from the in-tree series (``kvmem_tools.intree``: written
against the release, applied to a copy of its tree, as tests/test_intree.py
does) the series' own unit tests pass with the plugin registered; there each
feature vLLM has natively gets one log line, its patches stand down and its
options are vLLM's, while the host tier's options stay the plugin's. On the
plain release nothing is native and every patch applies as before
(tests/test_patches.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem_tools.intree import series as intree
from tests.helpers import (
    ROOT,
    engine_env,
    no_plugin_shim,
    run_engine,
    runnable_unit_tests,
    site_033,
    vllm_unit_test_env,
)
from vllm_kvmem.patches import ALL_PATCHES
from vllm_kvmem.patches._native import FEATURES, native_features
from vllm_kvmem.patches._registry import standing_down

#: The line the plugin logs for a feature vLLM has (``what`` filled in).
LINE = re.compile(r"vllm-kvmem: vLLM has (.+) natively; using vLLM's")
#: The patches that stand down where vLLM has every native feature.
BUDGET = {"executor_device_limits", "cpu_worker_memory", "gpu_worker_memory"}
LAYOUTS = {"cpu_attn_layouts"}


def _env(tree: Path | None, plugin: bool = True, shim: Path | None = None) -> dict:
    """An engine environment whose ``vllm`` is ``tree``'s (None: the
    installed one), with vLLM loading the plugin (VLLM_PLUGINS unset) or
    not (the shim makes importing vllm_kvmem fail)."""
    paths = [p for p in (shim, tree, ROOT) if p is not None]
    env = engine_env(PYTHONPATH=":".join(map(str, paths)))
    env.pop("VLLM_PLUGINS", None)
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    return env


def _run(python: str, code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


#: Run first in every process that runs the series' tests. The CPU layout
#: tests call vLLM's attention kernel before any torch op; on a host with AMX
#: tiles the kernel then dies of SIGILL, because the process has not yet
#: asked Linux for the AMX state (oneDNN asks on its first bf16 op, which in
#: an engine comes first). Plugin or not, vLLM's code is unchanged by this.
AMX_PERMISSION = (
    "import torch\nif torch.cpu._is_amx_tile_supported():\n    torch.cpu._init_amx()\n"
)


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def series_tree(request, tmp_path_factory):
    """A release's vLLM with the whole in-tree series applied: its
    interpreter, the tree and the series' unit tests."""
    if request.param == "0.32":
        python, src = sys.executable, intree.installed_vllm_root()
    else:
        python, src = request.getfixturevalue("vllm033_python"), site_033()
    base = tmp_path_factory.mktemp(f"native{request.param.replace('.', '')}")
    version, files = intree.write_series(base / "series", src)
    tree = intree.copy_tree(src, base / "tree")
    # vLLM's own tests (the sdist's), which some patches extend.
    intree.copy_tests(intree.tests_root(src, version), tree)
    intree.apply_series(tree, files)
    # The unit tests: the files the patches add and the tests they append to
    # vLLM's (the engine tests, tests/v1/e2e, run in test_intree_engines).
    tests = sorted(
        {
            t
            for p in intree.patches()
            for t in intree.unit_tests(p.for_series(request.param))
        }
    )
    tests = runnable_unit_tests(tests, tree)
    hub = vllm_unit_test_env(base / "hub")
    return dict(series=request.param, python=python, tree=tree, tests=tests, hub=hub)


def _pytest(series_tree: dict, env: dict, args: list[str]) -> str:
    """Run pytest on ``args`` in a fresh process of the tree's vLLM."""
    pytest_args = ["-rfE", "-p", "no:cacheprovider", "--noconftest", "--rootdir", "."]
    pytest_args += args
    code = (
        AMX_PERMISSION + f"import pytest, sys\nsys.exit(pytest.main({pytest_args!r}))\n"
    )
    done = _run(series_tree["python"], code, series_tree["tree"], env)
    return f"exit {done.returncode}\n{done.stdout}{done.stderr[-3000:]}"


def test_the_series_unit_tests_pass_with_the_plugin(series_tree, tmp_path):
    """The plugin registered (as vLLM's entry point registers it, and before
    the first test, so that every test runs patched), on a vLLM that has the
    series' features natively: the series' unit tests all pass, and the
    host tier's flags (not native) are still the plugin's."""
    tree = series_tree["tree"]
    args = ["-q", "-p", "no:cacheprovider", "--noconftest", "--rootdir", "."]
    args += series_tree["tests"]
    code = (
        AMX_PERMISSION
        + f"""\
import sys, vllm, vllm_kvmem
assert vllm.__file__.startswith({str(tree)!r}), vllm.__file__
assert vllm_kvmem.register() is True
import pytest
code = pytest.main({args!r})
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
flags = EngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions
if "--kv-host-cache-bytes" not in flags:
    print("HOST TIER FLAG GONE: the plugin's --kv-host-cache-bytes is missing")
    code = code or 3
sys.exit(code)
"""
    )
    done = _run(series_tree["python"], code, tree, _env(tree) | series_tree["hub"])
    output = done.stdout + done.stderr[-3000:]
    if done.returncode != 0:
        # Say which failures are the plugin's: the same tests without it.
        failed = re.findall(r"^FAILED (\S+?)(?: - |$)", done.stdout, re.M)
        alone = "(no test failed)"
        if failed:
            shim = no_plugin_shim(tmp_path / "shim")
            alone = _pytest(
                series_tree,
                _env(tree, plugin=False, shim=shim) | series_tree["hub"],
                failed,
            )
        pytest.fail(
            f"with the plugin:\n{output[-6000:]}\n\nthe failed tests without "
            f"the plugin:\n{alone[-3000:]}"
        )
    assert re.search(r"\d+ passed", done.stdout), output[-3000:]


#: Registers the plugin twice, builds a VllmConfig twice, and reports the
#: plugin's log lines, what it applied, the parser's flags and what
#: EngineArgs does with the options.
PROBE = """\
import json, sys
MODEL = sys.argv[1]
import vllm_kvmem
from vllm_kvmem.patches import ALL_PATCHES, is_applied
from vllm.platforms import current_platform
assert vllm_kvmem.register() is True and vllm_kvmem.register() is True
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
group = [g for g in parser._action_groups if g.title == "vllm-kvmem"]
ours = sorted(a.dest for g in group for a in g._group_actions)
for _ in range(2):
    EngineArgs(model=MODEL, skip_tokenizer_init=True).create_engine_config()
args = EngineArgs(model=MODEL, kv_host_cache_bytes="1G")
from vllm_kvmem.patches._native import native_options
refused = ""
if "kv_cache_tokens" in native_options():  # refused before any model is read
    try:
        EngineArgs(
            model=MODEL, additional_config={"kvmem": {"kv_cache_tokens": 1000}}
        ).create_engine_config()
    except ValueError as e:
        refused = str(e)
print("REPORT " + json.dumps(dict(
    applied=[p.name for p in ALL_PATCHES
             if p.applies_to(current_platform) and "0.32" in p.versions
             and is_applied(p)],
    ours=ours,
    host=args.additional_config.get("kvmem"),
    refused=refused,
)))
"""


def _probe(tree: Path | None, model: Path) -> dict:
    """Run :data:`PROBE` on vLLM 0.32 from ``tree`` (None: as installed)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(model)],
        cwd=tree or ROOT,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    # vLLM's log, as the operator reads it.
    output = (done.stdout + done.stderr).splitlines()
    report["native"] = [m[1] for ln in output if (m := LINE.search(ln))]
    return report


def _tree(tmp_path: Path, only: list[str] | None = None) -> Path:
    """The installed vLLM (0.32) with the series (or ``only`` its PRs)."""
    src = intree.installed_vllm_root()
    _v, files = intree.write_series(tmp_path / "series", src, only=only)
    tree = intree.copy_tree(src, tmp_path / "tree")
    intree.apply_series(tree, files)
    return tree


@pytest.fixture(scope="module")
def tree_032(tmp_path_factory) -> Path:
    """vLLM 0.32 with the whole series."""
    return _tree(tmp_path_factory.mktemp("tree032"))


def test_one_line_per_native_feature_and_its_patches_stand_down(tree_032, model_8l):
    """vLLM 0.32 with the series, on CPU: one line for each of the four
    features, once (registering and building a config twice logs nothing
    more), the budget and layout
    patches not applied, the option patches applied with the host and disk
    tiers' options only, and a native option given to the plugin refused."""
    report = _probe(tree_032, model_8l)
    assert report["native"] == [f.what for f in FEATURES]
    applied = set(report["applied"])
    assert not applied & (BUDGET | LAYOUTS), applied
    assert {"engine_args_cli", "engine_args_init", "engine_args_config"} <= applied
    assert "kv_cache_configs" in applied  # capacity table, host tier sizing
    tiers = ("kv_host_", "kv_disk_")  # the host tier's and its disk tier's
    assert report["ours"] == [n for n in report["ours"] if n.startswith(tiers)]
    assert report["ours"]
    assert report["host"] == {"kv_host_cache_bytes": "1G"}
    assert "has --kv-cache-tokens natively" in report["refused"], report


@pytest.mark.engine
def test_an_engine_on_the_series_with_the_plugin(tree_032, model_8l):
    """The operator's case: vLLM with the series and the plugin installed.
    vLLM's own --kv-cache-tokens sizes the cache (its planner's line), the
    plugin's host tier runs beside it, and the log has one line for each
    feature vLLM has."""
    run = run_engine(
        dict(
            model=str(model_8l),
            kv_cache_tokens=1000,
            max_model_len=-1,
            enforce_eager=True,
            kv_host_cache_bytes="64M",
        ),
        {"prompts": ["The KV cache"], "max_tokens": 4},
        PYTHONPATH=f"{tree_032}:{ROOT}",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    assert run.returncode == 0, run.log[-4000:]
    assert [m[1] for m in LINE.finditer(run.log)] == [f.what for f in FEATURES]
    assert "kv_cache_tokens=1,000: 9 KV cache blocks on every worker" in run.log
    assert "Host KV tier on this rank" in run.log
    (rank,) = run.ranks
    assert rank["num_blocks"] == 9


def test_each_feature_is_decided_on_its_own(tmp_path, model_8l):
    """Only the token budget's PR applied: --kv-cache-tokens is vLLM's, one
    line; --enable-pp-prop-kv-cache stays the plugin's, and so do the budget
    patches (the plugin's split still needs them) and the layout patch."""
    report = _probe(_tree(tmp_path, only=["kv_cache_tokens"]), model_8l)
    assert report["native"] == ["--kv-cache-tokens"]
    assert "enable_pp_prop_kv_cache" in report["ours"]
    assert "kv_cache_tokens" not in report["ours"]
    assert (BUDGET - {"gpu_worker_memory"}) | LAYOUTS <= set(report["applied"])


def test_on_the_release_nothing_is_native_and_no_line_is_logged(model_8l):
    report = _probe(None, model_8l)
    assert report["native"] == []
    assert "enable_pp_prop_kv_cache" in report["ours"]
    assert "kv_cache_tokens" in report["ours"]
    assert {"engine_args_init", "kv_cache_configs"} | BUDGET - {
        "gpu_worker_memory"
    } | LAYOUTS <= set(report["applied"])
    assert report["refused"] == ""


def test_the_release_has_none_of_the_features(vllm_patched):
    """In this process (vLLM 0.32 as released): no feature is native, so no
    patch stands down."""
    assert native_features(f.name for f in FEATURES) == []
    assert standing_down(ALL_PATCHES, []) == []


def test_a_patch_stands_down_only_when_vllm_has_all_its_features():
    (layouts,) = [p for p in ALL_PATCHES if p.name == "cpu_attn_layouts"]
    assert layouts.stands_down(["cpu_attn_block_outer", "cpu_mla_kv_cache_layouts"])
    assert not layouts.stands_down(["cpu_attn_block_outer"])
    options = [p for p in ALL_PATCHES if p.native_options]
    assert options and not standing_down(options, [f.name for f in FEATURES])
    with pytest.raises(ValueError, match="native must name features"):
        dataclasses.replace(layouts, native=("no_such_pr",))


def test_every_native_feature_is_a_pr_of_the_series():
    assert {f.name for f in FEATURES} <= set(intree.ORDER)
