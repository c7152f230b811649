"""Add the vllm-kvmem flags to vLLM's engine argument parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from vllm_kvmem.config import KVMemConfig, parse_size
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
        kwargs: dict[str, Any] = {"dest": name, "default": None}
        kwargs.update(_parse_time_checks(name))
        group.add_argument(
            KVMemConfig.flag(name), help=KVMemConfig.help(name), **kwargs
        )


def _parse_time_checks(name: str) -> dict[str, Any]:
    """argparse settings that refuse a bad value as the flag is parsed, in one
    line (``error: argument --flag: ...``), as vLLM's own typed flags are:
    a switch, a choice among the listed values, or a size."""
    annotation = KVMemConfig.model_fields[name].annotation
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    kind = annotation
    if get_origin(annotation) in (Union, UnionType):  # X | None
        (kind,) = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(kind) is Literal:
        choices = list(get_args(kind))
        return {"choices": choices, "metavar": "{" + ",".join(choices) + "}"}
    if get_origin(kind) is Annotated and any(
        getattr(m, "func", None) is parse_size for m in get_args(kind)[1:]
    ):
        return {"type": _size_type(name)}
    return {}


def _size_type(name: str) -> Callable[[str], int]:
    """A size flag's argparse type, its examples in the flag's unit."""
    what, examples = (
        ("token count", "400000, 400k, 1.5m")
        if "tokens" in name
        else ("size", "8G, 512M, 1.5g")
    )

    def size(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError:
            value = None
        if not isinstance(value, int) or value < 1:
            raise argparse.ArgumentTypeError(
                f"invalid value {text!r}: use a positive {what} such as {examples}"
            )
        return value

    return size


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
    "absent flag is distinguishable from an explicit one; choices and sizes "
    "checked as the flag is parsed, as vLLM's own typed flags are). vLLM calls "
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
