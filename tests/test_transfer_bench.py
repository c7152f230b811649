"""Smoke test of benchmarks/transfer_bench.py: it runs and reports (no speed checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import import_script

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "transfer_bench.py"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("matplotlib")
    yield from import_script(BENCH)


def test_quick_run_writes_json_and_png(bench, tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert (
        bench.main(["--quick", "--device", "cpu", "--iters", "1", "--out", str(out)])
        == 0
    )

    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert {"device_name", "torch", "config", "ceiling", "results", "targets"} <= set(
        report
    )
    for direction in ("d2h", "h2d"):
        assert report["ceiling"][direction]["gbps"] > 0

    results = report["results"]
    keys = {"shape", "block_size", "layout", "pattern", "direction", "gbps", "num_ops"}
    assert results and all(keys <= set(r) for r in results)
    assert all(r["gbps"] > 0 and r["seconds"] > 0 and r["bytes"] > 0 for r in results)
    combos = {(r["shape"], r["layout"], r["pattern"], r["direction"]) for r in results}
    assert len(combos) == 2 * 5 * 2 * 2  # shapes x layouts x patterns x directions
    assert {r["block_size"] for r in results} == {16, 32}

    # Each layout's path: direct and gather forced, auto as choose_strategy
    # says (on CPU: direct for the block-outer layout), naive without engine.
    paths = {
        "contiguous": {"direct"},
        "contiguous_gather": {"gather"},
        "contiguous_auto": {"direct"},
        "per_layer": {"gather"},
        "per_layer_naive": {"naive"},
    }
    for layout, expected in paths.items():
        assert {r["strategy"] for r in results if r["layout"] == layout} == expected
    assert any("unverified" in note for note in report["notes"])

    # Coalescing shows up in the op counts: one copy for a consecutive run on
    # the contiguous layout, one per layer per block for the naive baseline.
    for r in results:
        if r["layout"] in ("contiguous", "contiguous_auto") and (
            r["pattern"] == "consecutive"
        ):
            assert r["num_ops"] == 1
        if r["layout"] == "per_layer_naive":
            layers = 32 if r["shape"] == "8b" else 8
            assert r["num_ops"] == layers * r["num_blocks"]

    # Each target's verdict follows from its value and threshold (the CUDA
    # bandwidth target does not apply on CPU), and is the one printed.
    targets = report["targets"]
    assert targets and all(
        {"name", "value", "threshold", "passed"} <= set(t) for t in targets
    )
    # The 4x-per_layer target is gone (the H200 showed 0.42-1.01x); the
    # H200's findings replace it, as CUDA-only targets.
    names = {t["name"] for t in targets}
    assert not any(n.startswith("contiguous >= 4x per_layer at") for n in names)
    assert any(n.startswith("contiguous >= 4x per_layer_naive") for n in names)
    assert any(n.startswith("auto >= 95% of the better") for n in names)
    printed = capsys.readouterr().out.splitlines()
    assert any("unverified until the next GPU run" in line for line in printed)
    for t in targets:
        on_cuda_only = "on CUDA" in t["name"]
        expected = None if on_cuda_only else t["value"] >= t["threshold"]
        assert t["passed"] is expected, t
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[expected]
        line = f"{verdict}  {t['name']} [{t['shape']}, {t['direction']}]: "
        assert sum(p.startswith(line) for p in printed) == 1, (line, printed)
    assert out.with_suffix(".png").stat().st_size > 0
