"""The block copy engine on KV caches laid out by vLLM itself.

The caches are planned by vLLM's own ``get_kv_cache_config_from_groups`` and
allocated by its ``allocate_kv_cache`` (one backing int8 allocation, per-layer
views by stride) for the layer-outer LBHNC and the block-outer BLHNC layouts,
so the round trips prove the engine on the byte placement vLLM really uses.
The expected bytes of a block are read through vLLM's per-layer views, not
through the engine's own geometry.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from tests.copy_checks import CASES, random_bytes, round_trip
from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine
from vllm_kvmem.host_tier.copy_strategy import (
    AUTO_GATHER_MAX_STAGING_BYTES,
    BATCH_BELOW_BLOCK_BYTES,
    choose_strategy,
    gather_min_copies,
    plan_strategy,
)
from vllm_kvmem.host_tier.host_pool import HostBlockPool
from vllm_kvmem.host_tier.kv_region import KVRegion, host_slot_bytes

kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
worker_utils = pytest.importorskip("vllm.v1.worker.utils")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

LBHNC = KVCacheLayout.LBHNC  # layer-outer: one region per layer
BLHNC = KVCacheLayout.BLHNC  # block-outer: all layers of a block adjacent
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@dataclass
class VllmCache:
    layout: KVCacheLayout
    config: object  # vllm KVCacheConfig
    caches: dict[str, torch.Tensor]
    regions: list[KVRegion]

    @property
    def base(self) -> torch.Tensor:
        return self.regions[0].base

    def block_bytes(self, block: int) -> torch.Tensor:
        """Every layer's page of ``block``, read through vLLM's own views."""
        pages = [
            self.caches[name][block].reshape(-1).view(torch.uint8)
            for tensor in self.config.kv_cache_tensors
            for name in tensor.layers
        ]
        return torch.cat(pages).cpu()


def _fake_vllm_config(layout: KVCacheLayout, num_blocks: int) -> object:
    """The few fields ``get_kv_cache_config_from_groups`` reads."""
    cache_config = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=num_blocks,
        prefix_cache_retention_interval=None,
    )
    return types.SimpleNamespace(
        cache_config=cache_config,
        attention_config=types.SimpleNamespace(hisparse_config=None),
    )


def vllm_cache(
    layout: KVCacheLayout,
    head_sizes: list[int],
    *,
    num_blocks: int = 24,
    block_size: int = 16,
    num_kv_heads: int = 2,
    device: str = "cpu",
    with_regions: bool = True,
) -> VllmCache:
    """Plan and allocate a KV cache exactly as a vLLM 0.32 worker does."""
    specs = {
        f"model.layers.{i}.attn": kv_iface.FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=h,
            dtype=torch.bfloat16,
        )
        for i, h in enumerate(head_sizes)
    }
    if len(set(head_sizes)) == 1:
        group_spec = next(iter(specs.values()))
    else:  # two page sizes in one group: two KVCacheTensors
        group_spec = kv_iface.UniformTypeKVCacheSpecs(
            block_size=block_size, kv_cache_specs=specs
        )
    group = kv_iface.KVCacheGroupSpec(list(specs), group_spec)
    config = kv_utils.get_kv_cache_config_from_groups(
        _fake_vllm_config(layout, num_blocks), [group], 1 << 40
    )
    caches = worker_utils.allocate_kv_cache(config, torch.device(device), layout)
    regions = [
        KVRegion.from_views([caches[n] for n in t.layers], config.num_blocks)
        for t in config.kv_cache_tensors
        if with_regions
    ]
    return VllmCache(layout, config, caches, regions)


def make_engine(cache: VllmCache, num_slots: int = 32, **kw) -> BlockCopyEngine:
    pool = HostBlockPool.for_regions(cache.regions, num_slots)
    return BlockCopyEngine(cache.regions, pool, cache.base.device, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_bit_exact(device, layout, head_sizes, case):
    cache = vllm_cache(layout, head_sizes, device=device)
    assert len(cache.regions) == (1 if len(set(head_sizes)) == 1 else 2)
    engine = make_engine(cache)
    # Blocks of 28-32 KiB: on CUDA, auto gathers block-outer layouts too
    # (calls of few copies still go direct); on CPU it copies them directly.
    block_outer_direct = layout is BLHNC and device == "cpu"
    assert engine.strategy == ("direct" if block_outer_direct else "gather")
    round_trip(cache, engine, *CASES[case])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
def test_forced_gather_and_small_staging_round_trip(device, layout):
    """The gather path works on any layout, also in staging-sized chunks."""
    cache = vllm_cache(layout, [64, 64, 32], device=device)
    slot = host_slot_bytes(cache.regions)
    engine = make_engine(cache, strategy="gather", max_staging_bytes=2 * slot)
    round_trip(cache, engine, *CASES["unsorted"])


def test_regions_match_vllm_kv_cache_tensors():
    """Geometry read off the views equals vLLM's KVCacheTensor numbers."""
    for layout in (LBHNC, BLHNC):
        cache = vllm_cache(layout, [64, 64, 64, 32, 32])
        for region, t in zip(cache.regions, cache.config.kv_cache_tensors):
            spec = cache.config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs[
                t.layers[0]
            ]
            explicit = KVRegion.from_kv_cache_tensor(
                region.base, t, spec.page_size_bytes, cache.config.num_blocks
            )
            for name in (
                "offset",
                "num_layers",
                "page_bytes",
                "layer_stride",
                "block_stride",
                "num_blocks",
            ):
                assert getattr(region, name) == getattr(explicit, name), name
            assert region.base.numel() == t.size
            assert region.layers_adjacent == (layout is BLHNC)


