"""``kvmem demo``: the seed's A/B experiment on a tiny local model.

A pipeline of 2 with an uneven split (14/2 layers, the 7:1 shape of the seed's
56/8 Qwen3-32B run), started once without and once with
``--enable-pp-prop-kv-cache`` under the same ``--kv-cache-memory-bytes``, and a
side-by-side table of what each rank really allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vllm_kvmem.core.units import MiB
from vllm_kvmem.engine_report import REPORT_PREFIX

PP_COMPILATION = {"mode": 2, "backend": "eager"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="work and result directory")
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument(
        "--partition", default="14,2", help="VLLM_PP_LAYER_PARTITION for the run"
    )
    parser.add_argument(
        "--kv-cache-memory-bytes", default="64M", help="the budget, as for vLLM"
    )
    parser.add_argument("--max-model-len", type=int, default=2048)


def _engine(llm_kwargs: dict[str, Any], partition: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        VLLM_PP_LAYER_PARTITION=partition,
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kvmem.engine_report", json.dumps(llm_kwargs)],
        env=env,
        capture_output=True,
        text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(REPORT_PREFIX):
            return json.loads(line[len(REPORT_PREFIX) :])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
    raise RuntimeError(f"engine failed (exit {proc.returncode}); log above")


def format_table(runs: dict[str, dict[str, Any]], budget: int, max_len: int) -> str:
    head = (
        f"{'':14}| {'without --enable-pp-prop-kv-cache':^36} | "
        f"{'with --enable-pp-prop-kv-cache':^36}"
    )
    sub = (
        f"{'rank (layers)':14}|"
        + f" {'KV MiB':>8} {'blocks':>7} {'tokens':>9} {'conc':>8} |" * 2
    )
    lines = [
        f"KV budget --kv-cache-memory-bytes {budget / MiB:.0f} MiB, "
        f"max_model_len {max_len:,}",
        head,
        sub,
        "-" * len(sub),
    ]
    base, prop = runs["without"]["ranks"], runs["with"]["ranks"]
    for a, b in zip(base, prop):
        cells = [f"{a['rank']} ({a['layers']})".ljust(14) + "|"]
        for r in (a, b):
            cells.append(
                f" {r['kv_bytes'] / MiB:>8.2f} {r['num_blocks']:>7,} "
                f"{r['tokens']:>9,} {r['concurrency']:>7.2f}x |"
            )
        lines.append("".join(cells))
    totals = [sum(r["kv_bytes"] for r in x) / MiB for x in (base, prop)]
    lines.append("-" * len(sub))
    lines.append(
        f"{'total':14}| {totals[0]:>8.2f} {'':>27}| {totals[1]:>8.2f} {'':>27}|"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from vllm.utils.argparse_utils import human_readable_int

    from vllm_kvmem.tiny_model import build_tiny_model

    out = Path(args.out)
    budget = human_readable_int(str(args.kv_cache_memory_bytes))
    model = build_tiny_model(
        out / f"tiny-{args.num_layers}l", num_layers=args.num_layers
    )
    common = dict(
        model=str(model),
        pipeline_parallel_size=2,
        kv_cache_memory_bytes=budget,
        max_model_len=args.max_model_len,
        compilation_config=PP_COMPILATION,
    )
    runs = {}
    for name, flag in (("without", False), ("with", True)):
        print(
            f"[kvmem demo] starting a pipeline of 2 ({args.partition}) {name} the "
            "flag ...",
            flush=True,
        )
        runs[name] = _engine(
            {**common, "enable_pp_prop_kv_cache": flag}, args.partition
        )
    table = format_table(runs, budget, args.max_model_len)
    print(table)
    same = runs["without"]["token_ids"] == runs["with"]["token_ids"]
    print(f"greedy output identical with and without the flag: {same}")
    result = {
        "partition": args.partition,
        "kv_cache_memory_bytes": budget,
        "max_model_len": args.max_model_len,
        "runs": runs,
        "identical_output": same,
    }
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    print(f"[kvmem demo] wrote {out / 'demo.json'}")
    return 0
