"""The host tier's CPU copy thread on a real vLLM engine (CPU).

With ``kv_host_cache_copy_thread``, a worker's copies run on one thread
beside the forward pass, and a hit loaded for this step's forward is waited
for layer by layer: vLLM calls the connector's ``wait_for_layer_load`` before
each attention layer, and the layer waits for its own unit of the load only.
One in-process engine per test (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
test sees the worker's connector; greedy output is compared with the same
prompt computed from scratch in the same engine (float32).
"""

from __future__ import annotations

import pytest

from tests.helpers import captured_log, host_tier_kwargs, host_tier_workload

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("vllm_patched")]

BLOCK_BYTES = 1 << 20  # model_8l in float32: one 128-token block over 8 layers


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _params(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _filled(model, copy_thread):
    """An engine whose host tier holds the workload's documents, a step
    budget that loads one document's hit before the forward that uses it,
    and the worker's connector."""
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = LLM(
        **host_tier_kwargs(
            model,
            True,
            enforce_eager=True,
            kv_host_cache_step_bytes=8 * BLOCK_BYTES,
            kv_host_cache_copy_thread=copy_thread,
        )
    )
    docs = host_tier_workload()["prompts"]
    first = llm.generate(docs, _params(4), use_tqdm=False)
    return llm, docs, first, get_kv_transfer_group().connector_worker


def _record_unit_waits(monkeypatch):
    """Every wait for a load's layer unit: (unit, units done when it returned)."""
    from vllm_kvmem.host_tier import copy_engine

    waits = []
    wait = copy_engine._UnitProgress.wait

    def recording(self, unit):
        wait(self, unit)
        waits.append((unit, self._done))

    monkeypatch.setattr(copy_engine._UnitProgress, "wait", recording)
    return waits


def test_each_layer_waits_for_its_own_unit_of_a_hit(model_8l, in_process, monkeypatch):
    llm, docs, first, worker = _filled(model_8l, "on")
    attention = sorted(worker._layer_units, key=lambda n: int(n.split(".")[2]))
    # Every attention layer of the model is one unit of a load, in model order.
    assert len(attention) == 8
    assert [worker._layer_units[n] for n in attention] == list(range(8))
    waits = _record_unit_waits(monkeypatch)
    again = llm.generate([docs[0]], _params(4), use_tqdm=False)[0]
    # Seven blocks loaded for this step's forward (the eighth holds the last
    # prompt token), waited for layer by layer in the order the forward runs,
    # each wait over once its own unit was in place.
    assert again.num_cached_tokens == 7 * 128
    assert [u for u, _ in waits] == list(range(8))
    assert all(done > unit for unit, done in waits)
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert not worker._step_loads  # finished with the step


def test_a_load_that_fails_on_the_copy_thread_is_recomputed(
    model_8l, in_process, monkeypatch
):
    from vllm_kvmem.host_tier.copy_engine import BlockCopyEngine

    llm, docs, first, worker = _filled(model_8l, "on")

    def broken(self, blocks, slots, progress):
        progress.advance()  # one layer in place, then the fault
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(BlockCopyEngine, "_load_units", broken)
    with captured_log("vllm.kvmem") as records:
        again = llm.generate([docs[0]], _params(4), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    failed = [r.getMessage() for r in records if "copy thread failed" in r.getMessage()]
    assert failed and "injected copy fault" in failed[0]


def test_copy_thread_off_copies_in_the_step(model_8l, in_process, monkeypatch):
    llm, docs, first, worker = _filled(model_8l, "off")
    waits = _record_unit_waits(monkeypatch)
    again = llm.generate([docs[0]], _params(4), use_tqdm=False)[0]
    assert not worker._engine.copy_thread and not worker._layer_units
    assert again.num_cached_tokens == 7 * 128 and waits == []
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
