"""Block copy engine between the device KV cache and a host block pool.

vLLM 0.32 keeps the whole KV cache of a worker in ONE backing allocation and
describes where each layer's pages live with ``KVCacheTensor`` records: the
page of layer ``l`` for block ``b`` starts at
``offset + l * layer_stride + b * block_stride`` bytes into the allocation.
This module moves whole blocks (every layer of a block) between that
allocation and a host pool, and does it with as few copy operations as the
layout allows, because on a GPU every ``cudaMemcpyAsync`` costs ~5-7 us no
matter how small it is: small scattered copies are overhead-bound, large ones
run at line rate.

Two strategies:

``direct`` (block-outer layouts such as BLHNC, where all layers of a block
    are adjacent): a block is one contiguous run of bytes, so it is ONE copy,
    and runs of blocks whose ids AND host slots are both consecutive are
    coalesced into one copy.
``gather`` (any layout; the only one for layer-outer layouts such as LBHNC,
    where a block is scattered over ``num_layers`` pages): one
    ``index_select`` per region (per merged span on block-outer layouts)
    gathers every layer of every requested block into a staging buffer laid
    out like the host slots, then one copy per run of consecutive host slots;
    loads run the same in reverse with ``index_put_``. The number of
    operations does not grow with the number of layers, nor with the number
    of blocks when the slots are consecutive.

``strategy="auto"`` picks with ``copy_strategy.choose_strategy``, from the first GPU
measurements (NVIDIA H200, 2026-11-26; see :data:`BATCH_BELOW_BLOCK_BYTES`):
layer-outer layouts gather; on CUDA, block-outer layouts whose blocks are
smaller than :data:`BATCH_BELOW_BLOCK_BYTES` gather a call whose direct path
would need at least :func:`gather_min_copies` copies and copy the others
directly; larger blocks, and every block-outer layout on CPU, go direct.

Everything here is torch only (no vLLM import), so it unit-tests on CPU in
milliseconds and can be reused outside vLLM. On CUDA the copies run on a
dedicated stream into pinned host memory and complete asynchronously; on
CPU the same API runs the copies synchronously, or, with
``copy_thread=True``, on a copy thread per direction beside the forward
pass (the CPU's copy streams), loads layer by layer so that each attention
layer waits for its own KV only. The byte geometry lives in
``kv_region``, the views the copies read and write in ``block_views``, the
strategy choice and its constants in ``copy_strategy``, the host pool and
its pinning in ``host_pool``.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm_kvmem.host_tier.block_views import BlockViews
from vllm_kvmem.host_tier.copy_strategy import (
    AUTO_GATHER_MAX_STAGING_BYTES,
    DEFAULT_MAX_STAGING_BYTES,
    DIRECTIONS,
    Direction,
    Strategy,
    choose_strategy,
    plan_strategy,
)
from vllm_kvmem.host_tier.host_pool import HostBlockPool
from vllm_kvmem.host_tier.kv_region import KVRegion, host_slot_bytes

logger = logging.getLogger("vllm.kvmem.copy_engine")

# -- jobs ---------------------------------------------------------------------


@dataclass(eq=False)
class CopyJob:
    """A submitted save or load.

    ``num_ops`` counts the copy operations issued (memcpys and gather/scatter
    kernels), which is what coalescing is about and what tests assert on;
    ``strategy`` is the path the job took (``"direct"`` or ``"gather"``, empty
    for an empty job).
    On CUDA the job completes asynchronously: ``done()`` polls its event,
    ``wait()`` blocks the host on it, and ``make_current_stream_wait()``
    makes a compute stream wait for it on the device without blocking the
    host. On CPU the copies are already done when the job is returned, or,
    on an engine with a copy thread, run there (``future``): waiting is a
    host wait, and ``wait_unit(i)`` waits for a load's first ``i + 1``
    layer units only. A copy that fails on the thread sets ``failed`` and
    ``error``; waiting never raises.
    """

    direction: Direction
    num_blocks: int
    num_bytes: int
    num_ops: int
    event: torch.cuda.Event | None = field(default=None, repr=False)
    device: torch.device | None = field(default=None, repr=False)
    _keepalive: list[torch.Tensor] = field(default_factory=list, repr=False)
    #: Issuing failed part way: the event covers the copies queued before
    #: the failure; the destination holds no complete copy.
    failed: bool = False
    strategy: str = ""
    #: The copy thread's run of this job (CPU engines with a copy thread).
    future: Future[None] | None = field(default=None, repr=False)
    #: What the copy thread raised (``failed`` is then set).
    error: BaseException | None = field(default=None, repr=False)
    #: The device blocks the job writes or reads (for its failure).
    block_ids: tuple[int, ...] = field(default=(), repr=False)
    _units: _UnitProgress | None = field(default=None, repr=False)

    @property
    def asynchronous(self) -> bool:
        """True when the job may finish after it is returned (a CUDA event or
        the copy thread): its owner tracks it until ``done()``."""
        return self.event is not None or self.future is not None

    def done(self) -> bool:
        """True when the copies have finished (never blocks)."""
        if self.future is not None:
            return self.future.done()
        if self.event is None:
            return True
        if not self.event.query():
            return False
        self._keepalive.clear()
        return True

    def wait(self) -> None:
        """Block the host until the copies have finished (this job only)."""
        if self.future is not None:
            self.future.result()  # the thread's run never raises
        if self.event is not None:
            self.event.synchronize()
        self._keepalive.clear()

    def wait_unit(self, unit: int | None) -> None:
        """Block the host until layer unit ``unit`` of a load on the copy
        thread is in place (every unit: None, or a job not copied by unit)."""
        if unit is None or self._units is None:
            self.wait()
        else:
            self._units.wait(unit)

    def make_current_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current stream) after this job.

        A load's consumer calls this before kernels read the loaded blocks; a
        save's owner calls it before kernels overwrite the saved blocks. The
        dependency lives on the device: the host is not blocked. On the copy
        thread's jobs the host is the compute stream: it waits.
        """
        if self.future is not None:
            self.wait()
            return
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)


