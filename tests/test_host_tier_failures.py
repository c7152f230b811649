"""Copies that fail do not take the engine down, and lose nothing (CPU).

A real in-process engine with the host tier; failures are injected inside
the real copy engine (its per-copy seam raises, as a CUDA fault would),
before any copy of a job or part way through one. What must hold:

- a failed save is logged once per cause, counted, and its blocks are not
  kept on the host: the scheduler forgets them, nothing loads from them;
- a failed load is recomputed;
- greedy output stays that of the same prompts computed from scratch, and
  the engine keeps serving.
"""

from __future__ import annotations

import pytest

from tests.helpers import captured_log, host_tier_kwargs, host_tier_workload, messages

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("vllm_patched")]

FAULT = "CUDA error: unspecified launch failure (injected)"


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _params(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _engine(model):
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = LLM(**host_tier_kwargs(model, True, enforce_eager=True))
    core = llm.llm_engine.engine_core.engine_core
    tier = core.scheduler.connector.connector_scheduler
    return llm, tier, get_kv_transfer_group().connector_worker


class Faults:
    """Makes the next ``jobs`` saves (or loads) of the copy engine fail after
    ``after_copies`` of their copies, inside the engine."""

    def __init__(self, engine, direction: str, after_copies: int, jobs: int) -> None:
        self.engine, self.after_copies, self.left = engine, after_copies, jobs
        self.failed_jobs = 0
        real = getattr(engine, direction)
        real_copy = type(engine)._copy

        def submit(*args, **kwargs):
            if self.left <= 0:
                return real(*args, **kwargs)
            self.left -= 1
            copies = 0

            def copy(dst, src):
                nonlocal copies
                if copies >= self.after_copies:
                    self.failed_jobs += 1
                    raise RuntimeError(FAULT)
                copies += 1
                real_copy(engine, dst, src)

            engine._copy = copy
            try:
                return real(*args, **kwargs)
            finally:
                del engine._copy

        setattr(engine, direction, submit)


@pytest.mark.parametrize("after_copies", [0, 1], ids=["at-once", "part-way"])
def test_failed_saves_are_contained(model_8l, in_process, after_copies):
    llm, tier, worker = _engine(model_8l)
    docs = host_tier_workload()["prompts"]
    faults = Faults(worker._engine, "save", after_copies, jobs=6)
    with captured_log("vllm.kvmem.host_tier") as records:
        first = llm.generate(docs, _params(4), use_tqdm=False)
        again = llm.generate(docs, _params(4), use_tqdm=False)
    assert faults.failed_jobs >= 2  # several saves failed ...
    said = [m for m in messages(records) if "saving" in m and "failed" in m]
    assert len(said) == 1 and FAULT in said[0]  # ... one cause, said once
    assert worker.totals["save_errors"] >= faults.failed_jobs
    # Their blocks were forgotten before any lookup: nothing loaded from them,
    # and the saves that worked still serve hits.
    assert worker.totals["load_errors"] == 0
    assert tier.totals["hit_tokens"] > 0
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # Nothing the scheduler still indexes is a slot whose save failed for good.
    assert not worker._bad_slots & set(tier.index._keys)
    assert llm.generate(["still serving"], _params(2), use_tqdm=False)


@pytest.mark.parametrize("after_copies", [0, 1], ids=["at-once", "part-way"])
def test_failed_loads_are_recomputed(model_8l, in_process, after_copies):
    llm, tier, worker = _engine(model_8l)
    docs = host_tier_workload()["prompts"]
    first = llm.generate(docs, _params(4), use_tqdm=False)
    faults = Faults(worker._engine, "load", after_copies, jobs=2)
    with captured_log("vllm.kvmem.host_tier") as records:
        again = llm.generate(docs, _params(4), use_tqdm=False)
    assert faults.failed_jobs >= 1
    assert any("will be recomputed" in m for m in messages(records))
    assert worker.totals["load_errors"] >= 1
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert tier.index.pinned_slots == 0 and not tier.loads.inflight
