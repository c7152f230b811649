"""Stall benchmark of the host KV tier, through vLLM's OpenAI server (CPU).

Question: when a request whose prefix comes back from the host tier is
admitted, how long does a request that is already decoding stop producing
tokens? A host hit should cost the stream about one step, not a prefill.

Scenario (one run = one fresh server, one workload):

1. Document D1 (``--d1-tokens``, 2,048 by default) is read (``max_tokens 1``).
2. Document D2 (``--d2-tokens``, 3,072) is read; the device KV cache
   (``--kv-cache-memory-bytes 450M``, 111 blocks of 32 tokens at 128 KiB per
   token) cannot hold both, so most of D1's blocks are handed to D2: evicted
   (and, with the tier, spilled to host memory).
3. Request A streams ``--decode-tokens`` (160) tokens from a short prompt
   (``ignore_eos``, temperature 0). Every chunk's arrival time and token count
   is recorded (``return_token_ids``; a chunk normally holds one token).
4. Once A has produced ``--b-after`` (30) tokens, request B re-reads D1 plus a
   short question (``max_tokens 1``). B's end-to-end latency and its cached
   prompt tokens (``usage.prompt_tokens_details.cached_tokens``, server flag
   ``--enable-prompt-tokens-details``) are recorded: with the tier, the cached
   tokens show that B hit (D1's blocks that stayed on the device plus those
   loaded from host memory); without it, only the device's leftovers.

Prompts are exact token ids (the completions API takes ``prompt`` as a list of
ids), drawn from a fixed generator; documents and the other prompts share no
first block, so only D1 itself can be a prefix hit for B.

Reported per run: A's median inter-token gap (over A's whole decode, first
token excluded; merged tokens of one chunk count as gaps of 0), A's worst gap
that overlaps the window from B's send to B's response (B's admission and
prefill), worst / median, B's latency and cached tokens. Per configuration:
the median and the min-max spread over ``--repeats`` runs.

Configurations: ``none`` (no tier; B recomputes what the device lost) and
``tier`` (``--kv-host-cache-bytes 3G``). They are interleaved (none, tier,
none, tier, ...) so that load from other work on this shared machine hits both
alike.

Why its own client and not vLLM's (``vllm bench serve``): the workload is one
timed interleaving, not a request stream. B is sent when A's stream has
produced its ``--b-after``-th token, and the figures are A's chunk arrivals
with their token counts (``return_token_ids``) and B's and D2's cached prompt
tokens (``usage.prompt_tokens_details``); vLLM's client sends requests by rate
and concurrency, and its request functions keep neither token ids per chunk
nor cached tokens. The server, and the /metrics page read with
prometheus_client's parser, are ``_server.py``'s, shared with
``serving_bench.py``.

Why a fresh server per run and not one server per configuration with
``/reset_prefix_cache``: resetting the device prefix cache does not empty the
host tier, so from the second repeat on D1 and D2 would already be in host
memory, D2's eviction would spill nothing and B would see a different state
than in the first repeat. A fresh server starts every run from the same empty
device cache and empty tier (it costs ~30-60 s of startup per run, not timed).

The server is started with its working directory in a temporary folder, so
``python -m`` does not put this checkout first on ``sys.path``; with
``PYTHONPATH=/other/checkout`` the server then runs that checkout's
vllm_kvmem (the path it imports is recorded in the JSON and printed).

Model: a random-weight Llama from ``vllm_kvmem.tiny_model`` with 32 layers,
8 KV heads of 128, bfloat16: KV is 32 x 2 x 8 x 128 x 2 bytes = 128 KiB per
token, as vLLM stores it on the CPU. The hidden size (256) only sets the
weights' cost; on this 2-core CPU a decode step of this model takes ~25 ms,
mostly per-layer overhead (a hidden size of 128 is no faster), and a 2,048
token prefill ~2.6 s. ``--model-shape fp32-16l`` keeps 128 KiB per token with
16 fp32 layers (~16 ms decode step, ~1.4 s per 2k prefill).

``--max-model-len`` is 3,328, not 8,192: vLLM refuses to start when one
max-length request does not fit the device KV cache, and 450M holds 3,552
tokens of this model. Every prompt here is at most D2's 3,072 tokens.

Usage::

    flock /tmp/kvmem-bench.lock python benchmarks/stall_bench.py \\
        [--quick] [--configs none,tier,device] [--repeats 3] \\
        [--out benchmarks/results/stall_cpu.json]

Prints a table and PASS/FAIL lines for the targets (config ``tier``: A's worst
gap and B's latency each at most 1.25x the ``device`` arm's, a device prefix
hit of the same D1 in the same run; without that arm, the earlier absolute
ones: worst gap <= 3x median gap, B latency <= 100 ms); writes JSON and a PNG
(A's gaps per configuration around B's admission) next to it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Appended, not inserted: a PYTHONPATH checkout must win over this one.
if importlib.util.find_spec("vllm_kvmem") is None:
    sys.path.append(str(ROOT))

from _model import ModelShape  # noqa: E402
from _report import (  # noqa: E402
    finish,
    load_report,
    print_targets,
    provenance,
    versions,
    write_json,
)
from _server import ApiServer, http, parse_metrics  # noqa: E402
from _stall_figures import (  # noqa: E402
    DEVICE_CONFIG,
    aggregate,
    evaluate_targets,
    plot_report,
    print_table,
    summarize_run,
)
from tqdm import tqdm  # noqa: E402

CONFIGS = ("none", "tier")
DEVICE_FLOOR_KV = "2G"
BLOCK_SIZE = 32
DEVICE_KV = "450M"
HOST_KV = "3G"
MAX_NUM_BATCHED_TOKENS = 4096
MAX_MODEL_LEN = 3328
READY_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600
IDLE_BUSY_MAX = 0.25  # other work's share of the CPU that a run waits out
VOCAB_SIZE = 2048
FIRST_ID = 4  # ids 0..3 are the tokenizer's special tokens
BOS_ID = 1


SHAPES = {
    "bf16-32l": ModelShape(32, 256, 8, 8, 128, "bfloat16"),
    "fp32-16l": ModelShape(16, 256, 8, 8, 128, "float32"),
}


# -- workload -------------------------------------------------------------------


def _lcg(seed: int):
    """A fixed generator (not ``random``): the same ids on every Python."""
    state = (seed * 0x9E3779B97F4A7C15 + 0x2545F491) % (1 << 64)
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        yield state >> 33


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids: BOS, then ids from a generator seeded per prompt, so
    prompts with different seeds already differ in their first block."""
    rng = _lcg(seed)
    return [BOS_ID] + [
        FIRST_ID + next(rng) % (VOCAB_SIZE - FIRST_ID) for _ in range(n - 1)
    ]


