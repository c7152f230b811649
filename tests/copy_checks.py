"""Block-run cases and the round-trip check the copy-engine tests share.

vLLM-free, so that ``tests/test_copy_engine_cuda.py`` (run on the GPU machine
before vLLM is there) and ``tests/test_copy_engine.py`` (on vLLM's own caches)
copy the same patterns and check them the same way. A cache here is anything
with ``base`` (the backing allocation), ``regions`` (its ``KVRegion``s) and
``block_bytes(block)`` (every layer's page of a block, on the host).
"""

from __future__ import annotations

from typing import Any

import torch

CASES = {
    # name: (src blocks, host slots, destination blocks)
    "unsorted": (
        [7, 2, 11, 3, 4, 5, 20],
        [5, 0, 9, 1, 2, 3, 6],
        [0, 13, 1, 14, 15, 16, 22],
    ),
    "partial_last_run": ([8, 9, 10, 11, 12], [0, 1, 2, 3, 7], [17, 18, 19, 20, 2]),
    "single_block": ([23], [31], [0]),
    "reversed_run": ([6, 5, 4, 3], [3, 2, 1, 0], [10, 11, 12, 13]),
    "scattered": ([1, 21, 9, 15], [30, 3, 17, 8], [5, 6, 7, 8]),
}


def random_bytes(n: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """``n`` reproducible random bytes on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def block_mask(cache: Any, blocks: list[int]) -> torch.Tensor:
    """Bytes of the backing allocation that belong to ``blocks``."""
    mask = torch.zeros(cache.base.numel(), dtype=torch.bool)
    for r in cache.regions:
        for b in blocks:
            for layer in range(r.num_layers):
                start = r.offset + layer * r.layer_stride + b * r.block_stride
                mask[start : start + r.page_bytes] = True
    return mask


def round_trip(
    cache: Any,
    engine: Any,
    src_blocks: list[int],
    slots: list[int],
    dst_blocks: list[int],
) -> None:
    """Save, scribble, load into other blocks; compare byte for byte, and
    check that no byte outside the destination blocks changed."""
    base = cache.base
    base.copy_(random_bytes(base.numel(), 1, base.device))
    expected = {b: cache.block_bytes(b) for b in src_blocks}
    save = engine.save(src_blocks, slots)
    save.wait()
    assert save.done()
    for b, s in zip(src_blocks, slots):
        assert torch.equal(engine.pool.slot(s), expected[b]), (b, s)
    base.copy_(random_bytes(base.numel(), 2, base.device))  # scribble
    before = base.cpu().clone()
    load = engine.load(slots, dst_blocks)
    load.make_current_stream_wait()
    load.wait()
    for b, d in zip(src_blocks, dst_blocks):
        assert torch.equal(cache.block_bytes(d), expected[b]), (b, d)
    untouched = ~block_mask(cache, dst_blocks)
    assert torch.equal(base.cpu()[untouched], before[untouched])
