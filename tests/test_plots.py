"""Every committed plot (benchmarks/results/*.png) redrawn from its JSON: the
title names the JSON's model (by its published name where it has one), its
dtype and the machine; no title or label runs off the figure; no panel shows
a single data point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import import_script

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.collections import PathCollection  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH / "results"
PNGS = sorted(RESULTS.glob("*.png"))

#: The figure module of each benchmark (the JSON's ``benchmark`` field; the
#: transfer benchmark's JSON has none).
MODULES = {
    "host_tier_end_to_end": "_host_tier_figures.py",
    "host_tier_serving": "_serving_figures.py",
    "host_tier_stall": "_stall_figures.py",
    "workload_bench": "workload_bench.py",
    None: "_transfer_report.py",
}


@pytest.fixture(scope="module")
def report_mod():
    yield from import_script(BENCH / "_report.py")


def _module(name: str):
    gen = import_script(BENCH / name)
    return gen, next(gen)


def _data_xs(ax) -> set[float]:
    """x positions of the data drawn on ``ax``: lines in data coordinates,
    scatter points and bars (reference lines across the axes are left out)."""
    xs: set[float] = set()
    for line in ax.get_lines():
        if line.get_transform() == ax.transData:
            xs.update(float(x) for x in line.get_xdata() if x == x)
    for coll in ax.collections:
        if isinstance(coll, PathCollection):  # scatter
            xs.update(float(x) for x, _ in coll.get_offsets())
    for patch in ax.patches:
        if hasattr(patch, "get_x") and patch.get_height():
            xs.add(round(patch.get_x() + patch.get_width() / 2, 6))
    return xs


def test_every_png_has_its_json():
    assert PNGS
    for png in PNGS:
        assert png.with_suffix(".json").exists(), png


@pytest.mark.parametrize("png", PNGS, ids=[p.stem for p in PNGS])
def test_plot_says_what_it_shows(png, tmp_path, report_mod):
    report = json.loads(png.with_suffix(".json").read_text())
    gen, mod = _module(MODULES[report.get("benchmark")])
    try:
        fig = mod.figure(report)  # what plot_report saves, at a lower dpi
    finally:
        gen.close()
    fig.savefig(tmp_path / png.name, dpi=40)
    assert (tmp_path / png.name).stat().st_size > 0
    title = " ".join(fig._suptitle.get_text().split())

    machine = report_mod.machine_label(report)
    assert machine in title
    if "model" in report:
        label = report_mod.model_label(report["model"])
        assert label in title
        name = report["model"].get("name") or report["model"].get("shape")
        if report_mod.published_name(name):  # e.g. Qwen2.5-0.5B, not its slug
            assert f"{report_mod.published_name(name)} shape" in title
        assert report["model"]["dtype"] in title
    else:  # transfer: the shapes are in the panel titles
        panels = " ".join(ax.get_title() for ax in fig.axes)
        for shape in report["config"]["shapes"]:
            assert f"{shape['num_layers']} layers" in panels
    assert "fp32" not in title or report["model"]["dtype"] == "float32"

    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [fig._suptitle] + [ax.title for ax in fig.axes]
    texts += [leg for leg in fig.legends]
    for ax in fig.axes:
        if ax.get_legend() is not None:
            texts.append(ax.get_legend())
    for t in texts:
        if not t.get_visible() or (hasattr(t, "get_text") and not t.get_text()):
            continue
        ext = t.get_window_extent(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1, (png.name, t)
        assert ext.y0 >= box.y0 - 1 and ext.y1 <= box.y1 + 1, (png.name, t)

    for ax in fig.axes:
        assert len(_data_xs(ax)) >= 2, (png.name, ax.get_title())
    matplotlib.pyplot.close(fig)
