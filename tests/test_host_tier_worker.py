"""The worker side of the host tier: which copy waits for which, on a GPU.

No GPU here, so the copy engine is replaced by a recorder whose jobs stay in
flight until the test completes them: exactly what a CUDA stream does and
what the CPU copy engine (complete on return) can never show. The connector
code under test is the real one; what is mocked is the GPU (events and
streams), and it says so. Ordering to prove:

- the compute stream waits for a background save only when the step
  overwrites that block (a fence), or for this step's evicted-block saves;
- a load waits for exactly the in-flight saves of its slots and blocks;
- the forward waits for a synchronous load (its request is in the batch),
  never for an asynchronous one, and a save into a slot waits for the load
  still reading it;
- a request is reported loaded only when all its copies are done, and the
  scheduler is told a step's background saves are done only when they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_kvmem.host_tier.connector import KVMemHostTierConnector
from vllm_kvmem.host_tier.metadata import (
    HostTierMetadata,
    HostTierWorkerMeta,
    LoadChunk,
)
from vllm_kvmem.host_tier.stats import StepClock
from vllm_kvmem.host_tier.worker import HostTierWorker


@dataclass(eq=False)
class FakeJob:
    """A copy in flight on a (fake) CUDA stream."""

    kind: str
    blocks: list[int]
    slots: list[int]
    after: list[FakeJob]
    finished: bool = False
    compute_waits: int = 0
    event: object = field(default_factory=object)
    failed: bool = False
    future: None = None  # CopyJob's copy-thread run: none on a CUDA stream

    @property
    def asynchronous(self) -> bool:
        return True

    def done(self) -> bool:
        return self.finished

    def make_current_stream_wait(self, stream=None) -> None:
        assert stream is None  # the compute (current) stream
        self.compute_waits += 1


class FakeEngine:
    """Submits FakeJobs. ``fail[kind]``: the next submission of that kind
    fails as BlockCopyEngine's does, with the real CopyError; ``partial``
    says whether copies were queued before the failure (then the error
    carries a job tracking them)."""

    copy_thread = False  # CUDA: copy streams, not a thread

    def __init__(self) -> None:
        self.jobs: list[FakeJob] = []
        self.fail: dict[str, bool] = {}
        self.partial = True

    def _submit(self, kind, blocks, slots, after):
        from vllm_kvmem.host_tier.copy_engine import CopyError

        job = FakeJob(kind, list(blocks), list(slots), list(after))
        if self.fail.pop(kind, False):
            partial = job if self.partial else None
            if partial is not None:
                self.jobs.append(partial)
            raise CopyError(kind, len(blocks), RuntimeError("CUDA error: x"), partial)
        self.jobs.append(job)
        return job

    def save(self, blocks, slots, after=()):
        return self._submit("save", blocks, slots, after)

    def load(self, slots, blocks, after=()):
        return self._submit("load", blocks, slots, after)


@pytest.fixture
def worker():
    """The worker side, on the fake GPU (no KV caches registered)."""
    worker = HostTierWorker(None, enabled=True, num_slots=0, verify=False)
    worker._engine = FakeEngine()
    return worker


@pytest.fixture
def conn(worker):
    """A worker-role connector around ``worker``: the steps go through the
    connector's API, as vLLM calls it (metadata bound with vLLM's own
    bind_connector_metadata)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = KVMemHostTierConnector.__new__(KVMemHostTierConnector)
    conn._role = KVConnectorRole.WORKER
    conn._connector_metadata = None
    conn.connector_scheduler = None
    conn.connector_worker = worker
    conn.clock = StepClock()
    return conn


def _step(conn, meta):
    conn.handle_preemptions(meta)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    _, loaded = conn.get_finished(set())
    wmeta = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return loaded, wmeta.saved_through


