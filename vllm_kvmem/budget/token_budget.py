"""Token budgets: ``--kv-cache-tokens`` sizes the KV cache in tokens.

Every rank gets exactly the blocks that many tokens need, as vLLM counts
capacity, beside vLLM's null block (so every token asked for is usable),
from the KV specs its workers report; with pipeline parallelism
each stage's bytes follow its own KV bytes per block. The engine core plans
those blocks (``kv_budget.plan_kv_budget``, the search in
``core.kv_arith``); here is what the API server does:
:func:`check_budget_flags` refuses a token budget next to a byte budget, and
:func:`set_tokens_placeholder` stands in for the token budget's bytes until
the engine core sees the KV specs.
"""

from __future__ import annotations

from typing import Any

from vllm_kvmem.budget.pp_prop import BUDGET_FLAG
from vllm_kvmem.config import KVMemConfig

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
