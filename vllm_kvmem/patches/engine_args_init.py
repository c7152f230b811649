"""Accept the vllm-kvmem options as keyword arguments of EngineArgs / LLM."""

from __future__ import annotations

from vllm_kvmem.config import KVMemConfig, merge_options
from vllm_kvmem.patches._registry import ALL_PLATFORMS, Patch


def _make(original):
    def __init__(self, *args, **kwargs):
        from vllm_kvmem.patches._native import native_options

        native = native_options()  # vLLM's own fields: left in kwargs for vLLM
        ours = {
            name: kwargs.pop(name)
            for name in KVMemConfig.option_names()
            if name in kwargs and name not in native
        }
        original(self, *args, **kwargs)
        ours = {k: v for k, v in ours.items() if v is not None}
        if ours:
            self.additional_config = merge_options(
                self.additional_config, ours, "keyword argument"
            )

    return __init__


_COMMON = dict(
    make_replacement=_make,
    processes=("the Python process that builds EngineArgs (LLM, AsyncLLM, server)",),
    versions=("0.32", "0.33"),
    platforms=ALL_PLATFORMS,
    why="`LLM(**kwargs)` passes unknown keyword arguments to the EngineArgs "
    "dataclass, which rejects them, so `LLM(..., enable_pp_prop_kv_cache=True)` "
    "would fail. Python users call `vllm_kvmem.register()` first to get this "
    "patch.",
    how="Wraps the generated dataclass `__init__`: pops the vllm-kvmem keyword "
    "arguments, calls vLLM's `__init__` with the rest, and merges them into "
    "`additional_config['kvmem']`.",
    upstream="None (same as engine_args_cli).",
    remove_when="The options exist in vLLM's own CacheConfig.",
    native_options=True,
    idle="Calls vLLM's `__init__` with the same arguments; `additional_config` "
    "is untouched, and `inspect.signature(EngineArgs)` is vLLM's own (the "
    "wrapper carries it).",
)

PATCH = Patch(
    name="engine_args_init",
    target="vllm.engine.arg_utils:EngineArgs.__init__",
    signature=("self", "model"),
    signature_is_prefix=True,
    **_COMMON,
)
ASYNC_PATCH = Patch(
    name="async_engine_args_init",
    target="vllm.engine.arg_utils:AsyncEngineArgs.__init__",
    signature=("self", "model"),
    signature_is_prefix=True,
    **_COMMON,
)
