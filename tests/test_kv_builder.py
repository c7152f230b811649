"""vLLM 0.33's builder path, on a stand-in of vLLM 0.33's planning flow.

vLLM 0.33 has no CPU build, so it cannot run here. What runs instead is a
STAND-IN written for this test: vLLM 0.33's engine-core KV planning
(``Core._initialize_kv_caches`` and ``kv_cache_planning.get_kv_cache_configs``)
reproduced step by step on vLLM 0.32's own functions, with 0.33's
``DefaultKVCacheConfigBuilder`` likewise rebuilt on them, and 0.33's platform
hook added to 0.32's ``Platform``; vLLM reports version 0.33.0 meanwhile, so
vllm-kvmem's adapter takes its 0.33 routes into a stand-in
``kv_cache_planning`` module (:data:`PLANNING_033`, checked against the
parameters the adapter expects on 0.33). Everything of vllm-kvmem's is real:
the hook patch is applied with the registry, the executor patches run their
replacement functions, the builder is the one vLLM would instantiate.
``tests/test_vllm_versions.py`` checks, in 0.33.0's wheel, that the flow
still makes the calls this stand-in makes (:data:`STANDIN_CALLS`).

The builder path must give what the 0.32 planner patch gives: the same
configs, the same refusals, the same startup table.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from functools import partial
from types import SimpleNamespace

import pytest
import vllm
from vllm.platforms import current_platform
from vllm.platforms.interface import Platform
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.kv_cache_interface import KVCacheConfig

from tests.helpers import captured_log, messages
from tests.helpers import planner_config as _config
from tests.helpers import worker_specs as _specs
from vllm_kvmem import kv_builder
from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.patches import ALL_PATCHES, _registry

pytestmark = pytest.mark.usefixtures("vllm_patched")

BIG = 1 << 40
STANDIN_DEFAULT = f"{__name__}.DefaultBuilder033"

#: Calls 0.33.0's ``get_kv_cache_configs`` makes, that the stand-in flow below
#: mirrors (``tests/test_vllm_versions.py`` compares them with the wheel).
STANDIN_CALLS = {
    "get_kv_cache_config_builder",
    "_project_kv_cache_groups_to_worker",
    "_pool_bytes_per_block_from_builder",
    "builder.get_kv_cache_config_from_groups",
    "_auto_fit_max_model_len",
    "_check_enough_kv_cache_memory",
    "kv_cache_groups_tp_replicas",
}


class DefaultBuilder033:
    """0.33's ``DefaultKVCacheConfigBuilder``, on 0.32's functions (stand-in)."""

    def get_kv_cache_groups(self, vllm_config, kv_cache_spec):
        return ku.get_kv_cache_groups(vllm_config, kv_cache_spec)

    def get_kv_cache_config_from_groups(self, vllm_config, kv_cache_groups, num_blocks):
        if not kv_cache_groups:
            return KVCacheConfig(1, [], kv_cache_groups)
        bpb = ku._pool_bytes_per_block(vllm_config, kv_cache_groups)
        return ku.get_kv_cache_config_from_groups(
            vllm_config, kv_cache_groups, num_blocks * bpb
        )

    def _get_pool_bytes_per_block(self, vllm_config, kv_cache_groups):
        return None


class VendorBuilder(DefaultBuilder033):
    """A platform's own builder (as vllm-ascend ships one)."""


def _pool_bytes_per_block_from_builder(builder, vllm_config, kv_cache_groups):
    """0.33's function of that name (stand-in): the builder's figure, else a
    one-block probe with the override suppressed."""
    groups = kv_cache_groups
    if not groups:
        return 0
    pool = builder._get_pool_bytes_per_block(vllm_config, groups)
    if pool is not None:
        return pool
    cache = vllm_config.cache_config
    saved, cache.num_gpu_blocks_override = cache.num_gpu_blocks_override, None
    try:
        probe = builder.get_kv_cache_config_from_groups(vllm_config, groups, 1)
    finally:
        cache.num_gpu_blocks_override = saved
    (size,) = {t.size for t in probe.kv_cache_tensors}
    return size


