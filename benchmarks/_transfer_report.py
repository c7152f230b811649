"""The transfer benchmark's figures: the issue's targets as PASS/FAIL
records (the H200's findings among them), the table it prints and the plot
it writes, from the measured cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from _report import machine_label, print_rows, save_figure, set_title
from _transfer_cases import DIRECTIONS, LAYOUTS, MIB, PATTERNS, SAME_SPEED, Result

if TYPE_CHECKING:
    import torch


def evaluate_targets(
    results: list[Result],
    ceiling: dict[str, dict[str, float]],
    device: torch.device,
    batch_below: int,
) -> list[dict[str, Any]]:
    """The issue's targets, as PASS/FAIL records. ``batch_below``: the copy
    engine's ``BATCH_BELOW_BLOCK_BYTES``, the block size from which one copy
    per block should match the per-layer gather."""
    by_key = {
        (r.shape, r.block_size, r.layout, r.pattern, r.direction): r for r in results
    }
    targets: list[dict[str, Any]] = []
    block_sizes = sorted({r.block_size for r in results})
    smallest, largest = block_sizes[0], block_sizes[-1]
    on_cuda = device.type == "cuda"
    for shape in sorted({r.shape for r in results}):
        for direction in DIRECTIONS:
            contiguous = by_key.get(
                (shape, smallest, "contiguous", "scattered", direction)
            )
            naive = by_key.get(
                (shape, smallest, "per_layer_naive", "scattered", direction)
            )
            if contiguous is not None and naive is not None:
                ratio = contiguous.gbps / naive.gbps
                targets.append(
                    {
                        "name": f"contiguous >= 4x per_layer_naive "
                        f"at {smallest}-token blocks",
                        "shape": shape,
                        "direction": direction,
                        "value": ratio,
                        "threshold": 4.0,
                        "passed": ratio >= 4.0,
                        "unit": "x",
                        "detail": f"{contiguous.gbps:.2f} vs {naive.gbps:.2f} GB/s, "
                        f"scattered blocks",
                    }
                )
            targets += _same_speed_targets(
                by_key, shape, direction, on_cuda, batch_below
            )
            for pattern in PATTERNS:
                large = by_key.get((shape, largest, "contiguous", pattern, direction))
                if large is None:
                    continue
                frac = large.gbps / ceiling[direction]["gbps"]
                targets.append(
                    {
                        "name": f"large contiguous copies >= 80% of ceiling "
                        f"({largest}-token blocks, {pattern})",
                        "shape": shape,
                        "direction": direction,
                        "value": frac,
                        "threshold": 0.8,
                        "passed": frac >= 0.8,
                        "unit": "%",
                        "detail": f"{large.gbps:.2f} of "
                        f"{ceiling[direction]['gbps']:.2f} GB/s",
                    }
                )
    shape = "8b" if any(r.shape == "8b" for r in results) else results[0].shape
    # The figure is for 2 MiB blocks (16 tokens of the 8B shape);
    # without such a block in the run, the largest block stands in.
    two_mib = [
        r.block_size for r in results if r.shape == shape and r.block_bytes == 2 * MIB
    ]
    bandwidth_bs = two_mib[0] if two_mib else largest
    block_label = "2 MiB" if two_mib else f"{largest}-token"
    for direction in DIRECTIONS:
        for pattern in PATTERNS:
            r = by_key.get((shape, bandwidth_bs, "contiguous", pattern, direction))
            if r is None:
                continue
            targets.append(
                {
                    "name": f">= 45 GB/s per direction on CUDA "
                    f"({block_label} contiguous blocks, {pattern})",
                    "shape": shape,
                    "direction": direction,
                    "value": r.gbps,
                    "threshold": 45.0,
                    "passed": (r.gbps >= 45.0) if on_cuda else None,
                    "unit": "GB/s",
                    "detail": "measured on CUDA"
                    if on_cuda
                    else "not applicable off CUDA",
                }
            )
    return targets


def _same_speed_targets(
    by_key: dict[tuple, Result],
    shape: str,
    direction: str,
    on_cuda: bool,
    batch_below: int,
) -> list[dict[str, Any]]:
    """The H200's findings as targets (CUDA only; SKIP elsewhere): one copy
    per block matches the per-layer gather from 2 MiB blocks up, and the
    auto choice is never slower than the better of direct and gather."""
    out: list[dict[str, Any]] = []
    label = f"{batch_below // MIB} MiB"
    pairs = []  # (ratio, detail) at blocks of at least the threshold
    auto = []  # (ratio, detail) at every block size and pattern
    for (s, bs, layout, pattern, d), r in sorted(by_key.items()):
        if (s, d) != (shape, direction):
            continue
        if layout == "contiguous" and pattern == "scattered":
            other = by_key.get((s, bs, "per_layer", pattern, d))
            if other is not None and r.block_bytes >= batch_below:
                pairs.append(
                    (
                        r.gbps / other.gbps,
                        f"{_human(r.block_bytes)}: {r.gbps:.2f} vs "
                        f"{other.gbps:.2f} GB/s",
                    )
                )
        if layout == "contiguous_auto":
            direct = by_key.get((s, bs, "contiguous", pattern, d))
            gather = by_key.get((s, bs, "contiguous_gather", pattern, d))
            if direct is not None and gather is not None:
                best = max(direct.gbps, gather.gbps)
                auto.append(
                    (
                        r.gbps / best,
                        f"{_human(r.block_bytes)} {pattern}: {r.gbps:.2f} "
                        f"({r.strategy}) vs direct {direct.gbps:.2f}, "
                        f"gather {gather.gbps:.2f} GB/s",
                    )
                )
    for name, found, note in (
        (
            f"contiguous within 5% of per_layer at blocks >= {label} on CUDA "
            "(scattered)",
            pairs,
            "",
        ),
        (
            "auto >= 95% of the better of direct and gather on CUDA "
            "(every block size and pattern)",
            auto,
            "; GPU speed unverified until the next GPU run",
        ),
    ):
        if not found:
            continue
        worst, detail = min(found)
        out.append(
            {
                "name": name,
                "shape": shape,
                "direction": direction,
                "value": worst,
                "threshold": SAME_SPEED,
                "passed": (worst >= SAME_SPEED) if on_cuda else None,
                "unit": "x",
                "detail": f"worst {detail}{note}"
                if on_cuda
                else "not applicable off CUDA",
            }
        )
    return out


def print_table(results: list[Result], ceiling: dict[str, dict[str, float]]) -> None:
    note = (
        f"ceiling (one {ceiling['d2h']['bytes'] / MIB:.0f} MiB copy, best of "
        f"before/after): d2h {ceiling['d2h']['gbps']:.2f} GB/s, "
        f"h2d {ceiling['h2d']['gbps']:.2f} GB/s"
    )
    rows: dict[tuple, dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.shape, r.block_size, r.layout, r.pattern), {})[
            r.direction
        ] = r
    print_rows(
        ["shape", "tokens", "block", "layout", "pattern"]
        + ["d2h GB/s", "ops", "h2d GB/s", "ops"],
        [
            (shape, bs, _human(p["d2h"].block_bytes), layout, pattern)
            + (f"{p['d2h'].gbps:.2f}", p["d2h"].num_ops)
            + (f"{p['h2d'].gbps:.2f}", p["h2d"].num_ops)
            for (shape, bs, layout, pattern), p in rows.items()
        ],
        notes=[note],
    )


def target_label(t: dict[str, Any]) -> str:
    value = t["value"]
    shown = {"x": f"{value:.2f}x", "%": f"{value:.0%}"}.get(
        t.get("unit", ""), f"{value:.2f} GB/s"
    )
    return f"{t['name']} [{t['shape']}, {t['direction']}]: {shown} ({t['detail']})"


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


#: What the layouts and directions are, in words (legend, panel titles).
LAYOUT_LABELS = {
    "contiguous": "contiguous layout, one copy per block",
    "contiguous_gather": "contiguous layout, gathered (one kernel + one copy)",
    "contiguous_auto": "contiguous layout, engine picks (auto)",
    "per_layer": "per-layer layout (vLLM's default), gathered",
    "per_layer_naive": "per-layer layout, one copy per layer per block (no engine)",
}
PATTERN_LABELS = {
    "scattered": "scattered blocks (every other, shuffled)",
    "consecutive": "consecutive blocks",
}
DIRECTION_LABELS = {
    "d2h": "device to host (d2h: save)",
    "h2d": "host to device (h2d: load)",
}
COLORS = {
    "contiguous": "tab:blue",
    "contiguous_gather": "tab:green",
    "contiguous_auto": "tab:purple",
    "per_layer": "tab:orange",
    "per_layer_naive": "tab:red",
}
STYLES = {"scattered": "-", "consecutive": "--"}


def shape_label(shape: dict[str, Any]) -> str:
    """``8b`` -> "8B-like KV shape (32 layers, 8 KV heads of 128, bf16)"."""
    name = "8B-like" if shape["name"] == "8b" else shape["name"]
    dtype = {2: "bf16", 4: "fp32"}.get(shape.get("dtype_bytes", 2), "?")
    return (
        f"{name} KV shape ({shape['num_layers']} layers, {shape['num_kv_heads']} "
        f"KV heads of {shape['head_dim']}, {dtype})"
    )


def title_lines(report: dict[str, Any]) -> list[str]:
    c = report["config"]
    where = (
        "GPU memory <-> pinned host memory"
        if report.get("device") == "cuda"
        else "on CPU the 'device' is a plain tensor in RAM"
    )
    return [
        f"KV block copy speed of the host tier's copy engine: {c['blocks']} "
        f"blocks per transfer, median of {c['iters']} runs ({where})",
        machine_label(report),
    ]


def reference_label(report: dict[str, Any], results: list[Result]) -> str:
    """The dotted line's meaning: one plain large copy in the same run, and
    whether measured points exceed it (then it is no ceiling)."""
    ceiling = report["ceiling"]
    mib = ceiling["d2h"]["bytes"] / MIB
    above = sum(r.gbps > ceiling[r.direction]["gbps"] for r in results)
    label = f"one plain {mib:.0f} MiB copy, measured in the same run"
    if above:
        why = (
            "copies small enough for the CPU caches beat it"
            if report.get("device") != "cuda"
            else "it is no limit"
        )
        label += f"\n(not a ceiling: {above} points are faster; {why})"
    return label


def plot_report(report: dict[str, Any], path: Path) -> Any:
    """The PNG of a JSON this benchmark wrote (the run's and ``--replot``'s)."""
    fig = figure(report)
    save_figure(fig, path)
    return fig


def figure(report: dict[str, Any]) -> Any:
    """GB/s against block size: a row per model shape, a column per
    direction, a line per layout and block pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fields = set(Result.__dataclass_fields__)
    results = [Result(**{k: v for k, v in r.items() if k in fields})
               for r in report["results"]]  # fmt: skip
    ceiling = report["ceiling"]
    shapes = {s["name"]: s for s in report["config"].get("shapes", [])}
    names = sorted({r.shape for r in results})
    fig, axes = plt.subplots(
        len(names), 2, figsize=(13, 4.4 * len(names) + 2.2), squeeze=False,
        sharex=True, layout="constrained",
    )  # fmt: skip
    ref = reference_label(report, results)
    for i, name in enumerate(names):
        shape = shapes.get(name)
        for j, direction in enumerate(DIRECTIONS):
            ax = axes[i][j]
            for layout in LAYOUTS:
                for pattern in PATTERNS:
                    pts = sorted(
                        (r.block_size, r.gbps)
                        for r in results
                        if (r.shape, r.layout, r.pattern, r.direction)
                        == (name, layout, pattern, direction)
                    )
                    if pts:
                        ax.plot(
                            [p[0] for p in pts], [p[1] for p in pts],
                            STYLES[pattern], marker="o", color=COLORS[layout],
                        )  # fmt: skip
            ax.axhline(ceiling[direction]["gbps"], color="gray", linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r.block_size for r in results}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylim(bottom=0)
            ax.set_title(
                f"{shape_label(shape) if shape else name}\n"
                f"{DIRECTION_LABELS[direction]}",
                fontsize=10,
            )
            ax.set_xlabel("block size (tokens)")
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
    layouts = [lay for lay in LAYOUTS if any(r.layout == lay for r in results)]
    handles = [Line2D([], [], color=COLORS[lay], marker="o") for lay in layouts]
    labels = [LAYOUT_LABELS[lay] for lay in layouts]
    handles += [Line2D([], [], color="black", ls=STYLES[p]) for p in PATTERNS]
    labels += [PATTERN_LABELS[p] for p in PATTERNS]
    handles.append(Line2D([], [], color="gray", ls=":"))
    labels.append(ref)
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=9)
    set_title(fig, title_lines(report))
    return fig
