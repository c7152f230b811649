"""A KV-aware router's view of one vLLM engine, built from its KV events.

``KVEventIndex`` applies vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events to three tiers, the device (medium ``"GPU"`` or
None), the host (medium ``"CPU"``) and storage (medium ``"STORAGE"``, the
disk tier), and predicts the prefix a prompt will find cached. Blocks are
keyed by their token content, as llm-d's indexer and Dynamo's router key
them: a block's key chains its parent's key with its own
token ids (and LoRA name and extra keys), so the index never depends on how
vLLM hashes. ``BlockRemoved`` carries only vLLM's hashes, so the index keeps
the map from hash to key that the stores taught it.

``KVEventSubscriber`` receives the batches from vLLM's ``ZmqEventPublisher``
(multipart frames ``topic, seq (8 bytes big-endian), msgpack payload``) and
decodes them with vLLM's own ``KVEventBatch``.

Shared by ``benchmarks/kv_events_check.py`` and its tests.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEVICE = "device"
HOST = "host"
STORAGE = "storage"
#: KV event medium -> tier; vLLM's block pool publishes "GPU" on every
#: platform (None from older publishers).
TIER_OF_MEDIUM: dict[str | None, str] = {
    None: DEVICE,
    "GPU": DEVICE,
    "CPU": HOST,
    "STORAGE": STORAGE,
}

ROOT_KEY = b""


def block_key(
    parent: bytes,
    token_ids: Sequence[int],
    lora_name: str | None = None,
    extra_keys: Any = None,
) -> bytes:
    """The content key of one block: its tokens, LoRA and extra keys, chained
    to its parent's key (so equal keys mean equal prefixes)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"|".join(str(t).encode() for t in token_ids))
    h.update(repr((lora_name, extra_keys)).encode())
    return h.digest()


