"""Are vLLM's KV events right? A KV-aware router's index, checked request by
request against what the server reports (issue 43, item 3).

A live OpenAI server (``python -m vllm.entrypoints.openai.api_server`` with
the vllm-kvmem plugin) runs with a device KV cache small enough to evict,
the host tier (``--kv-host-cache-bytes``; ``--no-host-tier`` is the control),
prefix caching on, ``--enable-prompt-tokens-details`` (responses carry
``usage.prompt_tokens_details.cached_tokens``) and vLLM's ZMQ KV event
publisher (``--kv-events-config``) pointed at this process.

This process subscribes to the events, decodes them with vLLM's own
``KVEventBatch`` and keeps the index a router keeps
(``benchmarks/_kv_event_index.py``): the device tier (medium ``GPU``) and the
host tier (medium ``CPU``), keyed by token content. Then it sends a seeded
workload one request at a time, token-id prompts to ``/v1/completions``
(``max_tokens`` 1, temperature 0): a few system prompts, a few hundred
documents of several blocks behind them, revisited with random suffixes, so
that blocks leave the device and later come back from the host. Before each
request it drains the subscriber and predicts the cached prefix: ``d`` full
blocks on the device, then ``h`` on the host from there, at most
``(prompt_tokens - 1) // block_size`` blocks; predicted = ``(d + h) *
block_size``. A mismatch is a request whose reported ``cached_tokens``
differs.

The one timing assumption: vLLM publishes a step's events before it returns
the step's outputs, from a publisher thread, so when a response is in, its
events are on their way. Before each request the drain waits (up to
``--wait-ms``) for a batch published after the previous request was sent,
then reads until the socket stays quiet for ``--quiet-ms``. ``late_batches``
in the JSON counts the batches that broke the assumption (published before
the previous request was sent, received only after its prediction).

Usage::

    python benchmarks/kv_events_check.py [--requests 1000] [--seed 0]
        [--no-host-tier] [--pp 2] [--tp 2] [--python .venv-033/bin/python]
        [--out benchmarks/results/kv_events_check_cpu.json]

Exit code 0 when every prediction matched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from _kv_event_index import KVEventIndex, KVEventSubscriber, Prediction  # noqa: E402
from _model import ModelShape  # noqa: E402
from _report import provenance, write_json  # noqa: E402
from _server import ApiServer, http  # noqa: E402
from tqdm import tqdm  # noqa: E402

#: 2 layers (so PP=2 has a layer per stage), 2 KV heads (TP=2 splits them).
MODEL = ModelShape(
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
)
#: vLLM's CPU build wants multiples of 32; small blocks keep prompts short.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
#: The CPU pipeline recipe (``vllm_kvmem.demo_engine.PP_COMPILATION``).
PP_COMPILATION = {"mode": 2, "backend": "eager"}
DETAILS = 8  # mismatches written out in full
#: Token ids drawn for prompts: above the tokenizer's special ids.
FIRST_TOKEN_ID = 16


# -- workload ------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    doc: int
    kind: str  # "new" or "revisit"
    prompt: list[int]


def build_workload(
    seed: int,
    requests: int,
    docs: int,
    systems: int,
    vocab: int,
    block_size: int = BLOCK_SIZE,
    revisit: float = 0.65,
) -> list[Request]:
    """Seeded prompts ``system + document + suffix``.

    ``systems`` system prompts of 1-3 blocks, each shared by many documents;
    ``docs`` documents of 2-6 blocks plus a partial block; a request opens
    the next unread document or (probability ``revisit``) goes back to a
    random one already read, with a fresh suffix of 0-64 tokens (0 one time
    in ten: the prompt is then a repeat, and often whole blocks, so vLLM's
    cap on the last token is exercised).
    """
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]

    system = [tokens(block_size * rng.randint(1, 3)) for _ in range(systems)]
    body = [
        (
            rng.randrange(systems),
            tokens(block_size * rng.randint(2, 6) + rng.randrange(block_size)),
        )
        for _ in range(docs)
    ]
    out: list[Request] = []
    opened = 0
    for i in range(requests):
        if opened and (opened == docs or rng.random() < revisit):
            doc, kind = rng.randrange(opened), "revisit"
        else:
            doc, kind = opened, "new"
            opened += 1
        suffix = 0 if rng.random() < 0.1 else rng.randint(1, 2 * block_size)
        sys_id, text = body[doc]
        out.append(Request(i, doc, kind, system[sys_id] + text + tokens(suffix)))
    return out


# -- server ----------------------------------------------------------------------


def model_geometry(model: Path) -> dict[str, int]:
    """Vocabulary and KV bytes per token (float32) from ``config.json``."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    return {
        "vocab_size": cfg["vocab_size"],
        "num_layers": cfg["num_hidden_layers"],
        "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4,
    }


