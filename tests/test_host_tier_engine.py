"""The host KV tier on a real vLLM engine (CPU).

Workload: documents whose working set is several times the device KV cache,
read twice. Without the tier the second pass recomputes every prefix (the
device cache has evicted them); with it, the evicted blocks come back from
host memory. Greedy output must be token-identical either way, in a single
process, with the multi-process engine, and on a pipeline of 2.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import (
    ENGINE_TIMEOUT_S,
    HOST_TIER_DTYPE,
    ROOT,
    assert_agrees,
    both_vllms,
    engine_env,
    host_tier_kwargs,
    host_tier_workload,
    run_engine,
    selected_cases,
    side_by_side,
    start_ahead,
)
from vllm_kvmem.demo_engine import PP_COMPILATION

pytestmark = pytest.mark.engine


def _check_identical_and_hits(off, on):
    assert off.returncode == 0, off.log[-4000:]
    assert on.returncode == 0, on.log[-4000:]
    assert on.report["token_ids"] == off.report["token_ids"]
    second_off, second_on = (
        off.report["cached_tokens"][1],
        on.report["cached_tokens"][1],
    )
    assert sum(second_on) >= 4 * max(1, sum(second_off))  # host hits, not recompute
    assert "Host KV tier: " in on.log


def _single_stage_run(model, host: bool, multiprocess: str = "0"):
    """The single-stage run without or with the tier (``run_engine``'s)."""
    return run_engine(
        host_tier_kwargs(model, host, enforce_eager=True),
        host_tier_workload(),
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocess,
    )


@pytest.fixture(scope="module")
def single_stage_started(request, model_8l) -> None:
    """The baseline and the tier's engine of each single-stage case this
    session runs, started ahead two at a time (independent starts, mostly
    single-threaded imports on 2 cores)."""
    cases = selected_cases(request, "test_single_stage_output_identical_with_host_hits")
    # The multiprocess engine's start is the longest: first, beside the two
    # in-process ones one after the other.
    modes = sorted((c["multiprocess"] for c in cases), reverse=True)
    tier = [lambda m=m: _single_stage_run(model_8l, True, m) for m in modes]
    start_ahead(*tier[:1], lambda: _single_stage_run(model_8l, False), *tier[1:])


@pytest.mark.usefixtures("single_stage_started")
@pytest.mark.parametrize("multiprocess", ["0", "1"], ids=["inproc", "mp"])
def test_single_stage_output_identical_with_host_hits(model_8l, multiprocess):
    """Against one baseline without the tier (in-process engine): the output
    of one engine does not depend on where its core runs. On vLLM 0.33 the
    tier's output is held to 0.32's by test_vllm033_engine (a pipeline of 2
    with the tier) and test_intree_engines (an evicted prefix served again)."""
    off, on = side_by_side(
        lambda: _single_stage_run(model_8l, False),
        lambda: _single_stage_run(model_8l, True, multiprocess),
    )
    _check_identical_and_hits(off, on)


def test_pipeline_of_two_output_identical_with_host_hits(model_8l):
    kw = dict(pipeline_parallel_size=2, compilation_config=PP_COMPILATION)
    env = dict(VLLM_PP_LAYER_PARTITION="5,3")
    work = host_tier_workload(8)
    off, on = side_by_side(
        lambda: run_engine(host_tier_kwargs(model_8l, False, **kw), work, **env),
        lambda: run_engine(host_tier_kwargs(model_8l, True, **kw), work, **env),
    )
    _check_identical_and_hits(off, on)
    assert on.log.count("Host KV tier on this rank") == 2  # both stages hold a slice


# -- hybrid models: sliding-window and full-attention layers ------------------

WINDOW = 256
HYBRID_DEVICE_KV = 16 << 20  # 64 blocks of 2 layers x 128 tokens (float32)
# vLLM's own lines when its hybrid KV cache manager is turned off.
HMA_OFF = (
    "Turning off hybrid kv cache manager",
    "Hybrid KV cache manager is disabled",
)


@pytest.fixture(scope="module")
def model_hybrid(tmp_path_factory):
    """8 layers, every 4th full attention and the others a 256-token window
    (Gemma-3-like): vLLM's hybrid KV cache manager makes 4 KV cache groups of
    2 layers (3 sliding-window, 1 full-attention)."""
    from vllm_kvmem.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("hybrid"),
        sliding_window=WINDOW,
        sliding_window_pattern=4,
    )


