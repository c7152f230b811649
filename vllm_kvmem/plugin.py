"""The ``vllm.general_plugins`` entry point: patch vLLM in every process.

vLLM runs :func:`register` in the API server, the engine core and every
worker; Python users call it once before ``LLM(...)`` (``vllm_kvmem.register()``).
It is idempotent, applies only the patches that belong on the current
platform, and refuses (one log line, nothing patched) any vLLM outside the
series it runs on. This module imports vLLM only when :func:`register` runs.

Each patch record names the series whose sources it was checked against
(``Patch.versions``); on a series only its records apply (on vLLM 0.33 the
budget goes through a ``KVCacheConfigBuilder`` instead of the 0.32 planner
patch). A series outside ``vllm_adapter.SERIES`` is refused as a whole rather
than half-patched.

A vLLM built from the in-tree series has some of the features itself
(``patches/_native.py``), found by what vLLM has, not by its version. There
the patches those features replace stand down (``Patch.native``), the
option patches leave vLLM's own options to vLLM, and one INFO line per
feature says that vLLM's is used (from the process that builds the
VllmConfig, once: ``_native.log_once``).
"""

from __future__ import annotations

import os

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

    from vllm_kvmem.vllm_adapter import SERIES, series_of

    logger = init_logger("vllm.kvmem.plugin")
    version = vllm_version()
    series = series_of(version)
    if series is None:
        logger.warning(
            "vllm-kvmem supports vLLM %s only, found %s: nothing patched, "
            "the vllm-kvmem options are unavailable.",
            " and ".join(f"{s}.x" for s in SERIES),
            version,
        )
        return False
    from vllm.platforms import current_platform

    from vllm_kvmem.patches import ALL_PATCHES, apply_all, for_platform, for_series
    from vllm_kvmem.patches._native import OPTION_FEATURES, native_features, record
    from vllm_kvmem.patches._registry import standing_down

    patches = for_series(for_platform(ALL_PATCHES, current_platform), series)
    if not patches:
        logger.warning(
            "vllm-kvmem supports the CPU, CUDA, ROCm and XPU platforms, not %s: "
            "nothing patched, the vllm-kvmem options are unavailable.",
            type(current_platform).__name__,
        )
        return False
    # Only the features this platform's patches serve are looked up: the CPU
    # layouts' backends are imported on CPU alone.
    native = native_features(
        {*OPTION_FEATURES, *(name for p in patches for name in p.native)}
    )
    record(native)
    down = standing_down(patches, (f.name for f in native))
    patches = [p for p in patches if p not in down]
    applied = apply_all(patches)
    from vllm_kvmem.host_tier_setup import register_connector_name

    register_connector_name()
    _state["patched"] = True
    skipped = [p.name for p in ALL_PATCHES if p not in patches and p not in down]
    logger.debug(
        "vllm-kvmem patches applied in pid %d on %s, vLLM %s: %s%s%s",
        os.getpid(),
        type(current_platform).__name__,
        version,
        ", ".join(applied) or "none new",
        f" (not for this platform or series: {', '.join(skipped)})" if skipped else "",
        f" (standing down, vLLM has {', '.join(f.what for f in native)} "
        f"natively: {', '.join(p.name for p in down) or 'none'})"
        if native
        else "",
    )
    return True