def _get_kv_cache_builder(vllm_config):
    """0.33's ``get_kv_cache_config_builder``: the platform hook, no args."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    name = current_platform.get_kv_cache_config_builder_cls(vllm_config)
    return resolve_obj_by_qualname(name)()


def _get_kv_cache_configs_033(vllm_config, specs, available, global_groups):
    """0.33's ``kv_cache_planning.get_kv_cache_configs`` (stand-in; auto-fit
    and tensor-parallel replicas left out: max_model_len is explicit here,
    and replicas are not planned)."""
    builder = _get_kv_cache_builder(vllm_config)
    projected = [ku._project_kv_cache_groups_to_worker(global_groups, w) for w in specs]
    pool = partial(_pool_bytes_per_block_from_builder, builder, vllm_config)
    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        available = [
            override * pool(g) if g else a for g, a in zip(projected, available)
        ]
    check = [a - pool(g) if g else a for g, a in zip(projected, available)]
    for groups, mem in zip(projected, check):
        if groups:
            ku._check_enough_kv_cache_memory(
                mem,
                partial(ku._max_memory_usage_bytes_from_groups, vllm_config, groups),
                vllm_config.model_config.max_model_len,
                partial(ku._estimate_max_model_len_from_groups, vllm_config, groups),
            )
    configs = [
        builder.get_kv_cache_config_from_groups(
            vllm_config, groups, mem // pool(groups) if groups else 1
        )
        for groups, mem in zip(projected, available)
    ]
    least = min(c.num_blocks for c in configs)
    return [
        c
        if c.num_blocks == least
        else builder.get_kv_cache_config_from_groups(
            vllm_config, c.kv_cache_groups, least
        )
        for c in configs
    ]


def _patch_replacement(name):
    record = next(p for p in ALL_PATCHES if p.name == name)
    return record.make_replacement


def _get_global_kv_cache_groups(vllm_config, kv_cache_specs):
    """0.33's ``get_global_kv_cache_groups`` (stand-in): every worker's specs
    merged, grouped by the builder the platform hook names."""
    merged = {n: s for w in kv_cache_specs for n, s in w.items()}
    builder = _get_kv_cache_builder(vllm_config)
    return builder.get_kv_cache_groups(vllm_config, merged)


def _max_memory_usage_bytes_from_groups(builder, vllm_config, kv_cache_groups):
    """0.33's signature (the builder first), 0.32's arithmetic (stand-in)."""
    return ku._max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups)


#: A stand-in of 0.33's ``vllm.v1.core.kv_cache_planning`` with what
#: vllm-kvmem's adapter calls there (``vllm_adapter.VLLM_HELPERS``, 0.33).
PLANNING_033 = {
    "get_global_kv_cache_groups": _get_global_kv_cache_groups,
    "_project_kv_cache_groups_to_worker": ku._project_kv_cache_groups_to_worker,
    "_pool_bytes_per_block_from_builder": _pool_bytes_per_block_from_builder,
    "_max_memory_usage_bytes_from_groups": _max_memory_usage_bytes_from_groups,
}


@contextlib.contextmanager
def vllm_033():
    """vLLM reports 0.33.0 and has the stand-in planning module, so that
    vllm-kvmem's adapter takes its 0.33 routes (through the platform's
    builder) with the helper signatures it checks for 0.33."""
    module = types.ModuleType("vllm.v1.core.kv_cache_planning")
    for name, func in PLANNING_033.items():
        setattr(module, name, func)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, module.__name__, module)
        mp.setattr(vllm, "__version__", "0.33.0")
        mp.setattr(va, "_checked", {})
        assert va.plans_through_builder()
        yield


def engine_core_033(vllm_config, specs, limits):
    """0.33's ``Core._initialize_kv_caches`` around the planner, with
    vllm-kvmem's executor patches (their real replacement functions) on a
    stand-in executor that has these workers' specs and limits, and the
    adapter on its 0.33 routes."""
    executor = SimpleNamespace(
        vllm_config=vllm_config,
        collective_rpc=lambda method: [None] * len(specs),
        get_kv_cache_specs=lambda: specs,
    )
    with vllm_033():
        global_groups = _get_global_kv_cache_groups(vllm_config, specs)
        available = _patch_replacement("executor_device_limits")(lambda self: limits)(
            executor
        )
        configs = _get_kv_cache_configs_033(
            vllm_config, specs, available, global_groups
        )
        _patch_replacement("executor_kv_cache_init")(lambda self, c: None)(
            executor, configs
        )
    return configs


@pytest.fixture
def hook_033(monkeypatch):
    """0.33's platform hook on 0.32's ``Platform`` (naming the stand-in default
    builder, as 0.33's names ``DefaultKVCacheConfigBuilder``), and vllm-kvmem's
    hook patch applied on it by the registry; both gone after the test."""
    monkeypatch.setattr(
        Platform,
        "get_kv_cache_config_builder_cls",
        classmethod(lambda cls, vllm_config: STANDIN_DEFAULT),
        raising=False,
    )
    record = next(p for p in ALL_PATCHES if p.name == "kv_cache_builder")
    assert _registry.apply(record)
    assert _registry.is_applied(record)


def _same(a, b):
    assert [c.num_blocks for c in a] == [c.num_blocks for c in b]
    assert a == b  # tensors, groups and every field


CASES = {
    "pp-prop tp2 x pp2, 6/2 layers": dict(tp=2, layers=[6, 2]),
    "pp-prop, bytes not layers": dict(layers=[4, 4], heads=[2, 8]),
    "tokens 5,000": dict(tp=2, layers=[6, 2], heads=[2, 4], tokens=5000),
    "tokens 100,001": dict(layers=[6, 2], tokens=100_001),
    "no kvmem flag": dict(layers=[6, 2], flag=False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_builder_path_gives_the_planner_patch_configs(model_8l, hook_033, case):
    def build(path):
        cfg = _config(
            model_8l,
            tp=case.get("tp", 1),
            tokens=case.get("tokens"),
            flag=case.get("flag", True),
        )
        specs = _specs(
            cfg, case["layers"], tp=case.get("tp", 1), heads=case.get("heads")
        )
        return path(cfg, specs, [BIG] * len(specs))

    expected = build(ku.get_kv_cache_configs)  # vLLM 0.32 with the planner patch
    with captured_log("vllm.kvmem.capacity_table") as records:
        got = build(engine_core_033)
    _same(got, expected)
    (table,) = [m for m in messages(records) if m.startswith("KV cache per rank")]
    assert f"{got[0].num_blocks:,}" in table


def test_no_kvmem_flag_selects_the_platform_builder(model_8l, hook_033):
    cfg = _config(model_8l, flag=False)
    assert current_platform.get_kv_cache_config_builder_cls(cfg) == STANDIN_DEFAULT
    on = _config(model_8l)
    assert current_platform.get_kv_cache_config_builder_cls(on) == kv_builder.QUALNAME
    tokens = _config(model_8l, pp=1, tokens=4096)
    assert (
        current_platform.get_kv_cache_config_builder_cls(tokens) == kv_builder.QUALNAME
    )


def test_the_pipeline_split_holds_the_budget(model_8l, hook_033):
    cfg = _config(model_8l, budget=64 << 20)
    configs = engine_core_033(cfg, _specs(cfg, [6, 2]), [BIG, BIG])
    sizes = [max(t.size for t in c.kv_cache_tensors) for c in configs]
    assert sizes[0] == 3 * sizes[1]  # 6 layers against 2
    bpb = sum(sizes) // configs[0].num_blocks
    assert (64 << 20) - bpb < sum(sizes) <= 64 << 20


REFUSALS = {
    "share above a device": dict(budget=1 << 30, limits=[300 << 20, BIG]),
    "tokens above a device": dict(tokens=200_000, limits=[BIG, 10 << 20]),
    "tokens below one sequence": dict(tokens=100, limits=[BIG, BIG]),
    "share below one sequence": dict(budget=1 << 20, limits=[BIG, BIG]),
}


@pytest.mark.parametrize("case", REFUSALS.values(), ids=REFUSALS)
def test_refusals_are_the_planner_patch_refusals(model_8l, hook_033, case):
    def refusal(path):
        cfg = _config(
            model_8l, budget=case.get("budget", 64 << 20), tokens=case.get("tokens")
        )
        with pytest.raises(ValueError) as e:
            path(cfg, _specs(cfg, [6, 2]), case["limits"])
        return str(e.value)

    expected = refusal(ku.get_kv_cache_configs)
    assert expected.startswith(("--kv-cache-tokens", "--enable-pp-prop-kv-cache"))
    assert refusal(engine_core_033) == expected


def test_num_gpu_blocks_override_still_wins(model_8l, hook_033):
    cfg = _config(model_8l)
    cfg.cache_config.num_gpu_blocks_override = 7
    configs = engine_core_033(cfg, _specs(cfg, [6, 2]), [64 << 20] * 2)
    assert [c.num_blocks for c in configs] == [7, 7]


def test_outside_planning_the_builder_passes_vllm_counts_through(model_8l, hook_033):
    """Workers build a minimal cache for profiling through the same builder
    (0.33's ``_init_minimal_kv_cache_for_profiling``): before the engine core
    plans and after it is done, vLLM's count stands."""
    cfg = _config(model_8l, tokens=100_001)
    specs = _specs(cfg, [6, 2])
    builder = _get_kv_cache_builder(cfg)
    assert isinstance(builder, kv_builder.KVMemKVCacheConfigBuilder)
    groups = builder.get_kv_cache_groups(cfg, specs[0])
    assert builder.get_kv_cache_config_from_groups(cfg, groups, 3).num_blocks == 3
    planned = engine_core_033(cfg, specs, [BIG, BIG])[0].num_blocks
    assert planned > 3
    assert builder.get_kv_cache_config_from_groups(cfg, groups, 3).num_blocks == 3
    assert builder.get_kv_cache_config_from_groups(cfg, groups, 10**6).num_blocks == (
        10**6
    )


def test_a_platform_with_its_own_builder_is_refused_by_name(
    model_8l, hook_033, monkeypatch
):
    own = classmethod(lambda cls, vllm_config: f"{__name__}.VendorBuilder")
    monkeypatch.setattr(type(current_platform), "get_kv_cache_config_builder_cls", own)
    cfg = _config(model_8l, tokens=4096)
    with pytest.raises(ValueError) as e:
        engine_core_033(cfg, _specs(cfg, [6, 2]), [BIG, BIG])
    assert type(current_platform).__name__ in str(e.value)
    assert "VendorBuilder" in str(e.value)


def test_auto_max_model_len_is_refused_on_the_builder_path(model_8l, hook_033):
    cfg = _config(model_8l, tokens=4096)
    cfg.model_config.original_max_model_len = -1
    with pytest.raises(ValueError, match="--max-model-len auto"):
        engine_core_033(cfg, _specs(cfg, [6, 2]), [BIG, BIG])


def test_without_the_hook_nothing_of_the_builder_path_runs(model_8l, caplog):
    """vLLM 0.32 (no builders): the executor patch plans nothing, the planner
    patch does it all."""
    assert not va.plans_through_builder()
    cfg = _config(model_8l, tokens=4096)
    specs = _specs(cfg, [6, 2])
    executor = SimpleNamespace(
        vllm_config=cfg, collective_rpc=lambda m: [None, None], get_kv_cache_specs=None
    )
    with caplog.at_level(logging.INFO):
        _patch_replacement("executor_device_limits")(lambda self: [BIG, BIG])(executor)
    assert "kv_plan" not in cfg.additional_config.get("kvmem_runtime", {})
    assert ku.get_kv_cache_configs(cfg, specs, [BIG, BIG])[0].num_blocks > 1


def test_the_stand_in_makes_the_calls_0_33s_flow_makes(wheel_033):
    """If 0.33's ``get_kv_cache_configs`` calls something else, the stand-in
    above is stale: this fails (0.33.0's wheel, read, not imported)."""
    calls = wheel_033.calls("vllm.v1.core.kv_cache_planning:get_kv_cache_configs")
    plain = {"enumerate", "len", "min", "partial", "sum", "zip"}
    internal = {
        c
        for c in calls
        if c.startswith("builder.") or ("." not in c and c not in plain)
    }
    assert internal == STANDIN_CALLS
