"""--kv-host-cache-bytes / --kv-host-cache-policy: doors, bad input, fallbacks."""

from __future__ import annotations

import psutil
import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_kvmem.host_tier import CONNECTOR_NAME

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


def _args(model, **kw):
    return EngineArgs(model=str(model), kv_cache_memory_bytes=1 << 24, **kw)


def test_size_turns_on_the_connector_from_every_door(model_8l):
    from tests.test_config import _cli

    via_cli = _cli(
        "--model", str(model_8l), "--kv-cache-memory-bytes", "16M",
        "--kv-host-cache-bytes", "64M", "--kv-host-cache-policy", "fifo",
    )  # fmt: skip
    via_kwarg = _args(model_8l, kv_host_cache_bytes="64M", kv_host_cache_policy="fifo")
    via_additional = _args(
        model_8l,
        additional_config={
            "kvmem": {"kv_host_cache_bytes": 64 << 20, "kv_host_cache_policy": "fifo"}
        },
    )
    for args in (via_cli, via_kwarg, via_additional):
        cfg = args.create_engine_config()
        assert cfg.kv_transfer_config.kv_connector == CONNECTOR_NAME
        assert cfg.additional_config["kvmem"] == {
            "kv_host_cache_bytes": 64 << 20,
            "kv_host_cache_policy": "fifo",
        }


def test_size_above_host_memory_names_option_value_and_available(model_8l):
    too_big = psutil.virtual_memory().total * 2
    with pytest.raises(ValueError) as e:
        _args(model_8l, kv_host_cache_bytes=too_big).create_engine_config()
    msg = str(e.value)
    assert f"--kv-host-cache-bytes {too_big:,}" in msg
    assert "host memory available" in msg and "GiB" in msg


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            {"kv_transfer_config": {"kv_connector": "ExampleConnector",
                                    "kv_role": "kv_both"}},
            "cannot be combined with --kv-transfer-config",
        ),
        ({"enable_prefix_caching": False}, "needs prefix caching"),
        ({"kv_offloading_size": 1.0}, "both add a host KV tier"),
        ({"kv_host_cache_policy": "mru"}, "--kv-host-cache-policy.*'mru'.*lru, fifo"),
        ({"kv_host_cache_bytes": "lots"}, "--kv-host-cache-bytes.*not a size"),
    ],
)  # fmt: skip
def test_bad_input_fails_at_startup(model_8l, extra, match):
    kw = {"kv_host_cache_bytes": 64 << 20, **extra}
    with pytest.raises(ValueError, match=match):
        _args(model_8l, **kw).create_engine_config()
