"""benchmarks/serving_bench.py without a server: its dry run (the workload as
vLLM's own client parses and samples it), /metrics parsing, summaries,
tier/none ratios, targets and the output comparison."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from tests.helpers import import_script

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "serving_bench.py"


@pytest.fixture(scope="module")
def bench():
    yield from import_script(BENCH)


@pytest.fixture(scope="module")
def figures(bench):
    """The module beside the script that holds what these tests read."""
    yield from import_script(BENCH.parent / "_serving_figures.py")


METRICS_PAGE = """\
# HELP vllm:kvmem_host_hit_tokens_total Prompt tokens found in the host KV tier.
# TYPE vllm:kvmem_host_hit_tokens_total counter
vllm:kvmem_host_hit_tokens_total{engine="0",model_name="m"} 22400.0
vllm:kvmem_host_hit_tokens_total{engine="1",model_name="m"} 100.0
vllm:kvmem_host_hit_tokens_created{engine="0",model_name="m"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 8320.0
vllm:num_preemptions_total 0.0
"""


def test_parse_metrics_sums_label_sets_and_skips_others(bench):
    m = bench.parse_metrics(METRICS_PAGE + "vllm:not_asked_total 5.0\n", bench.METRICS)
    assert m == {
        "vllm:kvmem_host_hit_tokens_total": 22500.0,
        "vllm:prefix_cache_hits_total": 8320.0,
        "vllm:num_preemptions_total": 0.0,
    }
    after = dict(m, **{"vllm:kvmem_host_hit_tokens_total": 30000.0})
    delta = bench.metric_delta(m, after)
    assert delta["vllm:kvmem_host_hit_tokens_total"] == 7500.0
    assert delta["vllm:prefix_cache_hits_total"] == 0.0
    # A counter missing before (config none has no kvmem counters) is left out.
    assert bench.metric_delta({}, after) == {}


def test_dry_run_draws_each_level_from_vllms_dataset(bench, tmp_path, capsys):
    """The plan's client arguments go through ``vllm bench serve``'s parser and
    its ``prefix_repetition`` dataset: the prompts it draws share exactly as
    many prefixes as the level says, no server started."""
    argv = ["--dry-run", "--quick", "--num-prompts", "12"]
    assert bench.main([*argv, "--model-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])

    none, tier = (shlex.split(plan["servers"][c]) for c in ("none", "tier"))
    assert tier == [*none, "--kv-host-cache-bytes", "256M"]
    assert set(plan["levels"]) == {"unique", "high"}  # --quick's levels
    for name, want in (("unique", 12), ("high", 2)):
        lv = plan["levels"][name]
        client = shlex.split(lv["client"])
        assert client[:3] == ["vllm", "bench", "serve"]
        assert "--save-result" not in client  # only with --keep-raw
        assert lv["num_prefixes"] == want
        sampled = lv["sampled"]
        assert sampled["prompts"] == 12 and sampled["distinct_prefixes"] == want
        assert sampled["output_lens"] == [32]
        # 384 + 32 tokens; vLLM's sampler may miss by a token or two
        assert all(abs(n - 416) <= 4 for n in sampled["prompt_lens"])
    assert plan["order"][:2] == ["unique#0:none", "unique#0:tier"]  # interleaved
    assert len(plan["order"]) == 2 * 2 * 2  # levels x repeats x configs


def test_diagnostic_configs_and_their_ratios(bench, tmp_path, capsys):
    """``noop`` adds a connector that moves nothing, ``device`` a device cache
    of the host tier's size and no connector; each gets its own ratio to
    none, paired by repeat; a list without none is refused by name."""
    argv = ["--dry-run", "--quick", "--configs", "none,tier,noop,device"]
    assert bench.main([*argv, "--model-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])
    none, noop, device = (
        shlex.split(plan["servers"][c]) for c in ("none", "noop", "device")
    )
    assert noop[: len(none)] == none and noop[len(none)] == "--kv-transfer-config"
    assert json.loads(noop[-1]) == bench.NOOP_TRANSFER_CONFIG
    i = none.index("--kv-cache-memory-bytes") + 1
    assert (none[i], device[i]) == ("16M", "256M") and device[:i] == none[:i]
    assert plan["order"][:4] == [
        f"unique#0:{c}" for c in ("none", "tier", "noop", "device")
    ]
    env = bench.config_env("noop", {"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(bench.ROOT), "/x"]
    assert bench.config_env("tier", {"PYTHONPATH": "/x"}) == {"PYTHONPATH": "/x"}
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "tier,noop"])
    assert "none included" in capsys.readouterr().err

    runs = [
        _run("high", "none", 0, 10.0, 20.0),
        _run("high", "device", 0, 12.0, 30.0),
        _run("high", "noop", 0, 9.0, 20.0),
    ]
    lv = bench.summarize_level(runs, "high")
    assert lv["ratios_vs_none"]["device"]["itl_p99_ms"]["median"] == pytest.approx(1.5)
    assert lv["ratios_vs_none"]["noop"]["req_per_s"]["median"] == pytest.approx(0.9)
    assert lv["paired_repeats"] == 0 and lv["ratios"]["req_per_s"]["median"] is None


def test_a_block_size_cpu_attention_cannot_run_is_refused(bench, capsys):
    """vLLM 0.32's CPU attention takes multiples of 32: 16 would fail at
    engine start in every arm, so the bench refuses it before any server."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--block-size", "16"])
    err = capsys.readouterr().err
    assert "--block-size 16" in err and "multiples of 32" in err
    assert bench.parse_args(["--block-size", "64"]).block_size == 64


