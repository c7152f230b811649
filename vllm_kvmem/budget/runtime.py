"""The budget's run-time facts, one typed record in the engine core's config.

Two facts exist only once the engine is up, after vLLM built its
``VllmConfig``: every worker's device limit, collected by the engine core
(``device_limits.collect_from_workers``), and on vLLM 0.33 the plan that
vllm-kvmem's builder applies while vLLM plans (``kv_budget.stash_plan``).
:class:`BudgetRuntime` carries both in the engine core's own config, under
``additional_config[KEY]`` as plain JSON (vLLM hashes that dict), so every
hook that receives the config reads the same record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_kvmem.config import BudgetMode
from vllm_kvmem.core.units import mib

#: Where the record lives in ``VllmConfig.additional_config``.
KEY = "kvmem_budget"


@dataclass(frozen=True)
class DeviceLimit:
    """One worker's KV limit and what it is made of (bytes)."""

    free: int
    """Free device memory after the profile run (CPU: the NUMA node's available
    memory)."""
    mm_reserved: int = 0
    """vLLM's reservation for frontend multimodal GPU work."""
    cuda_graphs: int = 0
    """vLLM's estimate of the CUDA graph memory captured after the KV cache."""
    staging: int = 0
    """The host tier copy engine's staging buffers: its cap per copy stream."""
    pp_buffers: int = 0
    """The pipeline receive buffers of a stage after the first."""
    headroom: int = 0
    """Kept free on GPUs, as vLLM's own budget suggestion does."""

    @property
    def kv_bytes(self) -> int:
        taken = (
            self.mm_reserved
            + self.cuda_graphs
            + self.staging
            + self.pp_buffers
            + self.headroom
        )
        return max(0, self.free - taken)

    def describe(self) -> str:
        """``X MiB free after loading the model, less ... = Y MiB``."""
        text = f"{mib(self.free)} free after loading the model"
        less = [
            (self.mm_reserved, "vLLM's multimodal IPC reservation"),
            (self.cuda_graphs, "vLLM's CUDA graph estimate"),
            (self.staging, "the host KV tier's staging buffers"),
            (self.pp_buffers, "pipeline receive buffers"),
            (self.headroom, "headroom"),
        ]
        parts = [f"less {mib(n)} for {what}" for n, what in less if n]
        if not parts:
            return text
        return f"{text}, {', '.join(parts)}: {mib(self.kv_bytes)}"


@dataclass(frozen=True)
class BudgetPlan:
    """What the engine's budget mode decides before vLLM builds the configs."""

    title: str | None = None
    """The startup table's title: which budget sized the cache; None where
    vLLM sized it (the table says how)."""
    mode: BudgetMode | None = None
    """The budget mode that planned (``KVMemConfig.budget_mode``); None: vLLM
    sizes the cache, or the split does not apply."""
    blocks: int | None = None
    """The block count every rank gets; None: vLLM's own count."""
    memory: list[int] | None = None
    """Per-rank bytes for vLLM's planner (``blocks`` of each rank's groups);
    with the split, each rank's share of the pipeline-wide budget."""
    bytes_per_block: list[int] | None = None
    """Device bytes one block takes on each rank, as the plan read them from
    vLLM (0 without KV cache layers); None where vLLM sizes the cache."""

    def bytes_for_vllm(self, limits: list[int]) -> list[int]:
        """What vLLM's planner plans each rank from: the planned bytes, or
        each worker's device limit where vLLM's own figures stand."""
        return limits if self.memory is None else self.memory


@dataclass(frozen=True)
class BudgetRuntime:
    """The budget's facts in one engine core; empty elsewhere."""

    device_limits: list[DeviceLimit | None] = field(default_factory=list)
    """Each worker's limit with its components, by rank (None: a worker that
    measured none)."""
    plan: BudgetPlan | None = None
    """vLLM 0.33: the plan for the builder, from the executor's measurement
    until vLLM's configs are final; None outside that window."""

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> BudgetRuntime:
        stored = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
        if not stored:
            return cls()
        plan = stored.get("plan")
        return cls(
            device_limits=[
                DeviceLimit(**p) if p else None
                for p in stored.get("device_limits") or []
            ],
            plan=BudgetPlan(**plan) if plan else None,
        )

    def store(self, vllm_config: Any) -> None:
        """Write the record into ``vllm_config`` (changes its
        ``additional_config``)."""
        vllm_config.additional_config[KEY] = asdict(self)

    def limits_for(self, available_memory: list[int]) -> list[DeviceLimit]:
        """Each worker's limit with its components; a worker that reported
        none (or an executor that reduced the list) counts as plain free
        memory."""
        out = []
        for rank, available in enumerate(available_memory):
            limit = self.device_limits[rank] if rank < len(self.device_limits) else None
            out.append(
                limit
                if limit is not None and limit.kv_bytes == available
                else DeviceLimit(free=available)
            )
        return out
