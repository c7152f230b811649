"""The offline planner's numbers equal what a real engine allocates.

Each case starts vLLM on CPU (one subprocess per engine) and compares every
rank's block count, KV bytes, logged token capacity and concurrency with
``vllm_kvmem.planner.plan_capacity`` for the same model directory and flags.
Shapes differ in layer count, KV heads, head dim, dtype and attention kind
(one model has sliding-window layers). Real architectures' shapes
(``kvmem shape-model``: published configs, no weights) run with
``load_format="dummy"``: Qwen2.5-0.5B and Gemma 3 1B (the hybrid: sliding and
full KV cache groups) at full depth, Llama 3.1 8B and Qwen3-30B-A3B (the MoE,
on vLLM's CPU fused-MoE experts) cut to 2 layers, each layer's KV geometry
as published.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import assert_agrees, run_engine, selected_cases, start_ahead
from vllm_kvmem.core.units import MiB
from vllm_kvmem.demo_engine import PP_COMPILATION
from vllm_kvmem.planner import load_model, plan_capacity
from vllm_kvmem.planner.kv_math import kv_cache_groups
from vllm_kvmem.shape_model import build_shape_model
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


def _single_run(model, nbytes, ntokens, max_len, batch, **engine):
    """One in-process engine with these flags (``run_engine``'s cached run)."""
    kwargs = dict(model=str(model), max_model_len=max_len, enforce_eager=True)
    kwargs.update(engine)
    if batch:
        kwargs["max_num_batched_tokens"] = batch
    if nbytes:
        kwargs["kv_cache_memory_bytes"] = nbytes
    else:
        kwargs["kv_cache_tokens"] = ntokens
    return run_engine(kwargs, VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _engine_agrees_with_plan(model, nbytes, ntokens, max_len, batch, **engine):
    """One in-process engine and the planner, same model and flags; the
    engine's run once the two agree."""
    run = _single_run(model, nbytes, ntokens, max_len, batch, **engine)
    cap = plan_capacity(
        model,
        budget_bytes=nbytes,
        budget_tokens=ntokens,
        max_model_len=max_len,
        max_num_batched_tokens=batch,
        platform="cpu",
    )
    assert_agrees(run, cap, max_len)
    return run, cap


@pytest.fixture(scope="module")
def single_models(request, tmp_path_factory) -> dict[str, Path]:
    """The tiny models of the single-stage cases this session runs, by name,
    their engines started ahead two at a time (one start each, on 2 cores
    mostly single-threaded imports)."""
    root = tmp_path_factory.mktemp("single")
    cases = selected_cases(request, "test_single_stage_shapes")
    models = {c["name"]: build_tiny_model(root / c["name"], **c["opts"]) for c in cases}
    start_ahead(
        *(
            lambda c=c: _single_run(
                models[c["name"]], c["nbytes"], c["ntokens"], c["max_len"], c["batch"]
            )
            for c in cases
        )
    )
    return models


@pytest.mark.parametrize("name,opts,nbytes,ntokens,max_len,batch", SINGLE)
def test_single_stage_shapes(
    single_models, name, opts, nbytes, ntokens, max_len, batch
):
    model = single_models[name]
    _, cap = _engine_agrees_with_plan(model, nbytes, ntokens, max_len, batch)
    if "sliding" in name:
        assert cap.blocks_per_request < max_len // 128 + 1


REAL_SHAPES = [
    # (shape, --num-layers, budget bytes, budget tokens, max_model_len, batch)
    ("qwen2.5-0.5b", None, 64 * MiB, None, 2048, None),
    # 512-token batches: a sliding layer's request holds 9 blocks, not 17.
    ("gemma-3-1b", None, 64 * MiB, None, 2048, 512),
    ("llama-3.1-8b", 2, None, 10_000, 4096, None),
    ("qwen3-30b-a3b", 2, 64 * MiB, None, 4096, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def shape_models(request, tmp_path_factory) -> dict[str, Path]:
    """The shape models of the real-shape cases this session runs, by shape,
    their engines started ahead two at a time."""
    root = tmp_path_factory.mktemp("shapes")
    cases = selected_cases(request, "test_real_shapes_with_dummy_weights")
    models = {
        c["shape"]: build_shape_model(
            c["shape"], root / c["shape"], num_layers=c["layers"]
        )
        for c in cases
    }
    start_ahead(
        *(
            lambda c=c: _single_run(
                models[c["shape"]],
                *(c["nbytes"], c["ntokens"], c["max_len"], c["batch"]),
                load_format="dummy",
            )
            for c in cases
        )
    )
    return models


@pytest.mark.parametrize("shape,layers,nbytes,ntokens,max_len,batch", REAL_SHAPES)
def test_real_shapes_with_dummy_weights(
    shape_models, shape, layers, nbytes, ntokens, max_len, batch
):
    """A published architecture's KV geometry, served with random weights
    (one in-process engine start each, 20-40 s on 2 cores)."""
    model = shape_models[shape]
    run, _ = _engine_agrees_with_plan(
        model, nbytes, ntokens, max_len, batch, load_format="dummy"
    )
    # One layer's block (the first KV cache group's page) and the groups
    # (Gemma 3: 22 sliding layers in 6 groups of 4, the 4 full ones in 1).
    layers = load_model(model).layers()
    assert run.ranks[0]["page_bytes"] == layers[0].page_bytes(128)
    assert run.ranks[0]["num_groups"] == len(kv_cache_groups(layers))
    assert run.ranks[0]["num_groups"] == (7 if shape == "gemma-3-1b" else 1)
    assert len(run.report["token_ids"][0]) == 8  # it generated


PIPELINE = [
    # (partition, budget bytes, budget tokens, proportional); the per-GPU
    # budget (no flag) is checked in test_pp_prop_engine, on the same engine
    # run that is compared with unpatched vLLM. The first case is the engine
    # test_pp_prop_engine's uneven split starts (one run serves both).
    ("6,2", 64 * MiB, None, True),
    ("6,2", None, 20_000, True),
]


def _pipeline_run(model, partition, nbytes, ntokens, prop):
    """A pipeline of two with these flags (``run_engine``'s cached run)."""
    kwargs = dict(
        model=str(model),
        pipeline_parallel_size=2,
        max_model_len=512,
        compilation_config=PP_COMPILATION,
    )
    if nbytes:
        kwargs["kv_cache_memory_bytes"] = nbytes
    else:
        kwargs["kv_cache_tokens"] = ntokens
    kwargs["enable_pp_prop_kv_cache"] = prop
    return run_engine(kwargs, VLLM_PP_LAYER_PARTITION=partition)


@pytest.fixture(scope="module")
def pipelines_started(request, model_8l) -> None:
    """The pipeline cases this session runs, started ahead two at a time."""
    cases = selected_cases(request, "test_pipeline_of_two")
    start_ahead(
        *(
            lambda c=c: _pipeline_run(
                model_8l, c["partition"], c["nbytes"], c["ntokens"], c["prop"]
            )
            for c in cases
        )
    )


@pytest.mark.parametrize("partition,nbytes,ntokens,prop", PIPELINE)
def test_pipeline_of_two(pipelines_started, model_8l, partition, nbytes, ntokens, prop):
    run = _pipeline_run(model_8l, partition, nbytes, ntokens, prop)
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
