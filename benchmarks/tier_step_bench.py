"""The host tier's own work in each engine step, in microseconds, on both sides.

vLLM's real ``Scheduler`` (``schedule`` and ``update_from_output``) runs with
the tier configured, and the worker side is the connector vLLM builds for a
worker, over real CPU KV tensors, called in the order vLLM's model runner
calls it (``handle_preemptions``, ``start_load_kv``, ``get_finished``,
``build_connector_worker_meta``; ``KVConnectorModelRunnerMixin``). Only the
forward pass is stood in for: each scheduled request gets one sampled token,
so that the scheduler's and the tier's work is what is timed, at the pace of
the engine's steps, without the model's compute in between.

The times are the connector's own (``StepClock``: every connector call, on
each side, summed per step), which are the figures its
``vllm:kvmem_host_*_step_seconds`` histograms report on /metrics. A step is
*idle* when the tier has no copy to issue (no save, load or fence in its
metadata) and *busy* otherwise. Alongside, the whole ``schedule`` +
``update_from_output`` time with the tier and without any connector, so that
the tier's share of the scheduler's step is seen against vLLM's own.

The workload: ``--concurrency`` requests decode at a time, each with a
unique prompt of ``--prompt-tokens`` tokens (0% reuse: every block the prefix
cache evicts is spilled and none is ever read back) or, with ``--reuse``, a
share of requests repeating an earlier prompt (host hits). The device cache
has ``--device-blocks`` blocks; host block counts are swept
(``--host-blocks``) to show that the cost stays flat as the host tier grows.

    python benchmarks/tier_step_bench.py                       # the table
    python benchmarks/tier_step_bench.py --shape qwen2.5-0.5b  # a real shape
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:  # the no-op connector's module, tests/
    sys.path.insert(1, str(ROOT))

from _noop_connector import NOOP_TRANSFER_CONFIG  # noqa: E402
from _report import print_targets, provenance, versions, write_json  # noqa: E402
from tqdm import tqdm  # noqa: E402

IDLE_GOAL_US = 50.0
#: The ``--host-blocks`` value of the do-nothing connector's arm: vLLM's own
#: per-step work for any connector.
NOOP = 0


def _model_dir(shape: str, cache: Path) -> Path:
    """A model folder for ``shape``: the tiny model or a published shape."""
    out = cache / shape
    if (out / "config.json").is_file():
        return out
    if shape == "tiny":
        from vllm_kvmem.tiny_model import build_tiny_model

        return build_tiny_model(out)
    from vllm_kvmem.shape_model import build_shape_model

    return build_shape_model(shape, out)


def _configs(
    model: Path, args: argparse.Namespace, host_blocks: int | None, events: bool
):
    """vLLM's config for the run (the tier on with ``host_blocks``, no
    connector with None; vLLM's KV events on with ``events``, published
    nowhere), and a KV cache config of ``--device-blocks``."""
    import torch
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import vllm_kvmem

    vllm_kvmem.register()
    kv_transfer = None
    if host_blocks == NOOP:
        kv_transfer = KVTransferConfig(**NOOP_TRANSFER_CONFIG)
    elif host_blocks is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="HostTierConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"num_host_blocks": host_blocks},
        )
    vllm_config = EngineArgs(
        model=str(model),
        load_format="dummy",
        block_size=args.block_size,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.batch_tokens,
        max_model_len=args.prompt_tokens + args.output_tokens + args.block_size,
        kv_cache_memory_bytes=1 << 30,
        kv_transfer_config=kv_transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if events
        else None,
        enforce_eager=True,
    ).create_engine_config()
    hf = vllm_config.model_config
    num_layers = hf.get_num_layers(vllm_config.parallel_config)
    spec = FullAttentionSpec(
        block_size=args.block_size,
        num_kv_heads=hf.get_num_kv_heads(vllm_config.parallel_config),
        head_size=hf.get_head_size(),
        dtype=torch.bfloat16,
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}
    # The layout vLLM resolves on CPU with the plugin: BLHNC where the tier
    # asks for it (CPU_ATTN's widened set), CPU_ATTN's LBHNC otherwise.
    tier = host_blocks not in (None, NOOP)
    supported = ["BLHNC", "LBHNC"] if tier else ["LBHNC"]
    resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    # vLLM's own planner, held to --device-blocks by its block-count override.
    vllm_config.cache_config.num_gpu_blocks_override = args.device_blocks
    (kv_cache_config,) = get_kv_cache_configs(
        vllm_config, [specs], [spec.page_size_bytes * num_layers * args.device_blocks]
    )
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return vllm_config, kv_cache_config


class _Run:
    """One engine's scheduler and, with the tier, its worker-side connector."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = vllm_config
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.scheduler = Scheduler(
            vllm_config,
            kv_cache_config,
            StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.worker = None
        if self.scheduler.connector is not None:
            self.worker = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            caches = {}
            for t in kv_cache_config.kv_cache_tensors:
                backing = torch.zeros(t.size, dtype=torch.uint8)
                for name in t.layers:
                    caches[name] = backing
            self.worker.register_kv_caches(caches)
            # The pageable pool is pre-faulted in the background at startup:
            # wait, so that startup work is not timed as steps.
            engine = getattr(
                getattr(self.worker, "connector_worker", None), "_engine", None
            )
            if engine is not None:
                engine.pool.wait_prefaulted()

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            Request(req_id, prompt, params, None, block_hasher=self.hasher)
        )

    def step(self) -> dict[str, Any]:
        """One engine step; the times of its parts."""
        from vllm.v1.outputs import ModelRunnerOutput

        from vllm_kvmem.host_tier.metadata import HostTierMetadata

        t0 = time.perf_counter_ns()
        out = self.scheduler.schedule()
        t1 = time.perf_counter_ns()
        kv_out = None
        meta = out.kv_connector_metadata
        busy = False
        worker_ns = 0
        if self.worker is not None:
            busy = isinstance(meta, HostTierMetadata) and bool(
                meta.fence or meta.evict_saves or meta.ahead_saves or meta.loads
            )
            tw = time.perf_counter_ns()
            kv_out = self._worker_step(out)
            worker_ns = time.perf_counter_ns() - tw
        req_ids = list(out.num_scheduled_tokens)
        finished_prefill = [
            r
            for r in req_ids
            if self.scheduler.requests[r].num_computed_tokens
            + out.num_scheduled_tokens[r]
            >= self.scheduler.requests[r].num_prompt_tokens
        ]
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] if r in finished_prefill else [] for r in req_ids],
            kv_connector_output=kv_out,
        )
        t2 = time.perf_counter_ns()
        self.scheduler.update_from_output(out, runner_out)
        t3 = time.perf_counter_ns()
        # The connector's own clocks (None on a tier without them, e.g. an
        # older checkout measured with this script).
        sched_clock = getattr(self.scheduler.connector, "clock", None)
        worker_clock = getattr(self.worker, "clock", None)
        return {
            "scheduled": len(req_ids),
            "busy": busy,
            "vllm_scheduler_us": ((t1 - t0) + (t3 - t2)) / 1e3,
            "worker_calls_us": worker_ns / 1e3,
            "tier_scheduler_us": sched_clock.last_us if sched_clock else 0.0,
            "tier_worker_us": worker_clock.last_us if worker_clock else 0.0,
            "allocated": sum(
                len(group)
                for ids in out.scheduled_cached_reqs.new_block_ids
                for group in ids or ()
            )
            + sum(len(group) for r in out.scheduled_new_reqs for group in r.block_ids),
            "finished": len(out.finished_req_ids),
        }

    def _worker_step(self, out: Any) -> Any:
        """The worker connector's calls of one step, in vLLM's order."""
        from vllm.v1.outputs import KVConnectorOutput

        w = self.worker
        meta = out.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        return kv_out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.scheduler.shutdown()


