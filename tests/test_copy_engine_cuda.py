"""The copy engine's CUDA paths, on KV caches built with plain torch.

``tests/test_copy_engine.py`` proves the engine on caches that vLLM itself
plans and allocates, so it needs vLLM. The GPU machine has none until its
wheels are carried there (``scripts/gpu/``), so this file builds the same
byte placement without vLLM: :func:`plain_cache` restates vLLM 0.32's
``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` arithmetic for
LBHNC (layer-outer) and BLHNC (block-outer), one region per page size.
``test_plain_cache_matches_vllm`` holds it to vLLM's own where vLLM is
installed (CI, on CPU).

- bit-exact round trips on every device there is (CPU here, CUDA there):
  direct copies, the gather path and its staging in chunks, pinned pool
  (wherever CUDA is available, also for a CPU cache); ``strategy="auto"`` on
  a block-outer layout, which on CUDA gathers a call of many scattered small
  blocks and copies a run directly;
- the race test (CUDA only): a compute stream that is still busy writing the
  blocks a save reads, or the blocks a load fills. The engine orders its
  copy stream after the compute stream (``BlockCopyEngine._submit``:
  ``stream.wait_stream(current_stream)``), so the save sees the compute
  stream's bytes and the load lands after its write. With that wait removed
  (``torch.cuda.Stream.wait_stream`` patched to do nothing) the same test
  must see the race: the save reads the old bytes, the load is overwritten.
  The compute stream's work is a spin kernel of ``SPIN_MS`` (200 ms) and then
  the write, while a copy takes microseconds, so the unordered variant loses
  the race unless the host stalls for 200 ms between two calls: in practice
  every time;
- the consumer's side: a save whose copy is held back must be waited for
  (``CopyJob.make_current_stream_wait``) before the compute stream
  overwrites the saved blocks;
- ``StreamWaitTimer`` on real events: the stall it reports is the copy's
  duration when the compute stream waits on a long copy, and zero when the
  copy finished first.

Nothing here imports vLLM (the GPU machine runs it in stage 1,
``scripts/gpu/stage1.sh``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from tests.copy_checks import CASES, random_bytes, round_trip
from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine, CopyJob
from vllm_kvmem.host_tier.copy_strategy import (
    BATCH_BELOW_BLOCK_BYTES,
    gather_min_copies,
)
from vllm_kvmem.host_tier.host_pool import TORCH_CUDART_BINDINGS, HostBlockPool
from vllm_kvmem.host_tier.kv_region import KVRegion, host_slot_bytes
from vllm_kvmem.host_tier.wait_timer import StreamWaitTimer

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
LAYOUTS = ["LBHNC", "BLHNC"]
SPIN_MS = 200.0


# -- a KV cache laid out as vLLM 0.32 lays it out, without vLLM -------------------


@dataclass
class PlainCache:
    layout: str
    base: torch.Tensor  # the one backing allocation, uint8
    regions: list[KVRegion]

    def page(self, region: KVRegion, layer: int, block: int) -> torch.Tensor:
        start = (
            region.offset + layer * region.layer_stride + block * region.block_stride
        )
        return self.base[start : start + region.page_bytes]

    def block_bytes(self, block: int) -> torch.Tensor:
        """Every layer's page of ``block``, region by region (the host slot's
        order), read from the geometry formula, not through the engine."""
        return torch.cat(
            [
                self.page(r, layer, block)
                for r in self.regions
                for layer in range(r.num_layers)
            ]
        ).cpu()


def plain_cache(
    layout: str,
    head_sizes: list[int],
    *,
    num_blocks: int = 24,
    block_size: int = 16,
    num_kv_heads: int = 2,
    dtype_bytes: int = 2,
    device: str = "cpu",
) -> PlainCache:
    """vLLM 0.32's placement: layers grouped by page size in order of first
    appearance (one ``KVCacheTensor`` each); LBHNC puts each group's layers
    one after another, each layer's blocks contiguous; BLHNC puts every
    layer of a block together, the groups side by side inside a block."""
    groups: list[tuple[int, int]] = []  # (page bytes, layers)
    for h in head_sizes:
        page = 2 * num_kv_heads * h * dtype_bytes * block_size
        for i, (p, n) in enumerate(groups):
            if p == page:
                groups[i] = (p, n + 1)
                break
        else:
            groups.append((page, 1))
    block_span = sum(p * n for p, n in groups)
    base = torch.zeros(num_blocks * block_span, dtype=torch.uint8, device=device)
    regions, offset = [], 0
    for page, layers in groups:
        if layout == "LBHNC":
            layer_stride, block_stride = num_blocks * page, page
            step = layers * num_blocks * page
        elif layout == "BLHNC":
            layer_stride, block_stride = page, block_span
            step = layers * page
        else:
            raise ValueError(layout)
        if layers == 1:  # no second layer: vLLM's views give the page
            layer_stride = page
        regions.append(
            KVRegion(base, offset, layers, page, layer_stride, block_stride, num_blocks)
        )
        offset += step
    return PlainCache(layout, base, regions)


def make_engine(cache: PlainCache, num_slots: int = 32, **kw) -> BlockCopyEngine:
    pool = HostBlockPool.for_regions(cache.regions, num_slots)
    return BlockCopyEngine(cache.regions, pool, cache.base.device, **kw)


def test_plain_cache_matches_vllm():
    """The plain builder gives vLLM's own geometry (where vLLM is installed)."""
    kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    worker_utils = pytest.importorskip("vllm.v1.worker.utils")
    import types

    from vllm.v1.kv_cache_layout import KVCacheLayout

    for layout in LAYOUTS:
        for head_sizes in ([64] * 4, [64, 64, 64, 32, 32], [64, 64, 32]):
            specs = {
                f"model.layers.{i}.attn": kv_iface.FullAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=h, dtype=torch.bfloat16
                )
                for i, h in enumerate(head_sizes)
            }
            spec = (
                next(iter(specs.values()))
                if len(set(head_sizes)) == 1
                else kv_iface.UniformTypeKVCacheSpecs(
                    block_size=16, kv_cache_specs=specs
                )
            )
            cfg = types.SimpleNamespace(
                cache_config=types.SimpleNamespace(
                    get_resolved_kv_cache_layout=lambda lay=layout: KVCacheLayout[lay],
                    num_gpu_blocks_override=24,
                    prefix_cache_retention_interval=None,
                ),
                attention_config=types.SimpleNamespace(hisparse_config=None),
            )
            config = kv_utils.get_kv_cache_config_from_groups(
                cfg, [kv_iface.KVCacheGroupSpec(list(specs), spec)], 1 << 40
            )
            caches = worker_utils.allocate_kv_cache(
                config, torch.device("cpu"), KVCacheLayout[layout]
            )
            theirs = [
                KVRegion.from_views([caches[n] for n in t.layers], config.num_blocks)
                for t in config.kv_cache_tensors
            ]
            ours = plain_cache(layout, head_sizes).regions
            assert len(ours) == len(theirs), (layout, head_sizes)
            assert ours[0].base.numel() == theirs[0].base.numel()
            for a, b in zip(ours, theirs):
                for name in (
                    "offset",
                    "num_layers",
                    "page_bytes",
                    "layer_stride",
                    "block_stride",
                    "num_blocks",
                ):
                    assert getattr(a, name) == getattr(b, name), (
                        layout,
                        head_sizes,
                        name,
                    )


