"""[Core] Size the KV cache in tokens (``kv_cache_tokens``).

The tokens become a block count where vLLM plans the KV caches, on the
``num_gpu_blocks_override`` path of ``get_kv_cache_configs``: each worker's
available memory becomes that many blocks of its own bytes per block, so
vLLM's auto-fit, capacity check and allocation apply unchanged. vLLM's
capacity log says the tokens left after the null block; the CPU worker
reports its node's free memory as the limit instead of failing on its
``gpu_memory_utilization`` reservation.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "kv_cache_tokens"

MESSAGE = """\
## Purpose

Operators size KV caches in tokens ("hold 400k tokens"), but vLLM takes
bytes (`--gpu-memory-utilization`, `--kv-cache-memory-bytes`) or a block
count (`--num-gpu-blocks-override`, a testing knob), and the bytes a token
takes depend on the model, the KV cache dtype and, with pipeline
parallelism, on each stage's layers (#33263).

`--kv-cache-tokens N` (human-readable: `400k`) sizes the cache in tokens.
`get_kv_cache_configs` turns N into a block count and takes the
`num_gpu_blocks_override` path with it: the fewest blocks that hold N
tokens besides the null block, counted as `get_kv_cache_capacity` counts
capacity (requests of `max_model_len` tokens, taking blocks from every KV
cache group, so hybrid models are covered). Every worker gets exactly that
many blocks of its own bytes per block, so a pipeline stage with fewer
layers allocates less. Auto-fit of `--max-model-len auto`, the capacity
check and allocation run unchanged. A budget that needs more memory than a
worker has is refused with the most tokens that fit; one that holds less
than one `max_model_len` request, or a pipeline stage without KV cache
layers (which the override path cannot size), is refused too. `CacheConfig`
refuses it next to `kv_cache_memory_bytes`, `num_gpu_blocks_override` or
`enable_pp_prop_kv_cache`.

The capacity log says what the budget bought; the planner logs each
worker's KV cache bytes:

    kv_cache_tokens=3,000: 25 KV cache blocks on every worker; KV cache per
    worker: 0.01 GiB.
    CPU KV cache size: 3,200 tokens (3,072 after the null block,
    kv_cache_tokens=3,000), Maximum concurrency for 2,048 tokens per
    request: 1.56x

The CPU worker treats the budget as an explicit size, as it does
`kv_cache_memory_bytes`: no `--gpu-memory-utilization` reservation check,
and it reports its NUMA node's available memory as the limit the budget is
checked against. GPU workers profile as before; the profiled figure is the
limit.

## Test Plan

`pytest tests/v1/core/test_kv_cache_tokens.py`: synthetic specs and a model
config without weights. Block counts for several budgets, block sizes and
`max_model_len` values (the blocks besides the null block hold the budget,
one block fewer would not), two pipeline stages of 6 and 2 layers (same
blocks, own bytes), a full + sliding window model (two groups), auto-fit,
the three refusals, the options it cannot be combined with, the flag, and
the capacity log.

A CPU engine: `LLM(model=<8-layer Llama, bf16>, kv_cache_tokens=3000,
max_model_len=2048, enforce_eager=True)` with no other memory option; the
same with `max_model_len="auto"`, with `kv_cache_memory_bytes`, and with
100M tokens.

## Test Result

The unit tests pass on CPU. The engine (128-token blocks, 512 KiB each)
gets 25 blocks: 24 for requests (3,072 tokens) and the null block, 12.5 MiB
of KV cache, and generates. With `max_model_len="auto"`, max_model_len is
fitted to 3,072. With `kv_cache_memory_bytes` it is refused by
`CacheConfig`; 100M tokens are refused with the 2,570,240 tokens that fit
in the node's 9.81 GiB. Without the CPU worker change the same engine fails
at startup when the node has less free memory than the 0.92 reservation.
"""

_FIELD = '''

    kv_cache_tokens: int | None = Field(default=None, ge=1)
    """Size of the KV cache in tokens. When set, every worker gets exactly the
    KV cache blocks needed to hold this many tokens besides the null block,
    counted as the KV cache capacity is reported (requests of `max_model_len`
    tokens). With pipeline parallelism each stage allocates those blocks for
    its own layers. Cannot be combined with `kv_cache_memory_bytes`,
    `num_gpu_blocks_override` or `enable_pp_prop_kv_cache`."""'''

_VALIDATOR = """
    @model_validator(mode="after")
    def _validate_kv_cache_tokens(self) -> "CacheConfig":
        if self.kv_cache_tokens is None:
            return self
        for other in (
            "kv_cache_memory_bytes",
            "num_gpu_blocks_override",
            "enable_pp_prop_kv_cache",
        ):
            if getattr(self, other) not in (None, False):
                raise ValueError(
                    "kv_cache_tokens sets the number of KV cache blocks of every "
                    f"worker; it cannot be combined with {other}."
                )
        return self
