"""Host memory for the host KV tier: the block pool, pinned in place.

Pinning (``cudaHostRegister``) is what lets ``cudaMemcpyAsync`` run
asynchronously at full PCIe speed, and it is where a GPU server can die of a
host-side mistake: an error left pending in the CUDA runtime, a copy that
straddles two registrations, a pool left pinned after shutdown. Everything
about it lives here, apart from the copy engine, and reaches the runtime only
through :func:`_cudart`, so a stand-in can replace it on a machine without
a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_kvmem.host_tier.kv_region import KVRegion, host_slot_bytes

logger = logging.getLogger("vllm.kvmem.copy_engine")


#: Bytes pinned by one ``cudaHostRegister`` call (a multiple of the page size).
#: Bounded calls stay clear of driver limits on a single registration, and a
#: failure part way through is undone chunk by chunk.
HOST_REGISTER_CHUNK_BYTES = 1 << 30

# Pools not yet released or collected; see live_pools().
_LIVE_POOLS: weakref.WeakSet[HostBlockPool] = weakref.WeakSet()


def live_pools() -> list[HostBlockPool]:
    """Host pools that still hold their memory (not released, not collected).

    Lets tests and leak checks count what an engine left behind."""
    return list(_LIVE_POOLS)


#: What ``torch.cuda.cudart()`` binds (PyTorch's
#: ``torch/csrc/cuda/shared/cudart.cpp``, CUDA 12 and 13 builds): no
#: ``cudaGetLastError``. The tests' stand-in offers exactly these names.
TORCH_CUDART_BINDINGS = (
    "cudaError",
    "cudaGetErrorString",
    "cudaHostRegister",
    "cudaHostUnregister",
    "cudaMemGetInfo",
    "cudaProfilerStart",
    "cudaProfilerStop",
    "cudaStreamCreate",
    "cudaStreamDestroy",
)


def _cudart() -> Any:
    """The default CUDA runtime bindings for pinning (PyTorch's): the seam
    through which the pool reaches the runtime unless given one, so tests
    can substitute a stand-in on a machine without a GPU."""
    return torch.cuda.cudart()


#: Shared libraries whose ``*GetLastError`` clears the runtime's error slot.
_RUNTIME_LIBRARIES = (
    ("libcudart", "cudaGetLastError"),
    ("libamdhip64", "hipGetLastError"),
)


@functools.cache
def _loaded_runtime_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the CUDA runtime library this process has loaded
    (the one torch's bindings call into), through ctypes; None when none is
    loaded. PyTorch binds no such function, and a failed
    ``cudaHostRegister`` leaves its error pending in the runtime: the next
    kernel launch would raise it as its own."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for name, symbol in _RUNTIME_LIBRARIES:
        for path in sorted(p for p in paths if f"/{name}" in p):
            try:
                fn = getattr(ctypes.CDLL(path), symbol)
            except (OSError, AttributeError):
                continue
            fn.restype, fn.argtypes = ctypes.c_int, []
            return fn
    return None


def _clear_cuda_error(cudart: Any, err: int) -> None:
    """Reset the runtime's last-error slot after a failed (un)register, so it
    does not surface later as the error of an unrelated CUDA call.

    vLLM's ``CudaRTLibrary`` has ``cudaGetLastError``; PyTorch's bindings do
    not, so the process's runtime library is called directly. Must run on
    the thread that made the failed call (the error slot is per thread)."""
    clear = getattr(cudart, "cudaGetLastError", None)
    if clear is None:
        clear = _loaded_runtime_get_last_error()
    if clear is None:
        logger.warning(
            "cudaError %d from host memory registration could not be cleared (no "
            "CUDA runtime library found in this process); a later CUDA call may "
            "report it",
            err,
        )
        return
    clear()


def _round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple (this module imports no vLLM, so
    not ``vllm.utils.math_utils.round_up``)."""
    return -(-value // multiple) * multiple


def _page_aligned_empty(nbytes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``nbytes`` of host memory on whole pages that no other allocation shares.

    Returns ``(view, owner, registered_bytes)``. ``cudaHostRegister`` works on
    whole pages and refuses a page that is already registered, so a small
    pool sharing a page with another pinned buffer would fail to pin.
    """
    page = mmap.PAGESIZE
    span = _round_up(nbytes, page)
    owner = torch.empty(span + page, dtype=torch.uint8)
    start = -owner.data_ptr() % page
    return owner[start : start + nbytes], owner, span


def registration_bytes(slot_bytes: int) -> int:
    """Bytes of one pinned registration of a pool of ``slot_bytes`` slots.

    A registration must start and end on whole pages (the driver pins pages,
    and refuses one already pinned), and one ``cudaMemcpyAsync`` must not
    cross from one registration into the next (the driver rejects it or
    treats it as pageable, which blocks the host). Edges therefore fall on
    multiples of lcm(slot, page): whole slots and whole pages. As many of
    those as fit in ``HOST_REGISTER_CHUNK_BYTES``, and at least one even
    when it is bigger (a slot that shares few factors with the page size).
    """
    step = math.lcm(int(slot_bytes), mmap.PAGESIZE)
    return max(HOST_REGISTER_CHUNK_BYTES // step, 1) * step


def _register_chunks(ptr: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """``(address, size)`` pieces of ``chunk`` bytes (whole pages) that cover
    ``[ptr, ptr + nbytes)`` exactly; the last one is shorter unless the chunk
    size divides ``nbytes``."""
    page = mmap.PAGESIZE
    if ptr % page or nbytes % page or chunk % page:
        raise ValueError(
            f"host memory to pin must be whole pages: address {ptr:#x}, "
            f"{nbytes} bytes, chunks of {chunk}, page size {page}"
        )
    return [(ptr + off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


def _register_host_memory(cudart: Any, ptr: int, nbytes: int, chunk: int) -> list[int]:
    """Pin host memory in place with ``cudaHostRegister``, chunk by chunk.

    Returns the address of every registered chunk (what has to be
    unregistered). Pinning an existing allocation (instead of
    ``torch.empty(pin_memory=True)``) avoids PyTorch's caching host
    allocator, which rounds every pinned allocation up to a power of two: a
    100 GB pool would take 128 GB. If a chunk fails, its error is cleared,
    the chunks before it are unregistered and the error is raised: the pool
    is pinned whole or not at all, never partly.
    """
    chunks = _register_chunks(ptr, nbytes, chunk)
    done: list[int] = []
    for k, (address, size) in enumerate(chunks):
        err = int(cudart.cudaHostRegister(address, size, 0))
        if err == 0:
            done.append(address)
            continue
        _clear_cuda_error(cudart, err)
        _unregister_chunks(cudart, done)
        raise RuntimeError(
            f"cudaHostRegister failed with cudaError {err} on chunk {k + 1} of "
            f"{len(chunks)} ({(address - ptr) / 1024**3:.2f} GiB into the pool)"
        )
    return done


def _unregister_chunks(cudart: Any, addresses: Sequence[int]) -> None:
    """Unpin registered chunks, last first; a failure is logged and skipped,
    so one bad chunk does not leave the others pinned."""
    for address in reversed(addresses):
        try:
            err = int(cudart.cudaHostUnregister(address))
        except Exception:  # pragma: no cover - best effort at teardown
            logger.debug("cudaHostUnregister(%#x) raised", address, exc_info=True)
            continue
        if err != 0:
            _clear_cuda_error(cudart, err)
            logger.warning(
                "cudaHostUnregister(%#x) failed with cudaError %d", address, err
            )


def _release_host_memory(
    cudart: Any, addresses: list[int], owner: torch.Tensor
) -> None:
    """Unpin a pool's chunks. ``owner`` is the allocation: the finalizer holds
    it until this has run, so memory is never freed while still registered."""
    if addresses:
        _unregister_chunks(cudart, addresses)


#: ``madvise`` advice that faults pages in writable without touching their
#: contents (Linux 5.14+); ``mmap`` in Python 3.11 does not name it.
MADV_POPULATE_WRITE = 23


def _populate_write(tensor: torch.Tensor) -> bool:
    """Fault in the whole pages of ``tensor`` without writing to them.

    Safe while other threads write the same memory (the kernel only maps the
    pages). False where the kernel or libc cannot (older than Linux 5.14,
    not Linux): the caller then has to fault the pages in some other way.
    """
    page = mmap.PAGESIZE
    ptr = tensor.data_ptr()
    start = _round_up(ptr, page)
    end = (ptr + tensor.numel() * tensor.element_size()) // page * page
    if end <= start:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


def prefault_pages(tensor: torch.Tensor) -> None:
    """Fault in every page of a fresh host allocation.

    ``torch.empty`` returns lazily mapped memory: the first write to each
    page faults and zero-fills it, inside whichever copy happens to touch it
    first. For a host pool that is a save in the middle of a batch paying
    thousands of page faults; paying them once at startup keeps every later
    copy at memory speed. (A pinned pool is faulted in by registration.)

    Writes nothing where the kernel can populate pages for us, so it may run
    while copies already use the memory; otherwise it writes a zero to each
    page and must only run before anything else uses ``tensor``.
    """
    if not _populate_write(tensor):
        flat = tensor.view(-1).view(torch.uint8)
        flat[:: mmap.PAGESIZE].zero_()


class HostBlockPool:
    """Host memory for ``num_slots`` blocks of ``slot_bytes`` each.

    One contiguous uint8 tensor of shape ``[num_slots, slot_bytes]``; a slot
    holds every layer of one block back to back (region by region, layer by
    layer), so a slot is always one contiguous copy target whatever the
    device layout, and consecutive slots are one contiguous range.

    A pageable pool is pre-faulted in a background thread (``prefault``; see
    :func:`prefault_pages` and :meth:`wait_prefaulted`).

    ``pin_memory=None`` pins when CUDA is available: only pinned memory lets
    ``cudaMemcpyAsync`` run asynchronously at full PCIe speed. If pinning
    fails the pool stays pageable (correct, slower) and says so once, with
    the runtime's error cleared. ``cudart`` is the runtime to pin through
    (vLLM's ``CudaRTLibrary`` in a worker; PyTorch's bindings by default).
    A pinned pool is registered in pieces whose edges fall between slots
    (:func:`registration_bytes`); :meth:`split_runs` cuts a run of slots at
    those edges, so that no copy straddles two registrations.

    ``release()`` unpins and frees the memory at a known point (engine
    shutdown); a finalizer does the same if the pool is collected first.
    Pinned pages cannot be swapped out, so waiting for the garbage collector
    could leave a second engine in the same process short of memory.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        pin_memory: bool | None = None,
        prefault: bool = True,
        cudart: Any = None,
    ) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"HostBlockPool needs num_slots >= 1 and slot_bytes >= 1, got "
                f"num_slots={num_slots}, slot_bytes={slot_bytes}"
            )
        self.num_slots = int(num_slots)
        self.slot_bytes = int(slot_bytes)
        want_pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        shape = (self.num_slots, self.slot_bytes)
        # Chunk addresses to unregister; empty while the pool is not pinned.
        self._pinned_chunks: list[int] = []
        self._prefaulter: threading.Thread | None = None
        #: Slots per pinned registration (0: not pinned, no edges to respect).
        self.slots_per_registration = 0
        if want_pin:
            flat, owner, span = _page_aligned_empty(self.nbytes)
            chunk = registration_bytes(self.slot_bytes)
            try:
                if cudart is None:
                    cudart = _cudart()
                self._pinned_chunks = _register_host_memory(
                    cudart, flat.data_ptr(), span, chunk
                )
                self.slots_per_registration = chunk // self.slot_bytes
            except Exception as exc:
                logger.warning(
                    "Could not pin the %.2f GiB KV host pool (%s); using pageable "
                    "memory: copies stay correct but are slower and synchronous",
                    self.nbytes / 1024**3,
                    exc,
                )
            self.tensor = flat.view(shape)
            if prefault and not self._pinned_chunks:
                self._prefault_in_background(flat)
        else:
            owner = torch.empty(shape, dtype=torch.uint8)
            self.tensor = owner
            if prefault:
                self._prefault_in_background(owner)
        self.pinned = bool(self._pinned_chunks)
        # Runs at most once, whether called by release() or on collection:
        # the chunks are never unregistered twice.
        self._finalizer = weakref.finalize(
            self, _release_host_memory, cudart, self._pinned_chunks, owner
        )
        self._finalizer.atexit = False  # the process exit frees it anyway
        _LIVE_POOLS.add(self)

    @classmethod
    def for_regions(
        cls,
        regions: Sequence[KVRegion],
        num_slots: int,
        pin_memory: bool | None = None,
        prefault: bool = True,
        cudart: Any = None,
    ) -> HostBlockPool:
        """A pool whose slots fit one block of ``regions``."""
        return cls(
            num_slots,
            host_slot_bytes(regions),
            pin_memory=pin_memory,
            prefault=prefault,
            cudart=cudart,
        )

    def _prefault_in_background(self, memory: torch.Tensor) -> None:
        # A daemon thread (madvise releases the GIL): the engine finishes
        # starting meanwhile, and a copy that reaches a page first simply
        # faults it itself. The background fault-in must never write, or it
        # would race with those copies and zero their bytes: where the kernel
        # cannot populate without writing, pre-fault here, before anyone
        # else can see the pool.
        head = memory.view(-1)[: mmap.PAGESIZE * 2]
        if not _populate_write(head):
            logger.debug("madvise(MADV_POPULATE_WRITE) unavailable; pre-faulting now")
            prefault_pages(memory)
            return
        self._prefaulter = threading.Thread(
            target=_populate_write, args=(memory,), name="kvmem-prefault", daemon=True
        )
        self._prefaulter.start()

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Block until the background pre-fault is done; True when it is."""
        if self._prefaulter is not None:
            self._prefaulter.join(timeout)
            return not self._prefaulter.is_alive()
        return True

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Unpin (if pinned) and drop the memory now; idempotent.

        The caller must have finished every copy into or out of the pool.
        Views of ``tensor`` taken before keep the bytes allocated (unpinned)
        until they go away.
        """
        if self.released:
            return
        self._finalizer()
        self.pinned = False
        self.slots_per_registration = 0
        self.tensor = torch.empty((0, self.slot_bytes), dtype=torch.uint8)
        _LIVE_POOLS.discard(self)

    def split_runs(self, runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(first slot, count)`` runs cut where they cross a registration
        edge: each piece is one copy that stays inside one registration."""
        per = self.slots_per_registration
        if not per:
            return list(runs)
        out = []
        for start, count in runs:
            end = start + count
            while start < end:
                stop = min(end, (start // per + 1) * per)
                out.append((start, stop - start))
                start = stop
        return out

    def slot(self, slot_id: int) -> torch.Tensor:
        """The bytes of one slot (a view, for inspection and tests)."""
        return self.tensor[slot_id]