# -- bit-exact round trips -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_bit_exact(device, layout, head_sizes, case):
    cache = plain_cache(layout, head_sizes, device=device)
    engine = make_engine(cache)
    # 28-32 KiB blocks: auto gathers them on CUDA whatever the layout.
    block_outer_direct = layout == "BLHNC" and device == "cpu"
    assert engine.strategy == ("direct" if block_outer_direct else "gather")
    # The pool pins wherever CUDA is available, whatever the cache's device.
    assert engine.pool.pinned == CUDA
    round_trip(cache, engine, *CASES[case])
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forced_gather_and_small_staging_round_trip(device, layout):
    """The gather path (the staging buffer on CUDA) in staging-sized chunks."""
    cache = plain_cache(layout, [64, 64, 32], device=device)
    slot = host_slot_bytes(cache.regions)
    engine = make_engine(cache, strategy="gather", max_staging_bytes=2 * slot)
    round_trip(cache, engine, *CASES["unsorted"])
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_large_blocks_round_trip(device):
    """8B-like pages (32 layers, 8 heads of 128, 16 tokens: 2 MiB blocks),
    both layouts, a run long enough to coalesce."""
    for layout in LAYOUTS:
        cache = plain_cache(
            layout, [128] * 32, num_blocks=12, num_kv_heads=8, device=device
        )
        engine = make_engine(cache, num_slots=8)
        assert engine.slot_bytes == 2 * 1024**2 == BATCH_BELOW_BLOCK_BYTES
        # At the threshold: one copy per block on every device.
        assert engine.strategy == ("direct" if layout == "BLHNC" else "gather")
        round_trip(cache, engine, [1, 2, 3, 9], [0, 1, 2, 7], [4, 5, 6, 10])
        engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_auto_on_block_outer_small_blocks(device):
    """``auto`` on BLHNC with 32 KiB blocks: on CUDA a call of many scattered
    blocks gathers (the batched path) and a run of consecutive blocks is one
    direct copy; on CPU both are direct. Bit exact either way."""
    cache = plain_cache("BLHNC", [64] * 4, device=device)
    engine = make_engine(cache)
    assert engine.slot_bytes < BATCH_BELOW_BLOCK_BYTES
    many = gather_min_copies(engine.slot_bytes) + 4
    src = list(range(1, 2 * many, 2))  # every other block: one copy each
    slots = list(range(many))[::-1]
    dst = list(range(0, 2 * many, 2))
    assert max(src) < 24
    round_trip(cache, engine, src, slots, dst)
    scattered = engine.save(src, slots)
    run = engine.save(list(range(4, 12)), list(range(8)))
    for job in (scattered, run):
        job.wait()
    assert scattered.strategy == ("gather" if device == "cuda" else "direct")
    assert run.strategy == "direct" and run.num_ops == 1
    engine.close()


