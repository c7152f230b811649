"""Write the in-tree series from a source checkout of vllm-kvmem (the
generator is not in the wheel):
``python -m kvmem_tools.intree [--vllm-src PATH] [--out DIR] [--only PATCH]``.
Exit 2 when the tree is refused (no version, or a patch's
anchor missing: the message names the patch, the file and the anchor), or
when git has no identity to sign the commits off with (``git config
user.name`` and ``user.email``: the submitter's)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvmem_tools.intree.series import run

PROG = "python -m kvmem_tools.intree"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write the in-tree feature branch: a git format-patch series "
        "for vLLM's own tree (docs/upstream.md).",
    )
    parser.add_argument(
        "--vllm-src",
        help="vLLM source tree (a checkout, a folder holding vllm/, or a wheel); "
        "default: the installed vLLM package's sources",
    )
    parser.add_argument("--out", default="upstream-series", help="output folder")
    parser.add_argument(
        "--only",
        action="append",
        metavar="PATCH",
        help="write only this patch (a module of kvmem_tools/intree/patches), "
        "against the tree as it is: one PR alone; repeatable",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args.vllm_src, args.out, args.only)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
