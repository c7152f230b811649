"""The host tier's asynchronous life of a block on a real vLLM engine (CPU).

One in-process engine per test (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
scheduler, its connector and the worker's connector live in this process, so
the tests can watch every step's metadata and counters):

- a request with host hits waits in ``WAITING_FOR_REMOTE_KVS`` for its own
  blocks, a bounded number per step, while another request keeps decoding;
- a hit that fits what is left of the step's budget loads before that
  step's forward and runs in the same step; queued loads come first;
- cached blocks are copied to the host ahead of eviction, once, and a later
  eviction of them moves nothing;
- a block evicted before its copy ran is spilled late, or dropped;
- a corrupted host block is caught by the integrity check and recomputed.

Greedy output is compared with the same prompt computed from scratch in the
same engine (float32, see ``tests.helpers.host_tier_kwargs``).
"""

from __future__ import annotations

import pytest

from tests.helpers import captured_log, host_tier_kwargs, host_tier_workload, messages

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("vllm_patched")]

BLOCK_BYTES = 1 << 20  # model_8l in float32: one 128-token block over 8 layers


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _engine(model, **extra):
    from vllm import LLM

    llm = LLM(**host_tier_kwargs(model, True, enforce_eager=True, **extra))
    core = llm.llm_engine.engine_core.engine_core
    return llm, core.scheduler, core.scheduler.connector.connector_scheduler


def _filled(model, monkeypatch, max_tokens, **extra):
    """An engine whose host tier holds the workload's documents (their first
    outputs returned), recording every later step's connector metadata."""
    llm, sched, tier = _engine(model, **extra)
    docs = host_tier_workload()["prompts"]
    first = llm.generate(docs, _params(max_tokens), use_tqdm=False)
    return llm, sched, tier, docs, first, _record_metas(monkeypatch, sched)


