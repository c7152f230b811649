"""vLLM 0.33's extension point for vllm-kvmem's KV budgets: a config builder.

vLLM 0.33 plans the KV cache in a Core-owned flow
(``kv_cache_planning.get_kv_cache_configs``) and asks a
``KVCacheConfigBuilder``, chosen by the platform, for the layer groups and
for each worker's config at a block count: every worker gets
``device limit // bytes per block`` blocks, then all get the smallest count.

A pipeline-wide budget (``--enable-pp-prop-kv-cache``) and a token budget
(``--kv-cache-tokens``) change one number in that flow, the block count.
Workers report their device limit, the engine core plans the count with the
same code and errors as on vLLM 0.32 (``kv_budget.stash_plan``), and
:class:`KVMemKVCacheConfigBuilder` builds each config for that count through
the platform's own builder, which stays the one source of groups, bytes per
block and tensors. Outside a budget mode the platform's builder is used as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvmem import vllm_adapter as va
from vllm_kvmem.budget.kv_budget import planned_blocks, uses_device_limits
from vllm_kvmem.budget.pp_prop import BUDGET_FLAG
from vllm_kvmem.budget.token_budget import TOKENS_FLAG

try:
    from vllm.v1.core.kv_cache_config_builder import (
        KVCacheConfigBuilder as _BuilderBase,
    )
except ImportError:  # vLLM 0.32 has no builder interface and never selects one
    _BuilderBase = object  # type: ignore[assignment,misc]

#: What the patched platform hook names while a budget mode is on.
QUALNAME = "vllm_kvmem.budget.kv_builder.KVMemKVCacheConfigBuilder"


def select_builder(original: Callable[..., str], cls: Any, vllm_config: Any) -> str:
    """The platform hook (``Platform.get_kv_cache_config_builder_cls``) with
    vllm-kvmem: its builder while a budget mode sizes the cache, else the
    platform's own choice, unchanged."""
    chosen = original(cls, vllm_config)
    return QUALNAME if uses_device_limits(vllm_config) else chosen


def check_selected(vllm_config: Any) -> None:
    """Refuse a budget mode where the platform picks its builder itself (an
    out-of-tree platform overriding the hook): the budget could not apply."""
    from vllm.platforms import current_platform

    chosen = current_platform.get_kv_cache_config_builder_cls(vllm_config)
    if chosen != QUALNAME:
        raise ValueError(
            f"{TOKENS_FLAG} and {BUDGET_FLAG} with --enable-pp-prop-kv-cache need "
            f"vllm-kvmem's KV cache config builder, but the "
            f"{type(current_platform).__name__} platform selects its own "
            f"({chosen}); drop the vllm-kvmem budget flags on this platform."
        )


class KVMemKVCacheConfigBuilder(_BuilderBase):
    """The platform's builder, with the block count of vllm-kvmem's plan.

    Stateless, like every builder: each call resolves the platform's builder
    for its config (``vllm_adapter.platform_builder``), and the plan lives in
    the engine core's config only while vLLM plans.
    """

    def get_kv_cache_groups(self, vllm_config: Any, kv_cache_spec: dict) -> list:
        inner = va.platform_builder(vllm_config)
        return inner.get_kv_cache_groups(vllm_config, kv_cache_spec)

    def get_kv_cache_config_from_groups(
        self, vllm_config: Any, kv_cache_groups: list, num_blocks: int
    ) -> Any:
        inner = va.platform_builder(vllm_config)
        blocks = planned_blocks(vllm_config, num_blocks)
        return inner.get_kv_cache_config_from_groups(
            vllm_config, kv_cache_groups, blocks
        )

    def _get_pool_bytes_per_block(
        self, vllm_config: Any, kv_cache_groups: list
    ) -> int | None:
        # The platform builder's figure, measured as vLLM measures it, so that
        # vLLM never probes through this builder (a probe is not a plan).
        return va.bytes_per_block(vllm_config, kv_cache_groups)
