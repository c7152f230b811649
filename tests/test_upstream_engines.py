"""The patched vLLM 0.32 (``kvmem upstream``'s series applied to a copy of
the installed vLLM) runs our features with no plugin at all: one pipeline of
2 (split, layout, host tier) and one single-stage engine (token budget), in
processes where ``vllm_kvmem`` cannot be imported (a stand-in package that
raises comes first on the path) and ``VLLM_PLUGINS`` excludes the plugin.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_kvmem.core import pp_split
from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import PP_COMPILATION

ENGINE_TIMEOUT_S = 420

# ------------------------------------------------------------- engines

_ENGINE = r"""
import dataclasses, json, sys
from vllm import LLM, SamplingParams

kw, work = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**kw)
params = SamplingParams(max_tokens=work["max_tokens"], temperature=0.0)
rounds = []
for _ in range(work["rounds"]):
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    rounds.append({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens or 0 for o in outs]})

def report(worker):
    import sys
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    cfg = worker.model_runner.kv_cache_config
    fewer = dataclasses.replace(cfg, num_blocks=cfg.num_blocks - 1)
    return {
        "rank": worker.rank,
        "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
        "num_blocks": cfg.num_blocks,
        "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "layout": cfg.kv_cache_layout,
        "tokens": get_kv_cache_capacity(worker.vllm_config, cfg)[0],
        "tokens_one_block_less": get_kv_cache_capacity(worker.vllm_config, fewer)[0],
        "plugin_modules": sorted(m for m in sys.modules if m.startswith("vllm_kvmem")),
    }

ranks = sorted(llm.collective_rpc(report), key=lambda r: r["rank"])
mods = sorted(m for m in sys.modules if m.startswith("vllm_kvmem"))
out = {"rounds": rounds, "ranks": ranks, "plugin_modules": mods}
print("REPORT " + json.dumps(out))
"""


def _run(no_plugin, kwargs: dict, work: dict, **env: str) -> tuple[dict, str]:
    base, shim = no_plugin
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE, json.dumps(kwargs), json.dumps(work)],
        cwd=shim,  # not the repository: its vllm_kvmem must stay out of reach
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, log[-6000:]
    return json.loads(lines[-1].removeprefix("REPORT ")), log


BUDGET = 24 << 20  # pipeline-wide: 24 blocks of 128 tokens of model_8l in float32
HOST = 256 << 20


@pytest.mark.engine
def test_patched_vllm_splits_lays_out_and_hits_the_host_tier_without_plugin(
    no_plugin, model_8l
):
    kwargs = dict(
        model=str(model_8l),
        pipeline_parallel_size=2,
        compilation_config=PP_COMPILATION,
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        kv_host_cache_bytes=HOST,
        max_model_len=2048,
        max_num_seqs=2,
        dtype="float32",
    )
    # 6 documents of 8 blocks: twice the 24-block device cache on each stage.
    work = {"prompts": documents(6), "max_tokens": 4, "rounds": 2}
    report, log = _run(no_plugin, kwargs, work, VLLM_PP_LAYER_PARTITION="5,3")
    assert report["plugin_modules"] == []
    ranks = report["ranks"]
    assert all(r["plugin_modules"] == [] for r in ranks)
    assert "vllm-kvmem patches applied" not in log
    # The split, as the plugin's arithmetic gives it for these stages.
    bpb = [r["layers"] * r["page_bytes"] for r in ranks]
    shares = pp_split.split_budget(BUDGET, bpb)
    assert [r["layers"] for r in ranks] == [5, 3]
    assert [r["num_blocks"] for r in ranks] == [s.num_blocks for s in shares]
    assert "KV cache per rank (--enable-pp-prop-kv-cache" in log
    # The layout the host tier's connector asks for, which CPU_ATTN accepts.
    from vllm_kvmem.layout import PREFERRED

    assert [r["layout"] for r in ranks] == [PREFERRED, PREFERRED]
    # Host hits, identical greedy output.
    first, second = report["rounds"]
    assert second["token_ids"] == first["token_ids"]
    assert sum(second["cached"]) >= 4 * max(1, sum(first["cached"]))
    assert "Host KV tier: " in log


@pytest.mark.engine
def test_patched_vllm_token_budget_without_plugin(no_plugin, model_8l):
    tokens = 3000
    kwargs = dict(
        model=str(model_8l),
        kv_cache_tokens=tokens,
        max_model_len=2048,
        max_num_seqs=2,
        enforce_eager=True,
    )
    work = {"prompts": ["The KV cache"], "max_tokens": 4, "rounds": 1}
    report, log = _run(no_plugin, kwargs, work, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert report["plugin_modules"] == []
    (rank,) = report["ranks"]
    # Exactly the blocks the tokens need, as vLLM counts capacity.
    assert rank["tokens"] >= tokens > rank["tokens_one_block_less"]
    assert f"--kv-cache-tokens {tokens:,}" in log