def server_env(threads: int) -> dict[str, str]:
    """This process's environment plus the CPU recipe's (as the serving
    benchmark's servers)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PP_LAYER_PARTITION")
    }
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    return env


def server_args(
    args: argparse.Namespace, model: Path, events: dict[str, Any], host_bytes: int
) -> list[str]:
    """The server's command line (after the interpreter)."""
    cmd = [
        "--model", str(model), "--served-model-name", "kvcheck",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(BLOCK_SIZE),
        # Exactly this many device blocks on every rank, whatever the layout
        # (vllm-kvmem's option), so evictions come at the same point.
        "--kv-cache-tokens", str(args.device_blocks * BLOCK_SIZE),
        "--max-num-seqs", "2",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
        "--seed", str(args.seed),
        "--tensor-parallel-size", str(args.tp),
        "--pipeline-parallel-size", str(args.pp),
    ]  # fmt: skip
    if args.pp > 1:
        cmd += ["--compilation-config", json.dumps(PP_COMPILATION)]
    else:
        cmd += ["--enforce-eager"]
    if not args.no_host_tier:
        cmd += ["--kv-host-cache-bytes", str(host_bytes)]
    if args.disk_dir is not None:
        # Room for every block: disk files leave unannounced (no BlockRemoved).
        cmd += ["--kv-disk-cache-path", str(args.disk_dir.resolve())]
        cmd += ["--kv-disk-cache-bytes", "4G"]
    return cmd