def _workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The prompts, in arrival order: unique, or a ``--reuse`` share repeating
    one of the earlier prompts."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(args.requests):
        if prompts and rng.random() < args.reuse:
            prompts.append(list(rng.choice(prompts)))
        else:
            prompts.append([rng.randrange(10, 2000) for _ in range(args.prompt_tokens)])
    return prompts


def run_arm(
    model: Path,
    args: argparse.Namespace,
    host_blocks: int | None,
    on_start=None,
    events: bool = False,
) -> dict:
    """One run of the workload; ``on_start(run)`` may wrap what it inspects;
    ``events``: vLLM's KV events on (the tier's with them)."""
    vllm_config, kv_cache_config = _configs(model, args, host_blocks, events)
    run = _Run(vllm_config, kv_cache_config)
    if on_start is not None:
        on_start(run)
    steps: list[dict[str, Any]] = []
    try:
        prompts = _workload(args, seed=1)
        waiting = list(enumerate(prompts))
        while waiting or run.scheduler.has_unfinished_requests():
            while (
                waiting
                and len(run.scheduler.running) + len(run.scheduler.waiting)
                < args.concurrency
            ):
                i, prompt = waiting.pop(0)
                run.add(f"r{i}", prompt, args.output_tokens)
            steps.append(run.step())
        tier = getattr(run.scheduler.connector, "connector_scheduler", None)
        totals = dict(tier.totals) if tier is not None else {}
    finally:
        run.close()
    summary = _summary(steps, host_blocks, totals)
    summary["kv_events"] = events
    summary["per_step"] = steps if args.keep_steps else None
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    values = sorted(values)
    return {
        "n": len(values),
        "p50": round(values[len(values) // 2], 2),
        "p90": round(values[int(len(values) * 0.9)], 2),
        "mean": round(statistics.fmean(values), 2),
        "max": round(values[-1], 2),
    }


#: Each step's figures summarised per kind of step.
STEP_FIGURES = (
    "tier_scheduler_us",
    "tier_worker_us",
    "vllm_scheduler_us",
    "worker_calls_us",
)


def _summary(steps: list[dict], host_blocks: int | None, totals: dict) -> dict:
    out: dict[str, Any] = {"host_blocks": host_blocks, "steps": len(steps)}
    kinds = {
        "idle": [s for s in steps if not s["busy"]],
        "busy": [s for s in steps if s["busy"]],
        "all": steps,
    }
    for kind, chosen in kinds.items():
        out[kind] = {key: _stats([s[key] for s in chosen]) for key in STEP_FIGURES}
    out["tier_counters"] = {
        k: totals.get(k, 0)
        for k in ("blocks_spilled", "bytes_saved_ahead", "bytes_saved_at_eviction",
                  "blocks_loaded", "hit_tokens", "lookup_tokens")
    }  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        default="tiny",
        help="tiny, or a kvmem shape-model name (default %(default)s)",
    )
    p.add_argument("--device-blocks", type=int, default=1024)
    p.add_argument(
        "--host-blocks",
        default="0,1024,16384,131072",
        help="comma-separated host block counts to sweep; 0 is a do-nothing "
        "connector (vLLM's own per-step work)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument(
        "--reuse",
        type=float,
        default=0.0,
        help="share of requests repeating an earlier prompt",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--kv-events",
        choices=("off", "on", "both"),
        default="off",
        help="vLLM's KV events (--kv-events-config, published nowhere): the "
        "tier then sends its own; both: off and on, interleaved",
    )
    p.add_argument(
        "--keep-steps",
        action="store_true",
        help="keep every step's figures in the JSON",
    )
    p.add_argument(
        "--models",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvmem-bench-models",
    )
    p.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/tier_step_cpu.json")
    )
    return p.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_begin = time.time()
    model = _model_dir(args.shape, args.models)
    host_counts = [int(x) for x in args.host_blocks.split(",")]
    events = {"off": [False], "on": [True], "both": [False, True]}[args.kv_events]
    # A B A B: no connector, then each host size, events off then on, repeated.
    plan = [
        (rep, hb, ev)
        for rep in range(args.repeats)
        for hb in [None, *host_counts]
        for ev in events
    ]
    results: list[dict] = []
    with tqdm(total=len(plan), desc="tier step", unit="run") as bar:
        for rep, hb, ev in plan:
            r = run_arm(model, args, hb, events=ev)
            r["repeat"] = rep
            results.append(r)
            bar.update()
    table = [row for ev in events for row in _table(results, host_counts, ev)]
    targets = [
        {
            "name": f"idle tier work <= {IDLE_GOAL_US:.0f} us/step",
            "detail": f"{row['host_blocks']} host blocks, KV events "
            f"{'on' if row['kv_events'] else 'off'}: scheduler "
            f"{row['idle_scheduler_us']} + worker {row['idle_worker_us']} us",
            # None: a tier without its own clocks (an older checkout).
            "passed": row["idle_scheduler_us"] + row["idle_worker_us"] <= IDLE_GOAL_US
            if row["idle_scheduler_us"]
            else None,
        }
        for row in table
        if row["host_blocks"] not in (None, NOOP)
    ]
    doc = {
        **provenance("tier_step_bench.py", argv, t_begin, "CPU; see the docs"),
        "platform": "CPU",
        "versions": versions(),
        "code_under_test": _code_under_test(),
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
        "table": table,
        "runs": results,
        "targets": targets,
    }
    write_json(args.out, doc)
    _print_table(table)
    print_targets(targets)
    return 0


