"""Test scaffolding, not a PR: SimpleCPUOffloadConnector on vLLM's CPU platform.

The connector's worker creates CUDA streams, pins its host buffers with
``cudaHostRegister`` and copies with ``cuMemcpyBatchAsync``. The CPU build
has none of these, so an engine test of lazy offload (the late spills PR's
contract, ``tests/test_intree_offload.py``) cannot run here as vLLM ships it.
These edits stand in for what this machine lacks (a GPU): a synchronous copy
backend and no streams, pinning or compute-done event on the CPU platform.

It is not proposed upstream. On the CPU platform the "device" KV cache is
host memory already, so a larger ``VLLM_CPU_KVCACHE_SPACE`` holds the same
blocks with no copies: an offload tier there serves no CPU user, and the
only gain would be test coverage. :func:`apply` edits a vLLM tree in place,
after the series (its anchors are text the series leaves unchanged).
"""

from __future__ import annotations

from pathlib import Path

from kvmem_tools.intree.edits import Edit

SLUG = "cpu_scaffolding"
WORKER = "vllm/v1/simple_kv_offload/worker.py"
BACKEND = "vllm/v1/simple_kv_offload/copy_backend.py"

_SYNC = '''

class _CopyDone:
    """The event of a copy that ran on the calling thread: already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SyncCopyBackend:
    """Block copies on the calling thread: no streams, no pinning.

    For vLLM's CPU platform, where the "device" KV cache is host memory, so a
    block copy is a tensor copy. A copy has finished when ``launch_copy``
    returns; its completion goes into ``events_list`` as an event that reports
    complete, so the worker's bookkeeping is the one it keeps for
    ``DmaCopyBackend``.
    """

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def init(
        self,
        device_caches: dict[str, torch.Tensor],
        cpu_caches: dict[str, torch.Tensor],
    ) -> None:
        self._pairs = [(device_caches[n], cpu_caches[n]) for n in device_caches]

    def copy_blocks(
        self, src_blocks: list[int], dst_blocks: list[int], is_store: bool
    ) -> None:
        """Copy whole blocks, device to CPU if ``is_store``, else CPU to device."""
        for device_cache, cpu_cache in self._pairs:
            src, dst = (
                (device_cache, cpu_cache) if is_store else (cpu_cache, device_cache)
            )
            rows = src.index_select(0, torch.tensor(src_blocks, device=src.device))
            dst.index_copy_(
                0, torch.tensor(dst_blocks, device=dst.device), rows.to(dst.device)
            )

    def launch_copy(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: torch.Event | None = None,
    ) -> None:
        self.copy_blocks(src_blocks, dst_blocks, is_store)
        events_list.append((event_idx, _CopyDone()))

    def copy_before_overwrite(
        self, src_blocks: list[int], dst_blocks: list[int]
    ) -> _CopyDone:
        self.copy_blocks(src_blocks, dst_blocks, is_store=True)
        return _CopyDone()

    def shutdown(self) -> None:
        pass
'''

_STREAMS = """\
        # Use lowest priority so KV cache I/O yields to compute streams.
        low_pri, _ = torch.cuda.Stream.priority_range()
        self.load_stream = torch.cuda.Stream(priority=low_pri)
        self.store_stream = torch.cuda.Stream(priority=low_pri)
"""

_CPU_STREAMS = """\
        if self.device.type == "cpu":
            # CPU platform: no streams; blocks are copied synchronously.
            if self.disk_mode:
                raise ValueError(
                    'kv_offload_backend="disk" is not supported on the CPU '
                    'platform; use kv_offload_backend="cpu".'
                )
        else:
            # Use lowest priority so KV cache I/O yields to compute streams.
            low_pri, _ = torch.cuda.Stream.priority_range()
            self.load_stream = torch.cuda.Stream(priority=low_pri)
            self.store_stream = torch.cuda.Stream(priority=low_pri)
"""

_PIN = """\
        pin_memory = PIN_MEMORY
        if not pin_memory:
"""

_CPU_PIN = """\
        # On the CPU platform the device KV cache is host memory already.
        on_cpu = device.type == "cpu"
        pin_memory = PIN_MEMORY and not on_cpu
        if not pin_memory and not on_cpu:
"""

_CPU_BACKEND = """\
        if on_cpu:
            self._backend = SyncCopyBackend()
            self._backend.init(unique_gpu_caches, self.cpu_kv_caches)
            return
"""

_COMPUTE_DONE = """\
            if self._store_compute_done is None:
                self._store_compute_done = torch.Event()
            self._store_compute_done.record(torch.cuda.current_stream())
"""

_CPU_COMPUTE_DONE = """\
            if self.store_stream is not None:  # None on the CPU platform
                if self._store_compute_done is None:
                    self._store_compute_done = torch.Event()
                self._store_compute_done.record(torch.cuda.current_stream())
"""


#: The worker's backend field, as vLLM ships it and as the scaffolding leaves it.
_BACKEND_FIELD = """\
        self._backend: DmaCopyBackend | DiskBackend | None = None
"""
BACKEND_FIELD = (
    "        self._backend: DmaCopyBackend | DiskBackend | SyncCopyBackend | None"
    " = None\n"
)

EDITS = (
    Edit(BACKEND, "import threading\n", "from typing import Any\n"),
    Edit(BACKEND, "            events_list.append((event_idx, event))\n", _SYNC),
    Edit(
        WORKER,
        "from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend\n",
        "from vllm.v1.simple_kv_offload.copy_backend import "
        "DmaCopyBackend, SyncCopyBackend\n",
        where="replace",
    ),
    Edit(WORKER, _BACKEND_FIELD, BACKEND_FIELD, where="replace"),
    Edit(WORKER, _STREAMS, _CPU_STREAMS, where="replace"),
    Edit(WORKER, _PIN, _CPU_PIN, where="replace"),
    Edit(WORKER, "        self._backend = DmaCopyBackend()\n", _CPU_BACKEND, "before"),
    Edit(WORKER, _COMPUTE_DONE, _CPU_COMPUTE_DONE, where="replace"),
)


def apply(tree: Path) -> None:
    """Make SimpleCPUOffloadConnector run on the CPU platform in the vLLM
    tree under ``tree`` (a copy: it is edited in place)."""
    for edit in EDITS:
        edit.apply(tree, SLUG)
