"""PR 1's layout is stock vLLM's with the heaviest stage's share per worker.

``benchmarks/pp_budget_vs_trim.py`` found that PR 1
(``--enable-pp-prop-kv-cache``) changes the unit of the budget, not the
layout: stock vLLM's ``get_kv_cache_configs``, given on every worker the
heaviest stage's proportional share of a pipeline budget B, trims the
lighter stages (#25164) to exactly the layout PR 1 plans from B (same blocks,
same tensors and strides, same max_model_len, same refusals). The upstream
text (docs/upstream.md, "PR 1 and #25164") rests on that, so this runs the
script's core on small shapes with vLLM's real planner (one stock vLLM
process a release, no engine) and fails when the equivalence, or the budget
accounting around it, stops holding.

PR 1's side is its arithmetic (``split_kv_budget``, which
``tests/test_intree.py`` holds equal to the patch's) handed to stock vLLM as
each worker's available memory, which is all the patch changes; the script
also runs the patched tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, both_vllms, import_script

MiB = 1 << 20


@pytest.fixture(scope="module")
def bench() -> Any:
    yield from import_script(ROOT / "benchmarks" / "pp_budget_vs_trim.py")


def _cases(bench: Any) -> list[Any]:
    """An uneven 3-stage pipeline that fits, the same with a budget too small
    for one request, and a hybrid (sliding + full) 2-stage pipeline."""
    fits = bench.Case("qwen-16/6/2", "qwen2.5-0.5b", (16, 6, 2), 24 * MiB, 1024)
    return [
        fits,
        bench.Case("qwen-small", "qwen2.5-0.5b", (16, 6, 2), 3 * MiB, 1024),
        bench.Case("gemma-20/6", "gemma-3-1b", (20, 6), 160 * MiB, 8192),
    ]


@both_vllms
def test_heaviest_share_gives_pr1s_layout(bench, vllm_python, tmp_path: Path):
    cases = _cases(bench)
    dirs = bench.write_models(cases, tmp_path)
    modes = ("pr1_arith", "heaviest", "even", "whole")
    inputs = [bench.case_input(c, dirs[c.model], modes) for c in cases]
    report = bench.run_worker(Path(vllm_python), "stock", inputs, str(ROOT))
    fits, small, hybrid = (report["cases"][c.name] for c in cases)

    for case, got in ((cases[0], fits), (cases[2], hybrid)):
        bpb, pr1 = got["bytes_per_block"], got["pr1_arith"]
        assert len(set(bpb)) == len(bpb), bpb  # the stages really are uneven
        blocks = case.budget // sum(bpb)
        # PR 1: one block count, each stage that many of its own blocks, the
        # pipeline within the budget by less than one block of every stage.
        assert pr1["num_blocks"] == [blocks] * len(bpb)
        assert pr1["tensor_bytes"] == [blocks * b for b in bpb]
        assert case.budget - sum(bpb) < sum(pr1["tensor_bytes"]) <= case.budget
        # Stock vLLM given the heaviest stage's share everywhere: the same
        # layout on every worker, the same capacity.
        heaviest = got["heaviest"]
        for key in ("layouts", "num_blocks", "tensor_bytes", "max_model_len"):
            assert heaviest[key] == pr1[key], key
        assert heaviest["kv_cache_tokens"] == pr1["kv_cache_tokens"]
        # B per worker: the heaviest stage takes all of it, the pipeline more.
        whole = got["whole"]
        assert whole["num_blocks"][0] == case.budget // max(bpb)
        assert sum(whole["tensor_bytes"]) > case.budget
        # B / stages per worker: fewer blocks on every stage than PR 1.
        even = got["even"]
        if "refused" not in even:
            n = case.budget // len(bpb) // max(bpb)
            assert even["num_blocks"] == [n] * len(bpb)
            assert n < blocks

    # Too small for one request: refused alike (PR 1 adds no refusal).
    assert "refused" in small["pr1_arith"] and "refused" in small["heaviest"]
    # The hybrid's stages' bytes per block do not follow their layer counts
    # (KV cache groups of 4 layers): a layer-count share is not PR 1's split.
    assert hybrid["bytes_per_block"][0] * 6 != hybrid["bytes_per_block"][1] * 20
