"""The host tier's view of vLLM's free queue (its ``BlockPool``, handed over by
``bind_gpu_block_pool``): a walk of the queue's head, where vLLM evicts next,
that picks cached blocks to copy ahead; a shadow of the hashed blocks the next
scheduling pass may evict; and the check, among the blocks a pass allocated,
of which ones it evicted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvmem.host_tier.slots import HostSlots


class FreeQueueShadow:
    """The walk's place in the free queue, and the shadow of its head.

    vLLM drops a block's hash when it evicts the block; the shadow (block id
    -> hash and tokens covered, for the hashed blocks the tier has seen free)
    is how the tier knows which hash an evicted block held."""

    def __init__(
        self,
        slots: HostSlots,
        *,
        block_size: int,
        budget_blocks: int,
        scan_window: int,
        shadow_window: int,
    ) -> None:
        """``slots``: where the walk's picks go; ``budget_blocks``: saves per
        step; ``scan_window``: blocks at the head worth copying ahead;
        ``shadow_window``: blocks at the head one scheduling pass can evict."""
        self.slots = slots
        self.block_size = block_size
        self.budget_blocks = budget_blocks
        self.scan_window = scan_window
        self.shadow_window = shadow_window
        self.pool: Any = None  # vLLM's device BlockPool
        # Hashed device blocks the tier has seen free (near the head of the
        # free queue, or of finished requests): block id -> (hash, tokens it
        # covers).
        self.shadow: dict[int, Any] = {}
        # Blocks vLLM allocated in this scheduling pass (update_state_after_
        # alloc), and the walk's place in the free queue: the last block it
        # examined and the blocks examined ahead of it (see walk).
        self.allocated: list[int] = []
        self.cursor: Any = None
        self.examined: dict[int, None] = {}

    def note_allocated(self, blocks: Any) -> None:
        """The blocks vLLM allocated to an admitted request (read at the next
        :meth:`find_evictions`)."""
        for group_blocks in blocks.blocks:
            self.allocated.extend(b.block_id for b in group_blocks)

    def find_evictions(
        self,
        scheduler_output: Any,
        on_evicted: Callable[[int, Any, int | None], None],
    ) -> None:
        """The evictions of the last scheduling pass, found in the shadow and
        handed to ``on_evicted`` (block id, hash held, tokens covered).

        vLLM evicts a free cached block only when it hands the block to a
        request (``get_new_blocks``), dropping the block's hash as it does, so
        the blocks to check are this pass's allocations: the running
        requests' new blocks (in the scheduler output) and the blocks of the
        requests it admitted (``update_state_after_alloc``, which also sees
        the requests that wait for an asynchronous load). A shadowed block
        among them whose hash is no longer the one recorded was evicted; its
        KV is intact until this step's forward pass, which the workers'
        copies precede. The cost is per block allocated, not per block free.
        Missed: the blocks of a request preempted and evicted within one pass
        (vLLM frees them inside ``schedule()``), which are recomputed."""
        # In the order vLLM handed the blocks out: the running requests'
        # first, then the admitted ones'.
        allocated = [
            block_id
            for ids in scheduler_output.scheduled_cached_reqs.new_block_ids
            for group_ids in ids or ()
            for block_id in group_ids
        ]
        allocated += self.allocated
        self.allocated = []
        cursor = self.cursor
        blocks, shadow, examined = self.pool.blocks, self.shadow, self.examined
        for block_id in allocated:
            # Out of the free queue: no longer ahead of the walk's cursor.
            examined.pop(block_id, None)
            if cursor is not None and cursor.block_id == block_id:
                self.cursor = cursor = None  # the walk starts from the head
            entry = shadow.get(block_id)
            if entry is None:
                continue
            key, covered = entry
            block = blocks[block_id]
            if block.block_hash == key:
                continue  # a device prefix hit: still cached
            del shadow[block_id]
            if block.block_hash is None and block.ref_cnt == 0:
                continue  # dropped in place, not handed out
            on_evicted(block_id, key, covered)

    def walk(self, seq: int) -> list[tuple[int, int]]:
        """Walk the head of vLLM's free queue, where it evicts next: pick the
        cached blocks with no host copy yet to copy in the background (up to
        the step budget, within the scan window; saves of step ``seq``), and
        shadow the hashed blocks the next scheduling pass may evict.

        The walk goes on from where the last one stopped (a cursor, as
        vLLM's lazy offload walks): the blocks it examined stay examined
        until vLLM allocates them (:meth:`find_evictions` takes them off),
        and only the blocks that have come within the window since are
        looked at, so a step costs the blocks it moved, not the window. At a
        block it could not pick (budget spent, host full) the cursor stops,
        so that the next step picks it first; the blocks beyond are still
        shadowed, and walked again by the next step."""
        queue = getattr(self.pool, "free_block_queue", None)
        if queue is None:
            return []
        cursor = self.cursor
        if cursor is not None and (
            cursor.ref_cnt > 0 or cursor.prev_free_block is None
        ):
            cursor = None  # out of the queue: start again from the head
        if cursor is None:
            self.examined = {}
        examined, shadow, slots = self.examined, self.shadow, self.slots
        picked: list[tuple[int, int]] = []
        budget = self.budget_blocks
        position, stalled = len(examined), False
        for block in queue.iter_blocks_after(cursor):
            if position >= self.shadow_window:
                break
            position += 1
            key = block.block_hash
            if key is not None and not block.is_null:
                covered = block.block_hash_num_tokens
                shadow[block.block_id] = (key, covered)
                if (
                    not stalled
                    and position <= self.scan_window
                    and not slots.saving(block.block_id)
                    and (covered is None or covered % self.block_size == 0)
                    and key not in slots
                ):
                    slot = (
                        slots.save_ahead(block.block_id, key, seq)
                        if len(picked) < budget
                        else None
                    )
                    if slot is None:  # budget spent, or every slot pinned
                        stalled = True
                    else:
                        picked.append((block.block_id, slot))
            if not stalled:
                examined[block.block_id] = None
                cursor = block
        self.cursor = cursor
        return picked

    def shadow_blocks(self, block_ids: tuple[list[int], ...]) -> None:
        """A finished request's blocks, which vLLM frees now and may evict in
        the next scheduling pass, before a walk of the free queue saw them:
        the hashed ones are shadowed."""
        blocks = self.pool.blocks
        for ids in block_ids:
            for block_id in ids:
                block = blocks[block_id]
                if block.block_hash is not None and not block.is_null:
                    self.shadow[block_id] = (
                        block.block_hash,
                        block.block_hash_num_tokens,
                    )

    def reset(self) -> None:
        """The device prefix cache was reset: the free blocks' KV no longer
        matches the hashes recorded, and the walk starts from the head."""
        self.shadow = {}
        self.cursor, self.examined = None, {}
