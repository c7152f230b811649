"""The patched vLLM 0.32 (``kvmem upstream``'s series applied to a copy of
the installed vLLM) runs our features with no plugin at all, with results
equal to the plugin's: each configuration (a pipeline of 2 with split, layout
and host tier; a single-stage engine with a token budget) runs twice with the
same script, arguments and work:

- in-tree: the patched copy first on the path, in processes where
  ``vllm_kvmem`` cannot be imported (a stand-in package that raises comes
  first on the path) and ``VLLM_PLUGINS`` excludes the plugin;
- plugin: the installed, unmodified vLLM with vllm-kvmem loaded through its
  ``vllm.general_plugins`` entry point.

Per rank blocks, layers, page size, layout and capacity, every round's greedy
tokens and cached tokens, and the startup capacity table must be equal; the
absolute checks (the plugin's split arithmetic, BLHNC, host hits, the token
budget's bounds) keep two equally wrong runs from passing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT
from tests.helpers import engine_env as plugin_engine_env
from vllm_kvmem.core import pp_split
from vllm_kvmem.demo import documents
from vllm_kvmem.demo_engine import PP_COMPILATION

ENGINE_TIMEOUT_S = 420

# ------------------------------------------------------------- engines

_ENGINE = r"""
import dataclasses, json, sys
import vllm
from vllm import LLM, SamplingParams
from vllm.plugins import load_general_plugins

# vLLM's own plugin loading, before LLM(...) takes the options as keyword
# arguments: with the plugin it adds them to EngineArgs; in-tree (no plugin
# to load) they are EngineArgs fields already.
load_general_plugins()
kw, work = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**kw)
params = SamplingParams(max_tokens=work["max_tokens"], temperature=0.0)
rounds = []
for _ in range(work["rounds"]):
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    rounds.append({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
                   "cached": [o.num_cached_tokens or 0 for o in outs]})

def report(worker):
    import sys
    import vllm
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
    cfg = worker.model_runner.kv_cache_config
    fewer = dataclasses.replace(cfg, num_blocks=cfg.num_blocks - 1)
    return {
        "rank": worker.rank,
        "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
        "num_blocks": cfg.num_blocks,
        "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
        "layout": cfg.kv_cache_layout,
        "tokens": get_kv_cache_capacity(worker.vllm_config, cfg)[0],
        "tokens_one_block_less": get_kv_cache_capacity(worker.vllm_config, fewer)[0],
        "plugin_modules": sorted(m for m in sys.modules if m.startswith("vllm_kvmem")),
        "vllm_file": vllm.__file__,
    }

ranks = sorted(llm.collective_rpc(report), key=lambda r: r["rank"])
mods = sorted(m for m in sys.modules if m.startswith("vllm_kvmem"))
out = {"rounds": rounds, "ranks": ranks, "plugin_modules": mods,
       "vllm_file": vllm.__file__}
print("REPORT " + json.dumps(out))
"""


@dataclass(frozen=True)
class Run:
    report: dict[str, Any]
    log: str

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return self.report["ranks"]


@dataclass(frozen=True)
class Pair:
    """One configuration run in-tree (patched copy, no plugin) and with the
    plugin (unmodified vLLM)."""

    intree: Run
    plugin: Run


def _run(cmd_env: dict[str, str], cwd: Path, kwargs: dict, work: dict) -> Run:
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE, json.dumps(kwargs), json.dumps(work)],
        cwd=cwd,
        env=cmd_env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, log[-6000:]
    return Run(json.loads(lines[-1].removeprefix("REPORT ")), log)


def _both(no_plugin, kwargs: dict, work: dict, **env: str) -> Pair:
    """The same script, arguments, work and ``env`` in-tree, then with the plugin."""
    base, shim = no_plugin
    # cwd: the shim, not the repository: its vllm_kvmem must stay out of reach.
    intree = _run({**base, **env}, shim, kwargs, work)
    # The plugin's environment: the installed vLLM (no PYTHONPATH of ours),
    # every general plugin loaded (VLLM_PLUGINS unset), as tests.helpers runs
    # plugin engines.
    plugin_env = {
        k: v for k, v in plugin_engine_env(**env).items() if k != "VLLM_PLUGINS"
    }
    plugin = _run(plugin_env, ROOT, kwargs, work)
    return Pair(intree, plugin)


# ------------------------------------------------- the startup capacity table

TITLE = "KV cache per rank ("


def capacity_tables(log: str) -> list[list[str]]:
    """Each startup capacity table in ``log``, as lines without vLLM's log
    prefix: the title from "KV cache per rank (" on, then the lines that carry
    the title's prefix (process name and pid, level, time, file and line:
    vLLM's formatter repeats it on every line of a message)."""
    lines = log.splitlines()
    tables = []
    for i, line in enumerate(lines):
        at = line.find(TITLE)
        if at < 0:
            continue
        prefix, table = line[:at], [line[at:]]
        for cont in lines[i + 1 :]:
            if not cont.startswith(prefix) or TITLE in cont:
                break
            table.append(cont[len(prefix) :])
        tables.append(table)
    return tables