# -- CUDA only: bindings, races, the wait timer -----------------------------------


@needs_cuda
def test_torch_cudart_bindings_are_the_real_ones():
    """The host pool's stand-in list is what torch.cuda.cudart() binds."""
    real = {n for n in dir(torch.cuda.cudart()) if n.startswith("cuda")}
    assert real == set(TORCH_CUDART_BINDINGS)


@pytest.fixture(scope="module")
def spin():
    """``spin(ms)``: a kernel on the current stream that runs ``ms``
    milliseconds (``torch.cuda._sleep``, calibrated with events)."""
    if not CUDA:
        pytest.skip("needs CUDA")
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # load the kernel
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / start.elapsed_time(end)

    def run(ms: float) -> None:
        torch.cuda._sleep(int(per_ms * ms))

    return run


def _unordered(monkeypatch, calls: list[int]) -> None:
    """Remove the copy stream's wait on the compute stream."""
    monkeypatch.setattr(
        torch.cuda.Stream, "wait_stream", lambda self, other: calls.append(1)
    )


def _ordered_spy(monkeypatch, calls: list[int]) -> None:
    real = torch.cuda.Stream.wait_stream

    def spy(self, other):
        calls.append(1)
        return real(self, other)

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", spy)


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "wait_removed"])
def test_save_reads_what_the_compute_stream_wrote(spin, monkeypatch, layout, ordered):
    cache = plain_cache(layout, [64] * 4, device="cuda")
    engine = make_engine(cache)
    blocks, slots = [3, 7, 11, 12], [0, 1, 2, 3]
    engine.save(blocks, slots).wait()  # warm: kernels loaded, index pinned
    n = cache.base.numel()
    old = random_bytes(n, 10, "cuda")
    new = random_bytes(n, 11, "cuda")
    cache.base.copy_(old)
    torch.cuda.synchronize()
    calls: list[int] = []
    (_ordered_spy if ordered else _unordered)(monkeypatch, calls)
    spin(SPIN_MS)  # the compute stream is busy ...
    cache.base.copy_(new)  # ... then writes every block, the saved ones too
    t0 = time.perf_counter()
    job = engine.save(blocks, slots)
    issued_ms = (time.perf_counter() - t0) * 1e3
    job.wait()
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert calls, "the engine no longer calls Stream.wait_stream: update this test"
    cache_new = PlainCache(layout, new, [_rebase(r, new) for r in cache.regions])
    cache_old = PlainCache(layout, old, [_rebase(r, old) for r in cache.regions])
    got = [engine.pool.slot(s).clone() for s in slots]
    if ordered:
        for b, g in zip(blocks, got):
            assert torch.equal(g, cache_new.block_bytes(b)), b
    else:
        # The race, observed: the save read the blocks before the write.
        assert issued_ms < SPIN_MS, "the host was too slow to race"
        for b, g in zip(blocks, got):
            assert not torch.equal(g, cache_new.block_bytes(b)), b
            assert torch.equal(g, cache_old.block_bytes(b)), b
    engine.close()


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "wait_removed"])
def test_load_lands_after_the_compute_stream_wrote(spin, monkeypatch, layout, ordered):
    cache = plain_cache(layout, [64] * 4, device="cuda")
    engine = make_engine(cache)
    blocks, slots = [2, 5, 6, 19], [4, 5, 6, 9]
    n = cache.base.numel()
    saved = random_bytes(n, 20, "cuda")
    late = random_bytes(n, 21, "cuda")
    cache.base.copy_(saved)
    engine.save(blocks, slots).wait()  # the slots hold ``saved``'s blocks
    expected = [engine.pool.slot(s).clone() for s in slots]
    cache.base.zero_()
    torch.cuda.synchronize()
    calls: list[int] = []
    (_ordered_spy if ordered else _unordered)(monkeypatch, calls)
    spin(SPIN_MS)  # the compute stream is busy ...
    cache.base.copy_(late)  # ... then writes the blocks the load fills
    job = engine.load(slots, blocks)
    job.make_current_stream_wait()
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert calls
    cache_late = PlainCache(layout, late, [_rebase(r, late) for r in cache.regions])
    for b, e in zip(blocks, expected):
        if ordered:
            assert torch.equal(cache.block_bytes(b), e), b
        else:  # the compute stream's late write overwrote the load
            assert torch.equal(cache.block_bytes(b), cache_late.block_bytes(b)), b
            assert not torch.equal(cache.block_bytes(b), e), b
    engine.close()


