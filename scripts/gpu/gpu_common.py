"""What every GPU script here needs to know about the machine it runs on.

Standard library only: the stage scripts call it with the machine's bare
``python3`` before anything is installed, and the dry runs import it on CPU.

* :data:`SERVER_ENV`: environment every vLLM engine and server gets here.
* :func:`gpu_info`, :func:`device_suffix`, :func:`gpu_label`: outputs are
  named after the GPU that ran them (``nvidia-smi``), never assumed, and
  labelled GPU with the device inside the JSON.
* :data:`MEASURED_S`: what device calls and runs cost on the first GPU run
  (an NVIDIA H200, 2026-11-26), the figures every plan estimate here uses.
* :func:`run_captured`, :func:`write_dry_run`, :func:`csv_list`: what the
  GPU scripts share: a child process with a timeout, the dry run's plan file,
  comma-separated options.

Command line (for the shell scripts)::

    python3 scripts/gpu/gpu_common.py suffix          # h100, h200, ... or "cpu"
    python3 scripts/gpu/gpu_common.py label FILE.json [--command CMD]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: vLLM 0.32's sampler asks ``flashinfer_sampler_supported()`` at engine
#: start, which imports ``vllm.v1.attention.backends.flashinfer`` and so the
#: ``flashinfer`` package. The recipe does not carry flashinfer (vLLM on the
#: machine's torch 2.11: FLASH_ATTN and TRITON_ATTN need none of it), so on
#: the H200 run of 2026-11-26 every engine, plain vLLM as well as with the
#: plugin, failed in ``load_model`` with ``No module named 'flashinfer'``.
#: ``VLLM_USE_FLASHINFER_SAMPLER=0`` makes vLLM skip that check (and use its
#: PyTorch top-k/top-p sampler; greedy sampling is the same either way).
SERVER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

#: Device seconds measured on the first GPU run (NVIDIA H200, 2026-11-26,
#: the recipe at 32dfea4; the run's README and logs). Estimates in
#: ``ab_offload.py``, ``real_size.py``, ``stage2.py`` and
#: ``transport/fetch_wheels.py`` read these.
MEASURED_S = {
    # A call that finds no machine: 114 device s held after call 1, whose
    # command ran 84 s.
    "cold_start": 30.0,
    # Calls 2-8 (the pieces, one a call) held 56 s together: 8 s a call,
    # the transfer and the idle seconds before the next call included.
    "piece_call": 8.0,
    # Install from the pieces, requirement check and import probe, before
    # stage 2's items (call 9: 187 s, of which items a and b 136 s).
    "install_and_probe": 30.0,
    # Stage 1 (copy-engine CUDA tests, transfer benchmark, ABI check).
    "stage1": 85.0,
    # One LLM engine, --enforce-eager, tiny model, in its own process:
    # item a's two engines took 37 and 34 s, its failed ones 30-33 s.
    "engine_start_eager": 35.0,
    # One OpenAI server, --enforce-eager, tiny model: start and warm-up
    # (56, 60 and 64 s for the A/B's three servers, one after the other).
    "server_start_eager": 60.0,
    # The A/B's steps (tiny model, 96 prompts, 64 out): a probe of three
    # client calls 1.5 s, a throughput run 13-18 s (c4 and c8).
    "ab_probe": 1.5,
    "ab_throughput_run": 17.0,
    # The A/B, three arms, one repeat, three probes: 332 s, of which
    # starting three servers 180 s, 9 probes 14 s, 6 runs 98 s; the rest
    # (the model, stopping the servers, the report) about 40 s.
    "ab_fixed": 40.0,
    "ab_three_arms_one_repeat": 330.0,
}

#: GPU models named in file names by their short name (word-bounded:
#: ``GH200`` is not an H200).
KNOWN_GPUS = ("h100", "h200", "h20", "a100", "b200", "b100", "l40s", "l4")


def device_suffix(gpu_name: str) -> str:
    """``h100`` for any H100, ``h200`` for an H200, ..., else a slug of the
    name (``nvidia_gh200_480gb``); ``gpu`` when the name is empty."""
    low = gpu_name.lower()
    for model in KNOWN_GPUS:
        if re.search(rf"(?<![a-z0-9]){model}(?![a-z0-9])", low):
            return model
    slug = re.sub(r"[^a-z0-9]+", "_", low).strip("_")
    return slug or "gpu"


def gpu_info() -> dict[str, str] | None:
    """GPU 0 from ``nvidia-smi`` (no CUDA context in this process); None
    when there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not line:
        return None
    name, memory, driver = (x.strip() for x in (line.split(",") + ["", ""])[:3])
    return {"name": name, "memory": memory, "driver": driver}


def gpu_memory_gib(gpu: dict[str, str]) -> float | None:
    """``memory.total`` (``143771 MiB``) in GiB, None when unreadable."""
    m = re.match(r"\s*([\d.]+)\s*MiB", gpu.get("memory", ""))
    return float(m.group(1)) / 1024 if m else None


def gpu_label(gpu: dict[str, str], when: dt.datetime | None = None) -> str:
    """``GPU: NVIDIA H200, measured 2026-11-26`` (UTC date)."""
    when = when or dt.datetime.now(dt.UTC)
    return f"GPU: {gpu['name']}, measured {when:%Y-%m-%d}"


def label_file(path: Path, gpu: dict[str, str], command: str | None = None) -> dict:
    """Add ``platform``, ``label`` and ``device`` to a result JSON whose
    producer does not write them (keys it wrote are kept as they are)."""
    data = json.loads(path.read_text())
    extra: dict[str, Any] = {
        "platform": "GPU",
        "label": gpu_label(gpu),
        "gpu": gpu,
    }
    if command:
        extra["command_on_machine"] = command
    for key, value in extra.items():
        data.setdefault(key, value)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def run_captured(
    cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int | str, str]:
    """Run ``cmd``: its exit code (``"timeout"`` past ``timeout`` seconds) and
    its output, stdout then stderr (what it wrote before a timeout)."""
    try:
        done = subprocess.run(
            list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return "timeout", text


def write_dry_run(
    plan: dict[str, Any], out: Path, script: str, shown: Sequence[str] | None
) -> Path:
    """A dry run's plan: ``imported_torch_or_vllm`` added (a dry run imports
    neither), written to ``out/<script>_plan.json``; the ``shown`` keys
    printed (the whole plan when None), then where it went."""
    plan["imported_torch_or_vllm"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")
    )
    path = out / f"{script}_plan.json"
    path.write_text(json.dumps(plan, indent=1) + "\n")
    if shown is None:
        print(json.dumps(plan, indent=1))
    else:
        print(json.dumps({k: plan[k] for k in shown}))
    print(f"{script} dry run -> {path}")
    return path


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("suffix", help="the GPU's short name for file names, or cpu")
    lab = sub.add_parser("label", help="label a result JSON with the GPU")
    lab.add_argument("path", type=Path)
    lab.add_argument("--command")
    args = p.parse_args(argv)
    gpu = gpu_info()
    if args.cmd == "suffix":
        print(device_suffix(gpu["name"]) if gpu else "cpu")
        return 0
    if gpu is None:
        print(f"no NVIDIA GPU: {args.path} left unlabelled")
        return 2
    label_file(args.path, gpu, args.command)
    print(f"{args.path}: labelled {gpu_label(gpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
