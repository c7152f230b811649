"""The host tier's settings, read from vLLM's ``kv_connector_extra_config``:
the connector is configured through vLLM's own connector channel, so it needs
nothing but vLLM's config objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

#: Default per-step copy budget (each direction). On CPU the copies run inside
#: the step at memory speed (~8 GB/s here): 256 MiB holds a step up ~32 ms,
#: about one decode step of a small model, and a hit that size (2k tokens of
#: a 128 KiB/token model) loads synchronously and joins the batch in the step
#: it is admitted. On a GPU the copies run on side streams; 512 MiB is ~10 ms
#: of PCIe 5 traffic.
DEFAULT_STEP_BYTES = {"cpu": 256 << 20, "gpu": 512 << 20}

_CHOICES = {
    "eviction_policy": ("lru", "fifo"),
    "late_spill": ("copy", "drop"),
    "copy_thread": ("auto", "on", "off"),
}


def default_step_bytes() -> int:
    from vllm.platforms import current_platform

    return DEFAULT_STEP_BYTES["cpu" if current_platform.is_cpu() else "gpu"]


@dataclass(frozen=True)
class HostTierConfig:
    """Every key of the connector's ``kv_connector_extra_config``."""

    num_host_blocks: int = 0
    """Host blocks per TP shard; every pipeline stage holds this many, each
    block sized for the stage's own layers."""
    host_block_bytes: int = 0
    """Bytes of one host block summed over the pipeline stages (one TP
    shard), for logs and metrics; 0: this process's own KV cache config."""
    host_bytes: int = 0
    """The host size the blocks were counted from, for the line that says
    it holds none (0: not given)."""
    eviction_policy: Literal["lru", "fifo"] = "lru"
    step_bytes: int = 0
    """Copy budget per step and direction; 0: the platform's default."""
    late_spill: Literal["copy", "drop"] = "copy"
    """A cached block evicted before its background copy ran: copied before
    the step's forward pass, or dropped."""
    copy_thread: Literal["auto", "on", "off"] = "auto"
    """CPU: copies on a copy thread beside the forward pass, loads waited for
    layer by layer; ``auto`` where a CPU is left over by the forward's
    OpenMP threads."""
    verify: bool = False
    """Checksum every host block and recompute one that does not match."""
    disk_path: str = ""
    """Directory of the disk tier behind the host tier ("": none); see
    ``disk_store``."""
    disk_bytes: int = 0
    """Bytes the disk tier's directory may hold, all ranks and replicas."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HostTierConfig:
        """Parse and check the extra config; a bad key or value raises
        ``ValueError`` naming it and what would work."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        if unknown := sorted(set(extra) - set(known)):
            raise ValueError(
                f"kv_connector_extra_config has unknown keys {unknown} for the "
                f"host KV tier; known: {sorted(known)}"
            )
        for key, value in extra.items():
            if key in _CHOICES:
                if value not in _CHOICES[key]:
                    raise ValueError(
                        f"kv_connector_extra_config[{key!r}]={value!r}; use one "
                        f"of {list(_CHOICES[key])}"
                    )
            elif key == "verify":
                if not isinstance(value, bool):
                    raise ValueError(
                        f"kv_connector_extra_config['verify']={value!r}; use "
                        f"true or false"
                    )
            elif key == "disk_path":
                if not isinstance(value, str):
                    raise ValueError(
                        f"kv_connector_extra_config['disk_path']={value!r}; use "
                        f"a directory path"
                    )
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}]={value!r}; use a "
                    f"non-negative integer"
                )
        if bool(extra.get("disk_path")) != bool(extra.get("disk_bytes")):
            raise ValueError(
                "kv_connector_extra_config: disk_path and disk_bytes go together "
                f"(got disk_path={extra.get('disk_path', '')!r}, "
                f"disk_bytes={extra.get('disk_bytes', 0)!r})"
            )
        return cls(**extra)

    def to_extra_config(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def copy_budget_bytes(self) -> int:
        return self.step_bytes or default_step_bytes()
