"""Issue 36 on a GPU: the host KV tier and vLLM's CPU offloading at a real size.

Not run on a GPU yet (prepared and dry-run on CPU, 2026-11-27). It runs on
any CUDA machine with vLLM 0.32/0.33 and vllm-kvmem installed (no pieces,
no network: the model folder is written here from the checkout), and on the
lent machine as stage 2's item h (``bash scripts/gpu/stage2.sh --items h``).
``--dry-run`` writes the plan and the model folder anywhere, importing
neither torch nor vLLM and starting nothing.

The model: the Llama-3.1-8B shape (``kvmem shape-model llama-3.1-8b``:
config and the project's tokenizer, no weights; vLLM's ``--load-format
dummy`` makes random weights in memory), bfloat16, FLASH_ATTN
(``--attention-backend``), 16-token blocks (2 MiB of KV a block), one vLLM
OpenAI server per arm. No ``--enforce-eager``: decode runs as full CUDA
graphs (``cudagraph_mode`` ``FULL_DECODE_ONLY`` at batch sizes 1-32), as a
GPU operator runs it; graph replay skips the connector's per-layer hooks,
which eager mode runs at every layer (the H200 A/B of 2026-11-26 ran
eager). torch.compile is off (compilation mode 0): its cold compile, tens
of seconds per server and not measured on this machine, would not fit the
session, and prefills of 4k-32k tokens run outside the captured sizes
either way. ``--eager`` (every server eager) is the fallback if graphs fail.

Steps, most important first, so that a run cut short at ``--max-wall-s``
keeps what matters most:

1. **TTFT of a host hit against recompute** at ``--ttft-lens`` (4k, 16k,
   32k) prompt tokens, for the tier (``--kv-host-cache-bytes``),
   ``SimpleCPUOffloadConnector`` with ``lazy_offload`` and
   ``OffloadingConnector`` (``--kv-offloading-size``): reset; prompt P cold
   (a recompute with that connector on); fillers of 8k tokens, 1.25 times
   the device cache, so that P leaves the device; P again (a host hit, its
   hit tokens from ``/metrics``). ``none`` (plain recompute): P cold only.
2. **Per-step profile** of each arm's connector: ``ab_offload.py``'s arms
   (``none``, ``noop``: a connector that does nothing, vLLM's plumbing
   alone; ``tier``, ``simple_lazy``, ``offloading``), one decode-heavy run
   each (0% reuse at ``--concurrency``): ITL and TPOT from the client, the
   tier's own time per step from its ``/metrics`` histograms
   (``tier_step_us``), and each engine step's host time from vLLM's
   ``--enable-logging-iteration-details`` lines (decode-only steps apart).
3. **Throughput at 0% and 80% reuse** at concurrency 16: ``none``, ``tier``,
   ``simple_lazy`` and ``simple_lazy_series`` (the 0% runs are step 2's
   where it profiled the arm): the last is ``SimpleCPUOffloadConnector``
   with ``lazy_offload`` on a copy of the machine's vLLM with the in-tree
   series applied (late spills, and Model Runner V2 calling
   ``handle_preemptions`` before it writes new blocks; ``series_tree.py``
   builds it on the machine, about 15 s, once while the machine is warm),
   no plugin: the A/B of issue 42 at this size.
4. **FLASH_ATTN decode time per step with BLHNC** (the layout the tier asks
   for, forced here without a connector: ``VLLM_KV_CACHE_LAYOUT=BLHNC``)
   against the default: the same run as step 2 (``blhnc`` against ``none``).

Servers run side by side, at most ``--max-live`` at a time (three 8B servers
fit an H100's 78 GiB; memory per server: 15 GiB of weights, the device KV
cache, activations); the ones a phase needs start together. Phases: A
(tier, simple_lazy, offloading: step 1, offloading's profile), B (none
joins: profiles, step 3, none's TTFT), C (noop and blhnc join none: the
last profile, step 4). Before each start and each step the plan's estimate
of it is checked against the time left: nothing starts that would end past
``--max-wall-s``; what is skipped is recorded.

Everything goes to ``$OUT/real_size_<gpu>.json`` (named after the GPU,
``nvidia-smi``), labelled GPU with the device, rewritten after every step.
Exit 0 when every step ran, 1 when a step failed or an arm did not start,
3 when steps were skipped. Server and client logs go to ``--work``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ab_figures as figures  # noqa: E402  (no vLLM or torch at import)
import ab_offload as ab  # noqa: E402
import series_tree  # noqa: E402
import serving_bench as sb  # noqa: E402
from gpu_common import SERVER_ENV, csv_list, write_dry_run  # noqa: E402
from real_size_schedule import (  # noqa: E402
    COST_MEASURED,
    COST_S,
    Item,
    filler_count,
    schedule,
    start_cost,
)

GIB = 1 << 30
ARMS = ("none", "noop", "tier", "simple_lazy", "offloading", "blhnc",
        "simple_lazy_series")  # fmt: skip
#: Arms that run the series' vLLM copy (built before they start).
SERIES_ARMS = ("simple_lazy_series",)
STEPS = ("ttft", "profile", "throughput", "layout")
#: vLLM's per-step line with --enable-logging-iteration-details.
ITERATION = re.compile(
    r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens, "
    r"iteration elapsed time: ([\d.]+) ms"
)


# -- the plan (no vLLM, no torch) --------------------------------------------------


def shape(args: argparse.Namespace) -> Any:
    return sb.PublishedShape(args.shape, args.dtype)


def model_path(args: argparse.Namespace) -> Path:
    return args.model_cache / shape(args).tag


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    return shape(args).kv_bytes_per_token()


def arm_config(
    arm: str, host_bytes: int, tree: Path = series_tree.TREE
) -> dict[str, Any]:
    """``ab_offload.py``'s arms; ``blhnc``: no connector, the layout forced
    (what the tier asks vLLM for), the plugin loaded as in ``none``;
    ``simple_lazy_series``: ``simple_lazy``'s connector on the vLLM copy in
    ``tree`` (the series applied), first on ``PYTHONPATH``, no plugin."""
    if arm == "simple_lazy_series":
        lazy = ab.arm_config("simple_lazy", host_bytes)
        return {
            **lazy,
            "env": {**lazy["env"], "PYTHONPATH": series_tree.pythonpath(tree)},
            "what": lazy["what"] + ", on vLLM with the in-tree series "
            f"(late spills; {tree})",
        }
    if arm == "blhnc":
        return {
            "flags": [],
            "env": {"VLLM_KV_CACHE_LAYOUT": "BLHNC"},
            "unset_env": [],
            "what": "no connector, VLLM_KV_CACHE_LAYOUT=BLHNC (the tier's layout)",
        }
    return ab.arm_config(arm, host_bytes)


def server_cmd(arm: str, args: argparse.Namespace) -> list[str]:
    """serving_bench's server flags for the shape (``--load-format dummy``),
    without ``--enforce-eager`` unless ``--eager``, the run's common flags,
    then the arm's own."""
    ns = argparse.Namespace(**vars(args))
    ns.kv_cache_bytes = str(args.kv_cache_bytes_int)
    base = sb.server_args("none", model_path(args), ns)
    if not args.eager:
        base = [f for f in base if f != "--enforce-eager"]
        base += ["--compilation-config", json.dumps(compilation_config(args))]
    return [
        *base,
        "--attention-backend", "FLASH_ATTN",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        *(["--enable-logging-iteration-details"] if args.iteration_details else []),
        *arm_config(arm, args.host_bytes, args.series_tree)["flags"],
    ]  # fmt: skip


