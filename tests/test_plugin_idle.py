"""No kvmem flag, no change: the plugin installed and idle is invisible.

The same in-process engine, and the same introspection of vLLM's options,
on vLLM 0.32 and on 0.33 (``make setup-033``), once with the plugin
disabled (``VLLM_PLUGINS`` naming every plugin but vllm-kvmem) and once with
it registered through vLLM's entry point, both with no kvmem flag.
Compared: the resolved KV cache config of every rank (blocks, layout,
tensor sizes and strides), the greedy output, the signatures of
``EngineArgs`` and ``AsyncEngineArgs``, and the server's ``--help`` for
vLLM's own options. Any difference fails, naming it.
"""

from __future__ import annotations

import pytest

from tests.helpers import both_vllms, run_engine, run_probe, side_by_side

pytestmark = pytest.mark.engine

DISABLED = {"VLLM_PLUGINS": "lora_filesystem_resolver"}  # all but vllm-kvmem

# What a tool that wraps vLLM sees of its options, in a fresh process.
OPTIONS_PROBE = """
import inspect, json
from vllm.plugins import load_general_plugins
load_general_plugins()  # vLLM's own loading, honouring VLLM_PLUGINS
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
try:  # vLLM 0.33 moved the server's parser
    from vllm.entrypoints.common.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_kvmem.config import KVMemConfig

ours = {KVMemConfig.flag(n) for n in KVMemConfig.option_names()}
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
options = {}
for action in parser._actions:
    if action.dest in KVMemConfig.option_names():
        continue  # a vllm-kvmem flag (and its negative: --no-X on 0.32,
                  # --disable-X for an --enable-X flag on 0.33)
    key = " ".join(action.option_strings) or action.dest
    options[key] = [repr(action.default), action.help, repr(action.choices),
                    type(action).__name__]
print("REPORT " + json.dumps({
    "EngineArgs signature": str(inspect.signature(EngineArgs)),
    "AsyncEngineArgs signature": str(inspect.signature(AsyncEngineArgs)),
    "vLLM's own CLI options": options,
    "kvmem flags in --help": sorted(o for o in ours if o in parser.format_help()),
}))
"""


def _options(python: str, **env: str) -> dict:
    return run_probe(OPTIONS_PROBE, python=python, **env)


def _differences(without: dict, with_plugin: dict, where: str = "") -> list[str]:
    """Every key whose value differs, named by its path."""
    out = []
    for key in sorted(set(without) | set(with_plugin)):
        a, b = without.get(key, "<missing>"), with_plugin.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{where}{key}: ")
        elif a != b:
            out.append(f"{where}{key}: without the plugin {a!r}, with it {b!r}")
    return out


@both_vllms
def test_options_are_vllms_own_with_the_plugin_registered(vllm_python):
    without, with_plugin = _options(vllm_python, **DISABLED), _options(vllm_python)
    # The plugin did load: its flags are offered (and nothing else changed).
    assert without["kvmem flags in --help"] == []
    assert with_plugin["kvmem flags in --help"]
    without.pop("kvmem flags in --help"), with_plugin.pop("kvmem flags in --help")
    assert _differences(without, with_plugin) == []


@both_vllms
def test_engine_with_no_kvmem_flag_is_vllms_own(model_8l, vllm_python):
    kwargs = dict(
        model=str(model_8l),
        kv_cache_memory_bytes=32 << 20,
        max_model_len=1024,
        enforce_eager=True,
    )
    workload = {"prompts": ["The KV cache", "A pipeline of two"], "max_tokens": 8}
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    without, with_plugin = side_by_side(
        lambda: run_engine(kwargs, workload, vllm_python, **env, **DISABLED),
        lambda: run_engine(kwargs, workload, vllm_python, **env),
    )
    assert without.returncode == 0, without.log[-4000:]
    assert with_plugin.returncode == 0, with_plugin.log[-4000:]
    # Really disabled, and really on: the plugin's capacity table (its only
    # addition without flags, a log line) is there in one run only.
    assert "KV cache per rank" not in without.log
    assert "KV cache per rank" in with_plugin.log

    def view(run):
        ranks = {f"rank {r['rank']}": r for r in run.ranks}
        return {
            "KV cache": ranks,
            "greedy output": {"token_ids": run.report["token_ids"]},
        }

    assert _differences(view(without), view(with_plugin)) == []


def test_explicit_blhnc_on_cpu_is_refused_as_by_vllm(model_8l):
    """CPU_ATTN declares LBHNC only; without a connector that opts in, the
    plugin leaves that declaration alone, so vLLM refuses the variable the
    same way with and without it."""
    kwargs = dict(
        model=str(model_8l), kv_cache_memory_bytes=32 << 20, max_model_len=512
    )
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_KV_CACHE_LAYOUT="BLHNC")
    runs = side_by_side(
        lambda: run_engine(kwargs, None, **env, **DISABLED),
        lambda: run_engine(kwargs, None, **env),
    )
    expected = "VLLM_KV_CACHE_LAYOUT=BLHNC does not satisfy every supported set"
    for run in runs:
        assert run.returncode != 0
        assert expected in run.log, run.log[-4000:]
