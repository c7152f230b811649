"""The stall benchmark's figures: B's token gaps per run and across repeats,
the issue's targets, and the table and plot it prints and writes.

Pure functions of the runs' records (the arrival times of B's streamed
tokens, the servers' counters), so the tests check them on synthetic runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from _report import machine_label, model_label, print_rows, save_figure, set_title

#: A configuration beside none and tier: no tier, and a device cache large
#: enough that D1 is never evicted, so B is a device prefix hit: the floor of
#: A's gap for any cache, B's own first step included.
DEVICE_CONFIG = "device"
TARGET_GAP_RATIO = 3.0
TARGET_B_LATENCY_S = 0.100
#: The restated goal (issue 45): a host hit costs the stream and B at most
#: this much more than a device prefix hit of the same prefix in the same run.
#: B's first step attends over its whole context whether the prefix is on the
#: device or in host memory, so the device hit is the ceiling to approach.
TARGET_VS_DEVICE = 1.25


# -- analysis (pure) --------------------------------------------------------------


def token_arrivals(chunks: list[list[float]]) -> list[float]:
    """One arrival time per token: a chunk of k tokens gives k equal times."""
    return [t for t, k in chunks for _ in range(int(k))]


def gaps(arrivals: list[float]) -> list[tuple[float, float]]:
    """(start, end) of every inter-token gap, first token (TTFT) excluded."""
    return list(zip(arrivals, arrivals[1:]))


def window_gaps(
    spans: list[tuple[float, float]], t_from: float, t_to: float
) -> list[tuple[float, float]]:
    """Gaps that overlap [t_from, t_to]: the stream was waiting at some time
    while B was being admitted or served."""
    return [(s, e) for s, e in spans if e > t_from and s < t_to]


def summarize_run(result: dict[str, Any]) -> dict[str, Any]:
    arrivals = token_arrivals(result["a"]["chunks"])
    spans = gaps(arrivals)
    all_gaps = [e - s for s, e in spans]
    b = result["b"]
    win = window_gaps(spans, b["t_send"], b["t_end"])
    median = statistics.median(all_gaps) if all_gaps else None
    worst = max((e - s for s, e in win), default=None)
    worst_at = max(win, key=lambda g: g[1] - g[0])[0] if win else None
    return {
        "a_tokens": len(arrivals),
        "a_ttft_s": arrivals[0] if arrivals else None,
        "a_median_gap_s": median,
        "a_worst_gap_s": worst,
        "a_worst_gap_start_s": worst_at,
        "a_worst_gap_any_s": max(all_gaps, default=None),
        "gap_ratio": worst / median if worst is not None and median else None,
        "window_gaps": len(win),
        "b_latency_s": b["latency_s"],
        "b_prompt_tokens": b["prompt_tokens"],
        "b_cached_tokens": b["cached_tokens"],
        "b_a_tokens_before_send": b["a_tokens_before_send"],
        "d1_latency_s": result["d1"]["latency_s"],
        "d2_latency_s": result["d2"]["latency_s"],
        "d2_cached_tokens": result["d2"]["cached_tokens"],
    }


SUMMARY_KEYS = (
    "a_median_gap_s",
    "a_worst_gap_s",
    "gap_ratio",
    "b_latency_s",
    "b_cached_tokens",
    "a_ttft_s",
    "d1_latency_s",
)


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config and metric: median, min, max over the runs that finished."""
    out: dict[str, dict[str, Any]] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        sums = [r["summary"] for r in runs if r["config"] == config and r["summary"]]
        if not sums:
            continue
        agg: dict[str, Any] = {"runs": len(sums)}
        for key in SUMMARY_KEYS:
            vals = [s[key] for s in sums if s[key] is not None]
            agg[key] = (
                {
                    "median": statistics.median(vals),
                    "min": min(vals),
                    "max": max(vals),
                    "all": vals,
                }
                if vals
                else None
            )
        out[config] = agg
    return out


