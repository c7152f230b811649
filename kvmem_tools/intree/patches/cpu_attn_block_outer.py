"""[CPU] Block-outer KV cache layouts for CPU_ATTN.

CPU_ATTN declares the block-outer layouts its kernels serve after LBHNC, so
vLLM's own ``resolve_kv_cache_layout`` keeps LBHNC by default and gives
BLHNC to ``VLLM_KV_CACHE_LAYOUT`` or a connector's
``get_required_kvcache_layout()``. The CPU MLA backends, which declared no
layouts (read as any) yet cannot run block-outer views, declare their
layer-outer ones, so such a request falls back with vLLM's warning instead of
crashing in the first forward pass.
"""

from kvmem_tools.intree.edits import Edit, NewFile
from kvmem_tools.intree.series import FILES, InTreePatch

SLUG = "cpu_attn_block_outer"

MESSAGE = """\
## Purpose

`CPU_ATTN` declares only `LBHNC` in `supported_kv_cache_layouts()`, so a KV
connector that asks for a block-outer layout through
`get_required_kvcache_layout()` (all layers of a block adjacent: one copy
per block) is always refused on CPU, and `VLLM_KV_CACHE_LAYOUT=BLHNC` fails.
Yet its kernels (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
take the block and head strides from the view and only need each head's
`[N, C]` interior dense. This PR declares `BLHNC` and `BHLNC` after `LBHNC`:
`resolve_kv_cache_layout` still picks `LBHNC` unless the env var or a
connector asks. `LBNHC`/`BLNHC` stay out (token-major interiors).

It also fixes `CPU_MLA` and `AMX_MLA`, which declare no layouts, which reads
as any: a connector requiring `BLHNC` got it, and the first forward failed in
`CPUMLAImpl.do_kv_cache_update` (`kv_cache.view(-1, ...)`: "view size is not
compatible with input tensor's size and stride"; `AMX_MLA` views its cache
the same way). They now declare the layer-outer layouts (one latent head:
`LBNHC`, `LBHNC`, `LHBNC` are the same bytes), `LBNHC` first as before, so
such a connector gets `LBNHC` with vLLM's warning and
`VLLM_KV_CACHE_LAYOUT=BLHNC` fails at startup.

## Test Plan

`pytest tests/v1/attention/test_cpu_attn_kv_cache_layout.py`, no model:
- three layers in one allocation, viewed by `allocate_kv_cache` in `LBHNC`
  and in each declared layout (block-outer: block stride = layers x page);
  K/V written by `do_kv_cache_update`, then `forward` on a prefill, a decode
  and a chunked prefill (bf16, fp32, head size 80 on the vec16 kernels, fp8
  cache): caches and outputs bitwise equal;
- resolution: `LBHNC` by default; `BLHNC` from a connector or the env var;
  the CPU MLA backends resolve `LBNHC` for such a connector and refuse the
  env var.

End to end, greedy, no plugins: a random-weight Llama with the layout unset,
`BLHNC`, `BHLNC`, and a connector requiring `BLHNC`; a DeepSeek-V2 (MLA)
with that connector and with the env var.

## Test Result

The new tests pass on CPU (AVX-512, no AMX: vec and vec16 kernels).

Llama (8 layers, 2 KV heads, head size 64, `kv_cache_memory_bytes=32MiB`,
`enforce_eager`), five prompts x 32 tokens, twice (the second round reads
256 and 128 tokens back from the prefix cache): with `BLHNC`, `BHLNC` and
the connector, the 320 tokens and their logprobs are bitwise equal to the
default `LBHNC` run. Under `BLHNC` each layer's view has a block stride of
512 KiB (8 layers x 64 KiB pages).

DeepSeek-V2 (2 layers) on `CPU_MLA` with the connector: before, vLLM logged
`Using BLHNC KV cache layout.` and the first forward raised the view error;
now it warns `KV connector cache layout BLHNC does not satisfy every
supported set; valid layouts: ['LBNHC', 'LBHNC', 'LHBNC']. Using LBNHC
instead.` and the output equals the run without a connector token for token,
as do runs with `LBHNC` and `LHBNC`. `VLLM_KV_CACHE_LAYOUT=BLHNC` now fails
at startup naming those layouts. `AMX_MLA` and the AMX attention kernels
are covered by the declaration and resolution tests only (no AMX here).
"""

_CPU_ATTN = """\
        # The kernels take the block and head strides from the view and need
        # only each head's [N, C] block interior dense, so block-outer layouts
        # work too. LBHNC stays the default; VLLM_KV_CACHE_LAYOUT or a KV
        # connector's get_required_kvcache_layout() selects a block-outer one.
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.BHLNC)
"""

_MLA = """
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # A layer's cache is viewed as contiguous [num_blocks * block_size,
        # head_size] rows, so its blocks must be adjacent: layer-outer layouts
        # only. With one latent head these three are the same bytes.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.LHBNC)
"""

_BACKENDS = "vllm/v1/attention/backends/"
_IMPORT = "from vllm.v1.kv_cache_interface import KVCacheLayout\n"


def _changes() -> list:
    return [
        Edit(
            _BACKENDS + "cpu_attn.py",
            "        # The CPU backend only reads head-major block interiors.\n"
            "        return (KVCacheLayout.LBHNC,)\n",
            _CPU_ATTN,
            where="replace",
        ),
        Edit(_BACKENDS + "mla/cpu_mla.py", "    MultipleOf,\n)\n", _IMPORT),
        Edit(
            _BACKENDS + "mla/cpu_mla.py",
            "    def supports_block_size(cls, block_size: int | None) -> bool:\n"
            "        return block_size is None or block_size == 16\n",
            _MLA,
        ),
        Edit(
            _BACKENDS + "mla/amx_mla.py",
            "from vllm.v1.attention.backend import AttentionLayer, AttentionType, "
            "MultipleOf\n",
            _IMPORT,
        ),
        Edit(
            _BACKENDS + "mla/amx_mla.py", "        return block_size % 32 == 0\n", _MLA
        ),
        NewFile(
            "tests/v1/attention/test_cpu_attn_kv_cache_layout.py",
            FILES / SLUG / "tests/v1/attention/test_cpu_attn_kv_cache_layout.py",
        ),
    ]


PATCH = InTreePatch(
    slug=SLUG,
    subject="[CPU] Block-outer KV cache layouts for CPU_ATTN",
    message=MESSAGE,
    # The same edits apply to both releases' backends.
    changes={"0.32": _changes(), "0.33": _changes()},
)