def compilation_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": args.cudagraph_size_list,
    }


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    actions = schedule(args)
    used = list(dict.fromkeys(arm for a in actions for arm in a.arms))
    series = [a for a in used if a in SERIES_ARMS]
    total = (
        COST_S["fixed"]
        + sum(a.estimate_s for a in actions)
        + (COST_S["series_build"] if series else 0.0)
    )
    by_step: dict[str, float] = {}
    for a in actions:
        if a.item is not None:
            by_step[a.item.step] = by_step.get(a.item.step, 0.0) + a.estimate_s
    cfg = {arm: arm_config(arm, args.host_bytes, args.series_tree) for arm in used}
    return {
        "issue": 36,
        "script": "scripts/gpu/real_size.py",
        "status": "not run on a GPU yet (prepared and dry-run on CPU)",
        "model": {
            "shape": args.shape,
            "dtype": args.dtype,
            "folder": str(model_path(args)),
            "weights": "none: --load-format dummy (random, in memory)",
            "kv_bytes_per_token": kv_bytes_per_token(args),
            "block_bytes": kv_bytes_per_token(args) * args.block_size,
        },
        "common": {
            "attention_backend": "FLASH_ATTN",
            "enforce_eager": args.eager,
            "compilation_config": None if args.eager else compilation_config(args),
            "device_kv_tokens": args.device_kv_tokens,
            "device_kv_bytes": args.kv_cache_bytes_int,
            "host_bytes": args.host_bytes,
            "block_size_tokens": args.block_size,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "iteration_details": args.iteration_details,
            "server_env": SERVER_ENV,
        },
        "arms": {
            arm: {
                "what": cfg[arm]["what"],
                "server": ["python", "-m", "vllm.entrypoints.openai.api_server"]
                + server_cmd(arm, args),
                "env": cfg[arm]["env"],
                "unset_env": cfg[arm]["unset_env"],
            }
            for arm in used
        },
        "series_tree": {
            "folder": str(args.series_tree),
            "arms": series,
            "late_spill_pr": series_tree.LATE_SPILL,
            "built": "on the machine before the arm starts (series_tree.build: "
            "the generator's write_series for the machine's vLLM, all of ORDER)",
        }
        if series
        else None,
        "workload": {
            "ttft": {
                "lengths": args.ttft_len_list,
                "probes": args.probes,
                "filler_prompts": filler_count(args),
                "filler_len": args.filler_len,
                "steps": "reset; P cold; fillers; P again (host hit with a "
                "connector); none: P cold only (a recompute)",
            },
            "runs": {
                "client": "vllm bench serve, prefix_repetition (serving_bench.py)",
                "num_prompts": args.num_prompts,
                "prefix_len": args.prefix_len,
                "suffix_len": args.suffix_len,
                "output_len": args.output_len,
                "concurrency": args.concurrency,
                "levels": {
                    lv.name: round(lv.reuse(args.num_prompts), 3)
                    for lv in args.level_list
                },
                "repeats": args.repeats,
            },
        },
        "schedule": [
            {
                "kind": a.kind,
                "arms": a.arms,
                **({"step": a.item.name, "phase": a.item.phase} if a.item else {}),
                "estimate_s": round(a.estimate_s, 1),
            }
            for a in actions
        ],
        "max_live": args.max_live,
        "max_wall_s": args.max_wall_s,
        "estimate_s": round(total),
        "estimate_fits_max_wall": total <= args.max_wall_s,
        "estimate_by_step_s": {k: round(v) for k, v in by_step.items()},
        "estimate_starts_s": round(
            sum(a.estimate_s for a in actions if a.kind == "start")
        ),
        "cost_model_s": COST_S,
        "cost_model_measured": "measured on the H200 (2026-11-26, tiny model): "
        + ", ".join(COST_MEASURED)
        + "; the rest assumed for the 8B shape",
        "output": "$OUT/real_size_<gpu>.json (<gpu> from nvidia-smi: h100, h200, "
        "...), labelled GPU with the device",
        "not_a_check_here": "greedy identity: the shape's random weights emit "
        "ids beyond the project tokenizer's 2,048, which decode to nothing, so "
        "equal texts prove little at this shape (the tiny-model A/B is the "
        "identity check); the texts are compared and recorded all the same",
    }