def test_capacity_tables_strip_the_prefixes():
    log = "\n".join(
        [
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80] KV cache per rank (a):",
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80]   rank stage",
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80]      0     0",
            "(EngineCore pid=7) INFO 01-02 03:04:06 [y.py:1] next message",
            "INFO 01-02 03:04:07 [x.py:81] KV cache per rank (b):",
            "INFO 01-02 03:04:07 [x.py:81]   rank",
        ]
    )
    assert capacity_tables(log) == [
        ["KV cache per rank (a):", "  rank stage", "     0     0"],
        ["KV cache per rank (b):", "  rank"],
    ]


# ------------------------------------------------------------- comparisons

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
    """What must be equal between the two runs, by a name a failure shows."""
    out: dict[str, Any] = {"ranks": [r["rank"] for r in run.ranks]}
    for r in run.ranks:
        for f in RANK_FIELDS:
            out[f"rank {r['rank']} {f}"] = r[f]
    out["rounds"] = len(run.report["rounds"])
    for i, rnd in enumerate(run.report["rounds"]):
        out[f"round {i} token_ids"] = rnd["token_ids"]
        out[f"round {i} num_cached_tokens"] = rnd["cached"]
    tables = capacity_tables(run.log)
    out["capacity tables"] = len(tables)
    for i, table in enumerate(tables):
        out[f"capacity table {i} lines"] = len(table)
        for j, line in enumerate(table):
            out[f"capacity table {i} line {j}"] = line
    return out


def assert_equal_runs(pair: Pair) -> None:
    a, b = _fields(pair.intree), _fields(pair.plugin)
    diffs = []
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k, _MISSING), b.get(k, _MISSING)
        if x != y:
            diffs.append(f"  {k}:\n    in-tree {x!r}\n    plugin  {y!r}")
    assert not diffs, "the in-tree run differs from the plugin's:\n" + "\n".join(diffs)


def test_a_difference_names_its_field():
    rank = dict.fromkeys(RANK_FIELDS, 1) | {"rank": 0}
    rounds = [{"token_ids": [[5, 6]], "cached": [0]}]
    log = "INFO [x.py:1] KV cache per rank (t):\nINFO [x.py:1]      0    24"
    a = Run({"ranks": [rank], "rounds": rounds}, log)
    assert_equal_runs(Pair(a, a))
    b = Run({"ranks": [rank | {"num_blocks": 2}], "rounds": rounds}, log + "5")
    with pytest.raises(AssertionError) as err:
        assert_equal_runs(Pair(a, b))
    lines = [ln.strip() for ln in str(err.value).splitlines()]
    assert lines[1:7] == [
        "rank 0 num_blocks:",
        "in-tree 1",
        "plugin  2",
        "capacity table 0 line 1:",
        "in-tree '     0    24'",
        "plugin  '     0    245'",
    ]


def assert_sources(pair: Pair, patched_vllm: Path) -> None:
    """The in-tree run: the patched copy, no ``vllm_kvmem`` in any process;
    the plugin run: the installed vLLM, the plugin loaded in every process."""
    root = str(patched_vllm.resolve())
    intree, plugin = pair.intree, pair.plugin
    for proc in [intree.report, *intree.ranks]:
        assert proc["plugin_modules"] == [], proc
        assert str(Path(proc["vllm_file"]).resolve()).startswith(root), proc
    for proc in [plugin.report, *plugin.ranks]:
        assert "vllm_kvmem.plugin" in proc["plugin_modules"], proc
        assert not str(Path(proc["vllm_file"]).resolve()).startswith(root), proc


