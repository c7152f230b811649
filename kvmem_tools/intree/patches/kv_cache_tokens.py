"""[Core] Size the KV cache in tokens (``kv_cache_tokens``).

The tokens become each worker's available memory where vLLM plans the KV
caches, after the ``num_gpu_blocks_override`` block of
``get_kv_cache_configs`` (not through it: no override is logged): that many
blocks of the worker's own bytes per block, so vLLM's auto-fit, capacity
check and allocation apply unchanged. vLLM's capacity log says the tokens
left after the null block; the CPU worker reports its node's free memory as
the limit instead of failing on its ``gpu_memory_utilization`` reservation.
"""

from kvmem_tools.intree.edits import Edit, NewFile, appended
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "kv_cache_tokens"
ENGINE_TEST = "tests/v1/e2e/general/test_kv_cache_tokens_engine.py"
#: The unit tests join vLLM's planner tests (0.33: test_kv_cache_planning.py;
#: 0.32: test_kv_cache_utils.py, where the planner was), on their helpers
#: (``new_kv_cache_spec``, ``get_kv_cache_configs`` of the specs alone).
UNIT_TESTS = {
    "0.33": "tests/v1/core/test_kv_cache_planning.py",
    "0.32": "tests/v1/core/test_kv_cache_utils.py",
}

MESSAGE = pr_text(
    overview="""\
`--kv-cache-tokens N` (human-readable: `400k`) sizes the KV cache in tokens:
every worker gets the fewest blocks whose usable blocks hold N tokens.
Related: #33263 and #18121 (sizing the KV cache without estimating bytes per
model).""",
    claims=[
        "Operators size the cache in tokens without working out bytes per token "
        "for the model, KV dtype and, with pipeline parallelism, each stage.",
        "Tokens are counted as `get_kv_cache_capacity` counts them (requests of "
        "`max_model_len`, every KV cache group: hybrid models covered), after "
        "the null block; each stage allocates those blocks of its own size.",
        "Refused with the most tokens that fit when a worker lacks the memory; "
        "the capacity log says what the budget bought.",
    ],
    validation=f"""\
On CPU (vLLM's CPU build), vLLM 0.32.0 and 0.33.0; not run on GPUs:

- `pytest {UNIT_TESTS["0.33"]} -k kv_cache_tokens`: 17 passed; on
  0.32, where the planner was in `kv_cache_utils.py`,
  `pytest {UNIT_TESTS["0.32"]} -k kv_cache_tokens`: 17 passed. Added to
  vLLM's planner tests, on their helpers; synthetic specs and a model config
  without weights: block counts for several budgets, block sizes and
  `max_model_len` values (the usable blocks hold the budget, one fewer would
  not), stages of 6 and 2 layers, a full + sliding window model, auto-fit,
  the three refusals, the options it cannot be combined with, the flag, the
  capacity log, and no `num_gpu_blocks_override` log line.
- `pytest {ENGINE_TEST}`: 1 passed. `hmellor/tiny-random-LlamaForCausalLM`,
  `kv_cache_tokens=3000`, `max_model_len=512`: 25 blocks (24 usable hold
  3,072 tokens, one fewer would not), and it generates.""",
    details="""\
vLLM takes bytes (`--gpu-memory-utilization`, `--kv-cache-memory-bytes`) or
a block count (`--num-gpu-blocks-override`, a testing knob). The flag sets
each worker's available memory to N's blocks of its own bytes per block
right after the `num_gpu_blocks_override` block, so auto-fit of
`--max-model-len auto`, the capacity check and allocation run unchanged, and
no "Overriding num_gpu_blocks" line is logged for a user who set no
override. It is refused with `kv_cache_memory_bytes` or
`num_gpu_blocks_override` (one size each), below one `max_model_len`
request, and with a pipeline stage without KV cache layers. The CPU worker
treats it as an explicit size, as it does `kv_cache_memory_bytes`, and
reports its NUMA node's available memory as the limit; GPU workers profile
as before.

    kv_cache_tokens=3,000: 25 KV cache blocks on every worker; KV cache per
    worker: 0.01 GiB.
    CPU KV cache size: 3,200 tokens (3,072 after the null block,
    kv_cache_tokens=3,000), Maximum concurrency for 2,048 tokens per
    request: 1.56x

One knob: every stage gets the same block count, as vLLM already gives it.
A pipeline-wide byte budget (`--enable-pp-prop-kv-cache`) is a separate PR;
neither needs the other.""",
    duplicates="""\
searched the vLLM tracker for a token-denominated KV cache size. #33263
(open feature request) asks vLLM to stop allocating more KV cache than
`max_num_seqs * max_model_len` needs, and finds `kv_cache_memory_bytes` hard
to set per model; #18121 (open) asks how to set the KV cache size. This PR
does not cap the cache automatically; it gives the figure they would set, in
tokens. #17538 (closed) only reported the token capacity. No open PR sizes
the KV cache in tokens. The AGENTS.md `gh` searches are for the submitter to
rerun before opening.""",
    design_fit=Answer(
        False,
        "Open: ~115 lines of off-by-default logic in the core planner, on "
        "vLLM's own capacity count; a reviewer may want it in its own module.",
    ),
    testing=Answer(
        False,
        "Unit tests in CI's CPU `v1/core` step (`cpu_test`); the engine test "
        "sits in the E2E Core step (one GPU) but was run on CPU only.",
    ),
    code_quality=Answer(
        False, "Clear and short, but no docs page yet (only the flag's help)."
    ),
    contents=Answer(
        True, "Summary, related issues, claims with CPU figures, trade-offs."
    ),
)

