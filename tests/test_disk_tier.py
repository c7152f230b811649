"""The disk tier's wiring into the host tier, without an engine: which host
victims are written, how a disk hit's slot waits for its read, what the
workers report and how a failed read is refused (real DiskStores in a
temporary directory; the engine tests are tests/test_disk_tier_engine.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.disk_store import DiskStore
from vllm_kvmem.host_tier.disk_tier import SchedulerDisk, WorkerDisk
from vllm_kvmem.host_tier.host_index import HostBlockIndex
from vllm_kvmem.host_tier.load_queue import LoadQueue
from vllm_kvmem.host_tier.metadata import HostTierWorkerMeta
from vllm_kvmem.host_tier.slots import HostSlots

FP = {"model": "m", "block_size": 4}
SLOT_BYTES = 64


def _key(i: int) -> bytes:
    return bytes([i]) * 32 + b"\0\0\0\0"


def test_the_index_names_each_policy_victim_before_its_slot_is_reused():
    idx = HostBlockIndex(2)
    evicted = []
    idx.on_evict = lambda key, slot: evicted.append((key, slot))
    a, b = idx.put("a"), idx.put("b")
    idx.pin([a])
    c = idx.put("c")  # "a" is pinned: "b" goes
    assert evicted == [("b", b)] and c == b
    idx.drop_slot(c)  # forgotten, not evicted: nothing to write
    assert evicted == [("b", b)]


def test_a_slot_being_read_from_disk_is_held_but_never_matched():
    slots = HostSlots(4)
    slot = slots.take_for_disk("k")
    assert slot is not None and "k" in slots and slots.slot_of("k") is None
    assert slots.take_for_disk("k") is None  # on its way already
    slots.filled(slot)
    assert slots.slot_of("k") == slot
    other = slots.take_for_disk("x")
    slots.unfill(other)  # the read failed: forgotten
    assert "x" not in slots


def test_a_load_waits_for_its_disk_reads_and_a_failed_read_is_recomputed():
    slots = HostSlots(8)
    loads = LoadQueue(slots, budget_blocks=8)
    s1, s2 = slots.take_for_disk("a"), slots.take_for_disk("b")
    loads.add("r", [(s1, 10), (s2, 11)], [], sync=False, waiting={s1, s2})
    assert loads.step_loads() == []
    loads.disk_read_done(s1, True)
    assert loads.step_loads() == []  # one read still running
    loads.disk_read_done(s2, False)
    (chunk,) = loads.step_loads()
    assert (chunk.slots, chunk.blocks, chunk.invalid) == ([s1], [10], [11])
    assert chunk.last


def test_workers_report_reads_in_step_order_and_failures_refuse_the_block(tmp_path):
    root = str(tmp_path)
    cfg = HostTierConfig(disk_path=root, disk_bytes=1 << 20)
    worker = WorkerDisk(
        cfg, None, "pp0-tp0", store=DiskStore(root, FP, 1 << 20, rank="pp0-tp0")
    )
    sched = SchedulerDisk(
        cfg, None, store=DiskStore(root, FP, 1 << 20), ranks=["pp0-tp0"]
    )
    pool = torch.arange(4 * SLOT_BYTES, dtype=torch.int32).to(torch.uint8)
    pool = pool.view(4, SLOT_BYTES)
    image = pool.__getitem__
    try:
        # Step 1: slot 0's block was evicted from host memory: written.
        sched.demote(_key(1), 0)
        saves, reads = sched.take(1)
        assert saves == [(0, _key(1))] and reads == []
        worker.step(1, saves, reads, image, set())
        pool[0].zero_()  # the slot is reused at once: the writer has a copy
        assert worker.store.flush(timeout=10)
        through, failed, written = worker.report()
        assert (through, failed) == (1, ())
        assert written == ((_key(1), "pp0-tp0", SLOT_BYTES),)
        sched.written(written)
        assert sched.take_stored() == [_key(1)]
        assert sched.lookup([_key(1), _key(2)]) == 1
        sched.demote(_key(1), 3)  # whole on disk already: nothing to write
        assert sched.take(2) == ([], [])

        # Step 3: read it into slot 2, and a block with no file into slot 3.
        sched.read(2, _key(1))
        sched.read(3, _key(9))
        saves, reads = sched.take(3)
        worker.step(3, saves, reads, image, set())
        assert worker.wait_reads(timeout=10)
        through, failed, _ = worker.report()
        assert through == 3
        done, failed = sched.reported(through, failed)
        assert (done, failed) == ([2], [3])
        expected = torch.arange(SLOT_BYTES, dtype=torch.int32).to(torch.uint8)
        assert torch.equal(pool[2], expected)
        # A block whose read failed is not offered again until rewritten.
        sched.store.note_written(_key(9), "pp0-tp0", SLOT_BYTES)
        assert sched.lookup([_key(9)]) == 0
        sched.written([(_key(9), "pp0-tp0", SLOT_BYTES)])
        assert sched.lookup([_key(9)]) == 1
    finally:
        worker.close()
        sched.close()


def test_worker_answers_aggregate_as_every_worker_must_agree():
    a = HostTierWorkerMeta(5, (), 4, ((1, 3),), ((b"k", "pp0-tp0", 8),))
    b = HostTierWorkerMeta(6, (), 2, ((2, 3),), ((b"k", "pp1-tp0", 8),))
    both = a.aggregate(b)
    assert both.disk_read_through == 2
    assert both.disk_failed_reads == ((1, 3), (2, 3))
    assert {r for _, r, _ in both.disk_written} == {"pp0-tp0", "pp1-tp0"}


def test_a_block_whole_on_disk_is_announced_on_vllms_storage_medium():
    """``BlockStored`` with ``medium="STORAGE"`` (vLLM's name for a disk
    tier), with the tokens of the block's host event when it is known."""
    from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
    from vllm.v1.core.kv_cache_utils import (
        make_block_hash_with_group_id,
        maybe_convert_block_hash,
    )

    from vllm_kvmem.host_tier.host_index import STORED
    from vllm_kvmem.host_tier.kv_events import HostKVEvents

    events = HostKVEvents(block_size=4)
    events.enabled = True
    known, unknown = b"\1" * 32, b"\2" * 32
    external = maybe_convert_block_hash(known)  # as vLLM's events name it
    events.device[external, 0] = BlockStored(
        block_hashes=[external],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    events.add([(STORED, make_block_hash_with_group_id(known, 0))])
    events.take()
    events.stored_on_disk(
        [make_block_hash_with_group_id(h, 0) for h in (known, unknown)]
    )
    with_tokens, without = events.take()
    assert with_tokens.medium == without.medium == MEDIUM_STORAGE
    assert with_tokens.token_ids == [1, 2, 3, 4] and without.token_ids == []
    assert without.block_hashes == [maybe_convert_block_hash(unknown)]
    # Read back from disk into a host slot (not on the device any more): the
    # host event carries the tokens it had when the block was last there.
    events.device.clear()
    events.add(
        [(STORED, make_block_hash_with_group_id(h, 0)) for h in (known, unknown)]
    )
    again, never = events.take()
    assert again.medium == never.medium == "CPU"
    assert again.token_ids == [1, 2, 3, 4] and never.token_ids == []


def test_after_a_prefix_cache_reset_nothing_is_read_or_written(tmp_path):
    root = str(tmp_path)
    cfg = HostTierConfig(disk_path=root, disk_bytes=1 << 20)
    sched = SchedulerDisk(
        cfg, None, store=DiskStore(root, FP, 1 << 20), ranks=["pp0-tp0"]
    )
    try:
        sched.written([(_key(1), "pp0-tp0", SLOT_BYTES)])
        assert sched.lookup([_key(1)]) == 1
        sched.active = False  # HostTierScheduler.reset_cache
        sched.demote(_key(2), 0)
        assert sched.lookup([_key(1)]) == 0 and sched.take(1) == ([], [])
    finally:
        sched.close()


def test_disk_counters_and_gauge_are_in_the_tiers_metric_families():
    from vllm_kvmem.host_tier.disk_store import DISK_COUNTERS, DISK_GAUGES
    from vllm_kvmem.host_tier.stats import (
        COUNTERS,
        GAUGE_DOCS,
        GAUGES,
        METRIC_DOCS,
        HostTierStats,
    )

    assert set(DISK_COUNTERS) <= set(COUNTERS) and set(COUNTERS) == set(METRIC_DOCS)
    assert set(DISK_GAUGES) <= set(GAUGES) and set(GAUGES) == set(GAUGE_DOCS)
    stats = HostTierStats()
    stats.reset()
    other = HostTierStats()
    other.reset()
    other.data.update(disk_hits=3, disk_bytes_in_use=7)
    reduced = stats.aggregate(other).aggregate(other).reduce()
    assert reduced["disk_hits"] == 6 and reduced["disk_bytes_in_use"] == 7
    assert "disk_misses" not in reduced  # nothing counted: not in the log line


class _Request:
    """The fields of vLLM's ``Request`` that matching reads."""

    def __init__(self, block_hashes: list[bytes], num_tokens: int) -> None:
        self.request_id = "r"
        self.block_hashes = block_hashes
        self.num_tokens = num_tokens


def test_an_idle_step_waits_for_its_disk_reads_and_a_busy_step_does_not(tmp_path):
    """A step that computes nothing (its requests wait for disk reads) waits
    for them, bounded, off the GIL, at the end of the step; a step with a
    forward pass never does."""
    from vllm_kvmem.host_tier.metadata import HostTierMetadata
    from vllm_kvmem.host_tier.worker import IDLE_READ_WAIT_SECONDS, HostTierWorker

    root = str(tmp_path)
    cfg = HostTierConfig(disk_path=root, disk_bytes=1 << 20)
    disk = WorkerDisk(
        cfg, None, "pp0-tp0", store=DiskStore(root, FP, 1 << 20, rank="pp0-tp0")
    )
    pool = torch.zeros(2, SLOT_BYTES, dtype=torch.uint8)
    worker = HostTierWorker(None, enabled=True, num_slots=2, verify=False)
    worker._engine = type("Engine", (), {"slot_image": staticmethod(pool.__getitem__)})
    worker._disk = disk
    waits: list[float | None] = []
    real_wait = disk.wait_reads
    disk.wait_reads = lambda timeout=None: waits.append(timeout) or real_wait(timeout)
    try:
        for seq, idle in ((1, False), (2, True), (3, False)):
            meta = HostTierMetadata(seq=seq, disk_reads=[(0, _key(seq))], idle=idle)
            worker.handle_preemptions(meta)
            worker.build_connector_worker_meta()
            assert waits == ([IDLE_READ_WAIT_SECONDS] if seq >= 2 else [])
    finally:
        worker._engine = None  # no host pool to release
        worker.shutdown()


@pytest.mark.parametrize(
    ("device", "host_at", "disk_at", "offered"),
    [
        # Block 0 on the device (vLLM's hit), 1-2 in host memory, 3-4 on
        # disk, 5 nowhere: the tier offers 1-4.
        (1, (1, 2), (3, 4), (1, 2, 3, 4)),
        # A revisited document whose head was demoted to disk before its
        # tail: 0-1 on disk, 2-3 in host memory, 4 on disk: 0-4, each block
        # from where it is.
        (0, (2, 3), (0, 1, 4), (0, 1, 2, 3, 4)),
    ],
    ids=["device-host-disk", "disk-host-disk"],
)
def test_a_prefix_split_over_the_tiers_gets_every_part(
    tmp_path, device, host_at, disk_at, offered
):
    """Asynchronous; the host blocks are pinned at once (the host index
    cannot evict them) and load with the disk ones once their reads are
    done, in the prefix's order; a block read is matchable from then on."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import (
        KVCacheBlock,
        make_block_hash_with_group_id,
    )

    from vllm_kvmem.host_tier.matching import HostMatcher
    from vllm_kvmem.host_tier.support import GroupWindow

    bs = 4
    hashes = [bytes([i + 1]) * 32 for i in range(6)]
    keys = [make_block_hash_with_group_id(h, 0) for h in hashes]
    root = str(tmp_path)
    sched = SchedulerDisk(
        HostTierConfig(disk_path=root, disk_bytes=1 << 20),
        None,
        store=DiskStore(root, FP, 1 << 20),
        ranks=["pp0-tp0"],
    )
    try:
        slots = HostSlots(8)
        loads = LoadQueue(slots, budget_blocks=8)
        matcher = HostMatcher(
            slots, (GroupWindow(0),), bs, loads, lambda **_: None, sched
        )
        host = {pos: slots.take_for_save(keys[pos]) for pos in host_at}
        slots.end_step()
        sched.written([(keys[pos], "pp0-tp0", 64) for pos in disk_at])
        request = _Request(hashes, 6 * bs + 1)
        hit = len(offered) * bs
        assert matcher.match(request, device * bs) == (hit, True)
        assert all(s in slots.index._pins for s in host.values())
        blocks = KVCacheBlocks(([KVCacheBlock(100 + i) for i in range(6)],))
        matcher.claim(request, blocks, hit)
        _, reads = sched.take(1)
        assert [key for _, key in reads] == [keys[pos] for pos in disk_at]
        assert loads.step_loads() == []  # waiting for the reads
        done, failed = sched.reported(1, [])
        assert sorted(done) == sorted(slot for slot, _ in reads) and failed == []
        for slot in done:
            slots.filled(slot)
            loads.disk_read_done(slot, True)
        (chunk,) = loads.step_loads()
        assert chunk.blocks == [100 + pos for pos in offered]
        read_into = {pos: slot for pos, (slot, _) in zip(disk_at, reads)}
        assert chunk.slots == [host.get(pos, read_into.get(pos)) for pos in offered]
        assert slots.slot_of(keys[disk_at[0]]) == reads[0][0]
    finally:
        sched.close()
