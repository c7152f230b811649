# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline-proportional KV cache budget (`enable_pp_prop_kv_cache`)."""

import pytest
import torch

from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.core.kv_cache_planning import _split_kv_budget_across_pp_stages
from vllm.v1.kv_cache_interface import FullAttentionSpec

pytestmark = pytest.mark.cpu_test

MiB = 1 << 20
SPEC = FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
)


def _specs(stages: list[int]) -> list[dict]:
    """One spec dict a worker, holding its stage's layer."""
    return [{f"layers.{stage}": SPEC} for stage in stages]


def _config(budget: int, pp: int = 2, tp: int = 1) -> VllmConfig:
    return VllmConfig(
        cache_config=CacheConfig(
            kv_cache_memory_bytes=budget, enable_pp_prop_kv_cache=True
        ),
        parallel_config=ParallelConfig(
            pipeline_parallel_size=pp, tensor_parallel_size=tp
        ),
    )


@pytest.mark.parametrize(
    "bytes_per_block,tp",
    [
        ([6 * 64 * 1024, 2 * 64 * 1024], 1),  # 6 and 2 layers
        ([4 * 32 * 1024, 4 * 128 * 1024], 1),  # 2 and 8 KV heads
        ([6 * 64 * 1024] * 2 + [2 * 64 * 1024] * 2, 2),  # TP 2 x PP 2
    ],
)
def test_shares_follow_bytes_per_block(bytes_per_block, tp):
    budget = 64 * MiB
    config = _config(budget, tp=tp)
    stages = [w // tp for w in range(len(bytes_per_block))]
    memory = _split_kv_budget_across_pp_stages(
        config, _specs(stages), bytes_per_block, [budget] * len(bytes_per_block)
    )
    blocks = {m // b for m, b in zip(memory, bytes_per_block)}
    assert len(blocks) == 1  # the same block count on every stage
    assert all(m % b == 0 for m, b in zip(memory, bytes_per_block))
    per_shard = sum(memory[::tp])
    assert budget - sum(bytes_per_block[::tp]) < per_shard <= budget
    assert memory[0] * bytes_per_block[-1] == memory[-1] * bytes_per_block[0]


def test_a_stage_without_kv_cache_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline stage\(s\) \[1\] hold no KV"):
        _split_kv_budget_across_pp_stages(
            _config(64 * MiB), _specs([0, 1]), [64 * 1024, 0], [64 * MiB] * 2
        )


def test_workers_out_of_stage_order_are_refused():
    # TP 2 x PP 2 with the ranks tensor-parallel-major.
    with pytest.raises(RuntimeError, match="stage-major .* worker 1 does not hold"):
        _split_kv_budget_across_pp_stages(
            _config(64 * MiB, tp=2),
            _specs([0, 1, 0, 1]),
            [6 * 1024, 2 * 1024] * 2,
            [64 * MiB] * 4,
        )


def test_attention_free_model_keeps_its_memory():
    config = _config(64 * MiB)
    memory = _split_kv_budget_across_pp_stages(config, [{}, {}], [0, 0], [5, 7])
    assert memory == [5, 7]


def test_requires_kv_cache_memory_bytes():
    with pytest.raises(ValueError, match="set kv_cache_memory_bytes as well"):
        CacheConfig(enable_pp_prop_kv_cache=True)


def test_flag_reaches_cache_config():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--kv-cache-memory-bytes", "5G", "--enable-pp-prop-kv-cache"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.enable_pp_prop_kv_cache
    assert engine_args.kv_cache_memory_bytes == 5 << 30
