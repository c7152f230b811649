"""The ``vllm.general_plugins`` entry point: patch vLLM in every process.

vLLM runs this in the API server, the engine core and every worker; importing
``vllm_kvmem`` runs it too. It is idempotent, and refuses (one log line,
nothing patched) any vLLM other than the 0.32 series it was written against.
"""

from __future__ import annotations

import os

SUPPORTED_SERIES = "0.32."

_state: dict[str, bool] = {"done": False, "patched": False}


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> bool:
    """Apply every patch once; return True when vllm-kvmem is active."""
    if _state["done"]:
        return _state["patched"]
    _state["done"] = True
    from vllm.logger import init_logger

    logger = init_logger("vllm.kvmem.plugin")
    version = vllm_version()
    if not version.startswith(SUPPORTED_SERIES):
        logger.warning(
            "vllm-kvmem supports vLLM %sx only, found %s: nothing patched, "
            "the vllm-kvmem options are unavailable.",
            SUPPORTED_SERIES,
            version,
        )
        return False
    from vllm_kvmem.patches import ALL_PATCHES, apply_all

    applied = apply_all(ALL_PATCHES)
    _state["patched"] = True
    logger.debug(
        "vllm-kvmem patches applied in pid %d: %s", os.getpid(), ", ".join(applied)
    )
    return True
