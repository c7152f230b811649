"""Every patch record against the sources of every vLLM release it names.

vLLM 0.32 is installed (and runs: the rest of the suite); vLLM 0.33 has no
CPU build, so its sources are read from its CUDA wheel, fetched through pip
(its cache first) and never imported. For each release a record names, its
target must exist there with the parameters the record expects; a record
that names a release whose target moved fails here.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvmem.patches import ALL_PATCHES, original_of
from vllm_kvmem.patches._registry import KNOWN_SERIES
from vllm_kvmem.vllm_adapter import VLLM_HELPERS
from vllm_kvmem.vllm_sources import SourceTree

WHEEL_033 = "vllm==0.33.0"
# What a CUDA server installs: cp312 on manylinux x86_64 (the wheel is abi3).
WHEEL_PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
]


@pytest.fixture(scope="session")
def installed() -> SourceTree:
    import vllm

    return SourceTree(Path(vllm.__file__).resolve().parent.parent)


@pytest.fixture(scope="session")
def wheel_033(tmp_path_factory) -> SourceTree:
    """vLLM 0.33.0's wheel, read in place; skipped, saying why, when pip
    cannot fetch it (no package index and nothing in pip's cache)."""
    folder = tmp_path_factory.mktemp("vllm033")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d"]
    done = subprocess.run(
        [*cmd, str(folder), *WHEEL_PLATFORM, WHEEL_033],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheels = sorted(folder.glob("vllm-0.33.0-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot fetch {WHEEL_033} through pip: {done.stderr[-500:]}")
    return SourceTree(wheels[0])


def _tree(request, series: str) -> SourceTree:
    return request.getfixturevalue("installed" if series == "0.32" else "wheel_033")


def _cases():
    return [
        pytest.param(series, patch, id=f"{series}-{patch.name}")
        for series in KNOWN_SERIES
        for patch in ALL_PATCHES
        if series in patch.versions
    ]


def _expected(patch, params: tuple[str, ...]) -> tuple[str, ...]:
    return params[: len(patch.signature)] if patch.signature_is_prefix else params


@pytest.mark.parametrize("series,patch", _cases())
def test_record_target_exists_with_its_signature(request, series, patch):
    tree = _tree(request, series)
    assert tree.version().startswith(series + ".")
    assert _expected(patch, tree.parameters(patch.target)) == patch.signature


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=lambda p: p.name)
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


def test_adapter_helpers_that_0_33_moved(wheel_033):
    """The vLLM helpers the adapter calls, on 0.33: which still match, and
    which moved with the planner (what a 0.33 adapter has to port)."""
    moved = set()
    for helper in VLLM_HELPERS:
        try:
            params = wheel_033.parameters(helper.target)
        except LookupError:
            moved.add(helper.name)
            continue
        assert params == helper.signature, helper.target
    assert moved == {
        "get_kv_cache_groups",
        "_project_kv_cache_groups_to_worker",
        "_pool_bytes_per_block",
        "_max_memory_usage_bytes_from_groups",
        "get_kv_cache_config_from_groups",
    }


def test_a_record_with_an_unknown_series_is_refused():
    with pytest.raises(ValueError, match="versions must be"):
        dataclasses.replace(ALL_PATCHES[0], versions=("0.31",))
