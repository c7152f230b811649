"""The features of vllm-kvmem that a vLLM built from the in-tree series has
itself, and how the plugin sees that they are there.

The series (``kvmem_tools/intree``) moves some of what the plugin patches in
into vLLM's own code: PR ``pp_kv_budget`` adds ``enable_pp_prop_kv_cache``
and PR ``kv_cache_tokens`` adds ``kv_cache_tokens`` (each a ``CacheConfig``
field, an ``EngineArgs`` field and a flag, with vLLM's own planner code);
PR ``cpu_attn_block_outer`` makes CPU_ATTN declare its block-outer layouts,
and PR ``cpu_mla_kv_cache_layouts`` makes the CPU MLA backends declare
theirs. Where vLLM has a feature, the plugin must leave it to vLLM: claiming
vLLM's own ``kv_cache_tokens`` keyword or flag takes it away from vLLM's
config. The other PRs of the series (the CPU path and late spills of
vLLM's ``SimpleCPUOffloadConnector``, Model Runner V2's preemption order)
change vLLM's own connector and runner, which the plugin does not patch:
its host tier is its own connector and its options stay the plugin's.

A feature is detected by what vLLM has (a field, a declaration), never by
its version: a dev build or a partial series is read as it is. Each patch
record names the features that replace it (``Patch.native``); the plugin
applies it only where vLLM lacks one of them. One INFO line per feature vLLM
has (:func:`log_once`) comes from the process that builds the VllmConfig,
once vLLM has configured its logging there: plugins load in every process
(API server, engine core, each worker), often before logging is set up.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NativeFeature:
    """One feature of the in-tree series that a vllm-kvmem patch provides."""

    name: str
    """The in-tree PR that adds it to vLLM (``kvmem_tools/intree/patches``)."""
    what: str
    """How the log line and the docs name it (``--kv-cache-tokens``)."""
    detected_by: str
    """What is looked up in vLLM, for the docs."""
    present: Callable[[], bool]
    """Whether the loaded vLLM has it (imports what it reads)."""
    options: tuple[str, ...] = ()
    """The vllm-kvmem options (``KVMemConfig`` fields) vLLM then owns: its
    flag, its ``EngineArgs`` keyword and its checks."""


def _has_field(cls: type, name: str) -> bool:
    """A field of a (pydantic) dataclass or a pydantic model."""
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    return name in getattr(cls, "model_fields", {})


def _config_fields(name: str) -> Callable[[], bool]:
    """The series adds an option as a ``CacheConfig`` field and an
    ``EngineArgs`` field (with its flag); native only when both are there."""

    def present() -> bool:
        from vllm.config import CacheConfig
        from vllm.engine.arg_utils import EngineArgs

        return _has_field(CacheConfig, name) and _has_field(EngineArgs, name)

    return present


def _declares(backend: type, layout: str) -> bool:
    """Whether an attention backend's ``supported_kv_cache_layouts`` declares
    ``layout``: in what it returns here, or in its code. The series' CPU_ATTN
    leaves block-outer layouts out on AMX hosts (its AMX kernels are not
    validated on them): vLLM decides there too, so the plugin must not add
    them back."""
    method = backend.supported_kv_cache_layouts
    declared = method() or ()
    names = getattr(getattr(method, "__func__", method), "__code__", None)
    return any(getattr(d, "name", d) == layout for d in declared) or (
        names is not None and layout in names.co_names
    )


def _cpu_attn_block_outer() -> bool:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return _declares(CPUAttentionBackend, "BLHNC")


def _cpu_mla_layouts() -> bool:
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    return all(
        b.supported_kv_cache_layouts() is not None
        for b in (CPUMLABackend, AMXMLABackend)
    )


PP_KV_BUDGET = NativeFeature(
    name="pp_kv_budget",
    what="--enable-pp-prop-kv-cache",
    detected_by="`CacheConfig` and `EngineArgs` have an `enable_pp_prop_kv_cache` "
    "field",
    present=_config_fields("enable_pp_prop_kv_cache"),
    options=("enable_pp_prop_kv_cache",),
)
KV_CACHE_TOKENS = NativeFeature(
    name="kv_cache_tokens",
    what="--kv-cache-tokens",
    detected_by="`CacheConfig` and `EngineArgs` have a `kv_cache_tokens` field",
    present=_config_fields("kv_cache_tokens"),
    options=("kv_cache_tokens",),
)
CPU_ATTN_BLOCK_OUTER = NativeFeature(
    name="cpu_attn_block_outer",
    what="CPU_ATTN's block-outer KV cache layouts",
    detected_by="`CPUAttentionBackend.supported_kv_cache_layouts` declares BLHNC",
    present=_cpu_attn_block_outer,
)
CPU_MLA_KV_CACHE_LAYOUTS = NativeFeature(
    name="cpu_mla_kv_cache_layouts",
    what="the CPU MLA backends' KV cache layouts",
    detected_by="`CPUMLABackend` and `AMXMLABackend` declare their "
    "`supported_kv_cache_layouts`",
    present=_cpu_mla_layouts,
)

FEATURES: tuple[NativeFeature, ...] = (
    PP_KV_BUDGET,
    KV_CACHE_TOKENS,
    CPU_ATTN_BLOCK_OUTER,
    CPU_MLA_KV_CACHE_LAYOUTS,
)
BY_NAME: dict[str, NativeFeature] = {f.name: f for f in FEATURES}
#: The features that replace vllm-kvmem options (looked up in every process
#: whose patches read the options).
OPTION_FEATURES: tuple[str, ...] = tuple(f.name for f in FEATURES if f.options)


@functools.cache
def is_native(name: str) -> bool:
    """Whether the loaded vLLM has feature ``name`` (once per process)."""
    return BY_NAME[name].present()


def native_features(names: Iterable[str]) -> list[NativeFeature]:
    """The features among ``names`` that the loaded vLLM has, in order."""
    wanted = set(names)
    return [f for f in FEATURES if f.name in wanted and is_native(f.name)]


def native_options() -> frozenset[str]:
    """The vllm-kvmem options the loaded vLLM has itself: the plugin adds no
    flag for them, takes no keyword and reads none of them."""
    return frozenset(o for f in native_features(OPTION_FEATURES) for o in f.options)


#: What ``plugin.register`` found native in this process, until logged.
_found: dict[str, tuple[NativeFeature, ...]] = {}


def record(features: Iterable[NativeFeature]) -> None:
    """Keep what ``plugin.register`` found native, for :func:`log_once`."""
    _found["features"] = tuple(features)


def log_once() -> None:
    """One INFO line per feature vLLM has natively, the first time this
    process builds a VllmConfig (vLLM has configured its logging then)."""
    features = _found.pop("features", ())
    if features:
        from vllm.logger import init_logger

        logger = init_logger("vllm.kvmem.plugin")
        for feature in features:
            logger.info("vllm-kvmem: vLLM has %s natively; using vLLM's", feature.what)


def refuse_native_options(additional_config: dict[str, Any] | None) -> None:
    """An option vLLM has natively, given to the plugin anyway (through
    ``additional_config['kvmem']``, the plugin's third door), would be sized
    by patches that stood down: refuse it, naming vLLM's own option."""
    from vllm_kvmem.config import ADDITIONAL_CONFIG_KEY, KVMemConfig

    given = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(given, dict):
        return
    for name in sorted(native_options() & set(given)):
        raise ValueError(
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}][{name!r}]: this vLLM "
            f"has {KVMemConfig.flag(name)} natively (CacheConfig.{name}); give it "
            f"as vLLM's own option ({KVMemConfig.flag(name)}, or {name}= to "
            "EngineArgs / LLM), not through vllm-kvmem."
        )
