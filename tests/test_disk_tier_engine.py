"""The disk tier behind the host tier on real vLLM engines (CPU, float32).

Each engine is a process of its own (``tests/disk_tier_engine.py``; a restart
is a second process on the same directory). The workload: 12 documents of 8
blocks (96 blocks) through a device cache of 24 blocks and a host tier of 16,
so most blocks the host evicts go to disk, then the first 4 documents again:
they miss on the device and in host memory and hit on disk. Every run's
greedy tokens must equal an engine's without any tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, engine_env, on_vllm033

pytestmark = pytest.mark.engine

SCRIPT = ROOT / "tests" / "disk_tier_engine.py"
HOST = 16 << 20  # 16 blocks of model_8l in float32
WORKLOAD = [list(range(12)), [0, 1, 2, 3]]
AGAIN = [[0, 1, 2, 3]]
FAULTS = ("truncated", "checksum", "header", "missing")


def _start(model, disk, phases, host=HOST, hold=False, pause_before=(), python=None):
    """``hold``, ``pause_before``: see tests/disk_tier_engine.py; ``python``:
    the interpreter (vLLM 0.33's), default this one."""
    args = {
        "model": str(model),
        "disk": str(disk) if disk else None,
        "host": host,
        "docs": 12,
        "phases": phases,
        "hold": hold,
        "pause_before": list(pause_before),
    }
    env = engine_env(
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.Popen(
        [python or sys.executable, str(SCRIPT), json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE if hold or pause_before else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, out[-2000:] + err[-4000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


def _run(model: Path, disk: Path | None, phases, host: int | None = HOST) -> dict:
    return _report(_start(model, disk, phases, host))


def _faults(report: dict) -> int:
    return sum(report["worker"][f"disk_faults_{k}"] for k in FAULTS)


@pytest.fixture(scope="module")
def cold(model_8l) -> list[list[int]]:
    """The tokens of the documents read again, without any tier."""
    return _run(model_8l, None, WORKLOAD, host=None)["phases"][1]["tokens"]


@pytest.fixture(scope="module")
def filled(model_8l, tmp_path_factory) -> tuple[Path, dict]:
    """A directory the workload's engine wrote, and that engine's report."""
    disk = tmp_path_factory.mktemp("disk")
    return disk, _run(model_8l, disk, WORKLOAD)


def test_disk_hits_give_the_tokens_of_an_engine_without_tiers(cold, filled):
    _, run = filled
    again = run["phases"][1]
    assert again["tokens"] == cold
    worker, sched = run["worker"], run["scheduler"]
    assert worker["disk_blocks_written"] > 0 and worker["disk_write_drops"] == 0
    assert worker["disk_hits"] > 0 and _faults(run) == 0
    assert sched["disk_read_failures"] == 0 and sched["load_errors"] == 0
    # Every disk hit came back as cached tokens, loaded through host slots.
    assert sum(again["cached"]) >= worker["disk_hits"] * 128
    assert run["disk_bytes_in_use"] == worker["disk_bytes_written"]


def test_a_restart_hits_the_blocks_an_earlier_engine_wrote(model_8l, cold, filled):
    disk, _ = filled
    run = _run(model_8l, disk, AGAIN)
    again = run["phases"][0]
    assert again["tokens"] == cold
    # Nothing on the device or in host memory of a new engine: every cached
    # token came from disk.
    assert run["worker"]["disk_hits"] > 0 and _faults(run) == 0
    assert sum(again["cached"]) == run["worker"]["disk_hits"] * 128


def _read_until(proc: subprocess.Popen, prefix: str) -> str:
    """The rest of the engine's first stdout line starting with ``prefix``,
    read while the engine keeps running."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.removeprefix(prefix)
    proc.wait(timeout=60)
    raise AssertionError(f"engine exited {proc.returncode}: {proc.stderr.read()}")


def _held_report(proc: subprocess.Popen) -> dict:
    """The report of an engine told to stay up (``hold``), while it is up."""
    return json.loads(_read_until(proc, "REPORT "))


def test_two_engines_share_a_directory(model_8l, cold, tmp_path):
    """Replica A serves the workload and stays up; replica B, started on A's
    directory, serves A's documents from A's files (it has computed none of
    them): the same tokens, every cached token from disk, no fault. Both
    write into the directory while both are up."""
    a = _start(model_8l, tmp_path, WORKLOAD, hold=True)
    try:
        first = _held_report(a)
        assert first["phases"][1]["tokens"] == cold
        assert first["worker"]["disk_blocks_written"] > 0
        b = _run(model_8l, tmp_path, AGAIN)
    finally:
        a.communicate(input="\n", timeout=120)
    assert a.returncode == 0
    again = b["phases"][0]
    assert again["tokens"] == cold
    assert b["worker"]["disk_hits"] > 0 and _faults(b) == 0
    assert sum(again["cached"]) == b["worker"]["disk_hits"] * 128


def test_a_full_disk_and_files_truncated_while_it_runs(model_8l, cold, tmp_path):
    """The directory on a 40 MiB tmpfs (about half of the ~80 blocks the host
    evicts fit): writes fail with the kernel's ENOSPC, dropped and counted. Then,
    with the engine up, every block file is cut in half before the documents
    come back: their reads fail and the blocks are recomputed. Greedy tokens
    equal an engine's without any tier throughout."""
    from tests.test_disk_store import tmpfs

    mnt = tmp_path / "small"
    with tmpfs(mnt, "40m") as mounted:
        if not mounted:
            pytest.skip("mount is not permitted here: no real full filesystem")
        proc = _start(model_8l, mnt, WORKLOAD, pause_before=[1])
        try:
            _read_until(proc, "PAUSED")
            files = list(mnt.rglob("*.kvb"))
            assert files
            for path in files:
                with open(path, "r+b") as f:
                    f.truncate(path.stat().st_size // 2)
            proc.stdin.write("\n")
            proc.stdin.flush()
            run = _report(proc)
        finally:
            proc.kill()
            proc.wait()
    assert run["phases"][1]["tokens"] == cold
    worker = run["worker"]
    assert worker["disk_faults_disk_full"] > 0
    assert worker["disk_faults_truncated"] > 0 and worker["disk_hits"] == 0
    assert run["scheduler"]["disk_read_failures"] > 0


@on_vllm033
def test_disk_hits_on_vllm_033(model_8l, cold, vllm_python, tmp_path):
    """The same workload on vLLM 0.33: disk hits, the tokens of 0.32 without
    any tier (same kernels), no fault, in a directory of its own (vLLM's
    version is in the fingerprint)."""
    run = _report(_start(model_8l, tmp_path, WORKLOAD, python=vllm_python))
    assert run["phases"][1]["tokens"] == cold
    assert run["worker"]["disk_hits"] > 0 and _faults(run) == 0
    assert sum(run["phases"][1]["cached"]) >= run["worker"]["disk_hits"] * 128
    (fingerprint,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert '"vllm": "0.33.0"' in (fingerprint / "manifest.json").read_text()
