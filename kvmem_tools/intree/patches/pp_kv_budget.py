"""[Core] Pipeline-proportional KV cache budget (``enable_pp_prop_kv_cache``).

The split sits where vLLM plans the KV caches, after the
``num_gpu_blocks_override`` block of ``get_kv_cache_configs``: each worker's
available memory becomes its stage's share of ``kv_cache_memory_bytes``, so
vLLM's own auto-fit, capacity check and minimum-block trim apply unchanged.
The arithmetic is ``_split_kv_budget``, whose body is that of the plugin's
``vllm_kvmem.core.kv_arith.split_kv_budget`` (``tests/test_intree.py`` holds
them equal).
"""

from kvmem_tools.intree.edits import Edit, NewFile, appended
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "pp_kv_budget"
ENGINE_TEST = "tests/v1/e2e/general/test_pp_kv_cache_budget.py"
#: The unit tests join vLLM's planner tests (0.33: test_kv_cache_planning.py;
#: 0.32: test_kv_cache_utils.py, where the planner was); the flag's, its
#: engine argument tests.
UNIT_TESTS = {
    "0.33": "tests/v1/core/test_kv_cache_planning.py",
    "0.32": "tests/v1/core/test_kv_cache_utils.py",
}
ARG_TEST = "tests/engine/test_arg_utils.py"
_APPENDED = FILES / SLUG / "appended" / UNIT_TESTS["0.33"]

MESSAGE = pr_text(
    overview="""\
`--enable-pp-prop-kv-cache` makes `--kv-cache-memory-bytes` the KV cache
budget of the whole pipeline (per tensor-parallel shard) instead of each
device's. vLLM already gives every stage the block count of the most
constrained stage and trims the other stages' tensors to it (#25164); this
PR changes only the budget's unit, from the heaviest device's bytes to the
pipeline's.""",
    claims=[
        "With the flag, the KV caches of all stages together take at most "
        "`--kv-cache-memory-bytes` (per tensor-parallel shard), whatever the "
        "layer split (`VLLM_PP_LAYER_PARTITION=56,8`, stages with different "
        "layer types).",
        "Every stage holds the same number of blocks: "
        "`budget // sum(bytes per block of every stage)`.",
        "Off by default; no change to any other path.",
    ],
    validation=f"""\
On CPU (vLLM's CPU build, pipeline ranks as processes), vLLM 0.32.0 and
0.33.0; not run on GPUs:

- `pytest {UNIT_TESTS["0.33"]} -k pp_prop_kv_cache`: 7 passed; on 0.32,
  where the planner was in `kv_cache_utils.py`,
  `pytest {UNIT_TESTS["0.32"]} -k pp_prop_kv_cache`: 7 passed. Added to
  vLLM's planner tests; synthetic per-worker specs (6/2 and 4/4 layers, 2
  and 8 KV heads, TP 2 x PP 2), no model: shares follow the bytes per
  block, one block count on every stage, the sum within the budget; a stage
  without KV cache layers and workers out of stage order are refused; an
  attention-free model keeps its memory; the flag needs
  `--kv-cache-memory-bytes`.
- `pytest {ARG_TEST} -k pp_prop_kv_cache`: 1 passed (the flag reaches the
  engine arguments).
- `pytest {ENGINE_TEST}`: 1 passed. A pipeline of 2 on
  `hmellor/tiny-random-LlamaForCausalLM` (layers 6 and 2, float32, 128-token
  blocks of 128 KiB per layer), budget 24 MiB: 24 blocks on each stage,
  18 MiB and 6 MiB, the budget to the byte; greedy output generated.
- Against vLLM without the flag, given `--kv-cache-memory-bytes` = the
  heaviest stage's share (B x max/sum of bytes per block) on every worker:
  the same blocks, tensors, `max_model_len` and refusals on 12 uneven
  pipelines (`get_kv_cache_configs` of 0.32.0 and 0.33.0; Qwen3-32B 56/8 at
  5 GiB: 1280 blocks, 4.375 + 0.625 GiB either way, where 5 GiB per device
  takes 1.14x that). This PR changes the budget's unit, not the layout.""",
    details="""\
Without the flag, `--kv-cache-memory-bytes` is what each device may use:
the stage with the most KV bytes per block sets the block count, and since
#25164 the lighter stages allocate only that many blocks of their own size.
So the pipeline's total is the figure times the sum of the stages' bytes per
block over the heaviest stage's, which depends on the split and the layer
types. The same allocation is reachable today by setting the per-device
figure to the heaviest stage's share; the flag computes that share from a
pipeline total instead, right after the `num_gpu_blocks_override` block, so
auto-fit of `--max-model-len auto`, the capacity check and the trim run
unchanged. `num_gpu_blocks_override` wins (one warning). A stage without KV
cache layers is refused by name. Workers must arrive in rank order,
stage-major, as the executor gathers them: this is checked (workers of one
stage hold the same layers), not assumed.

One knob: this PR keeps a byte budget. Sizing the cache in tokens
(`--kv-cache-tokens`, a separate PR) also gives every stage the same block
count, from a token figure; neither PR needs the other.""",
    duplicates="""\
searched the vLLM tracker for KV cache sizing under pipeline parallelism.
#25164 (merged) trims every stage's tensors to the common block count: this
PR builds on it and changes only what the budget counts. #33698 (merged)
fixed the memory check for pipeline stages, and #34076 (open bug; its PRs
#34078 and #34080 closed) is about which worker bounds `max_model_len` with
uneven stages; neither makes the budget pipeline-wide. The AGENTS.md `gh`
searches are for the submitter to rerun before opening.""",
    design_fit=Answer(
        False,
        "Open: ~97 lines, most in the core planner, off by default, for a "
        "change of unit over what #25164 already does.",
    ),
    testing=Answer(
        False,
        "The unit tests run in CI's CPU `v1/core` step (`cpu_test`); the engine "
        "test needs 2 devices and is wired into no 2-GPU step; not run on GPUs.",
    ),
    code_quality=Answer(
        False, "Clear and short, but no docs page yet (only the flag's help)."
    ),
    contents=Answer(
        True,
        "Summary, related PRs, claims with evidence; the equivalence with "
        "vLLM's per-device figure measured.",
    ),
)