def evaluate_targets(
    agg: dict[str, dict[str, Any]], full_prefix_tokens: int
) -> list[dict[str, Any]]:
    """The issue's targets, on the tier config's medians over repeats: A's
    worst gap and B's latency against a device prefix hit's where the run has
    the device arm (``TARGET_VS_DEVICE``), else the absolute ones."""
    tier = agg.get("tier")
    if not tier or tier["gap_ratio"] is None:
        return []
    ratio, lat = tier["gap_ratio"], tier["b_latency_s"]
    worst, med = tier["a_worst_gap_s"], tier["a_median_gap_s"]
    cached = tier["b_cached_tokens"]
    targets = [
        {
            "name": f"tier: A's worst gap while B is admitted <= {TARGET_GAP_RATIO:g}x "
            "its median gap",
            "value": ratio["median"],
            "threshold": TARGET_GAP_RATIO,
            "passed": ratio["median"] <= TARGET_GAP_RATIO,
            "detail": f"{ratio['median']:.1f}x (worst {_ms(worst['median'])} ms / "
            f"median {_ms(med['median'])} ms; ratio over {tier['runs']} runs "
            f"{ratio['min']:.1f}-{ratio['max']:.1f}x)",
        },
        {
            "name": f"tier: B latency <= {TARGET_B_LATENCY_S * 1e3:.0f} ms",
            "value": lat["median"],
            "threshold": TARGET_B_LATENCY_S,
            "passed": lat["median"] <= TARGET_B_LATENCY_S,
            "detail": f"{_ms(lat['median'])} ms (over {tier['runs']} runs "
            f"{_ms(lat['min'])}-{_ms(lat['max'])} ms)",
        },
    ]
    floor = agg.get(DEVICE_CONFIG)
    if floor and floor["gap_ratio"] is not None:
        # With a device-hit arm in the run, the restated goals replace the
        # absolute ones (the worst gap over A's median, B under 100 ms).
        targets = []
        for key, what in (
            ("a_worst_gap_s", "A's worst gap"),
            ("b_latency_s", "B latency"),
        ):
            mine, dev = tier[key]["median"], floor[key]["median"]
            targets.append(
                {
                    "name": f"tier: {what} <= {TARGET_VS_DEVICE:g}x a device "
                    "prefix hit's (same prefix, same run)",
                    "value": mine / dev,
                    "threshold": TARGET_VS_DEVICE,
                    "passed": mine <= TARGET_VS_DEVICE * dev,
                    "detail": f"{_ms(mine)} ms against {_ms(dev)} ms for a device "
                    f"hit: {mine / dev:.2f}x (tier {_ms(tier[key]['min'])}-"
                    f"{_ms(tier[key]['max'])} ms over {tier['runs']} runs, device "
                    f"{_ms(floor[key]['min'])}-{_ms(floor[key]['max'])} ms over "
                    f"{floor['runs']})",
                }
            )
    if cached is not None:
        targets.append(
            {
                "name": "tier: B hits D1 (cached tokens >= D1's full blocks)",
                "value": cached["min"],
                "threshold": full_prefix_tokens,
                "passed": cached["min"] >= full_prefix_tokens,
                "detail": f"cached {cached['min']:.0f}-{cached['max']:.0f} of "
                f"{full_prefix_tokens} tokens in D1's full blocks",
            }
        )
    return targets


# -- output ---------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return f"{v * 1e3:.0f}" if v is not None else "-"


def _cell(stat: dict[str, Any] | None, ms: bool = True, x: bool = False) -> str:
    if stat is None:
        return "-"
    if x:
        return f"{stat['median']:.1f} ({stat['min']:.1f}-{stat['max']:.1f})"
    if ms:
        return f"{_ms(stat['median'])} ({_ms(stat['min'])}-{_ms(stat['max'])})"
    return f"{stat['median']:.0f} ({stat['min']:.0f}-{stat['max']:.0f})"


