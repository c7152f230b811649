"""The host pool's pinning, proven with stand-ins for the CUDA runtime.

This machine has no GPU, so the runtime the pool pins through is replaced by
stand-ins that offer exactly what the real bindings offer and model the one
piece of runtime state that matters here: the per-thread last-error slot,
which a failed ``cudaHostRegister`` sets and the next kernel launch raises
as its own error unless it is cleared first.

- ``torch``: PyTorch's ``torch.cuda.cudart()`` bindings, whose names
  (``TORCH_CUDART_BINDINGS``) come from PyTorch's source and are checked
  against the real module where CUDA is available. They have no
  ``cudaGetLastError``; the pool clears through the process's runtime
  library, whose seam shares the stand-in's error slot.
- ``vllm``: vLLM's ``CudaRTLibrary``; its names are read from the real class.
"""

from __future__ import annotations

import gc
import logging
import math
import mmap
import random

import pytest
import torch

from tests.helpers import captured_log
from vllm_kvmem.host_tier import host_pool
from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine
from vllm_kvmem.host_tier.host_pool import (
    TORCH_CUDART_BINDINGS,
    HostBlockPool,
    registration_bytes,
)
from vllm_kvmem.host_tier.kv_region import KVRegion

PAGE = mmap.PAGESIZE
ERROR = 2  # cudaErrorMemoryAllocation


def _vllm_cudart_names() -> set[str]:
    from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

    return {n for n in dir(CudaRTLibrary) if n.startswith("cuda") and n[4].isupper()}