def test_cpu_per_request(bench):
    before, after = {"server": 1.0, "engine": 0.5}, {"server": 3.0, "engine": 1.5}
    per = bench.cpu_per_request(before, after, {"completed": 4})
    assert per == {"server_cpu_ms_per_req": 500.0, "engine_cpu_ms_per_req": 250.0}
    none = bench.cpu_per_request(before, after, {"completed": 0})
    assert set(none.values()) == {None}


def test_levels_reuse_fraction(bench):
    levels = bench.LEVELS
    assert levels["unique"].num_prefixes(96) == 96
    assert levels["unique"].reuse(96) == 0.0
    assert levels["partial"].num_prefixes(96) == 48
    assert levels["partial"].reuse(96) == pytest.approx(0.5)
    assert levels["high"].num_prefixes(96) == 16  # the 16 x 384
    assert levels["high"].reuse(96) == pytest.approx(5 / 6)


def test_first_divergence_and_compare(figures):
    assert figures.first_divergence("abc", "abc") is None
    assert figures.first_divergence("abc", "abd") == 2
    assert figures.first_divergence("ab", "abc") == 2
    res = figures.compare_texts(
        ["same", "one two three", None], ["same", "one two four", "x"], str.split
    )
    assert res["compared"] == 3 and res["matching"] == 1
    assert res["mismatches"][0] == {"prompt": 1, "char": 8, "token": 2}
    assert res["mismatches"][1]["prompt"] == 2


def _run(level, config, rep, req_s, itl99, hits=None):
    s = {f: 1.0 for f in ("out_tok_per_s", "itl_p50_ms", "ttft_p50_ms", "ttft_p99_ms")}
    s.update(req_per_s=req_s, itl_p99_ms=itl99, host_hit_tokens=hits)
    return {"level": level, "config": config, "repeat": rep, "summary": s}


def test_summary_pairs_repeats_and_targets(bench):
    runs = [
        _run("unique", "none", 0, 10.0, 20.0),
        _run("unique", "tier", 0, 9.9, 21.0, 0),
        _run("unique", "none", 1, 8.0, 20.0),
        _run("unique", "tier", 1, 7.6, 30.0, 0),  # 0.95, 1.5
        _run("unique", "none", 2, 10.0, 20.0),
        _run("unique", "tier", 2, 10.0, 20.0, 0),
        _run("high", "none", 0, 5.0, 10.0),
        _run("high", "tier", 0, 6.0, 11.0, 900),
        {"level": "high", "config": "none", "repeat": 1, "summary": None},  # failed
        _run("high", "tier", 1, 1.0, 99.0, 900),  # unpaired: not in the ratios
    ]
    lv = bench.summarize_level(runs, "unique")
    assert lv["paired_repeats"] == 3
    assert lv["configs"]["none"]["req_per_s"]["median"] == 10.0
    assert lv["configs"]["none"]["req_per_s"]["min"] == 8.0
    tp = lv["ratios"]["req_per_s"]
    assert tp["median"] == pytest.approx(0.99)
    assert (tp["min"], tp["max"]) == (pytest.approx(0.95), pytest.approx(1.0))
    assert lv["ratios"]["itl_p99_ms"]["median"] == pytest.approx(1.05)
    high = bench.summarize_level(runs, "high")
    assert high["paired_repeats"] == 1
    assert high["ratios"]["req_per_s"]["values"] == [pytest.approx(1.2)]
    assert high["configs"]["tier"]["host_hit_tokens"]["median"] == 900

    targets = bench.evaluate_targets([lv, high], {"unique": 0.0, "high": 5 / 6})
    assert len(targets) == 4
    assert all(t["passed"] for t in targets)  # 0.99 >= 0.98; 1.2 >= 1.0; ITL 1.05, 1.1
    worse = bench.evaluate_targets(
        [bench.summarize_level([*runs[:2], *runs[2:4]], "unique")], {"unique": 0.0}
    )
    assert [t["passed"] for t in worse] == [False, False]  # 0.97 < 0.98; 1.275 > 1.2


def test_correctness_counts_tier_vs_none_and_none_vs_none(bench):
    def r(config, rep, texts):
        return {
            "level": "high",
            "config": config,
            "repeat": rep,
            "summary": {},
            "texts": texts,
        }

    runs = [
        r("none", 0, ["a b", "c d"]),
        r("tier", 0, ["a b", "c e"]),
        r("none", 1, ["a b", "c d"]),
        r("tier", 1, ["a b", "c d"]),
    ]
    c = bench.correctness(runs, str.split)["high"]
    assert (c["tier_vs_none_matching"], c["tier_vs_none_compared"]) == (3, 4)
    assert (c["none_vs_none_matching"], c["none_vs_none_compared"]) == (2, 2)
    assert c["tier_vs_none_first_diverging_token_min"] == 1
    assert c["none_vs_none_first_diverging_token_min"] is None
