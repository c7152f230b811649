"""The host tier's KV events on a real engine, as a KV-aware router sees them.

``python tests/host_tier_events_engine.py '{LLM kwargs}' '{workload}'`` runs
an engine whose scheduler lives in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; workers may be processes, as at
TP=2), with vLLM's KV events on, and replays every batch vLLM publishes into
an index of the device and host tiers keyed by token content, as llm-d's
indexer and Dynamo's router key theirs. It checks, and prints as one
``KVMEM_REPORT {json}`` line:

- before each request is sent, the index's prediction of its cached tokens
  (the device's prefix, then the host's run from there: vLLM asks the
  connector only past its own hit) against what vLLM reports;
- after each step, the host blocks the events announce against the blocks
  the tier's index holds;
- each host ``BlockStored`` against the device's event for that block (the
  same tokens and parent), and no block stored twice on a tier without a
  removal between.

Beside them, each worker's own facts (``LLM.collective_rpc``; callables are
allowed by ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, the demo's engine
environment): its KV cache (``vllm_kvmem.demo_engine.rank_kv_report``), its
tensor-parallel rank, and its host pool with the blocks it copied.

Run by tests/test_host_tier_events.py with either release's Python.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

REPORT_PREFIX = "KVMEM_REPORT "
MEDIA = ("GPU", "CPU")


class RouterIndex:
    """Blocks per tier, keyed by their token content."""

    def __init__(self) -> None:
        self.content: dict[tuple[Any, Any], Any] = {}  # (hash, group) -> key
        self.tiers: dict[str, set[Any]] = {m: set() for m in MEDIA}
        self.events: dict[str, int] = {}
        self.violations: list[str] = []

    def apply(self, event: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

        medium = getattr(event, "medium", None) or "GPU"
        name = f"{type(event).__name__}:{medium}"
        if isinstance(event, AllBlocksCleared):
            name = "AllBlocksCleared"
            for tier in self.tiers.values():
                tier.clear()
        self.events[name] = self.events.get(name, 0) + 1
        if isinstance(event, AllBlocksCleared):
            return
        tier = self.tiers[medium]
        for i, block_hash in enumerate(event.block_hashes):
            at = (block_hash, event.group_idx)
            if not isinstance(event, BlockStored):
                tier.discard(self.content.get(at))
                continue
            if not event.token_ids:
                self.violations.append(f"{name} {block_hash}: no token ids")
                continue
            size = event.block_size
            parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            key = (self.content.get((parent, event.group_idx)), tokens)
            if medium == "CPU" and self.content.get(at) != key:
                self.violations.append(
                    f"{name} {block_hash}: tokens or parent differ from the "
                    "device's event"
                )
            if key in tier:
                self.violations.append(f"{name} {block_hash}: stored twice")
            self.content[at] = key
            tier.add(key)

    def predict(self, token_ids: list[int], block_size: int) -> tuple[int, int]:
        """Blocks cached on the device, then on the host from there."""
        usable = (len(token_ids) - 1) // block_size
        keys, parent = [], None
        for i in range(usable):
            parent = (parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
            keys.append(parent)
        device = 0
        while device < usable and keys[device] in self.tiers["GPU"]:
            device += 1
        host = device
        while host < usable and keys[host] in self.tiers["CPU"]:
            host += 1
        return device, host - device


def count_copies(worker: Any) -> bool:
    """In a worker: count the blocks its host tier copies from now on (its
    copy engine's saves and loads); False where it holds no host pool."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return False
    engine = getattr(get_kv_transfer_group().connector_worker, "_engine", None)
    if engine is None:
        return False
    counts = {"saved": 0, "loaded": 0}
    save, load = engine.save, engine.load

    def counted_save(blocks, slots, after=()):
        counts["saved"] += len(blocks)
        return save(blocks, slots, after)

    def counted_load(slots, blocks, after=()):
        counts["loaded"] += len(blocks)
        return load(slots, blocks, after)

    engine.save, engine.load = counted_save, counted_load
    engine.kvmem_test_counts = counts
    return True


def rank_facts(worker: Any) -> dict[str, Any]:
    """In a worker: its KV cache, its TP rank, its host pool and copies."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    from vllm_kvmem.demo_engine import rank_kv_report

    facts = rank_kv_report(worker)
    facts["tp_rank"] = get_tp_group().rank_in_group
    tier = get_kv_transfer_group().connector_worker if has_kv_transfer_group() else None
    engine = getattr(tier, "_engine", None)
    facts["host_pool"] = (
        None
        if engine is None
        else {
            "num_slots": tier.num_slots,
            "slot_bytes": engine.pool.slot_bytes,
            "nbytes": engine.pool.nbytes,
            **getattr(engine, "kvmem_test_counts", {}),
        }
    )
    return facts


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        maybe_convert_block_hash,
    )

    load_general_plugins()
    kwargs, workload = json.loads(argv[0]), json.loads(argv[1])
    kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    connector = sched.connector
    tier = connector.connector_scheduler if connector is not None else None
    index = RouterIndex()
    steps = {"checked": 0, "host_set_mismatches": 0}

    def host_blocks() -> set[Any]:
        return {
            index.content.get(
                (maybe_convert_block_hash(get_block_hash(k)), get_group_id(k))
            )
            for k in tier.index._slots
        }

    publish = sched.kv_event_publisher.publish

    def replay(batch: Any) -> None:
        for event in batch.events:
            index.apply(event)
        if tier is not None:
            steps["checked"] += 1
            if host_blocks() != index.tiers["CPU"]:
                steps["host_set_mismatches"] += 1
        publish(batch)

    sched.kv_event_publisher.publish = replay
    llm.collective_rpc(count_copies)
    block_size = sched.block_size
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=workload.get("max_tokens", 2), temperature=0)
    requests = []
    reset = False
    for round_ in workload["rounds"]:
        if round_ == "reset":
            assert llm.reset_prefix_cache(reset_connector=True)
            reset = True
            continue
        for prompt in round_:
            ids = tokenizer(prompt).input_ids
            device, host = index.predict(ids, block_size)
            (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            requests.append(
                {
                    "predicted": (device + host) * block_size,
                    "predicted_host": host * block_size,
                    "cached": out.num_cached_tokens or 0,
                    "token_ids": list(out.outputs[0].token_ids),
                    # vLLM publishes a reset's events with the next step:
                    # the router learns of it with this request's first.
                    "after_reset": reset,
                }
            )
            reset = False
    report = {
        "requests": requests,
        "mismatches": sum(
            r["predicted"] != r["cached"] for r in requests if not r["after_reset"]
        ),
        "host_hit_tokens": sum(r["predicted_host"] for r in requests),
        "events": index.events,
        "violations": index.violations[:20],
        "steps": steps,
        "without_tokens": tier.events.without_tokens if tier is not None else 0,
        "block_size": block_size,
        "ranks": sorted(llm.collective_rpc(rank_facts), key=lambda r: r["rank"]),
        "host_slots": tier.num_slots if tier is not None else 0,
    }
    print(REPORT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
