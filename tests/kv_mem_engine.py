"""The KV cache memory options on a real engine, with the plugin.

- A pipeline of 2 stages (layers 5 and 3) with ``--enable-pp-prop-kv-cache``,
  a 24 MiB pipeline-wide budget and the host KV tier: every stage holds the
  blocks of the proportional split (the budget over the sum of the stages'
  bytes per block), the KV cache layout is BLHNC (the host tier's connector
  asks for it and CPU_ATTN accepts it), and a second pass over documents that
  fill twice the device cache hits the host tier with identical greedy tokens.

It checks the startup capacity table: exactly one is logged, and its cells
are the ranks' own figures. (The token budget's engine test is the in-tree
series' own, ``tests/v1/e2e/test_kv_cache_budget_engine.py``, which runs with
the plugin too: tests/test_intree_engines.py.)

The model is a small local checkpoint named by ``KV_MEM_TEST_MODEL``; with
``KV_MEM_TEST_REPORT`` naming a folder, each test writes what it measured to
``<test name>.json`` there, so that two runs (vLLM 0.32 and 0.33:
``tests/test_vllm033_engine.py``) can be compared. Each test starts one
engine: run one test per process (``pytest kv_mem_engine.py::<test>``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

from vllm_kvmem.demo import documents

TITLE = "KV cache per rank ("


@pytest.fixture
def model() -> str:
    path = os.environ.get("KV_MEM_TEST_MODEL")
    if not path:
        pytest.skip("KV_MEM_TEST_MODEL does not name a small local model to run")
    return path


@pytest.fixture
def engine_env(monkeypatch) -> None:
    # The budgets size the CPU KV cache, not VLLM_CPU_KVCACHE_SPACE.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    # Two pipeline stages on one CPU socket: no thread binding.
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The per-rank report is a function sent to the workers.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # Spawned, not forked: the engine's processes log to the file
    # descriptors pytest captures, not to a stream object they inherit.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def engine_output(capfd) -> str:
    """What the engine's processes wrote so far, captured at the file
    descriptors: the engine core and the workers inherit them, and LLM(...)
    points this process's vLLM logging at the stream pytest captures."""
    out, err = capfd.readouterr()
    # Written back, so that pytest still shows them if the test fails.
    sys.stdout.write(out)
    sys.stderr.write(err)
    return out + err


def capacity_tables(output: str) -> list[list[str]]:
    """Each capacity table in ``output``, as lines without vLLM's log prefix:
    the title from "KV cache per rank (" on, then the lines that carry the
    title's prefix (process name and pid, level, time, file and line: vLLM's
    formatter repeats it on every line of a message)."""
    lines = output.splitlines()
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
    output = "\n".join(
        [
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80] KV cache per rank (a):",
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80]   rank stage",
            "(EngineCore pid=7) INFO 01-02 03:04:05 [x.py:80]      0     0",
            "(EngineCore pid=7) INFO 01-02 03:04:06 [y.py:1] next message",
            "INFO 01-02 03:04:07 [x.py:81] KV cache per rank (b):",
            "INFO 01-02 03:04:07 [x.py:81]   rank",
        ]
    )
    assert capacity_tables(output) == [
        ["KV cache per rank (a):", "  rank stage", "     0     0"],
        ["KV cache per rank (b):", "  rank"],
    ]


def start(**kwargs: Any) -> LLM:
    # General plugins first, as vLLM's entry points load them: with the
    # options in-tree there is nothing to load; a plugin that adds them to the
    # engine arguments must be loaded before LLM(...) takes them.
    load_general_plugins()
    return LLM(**kwargs)


