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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, engine_env

pytestmark = pytest.mark.engine

SCRIPT = ROOT / "tests" / "disk_tier_engine.py"
HOST = 16 << 20  # 16 blocks of model_8l in float32
WORKLOAD = [list(range(12)), [0, 1, 2, 3]]
AGAIN = [[0, 1, 2, 3]]
FAULTS = ("truncated", "checksum", "header", "missing")


def _start(model: Path, disk: Path | None, phases, host: int | None = HOST, hold=False):
    args = {
        "model": str(model),
        "disk": str(disk) if disk else None,
        "host": host,
        "docs": 12,
        "phases": phases,
        "hold": hold,
    }
    env = engine_env(
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE if hold else None,
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


def _held_report(proc: subprocess.Popen) -> dict:
    """The report of an engine told to stay up (``hold``), while it is up."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("REPORT "):
            return json.loads(line.removeprefix("REPORT "))
    proc.wait(timeout=60)
    raise AssertionError(f"engine exited {proc.returncode}: {proc.stderr.read()}")


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


def test_truncated_files_are_recomputed_and_counted(model_8l, cold, filled, tmp_path):
    disk, _ = filled
    broken = tmp_path / "broken"
    shutil.copytree(disk, broken)
    files = list(broken.rglob("*.kvb"))
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    run = _run(model_8l, broken, AGAIN)
    assert run["phases"][0]["tokens"] == cold
    assert run["worker"]["disk_hits"] == 0
    assert run["worker"]["disk_faults_truncated"] > 0
    assert run["scheduler"]["disk_read_failures"] > 0
