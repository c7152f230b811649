"""[KV Offload] SimpleCPUOffloadConnector on vLLM's CPU platform.

The worker of SimpleCPUOffloadConnector creates CUDA streams, pins its host
buffers with ``cudaHostRegister`` and copies with ``cuMemcpyBatchAsync``. On
the CPU platform the "device" KV cache is host memory: this PR adds a
``SyncCopyBackend`` (a tensor copy on the calling thread) and skips the
streams, the pinning and the compute-done event there, so the worker's event
bookkeeping is unchanged. The RFC is docs/rfc-host-kv-tier.md.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "simple_cpu_offload_cpu"
WORKER = "vllm/v1/simple_kv_offload/worker.py"
BACKEND = "vllm/v1/simple_kv_offload/copy_backend.py"
#: The worker's backend field, as this PR leaves it (the next PR anchors on it).
BACKEND_FIELD = (
    "        self._backend: DmaCopyBackend | DiskBackend | SyncCopyBackend | None"
    " = None\n"
)

MESSAGE = pr_text(
    overview="""\
Let `SimpleCPUOffloadConnector` run on vLLM's CPU platform. Today its worker
fails at startup there (`torch.cuda.Stream.priority_range`); with this PR a
synchronous copy path takes the place of the CUDA streams, events, pinning
and batched memcpy. First of a short series (RFC: "Lazy CPU offload: what it
lacks"); the next PR adds late spills to lazy mode.
""",
    claims=[
        "On the CPU platform the connector starts, stores and loads, eager and lazy.",
        (
            "A stored block comes back bit-exact, and the worker reports completions "
            "through the same event bookkeeping as on CUDA."
        ),
        "CUDA and ROCm paths are unchanged (every new branch tests `device.type`).",
        '`kv_offload_backend="disk"` is refused on CPU at startup, by name.',
    ],
    validation="""\
- `pytest tests/v1/simple_kv_offload/test_cpu_copy_path.py`: 2 passed (CPU
  build of vLLM 0.32.0 and 0.33.0). No GPU needed: the KV cache is a host
  tensor, so this also runs in GPU CI.
- Engine check on the CPU build (random-weight 8-layer Llama, float32, a
  12-block device cache, prompts revisited after eviction): lazy offload
  serves 50% of the revisited prefix tokens from CPU memory, greedy output
  equal to no offload; eager mode serves all of them (384 of 384 tokens),
  same output.
""",
    details="""\
On the CPU platform the "device" KV cache is host memory, so a block copy is
a tensor copy: `SyncCopyBackend.copy_blocks` gathers the source rows with
`index_select` and writes them with `index_copy_`, on the calling thread. It
has `DmaCopyBackend`'s interface; `launch_copy` records an already-complete
event, so `get_finished`, `_flush_and_sync_all` and the store high-water
mark need no change. Skipped on CPU: the two copy streams, `cudaHostRegister`
(and its warning), and the compute-done event before stores (the forward has
finished when `wait_for_save` runs on CPU). The disk backend uses CUDA
streams, so it is refused rather than half-supported.

Limitations: copies are synchronous, so they are not overlapped with
compute; on the CPU platform a forward and a copy share the same cores
anyway.
""",
    duplicates="""\
none found. `OffloadingConnector`'s CPU backend and
`kv_offload/cpu/` are CUDA-only as well; no open PR adds CPU support to
either connector. This reuses the connector's worker as it is.
""",
    design_fit=Answer(
        True,
        (
            "One backend class beside `DmaCopyBackend`, four `device.type` branches "
            "in the worker; no core file changes."
        ),
    ),
    testing=Answer(
        True,
        (
            "Unit tests run on any platform; the engine check above ran outside CI "
            "(CPU build)."
        ),
    ),
    code_quality=Answer(
        False,
        (
            "Code and comments: yes. Docs: vLLM has no page for this connector yet; "
            "none updated."
        ),
    ),
    contents=Answer(
        True,
        (
            "Root cause (CUDA-only worker), trade-off (synchronous copies) and "
            "evidence above."
        ),
    ),
)

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

    def shutdown(self) -> None:
        pass
'''


_BACKEND_FIELD = """\
        self._backend: DmaCopyBackend | DiskBackend | None = None
"""

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


def _changes() -> list:
    test = "tests/v1/simple_kv_offload/test_cpu_copy_path.py"
    return [
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
        Edit(
            WORKER, "        self._backend = DmaCopyBackend()\n", _CPU_BACKEND, "before"
        ),
        Edit(WORKER, _COMPUTE_DONE, _CPU_COMPUTE_DONE, where="replace"),
        NewFile(test, FILES / SLUG / test),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[KV Offload] Run SimpleCPUOffloadConnector on CPU",
    message=MESSAGE,
    changes={"0.32": _changes(), "0.33": _changes()},
)
