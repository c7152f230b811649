"""The host KV tier on a real vLLM engine (CPU).

Workload: documents whose working set is several times the device KV cache,
read twice. Without the tier the second pass recomputes every prefix (the
device cache has evicted them); with it, the evicted blocks come back from
host memory. Greedy output must be token-identical either way, in a single
process, with the multi-process engine, and on a pipeline of 2.
"""

from __future__ import annotations

import pytest

from tests.helpers import (
    ENGINE_TIMEOUT_S,
    ROOT,
    engine_env,
    host_tier_kwargs,
    host_tier_workload,
    run_engine,
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


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_single_stage_output_identical_with_host_hits(model_8l, multiprocess):
    """Against one baseline without the tier (in-process engine): the output
    of one engine does not depend on where its core runs."""
    work = host_tier_workload()
    off = run_engine(
        host_tier_kwargs(model_8l, False, enforce_eager=True),
        work,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    on = run_engine(
        host_tier_kwargs(model_8l, True, enforce_eager=True),
        work,
        VLLM_ENABLE_V1_MULTIPROCESSING=multiprocess,
    )
    _check_identical_and_hits(off, on)


def test_pipeline_of_two_output_identical_with_host_hits(model_8l):
    kw = dict(pipeline_parallel_size=2, compilation_config=PP_COMPILATION)
    env = dict(VLLM_PP_LAYER_PARTITION="5,3")
    work = host_tier_workload(8)
    off = run_engine(host_tier_kwargs(model_8l, False, **kw), work, **env)
    on = run_engine(host_tier_kwargs(model_8l, True, **kw), work, **env)
    _check_identical_and_hits(off, on)
    assert on.log.count("Host KV tier on this rank") == 2  # both stages hold a slice


def test_unsupported_model_turns_the_tier_off_and_serves(tmp_path):
    from vllm_kvmem.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "sw", num_layers=4, sliding_window=256)
    run = run_engine(
        host_tier_kwargs(model, True, enforce_eager=True),
        {"prompts": ["a short prompt"], "max_tokens": 4},
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    assert run.returncode == 0, run.log[-4000:]
    assert run.log.count("Host KV tier off: its layers use SlidingWindowSpec") == 1
    assert len(run.report["token_ids"][0]) == 4


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
    assert not tier._matched and not tier._lookups and not tier._step_pins
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
from vllm_kvmem.host_tier import scheduler
from vllm_kvmem.core.host_pool import live_pools

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
report["listener_cleared"] = scheduler._evict_listener is None
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
        "listener_cleared": True,
        "second_running": 1,
        "second_shut_down": 0,
        "second_tokens": 2,
    }
    # The worker-side shutdown ran once per engine and released the pool, and
    # each engine's startup check logged how it computed the memory limit.
    assert log.count("Host KV tier released on this rank: 0.25 GiB") == 2
    assert log.count("Host KV tier memory check: 0.25 GiB x 1 TP x 1 DP-local") == 2
