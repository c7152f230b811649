"""Stage 2 of issue 17: vLLM 0.32 with the plugin on the GPU machine.

Items a and g ran on an NVIDIA H200 on 2026-11-26 (after their engines were
given ``VLLM_USE_FLASHINFER_SAMPLER=0``); b-f and h-j have not run on a GPU.
It runs after ``install_pieces.py install`` put vLLM and its wheels in a
target folder (``stage2.sh`` sets ``PYTHONPATH``). Every engine gets
``gpu_common.SERVER_ENV`` (vLLM 0.32's sampler imports flashinfer at start
otherwise, which the recipe does not carry). Items (the issue's a-e), each
engine in a subprocess of its own (this file with ``--child``), greedy, on a
tiny random model that ``kvmem tiny-model`` writes:

a. plugin installed, no kvmem flags, against plain vLLM (``VLLM_PLUGINS=``
   loads none): KV blocks and greedy tokens equal; ``torch.cuda`` untouched
   and no ``vllm.v1.worker.cpu*`` module in the LLM process and the worker;
b. host tier on and off (small device KV cache, so the first prompt is
   evicted): greedy tokens equal, cached tokens on the repeat, time to first
   token of the repeat (host hit against recompute);
c. the contiguous opt-in (``tests.contiguous_example``'s connector) on
   FLASH_ATTN against the default layout: tokens equal, decode throughput
   (bfloat16, ``attention_backend="FLASH_ATTN"``: vLLM 0.32 has no
   ``VLLM_ATTENTION_BACKEND`` variable, and float32 gets TRITON_ATTN);
d. ``kv_cache_tokens`` far beyond the device (a clear refusal naming a
   figure, not an out-of-memory crash), then that figure (starts), then the
   same with CUDA graphs on; an explicit pipeline-proportional budget near
   the device limit;
e. FLASH_ATTN decode time per step with ``VLLM_KV_CACHE_LAYOUT`` LBNHC (its
   default), BLNHC and BLHNC, and greedy identity across them (bfloat16,
   ``attention_backend="FLASH_ATTN"``);
f. Ray (issue 19): the same engine, TP=1 PP=1, on the multiprocessing
   executor and on ``--distributed-executor-backend ray`` (vLLM's default Ray
   executor, RayExecutorV2), with ``kv_cache_tokens`` (the engine core
   collects the workers' device limits through ``collective_rpc``) and the
   host tier (its connector metadata comes back from a Ray worker): the
   plugin loaded in the Ray worker, the limits line logged, blocks, greedy
   tokens and the repeat's host hit equal to the multiprocessing run. Needs
   Ray, which the GPU machine lacks: its wheel is carried separately
   (``scripts/gpu/README.md``) into ``.gpu-site-ray``; without it the item
   records that Ray is missing and starts nothing.
g. issue 30's A/B: our host tier against vLLM's ``SimpleCPUOffloadConnector``
   with ``lazy_offload`` (and ``OffloadingConnector``, ``--kv-offloading-size``,
   when ``--ab-args`` adds the arm), ``benchmarks/serving_bench.py``'s
   prefix-reuse workload through vLLM's OpenAI server, same device KV and
   host bytes, in one call: ``scripts/gpu/ab_offload.py`` in a child process.
   Its figures go to ``$OUT/ab_offload_<gpu>.json`` (``_h200`` on an H200:
   named after the GPU), not to ``stage2_results.json``, which records only
   how the child ended.
h. issue 36's real-size run: the Llama-3.1-8B shape (``load_format="dummy"``,
   bfloat16, FLASH_ATTN), TTFT of a host hit against recompute at 4k-32k
   tokens per connector, the per-step profile, throughput at 0% and 80%
   reuse, BLHNC against the default layout: ``scripts/gpu/real_size.py`` in
   a child process (``--real-args``), figures in ``$OUT/real_size_<gpu>.json``.
i. issue 42's late-spill check: the plugin's tier and vLLM's lazy offload on
   a vLLM copy with the in-tree series (late spills), each under Model Runner
   V2 and V1, against no offload: greedy identity, host hits of revisited
   prefixes, late spills V2 zeroed or copied on write first (a mixed-precision
   fp8 cache): ``scripts/gpu/late_spill.py`` in a child process
   (``--late-args``), figures in ``$OUT/late_spill_<gpu>.json``.
j. issue 47's KV events and disk hits on CUDA: ``benchmarks/kv_events_check.py``
   on an OpenAI server with the host tier and the disk tier behind it, every
   request's cached tokens predicted from vLLM's ZMQ KV events (device, host
   and storage), disk hits on ``/metrics``: ``scripts/gpu/events_disk.py`` in
   a child process (``--events-args``), figures in
   ``$OUT/events_disk_<gpu>.json``.

The dry run's plan gives each item's device seconds from the costs measured
on the H200 (``gpu_common.MEASURED_S``: an eager engine start 35 s).

Each item's results are written to ``$OUT/stage2_results.json`` as soon as
it ends (a call cut off at its limit keeps what finished); each engine's
output goes into ``$OUT/stage2_logs.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import stage2_scripts  # noqa: E402
from gpu_common import MEASURED_S, SERVER_ENV, run_captured  # noqa: E402

REPORT = "KVMEM_STAGE2 "
ITEMS = "abcdefghij"
#: Engines per item (d: up to four, one of them capturing CUDA graphs; f: two
#: and Ray's own start) and the seconds of work beside the starts: the plan's
#: estimate, from an eager engine start measured on the H200 (item a: two
#: engines in 70 s). g, h and i are their scripts' own estimates.
ITEM_ENGINES = {"a": 2, "b": 2, "c": 2, "d": 4, "e": 3, "f": 2}
ITEM_EXTRA_S = {"a": 0, "b": 10, "c": 10, "d": 60, "e": 15, "f": 60}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(i * seed + 3) % len(WORDS)] for i in range(words))


# -- the child: one engine ---------------------------------------------------------


def probe(worker: Any = None) -> dict:
    """Who owns torch.cuda in this process (vLLM's CPU worker replaces it)."""
    import torch

    names = {
        "Stream": torch.cuda.Stream,
        "Event": torch.cuda.Event,
        "current_stream": torch.cuda.current_stream,
        "stream": torch.cuda.stream,
        "get_memory_info": getattr(torch.accelerator, "get_memory_info", None),
    }
    owners = {k: getattr(v, "__module__", None) for k, v in names.items()}
    return {
        "pid": os.getpid(),
        "in_worker": worker is not None,
        "owners": owners,
        "untouched": all((m or "torch").startswith("torch") for m in owners.values()),
        "cpu_worker_modules": sorted(
            m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")
        ),
        "kvmem_loaded": "vllm_kvmem.plugin" in sys.modules
        and bool(sys.modules["vllm_kvmem.plugin"]._state.get("patched")),
        "ray_actor": _ray_actor_id(),
    }


def _ray_actor_id() -> str | None:
    """The Ray actor this runs in (a Ray worker), else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


def child(spec: dict) -> dict:
    """Start ``LLM(**spec['llm'])``, run its phases, report."""
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    from vllm_kvmem.demo_engine import collect

    load_general_plugins()  # honours VLLM_PLUGINS, before LLM checks kwargs
    t0 = time.perf_counter()
    llm = LLM(**spec["llm"])
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "phases": []}
    for phase in spec.get("phases", []):
        params = SamplingParams(max_tokens=phase["max_tokens"], temperature=0.0)
        batches = (
            [[p] for p in phase["prompts"]]
            if phase.get("sequential")
            else [phase["prompts"]]
        )
        results, times = [], []
        for batch in batches:
            start = time.perf_counter()
            results += llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        out["phases"].append(
            {
                "name": phase["name"],
                "token_ids": [list(r.outputs[0].token_ids) for r in results],
                "cached_tokens": [r.num_cached_tokens or 0 for r in results],
                "prompt_tokens": [len(r.prompt_token_ids or []) for r in results],
                "seconds": times,
                "output_tokens": sum(len(r.outputs[0].token_ids) for r in results),
            }
        )
    out["ranks"] = collect(llm)
    out["probes"] = [probe()] + list(llm.collective_rpc(probe))
    return out


# -- the parent: items -------------------------------------------------------------


class Runner:
    """Runs engines in subprocesses, keeps their logs, records results."""

    def __init__(
        self,
        work: Path,
        model: Path,
        timeout: float,
        out: Path | None = None,
        ab_args: str = "",
        real_args: str = "",
        late_args: str = "",
        events_args: str = "",
    ) -> None:
        # Kept under the repository's ignored .gpu-work/, not in $OUT: $OUT is
        # emptied before every call and brings back 8 files at most, while
        # the items of stage 2 may take more than one call.
        self.work = work
        self.model = model
        self.timeout = timeout
        self.out = out or work
        self.ab_args = ab_args
        self.real_args = real_args
        self.late_args = late_args
        self.events_args = events_args
        self.logs = work / "stage2_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results_path = work / "stage2_results.json"
        self.results: dict[str, Any] = (
            json.loads(self.results_path.read_text())
            if self.results_path.is_file()
            else {}
        )

    def engine(self, name: str, spec: dict, **env: str) -> dict:
        """One engine; its report, or its exit code and the end of its log."""
        full_env = dict(os.environ)
        for key, value in SERVER_ENV.items():  # flashinfer is not carried
            full_env.setdefault(key, value)
        full_env.update(VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONUNBUFFERED="1")
        # Only read by vLLM's CPU worker (a CPU rehearsal of this script).
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        full_env.update(env)
        t0 = time.perf_counter()
        code, text = run_captured(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            cwd=ROOT,
            env=full_env,
            timeout=self.timeout,
        )
        (self.logs / f"{name}.log").write_text(text)
        report = None
        for line in text.splitlines():
            if line.startswith(REPORT):
                report = json.loads(line[len(REPORT) :])
        print(
            f"  engine {name}: exit {code} in {time.perf_counter() - t0:.0f} s"
            + ("" if report else " (no report)"),
            flush=True,
        )
        errors = [
            ln
            for ln in text.splitlines()
            if re.search(r"Error|error:|refus|OutOfMemory|out of memory", ln)
        ][-8:]
        return {"exit": code, "report": report, "errors": errors, "env": env}

    def record(self, item: str, result: dict) -> None:
        self.results[item] = result
        self.results_path.write_text(json.dumps(self.results, indent=1) + "\n")


def base_llm(model: Path, **extra: Any) -> dict:
    kw = dict(
        model=str(model),
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    kw.update(extra)
    return kw


def _tokens(run: dict, phase: int = 0) -> Any:
    rep = run.get("report")
    return rep["phases"][phase]["token_ids"] if rep else None


def item_a(r: Runner) -> dict:
    """Plugin, no flags, against plain vLLM: KV blocks, tokens, torch.cuda."""
    from vllm_kvmem.demo import documents

    # float32: a random model's logits are near ties that bf16 can flip.
    spec = {
        "llm": base_llm(r.model, dtype="float32"),
        "phases": [{"name": "greedy", "prompts": documents(3), "max_tokens": 32}],
    }
    plain = r.engine("a_plain", spec, VLLM_PLUGINS="")
    plugin = r.engine("a_plugin", spec)
    blocks = [
        [x["num_blocks"] for x in run["report"]["ranks"]] if run["report"] else None
        for run in (plain, plugin)
    ]
    probes = plugin["report"]["probes"] if plugin["report"] else []
    return {
        "plain": plain,
        "plugin": plugin,
        "kv_blocks_equal": blocks[0] is not None and blocks[0] == blocks[1],
        "tokens_equal": _tokens(plain) is not None
        and _tokens(plain) == _tokens(plugin),
        "plugin_loaded_everywhere": bool(probes)
        and all(p["kvmem_loaded"] for p in probes),
        "torch_cuda_untouched_everywhere": bool(probes)
        and all(p["untouched"] and not p["cpu_worker_modules"] for p in probes),
    }


def item_b(r: Runner) -> dict:
    """Host tier on and off: tokens, cached tokens, TTFT of a host hit."""
    from vllm_kvmem.demo import documents

    # ~1,000-token documents; the device KV cache holds about three of them
    # (float32, 8 KiB a token), so four fillers evict the first.
    long_prompt, *fillers = documents(5)
    phases = [
        {
            "name": "first",
            "prompts": [long_prompt],
            "max_tokens": 16,
            "sequential": True,
        },
        {"name": "evict", "prompts": fillers, "max_tokens": 16, "sequential": True},
        {
            "name": "repeat_ttft",
            "prompts": [long_prompt],
            "max_tokens": 1,
            "sequential": True,
        },
        {
            "name": "repeat",
            "prompts": [long_prompt],
            "max_tokens": 16,
            "sequential": True,
        },
    ]
    small = dict(kv_cache_memory_bytes=24 << 20, dtype="float32")
    off = r.engine("b_tier_off", {"llm": base_llm(r.model, **small), "phases": phases})
    on = r.engine(
        "b_tier_on",
        {
            "llm": base_llm(r.model, kv_host_cache_bytes=1 << 30, **small),
            "phases": phases,
        },
    )

    def phase(run: dict, name: str) -> dict | None:
        rep = run.get("report")
        return (
            next((p for p in rep["phases"] if p["name"] == name), None) if rep else None
        )

    return {
        "off": off,
        "on": on,
        "tokens_equal": all(
            phase(off, n) is not None
            and phase(on, n) is not None
            and phase(off, n)["token_ids"] == phase(on, n)["token_ids"]
            for n in ("first", "evict", "repeat")
        ),
        "repeat_cached_tokens": {
            k: (phase(v, "repeat_ttft") or {}).get("cached_tokens")
            for k, v in (("off", off), ("on", on))
        },
        "repeat_ttft_s": {
            k: (phase(v, "repeat_ttft") or {}).get("seconds")
            for k, v in (("off", off), ("on", on))
        },
    }


CONNECTOR = {
    "kv_connector": "ContiguousLayoutExampleConnector",
    "kv_connector_module_path": "tests.contiguous_example",
    "kv_role": "kv_both",
}


def _decode_phase() -> dict:
    return {
        "name": "decode",
        "prompts": [prompt(k, 40) for k in range(1, 9)],
        "max_tokens": 256,
    }


def _throughput(run: dict) -> float | None:
    rep = run.get("report")
    if not rep:
        return None
    p = rep["phases"][0]
    return p["output_tokens"] / sum(p["seconds"])


#: FLASH_ATTN, asked for as vLLM 0.32 reads it (an engine argument: it has no
#: VLLM_ATTENTION_BACKEND variable), in bfloat16 (FLASH_ATTN has no float32).
FLASH = {"attention_backend": "FLASH_ATTN", "dtype": "bfloat16"}


def item_c(r: Runner) -> dict:
    """Contiguous opt-in on FLASH_ATTN against the default: tokens, decode."""
    default = r.engine(
        "c_default", {"llm": base_llm(r.model, **FLASH), "phases": [_decode_phase()]}
    )
    opted = r.engine(
        "c_contiguous",
        {
            "llm": base_llm(r.model, kv_transfer_config=CONNECTOR, **FLASH),
            "phases": [_decode_phase()],
        },
    )
    layouts = [
        [x.get("layout") for x in run["report"]["ranks"]] if run["report"] else None
        for run in (default, opted)
    ]
    return {
        "default": default,
        "contiguous": opted,
        "layouts": layouts,
        "tokens_equal": _tokens(default) is not None
        and _tokens(default) == _tokens(opted),
        "decode_tokens_per_s": [_throughput(default), _throughput(opted)],
    }


def item_d(r: Runner) -> dict:
    """Token budget beyond the device, at the suggestion, with graphs; an
    explicit pipeline-proportional budget near the limit."""
    phase = [{"name": "greedy", "prompts": [prompt(2, 50)], "max_tokens": 16}]
    huge = r.engine(
        "d_tokens_huge",
        {"llm": base_llm(r.model, kv_cache_tokens=10**9), "phases": phase},
    )
    suggested = None
    for line in huge["errors"]:
        m = re.search(r"--kv-cache-tokens ([\d,]+) or less", line)
        if m:
            suggested = int(m.group(1).replace(",", ""))
    result: dict[str, Any] = {"huge": huge, "suggested": suggested}
    if suggested:
        result["at_suggestion_eager"] = r.engine(
            "d_tokens_suggested",
            {
                "llm": base_llm(
                    r.model, kv_cache_tokens=suggested, gpu_memory_utilization=0.9
                ),
                "phases": phase,
            },
        )
        result["at_suggestion_graphs"] = r.engine(
            "d_tokens_suggested_graphs",
            {
                "llm": base_llm(
                    r.model,
                    kv_cache_tokens=suggested,
                    gpu_memory_utilization=0.9,
                    enforce_eager=False,
                    compilation_config={
                        "mode": 0,
                        "cudagraph_mode": "FULL_DECODE_ONLY",
                    },
                ),
                "phases": phase,
            },
        )
    import torch  # only for the device's size

    total = (
        torch.cuda.get_device_properties(0).total_memory
        if torch.cuda.is_available()
        else 0
    )
    result["explicit_near_limit"] = r.engine(
        "d_pp_prop_near_limit",
        {
            "llm": base_llm(
                r.model,
                kv_cache_memory_bytes=int(total * 0.97),
                enable_pp_prop_kv_cache=True,
                gpu_memory_utilization=0.95,
            ),
            "phases": phase,
        },
    )
    return result


def item_e(r: Runner) -> dict:
    """FLASH_ATTN decode per layout (LBNHC, BLNHC, BLHNC), greedy identity."""
    runs = {
        lay: r.engine(
            f"e_{lay}",
            {"llm": base_llm(r.model, **FLASH), "phases": [_decode_phase()]},
            VLLM_KV_CACHE_LAYOUT=lay,
        )
        for lay in ("LBNHC", "BLNHC", "BLHNC")
    }
    ref = _tokens(runs["LBNHC"])
    return {
        "runs": runs,
        "decode_tokens_per_s": {k: _throughput(v) for k, v in runs.items()},
        "tokens_equal_to_LBNHC": {
            k: ref is not None and _tokens(v) == ref for k, v in runs.items()
        },
        "layouts": {
            k: [x.get("layout") for x in v["report"]["ranks"]] if v["report"] else None
            for k, v in runs.items()
        },
    }


#: Where the Ray wheel is installed on the machine (README: "Ray, for item f").
RAY_SITE = ROOT / ".gpu-site-ray"
#: The limits line the engine core logs after collective_rpc (device_limits.py).
LIMITS_LINE = re.compile(r"KV cache limit per rank: (rank 0: .*)\.")


def _ray_env() -> dict[str, str] | None:
    """The environment that makes Ray importable in the engine and its Ray
    workers (they inherit PYTHONPATH); None when Ray is nowhere."""
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        return {}
    if not (RAY_SITE / "ray").is_dir():
        return None
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{RAY_SITE}:{path}" if path else str(RAY_SITE)}


def item_f(r: Runner) -> dict:
    """Ray, TP=1 PP=1, against the multiprocessing executor: plugin in the
    Ray worker, device limits collected, host tier's output, same tokens."""
    from vllm_kvmem.demo import documents

    env = _ray_env()
    if env is None:
        return {"skipped": f"Ray is not installed (no module ray, no {RAY_SITE})"}
    long_prompt, *fillers = documents(5)
    phases = [
        {"name": "first", "prompts": [long_prompt], "max_tokens": 16},
        {"name": "evict", "prompts": fillers, "max_tokens": 16, "sequential": True},
        {"name": "repeat", "prompts": [long_prompt], "max_tokens": 16},
    ]
    # About three documents' worth of device KV (16-token blocks), so the
    # fillers evict the first; the budget is sized by the engine core from the
    # workers' limits (collective_rpc), the repeat hits the host tier.
    llm = base_llm(
        r.model, dtype="float32", kv_cache_tokens=3072, kv_host_cache_bytes=1 << 30
    )
    runs = {
        "mp": r.engine("f_mp", {"llm": llm, "phases": phases}),
        "ray": r.engine(
            "f_ray",
            {
                "llm": dict(llm, distributed_executor_backend="ray"),
                "phases": phases,
            },
            **env,
        ),
    }

    def limits(name: str) -> str | None:
        m = LIMITS_LINE.search((r.logs / f"{name}.log").read_text())
        return m.group(1) if m else None

    def phase(run: dict, name: str) -> dict | None:
        rep = run.get("report")
        return (
            next((p for p in rep["phases"] if p["name"] == name), None) if rep else None
        )

    reports = {k: v.get("report") for k, v in runs.items()}
    workers = [p for p in (reports["ray"] or {}).get("probes", []) if p["in_worker"]]
    return {
        "runs": runs,
        "ray_importable_from": str(RAY_SITE) if env else "site-packages",
        "limits_collected": {k: limits(f"f_{k}") for k in runs},
        "ray_worker_probes": workers,
        "plugin_loaded_in_ray_worker": bool(workers)
        and all(p["kvmem_loaded"] and p["ray_actor"] for p in workers),
        "kv_blocks": {
            k: [x["num_blocks"] for x in rep["ranks"]] if rep else None
            for k, rep in reports.items()
        },
        "tokens_equal": all(
            phase(runs["mp"], n) is not None
            and phase(runs["ray"], n) is not None
            and phase(runs["mp"], n)["token_ids"] == phase(runs["ray"], n)["token_ids"]
            for n in ("first", "evict", "repeat")
        ),
        "repeat_cached_tokens": {
            k: (phase(v, "repeat") or {}).get("cached_tokens") for k, v in runs.items()
        },
    }


def item_estimate_s(
    item: str,
    ab_args: str = "",
    real_args: str = "",
    late_args: str = "",
    events_args: str = "",
) -> float:
    """Device seconds an item takes, from the costs measured on the H200."""
    if item in "ghij":
        args = {"g": ab_args, "h": real_args, "i": late_args, "j": events_args}[item]
        return stage2_scripts.estimate_s(item, args)
    return ITEM_ENGINES[item] * MEASURED_S["engine_start_eager"] + ITEM_EXTRA_S[item]


ITEM_FUNCS: dict[str, Callable[[Runner], dict]] = {
    "a": item_a,
    "b": item_b,
    "c": item_c,
    "d": item_d,
    "e": item_e,
    "f": item_f,
    "g": stage2_scripts.item_g,
    "h": stage2_scripts.item_h,
    "i": stage2_scripts.item_i,
    "j": stage2_scripts.item_j,
}


def make_model(out_dir: Path) -> Path:
    model = out_dir / "tiny-model"
    if not (model / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "vllm_kvmem.cli", "tiny-model", str(model)],
            cwd=ROOT,
            check=True,
        )
    return model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument(
        "--items",
        default=ITEMS[:5],
        help="which of a-j (default a-e; f needs Ray; g is issue 30's A/B, h "
        "issue 36's real-size run, i issue 42's late-spill check, j issue 47's "
        "KV events and disk hits)",
    )
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "out/stage2"))
    )
    p.add_argument(
        "--work",
        type=Path,
        default=ROOT / ".gpu-work",
        help="model, logs and results across calls (ignored by git)",
    )
    p.add_argument("--engine-timeout", type=float, default=240.0)
    p.add_argument(
        "--ab-args",
        default="",
        help="item g: arguments for ab_offload.py, e.g. "
        "'--arms none,tier,simple_lazy,offloading'",
    )
    p.add_argument(
        "--real-args",
        default="",
        help="item h: arguments for real_size.py, e.g. '--max-wall-s 480'",
    )
    p.add_argument(
        "--late-args",
        default="",
        help="item i: arguments for late_spill.py, e.g. '--max-wall-s 300'",
    )
    p.add_argument(
        "--events-args",
        default="",
        help="item j: arguments for events_disk.py, e.g. '--arms tier_disk,control'",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    args = p.parse_args(argv)
    if args.child:
        print(REPORT + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    unknown = set(args.items) - set(ITEMS)
    if unknown:
        p.error(f"unknown items {sorted(unknown)}: choose from {ITEMS}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        plan = {
            "items": {i: (ITEM_FUNCS[i].__doc__ or "").strip() for i in args.items},
            "item_descriptions": [
                ln for ln in __doc__.splitlines() if ln[:2] in {f"{i}." for i in ITEMS}
            ],
            "out": str(args.out),
            "work": str(args.work),
            "engine_timeout_s": args.engine_timeout,
            "server_env": SERVER_ENV,
            "estimate_s": {
                i: item_estimate_s(
                    i, args.ab_args, args.real_args, args.late_args, args.events_args
                )
                for i in args.items
            },
            "estimate_from": "gpu_common.MEASURED_S (NVIDIA H200, 2026-11-26): "
            f"an eager engine start {MEASURED_S['engine_start_eager']:.0f} s; "
            "items g-j: their scripts' own plans",
        }
        plan["estimate_total_s"] = sum(plan["estimate_s"].values())
        scripts = (
            ("g", args.ab_args),
            ("h", args.real_args),
            ("i", args.late_args),
            ("j", args.events_args),
        )
        for item, item_args in scripts:
            if item in args.items:
                plan[f"{item}_plan"] = stage2_scripts.plan(item, item_args, args.work)
        (args.out / "stage2_plan.json").write_text(json.dumps(plan, indent=1) + "\n")
        print("stage 2 dry run: items", args.items, "->", args.out / "stage2_plan.json")
        return 0
    model = make_model(args.work)
    runner = Runner(
        args.work,
        model,
        args.engine_timeout,
        args.out,
        args.ab_args,
        args.real_args,
        args.late_args,
        args.events_args,
    )
    for item in args.items:
        print(f"=== item {item}", flush=True)
        t0 = time.perf_counter()
        try:
            result = ITEM_FUNCS[item](runner)
        except Exception as exc:  # record and go on to the next item
            result = {"crashed": f"{type(exc).__name__}: {exc}"}
        result["wall_s"] = time.perf_counter() - t0
        runner.record(item, result)
        shutil.copy(runner.results_path, args.out / "stage2_results.json")
        summary = {
            k: v
            for k, v in result.items()
            if not isinstance(v, dict)
            or k
            in (
                "repeat_ttft_s",
                "repeat_cached_tokens",
                "decode_tokens_per_s",
                "tokens_equal_to_LBNHC",
                "limits_collected",
                "kv_blocks",
            )
        }
        print(json.dumps(summary, default=str)[:2000], flush=True)
    with tarfile.open(args.out / "stage2_logs.tar.gz", "w:gz") as tar:  # one file
        tar.add(runner.logs, arcname="stage2_logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