_FIELD = '''

    kv_cache_tokens: int | None = Field(default=None, ge=1)
    """Size of the KV cache in tokens. When set, every worker gets exactly the
    KV cache blocks needed to hold this many tokens besides the null block,
    counted as the KV cache capacity is reported (requests of `max_model_len`
    tokens). With pipeline parallelism each stage allocates those blocks for
    its own layers. Cannot be combined with `kv_cache_memory_bytes` or
    `num_gpu_blocks_override`."""'''

_VALIDATOR = """
    @model_validator(mode="after")
    def _validate_kv_cache_tokens(self) -> "CacheConfig":
        if self.kv_cache_tokens is None:
            return self
        for other in ("kv_cache_memory_bytes", "num_gpu_blocks_override"):
            if getattr(self, other) is not None:
                raise ValueError(
                    "kv_cache_tokens sets the number of KV cache blocks of every "
                    f"worker; it cannot be combined with {other}."
                )
        return self
"""

_HELPER = '''\
def _kv_cache_memory_for_tokens(
{builder_param}    vllm_config: VllmConfig,
    projected_groups_per_worker: list[list[KVCacheGroupSpec]],
    available_memory: list[int],
) -> list[int]:
    """Each worker's memory for the KV cache with `kv_cache_tokens`: the
    same number of blocks on every worker, the fewest whose usable blocks
    (all but the null block) hold that many tokens, counted as
    `get_kv_cache_capacity` counts them.

    Refuses a budget that needs more than a worker's available memory, or
    that holds less than one `max_model_len` request.
    """
    tokens = vllm_config.cache_config.kv_cache_tokens
    assert tokens is not None
    if not any(projected_groups_per_worker):
        return available_memory
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
    return [num_blocks * b for b in bytes_per_block]


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


_APPENDED = FILES / SLUG / "appended" / UNIT_TESTS["0.33"]
_MODEL = "from transformers import LlamaConfig\n"
_MOCK = "from unittest.mock import patch\n"
_ENGINE_ARGS = "from vllm.engine.arg_utils import EngineArgs\n"
_PARSER = "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"


def _test_edits(builder: bool) -> list:
    """The unit tests, appended to the release's planner tests, and what they
    import, where vLLM's import order puts it."""
    if builder:
        test = UNIT_TESTS["0.33"]
        return [
            Edit(test, "from types import SimpleNamespace\n", _MOCK),
            Edit(test, "import pytest\nimport torch\n", _MODEL),
            Edit(
                test,
                "from vllm.utils.mem_constants import GiB_bytes\n",
                _ENGINE_ARGS + _PARSER,
                where="before",
            ),
            appended(test, _APPENDED),
        ]
    test = UNIT_TESTS["0.32"]
    return [
        Edit(test, "from typing import Any\n", _MOCK),
        Edit(test, "import pytest\nimport torch\n", _MODEL),
        Edit(
            test, "from vllm.lora.request import LoRARequest\n", _ENGINE_ARGS, "before"
        ),
        Edit(test, "from vllm.utils.hashing import ", _PARSER, where="before"),
        appended(
            test,
            _APPENDED,
            renames=(("(kv_cache_planning, ", "(kv_cache_utils, "),),
        ),
    ]


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
        available_memory = _kv_cache_memory_for_tokens(
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
            "    # Reserve the null block BlockPool permanently holds back, so auto-fit"
            " and\n",
            call,
            where="before",
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
    changes.append(NewFile(ENGINE_TEST, FILES / SLUG / ENGINE_TEST))
    changes += _test_edits(builder)
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