def build_prompts(args: argparse.Namespace) -> dict[str, list[int]]:
    d1 = token_ids(1, args.d1_tokens)
    question = token_ids(4, args.question_tokens + 1)[1:]  # no BOS mid-prompt
    return {
        "warmup": token_ids(5, 40),
        "d1": d1,
        "d2": token_ids(2, args.d2_tokens),
        "a": token_ids(3, args.a_prompt_tokens),
        "b": d1 + question,
    }


# -- the server -----------------------------------------------------------------


def server_args(config: str, model: Path) -> list[str]:
    args = [
        "--model", str(model), "--served-model-name", "stall",
        "--kv-cache-memory-bytes", DEVICE_KV,
        "--block-size", str(BLOCK_SIZE),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enforce-eager", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    if config == DEVICE_CONFIG:
        args[args.index(DEVICE_KV)] = DEVICE_FLOOR_KV
    if config.startswith("tier"):
        args += ["--kv-host-cache-bytes", HOST_KV]
    name, _, options = config.partition("+")
    if "@" in name:  # tier@SIZE: another per-step copy budget
        args += ["--kv-host-cache-step-bytes", name.split("@", 1)[1]]
    for option in filter(None, options.split("+")):
        if option == "inline":  # tier+inline: copies in the step, no copy thread
            args += ["--kv-host-cache-copy-thread", "off"]
        else:  # tier+drop: another late-spill policy
            args += ["--kv-host-cache-late-spill", option]
    return args


def server_env(threads: int | None = None) -> dict[str, str]:
    """The server's environment; ``threads``: its engine's OpenMP threads
    (None: vLLM's default, every CPU)."""
    from vllm_kvmem.demo_engine import engine_env

    extra = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    return engine_env(
        VLLM_LOGGING_LEVEL=os.environ.get("STALL_BENCH_LOG_LEVEL", "INFO"),
        VLLM_SERVER_DEV_MODE="1",
        **extra,
    )


def kvmem_path(cwd: Path) -> str:
    """Where the server's interpreter (same env and cwd) imports vllm_kvmem."""
    out = subprocess.run(
        [sys.executable, "-c", "import vllm_kvmem; print(vllm_kvmem.__file__)"],
        cwd=cwd,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout.strip() or out.stderr.strip()[-500:]


# -- one run --------------------------------------------------------------------


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion request of exactly ``max_tokens`` tokens."""
    return {
        "model": "stall",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A non-streaming completion; latency and usage."""
    import requests

    body = _body(prompt, max_tokens)
    t0 = time.perf_counter()
    r = requests.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    t1 = time.perf_counter()
    r.raise_for_status()
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "t_send": t0,
        "t_end": t1,
        "latency_s": t1 - t0,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": details.get("cached_tokens"),
    }


def _stream(
    url: str,
    prompt: list[int],
    max_tokens: int,
    chunks: list[tuple[float, int]],
    progress: threading.Event,
    b_after: int,
    out: dict[str, Any],
) -> None:
    """Stream A; append (arrival time, tokens in chunk) per chunk. Sets
    ``progress`` once ``b_after`` tokens have arrived."""
    import requests

    body = _body(
        prompt,
        max_tokens,
        stream=True,
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    n = 0
    try:
        out["t_send"] = time.perf_counter()
        with requests.post(
            f"{url}/v1/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                t = time.perf_counter()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    out["usage"] = msg["usage"]
                for choice in msg.get("choices") or []:
                    k = len(choice.get("token_ids") or [])
                    if k:
                        chunks.append((t, k))
                        n += k
                if n >= b_after:
                    progress.set()
        out["t_end"] = time.perf_counter()
    except BaseException as e:  # reported by the caller
        out["error"] = repr(e)
    finally:
        progress.set()


def _kvmem_metrics(url: str) -> dict[str, float]:
    """The server's ``vllm:kvmem_*`` counters and gauges."""
    text = http(f"{url}/metrics", timeout=30)[1]
    return {k: v for k, v in parse_metrics(text).items() if k.startswith("vllm:kvmem_")}


def cpu_busy(interval_s: float = 2.0) -> float:
    """Fraction of all cores busy over ``interval_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals), idle

    t0, i0 = sample()
    time.sleep(interval_s)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except OSError:
            pass
    return total


class OtherWork:
    """CPU used by processes outside this benchmark and its server while the
    workload runs, as a share of all cores (0: the machine was ours)."""

    def __init__(self, server_pid: int) -> None:
        self.pids = sorted(set(_tree(server_pid)) | {os.getpid()})
        self.t0 = time.perf_counter()
        self.busy0, self.ours0 = _busy_ticks(), _cpu_ticks(self.pids)

    def share(self) -> float:
        wall = time.perf_counter() - self.t0
        other = (_busy_ticks() - self.busy0) - (_cpu_ticks(self.pids) - self.ours0)
        ticks = wall * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
        return max(0.0, other / ticks) if ticks else 0.0


def wait_idle(max_wait_s: float, busy_max: float = IDLE_BUSY_MAX) -> dict[str, Any]:
    """Before a run (none of ours is running then): wait up to ``max_wait_s``
    until other work uses under ``busy_max`` of the CPU, so a run does not
    start in the middle of someone else's job."""
    t0 = time.perf_counter()
    busy = cpu_busy()
    while busy > busy_max and time.perf_counter() - t0 < max_wait_s:
        time.sleep(3)  # polling the machine's load, bounded by max_wait_s
        busy = cpu_busy()
    return {"cpu_busy_before": busy, "idle_wait_s": time.perf_counter() - t0}


def run_workload(url: str, prompts: dict[str, list[int]], args) -> dict[str, Any]:
    """Warm-up, D1, D2, then A streaming with B sent once A has ``b_after``
    tokens. Times are seconds relative to A's send."""
    warm = _complete(url, prompts["warmup"], 8)
    d1 = _complete(url, prompts["d1"], 1)
    d2 = _complete(url, prompts["d2"], 1)
    chunks: list[tuple[float, int]] = []
    progress = threading.Event()
    a: dict[str, Any] = {}
    thread = threading.Thread(
        target=_stream,
        args=(url, prompts["a"], args.decode_tokens, chunks, progress, args.b_after, a),
        daemon=True,
    )
    thread.start()
    progress.wait(REQUEST_TIMEOUT_S)
    a_tokens_before_b = sum(k for _, k in chunks)
    b = _complete(url, prompts["b"], 1)
    thread.join(REQUEST_TIMEOUT_S)
    if "error" in a or thread.is_alive():
        raise RuntimeError(f"request A failed: {a.get('error', 'timed out')}")
    t0 = a["t_send"]
    for rec in (warm, d1, d2, b):
        rec["t_send"] -= t0
        rec["t_end"] -= t0
    return {
        "warmup": warm,
        "d1": d1,
        "d2": d2,
        "a": {
            "chunks": [[t - t0, k] for t, k in chunks],
            "t_end": a["t_end"] - t0,
            "tokens": sum(k for _, k in chunks),
            "usage": a.get("usage"),
        },
        "b": {**b, "a_tokens_before_send": a_tokens_before_b},
    }


def run_one(config: str, model: Path, workdir: Path, n: int, prompts, args):
    log = workdir / f"server-{n}-{config}.log"
    server = ApiServer(
        server_args(config, model),
        log,
        env=server_env(args.threads),
        cwd=workdir,
        ready_timeout_s=READY_TIMEOUT_S,
    )
    run: dict[str, Any] = {"config": config, **wait_idle(args.idle_wait)}
    run["loadavg_before"] = os.getloadavg()
    try:
        run["server_start_s"] = server.start()
        other = OtherWork(server.proc.pid)
        run["result"] = run_workload(server.url, prompts, args)
        run["other_cpu_share"] = other.share()
        run["kvmem_metrics"] = _kvmem_metrics(server.url)
        text = server.log_text()
        run["host_tier_log"] = [
            line.split("] ", 1)[-1]
            for line in text.splitlines()
            if "Host KV tier" in line
        ]
        run["ok"] = True
    except Exception as e:
        run["ok"] = False
        run["error"] = repr(e)
        run["error_log_tail"] = server.log_text()[-4000:]
    finally:
        server.stop()
    run["loadavg_after"] = os.getloadavg()
    return run


# -- the benchmark ----------------------------------------------------------------


def _configs(s: str) -> list[str]:
    from vllm_kvmem.config import parse_size

    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = []
    for n in names:
        name, _, options = n.partition("+")
        base, _, size = name.partition("@")
        parts = options.split("+") if options else []
        try:
            ok = (n in (*CONFIGS, DEVICE_CONFIG)) or (
                base == "tier"
                and (not size or parse_size(size) > 0)
                and all(p in ("copy", "drop", "inline") for p in parts)
                and len(set(parts)) == len(parts)
            )
        except ValueError:
            ok = False
        if not ok:
            bad.append(n)
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {bad}; use a subset of {','.join(CONFIGS)}, "
            f"{DEVICE_CONFIG} (no tier, D1 kept on the device: the floor), "
            "or tier@SIZE for the tier with --kv-host-cache-step-bytes SIZE "
            "(e.g. tier@128M), tier+drop for --kv-host-cache-late-spill drop, "
            "tier+inline for --kv-host-cache-copy-thread off"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 repeat, 48-token decode, B after 10 tokens",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / "stall_cpu.json",
        help="JSON path (default benchmarks/results/stall_cpu.json); the PNG "
        "goes next to it",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw the PNG of an earlier JSON (next to it), run nothing",
    )
    parser.add_argument(
        "--configs",
        type=_configs,
        default=[*CONFIGS, DEVICE_CONFIG],
        help="comma-separated, interleaved (default: none,tier,device); "
        "device: no tier and a device cache that keeps D1 (B is a device prefix "
        "hit: the ceiling a host hit can approach, and the tier's goals are "
        "relative to it); "
        "tier@SIZE adds the tier with --kv-host-cache-step-bytes SIZE, "
        "tier+drop with --kv-host-cache-late-spill drop (both: tier@SIZE+drop)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per config (default 3)"
    )
    parser.add_argument("--d1-tokens", type=int, default=2048)
    parser.add_argument("--d2-tokens", type=int, default=3072)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--a-prompt-tokens", type=int, default=24)
    parser.add_argument(
        "--decode-tokens", type=int, default=None, help="A's tokens (default 160)"
    )
    parser.add_argument(
        "--b-after",
        type=int,
        default=None,
        help="send B once A has this many tokens (default 30)",
    )
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=300,
        help="before each run, wait up to this many seconds for other work to "
        f"use under {IDLE_BUSY_MAX * 100:.0f}%% of the CPU "
        "(0: do not wait; default 300)",
    )
    parser.add_argument(
        "--busy-max",
        type=float,
        default=IDLE_BUSY_MAX,
        help="other work's CPU share during a run above which the run is run "
        f"again (default {IDLE_BUSY_MAX})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OpenMP threads of each server's engine (default: vLLM's, every "
        "CPU); with fewer than the CPUs, the host tier's copy thread runs on "
        "a CPU of its own (--kv-host-cache-copy-thread auto)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="reruns of a run that other work disturbed (default 2)",
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(SHAPES),
        default="bf16-32l",
        help="bf16-32l: 32 bfloat16 layers (default); fp32-16l: 16 float32 "
        "layers; both 128 KiB of KV per token",
    )
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=Path.home() / ".cache" / "vllm-kvmem" / "stall-bench",
        help="where the random-weight model is built once",
    )
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.decode_tokens = args.decode_tokens or (48 if args.quick else 160)
    args.b_after = args.b_after or (10 if args.quick else 30)
    if args.b_after >= args.decode_tokens:
        parser.error("--b-after must be below --decode-tokens")
    longest = max(args.d1_tokens + args.question_tokens, args.d2_tokens)
    if longest + 1 > MAX_MODEL_LEN:
        parser.error(f"prompts up to {longest} tokens exceed {MAX_MODEL_LEN}")
    return args


