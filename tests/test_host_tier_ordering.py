"""Late spills and fences against the model runner's writes into new blocks.

A late spill copies a block vLLM evicted in this scheduling pass, and a
fence waits for a background save still reading a block this step may
overwrite; both happen in the connector's ``handle_preemptions``. They are
only right if nothing has written the block yet. vLLM writes into freshly
allocated blocks before the forward: it zeroes ``new_block_ids_to_zero`` and
applies the copy-on-write ``kv_cache_block_copies``. The V1 model runner
(the only one on CPU) calls ``handle_preemptions`` first; Model Runner V2
(CUDA's default) after those writes. docs/host-kv-tier.md, "Writes into new
blocks before the forward, per runner", has the whole order.

- V1, on a real engine (CPU): blocks zeroed or copy-on-write targets in the
  step of their late spill reach the host with the KV they held before.
- V1 and V2, read from the installed vLLM sources (0.32, and 0.33 when its
  environment exists): the order of those writes and the connector hooks on
  every path through each runner's ``execute_model``, so a vLLM change trips
  here. Then the tier's scheduler, given vLLM's real ``SchedulerOutput``
  with those lists, sends exactly the spills that order leaves safe: all on
  V1, none of the overwritten blocks on V2 (their fenced saves forgotten).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmem_tools.vllm_sources import SourceTree
from tests.helpers import (
    captured_log,
    host_tier_kwargs,
    host_tier_workload,
    messages,
    site_033,
)

# ------------------------------------------------------- the runners' order

#: What each call of interest is, by the name it is called with: the
#: writes into new blocks, and the connector hooks.
EVENTS = {
    "_zero_block_ids": "zero",  # V1 (the CPU runner overrides it)
    "zero_block_ids": "zero",  # V2's KVBlockZeroer
    "copy_kv_cache_blocks_inplace": "copy_on_write",
    "preprocess_mamba": "mamba_state_copy",  # V1, mamba "align"
    "preprocess_state": "mamba_state_copy",  # V2's model state
    "handle_preemptions": "handle_preemptions",
    "bind_connector_metadata": "bind_connector_metadata",
    "start_load_kv": "start_load_kv",
}
WRITES = ("zero", "copy_on_write", "mamba_state_copy")

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V1_MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
V2_CONNECTOR = "vllm.v1.worker.gpu.kv_connector"


@dataclass(frozen=True)
class Runner:
    """Where a model runner's step starts, and the calls followed into
    (callee as written -> module, ``Class.function``)."""

    name: str
    entry: tuple[str, str]
    follow: dict[str, tuple[str, str]]
    #: The step with a forward pass, events in order (repeats collapsed), as
    #: docs/host-kv-tier.md writes it down.
    forward: tuple[str, ...]


V1 = Runner(
    "V1",
    (V1_RUNNER, "GPUModelRunner.execute_model"),
    {
        "self._update_states": (V1_RUNNER, "GPUModelRunner._update_states"),
        "self.maybe_get_kv_connector_output": (
            V1_MIXIN,
            "KVConnectorModelRunnerMixin.maybe_get_kv_connector_output",
        ),
        "self.kv_connector_no_forward": (
            V1_MIXIN,
            "KVConnectorModelRunnerMixin.kv_connector_no_forward",
        ),
        "KVConnectorModelRunnerMixin._get_kv_connector_output": (
            V1_MIXIN,
            "KVConnectorModelRunnerMixin._get_kv_connector_output",
        ),
    },
    (
        "handle_preemptions",
        "zero",
        "copy_on_write",
        "mamba_state_copy",
        "bind_connector_metadata",
        "start_load_kv",
    ),
)
V2 = Runner(
    "V2",
    (V2_RUNNER, "GPUModelRunner.execute_model"),
    {
        "self.update_requests": (V2_RUNNER, "GPUModelRunner.update_requests"),
        "self.kv_connector.pre_forward": (
            V2_CONNECTOR,
            "ActiveKVConnector.pre_forward",
        ),
        "self.kv_connector.no_forward": (V2_CONNECTOR, "ActiveKVConnector.no_forward"),
        "self.pre_forward": (V2_CONNECTOR, "ActiveKVConnector.pre_forward"),
        "self._start_load_kv": (V2_CONNECTOR, "ActiveKVConnector._start_load_kv"),
    },
    (
        "zero",
        "copy_on_write",
        "mamba_state_copy",
        "handle_preemptions",
        "bind_connector_metadata",
        "start_load_kv",
    ),
)

Path_ = tuple[tuple[str, ...], bool]  # (events, the function returned)


class StepReader:
    """The events of one runner's step, read from a vLLM source tree: every
    path through the entry function (its ``if`` branches and early
    returns), with the followed calls' events in their place (a followed
    function counts as straight-line code)."""

    def __init__(self, tree: SourceTree, runner: Runner) -> None:
        self.tree = tree
        self.runner = runner

    def function(self, module: str, qualname: str) -> ast.FunctionDef:
        mod = self.tree.module(module)
        if mod is None:
            pytest.fail(
                f"vLLM {self.tree.version()} has no {module}: re-read the order"
            )
        body: list[ast.stmt] = mod.body
        *classes, name = qualname.split(".")
        for cls in classes:
            found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
            if not found:
                pytest.fail(f"{module} has no class {cls}: re-read the order")
            body = found[-1].body
        funcs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
        if not funcs:
            pytest.fail(f"{module}:{qualname} is gone: re-read the order")
        return funcs[-1]

    def paths(self) -> list[Path_]:
        return self._block(self.function(*self.runner.entry).body, 0)

    def _block(self, stmts: list[ast.stmt], depth: int) -> list[Path_]:
        paths: list[Path_] = [((), False)]
        for stmt in stmts:
            branches = self._stmt(stmt, depth)
            grown = {
                (events + more, ended) if not done else (events, done)
                for events, done in paths
                for more, ended in (branches if not done else [((), True)])
            }
            paths = sorted(grown)
        return paths

    def _stmt(self, stmt: ast.stmt, depth: int) -> list[Path_]:
        if isinstance(stmt, ast.If):
            test = self._events(stmt.test, depth)
            arms = self._block(stmt.body, depth) + self._block(stmt.orelse, depth)
            return [(test + events, ended) for events, ended in arms]
        if isinstance(stmt, ast.With):
            head: tuple[str, ...] = ()
            for item in stmt.items:
                head += self._events(item.context_expr, depth)
            return [(head + ev, ended) for ev, ended in self._block(stmt.body, depth)]
        ended = isinstance(stmt, (ast.Return, ast.Raise))
        return [(self._events(stmt, depth), ended)]

    def _events(self, node: ast.AST, depth: int) -> tuple[str, ...]:
        """The events of the calls in ``node``, in source order, followed
        calls expanded (nested function definitions are not this code)."""
        calls: list[ast.Call] = []
        todo = [node]
        while todo:
            n = todo.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(n, ast.Call):
                calls.append(n)
            todo.extend(ast.iter_child_nodes(n))
        events: tuple[str, ...] = ()
        for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            callee = ast.unparse(call.func)
            if callee in self.runner.follow and depth < 4:
                func = self.function(*self.runner.follow[callee])
                for stmt in func.body:
                    events += self._events(stmt, depth + 1)
                continue
            name = callee.rsplit(".", 1)[-1]
            if name in EVENTS:
                events += (EVENTS[name],)
        return events


def _collapse(events: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(e for i, e in enumerate(events) if i == 0 or events[i - 1] != e)


@dataclass(frozen=True)
class Order:
    """What the tier needs to know of a runner's step."""

    forward: tuple[str, ...]  # the step with a forward pass, collapsed
    hook_first: bool  # handle_preemptions before every write, on every path
    writes_first: bool  # every write before handle_preemptions, on every path


