"""What the scheduler hands the workers each step, and what they answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadChunk:
    """Part of one request's host hits, copied in one step."""

    req_id: str
    slots: list[int]
    blocks: list[int]
    last: bool  # the request's loads are all handed out after this one
    # Loaded before this step's forward, which reads the blocks (the request
    # is in this step's batch); else in the background, reported when done.
    sync: bool = False
    # Blocks vLLM allocated for the hit that the host holds no copy of:
    # reported as failed loads, so vLLM recomputes them.
    invalid: list[int] = field(default_factory=list)


@dataclass
class HostTierMetadata(KVConnectorMetadata):
    """One step's copies, in the order the workers issue them.

    Before the forward pass (``handle_preemptions``): stop loading from
    ``stale_slots``, wait for the background saves of ``fence`` blocks (the
    step may overwrite them), copy ``evict_saves`` synchronously (blocks
    evicted this step with no host copy yet), then start ``ahead_saves`` in
    the background. Then (``start_load_kv``, before the forward when any load
    is ``sync``, after its launch otherwise): start ``loads``.
    """

    seq: int = 0
    # Slots whose background save raced a write the model runner made before
    # handle_preemptions (V2): no longer on the host, never loaded from until
    # a save writes them again.
    stale_slots: list[int] = field(default_factory=list)
    fence: list[int] = field(default_factory=list)
    evict_saves: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    ahead_saves: list[tuple[int, int]] = field(default_factory=list)  # (block, slot)
    loads: list[LoadChunk] = field(default_factory=list)
    # Disk tier, first of all (before the saves reuse the slots): host slots
    # whose block the host index evicted, to write to disk, and host slots to
    # read disk blocks into in the background, as (slot, block key).
    disk_saves: list[tuple[int, bytes]] = field(default_factory=list)
    disk_reads: list[tuple[int, bytes]] = field(default_factory=list)
    # The step schedules no tokens (its requests wait for loads): a worker
    # whose disk reads are in flight waits for them a little, off the GIL,
    # instead of returning to a loop of empty steps that starves its loader
    # thread of the GIL.
    idle: bool = False


@dataclass
class HostTierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: every background save of the steps up to
    ``saved_through`` has completed on this worker (min over workers), and
    the saves that failed, as ``(slot, step)`` (union over workers: a block
    is on the host only if every worker holds its slice)."""

    saved_through: int = 0
    failed_saves: tuple[tuple[int, int], ...] = ()
    # Disk tier: every read of the steps up to ``disk_read_through`` is done
    # (min over workers), the reads that failed as ``(slot, step)`` (union:
    # a block is in host memory only if every worker read its slice), and
    # the slices written, ``(key, rank tag, payload bytes)``.
    disk_read_through: int = 0
    disk_failed_reads: tuple[tuple[int, int], ...] = ()
    disk_written: tuple[tuple[bytes, str, int], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HostTierWorkerMeta:
        theirs = getattr(other, "saved_through", self.saved_through)
        failed = set(self.failed_saves) | set(getattr(other, "failed_saves", ()))
        reads = getattr(other, "disk_read_through", self.disk_read_through)
        bad_reads = set(self.disk_failed_reads)
        bad_reads.update(getattr(other, "disk_failed_reads", ()))
        return HostTierWorkerMeta(
            min(self.saved_through, theirs),
            tuple(sorted(failed)),
            min(self.disk_read_through, reads),
            tuple(sorted(bad_reads)),
            self.disk_written + tuple(getattr(other, "disk_written", ())),
        )
