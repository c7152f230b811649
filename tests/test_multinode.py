"""Pipelines across machines: vllm-kvmem on vLLM 0.32's multi-node launcher.

Two nodes on one machine (``tests/multinode.py``): the head (``LLM`` with
``nnodes=2, node_rank=0``: engine core, stage 0) and a headless node
(``vllm serve --headless --node-rank 1``: stage 1), each its own process
group with its own config, talking over 127.0.0.1. Four runs serve every
engine test, two at a time (their waits on timeouts overlap the others'
work): the uneven pipeline with ``--enable-pp-prop-kv-cache`` and the host
tier on two nodes and on one node, ``--kv-cache-tokens`` on two nodes ending
with node 1 killed, and a head whose node 1 cannot start (no vllm-kvmem).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import (
    EngineRun,
    assert_agrees,
    captured_log,
    engine_args_from_cli,
    host_tier_kwargs,
    host_tier_workload,
    messages,
)
from tests.multinode import PipelineRun, run_pipeline
from vllm_kvmem.demo_engine import PP_COMPILATION

MiB = 1 << 20
PARTITION = "6,2"
TOKENS = 4096
#: The head's step timeout in the run where node 1 dies: vLLM 0.32 notices a
#: dead node only when a step's reply from it times out.
STEP_TIMEOUT_S = 15
#: The head's torch.distributed timeout in the run where node 1 never starts.
JOIN_TIMEOUT_S = 10
#: Same thread count on every worker of every run (the node's worker count
#: changes vLLM's default), so that one-node and two-node numerics match.
ENV = {"VLLM_PP_LAYER_PARTITION": PARTITION, "OMP_NUM_THREADS": "1"}


def _tier_pipeline(model: Path) -> dict:
    """The host tier's engine test configuration as an uneven pipeline with
    the pipeline-wide budget: 24 MiB split 6:2 (float32: 128 KiB per layer
    per block), 24 blocks on both stages, a quarter of the 8 documents'
    working set."""
    return host_tier_kwargs(
        model,
        True,
        pipeline_parallel_size=2,
        compilation_config=PP_COMPILATION,
        enable_pp_prop_kv_cache=True,
    )


def _tokens_pipeline(model: Path, **extra) -> dict:
    return dict(
        model=str(model),
        pipeline_parallel_size=2,
        kv_cache_tokens=TOKENS,
        max_model_len=512,
        compilation_config=PP_COMPILATION,
        **extra,
    )


@pytest.fixture(scope="module")
def runs(model_8l, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("multinode")
    work = host_tier_workload(8)
    tier = _tier_pipeline(model_8l)
    # Node 1 without vllm-kvmem: its parser refuses --kv-cache-tokens.
    no_kvmem = {"VLLM_PLUGINS": "lora_filesystem_resolver"}
    step_timeout = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S)}
    jobs = {
        "two": lambda: run_pipeline(tier, work, root / "two", env=ENV),
        "one": lambda: run_pipeline(tier, work, root / "one", nnodes=1, env=ENV),
        "tokens": lambda: run_pipeline(
            _tokens_pipeline(model_8l),
            {},
            root / "tokens",
            kill_node1=True,
            env={**ENV, **step_timeout},
        ),
        "no_start": lambda: run_pipeline(
            _tokens_pipeline(model_8l, distributed_timeout_seconds=JOIN_TIMEOUT_S),
            {},
            root / "no_start",
            env=ENV,
            node1_env=no_kvmem,
        ),
    }
    # Three lanes: one run keeps about one of this machine's two cores busy
    # (its processes start one after another), and two of them spend a
    # timeout waiting; the shortest two share a lane.
    lanes = (("two", "no_start"), ("tokens",), ("one",))
    with ThreadPoolExecutor(len(lanes)) as pool:
        futures = [
            pool.submit(lambda lane=lane: {k: jobs[k]() for k in lane})
            for lane in lanes
        ]
        done = {k: v for f in futures for k, v in f.result().items()}
    two, one, tokens, no_start = (done[k] for k in ("two", "one", "tokens", "no_start"))
    return SimpleNamespace(two=two, one=one, tokens=tokens, no_start=no_start)


def _ok(run: PipelineRun) -> dict:
    assert run.returncode == 0 and run.report is not None, run.log[-6000:]
    return run.report


# ------------------------------------------- --enable-pp-prop-kv-cache, 2 nodes


@pytest.mark.engine
def test_each_node_allocates_exactly_its_share(runs):
    report = _ok(runs.two)
    ranks = report["ranks"]
    assert [r["pp_rank"] for r in ranks] == [0, 1]
    assert [r["layers"] for r in ranks] == [6, 2]
    # 24 MiB pipeline-wide over 6 + 2 layers of 128 KiB per block: 24 blocks,
    # 18 MiB on node 0 and 6 MiB on node 1, exactly.
    assert [r["kv_bytes"] for r in ranks] == [18 * MiB, 6 * MiB]
    assert [r["num_blocks"] for r in ranks] == [24, 24]
    keys = ("rank", "pp_rank", "layers", "kv_bytes", "num_blocks", "tokens")
    one = _ok(runs.one)["ranks"]
    assert [{k: r[k] for k in keys} for r in ranks] == [
        {k: r[k] for k in keys} for r in one
    ]
    head, node1 = runs.two.head.log, runs.two.node1.log
    # The engine core (node 0) collected node 1's device limit over the
    # launcher's message queues, and each worker logged its own share.
    assert re.search(
        r"KV cache limit per rank: rank 0: [\d,.]+ MiB free after loading the "
        r"model; rank 1: [\d,.]+ MiB free after loading the model, less [\d.]+ "
        r"MiB for pipeline receive buffers",
        head,
    ), head[-4000:]
    assert "based on 6/8 layers on rank 0), 24 blocks" in head
    assert "based on 2/8 layers on rank 1), 24 blocks" in node1
    assert "on rank 1)" not in head


@pytest.mark.engine
def test_greedy_output_identical_to_the_same_pipeline_on_one_node(runs):
    two, one = _ok(runs.two), _ok(runs.one)
    assert two["token_ids"] == one["token_ids"]
    assert len(two["token_ids"]) == 2 and all(len(t) == 8 for t in two["token_ids"])


# ------------------------------------------------------------- host tier


@pytest.mark.engine
def test_host_tier_spills_and_hits_on_both_nodes(runs):
    two, one = _ok(runs.two), _ok(runs.one)
    tier = two["tier"]
    assert [t["pp_rank"] for t in tier] == [0, 1]
    for t in tier:  # every stage, on its own node, copied blocks both ways
        assert t["saved"] > 0 and t["loaded"] > 0, tier
    # Each stage holds its slice of every host block: 6:2, as the KV cache.
    assert tier[0]["slot_bytes"] == 3 * tier[1]["slot_bytes"]
    assert tier[0]["pool_bytes"] == 3 * tier[1]["pool_bytes"]
    assert tier == one["tier"]  # the same copies as on one node
    # The second round found the evicted prefixes on the host.
    assert sum(two["cached_tokens"][0]) == 0
    assert sum(two["cached_tokens"][1]) >= 4 * 8 * 128
    assert two["cached_tokens"] == one["cached_tokens"]
    assert runs.two.head.log.count("Host KV tier on this rank") == 1
    assert runs.two.node1.log.count("Host KV tier on this rank") == 1


@pytest.mark.engine
def test_host_memory_is_checked_on_each_node_for_its_own_ranks(runs):
    _ok(runs.two)
    for node, log in ((0, runs.two.head.log), (1, runs.two.node1.log)):
        line = (
            f"Host KV tier memory check: 0.25 GiB x 1 TP x 1 DP-local = 0.25 GiB "
            f"on this node (--node-rank {node} of --nnodes 2, with 1/2 of each DP "
            f"rank's workers), limit 80% of the "
        )
        assert log.count(line) == 1, log[-4000:]
    assert "--node-rank 1" not in runs.two.head.log
    one = runs.one.head.log
    assert "0.25 GiB x 1 TP x 1 DP-local = 0.25 GiB on this node, limit" in one


# ------------------------------------------------------- --kv-cache-tokens


@pytest.mark.engine
def test_kv_cache_tokens_across_nodes(runs, model_8l):
    report = runs.tokens.report
    assert report is not None, runs.tokens.log[-6000:]
    from vllm_kvmem.planner import plan_capacity

    cap = plan_capacity(
        model_8l,
        pp=2,
        partition=PARTITION,
        budget_tokens=TOKENS,
        max_model_len=512,
        platform="cpu",
    )
    # assert_agrees reads the head's report; the run's exit code is the
    # node-death test's (below).
    assert_agrees(EngineRun(0, runs.tokens.log, report), cap, 512)
    assert [r["num_blocks"] for r in report["ranks"]] == [32, 32]  # 4,096 / 128
    assert "--kv-cache-tokens 4,096: 32 blocks on every rank" in runs.tokens.head.log
    assert "KV cache is sized in tokens (--kv-cache-tokens)" in runs.tokens.node1.log


# -------------------------------------------------------------- failures


@pytest.mark.engine
def test_a_node_that_dies_ends_the_head_within_the_step_timeout(runs):
    run = runs.tokens
    assert run.report is not None, run.log[-6000:]
    after = run.after
    assert after is not None, run.log[-6000:]
    # vLLM 0.32: the engine core waits for the last stage's reply (node 1)
    # until the step times out; stage 0's worker may log gloo's "Connection
    # closed by peer" first, or be waiting on node 1 itself.
    assert after["error"].startswith("EngineDeadError"), after
    assert STEP_TIMEOUT_S - 1 < after["seconds"] < STEP_TIMEOUT_S + 30, after
    assert re.search(r"TimeoutError: RPC call to \w+ timed out", run.head.log)
    assert run.returncode == 3  # the head's driver saw the error and exited


@pytest.mark.engine
def test_a_node_that_cannot_start_fails_the_head_within_the_join_timeout(runs):
    run = runs.no_start
    node1 = run.node1
    assert node1.returncode == 2, node1.log[-3000:]
    assert "unrecognized arguments: --kv-cache-tokens" in node1.log
    assert run.returncode not in (0, None), run.head.log[-6000:]
    assert re.search(
        r"DistStoreError: Timed out after \d+ seconds waiting for clients\. "
        r"1/2 clients joined\.",
        run.head.log,
    ), run.head.log[-6000:]
    assert "Engine core initialization failed" in run.head.log
    assert run.report is None


# ------------------------------------------ host memory check, no engine


@pytest.mark.parametrize(
    "flags,tp,dp,note",
    [
        # One node: every TP rank of every local DP rank (unchanged).
        (["-tp", "2", "-pp", "2"], 2, 1, ""),
        (["-tp", "2", "-dp", "2"], 2, 2, ""),
        # A pipeline stage per node: one pool here.
        (["-pp", "2", "--nnodes", "2", "--node-rank", "1"], 1, 1, "1/2"),
        # TP=4 over 2 nodes: 2 TP ranks here, not 4.
        (["-tp", "4", "--nnodes", "2"], 2, 1, "2/4"),
        # TP=4 x PP=2 over 2 nodes: one stage's 4 TP ranks here.
        (["-tp", "4", "-pp", "2", "--nnodes", "2"], 4, 1, "4/8"),
        # DP=2 over 2 nodes: one engine here, not 2.
        (["-dp", "2", "--nnodes", "2", "--node-rank", "1"], 1, 1, "1/1"),
        # DP=4 x TP=2 over 2 nodes: 2 engines of 2 TP ranks here.
        (["-tp", "2", "-dp", "4", "--nnodes", "2"], 2, 2, "2/2"),
    ],
)  # fmt: skip
def test_memory_check_counts_the_ranks_of_its_own_node(
    vllm_patched, model_8l, flags, tp, dp, note
):
    from vllm_kvmem.host_tier.startup import _pools_per_node

    args = engine_args_from_cli("--model", str(model_8l), *flags)
    here = _pools_per_node(args)
    assert (here.tp, here.dp) == (tp, dp)
    assert note in here.where()


def test_memory_check_accepts_per_node_what_one_node_could_not_hold(
    vllm_patched, model_8l, monkeypatch
):
    """TP=4 split over two nodes pins 2 pools per node: a size that 4 pools
    on one node would not fit passes, with the node named in the log."""
    import psutil

    from vllm_kvmem.host_tier.startup import add_connector_config

    avail = 10 << 30
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: SimpleNamespace(available=avail)
    )
    size = str(3 << 30)  # 4 x 3 GiB > 8 GiB (80%) >= 2 x 3 GiB
    base = ("--model", str(model_8l), "-tp", "4", "--kv-host-cache-bytes", size)
    with pytest.raises(ValueError, match=r"x 4 TP x 1 DP-local = 12\.00 GiB"):
        add_connector_config(engine_args_from_cli(*base))
    logger = logging.getLogger("vllm.kvmem.host_tier")
    level = logger.level
    logger.setLevel(logging.INFO)  # the line is INFO; pytest's root is WARNING
    try:
        with captured_log("vllm.kvmem.host_tier") as records:
            add_connector_config(
                engine_args_from_cli(*base, "--nnodes", "2", "--node-rank", "1")
            )
    finally:
        logger.setLevel(level)
    assert any(
        "3.00 GiB x 2 TP x 1 DP-local = 6.00 GiB on this node (--node-rank 1 of "
        "--nnodes 2, with 2/4 of each DP rank's workers)" in m
        for m in messages(records)
    ), messages(records)


@pytest.mark.parametrize(
    "flags,legacy,refused",
    [
        (["-pp", "2"], "0", True),  # last stage's outputs only: loads never end
        (["-pp", "2"], "1", False),  # RayExecutorV2: every worker's output
        (["-tp", "2"], "0", False),  # one stage: every worker is the last
    ],
)
def test_host_tier_refuses_the_legacy_ray_executor_with_a_pipeline(
    vllm_patched, model_8l, monkeypatch, flags, legacy, refused
):
    from vllm_kvmem.host_tier.startup import add_connector_config

    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", legacy)
    args = engine_args_from_cli(
        "--model", str(model_8l), "--distributed-executor-backend", "ray",
        "--kv-host-cache-bytes", "64M", *flags,
    )  # fmt: skip
    if refused:
        with pytest.raises(ValueError, match="legacy Ray executor"):
            add_connector_config(args)
    else:
        add_connector_config(args)
        assert args.kv_transfer_config.kv_connector == "KVMemHostTierConnector"