def read_order(tree: SourceTree, runner: Runner) -> Order:
    paths = [ev for ev, _ in StepReader(tree, runner).paths()]
    hooked = [ev for ev in paths if "handle_preemptions" in ev]
    assert hooked, f"{runner.name}: no path calls handle_preemptions"

    def before(ev: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...]) -> bool:
        ia = [i for i, e in enumerate(ev) if e in a]
        ib = [i for i, e in enumerate(ev) if e in b]
        return not ia or not ib or max(ia) < min(ib)

    hook = ("handle_preemptions",)
    full = [
        ev
        for ev in hooked
        if {"bind_connector_metadata", "start_load_kv"} <= set(ev)
        and all(w in ev for w in WRITES)
    ]
    assert full, f"{runner.name}: no path with every write and every hook"
    return Order(
        forward=_collapse(max(full, key=len)),
        hook_first=all(before(ev, hook, WRITES) for ev in hooked),
        writes_first=all(before(ev, WRITES, hook) for ev in hooked),
    )


@pytest.fixture(scope="module", params=["0.32", "0.33"], ids=["vllm032", "vllm033"])
def sources(request) -> SourceTree:
    """The installed sources of this interpreter's vLLM (0.32), or of the 0.33
    environment (skipped, saying how to build it, when absent)."""
    if request.param == "0.32":
        import vllm

        return SourceTree(Path(vllm.__file__).resolve().parents[1])
    request.getfixturevalue("vllm033_python")
    return SourceTree(site_033())


