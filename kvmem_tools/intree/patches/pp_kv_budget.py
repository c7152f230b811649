"""[Core] Pipeline-proportional KV cache budget (``enable_pp_prop_kv_cache``).

The split sits where vLLM plans the KV caches, beside the
``num_gpu_blocks_override`` block of ``get_kv_cache_configs``: each worker's
available memory becomes its stage's share of ``kv_cache_memory_bytes``, so
vLLM's own auto-fit, capacity check and minimum-block trim apply unchanged.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "pp_kv_budget"

MESSAGE = """\
## Purpose

With pipeline parallelism, `--kv-cache-memory-bytes` is a per-GPU figure:
every stage reserves it, and the engine then cuts every stage to the block
count of the stage with the most KV bytes per block (#25164 trims the
tensors). With unequal stages (`VLLM_PP_LAYER_PARTITION=56,8`, or a model
whose stages hold different layer types) the lighter stages reserve memory
they never use, and an operator cannot say how much KV memory the whole
pipeline should take.

`--enable-pp-prop-kv-cache` makes `--kv-cache-memory-bytes` one budget for
the pipeline (per tensor-parallel shard): `get_kv_cache_configs` gives each
stage `budget // sum(bytes per block of every stage) * its bytes per block`,
so every stage holds the same number of blocks and the stages together stay
within the budget. It sits beside the `num_gpu_blocks_override` block and,
like it, only changes each worker's available memory: auto-fit of
`--max-model-len auto`, the capacity check and the minimum-block trim run
unchanged. A stage that holds no KV cache layer is refused by name; with
`num_gpu_blocks_override` set, the override wins (one warning).

Related: #50821, #52921 (block counts across PP ranks).

## Test Plan

`pytest tests/v1/core/test_pp_kv_budget.py`: synthetic per-worker specs
(6/2 and 4/4 layers, 2 and 8 KV heads, TP 2 x PP 2), no model: the shares
follow the bytes per block, every stage holds the same block count, the sum
stays within the budget, an empty stage is refused by name, an
attention-free model keeps its memory, and the flag requires
`--kv-cache-memory-bytes`.
`pytest tests/v1/e2e/test_kv_cache_budget_engine.py`: a pipeline of 2 on
`hmellor/tiny-random-LlamaForCausalLM`; every stage holds the blocks of the
proportional split, within the budget.

## Test Result

