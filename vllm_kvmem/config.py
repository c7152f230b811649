"""The one typed configuration of vllm-kvmem, and how it rides in vLLM's config.

Every option reaches the engine the same way, whichever door it came in by
(a server flag, an ``LLM(...)`` keyword argument, or
``additional_config={"kvmem": {...}}``): it is validated here and stored,
normalised, in ``VllmConfig.additional_config["kvmem"]``, which vLLM already
ships to the engine core and to every worker process.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

ADDITIONAL_CONFIG_KEY = "kvmem"


class KVMemConfig(BaseModel):
    """Options of vllm-kvmem, in the style of vLLM's ``CacheConfig``."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, strict=True
    )

    enable_pp_prop_kv_cache: bool = False
    """Treat ``--kv-cache-memory-bytes`` as one budget for the whole pipeline
    (per tensor-parallel shard) and give each pipeline stage a share in
    proportion to its KV bytes per block, so that every stage holds the same
    number of blocks. Requires ``--kv-cache-memory-bytes``; has no effect with
    ``--pipeline-parallel-size 1``."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    @staticmethod
    def flag(name: str) -> str:
        """The server flag for an option name."""
        return "--" + name.replace("_", "-")

    @classmethod
    def help(cls, name: str) -> str:
        return " ".join((cls.model_fields[name].description or "").split())

    @classmethod
    def parse(cls, raw: Any) -> KVMemConfig:
        """Validate a raw mapping; errors name the flag, the value and the fix."""
        if raw is None:
            return cls()
        if isinstance(raw, KVMemConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a mapping of "
                f"vllm-kvmem options, got {raw!r}; valid keys: "
                f"{', '.join(cls.option_names())}"
            )
        unknown = sorted(set(raw) - set(cls.option_names()))
        if unknown:
            raise ValueError(
                f"unknown vllm-kvmem option(s) {', '.join(map(repr, unknown))} in "
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]; valid keys: "
                f"{', '.join(cls.option_names())}"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "?"
            field = cls.model_fields.get(name)
            expected = getattr(field.annotation, "__name__", str(field.annotation))
            raise ValueError(
                f"{cls.flag(name)} (additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
                f"[{name!r}]): invalid value {raw.get(name)!r}: {err['msg']}; "
                f"expected a {expected}"
            ) from None

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> KVMemConfig:
        additional = getattr(vllm_config, "additional_config", None) or {}
        return cls.parse(additional.get(ADDITIONAL_CONFIG_KEY))


def merge_options(
    additional_config: dict[str, Any] | None, options: dict[str, Any], source: str
) -> dict[str, Any]:
    """Return ``additional_config`` with ``options`` merged under ``kvmem``.

    The same option given twice with different values (say a keyword argument
    and ``additional_config``) is an error rather than a silent override.
    """
    merged = dict(additional_config or {})
    current = dict(merged.get(ADDITIONAL_CONFIG_KEY) or {})
    for name, value in options.items():
        if name in current and current[name] != value:
            raise ValueError(
                f"{KVMemConfig.flag(name)} given twice with different values: "
                f"{value!r} ({source}) and {current[name]!r} "
                f"(additional_config[{ADDITIONAL_CONFIG_KEY!r}]); give it once"
            )
        current[name] = value
    merged[ADDITIONAL_CONFIG_KEY] = current
    return merged
