"""The ``kvmem`` console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _patches(args: argparse.Namespace) -> int:
    from vllm_kvmem.patches import ALL_PATCHES
    from vllm_kvmem.patches._registry import to_markdown

    if args.markdown:
        print(to_markdown(ALL_PATCHES))
    else:
        for p in ALL_PATCHES:
            print(f"{p.name:26} {p.target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvmem import demo, planner, shape_model, tiny_model

    parser = argparse.ArgumentParser(
        prog="kvmem", description="vllm-kvmem: KV-cache memory tools for vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "tiny-model",
        help="write a random-weight Llama-style model and a locally trained "
        "tokenizer (nothing downloaded)",
    )
    tiny_model.add_arguments(p)
    p.set_defaults(func=tiny_model.run)
    p = sub.add_parser(
        "shape-model",
        help="write a published architecture's config.json (Llama 3.1 8B, "
        "Qwen2.5, Gemma 3, Qwen3 MoE, ...) with a local tokenizer and no "
        "weights, to serve with --load-format dummy; --list shows the catalog",
        description="Write a model folder with a published architecture's "
        "config.json, the locally trained tokenizer and no weight files: vLLM "
        "serves it with --load-format dummy (random weights in memory) at the "
        "real shape's cost and KV geometry. --num-layers N keeps every "
        "per-layer dimension and only the first N layers.",
    )
    shape_model.add_arguments(p)
    p.set_defaults(func=shape_model.run)
    p = sub.add_parser(
        "plan",
        help="offline KV cache planner: capacity, budgets, pipeline partitions",
    )
    planner.add_arguments(p)
    p.set_defaults(func=planner.run)
    p = sub.add_parser(
        "demo",
        help="A/B of --enable-pp-prop-kv-cache on a pipeline of 2 and of the "
        "host KV tier (tiny model), then the planner vs a real shape's engine",
    )
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
    p = sub.add_parser("patches", help="list the vLLM patches vllm-kvmem applies")
    p.add_argument("--markdown", action="store_true", help="print docs/patches.md")
    p.set_defaults(func=_patches)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"kvmem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
