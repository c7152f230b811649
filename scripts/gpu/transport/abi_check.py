"""Which binaries can share the GPU machine's libraries: symbol checks.

Carrying torch 2.13 with every CUDA library it pins does not fit the device
budget (``size_report.md``); two smaller plans depend on binary
compatibility, and this script checks it from the wheels' dynamic symbol
tables:

``needs``   (here) the shared libraries torch 2.13 loads by name (``NEEDED``)
            from the CUDA wheels it pins, and every symbol it imports from
            each: ``abi_needs.json``, small enough to commit and carry;
``compare`` (here) those needs against other versions of the CUDA wheels
            (the machine's, inferred from torch 2.11's pins): a preview;
``machine`` (on the GPU machine, Python standard library only) the same
            check against the libraries really installed there, through
            ``dlsym``: the answer that counts;
``vllm``    (here) the symbols vLLM 0.32's compiled extensions import from
            torch, against the libraries of another torch wheel (2.11: can
            vLLM run on the machine's own torch?).

``nm`` (binutils) is needed here, not on the GPU machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

_SO = re.compile(r"\.so(\.\d+)*$")


def _so_members(wheel: Path, wanted: set[str] | None = None) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return [
            n
            for n in z.namelist()
            if _SO.search(n) and (wanted is None or Path(n).name in wanted)
        ]


def _extract(wheel: Path, members: Iterable[str], dest: Path) -> list[Path]:
    with zipfile.ZipFile(wheel) as z:
        return [Path(z.extract(m, dest)) for m in members]


def _nm(path: Path, defined: bool) -> set[str]:
    """Dynamic symbols of a shared library, without version suffixes."""
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(
        ["nm", "-D", flag, str(path)], capture_output=True, text=True, check=False
    ).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if parts:
            names.add(parts[-1].split("@", 1)[0])
    return names


def _needed(path: Path) -> list[str]:
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=False
    ).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def _wheel_label(wheel: Path) -> str:
    name, version = wheel.name.split("-")[:2]
    return f"{name}=={version}"


def needs(torch_wheel: Path, lib_wheels: Sequence[Path]) -> dict:
    """Sonames torch's libraries load from ``lib_wheels`` and the symbols
    they import from each."""
    with tempfile.TemporaryDirectory() as tmp:
        torch_libs = _extract(
            torch_wheel,
            [m for m in _so_members(torch_wheel) if m.startswith("torch/lib/")],
            Path(tmp) / "torch",
        )
        wanted: set[str] = set()
        undefined: dict[str, set[str]] = {}
        for lib in torch_libs:
            wanted |= set(_needed(lib))
            undefined[lib.name] = _nm(lib, defined=False)
        out: dict[str, dict] = {}
        for wheel in lib_wheels:
            members = _so_members(wheel)
            for path in _extract(wheel, members, Path(tmp) / wheel.stem):
                defined = _nm(path, defined=True)
                symbols = sorted(set().union(*undefined.values()) & defined)
                if path.name not in wanted and not symbols:
                    continue
                out[path.name] = {
                    "package": _wheel_label(wheel),
                    "needed_by_name": path.name in wanted,
                    "users": sorted(
                        lib for lib, und in undefined.items() if und & defined
                    ),
                    "symbols": symbols,
                }
                path.unlink()  # cuDNN's libraries are GiBs unpacked
    return {"torch": _wheel_label(torch_wheel), "sonames": out}


def compare(needs_data: dict, lib_wheels: Sequence[Path]) -> dict:
    """``needs_data`` against the libraries of ``lib_wheels``."""
    with tempfile.TemporaryDirectory() as tmp:
        found: dict[str, tuple[str, set[str]]] = {}
        for wheel in lib_wheels:
            wanted = set(needs_data["sonames"])
            for path in _extract(wheel, _so_members(wheel, wanted), Path(tmp)):
                found[path.name] = (_wheel_label(wheel), _nm(path, defined=True))
                path.unlink()
    return _verdict(
        needs_data,
        {k: v[0] for k, v in found.items()},
        lambda so, sym: sym in found[so][1],
    )


def _verdict(needs_data: dict, have: dict[str, str], has_symbol) -> dict:
    rows = {}
    for soname, need in needs_data["sonames"].items():
        if soname not in have:
            rows[soname] = {
                "wanted": need["package"],
                "have": None,
                "missing": None,
                "ok": not need["needed_by_name"] and not need["symbols"],
            }
            continue
        missing = [s for s in need["symbols"] if not has_symbol(soname, s)]
        rows[soname] = {
            "wanted": need["package"],
            "have": have[soname],
            "symbols": len(need["symbols"]),
            "missing": missing,
            "ok": not missing,
        }
    return {
        "torch": needs_data["torch"],
        "ok": all(r["ok"] for r in rows.values()),
        "sonames": rows,
    }


def machine(needs_data: dict, roots: Sequence[Path]) -> dict:
    """The check on the GPU machine: each soname found under ``roots``
    (site-packages), loaded, and every needed symbol looked up by dlsym."""
    index: dict[str, Path] = {}
    for root in roots:
        for path in sorted(root.glob("nvidia/**/lib/*.so*")):
            index.setdefault(path.name, path)
    handles: dict[str, ctypes.CDLL] = {}
    have: dict[str, str] = {}
    for soname in needs_data["sonames"]:
        path = index.get(soname)
        if path is None:
            continue
        try:
            handles[soname] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            have[soname] = str(path)
        except OSError as exc:
            have[soname] = f"{path} (failed to load: {exc})"

    def has_symbol(soname: str, symbol: str) -> bool:
        handle = handles.get(soname)
        return handle is not None and hasattr(handle, symbol)

    return _verdict(needs_data, have, has_symbol)


def vllm(vllm_wheel: Path, torch_wheels: Sequence[Path]) -> dict:
    """For each torch wheel: the symbols vLLM's extensions import that the
    first (reference) torch defines and this one lacks, per extension."""
    with tempfile.TemporaryDirectory() as tmp:
        exts = {
            p.relative_to(Path(tmp) / "vllm").as_posix(): _nm(p, defined=False)
            for p in _extract(vllm_wheel, _so_members(vllm_wheel), Path(tmp) / "vllm")
        }
        defined: dict[str, set[str]] = {}
        for wheel in torch_wheels:
            members = [
                m
                for m in _so_members(wheel)
                if m.startswith("torch/lib/lib") and ("torch" in m or "c10" in m)
            ]
            symbols: set[str] = set()
            for path in _extract(wheel, members, Path(tmp) / wheel.stem):
                symbols |= _nm(path, defined=True)
                path.unlink()
            defined[_wheel_label(wheel)] = symbols
    reference, *others = defined
    out: dict[str, dict] = {"reference": reference, "torch": {}}
    for label in [reference, *others]:
        per_ext = {}
        for ext, und in sorted(exts.items()):
            from_torch = und & defined[reference]
            missing = sorted(from_torch - defined[label])
            per_ext[ext] = {
                "from_torch": len(from_torch),
                "cpp": sum(s.startswith("_Z") for s in from_torch),
                "missing": missing,
            }
        out["torch"][label] = per_ext
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("needs")
    n.add_argument("--torch-wheel", type=Path, required=True)
    n.add_argument("--lib-wheels", type=Path, nargs="+", required=True)
    n.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("--needs", type=Path, required=True)
    c.add_argument("--lib-wheels", type=Path, nargs="+", required=True)
    c.add_argument("--out", type=Path)
    m = sub.add_parser("machine")
    m.add_argument("--needs", type=Path, required=True)
    m.add_argument(
        "--site",
        type=Path,
        nargs="*",
        help="site-packages to search (default: this interpreter's sys.path)",
    )
    m.add_argument("--out", type=Path)
    v = sub.add_parser("vllm")
    v.add_argument("--vllm-wheel", type=Path, required=True)
    v.add_argument(
        "--torch-wheels",
        type=Path,
        nargs="+",
        required=True,
        help="reference torch first (the one vLLM was built for), then others",
    )
    v.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "needs":
        result = needs(args.torch_wheel, args.lib_wheels)
        out = args.out
    elif args.cmd == "compare":
        result = compare(json.loads(args.needs.read_text()), args.lib_wheels)
        out = args.out
    elif args.cmd == "machine":
        roots = args.site or [Path(x) for x in sys.path if x.endswith("-packages")]
        result = machine(json.loads(args.needs.read_text()), roots)
        out = args.out
    else:
        result = vllm(args.vllm_wheel, args.torch_wheels)
        out = args.out
    text = json.dumps(result, indent=1) + "\n"
    if out:
        out.write_text(text)
    summary = {
        k: v for k, v in result.items() if k in ("ok", "torch", "reference")
    } or result
    if args.cmd in ("compare", "machine"):
        for so, row in result["sonames"].items():
            missing = row["missing"]
            print(
                f"{'ok  ' if row['ok'] else 'FAIL'} {so}: wanted {row['wanted']}, "
                f"have {row['have']}, missing "
                f"{'-' if missing is None else len(missing)}"
                + (f" (e.g. {', '.join(missing[:5])})" if missing else "")
            )
        print("overall:", "ok" if result["ok"] else "FAIL")
    elif args.cmd == "vllm":
        for label, per_ext in result["torch"].items():
            bad = {e: len(r["missing"]) for e, r in per_ext.items() if r["missing"]}
            print(f"{label}: extensions missing torch symbols: {bad or 'none'}")
    else:
        print(json.dumps({k: len(v["symbols"]) for k, v in result["sonames"].items()}))
    del summary
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
