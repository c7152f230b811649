"""On the GPU machine: take in the wheel pieces each call carries, rebuild
the wheels, install them into a target folder, and check what they require.

Pieces arrive one folder per device call (``.gpu-wheels/<plan>/p001`` ...).
A carried path replaces its whole top-level folder on the machine (found on
the H200 run of 2026-11-26: carrying ``.gpu-wheels/torch211/p002`` deleted
``p001``), so the call that carries a piece must copy it out of the
checkout at once, to a store outside it that stays while the machine is
warm (:data:`STORE`, ``/tmp/kvmem-pieces``; ``KVMEM_PIECE_STORE`` moves
it). So:

``take``    copy the carried piece folders of a plan folder (e.g.
            ``.gpu-wheels/torch211``) into the store (:func:`store_for`:
            ``/tmp/kvmem-pieces/gpu-wheels/torch211``), then report the
            store like ``status``: the command of every call that carries
            a piece;
``status``  which pieces are in a folder (sizes; ``--hash`` for sha256 too)
            and which are still missing: cheap;
``install`` every piece checked (sha256), the wheels rebuilt and checked
            (sha256), then ``pip install --no-index --no-deps --target``;
            prints what it installed; ``--root`` is the store's folder;
``check``   every requirement of the packages in the target folder against
            what this interpreter sees with the target first on the path
            (the machine's own packages for the rest): missing or wrong
            versions, by name. The machine's versions were partly unknown
            when the wheels were chosen; this is where that is settled.

Python standard library (plus ``packaging``, which the machine has) only.
Development tooling for the lent machine, not part of vllm-kvmem.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pieces  # noqa: E402

#: Where the pieces are kept on the machine between calls (outside the
#: checkout, which the next carried path may replace).
STORE = Path("/tmp/kvmem-pieces")


def default_store() -> Path:
    """:data:`STORE`, or ``KVMEM_PIECE_STORE`` when set (the tests)."""
    return Path(os.environ.get("KVMEM_PIECE_STORE") or STORE)


def store_for(carried: Path, store: Path | None = None) -> Path:
    """The store's folder for a carried plan folder: its parent's and its own
    name, without leading dots (``.gpu-wheels-0.33.0/torch211`` ->
    ``STORE/gpu-wheels-0.33.0/torch211``), so releases and plans never mix."""
    carried = Path(os.path.abspath(carried))
    return (store or default_store()) / carried.parent.name.lstrip(".") / carried.name


def take(carried: Path, dest: Path, hash_them: bool = False) -> int:
    """Copy every piece folder under ``carried`` into ``dest`` (a folder whose
    piece is already there whole is left alone), then report ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(p for p in carried.glob("p[0-9]*") if p.is_dir())
    copied = []
    for folder in found:
        target = dest / folder.name
        same = target.is_dir() and sorted(
            (f.name, f.stat().st_size) for f in target.iterdir()
        ) == sorted((f.name, f.stat().st_size) for f in folder.iterdir())
        if same:
            continue
        tmp = dest / f".{folder.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # a piece is in the store whole or not at all
        copied.append(folder.name)
    print(
        f"took {', '.join(copied) or 'nothing new'} from {carried} into {dest}"
        + ("" if found else f" ({carried}: no piece folder carried in this call)")
    )
    if not any(dest.glob("p[0-9]*/manifest.json")):
        print(f"no piece in {dest} yet")
        return 3
    return status(dest, hash_them)


def status(root: Path, hash_them: bool) -> int:
    manifest = pieces.find_manifest(root)
    states = pieces.check_pieces(root, manifest, hash_them=hash_them)
    ok = [s for s in states if s.state == "ok"]
    print(
        f"plan {manifest.get('plan', '?')}: {len(ok)} of {len(states)} pieces "
        f"present ({'sha256' if hash_them else 'size'} checked), "
        f"{manifest['total_bytes'] / pieces.MIB:,.1f} MiB in "
        f"{len(manifest['files'])} wheels"
    )
    for s in states:
        if s.state != "ok":
            print(f"  {s.folder}: {s.state}")
    return 0 if len(ok) == len(states) else 3


