"""Issue 30 on the GPU machine: our host KV tier against vLLM's CPU offloading.

Ran once on an NVIDIA H200 on 2026-11-26 (arms none, tier and simple_lazy,
one repeat: ``benchmarks/results/ab_offload_h200.json``); the ``offloading``
and ``noop`` arms have not run on a GPU. vLLM's two offloading connectors
run on CUDA only. Stage 2's item g runs it (``bash scripts/gpu/stage2.sh
--items g``: vLLM 0.32 installed, vLLM and the plugin on ``PYTHONPATH``);
on any CUDA machine with vLLM 0.32/0.33 and vllm-kvmem installed it runs as
it is. ``--dry-run`` prints and writes the plan anywhere, importing neither
torch nor vLLM and starting nothing. Every server gets
``gpu_common.SERVER_ENV`` (``VLLM_USE_FLASHINFER_SAMPLER=0``: without
flashinfer installed, vLLM 0.32's sampler fails the engine's start).

Arms, one vLLM OpenAI server each, all started in the same call:
``benchmarks/serving_bench.py``'s server (its 8-layer float32 random-weight
Llama, 8 KiB of KV a token, ``--kv-cache-memory-bytes`` 16 MiB: 2,048 tokens
in 64 blocks of 32, ``--enforce-eager``, ``--max-model-len 1024``), the same
device KV bytes, the same host bytes (256 MiB: 1,024 blocks of 256 KiB in
every arm) and the same ``--max-num-batched-tokens``:

* ``none``: the plugin loaded, no kvmem flag: the tier off, evicted prefixes
  are recomputed. The reference for greedy identity and for a recompute's TTFT.
* ``tier``: ``--kv-host-cache-bytes HOST``, vllm-kvmem's host tier (blocks
  near eviction copied behind, loaded back on a hit).
* ``simple_lazy``: ``SimpleCPUOffloadConnector`` in ``lazy_offload`` mode,
  ``--kv-transfer-config`` with ``kv_connector_extra_config``
  ``{"cpu_bytes_to_use": HOST, "lazy_offload": true}`` (the keys vLLM 0.32
  and 0.33 read in ``simple_cpu_offload_connector.py``): cached blocks are
  offloaded as they near eviction, the same idea as the tier's write-behind.
  Its lazy target is ``2 * ceil(max_num_batched_tokens / block_size)`` device
  blocks (``SimpleCPUOffloadScheduler._estimate_lazy_target_blocks``): 32 of
  the 64 with the default 512 batched tokens. Plain vLLM (``VLLM_PLUGINS=``).
* ``offloading`` (the issue's third arm "if device time allows": add it with
  ``--arms``): ``--kv-offloading-size HOST/GiB``, which vLLM 0.32 turns into
  ``OffloadingConnector`` with ``cpu_bytes_to_use`` (its ``native`` backend,
  ``VLLM_USE_SIMPLE_KV_OFFLOAD`` unset): every block stored as it is
  computed. Plain vLLM.

Workload: ``serving_bench.py``'s prefix reuse, through its client (vLLM's
``vllm bench serve``, ``prefix_repetition``) and its server handling (reset
of the device prefix cache and the connector's host blocks before every run,
an untimed warm-up per server, ``/metrics`` deltas):

1. TTFT probes, ``--probes`` per arm (interleaved across arms): reset, one
   416-token prompt (cold), ``--evict-prompts`` other prompts (more than the
   device holds, so the first is evicted from the device), the first prompt
   again. Its TTFT is a host hit in the tier arms (the connector's hit
   tokens over that request are recorded to show it) and a recompute in
   ``none``: "TTFT on a host hit against recompute", paired by probe.
2. Throughput: ``--levels`` (default ``high``: 16 prefixes of 384 tokens,
   each used by 6 of 96 prompts, 32-token suffixes, 64 tokens out) at each of
   ``--concurrencies`` (default 4: the device holds about 4 requests; 8:
   oversubscribed, requests queue and are preempted), ``--repeats`` times,
   arms interleaved per repeat (default 1 repeat: with 2 the plan did not fit
   the H200 session's 320 s; the estimate uses the costs measured there).

Figures: greedy identity of every arm against ``none`` (texts per prompt,
same prompts in the same order; ``none`` against its own repeat 0 as the
floor of what batching allows), host hit rate (vLLM's own
``external_prefix_cache_hits / external_prefix_cache_queries``, which every
connector feeds, and hits over prompt tokens), TTFT of a host hit against
recompute, request and output-token throughput with TTFT and ITL
percentiles, each arm over ``none`` paired per repeat.

Everything is written to ``$OUT/ab_offload_<gpu>.json`` (``_h100`` on an
H100, ``_h200`` on an H200: named from ``nvidia-smi``), labelled GPU with the
device, rewritten
after every step, so a call cut off at its limit keeps what finished; steps
that would start after ``--max-wall-s`` are skipped and recorded as such.
Exit 0 when every step ran, 1 when a step failed or an arm did not start, 3
when steps were skipped.
Server and client logs go to ``--work`` (stage 2 packs them into
``stage2_logs.tar.gz``). Without an NVIDIA GPU it refuses to run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_bench as sb  # noqa: E402  (no vLLM or torch at import)
from ab_figures import (  # noqa: E402
    hit_rate,
    log_facts,
    summarize_probes,
    summarize_runs,
    tier_step_us,
)
from gpu_common import (  # noqa: E402
    MEASURED_S,
    SERVER_ENV,
    device_suffix,
    gpu_info,
    gpu_label,
    write_dry_run,
)

ARMS = ("none", "noop", "tier", "simple_lazy", "offloading")
DEFAULT_ARMS = ("none", "tier", "simple_lazy")
GIB = 1 << 30
MIB = 1 << 20
#: serving_bench's model: 8 layers x (K, V) x 2 KV heads x 64 x float32.
KV_BYTES_PER_TOKEN = 8 * 2 * 2 * 64 * 4
#: Counters read from each server's /metrics (deltas per run).
METRICS = sb.METRICS + (
    "vllm:external_prefix_cache_queries_total",
    "vllm:simple_kv_offload_load_blocks_total",
    "vllm:simple_kv_offload_save_outcomes_total",
    "vllm:kv_offload_load_bytes_total",
    "vllm:kv_offload_store_bytes_total",
    # The tier's own time per engine step, each side (its histograms).
    "vllm:kvmem_host_scheduler_step_seconds_sum",
    "vllm:kvmem_host_scheduler_step_seconds_count",
    "vllm:kvmem_host_worker_step_seconds_sum",
    "vllm:kvmem_host_worker_step_seconds_count",
)
#: The plan's costs, measured on the H200 run of 2026-11-26 (tiny model):
#: a server's start and warm-up, one probe (three client calls), one
#: throughput run (96 prompts, c4 or c8), and the rest (stopping the
#: servers, the report). Three arms, one repeat: 336 s estimated, 332 s run.
MEASURED_COST_S = {
    "server_start_and_warm_up": MEASURED_S["server_start_eager"],
    "probe": MEASURED_S["ab_probe"],
    "throughput_run": MEASURED_S["ab_throughput_run"],
    "fixed": MEASURED_S["ab_fixed"],
}


# -- the plan (no vLLM, no torch) --------------------------------------------------


def model_path(args: argparse.Namespace) -> Path:
    """Where ``serving_bench.ensure_model`` builds the model under the cache."""
    return args.model_cache / "L8-H256-KV2-D64-float32"


def arm_config(arm: str, host_bytes: int) -> dict[str, Any]:
    """An arm's extra server flags and environment, and what it is."""
    plain = {"VLLM_PLUGINS": ""}  # vLLM loads no plugin: nothing of ours runs
    if arm == "none":
        return {"flags": [], "env": {}, "unset_env": [], "what": "tier off"}
    if arm == "noop":
        # A connector that does nothing (the tests' example connector,
        # asking for no layout): vLLM's own per-step work for any connector.
        config = {
            "kv_connector": "ContiguousLayoutExampleConnector",
            "kv_connector_module_path": "tests.contiguous_example",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_cache_layout": None},
        }
        path = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
        )
        return {
            "flags": ["--kv-transfer-config", json.dumps(config)],
            "env": {**plain, "PYTHONPATH": path},
            "unset_env": [],
            "what": "a do-nothing KV connector (vLLM's connector plumbing alone)",
        }
    if arm == "tier":
        return {
            "flags": ["--kv-host-cache-bytes", str(host_bytes)],
            "env": {},
            "unset_env": [],
            "what": "vllm-kvmem host tier",
        }
    if arm == "simple_lazy":
        config = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": host_bytes,
                "lazy_offload": True,
            },
        }
        return {
            "flags": ["--kv-transfer-config", json.dumps(config)],
            "env": plain,
            "unset_env": [],
            "what": "vLLM SimpleCPUOffloadConnector, lazy_offload",
        }
    if arm == "offloading":
        return {
            "flags": ["--kv-offloading-size", repr(host_bytes / GIB)],
            "env": plain,
            "unset_env": ["VLLM_USE_SIMPLE_KV_OFFLOAD"],
            "what": "vLLM OffloadingConnector (--kv-offloading-size, native)",
        }
    raise ValueError(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")


def server_cmd(arm: str, model: Path, args: argparse.Namespace) -> list[str]:
    """serving_bench's server flags (its ``none`` config), the A/B's common
    flags, then the arm's own."""
    base = sb.server_args("none", model, args)
    return [
        *base,
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        *arm_config(arm, args.host_bytes)["flags"],
    ]  # fmt: skip


def evict_prompts(args: argparse.Namespace) -> int:
    """Prompts that overflow the device KV cache twice over."""
    if args.evict_prompts:
        return args.evict_prompts
    device_tokens = args.kv_cache_bytes_int // KV_BYTES_PER_TOKEN
    prompt = args.prefix_len + args.suffix_len
    return max(2, 2 * -(-device_tokens // prompt))


def estimate_s(args: argparse.Namespace) -> int:
    """Device seconds of the whole plan, from the costs measured on the H200."""
    n = len(args.arm_list)
    runs = n * len(args.level_list) * len(args.concurrency_list) * args.repeats
    return round(
        n * MEASURED_COST_S["server_start_and_warm_up"]
        + n * args.probes * MEASURED_COST_S["probe"]
        + runs * MEASURED_COST_S["throughput_run"]
        + MEASURED_COST_S["fixed"]
    )


def build_plan(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    block_bytes = KV_BYTES_PER_TOKEN * args.block_size
    arms = {}
    for arm in args.arm_list:
        cfg = arm_config(arm, args.host_bytes)
        arms[arm] = {
            "what": cfg["what"],
            "server": ["python", "-m", "vllm.entrypoints.openai.api_server"]
            + server_cmd(arm, model, args),
            "env": cfg["env"],
            "unset_env": cfg["unset_env"],
        }
    return {
        "issue": 30,
        "script": "scripts/gpu/ab_offload.py",
        "status": "ran on an NVIDIA H200 on 2026-11-26 with arms none, tier and "
        "simple_lazy, one repeat; the offloading and noop arms have not run on "
        "a GPU",
        "arms": arms,
        "server_env": SERVER_ENV,
        "equal_in_every_arm": {
            "model": f"{model} (serving_bench: 8 layers, hidden 256, 2 KV heads of "
            "64, float32, random weights)",
            "device_kv_bytes": args.kv_cache_bytes_int,
            "device_kv_blocks": args.kv_cache_bytes_int // block_bytes,
            "host_bytes": args.host_bytes,
            "host_blocks": args.host_bytes // block_bytes,
            "block_size_tokens": args.block_size,
            "block_bytes": block_bytes,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "simple_lazy_target_blocks": 2
            * -(-args.max_num_batched_tokens // args.block_size),
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
        "workload": {
            "client": "vllm.benchmarks.serve (vllm bench serve), prefix_repetition, "
            "through benchmarks/serving_bench.py",
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "levels": {
                lv.name: {
                    "num_prefixes": lv.num_prefixes(args.num_prompts),
                    "reuse": lv.reuse(args.num_prompts),
                }
                for lv in args.level_list
            },
            "concurrencies": args.concurrency_list,
            "repeats": args.repeats,
            "seed": args.seed,
            "probes": {
                "count": args.probes,
                "evict_prompts": evict_prompts(args),
                "output_len": args.probe_output_len,
                "steps": "reset; prompt P (cold); evict_prompts other prompts; "
                "P again (host hit in a tier arm, recompute in none)",
            },
        },
        "figures": [
            "greedy identity against none (texts per prompt), none against its "
            "repeat 0",
            "host hit rate: external_prefix_cache_hits / _queries, and over prompt "
            "tokens",
            "TTFT of the probe's repeat: host hit (tier arms) against recompute "
            "(none), paired by probe",
            "request and output-token throughput, TTFT and ITL p50/p99 per "
            "concurrency, arm/none paired per repeat",
            "per-step profile: the tier's own mean time per engine step, "
            "scheduler and worker side (its /metrics histograms, per run); the "
            "noop arm (--arms none,noop,...) is vLLM's connector plumbing alone, "
            "so its ITL against none is what any connector costs",
        ],
        "output": "$OUT/ab_offload_<gpu>.json, <gpu> from nvidia-smi (h100 on an "
        "H100, h200 on an H200, else the name as a slug), labelled GPU with the "
        "device; logs in --work",
        "verified_on_gpu": [
            "H200, 2026-11-26: three servers side by side at "
            "--gpu-memory-utilization 0.15; float32 runs TRITON_ATTN on the V2 "
            "model runner; SimpleCPUOffloadConnector's lazy mode loads host hits",
        ],
        "unverified_assumptions": [
            "OffloadingConnector's host buffer is a shared mmap region "
            "(SharedOffloadRegion; /dev/shm's size on the machine is unknown)",
            "the noop arm's connector (tests.contiguous_example) loads in a GPU "
            "server from PYTHONPATH",
            f"{len(args.arm_list)} servers side by side on one GPU at "
            f"--gpu-memory-utilization {args.gpu_memory_utilization} each",
        ],
        "max_wall_s": args.max_wall_s,
        "estimate_s": estimate_s(args),
        "estimate_from_measured_s": MEASURED_COST_S,
        "steps": len(args.arm_list) * (1 + args.probes)
        + len(args.arm_list)
        * len(args.level_list)
        * len(args.concurrency_list)
        * args.repeats,
    }


# -- the run (GPU) ----------------------------------------------------------------


class ABServer(sb.Server):
    """serving_bench's server, reading the A/B's counters too."""

    def metrics(self) -> dict[str, float]:
        return sb.parse_metrics(sb.http(f"{self.url}/metrics", timeout=30)[1], METRICS)


def _variant(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))
    for k, v in changes.items():
        setattr(ns, k, v)
    return ns


class GpuSession:
    """What a GPU script's run holds: its servers, the report it rewrites
    after every step, the wall-clock budget and vLLM's client. ``AB`` here
    and ``real_size.RealSize`` fill the report their own way."""

    script = "ab_offload"

    def __init__(
        self,
        args: argparse.Namespace,
        gpu: dict[str, str],
        argv: list[str],
        model: Path,
        benchmark: str,
        **report: Any,
    ) -> None:
        self.args = args
        self.work: Path = args.work
        self.work.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        suffix = device_suffix(gpu["name"])
        self.out_path = args.out / f"{self.script}_{suffix}.json"
        self.model = model
        self.servers: dict[str, ABServer] = {}
        self.calls = 0
        self._tokenizer: Any = None
        self.report: dict[str, Any] = {
            "benchmark": benchmark,
            "platform": "GPU",
            "label": gpu_label(gpu),
            "device": gpu,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", f"scripts/gpu/{self.script}.py", *argv]),
            "versions": sb.versions(),
            **report,
        }

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.model / "tokenizer.json"))
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def left_s(self) -> float:
        return self.args.max_wall_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.report["wall_s"] = time.monotonic() - self.t0
        tmp = self.out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        tmp.replace(self.out_path)

    def client(self, server: ABServer, ns: argparse.Namespace, prefixes: int,
               prompts: int, seed: int) -> dict[str, Any]:  # fmt: skip
        self.calls += 1
        name = f"client-{self.calls:04d}-{server.config}.json"
        argv = sb.client_argv(
            server, self.model, ns, prefixes, prompts, seed, self.work, name
        )
        try:
            return sb.run_client(
                argv, self.work / f"client-{server.config}.log", sb.RUN_TIMEOUT_S
            )
        finally:  # what it holds goes into this report; keep the logs small
            (self.work / name).unlink(missing_ok=True)

    def repeat_after_eviction(
        self,
        server: ABServer,
        one: argparse.Namespace,
        fill: argparse.Namespace,
        n: int,
        seed: int,
    ) -> dict[str, Any]:
        """The probe prompt (``one``, ``seed``) again after ``n`` filler
        prompts evicted it from the device: its TTFT and text, and the
        connector's hits over that request (a host hit, or a recompute)."""
        self.client(server, fill, n, n, seed + 500)
        before = server.settled_metrics()
        again = self.client(server, one, 1, 1, seed)
        delta = sb.metric_delta(before, server.settled_metrics())
        return {
            "repeat_ttft_ms": again["ttfts"][0] * 1000,
            "repeat_text": (again.get("generated_texts") or [None])[0],
            "repeat": hit_rate(delta),
            "repeat_delta": delta,
        }

    def finish(self, *steps: str) -> int:
        """The summary, the last line, and the exit code: 1 when a step of
        the report's ``steps`` lists failed or an arm did not start, 3 when
        steps were skipped, else 0."""
        print(json.dumps(self.report.get("summary", {}), default=str)[:3000])
        failed = [r for key in steps for r in self.report[key] if r.get("error")]
        down = [arm for arm, i in self.report["servers"].items() if i.get("error")]
        skipped = self.report["skipped"]
        print(
            f"JSON: {self.out_path}; failed steps {len(failed)}, arms down {down}, "
            f"skipped steps {len(skipped)}"
        )
        return 1 if failed or down else 3 if skipped else 0


def arm_env(cfg: dict[str, Any]) -> dict[str, str]:
    """A server's environment: serving_bench's, what the GPU machine needs
    (``SERVER_ENV``: no flashinfer there), then the arm's own."""
    env = sb.server_env(1)
    for key, value in SERVER_ENV.items():
        env.setdefault(key, value)
    for key in cfg["unset_env"]:
        env.pop(key, None)
    env.update(cfg["env"])
    return env


def run_on_gpu(session: Any, args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run ``session(args, gpu, argv).main()`` on this machine's NVIDIA GPU;
    2 (and a line saying why) without one."""
    gpu = gpu_info()
    if gpu is None:
        print(f"{session.script}: needs an NVIDIA GPU (nvidia-smi found none); "
              "--dry-run writes the plan anywhere")  # fmt: skip
        return 2
    # SIGTERM (a call's limit) runs the finally that stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(KeyboardInterrupt):
        return session(args, gpu, list(sys.argv[1:] if argv is None else argv)).main()
    return 130


class AB(GpuSession):
    def __init__(
        self, args: argparse.Namespace, gpu: dict[str, str], argv: list[str]
    ) -> None:
        model = sb.ensure_model(args.model_cache)
        super().__init__(
            args,
            gpu,
            argv,
            model,
            "ab_offload (issue 30)",
            plan=build_plan(args, model),
            servers={},
            probes=[],
            runs=[],
            skipped=[],
        )

    def start(self, arm: str) -> None:
        cfg = arm_config(arm, self.args.host_bytes)
        env = arm_env(cfg)
        server = ABServer(
            arm,
            server_cmd(arm, self.model, self.args),
            env,
            self.work / f"server-{arm}.log",
        )
        info: dict[str, Any] = {"cmd": server.args, "env": cfg["env"]}
        try:
            info["start_s"] = server.start()
            sb.warm_up(server, self.model, self.args, self.work)
            self.servers[arm] = server
        except Exception as e:  # the other arms go on
            info["error"] = f"{type(e).__name__}: {e}"
            info["log_tail"] = server.log_tail()
            server.stop()
        info["log_facts"] = log_facts(server.log_text())
        self.report["servers"][arm] = info

    def probe(self, arm: str, k: int) -> dict[str, Any]:
        server, a = self.servers[arm], self.args
        seed = a.seed + 1000 + k
        one = _variant(a, output_len=a.probe_output_len, concurrency=1)
        many = _variant(a, output_len=a.probe_output_len)
        rec: dict[str, Any] = {"arm": arm, "probe": k, "seed": seed}
        try:
            server.reset_prefix_cache()
            cold = self.client(server, one, 1, 1, seed)
            n = evict_prompts(a)
            rec.update(
                cold_ttft_ms=cold["ttfts"][0] * 1000,
                cold_text=(cold.get("generated_texts") or [None])[0],
                **self.repeat_after_eviction(server, one, many, n, seed),
            )
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["server_log_tail"] = server.log_tail()
        return rec

    def run(self, arm: str, level: Any, conc: int, rep: int) -> dict[str, Any]:
        server, a = self.servers[arm], self.args
        rec: dict[str, Any] = {
            "arm": arm,
            "level": level.name,
            "concurrency": conc,
            "repeat": rep,
            "summary": None,
        }
        try:
            server.reset_prefix_cache()
            before = server.settled_metrics()
            t = time.monotonic()
            result = self.client(
                server,
                _variant(a, concurrency=conc),
                level.num_prefixes(a.num_prompts),
                a.num_prompts,
                a.seed,
            )
            rec["client_wall_s"] = time.monotonic() - t
            delta = sb.metric_delta(before, server.settled_metrics())
            s = sb.summarize_client(result)
            rec["hits"] = hit_rate(delta)
            rec["tier_step_us"] = tier_step_us(delta)
            rec["server_metrics_delta"] = delta
            rec["texts"] = result.get("generated_texts")
            rec["input_lens"] = result.get("input_lens")
            sb.raise_on_failures(result, s, rec)
            rec["summary"] = s
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["server_log_tail"] = server.log_tail()
        return rec

    def step(self, what: str, fn: Any, dest: str) -> None:
        if self.left_s() <= 0:
            self.report["skipped"].append(what)
            print(f"  skipped (past --max-wall-s): {what}", flush=True)
            return
        t = time.monotonic()
        rec = fn()
        rec["wall_s"] = time.monotonic() - t
        self.report[dest].append(rec)
        print(
            f"  {what}: {rec.get('error') or 'ok'} in {rec['wall_s']:.1f} s",
            flush=True,
        )
        self.summarize()
        self.save()

    def summarize(self) -> None:
        arms = [a for a in self.args.arm_list if a in self.report["servers"]]
        self.report["summary"] = {
            "ttft_probes": summarize_probes(self.report["probes"], arms),
            "throughput": summarize_runs(self.report["runs"], arms, self.tokenize),
        }

    def main(self) -> int:
        a = self.args
        try:
            for arm in a.arm_list:
                if self.left_s() <= 0:
                    self.report["skipped"].append(f"start {arm}")
                    continue
                print(f"=== start {arm}", flush=True)
                self.start(arm)
                self.save()
            live = [arm for arm in a.arm_list if arm in self.servers]
            for k in range(a.probes):
                for arm in live:
                    self.step(
                        f"probe {k} {arm}", functools.partial(self.probe, arm, k),
                        "probes",
                    )  # fmt: skip
            for rep in range(a.repeats):
                for lv in a.level_list:
                    for conc in a.concurrency_list:
                        for arm in live:
                            self.step(
                                f"run {lv.name} c{conc} #{rep} {arm}",
                                functools.partial(self.run, arm, lv, conc, rep),
                                "runs",
                            )
        finally:
            for server in self.servers.values():
                server.stop()
            for arm, info in self.report["servers"].items():
                path = self.work / f"server-{arm}.log"
                if path.is_file():
                    info["log_facts"] = log_facts(path.read_text(errors="replace"))
            for r in self.report["runs"]:
                texts = r.pop("texts", None)
                r["text_digest"] = sb._text_digest(texts or [])
            self.save()
        return self.finish("runs", "probes")


# -- command line -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {ARMS}")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/ab")))
    p.add_argument(
        "--work",
        type=Path,
        default=ROOT / ".gpu-work" / "ab_offload",
        help="server and client logs",
    )
    p.add_argument(
        "--model-cache",
        type=Path,
        default=ROOT / ".gpu-work" / "serving-model",
        help="where serving_bench's model is built (once)",
    )
    p.add_argument("--levels", default="high", help=f"of {','.join(sb.LEVELS)}")
    p.add_argument("--concurrencies", default="4,8")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--probes", type=int, default=3)
    p.add_argument("--probe-output-len", type=int, default=1)
    p.add_argument("--evict-prompts", type=int, default=0, help="0: from the sizes")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-bytes", type=int, default=16 * MIB)
    p.add_argument("--host-bytes", type=int, default=256 * MIB)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    p.add_argument("--max-wall-s", type=float, default=500.0)
    args = p.parse_args(argv)
    args.arm_list = [x.strip() for x in args.arms.split(",") if x.strip()]
    bad = [x for x in args.arm_list if x not in ARMS]
    if bad or "none" not in args.arm_list:
        p.error(f"--arms: unknown {bad} or no 'none' (the reference); of {ARMS}")
    args.level_list = [sb.LEVELS[x.strip()] for x in args.levels.split(",")]
    args.concurrency_list = [int(x) for x in args.concurrencies.split(",")]
    # serving_bench's names: its server flags and client read these.
    args.kv_cache_bytes_int = args.kv_cache_bytes
    args.kv_cache_bytes = str(args.kv_cache_bytes)
    args.host_cache_bytes = str(args.host_bytes)
    args.concurrency = args.concurrency_list[0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        write_dry_run(build_plan(args, model_path(args)), args.out, "ab_offload", None)
        return 0
    return run_on_gpu(AB, args, argv)


if __name__ == "__main__":
    sys.exit(main())
