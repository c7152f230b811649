"""The KV arithmetic of one model under one setup, as the report shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvmem.planner import kv_math as km
from vllm_kvmem.planner.model import ModelInfo
from vllm_kvmem.planner.setup import Setup


@dataclass(frozen=True)
class KindRow:
    """KV cost of one layer kind on one TP rank."""

    kind: str
    num_layers: int
    kv_heads_per_rank: int
    head_size: int
    head_size_v: int
    sliding_window: int | None
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_request: int


@dataclass(frozen=True)
class StageRow:
    """One pipeline stage's KV cost (each TP rank of it)."""

    stage: int
    start: int
    end: int
    num_layers: int
    kv_bytes_per_token: int
    bytes_per_block: int


class KVCosts:
    """What one model's KV cache costs under one setup, shared by every report
    section: layer specs, cache groups, blocks per request, bytes per block
    and per token of each stage."""

    def __init__(self, model: ModelInfo, setup: Setup) -> None:
        self.model, self.setup = model, setup
        self.layers = model.layers(setup.kv_cache_dtype)
        self.groups = km.kv_cache_groups(self.layers, hybrid=setup.hybrid)
        self.in_flight = km.max_in_flight_tokens(
            setup.max_num_batched_tokens, setup.max_concurrent_batches
        )
        self.bpr = km.request_blocks(
            self.groups,
            block_size=setup.block_size,
            max_model_len=setup.max_model_len,
            max_in_flight_tokens=self.in_flight,
        )
        self.bytes_per_block = km.bytes_per_block_fn(
            self.groups, model.num_layers, block_size=setup.block_size, tp=setup.tp
        )
        self.ranges = km.stage_ranges(setup.partition)
        self.bpb = [self.bytes_per_block(a, b) for a, b in self.ranges]
        self.bpt = [
            km.stage_bytes_per_token(self.layers, a, b, setup.tp)
            for a, b in self.ranges
        ]
        self._stages: dict[str, Any] = dict(
            blocks_per_request=self.bpr,
            max_model_len=setup.max_model_len,
            block_size=setup.block_size,
            ranges=self.ranges,
            bytes_per_token=self.bpt,
        )

    def capacity(self, budget_bytes: int, proportional: bool) -> km.Capacity:
        """What ``--kv-cache-memory-bytes budget_bytes`` gives every stage."""
        return km.capacity_for_budget(
            self.bpb,
            budget_bytes=budget_bytes,
            proportional=proportional,
            **self._stages,
        )

    def token_capacity(self, tokens: int) -> km.Capacity:
        """What ``--kv-cache-tokens tokens`` gives every stage."""
        return km.capacity_for_tokens(self.bpb, tokens=tokens, **self._stages)

    def kind_rows(self) -> list[KindRow]:
        rows: dict[km.LayerKV, int] = {}
        for spec in self.layers:
            rows[spec] = rows.get(spec, 0) + 1
        # How each layer is sized (sliding as full with the hybrid manager off).
        sized = {i: g.spec for g in self.groups for i in g.layers}
        first = {spec: self.layers.index(spec) for spec in rows}
        s = self.setup
        return [
            KindRow(
                kind=spec.kind.value,
                num_layers=count,
                kv_heads_per_rank=spec.kv_heads_per_rank(s.tp),
                head_size=spec.head_size,
                head_size_v=spec.head_size_v,
                sliding_window=spec.sliding_window,
                bytes_per_token=spec.bytes_per_token(s.tp),
                bytes_per_block=spec.page_bytes(s.block_size, s.tp),
                blocks_per_request=sized[first[spec]].blocks_per_request(
                    block_size=s.block_size,
                    max_model_len=s.max_model_len,
                    max_in_flight_tokens=self.in_flight,
                ),
            )
            for spec, count in rows.items()
        ]

    def stage_rows(self) -> list[StageRow]:
        return [
            StageRow(i, a, b, b - a, t, p)
            for i, ((a, b), t, p) in enumerate(zip(self.ranges, self.bpt, self.bpb))
        ]
