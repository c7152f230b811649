"""Report the device's KV limit from the GPU worker when the split is active."""

from __future__ import annotations

from vllm_kvmem.patches import _worker_memory as w
from vllm_kvmem.patches._registry import Patch

PATCH = Patch(
    name="gpu_worker_memory",
    target="vllm.v1.worker.gpu_worker:Worker.determine_available_memory",
    make_replacement=w.make_replacement,
    signature=("self",),
    processes=("GPU workers",),
    versions=("0.32", "0.33"),
    platforms=("cuda", "rocm", "xpu"),
    why=w.WHY,
    how=w.HOW,
    upstream=w.UPSTREAM,
    remove_when=w.REMOVE_WHEN,
    idle=w.IDLE,
    native=w.NATIVE,
)
