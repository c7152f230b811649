"""vLLM's KV-cache figures, each in one place and from vLLM's own functions.

The stage of a rank, the KV cache groups vLLM's planner forms, bytes per
block, capacity in tokens, the bytes one max_model_len sequence needs, the
bytes of one host slot, a device's free memory and vLLM's multimodal
reservation are all vLLM's numbers; the rest of vllm-kvmem asks here instead
of re-deriving them, so a change in vLLM shows up in one module. The engine's
budget asks once for all it plans from (:func:`kv_figures`).

The vLLM functions this module calls (several are private) are listed in
:data:`VLLM_HELPERS` and only reached through it: each is checked against
the parameters we call it with the first time it is used, and
``tests/test_vllm_adapter.py`` checks them all, the way the patch records
check the functions vllm-kvmem replaces. Each record names the vLLM series it
holds for (``tests/test_vllm_versions.py`` reads 0.33's from its wheel): vLLM
0.33 moved planning to ``kv_cache_planning`` behind a ``KVCacheConfigBuilder``,
so there the groups, bytes per block and configs come from the builder the
platform selects (:func:`platform_builder`), as vLLM's own planner gets them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

_KU = "vllm.v1.core.kv_cache_utils"
_KP = "vllm.v1.core.kv_cache_planning"  # vLLM 0.33
_CPU = "vllm.utils.cpu_resource_utils"


def resolve_target(target: str) -> tuple[Any, str, Any]:
    """``module:attr`` or ``module:Class.attr`` as ``(owner, attr, raw)``, raw
    as stored (a staticmethod stays one); importing the module is the only
    side effect. The patch records resolve their targets here too."""
    module_name, path = target.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    return owner, attr, raw


@dataclass(frozen=True)
class VllmHelper:
    """One vLLM function vllm-kvmem calls, with the parameters it expects."""

    target: str
    """``module:attr``."""
    signature: tuple[str, ...]
    used_for: str
    versions: tuple[str, ...] = ("0.32", "0.33")
    """vLLM series whose sources hold ``target`` with ``signature``."""

    @property
    def name(self) -> str:
        return self.target.rsplit(":", 1)[1]

    @property
    def private(self) -> bool:
        return self.name.startswith("_")

    def check_signature(self) -> Callable[..., Any]:
        """The function, or an error naming it if vLLM changed it."""
        func = resolve_target(self.target)[2]
        params = tuple(inspect.signature(func).parameters)
        if params != self.signature:
            raise RuntimeError(
                f"vllm-kvmem calls {self.target} with parameters {self.signature}, "
                f"this vLLM has {params}; this vLLM is not supported"
            )
        return func


VLLM_HELPERS: tuple[VllmHelper, ...] = (
    VllmHelper(
        f"{_KU}:get_kv_cache_groups",
        ("vllm_config", "kv_cache_spec"),
        "the KV cache groups vLLM's planner forms from every worker's specs",
        ("0.32",),
    ),
    VllmHelper(
        f"{_KP}:get_global_kv_cache_groups",
        ("vllm_config", "kv_cache_specs"),
        "the KV cache groups vLLM's planner forms from every worker's specs",
        ("0.33",),
    ),
    VllmHelper(
        f"{_KU}:_project_kv_cache_groups_to_worker",
        ("global_kv_cache_groups", "worker_spec"),
        "those groups restricted to one worker's layers (its pipeline stage)",
        ("0.32",),
    ),
    VllmHelper(
        f"{_KP}:_project_kv_cache_groups_to_worker",
        ("global_kv_cache_groups", "worker_spec"),
        "those groups restricted to one worker's layers (its pipeline stage)",
        ("0.33",),
    ),
    VllmHelper(
        f"{_KU}:_pool_bytes_per_block",
        ("vllm_config", "kv_cache_groups"),
        "bytes per block, the divisor vLLM turns a budget into blocks with",
        ("0.32",),
    ),
    VllmHelper(
        f"{_KP}:_pool_bytes_per_block_from_builder",
        ("builder", "vllm_config", "kv_cache_groups"),
        "bytes per block, the divisor vLLM turns a budget into blocks with",
        ("0.33",),
    ),
    VllmHelper(
        f"{_KU}:_max_memory_usage_bytes_from_groups",
        ("vllm_config", "kv_cache_groups"),
        "bytes one max_model_len sequence needs, vLLM's startup check",
        ("0.32",),
    ),
    VllmHelper(
        f"{_KP}:_max_memory_usage_bytes_from_groups",
        ("builder", "vllm_config", "kv_cache_groups"),
        "bytes one max_model_len sequence needs, vLLM's startup check",
        ("0.33",),
    ),
    VllmHelper(
        f"{_KU}:get_kv_cache_config_from_groups",
        ("vllm_config", "kv_cache_groups", "available_memory"),
        "the config vLLM builds for a given number of bytes",
        ("0.32",),
    ),
    VllmHelper(
        f"{_KU}:get_kv_cache_capacity",
        ("vllm_config", "kv_cache_config"),
        "capacity in tokens and concurrency, as vLLM logs it",
    ),
    VllmHelper(
        "vllm.utils.import_utils:resolve_obj_by_qualname",
        ("qualname",),
        "the builder class a platform names (vLLM 0.33's builder hook)",
    ),
    VllmHelper(
        "vllm.multimodal.gpu_ipc_memory:reserve_mm_ipc_gpu_memory",
        ("available_kv_cache_memory_bytes", "mm_config", "api_process_count"),
        "what vLLM keeps off the KV cache for frontend multimodal GPU work",
    ),
    VllmHelper(
        "vllm.distributed.parallel_state:get_pp_group",
        (),
        "whether a worker is its pipeline's first stage (receives nothing)",
    ),
    VllmHelper(
        f"{_CPU}:get_allowed_cpu_list",
        (),
        "the CPU worker's NUMA node",
    ),
    VllmHelper(
        f"{_CPU}:get_memory_node_info",
        ("node_id",),
        "that node's available memory, what vLLM's CPU worker checks",
    ),
)

#: vLLM series vllm-kvmem runs on, and the one series a helper table entry or
#: a patch record must name to be used there.
SERIES: tuple[str, ...] = ("0.32", "0.33")


def series_of(version: str) -> str | None:
    """``0.33`` for ``0.33.1``; None for a series vllm-kvmem does not run on."""
    return next((s for s in SERIES if version.startswith(f"{s}.")), None)


def vllm_series() -> str:
    """The running vLLM's series (one of :data:`SERIES`)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    found = series_of(version)
    if found is None:
        raise RuntimeError(f"vllm-kvmem does not run on vLLM {version}")
    return found


