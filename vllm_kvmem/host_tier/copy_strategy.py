"""Which copy strategy the block copy engine uses (``copy_engine``), and the
staging it may hold: ``direct`` (one copy per run of consecutive blocks and
slots) or ``gather`` (one gather per region into a staging buffer, then one
copy per run of slots), and what ``strategy="auto"`` picks, from the first GPU
measurements.

Pure arithmetic over the KV regions' geometry (no torch), so the choice tests
on CPU for a CUDA device, and a KV budget can reserve the staging it implies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from vllm_kvmem.host_tier.kv_region import KVRegion, host_slot_bytes

Direction = Literal["save", "load"]
Strategy = Literal["auto", "direct", "gather"]

#: Default cap on the device staging buffer of the gather strategy. A transfer
#: of more blocks than fit is done in chunks, so a large save cannot claim a
#: large slice of device memory that the KV cache itself was sized to fill.
DEFAULT_MAX_STAGING_BYTES = 256 * 1024**2

#: The engine's copy streams, one per direction; each may hold a staging buffer.
DIRECTIONS: tuple[Direction, ...] = ("save", "load")
COPY_STREAMS = len(DIRECTIONS)

KiB = 1024
MiB = 1024**2

#: Block size (bytes of one block over all layers of one TP shard: one host
#: slot) below which, on CUDA, batching a call's blocks (``gather``) beats
#: one copy per block (``direct``) on block-outer layouts.
#:
#: Source: ``transfer_h200.json`` of the first GPU run (GPU, NVIDIA H200,
#: 2026-11-26, torch 2.11, pinned host pool; ``benchmarks/transfer_bench.py``),
#: 32 scattered blocks per transfer, BLHNC moved with ``direct`` (32 copies)
#: against ``gather`` (2 operations), GB/s d2h / h2d:
#:
#:   block      direct           gather           gather / direct
#:   64 KiB      5.65 /  5.72    13.23 / 13.80    2.34x / 2.41x
#:   128 KiB    11.62 / 11.86    18.83 / 21.99    1.62x / 1.85x
#:   256 KiB    24.79 / 23.26    28.16 / 29.81    1.14x / 1.28x
#:   512 KiB    37.86 / 32.56    39.40 / 39.63    1.04x / 1.22x
#:   1 MiB      43.58 / 42.96    44.56 / 45.11    1.02x / 1.05x
#:   2 MiB      48.16 / 47.79    47.63 / 47.68    0.99x / 1.00x
#:   4 MiB      51.36 / 50.94    49.88 / 49.96    0.97x / 0.98x
#:   8 MiB      53.01 / 53.00    49.17 / 50.04    0.93x / 0.94x
#:
#: (16 and 32 MiB: direct ahead by 1-6% too.) Where the blocks are
#: consecutive, ``direct`` is one copy per run and wins at every size (64
#: KiB: 20.90 / 20.40 against 13.32 / 14.43 GB/s; 1 MiB: 50.03 / 49.90
#: against 45.09 / 45.41). Not known: anything between 1 and 2 MiB (the two
#: points also come from different shapes, 8 and 32 layers), other GPUs (no
#: H100, no PCIe Gen4 host), other transfer lengths than 32 blocks.
BATCH_BELOW_BLOCK_BYTES = 2 * MiB

#: Fewest direct copies a call must need before gathering it pays off, at
#: 64 KiB blocks, and how many more per doubling of the block size (see
#: :func:`gather_min_copies`). Same H200 run, 64 KiB-1 MiB blocks: a
#: gather of 32 blocks takes 49-90 us longer than one direct copy of 32
#: consecutive blocks; each further direct copy costs 8.5-8.7 us at 64 KiB,
#: 6.9-7.4 at 128 KiB, 3.7-4.3 at 256 KiB, 2.6-4.8 at 512 KiB, 3.2-3.5 at
#: 1 MiB (from the 1-copy and 32-copy transfers). Break-even: 6.8-7.7 copies at 64 KiB,
#: 8.5-13 at 128 KiB, 13-21 at 256 KiB, 13-25 at 512 KiB, 21-27 at 1 MiB.
#: Only 1 and 32 copies were measured: the break-even assumes the cost grows
#: linearly between them, and the formula is a line in log2(block size)
#: through those break-evens. Unverified on a GPU.
GATHER_MIN_COPIES_AT_64K = 8
GATHER_MIN_COPIES_PER_DOUBLING = 4

#: Cap on the device staging buffer when ``auto`` gathers on a block-outer
#: layout, per copy stream; a KV budget reserves it on such layouts (2 x 32
#: MiB, a smaller figure than a layer-outer layout's full gather). It holds
#: :func:`gather_min_copies` blocks of up to about 1.2 MiB; larger blocks
#: stay direct (the gain measured at 1 MiB is 2-5%).
AUTO_GATHER_MAX_STAGING_BYTES = 32 * MiB


def staging_reserve(max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES) -> int:
    """Device bytes the gather strategy's staging can hold at once: up to the
    cap on each copy stream. PyTorch's caching allocator keeps a pool per
    stream, so a buffer freed on the save stream is not reused by the load
    stream, and both stay reserved."""
    return COPY_STREAMS * max_staging_bytes


def gather_min_copies(block_bytes: int) -> int:
    """Fewest direct copies for which one gather of the same blocks is
    faster on CUDA: ``8 + 4 * log2(block_bytes / 64 KiB)``, at least 8.

    Each direct copy costs a fixed few microseconds, the gather a larger
    fixed cost (index upload, kernel, the copy after it); the larger the
    block, the more of a direct copy's cost is bandwidth the gather pays too.
    """
    doublings = max(0.0, math.log2(max(block_bytes, 1) / (64 * KiB)))
    return math.ceil(
        GATHER_MIN_COPIES_AT_64K + GATHER_MIN_COPIES_PER_DOUBLING * doublings
    )


def choose_strategy(
    layout_allows_direct: bool,
    block_bytes: int,
    device_type: str,
    direct_copies: int | None = None,
    *,
    max_staging_bytes: int = AUTO_GATHER_MAX_STAGING_BYTES,
) -> Literal["direct", "gather"]:
    """What ``strategy="auto"`` does (pure, so it tests without a GPU).

    ``block_bytes``: one block over all regions (a host slot);
    ``device_type``: ``torch.device.type`` of the KV cache;
    ``direct_copies``: for one call, the copies ``direct`` would issue (one
    per run of consecutive blocks and slots); None asks for the engine's
    default, the choice for a call of many scattered blocks;
    ``max_staging_bytes``: the staging cap of one gather chunk.

    Layer-outer layouts can only gather. Off CUDA the copies are memcpys
    inside the step and ``direct`` stays, as before the GPU run (on the CPU
    run of 2026-11-21 the gather wins small scattered saves and loses the
    loads: no clear winner). On CUDA every copy costs a fixed few microseconds,
    so blocks below :data:`BATCH_BELOW_BLOCK_BYTES` are gathered, unless the
    call needs fewer than :func:`gather_min_copies` direct copies (a run of
    consecutive blocks is one copy), or a staging chunk holds fewer blocks
    than that.
    """
    if not layout_allows_direct:
        return "gather"
    if device_type != "cuda" or block_bytes >= BATCH_BELOW_BLOCK_BYTES:
        return "direct"
    need = gather_min_copies(block_bytes)
    if max_staging_bytes // max(block_bytes, 1) < need:
        return "direct"
    if direct_copies is not None and direct_copies < need:
        return "direct"
    return "gather"


def plan_strategy(
    regions: Sequence[KVRegion],
    device_type: str,
    strategy: Strategy = "auto",
    max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
) -> tuple[Literal["direct", "gather"], bool]:
    """The engine's strategy for ``regions`` on a ``device_type`` device, and
    whether each call re-chooses (``auto`` gathering a block-outer layout:
    calls with few direct copies still go direct).

    Takes the regions and a declared device type rather than an engine, so
    the choice tests on CPU regions for a CUDA device."""
    direct_ok = all(r.layers_adjacent for r in regions)
    if strategy == "auto":
        cap = min(max_staging_bytes, AUTO_GATHER_MAX_STAGING_BYTES)
        chosen = choose_strategy(
            direct_ok,
            host_slot_bytes(regions),
            device_type,
            max_staging_bytes=cap,
        )
        return chosen, direct_ok and chosen == "gather"
    if strategy == "direct" and not direct_ok:
        raise ValueError(
            "strategy 'direct' needs every region to keep the layers of a block "
            "adjacent (layer_stride == page_bytes); use 'gather'"
        )
    if strategy not in ("direct", "gather"):
        raise ValueError(f"unknown strategy {strategy!r}: use auto, direct, gather")
    return strategy, False
