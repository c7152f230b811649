"""The serving benchmark's figures: per reuse level, tier against none, the
issue's targets, greedy identity, and the table and plot it prints and
writes.

Pure functions of the runs' records (vLLM's client JSON summarised), so the
tests check them on synthetic runs and ``scripts/gpu/ab_figures.py`` reuses
them for its arms.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from _report import (
    code_label,
    machine_label,
    model_label,
    print_rows,
    save_figure,
    set_title,
)

CONFIGS = ("none", "tier")
#: Every configuration a run may have: ``noop`` (a connector that moves
#: nothing) and ``device`` (a device cache big enough for the reuse) say
#: which part of a tier/none difference is vLLM's connector plumbing or
#: prefix caching itself, and which is the tier's.
KNOWN_CONFIGS = ("none", "tier", "tier-inline", "noop", "device")
TARGET_ZERO_REUSE_RATIO = 0.98  # throughput tier/none at 0% reuse
TARGET_REUSE_RATIO = 1.0  # throughput tier/none at every reuse level > 0
TARGET_P99_ITL_RATIO = 1.2  # p99 ITL tier/none, every level
# Figures summarised per level and compared tier/none.
FIGURES = (
    "req_per_s",
    "out_tok_per_s",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "server_cpu_ms_per_req",
    "engine_cpu_ms_per_req",
)


# -- pure helpers (unit-tested) -------------------------------------------------


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first differing character; None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def compare_texts(
    a: list[str | None], b: list[str | None], tokenize: Any = None
) -> dict[str, Any]:
    """Per-prompt comparison of two runs' generated texts (same prompt order).

    ``tokenize(text) -> list`` turns the common prefix of a mismatch into its
    token count, i.e. the first diverging token position (approximate where
    re-tokenising text does not give back the generated ids)."""
    if len(a) != len(b):
        return {"compared": 0, "matching": 0, "mismatches": [], "error": "lengths"}
    mismatches = []
    matching = 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            mismatches.append({"prompt": i, "char": None, "token": None})
            continue
        pos = first_divergence(x, y)
        if pos is None:
            matching += 1
            continue
        tok = len(tokenize(x[:pos])) if tokenize is not None else None
        mismatches.append({"prompt": i, "char": pos, "token": tok})
    return {"compared": len(a), "matching": matching, "mismatches": mismatches}


def spread(values: list[float]) -> dict[str, Any]:
    """Median and min-max of the repeats (None when there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
    }


def run_ok(run: dict[str, Any]) -> bool:
    return run.get("summary") is not None


def summarize_level(runs: list[dict[str, Any]], level: str) -> dict[str, Any]:
    """Median and spread per config, and tier/none ratios paired by repeat
    (``ratios``; ``ratios_vs_none``: every other configuration's)."""
    mine = [r for r in runs if r["level"] == level and run_ok(r)]
    by: dict[str, dict[int, dict[str, Any]]] = {c: {} for c in CONFIGS}
    for r in mine:
        by.setdefault(r["config"], {})[r["repeat"]] = r["summary"]
    out: dict[str, Any] = {
        "level": level,
        "configs": {},
        "ratios": {},
        "ratios_vs_none": {},
    }
    for config, reps in by.items():
        if not reps:
            continue
        s = {f: spread([reps[k].get(f) for k in sorted(reps)]) for f in FIGURES}
        s["host_hit_tokens"] = spread(
            [reps[k].get("host_hit_tokens") for k in sorted(reps)]
        )
        out["configs"][config] = s
    for config in by:
        if config == "none":
            continue
        paired = sorted(set(by.get("none", {})) & set(by[config]))
        ratios: dict[str, Any] = {}
        for f in FIGURES:
            vals = []
            for k in paired:
                a, b = by["none"][k].get(f), by[config][k].get(f)
                if a and b is not None:
                    vals.append(b / a)
            ratios[f] = spread(vals)
        out["ratios_vs_none"][config] = ratios
        if config == "tier":
            out["ratios"] = ratios
            out["paired_repeats"] = len(paired)
    if not out["ratios"]:
        out["ratios"] = {f: spread([]) for f in FIGURES}
        out["paired_repeats"] = 0
    return out


def evaluate_targets(
    levels: list[dict[str, Any]], reuse_of: dict[str, float]
) -> list[dict[str, Any]]:
    """The issue's PASS/FAIL lines from the per-level summaries."""
    targets = []
    for lv in levels:
        name, reuse = lv["level"], reuse_of[lv["level"]]
        tp = lv["ratios"]["req_per_s"]
        if tp["median"] is not None:
            need = TARGET_ZERO_REUSE_RATIO if reuse == 0 else TARGET_REUSE_RATIO
            targets.append(
                {
                    "name": f"{name} ({reuse:.0%} reuse): throughput tier/none "
                    f">= {need:.2f}",
                    "level": name,
                    "value": tp["median"],
                    "threshold": need,
                    "passed": tp["median"] >= need,
                    "detail": f"median of {tp['n']} paired repeats {tp['median']:.3f} "
                    f"(spread {tp['min']:.3f}-{tp['max']:.3f})",
                }
            )
        itl = lv["ratios"]["itl_p99_ms"]
        if itl["median"] is not None:
            targets.append(
                {
                    "name": f"{name} ({reuse:.0%} reuse): p99 ITL tier/none "
                    f"<= {TARGET_P99_ITL_RATIO:.1f}",
                    "level": name,
                    "value": itl["median"],
                    "threshold": TARGET_P99_ITL_RATIO,
                    "passed": itl["median"] <= TARGET_P99_ITL_RATIO,
                    "detail": f"median of {itl['n']} paired repeats "
                    f"{itl['median']:.3f} (spread {itl['min']:.3f}-{itl['max']:.3f})",
                }
            )
    return targets