def _code_under_test() -> dict[str, str]:
    """Which vllm_kvmem ran (a checkout on PYTHONPATH measures older code)."""
    import subprocess

    import vllm_kvmem

    folder = Path(vllm_kvmem.__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(folder), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {"path": str(folder), "commit": commit}


def _table(
    results: list[dict], host_counts: list[int], events: bool = False
) -> list[dict]:
    """Medians over repeats, and the spread (min-max) of the repeats' p50s,
    of the runs with KV events ``events``."""
    rows = []
    for hb in [None, *host_counts]:
        runs = [
            r
            for r in results
            if r["host_blocks"] == hb and r.get("kv_events", False) == events
        ]

        def med(kind: str, key: str, stat: str = "p50", runs=runs) -> float:
            vals = [r[kind][key].get(stat) for r in runs if r[kind][key]["n"]]
            return round(statistics.median(vals), 1) if vals else 0.0

        def spread(kind: str, key: str, runs=runs) -> list[float]:
            vals = [r[kind][key]["p50"] for r in runs if r[kind][key]["n"]]
            return [round(min(vals), 1), round(max(vals), 1)] if vals else []

        rows.append({
            "host_blocks": hb,
            "kv_events": events,
            "steps": statistics.median(r["steps"] for r in runs),
            "idle_steps": statistics.median(r["idle"]["tier_scheduler_us"]["n"]
                                            for r in runs),
            "idle_scheduler_us": med("idle", "tier_scheduler_us"),
            "idle_scheduler_us_spread": spread("idle", "tier_scheduler_us"),
            "idle_worker_us": med("idle", "tier_worker_us"),
            "idle_worker_us_spread": spread("idle", "tier_worker_us"),
            "busy_scheduler_us": med("busy", "tier_scheduler_us"),
            "busy_scheduler_us_p90": med("busy", "tier_scheduler_us", "p90"),
            "busy_worker_us": med("busy", "tier_worker_us"),
            "vllm_scheduler_us": med("all", "vllm_scheduler_us"),
            "vllm_scheduler_us_mean": med("all", "vllm_scheduler_us", "mean"),
            "worker_calls_us_mean": med("all", "worker_calls_us", "mean"),
            "tier_scheduler_us_mean": med("all", "tier_scheduler_us", "mean"),
            "tier_worker_us_mean": med("all", "tier_worker_us", "mean"),
        })  # fmt: skip
    none = rows[0]
    for row in rows[1:]:
        # The tier's share of vLLM's scheduler step, measured from outside
        # (also for a tier that has no clocks of its own).
        row["scheduler_over_none_us_mean"] = round(
            row["vllm_scheduler_us_mean"] - none["vllm_scheduler_us_mean"], 1
        )
    return rows


def _print_table(rows: list[dict]) -> None:
    cols = [
        ("host blocks", "host_blocks"), ("events", "kv_events"),
        ("steps", "steps"), ("idle", "idle_steps"),
        ("idle sched", "idle_scheduler_us"), ("idle worker", "idle_worker_us"),
        ("busy sched", "busy_scheduler_us"), ("busy worker", "busy_worker_us"),
        ("vLLM sched p50", "vllm_scheduler_us"),
        ("sched mean", "vllm_scheduler_us_mean"),
        ("over none", "scheduler_over_none_us_mean"),
        ("tier sched mean", "tier_scheduler_us_mean"),
        ("worker mean", "worker_calls_us_mean"),
        ("tier wkr mean", "tier_worker_us_mean"),
    ]  # fmt: skip
    print("\nmicroseconds per engine step (medians over repeats)")
    print(" ".join(f"{title:>14}" for title, _ in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(key, '')):>14}" for _, key in cols))


if __name__ == "__main__":
    raise SystemExit(main())