#: A load on the copy thread copies run by run (consecutive blocks into
#: consecutive slots) up to this many runs per layer unit, and scatters with
#: one ``index_put_`` per unit beyond: strided copies load 200 MiB of 2 MiB
#: blocks in 34 ms on this project's CPU (the direct path in the step: 31.5
#: ms) where ``index_put_`` takes 49 ms, but each copy has a fixed cost.
MAX_UNIT_RUNS = 8


class _UnitProgress:
    """How many layer units of a load the copy thread has finished."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done = 0
        self._over = False

    def advance(self) -> None:
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wait(self, unit: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._over or self._done > unit)


class CopyError(RuntimeError):
    """A save or load that failed while its copies were being issued.

    ``job`` tracks the copies queued before the failure (they still run on a
    GPU): the caller waits for it before the blocks or slots are reused. It
    is None only when even that could not be recorded."""

    def __init__(
        self, direction: Direction, num_blocks: int, cause: BaseException, job: Any
    ) -> None:
        super().__init__(
            f"{direction} of {num_blocks} blocks failed: {type(cause).__name__}: "
            f"{cause}"
        )
        self.direction = direction
        self.cause = cause
        self.job: CopyJob | None = job


# -- engine -------------------------------------------------------------------


def _runs(
    first: Sequence[int], second: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``(start, length)`` of maximal runs where ids go up by exactly one.

    With ``second``, both sequences must step by one for the run to continue.
    """
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(first) + 1):
        if (
            i == len(first)
            or first[i] != first[i - 1] + 1
            or (second is not None and second[i] != second[i - 1] + 1)
        ):
            runs.append((start, i - start))
            start = i
    return runs


