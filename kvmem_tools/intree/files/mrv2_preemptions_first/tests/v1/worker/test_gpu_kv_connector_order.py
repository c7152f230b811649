# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 gives the KV connector ``handle_preemptions`` before the
step writes its new blocks (zeroing, copy-on-write), as V1 does.

``update_requests`` runs for real; the runner's GPU state is a stand-in that
records the writes, so the order is checked without a GPU."""

from types import SimpleNamespace

import numpy as np

import vllm.v1.worker.gpu.model_runner as v2_runner
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector, KVConnector


class _Recorder:
    """The connector's worker-side calls, in order."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def handle_preemptions(self, metadata) -> None:
        self.calls.append("handle_preemptions")

    def bind_connector_metadata(self, metadata) -> None:
        self.calls.append("bind_connector_metadata")


def _scheduler_output() -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.scheduled_cached_reqs = CachedRequestData.make_empty()
    output.new_block_ids_to_zero = [3]
    output.kv_cache_block_copies = [KVCacheBlockCopy(1, 4)]
    output.kv_connector_metadata = object()
    return output


def test_update_requests_hands_preemptions_over_before_writing(monkeypatch):
    calls: list[str] = []

    class Connector(KVConnector):
        def handle_preemptions(self, scheduler_output) -> None:
            calls.append("handle_preemptions")

    monkeypatch.setattr(
        v2_runner,
        "copy_kv_cache_blocks_inplace",
        lambda *args: calls.append("copy_on_write"),
    )
    runner = SimpleNamespace(
        req_states=SimpleNamespace(
            num_computed_tokens_np=np.zeros(1, dtype=np.int32),
            prefill_len=SimpleNamespace(np=np.zeros(1, dtype=np.int32)),
            num_computed_prefill_tokens=np.zeros(1, dtype=np.int32),
            req_id_to_index={},
        ),
        kv_block_zeroer=SimpleNamespace(zero_block_ids=lambda ids: calls.append("zero")),
        kv_caches=[],
        kv_cache_config=SimpleNamespace(num_blocks=8),
        kv_connector=Connector(),
    )
    v2_runner.GPUModelRunner.update_requests(runner, _scheduler_output())
    assert calls == ["handle_preemptions", "zero", "copy_on_write"]


def test_pre_forward_does_not_hand_preemptions_over_again():
    calls: list[str] = []
    connector = object.__new__(ActiveKVConnector)
    connector.kv_connector = _Recorder(calls)
    connector._disabled = False
    connector._pending_load_kwargs = None
    output = _scheduler_output()
    connector.handle_preemptions(output)
    connector.pre_forward(output)
    assert calls == ["handle_preemptions", "bind_connector_metadata"]
