"""The pure parts of benchmarks/stall_bench.py: prompts, gaps, the window
around B, summaries and targets (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import import_script

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "stall_bench.py"


@pytest.fixture(scope="module")
def bench():
    yield from import_script(BENCH)


@pytest.fixture(scope="module")
def figures(bench):
    """The module beside the script that holds what these tests read."""
    yield from import_script(BENCH.parent / "_stall_figures.py")


def test_model_shapes_store_128_kib_per_token(bench):
    for shape in bench.SHAPES.values():
        assert shape.kv_bytes_per_token() == 128 * 1024


def test_prompts_exact_distinct_and_b_extends_d1(bench):
    args = bench.parse_args([])
    p = bench.build_prompts(args)
    assert len(p["d1"]) == 2048 and len(p["d2"]) == 3072
    assert p["b"][: len(p["d1"])] == p["d1"]
    assert len(p["b"]) == 2048 + args.question_tokens
    bs = bench.BLOCK_SIZE
    firsts = {tuple(p[k][:bs]) for k in ("warmup", "d1", "d2", "a")}
    assert len(firsts) == 4  # no shared first block
    assert all(bench.FIRST_ID <= t < bench.VOCAB_SIZE for t in p["d2"][1:])
    assert bench.build_prompts(args) == p


def test_gaps_and_window(figures):
    chunks = [[1.0, 1], [1.01, 1], [1.02, 2], [1.5, 1], [1.51, 1]]
    arr = figures.token_arrivals(chunks)
    assert arr == [1.0, 1.01, 1.02, 1.02, 1.5, 1.51]
    spans = figures.gaps(arr)
    assert len(spans) == 5 and spans[2] == (1.02, 1.02)
    # B in flight 1.1..1.45: only the gap 1.02 -> 1.5 overlaps it
    assert figures.window_gaps(spans, 1.1, 1.45) == [(1.02, 1.5)]
    assert figures.window_gaps(spans, 2.0, 3.0) == []


def _result(gap_ms: list[float], b_send: float, b_end: float, cached: int):
    t, chunks = 0.5, [[0.5, 1]]
    for g in gap_ms:
        t += g / 1e3
        chunks.append([t, 1])
    req = {"latency_s": 1.0, "cached_tokens": 0}
    return {
        "a": {"chunks": chunks},
        "b": {
            "t_send": b_send,
            "t_end": b_end,
            "latency_s": b_end - b_send,
            "prompt_tokens": 2064,
            "cached_tokens": cached,
            "a_tokens_before_send": 30,
        },
        "d1": req,
        "d2": req,
    }


def test_summary_aggregate_and_targets(bench):
    # 10 ms steps, one 500 ms stall starting at t = 0.6 while B runs
    fast = _result([10] * 10 + [500] + [10] * 10, 0.61, 1.105, 2048)
    s = bench.summarize_run(fast)
    assert s["a_tokens"] == 22 and s["a_ttft_s"] == 0.5
    assert s["a_median_gap_s"] == pytest.approx(0.010)
    assert s["a_worst_gap_s"] == pytest.approx(0.500)
    assert s["gap_ratio"] == pytest.approx(50.0)
    assert s["window_gaps"] == 2  # the stall and the step B's response ends in

    good = _result([10] * 21, 0.55, 0.58, 2048)
    runs = [
        {"config": "tier", "summary": bench.summarize_run(good)},
        {"config": "tier", "summary": s},
        {"config": "tier", "summary": bench.summarize_run(good)},
        {"config": "none", "summary": s},
        {"config": "none", "summary": None},  # a failed run is left out
    ]
    agg = bench.aggregate(runs)
    assert agg["none"]["runs"] == 1 and agg["tier"]["runs"] == 3
    assert agg["tier"]["gap_ratio"]["median"] == pytest.approx(1.0)
    assert agg["tier"]["gap_ratio"]["max"] == pytest.approx(50.0)
    targets = bench.evaluate_targets(agg, 2048)
    assert [t["passed"] for t in targets] == [True, True, True]
    agg["tier"]["b_cached_tokens"]["min"] = 416
    assert not bench.evaluate_targets(agg, 2048)[2]["passed"]
    assert bench.evaluate_targets({"none": agg["none"]}, 2048) == []

    # With a device-hit arm, the goals are relative to it (issue 45): the
    # tier's worst gap (median 10 ms) and B latency (median 30 ms) against
    # the device hit's.
    device = _result([10] * 21, 0.55, 0.57, 2048)
    agg = bench.aggregate(
        runs + [{"config": "device", "summary": bench.summarize_run(device)}]
    )
    targets = bench.evaluate_targets(agg, 2048)
    assert [t["threshold"] for t in targets[:2]] == [1.25, 1.25]
    assert [t["passed"] for t in targets] == [True, False, True]
    assert targets[1]["value"] == pytest.approx(0.030 / 0.020)


def test_tier_budget_variants(bench, tmp_path):
    import argparse

    assert bench._configs("none,tier@256M") == ["none", "tier@256M"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"tier@SIZE.*tier@128M"):
        bench._configs("tier@lots")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\['tire'\]"):
        bench._configs("tire")
    assert "--kv-host-cache-bytes" not in bench.server_args("none", tmp_path)
    assert bench._configs("tier+drop,tier@64M+copy") == ["tier+drop", "tier@64M+copy"]
    with pytest.raises(argparse.ArgumentTypeError, match="tier\\+drop"):
        bench._configs("tier+keep")
    assert bench._configs("tier+inline,tier+drop+inline") == [
        "tier+inline",
        "tier+drop+inline",
    ]
    assert bench.server_args("tier+inline", tmp_path)[-2:] == [
        "--kv-host-cache-copy-thread",
        "off",
    ]
    step, late = "--kv-host-cache-step-bytes", "--kv-host-cache-late-spill"
    for config, tail in (
        ("tier@256M", ["--kv-host-cache-bytes", "3G", step, "256M"]),
        ("tier@64M+drop", [step, "64M", late, "drop"]),
    ):
        assert bench.server_args(config, tmp_path)[-4:] == tail, config
    runs = [{"config": c, "summary": None} for c in ("tier@256M", "none")]
    assert bench.aggregate(runs) == {}  # no finished run, nothing to aggregate


def test_help_renders(bench, capsys):
    # argparse %-formats help texts: a bare "%" in one made --help crash.
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--help"])
    assert exit_.value.code == 0
    assert (
        f"under {bench.IDLE_BUSY_MAX * 100:.0f}% of the CPU" in capsys.readouterr().out
    )
