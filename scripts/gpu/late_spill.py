"""Issue 42 on a GPU: late spills under Model Runner V1 and V2, output identity.

Not run on a GPU yet (prepared, and its V1 part run on CPU with
``--cpu``). Stage 2's item i on the lent machine (``bash
scripts/gpu/stage2.sh --items i``); ``--dry-run`` writes the plan anywhere,
importing neither torch nor vLLM.

Why: a late spill copies a cached block that the allocator handed to a new
request this step, before that step writes it. Model Runner V1 calls the
connector's ``handle_preemptions`` before ``_update_states``; V2 (the GPU
default where Triton is present) writes into freshly allocated blocks in
``update_requests`` first: it zeroes ``new_block_ids_to_zero`` when the KV
cache config ``needs_kv_cache_zeroing`` (vLLM 0.32: Mamba layers, or a
mixed-precision cache; a uniform fp8 cache does not) and applies
``kv_cache_block_copies`` (copy-on-write of a partial prefix hit, which
needs prefix hashes finer than a block: several KV cache groups). A block
spilled after such a write holds zeros or another request's KV under the old
prefix's keys. CPU runs V1 only (V2 needs Triton), so no CPU test sees V2's
order.

Arms (each engine greedy, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so the script reads the scheduler's outputs and the connector's counters):

- ``none``: no connector, the plugin loaded (the release's vLLM);
- ``tier``: the plugin's host tier (``KVMemHostTierConnector``), the
  release's vLLM;
- ``lazy_series``: vLLM's ``SimpleCPUOffloadConnector`` with
  ``lazy_offload`` on a copy of the machine's vLLM with the in-tree series
  applied (``series_tree.py``: the generator's ``write_series``, whatever
  PRs its ``ORDER`` holds, the late-spills PR among them), no plugin;
- ``lazy_pr6`` (with ``--arms``): the same with only the late-spills PR and
  the PRs it builds on (``write_series(only=[...])``): what the rest of the
  series changes on V2.

each under Model Runner V2 and V1 (``VLLM_USE_V2_MODEL_RUNNER=1`` / ``0``,
read by ``VllmConfig.use_v2_model_runner``; V2 first: it is the one no CPU
run has seen), on two workloads (``CASES``): ``plain``, the CPU contract's
(``tests/test_intree_offload.py``: 12 device blocks of 32 tokens, at most 2
requests, prompts 0-3, then 4-7 evicting them, then 0-3 again, whose
prefixes can only come from host memory), and ``mixed_fp8``: fp8 KV with
the first half of the layers left unquantized
(``kv_cache_dtype_skip_layers``): a mixed-precision cache, so
``needs_kv_cache_zeroing`` and V2 zeroes new blocks; and, as read in vLLM
0.32's sources (``Platform._align_heterogeneous_kv_block_size``), on CUDA the
fp8 layers get a larger block than the unquantized ones, two KV cache groups
whose prefix hashes are finer than the fp8 block, so a revisit that hits on
the device inside a block is copied on write (a fourth round revisits 0-3 on
the device). Not seen anywhere yet: vLLM's CPU build keeps one float32 group
for this config (no zeroing), so only a GPU shows it; the JSON records the
groups vLLM made. The plugin's tier turns itself off for both kinds of
config by design (``host_tier/support.py``): that arm then records
``tier_enabled`` false and runs as no offload.

Figures per runner, workload and arm: greedy tokens of every round equal to
``none``'s under the same runner; the revisit's cached tokens (host hits:
``none`` shows nothing was left on the device) and host hit rate; late
spills seen in the scheduler's outputs (``spill_gpu_blocks`` of the series'
metadata, ``evict_saves`` of the tier's), and how many of them V2 zeroed or
copied-on-write in the same step (their ids in ``new_block_ids_to_zero`` /
a ``kv_cache_block_copies`` destination); the tier's counters (its
``spills_skipped_overwritten`` when the plugin has it); the KV cache config
(groups, ``needs_kv_cache_zeroing``, hash and scheduler block sizes) and the
runner as vLLM decided it. Everything in ``$OUT/late_spill_<gpu>.json``,
labelled GPU with the device; ``--cpu`` writes ``late_spill_cpu.json``,
labelled CPU. Exit 0 when every engine ran and every arm's tokens equal
``none``'s, 1 when an engine failed or tokens differ, 3 when engines were
skipped at ``--max-wall-s``.

One process per runner and vLLM tree (the runner is read from the
environment), engines one after another in it, V2's first; before each
engine the time left is checked, and what does not fit is recorded as
skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import series_tree  # noqa: E402  (standard library only at import)
from gpu_common import (  # noqa: E402
    MEASURED_S,
    SERVER_ENV,
    csv_list,
    device_suffix,
    gpu_info,
    gpu_label,
    run_captured,
    write_dry_run,
)

REPORT = "KVMEM_LATE_SPILL "
ARMS = ("none", "tier", "lazy_series", "lazy_pr6")
DEFAULT_ARMS = ("none", "tier", "lazy_series")
#: The vLLM each arm runs: the release's with the plugin, or a patched copy.
TREES = {"none": "release", "tier": "release", "lazy_series": "series",
         "lazy_pr6": "pr6"}  # fmt: skip
#: VLLM_USE_V2_MODEL_RUNNER per runner; V2 first (never run on CPU).
RUNNERS = {"v2": "1", "v1": "0"}
HOST_BYTES = 16 << 20
LAZY = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": HOST_BYTES, "lazy_offload": True},
}
PLUGIN = {
    "kv_connector": "KVMemHostTierConnector",
    "kv_connector_module_path": "vllm_kvmem.host_tier.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"num_host_blocks": 64},
}
CONNECTORS: dict[str, dict[str, Any] | None] = {
    "none": None, "tier": PLUGIN, "lazy_series": LAZY, "lazy_pr6": LAZY,
}  # fmt: skip
#: The workloads. Device blocks are counted in float32 tokens of the model
#: (``block_size``); vLLM may raise a quantized group's block size, and
#: splits the same bytes its way.
CASES: dict[str, dict[str, Any]] = {
    "plain": {
        "what": "the CPU contract's workload (tests/test_intree_offload.py): "
        "uniform float32 KV, one KV cache group; V2 neither zeroes nor copies",
        "block_size": 32,
        "prompt_tokens": 3 * 32 + 5,
        "max_model_len": 4 * 32,
        "device_blocks": 12,
        "rounds": [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]],
        "revisit": 2,
        "llm": {},
        "skip_half_layers": False,
    },
    "mixed_fp8": {
        "what": "fp8 KV, the first half of the layers unquantized "
        "(kv_cache_dtype_skip_layers): mixed precision, so needs_kv_cache_zeroing "
        "and V2 zeroes new blocks; on CUDA (vLLM 0.32's sources, not seen) the "
        "fp8 group's block grows and hashes are finer than it, so device hits "
        "inside a block copy on write (round 4). CPU: one float32 group",
        "block_size": 32,
        "prompt_tokens": 3 * 64 + 16 + 5,  # a partial tail inside a 64-token block
        "max_model_len": 4 * 64,
        "device_blocks": 12,
        "rounds": [[0, 1, 2, 3], list(range(4, 12)), [0, 1, 2, 3], [0, 1, 2, 3]],
        "revisit": 2,
        "llm": {"kv_cache_dtype": "fp8"},
        "skip_half_layers": True,
    },
}
#: Device seconds. Measured on the H200 (2026-11-26): an eager engine of the
#: tiny model in its own process, 30-37 s (``engine_start_eager``). Assumed:
#: a further engine in the same process (no imports, no CUDA context) 25 s
#: with its tiny workload; building the series' vLLM copy 15 s (8.7 s on a
#: development CPU, git included).
COST_S = {
    "process": MEASURED_S["engine_start_eager"],
    "engine_in_process": 25.0,
    "series_build": 15.0,
    "fixed": 10.0,
}


# -- the plan (no vLLM, no torch) --------------------------------------------------


def tree_dir(tree: str, args: argparse.Namespace) -> Path:
    """Where a patched tree is built (kept while the machine is warm; the
    full series' is the one ``real_size.py``'s series arm reuses)."""
    name = series_tree.TREE.name + ("" if tree == "series" else f"-{tree}")
    return args.trees / name


def tree_only(tree: str) -> list[str] | None:
    """The generator's ``only`` for a tree: the whole series, or the
    late-spills PR with what it builds on."""
    return [series_tree.LATE_SPILL] if tree == "pr6" else None


def processes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The child processes in order: per runner (V2 first), the release's
    engines, then each patched tree's; engines workload-major inside."""
    out = []
    for runner in args.runner_list:
        for tree in ("release", "series", "pr6"):
            engines = [
                [case, arm]
                for case in args.case_list
                for arm in args.arm_list
                if TREES[arm] == tree
            ]
            if engines:
                out.append(
                    {
                        "runner": runner,
                        "tree": tree,
                        "engines": engines,
                        "estimate_s": COST_S["process"]
                        + COST_S["engine_in_process"] * (len(engines) - 1),
                    }
                )
    return out


