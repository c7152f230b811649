"""The host tier's saves: device blocks copied to host slots. Late spills (a
block vLLM evicted before its background copy ran, saved before the forward
pass that overwrites it), background saves in flight (a device block must
not be overwritten before its save is done: fences), saves a worker failed
(their slots forgotten), and saves the model runner would race: blocks it
writes before the connector's ``handle_preemptions`` (Model Runner V2; see
docs/host-kv-tier.md, "Writes into new blocks before the forward, per
runner")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.host_tier.host_index import HostBlockIndex
from vllm_kvmem.host_tier.metadata import HostTierMetadata, HostTierWorkerMeta

logger = init_logger("vllm.kvmem.host_tier")


class SpillQueue:
    """The saves of this step, and the background saves not yet done.

    The free-queue walk (``free_queue``) picks the background saves into
    :attr:`ahead`; the eviction check hands each evicted block to
    :meth:`late_spill`."""

    def __init__(
        self,
        index: HostBlockIndex,
        step_pins: list[int],
        *,
        block_size: int,
        late_spill: str,
        count: Callable[..., None],
    ) -> None:
        """``step_pins``: the scheduler's slots pinned for this step only
        (shared, cleared in place); ``late_spill``: ``copy`` or ``drop``;
        ``count``: the scheduler's counter (its interval stats)."""
        self.index = index
        self.step_pins = step_pins
        self.block_size = block_size
        self.drop_late = late_spill == "drop"
        self._count = count
        self.evict_saves: list[tuple[int, int]] = []  # this step's late spills
        # Background saves not yet known complete on every worker: block id ->
        # (block hash, step). The device block must not be overwritten first.
        self.ahead: dict[int, tuple[Any, int]] = {}
        self.saved_through = 0
        # slot -> step whose save last wrote it: a failure reported for that
        # step forgets the slot's block, a stale report (slot reused) nothing.
        self.save_step: dict[int, int] = {}
        # Blocks the workers' model runner writes this step before the
        # connector's handle_preemptions (set by the scheduler each step;
        # empty on V1): a save of them would read the written bytes or race
        # the write. And the slots of saves in flight that raced it (the
        # workers must not load from them).
        self.overwritten: frozenset[int] = frozenset()
        self.stale_slots: list[int] = []
        self._said_overwritten = False

    def late_spill(self, block_id: int, key: Any, covered: int | None) -> None:
        """vLLM handed the free cached block ``block_id``, which held ``key``
        (vLLM's hash with the block's KV cache group), to another request."""
        if covered is not None and covered % self.block_size:
            return  # a partial block: never looked up by full-block hashes
        if key in self.index:
            self.index.put(key)  # refresh its place in the host LRU
            self._count(blocks_evicted_on_host=1)
            return  # copied ahead (a fence waits for it if still in flight)
        if self.drop_late:
            self._count(blocks_evicted_dropped=1)
            return
        if block_id in self.overwritten:
            # Zeroed or a copy-on-write target before handle_preemptions:
            # the copy would hold the new bytes, so the block is not indexed.
            self._skipped_overwritten()
            return
        slot = self.index.put(key)
        if slot is not None:
            # Pinned until the workers get this step's saves: a later eviction
            # in the same step must not be given the same slot.
            self.index.pin([slot])
            self.step_pins.append(slot)
            self.evict_saves.append((block_id, slot))

    def fences(self, pool: Any) -> list[int]:
        """Blocks with a background save in flight that this step may
        overwrite: no longer free, or no longer holding the hash saved."""
        if not self.ahead or pool is None:
            return []
        fence = []
        for block_id, (key, step) in list(self.ahead.items()):
            block = pool.blocks[block_id]
            if (
                block.ref_cnt == 0
                and block.block_hash is not None
                and block.block_hash == key
            ):
                continue
            fence.append(block_id)
            del self.ahead[block_id]
            if block_id in self.overwritten:
                # The runner's write is queued before the workers' wait for
                # this save: the copy may hold either bytes. Forgotten, as a
                # failed save is, and never loaded from.
                slot = self.index.slot_of(key)
                if slot is not None and self._forget(slot, step):
                    self.stale_slots.append(slot)
                    self._skipped_overwritten()
        return fence

    def _skipped_overwritten(self) -> None:
        """Count a block not kept on the host because the model runner writes
        it first; say why once."""
        self._count(spills_skipped_overwritten=1)
        if self._said_overwritten:
            return
        self._said_overwritten = True
        logger.warning(
            "Host KV tier: the V2 model runner zeroes new blocks and applies "
            "copy-on-write copies (update_requests) before the connector's "
            "handle_preemptions, so blocks vLLM evicts and overwrites in the "
            "same step cannot be copied to host memory first; they are not "
            "kept on the host and are recomputed on a later hit. Such blocks "
            "are counted in vllm:kvmem_host_spills_skipped_overwritten, not "
            "logged."
        )

    def sent(self, meta: HostTierMetadata) -> None:
        """This step's saves go to the workers: record which step wrote each
        slot."""
        for _, slot in meta.evict_saves + meta.ahead_saves:
            self.save_step[slot] = meta.seq

    def reported(self, meta: HostTierWorkerMeta) -> None:
        """The workers' answer: the steps whose saves are all done, and the
        saves that failed."""
        if meta.saved_through > self.saved_through:
            self.saved_through = done = meta.saved_through
            self.ahead = {b: v for b, v in self.ahead.items() if v[1] > done}
        if meta.failed_saves:
            self._forget_failed_saves(meta.failed_saves)

    def _forget_failed_saves(self, failed: tuple[tuple[int, int], ...]) -> None:
        """Saves a worker could not complete: their blocks are not on the
        host, so no later lookup may find them (the workers already refuse
        to load from those slots until a save writes them again)."""
        for slot, step in failed:
            self._forget(slot, step)

    def _forget(self, slot: int, step: int) -> bool:
        """Forget ``slot``'s block if the save of ``step`` last wrote it (not
        a newer save since)."""
        if self.save_step.get(slot) != step:
            return False
        del self.save_step[slot]
        return self.index.drop_slot(slot)

    def reset(self, index: HostBlockIndex) -> None:
        """A new, empty index: queued saves are dropped (saves in flight
        still fence their blocks)."""
        self.index = index
        self.save_step = {}
        self.evict_saves = []
