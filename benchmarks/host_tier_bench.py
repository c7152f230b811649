"""End-to-end benchmark of the host KV tier on a real vLLM engine (CPU).

Workload: document Q&A, the shape of traffic a user recognises. Every prompt
is one document (``--doc-tokens`` tokens, 2,048 by default, distinct content
per document from a deterministic word generator) followed by a short
question. Requests are issued one at a time, so TTFT is not blurred by
queueing or batching. The device KV cache holds about 1.5 prompts; the
documents a run touches are >= 4x that, so a document that comes back has
been evicted from the device and is either recomputed or brought back by a
connector.

Reuse sweep: with reuse ``r`` a fraction ``r`` of the measured requests (spread
evenly) ask a new question about the least recently used document already
seen, the others open a new document. Runs with ``r > 0`` first read a pool of
``--docs`` documents (the seed phase, not timed into the results) so that the
least recently used document is always long gone from the device. At ``r = 0``
every request is a new document: the tier can only cost, never help.

Configurations, each in its own process with a fresh engine and the same
prompts, interleaved per reuse level so that noise from other work on the
machine hits them alike:

* ``none``: no connector; evicted prefixes are recomputed.
* ``host``: vllm-kvmem's host tier (``kv_host_cache_bytes`` sized to hold the
  whole working set, LRU).
* ``example``: upstream's ``ExampleConnector`` (the upstream connector that
  runs on the CPU platform): it writes the KV of every new prompt to
  safetensors files, one per layer, and on a later prompt whose block-aligned
  prefix (all but the last partial block) matches a stored prompt, loads it
  back token by token. Revisits here hit it, because a short question falls in
  the last partial block.
* ``device``: no connector and a device KV cache that holds every document,
  so a revisit is a device prefix hit: the ceiling a host hit can approach
  (run at reuse levels above 0 only).
* ``disk``: the host tier at ``--disk-host-prompts`` prompts (1 by default,
  so revisited documents have left host memory too) with the disk tier
  behind it (``--kv-disk-cache-path`` in a fresh directory under
  ``--disk-dir``). Before each measured revisit the benchmark waits for the
  tier's writes, then drops the block files from the page cache, so a disk
  hit's TTFT is the disk's and not RAM's.
* ``disk_restart``: the same, but the seed phase runs in one engine (which
  then reads a few documents nobody revisits, so the seeds go from host
  memory to disk, and stops, waiting for its writes) and the measured phase
  in a new engine on the same directory, page cache dropped: a disk hit
  after a restart (reuse levels above 0 only).
* ``host_small``: the host tier of the ``disk`` arm's size without a disk
  tier (0% reuse only): the baseline of "throughput with the disk tier
  configured against without it".

The vllm-kvmem plugin is loaded in every run (it is a no-op without the
option). Each run starts vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so the benchmark can read the scheduler's connector counters), fp32 weights
and KV (``bfloat16`` matmuls run ~60x slower than fp32 on CPUs without
AVX512-BF16, such as this one), ``enforce_eager``.

How time is measured (in the run's process, around vLLM's own step loop):

* TTFT: from ``LLMEngine.add_request`` (token ids, so no tokenisation) to the
  ``step()`` that returns the request's first token. This is what a client in
  the same process would see: scheduling, connector lookups and copies,
  prefill and the first sampled token. vLLM's ``RequestOutput.metrics`` is only
  filled with stat logging on and measures the same interval from arrival.
* Throughput: requests and prompt tokens per second of wall time over the
  measured phase (the seed phase excluded), each request decoding
  ``--max-tokens`` tokens (``ignore_eos``).
* At 0% reuse each configuration runs ``--zero-repeats`` times and the fastest
  run counts (other work on the machine can only slow a run down); every run
  is in the JSON.

Why not vLLM's benchmark client: this times the engine in-process, one
request at a time around vLLM's own step loop, and reads per request the
cached tokens and the host tier's hit counters from the scheduler's
connector. ``vllm bench serve`` measures through the HTTP server (its TTFT adds
the API server and detokenisation) and reports neither per request; ``vllm
bench latency`` times whole batches (no TTFT) and ``vllm bench throughput``
only totals. Nor do vLLM's datasets draw this schedule (an untimed seed phase,
then revisits to the least recently used document).

Engines start from multiprocessing's forkserver, which has imported vLLM once
(vLLM's import alone takes 10-20 s here); every run is a new process with a
new engine. ``--no-fork`` spawns a fresh interpreter per run instead.

Usage::

    python benchmarks/host_tier_bench.py [--quick] [--reuse 0,0.25,0.5,0.75,1]
        [--configs none,host,example,device,host_small,disk,disk_restart]
        [--docs N] [--requests N] [--disk-dir DIR]
        [--out benchmarks/results/host_tier_cpu.json]

Prints a table and PASS/FAIL lines for the issue's targets; writes JSON and a
PNG plot next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from _host_tier_figures import (  # noqa: E402
    BLOCK_SIZE,
    CONFIGS,
    DISK_CONFIGS,
    evaluate_targets,
    hit_vs_recompute,
    outputs_identical,
    paired_ratios,
    pick_runs,
    plot_report,
    print_hits,
    print_table,
    summarize_run,
)
from _host_tier_workload import (  # noqa: E402
    PromptBuilder,
    build_schedule,
)
from _model import ModelShape, PublishedShape  # noqa: E402
from _page_cache import drop_tree, filesystem_of  # noqa: E402
from _report import finish, print_targets, provenance, versions, write_json  # noqa: E402
from tqdm import tqdm  # noqa: E402

REUSE_LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
RUN_TIMEOUT_S = 900
#: Documents the disk_restart arm's first engine reads after its seeds, so
#: that the seeds leave host memory for disk before it stops.
FILLER_DOC = 2_000_000
#: What the forkserver imports once, before it forks the runs.
FORKSERVER_PRELOAD = ["torch", "vllm", "vllm.entrypoints.llm", "vllm_kvmem"]


# 2k-token prefill of ~1-2.5 s on 2 busy cores in fp32 (measured: 8 layers of
# 768 took ~3 s, so a 15-run sweep would not fit in 10 minutes).
FULL_MODEL = ModelShape(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4)
QUICK_MODEL = ModelShape(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)


# -- one run (in its own process) ----------------------------------------------


def _connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine (or None)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _worker_disk(tier: Any) -> Any:
    """The disk tier of the in-process worker (TP=1), or None."""
    if tier is None or getattr(tier, "disk", None) is None:
        return None
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return getattr(get_kv_transfer_group().connector_worker, "_disk", None)


def _disk_reads(disk: Any) -> int:
    return disk.store.stats().hits if disk is not None else 0


def _host_counters(tier: Any) -> dict[str, int] | None:
    index = getattr(tier, "index", None)
    return asdict(index.counters) if index is not None else None


def run_config(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, serve the schedule one request at a time, report."""
    from vllm_kvmem.plugin import register

    register()  # the LLM kwargs of vllm-kvmem (a no-op without them)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Before the engine starts: vLLM's CPU worker forbids it afterwards.
    torch.set_num_threads(spec["threads"])
    t_start = time.perf_counter()
    llm = LLM(**spec["llm_kwargs"])
    start_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    connector = _connector(llm)
    tier = getattr(connector, "connector_scheduler", None)  # the host tier's
    disk = _worker_disk(tier)
    disk_dir = spec["llm_kwargs"].get("kv_disk_cache_path")
    builder = PromptBuilder(Path(spec["llm_kwargs"]["model"]), spec["doc_tokens"])
    prompts = [builder.prompt(op["doc"], op["question"]) for op in spec["schedule"]]
    params = SamplingParams(
        max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True
    )

    records = []
    phase_start: float | None = None
    for i, (op, ids) in enumerate(zip(spec["schedule"], prompts)):
        if op["kind"] in ("new", "revisit") and phase_start is None:
            phase_start = time.perf_counter()
        dropped = None
        if spec.get("drop_page_cache") and op["kind"] == "revisit":
            # Untimed: the tier's queued writes land (a server would not
            # wait, but a dirty page cannot be dropped), then the files
            # leave the page cache.
            if disk is not None:
                assert disk.store.flush(timeout=120), "disk tier writes stuck"
            dropped = drop_tree(disk_dir)
        before = _host_counters(tier)
        reads_before = _disk_reads(disk)
        first = final = None
        t0 = time.perf_counter()
        engine.add_request(f"req-{i}", TokensPrompt(prompt_token_ids=ids), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    final = out
        t_end = time.perf_counter()
        assert final is not None and first is not None
        after = _host_counters(tier)
        rec = {
            **op,
            "prompt_tokens": len(ids),
            "ttft_s": first - t0,
            "latency_s": t_end - t0,
            "cached_tokens": final.num_cached_tokens or 0,
            "token_ids": list(final.outputs[0].token_ids),
        }
        if disk is not None:
            rec["disk_read_blocks"] = _disk_reads(disk) - reads_before
            rec["page_cache_dropped_files"] = dropped
        if before is not None and after is not None:
            rec["host_hit_blocks"] = after["hit_blocks"] - before["hit_blocks"]
            rec["host_lookup_blocks"] = after["lookup_blocks"] - before["lookup_blocks"]
        records.append(rec)
    phase_s = time.perf_counter() - phase_start if phase_start is not None else 0.0

    result: dict[str, Any] = {
        "engine_start_s": start_s,
        "measured_wall_s": phase_s,
        "num_device_blocks": scheduler.kv_cache_config.num_blocks,
        "block_size": scheduler.kv_cache_config.kv_cache_groups[
            0
        ].kv_cache_spec.block_size,
        "connector": type(connector).__name__ if connector is not None else None,
        "torch_threads": torch.get_num_threads(),
        "requests": records,
    }
    if _host_counters(tier) is not None:
        result["host_counters"] = _host_counters(tier)
        result["host_bytes_in_use"] = tier.host_bytes_in_use()
        result["host_num_slots"] = tier.num_slots
    if disk is not None:
        if spec.get("drain_disk"):  # the next engine reads what this one wrote
            assert disk.store.flush(timeout=300), "disk tier writes stuck"
        stats = disk.store.stats()
        result["disk_counters"] = stats.as_metrics()
        result["disk_bytes_in_use"] = tier.disk.bytes_in_use()
    storage = spec.get("example_storage")
    if storage:
        files = [p for p in Path(storage).rglob("*") if p.is_file()]
        result["example_storage_bytes"] = sum(p.stat().st_size for p in files)
        result["example_storage_files"] = len(files)
    return result


def _run_and_write(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_config(spec)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        return 1
    Path(spec["result_path"]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _child(spec_path: str) -> None:
    """One run, in a new process (forked from the forkserver, or spawned): its
    output goes to the run's log, and a hung run dies instead of the sweep."""
    spec = json.loads(Path(spec_path).read_text())
    signal.alarm(RUN_TIMEOUT_S)
    os.chdir(ROOT)
    run_log = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(run_log, 1)
    os.dup2(run_log, 2)
    sys.exit(_run_and_write(spec_path))


def engine_env() -> dict[str, str]:
    from vllm_kvmem.demo_engine import engine_env as base

    return base(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_LOGGING_LEVEL=os.environ.get("HOST_TIER_BENCH_LOG_LEVEL", "WARNING"),
    )


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside the block, and as it was after it (the
    bench also runs inside the test process, which must not see the engine's
    settings)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Runner:
    """Starts every run in a new process with a new engine. By default from
    multiprocessing's forkserver, which imports vLLM once (vLLM's import alone
    takes 10-20 s here) and forks each run from there; ``fork=False`` spawns a
    fresh interpreter per run."""

    def __init__(self, workdir: Path, fork: bool) -> None:
        import multiprocessing

        fork = fork and "forkserver" in multiprocessing.get_all_start_methods()
        self.ctx = multiprocessing.get_context("forkserver" if fork else "spawn")
        if fork:
            self.ctx.set_forkserver_preload(FORKSERVER_PRELOAD)

    def run(self, spec: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str]:
        spec_path = Path(spec["log_path"]).with_suffix(".spec.json")
        spec_path.write_text(json.dumps(spec))
        proc = self.ctx.Process(target=_child, args=(str(spec_path),))
        with _environment(engine_env()):  # what the forkserver and runs inherit
            proc.start()
        proc.join(RUN_TIMEOUT_S + 60)  # the run's own alarm fires first
        if proc.is_alive():
            proc.kill()
            proc.join()
        rc = proc.exitcode if proc.exitcode is not None else 124
        result_path = Path(spec["result_path"])
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        log_text = Path(spec["log_path"]).read_text(errors="replace")
        return rc, result, log_text

    def close(self) -> None:
        """Nothing to release: multiprocessing stops its forkserver at exit."""


# -- the benchmark ------------------------------------------------------------------


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _configs(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {bad}; use a subset of {','.join(CONFIGS)}"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / "host_tier_cpu.json",
        help="JSON path (default benchmarks/results/host_tier_cpu.json); the PNG "
        "goes next to it",
    )
    parser.add_argument(
        "--configs",
        type=_configs,
        default=["none", "host", "example", "device"],
        help="comma-separated subset of none,host,example,device,host_small,disk,"
        "disk_restart (default: none,host,example,device)",
    )
    parser.add_argument(
        "--reuse",
        type=_floats,
        default=None,
        help="comma-separated reuse fractions (default 0,0.25,0.5,0.75,1; "
        "--quick: 0,1)",
    )
    parser.add_argument(
        "--docs",
        type=int,
        default=None,
        help="documents read before the measured phase when reuse > 0, i.e. the "
        "working set at 100%% reuse (default: the fewest that make it >= 4x the "
        "device KV cache)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="measured requests per run"
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=None, help="document (prefix) length"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="tokens decoded per answer"
    )
    parser.add_argument(
        "--device-prompts",
        type=float,
        default=1.5,
        help="device KV cache size, in prompts (default 1.5)",
    )
    parser.add_argument(
        "--zero-repeats",
        type=int,
        default=None,
        help="runs per configuration at 0%% reuse, fastest counts "
        "(default 3; --quick: 1)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration at each reuse level above 0%% (default 1), "
        "interleaved none, host, none, host...",
    )
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=ROOT / "out" / "bench-model",
        help="where the random-weight model is built once (default out/bench-model)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch threads per engine (default: all cores but one). An OpenMP "
        "team that loses a core to another process stalls at every barrier: "
        "with tests running beside it, 2 threads on this 2-core machine took "
        "170-380 ms for a prefill that 1 thread does in 50 ms",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw the PNG and reprint the table of an earlier JSON, run nothing",
    )
    parser.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="where the disk arms' directories go, one per run, removed after "
        "(default: a temporary directory under /var/tmp); the filesystem it "
        "sits on is recorded",
    )
    parser.add_argument(
        "--disk-host-prompts",
        type=float,
        default=1.0,
        help="host tier size of the disk and host_small arms, in prompts "
        "(default 1: a revisited document has left host memory)",
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument(
        "--shape",
        default=None,
        help="a published shape (kvmem shape-model NAME, e.g. qwen2.5-0.5b) "
        "served with load_format=dummy, instead of the random-weight tiny model",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="with --shape: weight and KV dtype (default %(default)s)",
    )
    parser.add_argument(
        "--no-fork",
        action="store_true",
        help="start every run in a new interpreter instead of forking one that "
        "has imported vLLM (slower: vLLM's import is paid per run)",
    )
    args = parser.parse_args(argv)
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    if args.layers or args.hidden_size:
        hidden = args.hidden_size or shape.hidden_size
        shape = ModelShape(
            num_layers=args.layers or shape.num_layers,
            hidden_size=hidden,
            num_heads=hidden // shape.head_dim,
            num_kv_heads=max(1, hidden // shape.head_dim // 2),
        )
    if args.shape:
        shape = PublishedShape(args.shape, args.dtype, args.layers)
    args.shape = shape
    args.reuse = args.reuse or ([0.0, 1.0] if args.quick else list(REUSE_LEVELS))
    args.requests = args.requests or (8 if args.quick else 12)
    args.doc_tokens = args.doc_tokens or (512 if args.quick else 2048)
    args.zero_repeats = args.zero_repeats or (1 if args.quick else 3)
    if any(not 0 <= r <= 1 for r in args.reuse):
        parser.error("--reuse values must lie in [0, 1]")
    if args.disk_host_prompts <= 0:
        parser.error(
            f"--disk-host-prompts={args.disk_host_prompts:g}: the disk arms need a "
            "host tier of at least part of a prompt, e.g. 1"
        )
    if args.doc_tokens < 2 * BLOCK_SIZE or args.requests < 1:
        parser.error(f"--doc-tokens must be >= {2 * BLOCK_SIZE}, --requests >= 1")
    return args


def plan_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Device KV, pool and host tier sizes, in blocks and bytes."""
    question_max = 40  # tokens; questions are ~20
    max_model_len = args.doc_tokens + 2 * BLOCK_SIZE
    prompt_blocks = math.ceil(
        (args.doc_tokens + question_max + args.max_tokens) / BLOCK_SIZE
    )
    block_bytes = args.shape.kv_bytes_per_token() * BLOCK_SIZE
    device_blocks = max(
        math.ceil(max_model_len / BLOCK_SIZE),
        math.ceil(args.device_prompts * prompt_blocks),
    )
    pool = args.docs or math.ceil(4 * device_blocks / prompt_blocks)
    if pool < 2 + math.ceil(args.device_prompts):
        raise SystemExit(f"--docs {pool} is too few: revisits would hit the device")
    if args.requests * prompt_blocks < 4 * device_blocks:
        print(
            f"warning: at 0% reuse the working set ({args.requests} documents) is "
            f"under 4x the device KV cache ({device_blocks} blocks); use --requests "
            f"{math.ceil(4 * device_blocks / prompt_blocks)} or more",
            file=sys.stderr,
        )
    max_docs = pool + args.requests + 1  # + the warm-up document
    host_blocks = math.ceil(1.25 * max_docs * prompt_blocks)
    small_host_blocks = math.ceil(args.disk_host_prompts * prompt_blocks)
    return {
        "block_size": BLOCK_SIZE,
        "block_bytes": block_bytes,
        "prompt_blocks": prompt_blocks,
        "max_model_len": max_model_len,
        "device_blocks": device_blocks,
        "device_kv_bytes": device_blocks * block_bytes,
        "pool_docs": pool,
        "host_kv_bytes": host_blocks * block_bytes,
        "small_host_blocks": small_host_blocks,
        "small_host_kv_bytes": small_host_blocks * block_bytes,
        # Room for the whole working set and the files' headers.
        "disk_kv_bytes": 2 * host_blocks * block_bytes,
    }


def llm_kwargs(
    config: str,
    model: Path,
    sizes: dict[str, Any],
    storage: str | None,
    shape: ModelShape | PublishedShape = FULL_MODEL,
) -> dict[str, Any]:
    """``storage``: ExampleConnector's directory, or the disk tier's."""
    kw: dict[str, Any] = {
        "model": str(model),
        **shape.engine_kwargs(),
        "enforce_eager": True,
        "kv_cache_memory_bytes": sizes["device_kv_bytes"],
        "max_model_len": sizes["max_model_len"],
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 2,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    if config == "host":
        kw["kv_host_cache_bytes"] = sizes["host_kv_bytes"]
        kw["kv_host_cache_policy"] = "lru"
    elif config in ("host_small", "disk", "disk_restart"):
        kw["kv_host_cache_bytes"] = sizes["small_host_kv_bytes"]
        kw["kv_host_cache_policy"] = "lru"
        if config != "host_small":
            kw["kv_disk_cache_path"] = storage
            kw["kv_disk_cache_bytes"] = sizes["disk_kv_bytes"]
    elif config == "device":  # the whole working set fits: revisits hit it
        kw["kv_cache_memory_bytes"] = sizes["host_kv_bytes"]
    elif config == "example":
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    return kw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = plan_sizes(args)
    if isinstance(args.shape, ModelShape):
        args.shape = replace(
            args.shape, max_position_embeddings=sizes["max_model_len"] + 256
        )
    model = args.shape.ensure(args.model_cache)

    plan = []
    for reuse in args.reuse:
        repeats = args.zero_repeats if reuse == 0 else args.repeats
        for rep in range(repeats):
            for config in args.configs:
                if config in ("device", "disk_restart") and reuse == 0:
                    continue  # nothing comes back without reuse
                if config == "host_small" and reuse > 0:
                    continue  # the disk arm's baseline at 0% reuse only
                plan.append((reuse, rep, config))

    runs: list[dict[str, Any]] = []
    t_begin = time.time()
    disk_root = args.disk_dir or Path("/var/tmp")
    disk_root.mkdir(parents=True, exist_ok=True)
    disk_fs = filesystem_of(disk_root)
    with tempfile.TemporaryDirectory(prefix="host_tier_bench.") as tmp:
        workdir = Path(tmp)
        runner = Runner(workdir, fork=not args.no_fork)
        try:
            with tqdm(total=len(plan), desc="host tier", unit="run") as bar:
                for n, (reuse, rep, config) in enumerate(plan):
                    bar.set_postfix_str(f"{config} reuse={reuse:g} #{rep}")
                    schedule = build_schedule(reuse, sizes["pool_docs"], args.requests)
                    storage = None
                    if config == "example":
                        storage = str(workdir / f"example-{n}")
                        os.makedirs(storage)
                    elif config in DISK_CONFIGS:
                        storage = tempfile.mkdtemp(
                            prefix=f"host_tier_bench-{n}.", dir=disk_root
                        )
                    spec = {
                        "llm_kwargs": llm_kwargs(
                            config, model, sizes, storage, args.shape
                        ),
                        "schedule": schedule,
                        "doc_tokens": args.doc_tokens,
                        "max_tokens": args.max_tokens,
                        "threads": args.threads,
                        "example_storage": storage,
                        "log_path": str(workdir / f"run-{n}.log"),
                        "result_path": str(workdir / f"run-{n}.json"),
                    }
                    writer = None
                    if config == "disk_restart":
                        # The seed phase in an engine of its own, which stops;
                        # the measured phase in a new one, same directory.
                        first = next(
                            i
                            for i, op in enumerate(schedule)
                            if op["kind"] in ("new", "revisit")
                        )
                        # Blocks still in host memory when an engine stops
                        # are not written: documents nobody revisits push the
                        # seeds out of the device and host memory first.
                        fill = math.ceil(
                            (sizes["device_blocks"] + sizes["small_host_blocks"])
                            / sizes["prompt_blocks"]
                        )
                        fillers = [
                            {"doc": FILLER_DOC + i, "question": 0, "kind": "seed"}
                            for i in range(fill)
                        ]
                        wspec = {
                            **spec,
                            "schedule": schedule[:first] + fillers,
                            "drain_disk": True,
                            "log_path": str(workdir / f"run-{n}-writer.log"),
                            "result_path": str(workdir / f"run-{n}-writer.json"),
                        }
                        wrc, wresult, wlog = runner.run(wspec)
                        writer = {"returncode": wrc}
                        if wresult is not None:
                            writer["disk_counters"] = wresult.get("disk_counters")
                        if wrc != 0:
                            writer["error_log_tail"] = wlog[-4000:]
                        spec["schedule"] = schedule[:1] + schedule[first:]
                    if config in DISK_CONFIGS:
                        spec["drop_page_cache"] = True
                    load_before = os.getloadavg()
                    rc, result, log = runner.run(spec)
                    if storage:
                        shutil.rmtree(storage, ignore_errors=True)
                    docs = {op["doc"] for op in schedule if op["kind"] != "warmup"}
                    run = {
                        "config": config,
                        "reuse": reuse,
                        "repeat": rep,
                        "returncode": rc,
                        "loadavg_before": load_before,
                        "loadavg_after": os.getloadavg(),
                        "distinct_docs": len(docs),
                        "working_set_vs_device": len(docs)
                        * sizes["prompt_blocks"]
                        / sizes["device_blocks"],
                        "result": result,
                        "summary": None,
                    }
                    if writer is not None:
                        run["writer"] = writer
                    if rc != 0 or result is None:
                        run["error_log_tail"] = log[-4000:]
                        tqdm.write(
                            f"run {config} reuse={reuse:g} failed (rc={rc}):\n"
                            + log[-3000:],
                            file=sys.stderr,
                        )
                    else:
                        run["summary"] = summarize_run(run, args.doc_tokens)
                    runs.append(run)
                    bar.update(1)
        finally:
            runner.close()

    best = pick_runs(runs)
    engine = next((r["result"] for r in runs if r["result"]), {})

    report = {
        "benchmark": "host_tier_end_to_end",
        **provenance(
            "host_tier_bench.py",
            argv,
            t_begin,
            "shared machine: other jobs may run beside the benchmark; "
            "loadavg_before/after per run show how busy it was",
        ),
        "platform": "CPU",
        "versions": versions(),
        "model": {"path": str(model), **asdict(args.shape)},
        "workload": {
            "doc_tokens": args.doc_tokens,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "reuse": args.reuse,
            "configs": args.configs,
            "zero_repeats": args.zero_repeats,
            "quick": args.quick,
            "torch_threads": args.threads,
            "device_num_blocks": engine.get("num_device_blocks"),
            "disk_dir_filesystem": disk_fs
            if any(c in DISK_CONFIGS for c in args.configs)
            else None,
            "description": "document + short question per request, sequential; "
            "reuse r: a fraction r of measured requests revisit the least "
            "recently used document (evicted from the device), the rest open a "
            "new one; runs with r > 0 first read a pool of documents (seed "
            "phase, untimed)",
            **sizes,
        },
        "method": {
            "ttft": "wall time from LLMEngine.add_request (token ids) to the "
            "step() returning the first token, in the engine's process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0), one request at a time",
            "throughput": "measured requests and prompt tokens over the wall "
            "time of the measured phase (seed phase and warm-up excluded)",
            "percentiles": "linear interpolation; p99 of ~12 requests is "
            "close to the maximum",
            "repeats": "at 0% reuse the fastest of --zero-repeats runs counts",
            "host_hit_rate": "host-tier hit blocks / looked-up blocks over the "
            "measured phase, from the connector's index counters (lookups "
            "cover only blocks that missed on the device)",
        },
        "summary": [
            {
                "config": c,
                "reuse": r,
                **run["summary"],
                "repeats_prompt_tokens_per_s": [
                    x["summary"]["prompt_tokens_per_s"]
                    for x in runs
                    if x["summary"] and (x["config"], x["reuse"]) == (c, r)
                ],
            }
            for (c, r), run in sorted(
                best.items(), key=lambda kv: (kv[0][1], CONFIGS.index(kv[0][0]))
            )
        ],
        **analyse(runs, args.doc_tokens),
        "runs": runs,
    }
    png = write_json(out, report)
    show(report, png)
    failed = [r for r in runs if r["summary"] is None]
    return finish(out, png, len(failed), "error_log_tail")


def analyse(runs: list[dict[str, Any]], doc_tokens: int) -> dict[str, Any]:
    """Everything the report derives from its runs (``--replot`` redoes it)."""
    best = pick_runs(runs)
    identical = outputs_identical(runs, "none", "host")
    hits = hit_vs_recompute(runs, doc_tokens)
    known = [v for v in identical.values() if v is not None]
    return {
        "hit_vs_recompute": hits,
        "throughput_ratio_host_vs_none": paired_ratios(runs),
        "throughput_ratio_disk_vs_host_small": paired_ratios(
            runs, "disk", "host_small"
        ),
        "throughput_ratio_disk_vs_none": paired_ratios(runs, "disk", "none"),
        "outputs_identical": all(known) if known else None,
        "outputs_identical_by_reuse": identical,
        "example_outputs_identical_by_reuse": outputs_identical(
            runs, "none", "example"
        ),
        "disk_outputs_identical_by_reuse": {
            c: outputs_identical(runs, "none", c) for c in DISK_CONFIGS
        },
        "targets": evaluate_targets(best, runs, hits, identical),
    }


def show(report: dict[str, Any], png: Path) -> None:
    """The plot, the table, the ratios and the targets of a report."""
    best = pick_runs(report["runs"])
    hits = report["hit_vs_recompute"]
    if best:
        plot_report(report, png)
    print_table(best)
    if hits["recompute"]["n"] or hits["host_hit"]["n"]:
        print_hits(hits)
    for name in ("host_vs_none", "disk_vs_host_small", "disk_vs_none"):
        for level, r in report.get(f"throughput_ratio_{name}", {}).items():
            print(
                f"reuse {level}: throughput {name.replace('_vs_', '/')} "
                f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] over "
                f"{r['pairs']} paired repeats"
            )
    print(f"\ngreedy outputs identical, host vs none: {report['outputs_identical']}")
    for config, by_reuse in report.get("disk_outputs_identical_by_reuse", {}).items():
        if any(v is not None for v in by_reuse.values()):
            print(f"greedy outputs identical, {config} vs none: {by_reuse}")
    print_targets(report["targets"])


def replot(path: Path) -> int:
    """The figures, table, targets and PNG again from a JSON this script
    wrote, derived anew from its runs (the JSON is rewritten with them)."""
    report = json.loads(path.read_text())
    report.update(analyse(report["runs"], report["workload"]["doc_tokens"]))
    png = write_json(path, report)
    show(report, png)
    print(f"\nJSON: {path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
