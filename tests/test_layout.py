"""Layout resolution for connectors that opt in, on vLLM's real resolver.

Calls the patched ``resolve_kv_cache_layout`` the way the engine core does,
with a real VllmConfig and real vLLM KV specs.
"""

from __future__ import annotations

import dataclasses

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
# Opts in and names BLHNC through vLLM's get_required_kvcache_layout() too.
REQUIRED = {**EXAMPLE, "kv_connector": "BlockOuterRequiredConnector"}
# Names BLHNC through vLLM's API only: vLLM's own resolution.
VLLM_ONLY = {**EXAMPLE, "kv_connector": "VllmOnlyBlockOuterConnector"}
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


# What CPU workers report with a connector configured: CPU_ATTN with the
# opt-in, and CPU_MLA once vllm-kvmem has withheld its block-outer layouts.
MLA_ON_CPU = [["LBNHC", "LBHNC", "LHBNC"]]
WIDE = dataclasses.replace(FULL, head_size=128)  # another page shape


@pytest.mark.parametrize(
    "specs,layouts",
    [
        ([FULL] * 8, CPU_LAYOUTS),
        ([FULL] * 4 + [SLIDING] * 4, CPU_LAYOUTS),  # hybrid, one page shape
        ([FULL] * 4 + [WIDE] * 4, CPU_LAYOUTS),  # mixed pages: block-compact only
        ([MLA] * 4, CPU_LAYOUTS),  # a backend that takes BLHNC for MLA
        ([MLA] * 4, MLA_ON_CPU),
        ([FULL] * 8, [["LBHNC"]]),
        ([FULL] * 8, [["LBNHC", "LBHNC", "BLNHC", "BLHNC"]]),  # vLLM's default
    ],
)
def test_one_rule_with_vllm(model_8l, specs, layouts):
    """The opt-in gets a block-outer layout exactly where vLLM's own
    resolution gives one to a connector that requires BLHNC through
    get_required_kvcache_layout(), judged on the same specs."""
    from vllm_kvmem.patches import kv_cache_layout
    from vllm_kvmem.patches._registry import original_of

    ours = attn_utils.resolve_kv_cache_layout(_config(model_8l), layouts, specs)
    vllms = original_of(kv_cache_layout.PATCH)(
        _config(model_8l, VLLM_ONLY), layouts, specs
    )
    assert ours.is_block_outermost == vllms.is_block_outermost


def test_hybrid_model_gets_blhnc(model_8l, layout_log):
    """Sliding-window and full-attention layers (vLLM's hybrid KV cache
    groups) take the contiguous layout, as vLLM would for a connector that
    requires it, and the line says so."""
    cfg = _config(model_8l)
    layout_log.clear()
    specs = [FULL] * 2 + [SLIDING] * 6
    layout = attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, specs)
    assert layout.name == "BLHNC"
    (line,) = messages(layout_log)
    assert "Using BLHNC KV cache layout: contiguous across layers" in line


@pytest.mark.parametrize(
    "specs,layouts,reason,resolved",
    [
        ([MLA] * 4, MLA_ON_CPU, "MLA on CPU", "LBNHC"),
        ([FULL] * 8, [["LBHNC"]], "supports only LBHNC", "LBHNC"),
    ],
)
def test_fallback_logs_one_line_naming_the_condition(
    model_8l, layout_log, specs, layouts, reason, resolved
):
    cfg = _config(model_8l)
    layout_log.clear()
    # vLLM's own choice stands, and we say why it is not the contiguous one.
    layout = attn_utils.resolve_kv_cache_layout(cfg, layouts, specs)
    assert layout.name == resolved
    (line,) = messages(layout_log)
    assert "asks for the contiguous KV layout" in line and reason in line
    assert line.endswith(f"using vLLM's {resolved} KV cache layout (per layer).")


def test_connector_requiring_blhnc_gets_the_line_its_tensors_match(
    model_8l, layout_log
):
    """A connector that opts in and names BLHNC through vLLM's API: on a
    hybrid model both agree on BLHNC (one line, saying so); on MLA on CPU,
    where vllm-kvmem withheld it, vLLM falls back and our line names the
    layout vLLM chose, never the one asked for."""
    cfg = _config(model_8l, REQUIRED)
    layout_log.clear()
    specs = [FULL] * 2 + [SLIDING] * 6
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, specs).name == "BLHNC"
    (line,) = messages(layout_log)
    assert "Using BLHNC" in line and "per layer" not in line
    for connector, asked in ((REQUIRED, "asks for"), (VLLM_ONLY, "requires BLHNC")):
        cfg = _config(model_8l, connector)
        layout_log.clear()
        layout = attn_utils.resolve_kv_cache_layout(cfg, MLA_ON_CPU, [MLA] * 4)
        assert layout.name == "LBNHC"
        (line,) = messages(layout_log)
        assert asked in line and "MLA on CPU" in line and "LBNHC" in line


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


def _worker_config(model, connector, **kw):
    return EngineArgs(
        model=str(model),
        kv_transfer_config=connector,
        kv_cache_memory_bytes=1 << 26,
        max_model_len=1024,
        **kw,
    ).create_engine_config()


def test_cpu_workers_report_blhnc_only_to_an_opt_in(model_8l):
    """CPU_ATTN's list (LBHNC) gains BLHNC for a connector that opts in, and
    for no one else (vLLM's backend selection for the model, no engine)."""
    from vllm_kvmem.layout import worker_layouts

    assert worker_layouts(_worker_config(model_8l, EXAMPLE), ["LBHNC"]) == [
        "LBHNC",
        "BLHNC",
    ]
    for connector in (None, VLLM_ONLY):
        cfg = _worker_config(model_8l, connector)
        assert worker_layouts(cfg, ["LBHNC"]) == ["LBHNC"]


def test_cpu_mla_workers_never_report_a_block_outer_layout(tmp_path):
    """vLLM's CPU MLA backends declare no layouts (any, to vLLM) but fail on
    block-outer ones: with any connector configured the worker reports only
    the layer-outer part of vLLM's list, so vLLM cannot pick BLHNC; without
    one, vLLM's list is unchanged."""
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tests.helpers import write_mla_model
    from vllm_kvmem.layout import CPU_MLA_BACKENDS, worker_layouts

    # The vLLM bug: both CPU MLA backends accept any layout. (This machine has
    # no AMX tiles, so vLLM picks CPU_MLA below; AMX_MLA is handled the same.)
    for backend in (CPUMLABackend, AMXMLABackend):
        assert backend.get_name() in CPU_MLA_BACKENDS
        assert backend.supported_kv_cache_layouts() is None
    vllms = [x.name for x in attn_utils.get_supported_kv_cache_layouts([CPUMLABackend])]
    assert "BLHNC" in vllms
    model = write_mla_model(tmp_path / "mla")
    layer_outer = [n for n in vllms if not KVCacheLayout[n].is_block_outermost]
    for connector in (EXAMPLE, REQUIRED, VLLM_ONLY):
        cfg = _worker_config(model, connector, load_format="dummy")
        assert worker_layouts(cfg, vllms) == layer_outer
    cfg = _worker_config(model, None, load_format="dummy")
    assert worker_layouts(cfg, vllms) == vllms