def prompt_keys(
    token_ids: Sequence[int], block_size: int, lora_name: str | None = None
) -> list[bytes]:
    """The content keys of the prompt's full blocks, in order."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], lora_name)
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Prediction:
    """Blocks a prompt should find on each tier, and the cached tokens that
    vLLM should report for it."""

    device_blocks: int
    host_blocks: int
    block_size: int
    #: Of the blocks past the device's, those read from storage.
    storage_blocks: int = 0

    @property
    def tokens(self) -> int:
        return (self.device_blocks + self.host_blocks + self.storage_blocks) * (
            self.block_size
        )


@dataclass
class KVEventIndex:
    """Both tiers of one engine, by content key, with reference counts: vLLM
    does not deduplicate blocks (a prompt that is exactly whole blocks
    recomputes its last block and caches it a second time), so a key stays on
    a tier until every copy announced there has been removed."""

    #: vLLM block hash -> content key, kept for the whole run (a host store
    #: may name a parent that has left both tiers).
    key_of_hash: dict[Any, bytes] = field(default_factory=dict)
    tiers: dict[str, Counter[bytes]] = field(
        default_factory=lambda: {DEVICE: Counter(), HOST: Counter(), STORAGE: Counter()}
    )
    #: (event kind, medium) -> events seen.
    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: BlockStored events without token ids: they cannot be keyed by content.
    empty_token_events: int = 0
    #: BlockStored events whose parent hash no store has announced.
    unknown_parent_events: int = 0
    #: Removed hashes that no store announced, or not on that tier.
    unknown_removals: int = 0
    #: Events for a medium outside TIER_OF_MEDIUM.
    other_medium_events: int = 0
    block_sizes: set[int] = field(default_factory=set)

    def apply_all(self, events: Iterable[Any]) -> None:
        for event in events:
            self.apply(event)

    def apply(self, event: Any) -> None:
        """One event, as a router applies it."""
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        kind = type(event).__name__
        medium = getattr(event, "medium", None)
        self.events[(kind, str(medium))] += 1
        if isinstance(event, AllBlocksCleared):
            # Carries no medium: a router cannot tell which tier it means.
            for tier in self.tiers.values():
                tier.clear()
            return
        tier_name = TIER_OF_MEDIUM.get(medium)
        if tier_name is None:
            self.other_medium_events += 1
            return
        tier = self.tiers[tier_name]
        if isinstance(event, BlockStored):
            self._store(event, tier)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = self.key_of_hash.get(h)
                if key is None or tier[key] <= 0:
                    self.unknown_removals += 1
                    continue
                tier[key] -= 1
                if tier[key] == 0:
                    del tier[key]

    def _store(self, event: Any, tier: Counter[bytes]) -> None:
        n = len(event.block_hashes)
        if not event.token_ids:
            self.empty_token_events += 1
            return
        self.block_sizes.add(event.block_size)
        if len(event.token_ids) != n * event.block_size:
            raise ValueError(
                f"BlockStored with {n} hashes, block_size {event.block_size} "
                f"and {len(event.token_ids)} token ids"
            )
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        elif event.parent_block_hash in self.key_of_hash:
            parent = self.key_of_hash[event.parent_block_hash]
        else:
            self.unknown_parent_events += 1
            return
        extra = event.extra_keys or [None] * n
        bs = event.block_size
        for i, h in enumerate(event.block_hashes):
            # Plain token prompts have no extra keys (None), as the prompt
            # side's keys assume; a LoRA or salted block keys apart.
            parent = block_key(
                parent,
                event.token_ids[i * bs : (i + 1) * bs],
                event.lora_name,
                extra[i],
            )
            self.key_of_hash[h] = parent
            tier[parent] += 1

    def predict(self, token_ids: Sequence[int], block_size: int) -> Prediction:
        """The cached prefix vLLM should report: the longest run of full
        blocks on the device, then the longest run on the host from there
        (vLLM asks its connector only past its own hit), then, from the
        first block in storage on, blocks in storage or on the host (the
        disk tier takes each from where it is), at most ``(len - 1) //
        block_size`` blocks (it always computes the last prompt token)."""
        keys = prompt_keys(token_ids, block_size)
        n = min((len(token_ids) - 1) // block_size, len(keys))
        device, host, storage = (self.tiers[t] for t in (DEVICE, HOST, STORAGE))
        d = 0
        while d < n and device[keys[d]] > 0:
            d += 1
        h = 0
        while d + h < n and host[keys[d + h]] > 0:
            h += 1
        s = 0
        if d + h < n and storage[keys[d + h]] > 0:
            while d + h + s < n:
                key = keys[d + h + s]
                if storage[key] > 0:
                    s += 1
                elif host[key] > 0:
                    h += 1
                else:
                    break
        return Prediction(d, h, block_size, s)

    def summary(self) -> dict[str, Any]:
        return {
            "events": {f"{k}/{m}": n for (k, m), n in sorted(self.events.items())},
            "empty_token_events": self.empty_token_events,
            "unknown_parent_events": self.unknown_parent_events,
            "unknown_removals": self.unknown_removals,
            "other_medium_events": self.other_medium_events,
            "block_sizes": sorted(self.block_sizes),
            "device_blocks_indexed": sum(1 for v in self.tiers[DEVICE].values() if v),
            "host_blocks_indexed": sum(1 for v in self.tiers[HOST].values() if v),
            "storage_blocks_indexed": sum(1 for v in self.tiers[STORAGE].values() if v),
        }


class KVEventSubscriber:
    """A SUB socket that vLLM's publisher connects to.

    It binds ``tcp://127.0.0.1:<free port>`` and the engine gets that address
    as ``endpoint``: vLLM's ZmqEventPublisher binds only wildcard endpoints
    (``tcp://*:N``) and connects to any other, so nothing listens beyond the
    loopback and there is no race for the port. It exists before the server
    starts, so no batch is lost to ZMQ's slow-joiner window.
    """

    def __init__(self, topic: str = "kvmem") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never drop: the check needs all
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.batches = 0
        self.missed_seqs = 0
        #: Drains that saw no batch of the last request within ``wait_s``
        #: (it stored and evicted nothing, or its events were late).
        self.waits_timed_out = 0

    def events_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` for this subscriber."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "topic": self.topic,
        }

    def drain(
        self,
        index: KVEventIndex,
        quiet_s: float,
        since: float | None = None,
        wait_s: float = 1.0,
    ) -> list[float]:
        """Apply every batch that arrives until the socket stays quiet for
        ``quiet_s``; the batches' timestamps (the engine's ``time.time()``
        when it published them).

        With ``since`` (when the last request was sent; same machine, same
        clock) it first waits up to ``wait_s`` for a batch published after
        it, the last request's own events: batches arrive in order, so the
        quiet window then only has to cover that request's later steps. The
        check's one timing assumption is that window: vLLM publishes a
        step's events before it returns the step's outputs, from a thread,
        so once a response is in, its events are at most ``quiet_s`` apart.
        """
        import zmq

        stamps: list[float] = []
        waiting = since is not None
        deadline = time.monotonic() + wait_s
        while True:
            timeout = quiet_s
            if waiting:
                timeout = max(quiet_s, deadline - time.monotonic())
            if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
                if waiting:
                    self.waits_timed_out += 1
                break
            while True:
                try:
                    _topic, seq_bytes, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq != self.next_seq:
                    self.missed_seqs += max(0, seq - self.next_seq)
                self.next_seq = seq + 1
                batch = self._decoder.decode(payload)
                index.apply_all(batch.events)
                stamps.append(batch.ts)
                if since is not None and batch.ts >= since:
                    waiting = False
        self.batches += len(stamps)
        return stamps

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