@pytest.mark.parametrize("runner", [V1, V2], ids=["V1", "V2"])
def test_runner_order_is_the_one_written_down(sources, runner):
    """Each runner's step, read from vLLM's source: the order of the writes
    into new blocks and of the connector hooks (the doc's table). A change
    in vLLM fails here first; then re-read it and revisit the tier's guard
    (``HostTierScheduler._written_before_hooks``)."""
    order = read_order(sources, runner)
    assert order.forward == runner.forward, (sources.version(), order.forward)
    # Every path (with a forward pass, without one, early returns) agrees.
    assert order.hook_first != order.writes_first, order
    # Sync loads follow the writes on both runners: a load is not zeroed.
    assert order.forward.index("start_load_kv") > max(
        order.forward.index(w) for w in WRITES
    )


def test_cpu_runner_is_v1s_step(sources):
    """vLLM's CPU runner (the engines of this suite) runs V1's
    ``execute_model`` and ``_update_states`` as they are: it only replaces
    the zeroing itself, which it does on the CPU tensors."""
    cpu = sources.module("vllm.v1.worker.cpu_model_runner")
    (cls,) = [
        n
        for n in cpu.body
        if isinstance(n, ast.ClassDef) and n.name == "CPUModelRunner"
    ]
    assert [ast.unparse(b) for b in cls.bases] == ["GPUModelRunner"]
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "_zero_block_ids" in defined
    assert not defined & {"execute_model", "_update_states"}


# -------------------------------------- the tier's scheduler, V1 and V2

BS = 4  # tokens per block


@pytest.fixture
def vllm_config(request, monkeypatch):
    """A real ``VllmConfig`` whose ``use_v2_model_runner`` says the param's
    runner. CPU vLLM refuses to build a config for V2 (no Triton), so V2 is
    chosen after the config is built, through vLLM's own switch
    (VLLM_USE_V2_MODEL_RUNNER, read on every call once vLLM's env cache is
    off)."""
    import vllm.envs as envs
    from vllm.config import VllmConfig

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    envs.disable_envs_cache()
    config = VllmConfig()
    if request.param == "V2":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert config.use_v2_model_runner == (request.param == "V2")
    return config


def _tier(vllm_config: Any) -> Any:
    from vllm_kvmem.host_tier.config import HostTierConfig
    from vllm_kvmem.host_tier.scheduler import HostTierScheduler

    # One block of background saves per step (slots of 1 byte).
    return HostTierScheduler(
        HostTierConfig(step_bytes=1),
        vllm_config,
        reason="",
        num_slots=64,
        pipeline_slot_bytes=1,
        block_size=BS,
    )


def _running(block_ids: list[int]) -> Any:
    """vLLM's record of one running request given ``block_ids`` this step."""
    from vllm.v1.core.sched.output import CachedRequestData

    return CachedRequestData(
        req_ids=["r"],
        resumed_req_ids=set(),
        new_token_ids=[[]],
        all_token_ids={},
        new_block_ids=[(block_ids,)],
        num_computed_tokens=[0],
        num_output_tokens=[0],
    )