def test_contiguous_runs_are_coalesced():
    cache = vllm_cache(BLHNC, [64] * 4)
    engine = make_engine(cache)
    assert engine.save([4, 5, 6, 9], [0, 1, 2, 3]).num_ops == 2
    assert engine.save([9, 6, 4, 5], [3, 2, 0, 1]).num_ops == 2  # unsorted
    assert engine.save([4, 5, 6, 9], [0, 1, 5, 3]).num_ops == 3  # slots break
    assert engine.save(list(range(10, 20)), list(range(20, 30))).num_ops == 1
    assert engine.save([1, 3, 5, 7], [0, 1, 2, 3]).num_ops == 4  # one per block
    assert engine.load([0, 1, 2, 3], [4, 5, 6, 9]).num_ops == 2


def test_block_outer_regions_merge_into_one_copy_per_run():
    """Two KVCacheTensors side by side in a block are still one copy."""
    cache = vllm_cache(BLHNC, [64, 64, 64, 32, 32])
    engine = make_engine(cache)
    assert engine.save([4, 5, 6, 9], [0, 1, 2, 3]).num_ops == 2


@pytest.mark.parametrize("head_sizes", [[64] * 2, [64] * 8, [64, 64, 32]])
def test_per_layer_ops_do_not_grow_with_blocks_or_layers(head_sizes):
    cache = vllm_cache(LBHNC, head_sizes)
    engine = make_engine(cache)
    ops = set()
    for n in (1, 3, 8, 20):
        blocks = torch.randperm(24, generator=torch.Generator().manual_seed(n))[:n]
        ops.add(engine.save(blocks, list(range(n))).num_ops)
        ops.add(engine.load(list(range(n)), blocks).num_ops)
    assert ops == {len(cache.regions)}


