"""--kv-host-cache-bytes / --kv-host-cache-policy: doors, bad input, fallbacks."""

from __future__ import annotations

import logging

import psutil
import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.helpers import captured_log, engine_args_from_cli
from vllm_kvmem.host_tier_setup import CONNECTOR_NAME
from vllm_kvmem.plugin import register

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


def _args(model, **kw):
    return EngineArgs(model=str(model), kv_cache_memory_bytes=1 << 24, **kw)


def test_size_turns_on_the_connector_from_every_door(model_8l):
    via_cli = engine_args_from_cli(
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


GIB = 1 << 30


@pytest.fixture
def available_10g(monkeypatch):
    """Only psutil's available-memory figure is faked (10 GiB, so the 80%
    limit is a round 8 GiB); every other field, and everything vLLM does while
    building the config, is real."""
    real = psutil.virtual_memory()
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: real._replace(available=10 * GIB)
    )


@pytest.mark.parametrize(
    "parallel,tp,dp_local",
    [
        ({}, 1, 1),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 2, 2),
        # Two of the four data-parallel ranks on this node: only those count.
        (
            {
                "tensor_parallel_size": 2,
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
            },
            2,
            2,
        ),
        ({"tensor_parallel_size": 4, "data_parallel_size": 2}, 4, 2),
    ],
)
def test_memory_check_counts_every_rank_on_the_node_with_headroom(
    model_8l, available_10g, parallel, tp, dp_local
):
    """size x TP x DP-local must fit in 80% of the available memory: exactly
    at the limit starts, one MiB more fails naming the arithmetic, and the
    value the error suggests starts."""
    register()
    pools = tp * dp_local
    at_limit = 8 * GIB // pools
    with captured_log("vllm.kvmem.host_tier") as records:
        args = _args(model_8l, kv_host_cache_bytes=at_limit, **parallel)
        cfg = args.create_engine_config()
    assert cfg.kv_transfer_config.kv_connector == CONNECTOR_NAME
    assert cfg.parallel_config.tensor_parallel_size == tp
    checks = [r for r in records if "memory check" in r.getMessage()]
    assert len(checks) == 1 and checks[0].levelno == logging.INFO
    line = checks[0].getMessage()
    expected = f"{at_limit / GIB:.2f} GiB x {tp} TP x {dp_local} DP-local = 8.00 GiB"
    assert expected in line
    assert "80% of the 10.00 GiB" in line

    too_big = at_limit + (1 << 20)
    with pytest.raises(ValueError) as e:
        _args(model_8l, kv_host_cache_bytes=too_big, **parallel).create_engine_config()
    msg = str(e.value)
    assert f"--kv-host-cache-bytes {too_big:,} bytes" in msg
    assert (
        f"{too_big / GIB:.2f} GiB x {tp} TP x {dp_local} DP-local = "
        f"{too_big * pools / GIB:.2f} GiB on this node" in msg
    )
    assert "80% of the 10.00 GiB of host memory available = 8.00 GiB" in msg
    suggested = f"{8 * 1024 // pools}M"
    assert f"Use --kv-host-cache-bytes {suggested} or less" in msg
    _args(model_8l, kv_host_cache_bytes=suggested, **parallel).create_engine_config()


def test_memory_check_keeps_a_fifth_of_available_memory_free(model_8l, available_10g):
    """9 GiB would fit in the 10 GiB available, but pinned memory cannot be
    swapped: it must also leave 20% free."""
    register()
    with pytest.raises(ValueError, match=r"limit 80% of the 10\.00 GiB") as e:
        _args(model_8l, kv_host_cache_bytes=9 * GIB).create_engine_config()
    # True for this platform: CPU pools are not pinned.
    assert "pool, in CPU host memory (9.00 GiB" in str(e.value)
    assert "pinned" not in str(e.value)


