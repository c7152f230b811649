"""The blocks a ``--kv-cache-tokens`` budget buys, over ints only.

vLLM-free, like ``pp_split``, so that ``kvmem plan`` predicts the token
budget with the engine's own search.
"""

from __future__ import annotations

from collections.abc import Callable


def blocks_for_tokens(
    tokens: int, capacity: Callable[[int], int], *, guess: int = 1
) -> int:
    """Blocks a ``--kv-cache-tokens`` budget buys: vLLM's null block plus the
    fewest blocks whose capacity, as vLLM counts it (``capacity(blocks)``,
    never falling as blocks grow), is at least ``tokens``. So the tokens
    asked for are all usable: the scheduler never hands out the null block.

    The planner passes ``kv_math.vllm_capacity`` and a close ``guess``; the engine
    passes vLLM's own ``get_kv_cache_capacity`` over its KV cache groups.
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
