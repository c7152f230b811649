"""Pipelines across machines: vllm-kvmem on vLLM 0.32's multi-node launcher.

Two nodes on one machine (``tests/multinode.py``): the head (``LLM`` with
``nnodes=2, node_rank=0``: engine core, stage 0) and a headless node
(``vllm serve --headless --node-rank 1``: stage 1), each its own process
group with its own config, talking over 127.0.0.1 only.

Three runs serve every engine test, at the same time (one run keeps about
one core busy: its processes start one after another; two of them wait on
a timeout):

- ``pp``: the uneven pipeline of ``test_pp_prop_engine`` (6,2, 64 MiB with
  ``--enable-pp-prop-kv-cache``) on two nodes; at the end the head kills
  node 1 and sends one more request;
- ``tier``: the host tier's pipeline of ``test_host_tier_engine`` (5,3,
  float32, documents read twice) on two nodes, sized with
  ``--kv-cache-tokens`` to the 38 blocks that test's 24 MiB gives;
- ``no_start``: a head whose node 1 cannot start (no vllm-kvmem there).

The one-node references are those tests' own runs (``helpers.run_engine``
starts each once per session).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
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
    pp_kwargs,
    run_engine,
)
from tests.multinode import PipelineRun, run_pipeline
from vllm_kvmem.demo_engine import PP_COMPILATION

MiB = 1 << 20
KiB = 1 << 10
PP_PARTITION = "6,2"
PP_BUDGET = 64 * MiB
TIER_PARTITION = "5,3"
#: test_host_tier_engine's pipeline: 24 MiB per rank, 640 KiB per block on
#: stage 0 (5 float32 layers of 128 KiB): 38 blocks, to which vLLM cuts
#: stage 1 as well. The same 38 blocks from a token budget: 37 x 128 tokens
#: and vLLM's null block.
TIER_BLOCKS = 38
TIER_TOKENS = (TIER_BLOCKS - 1) * 128
#: The head's step timeout in the run where node 1 dies: vLLM 0.32 notices a
#: dead node only when a step's reply from it times out.
STEP_TIMEOUT_S = 15
#: The head's torch.distributed timeout in the run where node 1 never starts.
JOIN_TIMEOUT_S = 10


def _pp_kwargs(model) -> dict:
    """``test_pp_prop_engine.test_uneven_split_via_llm_kwargs``'s engine."""
    return pp_kwargs(model, PP_BUDGET, enable_pp_prop_kv_cache=True)


def _tier_kwargs(model, tokens: bool) -> dict:
    """``test_host_tier_engine``'s pipeline engine; with ``tokens`` its KV
    cache is sized by ``--kv-cache-tokens`` instead of 24 MiB per rank."""
    kw = host_tier_kwargs(
        model, True, pipeline_parallel_size=2, compilation_config=PP_COMPILATION
    )
    if tokens:
        del kw["kv_cache_memory_bytes"]
        kw["kv_cache_tokens"] = TIER_TOKENS
    return kw


@pytest.fixture(scope="module")
def runs(model_8l, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("multinode")
    pp_env = {"VLLM_PP_LAYER_PARTITION": PP_PARTITION}
    tier_env = {"VLLM_PP_LAYER_PARTITION": TIER_PARTITION}
    work = host_tier_workload(8)
    jobs = {
        "pp": lambda: run_pipeline(
            _pp_kwargs(model_8l),
            {},
            root / "pp",
            kill_node1=True,
            env={**pp_env, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S)},
        ),
        "tier": lambda: run_pipeline(
            _tier_kwargs(model_8l, tokens=True), work, root / "tier", env=tier_env
        ),
        "no_start": lambda: run_pipeline(
            {**_pp_kwargs(model_8l), "distributed_timeout_seconds": JOIN_TIMEOUT_S},
            {},
            root / "no_start",
            env=pp_env,
            # Node 1 without vllm-kvmem: its parser refuses the plugin's flag.
            node1_env={"VLLM_PLUGINS": "lora_filesystem_resolver"},
        ),
        "pp_ref": lambda: run_engine(_pp_kwargs(model_8l), **pp_env),
        "tier_ref": lambda: run_engine(
            _tier_kwargs(model_8l, tokens=False), work, **tier_env
        ),
    }
    # The references are usually there already (or needed by later modules).
    lanes = (("pp",), ("tier",), ("no_start", "pp_ref", "tier_ref"))
    with ThreadPoolExecutor(len(lanes)) as pool:
        futures = [
            pool.submit(lambda lane=lane: {k: jobs[k]() for k in lane})
            for lane in lanes
        ]
        done = {k: v for f in futures for k, v in f.result().items()}
    return SimpleNamespace(**done)


def _ok(run: PipelineRun | EngineRun) -> dict:
    assert run.returncode == 0 and run.report is not None, run.log[-6000:]
    return run.report


def _pp(run: PipelineRun) -> dict:
    """The ``pp`` run's report (its exit code is the node-death test's)."""
    assert run.report is not None, run.log[-6000:]
    return run.report


# ------------------------------------------- --enable-pp-prop-kv-cache, 2 nodes


