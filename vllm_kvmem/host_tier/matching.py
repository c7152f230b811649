"""The host tier's prefix hits: a new request's blocks looked up in the host
index by vLLM's own block hashes, the hit held until vLLM allocates the
request, then handed to the load queue as (host slot, device block) pairs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from vllm_kvmem.host_tier.load_queue import LoadQueue
from vllm_kvmem.host_tier.slots import HostSlots
from vllm_kvmem.host_tier.support import GroupWindow

logger = init_logger("vllm.kvmem.host_tier")


@dataclass
class _Match:
    """A request's host hit, pinned until vLLM allocates its blocks."""

    start: int  # first block of the hit
    slots: dict[tuple[int, int], int]  # (group, block position) -> host slot
    sync: bool
    # Slots taken for disk hits, read once vLLM allocates the request: slot
    # -> block key.
    disk: dict[int, bytes] = field(default_factory=dict)


class HostMatcher:
    """Which of a request's blocks the host holds, and which load.

    A hit is offered to vLLM (``get_num_new_matched_tokens``), its slots
    pinned, and loaded once vLLM has allocated the request's blocks
    (:meth:`claim`): in this step's forward when it fits what is left of the
    step's load budget, otherwise in the background."""

    def __init__(
        self,
        slots: HostSlots,
        groups: tuple[GroupWindow, ...],
        block_size: int,
        loads: LoadQueue,
        count: Callable[..., None],
        disk: Any = None,
    ) -> None:
        """``groups``: full-attention groups first; ``count``: the scheduler's
        counter (its interval stats); ``disk``: the disk tier behind the host
        (a ``SchedulerDisk``; one full-attention group only), or None."""
        self.disk = disk
        self.slots = slots
        self.groups = groups
        self.block_size = block_size
        self.loads = loads
        self._count = count
        self.matched: dict[str, _Match] = {}  # until vLLM allocates the request
        # request -> (tokens looked up, tokens hit), counted once allocated.
        self.lookups: dict[str, tuple[int, int]] = {}

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the hit's tokens, and whether
        they load asynchronously."""
        start = num_computed_tokens // self.block_size
        # Leave the last prompt token to compute, as vLLM needs one new token.
        stop = min(
            len(request.block_hashes), (request.num_tokens - 1) // self.block_size
        )
        old = self.matched.pop(request.request_id, None)
        if old:
            self._release(old.slots.values(), old.disk)
        if stop <= start:
            return 0, False
        end, slots = self._longest_hit(request.block_hashes, start, stop)
        self.slots.pin(list(slots.values()))
        disk: dict[int, bytes] = {}
        if self.disk is not None and end < stop:
            # The prefix goes on on disk: each block read into a host slot of
            # its own (pinned), then loaded like a host hit.
            end, disk = self._disk_hit(request.block_hashes, end, stop, slots)
        hit = (end - start) * self.block_size
        looked = (stop - start) * self.block_size
        # Counted once the request is allocated: a waiting request is looked up
        # again every step.
        self.lookups[request.request_id] = (looked, hit)
        if not slots:
            return 0, False
        # A hit that fits what is left of this step's load budget is loaded
        # before this step's forward and the request runs in this very step:
        # the other requests wait for at most one budget of copies either
        # way, and the request saves the two steps of the asynchronous path.
        sync = not disk and len(slots) <= self.loads.sync_room()
        self.matched[request.request_id] = _Match(start, slots, sync, disk)
        # Otherwise asynchronous: the request waits for its own blocks in
        # WAITING_FOR_REMOTE_KVS while every other request keeps running.
        return hit, not sync

    def _longest_hit(
        self, block_hashes: Any, start: int, stop: int
    ) -> tuple[int, dict[tuple[int, int], int]]:
        """The longest prefix, ending at a block in ``(start, stop]``, whose
        blocks the host holds for every KV cache group, as vLLM would use it:
        a full-attention group needs every block from ``start`` on, a
        sliding-window group only those the next token still attends to (the
        ones before ``start`` are vLLM's own device hit). Returns its end
        block and the host slot of each ``(group, position)`` to load."""

        def slot(group: GroupWindow, pos: int) -> int | None:
            key = make_block_hash_with_group_id(block_hashes[pos], group.group_id)
            return self.slots.slot_of(key)

        end = stop
        found: dict[tuple[int, int], int] = {}
        runs: list[tuple[GroupWindow, list[int]]] = []
        for group in self.groups:
            if group.window is None:  # a prefix: stop at its first miss
                for pos in range(start, end):
                    if (s := slot(group, pos)) is None:
                        end = pos
                        break
                    found[group.group_id, pos] = s
                continue
            # run[i]: host blocks in a row ending at position start + i
            run, length = [], 0
            for pos in range(start, end):
                s = slot(group, pos)
                length = length + 1 if s is not None else 0
                run.append(length)
                if s is not None:
                    found[group.group_id, pos] = s
            runs.append((group, run))
        # The longest end at which every sliding-window group holds its window.
        while end > start and not all(
            run[end - 1 - start]
            >= end - max(start, group.first_needed(end, self.block_size))
            for group, run in runs
        ):
            end -= 1
        slots = {}
        for group in self.groups:
            first = max(start, group.first_needed(end, self.block_size))
            for pos in range(first, end):
                slots[group.group_id, pos] = found[group.group_id, pos]
        self.slots.use(
            [
                make_block_hash_with_group_id(block_hashes[pos], gid)
                for gid, pos in slots
            ],
            (stop - start) * len(self.groups),
        )
        return end, slots

    def _disk_hit(
        self,
        block_hashes: Any,
        end: int,
        stop: int,
        slots: dict[tuple[int, int], int],
    ) -> tuple[int, dict[int, bytes]]:
        """Continue a hit ending at ``end`` with the blocks whole on disk, a
        host slot each (added to ``slots``): the new end and the slots to
        read into. Past the first disk block the prefix may go back and forth
        between disk and host memory (a revisited document's head was
        demoted before its tail): a block the host holds is loaded from
        there."""
        gid = self.groups[0].group_id
        disk: dict[int, bytes] = {}
        while end < stop:
            # One block at a time: most lookups end at the first block.
            key = make_block_hash_with_group_id(block_hashes[end], gid)
            if not self.disk.lookup([key]):
                held = self.slots.slot_of(key) if disk else None
                if held is None:
                    break
                self.slots.pin([held])
                self.slots.use([key], 0)
                slots[gid, end] = held
                end += 1
                continue
            slot = self.slots.take_for_disk(key)
            if slot is None:
                break  # every slot pinned, or the block on its way already
            slots[gid, end] = slot
            disk[slot] = key
            end += 1
        return end, disk

    def _release(self, slots: Any, disk: dict[int, bytes]) -> None:
        """Unpin a hit's slots; those taken for disk reads never sent are
        forgotten (they hold nothing)."""
        for slot in disk:
            self.slots.unfill(slot)
        self.slots.unpin(list(slots))

    def claim(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated ``request`` (``update_state_after_alloc``) and took
        ``num_external_tokens`` of its hit: count the lookup, and hand each
        allocated block of the hit with its host slot to the load queue."""
        looked, hit = self.lookups.pop(request.request_id, (0, 0))
        if looked:
            self._count(
                lookup_tokens=looked,
                hit_tokens=min(hit, num_external_tokens),
                miss_tokens=looked - min(hit, num_external_tokens),
            )
        matched = self.matched.pop(request.request_id, None)
        if matched is None:
            return
        n = num_external_tokens // self.block_size
        end = matched.start + n
        slots = dict(matched.slots)
        pairs: list[tuple[int, int]] = []  # (slot, block)
        invalid: list[int] = []
        if n:
            # Every block vLLM allocated for the hit gets its host copy: all of
            # a full-attention group's, a sliding-window group's within the
            # window (vLLM gives the others the null block).
            tables = blocks.blocks
            for group in self.groups:
                table = tables[group.group_id]
                for pos in range(matched.start, min(end, len(table))):
                    block = table[pos]
                    if block.is_null:
                        continue
                    slot = slots.pop((group.group_id, pos), None)
                    if slot is None:  # not part of the hit offered
                        slot = self._pin_held(request, group.group_id, pos)
                    if slot is None:
                        invalid.append(block.block_id)
                    else:
                        pairs.append((slot, block.block_id))
        unused = set(slots.values())
        self._release(  # matched, not needed
            slots.values(), {s: k for s, k in matched.disk.items() if s in unused}
        )
        waiting = set()
        for slot, _ in pairs:
            if slot in matched.disk:
                self.disk.read(slot, matched.disk[slot])
                waiting.add(slot)
        if invalid:
            # vLLM took a shorter hit than offered, whose window starts at
            # blocks the host does not hold: reported as failed loads, so
            # vLLM recomputes them.
            logger.warning(
                "Host KV tier: %d blocks of request %s have no host copy; they "
                "are recomputed.",
                len(invalid),
                request.request_id,
            )
        if pairs or invalid:
            self.loads.add(
                request.request_id, pairs, invalid, sync=matched.sync, waiting=waiting
            )

    def _pin_held(self, request: Any, group_id: int, pos: int) -> int | None:
        """The host slot of a request's block, pinned, if the host holds it."""
        key = make_block_hash_with_group_id(request.block_hashes[pos], group_id)
        slot = self.slots.slot_of(key)
        if slot is not None:
            self.slots.pin([slot])
        return slot

    def forget(self, req_id: str) -> None:
        """A request finished (or was aborted) before vLLM allocated it."""
        self.lookups.pop(req_id, None)
        matched = self.matched.pop(req_id, None)
        if matched is not None:
            self._release(matched.slots.values(), matched.disk)
