"""KV events for host blocks, as vLLM's own offload connectors send them:
``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"``, and
``AllBlocksCleared`` on a reset, taken by vLLM's scheduler from the
connector's ``take_events`` and published with the device's events
(``--kv-events-config``). KV-aware routers (llm-d, Dynamo, Ray Serve) read
them to score a prefix held in host memory as cached.

A host block's ``BlockStored`` is the device's own event for that block with
its medium changed: the same token ids, parent hash, block size, LoRA name,
extra keys and group, so a router that indexes by token content places it
exactly. The device events are read where vLLM queues them (the block pool's
``kv_event_queue``), before its scheduler takes them in the same step; a
block the tier never saw stored (none, in practice) goes out without tokens,
as vLLM's lazy offload sends every block. With events off vLLM queues
nothing, and this costs nothing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)

from vllm_kvmem.host_tier.host_index import CLEARED, STORED

# A device event's key: (vLLM's external block hash, KV cache group).
_Key = tuple[Any, int | None]
#: Host blocks' events kept for the disk tier's (a block reaches disk after
#: it left the device and the host): the most recent this many.
RECENT_HOST_EVENTS = 8192


class HostKVEvents:
    """The host tier's KV events (scheduler side, one per engine core)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.enabled = False
        self.pool: Any = None  # vLLM's device BlockPool
        # The device's BlockStored of each block cached on the device, one
        # block each: a host copy's event is made from it.
        self.device: dict[_Key, BlockStored] = {}
        self._removed: set[_Key] = set()  # dropped after this step's notes
        self._queue: list[KVCacheEvent] | None = None  # the pool's, read so far
        self._read = 0
        self._events: list[KVCacheEvent] = []
        self.without_tokens = 0  # host blocks sent without their tokens
        # The latest host blocks' events: a disk block's is made from them.
        self._recent: OrderedDict[_Key, BlockStored] = OrderedDict()

    def bind(self, pool: Any) -> bool:
        """Send events when vLLM's block pool queues its own."""
        self.pool = pool
        self.enabled = bool(getattr(pool, "enable_kv_cache_events", False))
        return self.enabled

    def observe(self) -> None:
        """Read the device events vLLM queued since the last call (its
        scheduler takes the queue once a step, after the connector's calls)."""
        if not self.enabled:
            return
        queue = self.pool.kv_event_queue
        if queue is not self._queue:
            self._queue, self._read = queue, 0
        for event in queue[self._read :]:
            if isinstance(event, BlockStored):
                if event.medium in (None, "GPU"):
                    self._stored_on_device(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, "GPU"):
                    self._removed.update(
                        (h, event.group_idx) for h in event.block_hashes
                    )
            elif isinstance(event, AllBlocksCleared):
                self._removed.update(self.device)
        self._read = len(queue)

    def _stored_on_device(self, event: BlockStored) -> None:
        hashes = event.block_hashes
        # Cached again (a hit loaded into a new block): not to be dropped.
        self._removed.difference_update((h, event.group_idx) for h in hashes)
        if len(hashes) == 1:
            self.device[hashes[0], event.group_idx] = event
            return
        # One event for several blocks: one each, tokens split by block.
        size = event.block_size
        parent = event.parent_block_hash
        lookahead = getattr(event, "lookahead_token_ids", None)
        for i, block_hash in enumerate(hashes):
            changes: dict[str, Any] = {
                "block_hashes": [block_hash],
                "parent_block_hash": parent,
                "token_ids": event.token_ids[i * size : (i + 1) * size],
            }
            if event.extra_keys is not None:
                changes["extra_keys"] = event.extra_keys[i : i + 1]
            if lookahead is not None:
                changes["lookahead_token_ids"] = lookahead[i : i + 1]
            self.device[block_hash, event.group_idx] = msgspec.structs.replace(
                event, **changes
            )
            parent = block_hash

    def add(self, notes: Iterable[tuple[str, Hashable]]) -> None:
        """Events for the host index's notes (``host_index``), in order; then
        forget the device blocks vLLM dropped this step (a block evicted and
        spilled in one step needs its device event until here)."""
        if not self.enabled:
            return
        events = self._events
        for what, key in notes:
            if what == CLEARED:
                events.append(AllBlocksCleared())
                continue
            block_hash = maybe_convert_block_hash(get_block_hash(key))
            group = get_group_id(key)
            if what == STORED:
                events.append(self._stored_on_host(block_hash, group))
            else:
                events.append(
                    BlockRemoved(
                        block_hashes=[block_hash], medium=MEDIUM_CPU, group_idx=group
                    )
                )
        for dropped in self._removed:
            self.device.pop(dropped, None)
        self._removed.clear()

    def _stored_on_host(self, block_hash: Any, group: int) -> BlockStored:
        device = self.device.get((block_hash, group))
        # A block read back from disk into a host slot is not on the device:
        # its event is the one it had when it was last on the host.
        event = (
            msgspec.structs.replace(device, medium=MEDIUM_CPU)
            if device is not None
            else self._recent.get((block_hash, group))
        )
        if event is None:  # e.g. read from disk another engine wrote
            return self._without_tokens(block_hash, group, MEDIUM_CPU)
        self._recent[block_hash, group] = event
        self._recent.move_to_end((block_hash, group))
        if len(self._recent) > RECENT_HOST_EVENTS:
            self._recent.popitem(last=False)
        return event

    def _without_tokens(self, block_hash: Any, group: int, medium: str) -> BlockStored:
        self.without_tokens += 1
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=None,
            token_ids=[],
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group,
        )

    def stored_on_disk(self, keys: Iterable[Hashable]) -> None:
        """``BlockStored`` with vLLM's storage medium (``STORAGE``, as its
        SimpleCPUOffload sends for its disk tier) for blocks now whole on
        disk. Files leave the directory as any engine sharing it evicts
        them, unseen here: no ``BlockRemoved`` follows, and a router's disk
        entry is a hint (a stale one is a miss, recomputed)."""
        if not self.enabled:
            return
        for key in keys:
            block_hash = maybe_convert_block_hash(get_block_hash(key))
            group = get_group_id(key)
            host = self._recent.get((block_hash, group))
            self._events.append(
                msgspec.structs.replace(host, medium=MEDIUM_STORAGE)
                if host is not None
                else self._without_tokens(block_hash, group, MEDIUM_STORAGE)
            )

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