# -- figures (pure) -----------------------------------------------------------------


def iterations(text: str) -> dict[str, Any] | None:
    """vLLM's per-step lines in a slice of a server log: each step's host
    time, decode-only steps apart from those with prefill tokens."""
    decode, mixed = [], []
    for m in ITERATION.finditer(text):
        ctx_tokens, ms = int(m.group(3)), float(m.group(6))
        (mixed if ctx_tokens else decode).append(ms)
    if not decode and not mixed:
        return None

    def pct(vals: list[float], q: float) -> float | None:
        if not vals:
            return None
        vals = sorted(vals)
        return vals[min(len(vals) - 1, int(q * len(vals)))]

    return {
        "decode_steps": len(decode),
        "decode_ms_p50": statistics.median(decode) if decode else None,
        "decode_ms_p90": pct(decode, 0.9),
        "prefill_steps": len(mixed),
        "prefill_ms_p50": statistics.median(mixed) if mixed else None,
    }


def summarize_ttft(probes: list[dict[str, Any]], arms: list[str]) -> dict:
    """Per arm and length: cold (a recompute with the arm's connector on) and
    repeat TTFT (a host hit), the repeat over its own cold and over plain
    vLLM's recompute (``none``'s cold) at that length."""
    ok = [p for p in probes if not p.get("error")]
    ref = {
        p["length"]: p["cold_ttft_ms"]
        for p in ok
        if p["arm"] == "none" and p.get("cold_ttft_ms")
    }
    out: dict[str, Any] = {}
    for arm in arms:
        per: dict[str, Any] = {}
        for length in sorted({p["length"] for p in ok if p["arm"] == arm}):
            mine = [p for p in ok if p["arm"] == arm and p["length"] == length]
            cold = figures.median([p.get("cold_ttft_ms") for p in mine])
            rep = figures.median([p.get("repeat_ttft_ms") for p in mine])
            per[str(length)] = {
                "probes": len(mine),
                "cold_ttft_ms": cold,
                "repeat_ttft_ms": rep,
                "repeat_over_cold": rep / cold if rep and cold else None,
                "repeat_over_none_recompute": rep / ref[length]
                if rep and ref.get(length)
                else None,
                "repeat_host_hit_tokens": [
                    (p.get("repeat") or {}).get("external_hit_tokens") for p in mine
                ],
                "prompt_tokens": sorted(
                    {p.get("prompt_tokens") for p in mine} - {None}
                ),
                "repeat_text_equal_to_cold": sum(
                    p.get("repeat_text") == p.get("cold_text") for p in mine
                ),
            }
        out[arm] = per
    return out