def correctness(runs: list[dict[str, Any]], tokenize: Any = None) -> dict[str, Any]:
    """Texts per prompt: tier r vs none r, none r vs none 0, per level."""
    out: dict[str, Any] = {}
    for level in dict.fromkeys(r["level"] for r in runs):
        texts = {
            (r["config"], r["repeat"]): r["texts"]
            for r in runs
            if r["level"] == level and run_ok(r) and r.get("texts") is not None
        }
        keys = ["tier_vs_none", "none_vs_none"]
        keys += [f"{c}_vs_none" for c, _ in texts if c not in ("none", "tier")]
        res: dict[str, Any] = {k: [] for k in dict.fromkeys(keys)}
        for (config, rep), t in sorted(texts.items()):
            if config != "none" and ("none", rep) in texts:
                c = compare_texts(texts[("none", rep)], t, tokenize)
                res[f"{config}_vs_none"].append({"repeat": rep, **c})
            if config == "none" and rep > 0 and ("none", 0) in texts:
                c = compare_texts(texts[("none", 0)], t, tokenize)
                res["none_vs_none"].append({"repeat": rep, **c})
        for key in list(res):
            cmp = res[key]
            res[f"{key}_matching"] = sum(c["matching"] for c in cmp)
            res[f"{key}_compared"] = sum(c["compared"] for c in cmp)
            toks = [
                m["token"]
                for c in cmp
                for m in c["mismatches"]
                if m["token"] is not None
            ]
            res[f"{key}_first_diverging_token_min"] = min(toks) if toks else None
        out[level] = res
    return out


# -- output -------------------------------------------------------------------------


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _cell(s: dict[str, Any], nd: int = 1) -> str:
    if s["median"] is None:
        return "-"
    return f"{_fmt(s['median'], nd)} [{_fmt(s['min'], nd)}-{_fmt(s['max'], nd)}]"


TABLE_COLS = (
    ("req_per_s", "req/s", 2),
    ("out_tok_per_s", "out tok/s", 0),
    ("itl_p50_ms", "ITL p50 ms", 1),
    ("itl_p99_ms", "ITL p99 ms", 1),
    ("ttft_p50_ms", "TTFT p50 ms", 0),
    ("ttft_p99_ms", "TTFT p99 ms", 0),
    ("engine_cpu_ms_per_req", "engine CPU ms/req", 1),
)


def print_table(levels: list[dict[str, Any]], reuse_of: dict[str, float]) -> None:
    rows = []
    for lv in levels:
        label = f"{lv['level']} ({reuse_of[lv['level']]:.0%})"
        for config, s in lv["configs"].items():
            cells = [_cell(s[f], nd) for f, _, nd in TABLE_COLS]
            hits = _fmt(s["host_hit_tokens"]["median"], 0)
            rows.append((label, config, *cells, hits))
        for config, ratios in lv.get("ratios_vs_none", {"tier": lv["ratios"]}).items():
            cells = [_cell(ratios[f], 3) for f, _, _ in TABLE_COLS]
            rows.append((label, f"{config}/none", *cells, ""))
    print_rows(
        ["level", "config", *(title for _, title, _ in TABLE_COLS), "host hit tok"],
        rows,
        notes=["median [min-max] over repeats; ratio rows: X/none paired per repeat"],
        left=2,
    )


def print_correctness(corr: dict[str, Any]) -> None:
    print()
    print("greedy outputs per prompt (matching / compared):")
    for level, c in corr.items():
        line = f"  {level:<8}"
        keys = [k[: -len("_matching")] for k in c if k.endswith("_matching")]
        for key in keys:
            label = key.replace("_vs_", " vs ")
            first = c[f"{key}_first_diverging_token_min"]
            extra = f", first diverging token >= {first}" if first is not None else ""
            line += f"  {label}: {c[f'{key}_matching']}/{c[f'{key}_compared']}{extra}"
        print(line)


def title_lines(report: dict[str, Any]) -> list[str]:
    """What the figure shows, the workload, and what ran it where."""
    w = report["workload"]
    code = code_label(report)
    return [
        "Host KV tier under load: kvmem host tier against no tier, "
        "same prompts, ratio of the two servers' figures",
        f"vllm bench serve, prefix_repetition, {w['num_prompts']} prompts of "
        f"{w['prefix_len']}+{w['suffix_len']} tokens in, {w['output_len']} out, "
        f"concurrency {w['concurrency']}, {w['repeats']} repeats",
        f"{model_label(report['model'])}; {machine_label(report)}"
        + (f"; {code}" if code else ""),
    ]


