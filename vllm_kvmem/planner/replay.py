"""A request trace replayed through a model of vLLM's device prefix cache and
the host tier behind it, to count the prompt tokens each tier would serve.

vLLM-free: requests come with their block keys already computed (vLLM's own
block hashes, see :mod:`vllm_kvmem.planner.trace`); this module only moves
keys between the two caches, in the order vLLM 0.32's ``BlockPool`` and the
tier's scheduler side move blocks:

- Device (``BlockPool``): ``num_blocks`` blocks, one of them vLLM's null
  block. A request's device hit is the longest prefix of its full-block keys
  cached on the device, at most ``(prompt_len - 1) // block_size`` blocks
  (vLLM always computes the last prompt token). Hit blocks are taken out of
  the free queue (``touch``); new blocks come from its head, and a cached
  block taken from there is evicted. A finished request's blocks are freed
  in reverse order: the cached ones to the tail (its last block evicted
  first), the others to the head (reused first).
- Host (the tier, ``--kv-host-cache-bytes``): ``host_blocks`` slots under
  LRU (a save, a re-save of a held block or a hit refreshes it) or FIFO.
  Past the device hit, the longest run of keys the host holds is a host
  hit; those blocks are allocated on the device and come back there. A block
  the device evicts goes to the host unless it is held already (then it is
  refreshed). After each step, cached free blocks near the head of the free
  queue are copied ahead of their eviction, as the tier's background saves
  do (``spill_ahead``: its scan window). A step's copies and hits are pinned
  for that step: a copy that finds every slot pinned is not made.

Steps: a request's prompt blocks are allocated in its first step, then one
block at a time as decoding fills them (a walk of the free queue after
each); the walk also goes on in decode steps that allocate nothing when a
full host stopped it. Concurrency: requests run in trace order, each holding
its blocks from its admission to its end, with at most ``max_concurrency``
holding at once (the oldest ends first; a request that does not fit ends
more). With 1 (the default) this is vLLM serving one request at a time,
which a CPU engine matches request by request (tests/test_planner_trace.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

#: The tier's eviction policies (``--kv-host-cache-policy``).
HOST_POLICIES = ("lru", "fifo")


@dataclass
class ReplayRequest:
    """One request as the caches see it.

    ``keys``: the keys of its full blocks, prompt and cached output together,
    in order (``keys[i]`` covers tokens ``[i * block_size, (i + 1) *
    block_size)``); ``prompt_len``: its prompt tokens; ``num_tokens``: the
    tokens whose KV it computes (prompt plus generated tokens but the last),
    which sets how many device blocks it holds."""

    keys: Sequence[Hashable]
    prompt_len: int
    num_tokens: int


@dataclass
class RequestHits:
    """Prompt tokens served by each tier for one request."""

    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int


@dataclass
class ReplayResult:
    """What a replay counted, per request and in total."""

    requests: list[RequestHits] = field(default_factory=list)
    device_evictions: int = 0  # cached device blocks reused for other blocks
    host_saves: int = 0  # blocks copied to the host (new copies only)
    host_drops: int = 0  # host blocks dropped by the host's policy

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def device_hit_tokens(self) -> int:
        return sum(r.device_hit_tokens for r in self.requests)

    @property
    def host_hit_tokens(self) -> int:
        return sum(r.host_hit_tokens for r in self.requests)


class HostCache:
    """The host tier's slots: keys under LRU or FIFO, as the tier's index."""

    def __init__(self, num_blocks: int, policy: str = "lru") -> None:
        if policy not in HOST_POLICIES:
            raise ValueError(
                f"--kv-host-cache-policy={policy!r}: use one of "
                f"{', '.join(HOST_POLICIES)}"
            )
        self.num_blocks = num_blocks
        self.policy = policy
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        # This step's hits and saves: never dropped within the step.
        self.pinned: set[Hashable] = set()
        self.saves = 0
        self.drops = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: Hashable) -> None:
        if self.policy == "lru":
            self._keys.move_to_end(key)

    def put(self, key: Hashable) -> bool:
        """A save: a held key is refreshed; a new one takes a slot, dropping
        the oldest key not pinned when full, and stays pinned for the step
        (the tier pins this step's copies until the workers have them).
        False when every slot is pinned: nothing saved."""
        if key in self._keys:
            self.touch(key)
            return True
        if self.num_blocks < 1:
            return False
        if len(self._keys) >= self.num_blocks:
            victim = next((k for k in self._keys if k not in self.pinned), None)
            if victim is None:
                return False
            del self._keys[victim]
            self.drops += 1
        self._keys[key] = None
        self.pinned.add(key)
        self.saves += 1
        return True


class DeviceCache:
    """vLLM's ``BlockPool`` with prefix caching, reduced to block ids and keys."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the device KV cache needs at least 2 blocks (one is vLLM's null "
                f"block), got {num_blocks}"
            )
        # Block 0 is the null block, never free; the others start free in id
        # order, as vLLM's free queue does.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key_of: list[Hashable | None] = [None] * num_blocks
        self.blocks_of: dict[Hashable, dict[int, None]] = {}  # first = vLLM's pick

    @property
    def num_free(self) -> int:
        return len(self.free)

    def cached(self, key: Hashable) -> int | None:
        blocks = self.blocks_of.get(key)
        return next(iter(blocks)) if blocks else None

    def touch(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def pop(self) -> tuple[int, Hashable | None]:
        """A free block from the head, and the key it held (evicted), if any."""
        block, _ = self.free.popitem(last=False)
        key = self.key_of[block]
        if key is not None:
            self.key_of[block] = None
            held = self.blocks_of[key]
            del held[block]
            if not held:
                del self.blocks_of[key]
        self.ref[block] = 1
        return block, key

    def set_key(self, block: int, key: Hashable) -> None:
        if self.key_of[block] is None:
            self.key_of[block] = key
            self.blocks_of.setdefault(key, {})[block] = None

    def release(self, blocks: Sequence[int]) -> None:
        """``free_blocks`` of a finished request's blocks, last block first."""
        to_head, to_tail = [], []
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (to_tail if self.key_of[block] is not None else to_head).append(block)
        for block in reversed(to_head):  # prepended in order: to_head[0] first
            self.free[block] = None
            self.free.move_to_end(block, last=False)
        for block in to_tail:
            self.free[block] = None


class Replay:
    """The two caches, fed one request at a time."""

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        block_size: int,
        *,
        policy: str = "lru",
        max_concurrency: int = 1,
        spill_ahead: int = 0,
    ) -> None:
        """``device_blocks``: vLLM's ``num_gpu_blocks`` (the null block
        included); ``host_blocks``: the tier's slots (0: no tier);
        ``spill_ahead``: blocks at the head of the free queue the tier copies
        ahead of eviction (its scan window; 0: only evicted blocks go to the
        host)."""
        if block_size < 1:
            raise ValueError(f"--block-size={block_size}: must be positive, e.g. 16")
        if max_concurrency < 1:
            raise ValueError(
                f"--max-concurrency={max_concurrency}: must be at least 1 (1: one "
                "request at a time)"
            )
        if host_blocks < 0:
            raise ValueError(f"host size of {host_blocks} blocks: must be 0 or more")
        self.device = DeviceCache(device_blocks)
        self.host = HostCache(host_blocks, policy)
        self.block_size = block_size
        self.max_concurrency = max_concurrency
        self.spill_ahead = spill_ahead if host_blocks else 0
        self.running: list[list[int]] = []  # block ids, oldest request first
        self.result = ReplayResult()
        # The background walk's place: free blocks it has looked at, which it
        # does not look at again until they leave the free queue.
        self._walked: set[int] = set()
        self._cursor: int | None = None
        self._stalled = False  # the last walk stopped at a full host

    def run(self, requests: Sequence[ReplayRequest]) -> ReplayResult:
        for i, req in enumerate(requests):
            self.admit(req, i)
        while self.running:
            self.device.release(self.running.pop(0))
        self.result.host_saves = self.host.saves
        self.result.host_drops = self.host.drops
        return self.result

    def admit(self, req: ReplayRequest, index: int = 0) -> None:
        bs = self.block_size
        if len(self.running) >= self.max_concurrency:
            self.device.release(self.running.pop(0))
        need = -(-req.num_tokens // bs)
        if len(req.keys) < req.num_tokens // bs:
            raise ValueError(
                f"request {index}: {len(req.keys)} block keys for "
                f"{req.num_tokens} tokens of KV"
            )
        limit = min(len(req.keys), max(req.prompt_len - 1, 0) // bs)
        device_hit: list[int] = []
        for key in req.keys[:limit]:
            block = self.device.cached(key)
            if block is None:
                break
            device_hit.append(block)
        host_hit = 0
        for key in req.keys[len(device_hit) : limit]:
            if key not in self.host:
                break
            host_hit += 1
        new = need - len(device_hit)
        # vLLM waits (or preempts) until the running requests leave room.
        while self._room(device_hit) < new and self.running:
            self.device.release(self.running.pop(0))
        if self._room(device_hit) < new:
            raise ValueError(
                f"request {index} needs {need} KV blocks, more than the device's "
                f"{len(self.device.ref) - 1}: raise --kv-cache-memory-bytes or "
                "leave the request out"
            )
        for block in device_hit:
            self.device.touch(block)
        start = len(device_hit)
        hit_keys = req.keys[start : start + host_hit]
        self.host.pinned = set(hit_keys)  # the step's pins start with the hit
        for key in hit_keys:
            self.host.touch(key)
        blocks = list(device_hit)
        # The prompt's blocks in its first step, then one block at a time as
        # decoding fills them, the tier walking the free queue after each.
        prompt_blocks = max(-(-req.prompt_len // bs), start + host_hit)
        self._allocate(blocks, min(prompt_blocks, need) - start, admitted=True)
        full = req.num_tokens // bs
        for pos in range(start, min(len(blocks), full)):
            self.device.set_key(blocks[pos], req.keys[pos])
        for computed in range(req.prompt_len + 1, req.num_tokens + 1):
            # A decode step: a new block when its token starts one; the walk
            # goes on where a full host stopped it in an earlier step.
            if -(-computed // bs) > len(blocks):
                self._allocate(blocks, 1)
            elif self._stalled:
                self._walk(())
                self.host.pinned = set()
            if computed % bs == 0 and computed // bs <= full:
                self.device.set_key(
                    blocks[computed // bs - 1], req.keys[computed // bs - 1]
                )
        self.running.append(blocks)
        self.result.requests.append(
            RequestHits(req.prompt_len, start * bs, host_hit * bs)
        )

    def _allocate(self, blocks: list[int], n: int, admitted: bool = False) -> None:
        """One step's new blocks from the free queue's head: evicted cached
        blocks go to the host (late spills), then the tier's walk (told of
        every block of the request in the step that admits it, as vLLM tells
        the tier)."""
        added = []
        for _ in range(n):
            block, evicted = self.device.pop()
            if evicted is not None:
                self.result.device_evictions += 1
                if self.host.num_blocks:
                    self.host.put(evicted)
            added.append(block)
        blocks += added
        self._walk(blocks if admitted else added)
        self.host.pinned = set()  # the step's copies are with the workers

    def _room(self, hit: Sequence[int]) -> int:
        """Free blocks left once a device hit's free blocks leave the queue."""
        return self.device.num_free - sum(1 for b in hit if self.device.ref[b] == 0)

    def _walk(self, allocated: Sequence[int]) -> None:
        """The tier's background saves after a step that handed out
        ``allocated``: cached blocks within ``spill_ahead`` of the free
        queue's head with no host copy are copied there. As the tier's walk,
        a block is looked at once while it stays free, and every block is
        looked at again when the walk's place (the last block it looked at)
        leaves the free queue."""
        if not self.spill_ahead:
            return
        self._stalled = False
        walked = self._walked
        for block in allocated:
            walked.discard(block)
            if block == self._cursor:
                self._cursor = None
        if self._cursor is None:
            walked.clear()
        device, host = self.device, self.host
        for position, block in enumerate(device.free):
            if position >= self.spill_ahead:
                break
            if block in walked:
                continue
            key = device.key_of[block]
            if key is not None and key not in host and not host.put(key):
                self._stalled = True  # every slot pinned: the next step goes on
                break
            walked.add(block)
            self._cursor = block