def print_table(agg: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    rows, failed = [], []
    for r in runs:
        s = r.get("summary")
        if not s:
            failed.append(f"{r['config']} #{r['repeat']} failed: {r.get('error')}")
            continue
        ratio = f"{s['gap_ratio']:.1f}x" if s["gap_ratio"] is not None else "-"
        rows.append(
            (
                r["config"],
                r["repeat"],
                _ms(s["a_median_gap_s"]),
                _ms(s["a_worst_gap_s"]),
                ratio,
                _ms(s["b_latency_s"]),
                f"{s['b_cached_tokens']}/{s['b_prompt_tokens']}",
                _ms(s["a_ttft_s"]),
                _ms(s["d1_latency_s"]),
                f"{r['cpu_busy_before']:.0%}",
                f"{r.get('other_cpu_share', 0):.0%}",
            )
        )
    print_rows(
        ["config", "#", "A med gap", "A worst", "ratio", "B lat", "B cached"]
        + ["A ttft", "D1", "busy", "other"],
        rows,
        notes=[
            "Per run (ms; worst gap = A's longest gap overlapping B's send..response;",
            "busy/other = CPU share of other work just before / during the run)",
        ],
    )
    for line in failed:
        print(line)
    print_rows(
        ["config", "runs", "A median gap ms", "A worst gap ms", "worst/median"]
        + ["B latency ms", "B cached tokens"],
        [
            (
                config,
                a["runs"],
                _cell(a["a_median_gap_s"]),
                _cell(a["a_worst_gap_s"]),
                _cell(a["gap_ratio"], x=True),
                _cell(a["b_latency_s"]),
                _cell(a["b_cached_tokens"], ms=False),
            )
            for config, a in agg.items()
        ],
        notes=["Per config: median (min-max) over repeats"],
    )


def config_label(config: str) -> str:
    """A configuration's name in words: none, tier, device, tier@SIZE
    (another per-step copy budget), tier+drop (late spill: drop)."""
    if config == "none":
        return "no tier (B recomputes the document)"
    if config == DEVICE_CONFIG:
        return "no tier, device cache big enough to keep the document (floor)"
    base, _, late = config.partition("+")
    words = "kvmem host tier"
    if "@" in base:
        words += f", copy budget {base.split('@', 1)[1]} per step"
    if late:
        words += f", late spill: {late}"
    return words


def title_lines(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    return [
        f"Host KV tier stall: request A streams {w['decode_tokens']} tokens; "
        f"meanwhile request B re-reads a {w['d1_tokens']}-token document that the "
        "device cache has evicted. Each point: the gap before one of A's tokens",
        f"{model_label(report['model'])}; {machine_label(report)}",
    ]


def plot_report(report: dict[str, Any], path: Path) -> Any:
    """The PNG of a JSON this benchmark wrote (the run's and ``--replot``'s)."""
    fig = figure(report)
    save_figure(fig, path)
    return fig


def figure(report: dict[str, Any]) -> Any:
    """A's gaps over time, aligned at B's send (t = 0), one panel per config;
    B's send..response shaded per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    configs = [c for c in report["workload"]["configs"] if c in report["summary"]]
    fig, axes = plt.subplots(
        1,
        len(configs),
        figsize=(7 * len(configs), 5.4),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, config in zip(axes[0], configs):
        done = [r for r in runs if r["config"] == config and r.get("summary")]
        for i, r in enumerate(done):
            res, color = r["result"], colors[i % len(colors)]
            b = res["b"]
            spans = gaps(token_arrivals(res["a"]["chunks"]))
            xs = [e - b["t_send"] for _, e in spans]
            ys = [max(1e3 * (e - s), 0.1) for s, e in spans]  # log axis: no zeros
            ax.plot(
                xs, ys, marker=".", ms=3, lw=0.8, color=color,
                label=f"repeat {r.get('repeat', i) + 1}",
            )  # fmt: skip
            ax.axvspan(0, b["latency_s"], color=color, alpha=0.12)
            ax.axvline(b["latency_s"], color=color, ls=":", lw=0.8)
        ax.axvline(0, color="black", lw=1, label="B sent (t = 0)")
        ax.axvline(
            float("nan"), color="gray", ls=":", lw=0.8,
            label="B answered (dotted, shaded: B in flight)",
        )  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("time of A's token, s after B was sent")
        ax.set_title(config_label(config), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("gap before this token of A (ms, log scale)")
    set_title(fig, title_lines(report))
    return fig