def disk_metrics(url: str) -> dict[str, float]:
    """The disk tier's samples on the server's /metrics (summed over label
    sets)."""
    code, text = http(f"{url}/metrics", None, timeout=60)
    if code != 200:
        raise RuntimeError(f"/metrics: {code} {text[:500]}")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvmem_host_disk_"):
            name = line.split("{")[0].split(" ")[0]
            if name.endswith("_created"):
                continue  # the client library's timestamps
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def server_versions(python: str) -> dict[str, str | None]:
    """vLLM's and vllm-kvmem's versions in the server's interpreter (package
    metadata), and the platform vLLM detects there (``device_type``: ``cuda``,
    ``cpu``)."""
    code = (
        "import json\nfrom importlib import metadata\nout = {}\n"
        "for d in ('vllm-cpu', 'vllm', 'vllm-kvmem', 'torch', 'pyzmq', 'msgspec'):\n"
        "    try: out[d] = metadata.version(d)\n"
        "    except metadata.PackageNotFoundError: out[d] = None\n"
        "from vllm.platforms import current_platform\n"
        "out['device_type'] = current_platform.device_type\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "kvcheck", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    code, text = http(f"{url}/v1/completions", json.dumps(body).encode(), timeout=300)
    if code != 200:
        raise RuntimeError(f"/v1/completions: {code} {text[:2000]}")
    return json.loads(text)


# -- the check -------------------------------------------------------------------


def record(req: Request, pred: Prediction, cached: int | None) -> dict[str, Any]:
    return {
        "request": req.index,
        "doc": req.doc,
        "kind": req.kind,
        "prompt_tokens": len(req.prompt),
        "predicted_device_blocks": pred.device_blocks,
        "predicted_host_blocks": pred.host_blocks,
        "predicted_storage_blocks": pred.storage_blocks,
        "predicted_tokens": pred.tokens,
        "reported_cached_tokens": cached,
    }


def summarize(records: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    bad = [r for r in records if r["reported_cached_tokens"] != r["predicted_tokens"]]

    def beyond_device(r: dict[str, Any]) -> bool:
        cached = r["reported_cached_tokens"] or 0
        return cached > r["predicted_device_blocks"] * block_size

    return {
        "requests": len(records),
        "mismatches": len(bad),
        "mismatches_reported_more": sum(
            (r["reported_cached_tokens"] or 0) > r["predicted_tokens"] for r in bad
        ),
        "mismatches_reported_less": sum(
            (r["reported_cached_tokens"] or 0) < r["predicted_tokens"] for r in bad
        ),
        "mismatches_after_late_batches": sum(
            "late_batches_after_prediction" in r for r in bad
        ),
        "predicted_host_hits": sum(r["predicted_host_blocks"] > 0 for r in records),
        "predicted_storage_hits": sum(
            r.get("predicted_storage_blocks", 0) > 0 for r in records
        ),
        "reported_beyond_device_prediction": sum(map(beyond_device, records)),
        "predicted_cached_tokens": sum(r["predicted_tokens"] for r in records),
        "reported_cached_tokens": sum(
            r["reported_cached_tokens"] or 0 for r in records
        ),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "first_mismatches": bad[:DETAILS],
    }


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, send the workload, compare every request."""
    if args.model is not None:
        model = args.model
    else:
        model = MODEL.ensure(args.model_cache)
    geo = model_geometry(model)
    block_bytes = BLOCK_SIZE * geo["kv_bytes_per_token"]
    host_bytes = math.ceil(args.host_blocks * block_bytes / args.tp)
    workload = build_workload(
        args.seed, args.requests, args.docs, args.systems, geo["vocab_size"]
    )
    if max(len(r.prompt) for r in workload) >= MAX_MODEL_LEN:
        raise SystemExit("a prompt is longer than --max-model-len")

    sub = KVEventSubscriber()
    index = KVEventIndex()
    log_path = args.log or ROOT / "out" / f"{args.out.stem}.server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    server = ApiServer(
        server_args(args, model, sub.events_config(), host_bytes),
        log_path,
        env=server_env(args.threads),
        cwd=ROOT,
        name="kv events server",
        python=args.python,
    )
    records: list[dict[str, Any]] = []
    late_batches = 0
    t0 = time.monotonic()
    try:
        with server:
            start_s = server.start_s
            t_requests = time.monotonic()
            sent = 0.0  # when the last request went out (this clock = vLLM's)
            for req in tqdm(workload, desc="kv events", unit="req"):
                stamps = sub.drain(
                    index,
                    args.quiet_ms / 1000,
                    since=sent or None,
                    wait_s=args.wait_ms / 1000,
                )
                # A batch published before the previous request was sent
                # should have been applied before its prediction.
                late = sum(ts < sent for ts in stamps)
                if late:
                    late_batches += late
                    records[-1]["late_batches_after_prediction"] = late
                pred = index.predict(req.prompt, BLOCK_SIZE)
                sent = time.time()
                usage = complete(server.url, req.prompt).get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                rec = record(req, pred, details.get("cached_tokens"))
                if rec["reported_cached_tokens"] != rec["predicted_tokens"]:
                    rec["index_before"] = {
                        "device_blocks": index.summary()["device_blocks_indexed"],
                        "host_blocks": index.summary()["host_blocks_indexed"],
                    }
                records.append(rec)
            requests_s = time.monotonic() - t_requests
            sub.drain(index, args.quiet_ms / 1000)
            metrics = disk_metrics(server.url) if args.disk_dir else None
    finally:
        sub.close()
    return {
        "model": {"path": str(model), **geo},
        "server": {
            "args": server.args,
            "python": server.python,
            "log": str(log_path),
            "start_s": start_s,
            "requests_s": requests_s,
            "wall_s": time.monotonic() - t0,
        },
        "sizes": {
            "block_size": BLOCK_SIZE,
            "device_blocks": args.device_blocks,
            "host_blocks": None if args.no_host_tier else args.host_blocks,
            "host_bytes": None if args.no_host_tier else host_bytes,
            "max_model_len": MAX_MODEL_LEN,
            "disk_dir": str(args.disk_dir) if args.disk_dir else None,
        },
        "disk_metrics": metrics,
        "events": {
            **index.summary(),
            "batches": sub.batches,
            "missed_seqs": sub.missed_seqs,
            "late_batches": late_batches,
            "waits_timed_out": sub.waits_timed_out,
        },
        "summary": summarize(records, BLOCK_SIZE),
        "records": records,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--docs", type=int, default=300, help="documents (default %(default)s)"
    )
    parser.add_argument(
        "--systems", type=int, default=8, help="system prompts (default %(default)s)"
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument(
        "--no-host-tier",
        action="store_true",
        help="the control: no host tier, the device's events must predict "
        "every request",
    )
    parser.add_argument(
        "--device-blocks",
        type=int,
        default=48,
        help=f"device KV blocks of {BLOCK_SIZE} tokens (default %(default)s: "
        "about 5 prompts)",
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=1024,
        help="host tier size in blocks (default %(default)s: under the "
        "documents' ~1,300 blocks, so the host drops blocks too)",
    )
    parser.add_argument(
        "--quiet-ms",
        type=float,
        default=100,
        help="the drain reads events until none came for this long "
        "(default %(default)s ms)",
    )
    parser.add_argument(
        "--wait-ms",
        type=float,
        default=500,
        help="before that, wait up to this long for a batch published after "
        "the last request was sent (default %(default)s ms; a request that "
        "stores and evicts nothing has none, and pays it)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the server's interpreter, e.g. .venv-033/bin/python for vLLM 0.33 "
        "(the events are decoded with this interpreter's vLLM classes)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="serve this model folder (served in float32) instead of building "
        "the 2-layer tiny model",
    )
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=ROOT / "out" / "bench-model",
        help="where the tiny model is built once (default out/bench-model)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="OMP threads of the server (default: all cores but one)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR / "kv_events_check_cpu.json"
    )
    parser.add_argument(
        "--log",
        type=Path,
        default=None,
        help="server log (default: out/<--out's name>.server.log)",
    )
    parser.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="also run the disk tier in this directory (--kv-disk-cache-path): "
        "its STORAGE events join the index, and /metrics' disk samples the JSON",
    )
    args = parser.parse_args(argv)
    if args.disk_dir is not None and args.no_host_tier:
        parser.error("--disk-dir needs the host tier: drop --no-host-tier")
    if args.requests < 1 or args.docs < 1 or args.systems < 1:
        parser.error("--requests, --docs and --systems must be >= 1")
    if args.device_blocks * BLOCK_SIZE < MAX_MODEL_LEN:
        parser.error(f"--device-blocks must hold {MAX_MODEL_LEN} tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run_check(args)
    s = result["summary"]
    versions = server_versions(args.python)
    device = str(versions.pop("device_type"))
    report = {
        "benchmark": "kv_events_check",
        **provenance(
            "kv_events_check.py",
            argv,
            t_begin,
            "shared machine; requests are sequential and nothing here is timed "
            "but the run itself",
        ),
        "platform": {"cuda": "GPU", "cpu": "CPU"}.get(device, device),
        "versions": versions,
        "layout": {"pp": args.pp, "tp": args.tp},
        "host_tier": not args.no_host_tier,
        "seed": args.seed,
        "method": {
            "index": "device tier = BlockStored/BlockRemoved with medium GPU or "
            "None, host tier = medium CPU; keys chain parent key + token ids; "
            "BlockRemoved applied through a block hash -> key map; "
            "AllBlocksCleared clears both tiers; refcounted (vLLM caches "
            "duplicates)",
            "prediction": "d = leading full blocks on the device, h = following "
            "blocks on the host, then (from a block in storage on) s blocks in "
            "storage or more on the host, d + h + s <= (prompt_tokens - 1) // "
            "block_size; predicted cached tokens = (d + h + s) * block_size",
            "timing_assumption": f"before each request the subscriber waits "
            f"up to {args.wait_ms:g} ms for a batch published after the last "
            f"request was sent, then reads until the socket is quiet for "
            f"{args.quiet_ms:g} ms; late_batches counts batches that broke it "
            "(published before the previous request was sent, received after "
            "its prediction)",
        },
        **result,
    }
    write_json(args.out, report)
    ev = result["events"]
    print()
    print(
        f"vLLM {report['versions'].get('vllm') or report['versions'].get('vllm-cpu')}"
        f", PP={args.pp} TP={args.tp}, host tier "
        f"{'on' if report['host_tier'] else 'off (control)'}"
    )
    print(
        f"requests {s['requests']}, mismatches {s['mismatches']} "
        f"(reported more {s['mismatches_reported_more']}, less "
        f"{s['mismatches_reported_less']}), predicted host hits "
        f"{s['predicted_host_hits']}, storage hits {s['predicted_storage_hits']}"
    )
    if result["disk_metrics"] is not None:
        shown = {k: v for k, v in result["disk_metrics"].items() if v}
        print(f"disk tier /metrics (non-zero): {shown}")
    print(
        f"events: {ev['events']}; batches {ev['batches']}, missed seqs "
        f"{ev['missed_seqs']}, late batches {ev['late_batches']}, empty token "
        f"ids {ev['empty_token_events']}"
    )
    for r in s["first_mismatches"][:3]:
        print(f"  mismatch: {json.dumps(r)}")
    print(f"\nJSON: {args.out}")
    return 0 if s["mismatches"] == 0 and s["requests"] == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
