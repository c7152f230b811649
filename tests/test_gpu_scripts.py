"""scripts/gpu/ on a machine without a GPU: what a CPU can check.

- pieces: split and rebuild round trip with sha256 (small synthetic files),
  a corrupted or missing piece refused by name, partial rebuilds;
- the requirement diff of ``fetch_wheels.py`` on a fixed synthetic pip
  report: markers, extras, the fixed point (requirements of packages that
  are not carried do not count), plans, estimates, the rendered report;
- ``install_pieces.py status`` and ``check``;
- ``stage1.sh --dry-run`` and ``stage2.sh --dry-run``;
- issue 30's A/B (``ab_offload.py``): its dry run (the plan, no torch or
  vLLM imported), its arms' flags as vLLM 0.32 parses them and the connector
  keys its sources read, and its figures from synthetic runs.

No network, nothing downloaded.
"""

from __future__ import annotations

import dataclasses
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
    # 14 piece calls do not fit 15 device minutes; vLLM alone (5) does.
    assert not report["plans"]["core"]["estimate"]["fits_with_stage1"]
    assert report["chosen"] == "torch211"
    text = fetch.render_markdown(report)
    assert "**Chosen plan: `torch211`.**" in text and "- a note" in text
    assert "| torch | 2.13.0 | 2.11.0 | torch | 500.0 |" in text
    assert "fits 15 min" in text and "15 device minutes per session" in text
    # With 30 device minutes, the most complete plan that fits.
    wide = report_for(dataclasses.replace(model, device_budget_s=30 * 60.0))
    assert wide["chosen"] == "full"
    assert "fits 30 min" in fetch.render_markdown(wide)


def test_the_device_time_model_takes_item_g_from_the_ab_script(fetch, ab):
    """Stage 2's first run in the model is issue 30's A/B, timed by
    ab_offload.py's own estimate for its default arms."""
    assert fetch.CallModel().stage2_runs_s == ab.estimate_s(ab.parse_args([]))


def test_committed_size_report_is_consistent(fetch):
    """The committed report came from a real run and says what it chose."""
    report = json.loads((GPU / "size_report.json").read_text())
    assert set(report["plans"]) == set(fetch.PLANS)
    assert report["chosen"] in fetch.PLANS
    full = report["plans"]["full"]["estimate"]
    assert full["mib"] > report["plans"][report["chosen"]]["estimate"]["mib"]
    # Written with today's device limits, and its choice fits them.
    assert report["call_model"] == dataclasses.asdict(fetch.CallModel())
    assert report["plans"][report["chosen"]]["estimate"]["fits_with_stage1"]
    assert report["pieces"]["plan"] == report["chosen"]
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
    # The plan that fits a 15-minute session is the default.
    assert "vLLM 0.32.0 plan torch211 items ae" in proc.stdout
    bad = _run("stage2.sh", tmp_path, "--dry-run", "--plan", "lean")
    assert bad.returncode == 2 and "--plan lean: torch211 or core" in bad.stdout
    plan = json.loads((tmp_path / "stage2_plan.json").read_text())
    assert set(plan["items"]) == {"a", "e"}
    assert all(plan["items"].values())
    assert "UNVERIFIED" in (GPU / "stage2.sh").read_text()
    bad = _run("stage2.sh", tmp_path, "--dry-run", "--items", "az")
    assert bad.returncode != 0 and "unknown items" in bad.stdout + bad.stderr


def test_rehearsal_of_torch211_refuses_without_its_pieces(tmp_path):
    env = dict(os.environ, PIECES=str(tmp_path / "none"))
    proc = subprocess.run(
        ["bash", str(GPU / "rehearse_torch211.sh"), str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run scripts/gpu/fetch_wheels.py first" in proc.stdout


@pytest.fixture(scope="module")
def rehearse():
    yield from import_script(GPU / "rehearse_torch211.py")


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
    assert "UNVERIFIED" in plan["status"]
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
    assert "_h100" in plan["output"]
    # The default leaves the third arm out (the issue: "if device time allows").
    proc = _ab_dry_run(tmp_path)
    plan = json.loads((tmp_path / "ab_offload_plan.json").read_text())
    assert list(plan["arms"]) == ["none", "tier", "simple_lazy"]
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
    """Stands in for a vLLM server: counters grow with every request."""

    def __init__(self, config, cmd_args, env, log):
        self.config, self.args, self.env, self.port = config, cmd_args, env, 1
        self.hits = 0.0

    def start(self):
        return 1.0

    def stop(self):
        pass

    def log_text(self):
        return "GPU KV cache size: 2,048 tokens, x"

    def log_tail(self):
        return ""

    def reset_prefix_cache(self):
        pass

    def settled_metrics(self):
        self.hits += 0 if self.config == "none" else 384.0
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
    args = ab.parse_args(
        ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
         "--model-cache", str(tmp_path / "model"), "--probes", "1"]
    )  # fmt: skip
    args.out.mkdir()
    gpu = {"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "x"}
    assert ab.AB(args, gpu, ["--probes", "1"]).main() == 0
    (path,) = (tmp_path / "out").iterdir()
    assert path.name == "ab_offload_h100.json"
    report = json.loads(path.read_text())
    assert report["platform"] == "GPU" and "H100" in report["label"]
    assert len(report["probes"]) == 3 and len(report["runs"]) == 3 * 2 * 2
    assert all("texts" not in r and r["summary"] for r in report["runs"])
    assert report["servers"]["tier"]["cmd"][-2:] == [
        "--kv-host-cache-bytes",
        str(256 << 20),
    ]
    probes = report["summary"]["ttft_probes"]
    assert probes["tier"]["repeat_host_hit_tokens"] == [384.0]
    c8 = report["summary"]["throughput"]["high@c8"]
    assert c8["simple_lazy"]["greedy_vs_none"]["matching"] == 2 * 96
    assert c8["tier"]["host_hit_rate"]["median"] == pytest.approx(0.5)
    # Past --max-wall-s, the steps are recorded as skipped, not run.
    args.max_wall_s = 0
    assert ab.AB(args, gpu, []).main() == 3
    report = json.loads(path.read_text())
    assert not report["servers"] and len(report["skipped"]) == 3
