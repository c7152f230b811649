"""Run one of vLLM's offline benchmark scripts as written and keep what it
measured but does not write anywhere.

``benchmarks/benchmark_long_document_qa_throughput.py`` from vLLM's sdist
builds an ``LLM`` from its command line, calls ``generate`` twice (a warm-up
and the measured pass) and prints only each pass's wall time. This driver
runs that script unchanged (``runpy``, its own ``__main__``), and watches
``LLM.generate`` from outside: per pass, the wall
time, each request's greedy token ids, cached tokens and first-token latency;
after each pass, the engine's in-process Prometheus metrics
(``LLM.get_metrics``).

Usage (workload_bench.py starts it with each arm's environment)::

    python _offline_client.py SCRIPT OUT.json -- SCRIPT_ARGS...

It imports only vLLM: the in-tree arm runs it with a vLLM tree that must not
load vllm_kvmem.
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from typing import Any


def _metrics(llm: Any) -> dict[str, Any]:
    """Counters (summed over label sets) and histograms (buckets summed)."""
    from vllm.v1.metrics.reader import Counter, Histogram

    counters: dict[str, float] = {}
    histograms: dict[str, dict[str, Any]] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            counters[m.name] = counters.get(m.name, 0) + m.value
        elif isinstance(m, Histogram):
            h = histograms.setdefault(m.name, {"buckets": {}, "count": 0, "sum": 0.0})
            for le, n in m.buckets.items():
                h["buckets"][le] = h["buckets"].get(le, 0) + n
            h["count"] += m.count
            h["sum"] += m.sum
    return {"counters": counters, "histograms": histograms}


def main(argv: list[str]) -> int:
    script, out, sep, *script_args = argv
    assert sep == "--", "usage: _offline_client.py SCRIPT OUT.json -- ARGS..."
    from vllm import LLM

    passes: list[dict[str, Any]] = []
    generate = LLM.generate

    def watched_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        outputs = generate(self, *args, **kwargs)
        wall = time.perf_counter() - t0
        passes.append(
            {
                "wall_s": wall,
                "requests": [
                    {
                        "prompt_token_ids": list(o.prompt_token_ids or []),
                        "token_ids": list(o.outputs[0].token_ids),
                        "cached_tokens": o.num_cached_tokens,
                        "ttft_s": (
                            o.metrics.first_token_latency if o.metrics else None
                        ),
                    }
                    for o in outputs
                ],
                # After the pass: the pass's own counts are the differences.
                "metrics_after": _metrics(self),
            }
        )
        return outputs

    LLM.generate = watched_generate  # type: ignore[method-assign]
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    report = {"passes": passes}
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
