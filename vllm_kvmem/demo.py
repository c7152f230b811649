"""``kvmem demo``: vllm-kvmem at work on a tiny local model.

1. The seed's A/B experiment: a pipeline of 2 with an uneven split (14/2
   layers, the 7:1 shape of the seed's 56/8 Qwen3-32B run), started once
   without and once with ``--enable-pp-prop-kv-cache`` under the same
   ``--kv-cache-memory-bytes``; a side-by-side table of what each rank really
   allocated.
2. The host KV tier: documents whose working set is 4x the device KV cache,
   read twice, with and without ``--kv-host-cache-bytes``; the second pass's
   cached tokens, time to first token, and whether the output is identical.
3. A real architecture's shape (``kvmem shape-model``, default Qwen2.5-0.5B:
   its published config, no weights) served with ``load_format="dummy"``:
   the offline planner's capacity beside what the engine allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_kvmem.core.stats import percentile
from vllm_kvmem.core.table import BAR, render_table
from vllm_kvmem.core.units import format_bytes
from vllm_kvmem.demo_engine import PP_COMPILATION, run_subprocess


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
    parser.add_argument(
        "--skip-host-tier", action="store_true", help="leave out the host tier A/B"
    )
    parser.add_argument(
        "--shape",
        default="qwen2.5-0.5b",
        help="catalog shape for the real-shape run (kvmem shape-model --list; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--skip-shape", action="store_true", help="leave out the real-shape run"
    )


def _engine(
    llm_kwargs: dict[str, Any],
    partition: str | None = None,
    workload: dict[str, Any] | None = None,
    **extra_env: str,
) -> dict[str, Any]:
    if partition:
        extra_env["VLLM_PP_LAYER_PARTITION"] = partition
    code, log, report = run_subprocess(llm_kwargs, workload, **extra_env)
    if report is None:
        sys.stderr.write(log[-9000:])
        raise RuntimeError(f"engine failed (exit {code}); log above")
    return report


def format_table(runs: dict[str, dict[str, Any]], budget: int, max_len: int) -> str:
    head = (
        f"{'':14}| {'without --enable-pp-prop-kv-cache':^36} | "
        f"{'with --enable-pp-prop-kv-cache':^36}"
    )
    side = ["KV MiB", "blocks", "tokens", "max reqs", BAR]
    base, prop = runs["without"]["ranks"], runs["with"]["ranks"]
    rows = [
        [f"{a['rank']} ({a['layers']})", *_rank_cells(a), *_rank_cells(b)]
        for a, b in zip(base, prop)
    ]
    totals = [_mib(sum(r["kv_bytes"] for r in x)) for x in (base, prop)]
    rows.append(["total", totals[0], "", "", "", totals[1], "", "", ""])
    sub, *body, total = render_table(
        ["rank (layers)", BAR, *side, *side],
        rows,
        widths=[13, 1, 8, 7, 9, 8, 1, 8, 7, 9, 8, 1],
        sep=" ",
    )
    rule = "-" * len(sub)
    title = (
        f"KV budget --kv-cache-memory-bytes {format_bytes(budget, 'MiB', digits=0)}"
        f", max_model_len {max_len:,}"
    )
    legend = (
        "Per rank: KV MiB allocated, KV blocks, tokens they hold, and max reqs: "
        f"how many {max_len:,}-token requests fit at once."
    )
    return "\n".join(
        [title, legend, head, sub, rule, *body, rule, total, _verdict(runs, budget)]
    )


def _verdict(runs: dict[str, dict[str, Any]], budget: int) -> str:
    """What the operator should see in the pipeline table, in one sentence."""
    used = {
        name: sum(r["kv_bytes"] for r in run["ranks"]) for name, run in runs.items()
    }
    blocks = {r["num_blocks"] for r in runs["with"]["ranks"]}
    same = f"the same {blocks.pop():,} blocks" if len(blocks) == 1 else "its blocks"
    budget_mib = format_bytes(budget, "MiB", digits=0)
    return (
        f"Without the flag the budget applies to each stage on its own: the "
        f"pipeline used {_mib(used['without'])} MiB of a {budget_mib} budget. With "
        f"it the stages share {budget_mib} ({_mib(used['with'])} MiB used) in "
        f"proportion to their KV bytes, each holding {same}."
    )


def _rank_cells(r: dict[str, Any]) -> list[str]:
    return [
        _mib(r["kv_bytes"]),
        f"{r['num_blocks']:,}",
        f"{r['tokens']:,}",
        f"{r['concurrency']:.2f}x",
    ]


def _mib(num_bytes: int) -> str:
    return format_bytes(num_bytes, "MiB", label=False)


def run(args: argparse.Namespace) -> int:
    from vllm.utils.argparse_utils import human_readable_int

    from vllm_kvmem.tiny_model import build_tiny_model

    out = Path(args.out)
    budget = human_readable_int(str(args.kv_cache_memory_bytes))
    if not args.skip_shape:
        from vllm_kvmem.shape_model import get_shape

        get_shape(args.shape, "--shape")  # fails before any engine starts
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
    if not args.skip_host_tier:
        result["host_tier"] = host_tier_demo(model, args.num_layers)
    if not args.skip_shape:
        result["real_shape"] = real_shape_demo(out, args.shape)
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    print(f"[kvmem demo] wrote {out / 'demo.json'}")
    return 0


#: The documents' vocabulary; the tests read the same documents.
WORDS = (
    "cache block layer page token memory host device copy stage pipeline "
    "budget window request batch prefix tier spill load hit miss engine"
).split()


def documents(n: int) -> list[str]:
    """~1,000-token documents (8 CPU blocks each), distinct from each other."""
    return [
        " ".join(WORDS[(i * k + k) % len(WORDS)] + str(k % 7) for i in range(400))
        + " question"
        for k in range(1, n + 1)
    ]


def host_tier_demo(model: Path, num_layers: int) -> dict[str, Any]:
    """Same workload with and without the host tier; second-pass TTFT."""
    docs = documents(12)
    # A 128-token CPU block of the default tiny model served in float32: 2 KV
    # heads x 64 x 4 bytes x (K, V) = 128 KiB per layer. float32 because a
    # random model's logits are near ties, which bf16 rounding can flip.
    block_bytes = num_layers * 128 * 1024
    device = 24 * block_bytes  # 24 blocks: the 96-block working set is 4x this
    common = dict(
        model=str(model),
        kv_cache_memory_bytes=device,
        max_model_len=2048,
        enforce_eager=True,
        dtype="float32",
    )
    workload = {"prompts": docs, "max_tokens": 1, "rounds": 2, "sequential": True}
    runs = {}
    for name, host in (("recompute", None), ("host tier", 256 << 20)):
        print(
            f"[kvmem demo] 12 documents read twice, device KV {device >> 20} MiB, "
            f"{name} ...",
            flush=True,
        )
        kwargs = dict(common, kv_host_cache_bytes=host) if host else common
        runs[name] = _engine(
            kwargs, workload=workload, VLLM_ENABLE_V1_MULTIPROCESSING="0"
        )
    print(format_tier_table(runs))
    return runs


def format_tier_table(runs: dict[str, dict[str, Any]]) -> str:
    rows, ttft = [], {}
    for name, r in runs.items():
        cached = sum(r["cached_tokens"][1])
        prompt = sum(r["prompt_tokens"])
        times = r["latency_s"][1]
        ttft[name] = sum(times) / len(times)
        p90 = percentile(times, 90)
        rows.append(
            [
                name,
                f"{cached:,}",
                f"{cached / prompt:.0%}",
                f"{ttft[name] * 1e3:.1f}",
                f"{p90 * 1e3:.1f}",
            ]
        )
    head, *body = render_table(
        ["second pass", BAR, "cached tokens", BAR, "hit rate", BAR, "mean TTFT ms"]
        + [BAR, "p90 TTFT ms"],
        rows,
        widths=[13, 1, 14],
        sep=" ",
    )
    same = runs["recompute"]["token_ids"] == runs["host tier"]["token_ids"]
    return "\n".join(
        [
            "The second pass reads the same documents again: blocks the device "
            "evicted come back from host memory instead of being recomputed.",
            head,
            "-" * 72,
            *body,
            f"TTFT {ttft['recompute'] / ttft['host tier']:.1f}x lower with the host "
            f"tier; greedy output identical: {same}",
        ]
    )


#: The real-shape run: a budget and context that start in seconds on a CPU.
SHAPE_BUDGET = 64 << 20
SHAPE_MAX_LEN = 2048


def real_shape_demo(out: Path, name: str) -> dict[str, Any]:
    """A published architecture's KV geometry with random weights: what the
    planner predicts, offline, beside what the engine allocated."""
    from vllm_kvmem.planner import plan_capacity
    from vllm_kvmem.shape_model import CATALOG, build_shape_model

    model = build_shape_model(name, out / f"shape-{name}")
    print(
        f"[kvmem demo] {name} ({CATALOG[name].source}: published config, no "
        f"weights), load_format=dummy, --kv-cache-memory-bytes "
        f"{SHAPE_BUDGET >> 20} MiB ...",
        flush=True,
    )
    kwargs = dict(
        model=str(model),
        load_format="dummy",
        kv_cache_memory_bytes=SHAPE_BUDGET,
        max_model_len=SHAPE_MAX_LEN,
        enforce_eager=True,
    )
    report = _engine(kwargs, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cap = plan_capacity(
        model,
        budget_bytes=SHAPE_BUDGET,
        max_model_len=SHAPE_MAX_LEN,
        platform="cpu",
    )
    print(format_shape_table(name, report["ranks"][0], cap))
    return {"shape": name, "engine": report["ranks"][0], "planner": asdict(cap)}


def format_shape_table(name: str, rank: dict[str, Any], cap: Any) -> str:
    """Planner and engine side by side: blocks, KV bytes, tokens, concurrency."""
    stage = cap.stages[0]
    planned = [stage.num_blocks, stage.kv_bytes, cap.tokens, cap.concurrency]
    got = [rank["num_blocks"], rank["kv_bytes"], rank["tokens"], rank["concurrency"]]
    rows = [
        [who, f"{b:,}", f"{n:,}", f"{t:,}", f"{c:.2f}x"]
        for who, (b, n, t, c) in (("kvmem plan", planned), ("vLLM engine", got))
    ]
    head, *body = render_table(
        ["", BAR, "blocks", BAR, "KV bytes", BAR, "tokens", BAR, "concurrency"],
        rows,
        widths=[13],
        sep=" ",
    )
    same = planned[:3] == got[:3] and abs(planned[3] - got[3]) < 1e-9
    return "\n".join(
        [
            f"{name}: {rank['layers']} layers, {stage.kv_bytes_per_token:,} KV "
            f"bytes/token, max_model_len {SHAPE_MAX_LEN:,}",
            head,
            "-" * len(head),
            *body,
            f"planner and engine agree: {same}",
        ]
    )