def helper(name: str, series: str) -> VllmHelper:
    """The table entry for ``name`` on ``series``."""
    return next(h for h in VLLM_HELPERS if h.name == name and series in h.versions)


_checked: dict[str, Callable[..., Any]] = {}


def _vllm(name: str) -> Callable[..., Any]:
    """The vLLM function ``name`` from :data:`VLLM_HELPERS`, checked once."""
    if name not in _checked:
        _checked[name] = helper(name, vllm_series()).check_signature()
    return _checked[name]


def plans_through_builder() -> bool:
    """vLLM 0.33 and later plan through a ``KVCacheConfigBuilder``."""
    return vllm_series() != "0.32"


def platform_builder(vllm_config: Any) -> Any:
    """The ``KVCacheConfigBuilder`` vLLM 0.33's platform selects for this
    config, never vllm-kvmem's (which wraps it): the one source of the
    arithmetic, as in vLLM's own planner."""
    from vllm.platforms import current_platform

    hook = type(current_platform).get_kv_cache_config_builder_cls.__func__
    own = getattr(hook, "__kvmem_original__", hook)
    qualname = own(type(current_platform), vllm_config)
    return _vllm("resolve_obj_by_qualname")(qualname)()


# ---------------------------------------------------------------- stages


def layer_names(kv_cache_config: Any) -> frozenset[str]:
    """Every KV cache layer a worker's ``KVCacheConfig`` holds."""
    return frozenset(n for g in kv_cache_config.kv_cache_groups for n in g.layer_names)


def stage_of_each_rank(layer_sets: Iterable[Iterable[str]]) -> list[int]:
    """Pipeline stage of each rank, from each rank's KV layer names.

    Tensor-parallel ranks of a stage hold the same layers; stages hold
    disjoint ones. Accepts a worker's KV specs (a dict keyed by layer name) or
    :func:`layer_names` of its config.
    """
    stages: dict[frozenset[str], int] = {}
    return [stages.setdefault(frozenset(s), len(stages)) for s in layer_sets]


