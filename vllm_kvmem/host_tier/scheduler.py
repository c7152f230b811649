"""The host tier's scheduler side: every decision. Which evicted block gets a
host slot, which cached blocks are copied ahead of eviction, which prefix hits
load (now or in the background) and in what chunks, and when a slot may be
reused. The workers execute what :class:`HostTierMetadata` says, in step order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.utils.mem_constants import MiB_bytes
from vllm.utils.mem_utils import format_gib
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from vllm_kvmem.host_tier.config import HostTierConfig
from vllm_kvmem.host_tier.host_index import HostBlockIndex
from vllm_kvmem.host_tier.metadata import (
    HostTierMetadata,
    HostTierWorkerMeta,
    LoadChunk,
)
from vllm_kvmem.host_tier.stats import CountsStats, HostTierStats
from vllm_kvmem.host_tier.support import GroupWindow, describe_groups

logger = init_logger("vllm.kvmem.host_tier")


@dataclass
class _Match:
    """A request's host hit, pinned until vLLM allocates its blocks."""

    start: int  # first block of the hit
    slots: dict[tuple[int, int], int]  # (group, block position) -> host slot
    sync: bool


@dataclass
class _Load:
    """A request's host hits, handed to the workers a chunk per step."""

    req_id: str
    pairs: list[tuple[int, int]]  # (slot, block) not yet handed out
    slots: list[int]  # every slot of the load, pinned until it finishes
    cancelled: bool = False
    sent: dict[int, int] = field(default_factory=dict)  # block -> slot handed out
    invalid: list[int] = field(default_factory=list)  # blocks with no host copy


