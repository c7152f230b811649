"""The contiguous (block-outer) layout on a real CPU engine.

CPU_ATTN, once it declares BLHNC (the plugin adds it for a worker whose
connector requires a block-outer layout through vLLM's
``get_required_kvcache_layout()``), must produce token-identical greedy output
to its default LBHNC layout: prompts spanning many blocks, prefix-cache hits
(a second round of the same prompts) and chunked prefill (small batches), at
two block sizes. A connector requiring BLHNC gets it end to end; one whose
requirement cannot be met gets vLLM's fallback and warning, and our line.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_engine, selected_cases, side_by_side, start_ahead
from vllm_kvmem.demo import WORDS

pytestmark = pytest.mark.engine


def _prompts() -> list[str]:
    # ~420-token shared prefix (a prefix-cache hit for every prompt after the
    # first) and distinct ~260-token tails: each prompt spans many blocks.
    prefix = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(300))
    return [
        prefix + " " + " ".join(WORDS[(i * k + 3) % len(WORDS)] for i in range(180))
        for k in (1, 5, 11)
    ]


WORKLOAD = {"prompts": _prompts(), "max_tokens": 24, "rounds": 2}
# A connector that requires BLHNC (get_required_kvcache_layout) and moves no data.
REQUIRES_BLHNC = {
    "kv_connector": "ContiguousLayoutExampleConnector",
    "kv_connector_module_path": "tests.contiguous_example",
    "kv_role": "kv_both",
}


def requiring(layout):
    """The same connector, requiring ``layout`` (None: no layout)."""
    return {**REQUIRES_BLHNC, "kv_connector_extra_config": {"kv_cache_layout": layout}}


def _run(model, block_size, connector=None, multiprocess="0"):
    return run_engine(
        dict(
            model=str(model),
            kv_cache_memory_bytes=32 << 20,
            max_model_len=2048,
            block_size=block_size,
            max_num_batched_tokens=256,  # chunked prefill of every prompt
            enforce_eager=True,
            kv_transfer_config=connector,
        ),
        WORKLOAD,
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocess,
    )


@pytest.fixture(scope="module")
def started(request, model_8l) -> None:
    """The baseline, the BLHNC engine and the engines of the requirement
    cases this session runs, started ahead two at a time (each engine a start
    of its own, on 2 cores mostly single-threaded imports)."""
    required = [
        c["required"]
        for c in selected_cases(
            request, "test_unmet_or_no_requirement_keeps_vllms_layout"
        )
    ]
    start_ahead(
        lambda: _run(model_8l, 128),
        lambda: _run(model_8l, 128, REQUIRES_BLHNC, multiprocess="1"),
        *(
            lambda r=r: _run(model_8l, 128, requiring(r), multiprocess="1")
            for r in required
        ),
    )


@pytest.mark.usefixtures("started")
def test_blhnc_is_token_identical_to_lbhnc(model_8l, block_size=128):
    """The engine with the connector runs its core in its own process (the
    layout is resolved there and adopted by the worker); the baseline, with no
    connector, in-process and on vLLM's layout. Other shapes and dtypes are
    the in-tree CPU patch's kernel tests (test_intree)."""
    base, contiguous = side_by_side(
        lambda: _run(model_8l, block_size),
        lambda: _run(model_8l, block_size, REQUIRES_BLHNC, multiprocess="1"),
    )
    assert base.returncode == 0, base.log[-4000:]
    assert contiguous.returncode == 0, contiguous.log[-4000:]
    (b,), (c,) = base.ranks, contiguous.ranks
    assert (b["layout"], c["layout"]) == ("LBHNC", "BLHNC")
    page = c["page_bytes"]
    # Per-layer views: block stride is one page (LBHNC) or 8 layers x page.
    assert page in b["view_stride_bytes"] and 8 * page not in b["view_stride_bytes"]
    assert 8 * page in c["view_stride_bytes"]
    assert contiguous.report["token_ids"] == base.report["token_ids"]
    # The second round and the later prompts hit the prefix cache.
    assert all(n >= block_size for n in contiguous.report["cached_tokens"][1])
    assert contiguous.report["cached_tokens"] == base.report["cached_tokens"]


