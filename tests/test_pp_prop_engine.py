"""--enable-pp-prop-kv-cache on a real multi-process vLLM engine (pipeline of 2).

Each test starts vLLM on CPU in a subprocess (engine core and one worker per
stage are separate processes), so these also prove the plugin loads and
patches in every process. Per-rank numbers are read from the workers' real
KV tensors via LLM.collective_rpc.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import assert_agrees, pp_kwargs, run_engine, side_by_side

pytestmark = pytest.mark.engine

MiB = 1 << 20


def _assert_proportional(ranks, budget):
    blocks = {r["num_blocks"] for r in ranks}
    assert len(blocks) == 1, ranks
    n = blocks.pop()
    bpb = [r["kv_bytes"] // n for r in ranks]
    total = sum(r["kv_bytes"] for r in ranks)
    assert total <= budget
    for r, b in zip(ranks, bpb):
        share = budget * b / sum(bpb)
        assert share - b < r["kv_bytes"] <= share  # within one block of the share
    return n


def test_uneven_split_via_llm_kwargs(model_8l):
    budget = 64 * MiB
    run = run_engine(
        pp_kwargs(model_8l, budget, enable_pp_prop_kv_cache=True),
        VLLM_PP_LAYER_PARTITION="6,2",
    )
    assert run.returncode == 0, run.log[-4000:]
    ranks = run.ranks
    assert [r["layers"] for r in ranks] == [6, 2]
    _assert_proportional(ranks, budget)
    assert ranks[0]["kv_bytes"] == 3 * ranks[1]["kv_bytes"]
    for rank, layers in ((0, 6), (1, 2)):
        line = re.search(
            rf"Reserved (\d+\.\d\d) GiB for KV cache \(proportionally split from "
            rf"0\.06 GiB based on {layers}/8 layers on rank {rank}\)",
            run.log,
        )
        assert line, run.log[-4000:]
        assert float(line.group(1)) == round(ranks[rank]["kv_bytes"] / (1 << 30), 2)
    assert "pipeline-wide, split by KV bytes per block" in run.log
    assert "w/o flag: KV GiB" in run.log
    # The engine core collected both workers' limits (executor patch, across
    # processes). Stage 1 receives stage 0's hidden states and residual every
    # step, into buffers allocated after the KV cache; stage 0 receives none.
    collected = re.search(r"KV cache limit per rank: (.*)\.", run.log)
    assert collected, run.log[-4000:]
    limits = re.fullmatch(
        r"rank 0: [\d,.]+ MiB free after loading the model; "
        r"rank 1: [\d,.]+ MiB free after loading the model, less ([\d.]+) MiB "
        r"for pipeline receive buffers: [\d,.]+ MiB",
        collected.group(1),
    )
    assert limits, collected.group(1)
    assert float(limits.group(1)) == round(_pp_receive_bytes(model_8l) / MiB, 2)


def _pp_receive_bytes(model) -> int:
    """What one pipeline receive holds: hidden states and residual for a full
    batch, from vLLM's own config of the engine the test starts (``LLM``'s
    defaults: its usage context sets the batch)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(**pp_kwargs(model, 64 * MiB))
    cfg = args.create_engine_config(UsageContext.LLM_CLASS)
    tokens = cfg.scheduler_config.max_num_batched_tokens
    hidden = cfg.model_config.get_hidden_size()
    return 2 * tokens * hidden * cfg.model_config.dtype.itemsize


def test_even_split_via_additional_config_other_shape(model_6l):
    budget = 40 * MiB
    run = run_engine(
        pp_kwargs(
            model_6l,
            budget,
            additional_config={"kvmem": {"enable_pp_prop_kv_cache": True}},
        ),
        VLLM_PP_LAYER_PARTITION="3,3",
    )
    assert run.returncode == 0, run.log[-4000:]
    ranks = run.ranks
    assert [r["layers"] for r in ranks] == [3, 3]
    _assert_proportional(ranks, budget)
    assert ranks[0]["kv_bytes"] == ranks[1]["kv_bytes"]


def test_without_flag_per_rank_results_equal_unpatched_vllm(model_8l):
    kwargs = pp_kwargs(model_8l, 48 * MiB)
    patched, unpatched = side_by_side(
        lambda: run_engine(kwargs, VLLM_PP_LAYER_PARTITION="5,3"),
        lambda: run_engine(
            kwargs,
            VLLM_PP_LAYER_PARTITION="5,3",
            VLLM_PLUGINS="lora_filesystem_resolver",  # everything but vllm-kvmem
        ),
    )
    assert patched.returncode == 0, patched.log[-4000:]
    assert unpatched.returncode == 0, unpatched.log[-4000:]
    keys = ("rank", "layers", "kv_bytes", "num_blocks", "tokens", "concurrency")
    assert [{k: r[k] for k in keys} for r in patched.ranks] == [
        {k: r[k] for k in keys} for r in unpatched.ranks
    ]
    assert patched.report["token_ids"] == unpatched.report["token_ids"]
    assert "pp_prop.py" not in unpatched.log + patched.log
    # ... and the offline planner predicts the same per-GPU numbers.
    from vllm_kvmem.planner import plan_capacity

    cap = plan_capacity(
        model_8l,
        pp=2,
        partition="5,3",
        budget_bytes=48 * MiB,
        max_model_len=512,
        platform="cpu",
    )
    assert_agrees(patched, cap, 512)


def test_share_too_small_for_one_sequence_fails_naming_rank_and_budget(model_8l):
    # CPU blocks are 128 tokens: 64 KiB per layer. A 6/2 split of 2 MiB gives
    # rank 0 1.5 MiB = 4 blocks of 384 KiB; one 512-token sequence there needs
    # 4 blocks + vLLM's null block.
    run = run_engine(
        pp_kwargs(model_8l, 2 * MiB, enable_pp_prop_kv_cache=True),
        VLLM_PP_LAYER_PARTITION="6,2",
    )
    assert run.returncode != 0
    assert re.search(
        r"--enable-pp-prop-kv-cache: rank 0 \(pipeline stage 0\) gets 1\.50 MiB "
        r"\(4 blocks\).* \(5 blocks, with vLLM's null block\) one 512-token "
        r"sequence needs there\. Use `--kv-cache-memory-bytes 3M` or more",
        run.log,
    ), run.log[-4000:]


def test_bad_partition_gives_vllms_own_error(model_8l):
    run = run_engine(
        pp_kwargs(model_8l, 64 * MiB, enable_pp_prop_kv_cache=True),
        VLLM_PP_LAYER_PARTITION="5,2",
    )
    assert run.returncode != 0
    assert "sum(partitions)=7 does not match num_hidden_layers=8" in run.log
    frames = [ln for ln in run.log.splitlines() if ln.strip().startswith("File ")]
    assert frames  # the traceback is there ...
    ours = [f for f in frames if "vllm_kvmem/" in f and "demo_engine.py" not in f]
    assert ours == []  # ... and does not pass through our patches