def _params(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _internal_ids(sched, name):
    """vLLM gives each request an internal id (the client's plus a suffix)."""
    return [r for r in sched.requests if r == name or r.startswith(name + "-")]


def _record_metas(monkeypatch, sched):
    """Every step's connector metadata, in order."""
    metas = []
    schedule = sched.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        metas.append(out.kv_connector_metadata)
        return out

    monkeypatch.setattr(sched, "schedule", recording)
    return metas


def test_host_hit_loads_in_bounded_chunks_while_others_decode(
    model_8l, in_process, monkeypatch
):
    from vllm.v1.request import RequestStatus

    llm, sched, tier, docs, first, metas = _filled(
        model_8l, monkeypatch, 8, kv_host_cache_step_bytes=2 * BLOCK_BYTES
    )
    engine = llm.llm_engine
    engine.add_request("A", "an unrelated request that keeps decoding", _params(60))
    engine.step()  # A's prefill
    engine.add_request("B", docs[0], _params(8))
    a_tokens, b_waiting, b_out = [], 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "A":
                a_tokens.append(len(out.outputs[0].token_ids))
            elif out.finished:
                b_out = out
        for rid in _internal_ids(sched, "B"):
            if sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                b_waiting += 1
    loads = [sum(len(c.blocks) for c in m.loads) for m in metas]
    # Seven host blocks (the eighth holds the last prompt token) in chunks of
    # at most two: B waits at least three steps for its own blocks...
    assert sum(loads) == 7 and max(loads) == 2
    assert b_waiting >= 3
    # ... while A produces a token in every step (none is held for B's copy).
    assert a_tokens == list(range(2, len(a_tokens) + 2))
    assert b_out.num_cached_tokens == 7 * 128
    assert b_out.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert tier.index.pinned_slots == 0 and not tier.loads.inflight


def test_hit_within_the_step_budget_runs_in_the_same_step(
    model_8l, in_process, monkeypatch
):
    from vllm.v1.request import RequestStatus

    llm, sched, tier, docs, first, metas = _filled(
        model_8l, monkeypatch, 4, kv_host_cache_step_bytes=8 * BLOCK_BYTES
    )
    engine = llm.llm_engine
    engine.add_request("B1", docs[0], _params(4))
    engine.add_request("B2", docs[1], _params(4))
    outs = {out.request_id: out for out in engine.step()}
    # B1's seven blocks fit the budget of eight: loaded before this step's
    # forward, and B1 has its first token from this very step. B2 gets the
    # one block left, asynchronously, and waits for the rest.
    b1, b2 = metas[0].loads
    assert (b1.sync, len(b1.blocks), b1.last) == (True, 7, True)
    assert (b2.sync, len(b2.blocks), b2.last) == (False, 1, False)
    assert len(outs["B1"].outputs[0].token_ids) == 1
    (b2_id,) = _internal_ids(sched, "B2")
    assert sched.requests[b2_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert tier.loads.queue[b2_id].pairs  # six blocks still queued
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    # Queued loads come first: B2's rest is the next step's load, alone.
    assert [(c.sync, len(c.blocks)) for c in metas[1].loads] == [(False, 6)]
    assert all(sum(len(c.blocks) for c in m.loads) <= 8 for m in metas)
    for name, doc in (("B1", first[0]), ("B2", first[1])):
        assert outs[name].num_cached_tokens == 7 * 128
        assert outs[name].outputs[0].token_ids == doc.outputs[0].token_ids
    assert tier.index.pinned_slots == 0 and not tier.loads.inflight


def test_blocks_are_copied_ahead_once_and_eviction_moves_nothing(
    model_8l, in_process, monkeypatch
):
    llm, sched, tier = _engine(model_8l)
    docs = host_tier_workload()["prompts"]
    stats = tier.totals  # counters since start
    x = llm.generate([docs[0]], _params(1), use_tqdm=False)[0]
    # Y decodes while X's blocks sit in the free queue: they are copied ahead.
    llm.generate([docs[1]], _params(6), use_tqdm=False)
    ahead = stats["bytes_saved_ahead"] // BLOCK_BYTES
    assert ahead >= 7  # X: seven full blocks (the eighth is partial)
    assert stats["bytes_saved_at_eviction"] == 0
    metas = _record_metas(monkeypatch, sched)
    # Z and W evict X's and Y's blocks: already on the host, nothing moves.
    llm.generate(docs[2:4], _params(1), use_tqdm=False)
    assert stats["blocks_evicted_on_host"] >= 7
    assert not any(m.evict_saves for m in metas)
    # Nothing was copied twice: one host slot per distinct block hash saved.
    assert tier.index.counters.spilled_blocks == len(tier.index)
    again = llm.generate([docs[0]], _params(1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 7 * 128
    assert again.outputs[0].token_ids == x.outputs[0].token_ids


@pytest.mark.parametrize("late", ["copy", "drop"])
def test_blocks_evicted_before_their_copy_ran(model_8l, in_process, late):
    # One block per step: X's eight blocks cannot all be copied ahead during
    # Y's two steps, so Z's allocation evicts some before their copy.
    llm, sched, tier = _engine(
        model_8l, kv_host_cache_step_bytes=BLOCK_BYTES, kv_host_cache_late_spill=late
    )
    docs = host_tier_workload()["prompts"]
    stats = tier.totals
    x = llm.generate([docs[0]], _params(1), use_tqdm=False)[0]
    llm.generate([docs[1]], _params(2), use_tqdm=False)
    llm.generate(docs[2:4], _params(1), use_tqdm=False)
    again = llm.generate([docs[0]], _params(1), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == x.outputs[0].token_ids
    if late == "copy":
        assert stats["bytes_saved_at_eviction"] > 0
        assert stats["blocks_evicted_dropped"] == 0
        assert again.num_cached_tokens == 7 * 128
    else:
        assert stats["bytes_saved_at_eviction"] == 0
        assert stats["blocks_evicted_dropped"] > 0
        # The blocks copied ahead are the tail of X (the free queue evicts a
        # request's last block first); without its head no prefix hits.
        assert again.num_cached_tokens < 7 * 128


def test_corrupted_host_block_is_recomputed_not_served(model_8l, in_process):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm, sched, tier = _engine(model_8l, kv_host_cache_verify=True)
    docs = host_tier_workload()["prompts"]
    first = llm.generate(docs, _params(8), use_tqdm=False)
    worker = get_kv_transfer_group().connector_worker
    assert worker._checksums  # every save was checksummed
    worker._engine.pool.tensor.add_(1)  # every host byte is now wrong
    with captured_log("vllm.kvmem.host_tier") as records:
        again = llm.generate([docs[0]], _params(8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    said = messages(records)
    assert any("fail their checksum; they will be recomputed" in m for m in said)
    assert worker.totals["load_errors"] >= 1


@pytest.mark.parametrize("copy_thread", ["off", "on"])
def test_abort_while_loads_are_queued_releases_everything(
    model_8l, in_process, monkeypatch, copy_thread
):
    """An aborted request's queued loads are cancelled; its chunk in flight
    still lands (on the copy thread: whenever the thread gets to it, while
    vLLM keeps stepping: the request is finished but still holds blocks),
    and then everything is released."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm, sched, tier = _engine(
        model_8l,
        kv_host_cache_step_bytes=BLOCK_BYTES,
        kv_host_cache_copy_thread=copy_thread,
    )
    docs = host_tier_workload()["prompts"]
    llm.generate(docs, _params(4), use_tqdm=False)
    pool = sched.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    metas = _record_metas(monkeypatch, sched)
    engine = llm.llm_engine
    engine.add_request("victim", docs[0], _params(4))
    engine.step()  # the first chunk of its loads is handed out
    assert sum(len(c.blocks) for c in metas[-1].loads) == 1
    (victim,) = _internal_ids(sched, "victim")
    assert victim in tier.loads.queue  # the rest waits
    engine.abort_request(["victim"])
    assert sched.has_requests()  # vLLM's engine loop keeps stepping for it
    worker = get_kv_transfer_group().connector_worker
    assert worker._engine.copy_thread == (copy_thread == "on")
    for jobs in list(worker._loads.values()):
        for job in jobs:
            job.wait()  # the chunk in flight (on the copy thread) lands
    # One step: the cancelled rest goes out as an empty last chunk, and the
    # worker reports the request's loads finished.
    engine.step()
    assert not _internal_ids(sched, "victim")
    assert not sched.has_requests()
    assert tier.index.pinned_slots == 0
    assert not tier.loads.queue and not tier.loads.inflight and not tier.matcher.matched
    assert pool.get_num_free_blocks() == free
    # Only one chunk was copied, and the same prefix is still served.
    assert sum(sum(len(c.blocks) for c in m.loads) for m in metas) == 1
    out = llm.generate([docs[0]], _params(4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 7 * 128


def test_shadow_sees_every_eviction_of_a_free_cached_block(
    model_8l, in_process, monkeypatch
):
    """The tier learns of evictions from vLLM's block pool alone (a shadow of
    the free queue's head, bind_gpu_block_pool): every free cached block vLLM
    hands to another request, as a spy on BlockPool._maybe_evict_cached_block
    sees it, reaches the tier once, with the hash it held."""
    llm, sched, tier = _engine(model_8l, kv_host_cache_step_bytes=BLOCK_BYTES)
    pool = sched.kv_cache_manager.block_pool
    evicted, told = [], []
    evict = pool._maybe_evict_cached_block

    def spy(block):
        if block.block_hash is not None and block.ref_cnt == 0:
            evicted.append((block.block_id, block.block_hash))
        return evict(block)

    monkeypatch.setattr(pool, "_maybe_evict_cached_block", spy)
    on_evicted = tier._on_evicted

    def heard(block_id, key, covered):
        told.append((block_id, key))
        return on_evicted(block_id, key, covered)

    monkeypatch.setattr(tier, "_on_evicted", heard)
    docs = host_tier_workload()["prompts"]
    llm.generate([docs[0]], _params(1), use_tqdm=False)
    llm.generate([docs[1]], _params(2), use_tqdm=False)
    llm.generate(docs[2:4], _params(1), use_tqdm=False)
    llm.generate([docs[0]], _params(1), use_tqdm=False)
    assert len(evicted) >= 8
    assert told == evicted
