"""Report the node's KV limit from the CPU worker when the split is active."""

from __future__ import annotations

from vllm_kvmem.patches import _worker_memory as w
from vllm_kvmem.patches._registry import Patch

PATCH = Patch(
    name="cpu_worker_memory",
    target="vllm.v1.worker.cpu_worker:CPUWorker.determine_available_memory",
    make_replacement=w.make_replacement,
    signature=("self",),
    processes=("CPU workers",),
    versions=("0.32", "0.33"),
    platforms=("cpu",),
    why=w.WHY + " CPUWorker overrides the GPU worker's method, so it needs its own.",
    how=w.HOW,
    upstream=w.UPSTREAM,
    remove_when=w.REMOVE_WHEN,
    idle=w.IDLE,
    native=w.NATIVE,
)
