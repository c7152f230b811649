"""The host tier's per-step work on vLLM's real scheduler: bounded by what a
step changes (blocks allocated or freed), not by the size of the free queue
or of the host tier, and still told of every eviction.

vLLM's ``Scheduler`` and ``BlockPool`` are real, driven by
``benchmarks/tier_step_bench.py``'s harness; only the forward pass is stood
in for (one sampled token per scheduled request), as vLLM's own scheduler
tests do. The benchmark times the steps; this proves the structure that makes
them cheap, with counts that do not depend on the machine's speed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT, import_script
from vllm_kvmem.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def bench():
    yield from import_script(ROOT / "benchmarks" / "tier_step_bench.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("step-cost") / "m", num_layers=2)


def _args(bench, *extra: str):
    # 0% reuse, 4 x 256-token prompts in flight on 128 device blocks: the
    # prefix cache evicts all the time.
    return bench.parse_args(
        ["--device-blocks", "128", "--requests", "32", "--prompt-tokens", "256",
         "--output-tokens", "24", "--concurrency", "4", "--batch-tokens", "512",
         "--keep-steps", *extra]
    )  # fmt: skip


def _spy_walk(counts: list[int]):
    """Count the free-queue blocks the tier's walk visits, per step."""

    def on_start(run):
        tier = run.scheduler.connector.connector_scheduler
        queue = tier._pool.free_block_queue
        walk = queue.iter_blocks_after

        def counted(cursor):
            for block in walk(cursor):
                counts[-1] += 1
                yield block

        queue.iter_blocks_after = counted
        build = tier.build_connector_meta

        def per_step(scheduler_output):
            counts.append(0)
            return build(scheduler_output)

        tier.build_connector_meta = per_step

    return on_start


@pytest.mark.parametrize("host_blocks", [256, 65536])
def test_walk_visits_what_a_step_changed_not_the_free_queue(bench, model, host_blocks):
    """Each free block is walked about once per time it enters the scan
    window: a step that allocates and frees nothing walks nothing, and the
    whole run walks a bounded multiple of the blocks it allocated, whatever
    the host tier's size. (The walk used to re-read the window, up to the
    whole free queue, at every step whose queue head moved.)"""
    counts: list[int] = []
    result = bench.run_arm(model, _args(bench), host_blocks, _spy_walk(counts))
    steps = result["per_step"]
    assert len(counts) == len(steps) and len(steps) > 100
    quiet = [n for n, s in zip(counts, steps) if not (s["allocated"] or s["finished"])]
    assert quiet and max(quiet) == 0
    allocated = sum(s["allocated"] for s in steps)
    assert result["tier_counters"]["blocks_spilled"] > 100  # it did work
    assert sum(counts) <= 2 * allocated + 128


def test_every_eviction_reaches_the_tier_once_with_its_hash(bench, model):
    """Evictions are found among the blocks a step allocated: exactly those
    a spy on ``BlockPool._maybe_evict_cached_block`` sees, in vLLM's order,
    with the hash each held."""
    evicted: list[tuple[int, object]] = []
    told: list[tuple[int, object]] = []

    def on_start(run):
        tier = run.scheduler.connector.connector_scheduler
        pool = tier._pool
        evict, on_evicted = pool._maybe_evict_cached_block, tier._on_evicted

        def spy(block):
            if block.block_hash is not None and block.ref_cnt == 0:
                evicted.append((block.block_id, block.block_hash))
            return evict(block)

        def heard(block_id, key, covered):
            told.append((block_id, key))
            return on_evicted(block_id, key, covered)

        pool._maybe_evict_cached_block = spy
        tier._on_evicted = heard

    bench.run_arm(model, _args(bench), 4096, on_start)
    assert len(evicted) > 100
    assert told == evicted