"""

_HELPER = '''\
def _num_blocks_for_kv_cache_tokens(
{builder_param}    vllm_config: VllmConfig,
    projected_groups_per_worker: list[list[KVCacheGroupSpec]],
    available_memory: list[int],
) -> int | None:
    """The number of KV cache blocks of every worker for `kv_cache_tokens`:
    the fewest whose usable blocks (all but the null block) hold that many
    tokens, counted as `get_kv_cache_capacity` counts them.

    Refuses a budget that needs more than a worker's available memory, or
    that holds less than one `max_model_len` request.
    """
    tokens = vllm_config.cache_config.kv_cache_tokens
    assert tokens is not None
    if not any(projected_groups_per_worker):
        return None
    empty = [
        worker
        for worker, groups in enumerate(projected_groups_per_worker)
        if not any(group.layer_names for group in groups)
    ]
    if empty:
        raise ValueError(
            f"kv_cache_tokens: worker(s) {{empty}} hold no KV cache layers; a KV "
            "cache sized in blocks needs KV cache layers on every pipeline stage "
            "(VLLM_PP_LAYER_PARTITION)."
        )
    bytes_per_block = [
        {bytes_per_block}
        for groups in projected_groups_per_worker
    ]
    # Blocks one request of max_model_len takes, summed over the KV cache groups.
    blocks_per_request = max(
        {usage} // b
        for groups, b in zip(projected_groups_per_worker, bytes_per_block)
    )
    max_model_len = vllm_config.model_config.max_model_len
    num_blocks = cdiv(tokens * blocks_per_request, max_model_len) + 1
    if (
        vllm_config.model_config.original_max_model_len != -1
        and num_blocks - 1 < blocks_per_request
    ):
        raise ValueError(
            f"kv_cache_tokens={{tokens}} holds less than one request of "
            f"max_model_len={{max_model_len}} tokens; set kv_cache_tokens to at "
            "least max_model_len, or decrease max_model_len."
        )
    for worker, (b, avail_mem) in enumerate(zip(bytes_per_block, available_memory)):
        if num_blocks * b > avail_mem:
            fits = (avail_mem // b - 1) * max_model_len // blocks_per_request
            raise ValueError(
                f"kv_cache_tokens={{tokens}} needs {{num_blocks}} KV cache blocks "
                f"({{format_gib(num_blocks * b)}} GiB) on worker {{worker}}, which has "
                f"{{format_gib(avail_mem)}} GiB available for the KV cache; at most "
                f"{{max(fits, 0)}} tokens fit."
            )
    logger.info(
        "kv_cache_tokens=%s: %d KV cache blocks on every worker; KV cache per "
        "worker: %s GiB.",
        f"{{tokens:,}}",
        num_blocks,
        ", ".join(format_gib(num_blocks * b) for b in bytes_per_block),
    )
    return num_blocks


'''

_CAPACITY_LOG = """\
    budget = ""
    if (kv_cache_tokens := vllm_config.cache_config.kv_cache_tokens) is not None:
        # The null block is never handed to a request.
        usable, _ = get_kv_cache_capacity(
            vllm_config,
            replace(kv_cache_config, num_blocks=kv_cache_config.num_blocks - 1),
        )
        budget = (
            f" ({usable:,} after the null block, kv_cache_tokens={kv_cache_tokens:,})"
        )
"""

_CPU_WORKER = """\
        if explicit_kv_cache_size is None and self.cache_config.kv_cache_tokens:
            # The engine sizes the KV cache from kv_cache_tokens and checks it
            # against the memory available on this node.
            return available_memory
"""


#: The test is written for vLLM 0.33; in 0.32 the planner is in kv_cache_utils
#: and groups the layers itself.
_TEST_RENAMES = (
    (
        "from vllm.v1.core.kv_cache_planning import (\n"
        "    get_global_kv_cache_groups,\n"
        "    get_kv_cache_configs,\n"
        ")\n"
        "from vllm.v1.core.kv_cache_utils import (\n"
        "    get_kv_cache_capacity,\n",
        "from vllm.v1.core.kv_cache_utils import (\n"
        "    get_kv_cache_capacity,\n"
        "    get_kv_cache_configs,\n",
    ),
    (
        "    groups = get_global_kv_cache_groups(config, specs)\n"
        "    return config, get_kv_cache_configs(config, specs, memory, groups)\n",
        "    return config, get_kv_cache_configs(config, specs, memory)\n",
    ),
)


_ENGINE_TEST = """

