"""What the transfer benchmark measures: model shapes, KV layouts and the
copy engine's strategy for each, block patterns, directions, and the record
of one measured case.

Shared by the run (``transfer_bench.py``) and its figures
(``_transfer_report.py``); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    def page_bytes(self, block_size: int) -> int:
        """One layer's page of one block: K and V for every head and token."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes * block_size


SHAPES = (
    Shape("8b", num_layers=32, num_kv_heads=8, head_dim=128),
    Shape("small", num_layers=8, num_kv_heads=2, head_dim=64),
)
BLOCK_SIZES = (16, 32, 64, 128, 256)
LAYOUTS = (
    "contiguous",
    "contiguous_gather",
    "contiguous_auto",
    "per_layer",
    "per_layer_naive",
)
#: The engine's strategy per layout (``per_layer_naive`` uses no engine).
STRATEGIES = {
    "contiguous": "direct",
    "contiguous_gather": "gather",
    "contiguous_auto": "auto",
    "per_layer": "auto",  # layer-outer: gather
}
#: Targets within this fraction count as equal: on the H200 the same gather
#: on the two layouts (``contiguous_gather``, ``per_layer``) differed by up
#: to 6% (one outlier aside), so "at least as fast" cannot mean >= 1.0.
SAME_SPEED = 0.95
AUTO_UNVERIFIED = (
    "contiguous_auto: the speed of the auto choice on a GPU is unverified "
    "until the next GPU run (the rule comes from the H200 run of 2026-11-26)"
)
PATTERNS = ("scattered", "consecutive")
DIRECTIONS = ("d2h", "h2d")


@dataclass
class Result:
    shape: str
    block_size: int
    layout: str
    pattern: str
    direction: str
    num_blocks: int
    bytes: int
    seconds: float
    gbps: float
    num_ops: int
    page_bytes: int
    block_bytes: int
    strategy: str = ""  # the path the engine took (``naive`` for the baseline)