@needs_cuda
@pytest.mark.parametrize("waits", [True, False], ids=["waits", "does_not_wait"])
def test_overwriting_saved_blocks_must_wait_for_the_save(spin, waits):
    """The consumer's half: a save held back on its copy stream (here behind
    a job that completes after a 200 ms spin on a side stream) still reads
    the old bytes if the compute stream waits for it before overwriting."""
    cache = plain_cache("BLHNC", [64] * 4, device="cuda")
    engine = make_engine(cache)
    blocks, slots = [1, 4, 9], [0, 1, 2]
    engine.save(blocks, slots).wait()
    old = random_bytes(cache.base.numel(), 30, "cuda")
    cache.base.copy_(old)
    expected = [cache.block_bytes(b) for b in blocks]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        spin(SPIN_MS)
        held = torch.cuda.Event()
        held.record(side)
    gate = CopyJob("save", 0, 0, 0, held, torch.device("cuda"))
    job = engine.save(blocks, slots, after=[gate])
    if waits:
        job.make_current_stream_wait()
    cache.base.fill_(0xEE)  # the next step's kernels overwrite the blocks
    torch.cuda.synchronize()
    for s, e in zip(slots, expected):
        got = engine.pool.slot(s)
        if waits:
            assert torch.equal(got, e)
        else:
            assert bool((got == 0xEE).all()), "the save ran before the overwrite"
    engine.close()


@needs_cuda
def test_wait_timer_measures_the_device_stall():
    """On real events: waiting on a long copy stalls the compute stream
    about the copy's duration; waiting on a finished copy stalls it ~0."""
    cache = plain_cache(
        "BLHNC", [128] * 32, num_blocks=520, num_kv_heads=8, device="cuda"
    )
    engine = make_engine(cache, num_slots=512)  # 1 GiB pinned
    blocks, slots = list(range(512)), list(range(512))
    engine.save(blocks, slots).wait()
    t0 = time.perf_counter()
    engine.save(blocks, slots).wait()
    alone_s = time.perf_counter() - t0
    timer = StreamWaitTimer(torch.device("cuda"), every=1)
    job = engine.save(blocks, slots)
    timer.wait([job])
    torch.cuda.synchronize()
    stall = timer.collect()
    assert 0.3 * alone_s < stall < 1.5 * alone_s, (stall, alone_s)
    job = engine.save(blocks, slots)
    job.wait()
    timer.wait([job])
    torch.cuda.synchronize()
    assert timer.collect() < 0.002
    engine.close()


def _rebase(region: KVRegion, base: torch.Tensor) -> KVRegion:
    return KVRegion(
        base,
        region.offset,
        region.num_layers,
        region.page_bytes,
        region.layer_stride,
        region.block_stride,
        region.num_blocks,
    )