def test_connector_requiring_blhnc_gets_the_contiguous_layout(model_8l):
    """vLLM's resolution in the engine core (its own process) takes the
    connector's BLHNC, our line says who asked, and the worker allocates it:
    every layer's view steps 8 layers x page from one block to the next (same
    run as above)."""
    run = _run(model_8l, 128, REQUIRES_BLHNC, multiprocess="1")
    assert run.returncode == 0, run.log[-4000:]
    (r,) = run.ranks
    assert r["layout"] == "BLHNC"
    assert 8 * r["page_bytes"] in r["view_stride_bytes"]
    assert "Using BLHNC KV cache layout." in run.log  # vLLM's own line
    assert (
        run.log.count(
            "Using BLHNC KV cache layout: contiguous across layers (one copy per "
            "block), requested by ContiguousLayoutExampleConnector."
        )
        == 1
    )


@pytest.mark.usefixtures("started")
@pytest.mark.parametrize("required", ["BLNHC", None])
def test_unmet_or_no_requirement_keeps_vllms_layout(model_8l, required):
    """A connector requiring BLNHC, which CPU_ATTN cannot serve (its kernel
    reads pages as [H, N, C]): vLLM falls back to LBHNC with its warning and
    our line says why. A connector requiring nothing: vLLM's LBHNC, and
    nothing said. Either way the output is the baseline's (no connector,
    block size 128 above) and the views are per layer."""
    base, run = side_by_side(
        lambda: _run(model_8l, 128),
        lambda: _run(model_8l, 128, requiring(required), multiprocess="1"),
    )
    assert run.returncode == 0, run.log[-4000:]
    (r,) = run.ranks
    assert r["layout"] == "LBHNC"
    assert r["page_bytes"] in r["view_stride_bytes"]
    assert 8 * r["page_bytes"] not in r["view_stride_bytes"]
    assert run.report["token_ids"] == base.report["token_ids"]
    said = [ln for ln in run.log.splitlines() if "requires the" in ln]
    if required is None:
        assert said == [] and "does not satisfy" not in run.log
        assert "requested by" not in run.log
        return
    assert (
        "KV connector cache layout BLNHC does not satisfy every supported set; "
        "valid layouts: ['LBHNC', 'BLHNC']. Using LBHNC instead."
    ) in run.log
    assert len(said) == 1, said
    assert said[0].endswith(
        "ContiguousLayoutExampleConnector requires the BLNHC KV cache layout, but "
        "the attention backends in use support only LBHNC, BLHNC; using vLLM's "
        "LBHNC KV cache layout (per layer)."
    )


def test_mla_model_with_a_connector_requiring_blhnc_serves(tmp_path):
    """vLLM's CPU MLA backend takes BLHNC when a connector asks (it declares
    no layouts) and then fails in its first forward pass (a vLLM bug, plugin
    or not). With the plugin the worker withholds block-outer layouts from
    CPU_MLA: the engine core resolves LBNHC with vLLM's warning, our one line
    says why, and the model serves. Multi-process, so the worker side runs in
    a worker process."""
    from tests.helpers import write_mla_model

    model = write_mla_model(tmp_path / "mla")
    run = run_engine(
        dict(
            model=str(model),
            load_format="dummy",  # random weights made by vLLM
            kv_cache_memory_bytes=32 << 20,
            max_model_len=1024,
            enforce_eager=True,
            kv_transfer_config=REQUIRES_BLHNC,
        ),
        {"prompts": ["The KV cache of a latent attention model"], "max_tokens": 4},
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
    )
    assert run.returncode == 0, run.log[-4000:]
    (r,) = run.ranks
    assert r["layout"] == "LBNHC"
    assert len(run.report["token_ids"][0]) == 4
    assert "KV connector cache layout BLHNC does not satisfy" in run.log
    said = [ln for ln in run.log.splitlines() if "requires the BLHNC" in ln]
    assert len(said) == 1, said
    assert "the model uses MLA on CPU" in said[0]
    assert said[0].endswith("using vLLM's LBNHC KV cache layout (per layer).")
    assert "Using BLHNC" not in run.log