def process_env(runner: str, tree: str, args: argparse.Namespace) -> dict[str, str]:
    """What a child's environment sets (over this process's): the runner,
    vLLM in-process, the flashinfer switch; a patched tree first on the
    path with no plugin; the release's vLLM with the checkout (the plugin)."""
    env = {
        "VLLM_USE_V2_MODEL_RUNNER": RUNNERS[runner],
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONUNBUFFERED": "1",
    }
    for key, value in SERVER_ENV.items():  # flashinfer is not carried
        env[key] = os.environ.get(key, value)
    current = os.environ.get("PYTHONPATH", "")
    if tree == "release":
        parts = [p for p in current.split(os.pathsep) if p]
        if not any(Path(p).resolve() == ROOT for p in parts):
            parts.append(str(ROOT))
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env["PYTHONPATH"] = series_tree.pythonpath(tree_dir(tree, args), current)
        env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin: nothing of ours runs
    if args.cpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "nobind"
        )
    return env


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    procs = processes(args)
    trees = sorted({p["tree"] for p in procs} - {"release"})
    total = (
        COST_S["fixed"]
        + COST_S["series_build"] * len(trees)
        + sum(p["estimate_s"] for p in procs)
    )
    return {
        "issue": 42,
        "script": "scripts/gpu/late_spill.py",
        "status": "not run on a GPU yet (prepared; V1 rehearsed on CPU with --cpu)",
        "platform": "CPU rehearsal (V1 only)" if args.cpu else "GPU",
        "model": str(model_path(args)),
        "arms": {
            arm: {"tree": TREES[arm], "kv_transfer_config": CONNECTORS[arm]}
            for arm in args.arm_list
        },
        "runners": {
            r: {"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[r]} for r in args.runner_list
        },
        "cases": {c: CASES[c] for c in args.case_list},
        "trees": {
            t: {
                "folder": str(tree_dir(t, args)),
                "only": tree_only(t),
                "late_spill_pr": series_tree.LATE_SPILL,
                "cpu_scaffolding": args.cpu,
            }
            for t in trees
        },
        "processes": [
            {**p, "env": process_env(p["runner"], p["tree"], args)} for p in procs
        ],
        "max_wall_s": args.max_wall_s,
        "estimate_s": round(total),
        "estimate_fits_max_wall": total <= args.max_wall_s,
        "cost_model_s": COST_S,
        "cost_model_measured": "process: an eager tiny-model engine in its own "
        "process on the H200 (2026-11-26); the rest assumed",
        "output": "$OUT/late_spill_<gpu>.json (<gpu> from nvidia-smi), labelled "
        "GPU with the device; --cpu: late_spill_cpu.json, labelled CPU",
    }


def model_path(args: argparse.Namespace) -> Path:
    return args.model or args.model_cache / "tiny-model"


# -- the child: engines in one process ----------------------------------------------


def _model_shape(model: str) -> tuple[int, int, int]:
    """Layers, KV heads and head size from the model's config.json."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head


def spilled_blocks(meta: Any) -> list[int]:
    """The device blocks a step's connector metadata copies out before the
    step writes them: the series' ``spill_gpu_blocks``, the tier's
    ``evict_saves`` (block, slot)."""
    if meta is None:
        return []
    series = getattr(meta, "spill_gpu_blocks", None)
    if series is not None:
        return list(series)
    return [block for block, _slot in getattr(meta, "evict_saves", None) or ()]


class StepSpy:
    """Counts, in each scheduler output, the late spills and those of them
    the same step zeroes or copies on write into (V2 does both before
    ``handle_preemptions`` unless a patched vLLM reorders it)."""

    def __init__(self, scheduler: Any) -> None:
        self.counts = dict.fromkeys(
            ("steps", "late_spills", "spill_steps", "zeroed_blocks", "cow_copies",
             "late_spills_zeroed_same_step", "late_spills_cow_same_step"), 0,
        )  # fmt: skip
        self.overlaps: list[dict[str, Any]] = []
        self.errors: list[str] = []
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            try:
                self.observe(out)
            except Exception as e:  # never break the engine
                self.errors.append(f"{type(e).__name__}: {e}")
            return out

        scheduler.schedule = schedule

    def observe(self, out: Any) -> None:
        c = self.counts
        c["steps"] += 1
        spilled = set(spilled_blocks(getattr(out, "kv_connector_metadata", None)))
        zeroed = set(getattr(out, "new_block_ids_to_zero", None) or ())
        cow = {
            x.dst_block_id for x in getattr(out, "kv_cache_block_copies", None) or ()
        }
        c["late_spills"] += len(spilled)
        c["spill_steps"] += bool(spilled)
        c["zeroed_blocks"] += len(zeroed)
        c["cow_copies"] += len(cow)
        c["late_spills_zeroed_same_step"] += len(spilled & zeroed)
        c["late_spills_cow_same_step"] += len(spilled & cow)
        if (spilled & (zeroed | cow)) and len(self.overlaps) < 20:
            self.overlaps.append(
                {"step": c["steps"], "zeroed": sorted(spilled & zeroed),
                 "cow": sorted(spilled & cow)}
            )  # fmt: skip

    def report(self) -> dict[str, Any]:
        return {**self.counts, "overlaps": self.overlaps, "errors": self.errors}


def _kv_facts(llm: Any, core: Any) -> dict[str, Any]:
    cfg = core.scheduler.kv_cache_config
    vcfg = getattr(llm.llm_engine, "vllm_config", None)
    return {
        "num_blocks": cfg.num_blocks,
        "groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "dtype": str(getattr(g.kv_cache_spec, "dtype", None)),
                "block_size": g.kv_cache_spec.block_size,
                "layers": len(g.layer_names),
            }
            for g in cfg.kv_cache_groups
        ],
        "needs_kv_cache_zeroing": getattr(cfg, "needs_kv_cache_zeroing", None),
        "hash_block_size": getattr(core.scheduler, "hash_block_size", None),
        "scheduler_block_size": getattr(core.scheduler, "block_size", None),
        "use_v2_model_runner": getattr(vcfg, "use_v2_model_runner", None),
        "async_scheduling": getattr(
            getattr(vcfg, "scheduler_config", None), "async_scheduling", None
        ),
        "connector": type(core.scheduler.connector).__name__
        if getattr(core.scheduler, "connector", None) is not None
        else None,
        "worker_connector": _worker_connector(),
    }


def _tier_counters(core: Any) -> dict[str, Any] | None:
    """The plugin's counters since start, both sides (None without it)."""
    connector = getattr(core.scheduler, "connector", None)
    sched = getattr(connector, "connector_scheduler", None)
    out = {"scheduler": dict(getattr(sched, "totals", None) or {})}
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker
        out["worker"] = dict(getattr(worker, "totals", None) or {})
    return out if any(out.values()) else None


def _worker_connector() -> str | None:
    """The worker side's KV connector in this process (the engine runs
    in-process), None when there is none: ``none`` must see none, not one
    left over from the engine before it."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return type(get_kv_transfer_group()).__name__ if has_kv_transfer_group() else None


def _cleanup(llm: Any | None) -> None:
    """Shut the in-process engine down (its worker's connector with it) and
    release its memory, so that the next engine of this process starts as
    in a fresh one; also after an engine that failed part way."""
    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def run_engine(spec: dict[str, Any], case_name: str, arm: str) -> dict[str, Any]:
    """One engine on one workload: its tokens, cached tokens, step counts."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    case = spec["cases"][case_name]
    layers, kv_heads, head = _model_shape(spec["model"])
    bs = case["block_size"]
    block_bytes = 2 * bs * kv_heads * head * 4 * layers  # float32 K and V
    kw: dict[str, Any] = dict(
        model=spec["model"], dtype="float32", block_size=bs,
        max_model_len=case["max_model_len"], max_num_seqs=2, enforce_eager=True,
        seed=0, kv_cache_memory_bytes=case["device_blocks"] * block_bytes,
        **case["llm"],
    )  # fmt: skip
    if case["skip_half_layers"]:
        kw["kv_cache_dtype_skip_layers"] = [str(i) for i in range(layers // 2)]
    if not spec["cpu"]:
        kw["gpu_memory_utilization"] = 0.3
    connector = CONNECTORS[arm]
    if connector:
        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    rec: dict[str, Any] = {"case": case_name, "arm": arm}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    rec["start_s"] = round(time.perf_counter() - t0, 1)
    try:
        core = llm.llm_engine.engine_core.engine_core
        spy = StepSpy(core.scheduler)
        n = case["prompt_tokens"]
        prompts = [
            TokensPrompt(
                prompt_token_ids=[(p * 131 + i * 7 + 11) % 1000 for i in range(n)]
            )
            for p in range(1 + max(max(r) for r in case["rounds"]))
        ]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        rounds = [
            llm.generate([prompts[i] for i in r], params, use_tqdm=False)
            for r in case["rounds"]
        ]
        rec["run_s"] = round(time.perf_counter() - t0, 2)
        rec["tokens"] = [[list(o.outputs[0].token_ids) for o in r] for r in rounds]
        rec["cached"] = [[o.num_cached_tokens or 0 for o in r] for r in rounds]
        rec["kv"] = _kv_facts(llm, core)
        rec["steps"] = spy.report()
        rec["tier_counters"] = _tier_counters(core) if arm == "tier" else None
        # The tier turns itself off for a config it does not serve (zeroing,
        # hashes finer than a block): that engine runs as no offload.
        rec["tier_enabled"] = (
            getattr(core.scheduler.connector, "enabled", None)
            if arm == "tier"
            else None
        )
    finally:
        _cleanup(llm)
    return rec


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Every engine of ``spec`` in this process, one after the other; an
    engine that would end past the deadline is skipped, one that fails is
    recorded and the next one runs."""
    import vllm

    out: dict[str, Any] = {
        "vllm_file": vllm.__file__,
        "vllm_version": vllm.__version__,
        "env_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "engines": [],
    }
    for case_name, arm in spec["engines"]:
        head = {"runner": spec["runner"], "tree": spec["tree"], "case": case_name,
                "arm": arm}  # fmt: skip
        if time.time() + spec["engine_s"] > spec["deadline"]:
            out["engines"].append({**head, "skipped": "past --max-wall-s"})
            continue
        t0 = time.perf_counter()
        try:
            rec = {**head, **run_engine(spec, case_name, arm)}
        except Exception as e:
            rec = {**head, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc().splitlines()[-12:]}  # fmt: skip
            _cleanup(None)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        said = rec.get("error") or "ok"
        print(f"  {spec['runner']} {case_name} {arm}: {said} in {rec['wall_s']} s",
              flush=True)  # fmt: skip
        out["engines"].append(rec)
    return out


# -- the parent: trees, processes, figures ----------------------------------------


def ensure_model(args: argparse.Namespace) -> Path:
    """The tiny model stage 2 uses (``kvmem tiny-model``), written if absent."""
    model = model_path(args)
    if not (model / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "vllm_kvmem.cli", "tiny-model", str(model)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)),
            check=True,
        )  # fmt: skip
    return model


def arm_figures(
    e: dict[str, Any], ref: dict[str, Any] | None, case: dict[str, Any]
) -> dict[str, Any]:
    """One engine's figures against its runner's ``none`` on that workload.
    The host hit rate counts the revisit's cached tokens over its prompts'
    whole prefix-hash blocks (what a prefix cache can hold)."""
    hash_bs = e["kv"].get("hash_block_size") or case["block_size"]
    full = case["prompt_tokens"] // hash_bs * hash_bs
    revisit = e["cached"][case["revisit"]]
    counters = e.get("tier_counters") or {}
    # The plugin's count of late spills it did not send because V2 writes
    # the block first (spills_skipped_overwritten, when the plugin has it).
    skipped = {
        f"{side}.{k}": v
        for side, totals in counters.items()
        for k, v in totals.items()
        if "skip" in k
    }
    steps = e["steps"]
    return {
        "tokens_equal_to_none": e["tokens"] == ref["tokens"] if ref else None,
        "revisit_cached_tokens": revisit,
        "revisit_host_hit_rate": round(sum(revisit) / (len(revisit) * full), 3),
        **{
            k: steps[k]
            for k in (
                "late_spills",
                "late_spills_zeroed_same_step",
                "late_spills_cow_same_step",
                "zeroed_blocks",
                "cow_copies",
            )
        },  # fmt: skip
        "tier_enabled": e.get("tier_enabled"),
        "tier_spills_skipped": skipped or None,
        "tier_saved_at_eviction_bytes": sum(
            t.get("bytes_saved_at_eviction", 0) for t in counters.values()
        )
        if counters
        else None,
    }


def summarize(engines: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    """Per runner and workload: what vLLM made of the KV cache (``none``'s
    engine), and each arm against ``none`` of that runner."""
    by = {(e["runner"], e["case"], e["arm"]): e for e in engines if "tokens" in e}
    out: dict[str, Any] = {}
    for runner in args.runner_list:
        for case_name in args.case_list:
            case = CASES[case_name]
            ref = by.get((runner, case_name, "none"))
            kv = (ref or {}).get("kv", {})
            out[f"{runner}/{case_name}"] = {
                "none_ran": ref is not None,
                "v2_runner": kv.get("use_v2_model_runner"),
                "zeroing": kv.get("needs_kv_cache_zeroing"),
                "kv_groups": kv.get("groups"),
                # None, unless an engine before it left its connector behind
                "none_worker_connector": kv.get("worker_connector"),
                "none_revisit_cached": ref["cached"][case["revisit"]] if ref else None,
                "arms": {
                    arm: arm_figures(by[key], ref, case) if key in by else None
                    for arm in args.arm_list
                    for key in [(runner, case_name, arm)]
                },
            }
    return out


def run_process(
    proc: dict[str, Any], args: argparse.Namespace, model: Path, deadline: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One child process (a runner and a vLLM tree, its engines in order):
    how it ended, and its engines' records (or an error for each)."""
    name = f"{proc['runner']}_{proc['tree']}"
    head = [{"runner": proc["runner"], "tree": proc["tree"], "case": c, "arm": a}
            for c, a in proc["engines"]]  # fmt: skip
    print(f"=== {name}: {', '.join('/'.join(e) for e in proc['engines'])}", flush=True)
    spec = {
        "model": str(model), "runner": proc["runner"], "tree": proc["tree"],
        "engines": proc["engines"], "cases": CASES, "cpu": args.cpu,
        "deadline": deadline, "engine_s": COST_S["engine_in_process"],
    }  # fmt: skip
    env = dict(os.environ, **process_env(proc["runner"], proc["tree"], args))
    t = time.monotonic()
    code, text = run_captured(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        cwd=args.work, env=env, timeout=max(60.0, deadline - time.time() + 60),
    )  # fmt: skip
    (args.work / f"{name}.log").write_text(text)
    lines = [ln for ln in text.splitlines() if ln.startswith(REPORT)]
    got = json.loads(lines[-1][len(REPORT) :]) if lines else None
    info = {
        "name": name, "exit": code, "wall_s": round(time.monotonic() - t, 1),
        "vllm_file": (got or {}).get("vllm_file"),
        "env_runner": (got or {}).get("env_runner"),
        "log_tail": None if got else text.splitlines()[-15:],
    }  # fmt: skip
    if got:
        return info, got["engines"]
    return info, [{**h, "error": f"process exit {code}"} for h in head]


def run(args: argparse.Namespace, gpu: dict[str, str] | None, argv: list[str]) -> int:
    """Trees, then each process; the JSON rewritten after each."""
    t0 = time.monotonic()
    deadline = time.time() + args.max_wall_s
    suffix = device_suffix(gpu["name"]) if gpu else "cpu"
    out_path = args.out / f"late_spill_{suffix}.json"
    args.work.mkdir(parents=True, exist_ok=True)
    cpu_label = "CPU rehearsal (Model Runner V1 only), not a GPU figure"
    report: dict[str, Any] = {
        "benchmark": "late_spill (issue 42)",
        "platform": "GPU" if gpu else "CPU",
        "label": gpu_label(gpu) if gpu else cpu_label,
        "device": gpu,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/gpu/late_spill.py", *argv]),
        "plan": build_plan(args),
        "trees": {},
        "processes": [],
        "engines": [],
        "skipped": [],
    }

    def save() -> None:
        report["wall_s"] = round(time.monotonic() - t0, 1)
        report["summary"] = summarize(report["engines"], args)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(out_path)

    model = ensure_model(args)
    procs = processes(args)
    for tree in sorted({p["tree"] for p in procs} - {"release"}):
        t = time.monotonic()
        try:
            built = series_tree.build(
                tree_dir(tree, args), only=tree_only(tree), cpu_scaffolding=args.cpu
            )
        except Exception as e:
            built = {"error": f"{type(e).__name__}: {e}"}
        built["build_s"] = round(time.monotonic() - t, 1)
        report["trees"][tree] = built
        print(f"tree {tree}: {built.get('error') or 'ready'}", flush=True)
    save()
    for proc in procs:
        head = [{"runner": proc["runner"], "tree": proc["tree"], "case": c, "arm": a}
                for c, a in proc["engines"]]  # fmt: skip
        error = report["trees"].get(proc["tree"], {}).get("error")
        if error:
            report["engines"] += [
                {**h, "error": f"tree not built: {error}"} for h in head
            ]
        elif time.time() + COST_S["process"] > deadline:
            report["skipped"].append(f"{proc['runner']}_{proc['tree']}")
            report["engines"] += [{**h, "skipped": "past --max-wall-s"} for h in head]
        else:
            info, engines = run_process(proc, args, model, deadline)
            report["processes"].append(info)
            report["engines"] += engines
        save()
    failed = [e for e in report["engines"] if e.get("error")]
    skipped = [e for e in report["engines"] if e.get("skipped")]
    differ = [
        f"{key} {arm}"
        for key, cell in report["summary"].items()
        for arm, a in cell["arms"].items()
        if a and a["tokens_equal_to_none"] is False
    ]
    print(json.dumps(report["summary"], default=str)[:3000])
    print(f"JSON: {out_path}; engines failed {len(failed)}, skipped {len(skipped)}, "
          f"tokens differ: {differ or 'none'}")  # fmt: skip
    return 1 if failed or differ else 3 if skipped else 0


# -- command line -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="write the plan only")
    p.add_argument("--cpu", action="store_true",
                   help="rehearse on CPU: Model Runner V1 only, the series' vLLM "
                   "with the generator's CPU scaffolding")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/late")))
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-work" / "late_spill",
                   help="the child processes' logs")  # fmt: skip
    p.add_argument("--model-cache", type=Path, default=ROOT / ".gpu-work",
                   help="holds tiny-model/ (stage 2's), written if absent")  # fmt: skip
    p.add_argument("--model", type=Path, help="a model folder instead")
    p.add_argument("--trees", type=Path, default=series_tree.TREE.parent,
                   help="where the patched vLLM copies are built")  # fmt: skip
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {ARMS}")
    p.add_argument("--runners", default=None,
                   help="of v2,v1 (default both, V2 first; --cpu: v1)")  # fmt: skip
    p.add_argument("--cases", default=None,
                   help=f"of {tuple(CASES)} (default all; --cpu: plain)")  # fmt: skip
    p.add_argument("--max-wall-s", type=float, default=400.0)
    args = p.parse_args(argv)
    args.arm_list = csv_list(args.arms)
    default_runners = "v1" if args.cpu else ",".join(RUNNERS)
    args.runner_list = csv_list(args.runners or default_runners)
    args.case_list = csv_list(args.cases or ("plain" if args.cpu else ",".join(CASES)))
    bad = [a for a in args.arm_list if a not in ARMS]
    bad += [r for r in args.runner_list if r not in RUNNERS]
    bad += [c for c in args.case_list if c not in CASES]
    if bad:
        p.error(f"unknown {bad}: arms of {ARMS}, runners of {tuple(RUNNERS)}, "
                f"cases of {tuple(CASES)}")  # fmt: skip
    if "none" not in args.arm_list:
        p.error("--arms needs 'none' (every arm's tokens are compared with it)")
    if args.cpu and "v2" in args.runner_list:
        p.error("--cpu runs Model Runner V1 only: vLLM's V2 needs Triton")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(REPORT + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        shown = ("estimate_s", "estimate_fits_max_wall")
        write_dry_run(build_plan(args), args.out, "late_spill", shown)
        return 0
    gpu = gpu_info()
    if gpu is None and not args.cpu:
        print("late_spill: needs an NVIDIA GPU (nvidia-smi found none); --cpu "
              "rehearses Model Runner V1 here, --dry-run writes the plan")  # fmt: skip
        return 2
    return run(
        args, None if args.cpu else gpu, list(sys.argv[1:] if argv is None else argv)
    )


if __name__ == "__main__":
    sys.exit(main())