def test_empty_transfer_is_a_finished_job():
    engine = make_engine(vllm_cache(BLHNC, [64] * 2))
    job = engine.save([], [])
    assert (job.num_ops, job.num_blocks, job.num_bytes, job.done()) == (0, 0, 0, True)


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
def test_bad_inputs_name_the_bad_value(layout):
    engine = make_engine(vllm_cache(layout, [64] * 2), num_slots=8)
    with pytest.raises(ValueError, match="block_ids has 2 entries but slot_ids has 1"):
        engine.save([1, 2], [0])
    with pytest.raises(ValueError, match=r"block id 24 \(position 1\) is out of range"):
        engine.save([3, 24], [0, 1])
    with pytest.raises(ValueError, match=r"block id -1 \(position 0\)"):
        engine.load([0], [-1])
    with pytest.raises(ValueError, match=r"slot id 8 \(position 2\) is out of range"):
        engine.save([1, 2, 3], [0, 1, 8])
    with pytest.raises(ValueError, match="slot id 5 appears more than once"):
        engine.save([1, 2], [5, 5])
    with pytest.raises(ValueError, match="block id 7 appears more than once"):
        engine.load([0, 1], [7, 7])
    with pytest.raises(ValueError, match=r"slot_ids\[1\] is not an integer id"):
        engine.save([1, 2], [0, 1.5])


def test_engine_rejects_mismatched_pool_and_forced_direct():
    cache = vllm_cache(LBHNC, [64] * 2)
    with pytest.raises(ValueError, match="host pool slots hold 100 bytes"):
        BlockCopyEngine(cache.regions, HostBlockPool(4, 100), "cpu")
    with pytest.raises(ValueError, match="strategy 'direct' needs"):
        make_engine(cache, strategy="direct")


def test_from_views_rejects_unequal_strides_and_scattered_pages():
    cache = vllm_cache(LBHNC, [64] * 4)
    names = cache.config.kv_cache_tensors[0].layers
    with pytest.raises(ValueError, match="not equally strided"):
        KVRegion.from_views([cache.caches[names[i]] for i in (0, 1, 3)])
    with pytest.raises(ValueError, match="increasing address order"):
        KVRegion.from_views([cache.caches[names[1]], cache.caches[names[0]]])
    heads_outer = vllm_cache(KVCacheLayout.LHBNC, [64] * 2, with_regions=False)
    views = list(heads_outer.caches.values())
    with pytest.raises(ValueError, match="not one contiguous run of bytes"):
        KVRegion.from_views(views)


def test_region_validation():
    base = torch.zeros(1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match="runs past its backing allocation"):
        KVRegion(base, 0, 2, 100, 100, 200, num_blocks=6)
    with pytest.raises(ValueError, match="pages overlap"):
        KVRegion(base, 0, 2, 100, 50, 200, num_blocks=2)
    region = KVRegion(base, 0, 2, 100, 100, 200)  # num_blocks from the size
    assert region.num_blocks == 5 and region.block_bytes == 200


def test_engine_close_releases_its_pool_and_refuses_copies():
    from vllm_kvmem.host_tier.host_pool import live_pools

    engine = make_engine(vllm_cache(BLHNC, [64] * 2), num_slots=8)
    pool = engine.pool
    assert pool in live_pools()
    engine.save([1, 2], [0, 1])
    engine.close()
    assert engine.closed and pool.released and pool not in live_pools()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.save([1], [0])


