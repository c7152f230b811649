"""The three doors to every option (flag, LLM kwarg, additional_config) give
the same result, and bad input fails at startup naming the flag."""

from __future__ import annotations

import sys

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.helpers import (
    both_vllms,
    captured_log,
    engine_args_from_cli,
    messages,
    run_probe,
)
from vllm_kvmem.config import KVMemConfig

# vLLM with vllm-kvmem patched in, as the entry point does in engine processes.
pytestmark = pytest.mark.usefixtures("vllm_patched")


def test_three_doors_give_the_same_config(model_8l):
    m = str(model_8l)
    via_cli = engine_args_from_cli("--model", m, "--enable-pp-prop-kv-cache")
    via_kwarg = EngineArgs(model=m, enable_pp_prop_kv_cache=True)
    via_additional = EngineArgs(
        model=m, additional_config={"kvmem": {"enable_pp_prop_kv_cache": True}}
    )
    expected = {"kvmem": {"enable_pp_prop_kv_cache": True}}
    assert via_cli.additional_config == expected
    assert via_kwarg.additional_config == expected
    assert via_additional.additional_config == expected


def test_absent_flag_leaves_additional_config_alone(model_8l):
    assert (
        "kvmem" not in engine_args_from_cli("--model", str(model_8l)).additional_config
    )
    off = engine_args_from_cli("--model", str(model_8l), "--no-enable-pp-prop-kv-cache")
    assert off.additional_config == {"kvmem": {"enable_pp_prop_kv_cache": False}}


def test_help_lists_the_flag():
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert "--enable-pp-prop-kv-cache" in parser.format_help()
    # Adding our group twice (plugins can load twice) must not add it twice.
    from vllm_kvmem.patches.engine_args_cli import add_kvmem_arguments

    add_kvmem_arguments(parser)
    assert parser.format_help().count("--enable-pp-prop-kv-cache") == 1


def test_conflicting_values_are_an_error(model_8l):
    with pytest.raises(ValueError, match="--enable-pp-prop-kv-cache given twice"):
        EngineArgs(
            model=str(model_8l),
            enable_pp_prop_kv_cache=False,
            additional_config={"kvmem": {"enable_pp_prop_kv_cache": True}},
        )


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"enable_pp_prop_kv_cache": "maybe"}, "--enable-pp-prop-kv-cache.*'maybe'"),
        ({"enable_pp_prop": True}, "unknown vllm-kvmem option.*valid keys"),
        (["x"], "must be a mapping"),
    ],
)
def test_bad_additional_config_fails_at_startup(model_8l, raw, match):
    args = EngineArgs(model=str(model_8l), additional_config={"kvmem": raw})
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()
    with pytest.raises(ValueError, match=match):
        KVMemConfig.parse(raw)


