"""Download, on a CPU machine with PyPI, exactly the wheels the GPU machine
lacks for vLLM 0.32.0 (CUDA) and torch 2.13.0, and cut them into pieces.

The GPU machine (``gpu_machine_packages.txt``) has Python 3.12, torch
2.11.0+cu130 with its nvidia-* libraries, transformers and more, and no
network: wheels reach it only inside a device call, 64 MiB per call. So:

1. pip resolves the full requirement tree of ``vllm==0.32.0 torch==2.13.0``
   (``pip install --dry-run --ignore-installed --report``) under a Python 3.12
   interpreter, so that environment markers are evaluated for 3.12, with
   ``--only-binary=:all:`` and this machine's pip configuration switched off
   (``PIP_CONFIG_FILE=/dev/null``: a local constraints file or wheel folder
   must not steer the resolution);
2. :func:`diff` compares every package of that tree with the machine's list:
   missing, present in a version that fails a requirement on it (every
   specifier any package of the tree puts on it), present and fine, or
   present in an unknown version (not carried; ``install_pieces.py check``
   verifies it on the machine);
3. the wheels to carry are downloaded with ``pip download --no-deps`` and
   checked against the sha256 that the resolution reported;
4. each plan (:data:`PLANS`: everything, or torch without the CUDA libraries
   over the machine's own, ...) gets a size line; the chosen plan's wheels
   are cut into pieces of at most 58 MiB (``pieces.py``), one folder each;
5. a size report (``size_report.md`` and ``.json``) says how many calls and
   device minutes each plan needs, and whether it fits.

Usage (repository root; CI never runs this, it downloads about 2 GB)::

    .venv/bin/python scripts/gpu/transport/fetch_wheels.py [--python python3.12]
        [--plan auto|full|lean|core] [--out .gpu-wheels] [--no-download]
    .venv/bin/python scripts/gpu/transport/fetch_wheels.py --rerender
        # no pip: the committed size report re-estimated with CallModel

Development tooling for the lent GPU machine (it has no network), not part
of vllm-kvmem: a GPU server installs vLLM and the plugin with pip.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pieces  # noqa: E402
from gpu_common import MEASURED_S  # noqa: E402
from requirement_diff import (  # noqa: E402
    CARRY_MISSING,
    OPTIONAL,
    PRESENT,
    UNVERIFIED,
    MachinePackage,
    Node,
    Row,
    canonicalize_name,
    diff,
    parse_machine_packages,
    requirement_tree,
    tier_of,
)

HERE = Path(__file__).resolve().parent  # scripts/gpu/transport
ROOT = HERE.parent.parent.parent
MIB = 1024**2
GIB = 1024**3
#: vLLM releases the recipe can carry, each with the torch its CUDA wheel pins
#: (vLLM 0.33.0 needs torch 2.14.0: a separate, larger carry).
VLLM_RELEASES = {"0.32.0": "2.13.0", "0.33.0": "2.14.0"}
DEFAULT_VLLM = "0.32.0"


def targets_for(vllm_version: str) -> tuple[str, str]:
    """``vllm==X`` and the ``torch==Y`` its CUDA wheel pins."""
    return (f"vllm=={vllm_version}", f"torch=={VLLM_RELEASES[vllm_version]}")


def default_out(vllm_version: str) -> Path:
    """Where a release's wheels go: ``.gpu-wheels`` for 0.32.0 (the recipe's
    default), ``.gpu-wheels-<version>`` for another (both git-ignored)."""
    suffix = "" if vllm_version == DEFAULT_VLLM else f"-{vllm_version}"
    return ROOT / f".gpu-wheels{suffix}"


MACHINE_LIST = HERE / "gpu_machine_packages.txt"


# -- plans --------------------------------------------------------------------

PLANS = {
    "full": "everything pip's resolution needs that the machine lacks, CUDA "
    "libraries and Triton included",
    "lean": "as full, but torch 2.13 runs on the machine's own CUDA "
    "libraries and Triton 3.6, except those whose symbols torch 2.13 needs "
    "and the machine's version lacks (abi_compare.json: NCCL)",
    "core": "as lean, without vLLM's large optional dependencies (OPTIONAL: "
    "kernels for other models and GPUs, multimodal, JIT compilers)",
    "torch211": "as core, without torch, torchvision and the CUDA libraries: "
    "vLLM 0.32 on the machine's own torch 2.11 (against vLLM's pin; "
    "abi_vllm.json: its attention, cache and MoE extensions resolve against "
    "torch 2.11, _qutlass_C and deep_gemm do not)",
}

#: ``abi_check.py compare``'s verdict, committed: the CUDA wheels whose
#: machine version lacks a symbol torch 2.13 imports must be carried.
ABI_COMPARE = HERE / "abi_compare.json"


def abi_notes(here: Path = HERE) -> list[str]:
    """The committed symbol checks, in words, for the size report."""
    notes = []
    compare = here / "abi_compare.json"
    if compare.is_file():
        data = json.loads(compare.read_text())
        for soname, row in data["sonames"].items():
            if not row["ok"]:
                notes.append(
                    f"abi_compare.json: torch 2.13 imports {len(row['missing'])} "
                    f"symbols from {soname} that {row['have']} (the machine's, "
                    f"inferred) lacks ({', '.join(row['missing'][:4])}, ...): "
                    f"{row['wanted']} must be carried."
                )
        good = [s for s, r in data["sonames"].items() if r["ok"]]
        notes.append(
            "abi_compare.json: every symbol torch 2.13 imports from "
            + ", ".join(good)
            + " is in the machine's (older) versions; sonames are the same. "
            "stage1.sh repeats the check on the machine's real libraries "
            "(abi_check.py machine, dlsym)."
        )
    vllm = here / "abi_vllm.json"
    if vllm.is_file():
        data = json.loads(vllm.read_text())
        for label, per_ext in data["torch"].items():
            if label == data["reference"]:
                continue
            bad = sorted(e for e, r in per_ext.items() if r["missing"])
            notes.append(
                f"abi_vllm.json: against {label}, every symbol vLLM 0.32's "
                f"compiled extensions import from torch resolves except in "
                f"{', '.join(bad)} (FP4 and DeepGEMM kernels, unused by a bf16 "
                "model): the torch211 plan is possible at the symbol level; "
                "vLLM's Python code against torch 2.11 is untested."
            )
    notes.append(
        "Pieces are cut from one stream with the torch211 plan's wheels "
        "first: after piece "
        "N (see the pieces section) those wheels can be installed "
        "(install_pieces.py install --partial) while the rest is still to come."
    )
    return notes


def abi_must_carry(path: Path = ABI_COMPARE) -> set[str]:
    """Canonical names of the CUDA wheels that fail the symbol check."""
    if not path.is_file():
        return set()
    data = json.loads(path.read_text())
    return {
        canonicalize_name(row["wanted"].split("==")[0])
        for row in data["sonames"].values()
        if not row["ok"]
    }


PLAN_SKIP_TIERS = {
    "full": set(),
    "lean": {"cuda-libs"},
    "core": {"cuda-libs", "optional"},
    "torch211": {"cuda-libs", "cuda-libs-abi", "optional", "torch"},
}


def plan_diff(
    tree: Mapping[str, Node],
    machine: Mapping[str, MachinePackage],
    plan: str,
    abi_carry: set[str] = frozenset(),
) -> list[Row]:
    """:func:`diff` for one plan: its left-out tiers are skipped."""
    skip = {n for n in tree if tier_of(n, abi_carry) in PLAN_SKIP_TIERS[plan]}
    rows = diff(tree, machine, skip)
    for r in rows:
        r.tier = tier_of(r.name, abi_carry)
    return rows


def stream_order(rows_by_plan: Mapping[str, Sequence[Row]], plan: str) -> list[Row]:
    """The chosen plan's wheels, those of the smaller plans first (each
    block by name): pieces arrive in order, so a smaller plan can be
    installed from the first pieces while the rest are still to come."""
    order = ["torch211", "core", "lean", "full"]
    order = order[: order.index(plan) + 1] if plan in order else [plan]
    placed: set[str] = set()
    out: list[Row] = []
    for p in order:
        for r in sorted(
            (r for r in rows_by_plan[p] if r.carry), key=lambda r: r.filename
        ):
            if r.name not in placed:
                placed.add(r.name)
                out.append(r)
    return out


# -- device time ----------------------------------------------------------------


@dataclass(frozen=True)
class CallModel:
    """What a device call costs, in seconds of the session's device time.

    Measured on the first GPU run (an NVIDIA H200, 2026-11-26;
    ``gpu_common.MEASURED_S``): a cold start 30 s; a call carrying one
    58 MiB piece 8 s (calls 2-8 held 56 s: the transfer, the command
    taking the piece and the idle seconds before the next call, which count
    as device time); install, requirement check and import probe 30 s for
    the torch211 plan's 344 MiB (20 s + 30 s per GiB, the per-GiB part not
    measured on any larger plan); stage 1 85 s. Stage 2's first run is the
    real-size run (``real_size.py``, its ``--max-wall-s`` default: the next
    session's runs after the pieces). Limits as the device README gives them
    since 2026-11-25: 15 device minutes per session, all calls together."""

    cold_start_s: float = MEASURED_S["cold_start"]
    per_piece_call_s: float = MEASURED_S["piece_call"]
    install_s_per_gib: float = 30.0
    install_fixed_s: float = MEASURED_S["install_and_probe"] - 10.0
    stage1_s: float = MEASURED_S["stage1"]  # one call, start excluded
    stage2_runs_s: float = 480.0  # real_size.py's --max-wall-s default
    device_budget_s: float = 15 * 60.0
    hold_limit_s: float = 30 * 60.0

    @property
    def limit_s(self) -> float:
        """What a plan may spend: the session's device time, in one hold."""
        return min(self.device_budget_s, self.hold_limit_s)


def estimate(total_bytes: int, piece_bytes: int, model: CallModel) -> dict:
    """Calls and device minutes to carry, install and run stage 2, alone and
    after stage 1 in the same machine hold (the pieces must all arrive within
    one hold: a machine given back starts bare)."""
    calls = math.ceil(total_bytes / piece_bytes) if total_bytes else 0
    carry_s = calls * model.per_piece_call_s
    install_s = model.install_fixed_s + total_bytes / GIB * model.install_s_per_gib
    stage2_s = model.cold_start_s + carry_s + install_s + model.stage2_runs_s
    both_s = stage2_s + model.stage1_s
    return {
        "bytes": total_bytes,
        "mib": round(total_bytes / MIB, 1),
        "calls": calls,
        "carry_min": round(carry_s / 60, 1),
        "install_min": round(install_s / 60, 1),
        "stage2_min": round(stage2_s / 60, 1),
        "stage1_and_2_min": round(both_s / 60, 1),
        "fits_stage2_alone": stage2_s <= model.limit_s,
        "fits_with_stage1": both_s <= model.limit_s,
    }


# -- pip ------------------------------------------------------------------------


def pip_env() -> dict[str, str]:
    """This machine's pip configuration off: its constraints file and local
    wheel folders must not steer what the GPU machine gets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def find_python312(explicit: str | None) -> str:
    """A Python 3.12 interpreter: markers such as ``python_version < "3.13"``
    must be evaluated for the GPU machine's Python, not this one's."""
    candidates = [explicit] if explicit else []
    candidates += [shutil.which("python3.12") or ""]
    candidates += sorted(
        str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")
    )
    for c in candidates:
        if not c:
            continue
        try:
            out = subprocess.run(
                [c, "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return c
    raise SystemExit(
        "no Python 3.12 interpreter found (the GPU machine runs 3.12.3); "
        "pass --python PATH"
    )


def resolve(python: str, roots: Sequence[str], work: Path) -> dict:
    """pip's full resolution of ``roots`` as a ``--report`` (nothing installed,
    only metadata fetched)."""
    report = work / "resolution.json"
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--quiet",
        "--report",
        str(report),
        *roots,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=pip_env())
    return json.loads(report.read_text())


def download(python: str, rows: Sequence[Row], dest: Path) -> dict[str, Path]:
    """Each row's exact wheel, by ``pip download --no-deps``, checked
    against the sha256 of the resolution; returns file by package name."""
    dest.mkdir(parents=True, exist_ok=True)
    want = [r for r in rows if not (dest / r.filename).is_file()]
    if want:
        cmd = [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
            str(dest),
            *(f"{r.name}=={r.version}" for r in want),
        ]
        print(f"$ pip download --no-deps ... ({len(want)} wheels)", flush=True)
        subprocess.run(cmd, check=True, env=pip_env())
    out = {}
    for r in rows:
        path = dest / r.filename
        if not path.is_file():
            raise SystemExit(f"{r.name}: pip did not download {r.filename}")
        if r.sha256 and pieces.sha256_file(path) != r.sha256:
            raise SystemExit(f"{r.filename}: sha256 differs from the resolution's")
        r.size = path.stat().st_size
        out[r.name] = path
    return out


# -- report ---------------------------------------------------------------------


#: The plan that has run on the machine: vLLM 0.32's engines and servers on
#: the machine's torch 2.11 (NVIDIA H200, 2026-11-26, with
#: ``VLLM_USE_FLASHINFER_SAMPLER=0``).
PROVEN_PLAN = "torch211"


def choose_plan(estimates: Mapping[str, dict], prefer: str | None = PROVEN_PLAN) -> str:
    """``prefer`` (the plan that has run) when it fits after stage 1; else the
    most complete plan that fits, else the smallest. With the measured costs
    the larger plans fit too, but each piece call is device time taken from
    the runs, and what they add (vLLM's torch pin) is not what a session
    measures."""
    if prefer is not None and estimates[prefer]["fits_with_stage1"]:
        return prefer
    for plan in ("full", "lean", "core", "torch211"):
        if estimates[plan]["fits_with_stage1"]:
            return plan
    return "torch211"


def _fmt_mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:,.1f}"


def _short(status: str) -> str:
    return status.split(":", 1)[0]


def render_markdown(report: Mapping) -> str:
    """The committed size report, from the JSON one."""
    model = report["call_model"]
    limit_min = f"{CallModel(**model).limit_s / 60:.0f}"
    full = report["plans"]["full"]["rows"]
    in_plan = {
        plan: {r["name"] for r in info["rows"] if r["status"].startswith("carry")}
        for plan, info in report["plans"].items()
    }
    counts: dict[str, int] = {}
    for r in full:
        counts[_short(r["status"])] = counts.get(_short(r["status"]), 0) + 1
    lines = [
        "# Wheels for vLLM 0.32.0 on the GPU machine: size report",
        "",
        f"Written by `{report['command']}` on {report['created']} (resolved "
        f"by pip {report['pip_version']} under Python "
        f"{report['resolver_python']}; the machine's list: "
        f"`{report['machine_list']}`). Sizes are of the wheels as "
        "downloaded. Nothing here ran on a GPU.",
        "",
        f"Full requirement tree of `{' '.join(report['targets'])}`: "
        f"{len(full)} packages. Against the machine, for plan `full`: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + ".",
        "",
        "## Plans",
        "",
        "| plan | what | wheels | MiB | "
        f"calls ({report['piece_bytes'] // MIB} MiB each) | stage 2 device min "
        f"| stage 1 + 2 in one hold | fits {limit_min} min |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for plan, info in report["plans"].items():
        est = info["estimate"]
        lines.append(
            f"| {plan} | {PLANS[plan]} | {info['wheels']} | {est['mib']:,} | "
            f"{est['calls']} | {est['stage2_min']} | {est['stage1_and_2_min']} | "
            f"{'yes' if est['fits_with_stage1'] else 'no'} |"
        )
    lines += [
        "",
        f"**Chosen plan: `{report['chosen']}`.** {report['chosen_why']}",
        "",
        "Device-time model (`CallModel` in the script; measured on the first "
        "GPU run, an NVIDIA H200 on 2026-11-26, except the install's per-GiB "
        f"part): cold start {model['cold_start_s']:.0f} s; each call that "
        f"carries one piece {model['per_piece_call_s']:.0f} s (sending about "
        f"{report['piece_bytes'] // MIB + 4} MiB, taking the piece out of the "
        "checkout, and the idle seconds until the session's next call, which "
        "count as device time); install and probe "
        f"{model['install_fixed_s']:.0f} s + {model['install_s_per_gib']:.0f} s "
        f"per GiB; stage 1 {model['stage1_s'] / 60:.1f} min; stage 2's runs "
        f"{model['stage2_runs_s'] / 60:.0f} min (the real-size run, "
        "`real_size.py --max-wall-s`). The chosen plan is the one that has "
        f"run on the machine ({PROVEN_PLAN}) when it fits, else the most "
        "complete that fits. Limits: "
        f"{model['device_budget_s'] / 60:.0f} device minutes per session, a "
        "machine held "
        f"{model['hold_limit_s'] / 60:.0f} minutes at most, and every piece "
        "must arrive within one hold (a machine given back comes back bare).",
        "",
    ]
    if report.get("pieces"):
        pc = report["pieces"]
        lines += [
            "## Pieces",
            "",
            f"Plan `{pc['plan']}`: {pc['count']} pieces of at most "
            f"{report['piece_bytes'] // MIB} MiB ({pc['total_bytes'] / MIB:,.1f} "
            f"MiB) in `{pc['folder']}/p001` ... (ignored by git; regenerate "
            "with the command above). The torch211 plan's wheels are complete "
            f"after piece {pc['torch211_complete_after_piece']}.",
            "",
        ]
    if report.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines += [
        "## Packages carried by plan `full` (largest first)",
        "",
        "| package | version | machine has | tier | MiB | lean | core | torch211 "
        "| why |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    sizes = report["sizes"]
    carried = sorted(
        (r for r in full if r["status"].startswith("carry")),
        key=lambda r: -(sizes.get(r["name"]) or 0),
    )
    for r in carried:
        why = (
            "missing"
            if r["status"] == CARRY_MISSING
            else "needs " + "; ".join(f"{s} ({w})" for w, s in r["failing"])
        )
        if r["tier"] == "optional":
            why += f"; optional: {OPTIONAL.get(r['name'], '')}"
        marks = [
            "x" if r["name"] in in_plan[p] else "" for p in ("lean", "core", "torch211")
        ]
        lines.append(
            f"| {r['name']} | {r['version']} | {r['machine_version'] or '-'} | "
            f"{r['tier']} | {_fmt_mib(sizes.get(r['name']))} | {marks[0]} | "
            f"{marks[1]} | {marks[2]} | {why} |"
        )
    unverified = [r for r in full if r["status"] == UNVERIFIED]
    lines += [
        "",
        "## On the machine in an unknown version (not carried)",
        "",
        "`install_pieces.py check` reads their versions there and lists any "
        "that fail what the installed packages ask; stage 1 writes the "
        "machine's `pip freeze`, which `--machine-packages` takes, to turn "
        "these into present or carried.",
        "",
    ]
    lines += [
        f"- {r['name']} (pip resolved {r['version']}; asked: "
        + (", ".join(sorted({s or "any" for _, s in r["wanted"]})) or "nothing")
        + ")"
        for r in unverified
    ]
    present = [r for r in full if r["status"] == PRESENT]
    lines += [
        "",
        "## On the machine in a version that satisfies what is carried",
        "",
        ", ".join(f"{r['name']} {r['machine_version']}" for r in present) or "-",
        "",
    ]
    return "\n".join(lines)


def choice(estimates: Mapping[str, dict], model: CallModel) -> tuple[str, str]:
    """The chosen plan and the report's sentence on it."""
    chosen = choose_plan(estimates)
    est = estimates[chosen]
    why = (
        f"It carries {est['mib']:,} MiB in {est['calls']} calls; stage 2 alone "
        f"needs about {est['stage2_min']} device minutes, stage 1 and 2 in one "
        f"hold about {est['stage1_and_2_min']}."
    )
    if chosen == PROVEN_PLAN:
        why += " It is the plan that has run on the machine (2026-11-26)."
    if not est["fits_with_stage1"]:
        why += (
            f" Even this does not fit after stage 1 in {model.limit_s / 60:.0f} device "
            "minutes: run stage 2 in a session of its own, carrying the "
            "pieces first."
        )
    return chosen, why


def build_report(
    rows_by_plan: Mapping[str, Sequence[Row]],
    sizes: Mapping[str, int],
    *,
    piece_bytes: int,
    model: CallModel,
    meta: Mapping,
    notes: Sequence[str] = (),
) -> dict:
    """Plans, estimates and rows as one JSON-able record."""
    plans = {}
    for plan, rows in rows_by_plan.items():
        carried = [r for r in rows if r.carry]
        total = sum(sizes.get(r.name, 0) for r in carried)
        plans[plan] = {
            "wheels": len(carried),
            "estimate": estimate(total, piece_bytes, model),
            "rows": [asdict(r) for r in rows],
        }
    chosen, why = choice({p: info["estimate"] for p, info in plans.items()}, model)
    return {
        **meta,
        "piece_bytes": piece_bytes,
        "call_model": asdict(model),
        "sizes": dict(sizes),
        "plans": plans,
        "chosen": chosen,
        "chosen_why": why,
        "notes": list(notes),
    }


# -- main -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", help="Python 3.12 interpreter for pip")
    p.add_argument(
        "--machine-packages",
        type=Path,
        default=MACHINE_LIST,
        help="the GPU machine's packages (this folder's list, or a pip freeze)",
    )
    p.add_argument(
        "--vllm",
        choices=sorted(VLLM_RELEASES),
        default=DEFAULT_VLLM,
        help="the vLLM release to carry (with the torch its wheel pins)",
    )
    p.add_argument(
        "--out", type=Path, help="default: .gpu-wheels (0.32.0), .gpu-wheels-VERSION"
    )
    p.add_argument(
        "--report-dir",
        type=Path,
        help="where size_report.md/.json go (default: this folder for 0.32.0, "
        "this folder's vllm-VERSION/ for another release)",
    )
    p.add_argument(
        "--plan",
        choices=["auto", *PLANS],
        default="auto",
        help="plan to cut into pieces (auto: chosen by the size report)",
    )
    p.add_argument("--piece-mib", type=int, default=pieces.DEFAULT_PIECE_BYTES // MIB)
    p.add_argument(
        "--no-download",
        action="store_true",
        help="resolve and diff only (sizes unknown, no pieces)",
    )
    p.add_argument(
        "--reuse-resolution",
        action="store_true",
        help="use OUT/resolution.json from an earlier run instead of resolving",
    )
    p.add_argument("--note", action="append", default=[], help="add to the report")
    p.add_argument(
        "--rerender",
        action="store_true",
        help="no pip: re-estimate the committed size report with CallModel "
        "(sizes and pieces as they were) and write it again",
    )
    args = p.parse_args(argv)
    args.out = args.out or default_out(args.vllm)
    if args.report_dir is None:
        same = args.vllm == DEFAULT_VLLM
        args.report_dir = HERE if same else HERE / f"vllm-{args.vllm}"
    return args


def pip_version(python: str) -> str:
    out = subprocess.run(
        [python, "-m", "pip", "--version"],
        capture_output=True,
        text=True,
        env=pip_env(),
    )
    m = re.match(r"pip (\S+)", out.stdout)
    return m.group(1) if m else "?"


def rerender(report: dict, model: CallModel, note: str | None = None) -> dict:
    """``report`` re-estimated with ``model``: each plan's bytes, the piece
    size and the pieces stay as measured; estimates, the call model, the
    choice and its reason follow ``model``. The choice must stay the plan
    whose pieces were cut (else the pieces are another plan's)."""
    out = dict(report)
    plans = {}
    for plan, info in report["plans"].items():
        est = estimate(info["estimate"]["bytes"], report["piece_bytes"], model)
        plans[plan] = {**info, "estimate": est}
    chosen, why = choice({p: i["estimate"] for p, i in plans.items()}, model)
    out.update(plans=plans, call_model=asdict(model), chosen=chosen, chosen_why=why)
    pieces_plan = (report.get("pieces") or {}).get("plan")
    if pieces_plan and pieces_plan != out["chosen"]:
        raise SystemExit(
            f"re-estimated, the report would choose {out['chosen']}, but its "
            f"pieces are {pieces_plan}'s: run fetch_wheels.py to cut new ones"
        )
    if note:
        kept = [n for n in report.get("notes", []) if n[:20] != note[:20]]
        out["notes"] = [*kept, note]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rerender:
        path = args.report_dir / "size_report.json"
        report = rerender(
            json.loads(path.read_text()),
            CallModel(),
            "Estimates re-made with the device costs measured on the first GPU "
            "run (NVIDIA H200, 2026-11-26) by `fetch_wheels.py --rerender`; "
            "sizes, resolution and pieces are those of the run above (the "
            "script has since moved to scripts/gpu/transport/).",
        )
        path.write_text(json.dumps(report, indent=1) + "\n")
        (args.report_dir / "size_report.md").write_text(render_markdown(report))
        print(f"{path}: chosen {report['chosen']}; {report['chosen_why']}")
        return 0
    python = find_python312(args.python)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = parse_machine_packages(args.machine_packages.read_text())
    targets = targets_for(args.vllm)
    if args.reuse_resolution and (args.out / "resolution.json").is_file():
        report = json.loads((args.out / "resolution.json").read_text())
    else:
        report = resolve(python, targets, args.out)
    tree = requirement_tree(report, targets)
    if args.vllm != DEFAULT_VLLM:
        args.note.append(
            f"The ABI files (abi_*.json) were measured for vLLM {DEFAULT_VLLM} and "
            f"torch {VLLM_RELEASES[DEFAULT_VLLM]}; the lean and core plans for vLLM "
            f"{args.vllm} (torch {VLLM_RELEASES[args.vllm]}) rely on them until "
            "abi_check.py is run for this release's wheels."
        )
    abi_carry = abi_must_carry()
    rows_by_plan = {plan: plan_diff(tree, machine, plan, abi_carry) for plan in PLANS}
    sizes: dict[str, int] = {}
    if not args.no_download:
        # Every plan carries a subset of what "full" carries.
        files = download(
            python, [r for r in rows_by_plan["full"] if r.carry], args.out / "wheels"
        )
        sizes = {name: path.stat().st_size for name, path in files.items()}
    meta = {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "targets": list(targets),
        "resolver_python": report["environment"]["python_full_version"],
        "pip_version": pip_version(python),
        "machine_list": _rel(args.machine_packages),
        "command": " ".join(
            [
                "python scripts/gpu/transport/fetch_wheels.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
    }
    out = build_report(
        rows_by_plan,
        sizes,
        piece_bytes=args.piece_mib * MIB,
        model=CallModel(),
        meta=meta,
        notes=abi_notes() + list(args.note),
    )
    plan = out["chosen"] if args.plan == "auto" else args.plan
    if not args.no_download:
        chosen = stream_order(rows_by_plan, plan)
        manifest = pieces.split(
            [args.out / "wheels" / r.filename for r in chosen],
            args.out / plan,
            args.piece_mib * MIB,
            meta={
                "plan": plan,
                "created": meta["created"],
                "plans": {
                    p: sorted(r.filename for r in rows_by_plan[p] if r.carry)
                    for p in PLANS
                },
            },
        )
        small = set(manifest["plans"]["torch211"])
        last = max(
            (
                p["index"]
                for f in manifest["files"]
                if f["name"] in small
                for p in manifest["pieces"]
                if p["offset"] < f["offset"] + f["size"]
                and p["offset"] + p["size"] > f["offset"]
            ),
            default=0,
        )
        out["pieces"] = {
            "plan": plan,
            "folder": _rel(args.out / plan),
            "count": len(manifest["pieces"]),
            "total_bytes": manifest["total_bytes"],
            "torch211_complete_after_piece": last,
        }
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "size_report.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.report_dir / "size_report.md").write_text(render_markdown(out))
    for name, info in out["plans"].items():
        est = info["estimate"]
        print(
            f"{name:5s} {info['wheels']:3d} wheels {est['mib']:9,.1f} MiB "
            f"{est['calls']:3d} calls  stage 2 {est['stage2_min']:5.1f} min  "
            f"stage 1+2 {est['stage1_and_2_min']:5.1f} min  "
            f"fits: {est['fits_with_stage1']}"
        )
    print(f"chosen: {out['chosen']}; report: {args.report_dir / 'size_report.md'}")
    return 0


def _rel(path: Path) -> str:
    """A path relative to the repository root where it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