def summarize_profile(runs: list[dict[str, Any]], arms: list[str]) -> dict:
    """Per arm, the 0% reuse run (step 2, and step 4's blhnc): ITL and TPOT,
    each engine step's host time, the tier's own time per step; ITL over
    ``none`` and over ``noop`` (what the arm adds beyond vLLM's plumbing)."""
    ok = [
        r
        for r in runs
        if r.get("summary") and r["level"] == "unique" and r["step"] != "throughput"
    ]
    by: dict[str, list[dict]] = {}
    for r in ok:
        by.setdefault(r["arm"], []).append(r)

    def med(arm: str, key: str) -> float | None:
        return figures.median([r["summary"].get(key) for r in by.get(arm, [])])

    out: dict[str, Any] = {}
    for arm in arms:
        if arm not in by:
            continue
        its = [r.get("iterations") or {} for r in by[arm]]
        out[arm] = {
            "runs": len(by[arm]),
            "itl_p50_ms": med(arm, "itl_p50_ms"),
            "itl_p99_ms": med(arm, "itl_p99_ms"),
            "tpot_p50_ms": med(arm, "tpot_p50_ms"),
            "req_per_s": med(arm, "req_per_s"),
            "decode_step_host_ms_p50": figures.median(
                [i.get("decode_ms_p50") for i in its]
            ),
            "tier_step_us": [r.get("tier_step_us") for r in by[arm]],
        }
        for ref in ("none", "noop"):
            a, b = med(arm, "itl_p50_ms"), med(ref, "itl_p50_ms")
            out[arm][f"itl_p50_over_{ref}"] = a / b if a and b else None
    return out


# -- the run (GPU) ------------------------------------------------------------------


