"""Stage 2's items g-j: this folder's GPU scripts, each in a child process.

``ab_offload.py`` (issue 30's A/B), ``real_size.py`` (issue 36),
``late_spill.py`` (issue 42: late spills under Model Runner V1 and V2) and
``events_disk.py`` (issue 47: KV events and disk hits on CUDA) run
with their own ``--max-wall-s``, write their own figures to ``$OUT`` and
leave their logs in stage 2's tarball; stage 2 records how each child ended,
and its dry run asks each script for its plan and estimate (they import
neither vLLM nor torch).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Protocol


class Runner(Protocol):
    """What these items use of stage 2's ``Runner``: where it works, logs and
    writes, and the arguments it passes each script."""

    work: Path
    out: Path
    logs: Path
    ab_args: str
    real_args: str
    late_args: str
    events_args: str


ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import run_captured  # noqa: E402  (standard library only)

AB_SCRIPT = Path(__file__).resolve().parent / "ab_offload.py"
REAL_SCRIPT = Path(__file__).resolve().parent / "real_size.py"
LATE_SCRIPT = Path(__file__).resolve().parent / "late_spill.py"
EVENTS_SCRIPT = Path(__file__).resolve().parent / "events_disk.py"
#: Each item's script, and the folder under ``.gpu-work`` its models go to
#: (item i shares stage 2's tiny model, ``.gpu-work/tiny-model``; item j
#: builds the KV events check's 2-layer model, ``.gpu-work/events-model``).
SCRIPTS = {
    "g": (AB_SCRIPT, "serving-model"),
    "h": (REAL_SCRIPT, "shape-models"),
    "i": (LATE_SCRIPT, "."),
    "j": (EVENTS_SCRIPT, "."),
}


def _script_module(path: Path) -> Any:
    """A script of this folder as a module (it imports no vLLM or torch)."""
    sys.path.insert(0, str(path.parent))
    return __import__(path.stem)


def _ab_module() -> Any:
    """scripts/gpu/ab_offload.py as a module."""
    return _script_module(AB_SCRIPT)


def _child_script(r: Runner, item: str, script: Path, args: str, cache: str) -> dict:
    """Run one of this folder's GPU scripts in a child process with its own
    ``--max-wall-s`` (then 120 s to stop its servers); its figures go to
    ``$OUT/<script>_<gpu>.json``, its logs into the tarball (``<item>_<script>/``),
    its model folders under ``.gpu-work/<cache>``."""
    argv = shlex.split(args)
    max_wall = _script_module(script).parse_args(argv).max_wall_s
    name = f"{item}_{script.stem}"
    work = r.logs / name  # server and client logs: into the tarball
    cmd = [
        sys.executable, str(script), "--out", str(r.out), "--work", str(work),
        "--model-cache", str(r.work / cache),
    ]  # fmt: skip
    t0 = time.perf_counter()
    code, text = run_captured(
        [*cmd, *argv],
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        timeout=max_wall + 120,
    )
    (r.logs / f"{name}.log").write_text(text)
    print(f"  {script.stem}: exit {code} in {time.perf_counter() - t0:.0f} s")
    files = sorted(p.name for p in r.out.glob(f"{script.stem}_*.json"))
    return {
        "exit": code,
        "argv": argv,
        "results_files": files,  # GPU-labelled, named after the GPU
        "last_lines": text.splitlines()[-3:],
        "errors": [ln for ln in text.splitlines() if re.search(r"Error|error:", ln)][
            -8:
        ],
    }


def item_g(r: Runner) -> dict:
    """Issue 30: host tier against SimpleCPUOffloadConnector (lazy_offload)
    and, when asked, OffloadingConnector; serving_bench's prefix-reuse
    workload on vLLM's OpenAI server (scripts/gpu/ab_offload.py)."""
    return _child_script(r, "g", AB_SCRIPT, r.ab_args, "serving-model")


def item_h(r: Runner) -> dict:
    """Issue 36: the real-size run (Llama-3.1-8B shape, dummy weights):
    TTFT of a host hit against recompute at 4k-32k tokens, the per-step
    profile, throughput at 0% and 80% reuse, BLHNC against the default
    (scripts/gpu/real_size.py)."""
    return _child_script(r, "h", REAL_SCRIPT, r.real_args, "shape-models")


def item_i(r: Runner) -> dict:
    """Issue 42: late spills under Model Runner V2 and V1, the plugin's tier
    and vLLM's lazy offload on the series' vLLM against no offload, greedy
    identity and host hits, on the tiny model (scripts/gpu/late_spill.py)."""
    return _child_script(r, "i", LATE_SCRIPT, r.late_args, ".")


def item_j(r: Runner) -> dict:
    """Issue 47, item 2: the host tier's KV events and the disk tier's hits
    on CUDA, benchmarks/kv_events_check.py on an OpenAI server with the host
    and disk tiers: every request's cached tokens predicted from the events
    (scripts/gpu/events_disk.py)."""
    return _child_script(r, "j", EVENTS_SCRIPT, r.events_args, ".")


def estimate_s(item: str, args: str) -> float:
    """Device seconds item g, h, i or j takes: its script's own estimate."""
    if item == "g":
        ab = _ab_module()
        return float(ab.estimate_s(ab.parse_args(shlex.split(args))))
    module = _script_module(SCRIPTS[item][0])
    return float(module.build_plan(module.parse_args(shlex.split(args)))["estimate_s"])


def plan(item: str, args: str, work: Path) -> dict[str, Any]:
    """Item g's, h's, i's or j's plan as its script's dry run writes it, with its
    argv."""
    if item == "g":
        ab = _ab_module()
        ab_args = ab.parse_args(shlex.split(args))
        ab_args.model_cache = work / "serving-model"
        out = ab.build_plan(ab_args, ab.model_path(ab_args))
    else:
        script, cache = SCRIPTS[item]
        module = _script_module(script)
        parsed = module.parse_args(shlex.split(args))
        parsed.model_cache = work / cache
        out = module.build_plan(parsed)
    out["argv"] = shlex.split(args)
    return out
