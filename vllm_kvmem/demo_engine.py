"""The demo's engine harness: what each rank of a running engine allocated.

``kvmem demo`` starts every engine through this module, in a subprocess, and
reads the truth from the workers (tensor storage sizes, block counts) rather
than from log lines; the tests and benchmarks borrow it for the same reason.
``python -m vllm_kvmem.demo_engine '{"model": ..., ...}'`` starts an engine
with those ``LLM`` keyword arguments, generates a few tokens and prints one
``KVMEM_REPORT {json}`` line. Its subprocesses allow callables in
``LLM.collective_rpc`` (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): a local
demo's engines only, never a server's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPORT_PREFIX = "KVMEM_REPORT "
# Pipeline parallel on CPU cannot run with enforce_eager (the first PP step
# asserts on intermediate tensors): compile with the eager backend instead.
PP_COMPILATION = {"mode": 2, "backend": "eager"}


def engine_env(**extra: str) -> dict[str, str]:
    """Environment for an engine subprocess on CPU: this process's, without
    the variables that would override what the caller asks for, with CPU
    pipeline parallel working (no thread binding) and callables allowed in
    ``LLM.collective_rpc``; ``extra`` last."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PP_LAYER_PARTITION")
    }
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_subprocess(
    llm_kwargs: dict[str, Any],
    workload: dict[str, Any] | None = None,
    timeout: float | None = None,
    cwd: str | None = None,
    python: str | None = None,
    **env: str,
) -> tuple[int, str, dict[str, Any] | None]:
    """Run :func:`run` in a fresh process of ``python`` (default: this
    interpreter); return (exit code, output, report)."""
    proc = subprocess.run(
        [
            python or sys.executable,
            "-m",
            "vllm_kvmem.demo_engine",
            json.dumps(llm_kwargs),
            json.dumps(workload or {}),
        ],
        cwd=cwd,
        env=engine_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = None
    for line in proc.stdout.splitlines():
        if line.startswith(REPORT_PREFIX):
            report = json.loads(line[len(REPORT_PREFIX) :])
    return proc.returncode, proc.stdout + proc.stderr, report


def rank_kv_report(worker: Any) -> dict[str, Any]:
    """Runs inside a worker (via ``LLM.collective_rpc``)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    runner = worker.model_runner
    storages: dict[int, int] = {}
    for t in runner.kv_caches:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    cfg = runner.kv_cache_config
    tokens, concurrency = get_kv_cache_capacity(worker.vllm_config, cfg)
    first = runner.kv_caches[0] if runner.kv_caches else None
    layers = sorted({n for g in cfg.kv_cache_groups for n in g.layer_names})
    return {
        "rank": worker.rank,
        "pp_rank": _pp_rank(),
        "layers": len(layers),
        "layer_names": layers,
        "kv_bytes": sum(storages.values()),
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.kv_cache_groups[0].kv_cache_spec.block_size,
        "tokens": tokens,
        "concurrency": concurrency,
        "max_model_len": worker.vllm_config.model_config.max_model_len,
        "kv_cache_memory_bytes": worker.cache_config.kv_cache_memory_bytes,
        "layout": cfg.kv_cache_layout,
        "view_shape": list(first.shape) if first is not None else None,
        "view_stride_bytes": [x * first.element_size() for x in first.stride()]
        if first is not None
        else None,
        "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "num_groups": len(cfg.kv_cache_groups),
    }


def _pp_rank() -> int:
    from vllm.distributed import get_pp_group

    return get_pp_group().rank_in_group


def collect(llm: Any) -> list[dict[str, Any]]:
    """Per-rank reports of an ``LLM``, in rank order."""
    return sorted(llm.collective_rpc(rank_kv_report), key=lambda r: r["rank"])


def run(
    llm_kwargs: dict[str, Any],
    prompts: list[str] | None = None,
    max_tokens: int = 8,
    rounds: int = 1,
    sequential: bool = False,
) -> dict:
    """Start the engine, generate greedily ``rounds`` times, report per rank.

    Later rounds repeat the same prompts, so they can hit the prefix cache;
    ``cached_tokens`` records how many prompt tokens each request found cached.
    ``sequential`` sends one request at a time and records each one's wall time
    in ``latency_s`` (with ``max_tokens=1`` that is its time to first token).
    """
    import time

    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    # vLLM's own plugin loading (it honours VLLM_PLUGINS), before LLM(...)
    # validates the vllm-kvmem keyword arguments.
    load_general_plugins()

    llm = LLM(**llm_kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = prompts or ["The KV cache"]
    token_ids, cached, latency = [], [], []
    outputs: list[Any] = []
    for _ in range(rounds):
        outputs, times = [], []
        for batch in [[p] for p in prompts] if sequential else [prompts]:
            start = time.perf_counter()
            outputs += llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        token_ids.append([list(o.outputs[0].token_ids) for o in outputs])
        cached.append([o.num_cached_tokens or 0 for o in outputs])
        latency.append(times)
    return {
        "ranks": collect(llm),
        "token_ids": token_ids[0] if rounds == 1 else token_ids,
        "cached_tokens": cached,
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outputs],
        "latency_s": latency,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    workload = json.loads(argv[1]) if len(argv) > 1 else {}
    report = run(json.loads(argv[0]), **workload)
    print(REPORT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