def test_gpu_copy_ordering(worker, conn):
    jobs = worker._engine.jobs
    # Step 1: blocks 5 and 6 copied ahead into slots 0 and 1, in flight.
    loaded, through = _step(conn, HostTierMetadata(seq=1, ahead_saves=[(5, 0), (6, 1)]))
    (ahead,) = jobs
    assert ahead.compute_waits == 0  # the forward pass does not wait for it
    assert (loaded, through) == (None, 0)  # step 1's saves are not done yet

    # Step 2: block 5 is reused (fence), block 7 evicted with no host copy,
    # a request loads slot 1 (still being written) into block 9, and another
    # loads slot 3 into block 7 (whose eviction save starts this step).
    meta = HostTierMetadata(
        seq=2,
        fence=[5],
        evict_saves=[(7, 2)],
        loads=[LoadChunk("r1", [1], [9], True), LoadChunk("r2", [3], [7], False)],
    )
    loaded, through = _step(conn, meta)
    evict, load1, load2 = jobs[1:]
    assert ahead.compute_waits == 1  # fence: forward waits before block 5 is reused
    assert evict.compute_waits == 1  # and for the evicted block's save
    assert load1.after == [ahead]  # reads slot 1, written by the ahead save
    assert load2.after == [evict]  # overwrites block 7, being saved
    assert (loaded, through) == (None, 0)

    # Step 3: nothing new; the copies finish one by one.
    load1.finished = True
    loaded, through = _step(conn, HostTierMetadata(seq=3))
    assert loaded == {"r1"}  # r1 had its last chunk; r2 did not
    assert through == 0  # step 1's ahead save is still in flight
    ahead.finished = evict.finished = load2.finished = True
    loaded, through = _step(
        conn, HostTierMetadata(seq=4, loads=[LoadChunk("r2", [], [], True)])
    )
    assert loaded == {"r2"} and through == 4
    # A fence on a block whose save is done waits for nothing.
    _step(conn, HostTierMetadata(seq=5, fence=[6]))
    assert ahead.compute_waits == 1


def test_sync_loads_hold_the_forward_and_later_saves_of_their_slots(worker, conn):
    jobs = worker._engine.jobs
    meta = HostTierMetadata(
        seq=1,
        loads=[
            LoadChunk("now", [0, 1], [4, 5], True, sync=True),
            LoadChunk("later", [2], [6], True),
        ],
    )
    loaded, _ = _step(conn, meta)
    sync_load, async_load = jobs
    assert sync_load.compute_waits == 1  # the forward reads blocks 4 and 5
    assert async_load.compute_waits == 0
    assert loaded is None  # a sync load is never reported: vLLM did not ask
    # Next step slot 1 is reused for a save while the sync load still reads
    # it, and slot 7 (no load) for another: only the first waits.
    _step(conn, HostTierMetadata(seq=2, ahead_saves=[(9, 1)]))
    _step(conn, HostTierMetadata(seq=3, ahead_saves=[(8, 7)]))
    assert jobs[2].after == [sync_load] and jobs[3].after == []
    sync_load.finished = async_load.finished = True
    loaded, _ = _step(conn, HostTierMetadata(seq=4))
    assert loaded == {"later"} and not worker._load_jobs


def test_worker_meta_takes_the_slowest_worker():
    a, b = HostTierWorkerMeta(7), HostTierWorkerMeta(4)
    assert a.aggregate(b).saved_through == 4
    assert b.aggregate(a).saved_through == 4


def test_cpu_engine_jobs_are_done_on_return(worker, conn):
    import torch

    from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine
    from vllm_kvmem.host_tier.host_pool import HostBlockPool
    from vllm_kvmem.host_tier.kv_region import KVRegion

    kv = torch.arange(16 * 2 * 64, dtype=torch.float32).view(16, 2, 64)
    region = KVRegion.from_views([kv[:, 0], kv[:, 1]])
    pool = HostBlockPool.for_regions([region], 4, pin_memory=False)
    worker._engine = BlockCopyEngine([region], pool)
    loaded, through = _step(
        conn,
        HostTierMetadata(
            seq=3, ahead_saves=[(2, 0)], loads=[LoadChunk("r", [0], [9], True)]
        ),
    )
    assert (loaded, through) == ({"r"}, 3)
    assert torch.equal(kv[9], kv[2])
    assert not worker._save_jobs and not worker._ahead_jobs


def test_worker_connector_reports_stats_only_when_it_counted(worker, conn):
    conn.enabled = True
    assert conn.get_kv_connector_stats() is None  # nothing counted yet
    worker._load_errors = {3, 4}
    assert conn.get_block_ids_with_load_errors() == {3, 4}
    stats = conn.get_kv_connector_stats()
    assert stats.data["load_errors"] == 2 and "host_bytes_in_use" not in stats.data
    assert worker.totals["load_errors"] == 2
    assert conn.get_kv_connector_stats() is None  # a new interval


