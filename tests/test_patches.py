"""Every patch: its vLLM target still exists with the expected signature,
applying it again is a no-op, and docs/patches.md is generated from the records."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from vllm_kvmem.patches import (
    ALL_PATCHES,
    apply_all,
    for_series,
    is_applied,
    original_of,
)
from vllm_kvmem.patches._registry import check_signature, to_markdown
from vllm_kvmem.plugin import register
from vllm_kvmem.vllm_adapter import vllm_series

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "patches.md"
#: The records for the installed vLLM (0.32); every series' targets are read
#: from its sources in tests/test_vllm_versions.py.
INSTALLED = for_series(ALL_PATCHES, vllm_series())


def test_other_series_records_are_not_applied_here():
    others = [p for p in ALL_PATCHES if p not in INSTALLED]
    assert {p.name for p in others} == {"kv_cache_builder", "executor_kv_cache_init"}


@pytest.mark.parametrize("patch", INSTALLED, ids=lambda p: p.name)
def test_target_exists_with_expected_signature(patch):
    from vllm.platforms import current_platform

    check_signature(patch)  # raises if vLLM moved or changed the target
    # Applied exactly where it belongs (this suite runs on the CPU platform;
    # tests/test_gpu_safety.py loads the plugin on a non-CPU one).
    assert is_applied(patch) == patch.applies_to(current_platform)


@pytest.mark.parametrize("patch", INSTALLED, ids=lambda p: p.name)
def test_applying_twice_changes_nothing(patch):
    from vllm.platforms import current_platform

    if not patch.applies_to(current_platform):
        pytest.skip(f"not a {current_platform.device_name} patch (test_gpu_safety)")
    owner, attr, before = patch.resolve()
    assert apply_all([patch]) == []
    assert register() is True
    _, _, after = patch.resolve()
    assert after is before
    assert original_of(patch) is not before


def test_a_moved_target_is_detected():
    moved = dataclasses.replace(ALL_PATCHES[-1], signature=("self", "renamed"))
    with pytest.raises(RuntimeError, match="not supported"):
        check_signature(moved)


def test_imported_names_are_rebound():
    import vllm.v1.core.kv_cache_utils as ku
    import vllm.v1.engine.core as core

    assert core.get_kv_cache_configs is ku.get_kv_cache_configs
    assert is_applied(next(p for p in ALL_PATCHES if p.name == "kv_cache_configs"))


def test_options_are_not_already_engine_args_fields():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvmem.config import KVMemConfig

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert not fields & set(KVMemConfig.option_names())


@pytest.mark.parametrize("patch", INSTALLED, ids=lambda p: p.name)
def test_wrapper_keeps_the_original_signature_and_metadata(patch):
    """Tools that introspect vLLM (``inspect.signature(EngineArgs)`` lists 256
    parameters) see the same callable with the plugin registered."""
    from vllm.platforms import current_platform

    if not patch.applies_to(current_platform):
        pytest.skip(f"not a {current_platform.device_name} patch (test_gpu_safety)")
    _, _, raw = patch.resolve()
    current = getattr(raw, "__func__", raw)
    original = original_of(patch)
    assert current is not original  # applied
    assert inspect.signature(current) == inspect.signature(original)
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        assert getattr(current, attr) == getattr(original, attr), attr


def test_engine_args_signature_is_vllms():
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    for cls in (EngineArgs, AsyncEngineArgs):
        params = inspect.signature(cls).parameters
        assert "kwargs" not in params and len(params) == len(dataclasses.fields(cls))


def test_unknown_vllm_version_patches_nothing(monkeypatch):
    from vllm_kvmem import plugin

    monkeypatch.setattr(plugin, "_state", {"done": False, "patched": False})
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.34.1")
    assert plugin.register() is False


def test_cpu_only_patches_target_cpu_modules_and_nothing_else_does():
    """The platform gate is only as good as the records: a patch whose target
    lives in a CPU-only vLLM module must be CPU-only, and a CPU-only patch
    must not hide a target that other platforms need."""
    cpu_modules = ("vllm.v1.worker.cpu", "vllm.v1.attention.backends.cpu")
    # CPU-only on a shared target, on purpose: CPU_ATTN's layouts, widened by
    # the worker (which knows its connector) and only on CPU.
    cpu_only_on_shared_targets = {"cpu_attn_layouts"}
    for p in ALL_PATCHES:
        if p.module_name.startswith(cpu_modules):
            assert p.platforms == ("cpu",), p
        elif p.platforms == ("cpu",):
            assert p.name in cpu_only_on_shared_targets, p


def test_a_record_must_say_what_it_does_with_no_flag():
    with pytest.raises(ValueError, match="with no kvmem flag"):
        dataclasses.replace(ALL_PATCHES[0], idle="")


def test_a_record_with_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="platforms must be"):
        dataclasses.replace(ALL_PATCHES[0], platforms=("tpu",))


def test_docs_are_generated_from_the_records():
    assert DOCS.read_text() == to_markdown(ALL_PATCHES) + "\n"


def test_model_config_patch_drops_only_the_connector_the_flag_added(tmp_path):
    """engine_args_model_config: the host tier connector that
    ``--kv-host-cache-bytes`` added goes for a model the tier cannot serve
    (the whole startup: tests/test_host_tier_config.py); the same connector
    named by hand, a model the tier serves, and no kvmem flag are left as
    vLLM has them."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from tests.helpers import captured_log, write_mla_model
    from vllm_kvmem.host_tier_setup import (
        CONNECTOR_NAME,
        MODULE_PATH,
        add_connector_config,
    )
    from vllm_kvmem.tiny_model import build_tiny_model

    mla = write_mla_model(tmp_path / "mla")
    served = build_tiny_model(tmp_path / "tiny", num_layers=2)

    def args(model, **kw):
        return EngineArgs(
            model=str(model), load_format="dummy", max_model_len=1024, **kw
        )

    def connector(a):
        return getattr(a.kv_transfer_config, "kv_connector", None)

    by_flag = args(mla, kv_host_cache_bytes="64M")
    served_by_flag = args(served, kv_host_cache_bytes="64M")
    by_hand = args(
        mla,
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_connector_module_path=MODULE_PATH,
            kv_role="kv_both",
        ),
    )
    plain = args(mla)
    for a in (by_flag, served_by_flag):
        add_connector_config(a)
        assert connector(a) == CONNECTOR_NAME
    with captured_log("vllm.kvmem") as records:
        for a in (by_flag, served_by_flag, by_hand, plain):
            a.create_model_config()
    off = [r.getMessage() for r in records if "Host KV tier off" in r.getMessage()]
    assert off == [
        "Host KV tier off: the model uses MLA; serving continues without it."
    ]
    assert connector(by_flag) is None
    assert connector(served_by_flag) == connector(by_hand) == CONNECTOR_NAME
    assert plain.kv_transfer_config is None