def build_report(
    args: argparse.Namespace,
    argv: list[str] | None,
    model: Path,
    plan: list[tuple[int, str]],
    runs: list[dict[str, Any]],
    discarded: list[dict[str, Any]],
    server_kvmem: str,
    t_begin: float,
    complete: bool,
) -> dict[str, Any]:
    """The JSON report (written after every run, ``complete`` at the end)."""
    shape = SHAPES[args.model_shape]
    agg = aggregate(runs)
    full_prefix = args.d1_tokens // BLOCK_SIZE * BLOCK_SIZE
    targets = evaluate_targets(agg, full_prefix)
    report = {
        "benchmark": "host_tier_stall",
        "complete": complete,
        **provenance(
            "stall_bench.py",
            argv,
            t_begin,
            "CPU only; shared machine: cpu_busy_before (other work's "
            "share of the CPU after idle_wait_s) and loadavg_before/after per "
            "run show how busy it was",
        ),
        "platform": "CPU",
        "versions": versions(),
        "server_vllm_kvmem": server_kvmem,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "model": {
            "path": str(model),
            "shape": args.model_shape,
            "engine_threads": args.threads,
            **asdict(shape),
            "kv_bytes_per_token": shape.kv_bytes_per_token(),
        },
        "server": {
            "args_none": [
                *("--host", "127.0.0.1", "--port", "0"),
                *server_args("none", model),
            ],
            "args_tier_extra": ["--kv-host-cache-bytes", HOST_KV],
            "note": "--port 0 stands for a free port picked per run; one fresh "
            "server per run",
        },
        "workload": {
            "d1_tokens": args.d1_tokens,
            "d2_tokens": args.d2_tokens,
            "question_tokens": args.question_tokens,
            "a_prompt_tokens": args.a_prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "b_after": args.b_after,
            "b_max_tokens": 1,
            "repeats": args.repeats,
            "configs": args.configs,
            "quick": args.quick,
            "order": [f"{c}#{r}" for r, c in plan],
            "d1_full_block_tokens": full_prefix,
        },
        "method": {
            "gaps": "client-side arrival times of A's streamed chunks "
            "(return_token_ids gives the tokens per chunk; k tokens in one "
            "chunk count as one gap and k-1 gaps of 0); first token excluded",
            "median_gap": "median of all of A's gaps",
            "worst_gap": "longest gap of A that overlaps [B sent, B response]",
            "b_latency": "wall time of B's non-streaming completion request",
            "b_cached_tokens": "usage.prompt_tokens_details.cached_tokens",
            "aggregate": "median and min-max over repeats",
            "other_cpu_share": "CPU time of processes outside the benchmark "
            "and its server during the workload (from /proc), as a share of "
            "all cores; a run above --busy-max is run again (up to --retries "
            "times; the disturbed runs are kept under discarded_runs) and "
            "marked contended if the last try is still above it",
        },
        "summary": agg,
        "targets": targets,
        "runs": runs,
        "discarded_runs": discarded,
    }
    return report


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds, so the running server is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        png = args.replot.with_suffix(".png")
        plot_report(load_report(args.replot), png)
        print(f"PNG:  {png}")
        return 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.model_shape]
    model = shape.ensure(args.model_cache)
    prompts = build_prompts(args)
    plan = [(rep, c) for rep in range(args.repeats) for c in args.configs]

    runs: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []  # runs that other work disturbed
    t_begin = time.time()
    with tempfile.TemporaryDirectory(prefix="stall_bench.") as tmp:
        workdir = Path(tmp)
        server_kvmem = kvmem_path(workdir)
        print(f"server imports vllm_kvmem from {server_kvmem}", flush=True)
        with tqdm(total=len(plan), desc="stall", unit="run") as bar:
            for n, (rep, config) in enumerate(plan):
                bar.set_postfix_str(f"{config} #{rep}")
                for attempt in range(args.retries + 1):
                    run = run_one(config, model, workdir, n, prompts, args)
                    run["repeat"], run["attempt"] = rep, attempt
                    share = run.get("other_cpu_share", 0.0)
                    if share <= args.busy_max or attempt == args.retries:
                        run["contended"] = share > args.busy_max
                        break
                    tqdm.write(
                        f"run {config} #{rep}: other work used {share:.0%} of "
                        "the CPU during the workload; running it again"
                    )
                    discarded.append(run)
                run["summary"] = summarize_run(run["result"]) if run["ok"] else None
                if not run["ok"]:
                    tqdm.write(
                        f"run {config} #{rep} failed: {run['error']}\n"
                        + run["error_log_tail"][-3000:],
                        file=sys.stderr,
                    )
                runs.append(run)
                partial = build_report(
                    args, argv, model, plan, runs, discarded, server_kvmem,
                    t_begin, False,
                )  # fmt: skip
                out.write_text(json.dumps(partial, indent=1) + "\n")
                bar.update(1)

    report = build_report(
        args, argv, model, plan, runs, discarded, server_kvmem, t_begin, True
    )
    agg, targets = report["summary"], report["targets"]
    png = write_json(out, report)
    if agg:
        plot_report(report, png)
    print_table(agg, runs)
    print_targets(targets)
    failed = [r for r in runs if not r["ok"]]
    return finish(out, png, len(failed), "error_log_tail")


if __name__ == "__main__":
    sys.exit(main())