class RealSize(ab.GpuSession):
    script = "real_size"

    def __init__(
        self, args: argparse.Namespace, gpu: dict[str, str], argv: list[str]
    ) -> None:
        super().__init__(
            args,
            gpu,
            argv,
            shape(args).ensure(args.model_cache),
            "real_size (issue 36)",
            machine=machine_facts(),
            plan=build_plan(args),
            servers={},
            ttft=[],
            runs=[],
            skipped=[],
        )

    # servers
    def _server(self, arm: str) -> ab.ABServer:
        env = ab.arm_env(arm_config(arm, self.args.host_bytes, self.args.series_tree))
        return ab.ABServer(
            arm, server_cmd(arm, self.args), env, self.work / f"server-{arm}.log"
        )

    def start(self, arms: list[str]) -> None:
        """Start ``arms`` together (threads: each start is a process and a
        readiness poll), then warm each up; an arm that fails beside others is
        tried once more alone when time allows. A series arm's vLLM copy is
        built first; an arm whose copy cannot be built does not start."""
        infos: dict[str, dict[str, Any]] = {}
        for arm in [a for a in arms if a in SERIES_ARMS]:
            error = self.series_error()
            if error:
                infos[arm] = {"error": f"series tree: {error}", "batch": arms}
        servers = {arm: self._server(arm) for arm in arms if arm not in infos}
        for arm, s in servers.items():
            infos[arm] = {"cmd": s.args, "batch": arms,
                          "env": arm_config(arm, self.args.host_bytes,
                                            self.args.series_tree)["env"]}  # fmt: skip
        if not servers:
            self.report["servers"].update(infos)
            return

        def go(arm: str, delay: float) -> float:
            time.sleep(delay)  # distinct free ports, staggered imports
            return servers[arm].start()

        with cf.ThreadPoolExecutor(len(servers)) as pool:
            futs = {arm: pool.submit(go, arm, 2.0 * k) for k, arm in enumerate(servers)}
        failed = []
        for arm, fut in futs.items():
            try:
                infos[arm]["start_s"] = fut.result()
            except Exception as e:
                infos[arm]["error"] = f"{type(e).__name__}: {e}"
                infos[arm]["log_tail"] = servers[arm].log_tail()
                servers[arm].stop()
                failed.append(arm)
        if failed and len(servers) > 1:
            for arm in failed:
                if self.left_s() < start_cost(1) + 30:
                    break
                infos[arm]["first_try"] = infos[arm].pop("error")
                servers[arm] = self._server(arm)
                try:
                    infos[arm]["start_s"] = servers[arm].start()
                    infos[arm]["alone"] = True
                    infos[arm].pop("log_tail", None)
                except Exception as e:
                    infos[arm]["error"] = f"{type(e).__name__}: {e}"
                    infos[arm]["log_tail"] = servers[arm].log_tail()
                    servers[arm].stop()
        for arm, server in servers.items():
            if "error" in infos[arm]:
                continue
            try:
                warm = ab._variant(self.args, output_len=16, concurrency=4)
                sb.warm_up(server, self.model, warm, self.work)
                self.servers[arm] = server
            except Exception as e:
                infos[arm]["error"] = f"warm-up: {type(e).__name__}: {e}"
                infos[arm]["log_tail"] = server.log_tail()
                server.stop()
            infos[arm]["log_facts"] = figures.log_facts(server.log_text())
        self.report["servers"].update(infos)

    def series_error(self) -> str | None:
        """Build (once) the series' vLLM copy the series arms run; why it
        could not be built, else None. Recorded in the report."""
        if "series_tree" not in self.report:
            t = time.monotonic()
            try:
                built = series_tree.build(self.args.series_tree)
            except Exception as e:
                built = {"error": f"{type(e).__name__}: {e}"}
            built["build_s"] = round(time.monotonic() - t, 1)
            self.report["series_tree"] = built
        return self.report["series_tree"].get("error")

    def stop(self, arms: list[str]) -> None:
        for arm in arms:
            server = self.servers.pop(arm, None)
            if server is not None:
                server.stop()
                info = self.report["servers"][arm]
                info["log_facts"] = figures.log_facts(server.log_text())

    # steps
    def ttft(self, it: Item) -> dict[str, Any]:
        server, a = self.servers[it.arm], self.args
        seed = a.seed + 1000 + 10 * it.length // 1024 + it.probe
        one = ab._variant(
            a, prefix_len=it.length - a.probe_suffix_len,
            suffix_len=a.probe_suffix_len, output_len=1, concurrency=1,
        )  # fmt: skip
        fill = ab._variant(
            a, prefix_len=a.filler_len - a.probe_suffix_len,
            suffix_len=a.probe_suffix_len, output_len=1, concurrency=4,
        )  # fmt: skip
        rec: dict[str, Any] = {"arm": it.arm, "length": it.length, "probe": it.probe}
        server.reset_prefix_cache()
        cold = self.client(server, one, 1, 1, seed)
        rec["cold_ttft_ms"] = cold["ttfts"][0] * 1000
        rec["prompt_tokens"] = (cold.get("input_lens") or [None])[0]
        rec["cold_text"] = (cold.get("generated_texts") or [None])[0]
        if it.cold_only:
            return rec
        rec.update(self.repeat_after_eviction(server, one, fill, filler_count(a), seed))
        return rec

    def run(self, it: Item) -> dict[str, Any]:
        server, a = self.servers[it.arm], self.args
        lv = sb.LEVELS[it.level]
        rec: dict[str, Any] = {
            "step": it.step, "arm": it.arm, "level": it.level,
            "concurrency": a.concurrency, "repeat": it.repeat, "summary": None,
        }  # fmt: skip
        server.reset_prefix_cache()
        before = server.settled_metrics()
        offset = len(server.log_text())
        t = time.monotonic()
        result = self.client(
            server, a, lv.num_prefixes(a.num_prompts), a.num_prompts, a.seed
        )
        rec["client_wall_s"] = time.monotonic() - t
        delta = sb.metric_delta(before, server.settled_metrics())
        s = sb.summarize_client(result)
        rec["hits"] = figures.hit_rate(delta)
        rec["tier_step_us"] = figures.tier_step_us(delta)
        rec["iterations"] = iterations(server.log_text()[offset:])
        rec["server_metrics_delta"] = delta
        rec["texts"] = result.get("generated_texts")
        rec["input_lens"] = result.get("input_lens")
        sb.raise_on_failures(result, s, rec)
        rec["summary"] = s
        return rec

    def item(self, it: Item) -> None:
        t = time.monotonic()
        dest = "ttft" if it.step == "ttft" else "runs"
        try:
            rec = self.ttft(it) if it.step == "ttft" else self.run(it)
        except Exception as e:
            rec = {"step": it.step, "arm": it.arm, "length": it.length,
                   "level": it.level, "repeat": it.repeat, "probe": it.probe,
                   "error": f"{type(e).__name__}: {e}",
                   "server_log_tail": self.servers[it.arm].log_tail()}  # fmt: skip
        rec["wall_s"] = time.monotonic() - t
        self.report[dest].append(rec)
        print(f"  {it.name}: {rec.get('error') or 'ok'} in {rec['wall_s']:.1f} s",
              flush=True)  # fmt: skip

    def summarize(self) -> None:
        arms = [a for a in ARMS if a in self.report["servers"]]
        runs = [r for r in self.report["runs"] if r.get("summary")]
        self.report["summary"] = {
            "ttft": summarize_ttft(self.report["ttft"], arms),
            "profile": summarize_profile(self.report["runs"], arms),
            "throughput": figures.summarize_runs(runs, arms, self.tokenize),
            "layouts": {
                arm: info.get("log_facts", {}).get("kv_cache_layout")
                for arm, info in self.report["servers"].items()
            },
        }

    def main(self) -> int:
        try:
            for action in schedule(self.args):
                if action.kind == "stop":
                    self.stop(action.arms)
                    continue
                if action.kind == "start":
                    first = action.estimate_s + 10.0
                    if self.left_s() < first:
                        self.report["skipped"].append(f"start {','.join(action.arms)}")
                        continue
                    print(f"=== start {', '.join(action.arms)}", flush=True)
                    self.start(action.arms)
                    self.save()
                    continue
                it = action.item
                assert it is not None
                if it.arm not in self.servers:
                    self.report["skipped"].append(f"{it.name} (arm not running)")
                    continue
                if self.left_s() < action.estimate_s:
                    self.report["skipped"].append(f"{it.name} (past --max-wall-s)")
                    print(f"  skipped (past --max-wall-s): {it.name}", flush=True)
                    continue
                self.item(it)
                self.summarize()
                self.save()
        finally:
            self.stop(list(self.servers))
            self.summarize()
            for r in self.report["runs"]:
                r["text_digest"] = sb._text_digest(r.pop("texts", None) or [])
            self.save()
        return self.finish("runs", "ttft")


