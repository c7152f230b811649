"""The device KV cache and the host pool as the block copy engine copies them.

``kv_region`` says where a block's bytes are; this module turns that into the
views the copies read and write, built once per engine: everything in the
widest integer element that divides every byte quantity, one
``[blocks, layers, page]`` view per region, and on block-outer layouts the
regions that continue each other inside a block merged into spans (one byte
run per block), each with its place in a host slot.

Torch only (no vLLM import), like ``copy_engine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvmem.host_tier.host_pool import HostBlockPool
from vllm_kvmem.host_tier.kv_region import KVRegion

# Widest integer element that divides every byte quantity is used for the
# copies: gathers and scatters are element-wise kernels, so copying 8-byte
# words instead of single bytes makes them up to 8x cheaper.
_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


@dataclass(frozen=True)
class _RegionPlan:
    """A region in widened elements, with its byte range in the host slot."""

    base: torch.Tensor  # widened view of the backing allocation
    offset: int  # in elements, relative to ``base``
    num_layers: int
    num_blocks: int
    page: int
    layer_stride: int
    block_stride: int
    host_offset: int  # in elements, inside a host slot

    def layer_view(self) -> torch.Tensor:
        """``[num_blocks, num_layers, page]`` view: dim 0 indexes blocks."""
        return torch.as_strided(
            self.base,
            (self.num_blocks, self.num_layers, self.page),
            (self.block_stride, self.layer_stride, 1),
            self.base.storage_offset() + self.offset,
        )


@dataclass
class _Span:
    """Adjacent block-contiguous regions: one byte run per block."""

    base: torch.Tensor
    offset: int
    block_stride: int
    length: int
    host_offset: int

    def rows(self, first_block: int, count: int) -> torch.Tensor:
        """``[count, length]`` view of ``count`` consecutive blocks."""
        return torch.as_strided(
            self.base,
            (count, self.length),
            (self.block_stride, 1),
            self.base.storage_offset() + self.offset + first_block * self.block_stride,
        )


class BlockViews:
    """The regions and the host pool in one wide element.

    ``pool``: ``[num_slots, slot]`` view of the host pool (``slot`` elements
    of ``dtype`` per slot); ``plans``: one per region, in order, each at its
    offset in a host slot; ``spans``: the merged byte runs of a block-outer
    layout, empty where some region's layers are not adjacent (no direct
    copy is possible)."""

    def __init__(
        self, regions: Sequence[KVRegion], pool: HostBlockPool, num_blocks: int
    ) -> None:
        self.regions = tuple(regions)
        self.num_blocks = num_blocks
        slot_bytes = pool.slot_bytes
        self.elem_bytes, self.dtype = self._pick_element(slot_bytes, pool)
        e = self.elem_bytes
        self.pool = pool.tensor.view(-1).view(self.dtype).view(pool.num_slots, -1)
        self.slot = slot_bytes // e
        self.plans: list[_RegionPlan] = []
        host_offset = 0
        for region in self.regions:
            wide = self._widen(region.base)
            self.plans.append(
                _RegionPlan(
                    base=wide,
                    offset=region.offset // e,
                    num_layers=region.num_layers,
                    num_blocks=region.num_blocks,  # type: ignore[arg-type]
                    page=region.page_bytes // e,
                    layer_stride=region.layer_stride // e,
                    block_stride=region.block_stride // e,
                    host_offset=host_offset // e,
                )
            )
            host_offset += region.block_bytes
        direct_ok = all(r.layers_adjacent for r in self.regions)
        self.spans = self._build_spans() if direct_ok else []

    def _pick_element(
        self, slot_bytes: int, pool: HostBlockPool
    ) -> tuple[int, torch.dtype]:
        quantities = [slot_bytes, pool.tensor.storage_offset()]
        for r in self.regions:
            quantities += [
                r.offset,
                r.page_bytes,
                r.layer_stride,
                r.block_stride,
                r.base.storage_offset(),
            ]
        for size, dtype in _WIDE_DTYPES:
            if all(q % size == 0 for q in quantities):
                return size, dtype
        raise AssertionError("unreachable: every quantity is a multiple of 1")

    def _widen(self, base: torch.Tensor) -> torch.Tensor:
        e = self.elem_bytes
        return base[: base.numel() // e * e].view(self.dtype)

    def _build_spans(self) -> list[_Span]:
        """Merge regions that continue each other inside a block.

        vLLM's block-outer packing puts the KVCacheTensors of a group side by
        side inside every block, so they usually merge into one span: one
        copy per block even with several page sizes.
        """
        spans: list[_Span] = []
        prev: KVRegion | None = None
        for region, plan in zip(self.regions, self.plans):
            length = plan.num_layers * plan.page
            last = spans[-1] if spans else None
            if (
                last is not None
                and prev is not None
                and prev.base.data_ptr() == region.base.data_ptr()
                and prev.base.numel() == region.base.numel()
                and last.block_stride == plan.block_stride
                and last.offset + last.length == plan.offset
                and last.host_offset + last.length == plan.host_offset
            ):
                last.length += length
            else:
                spans.append(
                    _Span(
                        base=plan.base,
                        offset=plan.offset,
                        block_stride=plan.block_stride,
                        length=length,
                        host_offset=plan.host_offset,
                    )
                )
            prev = region
        return spans

    def gather_views(self) -> list[tuple[torch.Tensor, int, tuple[int, ...]]]:
        """``(device view, host offset, row shape)`` per gather: dim 0 of the
        view indexes blocks, a row lands at ``host offset`` in a host slot.

        Block-outer layouts gather their merged spans (one kernel per span,
        usually one in all); others one ``[blocks, layers, page]`` view per
        region."""
        if self.spans:
            return [
                (
                    torch.as_strided(
                        span.base,
                        (self.num_blocks, span.length),
                        (span.block_stride, 1),
                        span.base.storage_offset() + span.offset,
                    ),
                    span.host_offset,
                    (span.length,),
                )
                for span in self.spans
            ]
        return [
            (plan.layer_view(), plan.host_offset, (plan.num_layers, plan.page))
            for plan in self.plans
        ]

    def layer_units(self) -> list[tuple[int, torch.Tensor, int, int]]:
        """``(start byte, device view, host offset, page)`` per layer of every
        region, in region then layer order: the device view is
        ``[num_blocks, page]`` (dim 0 indexes blocks), the layer's page of a
        host slot starts at ``host offset``. A load copied unit by unit can
        tell each attention layer when its own KV is in place; ``start
        byte`` (the page of block 0 in the backing allocation, as vLLM's
        ``KVCacheTensor`` places it) names the layer."""
        e = self.elem_bytes
        return [
            (
                (plan.offset + layer * plan.layer_stride) * e,
                plan.layer_view()[:, layer],
                plan.host_offset + layer * plan.page,
                plan.page,
            )
            for plan in self.plans
            for layer in range(plan.num_layers)
        ]

    def block_image(self, block_id: int) -> torch.Tensor:
        """A host copy of device block ``block_id`` laid out like a host slot
        (synchronous; ``block_id`` already checked)."""
        parts = [
            plan.layer_view()[block_id].reshape(-1).to("cpu") for plan in self.plans
        ]
        return torch.cat(parts).view(torch.uint8)

    def release_pool(self) -> None:
        """Drop the view of the host pool, or it would keep the bytes alive."""
        self.pool = torch.empty((0, self.slot), dtype=self.dtype)
