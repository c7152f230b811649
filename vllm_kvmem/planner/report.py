"""``kvmem plan``'s output: the human report and the JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from vllm_kvmem.core.table import render_table
from vllm_kvmem.core.units import flag_size, format_bytes, gib
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.model import NOT_SUPPORTED_NOTE
from vllm_kvmem.planner.partition import Recommendation, as_csv
from vllm_kvmem.planner.plans import Plan
from vllm_kvmem.planner.setup import Setup


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """JSON-ready plan: plain ints and floats, capacities with their stages."""

    def cap(c: km.Capacity | None) -> dict[str, Any] | None:
        if c is None:
            return None
        d = asdict(c)
        d["fits"] = c.fits
        d["total_kv_bytes"] = c.total_kv_bytes
        return d

    out: dict[str, Any] = {
        "model": p.model,
        "setup": asdict(p.setup),
        "kinds": [asdict(k) for k in p.kinds],
        "stages": [asdict(s) for s in p.stages],
        "blocks_per_request": p.blocks_per_request,
        "min_budget_per_gpu": p.min_budget_per_gpu,
        "min_budget_proportional": p.min_budget_proportional,
        "budget": p.budget,
        "without_split": cap(p.without_split),
        "with_split": cap(p.with_split),
        "tokens_capacity": cap(p.tokens_capacity),
        "target": asdict(p.target) if p.target else None,
        "heterogeneous": None,
        "not_supported": NOT_SUPPORTED_NOTE,
        "tiers": [asdict(t) for t in p.tiers],
        "notes": p.notes,
    }
    if p.hetero:
        h = asdict(p.hetero)
        h["command"] = _command(p, p.hetero)
        out["heterogeneous"] = h
    return out


def _command(p: Plan, r: Recommendation) -> str:
    return f"{r.env} vllm serve {p.model['path']} " + " ".join(r.flags)


def _weights_text(m: dict[str, Any]) -> str:
    if not m["weight_bytes"]:
        return m["weights_source"]
    return f"{format_bytes(m['weight_bytes'])} from {m['weights_source']}"


def format_plan(p: Plan) -> str:
    """The human report."""
    s, m = p.setup, p.model
    lines = [
        f"kvmem plan: {m['path']}",
        f"  model: {m['architecture']}, {m['num_layers']} layers, {m['dtype']}, "
        f"weights {_weights_text(m)}",
        f"  KV cache dtype {s.kv_cache_dtype}, block size {s.block_size} tokens, "
        f"TP {s.tp}, PP {s.pp}, max_model_len {s.max_model_len:,}",
        "",
        "KV bytes per token, per layer, on one TP rank:",
    ]
    lines += render_table(
        [
            "kind",
            "layers",
            "heads x (K+V)",
            "window",
            "bytes/token",
            "bytes/block",
            "blocks/request",
        ],
        [
            (
                k.kind,
                k.num_layers,
                f"{k.kv_heads_per_rank} x ({k.head_size}+{k.head_size_v})",
                f"{k.sliding_window:,}" if k.sliding_window else "-",
                f"{k.bytes_per_token:,}",
                f"{k.bytes_per_block:,}",
                f"{k.blocks_per_request:,}",
            )
            for k in p.kinds
        ],
        indent="  ",
    )
    lines.append(f"  {NOT_SUPPORTED_NOTE}")
    lines += [
        "",
        f"Pipeline stages (partition {as_csv(s.partition)}, {s.partition_source}):",
    ]
    lines += render_table(
        ["stage", "layers", "range", "KV bytes/token", "bytes/block", ""],
        [
            (
                st.stage,
                st.num_layers,
                f"{st.start}-{st.end - 1}",
                f"{st.kv_bytes_per_token:,}",
                f"{st.bytes_per_block:,}",
                format_bytes(st.bytes_per_block),
            )
            for st in p.stages
        ],
        indent="  ",
    )
    lines.append(
        f"  a {s.max_model_len:,}-token request takes {p.blocks_per_request:,} blocks "
        f"on every stage; vLLM starts with at least {p.blocks_per_request + 1:,} "
        "(one null block)"
    )
    least = (
        "  least --kv-cache-memory-bytes that starts: "
        f"{flag_size(p.min_budget_per_gpu)} per GPU"
    )
    if s.pp > 1:
        least += (
            f", or {flag_size(p.min_budget_proportional)} pipeline-wide with "
            "--enable-pp-prop-kv-cache"
        )
    lines.append(least)
    if p.without_split and s.pp == 1:
        b = p.budget["bytes"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-memory-bytes {b} ({format_bytes(b)}):"]
        lines += _capacity_lines(
            p.without_split, s, "one stage: --enable-pp-prop-kv-cache changes nothing"
        )
    elif p.without_split and p.with_split:
        b = p.budget["bytes"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-memory-bytes {b} ({format_bytes(b)}):"]
        lines += _capacity_lines(
            p.without_split,
            s,
            "without --enable-pp-prop-kv-cache: every GPU is handed "
            f"{format_bytes(b)}, vLLM cuts every stage to the smallest block count",
        )
        lines += _capacity_lines(
            p.with_split,
            s,
            f"with --enable-pp-prop-kv-cache: {format_bytes(b)} for the whole pipeline "
            "(per TP shard), split by bytes per block",
        )
    if p.tokens_capacity:
        t = p.budget["tokens"] if p.budget else 0
        lines += ["", f"Capacity for --kv-cache-tokens {t:,}:"]
        lines += _capacity_lines(
            p.tokens_capacity,
            s,
            "every stage gets the bytes of exactly those blocks (the same with "
            "and without --enable-pp-prop-kv-cache)",
        )
    if p.target:
        lines += _target_lines(p.target, s)
    if p.hetero:
        lines += _hetero_lines(p, p.hetero)
    if p.tiers:
        lines += ["", "Behind the device KV cache:"]
        lines += render_table(
            ["tier", "flag", "bytes", "bytes/block", "blocks", "tokens", "vs device"],
            [
                (
                    t.tier,
                    t.flag,
                    format_bytes(t.bytes),
                    f"{t.block_bytes:,}",
                    f"{t.blocks:,}",
                    f"{t.tokens:,}",
                    f"{t.vs_device:.1f}x" if t.vs_device else "-",
                )
                for t in p.tiers
            ],
            indent="  ",
        )
        lines += [f"  {t.tier}: {t.scope}" for t in p.tiers]
    for note in p.notes:
        lines += ["", f"note: {note}"]
    return "\n".join(lines)


def _capacity_lines(c: km.Capacity, s: Setup, title: str) -> list[str]:
    lines = [f"  {title}:"]
    lines += render_table(
        [
            "stage",
            "handed",
            "blocks",
            "tokens",
            "concurrency",
            "kept blocks",
            "KV kept",
        ],
        [
            (
                st.stage,
                format_bytes(st.budget_bytes),
                f"{st.handed_blocks:,}",
                f"{st.handed_tokens:,}",
                f"{st.handed_concurrency:.2f}x",
                f"{st.num_blocks:,}",
                format_bytes(st.kv_bytes),
            )
            for st in c.stages
        ],
        indent="    ",
    )
    if c.fits:
        lines.append(
            f"    vLLM logs: KV cache size {c.tokens:,} tokens, maximum concurrency "
            f"{c.concurrency:.2f}x for {s.max_model_len:,} tokens per request; "
            f"usable {c.usable_tokens:,} token slots (null block excluded); KV "
            f"allocated {format_bytes(c.total_kv_bytes)} per TP shard"
        )
    else:
        unit = (
            f"--kv-cache-tokens {c.min_budget}"
            if c.mode == "tokens"
            else f"--kv-cache-memory-bytes {flag_size(c.min_budget)}"
        )
        lines.append(
            f"    does not start: a {s.max_model_len:,}-token request needs "
            f"{c.blocks_per_request + 1:,} blocks per stage with the null block, "
            f"the budget gives {c.num_blocks:,}; use {unit} or more"
        )
    return lines


def _target_lines(t: km.BudgetNeed, s: Setup) -> list[str]:
    lines = [
        "",
        f"Budget for {t.concurrency:g} concurrent {s.max_model_len:,}-token requests "
        f"({t.num_blocks:,} blocks per stage, null block included):",
        f"  {'without the split: ' if s.pp > 1 else ''}--kv-cache-memory-bytes "
        f"{flag_size(t.per_gpu_bytes)} per GPU ({t.per_gpu_bytes} bytes)",
    ]
    if s.pp > 1:
        lines.append(
            f"  with --enable-pp-prop-kv-cache: --kv-cache-memory-bytes "
            f"{flag_size(t.proportional_bytes)} pipeline-wide "
            f"({t.proportional_bytes} bytes)"
        )
    lines.append(
        f"  or --kv-cache-tokens {t.tokens}; KV allocated "
        f"{format_bytes(t.allocated_bytes)} per TP shard"
    )
    return lines


def _even_verdict(p: Plan, r: Recommendation) -> str:
    """The even split's capacity, or why it cannot start."""
    for st in r.even.stages:
        if st.free_bytes < 0:
            return (
                f"does not start: stage {st.stage}'s weights "
                f"({gib(st.weight_bytes)} GiB) plus the reserve exceed its "
                f"{gib(st.device_bytes)} GiB"
            )
    if r.even.num_blocks < km.min_blocks(p.blocks_per_request):
        return (
            f"does not start: {r.even.num_blocks:,} blocks per stage, "
            f"{km.min_blocks(p.blocks_per_request):,} needed for one request"
        )
    return (
        f"{r.even.num_blocks:,} blocks = {r.even_tokens:,} tokens, "
        f"{r.even_concurrency:.2f}x concurrency"
    )


