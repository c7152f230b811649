"""PR 1 (``--enable-pp-prop-kv-cache``) against stock vLLM's minimum-block
trim (#25164), through vLLM's own planning code.

Why: a maintainer asks whether PR 1 adds anything to #25164.
``get_kv_cache_configs`` already cuts every pipeline stage to the smallest
block count and shrinks the lighter stages' tensors, so a user who gives
every worker the heaviest stage's share of a budget may get PR 1's layout
with stock vLLM. This measures it, per stage (blocks, tensor bytes, the whole
layout) and per pipeline (bytes against the budget, KV tokens, the
max_model_len settled on, refusals), for uneven pipelines: the seed's 56/8
Qwen3-32B at 5 GiB, 2 and 4 stages, TP x PP, a hybrid (sliding + full) and an
MLA model.

Every figure comes from vLLM's real ``get_kv_cache_configs`` (0.32:
``v1/core/kv_cache_utils.py``; 0.33: ``v1/core/kv_cache_planning.py`` after
``get_global_kv_cache_groups``) over real ``VllmConfig``s
(``EngineArgs.create_engine_config`` on a config.json, no weights) and the
KV cache specs vLLM's attention layers would register (from the same
config.json, read by ``vllm_kvmem.planner.model``; each checked against
``ModelConfig.get_num_kv_heads`` / ``get_head_size``). Modes, for a
pipeline-wide budget B:

- ``pr1``: vLLM with PR 1 applied (``kvmem_tools.intree --only
  pp_kv_budget`` on a copy of the release's vLLM), the flag on,
  ``kv_cache_memory_bytes`` = B, so every worker reports B and the patch
  splits it.
- ``pr1_arith``: stock vLLM given per worker ``split_kv_budget(B, stage
  bytes per block)``, the plugin's function that ``tests/test_intree.py``
  proves is PR 1's arithmetic verbatim: what the patch hands the stock code.
- ``heaviest``: stock vLLM, per-worker ``kv_cache_memory_bytes`` = the
  heaviest stage's proportional share, ``B * max(bpb) // sum(bpb)``, then
  #25164's trim (the maintainer's claim).
- ``by_layers``: stock, per worker ``B * max(layers) // sum(layers)``: the
  share a user computes from ``VLLM_PP_LAYER_PARTITION`` (the seed's rule).
- ``even``: stock, per worker ``B // pp`` (what a user naively types).
- ``whole``: stock, per worker B (the seed's baseline, today trimmed).
- ``pr2``: vLLM with PR 2 applied (``--only kv_cache_tokens``),
  ``kv_cache_tokens`` = the case's ``pr2_tokens`` (the budget in tokens).

Stage bytes per block come from a stock probe (memory to spare; each stage's
backing allocation over its block count). For some cases the smallest budget
each of ``pr1_arith`` and ``heaviest`` accepts is searched too (do they
refuse the same budgets?).

Run (from the repository root, no engine; about 1.5 minutes per release on two
cores)::

    .venv/bin/python benchmarks/pp_budget_vs_trim.py \\
        [--releases 0.32 0.33] [--out benchmarks/results/pp_budget_vs_trim.json]

0.33 is measured when ``.venv-033`` holds it. ``--worker`` is internal: one
vLLM process that plans the cases read from stdin.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/pp_budget_vs_trim.json"
VENV_033 = Path(os.environ.get("KVMEM_VENV_033", ROOT / ".venv-033"))
PYTHONS = {"0.32": ROOT / ".venv/bin/python", "0.33": VENV_033 / "bin/python"}
GiB = 1 << 30
MiB = 1 << 20

STOCK_MODES = ("pr1_arith", "heaviest", "by_layers", "even", "whole")

# ------------------------------------------------------------------- models

#: Qwen/Qwen3-32B's published config.json (the seed's model; not in the
#: shape catalog).
QWEN3_32B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "max_window_layers": 64,
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

#: deepseek-ai/DeepSeek-V2-Lite's attention (MLA: one latent of 512 + 64 per
#: token and layer, 27 layers); MoE fields as published.
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def model_config(name: str) -> dict[str, Any]:
    """A model's config.json content: the seed's Qwen3-32B, DeepSeek-V2-Lite,
    or a ``vllm_kvmem.shape_model`` catalog entry (published values)."""
    if name == "qwen3-32b":
        config = dict(QWEN3_32B)
    elif name == "deepseek-v2-lite":
        config = dict(DEEPSEEK_V2_LITE)
    else:
        from vllm_kvmem.shape_model import shape_config

        config = shape_config(name)
    return {**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


@dataclasses.dataclass(frozen=True)
class Case:
    """One pipeline: a model, its layer partition (one entry a stage), TP,
    the pipeline-wide budget B and the vLLM flags that size the cache."""

    name: str
    model: str
    partition: tuple[int, ...]
    budget: int
    max_model_len: int  # -1: vLLM's auto-fit
    tp: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    note: str = ""
    #: Also find the smallest budget each of ``pr1_arith`` and ``heaviest``
    #: accepts (do they refuse the same budgets?).
    threshold: bool = False
    #: Also plan with PR 2 (``--kv-cache-tokens``) at this many tokens.
    pr2_tokens: int | None = None


CASES: tuple[Case, ...] = (
    Case(
        "seed-qwen3-32b-56/8-5GiB-fp8kv",
        "qwen3-32b",
        (56, 8),
        5 * GiB,
        40960,
        kv_cache_dtype="fp8",
        threshold=True,
        pr2_tokens=40960,
        note="the seed's run: its logs (46,800 / 40,960 tokens, 4.38 / 0.62 GiB) "
        "imply 2048 KV bytes per token and layer, i.e. an 8-bit KV cache",
    ),
    Case(
        "seed-qwen3-32b-56/8-5GiB-fp8kv-auto",
        "qwen3-32b",
        (56, 8),
        5 * GiB,
        -1,
        kv_cache_dtype="fp8",
        note="the seed's pipeline with --max-model-len auto",
    ),
    Case("qwen3-32b-56/8-5GiB", "qwen3-32b", (56, 8), 5 * GiB, 16384),
    Case(
        "qwen3-32b-56/8-5GiB-40960-refused",
        "qwen3-32b",
        (56, 8),
        5 * GiB,
        40960,
        note="bf16 KV: 5 GiB holds 20,480 tokens of the pipeline, below max_model_len",
    ),
    Case("qwen3-32b-56/8-5GiB-auto", "qwen3-32b", (56, 8), 5 * GiB, -1),
    Case("qwen3-32b-48/16-5GiB-odd", "qwen3-32b", (48, 16), 5 * GiB + 12345, 8192),
    Case(
        "llama-3.1-8b-14/10/6/2-2GiB",
        "llama-3.1-8b",
        (14, 10, 6, 2),
        2 * GiB,
        8192,
        pr2_tokens=1023 * 16,
        note="pr2_tokens: what PR 1's 1024 blocks hold after the null block",
    ),
    Case("llama-3.1-8b-2/6/10/14-2GiB", "llama-3.1-8b", (2, 6, 10, 14), 2 * GiB, 8192),
    Case("llama-3.1-8b-tp2xpp2-24/8-1GiB", "llama-3.1-8b", (24, 8), GiB, 8192, tp=2),
    Case(
        "gemma-3-1b-20/6-160MiB",
        "gemma-3-1b",
        (20, 6),
        160 * MiB,
        8192,
        threshold=True,
        pr2_tokens=8192,
        note="hybrid: 512-token sliding window on 5 of 6 layers; 7 KV cache "
        "groups of 4 layers, so bytes per block go by layers per group on the "
        "stage, not by layers",
    ),
    Case(
        "gemma-3-1b-6/20-160MiB",
        "gemma-3-1b",
        (6, 20),
        160 * MiB,
        8192,
        threshold=True,
        pr2_tokens=8192,
    ),
    Case(
        "deepseek-v2-lite-21/6-1GiB",
        "deepseek-v2-lite",
        (21, 6),
        GiB,
        8192,
        threshold=True,
        pr2_tokens=8192,
        note="MLA: one 576-wide latent a token and layer",
    ),
)


def layer_specs(case: Case, model_dir: Path) -> list[dict[str, Any]]:
    """Each layer's KV spec on one rank (kind, heads, head sizes, torch dtype),
    from config.json as vllm-kvmem's planner reads it."""
    from vllm_kvmem.planner.model import model_from_config

    info = model_from_config(model_config(case.model), model_dir)
    torch_dtype = {1: "float8_e4m3fn", 2: info.dtype, 4: "float32"}
    return [
        {
            "kind": str(layer.kind),
            "heads": layer.kv_heads_per_rank(case.tp),
            "head_size": layer.head_size,
            "head_size_v": layer.head_size_v,
            "dtype": torch_dtype[layer.dtype_bytes],
            "window": layer.sliding_window,
        }
        for layer in info.layers(case.kv_cache_dtype)
    ]