def generate(llm: LLM, prompts: list[str], rounds: int) -> list[dict[str, Any]]:
    """Greedy tokens and cached tokens of every prompt, round by round."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    out = []
    for _ in range(rounds):
        done = llm.generate(prompts, params, use_tqdm=False)
        out.append(
            {
                "token_ids": [list(o.outputs[0].token_ids) for o in done],
                "cached": [o.num_cached_tokens or 0 for o in done],
            }
        )
    return out


def packages() -> list[str]:
    """The top-level packages this process imported (outside the standard
    library): which build of vLLM, and what else, ran."""
    names = {m.partition(".")[0] for m in sys.modules if not m.startswith("_")}
    return sorted(names - set(sys.stdlib_module_names))


def ranks_of(llm: LLM) -> list[dict[str, Any]]:
    """Per rank: KV cache layers, blocks, page size, layout and capacity (as
    vLLM counts it, and with one block less), and what the worker imported."""

    # Defined here, not at module level: sent to the workers by value, so
    # that they need not import this test module.
    def report(worker) -> dict[str, Any]:
        import dataclasses
        import sys

        import vllm
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        cfg = worker.model_runner.kv_cache_config
        fewer = dataclasses.replace(cfg, num_blocks=cfg.num_blocks - 1)
        tokens, _ = get_kv_cache_capacity(worker.vllm_config, cfg)
        tokens_one_block_less, _ = get_kv_cache_capacity(worker.vllm_config, fewer)
        names = {m.partition(".")[0] for m in sys.modules if not m.startswith("_")}
        return {
            "rank": worker.rank,
            "layers": len({n for g in cfg.kv_cache_groups for n in g.layer_names}),
            "num_blocks": cfg.num_blocks,
            "page_bytes": cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
            "layout": cfg.kv_cache_layout,
            "tokens": tokens,
            "tokens_one_block_less": tokens_one_block_less,
            "vllm_file": vllm.__file__,
            "packages": sorted(names - set(sys.stdlib_module_names)),
        }

    return sorted(llm.collective_rpc(report), key=lambda r: r["rank"])


def write_report(request, **fields: Any) -> None:
    """``<test name>.json`` in the folder ``KV_MEM_TEST_REPORT`` names, if any."""
    import vllm

    folder = os.environ.get("KV_MEM_TEST_REPORT")
    if not folder:
        return
    report = {**fields, "vllm_file": vllm.__file__, "packages": packages()}
    path = Path(folder) / f"{request.node.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def assert_table_agrees(table: list[str], ranks: list[dict[str, Any]]) -> None:
    """Rank, layers, blocks and tokens of the table's rows are the ranks'."""
    rows = [line.split() for line in table[2 : 2 + len(ranks)]]
    assert len(rows) == len(ranks), table
    for r, row in zip(ranks, rows, strict=True):
        assert row[0] == str(r["rank"]) and row[2] == str(r["layers"]), row
        assert row[4] == f"{r['num_blocks']:,}", row
        assert row[5] == f"{r['tokens']:,}", row


# ------------------------------------------- pipeline of 2, host tier

BUDGET = 24 << 20  # pipeline-wide; 24 blocks of 128 tokens of 8 layers in float32
HOST = 256 << 20


@pytest.mark.skipif(
    not current_platform.is_cpu(),
    reason="CPU settings: eager-backend compilation for pipeline parallel, "
    "CPU_ATTN's BLHNC layout",
)
def test_pp_prop_budget_layout_and_host_tier(
    request, monkeypatch, model, engine_env, capfd
):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,3")
    llm = start(
        model=model,
        pipeline_parallel_size=2,
        # Pipeline parallel on CPU does not run with enforce_eager: compile
        # with the eager backend instead.
        compilation_config={"mode": 2, "backend": "eager"},
        kv_cache_memory_bytes=BUDGET,
        enable_pp_prop_kv_cache=True,
        kv_host_cache_bytes=HOST,
        max_model_len=2048,
        max_num_seqs=2,
        # A random model's logits are near ties, which bf16 rounding can flip.
        dtype="float32",
    )
    # 6 documents of 8 blocks: twice the 24-block device cache of each stage.
    rounds = generate(llm, documents(6), rounds=2)
    ranks = ranks_of(llm)
    output = engine_output(capfd)
    tables = capacity_tables(output)
    write_report(request, ranks=ranks, rounds=rounds, capacity_tables=tables)

    # The proportional split: each stage gets the budget times its share of
    # the bytes per block, which is the same number of blocks on every stage.
    assert [r["layers"] for r in ranks] == [5, 3]
    per_block = [r["layers"] * r["page_bytes"] for r in ranks]
    shares = [BUDGET * b // sum(per_block) for b in per_block]
    blocks = [s // b for s, b in zip(shares, per_block)]
    assert [r["num_blocks"] for r in ranks] == blocks
    assert blocks == [BUDGET // sum(per_block)] * 2
    (table,) = tables
    assert table[0].startswith("KV cache per rank (--enable-pp-prop-kv-cache"), table
    assert_table_agrees(table, ranks)
    # The layout the host tier's connector asks for, which CPU_ATTN accepts.
    assert [r["layout"] for r in ranks] == ["BLHNC", "BLHNC"]
    # The second pass hits the host tier, with identical greedy output.
    first, second = rounds
    assert second["token_ids"] == first["token_ids"]
    assert sum(second["cached"]) >= 4 * max(1, sum(first["cached"]))
    assert "Host KV tier: " in output
