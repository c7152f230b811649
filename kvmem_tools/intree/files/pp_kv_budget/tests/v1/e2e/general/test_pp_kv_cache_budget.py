# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache budgets on a real engine.

A pipeline of 2 with `enable_pp_prop_kv_cache`: every stage holds the blocks
of the proportional split of `kv_cache_memory_bytes`, and greedy output is
the same as with the budget per GPU. With `KV_CACHE_TEST_REPORT` naming a
folder, each test writes what it measured to `<test name>.json` there, so
that two builds can be compared.
"""

import json
import os
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from vllm import LLM, SamplingParams
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

MODEL = "hmellor/tiny-random-LlamaForCausalLM"
BUDGET = 24 << 20
PROMPTS = [
    "The KV cache of a pipeline stage holds",
    "Blocks of every layer on the stage",
]


@pytest.fixture
def engine_env(monkeypatch) -> None:
    # The per-rank report is a function sent to the workers.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if current_platform.is_cpu():
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _pp_kwargs() -> dict[str, Any]:
    if current_platform.is_cpu():
        # CPU pipeline parallelism runs compiled with the eager backend.
        return {"compilation_config": {"mode": 2, "backend": "eager"}}
    return {}


def _ranks(llm: LLM) -> list[dict[str, Any]]:
    def report(worker) -> dict[str, Any]:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        cfg = worker.model_runner.kv_cache_config
        tokens, _ = get_kv_cache_capacity(worker.vllm_config, cfg)
        return {
            "rank": worker.rank,
            "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
            "num_blocks": cfg.num_blocks,
            "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
            "kv_bytes": sum(t.size for t in cfg.kv_cache_tensors),
            "tokens": tokens,
        }

    return sorted(llm.collective_rpc(report), key=lambda r: r["rank"])


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    done = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in done]


def _write_report(request, **fields: Any) -> None:
    if folder := os.environ.get("KV_CACHE_TEST_REPORT"):
        path = Path(folder) / f"{request.node.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fields, indent=1))


def test_pp_prop_kv_cache_splits_the_budget(request, monkeypatch, engine_env):
    layers = AutoConfig.from_pretrained(MODEL).num_hidden_layers
    first = layers - layers // 4 if layers >= 4 else layers // 2
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", f"{first},{layers - first}")
    # Plugins that add engine arguments load before LLM(...) takes them.
    load_general_plugins()
    llm = LLM(
        model=MODEL,
        pipeline_parallel_size=2,
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        max_model_len=512,
        dtype="float32",
        **_pp_kwargs(),
    )
    ranks = _ranks(llm)
    token_ids = _generate(llm)
    _write_report(request, ranks=ranks, token_ids=token_ids)

    assert [r["layers"] for r in ranks] == [first, layers - first]
    per_block = [r["layers"] * r["page_bytes"] for r in ranks]
    num_blocks = BUDGET // sum(per_block)
    assert [r["num_blocks"] for r in ranks] == [num_blocks, num_blocks]
    assert [r["kv_bytes"] for r in ranks] == [num_blocks * b for b in per_block]
    assert sum(r["kv_bytes"] for r in ranks) <= BUDGET
    assert all(len(t) == 8 for t in token_ids)
