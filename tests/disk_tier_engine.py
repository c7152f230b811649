"""One engine of the disk tier's tests: ``python tests/disk_tier_engine.py
'{json}'`` with ``model``, ``disk`` (a directory, or null: no disk tier),
``host`` (host tier bytes, or null: no tier at all), ``docs`` (how many
documents), ``llm`` (more ``LLM`` arguments, optional), ``phases`` (lists
of document indices, generated one list at a time), ``hold`` (optional:
after the report, stay up until a line arrives on stdin) and
``pause_before`` (optional phase indices: before each, the disk writes
done, print ``PAUSED`` and wait for a line on stdin). The engine core runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and so does the worker
at TP=1, so the script reads the tier's counters on both sides; it prints
one ``REPORT {json}`` line with every phase's greedy tokens and cached-token
counts, the scheduler's counters and (TP=1) the worker's, after the
worker's disk writes are done.

Run by tests/test_disk_tier_engine.py, one process per engine (a restart is
a second process on the same directory).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(args: dict) -> dict:
    import vllm_kvmem

    vllm_kvmem.register()
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tests.helpers import host_tier_kwargs
    from vllm_kvmem.demo import documents

    extra = {}
    if args["disk"]:
        extra = dict(kv_disk_cache_path=args["disk"], kv_disk_cache_bytes=1 << 30)
    extra.update(args.get("llm", {}))
    kw = host_tier_kwargs(
        args["model"], args["host"] is not None, enforce_eager=True, **extra
    )
    if args["host"] is not None:
        kw["kv_host_cache_bytes"] = args["host"]
    llm = LLM(**kw)
    docs = documents(args["docs"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    phases = []
    for i, phase in enumerate(args["phases"]):
        if i in args.get("pause_before", ()):
            # The files are written; the test changes them under the engine.
            worker = get_kv_transfer_group().connector_worker
            assert worker._disk.store.flush(timeout=60), "disk writes stuck"
            print("PAUSED", flush=True)
            sys.stdin.readline()
        outs = llm.generate([docs[i] for i in phase], params, use_tqdm=False)
        phases.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
            }
        )
    report: dict = {"phases": phases}
    if args["host"] is not None:
        core = llm.llm_engine.engine_core.engine_core
        tier = core.scheduler.connector.connector_scheduler
        report["scheduler"] = dict(tier.totals)
        if kw.get("tensor_parallel_size", 1) == 1:  # the worker is in here
            worker = get_kv_transfer_group().connector_worker
            if worker._disk is not None:
                assert worker._disk.store.flush(timeout=60), "disk writes stuck"
            worker.stats()  # fold the disk counters in
            report["worker"] = dict(worker.totals)
        if tier.disk is not None:
            report["disk_bytes_in_use"] = tier.disk.bytes_in_use()
    return report


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print("REPORT " + json.dumps(main(args)), flush=True)
    if args.get("hold"):  # stay up (another engine uses the directory) until told
        sys.stdin.readline()
