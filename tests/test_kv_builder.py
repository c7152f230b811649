"""vLLM 0.33's planning flow, real, against 0.32's, on worker layouts this
machine cannot start.

``tests/planning_probe.py`` plans each case as the engine core of its vLLM
release does, in a fresh process of that release: vLLM 0.32 (this
interpreter: ``kv_cache_utils.get_kv_cache_configs`` with vllm-kvmem's planner
patch) and vLLM 0.33 (``make setup-033``: ``get_global_kv_cache_groups``,
the executor's ``determine_available_memory``,
``kv_cache_planning.get_kv_cache_configs`` with the platform's
``KVCacheConfigBuilder``, the executor's ``initialize_from_config``, with
vllm-kvmem's patches applied by its entry point). Only the workers stand in:
their device limits are the case's (tensor x pipeline parallel layouts and
devices smaller than a share need more than this machine has).

The 0.33 flow must give what the 0.32 one gives: the same configs (blocks,
tensors, groups), the same max_model_len, the same startup table, the same
refusals. Where a real 0.33 engine can run (a pipeline of 2, one stage),
``tests/test_vllm033_engine.py`` starts one instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import run_probe, side_by_side, site_033
from tests.planning_probe import CORE_CALLS_033

BIG = 1 << 40
MiB = 1 << 20

# model_8l on CPU: 128-token blocks of 64 KiB per layer.
CASES = {
    "pp-prop tp2 x pp2, 6/2 layers": dict(layers=[6, 2], config=dict(tp=2)),
    "pp-prop, bytes not layers": dict(layers=[4, 4], heads=[2, 8]),
    "tokens 5,000, tp2": dict(
        layers=[6, 2], heads=[2, 4], config=dict(tp=2, tokens=5000)
    ),
    "tokens 100,001": dict(layers=[6, 2], config=dict(tokens=100_001)),
    "no kvmem flag": dict(layers=[6, 2], config=dict(flag=False)),
    "num_gpu_blocks_override": dict(layers=[6, 2], override=7, limits=[64 * MiB] * 2),
    "max-model-len auto, tokens 1,000": dict(
        layers=[6, 2], config=dict(tokens=1000, max_len=-1)
    ),
    "max-model-len auto, pp-prop 4 MiB": dict(
        layers=[6, 2], config=dict(budget=4 * MiB, max_len=-1)
    ),
    # Refusals.
    "share above a device": dict(
        layers=[6, 2], config=dict(budget=1 << 30), limits=[300 * MiB, BIG]
    ),
    "tokens above a device": dict(
        layers=[6, 2], config=dict(tokens=200_000), limits=[BIG, 10 * MiB]
    ),
    "tokens below one sequence": dict(layers=[6, 2], config=dict(tokens=100)),
    "share below one sequence": dict(layers=[6, 2], config=dict(budget=1 * MiB)),
    "a stage without KV layers": dict(layers=[8, 0]),
}


def _cases(model: Path, cases: dict) -> dict:
    out = {}
    for name, case in cases.items():
        tp = case.get("config", {}).get("tp", 1)
        limits = case.get("limits", [BIG] * len(case["layers"]))
        out[name] = {
            **case,
            "model": str(model),
            "limits": [x for x in limits for _ in range(tp)],
        }
    return out


def _plan(python: str | None, model: Path, cases: dict) -> dict:
    arg = json.dumps(_cases(model, cases))
    code = f"from tests.planning_probe import main; main([{arg!r}])"
    return run_probe(code, timeout=300, python=python, VLLM_LOGGING_LEVEL="INFO")


@pytest.fixture(scope="module")
def plans(model_8l, vllm033_python) -> dict[str, dict]:
    """Both releases' plans: two independent probe processes, side by side."""
    on_032, on_033 = side_by_side(
        lambda: _plan(None, model_8l, CASES),
        lambda: _plan(vllm033_python, model_8l, CASES),
    )
    return {"0.32": on_032, "0.33": on_033}


@pytest.mark.parametrize("case", CASES)
def test_vllm_033_plans_what_032_plans(plans, case):
    assert plans["0.33"][case] == plans["0.32"][case]


def _sizes(plan: dict) -> list[int]:
    return [max(t["size"] for t in c["tensors"]) for c in plan["configs"]]


