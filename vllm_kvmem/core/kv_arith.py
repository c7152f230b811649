"""KV-cache arithmetic over ints: the one home of the pipeline split.

vLLM-free, like the rest of ``core``: the planner (``kvmem plan``), the
engine's budget and the in-tree series (which reproduces
:func:`split_kv_budget` verbatim; ``tests/test_intree.py`` holds them equal)
compute the same figures from the same code.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_kv_budget(budget: int, stage_bytes_per_block: Sequence[int]) -> list[int]:
    """Each pipeline stage's share of one pipeline-wide KV budget.

    Every stage holds the same number of blocks, ``budget // sum(bytes per
    block)``, since a block id addresses one block on every stage; a stage's
    share is that many of its own blocks, so the shares never exceed the
    budget and each is a whole number of blocks.
    """
    num_blocks = budget // sum(stage_bytes_per_block)
    return [num_blocks * b for b in stage_bytes_per_block]