def _hybrid_kwargs(model, host, **extra):
    """The host tier's engine arguments; prefill chunks of 256 tokens, so a
    sliding-window group holds a few blocks per request where a full-attention
    one holds 16 (max_model_len 2048): vLLM's own capacity figure shows the
    difference."""
    kw = host_tier_kwargs(model, host, max_num_batched_tokens=256, **extra)
    kw["kv_cache_memory_bytes"] = HYBRID_DEVICE_KV
    return kw


def _kv_cache_groups(run) -> int:
    """KV cache groups vLLM formed (its engine core logs their block sizes
    when there are several)."""
    sizes = re.findall(r"kv cache group sizes \(([^)]*)\)", run.log)
    return len([x for x in sizes[0].split(",") if x.strip()]) if sizes else 1


def _check_same_kv_cache(off, on, groups):
    """With the tier as without: vLLM's hybrid KV cache manager stays on, with
    the same groups, blocks and capacity on every rank."""
    assert off.returncode == 0, off.log[-4000:]
    assert on.returncode == 0, on.log[-4000:]
    assert _kv_cache_groups(off) == _kv_cache_groups(on) == groups
    for line in HMA_OFF:
        assert line not in on.log
    assert len(on.ranks) == len(off.ranks)
    for a, b in zip(off.ranks, on.ranks):
        assert (b["num_blocks"], b["tokens"]) == (a["num_blocks"], a["tokens"])
        assert b["concurrency"] == pytest.approx(a["concurrency"])


