"""What the plugin does to a process that is not on the CPU platform, proven on
the CPU build: every precondition of the GPU path that does not need a GPU.

vLLM loads general plugins in the API server, the engine core and every GPU
worker. Importing a ``vllm.v1.worker.cpu*`` module replaces ``torch.cuda``'s
streams and events and ``torch.accelerator``'s memory query with CPU
placeholders (``vllm/v1/worker/cpu/shm.py``), so the plugin must never import
one there. Each check runs in a fresh subprocess: the platform is decided
once per process, and this test process has long since imported vLLM.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_probe

# The torch objects vLLM's CPU shim replaces at import time.
TORCH_PROBE = """
import torch
TORCH_NAMES = {
    "torch.cuda.Event": lambda: torch.cuda.Event,
    "torch.cuda.Stream": lambda: torch.cuda.Stream,
    "torch.cuda.current_stream": lambda: torch.cuda.current_stream,
    "torch.cuda.stream": lambda: torch.cuda.stream,
    "torch.accelerator.get_memory_info": lambda: torch.accelerator.get_memory_info,
    "torch.accelerator.synchronize": lambda: torch.accelerator.synchronize,
    "torch.accelerator.empty_cache": lambda: torch.accelerator.empty_cache,
    "torch.Tensor.pin_memory": lambda: torch.Tensor.pin_memory,
    "torch.Tensor.record_stream": lambda: torch.Tensor.record_stream,
}
BEFORE = {k: get() for k, get in TORCH_NAMES.items()}

def torch_changed():
    return sorted(k for k, get in TORCH_NAMES.items() if get() is not BEFORE[k])

def cpu_worker_modules():
    return sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.cpu"))
"""

# A platform that answers is_cpu() == False but keeps the CPU build's device
# plumbing (the CPU build cannot import vLLM's CUDA kernels). ``cuda`` claims
# CUDA; its worker module is imported under the CPU identity first, because
# importing it as CUDA pulls FlashAttention's compiled extensions, which this
# build lacks. ``oot`` claims an out-of-tree platform and pre-imports nothing.
FAKE_PLATFORM = """
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum
if KIND == "cuda":
    import vllm.v1.worker.gpu_worker  # noqa: F401  (see FAKE_PLATFORM's comment)
class NotCpuPlatform(CpuPlatform):
    _enum = PlatformEnum.CUDA if KIND == "cuda" else PlatformEnum.OOT
    device_name = KIND
platforms._current_platform = NotCpuPlatform()
"""

LOAD_PLUGINS = """
import json
before_plugins = set(sys.modules)
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_kvmem.patches import (
    ALL_PATCHES, apply_all, for_platform, for_series, is_applied)
from vllm_kvmem.vllm_adapter import vllm_series
imported = sorted(set(sys.modules) - before_plugins)
changed = torch_changed()
cpu_modules = cpu_worker_modules()
mine = for_series(for_platform(ALL_PATCHES, current_platform), vllm_series())
report = dict(
    is_cpu=current_platform.is_cpu(),
    torch_changed=changed,
    cpu_worker_modules=cpu_modules,
    imported_by_plugin=[m for m in imported if m.startswith("vllm.")],
    applied=sorted(p.name for p in mine if is_applied(p)),
    expected=sorted(p.name for p in mine),
    reapplied=apply_all(mine),
    active=__import__("vllm_kvmem.plugin").plugin._state["patched"],
)
print("REPORT " + json.dumps(report))
"""


def _run(code: str, **env: str) -> dict:
    return run_probe(code, timeout=300, **env)


@pytest.mark.parametrize("kind", ["cuda", "oot"])
def test_non_cpu_platform_keeps_torch_cuda_and_imports_no_cpu_module(kind):
    report = _run(
        "import sys\n"
        + TORCH_PROBE
        + f"KIND = {kind!r}\n"
        + FAKE_PLATFORM
        + LOAD_PLUGINS
    )
    assert report["is_cpu"] is False
    assert report["cpu_worker_modules"] == []
    assert report["torch_changed"] == []
    assert report["applied"] == report["expected"]
    assert report["reapplied"] == []
    if kind == "cuda":
        # The plugin really loaded and applied the CUDA patches, once.
        assert report["active"] is True
        assert "gpu_worker_memory" in report["expected"]
        assert "kv_cache_configs" in report["expected"]
        assert not {"cpu_worker_memory", "cpu_attn_layouts"} & set(report["expected"])
    else:
        # A platform vllm-kvmem does not know: nothing patched (one warning).
        assert report["active"] is False
        assert report["expected"] == []
    assert not any(
        m.startswith(("vllm.v1.worker.cpu", "vllm.v1.attention.backends.cpu"))
        for m in report["imported_by_plugin"]
    )


def test_cpu_platform_still_applies_the_cpu_patches():
    """The same probe on the real CPU platform: the CPU patches apply, and the
    probe does see vLLM's CPU shim replace torch.cuda (so the checks above can
    fail)."""
    report = _run("import sys\n" + TORCH_PROBE + LOAD_PLUGINS)
    assert report["is_cpu"] is True
    assert {"cpu_worker_memory", "cpu_attn_layouts"} <= set(report["applied"])
    assert report["applied"] == report["expected"]
    assert "gpu_worker_memory" not in report["expected"]
    assert "vllm.v1.worker.cpu_worker" in report["cpu_worker_modules"]
    assert "torch.cuda.Stream" in report["torch_changed"]


def test_importing_every_module_patches_nothing():
    """``import vllm_kvmem`` and every submodule: no patch, no torch change."""
    code = (
        "import sys, importlib, pkgutil\n"
        + TORCH_PROBE
        + """