def stages_of_configs(kv_cache_configs: Sequence[Any]) -> list[int]:
    return stage_of_each_rank(layer_names(c) for c in kv_cache_configs)


def first_rank_of_each_stage(stage: Sequence[int]) -> list[int]:
    """One rank per stage (one tensor-parallel shard of the pipeline)."""
    return [list(stage).index(s) for s in range(max(stage, default=-1) + 1)]


# ---------------------------------------------------------------- groups


def worker_groups(vllm_config: Any, kv_cache_specs: Sequence[dict[str, Any]]) -> list:
    """Each worker's KV cache groups, exactly as vLLM's planner will form them.

    Mirrors the first steps of ``get_kv_cache_configs`` with vLLM's own
    functions on a copy of the specs, so that bytes per block and the bytes one
    max_model_len sequence needs are vLLM's numbers, hybrid models included.
    """
    project = _vllm("_project_kv_cache_groups_to_worker")
    if plans_through_builder():
        groups = _vllm("get_global_kv_cache_groups")(vllm_config, list(kv_cache_specs))
        return [project(groups, w) for w in kv_cache_specs]
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    merged: dict[str, Any] = {}
    for specs in kv_cache_specs:
        for name, spec in specs.items():
            merged.setdefault(name, spec)
    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    for name, spec in merged.items():
        if isinstance(spec, SlidingWindowSpec):
            merged[name] = replace(spec, extra_retained_tokens=extra)
    groups = _vllm("get_kv_cache_groups")(vllm_config, merged)
    return [project(groups, w) for w in kv_cache_specs]


def bytes_per_block(vllm_config: Any, groups: Sequence[Any]) -> int:
    """Device bytes one block takes on a worker (all its layers)."""
    if plans_through_builder():
        builder = platform_builder(vllm_config)
        return _vllm("_pool_bytes_per_block_from_builder")(
            builder, vllm_config, list(groups)
        )
    return _vllm("_pool_bytes_per_block")(vllm_config, list(groups))


def sequence_bytes(vllm_config: Any, groups: Sequence[Any]) -> int:
    """Bytes one max_model_len sequence needs on a worker (no null block)."""
    usage = _vllm("_max_memory_usage_bytes_from_groups")
    if plans_through_builder():
        return usage(platform_builder(vllm_config), vllm_config, list(groups))
    return usage(vllm_config, list(groups))


def config_for_blocks(vllm_config: Any, groups: Sequence[Any], blocks: int) -> Any:
    """The ``KVCacheConfig`` vLLM builds for ``blocks`` blocks of ``groups``."""
    if plans_through_builder():
        builder = platform_builder(vllm_config)
        return builder.get_kv_cache_config_from_groups(
            vllm_config, list(groups), blocks
        )
    memory = blocks * bytes_per_block(vllm_config, groups)
    return _vllm("get_kv_cache_config_from_groups")(vllm_config, list(groups), memory)


def capacity(vllm_config: Any, kv_cache_config: Any) -> tuple[int, float]:
    """``(tokens, concurrency)`` of a config, as vLLM logs them."""
    return _vllm("get_kv_cache_capacity")(vllm_config, kv_cache_config)


def tokens_in(vllm_config: Any, groups: Sequence[Any], blocks: int) -> int:
    """Tokens ``blocks`` blocks of ``groups`` hold, as vLLM counts capacity."""
    return capacity(vllm_config, config_for_blocks(vllm_config, groups, blocks))[0]


@dataclass(frozen=True)
class KVFigures:
    """vLLM's figures of every rank's KV cache that the engine's budget plans
    from, read in one call (:func:`kv_figures`); lists are by rank."""

    stage: list[int]
    """Each rank's pipeline stage."""
    bytes_per_block: list[int]
    """Device bytes one block takes on each rank; 0 on a rank without KV
    cache layers."""
    sequence_bytes: list[int] | None
    """Bytes one max_model_len sequence needs on each rank (no null block; 0
    without KV cache layers); None where vLLM fits max_model_len to the cache
    (``--max-model-len auto``)."""
    tokens_in: Callable[[int, int], int]
    """``(rank, blocks)``: tokens that many blocks hold on that rank, as vLLM
    counts capacity."""

    @property
    def ranks_with_kv(self) -> list[int]:
        return [r for r, b in enumerate(self.bytes_per_block) if b]

    @property
    def first_rank_of_each_stage(self) -> list[int]:
        """One rank per stage (one tensor-parallel shard of the pipeline)."""
        return first_rank_of_each_stage(self.stage)