def install(
    root: Path, target: Path, python: str, keep_wheels: bool, partial: bool = False
) -> int:
    manifest = pieces.find_manifest(root)
    need = manifest["total_bytes"]
    work = Path(tempfile.mkdtemp(prefix="kvmem-wheels-"))
    if pieces.free_bytes(work) < need * 3:
        print(
            f"warning: {pieces.free_bytes(work) / pieces.GIB:.1f} GiB free at "
            f"{work}; the wheels ({need / pieces.GIB:.1f} GiB) and their "
            "installation need about three times that"
        )
    wheels = pieces.join(root, work, manifest, partial=partial)
    print(f"rebuilt {len(wheels)} of {len(manifest['files'])} wheels, sha256 checked")
    for plan, names in manifest.get("plans", {}).items():
        have = {w.name for w in wheels}
        print(f"  plan {plan}: {len(set(names) & have)} of {len(names)} wheels here")
    target.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--quiet",
        "--target",
        str(target),
        *map(str, wheels),
    ]
    print("$ pip install --no-index --no-deps --target", target, f"({len(wheels)})")
    rc = subprocess.run(cmd).returncode
    installed = sorted(
        "-".join(w.name.split("-")[:2]).replace("-", "==", 1) for w in wheels
    )
    (target / "kvmem-installed.json").write_text(
        json.dumps({"plan": manifest.get("plan"), "wheels": installed}, indent=1)
    )
    print(f"installed into {target} (pip exit {rc}):")
    for line in installed:
        print("  " + line)
    if not keep_wheels:
        shutil.rmtree(work, ignore_errors=True)
    return rc


def check(target: Path) -> dict:
    """Unmet requirements of the packages installed in ``target``."""
    from importlib import metadata

    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name

    path = [str(target)] + [p for p in sys.path if p != str(target)]
    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=path):
        name = canonicalize_name(dist.metadata["Name"] or "")
        seen.setdefault(name, dist)  # the first on the path wins, as on import
    ours = {
        canonicalize_name(d.metadata["Name"] or "")
        for d in metadata.distributions(path=[str(target)])
    }
    env = default_environment()
    unmet: list[dict] = []
    for name in sorted(ours):
        dist = seen[name]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(dict(env, extra="")):
                continue
            have = seen.get(canonicalize_name(req.name))
            if have is None:
                unmet.append({"package": name, "requires": text, "found": None})
            elif not req.specifier.contains(have.version, prereleases=True):
                unmet.append({"package": name, "requires": text, "found": have.version})
    try:  # what the plans leave out on purpose (requirement_diff.OPTIONAL)
        from requirement_diff import OPTIONAL
    except Exception:
        OPTIONAL = {}
    for u in unmet:
        u["left_out_on_purpose"] = (
            canonicalize_name(Requirement(u["requires"]).name) in OPTIONAL
        )
    return {
        "target": str(target),
        "installed": len(ours),
        "unmet": unmet,
        "shadowed": sorted(
            n
            for n in ours
            if any(
                canonicalize_name(d.metadata["Name"] or "") == n
                for d in metadata.distributions(
                    path=[p for p in sys.path if p != str(target)]
                )
            )
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("take", help="copy carried pieces into the store, report")
    t.add_argument("carried", type=Path, help="e.g. .gpu-wheels/torch211")
    t.add_argument("--dest", type=Path, help="default: the store's folder for it")
    t.add_argument("--hash", action="store_true", help="also check sha256")
    s = sub.add_parser("status")
    s.add_argument("--root", type=Path, required=True)
    s.add_argument("--hash", action="store_true", help="also check sha256")
    i = sub.add_parser("install")
    i.add_argument("--root", type=Path, required=True)
    i.add_argument("--target", type=Path, required=True)
    i.add_argument("--python", default=sys.executable)
    i.add_argument("--keep-wheels", action="store_true")
    i.add_argument(
        "--partial",
        action="store_true",
        help="install the wheels whose pieces have all arrived (the smaller "
        "plans' wheels come first in the stream)",
    )
    c = sub.add_parser("check")
    c.add_argument("--target", type=Path, required=True)
    c.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "take":
        return take(args.carried, args.dest or store_for(args.carried), args.hash)
    if args.cmd == "status":
        return status(args.root, args.hash)
    if args.cmd == "install":
        return install(
            args.root, args.target, args.python, args.keep_wheels, args.partial
        )
    result = check(args.target)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    real = [u for u in result["unmet"] if not u["left_out_on_purpose"]]
    print(
        f"{result['installed']} packages in {result['target']}; "
        f"{len(result['shadowed'])} shadow the machine's own; "
        f"{len(real)} unmet requirements (+{len(result['unmet']) - len(real)} "
        "on packages the plan leaves out on purpose)"
    )
    for u in real:
        print(f"  {u['package']}: needs {u['requires']}, found {u['found']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
