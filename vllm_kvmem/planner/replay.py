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
  for that step: a copy that finds every slot pinned is not made. A waiting
  request that does not fit was still looked up (vLLM asks the tier before
  it allocates): its host hit is refreshed, and stays pinned until its next
  lookup, every step it waits at the head of the queue.

Steps, as vLLM 0.32's scheduler runs them: the running requests' next
tokens first (a new block when one starts; a request that finds no free
block preempts the newest running one, recomputed later), then the waiting
requests in trace order while their blocks fit, the prompt's in one step; a
full block is cached when scheduled, so a request hits a prefix another
running request computes. The step's evicted blocks then go to the host
and the tier walks the free queue; finished requests free their blocks at
the step's end. Requests come from ``max_concurrency`` clients in a closed
loop: a client sends the trace's next request when its last one ended,
``send_delay`` steps later while other requests run (a server: 1). With 1
client this is vLLM serving one request at a time; a CPU engine matches the
replay request by request, one at a time and with clients in its own
process (``send_delay=0``; tests/test_planner_trace.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque
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


@dataclass
class _Request:
    """A request's state in the replay's scheduler."""

    req: ReplayRequest
    index: int
    length: int  # vLLM's num_tokens: prompt and tokens sampled so far
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is computed (or scheduled this step)
    preempted: bool = False


class Replay:
    """The two caches under vLLM's scheduler, one step at a time."""

    def __init__(
        self,
        device_blocks: int,
        host_blocks: int,
        block_size: int,
        *,
        policy: str = "lru",
        max_concurrency: int = 1,
        spill_ahead: int = 0,
        send_delay: int = 1,
    ) -> None:
        """``device_blocks``: vLLM's ``num_gpu_blocks`` (the null block
        included); ``host_blocks``: the tier's slots (0: no tier);
        ``max_concurrency``: requests in flight at once (the clients of a
        closed loop); ``spill_ahead``: blocks at the head of the free queue
        the tier copies ahead of eviction (its scan window; 0: only evicted
        blocks go to the host); ``send_delay``: steps the engine runs, while
        other requests run, between a request's end and its client's next
        request reaching the scheduler (1: a server, whose engine core goes
        on while the answer reaches the client and the next request comes
        back; 0: a client in the engine's own process)."""
        if block_size < 1:
            raise ValueError(f"--block-size={block_size}: must be positive, e.g. 16")
        if max_concurrency < 1:
            raise ValueError(
                f"--max-concurrency={max_concurrency}: must be at least 1 (1: one "
                "request at a time)"
            )
        if host_blocks < 0:
            raise ValueError(f"host size of {host_blocks} blocks: must be 0 or more")
        if send_delay < 0:
            raise ValueError(f"send delay of {send_delay} steps: must be 0 or more")
        self.device = DeviceCache(device_blocks)
        self.host = HostCache(host_blocks, policy)
        self.block_size = block_size
        self.max_concurrency = max_concurrency
        self.spill_ahead = spill_ahead if host_blocks else 0
        self.send_delay = send_delay
        self.running: list[_Request] = []  # in admission order, as vLLM's
        self.waiting: deque[_Request] = deque()
        # The clients with no request in flight: the step from which each
        # one's next request can be scheduled.
        self._clients: deque[int] = deque([0] * max_concurrency)
        self._step = 0
        self.result = ReplayResult()
        # The background walk's place: free blocks it has looked at, which it
        # does not look at again until they leave the free queue.
        self._walked: set[int] = set()
        self._cursor: int | None = None
        # This step's blocks handed out (the tier is told of them) and the
        # keys evicted by them (late spills, after the step's lookups).
        self._allocated: list[int] = []
        self._evicted: list[Hashable] = []
        # The host hit of a waiting request that did not fit, per request:
        # the tier pins it until the request's next lookup.
        self._held: dict[int, list[Hashable]] = {}

    def run(self, requests: Sequence[ReplayRequest]) -> ReplayResult:
        usable = len(self.device.ref) - 1
        for i, req in enumerate(requests):
            if len(req.keys) < req.num_tokens // self.block_size:
                raise ValueError(
                    f"request {i}: {len(req.keys)} block keys for "
                    f"{req.num_tokens} tokens of KV"
                )
            need = -(-req.num_tokens // self.block_size)
            if need > usable:
                raise ValueError(
                    f"request {i} needs {need} KV blocks, more than the device's "
                    f"{usable}: raise --kv-cache-memory-bytes or leave the "
                    "request out"
                )
            self.waiting.append(_Request(req, i, req.prompt_len))
        self.result.requests = [RequestHits(r.prompt_len, 0, 0) for r in requests]
        while self.waiting or self.running:
            self.step()
        self.result.host_saves = self.host.saves
        self.result.host_drops = self.host.drops
        return self.result

    def step(self) -> None:
        """One scheduling pass and its forward, as vLLM 0.32 runs them: the
        running requests' next tokens first (a request that finds no free
        block preempts the newest running one), then, when none was
        preempted, the waiting requests in order while their blocks fit (a
        new one once a client has sent it); then the tier's late spills and
        walk; finished requests free their blocks at the end, and their
        clients send the next request."""
        self._step += 1
        self._allocated, self._evicted = [], []
        self.host.pinned = {key for keys in self._held.values() for key in keys}
        preempted = False
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted by an older request this step
            if -(-(r.computed + 1) // self.block_size) > len(r.blocks):
                while not self.device.num_free and r in self.running:
                    self._preempt(self.running.pop())
                    preempted = True
                if r not in self.running:
                    continue
                self._allocate(r.blocks, 1)
            r.computed += 1
            self._cache(r)
        while not preempted and self.waiting and self._sent(self.waiting[0]):
            if not self._admit(self.waiting[0]):
                break  # vLLM waits for room (FCFS)
            r = self.waiting.popleft()
            if not r.preempted:
                self._clients.popleft()
            self.running.append(r)
        if self.host.num_blocks:
            for key in self._evicted:  # the tier's eviction check
                self.host.put(key)
        self._walk(self._allocated)
        for r in list(self.running):  # sampled this step
            r.length += 1
            if r.computed >= r.req.num_tokens:
                self.running.remove(r)
                self.device.release(r.blocks)
                self._clients.append(self._step + 1 + self.send_delay)

    def _sent(self, r: _Request) -> bool:
        """Whether the waiting request ``r`` has reached the scheduler: a
        preempted one has; a new one once a client is free and its delay is
        over, or at once when nothing runs (the engine idles until it
        comes)."""
        if r.preempted:
            return True
        if not self._clients:
            return False
        return self._clients[0] <= self._step or not self.running

    def _admit(self, r: _Request) -> bool:
        """Schedule a waiting request: its device hit, the host's run after
        it, and blocks for every token; False when they do not fit (it
        waits)."""
        bs, req = self.block_size, r.req
        limit = min(len(req.keys), max(r.length - 1, 0) // bs)
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
        start = len(device_hit)
        hit_keys = req.keys[start : start + host_hit]
        # vLLM asks the tier before it allocates: the lookup refreshes the
        # hit under LRU and pins it, whether or not the request fits.
        for key in hit_keys:
            self.host.touch(key)
        self.host.pinned.update(hit_keys)
        new = -(-r.length // bs) - len(device_hit)
        if self._room(device_hit) < new:
            if not self.running:
                raise AssertionError("a request that fits found no room")
            self._held[r.index] = hit_keys  # until its next lookup
            return False
        self._held.pop(r.index, None)  # pinned until the step's end
        for block in device_hit:
            self.device.touch(block)
        r.blocks = list(device_hit)
        self._allocate(r.blocks, new)
        # The tier is told of every block of the request (its hits too).
        self._allocated += r.blocks[:start]
        r.computed = r.length
        self._cache(r)
        if not r.preempted:  # vLLM counts a preempted request's lookup apart
            self.result.requests[r.index] = RequestHits(
                req.prompt_len, start * bs, host_hit * bs
            )
        return True

    def _preempt(self, r: _Request) -> None:
        """vLLM's preemption: the blocks freed, the request back at the head
        of the waiting queue, recomputed from its tokens so far."""
        self.device.release(r.blocks)
        r.blocks, r.computed, r.preempted = [], 0, True
        self.waiting.appendleft(r)

    def _cache(self, r: _Request) -> None:
        """Key the request's blocks its scheduled tokens fill (vLLM caches a
        full block when it schedules it)."""
        full = min(r.computed, r.req.num_tokens) // self.block_size
        for pos in range(full):
            self.device.set_key(r.blocks[pos], r.req.keys[pos])

    def _allocate(self, blocks: list[int], n: int) -> None:
        """``n`` new blocks from the free queue's head; the keys they held are
        evicted (the tier copies them at the step's end)."""
        for _ in range(n):
            block, evicted = self.device.pop()
            if evicted is not None:
                self.result.device_evictions += 1
                self._evicted.append(evicted)
            blocks.append(block)
            self._allocated.append(block)

    def _room(self, hit: Sequence[int]) -> int:
        """Free blocks left once a device hit's free blocks leave the queue."""
        return self.device.num_free - sum(1 for b in hit if self.device.ref[b] == 0)

    def _walk(self, allocated: Sequence[int]) -> None:
        """The tier's background saves after a step that handed out
        ``allocated``: cached blocks within ``spill_ahead`` of the free
        queue's head with no host copy are copied there. As the tier's walk,
        a block is looked at once while it stays free, and every block is
        looked at again when the walk's place (the last block it looked at)
        leaves the free queue; a host whose slots are all pinned stops it
        (the next step goes on)."""
        if not self.spill_ahead:
            return
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
                break  # every slot pinned: the next step goes on
            walked.add(block)
            self._cursor = block
