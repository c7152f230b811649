"""KV-cache arithmetic over ints: the one home of per-layer bytes, the blocks a
token budget buys and the pipeline split.

vLLM-free, like the rest of ``core``: the planner (``kvmem plan``), the
engine's budget and the in-tree series (which reproduces
:func:`split_kv_budget` verbatim; ``tests/test_intree.py`` holds them equal)
compute the same figures from the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_kvmem.core.units import cdiv

# ---------------------------------------------------------- per-layer bytes


def layer_bytes_per_token(
    kv_heads: int, head_size: int, head_size_v: int, dtype_bytes: int
) -> int:
    """K and V bytes one token costs in one layer on one rank, for ``kv_heads``
    heads of that rank (``AttentionSpec.page_size_bytes`` per token)."""
    return kv_heads * (head_size + head_size_v) * dtype_bytes


def layer_page_bytes(bytes_per_token: int, block_size: int) -> int:
    """One block of one layer (``AttentionSpec.page_size_bytes``)."""
    return bytes_per_token * block_size


# ---------------------------------------------------------- token budgets


def blocks_for_tokens(
    tokens: int, capacity: Callable[[int], int], *, guess: int = 1
) -> int:
    """Blocks a ``--kv-cache-tokens`` budget buys: vLLM's null block plus the
    fewest blocks whose capacity, as vLLM counts it (``capacity(blocks)``,
    never falling as blocks grow), is at least ``tokens``. So the tokens
    asked for are all usable: the scheduler never hands out the null block.

    The planner passes ``kv_math.vllm_capacity`` and a close ``guess``; the
    engine passes vLLM's own capacity over its KV cache groups.
    """
    if tokens <= 0:
        raise ValueError(f"--kv-cache-tokens={tokens}: must be positive, e.g. 400000")
    lo, hi = 1, max(1, guess)
    while capacity(hi) < tokens:
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if capacity(mid) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return hi + 1


# ------------------------------------------------------- the pipeline split


def split_kv_budget(budget: int, stage_bytes_per_block: Sequence[int]) -> list[int]:
    """Each pipeline stage's share of one pipeline-wide KV budget.

    Every stage holds the same number of blocks, ``budget // sum(bytes per
    block)``, since a block id addresses one block on every stage; a stage's
    share is that many of its own blocks, so the shares never exceed the
    budget and each is a whole number of blocks.
    """
    num_blocks = budget // sum(stage_bytes_per_block)
    return [num_blocks * b for b in stage_bytes_per_block]


@dataclass(frozen=True)
class StageShare:
    """What one stage (one pipeline rank) is given."""

    stage: int
    bytes_per_block: int
    share_bytes: int

    @property
    def num_blocks(self) -> int:
        return self.share_bytes // self.bytes_per_block


def split_budget(total_bytes: int, bytes_per_block: Sequence[int]) -> list[StageShare]:
    """:func:`split_kv_budget` of a budget that must be positive, over stages
    that must each hold KV cache, stage by stage."""
    if total_bytes <= 0:
        raise ValueError(f"total KV budget must be positive, got {total_bytes}")
    if not bytes_per_block or any(b <= 0 for b in bytes_per_block):
        raise ValueError(
            f"every stage needs a positive bytes-per-block, got {list(bytes_per_block)}"
        )
    shares = split_kv_budget(total_bytes, bytes_per_block)
    return [
        StageShare(stage=i, bytes_per_block=b, share_bytes=share)
        for i, (b, share) in enumerate(zip(bytes_per_block, shares))
    ]


def min_budget_for(needed_bytes: Sequence[int], bytes_per_block: Sequence[int]) -> int:
    """Smallest pipeline-wide budget whose :func:`split_kv_budget` share covers
    every stage's need: the most blocks any stage needs, of every stage."""
    return max(cdiv(n, b) for n, b in zip(needed_bytes, bytes_per_block)) * sum(
        bytes_per_block
    )


def max_budget_for(limits: Sequence[int], bytes_per_block: Sequence[int]) -> int:
    """Largest pipeline-wide budget whose :func:`split_kv_budget` share fits
    every stage's device: one byte short of one block more than the tightest
    stage holds."""
    blocks = min(limit // b for limit, b in zip(limits, bytes_per_block))
    return (blocks + 1) * sum(bytes_per_block) - 1


def uniform_blocks(total_bytes: int, bytes_per_block: Sequence[int]) -> int:
    """Blocks per stage when every stage gets the whole budget (vLLM's default).

    Since vLLM PR #25164 every stage is cut to the smallest block count, which
    is set by the stage with the most bytes per block.
    """
    return total_bytes // max(bytes_per_block)
