"""Add the vllm-kvmem flags to vLLM's engine argument parser."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch

GROUP_TITLE = "vllm-kvmem"


def add_kvmem_arguments(parser: Any) -> None:
    """Add one flag per option, but for the options vLLM has natively (its
    own flag is the one) and the flags the parser already has (a no-op the
    second time)."""
    from vllm_kvmem.patches._native import native_options

    native = native_options()
    names = [
        name
        for name in KVMemConfig.option_names()
        if name not in native
        and KVMemConfig.flag(name) not in parser._option_string_actions
    ]
    if not names:
        return
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="KV-cache memory options added by the vllm-kvmem plugin.",
    )
    for name in names:
        field = KVMemConfig.model_fields[name]
        kwargs: dict[str, Any] = {"dest": name, "default": None}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(
            KVMemConfig.flag(name), help=KVMemConfig.help(name), **kwargs
        )


def _make(original):
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        add_kvmem_arguments(parser)
        return parser

    return add_cli_args


PATCH = Patch(
    name="engine_args_cli",
    target="vllm.engine.arg_utils:EngineArgs.add_cli_args",
    make_replacement=_make,
    signature=("parser",),
    processes=("API server / CLI",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="The vllm-kvmem options must be server flags (`--enable-pp-prop-kv-cache`) "
    "that `vllm serve` and `python -m vllm.entrypoints.openai.api_server` accept.",
    how="Wraps the static method: after vLLM builds its parser, adds a `vllm-kvmem` "
    "argument group with one flag per `KVMemConfig` field (default None, so an "
    "absent flag is distinguishable from an explicit one). vLLM calls "
    "`load_general_plugins()` in `AsyncEngineArgs.add_cli_args` before it calls "
    "this method, so the patch is in place in time.",
    upstream="None: would be part of an upstream PR adding the options to "
    "CacheConfig (seed PR for `--enable-pp-prop-kv-cache`, never merged).",
    remove_when="The options exist in vLLM's own CacheConfig.",
    native_options=True,
    idle="Adds the vllm-kvmem flags to the parser (listed in `--help`, all "
    "defaulting to unset); vLLM's own options, their help and defaults are "
    "unchanged.",
)