def test_kv_cache_tokens_sizes_the_cache(request, monkeypatch, engine_env):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    load_general_plugins()
    llm = LLM(
        model=MODEL,
        kv_cache_tokens=3000,
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
    )
    ranks = _ranks(llm)
    token_ids = _generate(llm)
    _write_report(request, ranks=ranks, token_ids=token_ids)

    # Every block but the null block holds the tokens; one fewer would not.
    (rank,) = ranks
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    usable = (rank["num_blocks"] - 1) * block_size
    assert usable - block_size < 3000 <= usable
    assert all(len(t) == 8 for t in token_ids)
"""


def _changes(planner: str, builder: bool) -> list:
    """The edits for one release; ``builder``: vLLM 0.33's planner, which
    takes a ``KVCacheConfigBuilder``."""
    first = "builder, " if builder else ""
    helper = _HELPER.format(
        builder_param="    builder: KVCacheConfigBuilder,\n" if builder else "",
        bytes_per_block=(
            f"_pool_bytes_per_block{'_from_builder' if builder else ''}"
            f"({first}vllm_config, groups)"
        ),
        usage=f"_max_memory_usage_bytes_from_groups({first}vllm_config, groups)",
    )
    call = f"""\
    if vllm_config.cache_config.kv_cache_tokens is not None:
        override = _num_blocks_for_kv_cache_tokens(
            {first}vllm_config, projected_groups_per_worker, available_memory
        )
"""
    changes = [
        Edit(
            "vllm/config/cache.py",
            '    (when not-None) ignores gpu_memory_utilization"""',
            _FIELD,
        ),
        Edit(
            "vllm/config/cache.py",
            '            "kv_cache_memory_bytes",\n',
            '            "kv_cache_tokens",\n',
        ),
        Edit(
            "vllm/config/cache.py",
            "            self.user_specified_block_size = True\n        return self\n",
            _VALIDATOR,
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            '                "kv_cache_memory_bytes",\n',
            '                "kv_cache_tokens",\n',
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "    kv_cache_memory_bytes: int | None = "
            "CacheConfig.kv_cache_memory_bytes\n",
            "    kv_cache_tokens: int | None = CacheConfig.kv_cache_tokens\n",
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            '            "--kv-cache-memory-bytes", '
            '**cache_kwargs["kv_cache_memory_bytes"]\n'
            "        )\n",
            "        cache_group.add_argument("
            '"--kv-cache-tokens", **cache_kwargs["kv_cache_tokens"])\n',
        ),
        Edit(
            "vllm/engine/arg_utils.py",
            "            kv_cache_memory_bytes=self.kv_cache_memory_bytes,\n",
            "            kv_cache_tokens=self.kv_cache_tokens,\n",
        ),
        Edit(
            planner,
            "    override = vllm_config.cache_config.num_gpu_blocks_override\n",
            call,
        ),
        Edit(planner, "def _project_kv_cache_groups_to_worker(\n", helper, "before"),
        Edit(
            "vllm/v1/core/kv_cache_utils.py",
            '    logger.info_once(\n        "%s KV cache size: %s tokens, "\n',
            _CAPACITY_LOG,
            where="before",
        ),
        Edit(
            "vllm/v1/core/kv_cache_utils.py",
            '        "%s KV cache size: %s tokens, "\n',
            '        "%s KV cache size: %s tokens%s, "\n',
            where="replace",
        ),
        Edit(
            "vllm/v1/core/kv_cache_utils.py",
            '        f"{num_tokens:,}",\n',
            "        budget,\n",
        ),
        Edit(
            "vllm/v1/worker/cpu_worker.py",
            "        explicit_kv_cache_size = "
            "self.cache_config.kv_cache_memory_bytes\n",
            _CPU_WORKER,
        ),
    ]
    if not builder:
        # vLLM 0.32's CPU worker also checks its reservation at startup.
        changes.append(
            Edit(
                "vllm/v1/worker/cpu_worker.py",
                "            vllm_config.cache_config.kv_cache_memory_bytes is None\n",
                "            and vllm_config.cache_config.kv_cache_tokens is None\n",
            )
        )
    changes.append(
        Edit(
            "tests/v1/e2e/test_kv_cache_budget_engine.py",
            "    assert all(len(t) == 8 for t in token_ids)\n",
            _ENGINE_TEST,
        )
    )
    changes.append(
        NewFile(
            "tests/v1/core/test_kv_cache_tokens.py",
            FILES / SLUG / "tests/v1/core/test_kv_cache_tokens.py",
            renames=() if builder else _TEST_RENAMES,
        )
    )
    return changes


PATCH = InTreePatch(
    slug=SLUG,
    subject="[Core] Size the KV cache in tokens (--kv-cache-tokens)",
    message=MESSAGE,
    changes={
        "0.32": _changes("vllm/v1/core/kv_cache_utils.py", builder=False),
        "0.33": _changes("vllm/v1/core/kv_cache_planning.py", builder=True),
    },
)
