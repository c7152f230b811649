"""Token budgets: ``--kv-cache-tokens`` sizes the KV cache in tokens.

Every rank gets exactly the blocks that many tokens need, as vLLM counts
capacity, beside vLLM's null block (so every token asked for is usable),
from the KV specs its workers report; with pipeline parallelism
each stage's bytes follow its own KV bytes per block.

* API server: :func:`check_budget_flags` refuses a token budget next to a byte
  budget, and :func:`set_tokens_placeholder` stands in for the token budget's
  bytes until the engine core sees the KV specs.
* Engine core: :func:`token_budget_memory` turns the tokens into each rank's
  blocks and bytes, checked against each rank's device and one
  max_model_len sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from vllm.logger import init_logger

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget.device_limits import limits_for
from vllm_kvmem.budget.pp_prop import BUDGET_FLAG
from vllm_kvmem.budget.token_blocks import blocks_for_tokens
from vllm_kvmem.config import KVMemConfig
from vllm_kvmem.core.units import mib

logger = init_logger("vllm.kvmem.token_budget")

TOKENS_FLAG = KVMemConfig.flag("kv_cache_tokens")

# A token budget has no byte figure until the engine sees the KV specs. Until
# then vLLM's explicit-budget path runs with this placeholder (no profiling, and
# the CPU worker's startup memory check is skipped); our patches replace it.
TOKENS_PLACEHOLDER_BYTES = 1


def check_budget_flags(vllm_config: Any) -> None:
    """A token budget and a byte budget cannot both size the cache; changes
    nothing."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    if cfg.kv_cache_tokens is not None and budget not in (
        None,
        TOKENS_PLACEHOLDER_BYTES,
    ):
        raise ValueError(
            f"{TOKENS_FLAG} {cfg.kv_cache_tokens:,} and {BUDGET_FLAG} "
            f"{budget:,} both size the KV cache; give one of them (on CPU, "
            f"VLLM_CPU_KVCACHE_SPACE also sets {BUDGET_FLAG})."
        )


def set_tokens_placeholder(vllm_config: Any) -> None:
    """With a token budget, set vLLM's byte budget to the placeholder (changes
    ``vllm_config``): vLLM then skips profiling and the engine sizes the cache."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    if cfg.kv_cache_tokens is not None:
        vllm_config.cache_config.kv_cache_memory_bytes = TOKENS_PLACEHOLDER_BYTES


def token_budget_memory(
    vllm_config: Any,
    kv_cache_specs: list[dict[str, Any]],
    limits: list[int],
    tokens: int,
) -> tuple[int, list[int]]:
    """Every rank gets exactly the blocks ``tokens`` need, from its own specs:
    ``(blocks, bytes per rank)``."""
    groups = va.worker_groups(vllm_config, kv_cache_specs)
    # All ranks share one block table, so one block count; the largest count any
    # rank's groups need (they agree unless a stage lacks a group) wins.
    blocks = max(
        blocks_for_tokens(tokens, partial(va.tokens_in, vllm_config, g))
        for g in groups
        if g
    )
    if vllm_config.model_config.original_max_model_len != -1:
        _check_holds_a_sequence(vllm_config, groups, blocks, tokens)
    bpb = [va.bytes_per_block(vllm_config, g) if g else 0 for g in groups]
    memory = [blocks * b for b in bpb]
    described = limits_for(vllm_config, limits)
    for rank, (need, limit) in enumerate(zip(memory, limits)):
        if need > limit:
            # The null block is one of the blocks that fit.
            fit = va.tokens_in(vllm_config, groups[rank], limit // bpb[rank] - 1)
            raise ValueError(
                f"{TOKENS_FLAG} {tokens:,}: rank {rank} needs {blocks:,} blocks = "
                f"{mib(need)} of KV cache, more than its device can hold "
                f"({described[rank].describe()}). Use "
                f"{TOKENS_FLAG} {fit:,} or less."
            )
    logger.info(
        "%s %s: %d blocks on every rank, %s.",
        TOKENS_FLAG,
        f"{tokens:,}",
        blocks,
        ", ".join(f"rank {r} {mib(m)}" for r, m in enumerate(memory)),
    )
    return blocks, memory


def _check_holds_a_sequence(
    vllm_config: Any, groups: Sequence[Any], blocks: int, tokens: int
) -> None:
    """vLLM refuses a cache that cannot hold one max_model_len request next to
    its null block; say so in tokens, with the smallest budget that works."""
    need = max(
        va.sequence_bytes(vllm_config, g) // va.bytes_per_block(vllm_config, g) + 1
        for g in groups
        if g
    )
    if blocks >= need:
        return
    # The least budget that buys need blocks: one token more than need - 2 hold.
    least = max(va.tokens_in(vllm_config, g, need - 2) for g in groups if g) + 1
    max_len = vllm_config.model_config.max_model_len
    raise ValueError(
        f"{TOKENS_FLAG} {tokens:,} cannot hold one {max_len:,}-token sequence "
        f"(max_model_len) next to vLLM's null block: that needs {need:,} blocks. "
        f"Use {TOKENS_FLAG} {least:,} or more, or lower --max-model-len."
    )