def _id_list(ids: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(
                f"{name} must be a 1-D integer tensor, got {ids.dtype} "
                f"of shape {tuple(ids.shape)}"
            )
        return [int(i) for i in ids.tolist()]
    out = []
    for pos, value in enumerate(ids):
        try:
            out.append(operator.index(value))
        except TypeError:
            raise ValueError(f"{name}[{pos}] is not an integer id: {value!r}") from None
    return out


def _slot_runs(
    pool: HostBlockPool, runs: list[tuple[int, int]], slots: list[int]
) -> list[tuple[int, int]]:
    """Runs of consecutive slots (positions in ``slots``), cut where they
    cross one of the pool's pinned registrations: a ``cudaMemcpyAsync``
    over two registrations fails or degrades to a blocking copy."""
    out = []
    for start, count in runs:
        slot0 = slots[start]
        out += [
            (start + first - slot0, n) for first, n in pool.split_runs([(slot0, count)])
        ]
    return out


def _pool_copies(
    direction: Direction,
    staging: torch.Tensor,
    host_pool: torch.Tensor,
    slots: list[int],
    slot_runs: list[tuple[int, int]],
    copy: Callable[[torch.Tensor, torch.Tensor], None],
) -> int:
    """One copy per run of slots between the staging rows and the pool: out
    of the pool before a load's scatter, into it after a save's gather;
    ``slot_runs`` as positions in ``slots``, which the staging rows follow."""
    for start, count in slot_runs:
        slot0 = slots[start]
        rows = staging[start : start + count]
        host = host_pool[slot0 : slot0 + count]
        if direction == "save":
            copy(host, rows)
        else:
            copy(rows, host)
    return len(slot_runs)


class PageGather:
    """The ``gather`` path of a :class:`BlockCopyEngine`: every layer of the
    requested blocks in one ``index_select`` per view into a staging buffer
    laid out like the host slots, then one copy per run of consecutive slots
    (loads the same in reverse with ``index_put_``), in chunks of at most
    ``staging_cap`` bytes of staging.

    The engine issues it on its copy stream; ``copy`` is the engine's copy of
    one tensor into another, so that every memcpy goes through one seam."""

    def __init__(
        self,
        views: BlockViews,
        pool: HostBlockPool,
        device: torch.device,
        staging_cap: int,
    ) -> None:
        self.views = views  # its ``pool`` is read at each call: close empties it
        self.pool = pool
        self.device = device
        self.staging_cap = staging_cap
        self.slot_bytes = pool.slot_bytes
        self._is_cuda = device.type == "cuda"
        self._gather_views = views.gather_views()

    def _index(self, ids: list[int], keep: list[torch.Tensor]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if not self._is_cuda:
            return index
        # A pageable source would make the upload synchronous, and the copy
        # stream already waits on the compute stream: that would block the
        # host until the compute stream drains. Pinned + non_blocking does not.
        index = index.pin_memory()
        keep.append(index)
        return index.to(self.device, non_blocking=True)

    def issue(
        self,
        direction: Direction,
        blocks: list[int],
        slots: list[int],
        keep: list[torch.Tensor],
        copy: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> int:
        """Gather/scatter all layers at once through a slot-shaped staging buffer."""
        host_pool = self.views.pool
        pairs = sorted(zip(slots, blocks))
        chunk = max(1, self.staging_cap // self.slot_bytes)
        every = [s for s, _ in pairs]
        if not self._is_cuda and len(_slot_runs(self.pool, _runs(every), every)) == 1:
            chunk = len(pairs)  # gathered straight into the pool: no staging
        num_ops = 0
        for c in range(0, len(pairs), chunk):
            part = pairs[c : c + chunk]
            part_slots = [s for s, _ in part]
            slot_runs = _slot_runs(self.pool, _runs(part_slots), part_slots)
            index = self._index([b for _, b in part], keep)
            m = len(part)
            # With the pool on the same device (CPU) and one run of slots, the
            # pool rows are the staging buffer: no second pass over the bytes.
            in_place = not self._is_cuda and len(slot_runs) == 1
            if in_place:
                staging = host_pool[part_slots[0] : part_slots[0] + m]
            else:
                staging = torch.empty(
                    (m, self.views.slot), dtype=self.views.dtype, device=self.device
                )
            if direction == "load" and not in_place:
                num_ops += _pool_copies(
                    direction, staging, host_pool, part_slots, slot_runs, copy
                )
            for view, host_offset, row_shape in self._gather_views:
                width = math.prod(row_shape)
                rows = staging[:, host_offset : host_offset + width]
                rows = rows.view(m, *row_shape)
                if direction == "save":
                    torch.index_select(view, 0, index, out=rows)
                else:
                    # index_put_ rather than index_copy_: same single
                    # scatter, measured ~15% faster on CPU.
                    view.index_put_((index,), rows)
                num_ops += 1
            if direction == "save" and not in_place:
                num_ops += _pool_copies(
                    direction, staging, host_pool, part_slots, slot_runs, copy
                )
        return num_ops


class BlockCopyEngine:
    """Copies blocks between the device KV regions and a ``HostBlockPool``.

    ``save(block_ids, slot_ids)`` copies device block ``block_ids[i]`` into
    host slot ``slot_ids[i]``; ``load(slot_ids, block_ids)`` does the reverse.
    Lists may be unsorted and of any length. The destinations of one call
    must be distinct.

    ``strategy``: ``"auto"`` chooses with :func:`plan_strategy` (layer-outer:
    ``gather``; block-outer: ``direct``, except on CUDA with blocks below
    :data:`BATCH_BELOW_BLOCK_BYTES`, where each call gathers when it would
    need :func:`gather_min_copies` direct copies or more); ``strategy`` then
    holds the engine's default and ``CopyJob.strategy`` what a call took.
    Either can be forced (``direct`` only where the layout allows it).

    On CUDA the engine owns one copy stream per direction. Every job first
    makes its stream wait for the compute stream's current position (a
    device-side dependency, not a host sync), so a save reads finished KV
    writes and a load does not overwrite blocks that queued kernels still
    read. Jobs of one direction run in submission order; across directions
    the caller passes ``after=`` the jobs a copy depends on (a load from a
    slot whose save is in flight, say). Not thread-safe: submit from one
    thread. ``close()`` drains both streams and releases the pool, at engine
    shutdown rather than whenever the garbage collector gets to it.

    ``copy_thread`` (CPU only): the copies run on one thread per direction,
    as the CUDA copy streams do: jobs of one direction in submission order,
    a job starting after the jobs in its ``after`` (a host wait on the
    thread), so a load is never queued behind background saves. Loads go
    layer unit by layer unit (:meth:`layer_unit_starts`), saves as above.
    Worth it where a CPU is left over by the forward pass's OpenMP threads.
    """

    def __init__(
        self,
        regions: Sequence[KVRegion],
        pool: HostBlockPool,
        device: torch.device | str | None = None,
        *,
        strategy: Strategy = "auto",
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        copy_thread: bool = False,
    ) -> None:
        if not regions:
            raise ValueError("BlockCopyEngine needs at least one KVRegion")
        self.regions = tuple(regions)
        self.pool = pool
        self.device = torch.device(device) if device is not None else regions[0].device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        for i, region in enumerate(self.regions):
            if region.device != self.device:
                raise ValueError(
                    f"region {i} lives on {region.device}, not on the engine's "
                    f"device {self.device}"
                )
        if pool.tensor.device.type != "cpu":
            raise ValueError(
                f"the host pool must be in CPU memory, not {pool.tensor.device}"
            )
        self.slot_bytes = host_slot_bytes(self.regions)
        if pool.slot_bytes != self.slot_bytes:
            raise ValueError(
                f"host pool slots hold {pool.slot_bytes} bytes but one block of these "
                f"regions is {self.slot_bytes} bytes"
            )
        self.num_blocks = min(r.num_blocks for r in self.regions)  # type: ignore[type-var]
        self.max_staging_bytes = max(int(max_staging_bytes), 1)
        self._is_cuda = self.device.type == "cuda"
        self._closed = False
        # One stream per direction: a background save never queues a load
        # behind it (and the reverse); explicit ``after`` dependencies order
        # the two where they touch the same slot or block.
        self._streams: dict[Direction, torch.cuda.Stream] = (
            {d: torch.cuda.Stream(device=self.device) for d in DIRECTIONS}
            if self._is_cuda
            else {}
        )

        self._views = BlockViews(self.regions, pool, self.num_blocks)

        chosen, per_call = plan_strategy(
            self.regions, self.device.type, strategy, self.max_staging_bytes
        )
        self.strategy: Literal["direct", "gather"] = chosen
        #: ``auto`` gathering a block-outer layout: each call re-chooses from
        #: its number of direct copies (:func:`choose_strategy`).
        self._per_call = per_call
        staging_cap = self.max_staging_bytes
        if per_call:
            # The smaller cap the budget reserves for block-outer layouts.
            staging_cap = min(staging_cap, AUTO_GATHER_MAX_STAGING_BYTES)
        self._gather = PageGather(self._views, pool, self.device, staging_cap)
        if copy_thread and self._is_cuda:
            raise ValueError("copy_thread is for CPU engines; CUDA has copy streams")
        self._threads: dict[Direction, ThreadPoolExecutor] = (
            {
                d: ThreadPoolExecutor(1, thread_name_prefix=f"kvmem-host-{d}")
                for d in DIRECTIONS
            }
            if copy_thread
            else {}
        )
        self._units = self._views.layer_units() if copy_thread else []

    # -- public API ---------------------------------------------------------

    def save(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        slot_ids: Sequence[int] | torch.Tensor,
        after: Sequence[CopyJob] = (),
    ) -> CopyJob:
        """Copy device blocks ``block_ids[i]`` into host slots ``slot_ids[i]``.

        The copy starts after the compute stream's current position and after
        every job in ``after`` (device-side waits; the host is not blocked)."""
        blocks, slots = self._check(block_ids, slot_ids, "save")
        return self._submit("save", blocks, slots, after)

    def load(
        self,
        slot_ids: Sequence[int] | torch.Tensor,
        block_ids: Sequence[int] | torch.Tensor,
        after: Sequence[CopyJob] = (),
    ) -> CopyJob:
        """Copy host slots ``slot_ids[i]`` into device blocks ``block_ids[i]``,
        ordered like :meth:`save`."""
        blocks, slots = self._check(block_ids, slot_ids, "load")
        return self._submit("load", blocks, slots, after)

    def block_image(self, block_id: int) -> torch.Tensor:
        """A host copy of device block ``block_id`` laid out like a host slot
        (synchronous; for integrity checks and tests, not the data path)."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"block id {block_id} is out of range: the device KV cache has "
                f"{self.num_blocks} blocks"
            )
        return self._views.block_image(block_id)

    @property
    def copy_thread(self) -> bool:
        return bool(self._threads)

    def layer_unit_starts(self) -> list[int]:
        """Byte offset in the backing allocation of each layer unit's page of
        block 0, in the order a load on the copy thread finishes them (empty
        without a copy thread); ``CopyJob.wait_unit`` takes the position."""
        return [start for start, *_ in self._units]

    def slot_image(self, slot_id: int) -> torch.Tensor:
        """The bytes of host slot ``slot_id`` (a view of the pool)."""
        return self._views.pool[slot_id].view(torch.uint8)

    def close(self) -> None:
        """Wait for queued copies, then release the host pool; idempotent.

        The copy streams must be drained first: unpinning memory that a DMA
        still reads or writes is undefined behaviour.
        """
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.synchronize()
        for thread in self._threads.values():
            thread.shutdown(wait=True)
        # Drop the engine's own view too, or it would keep the bytes alive.
        self._views.release_pool()
        self.pool.release()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals ----------------------------------------------------------

    def _check(
        self,
        block_ids: Sequence[int] | torch.Tensor,
        slot_ids: Sequence[int] | torch.Tensor,
        direction: Direction,
    ) -> tuple[list[int], list[int]]:
        if self._closed:
            raise RuntimeError(
                f"this BlockCopyEngine is closed (its host pool is released); "
                f"cannot {direction}"
            )
        blocks = _id_list(block_ids, "block_ids")
        slots = _id_list(slot_ids, "slot_ids")
        if len(blocks) != len(slots):
            raise ValueError(
                f"block_ids has {len(blocks)} entries but slot_ids has {len(slots)}; "
                "they pair up one to one"
            )
        for name, ids, limit, what in (
            ("block", blocks, self.num_blocks, "the device KV cache has"),
            ("slot", slots, self.pool.num_slots, "the host pool has"),
        ):
            for pos, value in enumerate(ids):
                if not 0 <= value < limit:
                    raise ValueError(
                        f"{name} id {value} (position {pos}) is out of range: "
                        f"{what} {limit} {name}s (0..{limit - 1})"
                    )
        dest_name, dest = ("slot", slots) if direction == "save" else ("block", blocks)
        if len(set(dest)) != len(dest):
            seen: set[int] = set()
            for value in dest:
                if value in seen:
                    raise ValueError(
                        f"{dest_name} id {value} appears more than once; a "
                        f"{direction} writes each {dest_name} at most once"
                    )
                seen.add(value)
        return blocks, slots

    def _submit(
        self,
        direction: Direction,
        blocks: list[int],
        slots: list[int],
        after: Sequence[CopyJob] = (),
    ) -> CopyJob:
        n = len(blocks)
        if n == 0:
            return CopyJob(direction, 0, 0, 0)
        if self._threads and direction == "load":
            # Layer unit by layer unit, whatever the strategy.
            return self._on_thread(direction, blocks, slots, "layers", None, after)
        strategy, direct_runs = self._call_strategy(blocks, slots)

        def issue(keep: list[torch.Tensor]) -> int:
            if strategy == "direct":
                return self._issue_direct(direction, *direct_runs)
            return self._gather.issue(direction, blocks, slots, keep, self._copy)

        keep: list[torch.Tensor] = []
        if self._threads:
            return self._on_thread(direction, blocks, slots, strategy, issue, after)
        stream = self._streams.get(direction)
        if stream is None:
            # CPU: every earlier job is complete, so ``after`` holds already.
            try:
                num_ops = issue(keep)
            except Exception as exc:
                # What was copied before the failure is done: nothing to track.
                job = CopyJob(
                    direction,
                    n,
                    n * self.slot_bytes,
                    0,
                    failed=True,
                    strategy=strategy,
                )
                raise CopyError(direction, n, exc, job) from exc
            return CopyJob(
                direction, n, n * self.slot_bytes, num_ops, strategy=strategy
            )
        # Device-side ordering only: the copy stream starts where the compute
        # stream is now and after the jobs it depends on; the host is never
        # blocked.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for job in after:
            job.make_current_stream_wait(stream)
        with torch.cuda.stream(stream):
            try:
                num_ops = issue(keep)
            except Exception as exc:
                partial = self._track_partial(direction, n, stream, keep)
                if partial is not None:
                    partial.strategy = strategy
                raise CopyError(direction, n, exc, partial) from exc
            event = torch.cuda.Event()
            event.record(stream)
        return CopyJob(
            direction,
            n,
            n * self.slot_bytes,
            num_ops,
            event,
            self.device,
            keep,
            strategy=strategy,
        )

    def _call_strategy(
        self, blocks: list[int], slots: list[int]
    ) -> tuple[
        Literal["direct", "gather"], tuple[list[tuple[int, int]], list[tuple[int, int]]]
    ]:
        """The path of one call, and direct's ``(pairs, runs)`` when that is
        the path: under ``auto`` on a block-outer layout, a call that direct
        moves in few copies (consecutive blocks into consecutive slots) is
        cheaper as those copies than as one gather."""
        if self.strategy == "gather" and not self._per_call:
            return "gather", ([], [])
        pairs = sorted(zip(blocks, slots))
        sorted_slots = [s for _, s in pairs]
        runs = _slot_runs(
            self.pool, _runs([b for b, _ in pairs], sorted_slots), sorted_slots
        )
        if self.strategy == "direct":
            return "direct", (pairs, runs)
        copies = self._direct_copies(runs)
        chosen = choose_strategy(
            True,
            self.slot_bytes,
            self.device.type,
            copies,
            max_staging_bytes=self._gather.staging_cap,
        )
        return chosen, (pairs, runs)

    def _on_thread(
        self,
        direction: Direction,
        blocks: list[int],
        slots: list[int],
        strategy: str,
        issue: Callable[[list[torch.Tensor]], int] | None,
        after: Sequence[CopyJob],
    ) -> CopyJob:
        """Queue one job on its direction's copy thread, to start once the
        jobs in ``after`` (the other direction's) are done: ``issue``
        (saves), or a load unit by unit. A failure marks the job; the thread
        goes on with the next."""
        n = len(blocks)
        job = CopyJob(
            direction,
            n,
            n * self.slot_bytes,
            0,
            strategy=strategy,
            block_ids=tuple(blocks),
            _units=_UnitProgress() if issue is None else None,
        )

        def run() -> None:
            for job_before in after:
                job_before.wait()
            try:
                if issue is None and any(
                    j.failed and j.direction == "save" for j in after
                ):
                    # Its slots hold no complete copy: loading them would
                    # serve wrong KV; failing the load recomputes the blocks.
                    raise RuntimeError("a save into the slots it reads failed")
                # The copy thread does not inherit the engine's inference mode.
                with torch.inference_mode():
                    if issue is None:
                        job.num_ops = self._load_units(blocks, slots, job._units)
                    else:
                        job.num_ops = issue([])
            except BaseException as exc:  # noqa: BLE001 - reported by the job
                job.failed, job.error = True, exc
            finally:
                if job._units is not None:
                    job._units.finish()

        job.future = self._threads[direction].submit(run)
        return job

    def _load_units(
        self, blocks: list[int], slots: list[int], progress: _UnitProgress
    ) -> int:
        """Scatter host slots into device blocks one layer unit at a time: a
        plain copy per run of consecutive blocks and slots where the runs
        are few (memcpy speed), else one ``index_put_`` per unit (from the
        pool rows themselves when the slots run consecutively)."""
        pairs = sorted(zip(blocks, slots))
        runs = _runs([b for b, _ in pairs], [s for _, s in pairs])
        pool = self._views.pool
        num_ops = 0
        if len(runs) <= MAX_UNIT_RUNS:
            for _, view, host_offset, page in self._units:
                for start, count in runs:
                    block0, slot0 = pairs[start]
                    view[block0 : block0 + count].copy_(
                        pool[slot0 : slot0 + count, host_offset : host_offset + page]
                    )
                    num_ops += 1
                progress.advance()
            return num_ops
        by_slot = sorted(zip(slots, blocks))
        every = [s for s, _ in by_slot]
        block_index = torch.tensor([b for _, b in by_slot], dtype=torch.int64)
        one_run = len(_runs(every)) == 1
        slot_index = None if one_run else torch.tensor(every, dtype=torch.int64)
        for _, view, host_offset, page in self._units:
            columns = pool[:, host_offset : host_offset + page]
            if slot_index is None:
                rows = columns[every[0] : every[0] + len(every)]
            else:
                rows = torch.index_select(columns, 0, slot_index)
                num_ops += 1
            view.index_put_((block_index,), rows)
            num_ops += 1
            progress.advance()
        return num_ops

    def _direct_copies(self, runs: list[tuple[int, int]]) -> int:
        """Copies :meth:`_issue_direct` issues for ``runs``."""
        slot = self._views.slot
        whole = [span.block_stride == span.length == slot for span in self._views.spans]
        return sum(
            1 if count == 1 or contiguous else count
            for _, count in runs
            for contiguous in whole
        )

    def _track_partial(
        self,
        direction: Direction,
        n: int,
        stream: torch.cuda.Stream,
        keep: list[torch.Tensor],
    ) -> CopyJob | None:
        """A job for the copies a failed submission had already queued: they
        still run, so whoever reuses their blocks or slots must wait for them.
        None when not even an event can be recorded (the device is lost)."""
        try:
            event = torch.cuda.Event()
            event.record(stream)
        except Exception:
            logger.debug("recording an event after a failed copy failed", exc_info=True)
            return None
        return CopyJob(
            direction, n, n * self.slot_bytes, 0, event, self.device, keep, failed=True
        )

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self._is_cuda)

    def _issue_direct(
        self,
        direction: Direction,
        pairs: list[tuple[int, int]],
        runs: list[tuple[int, int]],
    ) -> int:
        """One copy per run of consecutive (block, slot) pairs per span;
        ``pairs`` sorted by block, ``runs`` as positions in ``pairs``."""
        spans, host_pool = self._views.spans, self._views.pool
        num_ops = 0
        for start, count in runs:
            block0, slot0 = pairs[start]
            for span in spans:
                dev = span.rows(block0, count)
                host = host_pool[
                    slot0 : slot0 + count,
                    span.host_offset : span.host_offset + span.length,
                ]
                if dev.is_contiguous() and host.is_contiguous():
                    pieces = [(dev, host)]
                else:
                    # Padded blocks or several spans: keep every copy a plain
                    # memcpy (a strided host target would make torch stage it
                    # through pageable memory and block).
                    pieces = [(dev[i], host[i]) for i in range(count)]
                for d, h in pieces:
                    if direction == "save":
                        self._copy(h, d)
                    else:
                        self._copy(d, h)
                    num_ops += 1
        return num_ops


__all__ = ["BlockCopyEngine", "CopyError", "CopyJob"]
