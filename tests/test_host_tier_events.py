"""KV events for host blocks, on a real engine (CPU).

A KV-aware router (llm-d's indexer, Dynamo's router, Ray Serve's
``KVAwareRouter``) learns where a prefix lives from vLLM's KV events; a block
in host memory is ``medium="CPU"``. ``tests/host_tier_events_engine.py``
replays every batch vLLM publishes into a router's index, keyed by token
content, and predicts each request's cached tokens before sending it. With
the tier's events the prediction is exact, host hits included; without
them every host hit would be a miss to the router. (``events_run`` in
tests/helpers.py: tests/test_tp2_engine.py runs the same script at TP=2.)
"""

from __future__ import annotations

import pytest

from tests.helpers import events_run, on_vllm033

pytestmark = [pytest.mark.engine]


@on_vllm033
def test_router_predicts_every_hit_with_host_blocks(model_8l, vllm_python):
    """On 0.33 (on 0.32: tests/test_kv_events_check.py over vLLM's ZMQ
    publisher, and tests/test_host_tier_step_cost.py step by step)."""
    report = events_run(model_8l, vllm_python)
    requests, events = report["requests"], report["events"]
    # Host hits happened, and the router saw each of them coming.
    assert report["host_hit_tokens"] >= 16 * report["block_size"]
    assert report["mismatches"] == 0, [(r["predicted"], r["cached"]) for r in requests]
    # Every step, the host blocks the events announce are the tier's.
    assert report["steps"]["checked"] > 0
    assert report["steps"]["host_set_mismatches"] == 0
    # Self-describing: each host block's event is the device's (tokens,
    # parent), sent once; the host's own evictions are announced.
    assert report["violations"] == [] and report["without_tokens"] == 0
    assert events["BlockStored:CPU"] > 40
    assert events["BlockRemoved:CPU"] > 0
    # The reset: the device's AllBlocksCleared and the tier's.
    assert events["AllBlocksCleared"] == 2
    after_reset = requests[24:]
    assert [r["cached"] for r in after_reset] == [0, 0, 0]