def kv_figures(vllm_config: Any, kv_cache_specs: Sequence[dict[str, Any]]) -> KVFigures:
    """Every rank's :class:`KVFigures` from its KV specs, with the groups
    vLLM's planner will form (:func:`worker_groups`)."""
    groups = worker_groups(vllm_config, kv_cache_specs)
    bpb = [
        bytes_per_block(vllm_config, g) if specs else 0
        for g, specs in zip(groups, kv_cache_specs)
    ]
    sequence = None
    if vllm_config.model_config.original_max_model_len != -1:
        sequence = [
            sequence_bytes(vllm_config, g) if b else 0 for g, b in zip(groups, bpb)
        ]

    def rank_tokens_in(rank: int, blocks: int) -> int:
        return tokens_in(vllm_config, groups[rank], blocks)

    return KVFigures(stage_of_each_rank(kv_cache_specs), bpb, sequence, rank_tokens_in)


def reserved_bytes(kv_cache_config: Any) -> int:
    """KV bytes a worker allocates (its largest KV cache tensor)."""
    return max((t.size for t in kv_cache_config.kv_cache_tensors), default=0)


# ---------------------------------------------------------------- devices


def free_device_bytes(worker: Any) -> int:
    """Bytes this worker's device can still hold, read after vLLM's profiling.

    CPU: the available memory of the worker's NUMA node (what vLLM's CPU worker
    checks). Accelerators: the free device memory, as reported by torch.
    """
    import torch

    device = getattr(worker, "device", None)
    if device is None or torch.device(device).type == "cpu":
        node = _vllm("get_allowed_cpu_list")()[0].numa_node
        return int(_vllm("get_memory_node_info")(node).available_memory)
    free, _total = torch.accelerator.get_memory_info(device)
    return int(free)


def pp_receive_bytes(worker: Any) -> int:
    """Bytes a step's pipeline receive allocates on this worker's device.

    Every stage after the first receives the previous stage's intermediate
    tensors each step, into tensors allocated then (``irecv_tensor_dict``),
    after the KV cache took its memory; the profile run never receives.
    Their shape is vLLM's own ``make_empty_intermediate_tensors`` for
    ``max_num_tokens`` tokens: the buffer vLLM's model runner keeps from its
    profile run where it has one, else that function's shapes on the meta
    device (nothing allocated). 0 on the first stage and without pipelines.
    """
    import torch

    config = worker.vllm_config
    if config.parallel_config.pipeline_parallel_size == 1:
        return 0
    if _vllm("get_pp_group")().is_first_rank:
        return 0
    runner = worker.model_runner
    buffers = getattr(runner, "intermediate_tensors", None)
    if buffers is None:
        buffers = runner.get_model().make_empty_intermediate_tensors(
            batch_size=config.scheduler_config.max_num_batched_tokens,
            dtype=config.model_config.dtype,
            device=torch.device("meta"),
        )
    return sum(t.numel() * t.element_size() for t in buffers.tensors.values())


# Larger than any reservation, so that vLLM's function returns instead of
# raising and the difference is the reservation.
_PROBE_BYTES = 1 << 60


def mm_reservation_bytes(vllm_config: Any) -> int:
    """What vLLM keeps off the KV cache for frontend multimodal GPU work, from
    vLLM's own ``reserve_mm_ipc_gpu_memory`` (0 for a text-only model)."""
    mm_config = vllm_config.model_config.multimodal_config
    if mm_config is None:
        return 0
    count = getattr(vllm_config.parallel_config, "_api_process_count", 1)
    reserve = _vllm("reserve_mm_ipc_gpu_memory")
    return _PROBE_BYTES - reserve(_PROBE_BYTES, mm_config, count)
