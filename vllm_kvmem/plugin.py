"""The ``vllm.general_plugins`` entry point: patch vLLM in every process.

vLLM runs :func:`register` in the API server, the engine core and every
worker; Python users call it once before ``LLM(...)`` (``vllm_kvmem.register()``).
It is idempotent, applies only the patches that belong on the current
platform, and refuses (one log line, nothing patched) any vLLM outside the
series it runs on. This module imports vLLM only when :func:`register` runs.

Each patch record names the series whose sources it was checked against
(``Patch.versions``). vLLM 0.33's sources are checked too, but 0.33 moved KV
cache planning behind a ``KVCacheConfigBuilder`` and vllm-kvmem does not yet
plan through it, so 0.33 is still refused as a whole rather than half-patched.
"""

from __future__ import annotations

import os

#: The series vllm-kvmem patches. Every record applied there must name it.
SUPPORTED_SERIES = "0.32."

#: Why a series that is checked statically is still refused.
_NOT_YET = {
    "0.33.": " (vLLM 0.33 plans the KV cache through a KVCacheConfigBuilder, "
    "which vllm-kvmem does not implement yet.)"
}

_state: dict[str, bool] = {"done": False, "patched": False}


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> bool:
    """Apply the current platform's patches once; True when vllm-kvmem is active."""
    if _state["done"]:
        return _state["patched"]
    _state["done"] = True
    from vllm.logger import init_logger

    logger = init_logger("vllm.kvmem.plugin")
    version = vllm_version()
    if not version.startswith(SUPPORTED_SERIES):
        logger.warning(
            "vllm-kvmem supports vLLM %sx only, found %s: nothing patched, "
            "the vllm-kvmem options are unavailable.%s",
            SUPPORTED_SERIES,
            version,
            _NOT_YET.get(version[:5], ""),
        )
        return False
    from vllm.platforms import current_platform

    from vllm_kvmem.patches import ALL_PATCHES, apply_all, for_platform

    patches = [
        p for p in for_platform(ALL_PATCHES, current_platform) if p.for_version(version)
    ]
    if not patches:
        logger.warning(
            "vllm-kvmem supports the CPU, CUDA, ROCm and XPU platforms, not %s: "
            "nothing patched, the vllm-kvmem options are unavailable.",
            type(current_platform).__name__,
        )
        return False
    applied = apply_all(patches)
    _state["patched"] = True
    skipped = [p.name for p in ALL_PATCHES if p not in patches]
    logger.debug(
        "vllm-kvmem patches applied in pid %d on %s: %s%s",
        os.getpid(),
        type(current_platform).__name__,
        ", ".join(applied) or "none new",
        f" (not for this platform: {', '.join(skipped)})" if skipped else "",
    )
    return True