import vllm_kvmem
names = sorted(m.name for m in pkgutil.walk_packages(
    vllm_kvmem.__path__, "vllm_kvmem."))
for name in names:
    importlib.import_module(name)
changed = torch_changed()
from vllm_kvmem.patches import ALL_PATCHES, for_series, is_applied
from vllm_kvmem.vllm_adapter import vllm_series
from vllm.platforms import current_platform
report = dict(
    modules=names,
    torch_changed=changed,
    applied=[p.name for p in for_series(ALL_PATCHES, vllm_series())
             if p.applies_to(current_platform) and is_applied(p)],
)
print("REPORT " + json.dumps(report))
"""
    )
    report = _run(code.replace("import sys,", "import json, sys,"))
    assert "vllm_kvmem.host_tier" in report["modules"]
    assert "vllm_kvmem.patches.gpu_worker_memory" in report["modules"]
    assert report["torch_changed"] == []
    assert report["applied"] == []


BLOCK_VLLM = """
import sys
class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoVllm())
"""


#: The host tier's modules that import no vLLM (its copies, pool and index).
HOST_TIER_VLLM_FREE = (
    "host_index",
    "kv_region",
    "host_pool",
    "copy_strategy",
    "block_views",
    "copy_engine",
    "wait_timer",
)


def test_core_and_kvmem_plan_work_without_vllm(model_6l):
    code = (
        BLOCK_VLLM
        + f"""
import importlib, io, json, contextlib, pkgutil
import vllm_kvmem
import vllm_kvmem.core
core = sorted(m.name for m in pkgutil.walk_packages(
    vllm_kvmem.core.__path__, "vllm_kvmem.core."))
core += [f"vllm_kvmem.host_tier.{{m}}" for m in {HOST_TIER_VLLM_FREE!r}]
for name in core:
    importlib.import_module(name)
try:
    import vllm  # noqa: F401
    blocked = False
except ModuleNotFoundError:
    blocked = True
from vllm_kvmem.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["plan", {str(model_6l)!r}, "--kv-cache-memory-bytes", "64M",
               "--json"])
print("REPORT " + json.dumps(dict(
    blocked=blocked, core=core, rc=rc, plan=json.loads(out.getvalue()),
    vllm_loaded=sorted(m for m in sys.modules if m.split(".")[0] == "vllm"))))
"""
    )
    report = _run(code)
    assert report["blocked"] is True
    assert report["vllm_loaded"] == []
    assert "vllm_kvmem.host_tier.copy_engine" in report["core"]
    assert report["rc"] == 0
    # A real plan, computed without vLLM, from model_6l's shape: 6 layers of
    # K and V, 4 KV heads of 32, fp16.
    plan = report["plan"]
    assert plan["model"]["num_layers"] == 6
    assert plan["stages"][0]["kv_bytes_per_token"] == 6 * 2 * 4 * 32 * 2