def _hetero_lines(p: Plan, r: Recommendation) -> list[str]:
    devs = ",".join(gib(d) for d in r.device_memory)
    lines = [
        "",
        f"Heterogeneous pipeline: GPUs of {devs} GiB for stages "
        f"0-{p.setup.pp - 1}, {p.setup.tp} per stage; {gib(r.reserve_bytes)} GiB "
        "reserved per GPU for activations and runtime (an assumption, "
        "--reserve-memory); weights per GPU from "
        f"{r.weights_source}:",
    ]
    rows = []
    for label, fit in (("recommended", r.best), ("even (vLLM)", r.even)):
        for st in fit.stages:
            rows.append(
                (
                    f"{label} {as_csv(fit.partition)}" if st.stage == 0 else "",
                    st.stage,
                    st.num_layers,
                    gib(st.device_bytes),
                    gib(st.weight_bytes),
                    gib(st.free_bytes),
                    f"{st.bytes_per_block:,}",
                    f"{st.max_blocks:,}"
                    if st.max_blocks >= 0
                    else "weights do not fit",
                )
            )
    lines += render_table(
        [
            "partition",
            "stage",
            "layers",
            "device GiB",
            "weights GiB",
            "free GiB",
            "bytes/block",
            "blocks",
        ],
        rows,
        indent="  ",
    )
    lines.append(
        f"  recommended {as_csv(r.best.partition)}: {r.best.num_blocks:,} blocks per "
        f"stage = {r.best_tokens:,} tokens, {r.best_concurrency:.2f}x concurrency"
    )
    lines.append(f"  even {as_csv(r.even.partition)}: {_even_verdict(p, r)}")
    lines += [
        "  run with vllm-kvmem:",
        f"    {r.env} vllm serve {p.model['path']} \\",
        "      " + " \\\n      ".join(r.flags),
        "  or without the flag (CUDA): hand every GPU the fattest stage's bytes; "
        "vLLM trims each stage to the same block count before allocating:",
        f"    {r.env} vllm serve {p.model['path']} " + " ".join(r.plain_vllm_flags),
    ]
    return lines
