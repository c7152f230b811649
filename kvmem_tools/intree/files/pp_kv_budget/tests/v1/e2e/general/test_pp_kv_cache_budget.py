# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`enable_pp_prop_kv_cache` on a real pipeline of 2: every stage holds the
blocks of the split of `kv_cache_memory_bytes`, within the budget."""

from typing import Any

import pytest
from transformers import AutoConfig

from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

MODEL = "hmellor/tiny-random-LlamaForCausalLM"
BUDGET = 24 << 20


@pytest.fixture
def engine_env(monkeypatch) -> None:
    # The per-rank report is a function sent to the workers.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if current_platform.is_cpu():
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _ranks(llm: LLM) -> list[dict[str, Any]]:
    def report(worker) -> dict[str, Any]:
        cfg = worker.model_runner.kv_cache_config
        return {
            "rank": worker.rank,
            "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
            "num_blocks": cfg.num_blocks,
            "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
            "kv_bytes": sum(t.size for t in cfg.kv_cache_tensors),
        }

    return sorted(llm.collective_rpc(report), key=lambda r: r["rank"])


# CPU ranks run a pipeline of 2 on one host; other platforms need 2 devices.
@pytest.mark.skipif(
    not current_platform.is_cpu() and current_platform.device_count() < 2,
    reason="Need at least 2 devices to run the test.",
)
def test_pp_prop_kv_cache_splits_the_budget(monkeypatch, engine_env):
    layers = AutoConfig.from_pretrained(MODEL).num_hidden_layers
    first = layers - layers // 4 if layers >= 4 else layers // 2
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", f"{first},{layers - first}")
    kwargs: dict[str, Any] = {}
    if current_platform.is_cpu():
        # CPU pipeline parallelism runs compiled with the eager backend.
        kwargs["compilation_config"] = {"mode": 2, "backend": "eager"}
    llm = LLM(
        model=MODEL,
        pipeline_parallel_size=2,
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        max_model_len=512,
        dtype="float32",
        **kwargs,
    )
    ranks = _ranks(llm)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(["The KV cache of a pipeline stage"], params)

    assert [r["layers"] for r in ranks] == [first, layers - first]
    per_block = [r["layers"] * r["page_bytes"] for r in ranks]
    num_blocks = BUDGET // sum(per_block)
    assert [r["num_blocks"] for r in ranks] == [num_blocks, num_blocks]
    assert [r["kv_bytes"] for r in ranks] == [num_blocks * b for b in per_block]
    assert sum(r["kv_bytes"] for r in ranks) <= BUDGET
    assert len(outputs[0].outputs[0].token_ids) == 8
