"""scripts/gpu/ on a machine without a GPU: what a CPU can check.

- pieces (``transport/``): split and rebuild round trip with sha256 (small
  synthetic files), a corrupted or missing piece refused by name, partial
  rebuilds;
- the requirement diff of ``fetch_wheels.py`` on a fixed synthetic pip
  report: markers, extras, the fixed point (requirements of packages that
  are not carried do not count), plans, estimates from the costs measured
  on the H200, the rendered report;
- ``install_pieces.py take`` (each call's carried piece copied out of the
  checkout into the store, as the calls replace each other's carried
  folder), ``status`` and ``check``;
- outputs named after the GPU (``gpu_common.py``, a stand-in ``nvidia-smi``)
  and labelled GPU; ``VLLM_USE_FLASHINFER_SAMPLER=0`` in every engine's and
  server's environment (stage 2's engines, the A/B's and the real-size
  run's servers, ``stage2.sh``);
- ``stage1.sh --dry-run`` and ``stage2.sh --dry-run``;
- issue 30's A/B (``ab_offload.py``): its dry run (the plan, no torch or
  vLLM imported), its arms' flags as vLLM 0.32 parses them and the connector
  keys its sources read, and its figures from synthetic runs;
- issue 36's real-size run (``real_size.py``): its dry run (plan, schedule,
  estimate within ``--max-wall-s``, the model folder written), its servers'
  flags as vLLM 0.32 parses them, and its whole sequence with stand-ins; its
  ``simple_lazy_series`` arm (the series' vLLM first on the path, no
  plugin; an arm whose tree cannot be built does not start);
- the series' vLLM copy (``series_tree.py``): built with git and, for a
  machine without it, from carried patches applied in Python, the two trees
  identical; reused when nothing changed; a patch that does not fit refused;
- issue 42's late-spill check (``late_spill.py``): its dry run (processes
  V2 first, each runner's and tree's environment, the estimate), its
  scheduler-output counting and figures on synthetic records, stage 2's item
  i, and (``engine``) its CPU rehearsal: Model Runner V1, the plugin's tier
  and lazy offload on the series' vLLM against no offload, tokens equal and
  every revisited prefix a host hit;
- no file of the recipe, the benchmarks, the docs or the packages names a
  development machine's path.

No network, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import import_script

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "scripts" / "gpu"
TRANSPORT = GPU / "transport"


@pytest.fixture(scope="module")
def pieces():
    yield from import_script(TRANSPORT / "pieces.py")


@pytest.fixture(scope="module")
def fetch():
    yield from import_script(TRANSPORT / "fetch_wheels.py")


@pytest.fixture(scope="module")
def installer():
    yield from import_script(TRANSPORT / "install_pieces.py")


@pytest.fixture(scope="module")
def common():
    yield from import_script(GPU / "gpu_common.py")


def _files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    out = []
    for i, n in enumerate(sizes):
        path = tmp_path / "src" / f"pkg{i}-1.0-py3-none-any.whl"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(n))
        out.append(path)
    return out


# -- pieces ---------------------------------------------------------------------------


def test_split_and_join_round_trip(pieces, tmp_path):
    files = _files(tmp_path, [1000, 1, 2500, 0, 999])
    root = tmp_path / "core"
    manifest = pieces.split(files, root, piece_bytes=700, meta={"plan": "core"})
    total = sum(f.stat().st_size for f in files)
    assert manifest["total_bytes"] == total
    assert len(manifest["pieces"]) == -(-total // 700)
    assert all(p["size"] <= 700 for p in manifest["pieces"])
    for p in manifest["pieces"]:  # one folder each, manifest in every one
        folder = root / p["folder"]
        assert sorted(x.name for x in folder.iterdir()) == sorted(
            [p["file"], "manifest.json"]
        )
        data = (folder / p["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == p["sha256"]
    for f, entry in zip(files, manifest["files"]):
        assert entry["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    # Rebuilt from the pieces alone, the root manifest gone (as on the machine).
    (root / "manifest.json").unlink()
    out = pieces.join(root, tmp_path / "out")
    assert [p.name for p in out] == [f.name for f in files]
    for f, g in zip(files, out):
        assert g.read_bytes() == f.read_bytes()


def test_join_refuses_bad_or_missing_pieces_by_name(pieces, tmp_path):
    files = _files(tmp_path, [3000, 2000])
    root = tmp_path / "core"
    manifest = pieces.split(files, root, piece_bytes=1024)
    bad = root / "p002" / "piece-002.bin"
    data = bytearray(bad.read_bytes())
    data[10] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"p002 \(bad sha256\)"):
        pieces.join(root, tmp_path / "out", manifest)
    bad.write_bytes(bad.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"p002 \(bad size\)"):
        pieces.join(root, tmp_path / "out", manifest)
    (bad.parent / "manifest.json").unlink()
    bad.unlink()
    bad.parent.rmdir()
    with pytest.raises(ValueError, match=r"p002 \(missing\)"):
        pieces.join(root, tmp_path / "out", manifest)
    # With --partial, the file whose bytes all arrived is rebuilt (the first
    # 3000 bytes lie in pieces 1-3; piece 2 is gone, so neither is complete
    # here), and the second one (pieces 3-5) is.
    got = pieces.join(root, tmp_path / "part", manifest, partial=True)
    assert [p.name for p in got] == [files[1].name]
    assert got[0].read_bytes() == files[1].read_bytes()


def test_split_rejects_duplicate_names(pieces, tmp_path):
    a = _files(tmp_path, [10])[0]
    with pytest.raises(ValueError, match="share a name"):
        pieces.split([a, a], tmp_path / "x", piece_bytes=4)


def test_install_pieces_status(installer, pieces, tmp_path, capsys):
    files = _files(tmp_path, [5000])
    root = tmp_path / "core"
    pieces.split(files, root, piece_bytes=2048, meta={"plan": "core"})
    assert installer.main(["status", "--root", str(root), "--hash"]) == 0
    assert "3 of 3 pieces present (sha256 checked)" in capsys.readouterr().out
    for path in (root / "p003").iterdir():
        path.unlink()
    (root / "manifest.json").unlink()
    assert installer.main(["status", "--root", str(root)]) == 3
    out = capsys.readouterr().out
    assert "2 of 3 pieces present" in out and "p003: missing" in out


def _take(tmp_path: Path, store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRANSPORT / "install_pieces.py"), "take", *args],
        cwd=tmp_path / "checkout",
        env=dict(os.environ, KVMEM_PIECE_STORE=str(store)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_take_keeps_each_calls_piece_outside_the_checkout(installer, pieces, tmp_path):
    """As on the H200 (2026-11-26): a carried path replaces its whole
    top-level folder, so each call's checkout holds only that call's piece.
    Each call takes it into the store; the store ends complete and is what
    the install reads."""
    files = _files(tmp_path, [5000, 300])
    cut = tmp_path / "cut" / "torch211"
    manifest = pieces.split(files, cut, piece_bytes=2048, meta={"plan": "torch211"})
    store = tmp_path / "store"
    carried = tmp_path / "checkout" / ".gpu-wheels" / "torch211"
    dest = store / "gpu-wheels" / "torch211"
    assert installer.store_for(Path(".gpu-wheels/torch211"), store) == dest
    assert installer.store_for(Path(".gpu-wheels-0.33.0/torch211"), store) == (
        store / "gpu-wheels-0.33.0" / "torch211"
    )
    for n, p in enumerate(manifest["pieces"], 1):
        # The call's carried path: .gpu-wheels holds this piece alone.
        shutil.rmtree(tmp_path / "checkout", ignore_errors=True)
        shutil.copytree(cut / p["folder"], carried / p["folder"])
        proc = _take(tmp_path, store, ".gpu-wheels/torch211")
        last = n == len(manifest["pieces"])
        assert proc.returncode == (0 if last else 3), proc.stdout + proc.stderr
        assert (
            f"took {p['folder']} from .gpu-wheels/torch211 into {dest}" in proc.stdout
        )
        assert f"{n} of {len(manifest['pieces'])} pieces present" in proc.stdout
    again = _take(tmp_path, store, ".gpu-wheels/torch211")  # idempotent
    assert again.returncode == 0 and "took nothing new" in again.stdout
    assert installer.main(["status", "--root", str(dest), "--hash"]) == 0
    (tmp_path / "checkout" / ".gpu-wheels").rename(tmp_path / "gone")  # next call
    out = pieces.join(dest, tmp_path / "wheels", manifest)
    assert [w.read_bytes() for w in out] == [f.read_bytes() for f in files]
    # Nothing carried and nothing in the store yet: says so, exit 3.
    empty = _take(tmp_path, tmp_path / "empty", ".gpu-wheels/torch211")
    assert empty.returncode == 3 and "no piece folder carried" in empty.stdout


def test_install_pieces_check_finds_unmet_requirements(installer, tmp_path):
    """A fake install target whose package needs a missing and a wrong one."""
    target = tmp_path / "site"
    dist = target / "kvmemfake-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvmemfake\nVersion: 1.0\n"
        "Requires-Dist: pytest>=1\n"  # there
        "Requires-Dist: pytest<1\n"  # wrong version
        "Requires-Dist: kvmem-no-such-package\n"  # missing
        'Requires-Dist: kvmem-other; python_version < "3"\n'  # marker false
        'Requires-Dist: kvmem-extra; extra == "x"\n'  # extra not asked
    )
    result = installer.check(target)
    assert result["installed"] == 1
    unmet = {(u["requires"], u["found"] is None) for u in result["unmet"]}
    assert unmet == {("pytest<1", False), ("kvmem-no-such-package", True)}


# -- the requirement diff -------------------------------------------------------


def _item(name, version, requires=(), url=None):
    return {
        "metadata": {"name": name, "version": version, "requires_dist": list(requires)},
        "download_info": {
            "url": url or f"https://example.invalid/{name}-{version}-py3-none-any.whl",
            "archive_info": {"hashes": {"sha256": "0" * 64}},
        },
    }


REPORT = {
    "environment": {
        "python_version": "3.12",
        "python_full_version": "3.12.1",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "platform_release": "",
        "platform_version": "",
        "implementation_version": "3.12.1",
    },
    "install": [
        _item(
            "vllm",
            "0.32.0",
            [
                "torch==2.13.0",
                "numpy",
                "numba==0.65.0",
                "mistral-common>=1.0",
                'winonly; sys_platform == "win32"',
                'py313only; python_version >= "3.13"',
            ],
        ),
        _item(
            "torch",
            "2.13.0",
            [
                "cuda-toolkit[cublas]==13.0.3",
                "nvidia-nccl-cu13==2.29.7",
                "filelock",
            ],
        ),
        _item(
            "cuda-toolkit",
            "13.0.3",
            [
                'nvidia-cublas==13.1.1.3; extra == "cublas"',
                'nvidia-cufft; extra == "cufft"',
            ],
        ),
        _item("nvidia-cublas", "13.1.1.3"),
        _item("nvidia-cufft", "12.0.0"),
        _item("nvidia-nccl-cu13", "2.29.7"),
        _item("numpy", "2.3.5"),
        _item("numba", "0.65.0", ["numpy<2.5", "llvmlite"]),
        _item("llvmlite", "0.47.0"),
        _item("mistral-common", "1.13.1", ["numpy<2.4", "pycountry"]),
        _item("pycountry", "26.2.16"),
        _item("filelock", "4.2.12"),
    ],
}

MACHINE = """\
# name version source
torch 2.11.0 kinds-pip-list
numpy 2.5.2 kinds-pip-list
numba ? kinds-names
nvidia-cublas 13.1.0.3 torch-2.11.0-pin
nvidia-nccl-cu13 2.28.9 torch-2.11.0-pin
cuda-toolkit 13.0.2 torch-2.11.0-pin
filelock 3.20.0 kinds-pip-list
llvmlite==0.44.0
"""


@pytest.fixture()
def tree(fetch):
    return fetch.requirement_tree(REPORT, ["vllm==0.32.0", "torch==2.13.0"])


def test_machine_list_parses_both_formats(fetch):
    m = fetch.parse_machine_packages(MACHINE)
    assert m["torch"].version == "2.11.0" and m["torch"].source == "kinds-pip-list"
    assert m["numba"].version is None
    assert m["llvmlite"].version == "0.44.0" and m["llvmlite"].source == "pip-freeze"
    committed = fetch.parse_machine_packages(fetch.MACHINE_LIST.read_text())
    assert committed["torch"].version == "2.11.0" and len(committed) > 150


def test_tree_follows_markers_and_extras(tree):
    wanted = {name: node.wanted for name, node in tree.items()}
    assert ("<root>", "==2.13.0") in wanted["torch"] and ("vllm", "==2.13.0") in wanted[
        "torch"
    ]
    assert tree["cuda-toolkit"].extras == {"cublas"}
    assert wanted["nvidia-cublas"] == [("cuda-toolkit", "==13.1.1.3")]
    assert wanted["nvidia-cufft"] == []  # its extra was not asked for
    assert "winonly" not in tree and "py313only" not in tree


def test_diff_classifies_against_the_machine(fetch, tree):
    machine = fetch.parse_machine_packages(MACHINE)
    rows = {r.name: r for r in fetch.diff(tree, machine)}
    status = {n: r.status.split(":")[0] for n, r in rows.items()}
    assert status == {
        "vllm": "carry",  # missing
        "torch": "carry",  # 2.11.0 fails ==2.13.0
        "cuda-toolkit": "carry",
        "nvidia-cublas": "carry",
        "nvidia-cufft": "not needed",  # its extra was not asked for
        "nvidia-nccl-cu13": "carry",
        "numpy": "carry",  # mistral-common (carried) needs <2.4
        "numba": "unverified",
        # The machine has it; only numba asks, and numba is not carried.
        "llvmlite": "present",
        "mistral-common": "carry",
        "pycountry": "carry",
        "filelock": "present",  # any version
    }
    assert rows["torch"].failing == [("<root>", "==2.13.0"), ("vllm", "==2.13.0")]
    assert rows["numpy"].failing == [("mistral-common", "<2.4")]
    assert rows["numba"].machine_version is None


def test_plans_skip_tiers_and_their_requirements(fetch, tree):
    machine = fetch.parse_machine_packages(MACHINE)
    abi = {"nvidia-nccl-cu13"}
    fetch.OPTIONAL["mistral-common"]  # the synthetic optional package is real
    carried = {
        plan: {r.name for r in fetch.plan_diff(tree, machine, plan, abi) if r.carry}
        for plan in fetch.PLANS
    }
    assert carried["full"] == {
        "vllm", "torch", "cuda-toolkit", "nvidia-cublas", "nvidia-nccl-cu13",
        "numpy", "mistral-common", "pycountry",
    }  # fmt: skip
    # lean: the machine's CUDA libraries, except the one that fails the ABI check
    assert carried["lean"] == carried["full"] - {"cuda-toolkit", "nvidia-cublas"}
    # core: no optional mistral-common, so numpy 2.5.2 is fine and stays
    assert carried["core"] == {"vllm", "torch", "nvidia-nccl-cu13"}
    assert carried["torch211"] == {"vllm"}
    order = fetch.stream_order(
        {p: fetch.plan_diff(tree, machine, p, abi) for p in fetch.PLANS}, "core"
    )
    assert [r.name for r in order][0] == "vllm"  # torch211's wheels first


def test_estimates_and_report(fetch, tree):
    model = fetch.CallModel()
    est = fetch.estimate(100 * fetch.MIB, 60 * fetch.MIB, model)
    assert est["calls"] == 2
    assert est["stage2_min"] == pytest.approx(
        (model.cold_start_s + 2 * model.per_piece_call_s + model.install_fixed_s
         + 100 / 1024 * model.install_s_per_gib + model.stage2_runs_s) / 60, abs=0.06
    )  # fmt: skip
    assert est["fits_with_stage1"] is True
    big = fetch.estimate(5 * fetch.GIB, 60 * fetch.MIB, model)
    assert big["calls"] == 86 and big["fits_with_stage1"] is False
    machine = fetch.parse_machine_packages(MACHINE)
    rows_by_plan = {p: fetch.plan_diff(tree, machine, p) for p in fetch.PLANS}
    sizes = {"vllm": 300 * fetch.MIB, "torch": 500 * fetch.MIB}

    def report_for(model):
        return fetch.build_report(
            rows_by_plan,
            sizes,
            piece_bytes=60 * fetch.MIB,
            model=model,
            meta={
                "created": "t",
                "targets": ["vllm==0.32.0"],
                "resolver_python": "3.12.1",
                "pip_version": "x",
                "machine_list": "m",
                "command": "c",
            },
            notes=["a note"],
        )

    report = report_for(model)
    json.dumps(report)  # JSON-able
    assert report["plans"]["core"]["estimate"]["calls"] == 14  # 800 MiB / 60
    # At the measured 8 s a piece call, 14 calls fit 15 device minutes too;
    # the choice stays the plan that has run on the machine (fewest calls).
    assert report["plans"]["core"]["estimate"]["fits_with_stage1"]
    assert report["chosen"] == "torch211" == fetch.PROVEN_PLAN
    estimates = {p: info["estimate"] for p, info in report["plans"].items()}
    assert fetch.choose_plan(estimates, prefer=None) == "full"  # most complete
    text = fetch.render_markdown(report)
    assert "**Chosen plan: `torch211`.**" in text and "- a note" in text
    assert "It is the plan that has run on the machine" in text
    assert "| torch | 2.13.0 | 2.11.0 | torch | 500.0 |" in text
    assert "fits 15 min" in text and "15 device minutes per session" in text
    assert "measured on the first GPU run" in text
    # Too short a session for any plan: the smallest, with the advice.
    tight = report_for(dataclasses.replace(model, device_budget_s=5 * 60.0))
    assert tight["chosen"] == "torch211" and "session of its own" in tight["chosen_why"]
    assert "fits 5 min" in fetch.render_markdown(tight)


def test_the_device_time_model_is_the_h200_runs(fetch, common):
    """CallModel's costs are those measured on the first GPU run."""
    model = fetch.CallModel()
    measured = common.MEASURED_S
    assert model.cold_start_s == measured["cold_start"] == 30
    assert model.per_piece_call_s == measured["piece_call"] == 8
    assert model.stage1_s == measured["stage1"]
    # install and probe of the torch211 plan's 344 MiB: about 30 s
    assert model.install_fixed_s + 344 / 1024 * model.install_s_per_gib == (
        pytest.approx(measured["install_and_probe"], abs=1)
    )