def table_rows(run: Run) -> list[list[str]]:
    """The one capacity table's rank rows, split into cells."""
    (table,) = capacity_tables(run.log)
    return [line.split() for line in table[2 : 2 + len(run.ranks)]]


def assert_table_agrees(run: Run) -> None:
    """Rank, layers, blocks and tokens of the table's rows are the ranks'."""
    for r, row in zip(run.ranks, table_rows(run), strict=True):
        assert row[0] == str(r["rank"]) and row[2] == str(r["layers"]), row
        assert row[4] == f"{r['num_blocks']:,}" and row[5] == f"{r['tokens']:,}", row


# ------------------------------------------- pipeline of 2, host tier

BUDGET = 24 << 20  # pipeline-wide: 24 blocks of 128 tokens of model_8l in float32
HOST = 256 << 20


@pytest.fixture(scope="module")
def pp_runs(no_plugin, model_8l) -> Pair:
    kwargs = dict(
        model=str(model_8l),
        pipeline_parallel_size=2,
        compilation_config=PP_COMPILATION,
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        kv_host_cache_bytes=HOST,
        max_model_len=2048,
        max_num_seqs=2,
        dtype="float32",
    )
    # 6 documents of 8 blocks: twice the 24-block device cache on each stage.
    work = {"prompts": documents(6), "max_tokens": 4, "rounds": 2}
    return _both(no_plugin, kwargs, work, VLLM_PP_LAYER_PARTITION="5,3")


@pytest.mark.engine
def test_pp_runs_in_tree_without_plugin_and_with_it_on_unmodified_vllm(
    pp_runs, patched_vllm
):
    assert_sources(pp_runs, patched_vllm)


@pytest.mark.engine
def test_patched_vllm_splits_lays_out_and_hits_the_host_tier_without_plugin(
    pp_runs,
):
    run = pp_runs.intree
    ranks = run.ranks
    # The split, as the plugin's arithmetic gives it for these stages.
    bpb = [r["layers"] * r["page_bytes"] for r in ranks]
    shares = pp_split.split_budget(BUDGET, bpb)
    assert [r["layers"] for r in ranks] == [5, 3]
    assert [r["num_blocks"] for r in ranks] == [s.num_blocks for s in shares]
    (table,) = capacity_tables(run.log)
    assert table[0].startswith("KV cache per rank (--enable-pp-prop-kv-cache"), table
    assert_table_agrees(run)
    # The layout the host tier's connector asks for, which CPU_ATTN accepts.
    from vllm_kvmem.layout import PREFERRED

    assert [r["layout"] for r in ranks] == [PREFERRED, PREFERRED]
    # Host hits, identical greedy output.
    first, second = run.report["rounds"]
    assert second["token_ids"] == first["token_ids"]
    assert sum(second["cached"]) >= 4 * max(1, sum(first["cached"]))
    assert "Host KV tier: " in run.log


@pytest.mark.engine
def test_patched_vllm_pp_results_equal_the_plugins(pp_runs):
    assert "Host KV tier: " in pp_runs.plugin.log
    assert_equal_runs(pp_runs)


# ------------------------------------------- single stage, token budget

TOKENS = 3000


@pytest.fixture(scope="module")
def budget_runs(no_plugin, model_8l) -> Pair:
    kwargs = dict(
        model=str(model_8l),
        kv_cache_tokens=TOKENS,
        max_model_len=2048,
        max_num_seqs=2,
        enforce_eager=True,
    )
    work = {"prompts": ["The KV cache"], "max_tokens": 4, "rounds": 1}
    return _both(no_plugin, kwargs, work, VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.mark.engine
def test_budget_runs_in_tree_without_plugin_and_with_it_on_unmodified_vllm(
    budget_runs, patched_vllm
):
    assert_sources(budget_runs, patched_vllm)


@pytest.mark.engine
def test_patched_vllm_token_budget_without_plugin(budget_runs):
    run = budget_runs.intree
    (rank,) = run.ranks
    # Exactly the blocks the tokens need, as vLLM counts capacity.
    assert rank["tokens"] >= TOKENS > rank["tokens_one_block_less"]
    (table,) = capacity_tables(run.log)
    assert f"--kv-cache-tokens {TOKENS:,}" in table[0], table
    assert_table_agrees(run)


@pytest.mark.engine
def test_patched_vllm_token_budget_results_equal_the_plugins(budget_runs):
    assert_equal_runs(budget_runs)
