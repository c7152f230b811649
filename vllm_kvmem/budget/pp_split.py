"""Pipeline-proportional KV budget arithmetic.

One pipeline-wide budget ``T`` is split so that stage ``s`` receives
``T * bytes_per_block[s] / sum(bytes_per_block)``. Every stage then holds the
same number of blocks (``T // sum(bytes_per_block)``), which is what the
scheduler needs, since a block id addresses one block on every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvmem.core.units import cdiv


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
    """Split ``total_bytes`` across stages in proportion to bytes per block.

    Integer arithmetic throughout, so that ``share // bytes_per_block`` is the
    same block count ``total_bytes // sum(bytes_per_block)`` on every stage and
    the sum of the shares never exceeds ``total_bytes``.
    """
    if total_bytes <= 0:
        raise ValueError(f"total KV budget must be positive, got {total_bytes}")
    if not bytes_per_block or any(b <= 0 for b in bytes_per_block):
        raise ValueError(
            f"every stage needs a positive bytes-per-block, got {list(bytes_per_block)}"
        )
    total_bpb = sum(bytes_per_block)
    return [
        StageShare(stage=i, bytes_per_block=b, share_bytes=total_bytes * b // total_bpb)
        for i, b in enumerate(bytes_per_block)
    ]


def min_budget_for(needed_bytes: Sequence[int], bytes_per_block: Sequence[int]) -> int:
    """Smallest pipeline-wide budget whose share covers every stage's need."""
    total_bpb = sum(bytes_per_block)
    return max(
        cdiv(need * total_bpb, b) for need, b in zip(needed_bytes, bytes_per_block)
    )


def max_budget_for(limits: Sequence[int], bytes_per_block: Sequence[int]) -> int:
    """Largest pipeline-wide budget whose share fits every stage's device."""
    total_bpb = sum(bytes_per_block)
    # floor(T * b / S) <= limit  <=>  T < (limit + 1) * S / b
    return min(
        cdiv((limit + 1) * total_bpb, b) - 1
        for limit, b in zip(limits, bytes_per_block)
    )


def uniform_blocks(total_bytes: int, bytes_per_block: Sequence[int]) -> int:
    """Blocks per stage when every stage gets the whole budget (vLLM's default).

    Since vLLM PR #25164 every stage is cut to the smallest block count, which
    is set by the stage with the most bytes per block.
    """
    return total_bytes // max(bytes_per_block)
