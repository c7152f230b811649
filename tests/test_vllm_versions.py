"""Every patch record against the sources of every vLLM release it names.

vLLM 0.32 is installed (and runs: the rest of the suite); vLLM 0.33's
sources are read from its CUDA wheel as released, fetched through pip (its
cache first; the ``wheel_033`` fixture in conftest.py) and not imported
(0.33 also runs, on CPU: ``tests/test_vllm033_engine.py``). For each
release a record names, its target must exist there with the parameters the
record expects; a record that names a release whose target moved fails here.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from kvmem_tools.vllm_sources import SourceTree
from tests.helpers import run_probe
from vllm_kvmem.patches import ALL_PATCHES, original_of
from vllm_kvmem.patches._registry import KNOWN_SERIES
from vllm_kvmem.vllm_adapter import VLLM_HELPERS


@pytest.fixture(scope="session")
def installed() -> SourceTree:
    import vllm

    return SourceTree(Path(vllm.__file__).resolve().parent.parent)


def _tree(request, series: str) -> SourceTree:
    return request.getfixturevalue("installed" if series == "0.32" else "wheel_033")


def _cases(records):
    """``(series, record)`` for every series each record (a patch or an
    adapter helper) names."""
    return [
        pytest.param(series, record, id=f"{series}-{record.name}")
        for series in KNOWN_SERIES
        for record in records
        if series in record.versions
    ]


def _expected(patch, params: tuple[str, ...]) -> tuple[str, ...]:
    return params[: len(patch.signature)] if patch.signature_is_prefix else params


@pytest.mark.parametrize("series,patch", _cases(ALL_PATCHES))
def test_record_target_exists_with_its_signature(request, series, patch):
    tree = _tree(request, series)
    assert tree.version().startswith(series + ".")
    assert _expected(patch, tree.parameters(patch.target)) == patch.signature


@pytest.mark.parametrize(
    "patch", [p for p in ALL_PATCHES if "0.32" in p.versions], ids=lambda p: p.name
)
def test_source_reader_agrees_with_the_running_vllm(installed, patch):
    """The reader is right where it can be checked: on the installed 0.32 it
    gives exactly the parameters Python gives for the real objects (a
    dataclass's generated ``__init__`` included)."""
    real = tuple(inspect.signature(original_of(patch)).parameters)
    assert installed.parameters(patch.target) == real


def test_a_misnamed_or_moved_target_is_caught(request, installed, wheel_033):
    record = ALL_PATCHES[0]
    misnamed = dataclasses.replace(record, target=record.target + "_renamed")
    for tree in (installed, wheel_033):
        with pytest.raises(LookupError, match="no function"):
            tree.parameters(misnamed.target)
    # vLLM 0.33 moved KV cache planning out of kv_cache_utils (behind a
    # KVCacheConfigBuilder): the 0.32 planner record names 0.32 only.
    planner = next(p for p in ALL_PATCHES if p.name == "kv_cache_configs")
    assert planner.versions == ("0.32",)
    with pytest.raises(LookupError):
        wheel_033.parameters(planner.target)


@pytest.mark.parametrize("series,helper", _cases(VLLM_HELPERS))
def test_adapter_helper_exists_with_its_signature(request, series, helper):
    """The vLLM functions the adapter calls, per series: 0.33 moved five of
    them to kv_cache_planning, three of those now take the builder."""
    assert _tree(request, series).parameters(helper.target) == helper.signature


BUILDER_033 = "vllm.v1.core.kv_cache_config_builder"
PLANNING_033 = "vllm.v1.core.kv_cache_planning"


def test_our_builder_has_the_0_33_interface(wheel_033):
    """Every method of 0.33's ``KVCacheConfigBuilder`` (the abstract ones and
    the pool-bytes hook vLLM calls), with the same parameters."""
    from vllm_kvmem.budget.kv_builder import KVMemKVCacheConfigBuilder

    for method in (
        "get_kv_cache_groups",
        "get_kv_cache_config_from_groups",
        "_get_pool_bytes_per_block",
    ):
        theirs = wheel_033.parameters(f"{BUILDER_033}:KVCacheConfigBuilder.{method}")
        ours = inspect.signature(getattr(KVMemKVCacheConfigBuilder, method))
        assert tuple(ours.parameters) == theirs, method


def test_0_33_instantiates_the_builder_the_platform_names(wheel_033):
    """The hook vllm-kvmem patches is what 0.33 asks, and the class it names is
    built with no arguments (so ours must be, and resolves its inner builder
    per call)."""
    calls = wheel_033.calls(f"{BUILDER_033}:get_kv_cache_config_builder")
    assert calls["current_platform.get_kv_cache_config_builder_cls"] == [1]
    assert calls["builder_cls"] == [0]


def test_registration_accepts_0_32_and_0_33_and_refuses_other_series():
    code = """
import json, logging, vllm
from vllm_kvmem import plugin
seen = []
class Catch(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("vllm.kvmem.plugin").addHandler(Catch())
vllm.__version__ = VERSION
print("REPORT " + json.dumps({"active": plugin.register(), "log": seen}))
"""
    refused = run_probe(code.replace("VERSION", "'0.34.0'"))
    assert refused["active"] is False
    (line,) = refused["log"]
    assert "supports vLLM 0.32.x and 0.33.x only, found 0.34.0" in line
    assert run_probe(code.replace("VERSION", "'0.32.9'"))["active"] is True


def test_a_record_with_an_unknown_series_is_refused():
    with pytest.raises(ValueError, match="versions must be"):
        dataclasses.replace(ALL_PATCHES[0], versions=("0.31",))