All pass on CPU (vLLM's CPU build). The engine test, a pipeline of 2
(layers 6 and 2, float32, 128-token blocks of 128 KiB per layer) with a
24 MiB budget: 24 blocks on each stage, 18 MiB and 6 MiB, the budget to the
byte.
"""

_FIELD = '''

    enable_pp_prop_kv_cache: bool = False
    """Treat `kv_cache_memory_bytes` as one budget for the whole pipeline (per
    tensor-parallel shard) and split it across the pipeline stages in
    proportion to each stage's KV cache bytes per block, so that every stage
    holds the same number of blocks. Requires `kv_cache_memory_bytes`."""'''

_VALIDATOR = """\
    @model_validator(mode="after")
    def _validate_enable_pp_prop_kv_cache(self) -> "CacheConfig":
        if self.enable_pp_prop_kv_cache and self.kv_cache_memory_bytes is None:
            raise ValueError(
                "enable_pp_prop_kv_cache splits kv_cache_memory_bytes across the "
                "pipeline stages; set kv_cache_memory_bytes as well."
            )
        return self
"""

_SPLIT = '''\
def _split_kv_budget_across_pp_stages(
    vllm_config: VllmConfig,
    bytes_per_block: list[int],
    available_memory: list[int],
) -> list[int]:
    """Each worker's share of `kv_cache_memory_bytes` with
    `enable_pp_prop_kv_cache`: in proportion to its stage's KV bytes per
    block, so that every stage holds the same number of blocks.

    Workers come in rank order, stage-major, and the workers of one stage
    hold the same layers. Every share is at most the budget, which is what
    each worker reported as its available memory.
    """
    if not any(bytes_per_block):
        return available_memory
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    assert budget is not None
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    stage_bytes = bytes_per_block[:: len(bytes_per_block) // pp_size]
    if 0 in stage_bytes:
        empty = [stage for stage, b in enumerate(stage_bytes) if b == 0]
        raise ValueError(
            f"enable_pp_prop_kv_cache: pipeline stage(s) {empty} hold no KV cache "
            "layers, so kv_cache_memory_bytes cannot be split by KV bytes per "
            "block. Give every stage attention layers (VLLM_PP_LAYER_PARTITION) "
            "or disable enable_pp_prop_kv_cache."
        )
    num_blocks = budget // sum(stage_bytes)
    logger.info(
        "Splitting kv_cache_memory_bytes (%s GiB) across %d pipeline stages by "
        "KV bytes per block: %s GiB, %d blocks on every stage.",
        format_gib(budget),
        pp_size,
        ", ".join(format_gib(num_blocks * b) for b in stage_bytes),
        num_blocks,
    )
    return [num_blocks * b for b in bytes_per_block]
'''


def _conditional(bytes_per_block: str) -> str:
    """``bytes if worker_spec else 0``, wrapped as ruff wraps it where it is
    too long for one line at its indent (20 spaces)."""
    line = f"{bytes_per_block} if worker_spec else 0"
    if 20 + len(line) <= 88:
        return line
    return f"{bytes_per_block}\n{' ' * 20}if worker_spec\n{' ' * 20}else 0"


def _planner_edit(path: str, bytes_per_block: str) -> Edit:
    return Edit(
        path,
        "    # Reserve the null block BlockPool permanently holds back, so auto-fit"
        " and\n",
        f"""\
    # With `enable_pp_prop_kv_cache`, `kv_cache_memory_bytes` is one budget for
    # the pipeline: each stage gets a share in proportion to its bytes per block.
    if vllm_config.cache_config.enable_pp_prop_kv_cache:
        if override is not None:
            logger.warning(
                "num_gpu_blocks_override sets the number of KV cache blocks; "
                "enable_pp_prop_kv_cache is not applied."
            )
        else:
            available_memory = _split_kv_budget_across_pp_stages(
                vllm_config,
                [
                    {_conditional(bytes_per_block)}
                    for groups, worker_spec in zip(
                        projected_groups_per_worker, kv_cache_specs
                    )
                ],
                available_memory,
            )

""",
        where="before",
    )


def _changes(planner: str, bytes_per_block: str, before_planner: str) -> list:
    module = planner.removesuffix(".py").replace("/", ".")
    return [
        Edit(
            "vllm/config/cache.py",
            '    (when not-None) ignores gpu_memory_utilization"""',
            _FIELD,
        ),
        Edit(
            "vllm/config/cache.py",
            '            "kv_cache_memory_bytes",\n',
            '            "enable_pp_prop_kv_cache",\n',
        ),
        Edit(
            "vllm/config/cache.py",
            '    @field_validator("cache_dtype", mode="after")\n',
            _VALIDATOR + "\n",
            where="before",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "    kv_cache_memory_bytes: int | None = "
            "CacheConfig.kv_cache_memory_bytes\n",
            "    enable_pp_prop_kv_cache: bool = CacheConfig.enable_pp_prop_kv_cache\n",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            '            "--kv-cache-memory-bytes", '
            '**cache_kwargs["kv_cache_memory_bytes"]\n'
            "        )\n",
            "        cache_group.add_argument(\n"
            '            "--enable-pp-prop-kv-cache",\n'
            '            **cache_kwargs["enable_pp_prop_kv_cache"],\n'
            "        )\n",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "            kv_cache_memory_bytes=self.kv_cache_memory_bytes,\n",
            "            enable_pp_prop_kv_cache=self.enable_pp_prop_kv_cache,\n",
        ),
        _planner_edit(planner, bytes_per_block),
        Edit(planner, before_planner, _SPLIT + "\n\n", where="before"),
        NewFile(
            "tests/v1/e2e/test_kv_cache_budget_engine.py",
            FILES / SLUG / "tests/v1/e2e/test_kv_cache_budget_engine.py",
        ),
        NewFile(
            "tests/v1/core/test_pp_kv_budget.py",
            FILES / SLUG / "tests/v1/core/test_pp_kv_budget.py",
            renames=(("vllm.v1.core.kv_cache_planning", module),),
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[Core] Pipeline-proportional KV cache budget",
    message=MESSAGE,
    changes={
        "0.32": _changes(
            "vllm/v1/core/kv_cache_utils.py",
            "_pool_bytes_per_block(vllm_config, groups)",
            "def get_kv_cache_configs(\n",
        ),
        "0.33": _changes(
            "vllm/v1/core/kv_cache_planning.py",
            "_pool_bytes_per_block_from_builder(builder, vllm_config, groups)",
            "def get_kv_cache_configs(\n",
        ),
    },
)