def test_the_plans_are_right(plans):
    """Absolute checks, on both releases."""
    for plan in plans.values():
        tp2 = _sizes(plan["pp-prop tp2 x pp2, 6/2 layers"])
        assert tp2[0] == tp2[1] == 3 * tp2[2] == 3 * tp2[3]  # 6 layers against 2
        blocks = plan["pp-prop tp2 x pp2, 6/2 layers"]["configs"][0]["num_blocks"]
        assert (64 * MiB) - (tp2[0] + tp2[2]) // blocks < tp2[0] + tp2[2] <= 64 * MiB
        heads = _sizes(plan["pp-prop, bytes not layers"])
        assert heads[1] == 4 * heads[0]  # 4x the KV heads: 4x the share
        override = plan["num_gpu_blocks_override"]["configs"]
        assert [c["num_blocks"] for c in override] == [7, 7]
        # 1,000 tokens: 8 blocks of 128 and vLLM's null block; auto-fit
        # brings max_model_len down to what the 8 hold.
        auto = plan["max-model-len auto, tokens 1,000"]
        assert [c["num_blocks"] for c in auto["configs"]] == [9, 9]
        assert auto["max_model_len"] == 8 * 128
        (table,) = auto["tables"]
        assert "--kv-cache-tokens 1,000; max_model_len 1,024" in table
        # 4 MiB over 6 + 2 layers of 64 KiB blocks: 8 blocks on each stage.
        auto_pp = plan["max-model-len auto, pp-prop 4 MiB"]
        assert [c["num_blocks"] for c in auto_pp["configs"]] == [8, 8]
        assert auto_pp["max_model_len"] == 7 * 128
        for name in ("share above a device", "share below one sequence"):
            assert plan[name]["refused"].startswith("--enable-pp-prop-kv-cache")
        assert (
            "pipeline stage 1 (rank 1) holds no KV cache layers"
            in (plan["a stage without KV layers"]["refused"])
        )
        for name in ("tokens above a device", "tokens below one sequence"):
            assert plan[name]["refused"].startswith("--kv-cache-tokens")


def test_a_platform_with_its_own_builder_is_refused_by_name(model_8l, vllm033_python):
    vendor = dict(
        layers=[6, 2],
        config=dict(tokens=4096),
        platform_builder="tests.planning_probe.VendorBuilder",
    )
    got = _plan(vllm033_python, model_8l, {"vendor": vendor})["vendor"]
    assert "CpuPlatform" in got["refused"], got
    assert "tests.planning_probe.VendorBuilder" in got["refused"]


def test_the_probe_makes_the_engine_cores_calls(vllm033_python):
    """If 0.33's ``EngineCore._initialize_kv_caches`` stops making the calls
    ``plan_033`` makes, in that order, the probe is stale: this fails."""
    from kvmem_tools.vllm_sources import SourceTree

    tree = SourceTree(site_033())
    assert tree.version().startswith("0.33.")
    calls = list(tree.calls("vllm.v1.engine.core:EngineCore._initialize_kv_caches"))
    assert [c for c in calls if c in CORE_CALLS_033] == list(CORE_CALLS_033)


@pytest.mark.usefixtures("vllm_patched")
def test_on_vllm_032_the_executor_plans_nothing(model_8l, caplog):
    """vLLM 0.32 (no builders): the executor patch plans nothing, the planner
    patch does it all."""
    from vllm.v1.core import kv_cache_utils as ku

    from tests.helpers import planner_config, worker_specs
    from vllm_kvmem import vllm_adapter as va
    from vllm_kvmem.budget.runtime import BudgetRuntime
    from vllm_kvmem.patches import ALL_PATCHES

    assert not va.plans_through_builder()
    cfg = planner_config(model_8l, tokens=4096)
    specs = worker_specs(cfg, [6, 2])
    executor = SimpleNamespace(
        vllm_config=cfg, collective_rpc=lambda m: [None, None], get_kv_cache_specs=None
    )
    record = next(p for p in ALL_PATCHES if p.name == "executor_device_limits")
    with caplog.at_level(logging.INFO):
        record.make_replacement(lambda self: [BIG, BIG])(executor)
    assert BudgetRuntime.from_vllm_config(cfg).plan is None
    assert ku.get_kv_cache_configs(cfg, specs, [BIG, BIG])[0].num_blocks > 1
