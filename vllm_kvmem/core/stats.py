"""Fixed pseudo-random numbers and percentiles, one of each.

vLLM-free like the rest of ``core``. The generator is hand-rolled rather than
``random`` so that the tiny model's tokenizer corpus and the benchmarks'
documents are the same text on every Python version.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

_MASK = (1 << 64) - 1


def lcg(state: int) -> Iterator[int]:
    """31-bit numbers from Knuth's 64-bit MMIX linear congruential generator,
    starting after ``state``."""
    state &= _MASK
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) & _MASK
        yield state >> 33


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
