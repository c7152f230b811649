"""benchmarks/workload_bench.py end to end in its quick mode: vLLM's own
multi-turn client (from the sdist) against OpenAI servers on the tiny model:
no offload and the plugin's host tier at 4x the device KV cache. The third
arm, vLLM's lazy CPU offload on the in-tree series, is left to the
benchmark's own runs (about 30 s more here, over the suite's time budget);
tests/test_intree_offload.py runs lazy offload on the series against the
tier.

The benchmark takes no lock here (``--lock ''``): run the test under
``flock /tmp/kvmem-bench.lock``, as every engine test. The pure helpers
(histogram quantile, cell plan, answer comparison) are checked without a
server.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.helpers import import_script

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "workload_bench.py"


@pytest.fixture(scope="module")
def bench():
    yield from import_script(BENCH)


def test_histogram_quantile_interpolates_inside_the_bucket(bench):
    # 10 observations <= 1, 10 more in (1, 2], none above.
    cumulative = {1.0: 10, 2.0: 20, math.inf: 20}
    assert bench.histogram_quantile(cumulative, 0.5) == 1.0
    assert bench.histogram_quantile(cumulative, 0.75) == pytest.approx(1.5)
    assert bench.histogram_quantile(cumulative, 0.99) == pytest.approx(1.98)
    assert bench.histogram_quantile({1.0: 0, math.inf: 0}, 0.99) is None
    before = {1.0: 4, 2.0: 5, math.inf: 5}
    assert bench.hist_delta(before, cumulative) == {1.0: 6, 2.0: 15, math.inf: 15}


def test_cells_group_by_host_size_with_none_first(bench):
    groups = bench.plan_cells(["none", "tier", "lazy"], [0, 1, 2])
    names = [[c.name for c in g] for g in groups]
    assert names == [["none", "tier@1x", "lazy@1x"], ["tier@2x", "lazy@2x"]]
    assert [[c.name for c in g] for g in bench.plan_cells(["none"], [0, 4])] == [
        ["none"]
    ]


def test_answers_compared_on_turns_both_runs_finished(bench):
    base = {"c0#1": ["a"], "c0#3": ["b"], "c1#1": ["x"]}
    other = {"c0#1": ["a"], "c0#3": ["B"], "c2#1": ["y"]}
    cmp = bench.compare_answers(base, other)
    assert cmp == {
        "compared": 2,
        "matching": 1,
        "mismatches": ["c0#3"],
        "in_one_run_only": 2,
    }


@pytest.mark.engine
def test_quick_run_no_offload_and_tier(bench, tmp_path):
    pytest.importorskip("pandas")  # vLLM's multi-turn client imports it
    out = tmp_path / "workload.json"
    t0 = time.monotonic()
    argv = ["--quick", "--arms", "none,tier", "--lock", "", "--out", str(out)]
    assert bench.main(argv) == 0
    wall = time.monotonic() - t0

    report = json.loads(out.read_text())
    assert report["platform"] == "CPU" and report["quick"] is True
    assert {"created", "command", "summary", "runs", "quiet", "sizes"} <= set(report)
    assert report["groups"] == [["none", "tier@4x"]]
    cells = {c["cell"]: c for c in report["summary"]["multi_turn"]}
    assert set(cells) == {"none", "tier@4x"}
    for c in cells.values():
        assert c["runs"] == 1 and c["failed"] == 0
        for key in ("ttft_p50_ms", "ttft_p90_ms", "itl_p99_ms", "req_per_s"):
            assert c[key]["median"] > 0 and c[key]["min"] <= c[key]["max"]
        assert c["ttft_p50_ms"]["median"] <= c["ttft_p90_ms"]["median"]
    # Both host tiers served prefixes that the device cache had evicted; with
    # no connector nothing came from host memory.
    assert cells["tier@4x"]["host_hit_rate"]["median"] > 0
    assert cells["none"]["host_hit_rate"]["median"] == 0
    runs = {r["cell"]: r for r in report["runs"]}
    assert runs["tier@4x"]["server_counters_delta"]["vllm:kvmem_host_hit_tokens"] > 0
    assert "vllm:kvmem_host_hit_tokens" not in runs["none"]["server_counters_delta"]
    for r in runs.values():
        for side in ("quiet_before", "quiet_after"):
            assert len(r[side]["loadavg"]) == 3 and r[side]["top"]
        # The trace holds every prompt token the server was sent.
        assert r["trace_prompt_tokens"]["trace"] == r["trace_prompt_tokens"]["server"]
    # Greedy answers are the same with and without either host tier.
    cmp = report["correctness"]["multi_turn"]["tier@4x#0"]
    assert cmp["compared"] > 0 and cmp["matching"] == cmp["compared"], cmp

    trace = json.loads(out.with_name("workload_trace.json").read_text())
    assert [t["cell"] for t in trace["runs"]] == ["none", "tier@4x"]
    for t in trace["runs"]:
        # Every request the server finished, and no other, is in the trace;
        # vLLM's client can lose a measurement (see run_multi_turn).
        summary = runs[t["cell"]]["summary"]
        assert len(t["requests"]) == summary["server_requests"]
        assert 0 < summary["requests"] <= summary["server_requests"]
        assert all(q["prompt_token_ids"] for q in t["requests"])
    assert out.with_suffix(".png").stat().st_size > 0
    print(f"quick two-arm run: {wall:.0f} s, {report['busy_s']:.0f} s not waiting")
