"""The host tier's block index: which block hash lives in which host slot.

vLLM-free. The scheduler owns one index per engine (inside ``slots``, the
owner of a slot's life) and makes every decision (which block to spill
where, which slot to load from); workers only execute the copies, so every
rank of a pipeline or tensor-parallel group stays in lockstep. Slots
referenced by a pending load are pinned and never reused before that load
has been handed to the workers. Every block that becomes matchable or stops
being so is noted here, the one place it happens, when :attr:`notes` is on
(KV events)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

POLICIES = ("lru", "fifo")

#: What :attr:`HostBlockIndex.notes` records, in order: a key made matchable
#: (its host copy is issued before any load can read it), a key dropped
#: (evicted by the policy, or forgotten: a failed save, a bad copy), every key
#: dropped at once (a reset).
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass
class IndexCounters:
    """Monotonic counters; the connector reports differences per interval."""

    lookup_blocks: int = 0
    hit_blocks: int = 0
    spilled_blocks: int = 0
    loaded_blocks: int = 0
    dropped_blocks: int = 0  # evicted from the host tier itself


class HostBlockIndex:
    """Fixed number of slots, keyed by block hash, with LRU or FIFO eviction."""

    def __init__(self, num_slots: int, policy: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(
                f"unknown host tier eviction policy {policy!r}; use one of {POLICIES}"
            )
        self.num_slots = num_slots
        self.policy = policy
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # oldest first
        self._keys: dict[int, Hashable] = {}  # slot -> key
        self._dropped: set[int] = set()  # dropped while pinned: not yet free
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self.counters = IndexCounters()
        # (STORED | REMOVED | CLEARED, key) in order, while someone takes them
        # (None: not recorded, nothing spent).
        self.notes: list[tuple[str, Hashable]] | None = None
        #: Called with each block the policy evicts and its slot, before the
        #: slot is reused (the disk tier writes it there).
        self.on_evict: Callable[[Hashable, int], None] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    @property
    def pinned_slots(self) -> int:
        return len(self._pins)

    def match_prefix(self, keys: Sequence[Hashable]) -> list[int]:
        """Slots of the longest prefix of ``keys`` held here (a lookup)."""
        slots = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is None:
                break
            slots.append(slot)
        self.counters.lookup_blocks += len(keys)
        self.counters.hit_blocks += len(slots)
        for key in keys[: len(slots)]:
            self._touch(key)
        return slots

    def slot_of(self, key: Hashable) -> int | None:
        """The slot holding ``key``, or None; not a use (nothing refreshed,
        nothing counted): a lookup looks at many keys and uses some."""
        return self._slots.get(key)

    def use(self, keys: Sequence[Hashable], looked: int) -> None:
        """Count a lookup of ``looked`` blocks that hit the blocks ``keys``
        (all held here), and refresh them under LRU."""
        self.counters.lookup_blocks += looked
        self.counters.hit_blocks += len(keys)
        for key in keys:
            self._touch(key)

    def put(self, key: Hashable) -> int | None:
        """Make room for ``key`` and return its new slot (the caller copies the
        block there). None if it is already held (nothing to copy) or if every
        slot is pinned."""
        if key in self._slots:
            self._touch(key)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._slots[key] = slot
        self._keys[slot] = key
        self.counters.spilled_blocks += 1
        if self.notes is not None:
            self.notes.append((STORED, key))
        return slot

    def drop_slot(self, slot: int) -> bool:
        """Forget the block held in ``slot`` (its copy is known to be bad), so
        that no later lookup finds it. The caller must have finished every
        copy from the slot. Returns whether the slot held a block."""
        key = self._keys.pop(slot, None)
        if key is None:
            return False
        del self._slots[key]
        self._release(slot)
        self._dropped_key(key)
        return True

    def clear(self) -> None:
        """Forget every block (a reset); a pinned slot is freed once its last
        pending load is done."""
        for slot in self._keys:
            self._release(slot)
        self._slots.clear()
        self._keys.clear()
        if self.notes is not None:
            self.notes.append((CLEARED, None))

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._dropped.add(slot)  # freed once its last pending load is done
        else:
            self._free.append(slot)

    def _dropped_key(self, key: Hashable) -> None:
        self.counters.dropped_blocks += 1
        if self.notes is not None:
            self.notes.append((REMOVED, key))

    def pin(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._pins[s] = self._pins.get(s, 0) + 1

    def unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            left = self._pins.get(s, 0) - 1
            if left > 0:
                self._pins[s] = left
            else:
                self._pins.pop(s, None)
                if s in self._dropped:
                    self._dropped.discard(s)
                    self._free.append(s)

    def _touch(self, key: Hashable) -> None:
        if self.policy == "lru":
            self._slots.move_to_end(key)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():  # oldest first
            if slot not in self._pins:
                del self._slots[key]
                del self._keys[slot]
                self._dropped_key(key)
                if self.on_evict is not None:
                    self.on_evict(key, slot)
                return slot
        return None
