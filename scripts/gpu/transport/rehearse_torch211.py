"""The torch211 plan's Python side, rehearsed on a CPU machine.

Run by ``rehearse_torch211.sh`` inside a Python 3.12 environment that holds
the GPU machine's torch 2.11.0 (the CUDA build, from PyPI) and the plan's
pieces installed by ``install_pieces.py``, with a load-time stand-in for the
CUDA driver library on ``LD_LIBRARY_PATH``. Two checks, each in its own
process (vLLM decides its platform once per process):

``imports``  vLLM 0.32's compiled extensions load against torch 2.11, the
             ops a dense Llama runs have CUDA kernels registered in torch
             2.11's dispatcher, and every module stage 2's
             A/B reaches imports: the engine, the GPU worker and model
             runner, FLASH_ATTN, both offloading connectors, the OpenAI
             server, vLLM's benchmark client, and the plugin's tier;
``plugin``   on vLLM's real ``CudaPlatform`` (stand-ins for the answers only
             a GPU gives: capability 9.0, and Triton's CUDA driver active),
             vLLM's plugin loader runs the plugin: every patch for CUDA and
             0.32 applies (its signature tripwires read the CUDA wheel's
             code), no CPU worker module is imported, and the in-tree
             connector name is registered.

What it cannot show: anything that runs a kernel. Prints one JSON line.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import traceback

#: What stage 2 (``stage2.sh``'s probe and item g) imports, extensions first.
MODULES = (
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm.vllm_flash_attn",
    "vllm._custom_ops",
    "vllm.platforms.cuda",
    "vllm.engine.arg_utils",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.model_executor.models.llama",
    "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.entrypoints.openai.api_server",
    "vllm.benchmarks.serve",
    "vllm_kvmem.plugin",
    "vllm_kvmem.host_tier.connector",
    "vllm_kvmem.host_tier.worker",
)

#: Ops a dense Llama runs on FLASH_ATTN (and the tier's block copies use),
#: which must have a CUDA kernel once the extensions have loaded.
CUDA_OPS = (
    "_C::rms_norm",
    "_C::fused_add_rms_norm",
    "_C::silu_and_mul",
    "_C::rotary_embedding",
    "_C_cache_ops::reshape_and_cache_flash",
    "_C_cache_ops::swap_blocks",
    "_vllm_fa3_C::fwd",
    "_vllm_fa2_C::varlen_fwd",
)


def check_imports() -> dict:
    import torch
    import vllm

    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = traceback.format_exception_only(exc)[-1].strip()[:300]
    names = set(torch._C._dispatch_get_all_op_names())
    ops = {
        op: op in names and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
        for op in CUDA_OPS
    }
    return {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "vllm_file": vllm.__file__,
        "imported": [m for m in MODULES if m not in failed],
        "failed": failed,
        "cuda_kernels": ops,
    }


def check_plugin() -> dict:
    from triton.backends.nvidia.driver import CudaDriver

    # Stand-ins for what only a GPU answers (there: an H100).
    CudaDriver.is_active = staticmethod(lambda: True)
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    CudaPlatform.get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(9, 0)
    )
    CudaPlatform.get_device_name = classmethod(
        lambda cls, device_id=0: "NVIDIA H100 80GB HBM3"
    )
    platforms._current_platform = CudaPlatform()

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_kvmem import plugin
    from vllm_kvmem.patches import ALL_PATCHES, for_platform, for_series, is_applied
    from vllm_kvmem.vllm_adapter import vllm_series

    mine = for_series(for_platform(ALL_PATCHES, current_platform), vllm_series())
    return {
        "platform": type(current_platform).__name__,
        "is_cuda": current_platform.is_cuda(),
        "series": vllm_series(),
        "expected": sorted(p.name for p in mine),
        "applied": sorted(p.name for p in mine if is_applied(p)),
        "cpu_worker_modules": sorted(
            m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")
        ),
        "plugin_state": dict(plugin._state),
        "connector_registered": "HostTierConnector" in KVConnectorFactory._registry,
    }


def main() -> int:
    if len(sys.argv) > 1:  # one check, in this process
        check = {"imports": check_imports, "plugin": check_plugin}[sys.argv[1]]
        print("RESULT " + json.dumps(check()))
        return 0
    report: dict = {}
    for name in ("imports", "plugin"):
        done = subprocess.run(
            [sys.executable, __file__, name], capture_output=True, text=True
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        report[name] = (
            json.loads(lines[-1].removeprefix("RESULT "))
            if done.returncode == 0 and lines
            else {"error": (done.stdout + done.stderr)[-3000:]}
        )
    imports, plug = report["imports"], report["plugin"]
    report["ok"] = bool(
        not imports.get("failed", True)
        and all(imports.get("cuda_kernels", {"": False}).values())
        and plug.get("is_cuda")
        and plug.get("expected")
        and plug.get("applied") == plug.get("expected")
        and plug.get("cpu_worker_modules") == []
        and plug.get("connector_registered")
    )
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