@pytest.mark.parametrize("layout", [BLHNC, LBHNC])
@pytest.mark.parametrize("direction", ["save", "load"])
def test_failure_part_way_raises_copy_error_with_a_job(layout, direction, monkeypatch):
    """A copy that fails while the job's copies are being issued raises
    CopyError naming the direction, with a job marked failed (on CPU the
    copies issued before it are complete, so there is nothing left to track)."""
    from vllm_kvmem.host_tier.copy_engine import CopyError

    engine = make_engine(vllm_cache(layout, [64] * 2), num_slots=8)
    calls = []
    real_copy = engine._copy
    real_index = torch.index_select

    def failing_copy(dst, src):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access (stand-in)")

    def failing_index(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access (stand-in)")

    # Scattered slots force copies through the pool (no in-place gather).
    blocks, slots = [3, 9, 4], [6, 0, 3]
    monkeypatch.setattr(engine, "_copy", failing_copy)
    monkeypatch.setattr(torch, "index_select", failing_index)
    if direction == "load":
        monkeypatch.setattr(engine, "_copy", real_copy)
        monkeypatch.setattr(torch, "index_select", real_index)
        engine.save(blocks, slots)
        monkeypatch.setattr(engine, "_copy", failing_copy)
        if engine.strategy == "gather":
            monkeypatch.setattr(
                torch.Tensor, "index_put_", lambda *a, **k: failing_index()
            )
    with pytest.raises(CopyError) as err:
        getattr(engine, direction)(
            *((blocks, slots) if direction == "save" else (slots, blocks))
        )
    assert err.value.direction == direction
    assert f"{direction} of 3 blocks failed: RuntimeError: CUDA error" in str(err.value)
    assert err.value.job is not None and err.value.job.failed
    assert err.value.job.done()  # CPU: nothing in flight
    monkeypatch.undo()
    engine.save([1], [1])  # the engine keeps working afterwards
    engine.close()


# -- strategy="auto": the measured rule (no GPU needed) ------------------------

KIB, MIB = 1024, 1024**2
BIG_STAGING = 1 << 40  # no staging cap: the block-size rule alone


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("block_outer", [True, False], ids=["BLHNC", "LBHNC"])
@pytest.mark.parametrize(
    "block_bytes",
    [64 * KIB, BATCH_BELOW_BLOCK_BYTES - 1, BATCH_BELOW_BLOCK_BYTES, 32 * MIB],
    ids=["64KiB", "below", "at", "above"],
)
def test_choose_strategy_around_the_threshold(device_type, block_outer, block_bytes):
    """Layer-outer always gathers; block-outer gathers only on CUDA below the
    threshold (the H200 figures), for a call of many scattered blocks."""
    got = choose_strategy(
        block_outer, block_bytes, device_type, max_staging_bytes=BIG_STAGING
    )
    many = choose_strategy(
        block_outer, block_bytes, device_type, 32, max_staging_bytes=BIG_STAGING
    )
    if not block_outer:
        expected = "gather"
    elif device_type == "cuda" and block_bytes < BATCH_BELOW_BLOCK_BYTES:
        expected = "gather"
    else:
        expected = "direct"
    assert got == many == expected


def test_threshold_is_the_h200_crossover():
    """2 MiB: the first measured size where one copy per block matched the
    gather (48.16 / 47.79 against 47.63 / 47.68 GB/s); at 1 MiB the gather
    was still 2-5% ahead."""
    assert BATCH_BELOW_BLOCK_BYTES == 2 * MIB
    assert choose_strategy(True, 1 * MIB, "cuda", 32) == "gather"
    assert choose_strategy(True, 2 * MIB, "cuda", 32) == "direct"


@pytest.mark.parametrize(
    "block_bytes,need",
    [(8 * KIB, 8), (64 * KIB, 8), (128 * KIB, 12), (256 * KIB, 16), (1 * MIB, 24)],
)
def test_gather_min_copies_follows_the_measured_break_even(block_bytes, need):
    assert gather_min_copies(block_bytes) == need


@pytest.mark.parametrize("block_bytes", [64 * KIB, 192 * KIB, 1 * MIB])
def test_auto_copies_a_call_of_few_runs_directly(block_bytes):
    """Consecutive blocks are one direct copy, which beat the gather at every
    measured size; the gather takes over from gather_min_copies copies."""
    need = gather_min_copies(block_bytes)
    for copies, expected in ((1, "direct"), (need - 1, "direct"), (need, "gather")):
        assert choose_strategy(True, block_bytes, "cuda", copies) == expected, copies
    for copies in (1, need, 64):  # CPU: unchanged, always direct
        assert choose_strategy(True, block_bytes, "cpu", copies) == "direct"


def test_auto_staging_cap_keeps_large_blocks_direct():
    """The staging of a block-outer gather is capped (the budget reserves
    none there): a chunk that cannot hold gather_min_copies blocks would not
    pay for its gather, so such blocks stay direct."""
    cap = AUTO_GATHER_MAX_STAGING_BYTES
    assert choose_strategy(True, 1 * MIB, "cuda", 32, max_staging_bytes=cap) == (
        "gather"
    )
    assert choose_strategy(True, 3 * MIB // 2, "cuda", 32, max_staging_bytes=cap) == (
        "direct"
    )
    assert choose_strategy(True, 64 * KIB, "cuda", 32, max_staging_bytes=KIB) == (
        "direct"
    )


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
def test_engine_plan_for_cuda_on_cpu_regions(layout, head_sizes):
    """What an engine on these regions would choose on a CUDA device: the
    engine's own choice (``plan_strategy``), fed CPU regions and a declared
    device type, with no GPU and nothing of torch.cuda faked."""
    cache = vllm_cache(layout, head_sizes)
    assert host_slot_bytes(cache.regions) < BATCH_BELOW_BLOCK_BYTES
    if layout is BLHNC:
        assert plan_strategy(cache.regions, "cuda") == ("gather", True)
        assert plan_strategy(cache.regions, "cpu") == ("direct", False)
        assert plan_strategy(cache.regions, "cuda", "direct") == ("direct", False)
    else:
        assert plan_strategy(cache.regions, "cuda") == ("gather", False)
        assert plan_strategy(cache.regions, "cpu") == ("gather", False)
        with pytest.raises(ValueError, match="strategy 'direct' needs"):
            plan_strategy(cache.regions, "cuda", "direct")
    for device_type in ("cuda", "cpu"):
        assert plan_strategy(cache.regions, device_type, "gather") == (
            "gather",
            False,
        )
    # The engine on CPU takes the CPU plan.
    engine = make_engine(cache)
    assert engine.strategy == plan_strategy(cache.regions, "cpu")[0]


def test_engine_plan_for_cuda_with_2mib_blocks_is_direct():
    """8B-like blocks (32 layers, 8 heads of 128, 16 tokens: 2 MiB): at the
    threshold, one copy per block on CUDA too."""
    cache = vllm_cache(BLHNC, [128] * 32, num_blocks=4, num_kv_heads=8)
    assert host_slot_bytes(cache.regions) == BATCH_BELOW_BLOCK_BYTES
    assert plan_strategy(cache.regions, "cuda") == ("direct", False)


@pytest.mark.parametrize("strategy", ["direct", "gather", "auto"])
@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
def test_block_outer_round_trip_with_each_strategy(strategy, head_sizes):
    """Many scattered blocks (what auto gathers on CUDA) and a run, with each
    strategy on CPU; the job says which path it took."""
    cache = vllm_cache(BLHNC, head_sizes)
    engine = make_engine(cache, strategy=strategy)
    path = "gather" if strategy == "gather" else "direct"
    src = [1, 21, 9, 15, 3, 17, 11, 5, 19, 7, 13, 23]
    slots = [30, 3, 17, 8, 0, 12, 25, 6, 19, 27, 1, 10]
    dst = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    round_trip(cache, engine, src, slots, dst)
    assert engine.save(src, slots).strategy == path
    job = engine.save(list(range(4, 16)), list(range(12)))
    assert job.strategy == path
    # direct: one copy for the run; gather: one kernel for the merged spans
    # (both regions), straight into the pool's one run of slots (CPU).
    assert job.num_ops == 1
    engine.close()


@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
def test_direct_copy_count_matches_what_direct_issues(head_sizes):
    """Auto's per-call choice counts direct's copies without issuing them;
    the count must be what a direct save then issues."""
    engine = make_engine(vllm_cache(BLHNC, head_sizes))
    for blocks, slots in (
        ([4, 5, 6, 9], [0, 1, 2, 3]),
        ([9, 6, 4, 5], [3, 2, 0, 1]),
        ([4, 5, 6, 9], [0, 1, 5, 3]),
        (list(range(10, 20)), list(range(20, 30))),
        ([1, 3, 5, 7, 9, 11, 13, 15, 17], [8, 7, 6, 5, 4, 3, 2, 1, 0]),
    ):
        _, (_, runs) = engine._call_strategy(blocks, slots)
        assert engine._direct_copies(runs) == engine.save(blocks, slots).num_ops


# -- the CPU copy thread ---------------------------------------------------------


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
@pytest.mark.parametrize(
    "head_sizes", [[64] * 4, [64, 64, 64, 32, 32]], ids=["one_region", "two_regions"]
)
@pytest.mark.parametrize("case", [*CASES, "many_runs"])
def test_copy_thread_round_trip_bit_exact(layout, head_sizes, case):
    """Saves and layer-by-layer loads on the copy thread move the same bytes
    as the copies in the caller's thread, and touch nothing else: run by run
    or, past MAX_UNIT_RUNS runs, scattered with one index_put_ per unit."""
    from vllm_kvmem.host_tier.copy_engine import MAX_UNIT_RUNS

    cache = vllm_cache(layout, head_sizes)
    engine = make_engine(cache, copy_thread=True)
    n = MAX_UNIT_RUNS + 1  # no two consecutive: n runs
    many = (
        [2 * i for i in range(n)],
        [3 * i for i in range(n)],
        [2 * i + 1 for i in range(n)],
    )
    args = many if case == "many_runs" else CASES[case]
    try:
        round_trip(cache, engine, *args)
    finally:
        engine.close()


@pytest.mark.parametrize("layout", [LBHNC, BLHNC], ids=lambda x: x.name)
def test_copy_thread_names_every_layer_of_vllms_kv_cache_tensors(layout):
    """Each layer of vLLM's ``KVCacheTensor``s is one unit of a load, found by
    where vLLM places its page of block 0 (what the worker maps layer names
    with), in model order, and its unit holds exactly that layer's bytes."""
    cache = vllm_cache(layout, [64, 64, 64, 32, 32])
    engine = make_engine(cache, copy_thread=True)
    try:
        starts = engine.layer_unit_starts()
        names = [
            (t.offset + i * t.layer_stride, name)
            for t in cache.config.kv_cache_tensors
            for i, name in enumerate(t.layers)
        ]
        assert sorted(starts) == sorted(s for s, _ in names)
        assert len(set(starts)) == len(starts) == 5
        base = cache.base
        base.copy_(random_bytes(base.numel(), 3, base.device))
        engine.save([4], [0]).wait()
        base.zero_()
        job = engine.load([0], [9])
        by_start = dict(names)
        for unit, start in enumerate(starts):
            job.wait_unit(unit)
            page = cache.caches[by_start[start]][9].reshape(-1).view(torch.uint8)
            assert page.any()  # this layer's unit is in place
        job.wait()
        assert job.strategy == "layers" and not job.failed
        assert torch.equal(cache.block_bytes(9), engine.slot_image(0).cpu())
    finally:
        engine.close()


def test_copy_thread_failure_marks_the_job_and_the_thread_goes_on(monkeypatch):
    """A copy that raises on the thread fails its job (waiting does not
    raise: the worker turns it into recomputed blocks); the next job runs."""
    cache = vllm_cache(LBHNC, [64] * 4)
    engine = make_engine(cache, copy_thread=True)
    try:
        engine.save([1, 2], [0, 1]).wait()
        real = BlockCopyEngine._load_units

        def broken(self, blocks, slots, progress):
            progress.advance()  # one unit copied, then the fault
            raise RuntimeError("injected copy fault")

        monkeypatch.setattr(BlockCopyEngine, "_load_units", broken)
        job = engine.load([0, 1], [5, 6])
        job.wait_unit(3)  # returns: the job is over, failed
        job.wait()
        assert job.failed and isinstance(job.error, RuntimeError)
        assert job.block_ids == (5, 6) and job.done()
        monkeypatch.setattr(BlockCopyEngine, "_load_units", real)
        ok = engine.load([0, 1], [5, 6])
        ok.wait()
        assert not ok.failed
        assert torch.equal(cache.block_bytes(5), engine.slot_image(0).cpu())
    finally:
        engine.close()


def test_copy_thread_is_cpu_only_and_auto_wants_a_spare_cpu(monkeypatch):
    import os

    from vllm_kvmem.host_tier.worker import use_copy_thread

    assert not use_copy_thread("on", "cuda") and not use_copy_thread("auto", "cuda")
    assert use_copy_thread("on", "cpu") and not use_copy_thread("off", "cpu")
    threads = torch.get_num_threads()
    # The machine's CPU affinity, stated: what auto compares the OpenMP
    # threads of the forward pass with.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads)))
    assert not use_copy_thread("auto", "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads + 1)))
    assert use_copy_thread("auto", "cpu")


def test_copy_threads_run_loads_beside_saves_and_honour_after():
    """One thread per direction, as the CUDA copy streams: a load is not
    queued behind a save in flight, and a load given that save in ``after``
    starts only once it is done (what the worker asks for when the load
    reads a slot the save writes)."""
    import threading

    cache = vllm_cache(BLHNC, [64] * 4)
    engine = make_engine(cache, copy_thread=True)
    release, saving = threading.Event(), threading.Event()
    release.set()  # saves go through until it is cleared
    direct, load_units = engine._issue_direct, engine._load_units
    done = []

    def held_save(direction, *runs):
        if not release.is_set():
            saving.set()
            release.wait()
        n = direct(direction, *runs)
        done.append("save")
        return n

    def recorded_load(*args):
        n = load_units(*args)
        done.append("load")
        return n

    engine._issue_direct, engine._load_units = held_save, recorded_load
    try:
        base = cache.base
        base.copy_(random_bytes(base.numel(), 5, base.device))
        engine.save([1], [1]).wait()
        release.clear()
        save = engine.save([2], [2])
        saving.wait()  # the save thread is inside this save, held
        engine.load([1], [10]).wait()  # another slot: done meanwhile
        assert not save.done() and done == ["save", "load"]
        dependent = engine.load([2], [11], after=[save])
        release.set()
        dependent.wait()
        assert done == ["save", "load", "save", "load"]
        assert torch.equal(cache.block_bytes(10), engine.slot_image(1).cpu())
        assert torch.equal(cache.block_bytes(11), engine.slot_image(2).cpu())
    finally:
        release.set()
        engine.close()


def test_copy_thread_load_after_a_failed_save_fails_too(monkeypatch):
    """A load that reads slots a failed save was writing must not copy them
    (they hold no complete copy): it fails, and the worker recomputes its
    blocks. A load with no failed save before it is not affected."""
    cache = vllm_cache(LBHNC, [64] * 4)
    engine = make_engine(cache, copy_thread=True)
    try:
        engine.save([3], [3]).wait()

        def broken(*args, **kwargs):
            raise RuntimeError("injected save fault")

        monkeypatch.setattr(engine._gather, "issue", broken)
        save = engine.save([1], [0])
        load = engine.load([0], [5], after=[save])
        load.wait()
        assert save.failed and load.failed
        assert "save into the slots it reads failed" in str(load.error)
        monkeypatch.undo()
        other = engine.load([3], [6])  # no failed save before it
        other.wait()
        assert not other.failed
        assert torch.equal(cache.block_bytes(6), engine.slot_image(3).cpu())
    finally:
        engine.close()