def _assert_reported(stats: Any, skipped: int, vllm_config: Any) -> None:
    """The counter reaches the stats log line and vLLM's /metrics."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_kvmem.host_tier.stats import HostTierPromMetrics

    assert stats.reduce()["spills_skipped_overwritten"] == skipped
    registry = CollectorRegistry()
    types = {
        cls: type(
            cls.__name__,
            (cls,),
            {"__init__": functools.partialmethod(cls.__init__, registry=registry)},
        )
        for cls in (Counter, Gauge, Histogram)
    }
    prom = HostTierPromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(stats.data, 0)
    name = "vllm:kvmem_host_spills_skipped_overwritten_total"
    assert registry.get_sample_value(name, {"engine": "0"}) == skipped


@pytest.mark.parametrize("vllm_config", ["V1", "V2"], indirect=True)
def test_scheduler_sends_the_spills_the_runner_order_leaves_safe(vllm_config, sources):
    """Six cached blocks free in vLLM's real ``BlockPool``, one copied ahead
    (its save still in flight); a request then takes five of them: two are
    zeroed (one the block copied ahead), one is a copy-on-write target. The tier
    sends the late spills the runner's order (read from source) leaves safe:
    all on V1; on V2 none of the overwritten ones, whose keys are not
    indexed, and the in-flight save of an overwritten block is forgotten and
    its slot never loaded from."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import (
        KVCacheBlockCopy,
        make_block_hash_with_group_id,
    )
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_kvmem.host_tier.metadata import HostTierMetadata, LoadChunk
    from vllm_kvmem.host_tier.worker import HostTierWorker

    runner = V2 if vllm_config.use_v2_model_runner else V1
    order = read_order(sources, runner)
    tier = _tier(vllm_config)
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS)
    tier.bind_gpu_block_pool(pool)
    cached = pool.get_new_blocks(6)  # blocks 1..6
    keys = {}
    for i, block in enumerate(cached):
        key = make_block_hash_with_group_id(bytes([i + 1]) * 32, 0)
        block.set_block_hash(key, (i + 1) * BS)
        pool.cached_block_hash_to_block.insert(key, block)
        keys[block.block_id] = key
    pool.free_blocks(reversed(cached))  # evicted last-first: 6, 5, ..., 1
    first = tier.build_connector_meta(SchedulerOutput.make_empty())
    ((ahead, ahead_slot),) = first.ahead_saves  # the walk's one save
    assert ahead == 6

    taken = [b.block_id for b in pool.get_new_blocks(14)]  # evicts 6, 5, 4, 3, 2
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = _running(taken)
    out.new_block_ids_to_zero = [6, 5]
    out.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=1, dst_block_id=4)]
    overwritten = {6, 5, 4}
    with captured_log("vllm.kvmem.host_tier") as records:
        meta = tier.build_connector_meta(out)

    late = {5, 4, 3, 2}  # evicted with no host copy yet (6 was copied ahead)
    safe = late if order.hook_first else late - overwritten
    assert {b for b, _ in meta.evict_saves} == safe
    assert meta.fence == [6]  # its save is still waited for, either way
    assert [b for b, _ in meta.ahead_saves] == [1]  # the walk goes on
    for block_id in late:
        assert (keys[block_id] in tier.index) == (block_id in safe)
    said = [m for m in messages(records) if "V2 model runner" in m]
    if order.hook_first:
        assert tier.runner_writes_first is False
        assert meta.stale_slots == [] and keys[6] in tier.index
        assert len(tier.index) == 6
        assert tier.totals["spills_skipped_overwritten"] == 0 and not said
        return
    assert order.writes_first and tier.runner_writes_first
    # The copy ahead of block 6 may hold its old or its zeroed bytes: it is
    # forgotten, and only the spills sent and the new save ahead are held.
    assert meta.stale_slots == [ahead_slot] and keys[6] not in tier.index
    assert len(tier.index) == len(safe) + 1
    assert tier.totals["spills_skipped_overwritten"] == 3
    assert len(said) == 1 and "handle_preemptions" in said[0]
    _assert_reported(tier.stats(), 3, vllm_config)
    # Said once: block 1, copied ahead in this step and zeroed in the next,
    # is counted only.
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = _running([b.block_id for b in pool.get_new_blocks(1)])
    out.new_block_ids_to_zero = [1]
    with captured_log("vllm.kvmem.host_tier") as records:
        assert tier.build_connector_meta(out).fence == [1]
    assert not [m for m in messages(records) if "V2 model runner" in m]
    assert tier.totals["spills_skipped_overwritten"] == 4

    # A worker told the slot is stale never loads from it: a load already
    # promised from it is reported failed, and vLLM recomputes the block.
    worker = HostTierWorker(None, enabled=True, num_slots=0, verify=False)
    worker._engine = object()  # no copy reaches it: the load is refused first
    stale = HostTierMetadata(seq=meta.seq, stale_slots=meta.stale_slots)
    worker.handle_preemptions(stale)
    worker.start_load_kv(
        HostTierMetadata(loads=[LoadChunk("q", [ahead_slot], [9], True)])
    )
    assert worker.get_block_ids_with_load_errors() == {9}


# ------------------------------------------------ V1 on a real engine (CPU)

BLOCK_BYTES = 1 << 20  # model_8l in float32: one 128-token block over 8 layers


@dataclass
class Spill:
    """One late spill of the engine run, and the block's bytes around it."""

    kind: str  # how the runner overwrites the block in the spill's step
    step: int
    block_id: int
    slot: int
    key: Any
    before: Any  # the block's bytes when vLLM evicted it
    src: int | None = None  # the copy-on-write source
    written: Any = None  # the block's bytes after the runner's writes
    expected: Any = None  # what the write put there (zeros, the source)


