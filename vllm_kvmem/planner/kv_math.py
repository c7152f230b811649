"""KV-cache memory arithmetic, mirroring vLLM 0.32.0 without importing it.

Everything here is integers over a model's per-layer KV specs, so that
``kvmem plan`` works offline and tests can predict what an engine allocates.
Each function names the vLLM code it mirrors (paths under ``vllm/``):

* bytes per token and per block: ``AttentionSpec.page_size_bytes``,
  ``MLAAttentionSpec`` (v1/kv_cache_interface.py);
* blocks one request needs: ``FullAttentionSpec.max_memory_usage_bytes`` and
  ``SlidingWindowSpec.max_admission_blocks_per_request`` (same file);
* grouping of mixed full/sliding layers and bytes per block of a worker:
  ``_get_kv_cache_groups_uniform_page_size``, ``_get_kv_cache_bytes_per_block``
  and ``get_kv_cache_configs`` (v1/core/kv_cache_utils.py);
* what vLLM prints as "KV cache size: N tokens" and "Maximum concurrency":
  ``get_kv_cache_capacity`` / ``get_max_concurrency_for_kv_cache_config``;
* the default layer split: ``get_pp_indices`` (distributed/utils.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction

from vllm_kvmem.core import kv_arith
from vllm_kvmem.core.units import cdiv

# ----------------------------------------------------------------- dtypes

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
}

# vLLM's CacheDType values this planner sizes; the rest pack scales or use
# sub-byte formats whose page layout is backend-specific.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DS_MLA_BYTES = 656  # per token, from MLAAttention.get_kv_cache_spec


def resolve_model_dtype(config_dtype: str | None, dtype: str = "auto") -> str:
    """The dtype vLLM runs the model in (``_get_and_verify_dtype``).

    With ``--dtype auto`` a float32 (or missing) config dtype is downcast to
    the platform's preferred 16-bit type; bfloat16 is assumed, and its size is
    what matters here (float16 has the same).
    """
    if dtype != "auto":
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"--dtype={dtype!r}: use auto, bfloat16, float16 (half) or "
                "float32 (float)"
            )
        return {"half": "float16", "float": "float32"}.get(dtype, dtype)
    name = (config_dtype or "float32").removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(
            f"config.json torch_dtype={config_dtype!r} is not a dtype this planner "
            "knows; pass --dtype bfloat16, float16 or float32"
        )
    return "bfloat16" if DTYPE_BYTES[name] >= 4 else name


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes of one KV element: ``auto`` is the model dtype, fp8 is one byte."""
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[model_dtype]
    if kv_cache_dtype in ("bfloat16", "float16"):
        return 2
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 1
    raise ValueError(
        f"--kv-cache-dtype={kv_cache_dtype!r} is not supported by the planner "
        f"(its page layout is backend-specific); use one of "
        f"{', '.join(KV_CACHE_DTYPES)}"
    )


# ------------------------------------------------------------ layer specs


class LayerKind(StrEnum):
    """KV cache kinds the planner sizes."""

    FULL = "full_attention"
    SLIDING = "sliding_window"
    MLA = "mla"


