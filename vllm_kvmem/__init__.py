"""vllm-kvmem: KV-cache memory extensions for vLLM 0.32.

Importing the package applies its vLLM patches (the same thing vLLM's
``vllm.general_plugins`` entry point does in every engine process), so that
``LLM(..., enable_pp_prop_kv_cache=True)`` accepts the new keyword arguments.
Set ``VLLM_KVMEM_AUTOREGISTER=0`` to import the vLLM-free core without that.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__version__ = "0.1.0"


def _autoregister() -> None:
    if os.environ.get("VLLM_KVMEM_AUTOREGISTER", "1") == "0":
        return
    if os.path.basename(sys.argv[0] if sys.argv else "") == "kvmem":
        return  # the offline CLI starts no engine: skip vLLM's 10 s import
    if importlib.util.find_spec("vllm") is None:
        return
    from vllm_kvmem.plugin import register

    register()


_autoregister()
