# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""HostTierConnector on a real engine: a prefix the device cache evicted is
served from host memory, with the same greedy tokens. With
`KV_CACHE_TEST_REPORT` naming a folder, the test writes what it measured to
`<test name>.json` there, so that two builds can be compared."""

import json
import os
from pathlib import Path

import pytest
from transformers import AutoConfig

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

MODEL = "hmellor/tiny-random-LlamaForCausalLM"
BLOCK_SIZE = 128
PROMPT_BLOCKS = 5


@pytest.fixture
def engine_env(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if current_platform.is_cpu():
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def test_evicted_prefix_is_served_from_host_memory(request, engine_env):
    hf = AutoConfig.from_pretrained(MODEL)
    kv_heads = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    head_size = getattr(hf, "head_dim", None) or (
        hf.hidden_size // hf.num_attention_heads
    )
    # float32 K and V of every layer: a 12-block device cache.
    block_bytes = 2 * BLOCK_SIZE * kv_heads * head_size * 4 * hf.num_hidden_layers
    llm = LLM(
        model=MODEL,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=1,
        enforce_eager=True,
        kv_cache_memory_bytes=12 * block_bytes,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HostTierConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"num_host_blocks": 64},
        ),
    )
    length = PROMPT_BLOCKS * BLOCK_SIZE + 7
    prompts = [
        TokensPrompt(
            prompt_token_ids=[(p * 131 + i) % hf.vocab_size for i in range(length)]
        )
        for p in range(3)
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    again = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    layout = llm.collective_rpc(
        lambda worker: worker.vllm_config.cache_config.kv_cache_layout
    )

    report = {
        "layout": [str(x) for x in layout],
        "first_cached": [o.num_cached_tokens for o in first],
        "again_cached": again.num_cached_tokens,
        "token_ids": [list(o.outputs[0].token_ids) for o in first],
        "again_token_ids": list(again.outputs[0].token_ids),
    }
    if folder := os.environ.get("KV_CACHE_TEST_REPORT"):
        path = Path(folder) / f"{request.node.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))

    # Prompts 1 and 2 take 6 blocks each of the 11 usable: the second pops
    # all of prompt 0's, so its 5 full blocks can only come from host memory.
    assert report["first_cached"] == [0, 0, 0]
    assert report["again_cached"] == PROMPT_BLOCKS * BLOCK_SIZE
    assert report["again_token_ids"] == report["token_ids"][0]