# Layer kinds seen in configs that are not per-token KV caches this planner
# can size, with the plain reason given to the user.
UNSUPPORTED_KINDS: dict[str, str] = {
    "linear_attention": "linear-attention layers keep a fixed-size state, not a "
    "per-token KV cache",
    "mamba": "Mamba layers keep a fixed-size SSM state, not a per-token KV cache",
    "chunked_attention": "chunked local attention (Llama 4) is not modelled",
    "cross_attention": "cross-attention caches are sized by the encoder input",
}


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's KV cache, before tensor parallelism.

    ``num_kv_heads`` is the model's total; ``head_size_v`` is 0 for MLA, whose
    single latent vector (kv_lora_rank + qk_rope_head_dim) is one "head" that
    tensor parallelism does not split.
    """

    kind: LayerKind
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    sliding_window: int | None = None
    state_bytes: int | None = None  # opaque per-token bytes (fp8_ds_mla)

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """Heads one TP rank stores (``ModelConfig.get_num_kv_heads``).

        KV heads are split across TP ranks and replicated when there are fewer
        heads than ranks, so a rank never holds less than one head.
        """
        if self.kind is LayerKind.MLA:
            return 1
        return max(1, self.num_kv_heads // tp)

    def bytes_per_token(self, tp: int = 1) -> int:
        """K and V bytes one token costs in this layer on one TP rank."""
        if self.state_bytes is not None:
            return self.kv_heads_per_rank(tp) * self.state_bytes
        return kv_arith.layer_bytes_per_token(
            self.kv_heads_per_rank(tp),
            self.head_size,
            self.head_size_v,
            self.dtype_bytes,
        )

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        """One block of this layer (``AttentionSpec.page_size_bytes``)."""
        return kv_arith.layer_page_bytes(self.bytes_per_token(tp), block_size)

    def blocks_per_request(
        self, *, block_size: int, max_model_len: int, max_in_flight_tokens: int
    ) -> int:
        """Blocks one ``max_model_len`` request holds in this layer's group.

        Full attention and MLA keep every token: ``cdiv(max_model_len,
        block_size)``. A sliding window keeps ``window - 1`` tokens plus the
        tokens in flight, capped at ``max_model_len``, plus one block because
        the window need not start on a block boundary
        (``SlidingWindowSpec.max_admission_blocks_per_request``).
        """
        if self.kind is LayerKind.SLIDING:
            assert self.sliding_window is not None
            num_tokens = min(
                self.sliding_window - 1 + max_in_flight_tokens, max_model_len
            )
            return cdiv(num_tokens, block_size) + 1
        return cdiv(max_model_len, block_size)


def full_attention(
    num_kv_heads: int, head_dim: int, dtype_bytes: int, *, head_dim_v: int | None = None
) -> LayerKV:
    return LayerKV(
        LayerKind.FULL,
        num_kv_heads,
        head_dim,
        head_dim if head_dim_v is None else head_dim_v,
        dtype_bytes,
    )


def sliding_window(
    num_kv_heads: int, head_dim: int, dtype_bytes: int, window: int
) -> LayerKV:
    if window <= 0:
        raise ValueError(f"sliding_window={window}: must be a positive token count")
    return LayerKV(
        LayerKind.SLIDING, num_kv_heads, head_dim, head_dim, dtype_bytes, window
    )


def mla(
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype_bytes: int,
    *,
    state_bytes: int | None = None,
) -> LayerKV:
    return LayerKV(
        LayerKind.MLA,
        1,
        kv_lora_rank + qk_rope_head_dim,
        0,
        dtype_bytes,
        state_bytes=state_bytes,
    )


# ---------------------------------------------------------------- groups


@dataclass(frozen=True)
class KVGroup:
    """A KV cache group: layers sharing one block table in the scheduler."""

    spec: LayerKV
    layers: tuple[int, ...]


def kv_cache_groups(layers: Sequence[LayerKV], *, hybrid: bool = True) -> list[KVGroup]:
    """Group layers as ``get_kv_cache_groups`` does for these layer kinds.

    * one spec for every layer (the usual case): one group of all layers;
    * full attention mixed with sliding window, hybrid manager off
      (``--disable-hybrid-kv-cache-manager``): every layer is sized as full
      attention (``unify_hybrid_kv_cache_specs``), one group;
    * mixed, hybrid manager on, equal page sizes: vLLM's
      ``_get_kv_cache_groups_uniform_page_size`` — buckets by spec, a group
      size of the smallest bucket (the largest when max < 1.5 * min), and
      bucket ``i``-th group taking ``layers[i::num_groups]``.
    """
    if not layers:
        raise ValueError("the model has no attention layers with a KV cache")
    if all(spec == layers[0] for spec in layers):
        return [KVGroup(layers[0], tuple(range(len(layers))))]
    kinds = {spec.kind for spec in layers}
    if LayerKind.MLA in kinds:
        raise ValueError(
            "MLA layers mixed with other attention kinds are not supported by "
            "the planner"
        )
    if not hybrid:
        full = [
            LayerKV(
                LayerKind.FULL,
                s.num_kv_heads,
                s.head_size,
                s.head_size_v,
                s.dtype_bytes,
            )
            for s in layers
        ]
        if all(spec == full[0] for spec in full):
            return [KVGroup(full[0], tuple(range(len(layers))))]
    shapes = {
        (s.num_kv_heads, s.head_size, s.head_size_v, s.dtype_bytes) for s in layers
    }
    if len(shapes) > 1:
        raise ValueError(
            "layers with different KV bytes per token (e.g. a different head "
            "size for sliding-window layers) are not supported by the planner"
        )
    buckets: dict[LayerKV, list[int]] = {}
    for i, spec in enumerate(layers):
        buckets.setdefault(spec, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    groups = []
    for spec, idx in buckets.items():
        n = cdiv(len(idx), group_size)
        groups += [KVGroup(spec, tuple(idx[i::n])) for i in range(n)]
    return groups


def stage_bytes_per_block(
    groups: Sequence[KVGroup], start: int, end: int, *, block_size: int, tp: int = 1
) -> int:
    """Bytes one block costs a worker holding layers ``[start, end)``.

    Every group draws from one pool of blocks whose size is set by the group
    with the most bytes on this worker (``_get_kv_cache_bytes_per_block``).
    """
    return max(
        sum(g.spec.page_bytes(block_size, tp) for i in g.layers if start <= i < end)
        for g in groups
    )


def bytes_per_block_fn(
    groups: Sequence[KVGroup], num_layers: int, *, block_size: int, tp: int = 1
) -> Callable[[int, int], int]:
    """``stage_bytes_per_block`` as a function of ``(start, end)`` in O(groups).

    Prefix sums per group, for the partition search's many probes.
    """
    prefixes = []
    for g in groups:
        page = [0] * num_layers
        for i in g.layers:
            page[i] = g.spec.page_bytes(block_size, tp)
        prefixes.append([0, *_accumulate(page)])

    def bytes_per_block(start: int, end: int) -> int:
        return max(p[end] - p[start] for p in prefixes)

    return bytes_per_block


def stage_bytes_per_token(
    layers: Sequence[LayerKV], start: int, end: int, tp: int
) -> int:
    """KV bytes one token costs on a stage: the sum over its layers."""
    return sum(spec.bytes_per_token(tp) for spec in layers[start:end])


def request_blocks(
    groups: Sequence[KVGroup],
    *,
    block_size: int,
    max_model_len: int,
    max_in_flight_tokens: int,
) -> int:
    """Pool blocks one ``max_model_len`` request takes, summed over groups.

    The same on every stage: a worker keeps every group, empty or not
    (``_project_kv_cache_groups_to_worker``).
    """
    return sum(
        g.spec.blocks_per_request(
            block_size=block_size,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
        )
        for g in groups
    )


def max_in_flight_tokens(
    max_num_batched_tokens: int, max_concurrent_batches: int
) -> int:
    """``VllmConfig.max_in_flight_tokens``: what a sliding window must keep extra."""
    return max_num_batched_tokens * max_concurrent_batches


def default_max_concurrent_batches(pp: int, platform: str) -> int:
    """``VllmConfig.max_concurrent_batches`` for vLLM's defaults.

    CPU turns async scheduling off (platforms/cpu.py): PP size. CUDA enables
    async scheduling with the V2 model runner by default: PP size + 1.
    """
    return pp if platform == "cpu" else pp + 1


# ------------------------------------------------------------ partitions


def default_partition(num_layers: int, pp: int) -> list[int]:
    """vLLM's split without VLLM_PP_LAYER_PARTITION (``get_pp_indices``).

    Layers are split evenly; the remainder goes one layer each to the stages
    before the last, starting from the second-to-last and moving towards the
    first (the last stage also holds the final norm and lm_head).
    """
    if pp < 1:
        raise ValueError(f"--pipeline-parallel-size={pp}: must be at least 1")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def parse_partition(text: str | Sequence[int], num_layers: int, pp: int) -> list[int]:
    """Check a VLLM_PP_LAYER_PARTITION-style split and return it as ints."""
    example = ",".join(map(str, default_partition(num_layers, pp)))
    if isinstance(text, str):
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(
                f"--pp-layer-partition={text!r}: use comma-separated layer counts, "
                f"one per pipeline stage, e.g. {example}"
            ) from None
    else:
        parts = list(text)
    shown = ",".join(map(str, parts))
    if len(parts) != pp:
        raise ValueError(
            f"--pp-layer-partition={shown} has {len(parts)} stages but "
            f"--pipeline-parallel-size is {pp}; give {pp} counts, e.g. {example}"
        )
    if sum(parts) != num_layers:
        raise ValueError(
            f"--pp-layer-partition={shown} adds up to {sum(parts)} layers but the "
            f"model has {num_layers}; the counts must sum to {num_layers}, "
            f"e.g. {example}"
        )
    if min(parts) < 1:
        raise ValueError(
            f"--pp-layer-partition={shown}: every stage needs at least one layer, "
            f"e.g. {example}"
        )
    return parts


def stage_ranges(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` layer indices of each stage."""
    bounds = [0, *_accumulate(partition)]
    return list(zip(bounds[:-1], bounds[1:]))


