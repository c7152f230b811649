"""The one vLLM adapter: every vLLM function it calls is in its table, each
still has the parameters we call it with, and no other module reaches into
vLLM's KV-cache internals or re-derives the stage of a rank."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.host_tier.kv_region import config_slot_bytes
from vllm_kvmem.host_tier_setup import pipeline_block_bytes

PACKAGE = Path(va.__file__).resolve().parent


INSTALLED = [h for h in va.VLLM_HELPERS if va.vllm_series() in h.versions]


@pytest.mark.parametrize("helper", INSTALLED, ids=lambda h: h.name)
def test_helper_exists_with_expected_signature(helper):
    """On the installed vLLM; every series' entries are read from its sources
    in tests/test_vllm_versions.py."""
    assert callable(helper.check_signature())  # raises if vLLM changed it


def test_every_helper_has_one_entry_per_series():
    for name in {h.name for h in va.VLLM_HELPERS}:
        for series in va.SERIES:
            found = [
                h for h in va.VLLM_HELPERS if h.name == name and series in h.versions
            ]
            assert len(found) <= 1, (name, series)


def test_a_changed_helper_is_detected():
    moved = dataclasses.replace(va.VLLM_HELPERS[0], signature=("vllm_config",))
    with pytest.raises(RuntimeError, match="this vLLM is not supported"):
        moved.check_signature()


def test_table_is_exactly_what_the_adapter_calls():
    source = Path(va.__file__).read_text()
    called = set(re.findall(r'_vllm\("(\w+)"\)', source))
    assert called == {h.name for h in va.VLLM_HELPERS}
    assert any(h.private for h in va.VLLM_HELPERS)


def _imports_from(path: Path) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out.append((node.value.id, node.attr))
    return out


def test_no_other_module_calls_vllm_private_kv_helpers():
    private = {h.name for h in va.VLLM_HELPERS if h.private}
    offenders = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "vllm_adapter.py"
        for _module, name in _imports_from(path)
        if name in private
    ]
    assert offenders == []


def test_no_other_module_derives_stages_from_layer_sets():
    # The stage of a rank was once derived from its layer set in five places.
    pattern = re.compile(r"frozenset\(.*layer_names")
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "vllm_adapter.py" and pattern.search(path.read_text())
    ]
    assert offenders == []


def test_stages_from_specs_and_from_configs():
    # TP=2 x PP=2: ranks 0-1 hold layers a, b; ranks 2-3 hold c.
    specs = [{"a": 1, "b": 1}, {"b": 1, "a": 1}, {"c": 1}, {"c": 1}]
    assert va.stage_of_each_rank(specs) == [0, 0, 1, 1]
    assert va.first_rank_of_each_stage([0, 0, 1, 1]) == [0, 2]

    def config(*names):
        group = SimpleNamespace(layer_names=list(names))
        return SimpleNamespace(kv_cache_groups=[group])

    configs = [config("a", "b"), config("c"), config("b", "a"), config("c")]
    assert va.stages_of_configs(configs) == [0, 1, 0, 1]
    assert va.layer_names(configs[2]) == {"a", "b"}


def test_pipeline_block_bytes_counts_each_stage_once():
    def config(page, *names):
        spec = SimpleNamespace(page_size_bytes=page)
        group = SimpleNamespace(layer_names=list(names), kv_cache_spec=spec)
        tensor = SimpleNamespace(
            offset=0, layers=list(names), layer_stride=page * 10, block_stride=page
        )
        return SimpleNamespace(kv_cache_groups=[group], kv_cache_tensors=[tensor])

    # TP=2 x PP=2, stage 0 with 3 layers of 4 KiB pages, stage 1 with 1.
    configs = [config(4096, "a", "b", "c"), config(4096, "d")] * 2
    assert config_slot_bytes(configs[0]) == 3 * 4096
    assert pipeline_block_bytes(configs) == 4 * 4096


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_host_slot_of_a_hybrid_model_is_one_physical_block(model_8l, layout):
    """vLLM's hybrid KV cache manager overlays its groups (a block id belongs
    to one group at a time): 2 full-attention and 6 sliding-window layers make
    4 groups of 2 layers, whose tensors alias, so a block is 2 pages, not 8."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    vllm_config = EngineArgs(
        model=str(model_8l), max_model_len=512, kv_cache_memory_bytes=64 << 20
    ).create_engine_config()
    vllm_config.cache_config.kv_cache_layout = layout  # the engine core resolves it
    kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs = {
        f"layers.{i}": FullAttentionSpec(**kw)
        if i % 4 == 3
        else SlidingWindowSpec(**kw, sliding_window=64)
        for i in range(8)
    }
    page = specs["layers.0"].page_size_bytes
    (config,) = get_kv_cache_configs(vllm_config, [specs], [400 * 2 * page])
    assert len(config.kv_cache_groups) == 4
    assert len(config.kv_cache_tensors) == 4  # one per group, overlaid
    assert config.num_blocks == 400
    assert config_slot_bytes(config) == 2 * page


def test_capacity_is_vllms(model_8l, vllm_patched):
    """Bytes per block and tokens for a block count, on a real VllmConfig,
    against vLLM's own planner run end to end."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    vllm_config = EngineArgs(
        model=str(model_8l), max_model_len=512, kv_cache_memory_bytes=64 << 20
    ).create_engine_config()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=__import__("torch").bfloat16
    )
    specs = [{f"layers.{i}": spec for i in range(8)}]
    (groups,) = va.worker_groups(vllm_config, specs)
    bpb = va.bytes_per_block(vllm_config, groups)
    assert bpb == 8 * spec.page_size_bytes
    (real,) = get_kv_cache_configs(vllm_config, specs, [100 * bpb])
    assert real.num_blocks == 100
    assert (
        va.tokens_in(vllm_config, groups, 100)
        == (get_kv_cache_capacity(vllm_config, real)[0])
    )
    assert va.sequence_bytes(vllm_config, groups) == 512 // 16 * bpb