class HostTierScheduler(CountsStats):
    """The scheduler-side half of the connector (one per engine core)."""

    def __init__(
        self,
        config: HostTierConfig,
        vllm_config: Any,
        *,
        reason: str,
        num_slots: int,
        pipeline_slot_bytes: int,
        block_size: int,
        groups: tuple[GroupWindow, ...] = (GroupWindow(0),),
    ) -> None:
        """``reason``: why the tier is off (empty when on); ``groups``: the
        KV cache groups a hit restores (all of vLLM's, in its order)."""
        super().__init__()
        self.config = config
        self.enabled = not reason
        self.num_slots = num_slots
        self.pipeline_slot_bytes = pipeline_slot_bytes
        self.block_size = block_size
        self.step_bytes = config.copy_budget_bytes
        # Full-attention groups first: their hit is a plain prefix, which
        # bounds the search in the sliding-window ones.
        self.groups = tuple(sorted(groups, key=lambda g: g.window is not None))
        self._seq = 0
        self._pool: Any = None  # vLLM's device BlockPool (bind_gpu_block_pool)
        self._evict_saves: list[tuple[int, int]] = []
        # Hashed device blocks the tier has seen free (near the head of the
        # free queue, or of finished requests): block id -> (hash, tokens it
        # covers). vLLM drops a block's hash when it evicts the block, so this
        # is how the tier knows which hash an evicted block held (see
        # _spill_shadow_evictions).
        self._shadow: dict[int, Any] = {}
        # Blocks vLLM allocated in this scheduling pass (update_state_after_
        # alloc), and the walk's place in the free queue: the last block it
        # examined and the blocks examined ahead of it (see _walk_free_queue).
        self._allocated: list[int] = []
        self._cursor: Any = None
        self._examined: dict[int, None] = {}
        self._matched: dict[str, _Match] = {}  # until vLLM allocates the request
        self._sync_loads: list[LoadChunk] = []  # this step's
        self._sync_blocks = 0
        self._lookups: dict[str, tuple[int, int]] = {}
        self._step_pins: list[int] = []  # slots of this step's saves
        self._load_queue: dict[str, _Load] = {}  # in arrival order
        self._inflight_loads: dict[str, _Load] = {}  # all handed out, not done
        # Background saves not yet known complete on every worker: block id ->
        # (block hash, step). The device block must not be overwritten first.
        self._ahead: dict[int, tuple[Any, int]] = {}
        self._saved_through = 0
        # slot -> step whose save last wrote it: a failure reported for that
        # step forgets the slot's block, a stale report (slot reused) nothing.
        self._save_step: dict[int, int] = {}
        sched = vllm_config.scheduler_config
        step_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 0)
        slot_bytes = max(1, self.pipeline_slot_bytes)
        self._budget_blocks = max(1, self.step_bytes // slot_bytes)
        # Blocks near the head of the free queue worth copying ahead: what the
        # next two steps could evict.
        self._scan_window = max(2 * cdiv(step_tokens, self.block_size), 64)
        # Blocks one scheduling pass can evict: every group's share of the
        # step's tokens, plus a block boundary per scheduled request.
        max_seqs = int(getattr(sched, "max_num_seqs", 0) or 0)
        per_group = cdiv(step_tokens, self.block_size) + max_seqs + 1
        self._shadow_window = max(self._scan_window, per_group * len(self.groups))
        if not self.enabled:
            logger.warning(
                "Host KV tier off: %s; serving continues without it.", reason
            )
            return
        self.index = HostBlockIndex(self.num_slots, config.eviction_policy)
        logger.info(
            "Host KV tier: %d blocks of %d tokens (%s GiB per TP shard, %s "
            "eviction) for %s; background copies up to %d MiB per step each "
            "way, late spills %s.",
            self.num_slots,
            self.block_size,
            format_gib(self.num_slots * self.pipeline_slot_bytes),
            config.eviction_policy,
            describe_groups(self.groups),
            self.step_bytes // MiB_bytes,
            "copied" if config.late_spill == "copy" else "dropped",
        )

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool

    def _spill_shadow_evictions(self, scheduler_output: Any) -> None:
        """The evictions of the last scheduling pass, found in the shadow.

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
        allocated += self._allocated
        self._allocated = []
        cursor = self._cursor
        blocks, shadow, examined = self._pool.blocks, self._shadow, self._examined
        for block_id in allocated:
            # Out of the free queue: no longer ahead of the walk's cursor.
            examined.pop(block_id, None)
            if cursor is not None and cursor.block_id == block_id:
                self._cursor = cursor = None  # the walk starts from the head
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
            self._on_evicted(block_id, key, covered)

    def _on_evicted(self, block_id: int, key: Any, covered: int | None) -> None:
        """vLLM handed the free cached block ``block_id``, which held ``key``
        (vLLM's hash with the block's KV cache group), to another request."""
        if covered is not None and covered % self.block_size:
            return  # a partial block: never looked up by full-block hashes
        if key in self.index:
            self.index.put(key)  # refresh its place in the host LRU
            self._count(blocks_evicted_on_host=1)
            return  # copied ahead (a fence waits for it if still in flight)
        if self.config.late_spill == "drop":
            self._count(blocks_evicted_dropped=1)
            return
        slot = self.index.put(key)
        if slot is not None:
            # Pinned until the workers get this step's saves: a later eviction
            # in the same step must not be given the same slot.
            self.index.pin([slot])
            self._step_pins.append(slot)
            self._evict_saves.append((block_id, slot))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.enabled:
            return 0, False
        start = num_computed_tokens // self.block_size
        # Leave the last prompt token to compute, as vLLM needs one new token.
        stop = min(
            len(request.block_hashes), (request.num_tokens - 1) // self.block_size
        )
        old = self._matched.pop(request.request_id, None)
        if old:
            self.index.unpin(list(old.slots.values()))
        if stop <= start:
            return 0, False
        end, slots = self._longest_hit(request.block_hashes, start, stop)
        hit = (end - start) * self.block_size
        looked = (stop - start) * self.block_size
        # Counted once the request is allocated: a waiting request is looked up
        # again every step.
        self._lookups[request.request_id] = (looked, hit)
        if not slots:
            return 0, False
        self.index.pin(list(slots.values()))
        # A hit that fits what is left of this step's load budget is loaded
        # before this step's forward and the request runs in this very step:
        # the other requests wait for at most one budget of copies either
        # way, and the request saves the two steps of the asynchronous path.
        sync = len(slots) <= self._sync_room()
        self._matched[request.request_id] = _Match(start, slots, sync)
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
            return self.index.slot_of(key)

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
        self.index.use(
            [
                make_block_hash_with_group_id(block_hashes[pos], gid)
                for gid, pos in slots
            ],
            (stop - start) * len(self.groups),
        )
        return end, slots

    def _sync_room(self) -> int:
        """Blocks of this step's load budget not yet promised: queued
        asynchronous loads come first, so they are never starved."""
        queued = sum(len(x.pairs) for x in self._load_queue.values() if not x.cancelled)
        budget = self._budget_blocks
        return budget - self._sync_blocks - min(queued, budget)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if self.enabled and self._pool is not None:  # read at the next meta
            for group_blocks in blocks.blocks:
                self._allocated.extend(b.block_id for b in group_blocks)
        looked, hit = self._lookups.pop(request.request_id, (0, 0))
        if looked:
            self._count(
                lookup_tokens=looked,
                hit_tokens=min(hit, num_external_tokens),
                miss_tokens=looked - min(hit, num_external_tokens),
            )
        matched = self._matched.pop(request.request_id, None)
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
        self.index.unpin(list(slots.values()))  # matched, not needed
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
        if not pairs and not invalid:
            return
        if matched.sync:
            # Pinned until the workers get this step's copies; a save into a
            # slot reused later waits for the load on the workers.
            self._sync_loads.append(
                LoadChunk(
                    request.request_id,
                    [s for s, _ in pairs],
                    [b for _, b in pairs],
                    True,
                    sync=True,
                    invalid=invalid,
                )
            )
            self._sync_blocks += len(pairs)
            self._step_pins += [s for s, _ in pairs]
            return
        self._load_queue[request.request_id] = _Load(
            request.request_id, pairs, [s for s, _ in pairs], invalid=invalid
        )

    def _pin_held(self, request: Any, group_id: int, pos: int) -> int | None:
        """The host slot of a request's block, pinned, if the host holds it."""
        key = make_block_hash_with_group_id(request.block_hashes[pos], group_id)
        slot = self.index.slot_of(key)
        if slot is not None:
            self.index.pin([slot])
        return slot

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._seq += 1
        meta = HostTierMetadata(seq=self._seq)
        if not self.enabled:
            return meta
        if self._pool is not None:
            self._spill_shadow_evictions(scheduler_output)
        meta.fence = self._fences()
        meta.evict_saves, self._evict_saves = self._evict_saves, []
        meta.ahead_saves = self._walk_free_queue()
        meta.loads = self._sync_loads + self._next_load_chunks(
            self._budget_blocks - self._sync_blocks
        )
        self._sync_loads, self._sync_blocks = [], 0
        for _, slot in meta.evict_saves + meta.ahead_saves:
            self._save_step[slot] = meta.seq
        # The workers issue this step's saves before any later step's copies:
        # the slots may be reused from the next step on.
        self.index.unpin(self._step_pins)
        self._step_pins = []
        loaded = sum(len(c.blocks) for c in meta.loads)
        saved = len(meta.evict_saves) + len(meta.ahead_saves)
        self.index.counters.loaded_blocks += loaded
        self._count(
            blocks_spilled=saved,
            blocks_loaded=loaded,
            bytes_moved=(saved + loaded) * self.pipeline_slot_bytes,
            bytes_saved_ahead=len(meta.ahead_saves) * self.pipeline_slot_bytes,
            bytes_saved_at_eviction=len(meta.evict_saves) * self.pipeline_slot_bytes,
        )
        return meta

    def _fences(self) -> list[int]:
        """Blocks with a background save in flight that this step may
        overwrite: no longer free, or no longer holding the hash saved."""
        if not self._ahead or self._pool is None:
            return []
        fence = []
        for block_id, (key, _) in list(self._ahead.items()):
            block = self._pool.blocks[block_id]
            if (
                block.ref_cnt == 0
                and block.block_hash is not None
                and block.block_hash == key
            ):
                continue
            fence.append(block_id)
            del self._ahead[block_id]
        return fence

    def _walk_free_queue(self) -> list[tuple[int, int]]:
        """Walk the head of vLLM's free queue, where it evicts next: pick the
        cached blocks with no host copy yet to copy in the background (up to
        the step budget, within the scan window), and shadow the hashed
        blocks the next scheduling pass may evict.

        The walk goes on from where the last one stopped (a cursor, as
        vLLM's lazy offload walks): the blocks it examined stay examined
        until vLLM allocates them (``_spill_shadow_evictions`` takes them
        off), and only the blocks that have come within the window since are
        looked at, so a step costs the blocks it moved, not the window. At a
        block it could not pick (budget spent, host full) the cursor stops,
        so that the next step picks it first; the blocks beyond are still
        shadowed, and walked again by the next step."""
        queue = getattr(self._pool, "free_block_queue", None)
        if queue is None:
            return []
        cursor = self._cursor
        if cursor is not None and (
            cursor.ref_cnt > 0 or cursor.prev_free_block is None
        ):
            cursor = None  # out of the queue: start again from the head
        if cursor is None:
            self._examined = {}
        examined, shadow, index = self._examined, self._shadow, self.index
        picked: list[tuple[int, int]] = []
        budget = self._budget_blocks
        position, stalled = len(examined), False
        for block in queue.iter_blocks_after(cursor):
            if position >= self._shadow_window:
                break
            position += 1
            key = block.block_hash
            if key is not None and not block.is_null:
                covered = block.block_hash_num_tokens
                shadow[block.block_id] = (key, covered)
                if (
                    not stalled
                    and position <= self._scan_window
                    and block.block_id not in self._ahead
                    and (covered is None or covered % self.block_size == 0)
                    and key not in index
                ):
                    slot = index.put(key) if len(picked) < budget else None
                    if slot is None:  # budget spent, or every slot pinned
                        stalled = True
                    else:
                        index.pin([slot])
                        self._step_pins.append(slot)
                        picked.append((block.block_id, slot))
                        self._ahead[block.block_id] = (key, self._seq)
            if not stalled:
                examined[block.block_id] = None
                cursor = block
        self._cursor = cursor
        return picked

    def _next_load_chunks(self, budget: int) -> list[LoadChunk]:
        """This step's share of the queued loads (up to ``budget`` blocks),
        oldest request first."""
        chunks: list[LoadChunk] = []
        for req_id in list(self._load_queue):
            load = self._load_queue[req_id]
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
                del self._load_queue[req_id]
                self._inflight_loads[req_id] = load
        return chunks

    def update_connector_output(self, connector_output: Any) -> None:
        if not self.enabled:
            return
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HostTierWorkerMeta) and meta.saved_through > (
            self._saved_through
        ):
            self._saved_through = meta.saved_through
            done = self._saved_through
            self._ahead = {b: v for b, v in self._ahead.items() if v[1] > done}
        if isinstance(meta, HostTierWorkerMeta) and meta.failed_saves:
            self._forget_failed_saves(meta.failed_saves)
        if bad := connector_output.invalid_block_ids:
            self._drop_bad_copies(bad)
        for req_id in connector_output.finished_recving or ():
            load = self._inflight_loads.pop(req_id, None)
            if load is not None:
                self.index.unpin(load.slots)

    def _forget_failed_saves(self, failed: tuple[tuple[int, int], ...]) -> None:
        """Saves a worker could not complete: their blocks are not on the
        host, so no later lookup may find them (the workers already refuse
        to load from those slots until a save writes them again)."""
        for slot, step in failed:
            if self._save_step.get(slot) == step:
                del self._save_step[slot]
                self.index.drop_slot(slot)

    def _drop_bad_copies(self, block_ids: set[int]) -> None:
        """Blocks that failed to load: vLLM recomputes them, and their host
        copies are forgotten, so a retry cannot load the same bad bytes."""
        loads = list(self._inflight_loads.values()) + list(self._load_queue.values())
        dropped = 0
        for load in loads:
            for block_id in block_ids.intersection(load.sent):
                dropped += self.index.drop_slot(load.sent[block_id])
        if dropped:
            logger.warning(
                "Host KV tier: dropped %d host blocks that failed to load; their "
                "tokens are recomputed.",
                dropped,
            )

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The tier never holds a finished request's blocks (``False``); it
        shadows the cached ones, which vLLM frees now and may evict in the
        next scheduling pass, before a walk of the free queue saw them."""
        if self.enabled and self._pool is not None:
            blocks = self._pool.blocks
            for ids in block_ids:
                for block_id in ids:
                    block = blocks[block_id]
                    if block.block_hash is not None and not block.is_null:
                        self._shadow[block_id] = (
                            block.block_hash,
                            block.block_hash_num_tokens,
                        )
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        matched = self._matched.pop(req_id, None)
        if matched is not None:
            self.index.unpin(list(matched.slots.values()))
        load = self._load_queue.get(req_id) if self.enabled else None
        if load is not None:
            # Aborted while its loads wait: the rest is not copied, and the
            # workers still report it finished (vLLM frees its blocks then).
            load.cancelled = True
        return False, None

    def reset_cache(self) -> bool | None:
        """Drop every host block (vLLM calls this on a prefix-cache reset, e.g.
        after a weight update): stale KV must never be served."""
        if not self.enabled:
            return None
        self.index = HostBlockIndex(self.num_slots, self.config.eviction_policy)
        self._save_step = {}
        # Loads already promised to allocated blocks still run, so their slots
        # stay pinned until they finish; queued saves are dropped.
        self._evict_saves = []
        self._step_pins = []
        self._shadow = {}  # their KV no longer matches the hashes recorded
        self._cursor, self._examined = None, {}
        for load in self._load_queue.values():
            self.index.pin(load.slots)
        for load in self._inflight_loads.values():
            self.index.pin(load.slots)
        for match in self._matched.values():
            self.index.pin(list(match.slots.values()))
        for chunk in self._sync_loads:  # this step's: unpinned once sent
            self.index.pin(chunk.slots)
            self._step_pins += chunk.slots
        logger.info("Host KV tier reset: all host blocks dropped.")
        return True

    def host_bytes_in_use(self) -> int:
        return len(self.index) * self.pipeline_slot_bytes if self.enabled else 0

    def load_queue_blocks(self) -> int:
        queued = sum(len(x.pairs) for x in self._load_queue.values())
        return queued + sum(len(x.slots) for x in self._inflight_loads.values())

    def stats(self) -> HostTierStats | None:
        """This interval's counters, plus the gauges: only the scheduler side
        owns them. None when nothing was counted (vLLM drops empty stats)."""
        stats = self._take_stats()
        if stats is None:
            return None
        stats.data["host_bytes_in_use"] = self.host_bytes_in_use()
        stats.data["load_queue_blocks"] = self.load_queue_blocks()
        return stats

    def shutdown(self) -> None:
        self._shadow = {}
