"""[Bugfix][CPU] CPU MLA backends declare their KV cache layouts.

``CPU_MLA`` and ``AMX_MLA`` declared no layouts, which vLLM reads as "any":
a connector requiring BLHNC got it and the first forward pass failed. They
now declare their layer-outer layouts. Its own PR (it was carried by the
CPU_ATTN layout PR before): a fix for another backend, needed with or
without that PR. Its test joins vLLM's CPU MLA backend tests
(``tests/v1/attention/test_cpu_mla_backend.py``), and that test the
CPU-Kernel Tests step of ``.buildkite`` (the file is in no CI step yet).
"""

from kvmem_tools.intree.edits import Edit, appended
from kvmem_tools.intree.patches.cpu_attn_block_outer import ci_edits
from kvmem_tools.intree.pr_text import Answer, pr_text
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "cpu_mla_kv_cache_layouts"
TEST = "tests/v1/attention/test_cpu_mla_backend.py"
TEST_NAME = "test_cpu_mla_kv_cache_layout_is_layer_compact"

MESSAGE = pr_text(
    overview="""\
`CPU_MLA` and `AMX_MLA` declare their layer-outer KV cache layouts instead
of none, so a KV connector requiring `BLHNC` falls back to `LBNHC` with
vLLM's warning instead of crashing in the first forward pass.""",
    claims=[
        "Fixes `view size is not compatible with input tensor's size and "
        "stride` in `CPUMLAImpl.do_kv_cache_update` under a connector whose "
        "`get_required_kvcache_layout()` is `BLHNC`.",
        "`VLLM_KV_CACHE_LAYOUT=BLHNC` with a CPU MLA model now fails at "
        "startup, naming the valid layouts.",
    ],
    validation=f"""\
On CPU (x86, AVX-512 with AMX tiles), vLLM 0.32.0 and 0.33.0, this PR alone:

- `pytest {TEST} -k {TEST_NAME}`: 2 passed (both backends; added to
  vLLM's CPU MLA tests): the declared layouts are layer-compact; `LBNHC` by
  default and for a connector requiring `BLHNC`; the env var is refused.
- Reproducer (not in CI): DeepSeek-V2 (2 layers, `load_format="dummy"`) on
  `CPU_MLA` with a connector requiring `BLHNC`, 8 greedy tokens. Before:
  `Using BLHNC KV cache layout.`, then the view error in the first forward.
  After: `KV connector cache layout BLHNC does not satisfy every supported
  set; valid layouts: ['LBNHC', 'LBHNC', 'LHBNC']. Using LBNHC instead.`,
  and the 8 tokens equal those of the run without a connector.""",
    details="""\
Root cause: `supported_kv_cache_layouts()` returning `None` means "any
layout" to `resolve_kv_cache_layout`, but both MLA backends view a layer's
cache as contiguous `[num_blocks * block_size, head_size]` rows
(`kv_cache.view(-1, ...)`), which holds only when a layer's blocks are
adjacent: layer-outer layouts. With one latent head `LBNHC`, `LBHNC` and
`LHBNC` are the same bytes; `LBNHC` stays first, so nothing changes for
anyone who does not ask for a layout. `AMX_MLA` is covered by the
declaration and resolution test only (no engine run on it).""",
    duplicates="""\
searched the vLLM tracker for MLA KV cache layout declarations: #55438
(open, fixing #55431) declares layer-compact layouts for the DeepSeek-V3.2
sparse MLA backends on GPU, the same class of fix for other backends; it
does not touch `cpu_mla.py` or `amx_mla.py`. #51718 (merged) introduced
`supported_kv_cache_layouts()` with `None` as "any". No open PR declares the
CPU MLA layouts. The AGENTS.md `gh` searches are for the submitter to rerun
before opening.""",
    design_fit=Answer(True, "A declaration on each backend; no logic added."),
    testing=Answer(
        False,
        "Resolution tests in the CPU-Kernel Tests step; the crash reproducer "
        "is an engine run outside CI, and AMX_MLA runs no engine here.",
    ),
    code_quality=Answer(True, "One comment says why only layer-outer layouts."),
    contents=Answer(True, "Root cause, reproducer before and after, limits."),
)

_MLA = """
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # A layer's cache is viewed as contiguous [num_blocks * block_size,
        # head_size] rows, so its blocks must be adjacent: layer-outer layouts
        # only. With one latent head these three are the same bytes.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.LHBNC)
"""

_BACKENDS = "vllm/v1/attention/backends/mla/"
#: What the test needs, in the places vLLM's import order puts it.
_TEST_IMPORTS = (
    "from vllm.config import KVTransferConfig, VllmConfig\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.base import "
    "KVConnectorBase_V1\n",
    "from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend\n"
    "from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend\n",
    "from vllm.v1.attention.backends.utils import (\n"
    "    get_supported_kv_cache_layouts,\n"
    "    resolve_kv_cache_layout,\n"
    ")\n"
    "from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec\n",
)
_IMPORT = "from vllm.v1.kv_cache_interface import KVCacheLayout\n"


def _changes() -> list:
    return [
        Edit(_BACKENDS + "cpu_mla.py", "    MultipleOf,\n)\n", _IMPORT),
        Edit(
            _BACKENDS + "cpu_mla.py",
            "    def supports_block_size(cls, block_size: int | None) -> bool:\n"
            "        return block_size is None or block_size == 16\n",
            _MLA,
        ),
        Edit(
            _BACKENDS + "amx_mla.py",
            "from vllm.v1.attention.backend import AttentionLayer, AttentionType, "
            "MultipleOf\n",
            _IMPORT,
        ),
        Edit(_BACKENDS + "amx_mla.py", "        return block_size % 32 == 0\n", _MLA),
        Edit(
            TEST,
            "from vllm.platforms import current_platform\n",
            _TEST_IMPORTS[0],
            "before",
        ),
        Edit(
            TEST,
            "from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (\n",
            _TEST_IMPORTS[1],
            "before",
        ),
        Edit(TEST, "    ZenCPUSDPAMLAPrefillBackend,\n)\n", _TEST_IMPORTS[2]),
        appended(TEST, FILES / SLUG / "appended" / TEST),
        *ci_edits(
            f"{TEST}::{TEST_NAME}",
            "tests/kernels/attention/test_amx_mla.py",
            _BACKENDS + "cpu_mla.py",
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[Bugfix][CPU] Declare the CPU MLA KV cache layouts",
    message=MESSAGE,
    changes={"0.32": _changes(), "0.33": _changes()},
)
