"""Carry the vllm-kvmem flags from the parsed namespace into EngineArgs."""

from __future__ import annotations

from vllm_kvmem.config import KVMemConfig, merge_options
from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def from_cli_args(cls, args):
        from vllm_kvmem.patches._native import native_options

        engine_args = original(cls, args)
        native = native_options()  # vLLM's own fields: its method carried them
        given = {
            name: getattr(args, name)
            for name in KVMemConfig.option_names()
            if name not in native and getattr(args, name, None) is not None
        }
        if given:
            engine_args.additional_config = merge_options(
                engine_args.additional_config, given, "command-line flag"
            )
        return engine_args

    return from_cli_args


PATCH = Patch(
    name="engine_args_from_cli",
    target="vllm.engine.arg_utils:EngineArgs.from_cli_args",
    make_replacement=_make,
    signature=("cls", "args"),
    processes=("API server / CLI",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="`from_cli_args` keeps only namespace attributes that are EngineArgs "
    "dataclass fields, so the vllm-kvmem flags would be dropped silently.",
    how="Wraps the class method: reads the vllm-kvmem attributes that were given "
    "and merges them into `engine_args.additional_config['kvmem']` (an "
    "error if `--additional-config` sets the same option to another value).",
    upstream="None (same as engine_args_cli).",
    remove_when="The options exist in vLLM's own CacheConfig.",
    native_options=True,
    idle="Calls vLLM's method and returns its result unchanged (no kvmem flag "
    "given: nothing is merged into `additional_config`).",
)
