"""The one typed configuration of vllm-kvmem, and how it rides in vLLM's config.

Every option is validated here, whichever door it came in by (a server flag
or an ``LLM(...)`` keyword argument). The plugin can add no field to vLLM's
configs (in the in-tree series, ``kvmem_tools/intree``, they are
``CacheConfig`` fields), so they are stored, normalised, in
``VllmConfig.additional_config["kvmem"]``, which vLLM already ships to the
engine core and to every worker process, and that mapping is a third door.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

ADDITIONAL_CONFIG_KEY = "kvmem"

#: The engine core's budget modes (:meth:`KVMemConfig.budget_mode`).
BudgetMode = Literal["tokens", "split"]


def parse_size(value: Any) -> Any:
    """Accept vLLM's human-readable integers ("400k", "5G") where ints go,
    parsed by vLLM's own ``human_readable_int`` (the planner, which runs
    without vLLM, uses ``core.units.parse_size``, held equal to it by a test).

    Strings only: pydantic checks everything else strictly as an int.
    """
    if isinstance(value, str):
        from argparse import ArgumentTypeError

        from vllm.utils.argparse_utils import human_readable_int

        try:
            return human_readable_int(value)
        except (ArgumentTypeError, ValueError) as e:
            raise ValueError(
                f"not a size: {value!r} (use e.g. 400000, 400k, 512K)"
            ) from e
    return value


SizeInt = Annotated[int, BeforeValidator(parse_size), Field(ge=1)]


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

    kv_cache_tokens: SizeInt | None = None
    """Size the KV cache in tokens instead of bytes (e.g. ``400k``): every rank
    gets exactly the blocks that many tokens need, as vLLM counts capacity,
    computed from the KV specs the workers report. Mutually exclusive with
    ``--kv-cache-memory-bytes``; with pipeline parallelism each stage's bytes
    follow its KV bytes per block, like ``--enable-pp-prop-kv-cache``."""

    kv_host_cache_bytes: SizeInt | None = None
    """Host (CPU) memory for a second KV tier, e.g. ``8G``, in total per
    tensor-parallel shard (split over pipeline stages by their KV bytes per
    block). Blocks evicted from the device prefix cache are copied there and
    copied back on a later prefix hit instead of being recomputed. Unlike
    vLLM's ``--kv-offloading-size``, which stores every block as it is
    computed, only evicted blocks move, so a workload without reuse pays
    almost nothing."""

    kv_host_cache_policy: Literal["lru", "fifo"] = "lru"
    """Which host-tier block to drop when the host tier is full: ``lru``
    (least recently spilled or hit) or ``fifo`` (oldest spilled)."""

    kv_host_cache_step_bytes: SizeInt | None = None
    """Most bytes the host tier copies in the background per engine step, in
    each direction: loads of host hits, and copies ahead of eviction of the
    cached blocks next in line to be evicted. Bounds how long one step can be
    held up by copies (CPU: copies run in the step) or how much copy traffic
    one step adds (GPU: side streams). A hit that fits what is left of a
    step's budget loads before that step's forward, and its request runs in
    that step; a larger one waits for its blocks while the others run.
    Default: 256M on CPU, 512M on GPUs. At least one block moves per step
    whatever the value."""

    kv_host_cache_late_spill: Literal["copy", "drop"] = "copy"
    """What happens to a cached block that vLLM evicts before its background
    copy ran: ``copy`` spills it synchronously before the step's forward pass
    (the block stays reusable), ``drop`` lets it go (no copy on the critical
    path; a later hit on it recomputes)."""

    kv_host_cache_copy_thread: Literal["auto", "on", "off"] = "auto"
    """CPU platforms: run the host tier's copies on copy threads beside the
    forward pass, one per direction (the CPU's counterpart of a GPU's copy
    streams), and let each
    attention layer wait only for its own KV of a host hit, so that the copy
    of a hit overlaps the forward pass. ``auto``: on where the engine's
    OpenMP threads leave a CPU of the process unused (the thread runs
    there); ``off``: copies run inside the step, before the forward. No
    effect on GPUs."""

    kv_host_cache_verify: bool = False
    """Debug: checksum every block saved to the host tier and verify it when
    it is loaded back; a mismatch turns the block into a miss that vLLM
    recomputes, and is logged. Costs a synchronous pass over every copied
    byte."""

    kv_disk_cache_path: str | None = None
    """Directory of a disk KV tier behind the host tier (an absolute path,
    local or shared by several engines): blocks the host tier evicts are
    written there, one file per block and worker, and a prefix that misses
    on the device and in host memory is read back from it, also by another
    engine or after a restart. Needs ``--kv-host-cache-bytes`` and
    ``--kv-disk-cache-bytes``, and block hashes every process agrees on
    (``--prefix-caching-hash-algo sha256``, vLLM's default, or the same
    ``PYTHONHASHSEED`` everywhere)."""

    kv_disk_cache_bytes: SizeInt | None = None
    """Bytes the disk KV tier's directory may hold (``100G``), all workers
    and all engines sharing it together; the least recently used blocks are
    removed beyond it. Needs ``--kv-disk-cache-path``."""

    def budget_mode(self, vllm_config: Any) -> BudgetMode | None:
        """Which vllm-kvmem budget sizes the KV cache of ``vllm_config``:
        ``tokens`` (``--kv-cache-tokens``), ``split``
        (``--enable-pp-prop-kv-cache`` with a byte budget and more than one
        pipeline stage), or None: vLLM's own sizing. In either mode the
        workers report their device limit and the engine core plans every
        rank's blocks."""
        if self.kv_cache_tokens is not None:
            return "tokens"
        if (
            self.enable_pp_prop_kv_cache
            and vllm_config.cache_config.kv_cache_memory_bytes is not None
            and vllm_config.parallel_config.pipeline_parallel_size > 1
        ):
            return "split"
        return None

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
            choices = (
                get_args(cls.model_fields[name].annotation)
                if name in (cls.model_fields)
                else ()
            )
            expected = {
                "bool_type": "a boolean (true/false)",
                "bool_parsing": "a boolean (true/false)",
                "literal_error": "one of " + ", ".join(map(str, choices)),
            }.get(err["type"], "a positive integer or a size like 400k or 8G")
            # Our own validators' reasons, without pydantic's "Value error, ".
            reason = (
                str(err["ctx"]["error"])
                if err["type"] == "value_error" and "error" in err.get("ctx", {})
                else err["msg"]
            )
            raise ValueError(
                f"{cls.flag(name)}{_source(name)}: invalid value "
                f"{raw.get(name)!r}: {reason}; expected {expected}"
            ) from None

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> KVMemConfig:
        """The options a ``VllmConfig`` carries, parsed once per process.

        Every patch that runs in a process asks for them; a mapping with the
        same items is validated only the first time (errors are not cached).
        """
        additional = getattr(vllm_config, "additional_config", None) or {}
        raw = additional.get(ADDITIONAL_CONFIG_KEY)
        if not isinstance(raw, dict):
            return cls.parse(raw)
        try:
            # Types in the key: True == 1 and 1.0 == 1, but strict parsing
            # accepts only one of each pair.
            key = tuple((k, type(v), v) for k, v in sorted(raw.items()))
            return _parse_items(key)
        except TypeError:  # an unhashable value: parse() says what is wrong
            return cls.parse(raw)


def _source(name: str) -> str:
    """Where option ``name`` rides, for error messages (after its flag)."""
    return f" (additional_config[{ADDITIONAL_CONFIG_KEY!r}][{name!r}])"


@functools.lru_cache(maxsize=64)
def _parse_items(key: tuple[tuple[str, type, Any], ...]) -> KVMemConfig:
    return KVMemConfig.parse({k: v for k, _, v in key})


def check_options(vllm_config: Any) -> KVMemConfig:
    """Validate the options at startup (a bad value fails naming its flag),
    and write them back into ``additional_config`` normalised (sizes as
    integers, only the options given), so that the engine core and every
    worker read the same mapping; changes ``vllm_config``."""
    cfg = KVMemConfig.from_vllm_config(vllm_config)
    additional = vllm_config.additional_config
    if ADDITIONAL_CONFIG_KEY in additional:
        additional[ADDITIONAL_CONFIG_KEY] = cfg.model_dump(exclude_unset=True)
    return cfg


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
