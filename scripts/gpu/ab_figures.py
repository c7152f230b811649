"""The A/B's figures from its runs (issue 30; ``real_size.py`` reads the same).

Pure functions of what the runs recorded: the connector's hits from a
``/metrics`` delta, the tier's time per step, the probes' TTFT and the
throughput runs' medians and ratios against ``none``, and what a server's
log says about its KV caches. No vLLM or torch, so the tests check them on
synthetic runs.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "benchmarks"))

from _serving_figures import FIGURES, compare_texts, spread  # noqa: E402

#: What each server's log says about its KV caches (None when absent).
LOG_FACTS = {
    "device_kv_tokens": re.compile(r"\w+ KV cache size: ([\d,]+) tokens"),
    "tier_host_blocks": re.compile(r"Host KV tier: (\d+) blocks of"),
    "simple_host_blocks": re.compile(
        r"SimpleCPUOffloadScheduler: Allocating (\d+) offload blocks"
    ),
    "simple_mode": re.compile(r"SimpleCPUOffloadConnector: role=\w+, .*mode=(\w+)"),
    "attention_backend": re.compile(r"Using (\w+) (?:attention )?backend[ .]"),
    "kv_cache_layout": re.compile(r"Using (\w+) KV cache layout"),
    "model_runner": re.compile(r"Using (V\d) Model Runner"),
}


def tier_step_us(delta: dict[str, float]) -> dict[str, float] | None:
    """The tier's own mean time per engine step over a run, each side, from
    its histograms (None in the arms without the tier). The histograms are
    sent in batches (64 steps or 1 s), so a run's last steps may fall in the
    next run's delta."""
    out = {}
    for side in ("scheduler", "worker"):
        name = f"vllm:kvmem_host_{side}_step_seconds"
        count = delta.get(f"{name}_count")
        if count:
            out[f"{side}_mean_us"] = round(1e6 * delta[f"{name}_sum"] / count, 1)
            out[f"{side}_steps"] = count
    return out or None


def hit_rate(delta: dict[str, float]) -> dict[str, Any]:
    """Host (connector) hits of one run from its /metrics delta."""
    queries = delta.get("vllm:external_prefix_cache_queries_total")
    hits = delta.get("vllm:external_prefix_cache_hits_total")
    prompt = delta.get("vllm:prompt_tokens_total")
    return {
        "external_hit_tokens": hits,
        "external_query_tokens": queries,
        "host_hit_rate": hits / queries if hits is not None and queries else None,
        "host_hits_over_prompt_tokens": hits / prompt
        if hits is not None and prompt
        else None,
        "device_prefix_hit_tokens": delta.get("vllm:prefix_cache_hits_total"),
        "kvmem_host_hit_tokens": delta.get("vllm:kvmem_host_hit_tokens_total"),
        "preemptions": delta.get("vllm:num_preemptions_total"),
    }


def median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize_probes(probes: list[dict[str, Any]], arms: list[str]) -> dict:
    """Per arm: medians of cold and repeat TTFT, the repeat's host hit tokens,
    and the repeat's TTFT over ``none``'s (a recompute), paired by probe."""
    by = {(p["arm"], p["probe"]): p for p in probes if p.get("error") is None}
    out: dict[str, Any] = {}
    for arm in arms:
        mine = [by[k] for k in sorted(by) if k[0] == arm]
        ratios = []
        for p in mine:
            ref = by.get(("none", p["probe"]))
            if ref and p.get("repeat_ttft_ms") and ref.get("repeat_ttft_ms"):
                ratios.append(p["repeat_ttft_ms"] / ref["repeat_ttft_ms"])
        same = [
            p.get("repeat_text") == by[("none", p["probe"])].get("repeat_text")
            for p in mine
            if ("none", p["probe"]) in by
        ]
        out[arm] = {
            "probes": len(mine),
            "cold_ttft_ms": median([p.get("cold_ttft_ms") for p in mine]),
            "repeat_ttft_ms": median([p.get("repeat_ttft_ms") for p in mine]),
            "repeat_host_hit_tokens": [
                p.get("repeat", {}).get("external_hit_tokens") for p in mine
            ],
            "repeat_device_hit_tokens": [
                p.get("repeat", {}).get("device_prefix_hit_tokens") for p in mine
            ],
            "repeat_ttft_over_none": spread(ratios),
            "repeat_text_equal_to_none": f"{sum(same)}/{len(same)}",
        }
    return out


def summarize_runs(
    runs: list[dict[str, Any]], arms: list[str], tokenize: Any = None
) -> dict[str, Any]:
    """Per level and concurrency, per arm: medians over repeats, arm/none
    ratios paired per repeat, greedy identity against none."""
    ok = [r for r in runs if r.get("summary") is not None]
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["level"], r["concurrency"]) for r in ok):
        mine = [r for r in ok if (r["level"], r["concurrency"]) == key]
        by = {(r["arm"], r["repeat"]): r for r in mine}
        cell: dict[str, Any] = {}
        for arm in arms:
            reps = sorted(k[1] for k in by if k[0] == arm)
            if not reps:
                continue
            s: dict[str, Any] = {"repeats": len(reps)}
            for f in FIGURES:  # a figure a run did not record is None
                s[f] = spread([by[(arm, k)]["summary"].get(f) for k in reps])
                ratios = [
                    by[(arm, k)]["summary"][f] / by[("none", k)]["summary"][f]
                    for k in reps
                    if ("none", k) in by
                    and by[("none", k)]["summary"].get(f)
                    and by[(arm, k)]["summary"].get(f) is not None
                ]
                s[f + "_over_none"] = spread(ratios)
            s["host_hit_rate"] = spread(
                [by[(arm, k)]["hits"]["host_hit_rate"] for k in reps]
            )
            s["host_hits_over_prompt_tokens"] = spread(
                [by[(arm, k)]["hits"]["host_hits_over_prompt_tokens"] for k in reps]
            )
            ident = [
                compare_texts(
                    by[("none", k)].get("texts") or [],
                    by[(arm, k)].get("texts") or [],
                    tokenize,
                )
                for k in reps
                if ("none", k) in by
            ]
            s["greedy_vs_none"] = {
                "matching": sum(c["matching"] for c in ident),
                "compared": sum(c["compared"] for c in ident),
                "first_diverging_token_min": min(
                    (
                        m["token"]
                        for c in ident
                        for m in c["mismatches"]
                        if m["token"] is not None
                    ),
                    default=None,
                ),
            }
            cell[arm] = s
        floor = [
            compare_texts(
                by[("none", 0)].get("texts") or [], by[("none", k)].get("texts") or []
            )
            for k in sorted(k for a, k in by if a == "none" and k > 0)
            if ("none", 0) in by
        ]
        cell["none_vs_none_repeat0"] = {
            "matching": sum(c["matching"] for c in floor),
            "compared": sum(c["compared"] for c in floor),
        }
        out[f"{key[0]}@c{key[1]}"] = cell
    return out


def log_facts(text: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for key, pattern in LOG_FACTS.items():
        found = pattern.findall(text)
        facts[key] = sorted(set(found)) if found else None
    return facts
