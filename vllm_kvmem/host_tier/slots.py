"""The life of a host slot, in one place: which block it holds (the index),
who holds it (pins: a pending load, this step's copies), the save that last
wrote it and whether that save is done, failed or raced a write, and the
notes of every block that became matchable or stopped being so.

vLLM-free. The parts of the scheduler side (the prefix hits, the free-queue
walk, the loads and the saves) ask this owner instead of each other's state,
and a reset is one call."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from vllm_kvmem.host_tier.host_index import HostBlockIndex


class HostSlots:
    """Every host slot's state, on the scheduler side (one per engine core)."""

    def __init__(self, num_slots: int, policy: str = "lru") -> None:
        self.index = HostBlockIndex(num_slots, policy)
        # Slots pinned until the workers get this step's copies (saves and
        # loads), released by end_step.
        self.step_pins: list[int] = []
        # Background saves not yet known complete on every worker: block id
        # -> (block hash, step). The device block must not be overwritten
        # before its save is done (a fence).
        self.ahead: dict[int, tuple[Any, int]] = {}
        self.saved_through = 0
        # slot -> step whose save last wrote it: a failure reported for that
        # step forgets the slot's block, a stale report (slot reused) nothing.
        self.save_step: dict[int, int] = {}
        # Slots given to disk blocks whose read into host memory is not done
        # yet: held in the index (pinned), never matched or loaded from.
        self.filling: set[int] = set()

    # -- what the host holds ----------------------------------------------------

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.index

    def slot_of(self, key: Hashable) -> int | None:
        """The slot holding ``key`` ready to load (not one still being read
        from disk)."""
        slot = self.index.slot_of(key)
        return None if slot in self.filling else slot

    def use(self, keys: Sequence[Hashable], looked: int) -> None:
        self.index.use(keys, looked)

    def refresh(self, key: Hashable) -> None:
        """``key`` is held and wanted again: its place in the policy's order."""
        self.index.put(key)

    # -- pins -------------------------------------------------------------------

    def pin(self, slots: Sequence[int]) -> None:
        self.index.pin(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self.index.unpin(slots)

    def pin_for_step(self, slots: Sequence[int]) -> None:
        """Pinned until the workers get this step's copies."""
        self.index.pin(slots)
        self.step_pins += slots

    def unpin_after_step(self, slots: Sequence[int]) -> None:
        """Slots already pinned (a hit's), released with this step's."""
        self.step_pins += slots

    def end_step(self) -> None:
        """The workers have this step's copies, saves issued before any later
        step's: the step's slots may be reused from the next step on."""
        self.index.unpin(self.step_pins)
        self.step_pins.clear()

    # -- disk reads -------------------------------------------------------------

    def take_for_disk(self, key: Hashable) -> int | None:
        """A slot, pinned, for ``key`` to be read into from disk; None when
        every slot is pinned or ``key`` is held already."""
        slot = self.index.put(key)
        if slot is not None:
            self.index.pin([slot])
            self.filling.add(slot)
        return slot

    def filled(self, slot: int) -> None:
        """The disk read into ``slot`` is done on every worker."""
        self.filling.discard(slot)

    def unfill(self, slot: int) -> None:
        """The disk read into ``slot`` failed or will not run: its block is
        forgotten (the caller still unpins it)."""
        if slot in self.filling:
            self.filling.discard(slot)
            self.index.drop_slot(slot)

    # -- saves ------------------------------------------------------------------

    def take_for_save(self, key: Hashable) -> int | None:
        """A slot for a new copy of ``key``, pinned for this step (a later
        save in the same step must not be given it); None when every slot is
        pinned or ``key`` is held already."""
        slot = self.index.put(key)
        if slot is not None:
            self.pin_for_step([slot])
        return slot

    def save_ahead(self, block_id: int, key: Hashable, seq: int) -> int | None:
        """:meth:`take_for_save` for a background save of the device block
        ``block_id`` in step ``seq``, fenced until every worker reports it."""
        slot = self.take_for_save(key)
        if slot is not None:
            self.ahead[block_id] = (key, seq)
        return slot

    def saving(self, block_id: int) -> bool:
        """A background save of ``block_id`` is in flight."""
        return block_id in self.ahead

    def sent(self, seq: int, saves: Sequence[tuple[int, int]]) -> None:
        """Step ``seq``'s saves, ``(block, slot)``, go to the workers."""
        for _, slot in saves:
            self.save_step[slot] = seq

    def fences(
        self, pool: Any, overwritten: frozenset[int]
    ) -> tuple[list[int], list[int]]:
        """Blocks with a background save in flight that this step may
        overwrite (no longer free, or no longer holding the hash saved), and
        the slots of those the model runner writes before the workers wait
        for the save (``overwritten``): the copy may hold either bytes, so
        the block is forgotten, as a failed save is, and never loaded from."""
        if not self.ahead or pool is None:
            return [], []
        fence, stale = [], []
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
            if block_id in overwritten:
                slot = self.index.slot_of(key)
                if slot is not None and self.forget(slot, step):
                    stale.append(slot)
        return fence, stale

    def reported(self, saved_through: int, failed: Sequence[tuple[int, int]]) -> None:
        """The workers' answer: every background save of the steps through
        ``saved_through`` is done; ``failed`` saves, ``(slot, step)``, are not
        on the host (the workers refuse to load from those slots until a save
        writes them again)."""
        if saved_through > self.saved_through:
            self.saved_through = done = saved_through
            self.ahead = {b: v for b, v in self.ahead.items() if v[1] > done}
        for slot, step in failed:
            self.forget(slot, step)

    def forget(self, slot: int, step: int) -> bool:
        """Forget ``slot``'s block if the save of ``step`` last wrote it (not
        a newer save since)."""
        if self.save_step.get(slot) != step:
            return False
        del self.save_step[slot]
        return self.index.drop_slot(slot)

    def drop(self, slot: int) -> bool:
        """Forget ``slot``'s block: a copy of it failed to load."""
        return self.index.drop_slot(slot)

    # -- a reset, and what happened -----------------------------------------------

    def reset(self) -> None:
        """Every block forgotten (a prefix-cache reset). Saves in flight still
        fence their device blocks, and the slots of loads and hits already
        promised stay pinned, freed when they are done."""
        self.index.clear()
        self.save_step = {}

    def record_notes(self) -> None:
        """Note every block made matchable or dropped (KV events)."""
        if self.index.notes is None:
            self.index.notes = []

    def take_notes(self) -> list[tuple[str, Hashable]]:
        """The notes since the last call, in order (see ``host_index``)."""
        notes = self.index.notes
        if not notes:
            return []
        self.index.notes = []
        return notes
