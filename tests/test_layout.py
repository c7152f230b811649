"""Layout resolution for connectors that opt in, on vLLM's real resolver.

Calls the patched ``resolve_kv_cache_layout`` the way the engine core does,
with a real VllmConfig and real vLLM KV specs.
"""

from __future__ import annotations

import pytest
import torch
import vllm.v1.attention.backends.utils as attn_utils
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tests.helpers import captured_log, messages

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


EXAMPLE = {
    "kv_connector": "ContiguousLayoutExampleConnector",
    "kv_connector_module_path": "tests.contiguous_example",
    "kv_role": "kv_both",
}
FULL = FullAttentionSpec(
    block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
)
SLIDING = SlidingWindowSpec(
    block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
    sliding_window=256,
)  # fmt: skip
MLA = MLAAttentionSpec(
    block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
)
CPU_LAYOUTS = [["LBHNC", "BLHNC"]]


def _config(model, connector=EXAMPLE):
    return EngineArgs(
        model=str(model), kv_transfer_config=connector, kv_cache_memory_bytes=1 << 26
    ).create_engine_config()


@pytest.fixture
def layout_log(model_8l):
    """The layout module's log records while the test runs."""
    # vLLM configures its loggers when it first builds a config: do that first.
    _config(model_8l, None)
    with captured_log("vllm.kvmem.layout") as records:
        yield records


def test_opted_in_uniform_model_gets_blhnc(model_8l, layout_log):
    cfg = _config(model_8l)
    layout_log.clear()
    layout = attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS * 2, [FULL] * 8)
    assert layout.name == "BLHNC" and layout.is_block_outermost
    assert cfg.cache_config.kv_cache_layout == "BLHNC"
    assert any("contiguous across layers" in m for m in messages(layout_log))


def test_no_connector_or_no_opt_in_keeps_vllms_choice(model_8l, layout_log):
    assert attn_utils.resolve_kv_cache_layout(
        _config(model_8l, None), CPU_LAYOUTS, [FULL]
    ).name == ("LBHNC")
    example = {**EXAMPLE, "kv_connector": "ExampleConnector"}
    example.pop("kv_connector_module_path")
    example["kv_connector_extra_config"] = {"shared_storage_path": "/tmp/kvmem-x"}
    cfg = _config(model_8l, example)
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, [FULL]).name == "LBHNC"
    assert layout_log == []  # nothing said when nobody asked


@pytest.mark.parametrize(
    "specs,layouts,reason",
    [
        ([FULL] * 4 + [SLIDING] * 4, CPU_LAYOUTS, "not one uniform KV cache group"),
        ([MLA] * 4, [["LBHNC", "BLHNC"]], "MLA"),
        ([FULL] * 8, [["LBHNC"]], "supports only LBHNC"),
    ],
)
def test_fallback_logs_one_line_naming_the_condition(
    model_8l, layout_log, specs, layouts, reason
):
    cfg = _config(model_8l)
    # vLLM's own choice stands, and we say why it is not the contiguous one.
    layout = attn_utils.resolve_kv_cache_layout(cfg, layouts, specs)
    assert layout.name == "LBHNC"
    said = [m for m in messages(layout_log) if "asks for the contiguous KV layout" in m]
    assert len(said) == 1 and reason in said[0], messages(layout_log)


def _set_layout_env(monkeypatch, value):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", value)
    import vllm.envs as envs

    if hasattr(envs, "cache_clear"):
        envs.cache_clear()


def test_explicit_env_layout_wins(model_8l, layout_log, monkeypatch):
    _set_layout_env(monkeypatch, "LBHNC")
    cfg = _config(model_8l)
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, [FULL]).name == "LBHNC"
    assert any("VLLM_KV_CACHE_LAYOUT=LBHNC" in m for m in messages(layout_log))


def test_env_layout_is_read_before_the_connector_is_imported(model_8l, monkeypatch):
    """vLLM's order: VLLM_KV_CACHE_LAYOUT first, and then the connector is not
    consulted, so a connector class that cannot be imported fails where vLLM
    fails (when the connector is built), not during layout resolution."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = _config(model_8l)
    asked = []
    real = KVConnectorFactory.get_connector_class.__func__

    def recording(cls, kv_transfer_config):
        asked.append(kv_transfer_config.kv_connector)
        return real(cls, kv_transfer_config)

    monkeypatch.setattr(
        KVConnectorFactory, "get_connector_class", classmethod(recording)
    )
    _set_layout_env(monkeypatch, "LBHNC")
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, [FULL]).name == "LBHNC"
    assert asked == []


def test_cpu_backend_declaration_is_vllms():
    """The plugin does not widen CPU_ATTN's own declaration: BLHNC is added by
    a worker whose connector opts in (tests/test_layout_engine.py)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    names = [x.name for x in CPUAttentionBackend.supported_kv_cache_layouts()]
    assert names == ["LBHNC"]