def machine_facts() -> dict[str, Any]:
    """What the connectors' host memory depends on (OffloadingConnector's
    region lives in /dev/shm)."""
    facts: dict[str, Any] = {}
    for key, path in (("dev_shm", "/dev/shm"), ("tmp", "/tmp")):
        with contextlib.suppress(OSError):
            st = os.statvfs(path)
            facts[f"{key}_free_gib"] = round(st.f_bavail * st.f_frsize / GIB, 1)
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(("MemTotal", "MemAvailable")):
                name, kib = line.split(":")
                facts[f"{name.lower()}_gib"] = round(int(kib.split()[0]) / (1 << 20), 1)
    return facts


# -- command line -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="write the plan only")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/real")))
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-work" / "real_size",
                   help="server and client logs")  # fmt: skip
    p.add_argument("--model-cache", type=Path,
                   default=ROOT / ".gpu-work" / "shape-models")  # fmt: skip
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", default=",".join(STEPS), help=f"of {STEPS}")
    p.add_argument("--ttft-lens", default="4096,16384,32768")
    p.add_argument("--ttft-arms", default="tier,simple_lazy,offloading,none")
    p.add_argument("--probes", type=int, default=1)
    p.add_argument("--probe-suffix-len", type=int, default=32)
    p.add_argument("--filler-len", type=int, default=8192)
    p.add_argument("--profile-arms", default="none,noop,tier,simple_lazy,offloading")
    p.add_argument("--throughput-arms", default="none,tier,simple_lazy",
                   help="simple_lazy_series (the series' vLLM, needs this "
                   "checkout's kvmem_tools and git or a carried series) when "
                   "asked")  # fmt: skip
    p.add_argument("--layout-arms", default="none,blhnc")
    p.add_argument("--layout-repeats", type=int, default=1)
    p.add_argument("--levels", default="unique,eighty", help="0%% and 80%% reuse")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=33792)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--device-kv-tokens", type=int, default=36864,
                   help="device KV cache (a 32k prompt; c16 of 2,304)")  # fmt: skip
    p.add_argument("--host-bytes", type=int, default=8 * GIB)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--cudagraph-sizes", default="1,2,4,8,16,24,32")
    p.add_argument("--eager", action="store_true",
                   help="--enforce-eager everywhere (if CUDA graphs fail)")  # fmt: skip
    p.add_argument("--no-iteration-details", dest="iteration_details",
                   action="store_false")  # fmt: skip
    p.add_argument("--max-live", type=int, default=3,
                   help="servers at once (three 8B servers fit an H100)")  # fmt: skip
    p.add_argument("--series-tree", type=Path, default=series_tree.TREE,
                   help="the series' vLLM copy (built if absent)")  # fmt: skip
    p.add_argument("--max-wall-s", type=float, default=480.0)
    args = p.parse_args(argv)
    args.step_list = csv_list(args.steps)
    args.ttft_len_list = [int(x) for x in csv_list(args.ttft_lens)]
    args.ttft_arm_list = csv_list(args.ttft_arms)
    args.profile_arm_list = csv_list(args.profile_arms)
    args.throughput_arm_list = csv_list(args.throughput_arms)
    args.layout_arm_list = csv_list(args.layout_arms)
    args.cudagraph_size_list = [int(x) for x in csv_list(args.cudagraph_sizes)]
    bad = [s for s in args.step_list if s not in STEPS]
    arms = (
        args.ttft_arm_list + args.profile_arm_list + args.throughput_arm_list
        + args.layout_arm_list
    )  # fmt: skip
    bad += [a for a in arms if a not in ARMS]
    if bad:
        p.error(f"unknown {sorted(set(bad))}: steps of {STEPS}, arms of {ARMS}")
    if "none" not in args.throughput_arm_list + args.layout_arm_list:
        p.error("--throughput-arms / --layout-arms need 'none' (the reference)")
    if max(args.ttft_len_list) + 8 > args.max_model_len:
        p.error("--max-model-len must hold the longest --ttft-lens prompt")
    if args.device_kv_tokens < args.max_model_len:
        p.error("--device-kv-tokens below --max-model-len: vLLM refuses to start")
    args.level_list = [sb.LEVELS[x] for x in csv_list(args.levels)]
    # serving_bench's names: its server flags and client read these.
    args.kv_cache_bytes_int = args.device_kv_tokens * kv_bytes_per_token(args)
    args.kv_cache_bytes = str(args.kv_cache_bytes_int)
    args.host_cache_bytes = str(args.host_bytes)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        plan = build_plan(args)
        folder = shape(args).ensure(args.model_cache)  # config only, no weights
        plan["model"]["written"] = sorted(p.name for p in folder.iterdir())
        shown = ("estimate_s", "estimate_by_step_s", "estimate_starts_s")
        write_dry_run(plan, args.out, "real_size", shown)
        return 0
    return ab.run_on_gpu(RealSize, args, argv)


if __name__ == "__main__":
    sys.exit(main())
