"""The offline planner's numbers equal what a real engine allocates.

Each case starts vLLM on CPU (one subprocess per engine) and compares every
rank's block count, KV bytes, logged token capacity and concurrency with
``vllm_kvmem.planner.plan_capacity`` for the same model directory and flags.
Shapes differ in layer count, KV heads, head dim, dtype and attention kind
(one model has sliding-window layers).
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_agrees, run_engine
from vllm_kvmem.core.units import MiB
from vllm_kvmem.demo_engine import PP_COMPILATION
from vllm_kvmem.planner import plan_capacity
from vllm_kvmem.tiny_model import build_tiny_model

pytestmark = pytest.mark.engine


SINGLE = [
    # (name, model options, budget bytes, budget tokens, max_model_len, batch)
    ("6l-4kv-hd32-fp16", dict(num_layers=6, hidden_size=128, num_kv_heads=4,
                              head_dim=32, dtype="float16"), 24 * MiB, None, 1024,
     None),
    # A 256-token window with 512-token batches: a request holds 7 blocks of
    # 128 tokens instead of the 33 a full-attention 4096-token request needs.
    ("8l-sliding-256", dict(num_layers=8, sliding_window=256), 16 * MiB, None, 4096,
     512),
    ("4l-8kv-hd32-tokens", dict(num_layers=4, hidden_size=256, num_heads=8,
                                num_kv_heads=8, head_dim=32), None, 10_000, 1024,
     None),
]  # fmt: skip


@pytest.mark.parametrize("name,opts,nbytes,ntokens,max_len,batch", SINGLE)
def test_single_stage_shapes(tmp_path, name, opts, nbytes, ntokens, max_len, batch):
    model = build_tiny_model(tmp_path / name, **opts)
    kwargs = dict(model=str(model), max_model_len=max_len, enforce_eager=True)
    if batch:
        kwargs["max_num_batched_tokens"] = batch
    if nbytes:
        kwargs["kv_cache_memory_bytes"] = nbytes
    else:
        kwargs["kv_cache_tokens"] = ntokens
    run = run_engine(kwargs, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cap = plan_capacity(
        model,
        budget_bytes=nbytes,
        budget_tokens=ntokens,
        max_model_len=max_len,
        max_num_batched_tokens=batch,
        platform="cpu",
    )
    assert_agrees(run, cap, max_len)
    if "sliding" in name:
        assert cap.blocks_per_request < max_len // 128 + 1


PIPELINE = [
    # (partition, budget bytes, budget tokens, proportional); the per-GPU
    # budget (no flag) is checked in test_pp_prop_engine, on the same engine
    # run that is compared with unpatched vLLM. The first case is the engine
    # test_pp_prop_engine's uneven split starts (one run serves both).
    ("6,2", 64 * MiB, None, True),
    ("6,2", None, 20_000, True),
]


@pytest.mark.parametrize("partition,nbytes,ntokens,prop", PIPELINE)
def test_pipeline_of_two(model_8l, partition, nbytes, ntokens, prop):
    kwargs = dict(
        model=str(model_8l),
        pipeline_parallel_size=2,
        max_model_len=512,
        compilation_config=PP_COMPILATION,
    )
    if nbytes:
        kwargs["kv_cache_memory_bytes"] = nbytes
    else:
        kwargs["kv_cache_tokens"] = ntokens
    kwargs["enable_pp_prop_kv_cache"] = prop
    run = run_engine(kwargs, VLLM_PP_LAYER_PARTITION=partition)
    cap = plan_capacity(
        model_8l,
        pp=2,
        partition=partition,
        budget_bytes=nbytes,
        budget_tokens=ntokens,
        max_model_len=512,
        proportional=prop,
        platform="cpu",
    )
    assert_agrees(run, cap, 512)