def case_input(case: Case, model_dir: Path, modes: Sequence[str]) -> dict[str, Any]:
    """What a worker process needs for one case (JSON)."""
    return {
        **dataclasses.asdict(case),
        "model_dir": str(model_dir),
        "layers": layer_specs(case, model_dir),
        "modes": list(modes),
    }


# ------------------------------------------------------------------ worker
# Runs in a vLLM process: stock (VLLM_PLUGINS="", no plugin loaded) or the
# copy patched with PR 1 (no vllm_kvmem importable at all).


def _vllm_config(
    case: dict[str, Any], kv_bytes: int | None, flag: bool, tokens: int | None = None
) -> Any:
    """A fresh engine-core VllmConfig (auto-fit mutates it). ``flag``: PR 1's
    ``enable_pp_prop_kv_cache``; ``tokens``: PR 2's ``kv_cache_tokens``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    extra: dict[str, Any] = {"enable_pp_prop_kv_cache": True} if flag else {}
    if tokens is not None:
        extra["kv_cache_tokens"] = tokens
    cfg = EngineArgs(
        model=case["model_dir"],
        pipeline_parallel_size=len(case["partition"]),
        tensor_parallel_size=case["tp"],
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=case["max_model_len"],
        block_size=case["block_size"],
        kv_cache_dtype=case["kv_cache_dtype"],
        skip_tokenizer_init=True,
        **extra,
    ).create_engine_config()
    register_all_kvcache_specs(cfg)
    return cfg


def _worker_specs(case: dict[str, Any], cfg: Any) -> list[dict[str, Any]]:
    """Per-worker spec dicts, rank order stage-major, TP-minor (as vLLM's
    executor gathers them), checked against vLLM's own head count and size."""
    import torch
    import vllm.v1.attention.backends.utils as attn_utils
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    mc = cfg.model_config
    bs = cfg.cache_config.block_size
    assert bs == case["block_size"], (bs, case["block_size"])

    def spec(layer: dict[str, Any]) -> Any:
        assert layer["heads"] == mc.get_num_kv_heads(cfg.parallel_config), layer
        assert layer["head_size"] == mc.get_head_size(), layer
        common = dict(
            block_size=bs,
            num_kv_heads=layer["heads"],
            head_size=layer["head_size"],
            dtype=getattr(torch, layer["dtype"]),
        )
        if layer["kind"] == "mla":
            assert mc.use_mla
            return MLAAttentionSpec(**common)
        if layer["kind"] == "sliding_window":
            return SlidingWindowSpec(**common, sliding_window=layer["window"])
        return FullAttentionSpec(**common, head_size_v=layer["head_size_v"])

    out: list[dict[str, Any]] = []
    first = 0
    for n in case["partition"]:
        stage = {
            f"model.layers.{i}.self_attn.attn": spec(case["layers"][i])
            for i in range(first, first + n)
        }
        first += n
        out += [dict(stage) for _ in range(case["tp"])]
    attn_utils.resolve_kv_cache_layout(
        cfg, [["LBHNC"]] * len(out), [s for d in out for s in d.values()]
    )
    return out