def _unified_concurrency(rank) -> float:
    """What a rank's memory would hold with every layer sized as full
    attention (vLLM's hybrid KV cache manager off): a max_model_len request
    in blocks of every layer."""
    all_layers = rank["kv_bytes"] // (rank["layers"] * rank["page_bytes"])
    return all_layers / -(-rank["max_model_len"] // rank["block_size"])


def _hybrid_run(model, host, python=None):
    """The single-stage hybrid run without or with the tier, on the vLLM of
    ``python`` (this interpreter's by default), shared by the tests below."""
    kwargs = _hybrid_kwargs(model, host, enforce_eager=True)
    env = dict(python=python, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return run_engine(kwargs, host_tier_workload(), **env)


@both_vllms
def test_hybrid_model_keeps_its_kv_cache_groups_with_host_hits(
    model_hybrid, vllm_python
):
    """The tier serves the sliding-window groups too: host hits on the second
    pass (a hit restores each group's blocks the prefix needs) and identical
    greedy output, with vLLM's hybrid KV cache manager and its capacity."""
    off, on = side_by_side(
        lambda: _hybrid_run(model_hybrid, False, vllm_python),
        lambda: _hybrid_run(model_hybrid, True, vllm_python),
    )
    _check_same_kv_cache(off, on, groups=4)
    # The same device holds twice as many 2048-token requests as it would
    # with the manager off (16 MiB: 2.06x against 1.0x).
    assert on.ranks[0]["concurrency"] >= 2 * _unified_concurrency(on.ranks[0])
    _check_identical_and_hits(off, on)
    # Every document's prefix comes back, not only the full-attention group's.
    assert min(on.report["cached_tokens"][1]) >= 6 * on.ranks[0]["block_size"]
    assert (
        "for 4 KV cache groups (1 full attention, 3 sliding window of 256 tokens)"
    ) in on.log


@both_vllms
def test_hybrid_model_layout_line_matches_its_tensors(model_hybrid, vllm_python):
    """The tier asks for the contiguous layout; vLLM's rule gives it to a
    hybrid model (same run as above), and the one line says BLHNC, as the
    tensors are."""
    on = _hybrid_run(model_hybrid, True, vllm_python)
    assert on.returncode == 0, on.log[-4000:]
    assert on.ranks[0]["layout"] == "BLHNC"
    assert on.log.count("Using BLHNC KV cache layout: contiguous across layers") == 1
    assert "per layer" not in on.log and "per-layer layout" not in on.log


def test_hybrid_model_pipeline_of_two(model_hybrid):
    """A pipeline of 2 (stage 1 holds two sliding-window layers and one full):
    vLLM's hybrid KV cache manager stays on, every rank allocates what vLLM
    allocates without the tier (the offline planner's figure, which
    test_planner_agreement holds to real engines), each stage holds its slice
    of every host block, and the output is the single-stage run's with host
    hits (the baseline of the test above: one pipeline start, not two)."""
    from vllm_kvmem.planner import plan_capacity

    kw = dict(pipeline_parallel_size=2, compilation_config=PP_COMPILATION)
    on = run_engine(
        _hybrid_kwargs(model_hybrid, True, **kw),
        host_tier_workload(),
        VLLM_PP_LAYER_PARTITION="5,3",
    )
    off = _hybrid_run(model_hybrid, False)
    assert on.returncode == 0, on.log[-4000:]
    assert _kv_cache_groups(on) == 4
    for line in HMA_OFF:
        assert line not in on.log
    plan = dict(
        budget_bytes=HYBRID_DEVICE_KV,
        max_model_len=2048,
        max_num_batched_tokens=256,
        platform="cpu",
        dtype=HOST_TIER_DTYPE,
        pp=2,
        partition=[5, 3],
    )
    assert_agrees(on, plan_capacity(model_hybrid, **plan), 2048)
    unified = plan_capacity(model_hybrid, hybrid=False, **plan)  # manager off
    assert on.ranks[0]["tokens"] > unified.tokens
    _check_identical_and_hits(off, on)
    assert on.log.count("Host KV tier on this rank") == 2


def test_sliding_window_model_is_served(tmp_path):
    """Every layer sliding (one sliding-window KV cache group): served, with
    host hits and identical output (the tier used to turn itself off)."""
    from vllm_kvmem.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "sw", num_layers=4, sliding_window=WINDOW)
    work = host_tier_workload()
    kw = dict(enforce_eager=True, max_num_batched_tokens=256)
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # 16 blocks: fewer than the 12 documents' last windows (3 blocks each),
    # which are all a hit on a sliding window needs.
    off, on = side_by_side(
        *(
            lambda host=host: run_engine(
                dict(
                    host_tier_kwargs(model, host, **kw), kv_cache_memory_bytes=8 << 20
                ),
                work,
                **env,
            )
            for host in (False, True)
        )
    )
    _check_same_kv_cache(off, on, groups=1)
    _check_identical_and_hits(off, on)
    assert "Host KV tier off" not in on.log
    assert "for 1 KV cache group (sliding window of 256 tokens)" in on.log


def test_abort_mid_load_releases_everything(model_8l, monkeypatch, vllm_patched):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(**host_tier_kwargs(model_8l, True, enforce_eager=True))
    docs = host_tier_workload()["prompts"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(docs, params, use_tqdm=False)  # fills the host tier
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    tier = sched.connector.connector_scheduler
    pool = sched.kv_cache_manager.block_pool
    in_use, free = tier.host_bytes_in_use(), pool.get_num_free_blocks()
    assert in_use > 0
    counters = tier.index.counters
    spilled, dropped = counters.spilled_blocks, counters.dropped_blocks

    aborted: list[bool] = []
    schedule = sched.schedule
    engine = llm.llm_engine

    def schedule_then_abort(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.kv_connector_metadata.loads and not aborted:
            # The client aborts after the step was scheduled with host loads
            # and before its forward pass (and the loads) run.
            aborted.append(True)
            engine.abort_request(["victim"])
        return out

    monkeypatch.setattr(sched, "schedule", schedule_then_abort)
    engine.add_request("victim", docs[0], params)
    for _ in range(50):  # bounded: the request ends within a few steps
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert aborted  # the request was scheduled with host loads, then aborted
    assert tier.index.pinned_slots == 0
    assert (
        not tier.matcher.matched
        and not tier.matcher.lookups
        and not tier.slots.step_pins
    )
    # Host memory changed only by the blocks the victim's allocation evicted
    # (spilled as usual): nothing is held for the aborted load.
    new_blocks = (counters.spilled_blocks - spilled) - (
        counters.dropped_blocks - dropped
    )
    assert tier.host_bytes_in_use() == in_use + new_blocks * tier.pipeline_slot_bytes
    # The slot size the scheduler sized the tier with (from the KV cache
    # configs) is what the worker's copy engine allocated from the real tensors.
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    assert worker._engine.pool.slot_bytes == tier.pipeline_slot_bytes
    assert pool.get_num_free_blocks() == free
    # ... and the engine still serves the same prefix from the host tier.
    monkeypatch.setattr(sched, "schedule", schedule)
    out = llm.generate([docs[1]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    # A prefix-cache reset with the connector (after a weight update, say)
    # drops the host tier too: stale KV is never served.
    assert llm.reset_prefix_cache(reset_connector=True)
    assert tier.host_bytes_in_use() == 0
    out = llm.generate([docs[2]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_host_tier_smaller_than_one_steps_evictions(model_8l):
    """Three host blocks, prefills evicting eight device blocks per step: the
    tier must never hand one slot to two saves of the same step."""
    no_tier = host_tier_kwargs(model_8l, False, enforce_eager=True)
    small = dict(no_tier, kv_host_cache_bytes=3 << 20)
    env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # The single-stage tests' baseline (same engine, same workload).
    off = run_engine(no_tier, host_tier_workload(), **env)
    on = run_engine(small, host_tier_workload(), **env)
    assert on.returncode == 0, on.log[-4000:]
    assert on.report["token_ids"] == off.report["token_ids"]
    assert "Host KV tier: 3 blocks" in on.log


# Runs in a fresh process (VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and
# worker in that process, so its host pools can be counted there). The first
# engine's worker connector stays referenced after the shutdown, as a traceback
# or user code can keep it: vLLM's shutdown ends in gc.collect(), which would
# otherwise free an unreferenced pool whether the connector released it or not.
_TWO_ENGINES = """
import json, sys
from vllm_kvmem.plugin import register
register()
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm_kvmem.host_tier.host_pool import live_pools

kwargs = json.loads(sys.argv[1])
params = SamplingParams(max_tokens=2, temperature=0.0)
report = {}
first = LLM(**kwargs)
first.generate(["a short prompt"], params, use_tqdm=False)
report["first_running"] = len(live_pools())
kept = get_kv_transfer_group()  # the worker-side connector
first.llm_engine.engine_core.shutdown()  # in-process shutdown in vLLM 0.32
report["first_shut_down"] = len(live_pools())
report["kept_connector_closed"] = kept.connector_worker._engine is None
second = LLM(**kwargs)
report["second_running"] = len(live_pools())
out = second.generate(["a short prompt"], params, use_tqdm=False)
report["second_tokens"] = len(out[0].outputs[0].token_ids)
second.llm_engine.engine_core.shutdown()
report["second_shut_down"] = len(live_pools())
print("TWO_ENGINES " + json.dumps(report), flush=True)
"""


def test_engine_shutdown_releases_the_host_pool(model_8l):
    """Shutting an in-process engine down reaches the connector's shutdown()
    (vLLM: EngineCore.shutdown -> executor -> Worker.shutdown ->
    ensure_kv_transfer_shutdown), which releases the host pool: a second
    engine in the same process finds one live pool, its own, not two."""
    import json
    import subprocess
    import sys

    kwargs = host_tier_kwargs(model_8l, True, enforce_eager=True)
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_ENGINES, json.dumps(kwargs)],
        cwd=str(ROOT),
        env=engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TWO_ENGINES "))
    report = json.loads(line.split(" ", 1)[1])
    assert report == {
        "first_running": 1,
        "first_shut_down": 0,
        "kept_connector_closed": True,
        "second_running": 1,
        "second_shut_down": 0,
        "second_tokens": 2,
    }
    # The worker-side shutdown ran once per engine and released the pool, and
    # each engine's startup check logged how it computed the memory limit.
    assert log.count("Host KV tier released on this rank: 0.25 GiB") == 2
    assert log.count("Host KV tier memory check: 0.25 GiB x 1 TP x 1 DP-local") == 2
