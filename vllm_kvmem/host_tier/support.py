"""Which KV cache configs the host tier serves, and what a host hit must
restore of each of vLLM's KV cache groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvmem.host_tier.kv_region import config_slot_bytes


@dataclass(frozen=True)
class GroupWindow:
    """What a prefix hit needs of one KV cache group: every block of the
    prefix (full attention, ``window`` None), or only the blocks the next
    token still attends to (sliding window)."""

    group_id: int
    window: int | None = None
    extra_retained: int = 0  # tokens kept below the window (vLLM's MTP margin)

    def first_needed(self, end_block: int, block_size: int) -> int:
        """The first block a hit ending before block ``end_block`` needs:
        vLLM nulls the blocks before it (``get_num_skipped_tokens`` of the
        group's manager, on the hit's tokens)."""
        if self.window is None:
            return 0
        skipped = end_block * block_size - self.window + 1 - self.extra_retained
        return max(0, skipped) // block_size


def describe_groups(groups: tuple[GroupWindow, ...]) -> str:
    """``1 KV cache group (full attention)``, ``4 KV cache groups (1 full
    attention, 3 sliding window of 256 tokens)``: what a hit restores."""
    kinds: dict[str, int] = {}
    for g in groups:
        kind = "full attention"
        if g.window is not None:
            kind = f"sliding window of {g.window} tokens"
        kinds[kind] = kinds.get(kind, 0) + 1
    if len(groups) == 1:
        return f"1 KV cache group ({next(iter(kinds))})"
    parts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    return f"{len(groups)} KV cache groups ({parts})"


def unsupported_reason(kv_cache_config: Any) -> str:
    """Why the tier cannot serve this model/backend; empty when it can.

    Served: KV cache groups of full attention and of sliding-window
    attention (vLLM's hybrid KV cache manager keeps one group per kind and
    window), with one block size."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return "the model has no KV cache"
    served = (FullAttentionSpec, SlidingWindowSpec)
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, MLAAttentionSpec):
            return "the model uses MLA"
        if type(spec) not in served:
            return (
                f"its layers use {type(spec).__name__}; it serves full-attention "
                "and sliding-window KV cache groups only"
            )
        if getattr(g, "is_eagle_group", False):
            return "a speculative decoding draft model has its own KV cache group"
    sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    if len(sizes) > 1:
        return f"its KV cache groups have different block sizes ({sizes})"
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        return "vLLM zeroes new blocks of this model before connectors run"
    hash_bs = kv_cache_config.hash_block_size
    if hash_bs not in (None, sizes[0]):
        return f"prefix hashes cover {hash_bs} tokens, blocks {sizes[0]}"
    try:
        config_slot_bytes(kv_cache_config)
    except ValueError as exc:
        return str(exc)
    return ""


def hit_groups(kv_cache_config: Any) -> tuple[GroupWindow, ...]:
    """What a host hit restores of each of vLLM's KV cache groups (a model
    :func:`unsupported_reason` accepts)."""
    return tuple(
        GroupWindow(
            i,
            getattr(g.kv_cache_spec, "sliding_window", None),
            getattr(g.kv_cache_spec, "extra_retained_tokens", 0),
        )
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )
