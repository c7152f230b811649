"""Layout resolution for connectors that require a block-outer layout
through vLLM's ``get_required_kvcache_layout()``, on vLLM's real resolver.

Calls the patched ``resolve_kv_cache_layout`` the way the engine core does,
with a real VllmConfig and real vLLM KV specs, and the patched worker's list
with vLLM's real backend selection.
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
}  # requires BLHNC through vLLM's get_required_kvcache_layout()


def requiring(layout):
    """The example connector, requiring ``layout`` (None: no layout)."""
    return {**EXAMPLE, "kv_connector_extra_config": {"kv_cache_layout": layout}}


# vLLM's own ExampleConnector: get_required_kvcache_layout() is the base's None.
VLLM_EXAMPLE = {
    "kv_connector": "ExampleConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/kvmem-x"},
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
WIDE = dataclasses.replace(FULL, head_size=128)  # another page shape
# What CPU workers report with a connector configured: CPU_ATTN for a connector
# requiring a block-outer layout, CPU_MLA once vllm-kvmem has withheld its
# block-outer layouts; and a GPU worker whose backends declare nothing.
CPU_LAYOUTS = [["LBHNC", "BLHNC"]]
MLA_ON_CPU = [["LBNHC", "LBHNC", "LHBNC"]]
ANY = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]


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


@pytest.fixture
def vllm_log(model_8l):
    """vLLM's own resolver's log records (its fallback warning)."""
    _config(model_8l, None)
    with captured_log("vllm.v1.attention.backends.utils") as records:
        yield records


@pytest.mark.parametrize(
    "specs",
    [
        [FULL] * 8,
        [FULL] * 2 + [SLIDING] * 6,  # hybrid: vLLM's KV cache groups
        [FULL] * 4 + [WIDE] * 4,  # mixed pages: block-compact only, as BLHNC is
    ],
)
def test_connector_requiring_blhnc_gets_it(model_8l, layout_log, specs):
    """vLLM's own rule takes the connector's BLHNC; our one line says so."""
    cfg = _config(model_8l)
    layout_log.clear()
    layout = attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS * 2, specs)
    assert layout.name == "BLHNC" and layout.is_block_outermost
    assert cfg.cache_config.kv_cache_layout == "BLHNC"
    assert messages(layout_log) == [
        "Using BLHNC KV cache layout: contiguous across layers (one copy per "
        "block), requested by ContiguousLayoutExampleConnector."
    ]


@pytest.mark.parametrize("connector", [None, VLLM_EXAMPLE, requiring(None)])
def test_no_connector_or_not_asking_keeps_vllms_choice(model_8l, layout_log, connector):
    cfg = _config(model_8l, connector)
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, [FULL]).name == "LBHNC"
    assert layout_log == []  # nothing said when nobody asked


def test_a_layer_outer_requirement_is_vllms_alone(model_8l, layout_log):
    cfg = _config(model_8l, requiring("HND"))  # FlashInfer's legacy name
    assert attn_utils.resolve_kv_cache_layout(cfg, ANY, [FULL]).name == "LBHNC"
    assert layout_log == []


@pytest.mark.parametrize(
    "required,specs,layouts,reason,resolved",
    [
        ("BLHNC", [MLA] * 4, MLA_ON_CPU, "the model uses MLA on CPU", "LBNHC"),
        (
            "BLHNC",
            [FULL] * 8,
            [["LBHNC"]],
            "the attention backends in use support only LBHNC",
            "LBHNC",
        ),
        (
            "BLNHC",  # CPU_ATTN reads pages as [H, N, C]: BLHNC only
            [FULL] * 8,
            CPU_LAYOUTS,
            "the attention backends in use support only LBHNC, BLHNC",
            "LBHNC",
        ),
        (
            "BHLNC",  # block-outer, not block-compact
            [FULL] * 4 + [WIDE] * 4,
            ANY,
            "the model's layers have different page shapes",
            "LBNHC",
        ),
    ],
)
def test_unmet_request_gets_vllms_fallback_and_one_line(
    model_8l, layout_log, vllm_log, required, specs, layouts, reason, resolved
):
    """vLLM falls back with its own warning; our one line says why."""
    cfg = _config(model_8l, requiring(required))
    layout_log.clear()
    vllm_log.clear()
    layout = attn_utils.resolve_kv_cache_layout(cfg, layouts, specs)
    assert layout.name == resolved
    assert any(
        f"KV connector cache layout {required} does not satisfy every supported set"
        in m
        and f"Using {resolved} instead." in m
        for m in messages(vllm_log)
    )
    (line,) = messages(layout_log)
    assert line.startswith(
        f"ContiguousLayoutExampleConnector requires the {required} KV cache "
        f"layout, but {reason}"
    )
    assert line.endswith(f"; using vLLM's {resolved} KV cache layout (per layer).")


def _set_layout_env(monkeypatch, value):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", value)
    import vllm.envs as envs

    if hasattr(envs, "cache_clear"):
        envs.cache_clear()


def test_env_layout_is_read_before_the_connector_is_imported(
    model_8l, layout_log, monkeypatch
):
    """vLLM's order: VLLM_KV_CACHE_LAYOUT first, and then the connector is not
    consulted, by vLLM or by us (no line), so a connector class that cannot be
    imported fails where vLLM fails (when the connector is built), not during
    layout resolution."""
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
    layout_log.clear()
    assert attn_utils.resolve_kv_cache_layout(cfg, CPU_LAYOUTS, [FULL]).name == "LBHNC"
    assert asked == [] and layout_log == []


def test_cpu_backend_declaration_is_vllms():
    """The plugin does not widen CPU_ATTN's own declaration: BLHNC is added by
    a worker whose connector requires a block-outer layout
    (tests/test_layout_engine.py)."""
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


def test_cpu_workers_report_blhnc_only_to_a_block_outer_request(model_8l):
    """CPU_ATTN's list (LBHNC) gains BLHNC for a connector whose
    get_required_kvcache_layout() names a block-outer layout, and for no one
    else (vLLM's backend selection for the model, no engine)."""
    from vllm_kvmem.layout import worker_layouts

    for connector in (EXAMPLE, requiring("BLNHC")):
        cfg = _worker_config(model_8l, connector)
        assert worker_layouts(cfg, ["LBHNC"]) == ["LBHNC", "BLHNC"]
    for connector in (None, VLLM_EXAMPLE, requiring(None), requiring("LBHNC")):
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
    for connector in (EXAMPLE, VLLM_EXAMPLE):
        cfg = _worker_config(model, connector, load_format="dummy")
        assert worker_layouts(cfg, vllms) == layer_outer
    cfg = _worker_config(model, None, load_format="dummy")
    assert worker_layouts(cfg, vllms) == vllms
