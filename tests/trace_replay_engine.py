"""A request trace served by a real engine, one request at a time, with each
request's device and host hits as the engine counts them.

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

Run by tests/test_planner_trace.py against ``vllm_kvmem.planner.trace.predict``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

REPORT_PREFIX = "KVMEM_REPORT "


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    kwargs, workload = json.loads(argv[0]), json.loads(argv[1])
    llm = LLM(**kwargs)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    connector = sched.connector
    tier = connector.connector_scheduler if connector is not None else None
    requests = []
    for req in workload["requests"]:
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
    report = {
        "requests": requests,
        "num_gpu_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
        "block_size": sched.block_size,
        "host_slots": tier.num_slots if tier is not None else 0,
        "max_num_batched_tokens": sched.scheduler_config.max_num_batched_tokens,
    }
    print(REPORT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