def test_worker_stats_never_reset_the_scheduler_gauges():
    from vllm_kvmem.host_tier.stats import HostTierStats

    scheduler, worker = HostTierStats(), HostTierStats()
    scheduler.reset()
    worker.reset()
    scheduler.data.update(host_bytes_in_use=4096, load_queue_blocks=3, hit_tokens=8)
    worker.data["copy_wait_seconds"] = 0.5
    # vLLM aggregates the workers' stats first, then the scheduler's; a later
    # interval may carry worker stats only.
    merged = worker.aggregate(scheduler).reduce()
    assert merged["host_bytes_in_use"] == 4096 and merged["copy_wait_seconds"] == 0.5
    later = HostTierStats()
    later.reset()
    later.data["copy_wait_seconds"] = 0.1
    assert "host_bytes_in_use" not in later.reduce()


def test_save_that_fails_part_way_is_contained_and_tracked(worker, conn):
    jobs, engine = worker._engine.jobs, worker._engine
    engine.fail["save"] = True
    # Step 1: block 7 is evicted into slot 2 and its save fails part way.
    _step(conn, HostTierMetadata(seq=1, evict_saves=[(7, 2)]))
    (partial,) = jobs
    # The copies it queued still read block 7: the forward waits for them,
    # and the scheduler hears that slot 2 holds nothing from step 1.
    assert partial.compute_waits == 1
    assert worker.totals["save_errors"] == 1
    wmeta = conn.build_connector_worker_meta()
    assert wmeta.failed_saves == ()  # reported once, in step 1's meta
    # Step 2: a load from slot 2 (scheduled before the report arrived) is
    # refused and recomputed; a load of slot 4 into block 7 waits for the
    # partial save still reading block 7.
    meta = HostTierMetadata(
        seq=2,
        loads=[LoadChunk("r", [2, 4], [9, 7], True, sync=True)],
    )
    _step(conn, meta)
    load = jobs[-1]
    assert (load.slots, load.blocks, load.after) == ([4], [7], [partial])
    assert conn.get_block_ids_with_load_errors() == {9}
    # A later save into slot 2 that works makes it loadable again.
    _step(conn, HostTierMetadata(seq=3, ahead_saves=[(5, 2)]))
    _step(conn, HostTierMetadata(seq=4, loads=[LoadChunk("s", [2], [6], True)]))
    assert jobs[-1].slots == [2] and conn.get_block_ids_with_load_errors() == set()


def test_failed_saves_reach_the_scheduler_once(worker, conn):
    worker._engine.fail["save"] = True
    worker._engine.partial = False  # nothing was queued
    conn.handle_preemptions(HostTierMetadata(seq=5, ahead_saves=[(1, 0), (2, 3)]))
    first = conn.build_connector_worker_meta()
    assert first.failed_saves == ((0, 5), (3, 5))
    assert conn.build_connector_worker_meta().failed_saves == ()
    # Over workers (tensor-parallel ranks, stages) the failures add up.
    other = HostTierWorkerMeta(saved_through=9, failed_saves=((7, 5),))
    merged = first.aggregate(other)
    assert merged.failed_saves == ((0, 5), (3, 5), (7, 5)) and merged.saved_through == 5


def test_load_that_fails_part_way_orders_the_recompute_after_it(worker, conn):
    jobs, engine = worker._engine.jobs, worker._engine
    engine.fail["load"] = True
    meta = HostTierMetadata(seq=1, loads=[LoadChunk("r", [0, 1], [4, 5], True)])
    loaded, _ = _step(conn, meta)
    (partial,) = jobs
    # Its late copies still write blocks 4 and 5: the compute stream (which
    # recomputes them) waits for them, and so does a save into slot 1.
    assert partial.compute_waits == 1
    assert conn.get_block_ids_with_load_errors() == {4, 5}
    assert loaded == {"r"}  # reported, so vLLM recomputes instead of waiting
    _step(conn, HostTierMetadata(seq=2, ahead_saves=[(8, 1)]))
    assert jobs[-1].after == [partial]
