"""scripts/gpu/ on a machine without a GPU: what a CPU can check.

- pieces: split and rebuild round trip with sha256 (small synthetic files),
  a corrupted or missing piece refused by name, partial rebuilds;
- the requirement diff of ``fetch_wheels.py`` on a fixed synthetic pip
  report: markers, extras, the fixed point (requirements of packages that
  are not carried do not count), plans, estimates, the rendered report;
- ``install_pieces.py status`` and ``check``;
- ``stage1.sh --dry-run`` and ``stage2.sh --dry-run``.

No network, nothing downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import import_script

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "scripts" / "gpu"


@pytest.fixture(scope="module")
def pieces():
    yield from import_script(GPU / "pieces.py")


@pytest.fixture(scope="module")
def fetch():
    yield from import_script(GPU / "fetch_wheels.py")


@pytest.fixture(scope="module")
def installer():
    yield from import_script(GPU / "install_pieces.py")


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
    report = fetch.build_report(
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
    json.dumps(report)  # JSON-able
    assert report["plans"]["core"]["estimate"]["calls"] == 14  # 800 MiB / 60
    assert report["chosen"] == "full"  # the most complete plan that fits
    text = fetch.render_markdown(report)
    assert "**Chosen plan: `full`.**" in text and "- a note" in text
    assert "| torch | 2.13.0 | 2.11.0 | torch | 500.0 |" in text


def test_committed_size_report_is_consistent(fetch):
    """The committed report came from a real run and says what it chose."""
    report = json.loads((GPU / "size_report.json").read_text())
    assert set(report["plans"]) == set(fetch.PLANS)
    assert report["chosen"] in fetch.PLANS
    full = report["plans"]["full"]["estimate"]
    assert full["mib"] > report["plans"][report["chosen"]]["estimate"]["mib"]
    assert (GPU / "size_report.md").read_text().startswith("# Wheels for vLLM")


# -- the stage scripts ---------------------------------------------------------------


def _run(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(GPU / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_stage1_dry_run(tmp_path):
    proc = _run("stage1.sh", tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    names = {p.name for p in tmp_path.iterdir()}
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
    report = json.loads((tmp_path / "transfer_cpu_dryrun.json").read_text())
    assert report["pageable"]["results"] and report["overlap"]["results"]


def test_stage2_dry_run(tmp_path):
    proc = _run("stage2.sh", tmp_path, "--dry-run", "--items", "ae")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    assert set(plan["items"]) == {"a", "e"}
    assert all(plan["items"].values())
    assert "UNVERIFIED" in (GPU / "stage2.sh").read_text()
    bad = _run("stage2.sh", tmp_path, "--dry-run", "--items", "az")
    assert bad.returncode != 0 and "unknown items" in bad.stdout + bad.stderr