def _accumulate(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


# -------------------------------------------------------------- capacity


def vllm_capacity(
    num_blocks: int, blocks_per_request: int, max_model_len: int
) -> tuple[int, float]:
    """What vLLM logs: "KV cache size: N tokens", "Maximum concurrency: C x".

    ``get_max_concurrency_for_kv_cache_config`` divides *all* blocks (the null
    block included) by the blocks one request needs, and ``get_kv_cache_capacity``
    prints ``int(concurrency * max_model_len)``. Same float expression, so the
    same number.
    """
    concurrency = num_blocks / blocks_per_request
    return int(concurrency * max_model_len), concurrency


def min_tokens(blocks_per_request: int, max_model_len: int) -> int:
    """Least ``--kv-cache-tokens`` that starts: one more than ``bpr - 1``
    blocks hold, so that the budget buys ``bpr`` usable blocks (one request)
    beside the null block."""
    return (
        vllm_capacity(blocks_per_request - 1, blocks_per_request, max_model_len)[0] + 1
    )


def min_blocks(blocks_per_request: int) -> int:
    """Fewest blocks vLLM starts with: one request plus the null block.

    ``get_kv_cache_configs`` checks ``memory - bytes_per_block >= bytes one
    max_model_len request needs`` on every worker.
    """
    return blocks_per_request + 1


@dataclass(frozen=True)
class StageCapacity:
    """One pipeline stage (each TP rank of it holds the same)."""

    stage: int
    start: int
    end: int
    kv_bytes_per_token: int
    bytes_per_block: int
    budget_bytes: int  # what this stage's workers are handed
    handed_blocks: int  # budget_bytes // bytes_per_block, before vLLM's cut
    handed_tokens: int  # what vLLM <= 0.10 logged per rank (seed 000)
    handed_concurrency: float
    num_blocks: int  # after every stage is cut to the smallest count
    kv_bytes: int  # allocated: num_blocks * bytes_per_block

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Capacity:
    """The KV cache a budget gives a pipeline, in vLLM's own figures."""

    mode: str  # "per-gpu" (vLLM default), "proportional", "tokens"
    budget_bytes: int  # per GPU (per-gpu) or pipeline-wide per TP shard
    num_blocks: int
    tokens: int  # vLLM's "KV cache size: N tokens"
    concurrency: float  # vLLM's "Maximum concurrency"
    usable_tokens: int  # (num_blocks - 1) * block_size: the null block excluded
    blocks_per_request: int
    min_budget: int  # least budget that starts, in bytes (tokens for "tokens")
    stages: list[StageCapacity] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.num_blocks >= min_blocks(self.blocks_per_request)

    @property
    def total_kv_bytes(self) -> int:
        """KV bytes one TP shard of the pipeline allocates."""
        return sum(s.kv_bytes for s in self.stages)


def min_budget(
    bytes_per_block: Sequence[int], blocks_per_request: int, *, proportional: bool
) -> int:
    """Least ``--kv-cache-memory-bytes`` that holds one request plus the null block."""
    need = min_blocks(blocks_per_request)
    if proportional:
        return kv_arith.min_budget_for(
            [need * b for b in bytes_per_block], bytes_per_block
        )
    return need * max(bytes_per_block)


def capacity_for_budget(
    bytes_per_block: Sequence[int],
    *,
    budget_bytes: int,
    blocks_per_request: int,
    max_model_len: int,
    block_size: int,
    proportional: bool,
    ranges: Sequence[tuple[int, int]] | None = None,
    bytes_per_token: Sequence[int] | None = None,
) -> Capacity:
    """Capacity of ``--kv-cache-memory-bytes budget_bytes``, with or without the split.

    Without ``--enable-pp-prop-kv-cache`` every worker is handed the whole
    budget and vLLM cuts every stage to the smallest block count
    (``get_kv_cache_configs``). With it, the budget is pipeline-wide and split
    by bytes per block (``kv_arith.split_budget``), so every stage gets the
    same count.
    """
    if budget_bytes <= 0:
        raise ValueError(
            f"--kv-cache-memory-bytes={budget_bytes}: must be positive, e.g. 5G"
        )
    if proportional:
        budgets = [
            s.share_bytes for s in kv_arith.split_budget(budget_bytes, bytes_per_block)
        ]
    else:
        budgets = [budget_bytes] * len(bytes_per_block)
    return _capacity(
        "proportional" if proportional else "per-gpu",
        budget_bytes,
        budgets,
        bytes_per_block,
        blocks_per_request=blocks_per_request,
        max_model_len=max_model_len,
        block_size=block_size,
        min_budget=min_budget(
            bytes_per_block, blocks_per_request, proportional=proportional
        ),
        ranges=ranges,
        bytes_per_token=bytes_per_token,
    )


def capacity_for_tokens(
    bytes_per_block: Sequence[int],
    *,
    tokens: int,
    blocks_per_request: int,
    max_model_len: int,
    block_size: int,
    ranges: Sequence[tuple[int, int]] | None = None,
    bytes_per_token: Sequence[int] | None = None,
) -> Capacity:
    """Capacity of a token budget: every stage gets exactly its blocks' bytes.

    The same with and without the proportional split: each stage is handed
    ``blocks_for_tokens(tokens) * bytes_per_block`` of its own.
    """
    blocks = kv_arith.blocks_for_tokens(
        tokens,
        lambda n: vllm_capacity(n, blocks_per_request, max_model_len)[0],
        guess=cdiv(tokens * blocks_per_request, max_model_len),
    )
    budgets = [blocks * b for b in bytes_per_block]
    return _capacity(
        "tokens",
        sum(budgets),
        budgets,
        bytes_per_block,
        blocks_per_request=blocks_per_request,
        max_model_len=max_model_len,
        block_size=block_size,
        min_budget=min_tokens(blocks_per_request, max_model_len),
        ranges=ranges,
        bytes_per_token=bytes_per_token,
    )


def _capacity(
    mode: str,
    budget_bytes: int,
    budgets: Sequence[int],
    bytes_per_block: Sequence[int],
    *,
    blocks_per_request: int,
    max_model_len: int,
    block_size: int,
    min_budget: int,
    ranges: Sequence[tuple[int, int]] | None,
    bytes_per_token: Sequence[int] | None,
) -> Capacity:
    handed = [b // bpb for b, bpb in zip(budgets, bytes_per_block)]
    num_blocks = min(handed)
    ranges = ranges or [(0, 0)] * len(budgets)
    bytes_per_token = bytes_per_token or [0] * len(budgets)
    stages = []
    for s, (budget, bpb, n) in enumerate(zip(budgets, bytes_per_block, handed)):
        tok, conc = vllm_capacity(n, blocks_per_request, max_model_len)
        stages.append(
            StageCapacity(
                stage=s,
                start=ranges[s][0],
                end=ranges[s][1],
                kv_bytes_per_token=bytes_per_token[s],
                bytes_per_block=bpb,
                budget_bytes=budget,
                handed_blocks=n,
                handed_tokens=tok,
                handed_concurrency=conc,
                num_blocks=num_blocks,
                kv_bytes=num_blocks * bpb,
            )
        )
    tokens, concurrency = vllm_capacity(num_blocks, blocks_per_request, max_model_len)
    return Capacity(
        mode=mode,
        budget_bytes=budget_bytes,
        num_blocks=num_blocks,
        tokens=tokens,
        concurrency=concurrency,
        usable_tokens=max(0, num_blocks - 1) * block_size,
        blocks_per_request=blocks_per_request,
        min_budget=min_budget,
        stages=stages,
    )


@dataclass(frozen=True)
class BudgetNeed:
    """Budget for a target concurrency at max_model_len, both ways."""

    concurrency: float
    num_blocks: int  # per stage, null block included
    per_gpu_bytes: int  # --kv-cache-memory-bytes without the split
    proportional_bytes: int  # --kv-cache-memory-bytes with --enable-pp-prop-kv-cache
    tokens: int  # --kv-cache-tokens that gives the same blocks (vLLM's figure)
    allocated_bytes: int  # KV one TP shard of the pipeline allocates (either way)


def budget_for_concurrency(
    bytes_per_block: Sequence[int],
    *,
    concurrency: float,
    blocks_per_request: int,
    max_model_len: int,
) -> BudgetNeed:
    """Least budget so that ``concurrency`` max-length requests really fit.

    Blocks: ``ceil(concurrency * blocks_per_request)`` usable plus the null
    block (vLLM's logged concurrency, which counts the null block, will read
    slightly higher). Without the split every GPU must be handed what the
    fattest stage needs; with it, the pipeline needs the sum over stages.
    """
    if not concurrency > 0:
        raise ValueError(
            f"--target-concurrency={concurrency}: must be positive, e.g. 4 or 1.5"
        )
    usable = math.ceil(Fraction(str(concurrency)) * blocks_per_request)
    blocks = max(usable, blocks_per_request) + 1
    return BudgetNeed(
        concurrency=concurrency,
        num_blocks=blocks,
        per_gpu_bytes=blocks * max(bytes_per_block),
        proportional_bytes=blocks * sum(bytes_per_block),
        # --kv-cache-tokens buys the null block beside the tokens it names.
        tokens=vllm_capacity(blocks - 1, blocks_per_request, max_model_len)[0],
        allocated_bytes=blocks * sum(bytes_per_block),
    )