@pytest.mark.engine
def test_each_node_allocates_exactly_its_share(runs):
    ranks = _pp(runs.pp)["ranks"]
    assert [r["pp_rank"] for r in ranks] == [0, 1]
    assert [r["layers"] for r in ranks] == [6, 2]
    # 64 MiB pipeline-wide over 6 + 2 bf16 layers of 64 KiB per block: 128
    # blocks, 48 MiB on node 0 and 16 MiB on node 1, exactly.
    assert [r["kv_bytes"] for r in ranks] == [48 * MiB, 16 * MiB]
    assert [r["num_blocks"] for r in ranks] == [128, 128]
    keys = ("rank", "pp_rank", "layers", "kv_bytes", "num_blocks", "tokens")
    one = _ok(runs.pp_ref)["ranks"]
    assert [{k: r[k] for k in keys} for r in ranks] == [
        {k: r[k] for k in keys} for r in one
    ]
    head, node1 = runs.pp.head.log, runs.pp.node1.log
    # The engine core (node 0) collected node 1's device limit over the
    # launcher's message queues, and each worker logged its own share.
    assert re.search(
        r"KV cache limit per rank: rank 0: [\d,.]+ MiB free after loading the "
        r"model; rank 1: [\d,.]+ MiB free after loading the model, less [\d.]+ "
        r"MiB for pipeline receive buffers",
        head,
    ), head[-4000:]
    assert "based on 6/8 layers on rank 0), 128 blocks" in head
    assert "based on 2/8 layers on rank 1), 128 blocks" in node1
    assert "on rank 1)" not in head


@pytest.mark.engine
def test_greedy_output_identical_to_the_same_pipeline_on_one_node(runs):
    assert _pp(runs.pp)["token_ids"] == _ok(runs.pp_ref)["token_ids"]
    tier, ref = _ok(runs.tier), _ok(runs.tier_ref)
    assert tier["token_ids"] == ref["token_ids"]
    assert len(tier["token_ids"]) == 2 and len(tier["token_ids"][0]) == 8


# ------------------------------------------------------------- host tier


@pytest.mark.engine
def test_host_tier_spills_and_hits_on_both_nodes(runs):
    tier, ref = _ok(runs.tier), _ok(runs.tier_ref)
    copies = tier["tier"]
    assert [t["pp_rank"] for t in copies] == [0, 1]
    for t in copies:  # every stage, on its own node, copied blocks both ways
        assert t["saved"] > 0 and t["loaded"] > 0, copies
    # Each stage holds its slice of every host block, 5:3 as its layers.
    assert [t["slot_bytes"] for t in copies] == [640 * KiB, 384 * KiB]
    # The second round found the evicted prefixes on the host, as on one node.
    assert sum(tier["cached_tokens"][0]) == 0
    assert sum(tier["cached_tokens"][1]) >= 4 * 8 * 128
    assert tier["cached_tokens"] == ref["cached_tokens"]
    assert runs.tier.head.log.count("Host KV tier on this rank") == 1
    assert runs.tier.node1.log.count("Host KV tier on this rank") == 1


@pytest.mark.engine
def test_host_memory_is_checked_on_each_node_for_its_own_ranks(runs):
    _ok(runs.tier)
    for node, log in ((0, runs.tier.head.log), (1, runs.tier.node1.log)):
        line = (
            f"Host KV tier memory check: 0.25 GiB x 1 TP x 1 DP-local = 0.25 GiB "
            f"on this node (--node-rank {node} of --nnodes 2, with 1/2 of each DP "
            f"rank's workers), limit 80% of the "
        )
        assert log.count(line) == 1, log[-4000:]
    assert "--node-rank 1" not in runs.tier.head.log
    one = runs.tier_ref.log
    assert "0.25 GiB x 1 TP x 1 DP-local = 0.25 GiB on this node, limit" in one


# ------------------------------------------------------- --kv-cache-tokens


@pytest.mark.engine
def test_kv_cache_tokens_across_nodes(runs, model_8l):
    from vllm_kvmem.planner import plan_capacity

    tier, ref = _ok(runs.tier), _ok(runs.tier_ref)
    cap = plan_capacity(
        model_8l,
        pp=2,
        partition=TIER_PARTITION,
        budget_tokens=TIER_TOKENS,
        max_model_len=2048,
        dtype="float32",
        platform="cpu",
    )
    assert_agrees(EngineRun(0, runs.tier.log, tier), cap, 2048)
    assert [r["num_blocks"] for r in tier["ranks"]] == [TIER_BLOCKS] * 2
    # The same KV cache as the one-node run's 24 MiB per rank.
    keys = ("rank", "layers", "kv_bytes", "num_blocks", "tokens")
    assert [{k: r[k] for k in keys} for r in tier["ranks"]] == [
        {k: r[k] for k in keys} for r in ref["ranks"]
    ]
    assert f"--kv-cache-tokens {TIER_TOKENS:,}: {TIER_BLOCKS} blocks on every rank" in (
        runs.tier.head.log
    )
    assert "KV cache is sized in tokens (--kv-cache-tokens)" in runs.tier.node1.log


# -------------------------------------------------------------- failures


@pytest.mark.engine
def test_a_node_that_dies_ends_the_head_within_the_step_timeout(runs):
    run = runs.pp
    _pp(run)
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
    assert "unrecognized arguments: --enable-pp-prop-kv-cache" in node1.log
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
    from vllm_kvmem.host_tier_setup import _pools_per_node

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

    from vllm_kvmem.host_tier_setup import add_connector_config

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
    from vllm_kvmem.host_tier_setup import add_connector_config

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
