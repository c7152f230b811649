"""The engine core's KV planning, as this process's vLLM runs it, on worker
layouts this machine cannot start (tensor x pipeline parallel, devices
smaller than a share).

``python -m tests.planning_probe CASES_JSON`` prints one ``REPORT {json}``
line: for each case, every rank's config (blocks, tensor sizes, group layer
names and spec), the max_model_len vLLM settled on and the startup table, or
the refusal's message. ``tests/test_kv_builder.py`` runs it with vLLM 0.32 and
with 0.33 and compares.

What is real: vLLM's configs and KV specs, vLLM's planning functions of the
release (0.32: ``kv_cache_utils.get_kv_cache_configs``; 0.33:
``get_global_kv_cache_groups``, ``kv_cache_planning.get_kv_cache_configs``
and the platform's ``KVCacheConfigBuilder``), vLLM's ``Executor`` methods
with vllm-kvmem's patches applied by its entry point. What stands in: the
workers behind the executor (``collective_rpc`` answers with each case's
device limits, as workers on those devices would), since the layouts need
more processes and devices than there are here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any

from tests.helpers import planner_config, worker_specs

#: The calls of 0.33's ``EngineCore._initialize_kv_caches`` that
#: :func:`plan_033` makes, in its order (test_kv_builder checks they are still
#: there, in the installed 0.33).
CORE_CALLS_033 = (
    "get_global_kv_cache_groups",
    "self.model_executor.determine_available_memory",
    "get_kv_cache_configs",
    "self.model_executor.initialize_from_config",
)


def _executor(cfg: Any, specs: list[dict], limits: list[int]) -> Any:
    """vLLM's ``Executor`` class, its methods as vLLM (and vllm-kvmem's
    patches) define them, over workers that answer with ``limits``."""
    from vllm.v1.executor.abstract import Executor

    class Workers(Executor):
        def collective_rpc(self, method, *args, **kwargs):
            if method == "determine_available_memory":
                return list(limits)
            return [None] * len(specs)  # vllm-kvmem's limit components

        def get_kv_cache_specs(self):
            return specs

        def _init_executor(self):  # no workers to start: they stand in
            pass

        def check_health(self):
            pass

    executor = object.__new__(Workers)
    executor.vllm_config = cfg
    return executor


def plan_032(cfg: Any, specs: list[dict], limits: list[int]) -> list[Any]:
    from vllm.v1.core import kv_cache_utils as ku

    available = _executor(cfg, specs, limits).determine_available_memory()
    return ku.get_kv_cache_configs(cfg, specs, available)


def plan_033(cfg: Any, specs: list[dict], limits: list[int]) -> list[Any]:
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    executor = _executor(cfg, specs, limits)
    groups = get_global_kv_cache_groups(cfg, specs)
    available = executor.determine_available_memory()
    configs = get_kv_cache_configs(cfg, specs, available, groups)
    executor.initialize_from_config(configs)
    return configs


try:  # vLLM 0.33: a platform's own builder, as vllm-ascend ships one
    from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder

    class VendorBuilder(DefaultKVCacheConfigBuilder):
        """A platform's own KV cache config builder."""

except ImportError:
    pass


def _summary(configs: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "num_blocks": c.num_blocks,
            "tensors": [dataclasses.asdict(t) for t in c.kv_cache_tensors],
            "groups": [
                (g.layer_names, type(g.kv_cache_spec).__name__)
                for g in c.kv_cache_groups
            ],
        }
        for c in configs
    ]


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One case: the configs vLLM plans for it, or its refusal."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    hook = platform.__dict__.get("get_kv_cache_config_builder_cls")
    if builder := case.get("platform_builder"):
        own = classmethod(lambda cls, vllm_config: builder)
        platform.get_kv_cache_config_builder_cls = own
    try:
        return _plan(case)
    finally:
        if builder and hook is None:
            del platform.get_kv_cache_config_builder_cls
        elif builder:
            platform.get_kv_cache_config_builder_cls = hook


def _plan(case: dict[str, Any]) -> dict[str, Any]:
    import vllm

    config = case.get("config", {})
    cfg = planner_config(case["model"], **config)
    if (override := case.get("override")) is not None:
        cfg.cache_config.num_gpu_blocks_override = override
    specs = worker_specs(
        cfg, case["layers"], tp=config.get("tp", 1), heads=case.get("heads")
    )
    plan = plan_033 if vllm.__version__.startswith("0.33.") else plan_032
    tables: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: tables.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvmem.capacity_table")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        configs = plan(cfg, specs, case["limits"])
    except ValueError as e:
        return {"refused": str(e)}
    finally:
        logger.removeHandler(handler)
    return {
        "configs": _summary(configs),
        "max_model_len": cfg.model_config.max_model_len,
        "tables": [t for t in tables if t.startswith("KV cache per rank")],
    }


def main(argv: list[str]) -> None:
    from vllm_kvmem import register

    assert register() is True
    cases = json.loads(argv[0])
    print("REPORT " + json.dumps({name: run_case(c) for name, c in cases.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
