"""The host tier's loads: host hits copied back into the device blocks vLLM
allocated for them, within a budget of blocks per step. A small hit loads in
the step that admits its request; a larger one queues, and goes to the
workers a chunk per step, oldest request first."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.logger import init_logger

from vllm_kvmem.host_tier.metadata import LoadChunk
from vllm_kvmem.host_tier.slots import HostSlots

logger = init_logger("vllm.kvmem.host_tier")


@dataclass
class _Load:
    """A request's host hits, handed to the workers a chunk per step."""

    req_id: str
    pairs: list[tuple[int, int]]  # (slot, block) not yet handed out
    slots: list[int]  # every slot of the load, pinned until it finishes
    cancelled: bool = False
    sent: dict[int, int] = field(default_factory=dict)  # block -> slot handed out
    invalid: list[int] = field(default_factory=list)  # blocks with no host copy
    waiting: set[int] = field(default_factory=set)  # slots still read from disk


class LoadQueue:
    """This step's loads, the queued ones, and those in flight on the workers.

    Slots stay pinned until their load is done: a slot of this step's loads
    for the step (released once the workers have this step's copies), a
    queued or in-flight load's until the workers report it finished."""

    def __init__(self, slots: HostSlots, budget_blocks: int) -> None:
        """``budget_blocks``: blocks loaded per step."""
        self.slots = slots
        self.budget_blocks = budget_blocks
        self.sync_loads: list[LoadChunk] = []  # this step's
        self.sync_blocks = 0
        self.queue: dict[str, _Load] = {}  # in arrival order
        self.inflight: dict[str, _Load] = {}  # all handed out, not done

    def sync_room(self) -> int:
        """Blocks of this step's load budget not yet promised: queued
        asynchronous loads come first, so they are never starved."""
        queued = sum(len(x.pairs) for x in self.queue.values() if not x.cancelled)
        budget = self.budget_blocks
        return budget - self.sync_blocks - min(queued, budget)

    def add(
        self,
        req_id: str,
        pairs: list[tuple[int, int]],
        invalid: list[int],
        *,
        sync: bool,
        waiting: set[int] | None = None,
    ) -> None:
        """A request's hit, as (slot, block) pairs whose slots are pinned, and
        the blocks with no host copy (reported as failed loads): loaded in this
        step (``sync``) or queued; ``waiting``: slots whose disk read must be
        done first (never ``sync``)."""
        if sync:
            # Pinned until the workers get this step's copies; a save into a
            # slot reused later waits for the load on the workers.
            self.sync_loads.append(
                LoadChunk(
                    req_id,
                    [s for s, _ in pairs],
                    [b for _, b in pairs],
                    True,
                    sync=True,
                    invalid=invalid,
                )
            )
            self.sync_blocks += len(pairs)
            self.slots.unpin_after_step([s for s, _ in pairs])
            return
        self.queue[req_id] = _Load(
            req_id,
            pairs,
            [s for s, _ in pairs],
            invalid=invalid,
            waiting=set(waiting or ()),
        )

    def step_loads(self) -> list[LoadChunk]:
        """This step's loads: the ones admitted in it, then the queued loads'
        share of the rest of the budget, oldest request first."""
        chunks, self.sync_loads = self.sync_loads, []
        budget = self.budget_blocks - self.sync_blocks
        self.sync_blocks = 0
        for req_id in list(self.queue):
            load = self.queue[req_id]
            if load.waiting:
                # Its disk reads are still writing its slots: even a
                # cancelled load keeps them pinned until then.
                continue
            if load.cancelled:
                take: list[tuple[int, int]] = []
                load.pairs = []
            else:
                if budget <= 0:
                    break
                take, load.pairs = load.pairs[:budget], load.pairs[budget:]
                budget -= len(take)
                load.sent.update((b, s) for s, b in take)
            last = not load.pairs
            chunks.append(
                LoadChunk(
                    req_id,
                    [s for s, _ in take],
                    [b for _, b in take],
                    last,
                    invalid=load.invalid,
                )
            )
            load.invalid = []
            if last:
                del self.queue[req_id]
                self.inflight[req_id] = load
        return chunks

    def disk_read_done(self, slot: int, ok: bool) -> None:
        """A disk read into ``slot`` is done on every worker; a failed one
        leaves its block to vLLM to recompute."""
        for load in self.queue.values():
            if slot in load.waiting:
                load.waiting.discard(slot)
                if not ok:
                    load.invalid += [b for s, b in load.pairs if s == slot]
                    load.pairs = [(s, b) for s, b in load.pairs if s != slot]
                return

    def finished(self, req_ids: set[str] | None) -> None:
        """Loads the workers report done: their slots are free to reuse."""
        for req_id in req_ids or ():
            load = self.inflight.pop(req_id, None)
            if load is not None:
                self.slots.unpin(load.slots)

    def drop_bad_copies(self, block_ids: set[int]) -> None:
        """Blocks that failed to load: vLLM recomputes them, and their host
        copies are forgotten, so a retry cannot load the same bad bytes."""
        loads = list(self.inflight.values()) + list(self.queue.values())
        dropped = 0
        for load in loads:
            for block_id in block_ids.intersection(load.sent):
                dropped += self.slots.drop(load.sent[block_id])
        if dropped:
            logger.warning(
                "Host KV tier: dropped %d host blocks that failed to load; their "
                "tokens are recomputed.",
                dropped,
            )

    def cancel(self, req_id: str) -> None:
        """Aborted while its loads wait: the rest is not copied, and the
        workers still report it finished (vLLM frees its blocks then)."""
        load = self.queue.get(req_id)
        if load is not None:
            load.cancelled = True

    def blocks(self) -> int:
        """Blocks waiting to load or in flight (a gauge)."""
        queued = sum(len(x.pairs) for x in self.queue.values())
        return queued + sum(len(x.slots) for x in self.inflight.values())