@pytest.mark.parametrize("host_blocks", [48, 4096])
def test_with_kv_events_each_host_block_is_announced_once_with_its_tokens(
    bench, model, host_blocks
):
    """With vLLM's KV events on, what vLLM's scheduler publishes says at every
    step which blocks the host holds (``medium="CPU"``), each stored block
    with the tokens and parent of the device's event for it, and nothing
    when the tier's own policy evicts (48 slots) goes unannounced."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        maybe_convert_block_hash,
    )

    device: dict = {}
    held: set = set()
    seen = {"steps": 0, "stored": 0, "removed": 0}
    mismatches: list = []

    def on_start(run):
        tier = run.scheduler.connector.connector_scheduler
        publisher = run.scheduler.kv_event_publisher
        publish = publisher.publish

        def replay(batch):
            for ev in batch.events:
                assert not isinstance(ev, AllBlocksCleared)
                at = [(h, ev.group_idx) for h in ev.block_hashes]
                if ev.medium == "GPU" and isinstance(ev, BlockStored):
                    size = ev.block_size
                    for i, key in enumerate(at):
                        device[key] = ev.token_ids[i * size : (i + 1) * size]
                elif ev.medium == "CPU" and isinstance(ev, BlockStored):
                    (key,) = at
                    assert key not in held  # once
                    assert ev.token_ids == device[key]
                    held.add(key)
                    seen["stored"] += 1
                elif ev.medium == "CPU":
                    held.difference_update(at)
                    seen["removed"] += 1
            index = {
                (maybe_convert_block_hash(get_block_hash(k)), get_group_id(k))
                for k in tier.index._slots
            }
            seen["steps"] += 1
            if index != held:
                mismatches.append(seen["steps"])
            publish(batch)

        publisher.publish = replay

    result = bench.run_arm(model, _args(bench), host_blocks, on_start, events=True)
    assert result["tier_counters"]["blocks_spilled"] == seen["stored"] > 100
    assert seen["steps"] > 20 and mismatches == []  # steps with events
    assert (seen["removed"] > 0) == (host_blocks == 48)


def test_step_times_reach_vllm_in_batches_and_prometheus_as_a_histogram(monkeypatch):
    """The clock hands vLLM its step times every 64 steps or every second
    (an idle tier adds no stats object to most steps' output); the stats of
    several workers concatenate, the log line gets p50 and max, and
    vLLM's Prometheus types make them one histogram per side."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_kvmem.host_tier import stats as st

    now = [1000.0]
    monkeypatch.setattr(st.time, "monotonic", lambda: now[0])
    clock = st.StepClock()
    for step in range(st.StepClock.FLUSH_STEPS - 1):
        clock.ns = (step + 1) * 1000  # 1, 2, ... us
        clock.end_step()
        assert clock.take_due() is None  # neither 64 steps nor 1 s yet
    clock.ns = 64_000
    clock.end_step()
    times = clock.take_due()
    assert times == [float(i) for i in range(1, 65)] and clock.take_due() is None
    clock.end_step()  # one more step, then a second passes
    now[0] += st.StepClock.FLUSH_SECONDS
    assert clock.take_due() == [0.0]

    a, b = st.HostTierStats(), st.HostTierStats()
    a.reset()
    b.reset()
    a.data["worker_step_us"] = [1.0, 3.0]
    b.data["worker_step_us"] = [2.0]
    assert not a.is_empty()
    merged = a.aggregate(b)
    assert merged.data["worker_step_us"] == [1.0, 3.0, 2.0]
    reduced = merged.reduce()
    assert reduced["worker_step_us_p50"] == 2.0 and reduced["worker_step_us_max"] == 3.0

    registry = CollectorRegistry()

    def bind(cls):
        return type(cls.__name__, (cls,), {"__init__": functools.partialmethod(
            cls.__init__, registry=registry)})  # fmt: skip

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = st.HostTierPromMetrics(config, types, ["engine"], {0: ["0"]})
    prom.observe({"worker_step_us": [20.0, 3000.0], "scheduler_step_us": [40.0]}, 0)
    name = "vllm:kvmem_host_worker_step_seconds"
    assert registry.get_sample_value(f"{name}_count", {"engine": "0"}) == 2
    assert registry.get_sample_value(
        f"{name}_bucket", {"engine": "0", "le": "2.5e-05"}
    ) == 1  # fmt: skip
    assert registry.get_sample_value(
        "vllm:kvmem_host_scheduler_step_seconds_sum", {"engine": "0"}
    ) == pytest.approx(40e-6)