def _digest(config: Any) -> str:
    """The whole layout of one worker (block count, tensors, groups)."""
    text = repr(
        (
            config.num_blocks,
            [dataclasses.asdict(t) for t in config.kv_cache_tensors],
            [(g.layer_names, repr(g.kv_cache_spec)) for g in config.kv_cache_groups],
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plan(
    case: dict[str, Any],
    available: list[int],
    kv_bytes: int | None,
    flag: bool = False,
    tokens: int | None = None,
) -> dict[str, Any]:
    """vLLM's planning of one case with each worker reporting ``available``."""
    import vllm
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    cfg = _vllm_config(case, kv_bytes, flag, tokens)
    specs = _worker_specs(case, cfg)
    logs: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: logs.append(r.getMessage())  # type: ignore[method-assign]
    core_logger = logging.getLogger("vllm.v1.core")
    core_logger.addHandler(handler)
    core_logger.setLevel(logging.INFO)
    try:
        if vllm.__version__.startswith("0.33."):
            from vllm.v1.core import kv_cache_planning as kp

            groups = kp.get_global_kv_cache_groups(cfg, specs)
            configs = kp.get_kv_cache_configs(cfg, specs, list(available), groups)
        else:
            from vllm.v1.core import kv_cache_utils as ku

            configs = ku.get_kv_cache_configs(cfg, specs, list(available))
    except (ValueError, RuntimeError) as e:
        return {"available": available, "refused": str(e), "log": logs}
    finally:
        core_logger.removeHandler(handler)
    tokens, concurrency = get_kv_cache_capacity(cfg, configs[0])
    tp = case["tp"]
    return {
        "available": available,
        "num_blocks": [c.num_blocks for c in configs[::tp]],
        # One backing allocation a worker; every tensor (one per group and
        # spec) is a view into it, so ``size`` is the same on each.
        "tensor_bytes": [
            max(t.size for t in c.kv_cache_tensors) for c in configs[::tp]
        ],
        "num_tensors": [len(c.kv_cache_tensors) for c in configs[::tp]],
        "num_groups": len(configs[0].kv_cache_groups),
        "layouts": [_digest(c) for c in configs],
        "max_model_len": cfg.model_config.max_model_len,
        "kv_cache_tokens": tokens,
        "max_concurrency": round(concurrency, 4),
        "log": [
            m for m in logs if any(w in m for w in ("pipeline", "Overrid", "tokens"))
        ],
    }


def _stage_bytes_per_block(case: dict[str, Any]) -> list[int]:
    """Each stage's KV bytes per block as stock vLLM lays it out: its tensor
    bytes over its block count, from a plan with memory to spare."""
    probe = _plan(case, [1 << 50] * len(case["partition"]) * case["tp"], 1 << 50)
    assert "refused" not in probe, probe
    out = []
    for nbytes, blocks in zip(probe["tensor_bytes"], probe["num_blocks"]):
        assert nbytes % blocks == 0, (nbytes, blocks)
        out.append(nbytes // blocks)
    return out


def _min_blocks(accepts: Any) -> int:
    """The smallest block count N whose budget vLLM accepts, ``accepts(N)``
    planning with N blocks' worth of memory (the budget N * sum(bytes per
    block)); acceptance only grows with N."""
    lo, hi = 1, 64
    while not accepts(hi):
        lo, hi = hi + 1, hi * 2
        assert hi < 1 << 24, "never accepted"
    while lo < hi:
        mid = (lo + hi) // 2
        if accepts(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def worker_case(case: dict[str, Any], side: str) -> dict[str, Any]:
    """The modes of one case on this process's vLLM (``side``: ``stock`` or
    ``pr1``, the copy patched with PR 1)."""
    budget, pp, tp = case["budget"], len(case["partition"]), case["tp"]
    workers = pp * tp

    def each(per_stage: list[int]) -> list[int]:
        return [per_stage[w // tp] for w in range(workers)]

    if side == "pr1":
        return {"pr1": _plan(case, [budget] * workers, budget, flag=True)}
    if side == "pr2":
        if case["pr2_tokens"] is None:
            return {}
        # Workers report their device's memory (ample here); PR 2 sizes.
        limits = [1 << 40] * workers
        return {"pr2": _plan(case, limits, None, tokens=case["pr2_tokens"])}
    bpb = _stage_bytes_per_block(case)
    out: dict[str, Any] = {"bytes_per_block": bpb}
    if case["threshold"]:

        def fits(available: list[int]) -> bool:
            return "refused" not in _plan(case, available, max(available))

        # A budget of N * sum(bpb): PR 1's shares are N blocks of each stage;
        # the heaviest stage's share is N * max(bpb).
        out["min_blocks_accepted"] = {
            "pr1_arith": _min_blocks(lambda n: fits(each([n * b for b in bpb]))),
            "heaviest": _min_blocks(lambda n: fits([n * max(bpb)] * workers)),
        }
    for mode in case["modes"]:
        if mode == "pr1_arith":
            from vllm_kvmem.core.kv_arith import split_kv_budget

            shares = each(split_kv_budget(budget, bpb))
            out[mode] = _plan(case, shares, budget)
            continue
        if mode == "heaviest":
            per_worker = budget * max(bpb) // sum(bpb)
        elif mode == "by_layers":
            per_worker = budget * max(case["partition"]) // sum(case["partition"])
        elif mode == "even":
            per_worker = budget // pp
        elif mode == "whole":
            per_worker = budget
        else:
            raise ValueError(f"unknown mode {mode!r}")
        out[mode] = _plan(case, [per_worker] * workers, per_worker)
    return out


def worker_main(side: str) -> None:
    """Plan the cases on stdin; print ``REPORT {json}`` as the last line."""
    import vllm
    from vllm.config import CacheConfig

    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    added = {"pr1": "enable_pp_prop_kv_cache", "pr2": "kv_cache_tokens"}
    for pr, field in added.items():
        assert (field in fields) == (side == pr), (side, field, vllm.__file__)
    assert "vllm_kvmem.plugin" not in sys.modules
    cases = json.loads(sys.stdin.read())
    report = {
        "vllm": vllm.__version__,
        "vllm_file": vllm.__file__,
        "cases": {c["name"]: worker_case(c, side) for c in cases},
    }
    # vllm_kvmem.core may be imported (pr1_arith); its plugin never registered.
    plugin = sys.modules.get("vllm_kvmem.plugin")
    assert plugin is None or not plugin._state["done"], "vllm-kvmem registered"
    print("REPORT " + json.dumps(report))


# ------------------------------------------------------------------ driver


def run_worker(
    python: Path, side: str, cases: list[dict[str, Any]], pythonpath: str
) -> dict[str, Any]:
    """One vLLM process (no plugin loaded) planning ``cases``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=pythonpath,
        VLLM_PLUGINS="",
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_TARGET_DEVICE="cpu",
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "--worker", side],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{side} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("REPORT "))


def _shim(folder: Path) -> Path:
    """A ``vllm_kvmem`` that raises on import, first on the patched vLLM's
    path: the in-tree PR must work with no plugin."""
    (folder / "vllm_kvmem").mkdir(parents=True, exist_ok=True)
    (folder / "vllm_kvmem/__init__.py").write_text(
        "raise ImportError('the in-tree vLLM imported vllm_kvmem')\n"
    )
    return folder


def patched_tree(release: str, python: Path, work: Path, patch: str) -> Path:
    """A copy of the release's vLLM with one PR alone applied (the series
    written ``--only PATCH`` against that release's sources)."""
    from kvmem_tools.intree import series as intree

    if release == "0.32":
        src = intree.installed_vllm_root()
    else:
        src = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    version, files = intree.write_series(work / f"series-{patch}", src, only=[patch])
    assert version.startswith(release + "."), version
    assert len(files) == 1, files
    tree = intree.copy_tree(src, work / f"tree-{patch}")
    intree.apply_series(tree, files)
    return tree


def write_models(cases: Sequence[Case], folder: Path) -> dict[str, Path]:
    """One config.json folder per model (no weights, no tokenizer: the
    workers build configs with ``skip_tokenizer_init``)."""
    out = {}
    for model in sorted({c.model for c in cases}):
        path = folder / model
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(model_config(model), indent=2))
        out[model] = path
    return out


def measure_release(
    release: str, cases: Sequence[Case], modes: Sequence[str], with_prs: bool
) -> dict[str, Any]:
    """Every case on one release: stock modes, and (``with_prs``) PR 1's and
    PR 2's patched copies."""
    python = PYTHONS[release]
    with tempfile.TemporaryDirectory(prefix="pp-budget-") as tmp:
        work = Path(tmp)
        dirs = write_models(cases, work / "models")
        inputs = [case_input(c, dirs[c.model], modes) for c in cases]
        stock = run_worker(python, "stock", inputs, str(ROOT))
        result = {"vllm": stock["vllm"], "cases": stock["cases"]}
        if with_prs:
            shim = _shim(work / "shim")
            for side, patch in (("pr1", "pp_kv_budget"), ("pr2", "kv_cache_tokens")):
                tree = patched_tree(release, python, work, patch)
                out = run_worker(python, side, inputs, f"{tree}:{shim}")
                assert out["vllm_file"].startswith(str(tree)), out["vllm_file"]
                for name, modes_out in out["cases"].items():
                    result["cases"][name].update(modes_out)
    for c in cases:
        result["cases"][c.name] = summarize(c, result["cases"][c.name])
    return result


def _pipeline(plan: dict[str, Any], budget: int, tp: int) -> dict[str, Any]:
    """A plan's pipeline totals against the budget (per TP shard: one rank a
    stage, the unit of PR 1's budget)."""
    if "refused" in plan:
        return {"refused": True}
    total = sum(plan["tensor_bytes"])
    return {
        "pipeline_bytes": total,
        "pipeline_bytes_all_ranks": total * tp,
        "of_budget": round(total / budget, 4),
    }


def summarize(case: Case, modes: dict[str, Any]) -> dict[str, Any]:
    """The equivalences: which modes give PR 1's exact layout, and what the
    others cost or waste."""
    bpb = modes["bytes_per_block"]
    reference = modes.get("pr1", modes.get("pr1_arith"))
    assert reference is not None

    def same(mode: str) -> bool | None:
        plan = modes.get(mode)
        if plan is None:
            return None
        if "refused" in plan or "refused" in reference:
            return "refused" in plan and "refused" in reference
        keys = ("layouts", "max_model_len", "kv_cache_tokens", "num_blocks")
        return all(plan[k] == reference[k] for k in keys)

    for mode in ("pr1", *STOCK_MODES, "pr2"):
        if mode in modes:
            modes[mode]["totals"] = _pipeline(modes[mode], case.budget, case.tp)
    if accepted := modes.get("min_blocks_accepted"):
        modes["min_budget_accepted"] = {m: n * sum(bpb) for m, n in accepted.items()}
        pr2 = modes.get("pr2", {})
        if case.pr2_tokens == case.max_model_len and "num_blocks" in pr2:
            # One max_model_len request in tokens: the smallest budget that fits.
            modes["pr2_blocks_are_min_accepted"] = (
                pr2["num_blocks"][0] == accepted["pr1_arith"]
            )
    return {
        **dataclasses.asdict(case),
        **modes,
        "layer_share_is_bytes_share": [
            case.budget * max(case.partition) // sum(case.partition)
            == case.budget * max(bpb) // sum(bpb)
        ],
        "pr1_blocks": case.budget // sum(bpb),
        "same_as_pr1": {
            m: same(m)
            for m in (*STOCK_MODES, "pr1", "pr2")
            if m in modes and m != "pr1"
        },
    }


def _figures(plan: dict[str, Any]) -> Any:
    """What a plan allocates, or that it refused."""
    if "refused" in plan:
        return "refused"
    return [plan["num_blocks"], plan["tensor_bytes"], plan["max_model_len"]]


def overall(results: dict[str, Any]) -> dict[str, Any]:
    """The findings over every case: which modes equal PR 1 everywhere, what
    each costs against the budget, and whether the releases agree."""
    out: dict[str, Any] = {}
    for release, res in results.items():
        cases = res["cases"].values()
        out[release] = {
            f"{m}_equals_pr1_everywhere": all(c["same_as_pr1"][m] for c in cases)
            for m in ("pr1_arith", "heaviest")
        }
        out[release]["by_layers_differs"] = [
            c["name"] for c in cases if not c["same_as_pr1"]["by_layers"]
        ]
        out[release]["min_budget_accepted_equal"] = all(
            len(set(c["min_budget_accepted"].values())) == 1
            for c in cases
            if "min_budget_accepted" in c
        )
        out[release]["pipeline_of_budget"] = {
            c["name"]: {
                m: c[m]["totals"].get("of_budget", "refused")
                for m in ("pr1", *STOCK_MODES, "pr2")
                if m in c
            }
            for c in cases
        }
    if len(results) > 1:
        figures = [
            {
                name: {
                    m: _figures(c[m]) for m in ("pr1", *STOCK_MODES, "pr2") if m in c
                }
                for name, c in res["cases"].items()
            }
            for res in results.values()
        ]
        out["releases_agree"] = all(f == figures[0] for f in figures)
    return out


def _table(results: dict[str, Any]) -> str:
    """One line a case and mode: blocks and GiB per stage, pipeline total."""
    lines = []
    for release, res in results.items():
        lines.append(f"vLLM {res['vllm']} ({release})")
        for name, case in res["cases"].items():
            lines.append(
                f"  {name}  B={case['budget'] / GiB:.3f} GiB  "
                f"same as PR 1: {case['same_as_pr1']}"
            )
            for mode in ("pr1", *STOCK_MODES, "pr2"):
                plan = case.get(mode)
                if plan is None:
                    continue
                if "refused" in plan:
                    lines.append(f"    {mode:10} refused: {plan['refused'][:90]}")
                    continue
                stages = " ".join(
                    f"{b}/{n / GiB:.3f}"
                    for b, n in zip(plan["num_blocks"], plan["tensor_bytes"])
                )
                t = plan["totals"]
                lines.append(
                    f"    {mode:10} blocks/GiB {stages}  pipeline "
                    f"{t['pipeline_bytes'] / GiB:.3f} GiB ({t['of_budget']:.3f} B)"
                    f"  tokens {plan['kv_cache_tokens']}  len {plan['max_model_len']}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="+", default=["0.32", "0.33"])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--worker", choices=["stock", "pr1", "pr2"], help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    sys.path.insert(0, str(ROOT))
    from _report import provenance

    t0 = time.time()
    results = {}
    for release in args.releases:
        if not PYTHONS[release].exists():
            print(f"vLLM {release}: {PYTHONS[release]} missing, skipped")
            continue
        results[release] = measure_release(release, CASES, STOCK_MODES, True)
    print(_table(results))
    report = {
        **provenance(
            "pp_budget_vs_trim.py", argv, t0, "2 shared cores; no engine, planning only"
        ),
        "modes": {
            "pr1": "vLLM patched with PR 1, flag on, kv_cache_memory_bytes=B",
            "pr1_arith": "stock, per worker split_kv_budget(B, stage bytes/block)",
            "heaviest": "stock, per worker B*max(bpb)//sum(bpb), then the trim",
            "by_layers": "stock, per worker B*max(layers)//sum(layers)",
            "even": "stock, per worker B//pp",
            "whole": "stock, per worker B",
            "pr2": "vLLM patched with PR 2, kv_cache_tokens=the case's pr2_tokens",
        },
        "summary": overall(results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
