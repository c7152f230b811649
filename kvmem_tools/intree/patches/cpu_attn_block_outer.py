"""[CPU] Block-outer KV cache layouts for CPU_ATTN.

On x86 hosts without AMX tiles (where ``_get_attn_isa`` picks only the vec
and vec16 kernels, the ones the test validates) CPU_ATTN declares the
block-outer layouts after LBHNC, so vLLM's own ``resolve_kv_cache_layout``
keeps LBHNC by default and gives BLHNC to ``VLLM_KV_CACHE_LAYOUT`` or a
connector's ``get_required_kvcache_layout()``. Every other host (AMX, and
the NEON, VSX, VXE and RVV kernels) declares LBHNC alone, as before. Its
tests join vLLM's CPU attention kernel tests (``test_cpu_attn.py``, which the
CPU-Kernel Tests step of ``.buildkite`` runs); the backend joins that step's
source dependencies.
"""

from kvmem_tools.intree.edits import Edit, appended
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "cpu_attn_block_outer"
TEST = "tests/kernels/attention/test_cpu_attn.py"
CPU_CI = ".buildkite/hardware_tests/cpu.yaml"

MESSAGE = pr_text(
    overview="""\
On x86 hosts without AMX tiles, `CPU_ATTN` declares `BLHNC` and `BHLNC` after
`LBHNC`, so a KV connector that asks for a block-outer layout (all layers of
a block adjacent: one copy per block) through `get_required_kvcache_layout()`
gets it on CPU, as does `VLLM_KV_CACHE_LAYOUT=BLHNC`. Builds on the layout
vocabulary of RFC #42082 (#51718).""",
    claims=[
        "Block-outer layouts where `_get_attn_isa` can only pick the vec and "
        "vec16 kernels (x86 without AMX tiles); those kernels give outputs "
        "bitwise equal to a cache of one layer per allocation.",
        "`LBHNC` stays the default: `resolve_kv_cache_layout` picks a "
        "block-outer layout only when the env var or a connector asks.",
        "Every other host keeps `LBHNC` alone: AMX, and the NEON, VSX, VXE and "
        "RVV kernels of Arm, POWER, s390x and RISC-V, none validated on "
        "block-outer views.",
    ],
    validation=f"""\
On one x86 host (AVX-512 with AMX tiles), vLLM 0.32.0 and 0.33.0, tests
added to vLLM's CPU attention kernel tests:

- `pytest {TEST} -k "block_outer or kv_cache_layouts"`: 14 passed.
  `varlen_with_paged_kv` (a prefill, decode and chunked-prefill batch) with
  its cache as the last of three layers in a `BLHNC` or `BHLNC` allocation,
  on the vec kernels (bf16, fp32, fp8 cache) and vec16 (head size 80):
  within the reference tolerance and bitwise equal to the same inputs on a
  cache of its own. The declaration and resolution on x86 with and without
  AMX, Arm, POWER, s390x and RISC-V (the host simulated): `LBHNC` by
  default, `BLHNC` from a connector only on x86 without AMX.
- An x86 host with AVX2 and no AVX-512 (the AVX2 build of the vec
  kernels), the same command: 12 passed, 2 skipped (the FP8 cache cases,
  which need AVX-512 or AMX, as `_get_attn_isa` says).
- Not run: any non-x86 host.""",
    details=f"""\
The kernels (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
take the block and head strides from the view and need only each head's
`[N, C]` block interior dense, so `BLHNC` and `BHLNC` need no kernel change;
`LBNHC`/`BLNHC` (token-major interiors) stay out. The declaration cannot see
the dtype or head size, so it is gated on the host: on x86 without AMX tiles
`_get_attn_isa` returns `vec` or `vec16` for every dtype, which is what the
test covers; AMX hosts (bf16 on the AMX kernels) and the other
architectures keep `LBHNC`, conservatively also for their fp32 runs. The
test file is in the CPU-Kernel Tests step already; `cpu_attn.py` joins that
step's source dependencies (`{CPU_CI}`), so changes to the backend run it.""",
    duplicates="""\
searched the vLLM tracker for CPU attention KV cache layouts: #42740 (merged)
declared the CPU backend's head-major layout, #51718 (merged, RFC #42082)
added the layout vocabulary and `supported_kv_cache_layouts()`, which this PR
extends for `CPU_ATTN`; #40075 (open) makes SimpleCPUOffloadConnector use a
cross-layer layout on GPU and is a consumer, not an overlap. None declares
block-outer layouts for `CPU_ATTN`. The AGENTS.md `gh` searches are for the
submitter to rerun before opening.""",
    design_fit=Answer(
        True,
        "A few lines in the CPU backend's declaration, on vLLM's own layout "
        "resolution; no kernel change.",
    ),
    testing=Answer(
        True,
        "Kernel and declaration tests in vLLM's CPU attention suite, run by "
        "the CPU-Kernel Tests step, on AVX-512 and AVX2 hosts.",
    ),
    code_quality=Answer(True, "One comment says why block-outer views work."),
    contents=Answer(True, "Summary, related PRs, claims with evidence, limits stated."),
)

