"""[CPU] Block-outer KV cache layouts for CPU_ATTN.

On x86 hosts without AMX tiles (where ``_get_attn_isa`` picks only the vec
and vec16 kernels, the ones the test validates) CPU_ATTN declares the
block-outer layouts after LBHNC, so vLLM's own ``resolve_kv_cache_layout``
keeps LBHNC by default and gives BLHNC to ``VLLM_KV_CACHE_LAYOUT`` or a
connector's ``get_required_kvcache_layout()``. Every other host (AMX, and
the NEON, VSX, VXE and RVV kernels) declares LBHNC alone, as before.
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
On x86 hosts without AMX tiles, `CPU_ATTN` declares `BLHNC` and `BHLNC` after
`LBHNC`, so a KV connector that asks for a block-outer layout (all layers of
a block adjacent: one copy per block) through `get_required_kvcache_layout()`
gets it on CPU, as does `VLLM_KV_CACHE_LAYOUT=BLHNC`. Builds on the layout
vocabulary of RFC #42082 (#51718).""",
    claims=[
        "Block-outer layouts where `_get_attn_isa` can only pick the vec and "
        "vec16 kernels (x86 without AMX tiles), with caches and outputs "
        "bitwise equal to `LBHNC`.",
        "`LBHNC` stays the default: `resolve_kv_cache_layout` picks a "
        "block-outer layout only when the env var or a connector asks.",
        "Every other host keeps `LBHNC` alone: AMX, and the NEON, VSX, VXE and "
        "RVV kernels of Arm, POWER, s390x and RISC-V, none validated on "
        "block-outer views.",
    ],
    validation=f"""\
On one x86 host (AVX-512 with AMX tiles), vLLM 0.32.0 and 0.33.0:

- `pytest {TEST}`: 16 passed with AMX reported absent
  (`torch.cpu._is_amx_tile_supported` patched to return False, so every
  dtype runs the vec kernels, as on an AVX-512 host without AMX); on the
  host as it is, 11 passed and 5 skipped (the cases on the AMX kernels, and
  the connector case: `LBHNC` alone is declared there). Three layers in one
  allocation, viewed by `allocate_kv_cache` in `LBHNC` and in `BLHNC` and
  `BHLNC` (block stride = layers x page); K/V written by
  `do_kv_cache_update`, then `forward` on a prefill, a decode and a chunked
  prefill (bf16, fp32, head size 80 on the vec16 kernels, fp8 cache):
  caches and outputs bitwise equal. Resolution: `LBHNC` by default, `BLHNC`
  from a connector or the env var; `LBHNC` alone on AMX and non-x86 hosts
  (simulated).
- Not run: the AVX2 build of the vec kernels; any non-x86 host.""",
    details=f"""\
The kernels (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
take the block and head strides from the view and need only each head's
`[N, C]` block interior dense, so `BLHNC` and `BHLNC` need no kernel change;
`LBNHC`/`BLNHC` (token-major interiors) stay out. The declaration cannot see
the dtype or head size, so it is gated on the host: on x86 without AMX tiles
`_get_attn_isa` returns `vec` or `vec16` for every dtype, which is what the
test covers; AMX hosts (bf16 on the AMX kernels) and the other
architectures keep `LBHNC`, conservatively also for their fp32 runs. The
test joins the CPU-Kernel Tests step (`{CPU_CI}`).""",
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
        False,
        "Bitwise tests in the CPU-Kernel Tests step, but validated on AVX-512 "
        "only: the AVX2 build and AMX are not run, so AMX keeps `LBHNC`.",
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