def test_the_device_time_model_takes_the_real_size_run(fetch, real):
    """Stage 2's first run in the model is the next session's real-size run:
    its --max-wall-s, which its default plan fits."""
    args = real.parse_args([])
    assert fetch.CallModel().stage2_runs_s == args.max_wall_s
    assert real.build_plan(args)["estimate_s"] <= args.max_wall_s


def test_committed_size_report_is_consistent(fetch):
    """The committed report came from a real run and says what it chose."""
    report = json.loads((TRANSPORT / "size_report.json").read_text())
    assert set(report["plans"]) == set(fetch.PLANS)
    assert report["chosen"] in fetch.PLANS
    full = report["plans"]["full"]["estimate"]
    assert full["mib"] > report["plans"][report["chosen"]]["estimate"]["mib"]
    # Written with today's device limits, and its choice fits them.
    assert report["call_model"] == dataclasses.asdict(fetch.CallModel())
    assert report["plans"][report["chosen"]]["estimate"]["fits_with_stage1"]
    assert report["pieces"]["plan"] == report["chosen"]
    md = (TRANSPORT / "size_report.md").read_text()
    assert md.startswith("# Wheels for vLLM")
    # Re-estimated with today's CallModel: rendering again changes nothing.
    again = fetch.rerender(report, fetch.CallModel(), report["notes"][-1])
    assert again == report and fetch.render_markdown(again) == md


