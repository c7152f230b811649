"""A request trace served by a real engine, one request at a time or as a
closed loop of clients, with each request's device and host hits as the
engine counts them.

``python tests/trace_replay_engine.py '{LLM kwargs}' '{"requests": [...]}'``
runs an engine whose scheduler lives in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), sends each request
(``{"prompt_token_ids": [...], "output_len": n}``, greedy, exactly ``n``
tokens) after the previous one finished, and prints one ``KVMEM_REPORT
{json}`` line: per request the prompt tokens, the cached tokens vLLM reports
(device and host hits), and the host tier's hit tokens (its scheduler's
``hit_tokens`` counter, the figure behind
``vllm:kvmem_host_hit_tokens_total``); and the engine's device block count,
block size and host slots, which the prediction is given.

With ``"concurrency": N`` in the workload, N requests are in flight: the
engine is stepped here (``LLMEngine.step``, one scheduling pass and forward
each), and the next request of the trace is added as soon as one finishes,
before the next step, as N clients would each send their next request at
once. A request's host hit is the tokens vLLM took from the tier when it
first allocated the request (``num_external_tokens`` of the tier's
``update_state_after_alloc``; ``host_total`` is the tier's counter).

Run by tests/test_planner_trace.py against ``vllm_kvmem.planner.trace.predict``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

REPORT_PREFIX = "KVMEM_REPORT "


def main(argv: list[str]) -> int:
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    kwargs, workload = json.loads(argv[0]), json.loads(argv[1])
    llm = LLM(**kwargs)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    connector = sched.connector
    tier = connector.connector_scheduler if connector is not None else None
    if workload.get("concurrency"):
        requests = closed_loop(llm, tier, workload["requests"], workload["concurrency"])
    else:
        requests = one_at_a_time(llm, tier, workload["requests"])
    report = {
        "requests": requests,
        "host_total": (tier.totals["hit_tokens"] if tier is not None else 0),
        "num_gpu_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
        "block_size": sched.block_size,
        "host_slots": tier.num_slots if tier is not None else 0,
        "max_num_batched_tokens": sched.scheduler_config.max_num_batched_tokens,
    }
    print(REPORT_PREFIX + json.dumps(report), flush=True)
    return 0


def one_at_a_time(llm: Any, tier: Any, trace: list[dict]) -> list[dict]:
    """Each request sent once the previous one finished."""
    from vllm import SamplingParams

    requests = []
    for req in trace:
        before = tier.totals["hit_tokens"] if tier is not None else 0
        params = SamplingParams(
            max_tokens=req.get("output_len", 1), temperature=0, ignore_eos=True
        )
        (out,) = llm.generate(
            {"prompt_token_ids": req["prompt_token_ids"]}, params, use_tqdm=False
        )
        host = (tier.totals["hit_tokens"] if tier is not None else 0) - before
        cached = out.num_cached_tokens or 0
        requests.append(
            {
                "prompt_tokens": len(req["prompt_token_ids"]),
                "cached": cached,
                "device": cached - host,
                "host": host,
                "generated": len(out.outputs[0].token_ids),
            }
        )
    return requests


def closed_loop(llm: Any, tier: Any, trace: list[dict], clients: int) -> list[dict]:
    """``clients`` requests in flight; a finished one's successor (the next in
    the trace) is added before the next step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    requests: list[dict] = [{} for _ in trace]
    sent = 0
    external: dict[str, int] = {}
    if tier is not None:
        # vLLM's word on each request's host hit, when it allocates it first
        # (a preempted request's second lookup is not counted, as vLLM's).
        alloc = tier.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, n: int) -> None:
            # The engine's id is ours with a random suffix ("3-1a2b3c4d").
            external.setdefault(request.request_id.rsplit("-", 1)[0], n)
            alloc(request, blocks, n)

        tier.update_state_after_alloc = update_state_after_alloc

    def send() -> None:
        nonlocal sent
        req = trace[sent]
        params = SamplingParams(
            max_tokens=req.get("output_len", 1), temperature=0, ignore_eos=True
        )
        engine.add_request(
            str(sent), {"prompt_token_ids": req["prompt_token_ids"]}, params
        )
        sent += 1

    while sent < min(clients, len(trace)):
        send()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                r = requests[int(out.request_id)]
                r["prompt_tokens"] = len(out.prompt_token_ids)
                r["cached"] = out.num_cached_tokens or 0
                r["host"] = external.get(out.request_id, 0)
                r["device"] = r["cached"] - r["host"]
                r["generated"] = len(out.outputs[0].token_ids)
        for out in outputs:
            if out.finished and sent < len(trace):
                send()
    return requests


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