_CPU_ATTN = """\
        # The vec and vec16 kernels take the block and head strides from the
        # view and need only each head's [N, C] interior dense. They are the
        # only kernels _get_attn_isa picks on x86 without AMX tiles.
        if (
            current_platform.get_cpu_architecture() != CpuArchEnum.X86
            or torch.cpu._is_amx_tile_supported()
        ):
            return (KVCacheLayout.LBHNC,)
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.BHLNC)
"""


def ci_edits(test: str, after: str, source: str) -> list[Edit]:
    """Add ``test`` (a file, or a test in it) to the CPU-Kernel Tests step of
    ``.buildkite``, after the test file ``after`` in its pytest command and,
    with the ``source`` file it tests, in the file dependencies that trigger
    the step."""
    file = test.split("::")[0]
    return [
        Edit(CPU_CI, f"  - {after}\n", f"  - {file}\n  - {source}\n"),
        Edit(CPU_CI, f"      {after} \\\n", f"      {test} \\\n"),
    ]


_TEST_ALLOCATION = """\
    packed_key_value_cache = torch.empty(
        num_blocks, num_kv_heads, block_size, head_size * 2, dtype=cache_dtype
    )
"""

_TEST_RETURN = """\
        atol, rtol = 1.5e-2, 1e-2

    (
        torch.testing.assert_close(out_with_split, ref_output, atol=atol, rtol=rtol),
        f"{torch.max(torch.abs(out_with_split - ref_output))}",
    )
    (
        torch.testing.assert_close(out_without_split, ref_output, atol=atol, rtol=rtol),
        f"{torch.max(torch.abs(out_without_split - ref_output))}",
    )
"""


def _changes(kv_cache_interface_after: str) -> list:
    """The edits; ``kv_cache_interface_after``: the import line of the test
    file that the ``vllm.v1.kv_cache_interface`` import follows."""
    return [
        Edit(
            "vllm/v1/attention/backends/cpu_attn.py",
            "        # The CPU backend only reads head-major block interiors.\n"
            "        return (KVCacheLayout.LBHNC,)\n",
            _CPU_ATTN,
            where="replace",
        ),
        # The test extends vLLM's CPU attention kernel tests: the paged-KV
        # helper can place the cache in one layer of a block-outer allocation
        # and returns its output.
        Edit(
            TEST,
            "from vllm.model_executor.kernels.linear.zentorch_utils import "
            "has_zentorch_op\n",
            "from vllm.config import KVTransferConfig, VllmConfig\n"
            "from vllm.distributed.kv_transfer.kv_connector.v1.base import "
            "KVConnectorBase_V1\n",
            where="before",
        ),
        Edit(
            TEST,
            "from vllm.v1.attention.backends.cpu_attn import _get_attn_isa\n",
            "from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, "
            "_get_attn_isa\n",
            where="replace",
        ),
        Edit(
            TEST,
            "    zentorch_sdpa_attn,\n)\n",
            "from vllm.v1.attention.backends.utils import (\n"
            "    get_supported_kv_cache_layouts,\n"
            "    resolve_kv_cache_layout,\n"
            ")\n",
        ),
        Edit(
            TEST,
            kv_cache_interface_after,
            "from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout\n",
        ),
        Edit(
            TEST,
            "    s_aux_dtype: torch.dtype = torch.bfloat16,\n) -> None:\n",
            "    s_aux_dtype: torch.dtype = torch.bfloat16,\n"
            "    block_outer_layout: str | None = None,\n"
            ") -> torch.Tensor:\n",
            where="replace",
        ),
        Edit(
            TEST,
            _TEST_ALLOCATION,
            "    if block_outer_layout is None:\n"
            + _TEST_ALLOCATION.replace("\n    ", "\n        ").replace(
                "    packed", "        packed", 1
            )
            + "    else:\n"
            "        packed_key_value_cache = _block_outer_layer(\n"
            "            block_outer_layout,\n"
            "            num_blocks,\n"
            "            num_kv_heads,\n"
            "            block_size,\n"
            "            head_size * 2,\n"
            "            cache_dtype,\n"
            "        )\n",
            where="replace",
        ),
        Edit(TEST, _TEST_RETURN, "    return out_without_split\n"),
        appended(TEST, FILES / SLUG / "appended" / TEST),
        # Changes to the backend trigger the CPU-Kernel Tests step, which
        # runs the test file already.
        Edit(CPU_CI, f"  - {TEST}\n", "  - vllm/v1/attention/backends/cpu_attn.py\n"),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[CPU] Block-outer KV cache layouts for CPU_ATTN",
    message=MESSAGE,
    changes={
        "0.32": _changes("    resolve_kv_cache_layout,\n)\n"),
        "0.33": _changes(
            "from vllm.v1.attention.selector import AttentionSelectorConfig\n"
        ),
    },
)