class Runtime:
    """What the pool can observe of a CUDA runtime: registrations and the
    last-error slot. Fails the ``fail_on``-th register call (1-based)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.registered: list[tuple[int, int]] = []  # (address, size) that pinned
        self.register_calls = 0
        self.unregistered: list[int] = []
        self.pending = 0  # the last-error slot

    def register(self, ptr: int, size: int, flags: int = 0) -> int:
        self.register_calls += 1
        if self.register_calls == self.fail_on:
            self.pending = ERROR
            return ERROR
        for a, n in self.registered:
            assert ptr + size <= a or a + n <= ptr, "registered a page twice"
        self.registered.append((ptr, size))
        return 0

    def unregister(self, ptr: int) -> int:
        assert ptr in {a for a, _ in self.registered}, "unregistered a foreign ptr"
        assert ptr not in self.unregistered, "unregistered twice"
        self.unregistered.append(ptr)
        return 0

    def get_last_error(self) -> int:
        err, self.pending = self.pending, 0
        return err

    def launch_kernel(self) -> None:
        """PyTorch checks every launch with cudaGetLastError
        (C10_CUDA_KERNEL_LAUNCH_CHECK): a pending error fails the launch."""
        if err := self.get_last_error():
            raise RuntimeError(f"CUDA error {err} raised by an unrelated kernel")

    def registration_of(self, ptr: int, nbytes: int) -> int:
        """Index of the registration holding ``[ptr, ptr + nbytes)`` whole."""
        for k, (a, n) in enumerate(self.registered):
            if a <= ptr and ptr + nbytes <= a + n:
                return k
        raise AssertionError(f"{nbytes} bytes at {ptr:#x} span two registrations")


def _bindings(runtime: Runtime, names: set[str]) -> object:
    """An object with exactly ``names``: the pool's calls go to ``runtime``,
    the rest are there (as on the real object) but not used by the pool."""
    impl = {
        "cudaHostRegister": runtime.register,
        "cudaHostUnregister": runtime.unregister,
        "cudaGetLastError": runtime.get_last_error,
    }

    def unused(name):
        def call(*args):
            raise AssertionError(f"the pool called {name}, which it does not need")

        return call

    attrs = {n: impl.get(n) or unused(n) for n in names}
    return type("CudartStandIn", (), {k: staticmethod(v) for k, v in attrs.items()})()


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.fixture(params=["torch", "vllm"])
def runtime(request, monkeypatch):
    """A fresh Runtime behind the pool's default seam (``torch``: PyTorch's
    bindings and the process's runtime library) or passed as vLLM's
    ``CudaRTLibrary`` would be (``vllm``), with 4-page registrations so that a
    pool of a few dozen KiB spans several."""
    rt = Runtime()
    monkeypatch.setattr(host_pool, "HOST_REGISTER_CHUNK_BYTES", 4 * PAGE + 1)
    if request.param == "torch":
        monkeypatch.setattr(
            host_pool, "_cudart", lambda: _bindings(rt, set(TORCH_CUDART_BINDINGS))
        )
        monkeypatch.setattr(
            host_pool, "_loaded_runtime_get_last_error", lambda: rt.get_last_error
        )
        rt.cudart = None
    else:
        monkeypatch.setattr(host_pool, "_cudart", _no_default_runtime)
        rt.cudart = _bindings(rt, _vllm_cudart_names())
    return rt


def _no_default_runtime():
    raise AssertionError("a pool given a runtime must not reach for the default")


def _pool(rt: Runtime, num_slots: int, slot_bytes: int) -> HostBlockPool:
    return HostBlockPool(num_slots, slot_bytes, pin_memory=True, cudart=rt.cudart)


# -- the stand-ins are the real thing's shape ----------------------------------


def test_stand_ins_offer_exactly_what_the_real_runtimes_offer():
    rt = Runtime()
    torch_like = _bindings(rt, set(TORCH_CUDART_BINDINGS))
    assert _public(torch_like) == set(TORCH_CUDART_BINDINGS)
    assert "cudaGetLastError" not in _public(torch_like)
    vllm_like = _bindings(rt, _vllm_cudart_names())
    assert {"cudaHostRegister", "cudaHostUnregister", "cudaGetLastError"} <= _public(
        vllm_like
    )
    if torch.cuda.is_available():  # the GPU machine: the list is PyTorch's own
        real = {n for n in _public(torch.cuda.cudart()) if n.startswith("cuda")}
        assert real == set(TORCH_CUDART_BINDINGS)


# -- a failed pin falls back and leaves nothing pending ------------------------


def test_pool_pinning_falls_back_with_one_warning_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with captured_log("vllm.kvmem.copy_engine") as records:
        pool = HostBlockPool(4, 64, pin_memory=True)
    assert not pool.pinned and pool.tensor.shape == (4, 64)
    assert pool.tensor.data_ptr() % mmap.PAGESIZE == 0  # pinnable pages of its own
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "pageable" in records[0].getMessage()
    assert not HostBlockPool(4, 64).pinned  # default: pin only with CUDA


@pytest.mark.parametrize("fail_on", [1, 3, 4])
def test_failed_pin_rolls_back_and_leaves_no_cuda_error_pending(runtime, fail_on):
    runtime.fail_on = fail_on  # chunks before it pin, then it fails (of 4)
    with captured_log("vllm.kvmem.copy_engine") as records:
        pool = _pool(runtime, 16, PAGE)
    assert runtime.register_calls == fail_on  # stopped at the failure
    succeeded = [a for a, _ in runtime.registered]
    assert len(succeeded) == fail_on - 1
    assert runtime.unregistered == succeeded[::-1]  # exactly those, last first
    # The documented fallback: the next kernel launch (the worker's warm-up)
    # does not inherit the registration's error.
    assert runtime.pending == 0
    runtime.launch_kernel()
    assert not pool.pinned and pool.slots_per_registration == 0
    assert [r.levelno for r in records] == [logging.WARNING]
    msg = records[0].getMessage()
    assert "pageable" in msg and f"chunk {fail_on} of 4" in msg
    pool.tensor.fill_(7)  # the pageable pool is usable
    pool.release()
    assert len(runtime.unregistered) == fail_on - 1  # release unpins nothing


def test_error_that_cannot_be_cleared_is_said(monkeypatch):
    rt = Runtime(fail_on=1)
    monkeypatch.setattr(host_pool, "_loaded_runtime_get_last_error", lambda: None)
    torch_like = _bindings(rt, set(TORCH_CUDART_BINDINGS))
    with captured_log("vllm.kvmem.copy_engine") as records:
        pool = HostBlockPool(4, PAGE, pin_memory=True, cudart=torch_like)
    assert not pool.pinned and rt.pending == ERROR
    messages = [r.getMessage() for r in records]
    assert any(
        "could not be cleared" in m and f"cudaError {ERROR}" in m for m in messages
    )


def test_no_runtime_library_is_loaded_in_a_cpu_process():
    if torch.cuda.is_available():
        pytest.skip("a CUDA process has the runtime library loaded")
    assert host_pool._loaded_runtime_get_last_error() is None


# -- registrations end between slots; copies stay inside one -------------------


def test_pinned_chunks_cover_the_pool_exactly(runtime):
    # 10.5 pages of slots: 11 pages to pin, in chunks of 4 + 4 + 3 pages (the
    # chunk size 4 pages + 1 byte is rounded down to whole pages).
    pool = _pool(runtime, 21, PAGE // 2)
    start = pool.tensor.data_ptr()
    span = -(-pool.nbytes // PAGE) * PAGE
    assert pool.pinned and span == 11 * PAGE
    chunks = runtime.registered
    assert [size for _, size in chunks] == [4 * PAGE, 4 * PAGE, 3 * PAGE]
    assert chunks[0][0] == start
    for (a, size), (b, _) in zip(chunks, chunks[1:]):
        assert b == a + size  # no gap, no overlap
    assert all(a % PAGE == 0 and size % PAGE == 0 for a, size in chunks)
    assert chunks[-1][0] + chunks[-1][1] == start + span
    assert pool.slots_per_registration == 8
    pool.release()


SLOT_SIZES = [
    5 * 256 * 1024,  # 80 layers x 16 KiB pages: 1.25 MiB, does not divide 1 GiB
    3 * PAGE,
    PAGE // 2,
    6144,  # 1.5 pages
    3000,  # shares only a factor of 8 with the page
    2 * PAGE,
]


@pytest.mark.parametrize("slot_bytes", SLOT_SIZES)
@pytest.mark.parametrize("cap_pages", [1, 4, 16])
def test_registrations_end_on_slot_and_page_edges(monkeypatch, slot_bytes, cap_pages):
    monkeypatch.setattr(host_pool, "HOST_REGISTER_CHUNK_BYTES", cap_pages * PAGE)
    size = registration_bytes(slot_bytes)
    assert size % PAGE == 0 and size % slot_bytes == 0
    assert size <= max(cap_pages * PAGE, slot_bytes * PAGE)
    # The most whole lcm(slot, page) steps that fit the cap.
    step = math.lcm(slot_bytes, PAGE)
    assert size == max(cap_pages * PAGE // step, 1) * step


def _region(slot_bytes: int, num_blocks: int, layers: int) -> KVRegion:
    """A device cache (on CPU) whose block is ``slot_bytes``: one span per
    block (direct) with 1 layer, layer-outer (gather) with several."""
    page = slot_bytes // layers
    base = torch.randint(0, 255, (num_blocks * slot_bytes,), dtype=torch.uint8)
    if layers == 1:
        return KVRegion(base, 0, 1, page, page, page, num_blocks=num_blocks)
    return KVRegion(
        base, 0, layers, page, num_blocks * page, page, num_blocks=num_blocks
    )


@pytest.mark.parametrize("slot_bytes", SLOT_SIZES)
@pytest.mark.parametrize("layers", [1, 2])
def test_no_copy_crosses_a_registration(runtime, monkeypatch, slot_bytes, layers):
    """Property test: random pool sizes and block-run patterns (runs of
    consecutive slots across registration edges, scattered slots, reversed
    orders); every memcpy touching the pool stays inside one registration,
    and the bytes round-trip exactly."""
    rng = random.Random(slot_bytes * 10 + layers)
    monkeypatch.setattr(
        host_pool, "HOST_REGISTER_CHUNK_BYTES", max(slot_bytes * 3, 4 * PAGE) + 1
    )
    per = registration_bytes(slot_bytes) // slot_bytes
    for pattern in ["across an edge", "run", "scattered", "reversed"]:
        num_slots = rng.randint(per + 2, 3 * per + 2)  # two registrations or more
        num_blocks = num_slots + 4
        region = _region(slot_bytes, num_blocks, layers)
        pool = _pool(runtime, num_slots, slot_bytes)
        assert pool.pinned and pool.slots_per_registration == per
        engine = BlockCopyEngine([region], pool)
        lo, hi = pool.tensor.data_ptr(), pool.tensor.data_ptr() + pool.nbytes
        copies = []

        def checked_copy(dst, src, _copy=engine._copy, lo=lo, hi=hi, copies=copies):
            for t in (dst, src):
                if lo <= t.data_ptr() < hi:
                    assert t.is_contiguous()
                    nbytes = t.numel() * t.element_size()
                    copies.append(runtime.registration_of(t.data_ptr(), nbytes))
            _copy(dst, src)

        monkeypatch.setattr(engine, "_copy", checked_copy)
        if pattern == "across an edge":  # one run of slots over the first edge
            slots = list(range(per - 1, min(num_slots, 2 * per + 1)))
        else:
            n = rng.randint(2, num_slots)
            first = rng.randint(0, num_slots - n)
            slots = list(range(first, first + n))
            if pattern != "run":
                slots = rng.sample(range(num_slots), n)
            if pattern == "reversed":
                slots.sort(reverse=True)
        blocks = rng.sample(range(num_blocks), len(slots))
        expected = [engine.block_image(b) for b in blocks]
        engine.save(blocks, slots)
        for slot, image in zip(slots, expected):
            assert torch.equal(engine.slot_image(slot), image)
        targets = rng.sample(range(num_blocks), len(slots))
        engine.load(slots, targets)
        for block, image in zip(targets, expected):
            assert torch.equal(engine.block_image(block), image)
        if pattern == "across an edge":
            assert len(set(copies)) >= 2  # the run was cut at the edge
        engine.close()
        runtime.registered.clear()
        runtime.unregistered.clear()


# -- release and pre-faulting --------------------------------------------------


def test_release_unpins_every_chunk_once_and_frees(runtime):
    from vllm_kvmem.host_tier.host_pool import live_pools

    pool = _pool(runtime, 12, PAGE)
    chunks = [a for a, _ in runtime.registered]
    assert len(chunks) == 3 and pool in live_pools()
    pool.release()
    assert sorted(runtime.unregistered) == sorted(chunks)
    assert pool.released and not pool.pinned and pool.tensor.numel() == 0
    assert pool not in live_pools()
    pool.release()  # idempotent
    del pool
    gc.collect()  # the finalizer already ran: no second unregister
    assert sorted(runtime.unregistered) == sorted(chunks)


def test_collected_pool_is_unpinned_by_its_finalizer(runtime):
    from vllm_kvmem.host_tier.host_pool import live_pools

    before = len(live_pools())
    pool = _pool(runtime, 8, PAGE)
    chunks = [a for a, _ in runtime.registered]
    assert len(live_pools()) == before + 1
    del pool
    gc.collect()
    assert sorted(runtime.unregistered) == sorted(chunks)
    assert len(live_pools()) == before


def test_pageable_pool_is_prefaulted_so_copies_do_not_fault():
    """A save into a fresh pageable pool must not pay one page fault per page
    (the first-touch cost that dominated the host tier's stalls on CPU)."""
    import resource

    nbytes = 64 << 20
    src = torch.ones(nbytes, dtype=torch.uint8)

    def faults_copying_into(pool: HostBlockPool) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        pool.tensor.view(-1).copy_(src)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    cold = HostBlockPool(64, 1 << 20, pin_memory=False, prefault=False)
    warm = HostBlockPool(64, 1 << 20, pin_memory=False)
    assert warm.wait_prefaulted(timeout=60)
    cold_faults, warm_faults = faults_copying_into(cold), faults_copying_into(warm)
    # Without pre-faulting the copy faults at least once per 2 MiB (per 4 KiB
    # page without transparent huge pages); pre-faulted, almost never.
    assert cold_faults >= nbytes // (2 << 20)
    assert warm_faults <= cold_faults // 8


def test_background_prefault_never_overwrites_what_copies_wrote():
    """The pool is usable at once: bytes written while the background
    pre-fault runs survive it (a pre-fault that wrote zeros to each page
    raced with the first saves and corrupted them)."""
    from vllm_kvmem.host_tier.host_pool import MADV_POPULATE_WRITE, _populate_write

    assert MADV_POPULATE_WRITE == 23
    pool = HostBlockPool(256, 1 << 20, pin_memory=False)
    flat = pool.tensor.view(-1)
    flat.fill_(0xAB)  # races with the pre-fault thread started above
    assert pool.wait_prefaulted(timeout=60)
    assert bool((flat[:: mmap.PAGESIZE] == 0xAB).all())
    assert bool((flat == 0xAB).all())
    # Populating an already-written range keeps its bytes too.
    assert _populate_write(flat) in (True, False)
    assert bool((flat[:: mmap.PAGESIZE] == 0xAB).all())
