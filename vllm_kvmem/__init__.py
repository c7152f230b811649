"""vllm-kvmem: KV-cache memory extensions for vLLM 0.32 and 0.33.

Importing this package, or any module of it, patches nothing and does not
import vLLM: the vLLM-free core (``vllm_kvmem.core``) and the offline planner
(``kvmem plan``) work where vLLM is not installed.

vLLM applies the patches itself in every process it starts (the API server,
the engine core, every worker) through the ``vllm.general_plugins`` entry
point. A Python user who passes vllm-kvmem options to ``LLM(...)`` takes one
explicit step first, because ``LLM`` validates its keyword arguments before
vLLM loads any plugin::

    import vllm_kvmem

    vllm_kvmem.register()
    llm = LLM(model, kv_cache_memory_bytes=5 << 30, enable_pp_prop_kv_cache=True)

or ``vllm_kvmem.LLM(...)``, which takes that step and builds vLLM's ``LLM``.
"""

from __future__ import annotations

from typing import Any

from vllm_kvmem.plugin import register

__version__ = "0.1.0"

__all__ = ["LLM", "__version__", "register"]


def LLM(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (vLLM's class name)
    """``vllm.LLM(*args, **kwargs)`` with :func:`register` called first, so
    that vllm-kvmem's keyword arguments are accepted."""
    register()
    from vllm import LLM as VllmLLM

    return VllmLLM(*args, **kwargs)
