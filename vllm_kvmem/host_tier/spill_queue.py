"""The host tier's saves: device blocks copied to host slots. Late spills (a
block vLLM evicted before its background copy ran, saved before the forward
pass that overwrites it) and the saves the model runner would race: blocks it
writes before the connector's ``handle_preemptions`` (Model Runner V2; see
docs/host-kv-tier.md, "Writes into new blocks before the forward, per
runner"). The saves' own state (in flight, done, failed) is the slots'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem.host_tier.slots import HostSlots

logger = init_logger("vllm.kvmem.host_tier")


class SpillQueue:
    """This step's late spills, and the blocks the runner writes first.

    The eviction check hands each evicted block to :meth:`late_spill`; the
    free-queue walk (``free_queue``) starts the background saves itself."""

    def __init__(
        self,
        slots: HostSlots,
        *,
        block_size: int,
        late_spill: str,
        count: Callable[..., None],
    ) -> None:
        """``late_spill``: ``copy`` or ``drop``; ``count``: the scheduler's
        counter (its interval stats)."""
        self.slots = slots
        self.block_size = block_size
        self.drop_late = late_spill == "drop"
        self._count = count
        self.evict_saves: list[tuple[int, int]] = []  # this step's late spills
        # Blocks the workers' model runner writes this step before the
        # connector's handle_preemptions (set by the scheduler each step;
        # empty on V1): a save of them would read the written bytes or race
        # the write.
        self.overwritten: frozenset[int] = frozenset()
        self._said_overwritten = False

    def late_spill(self, block_id: int, key: Any, covered: int | None) -> None:
        """vLLM handed the free cached block ``block_id``, which held ``key``
        (vLLM's hash with the block's KV cache group), to another request."""
        if covered is not None and covered % self.block_size:
            return  # a partial block: never looked up by full-block hashes
        if key in self.slots:
            self.slots.refresh(key)  # its place in the host LRU
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
        slot = self.slots.take_for_save(key)
        if slot is not None:
            self.evict_saves.append((block_id, slot))

    def fences(self, pool: Any) -> tuple[list[int], list[int]]:
        """Blocks with a background save in flight that this step may
        overwrite, and the slots of those saves that raced a write of the
        model runner (forgotten; the workers must not load from them)."""
        fence, stale = self.slots.fences(pool, self.overwritten)
        for _ in stale:
            self._skipped_overwritten()
        return fence, stale

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

    def take(self) -> list[tuple[int, int]]:
        """This step's late spills, ``(block, slot)``, for the workers."""
        saves, self.evict_saves = self.evict_saves, []
        return saves