def plot_report(report: dict[str, Any], path: Path) -> Any:
    """The PNG of a JSON this benchmark wrote (the run's and ``--replot``'s)."""
    fig = figure(report)
    save_figure(fig, path)
    return fig


def _ratio_points(ax: Any, xs: list[float], stats: list[dict[str, Any]]) -> None:
    """Median and min-max of each x's paired repeats, and every repeat."""
    med, lo, hi = [], [], []
    for s in stats:
        m = s["median"] if s["median"] is not None else float("nan")
        med.append(m)
        lo.append(m - s["min"] if s["min"] is not None else 0)
        hi.append(s["max"] - m if s["max"] is not None else 0)
    n = max((s["n"] for s in stats), default=0)
    ax.errorbar(
        xs,
        med,
        yerr=[lo, hi],
        fmt="o",
        capsize=6,
        color="tab:blue",
        label=f"median of {n} repeats (bar: min to max)",
    )
    for x, s in zip(xs, stats):
        ax.scatter(
            [x] * len(s["values"]),
            s["values"],
            color="tab:blue",
            alpha=0.3,
            s=12,
            label="one repeat (tier and no tier run back to back)",
        )
    ax.axhline(1.0, color="gray", lw=1, label="1.0: same as no tier")
    ax.grid(True, axis="y", alpha=0.3)


def _target(ax: Any, x0: float, x1: float, value: float, label: str) -> None:
    ax.hlines(value, x0, x1, colors="tab:red", linestyles="--", label=label)


def _legend(fig: Any, axes: Any, ncols: int = 3) -> None:
    """One legend under the panels, each series named once."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(
        list(seen.values()),
        list(seen),
        loc="outside lower center",
        ncols=min(len(seen), ncols),
        fontsize=9,
    )


THROUGHPUT_TARGET = (
    f"target: throughput tier / no tier at least {TARGET_ZERO_REUSE_RATIO:g} "
    f"at 0% reuse, {TARGET_REUSE_RATIO:g} above"
)
ITL_TARGET = f"target: p99 ITL tier / no tier at most {TARGET_P99_ITL_RATIO:g}"


def figure(report: dict[str, Any]) -> Any:
    """Per reuse level: throughput and p99 ITL, tier / none, median and
    min-max of the paired repeats, against the issue's targets. A run of one
    reuse level is one panel with the two ratios side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in report["levels"] if lv["configs"]]
    reuse_of = {n: lv["reuse"] for n, lv in report["workload"]["levels"].items()}
    if len(levels) == 1:
        lv = levels[0]
        reuse = reuse_of[lv["level"]]
        fig, ax = plt.subplots(figsize=(11, 6), layout="constrained")
        _ratio_points(
            ax, [0, 1], [lv["ratios"]["req_per_s"], lv["ratios"]["itl_p99_ms"]]
        )
        need = TARGET_ZERO_REUSE_RATIO if reuse == 0 else TARGET_REUSE_RATIO
        _target(ax, -0.3, 0.3, need, THROUGHPUT_TARGET)
        _target(ax, 0.7, 1.3, TARGET_P99_ITL_RATIO, ITL_TARGET)
        ax.set_xticks([0, 1], ["throughput (req/s)", "p99 inter-token latency"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_ylabel("tier / no tier")
        ax.set_title(f"one reuse level: {lv['level']}, {reuse:.0%} reuse")
        _legend(fig, [ax], ncols=2)
        set_title(fig, title_lines(report))
        return fig

    names = [lv["level"] for lv in levels]
    labels = [f"{n}\n{reuse_of[n]:.0%} reuse" for n in names]
    xs = list(range(len(names)))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.8), layout="constrained")
    for ax, key, ylabel in (
        (axes[0], "req_per_s", "throughput, tier / no tier (req/s)"),
        (axes[1], "itl_p99_ms", "p99 inter-token latency, tier / no tier"),
    ):
        _ratio_points(ax, xs, [lv["ratios"][key] for lv in levels])
        ax.set_xticks(xs, labels)
        ax.set_xlim(-0.5, len(xs) - 0.5)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("reuse level: share of prompts whose prefix was sent before")
    zero = [x for x, n in zip(xs, names) if reuse_of[n] == 0]
    rest = [x for x, n in zip(xs, names) if reuse_of[n] > 0]
    for where, target in ((zero, TARGET_ZERO_REUSE_RATIO), (rest, TARGET_REUSE_RATIO)):
        if where:
            _target(
                axes[0], min(where) - 0.3, max(where) + 0.3, target, THROUGHPUT_TARGET
            )
    _target(axes[1], -0.5, len(xs) - 0.5, TARGET_P99_ITL_RATIO, ITL_TARGET)
    _legend(fig, axes)
    set_title(fig, title_lines(report))
    return fig
