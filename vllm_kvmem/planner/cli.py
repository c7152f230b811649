"""``kvmem plan``'s flags, named after vLLM's where one exists."""

from __future__ import annotations

import argparse
import json
import os

from vllm_kvmem.core.units import parse_positive_size
from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.partition import DEFAULT_RESERVE
from vllm_kvmem.planner.plans import plan
from vllm_kvmem.planner.replay import HOST_POLICIES
from vllm_kvmem.planner.report import format_plan, plan_to_dict
from vllm_kvmem.planner.setup import PLATFORMS, Options
from vllm_kvmem.planner.trace import TRACE_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvmem plan``; names follow vLLM's where one exists."""
    parser.add_argument("model_dir", help="local model directory with config.json")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="TP size: KV heads are split across TP ranks, replicated when fewer "
        "heads than ranks (default %(default)s)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        help="PP size (default 1, or the number of --device-memory entries)",
    )
    parser.add_argument(
        "--pp-layer-partition",
        default=os.environ.get("VLLM_PP_LAYER_PARTITION"),
        help="layers per stage like VLLM_PP_LAYER_PARTITION, e.g. 56,8 (default: "
        "$VLLM_PP_LAYER_PARTITION, else vLLM's even split)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        help="KV budget in bytes: 5G, 512M, 1.5g, 400000 (vLLM's syntax); per GPU, "
        "or pipeline-wide with --enable-pp-prop-kv-cache (both are reported)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        help="KV budget in tokens (e.g. 400000 or 400k) instead of bytes; not with "
        "--kv-cache-memory-bytes",
    )
    parser.add_argument(
        "--max-model-len",
        help="tokens per request (default: config's max_position_embeddings); 32k, "
        "32K and 32768 are read as vLLM reads them",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default 16; with --platform cpu vLLM uses 128, "
        "16 for MLA: vllm/platforms/cpu.py)",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cuda",
        help="whose defaults to use for the block size and batch sizes "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model dtype as vLLM's --dtype (default auto: config dtype, float32 "
        "downcast to 16 bits)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help=f"one of {', '.join(km.KV_CACHE_DTYPES)}, fp8_ds_mla (MLA); auto = "
        "model dtype, fp8 = 1 byte (default auto)",
    )
    parser.add_argument(
        "--target-concurrency",
        type=float,
        default=None,
        help="print the budget for this many concurrent max-model-len requests",
    )
    parser.add_argument(
        "--device-memory",
        help="memory of one GPU per pipeline stage, e.g. 16G,32G: recommends the "
        "layer partition with the most KV capacity and prints the command",
    )
    parser.add_argument(
        "--reserve-memory",
        default=DEFAULT_RESERVE,
        help="per-GPU memory neither weights nor KV may use (activations, CUDA "
        "graphs, NCCL, runtime); an assumption, measure yours (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        default=None,
        help="vLLM's max_num_batched_tokens, which sizes sliding-window caches "
        "(default: `vllm serve`'s, 2048; x TP x PP on CPU)",
    )
    parser.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=None,
        help="batches in flight (vLLM: PP size, +1 with async scheduling, the CUDA "
        "default; CPU: PP size); sizes sliding-window caches",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="as vLLM's flag: size sliding-window layers like full attention when "
        "mixed with full-attention layers",
    )
    parser.add_argument(
        "--kv-host-cache-bytes",
        default=None,
        help="the host tier's size per TP shard (8G): its capacity in blocks and "
        "tokens next to the device's",
    )
    parser.add_argument(
        "--kv-disk-cache-bytes",
        default=None,
        help="the disk tier's size, its whole directory (500G): its capacity in "
        "blocks and tokens (needs --kv-host-cache-bytes, as the engine does)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    trace = parser.add_argument_group(
        "sizing the host tier from a workload (docs/kv-planning.md)"
    )
    trace.add_argument(
        "--trace",
        help="replay this request trace through vLLM's block hashing and prefix "
        "cache with the host tier behind it, and print the hit rates per host "
        "size instead of the capacity report",
    )
    trace.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="auto",
        help="tokens, text, lengths (JSON lines) or conversations (vLLM's "
        "multi-turn client's JSON); auto: a JSON list is conversations, JSON "
        "lines are read line by line (default %(default)s)",
    )
    trace.add_argument(
        "--host-sizes",
        default="0,1x,2x,4x",
        help="host tier sizes to replay: bytes (512M, 8G) or multiples of the "
        "device KV cache (2x), comma-separated (default %(default)s)",
    )
    trace.add_argument(
        "--max-concurrency",
        type=int,
        default=1,
        help="clients in a closed loop in the replay, each sending the "
        "trace's next request once its last one ended, as through a server "
        "(default %(default)s: one request at a time)",
    )
    trace.add_argument(
        "--kv-host-cache-policy",
        choices=HOST_POLICIES,
        default="lru",
        help="the host tier's eviction policy (default %(default)s)",
    )
    trace.add_argument(
        "--max-active-conversations",
        type=int,
        default=1,
        help="conversations trace: how many one client of vLLM's multi-turn "
        "benchmark keeps going at once, which orders the turns (default "
        "%(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """``kvmem plan``: print the report; ValueErrors carry the one-line error."""
    devices = _device_list(args.device_memory)
    options = Options(
        tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size or (len(devices) if devices else 1),
        partition=args.pp_layer_partition or None,
        max_model_len=_optional_size(args.max_model_len, "--max-model-len"),
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_num_batched_tokens=_optional_size(
            args.max_num_batched_tokens, "--max-num-batched-tokens"
        ),
        max_concurrent_batches=args.max_concurrent_batches,
        hybrid=not args.disable_hybrid_kv_cache_manager,
        platform=args.platform,
    )
    if args.trace is not None:
        return _run_trace(args, options)
    result = plan(
        args.model_dir,
        options,
        budget_bytes=args.kv_cache_memory_bytes,
        budget_tokens=args.kv_cache_tokens,
        target_concurrency=args.target_concurrency,
        device_memory=devices,
        reserve_memory=args.reserve_memory,
        host_bytes=args.kv_host_cache_bytes,
        disk_bytes=args.kv_disk_cache_bytes,
    )
    if args.json:
        print(json.dumps(plan_to_dict(result), indent=2))
    else:
        print(format_plan(result))
    return 0


def _run_trace(args: argparse.Namespace, options: Options) -> int:
    """``kvmem plan --trace``: the workload's hit rates per host size."""
    from vllm_kvmem.planner.trace import format_trace_report, trace_report

    report = trace_report(
        args.model_dir,
        options,
        trace=args.trace,
        trace_format=args.trace_format,
        host_sizes=args.host_sizes,
        budget_bytes=args.kv_cache_memory_bytes,
        budget_tokens=args.kv_cache_tokens,
        policy=args.kv_host_cache_policy,
        max_concurrency=args.max_concurrency,
        max_active_conversations=args.max_active_conversations,
    )
    print(json.dumps(report, indent=2) if args.json else format_trace_report(report))
    return 0


def _optional_size(value: str | None, flag: str) -> int | None:
    return None if value is None else parse_positive_size(value, flag=flag)


def _device_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(
            f"--device-memory={text!r}: give one size per stage, e.g. 16G,32G"
        )
    return items