# -- the stage scripts ---------------------------------------------------------------


def _run(
    script: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    full = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    full.update(env or {})
    return subprocess.run(
        ["bash", str(GPU / script), *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
    )


H200_SMI = "NVIDIA H200, 143771 MiB, 580.159.04"


@pytest.fixture()
def fake_gpu(tmp_path: Path) -> dict[str, str]:
    """PATH with an ``nvidia-smi`` that answers as the H200 of 2026-11-26."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{H200_SMI}'\n")
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_outputs_are_named_and_labelled_after_the_gpu(common, tmp_path, fake_gpu):
    assert common.device_suffix("NVIDIA H100 80GB HBM3") == "h100"
    assert common.device_suffix("NVIDIA H200") == "h200"
    assert common.device_suffix("NVIDIA H100 NVL") == "h100"
    assert common.device_suffix("NVIDIA GH200 480GB") == "nvidia_gh200_480gb"
    assert common.device_suffix("NVIDIA A10G") == "nvidia_a10g"
    assert common.device_suffix("") == "gpu"
    tool = [sys.executable, str(GPU / "gpu_common.py")]
    got = subprocess.run([*tool, "suffix"], env=dict(os.environ, **fake_gpu),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert got.stdout.strip() == "h200", got.stderr
    result = tmp_path / "transfer_h200.json"
    result.write_text(json.dumps({"device": "cuda", "device_name": "NVIDIA H200"}))
    subprocess.run([*tool, "label", str(result), "--command", "x"], check=True,
                   env=dict(os.environ, **fake_gpu), timeout=60)  # fmt: skip
    data = json.loads(result.read_text())
    assert data["platform"] == "GPU" and data["device"] == "cuda"  # kept
    assert data["label"].startswith("GPU: NVIDIA H200, measured 20")
    assert data["gpu"] == {
        "name": "NVIDIA H200",
        "memory": "143771 MiB",
        "driver": "580.159.04",
    }
    assert common.gpu_memory_gib(data["gpu"]) == pytest.approx(140.4, abs=0.1)
    # Without a GPU: "cpu", nothing labelled.
    no_gpu = dict(os.environ, PATH=str(tmp_path / "nowhere"))
    got = subprocess.run([*tool, "suffix"], env=no_gpu, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert got.stdout.strip() == "cpu"


def test_stage1_dry_run(tmp_path, fake_gpu):
    proc = _run("stage1.sh", tmp_path, "--dry-run", env=fake_gpu)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    names = {p.name for p in tmp_path.iterdir()} - {"fake-bin"}
    assert {
        "stage1.log",
        "stage1_pytest.xml",
        "transfer_cpu_dryrun.json",
        "transfer_cpu_dryrun.png",
        "abi_machine.json",
        "pip_freeze.txt",
        "machine.txt",
    } <= names
    assert len(names) <= 8  # what a device call brings back
    log = (tmp_path / "stage1.log").read_text()
    assert "DRY RUN" in log and "pytest: exit 0" in log
    # Named after the GPU nvidia-smi names (here the stand-in's H200).
    assert "GPU: h200" in log and "transfer_h200.json" in log
    assert "transfer_h100" not in (GPU / "stage1.sh").read_text()
    # Carried pieces are taken out of the checkout first (none here).
    assert "=== pieces" in log and "pieces: exit 0" in log
    report = json.loads((tmp_path / "transfer_cpu_dryrun.json").read_text())
    assert report["pageable"]["results"] and report["overlap"]["results"]


def test_stage2_dry_run(tmp_path):
    store = tmp_path / "store"
    env = {"KVMEM_PIECE_STORE": str(store)}
    proc = _run("stage2.sh", tmp_path, "--dry-run", "--items", "ae", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # The plan that fits a 15-minute session is the default.
    assert "vLLM 0.32.0 plan torch211 items ae" in proc.stdout
    # Every engine without flashinfer's sampler (flashinfer is not carried).
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in proc.stdout
    # The install reads the pieces from the store, never from the checkout.
    assert f"install --root {store}/gpu-wheels/" in proc.stdout
    bad = _run("stage2.sh", tmp_path, "--dry-run", "--plan", "lean")
    assert bad.returncode == 2 and "--plan lean: torch211 or core" in bad.stdout
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    assert set(plan["items"]) == {"a", "e"}
    assert all(plan["items"].values())
    assert plan["server_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    # From an eager engine start measured on the H200 (35 s): a 2, e 3.
    assert plan["estimate_s"] == {"a": 70.0, "e": 120.0}
    bad = _run("stage2.sh", tmp_path, "--dry-run", "--items", "az")
    assert bad.returncode != 0 and "unknown items" in bad.stdout + bad.stderr


@pytest.fixture(scope="module")
def stage2():
    yield from import_script(GPU / "stage2.py")


def test_stage2_engines_get_the_flashinfer_switch_and_flash_attn(
    stage2, tmp_path, monkeypatch
):
    """Every engine's environment has VLLM_USE_FLASHINFER_SAMPLER=0 (unless
    the caller set it), and items c and e ask for FLASH_ATTN as vLLM 0.32
    reads it (an engine argument; it has no VLLM_ATTENTION_BACKEND)."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(kw["env"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(stage2.subprocess, "run", fake_run)
    runner = stage2.Runner(tmp_path, tmp_path / "model", 10.0)
    runner.engine("x", {"llm": {}})
    assert seen[-1]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # the caller's wins
    runner.engine("y", {"llm": {}})
    assert seen[-1]["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    specs = []
    monkeypatch.setattr(
        runner, "engine", lambda name, spec, **env: specs.append((spec, env)) or {}
    )
    for item in (stage2.item_c, stage2.item_e):
        with contextlib.suppress(Exception):
            item(runner)
    assert len(specs) == 5
    for spec, env in specs:
        assert spec["llm"]["attention_backend"] == "FLASH_ATTN"
        assert spec["llm"]["dtype"] == "bfloat16"
        assert "VLLM_ATTENTION_BACKEND" not in env


def test_rehearsal_of_torch211_refuses_without_its_pieces(tmp_path):
    env = dict(os.environ, PIECES=str(tmp_path / "none"))
    proc = subprocess.run(
        ["bash", str(TRANSPORT / "rehearse_torch211.sh"), str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run scripts/gpu/transport/fetch_wheels.py first" in proc.stdout


@pytest.fixture(scope="module")
def rehearse():
    yield from import_script(TRANSPORT / "rehearse_torch211.py")


def test_rehearsal_of_torch211_names_modules_vllm_032_has(rehearse):
    """The rehearsal's import list (run against the CUDA wheel, not here):
    every Python module in it exists in vLLM 0.32 (the CPU build ships the
    same Python; the compiled extensions are the CUDA wheel's alone)."""
    import importlib.util

    python = [m for m in rehearse.MODULES if not m.endswith("_C_stable_libtorch")]
    assert len(python) == len(rehearse.MODULES) - 2
    assert [m for m in python if importlib.util.find_spec(m) is None] == []


# -- issue 30's A/B (ab_offload.py): plan and figures, no engine -------------------


@pytest.fixture(scope="module")
def ab():
    bench = str(ROOT / "benchmarks")
    had = bench in sys.path
    yield from import_script(GPU / "ab_offload.py")
    if not had and bench in sys.path:  # it puts serving_bench's folder there
        sys.path.remove(bench)
    sys.modules.pop("serving_bench", None)


def _ab_dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GPU / "ab_offload.py"), "--dry-run", "--out",
         str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_ab_offload_dry_run_plan(tmp_path):
    arms = "none,tier,simple_lazy,offloading"
    proc = _ab_dry_run(tmp_path, "--arms", arms)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "ab_offload_plan.json").read_text())
    assert plan["imported_torch_or_vllm"] == []  # nothing of CUDA, no engine
    assert "H200 on 2026-11-26" in plan["status"]
    assert plan["server_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert list(plan["arms"]) == arms.split(",")
    cmds = {a: plan["arms"][a]["server"] for a in plan["arms"]}
    # Same model, device KV, batching and block size in every arm.
    for flag in ("--model", "--kv-cache-memory-bytes", "--max-num-batched-tokens",
                 "--block-size", "--max-model-len", "--dtype"):  # fmt: skip
        assert len({_flag(c, flag) for c in cmds.values()}) == 1, flag
    same = plan["equal_in_every_arm"]
    assert int(_flag(cmds["none"], "--kv-cache-memory-bytes")) == 16 << 20
    assert same["device_kv_blocks"] == 64 and same["host_blocks"] == 1024
    # Same host bytes, each in its arm's own terms.
    host = same["host_bytes"]
    assert int(_flag(cmds["tier"], "--kv-host-cache-bytes")) == host
    kv = json.loads(_flag(cmds["simple_lazy"], "--kv-transfer-config"))
    assert kv["kv_connector"] == "SimpleCPUOffloadConnector"
    assert kv["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": host,
        "lazy_offload": True,
    }
    assert float(_flag(cmds["offloading"], "--kv-offloading-size")) * (1 << 30) == host
    assert "--kv-host-cache-bytes" not in cmds["none"] + cmds["simple_lazy"]
    # vLLM's own arms run without the plugin; ours with it.
    assert plan["arms"]["simple_lazy"]["env"] == {"VLLM_PLUGINS": ""}
    assert plan["arms"]["offloading"]["env"] == {"VLLM_PLUGINS": ""}
    assert "VLLM_USE_SIMPLE_KV_OFFLOAD" in plan["arms"]["offloading"]["unset_env"]
    assert plan["arms"]["tier"]["env"] == {} == plan["arms"]["none"]["env"]
    wl = plan["workload"]
    assert wl["concurrencies"] == [4, 8] and wl["prefix_len"] == 384
    assert wl["levels"]["high"]["num_prefixes"] == 16
    assert wl["probes"]["evict_prompts"] * 416 > 2 * 2048  # overflows the device
    assert "ab_offload_<gpu>.json" in plan["output"] and "h200" in plan["output"]
    # The default leaves the third arm out (the issue: "if device time allows").
    proc = _ab_dry_run(tmp_path)
    plan = json.loads((tmp_path / "ab_offload_plan.json").read_text())
    assert list(plan["arms"]) == ["none", "tier", "simple_lazy"]
    # One repeat (two did not fit the H200's 320 s), estimated from the costs
    # measured there: the run took 332 s.
    assert plan["workload"]["repeats"] == 1
    assert plan["estimate_s"] == pytest.approx(330, abs=10)
    assert plan["estimate_s"] < plan["max_wall_s"] < 600
    bad = _ab_dry_run(tmp_path, "--arms", "tier,lmcache")
    assert bad.returncode != 0 and "unknown" in bad.stderr


def test_ab_offload_refuses_without_a_gpu(ab, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ab, "gpu_info", lambda: None)
    assert ab.main(["--out", str(tmp_path)]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
    assert not list(tmp_path.glob("ab_offload_*.json"))


def test_ab_offload_arms_as_vllm_reads_them(ab):
    """vLLM 0.32 parses the vLLM arms' flags, and its connector sources read
    the keys the plan sets (read as text: nothing of CUDA imported)."""
    import importlib.util

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = ab.parse_args(["--arms", "none,simple_lazy,offloading"])
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    model = ab.model_path(args)
    for arm, check in (
        ("simple_lazy", lambda e: e.kv_transfer_config.kv_connector_extra_config),
        ("offloading", lambda e: (e.kv_offloading_size, e.kv_offloading_backend)),
    ):
        engine = EngineArgs.from_cli_args(
            parser.parse_args(ab.server_cmd(arm, model, args))
        )
        assert engine.kv_cache_memory_bytes == 16 << 20
        assert engine.max_num_batched_tokens == 512
        got = check(engine)
        if arm == "simple_lazy":
            assert engine.kv_transfer_config.kv_connector == (
                "SimpleCPUOffloadConnector"
            )
            assert got == {"cpu_bytes_to_use": 256 << 20, "lazy_offload": True}
        else:
            assert got == (0.25, "native")
    root = Path(importlib.util.find_spec("vllm").origin).parent
    simple = (
        root / "distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py"
    ).read_text()
    assert 'extra_config.get("lazy_offload"' in simple
    assert 'extra_config.get("cpu_bytes_to_use"' in simple
    post = (root / "config/vllm.py").read_text()
    assert 'config_connector = "OffloadingConnector"' in post
    assert '{"cpu_bytes_to_use": kv_offloading_size * (1 << 30)}' in post


def _ab_record(arm, rep, conc, texts, req_s, hits, queries, level="high"):
    """One throughput run as ab_offload records it (figures made up)."""
    summary = dict.fromkeys(
        ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "out_tok_per_s"),
        1.0,
    )
    summary["req_per_s"] = req_s
    delta = {
        "vllm:external_prefix_cache_hits_total": hits,
        "vllm:external_prefix_cache_queries_total": queries,
        "vllm:prompt_tokens_total": 1000.0,
    }
    return {
        "arm": arm, "level": level, "concurrency": conc, "repeat": rep,
        "summary": summary, "texts": texts, "delta": delta,
    }  # fmt: skip


def test_ab_offload_figures(ab):
    runs = []
    for rep in (0, 1):
        for arm, req_s, hits, text in (
            ("none", 2.0, 0.0, ["a", "b"]),
            ("tier", 3.0, 500.0, ["a", "b"]),
            ("simple_lazy", 2.5, 250.0, ["a", "x"]),
        ):
            r = _ab_record(arm, rep, 4, text, req_s, hits, 1000.0)
            r["hits"] = ab.hit_rate(r.pop("delta"))
            runs.append(r)
    runs.append({"arm": "tier", "level": "high", "concurrency": 8, "repeat": 0,
                 "summary": None, "error": "RuntimeError: x"})  # fmt: skip
    out = ab.summarize_runs(runs, ["none", "tier", "simple_lazy"])
    cell = out["high@c4"]
    assert set(out) == {"high@c4"}  # the failed run counts nowhere
    assert cell["tier"]["req_per_s_over_none"]["median"] == 1.5
    assert cell["simple_lazy"]["req_per_s_over_none"]["median"] == 1.25
    assert cell["tier"]["host_hit_rate"]["median"] == 0.5
    assert cell["tier"]["host_hits_over_prompt_tokens"]["median"] == 0.5
    assert cell["tier"]["greedy_vs_none"]["matching"] == 4
    assert cell["simple_lazy"]["greedy_vs_none"] == {
        "matching": 2, "compared": 4, "first_diverging_token_min": None,
    }  # fmt: skip
    assert cell["none_vs_none_repeat0"] == {"matching": 2, "compared": 2}
    probes = [
        {"arm": "none", "probe": 0, "cold_ttft_ms": 10.0, "repeat_ttft_ms": 10.0,
         "repeat_text": "t", "repeat": {"external_hit_tokens": None}},
        {"arm": "tier", "probe": 0, "cold_ttft_ms": 11.0, "repeat_ttft_ms": 4.0,
         "repeat_text": "t", "repeat": {"external_hit_tokens": 384.0}},
        {"arm": "simple_lazy", "probe": 0, "error": "boom"},
    ]  # fmt: skip
    got = ab.summarize_probes(probes, ["none", "tier", "simple_lazy"])
    assert got["tier"]["repeat_ttft_over_none"]["median"] == 0.4
    assert got["tier"]["repeat_host_hit_tokens"] == [384.0]
    assert got["tier"]["repeat_text_equal_to_none"] == "1/1"
    assert got["simple_lazy"]["probes"] == 0
    assert ab.hit_rate({})["host_hit_rate"] is None
    assert ab.device_suffix("NVIDIA H100 80GB HBM3") == "h100"
    assert ab.device_suffix("NVIDIA H200") == "h200"
    facts = ab.log_facts(
        "INFO x GPU KV cache size: 2,048 tokens, Maximum\n"
        "INFO SimpleCPUOffloadScheduler: Allocating 1024 offload blocks (0.25 GB\n"
        "INFO Using TRITON_ATTN attention backend out of potential backends: [x].\n"
    )
    assert facts["device_kv_tokens"] == ["2,048"]
    assert facts["simple_host_blocks"] == ["1024"]
    assert facts["attention_backend"] == ["TRITON_ATTN"]
    assert facts["tier_host_blocks"] is None


def test_stage2_dry_run_plans_the_ab(tmp_path):
    proc = _run_stage2_g(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    assert (
        set(plan["items"]) == {"g"}
        and "SimpleCPUOffloadConnector" in (plan["items"]["g"])
    )
    g = plan["g_plan"]
    assert list(g["arms"]) == ["none", "tier", "simple_lazy", "offloading"]
    assert g["argv"] == ["--arms", "none,tier,simple_lazy,offloading"]
    assert "serving-model" in g["equal_in_every_arm"]["model"]


def _run_stage2_g(tmp_path: Path) -> subprocess.CompletedProcess:
    return _run(
        "stage2.sh", tmp_path, "--dry-run", "--items", "g",
        "--ab-args", "--arms none,tier,simple_lazy,offloading",
    )  # fmt: skip


class _FakeServer:
    """Stands in for a vLLM server: counters grow with every request, and its
    log with one of vLLM's per-step lines (decode-only) per metrics read."""

    made: list[_FakeServer] = []

    def __init__(self, config, cmd_args, env, log):
        self.config, self.args, self.env, self.port = config, cmd_args, env, 1
        self.hits = 0.0
        self.log = "GPU KV cache size: 2,048 tokens, x\nUsing FLASH_ATTN backend.\n"
        _FakeServer.made.append(self)

    def start(self):
        return 1.0

    def stop(self):
        pass

    def log_text(self):
        return self.log

    def log_tail(self):
        return ""

    def reset_prefix_cache(self):
        pass

    def settled_metrics(self):
        self.hits += 0 if self.config == "none" else 384.0
        self.log += (
            "INFO Iteration(7): 0 context requests, 0 context tokens, 16 "
            "generation requests, 16 generation tokens, iteration elapsed time: "
            "2.50 ms, GPU KV cache usage: 40.0%\n"
        )
        return {
            "vllm:external_prefix_cache_hits_total": self.hits,
            "vllm:external_prefix_cache_queries_total": 2 * self.hits + 1,
            "vllm:prompt_tokens_total": 4 * self.hits + 1,
        }


def test_ab_offload_main_with_stand_ins(ab, tmp_path, monkeypatch):
    """The whole sequence (starts, probes, runs, the JSON) with stand-ins for
    the servers and the client: names and the file, not figures."""

    def client(argv, log, timeout):
        n = int(argv[argv.index("--num-prompts") + 1])
        return {
            "ttfts": [0.01] * n,
            "generated_texts": ["same"] * n,
            "input_lens": [416] * n,
            "completed": n,
            "failed": 0,
            "errors": [],
            "request_throughput": 2.0,
            "output_throughput": 100.0,
            "median_itl_ms": 5.0,
            "p99_itl_ms": 9.0,
            "median_ttft_ms": 10.0,
            "p99_ttft_ms": 20.0,
            "median_tpot_ms": 5.0,
            "duration": 3.0,
        }

    monkeypatch.setattr(ab, "ABServer", _FakeServer)
    monkeypatch.setattr(ab.sb, "warm_up", lambda *a: None)
    monkeypatch.setattr(ab.sb, "run_client", client)
    monkeypatch.setattr(ab.sb, "ensure_model", lambda cache: cache)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    args = ab.parse_args(
        ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--model-cache", str(tmp_path / "model"), "--probes", "1"]
    )  # fmt: skip
    args.out.mkdir()
    _FakeServer.made.clear()
    gpu = {"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "x"}
    assert ab.AB(args, gpu, ["--probes", "1"]).main() == 0
    (path,) = (tmp_path / "out").iterdir()
    assert path.name == "ab_offload_h200.json"  # the GPU that ran it
    # Every server without flashinfer's sampler (not carried: engines fail).
    assert {s.config for s in _FakeServer.made} == {"none", "tier", "simple_lazy"}
    assert all(s.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" for s in _FakeServer.made)
    report = json.loads(path.read_text())
    assert report["platform"] == "GPU" and "H200" in report["label"]
    assert report["device"]["name"] == "NVIDIA H200"
    assert len(report["probes"]) == 3 and len(report["runs"]) == 3 * 2 * 1
    assert all("texts" not in r and r["summary"] for r in report["runs"])
    assert report["servers"]["tier"]["cmd"][-2:] == [
        "--kv-host-cache-bytes",
        str(256 << 20),
    ]
    probes = report["summary"]["ttft_probes"]
    assert probes["tier"]["repeat_host_hit_tokens"] == [384.0]
    c8 = report["summary"]["throughput"]["high@c8"]
    assert c8["simple_lazy"]["greedy_vs_none"]["matching"] == 96
    assert c8["tier"]["host_hit_rate"]["median"] == pytest.approx(0.5)
    # Past --max-wall-s, the steps are recorded as skipped, not run.
    args.max_wall_s = 0
    assert ab.AB(args, gpu, []).main() == 3
    report = json.loads(path.read_text())
    assert not report["servers"] and len(report["skipped"]) == 3


# -- issue 36's real-size run (real_size.py): plan, flags, sequence ------------------


@pytest.fixture(scope="module")
def real(ab):
    yield from import_script(GPU / "real_size.py")


def test_real_size_dry_run_plan(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(GPU / "real_size.py"), "--dry-run", "--out",
         str(tmp_path), "--model-cache", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "real_size_plan.json").read_text())
    assert plan["imported_torch_or_vllm"] == []
    # The folder a GPU machine without network serves: config, no weights.
    model = plan["model"]
    assert {"config.json", "tokenizer.json", "kvmem-shape.json"} <= set(
        model["written"]
    )
    assert not any(n.endswith(".safetensors") for n in model["written"])
    config = json.loads((Path(model["folder"]) / "config.json").read_text())
    assert config["num_hidden_layers"] == 32 and config["num_key_value_heads"] == 8
    assert model["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # 128 KiB, bf16
    assert model["block_bytes"] == 2 << 20
    cmds = {arm: info["server"] for arm, info in plan["arms"].items()}
    assert set(cmds) == {"none", "noop", "tier", "simple_lazy", "offloading", "blhnc"}
    for cmd in cmds.values():
        assert _flag(cmd, "--load-format") == "dummy"
        assert _flag(cmd, "--dtype") == "bfloat16"
        assert _flag(cmd, "--attention-backend") == "FLASH_ATTN"
        assert "--enforce-eager" not in cmd  # decode as full CUDA graphs
        cc = json.loads(_flag(cmd, "--compilation-config"))
        assert cc["cudagraph_mode"] == "FULL_DECODE_ONLY" and cc["mode"] == 0
        assert "--enable-logging-iteration-details" in cmd
    for flag in ("--kv-cache-memory-bytes", "--max-model-len", "--block-size",
                 "--max-num-batched-tokens"):  # fmt: skip
        assert len({_flag(c, flag) for c in cmds.values()}) == 1, flag
    host = plan["common"]["host_bytes"]
    assert int(_flag(cmds["tier"], "--kv-host-cache-bytes")) == host
    kv = json.loads(_flag(cmds["simple_lazy"], "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": host,
        "lazy_offload": True,
    }
    assert float(_flag(cmds["offloading"], "--kv-offloading-size")) * (1 << 30) == host
    assert plan["arms"]["blhnc"]["env"] == {"VLLM_KV_CACHE_LAYOUT": "BLHNC"}
    assert plan["common"]["server_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert plan["common"]["device_kv_tokens"] >= plan["common"]["max_model_len"]
    assert plan["workload"]["ttft"]["lengths"] == [4096, 16384, 32768]
    assert plan["workload"]["runs"]["levels"] == {"unique": 0.0, "eighty": 0.8}
    # Most important first: every TTFT of the three connectors before any
    # other step; the tier's 32k TTFT in the first phase.
    steps = [a["step"] for a in plan["schedule"] if a["kind"] == "item"]
    first_other = next(i for i, n in enumerate(steps) if not n.startswith("ttft"))
    assert {n.split()[-1] for n in steps[:first_other]} == {
        "tier", "simple_lazy", "offloading",
    }  # fmt: skip
    assert len(steps[:first_other]) == 9
    assert steps.index("profile unique #0 noop") < steps.index("layout unique #0 blhnc")
    # At most three servers at once; the first phase's start together.
    live: set[str] = set()
    for a in plan["schedule"]:
        if a["kind"] == "start":
            live |= set(a["arms"])
        elif a["kind"] == "stop":
            live -= set(a["arms"])
        assert len(live) <= plan["max_live"] == 3
    assert plan["schedule"][0] == {
        "kind": "start", "arms": ["tier", "simple_lazy", "offloading"],
        "estimate_s": 95.0,
    }  # fmt: skip
    # The estimate (measured base costs, assumed 8B parts) fits --max-wall-s.
    assert plan["estimate_fits_max_wall"] and plan["estimate_s"] <= 480
    assert plan["output"].startswith("$OUT/real_size_<gpu>.json")


def test_real_size_servers_as_vllm_reads_them(real, tmp_path):
    """vLLM 0.32 parses every arm's server flags (the tier's flag is the
    plugin's, checked in the plan test)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = real.parse_args(["--model-cache", str(tmp_path)])
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for arm in ("none", "noop", "simple_lazy", "offloading", "blhnc"):
        engine = EngineArgs.from_cli_args(parser.parse_args(real.server_cmd(arm, args)))
        assert str(getattr(engine.attention_backend, "name", engine.attention_backend))
        assert "FLASH_ATTN" in str(engine.attention_backend)
        assert engine.load_format == "dummy" and not engine.enforce_eager
        assert engine.kv_cache_memory_bytes == 36864 * 128 * 1024
        assert engine.compilation_config.cudagraph_capture_sizes == [
            1, 2, 4, 8, 16, 24, 32,
        ]  # fmt: skip
        assert engine.enable_logging_iteration_details
    eager = real.parse_args(["--model-cache", str(tmp_path), "--eager"])
    assert "--enforce-eager" in real.server_cmd("none", eager)
    with pytest.raises(SystemExit):
        real.parse_args(["--ttft-lens", "65536"])  # beyond --max-model-len


def test_real_size_main_with_stand_ins(real, tmp_path, monkeypatch):
    """The whole sequence with stand-ins for the servers and the client: the
    GPU-named, GPU-labelled file, each step's records, the summaries, the
    flashinfer switch in every server, skipping past --max-wall-s."""

    def client(argv, log, timeout):
        n = int(argv[argv.index("--num-prompts") + 1])
        plen = int(argv[argv.index("--prefix-repetition-prefix-len") + 1])
        return {
            "ttfts": [plen / 1e6] * n, "generated_texts": ["t"] * n,
            "input_lens": [plen + 32] * n, "completed": n, "failed": 0,
            "errors": [], "request_throughput": 2.0, "output_throughput": 99.0,
            "median_itl_ms": 8.0, "p99_itl_ms": 9.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 60.0, "median_tpot_ms": 8.0, "duration": 3.0,
        }  # fmt: skip

    monkeypatch.setattr(real.ab, "ABServer", _FakeServer)
    monkeypatch.setattr(real.sb, "warm_up", lambda *a: None)
    monkeypatch.setattr(real.sb, "run_client", client)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    args = real.parse_args(
        ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--model-cache", str(tmp_path / "models")]
    )  # fmt: skip
    args.out.mkdir()
    _FakeServer.made.clear()
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "x"}
    assert real.RealSize(args, gpu, []).main() == 0
    (path,) = (tmp_path / "out").iterdir()
    assert path.name == "real_size_h100.json"
    report = json.loads(path.read_text())
    assert report["platform"] == "GPU" and "NVIDIA H100" in report["label"]
    default_arms = set(real.ARMS) - set(real.SERIES_ARMS)  # asked for by name
    assert {s.config for s in _FakeServer.made} == default_arms
    assert all(s.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" for s in _FakeServer.made)
    assert len(report["ttft"]) == 9 + 3 and not report["skipped"]
    ttft = report["summary"]["ttft"]
    assert ttft["tier"]["32768"]["repeat_host_hit_tokens"] == [384.0]
    assert ttft["tier"]["4096"]["repeat_over_none_recompute"] == pytest.approx(1.0)
    profile = report["summary"]["profile"]
    assert set(profile) == default_arms
    assert profile["noop"]["decode_step_host_ms_p50"] == 2.5  # vLLM's step lines
    assert profile["tier"]["itl_p50_over_noop"] == 1.0
    cells = report["summary"]["throughput"]
    assert set(cells) == {"unique@c16", "eighty@c16"}
    assert set(cells["eighty@c16"]) - {"none_vs_none_repeat0"} == {
        "none", "tier", "simple_lazy",
    }  # fmt: skip
    assert all("texts" not in r for r in report["runs"])
    # Past --max-wall-s nothing starts; every start and step is recorded.
    args.max_wall_s = 0
    assert real.RealSize(args, gpu, []).main() == 3
    report = json.loads(path.read_text())
    assert not report["servers"] and not report["runs"]
    assert len(report["skipped"]) == len(real.schedule(args)) - sum(
        a.kind == "stop" for a in real.schedule(args)
    )


def test_stage2_dry_run_plans_the_real_size_run(tmp_path):
    proc = _run(
        "stage2.sh", tmp_path, "--dry-run", "--items", "h",
        "--real-args", "--max-wall-s 400",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    h = plan["h_plan"]
    assert h["argv"] == ["--max-wall-s", "400"] and h["max_wall_s"] == 400
    assert not h["estimate_fits_max_wall"]  # what a short cap will skip
    assert plan["estimate_s"]["h"] == h["estimate_s"]
    assert "real_size" in plan["items"]["h"]


def test_real_size_series_arm(real, tmp_path, monkeypatch):
    """lazy+series: simple_lazy's connector on the series' vLLM copy (first on
    PYTHONPATH, no plugin); its copy is built once before it starts, and an
    arm whose copy cannot be built does not start while the others run."""
    tree = tmp_path / "intree"
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "--model-cache", str(tmp_path / "models"), "--series-tree", str(tree),
            "--steps", "throughput", "--max-live", "4",
            "--throughput-arms", "none,tier,simple_lazy,simple_lazy_series",
            ]  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", f"/site{os.pathsep}{ROOT}")
    args = real.parse_args(argv)
    plan = real.build_plan(args)
    series, lazy = plan["arms"]["simple_lazy_series"], plan["arms"]["simple_lazy"]
    assert series["server"] == lazy["server"]  # the same connector and flags
    assert series["env"] == {
        "VLLM_PLUGINS": "",
        "PYTHONPATH": f"{tree}{os.pathsep}/site",
    }
    assert plan["series_tree"]["late_spill_pr"] == "simple_cpu_offload_late_spill"
    # One start of four servers (an H200 holds them), the copy's build in the
    # estimate; without the arm no build is counted.
    assert [a["arms"] for a in plan["schedule"] if a["kind"] == "start"] == [
        ["none", "tier", "simple_lazy", "simple_lazy_series"]
    ]
    plain = real.build_plan(real.parse_args(argv[:-2]))
    assert plain["series_tree"] is None and "simple_lazy_series" not in plain["arms"]
    assert plan["estimate_s"] > plain["estimate_s"]
    monkeypatch.setattr(real.ab, "ABServer", _FakeServer)
    monkeypatch.setattr(real.sb, "warm_up", lambda *a: None)
    monkeypatch.setattr(real.sb, "run_client", lambda argv, log, timeout: {
        "ttfts": [0.01] * 48, "generated_texts": ["t"] * 48, "input_lens": [2176] * 48,
        "completed": 48, "failed": 0, "errors": [], "request_throughput": 2.0,
        "output_throughput": 99.0, "median_itl_ms": 8.0, "p99_itl_ms": 9.0,
        "median_ttft_ms": 30.0, "p99_ttft_ms": 60.0, "median_tpot_ms": 8.0,
        "duration": 3.0})  # fmt: skip
    builds = []

    def build(dest, *a, **kw):
        builds.append(dest)
        return {"tree": str(dest), "patches": ["0001.patch"]}

    monkeypatch.setattr(real.series_tree, "build", build)
    gpu = {"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "x"}
    args.out.mkdir()
    _FakeServer.made.clear()
    assert real.RealSize(args, gpu, argv).main() == 0
    assert builds == [tree]
    made = {s.config: s for s in _FakeServer.made}
    assert made["simple_lazy_series"].env["PYTHONPATH"].split(os.pathsep)[0] == str(
        tree
    )
    assert made["simple_lazy_series"].env["VLLM_PLUGINS"] == ""
    report = json.loads((args.out / "real_size_h200.json").read_text())
    assert report["series_tree"]["tree"] == str(tree)
    assert "simple_lazy_series" in report["summary"]["throughput"]["eighty@c16"]

    def broken(*a, **kw):
        raise RuntimeError("no git on this machine and no carried series")

    monkeypatch.setattr(real.series_tree, "build", broken)
    _FakeServer.made.clear()
    assert real.RealSize(args, gpu, argv).main() == 1  # an arm did not start
    report = json.loads((args.out / "real_size_h200.json").read_text())
    assert "no git" in report["servers"]["simple_lazy_series"]["error"]
    assert {s.config for s in _FakeServer.made} == {"none", "tier", "simple_lazy"}
    assert any("simple_lazy_series" in s for s in report["skipped"])


# -- the series' vLLM copy (series_tree.py) ------------------------------------------


@pytest.fixture(scope="module")
def series_tree():
    yield from import_script(GPU / "series_tree.py")


def _tree_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def test_series_tree_with_and_without_git(series_tree, tmp_path):
    """The lent machine may lack git: the patches prepared here and carried,
    applied in Python, give the tree git gives; a tree is reused while the
    vLLM, the PRs and the generator are the same; a patch whose context is
    not in the tree is refused by name, before anything is written."""
    carried = tmp_path / "carried"
    made = series_tree.prepare(carried)
    assert "simple_cpu_offload_late_spill" in made["order"]
    assert len(made["patches"]) == len(made["order"])
    with_git = series_tree.build(tmp_path / "git", use_git=True)
    assert with_git["applied_with"].startswith("git") and not with_git["reused"]
    store = tmp_path / "store"
    without = series_tree.build(
        tmp_path / "py", use_git=False, carried=carried, store=store
    )
    assert without["applied_with"].startswith("python")
    assert (store / "kvmem-series.json").is_file()  # taken out of the checkout
    assert without["patches"] == with_git["patches"]
    assert _tree_files(tmp_path / "git") == _tree_files(tmp_path / "py")
    # vLLM's Python files copied, everything else linked to the source.
    assert (tmp_path / "py" / "vllm" / "v1" / "core" / "block_pool.py").is_file()
    assert series_tree.build(tmp_path / "git", use_git=True)["reused"]
    # No git and nothing carried: said so, with what to do.
    with pytest.raises(RuntimeError, match="series_tree.py prepare"):
        series_tree.build(
            tmp_path / "none", use_git=False, carried=tmp_path / "nothing",
            store=tmp_path / "nostore",
        )  # fmt: skip
    # A hunk whose context is not there refuses the patch; nothing written.
    victim = tmp_path / "py" / "vllm" / "v1" / "core" / "block_pool.py"
    victim.write_text(victim.read_text().replace("class BlockPool", "class Pool"))
    patch = next(carried.glob("*Late-spills*.patch"))
    before = _tree_files(tmp_path / "py")
    with pytest.raises(RuntimeError, match=f"{patch.name}: vllm/v1/core/block_pool"):
        series_tree.python_apply(
            tmp_path / "py",
            patch,
            series_tree._intree().absent_vllm_tests(tmp_path / "py", patch),
        )
    with pytest.raises(RuntimeError, match="not in the tree"):
        series_tree.python_apply(tmp_path / "py", patch)  # vLLM's tests absent
    assert _tree_files(tmp_path / "py") == before
    # An arm's path: the tree first, the checkout (the plugin) never.
    path = series_tree.pythonpath(Path("/t"), f"/site{os.pathsep}{ROOT}")
    assert path == f"/t{os.pathsep}/site"


# -- issue 42's late-spill check (late_spill.py) -------------------------------------


@pytest.fixture(scope="module")
def late():
    yield from import_script(GPU / "late_spill.py")


def test_late_spill_dry_run_plan(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(GPU / "late_spill.py"), "--dry-run", "--out",
         str(tmp_path), "--model-cache", str(tmp_path / "models")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "late_spill_plan.json").read_text())
    assert plan["imported_torch_or_vllm"] == []
    assert set(plan["arms"]) == {"none", "tier", "lazy_series"}
    assert plan["arms"]["tier"]["kv_transfer_config"]["kv_connector"] == (
        "KVMemHostTierConnector"
    )
    lazy = plan["arms"]["lazy_series"]["kv_transfer_config"]
    assert lazy["kv_connector"] == "SimpleCPUOffloadConnector"
    assert lazy["kv_connector_extra_config"]["lazy_offload"] is True
    # V2 first (the GPU default no CPU run has seen), the release's engines
    # before the series' copy; both workloads in each process.
    procs = [(p["runner"], p["tree"]) for p in plan["processes"]]
    assert procs == [("v2", "release"), ("v2", "series"),
                     ("v1", "release"), ("v1", "series")]  # fmt: skip
    for p in plan["processes"]:
        env = p["env"]
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == {"v2": "1", "v1": "0"}[p["runner"]]
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # counters in-process
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        first = env["PYTHONPATH"].split(os.pathsep)[0]
        if p["tree"] == "series":
            assert env["VLLM_PLUGINS"] == "" and first == "/tmp/kvmem-intree"
            assert str(ROOT) not in env["PYTHONPATH"].split(os.pathsep)
            assert [c for c, _ in p["engines"]] == ["plain", "mixed_fp8"]
        else:
            assert "VLLM_PLUGINS" not in env
            assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert plan["trees"]["series"]["only"] is None  # the whole series
    mixed = plan["cases"]["mixed_fp8"]
    assert mixed["llm"] == {"kv_cache_dtype": "fp8"} and mixed["skip_half_layers"]
    assert len(mixed["rounds"]) == 4  # a device revisit: copy-on-write
    assert plan["estimate_fits_max_wall"] and plan["estimate_s"] <= 400
    assert plan["output"].startswith("$OUT/late_spill_<gpu>.json")


def test_late_spill_arguments(late, tmp_path, monkeypatch):
    cpu = late.parse_args(["--cpu"])
    assert cpu.runner_list == ["v1"] and cpu.case_list == ["plain"]
    assert [p["runner"] for p in late.processes(cpu)] == ["v1", "v1"]
    pr6 = late.parse_args(["--arms", "none,lazy_pr6", "--trees", str(tmp_path)])
    (tree,) = late.build_plan(pr6)["trees"].values()
    assert tree["only"] == ["simple_cpu_offload_late_spill"]
    assert tree["folder"] == str(tmp_path / "kvmem-intree-pr6")
    for bad in (["--cpu", "--runners", "v2"], ["--arms", "tier"],
                ["--arms", "none,lazy"], ["--cases", "fp8"]):  # fmt: skip
        with pytest.raises(SystemExit):
            late.parse_args(bad)
    monkeypatch.setattr(late, "gpu_info", lambda: None)
    assert late.main(["--out", str(tmp_path), "--model", str(tmp_path)]) == 2


def test_late_spill_counts_and_figures(late):
    """The scheduler's outputs counted (late spills of either connector, and
    those the same step zeroes or copies on write into), and each arm's
    figures against its runner's none."""
    from types import SimpleNamespace as NS

    outputs = iter([
        NS(kv_connector_metadata=NS(spill_gpu_blocks=[3, 4]),
           new_block_ids_to_zero=[4, 9], kv_cache_block_copies=None),
        NS(kv_connector_metadata=NS(evict_saves=[(5, 0), (6, 1)]),
           new_block_ids_to_zero=None,
           kv_cache_block_copies=[NS(src_block_id=1, dst_block_id=6)]),
        NS(kv_connector_metadata=None, new_block_ids_to_zero=[7],
           kv_cache_block_copies=[]),
    ])  # fmt: skip
    sched = NS(schedule=lambda: next(outputs))
    spy = late.StepSpy(sched)
    for _ in range(3):
        sched.schedule()
    got = spy.report()
    assert got["steps"] == 3 and got["late_spills"] == 4 and got["spill_steps"] == 2
    assert got["late_spills_zeroed_same_step"] == 1  # block 4
    assert got["late_spills_cow_same_step"] == 1  # block 6
    assert got["zeroed_blocks"] == 3 and got["cow_copies"] == 1
    assert got["overlaps"] == [{"step": 1, "zeroed": [4], "cow": []},
                               {"step": 2, "zeroed": [], "cow": [6]}]  # fmt: skip

    def engine(arm, tokens, cached, counters=None):
        return {"runner": "v2", "case": "plain", "arm": arm, "tokens": tokens,
                "cached": cached, "kv": {"hash_block_size": 32, "groups": [],
                "needs_kv_cache_zeroing": False, "use_v2_model_runner": True},
                "steps": got, "tier_counters": counters}  # fmt: skip

    same, rounds = [[[1, 2]]] * 3, [[0] * 4, [0] * 4, [96, 96, 96, 0]]
    engines = [
        engine("none", same, [[0] * 4] * 3),
        engine("tier", same, rounds,
               {"scheduler": {"spills_skipped_overwritten": 2,
                              "bytes_saved_at_eviction": 8}}),
        engine("lazy_series", [[[1, 3]]] * 3, rounds),
        {"runner": "v2", "case": "plain", "arm": "lazy_pr6", "error": "x"},
    ]  # fmt: skip
    args = late.parse_args(["--runners", "v2", "--cases", "plain",
                            "--arms", "none,tier,lazy_series,lazy_pr6"])  # fmt: skip
    cell = late.summarize(engines, args)["v2/plain"]
    assert cell["v2_runner"] is True and cell["none_revisit_cached"] == [0] * 4
    tier, lazy = cell["arms"]["tier"], cell["arms"]["lazy_series"]
    assert tier["tokens_equal_to_none"] and not lazy["tokens_equal_to_none"]
    assert tier["revisit_host_hit_rate"] == 0.75  # 288 of 4 x 96 tokens
    assert tier["tier_spills_skipped"] == {"scheduler.spills_skipped_overwritten": 2}
    assert tier["tier_saved_at_eviction_bytes"] == 8
    assert lazy["tier_spills_skipped"] is None and lazy["late_spills"] == 4
    assert cell["arms"]["lazy_pr6"] is None  # failed: no figures


def test_late_spill_skips_and_unbuilt_trees(late, tmp_path, monkeypatch):
    """Nothing starts past --max-wall-s (every engine recorded as skipped,
    exit 3); an arm whose vLLM copy cannot be built is recorded as failed
    (exit 1), and the JSON is labelled as a CPU run here."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["--cpu", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"),
            "--model", str(model), "--max-wall-s", "0"]  # fmt: skip
    (tmp_path / "out").mkdir()
    built = []

    def build(dest, **kw):
        built.append((dest, kw))
        return {"tree": str(dest)}

    monkeypatch.setattr(late.series_tree, "build", build)
    assert late.run(late.parse_args(argv), None, argv) == 3
    report = json.loads((tmp_path / "out" / "late_spill_cpu.json").read_text())
    assert report["platform"] == "CPU" and "not a GPU figure" in report["label"]
    assert built[0][1] == {"only": None, "cpu_scaffolding": True}
    assert [e["skipped"] for e in report["engines"]] == ["past --max-wall-s"] * 3
    assert report["summary"]["v1/plain"]["arms"] == dict.fromkeys(
        ("none", "tier", "lazy_series")
    )

    def broken(dest, **kw):
        raise RuntimeError("no git on this machine and no carried series")

    monkeypatch.setattr(late.series_tree, "build", broken)
    assert late.run(late.parse_args(argv), None, argv) == 1
    report = json.loads((tmp_path / "out" / "late_spill_cpu.json").read_text())
    lazy = next(e for e in report["engines"] if e["arm"] == "lazy_series")
    assert lazy["error"].startswith("tree not built: RuntimeError: no git")


def test_stage2_dry_run_plans_the_late_spill_check(tmp_path):
    proc = _run(
        "stage2.sh", tmp_path, "--dry-run", "--items", "i",
        "--late-args", "--max-wall-s 200",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    i = plan["i_plan"]
    assert i["argv"] == ["--max-wall-s", "200"] and i["max_wall_s"] == 200
    assert not i["estimate_fits_max_wall"]  # what a short cap will skip
    assert plan["estimate_s"]["i"] == i["estimate_s"]
    assert "late_spill" in plan["items"]["i"]
    # stage 2's tiny model, shared with items a-f
    assert i["model"].endswith("tiny-model") and "series_tree.py take" in proc.stdout


@pytest.mark.engine
def test_late_spill_cpu_rehearsal(model_8l, tmp_path):
    """Model Runner V1 on CPU (V2 needs Triton): the plugin's tier and lazy
    offload on the series' vLLM (with the generator's CPU scaffolding), each
    against no offload on the CPU contract's workload."""
    proc = subprocess.run(
        [sys.executable, str(GPU / "late_spill.py"), "--cpu",
         "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--trees", str(tmp_path / "trees"), "--model", str(model_8l)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "late_spill_cpu.json").read_text())
    assert report["platform"] == "CPU" and "not a GPU figure" in report["label"]
    series = next(p for p in report["processes"] if p["name"] == "v1_series")
    assert series["vllm_file"].startswith(str(tmp_path / "trees" / "kvmem-intree"))
    assert {p["env_runner"] for p in report["processes"]} == {"0"}
    cell = report["summary"]["v1/plain"]
    assert cell["v2_runner"] is False and cell["zeroing"] is False
    assert cell["none_revisit_cached"] == [0, 0, 0, 0]  # nothing left on device
    assert cell["none_worker_connector"] is None  # a fresh engine each time
    tier = next(e for e in report["engines"] if e["arm"] == "tier")
    assert tier["kv"]["worker_connector"] == "KVMemHostTierConnector"
    assert cell["arms"]["tier"]["tier_enabled"] is True
    for arm in ("tier", "lazy_series"):
        got = cell["arms"][arm]
        assert got["tokens_equal_to_none"], arm
        assert got["revisit_host_hit_rate"] == 1.0, arm
        assert got["late_spills"] > 0, arm  # the workload forces late spills
        assert got["late_spills_zeroed_same_step"] == 0, arm  # V1, one group


@pytest.fixture(scope="module")
def events():
    yield from import_script(GPU / "events_disk.py")


@pytest.fixture(scope="module")
def kv_check():
    yield from import_script(ROOT / "benchmarks" / "kv_events_check.py")


def test_events_disk_dry_run_plan(tmp_path, kv_check):
    proc = subprocess.run(
        [sys.executable, str(GPU / "events_disk.py"), "--dry-run", "--out",
         str(tmp_path), "--arms", "tier_disk,control", "--requests", "300"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "events_disk_plan.json").read_text())
    assert plan["imported_torch_or_vllm"] == []
    assert list(plan["arms"]) == ["tier_disk", "control"]
    assert plan["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    # Each arm's command line as the check parses it.
    disk = kv_check.parse_args(plan["arms"]["tier_disk"]["argv"][1:])
    assert disk.requests == 300 and disk.host_blocks == 32
    assert disk.disk_dir is not None and not disk.no_host_tier
    control = kv_check.parse_args(plan["arms"]["control"]["argv"][1:])
    assert control.no_host_tier and control.disk_dir is None
    # One file back from the machine: the checks' JSONs stay in --work.
    assert all(
        Path(a["argv"][a["argv"].index("--out") + 1]).parent.parent.name
        == "events_disk"
        for a in plan["arms"].values()
    )
    assert plan["estimate_s"] == 2 * plan["arms"]["control"]["estimate_s"]
    assert plan["estimate_fits_max_wall"] and plan["output"].startswith(
        "$OUT/events_disk_<gpu>.json"
    )


def test_events_disk_arguments(events):
    with pytest.raises(SystemExit):
        events.parse_args(["--arms", "tier,control"])  # no such arm
    with pytest.raises(SystemExit):
        events.parse_args(["--requests", "0"])
    assert events.parse_args([]).arm_list == ["tier_disk"]


def test_events_disk_figures_from_a_recorded_check(events):
    """The pass rule on the CPU run of 2026-11-28 (400 requests, disk tier
    behind a 32-block host tier), then on the same run with what a failure
    looks like."""
    check = json.loads(
        (ROOT / "benchmarks/results/kv_events_check_disk_cpu.json").read_text()
    )
    got = events.arm_figures("tier_disk", check)
    assert got["passed"] and got["platform"] == "CPU"
    assert got["mismatches"] == 0 and got["disk_hits"] > 0
    assert got["predicted_host_hits"] > 0 and got["predicted_storage_hits"] > 0
    bad = json.loads(json.dumps(check))
    bad["summary"]["mismatches"] = 3
    bad["disk_metrics"]["vllm:kvmem_host_disk_hits_total"] = 0.0
    got = events.arm_figures("tier_disk", bad)
    assert not got["passed"] and got["why"] == "3 mismatches; no disk hit"
    # The control has no disk tier: no disk hit is expected of it.
    control = json.loads(json.dumps(check))
    control["disk_metrics"] = None
    control["summary"]["predicted_host_hits"] = 0
    control["summary"]["predicted_storage_hits"] = 0
    assert events.arm_figures("control", control)["passed"]
    assert events.arm_figures("control", None) == {"passed": False, "why": "no JSON"}


def test_stage2_dry_run_plans_the_events_check(tmp_path):
    proc = _run(
        "stage2.sh", tmp_path, "--dry-run", "--items", "j",
        "--events-args", "--arms tier_disk,control --max-wall-s 200",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    j = plan["j_plan"]
    assert j["argv"] == ["--arms", "tier_disk,control", "--max-wall-s", "200"]
    assert not j["estimate_fits_max_wall"]  # the control is skipped then
    assert plan["estimate_s"]["j"] == j["estimate_s"]
    assert "events_disk" in plan["items"]["j"]
    # The check's own 2-layer model, beside stage 2's tiny model
    model_cache = j["arms"]["tier_disk"]["argv"].index("--model-cache") + 1
    assert j["arms"]["tier_disk"]["argv"][model_cache].endswith("events-model")


@pytest.mark.engine
def test_events_disk_cpu_rehearsal(model_8l, tmp_path):
    """The GPU item on CPU: one server with the host and disk tiers, the
    check's JSON inside the one file, labelled CPU from vLLM's platform."""
    proc = subprocess.run(
        [sys.executable, str(GPU / "events_disk.py"), "--cpu", "--requests", "80",
         "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--model", str(model_8l)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["events_disk_cpu.json"]
    report = json.loads((tmp_path / "out" / "events_disk_cpu.json").read_text())
    assert report["platform"] == "CPU" and "not a GPU figure" in report["label"]
    arm = report["arms"]["tier_disk"]
    assert arm["exit"] == 0 and arm["figures"]["passed"]
    assert arm["check"]["platform"] == "CPU"  # vLLM's own detection
    assert arm["figures"]["mismatches"] == 0 and arm["figures"]["disk_hits"] > 0
    assert arm["check"]["events"]["events"]["BlockStored/STORAGE"] > 0


def test_no_machine_paths_in_the_project():
    """A development machine's folders belong to no file of the project
    (recorded results keep where they ran; they are data, not read here)."""
    bad = []
    for folder in ("benchmarks", "scripts", "docs", "vllm_kvmem", "kvmem_tools"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".md", ".sh", ".txt", ".toml"}:
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines()):
                if any(m in line for m in ("/work/", "/home/", "/root/")):
                    bad.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    assert not bad, "\n".join(bad)
