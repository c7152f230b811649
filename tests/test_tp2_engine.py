"""Tensor parallelism 2 on CPU, end to end: the host tier and the KV budgets.

vLLM's CPU build runs ``tensor_parallel_size=2`` on two cores: an engine
core and one worker process per rank, each rank holding one of the model's
two KV heads. Every engine here runs ``tests/host_tier_events_engine.py``
(``events_run`` in tests/helpers.py, as tests/test_host_tier_events.py
does; the scheduler in the script's process, the workers in their own): 12
documents of 8 blocks for a device cache of 24, again in reverse, a
prefix-cache reset, three again. Its report holds each request's output
and cached tokens, the cached tokens a KV-aware router predicted from
vLLM's KV events, and each worker's own facts (its KV cache, its host pool,
the blocks it copied).

Four engine starts (CI time: 45-80 s each here, most of it starting vLLM
in every process):

- TP=2, the tier on, the cache sized by ``--kv-cache-tokens`` (vLLM 0.32):
  identical output, host hits, each rank's host pool, the KV events, the
  token budget per rank, the BLHNC layout;
- TP=2 without the tier, same cache (vLLM 0.32): the output reference;
- TP=2 x PP=2, 4 ranks, the tier on, the pipeline-wide budget
  (``--enable-pp-prop-kv-cache`` with ``--kv-cache-memory-bytes``), on
  vLLM 0.32 and 0.33: the split per rank, each (stage, TP rank)'s host
  slice, the BLHNC layout, the events with 4 workers, and every request
  served exactly as by the TP=2 engine (so, with the tier, as without it).

On 0.33 only the pipeline runs: it takes every path of the tier and of the
budgets that differs between the releases (the connector API across worker
processes, the events, the layout, the executor and ``KVCacheConfigBuilder``
handing each rank its planned bytes), at 4 ranks; the token budget differs
from the byte budget only in the release-independent plan
(``plan_kv_budget``). A TP=2 start per release more would add ~90 s.

The host memory check at TP=2 runs without an engine (it refuses at
config time); each engine's own check line says it counted both ranks.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import psutil
import pytest

from tests.helpers import both_vllms, events_run
from vllm_kvmem.demo_engine import PP_COMPILATION

TP = 2
#: The device cache in tokens: 24 blocks of 128 and vLLM's null block on
#: each rank, the 24 blocks the TP=1 tests' 24 MiB hold.
TOKENS = 24 * 128
BLOCKS = TOKENS // 128 + 1
#: The host tier, per TP shard (the option's unit): 40 blocks of 8 layers x
#: 1 KV head x 128 tokens in float32 (512 KiB per rank), each rank's own pool.
HOST_KV = 20 << 20
SHARD_BLOCK_BYTES = 8 * 2 * 64 * 128 * 4  # layers x (K, V) x head dim x tokens x 4
HOST_SLOTS = HOST_KV // SHARD_BLOCK_BYTES
#: The pipeline-wide budget per TP shard that gives the same 25 blocks on
#: every rank of a 6 + 2 layer pipeline (stage 0: 6/8 of it, stage 1: 2/8).
PP_BUDGET = BLOCKS * SHARD_BLOCK_BYTES
PARTITION = "6,2"
#: One OpenMP thread per process: with vLLM's default (as many as cores) two
#: workers and the scheduler oversubscribe the 2 cores, and the TP=2 run
#: takes 3x as long (124 s against 38 s here).
ENV = {"OMP_NUM_THREADS": "1"}

_RUNS: dict[str, dict[str, Any]] = {}


def _run(name: str, model, python: str, **kwargs: Any) -> dict[str, Any]:
    """``events_run`` once per session for these arguments."""
    key = f"{name} {model} {python}"
    if key not in _RUNS:
        _RUNS[key] = events_run(model, python, tensor_parallel_size=TP, **kwargs)
    return _RUNS[key]


def tier_on(model) -> dict[str, Any]:
    """TP=2 with the tier, the device sized in tokens (0.32)."""
    return _run(
        "tier", model, sys.executable, host_kv=HOST_KV, env=ENV, kv_cache_tokens=TOKENS
    )


def tier_off(model) -> dict[str, Any]:
    """TP=2 without the tier, same device cache: the output reference (0.32)."""
    return _run(
        "off", model, sys.executable, host_kv=None, env=ENV, kv_cache_tokens=TOKENS
    )


def pipeline(model, python: str) -> dict[str, Any]:
    """TP=2 x PP=2 (4 ranks) with the tier and the pipeline-wide budget."""
    return _run(
        "pipeline",
        model,
        python,
        host_kv=HOST_KV,
        env={**ENV, "VLLM_PP_LAYER_PARTITION": PARTITION},
        pipeline_parallel_size=2,
        compilation_config=PP_COMPILATION,  # PP on CPU cannot run eager
        enforce_eager=False,
        kv_cache_memory_bytes=PP_BUDGET,
        enable_pp_prop_kv_cache=True,
    )


def _agrees_with_planner(ranks: list[dict[str, Any]], cap: Any) -> None:
    """Every rank allocated what ``kvmem plan`` predicts for its stage (one
    TP shard: the planner's per-rank figures)."""
    assert len(ranks) == TP * len(cap.stages)
    for r in ranks:
        st = cap.stages[r["pp_rank"]]
        assert r["layers"] == st.num_layers
        assert r["num_blocks"] == st.num_blocks == cap.num_blocks == BLOCKS
        assert r["kv_bytes"] == st.kv_bytes
        assert r["tokens"] == cap.tokens
        assert r["concurrency"] == pytest.approx(cap.concurrency)


def _host_slices(run: dict[str, Any]) -> None:
    """Each rank holds its own pool: every host block's slice for its stage
    and TP shard, the same number of blocks on every rank (the scheduler's),
    and copies every block the others copy."""
    ranks = run["ranks"]
    assert run["host_slots"] == HOST_SLOTS == 40
    for r in ranks:
        pool = r["host_pool"]
        assert pool is not None, r
        assert pool["num_slots"] == HOST_SLOTS
        # One slot is this rank's block: its layers' pages, its KV head.
        assert pool["slot_bytes"] == r["layers"] * r["page_bytes"]
        assert pool["nbytes"] == HOST_SLOTS * pool["slot_bytes"]
    # One TP shard's stages together hold the option's bytes: a block of
    # the pipeline is 512 KiB per shard, 40 of them are 20 MiB.
    for tp_rank in range(TP):
        shard = [r["host_pool"]["nbytes"] for r in ranks if r["tp_rank"] == tp_rank]
        assert sum(shard) == HOST_KV
    # Both TP ranks (and stages) copy every block: no rank is left behind.
    copies = {(r["host_pool"]["saved"], r["host_pool"]["loaded"]) for r in ranks}
    assert len(copies) == 1, [r["host_pool"] for r in ranks]
    saved, loaded = copies.pop()
    assert saved > HOST_SLOTS and loaded >= 16
    assert run["log"].count("Host KV tier on this rank: 40 slots x ") == len(ranks)
    # The engine's memory check counted both TP ranks' pools.
    assert "0.02 GiB x 2 TP x 1 DP-local = 0.04 GiB on this node" in run["log"]


def _events_exact(run: dict[str, Any]) -> None:
    """The router's index, fed every event vLLM published, predicts every
    request's cached tokens; no block is announced twice (a rank's
    duplicate would be), the host set matches the tier's every step."""
    requests = run["requests"]
    assert run["mismatches"] == 0, [(r["predicted"], r["cached"]) for r in requests]
    assert run["violations"] == [] and run["without_tokens"] == 0
    assert run["steps"]["checked"] > 0
    assert run["steps"]["host_set_mismatches"] == 0
    # One reset: the device's AllBlocksCleared and the tier's, not per rank.
    assert run["events"]["AllBlocksCleared"] == 2
    assert run["events"]["BlockStored:CPU"] > HOST_SLOTS
    assert run["events"]["BlockRemoved:CPU"] > 0


def _blhnc(ranks: list[dict[str, Any]]) -> None:
    """The tier's contiguous layout on every rank: a block's layers adjacent
    (each layer's view steps over all the rank's layers per block)."""
    for r in ranks:
        assert r["layout"] == "BLHNC"
        assert r["view_stride_bytes"][0] == r["layers"] * r["page_bytes"]


# ------------------------------------------------------------------ TP=2


@pytest.mark.engine
def test_tier_output_identical_with_host_hits_after_eviction(model_8l):
    """The same greedy output with the tier as without, request by request,
    and host hits: requests whose cached tokens exceed what the device held
    (the evicted part came back from each rank's pool)."""
    on, off = tier_on(model_8l), tier_off(model_8l)
    assert [r["token_ids"] for r in on["requests"]] == [
        r["token_ids"] for r in off["requests"]
    ]
    device = [r["predicted"] - r["predicted_host"] for r in on["requests"]]
    host_hits = [
        r["cached"] - d for r, d in zip(on["requests"], device) if r["cached"] > d
    ]
    assert len(host_hits) >= 3 and sum(host_hits) == on["host_hit_tokens"] >= 16 * 128
    # Without the tier those requests found at most the device's part.
    cached_on = sum(r["cached"] for r in on["requests"])
    cached_off = sum(r["cached"] for r in off["requests"])
    assert cached_on >= cached_off + on["host_hit_tokens"]
    assert "Host KV tier: 40 blocks of 128 tokens (0.02 GiB per TP shard" in on["log"]


@pytest.mark.engine
def test_each_rank_holds_its_shard_of_every_host_block(model_8l):
    """``--kv-host-cache-bytes`` is per TP shard: each of the 2 ranks pins
    its own 20 MiB pool of 40 blocks of 512 KiB (half a TP=1 block: one of
    the 2 KV heads), and both copy every block."""
    run = tier_on(model_8l)
    assert [r["tp_rank"] for r in run["ranks"]] == [0, 1]
    for r in run["ranks"]:
        assert r["page_bytes"] * r["layers"] == SHARD_BLOCK_BYTES
    _host_slices(run)


@pytest.mark.engine
def test_kv_events_once_and_exact_at_tp2(model_8l):
    """The scheduler publishes once for both ranks: every request predicted
    exactly, host hits included, with the tier and (0.32) without."""
    _events_exact(tier_on(model_8l))
    off = tier_off(model_8l)
    assert off["mismatches"] == 0 and off["violations"] == []
    assert off["events"]["AllBlocksCleared"] == 1
    assert not any(k.endswith(":CPU") for k in off["events"])


@pytest.mark.engine
def test_kv_cache_tokens_and_blhnc_per_rank(model_8l):
    """``--kv-cache-tokens 3072`` gives each rank the 24 blocks it needs and
    the null block, in its own KV head's bytes (the planner's figures at
    TP=2), laid out BLHNC for the tier; the tier-off run gets the same
    cache in vLLM's per-layer layout."""
    from vllm_kvmem.planner import plan_capacity

    run = tier_on(model_8l)
    cap = plan_capacity(
        model_8l,
        tp=TP,
        budget_tokens=TOKENS,
        max_model_len=2048,
        dtype="float32",
        platform="cpu",
    )
    _agrees_with_planner(run["ranks"], cap)
    _blhnc(run["ranks"])
    line = f"--kv-cache-tokens 3,072: {BLOCKS} blocks on every rank, rank 0 12.50 MiB"
    assert f"{line}, rank 1 12.50 MiB." in run["log"]
    off = tier_off(model_8l)
    _agrees_with_planner(off["ranks"], cap)
    assert {r["layout"] for r in off["ranks"]} == {"LBHNC"}


def test_host_memory_check_counts_both_ranks(vllm_patched, model_8l):
    """No engine: the check runs when vLLM builds the config. A size that
    one pool fits in (80% of the available memory) but two do not starts at
    TP=1 and is refused at TP=2, the message counting 2 TP ranks' pools.
    (The engines above log the same check with 2 TP, on both releases.)"""
    from vllm.engine.arg_utils import EngineArgs

    available = psutil.virtual_memory().available
    size = int(available * 0.8 * 0.7)  # slack for other processes' churn

    def config(tp: int) -> Any:
        return EngineArgs(
            model=str(model_8l),
            tensor_parallel_size=tp,
            kv_cache_memory_bytes=1 << 24,
            kv_host_cache_bytes=size,
        ).create_engine_config()

    assert config(1).kv_transfer_config is not None
    with pytest.raises(ValueError) as e:
        config(TP)
    msg = str(e.value)
    assert f"--kv-host-cache-bytes {size:,} bytes does not fit this node" in msg
    assert "every tensor-parallel rank" in msg
    gib = size / (1 << 30)
    assert f"{gib:.2f} GiB x 2 TP x 1 DP-local = {2 * gib:.2f} GiB" in msg
    suggested = int(re.search(r"Use --kv-host-cache-bytes (\d+)M or less", msg)[1])
    assert suggested << 20 < size  # half the limit: less than one pool here


# -------------------------------------------------------------- TP=2 x PP=2


@pytest.mark.engine
@both_vllms
def test_pipeline_of_two_at_tp2_splits_the_budget_per_tp_shard(model_8l, vllm_python):
    """4 ranks, stages of 6 and 2 layers: the 12.5 MiB pipeline-wide budget is
    each TP shard's, split 3:1 between the stages, 25 blocks on every rank
    (the planner's figures); each rank logs its share."""
    from vllm_kvmem.planner import plan_capacity

    run = pipeline(model_8l, vllm_python)
    ranks = run["ranks"]
    assert [(r["pp_rank"], r["tp_rank"]) for r in ranks] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert [r["layers"] for r in ranks] == [6, 6, 2, 2]
    cap = plan_capacity(
        model_8l,
        tp=TP,
        pp=2,
        partition=PARTITION,
        budget_bytes=PP_BUDGET,
        proportional=True,
        max_model_len=2048,
        dtype="float32",
        platform="cpu",
    )
    _agrees_with_planner(ranks, cap)
    for tp_rank in range(TP):
        shard = [r["kv_bytes"] for r in ranks if r["tp_rank"] == tp_rank]
        assert shard == [PP_BUDGET * 3 // 4, PP_BUDGET // 4]
    for r in ranks:
        assert re.search(
            rf"Reserved 0\.0\d GiB for KV cache \(proportionally split from "
            rf"0\.01 GiB based on {r['layers']}/8 layers on rank {r['rank']}\), "
            rf"{BLOCKS} blocks\.",
            run["log"],
        ), r["rank"]
    assert "pipeline-wide budget" in run["log"]


@pytest.mark.engine
@both_vllms
def test_pipeline_of_two_at_tp2_serves_the_tier_as_tp2(model_8l, vllm_python):
    """The same engine: every rank BLHNC, each (stage, TP rank) holding its
    slice of every host block, the events exact with 4 workers, and every
    request served as by the TP=2 engine on 0.32 (output, cached tokens,
    predictions, host hits included): on either release, the tier's output
    is the output without it."""
    from vllm_kvmem.planner import plan

    run = pipeline(model_8l, vllm_python)
    _blhnc(run["ranks"])
    _host_slices(run)
    _events_exact(run)
    # `kvmem plan --kv-host-cache-bytes` counts the blocks the engine holds.
    host, disk = plan(
        model_8l,
        tp=TP,
        pp=2,
        partition=PARTITION,
        dtype="float32",
        platform="cpu",
        max_model_len=2048,
        host_bytes=HOST_KV,
        disk_bytes=HOST_KV,
    ).tiers
    assert host.blocks == run["host_slots"] == HOST_SLOTS
    # A disk block is every rank's slice, one file each with its header.
    slices = sum(r["host_pool"]["slot_bytes"] for r in run["ranks"])
    assert disk.block_bytes == slices + len(run["ranks"]) * 128
    assert run["host_hit_tokens"] >= 16 * 128
    keys = ("token_ids", "cached", "predicted", "predicted_host")
    tp2 = tier_on(model_8l)
    assert [{k: r[k] for k in keys} for r in run["requests"]] == [
        {k: r[k] for k in keys} for r in tp2["requests"]
    ]
    assert [r["token_ids"] for r in run["requests"]] == [
        r["token_ids"] for r in tier_off(model_8l)["requests"]
    ]