def test_hybrid_model_keeps_vllms_hybrid_kv_cache_manager(tmp_path):
    """The connector implements SupportsHMA: vLLM keeps its hybrid KV cache
    manager for a sliding-window + full-attention model with the tier on."""
    from vllm_kvmem.tiny_model import build_tiny_model

    model = build_tiny_model(
        tmp_path / "hybrid", num_layers=4, sliding_window=256, sliding_window_pattern=2
    )
    cfg = _args(model, kv_host_cache_bytes="64M").create_engine_config()
    assert cfg.kv_transfer_config.kv_connector == CONNECTOR_NAME
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize(
    "write,reason",
    [
        ("write_mla_model", "the model uses MLA"),
        ("write_mamba_hybrid_model", "Mamba or linear-attention state"),
    ],
)
def test_model_the_tier_cannot_serve_is_refused_before_vllm_builds_its_config(
    tmp_path, write, reason
):
    """Refused in one line as soon as vLLM has the model's config, before the
    VllmConfig picks the KV cache manager from the connector: the config is
    the one vLLM builds without the flag (no connector)."""
    import tests.helpers

    model = getattr(tests.helpers, write)(tmp_path / "m")
    kw = dict(load_format="dummy", max_model_len=1024)
    with captured_log("vllm.kvmem") as records:
        cfg = _args(model, kv_host_cache_bytes="64M", **kw).create_engine_config()
    off = [r.getMessage() for r in records if "Host KV tier off" in r.getMessage()]
    assert len(off) == 1 and reason in off[0], off
    assert off[0].endswith("; serving continues without it.")
    assert cfg.kv_transfer_config is None
    plain = _args(model, **kw).create_engine_config()
    assert (
        cfg.scheduler_config.disable_hybrid_kv_cache_manager
        == plain.scheduler_config.disable_hybrid_kv_cache_manager
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"num_host_block": 8}, r"unknown keys \['num_host_block'\].*num_host_blocks"),
        ({"eviction_policy": "lfu"}, r"\['eviction_policy'\]='lfu'; use one of"),
        ({"late_spill": "keep"}, r"\['late_spill'\]='keep'; use one of"),
        ({"num_host_blocks": -1}, r"\['num_host_blocks'\]=-1; use a non-negative"),
        ({"step_bytes": "1G"}, r"\['step_bytes'\]='1G'; use a non-negative"),
        ({"verify": "yes"}, r"\['verify'\]='yes'; use true or false"),
    ],
)
def test_bad_connector_extra_config_is_refused_by_name(extra, message):
    """The connector named directly (kv_connector_extra_config): every bad key
    or value is an error that names it and what would work."""
    from vllm_kvmem.host_tier.config import HostTierConfig

    with pytest.raises(ValueError, match=message):
        HostTierConfig.from_extra_config(extra)
    assert HostTierConfig.from_extra_config({"num_host_blocks": 8}).num_host_blocks == 8


# -- --kv-disk-cache-path / --kv-disk-cache-bytes: the disk tier behind it --


def test_disk_flags_reach_the_connector_from_every_door(model_8l, tmp_path):
    disk = str(tmp_path / "kv")
    via_cli = engine_args_from_cli(
        "--model", str(model_8l), "--kv-cache-memory-bytes", "16M",
        "--kv-host-cache-bytes", "64M", "--kv-disk-cache-path", disk,
        "--kv-disk-cache-bytes", "1G",
    )  # fmt: skip
    via_kwarg = _args(
        model_8l, kv_host_cache_bytes="64M", kv_disk_cache_path=disk,
        kv_disk_cache_bytes="1G",
    )  # fmt: skip
    via_additional = _args(
        model_8l,
        additional_config={
            "kvmem": {
                "kv_host_cache_bytes": 64 << 20,
                "kv_disk_cache_path": disk,
                "kv_disk_cache_bytes": 1 << 30,
            }
        },
    )
    for args in (via_cli, via_kwarg, via_additional):
        cfg = args.create_engine_config()
        extra = cfg.kv_transfer_config.kv_connector_extra_config
        assert (extra["disk_path"], extra["disk_bytes"]) == (disk, 1 << 30)
        assert cfg.additional_config["kvmem"]["kv_disk_cache_bytes"] == 1 << 30


def test_no_disk_flags_no_disk_tier(model_8l):
    cfg = _args(model_8l, kv_host_cache_bytes="64M").create_engine_config()
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    assert (extra["disk_path"], extra["disk_bytes"]) == ("", 0)


@pytest.mark.parametrize(
    "kw,line",
    [
        (
            {"kv_host_cache_bytes": None},
            "--kv-disk-cache-path {d} adds a disk tier behind the host KV tier, "
            "which is off: add --kv-host-cache-bytes",
        ),
        (
            {"kv_disk_cache_bytes": None},
            "--kv-disk-cache-path {d} needs --kv-disk-cache-bytes N > 0",
        ),
        (
            {"kv_disk_cache_path": None},
            "--kv-disk-cache-bytes 1,073,741,824 needs --kv-disk-cache-path DIR",
        ),
        (
            {"kv_disk_cache_path": "relative/kv"},
            "--kv-disk-cache-path relative/kv: use an absolute path",
        ),
        (
            {"kv_disk_cache_bytes": "lots"},
            "--kv-disk-cache-bytes (additional_config['kvmem']"
            "['kv_disk_cache_bytes']): invalid value 'lots': not a size",
        ),
        (
            {"prefix_caching_hash_algo": "xxhash"},
            "--prefix-caching-hash-algo xxhash seeds randomly in every process",
        ),
    ],
)
def test_bad_disk_settings_fail_at_startup_in_one_line(
    model_8l, tmp_path, monkeypatch, kw, line
):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    disk = str(tmp_path / "kv")
    base = dict(
        kv_host_cache_bytes="64M", kv_disk_cache_path=disk, kv_disk_cache_bytes="1G"
    )
    base.update(kw)
    args = {k: v for k, v in base.items() if v is not None}
    with pytest.raises(ValueError) as e:
        _args(model_8l, **args).create_engine_config()
    msg = str(e.value)
    assert line.format(d=disk) in msg and "\n" not in msg, msg


def test_xxhash_with_a_shared_pythonhashseed_is_accepted(
    model_8l, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    cfg = _args(
        model_8l, kv_host_cache_bytes="64M", kv_disk_cache_path=str(tmp_path),
        kv_disk_cache_bytes="1G", prefix_caching_hash_algo="xxhash",
    ).create_engine_config()  # fmt: skip
    assert cfg.kv_transfer_config.kv_connector_extra_config["disk_path"]