@pytest.mark.engine
@pytest.mark.usefixtures("vllm_patched")
def test_v1_late_spill_holds_the_kv_from_before_the_runners_writes(
    model_8l, monkeypatch
):
    """A real in-process engine (the CPU runner: V1's step), late spills on
    (one block of background saves per step, so evictions outrun them).
    Each block spilled late is also named, in vLLM's real SchedulerOutput of
    its step, as a block to zero or as the target of a copy-on-write copy,
    as vLLM does for fresh blocks of models that need zeroing or of partial
    prefix hits (with the tier on, vLLM emits neither today: the tier is off
    where vLLM zeroes, and partial hits need prefix hashes finer than a
    block, which it refuses). V1's runner runs those writes after
    handle_preemptions: the host copy holds the KV from before them, the
    runner did overwrite the block, and a later host hit serves the right
    tokens."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(
        **host_tier_kwargs(
            model_8l, True, enforce_eager=True, kv_host_cache_step_bytes=BLOCK_BYTES
        )
    )
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector  # the scheduler side's
    tier = connector.connector_scheduler
    worker_connector = get_kv_transfer_group()
    copies = worker_connector.connector_worker._engine
    num_blocks = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    assert tier.runner_writes_first is False  # CPU: V1

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    docs = host_tier_workload()["prompts"]
    x = llm.generate([docs[0]], params(1), use_tqdm=False)[0]
    llm.generate([docs[1]], params(2), use_tqdm=False)

    # The step's SchedulerOutput while the tier builds its metadata, and the
    # blocks the step hands out (a copy-on-write source must not be one).
    building: list[Any] = []
    build = connector.build_connector_meta

    def build_meta(scheduler_output: Any) -> Any:
        cached = scheduler_output.scheduled_cached_reqs.new_block_ids
        handed = [r.block_ids for r in scheduler_output.scheduled_new_reqs]
        handed += [ids for ids in cached if ids is not None]
        building[:] = [scheduler_output, {b for ids in handed for g in ids for b in g}]
        return build(scheduler_output)

    monkeypatch.setattr(connector, "build_connector_meta", build_meta)

    spills: list[Spill] = []
    on_evicted = tier._on_evicted

    def evicted(block_id: int, key: Any, covered: int | None) -> None:
        before = copies.block_image(block_id).clone()
        queued = len(tier.spills.evict_saves)
        on_evicted(block_id, key, covered)
        if len(tier.spills.evict_saves) == queued:
            return  # on the host already, or partial: no late spill
        out, handed = building
        spill = Spill(
            ("zero", "copy_on_write")[len(spills) % 2],
            tier._seq,
            block_id,
            tier.spills.evict_saves[-1][1],
            key,
            before,
        )
        if spill.kind == "zero":
            out.new_block_ids_to_zero = [*(out.new_block_ids_to_zero or ()), block_id]
        else:
            # A source with other bytes, not handed out (so not written) in
            # this step.
            spill.src = next(
                b
                for b in range(1, num_blocks)
                if b not in handed and not torch.equal(copies.block_image(b), before)
            )
            out.kv_cache_block_copies = [
                *(out.kv_cache_block_copies or ()),
                KVCacheBlockCopy(src_block_id=spill.src, dst_block_id=block_id),
            ]
        spills.append(spill)

    monkeypatch.setattr(tier, "_on_evicted", evicted)

    # After the runner's writes (V1: _update_states), before the forward.
    bind = worker_connector.bind_connector_metadata

    def bound(meta: Any) -> None:
        for spill in spills:
            if spill.step == meta.seq:
                spill.written = copies.block_image(spill.block_id).clone()
                spill.expected = (
                    torch.zeros_like(spill.before)
                    if spill.src is None
                    else copies.block_image(spill.src).clone()
                )
        bind(meta)

    monkeypatch.setattr(worker_connector, "bind_connector_metadata", bound)

    llm.generate(docs[2:4], params(1), use_tqdm=False)
    assert {s.kind for s in spills} == {"zero", "copy_on_write"}, spills
    for spill in spills:
        assert spill.written is not None, spill
        assert spill.before.any() and spill.expected.any() == (spill.src is not None)
        # The runner did write the block before the forward ...
        assert torch.equal(spill.written, spill.expected), spill
        assert not torch.equal(spill.written, spill.before), spill
        # ... and the host holds what the block held before.
        assert tier.index.slot_of(spill.key) == spill.slot
        assert torch.equal(copies.slot_image(spill.slot), spill.before), spill
    assert tier.totals["spills_skipped_overwritten"] == 0
    assert tier.totals["bytes_saved_at_eviction"] == len(spills) * BLOCK_BYTES

    again = llm.generate([docs[0]], params(1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 7 * 128
    assert again.outputs[0].token_ids == x.outputs[0].token_ids