def test_flag_without_budget_names_both_flags(model_8l, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = EngineArgs(model=str(model_8l), enable_pp_prop_kv_cache=True)
    with pytest.raises(ValueError) as e:
        args.create_engine_config()
    assert "--enable-pp-prop-kv-cache" in str(e.value)
    assert "--kv-cache-memory-bytes" in str(e.value)


def test_pipeline_size_one_warns_once(model_8l):
    with captured_log("vllm.kvmem.pp_prop") as records:
        config = EngineArgs(
            model=str(model_8l),
            enable_pp_prop_kv_cache=True,
            kv_cache_memory_bytes=64 << 20,
        ).create_engine_config()
    warnings = [m for m in messages(records) if "no effect" in m]
    assert len(warnings) == 1
    assert "--pipeline-parallel-size 1" in warnings[0]
    assert config.additional_config["kvmem"] == {"enable_pp_prop_kv_cache": True}


def test_kv_cache_tokens_takes_sizes_through_every_door(model_8l):
    m = str(model_8l)
    via_cli = engine_args_from_cli("--model", m, "--kv-cache-tokens", "400k")
    via_kwarg = EngineArgs(model=m, kv_cache_tokens="400k")
    via_additional = EngineArgs(
        model=m, additional_config={"kvmem": {"kv_cache_tokens": 400_000}}
    )
    configs = [
        a.create_engine_config().additional_config["kvmem"]
        for a in (via_cli, via_kwarg, via_additional)
    ]
    assert configs == [{"kv_cache_tokens": 400_000}] * 3


@pytest.mark.parametrize(
    "value,reason",
    [
        ("lots", "not a size: 'lots' (use e.g. 400000, 400k, 512K)"),
        ("1.5K", "not a size: '1.5K' (use e.g. 400000, 400k, 512K)"),
        (0, "Input should be greater than or equal to 1"),
        (-3, "Input should be greater than or equal to 1"),
    ],
)
def test_bad_kv_cache_tokens_names_the_flag(model_8l, value, reason):
    """The message names the flag, where the value sits in additional_config,
    the value itself, why it is wrong, and what would be accepted."""
    args = EngineArgs(model=str(model_8l), kv_cache_tokens=value)
    with pytest.raises(ValueError) as e:
        args.create_engine_config()
    msg = str(e.value)
    assert msg.startswith(
        "--kv-cache-tokens (additional_config['kvmem']['kv_cache_tokens']): "
        f"invalid value {value!r}: "
    ), msg
    assert reason in msg
    assert msg.endswith("; expected a positive integer or a size like 400k or 8G")


def test_kv_cache_tokens_and_bytes_are_mutually_exclusive(model_8l, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = EngineArgs(
        model=str(model_8l), kv_cache_tokens=4096, kv_cache_memory_bytes=64 << 20
    )
    with pytest.raises(ValueError) as e:
        args.create_engine_config()
    assert "--kv-cache-tokens 4,096" in str(e.value)
    assert "--kv-cache-memory-bytes 67,108,864" in str(e.value)


def test_options_are_parsed_once_per_process(monkeypatch):
    """Every patch in a process asks for the options; the same mapping is
    validated once, a changed one again, and strictness survives the cache."""
    from types import SimpleNamespace

    from vllm_kvmem import config as config_module

    config_module._parse_items.cache_clear()
    parsed = []
    validate = KVMemConfig.model_validate.__func__

    def counting(cls, raw, *args, **kwargs):
        parsed.append(dict(raw))
        return validate(cls, raw, *args, **kwargs)

    monkeypatch.setattr(KVMemConfig, "model_validate", classmethod(counting))
    vllm_config = SimpleNamespace(additional_config={"kvmem": {"kv_cache_tokens": 7}})
    first = KVMemConfig.from_vllm_config(vllm_config)
    assert KVMemConfig.from_vllm_config(vllm_config) is first
    assert parsed == [{"kv_cache_tokens": 7}]
    vllm_config.additional_config["kvmem"] = {"kv_cache_tokens": 8}
    assert KVMemConfig.from_vllm_config(vllm_config).kv_cache_tokens == 8
    assert len(parsed) == 2
    # True == 1, but a strict bool option refuses 1 even after True was cached.
    vllm_config.additional_config["kvmem"] = {"enable_pp_prop_kv_cache": True}
    assert KVMemConfig.from_vllm_config(vllm_config).enable_pp_prop_kv_cache
    vllm_config.additional_config["kvmem"] = {"enable_pp_prop_kv_cache": 1}
    with pytest.raises(ValueError, match="--enable-pp-prop-kv-cache"):
        KVMemConfig.from_vllm_config(vllm_config)


# What a user of each vLLM release is told for bad input, in a fresh process
# of that release (vllm-kvmem registered, as `LLM` users do).
REFUSALS_PROBE = """
import json, os, sys
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
import vllm_kvmem
vllm_kvmem.register()
from vllm.engine.arg_utils import EngineArgs
out = {}
for name, kwargs in json.loads(sys.argv[1]).items():
    try:
        EngineArgs(**kwargs).create_engine_config()
        out[name] = None
    except (ValueError, TypeError) as e:
        out[name] = str(e)
print("REPORT " + json.dumps(out))
"""

REFUSALS = {
    "tokens not a size": (
        dict(kv_cache_tokens="lots"),
        "--kv-cache-tokens (additional_config['kvmem']['kv_cache_tokens']): "
        "invalid value 'lots': not a size: 'lots' (use e.g. 400000, 400k, 512K)",
    ),
    "pp flag without a budget": (
        dict(enable_pp_prop_kv_cache=True, pipeline_parallel_size=2),
        "--enable-pp-prop-kv-cache needs --kv-cache-memory-bytes",
    ),
    "tokens and bytes": (
        dict(kv_cache_tokens=4096, kv_cache_memory_bytes=64 << 20),
        "--kv-cache-tokens 4,096 and --kv-cache-memory-bytes 67,108,864 both size "
        "the KV cache; give one of them",
    ),
    "unknown key": (
        dict(additional_config={"kvmem": {"enable_pp_prop": True}}),
        "unknown vllm-kvmem option(s) 'enable_pp_prop' in "
        "additional_config['kvmem']; valid keys: enable_pp_prop_kv_cache,",
    ),
    "host policy": (
        dict(kv_host_cache_bytes=1 << 30, kv_host_cache_policy="random"),
        "--kv-host-cache-policy (additional_config['kvmem']['kv_host_cache_policy'])"
        ": invalid value 'random': Input should be 'lru' or 'fifo'; expected one "
        "of lru, fifo",
    ),
}


#: What each release's fresh process answered to a refusals probe, by
#: (interpreter, probe): the answers are deterministic, so the 0.33 case
#: compares with the 0.32 case's process instead of starting another.
_REFUSED: dict[tuple[str, str], dict] = {}


def _refusals(code: str, python: str) -> dict:
    """:data:`REFUSALS_PROBE` (as ``code``) in a fresh process of ``python``,
    once per session."""
    if (python, code) not in _REFUSED:
        _REFUSED[python, code] = run_probe(code, timeout=300, python=python)
    return _REFUSED[python, code]


@both_vllms
def test_bad_values_are_refused_with_our_messages(model_8l, vllm_python):
    """The same messages on vLLM 0.32 and 0.33 (this test's other case)."""
    import json

    cases = {n: {"model": str(model_8l), **kw} for n, (kw, _) in REFUSALS.items()}
    code = REFUSALS_PROBE.replace("sys.argv[1]", repr(json.dumps(cases)))
    got = _refusals(code, vllm_python)
    for name, (_kw, expected) in REFUSALS.items():
        assert got[name] is not None, f"{name}: accepted"
        assert expected in got[name], (name, got[name])
    if vllm_python != sys.executable:
        assert got == _refusals(code, sys.executable), "0.33 says otherwise than 0.32"


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["--kv-host-cache-policy", "mru"],
            "error: argument --kv-host-cache-policy: invalid choice: 'mru' "
            "(choose from 'lru', 'fifo')",
        ),
        (
            ["--kv-host-cache-late-spill", "later"],
            "error: argument --kv-host-cache-late-spill: invalid choice: 'later' "
            "(choose from 'copy', 'drop')",
        ),
        (
            ["--kv-host-cache-bytes", "10 GB"],
            "error: argument --kv-host-cache-bytes: invalid value '10 GB': use a "
            "positive size such as 8G, 512M, 1.5g",
        ),
        (
            ["--kv-disk-cache-bytes", "10 GB"],
            "error: argument --kv-disk-cache-bytes: invalid value '10 GB': use a "
            "positive size such as 8G, 512M, 1.5g",
        ),
        (
            ["--kv-cache-tokens", "abc"],
            "error: argument --kv-cache-tokens: invalid value 'abc': use a "
            "positive token count such as 400000, 400k, 1.5m",
        ),
    ],
)
def test_bad_flags_are_refused_as_they_are_parsed(argv, line, capsys):
    """A server's bad flag ends in vLLM's one-line argparse error, before
    anything starts: the flag, the value, what would work."""
    with pytest.raises(SystemExit) as e:
        engine_args_from_cli("--model", "m", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(line) and "Traceback" not in err


def test_good_flags_parse_to_values():
    args = engine_args_from_cli(
        "--model", "m", "--kv-host-cache-bytes", "8G", "--kv-cache-tokens", "400k",
        "--kv-host-cache-policy", "fifo", "--kv-host-cache-verify",
        "--kv-disk-cache-path", "/data/kv", "--kv-disk-cache-bytes", "100G",
    )  # fmt: skip
    assert args.additional_config["kvmem"] == {
        "kv_host_cache_bytes": 8 << 30,
        "kv_cache_tokens": 400_000,
        "kv_host_cache_policy": "fifo",
        "kv_host_cache_verify": True,
        "kv_disk_cache_path": "/data/kv",
        "kv_disk_cache_bytes": 100 << 30,
    }
