"""[CPU] Block-outer KV cache layouts for CPU_ATTN.

CPU_ATTN declares the block-outer layouts its vec kernels serve after LBHNC,
so vLLM's own ``resolve_kv_cache_layout`` keeps LBHNC by default and gives
BLHNC to ``VLLM_KV_CACHE_LAYOUT`` or a connector's
``get_required_kvcache_layout()``. On a host with AMX tiles (whose kernels
are not validated on block-outer views) it declares LBHNC alone, as before.
Its test joins the CPU-Kernel Tests step of ``.buildkite``.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "cpu_attn_block_outer"
TEST = "tests/v1/attention/test_cpu_attn_kv_cache_layout.py"
CPU_CI = ".buildkite/hardware_tests/cpu.yaml"

MESSAGE = pr_text(
    overview="""\
`CPU_ATTN` declares `BLHNC` and `BHLNC` after `LBHNC`, so a KV connector that
asks for a block-outer layout (all layers of a block adjacent: one copy per
block) through `get_required_kvcache_layout()` gets it on CPU, as does
`VLLM_KV_CACHE_LAYOUT=BLHNC`.""",
    claims=[
        "Block-outer layouts on the CPU backend's vec and vec16 kernels, with "
        "caches and outputs bitwise equal to `LBHNC`.",
        "`LBHNC` stays the default: `resolve_kv_cache_layout` picks a "
        "block-outer layout only when the env var or a connector asks.",
        "Hosts with AMX tiles keep `LBHNC` alone: the AMX kernels are not "
        "validated on block-outer views.",
    ],
    validation=f"""\
On CPU (AVX-512, no AMX), vLLM 0.32.0 and 0.33.0:

- `pytest {TEST}`: 15 passed. Three layers in one allocation, viewed by
  `allocate_kv_cache` in `LBHNC` and in each declared layout (block-outer:
  block stride = layers x page); K/V written by `do_kv_cache_update`, then
  `forward` on a prefill, a decode and a chunked prefill (bf16, fp32, head
  size 80 on the vec16 kernels, fp8 cache): caches and outputs bitwise
  equal. Resolution: `LBHNC` by default, `BLHNC` from a connector or the
  env var.
- End to end, greedy: a random-weight Llama (8 layers, 2 KV heads, head size
  64, `enforce_eager`), five prompts x 32 tokens, twice (the second round
  reads 256 and 128 tokens from the prefix cache): with `BLHNC`, `BHLNC` and
  a connector requiring `BLHNC`, the 320 tokens and their logprobs are
  bitwise equal to the default `LBHNC` run.""",
    details=f"""\
The kernels (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
take the block and head strides from the view and need only each head's
`[N, C]` block interior dense, so `BLHNC` and `BHLNC` need no kernel change;
`LBNHC`/`BLNHC` (token-major interiors) stay out. The AMX path is untested
here (no AMX host), so the declaration is gated on
`torch.cpu._is_amx_tile_supported()`, the check `_get_attn_isa` makes. The
test joins the CPU-Kernel Tests step (`{CPU_CI}`).""",
    duplicates="""\
no open PR we know of declares block-outer layouts for `CPU_ATTN`. The `gh`
searches of AGENTS.md are for the submitter to rerun before opening.""",
    design_fit=Answer(
        True,
        "A few lines in the CPU backend's declaration, on vLLM's own layout "
        "resolution; no kernel change.",
    ),
    testing=Answer(
        False,
        "Bitwise tests in the CPU-Kernel Tests step; the AMX kernels are not "
        "covered (no AMX host), so AMX keeps `LBHNC`.",
    ),
    code_quality=Answer(True, "One comment says why block-outer views work."),
    contents=Answer(True, "Summary, claims with evidence, limitation stated."),
)

_CPU_ATTN = """\
        # The kernels take the block and head strides from the view and need
        # only each head's [N, C] interior dense, so block-outer views work on
        # the vec kernels; the AMX kernels are not validated on them.
        if torch.cpu._is_amx_tile_supported():
            return (KVCacheLayout.LBHNC,)
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.BHLNC)
"""


def ci_edits(test: str, after: str, source: str) -> list[Edit]:
    """Add ``test`` to the CPU-Kernel Tests step of ``.buildkite``, after the
    test file ``after`` in its pytest command and, with the ``source`` file
    it tests, in the file dependencies that trigger the step."""
    return [
        Edit(CPU_CI, f"  - {after}\n", f"  - {test}\n  - {source}\n"),
        Edit(CPU_CI, f"      {after} \\\n", f"      {test} \\\n"),
    ]


def _changes() -> list:
    return [
        Edit(
            "vllm/v1/attention/backends/cpu_attn.py",
            "        # The CPU backend only reads head-major block interiors.\n"
            "        return (KVCacheLayout.LBHNC,)\n",
            _CPU_ATTN,
            where="replace",
        ),
        NewFile(TEST, FILES / SLUG / TEST),
        *ci_edits(
            TEST,
            "tests/v1/attention/test_group_head_counts.py",
            "vllm/v1/attention/backends/cpu_attn.py",
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[CPU] Block-outer KV cache layouts for CPU_ATTN",
    message=MESSAGE,
    # The same edits apply to both releases' backends.
    changes={"0.32": _changes(), "0.33": _changes()},
)