_FIELD = '''

    enable_pp_prop_kv_cache: bool = False
    """Treat `kv_cache_memory_bytes` as one budget for the whole pipeline (per
    tensor-parallel shard) and split it across the pipeline stages so that
    every stage holds the same number of blocks, each of its own KV bytes per
    block. Requires `kv_cache_memory_bytes`."""'''

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
def _split_kv_budget(budget: int, stage_bytes_per_block: list[int]) -> list[int]:
    num_blocks = budget // sum(stage_bytes_per_block)
    return [num_blocks * b for b in stage_bytes_per_block]


def _split_kv_budget_across_pp_stages(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    bytes_per_block: list[int],
    available_memory: list[int],
) -> list[int]:
    """Each worker's share of `kv_cache_memory_bytes` with
    `enable_pp_prop_kv_cache`: every stage holds the same number of blocks,
    each of its own bytes per block.

    Workers come in rank order, stage-major (checked: the workers of one
    stage hold the same layers). Every share is at most the budget, which is
    what each worker reported as its available memory.
    """
    if not any(bytes_per_block):
        return available_memory
    budget = vllm_config.cache_config.kv_cache_memory_bytes
    assert budget is not None
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    per_stage, rest = divmod(len(kv_cache_specs), pp_size)
    for worker, specs in enumerate(kv_cache_specs):
        first = worker - worker % per_stage
        if rest or specs.keys() != kv_cache_specs[first].keys():
            raise RuntimeError(
                "enable_pp_prop_kv_cache needs the workers' KV cache specs in rank "
                f"order, stage-major ({per_stage} workers a stage), but worker "
                f"{worker} does not hold the layers of worker {first}."
            )
    stage_bytes = bytes_per_block[::per_stage]
    if 0 in stage_bytes:
        empty = [stage for stage, b in enumerate(stage_bytes) if b == 0]
        raise ValueError(
            f"enable_pp_prop_kv_cache: pipeline stage(s) {empty} hold no KV cache "
            "layers, so kv_cache_memory_bytes cannot be split by KV bytes per "
            "block. Give every stage attention layers (VLLM_PP_LAYER_PARTITION) "
            "or disable enable_pp_prop_kv_cache."
        )
    shares = _split_kv_budget(budget, stage_bytes)
    logger.info(
        "Splitting kv_cache_memory_bytes (%s GiB) across %d pipeline stages: "
        "%s GiB, %d blocks on every stage.",
        format_gib(budget),
        pp_size,
        ", ".join(format_gib(share) for share in shares),
        shares[0] // stage_bytes[0],
    )
    return [shares[worker // per_stage] for worker in range(len(kv_cache_specs))]
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
    # the pipeline, split so that every stage holds the same number of blocks.
    if vllm_config.cache_config.enable_pp_prop_kv_cache:
        if override is not None:
            logger.warning(
                "num_gpu_blocks_override sets the number of KV cache blocks; "
                "enable_pp_prop_kv_cache is not applied."
            )
        else:
            available_memory = _split_kv_budget_across_pp_stages(
                vllm_config,
                kv_cache_specs,
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


def _changes(
    planner: str, bytes_per_block: str, before_planner: str, unit_test: str
) -> list:
    module = planner.removesuffix(".py").rsplit("/", 1)[1]
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
        NewFile(ENGINE_TEST, FILES / SLUG / ENGINE_TEST),
        # The unit tests join vLLM's planner tests, on their helpers.
        Edit(
            unit_test,
            "from vllm.config import (\n    CacheConfig,\n    ModelConfig,\n",
            "    ParallelConfig,\n",
        ),
        appended(
            unit_test,
            _APPENDED,
            renames=(("kv_cache_planning._split", f"{module}._split"),),
        ),
        appended(ARG_TEST, FILES / SLUG / "appended" / ARG_TEST),
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
            UNIT_TESTS["0.32"],
        ),
        "0.33": _changes(
            "vllm/v1/core/kv_cache_planning.py",
            "_pool_bytes_per_block_from_builder(builder, vllm_config, groups)",
            "def get_kv_cache_configs(\n",
            UNIT_TESTS["0.33"],
        ),
    },
)
