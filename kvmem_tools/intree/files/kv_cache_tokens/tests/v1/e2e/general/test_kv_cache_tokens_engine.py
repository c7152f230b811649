# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`kv_cache_tokens` on a real engine: the blocks besides the null block
hold the tokens, and one block fewer would not."""

from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

MODEL = "hmellor/tiny-random-LlamaForCausalLM"


def test_kv_cache_tokens_sizes_the_cache(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if current_platform.is_cpu():
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(
        model=MODEL,
        kv_cache_tokens=3000,
        max_model_len=512,
        enforce_eager=True,
        dtype="float32",
    )
    (num_blocks,) = llm.collective_rpc(
        lambda worker: worker.model_runner.kv_cache_config.num_blocks
    )
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(["The KV cache of a pipeline stage"], params)

    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    usable = (num_blocks - 1) * block_size
    assert usable - block_size < 3000 <= usable
    assert len(outputs[0].outputs[0].token_ids) == 8
