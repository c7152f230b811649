"""Where each block's bytes live in vLLM's backing KV allocation.

vLLM 0.32 keeps the whole KV cache of a worker in ONE backing allocation and
describes where each layer's pages live with ``KVCacheTensor`` records: the
page of layer ``l`` for block ``b`` starts at
``offset + l * layer_stride + b * block_stride`` bytes into the allocation.
``KVRegion`` restates that arithmetic without importing vLLM, checks it, and
tells the copy engine and the host pool how many bytes one block takes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _as_byte_tensor(base: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor of any dtype as a flat uint8 tensor."""
    if not base.is_contiguous():
        raise ValueError(
            "the backing KV allocation must be a contiguous tensor; got one with "
            f"shape {tuple(base.shape)} and strides {tuple(base.stride())}"
        )
    flat = base.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass(frozen=True, eq=False)
class KVRegion:
    """Byte-level placement of one ``KVCacheTensor`` in its backing allocation.

    Layer ``l``'s page of block ``b`` is the ``page_bytes`` bytes starting at
    ``offset + l * layer_stride + b * block_stride`` in ``base``. This is the
    same arithmetic as vLLM's ``KVCacheTensor`` (see its docstring in
    ``vllm/v1/kv_cache_interface.py``), restated here so that the core does not
    depend on vLLM.

    ``base`` is normalised to a flat uint8 view of the backing allocation
    (vLLM allocates it as int8). ``num_blocks`` defaults to as many blocks as
    fit in ``base``.
    """

    base: torch.Tensor
    offset: int
    num_layers: int
    page_bytes: int
    layer_stride: int
    block_stride: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        base = _as_byte_tensor(self.base)
        object.__setattr__(self, "base", base)
        minimums = {
            "offset": 0,
            "num_layers": 1,
            "page_bytes": 1,
            "layer_stride": 0,
            "block_stride": 0,
            "num_blocks": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is None and name == "num_blocks":
                continue
            try:
                value = operator.index(value)
            except TypeError:
                raise ValueError(
                    f"KVRegion.{name} must be an integer: {value!r}"
                ) from None
            if value < minimum:
                raise ValueError(f"KVRegion.{name} must be >= {minimum}: {value}")
            object.__setattr__(self, name, value)
        if self.num_layers > 1 and self.layer_stride == 0:
            raise ValueError("KVRegion.layer_stride is 0 but there are several layers")
        last_layer_end = (
            self.offset + (self.num_layers - 1) * self.layer_stride + self.page_bytes
        )
        if self.num_blocks is None:
            if last_layer_end > base.numel():
                raise ValueError(
                    f"KVRegion does not fit its {base.numel()}-byte backing "
                    f"allocation even for one block (needs {last_layer_end} bytes)"
                )
            room = base.numel() - last_layer_end
            num_blocks = room // self.block_stride + 1 if self.block_stride else 1
            object.__setattr__(self, "num_blocks", num_blocks)
        if self.num_blocks > 1 and self.block_stride == 0:
            raise ValueError("KVRegion.block_stride is 0 but there are several blocks")
        end = last_layer_end + (self.num_blocks - 1) * self.block_stride
        if end > base.numel():
            raise ValueError(
                f"KVRegion runs past its backing allocation: the last page ends at "
                f"byte {end} but the allocation has {base.numel()} bytes "
                f"(offset={self.offset}, num_layers={self.num_layers}, "
                f"num_blocks={self.num_blocks}, layer_stride={self.layer_stride}, "
                f"block_stride={self.block_stride}, page_bytes={self.page_bytes})"
            )
        # Pages must not overlap, or a load of one block would clobber another.
        if self.num_layers > 1 and self.num_blocks > 1:
            (inner, n_inner), (outer, _) = sorted(
                [
                    (self.layer_stride, self.num_layers),
                    (self.block_stride, self.num_blocks),
                ]
            )
            if inner < self.page_bytes or outer < n_inner * inner:
                raise ValueError(
                    f"KVRegion pages overlap: page_bytes={self.page_bytes}, "
                    f"layer_stride={self.layer_stride} x {self.num_layers} layers, "
                    f"block_stride={self.block_stride} x {self.num_blocks} blocks"
                )
        elif self.num_layers > 1 and self.layer_stride < self.page_bytes:
            raise ValueError(
                f"KVRegion layer pages overlap: layer_stride={self.layer_stride} < "
                f"page_bytes={self.page_bytes}"
            )
        elif self.num_blocks > 1 and self.block_stride < self.page_bytes:
            raise ValueError(
                f"KVRegion block pages overlap: block_stride={self.block_stride} < "
                f"page_bytes={self.page_bytes}"
            )

    # -- constructors -------------------------------------------------------

    @classmethod
    def from_kv_cache_tensor(
        cls,
        base: torch.Tensor,
        kv_cache_tensor: Any,
        page_bytes: int,
        num_blocks: int | None = None,
    ) -> KVRegion:
        """Build from a vLLM ``KVCacheTensor`` (duck-typed, so no vLLM import).

        ``page_bytes`` is the layer spec's ``page_size_bytes``; ``num_blocks``
        is ``KVCacheConfig.num_blocks``.
        """
        return cls(
            base=base,
            offset=int(kv_cache_tensor.offset),
            num_layers=len(kv_cache_tensor.layers),
            page_bytes=int(page_bytes),
            layer_stride=int(kv_cache_tensor.layer_stride),
            block_stride=int(kv_cache_tensor.block_stride),
            num_blocks=num_blocks,
        )

    @classmethod
    def from_views(
        cls, views: Sequence[torch.Tensor], num_blocks: int | None = None
    ) -> KVRegion:
        """Derive the byte geometry from per-layer cache views over one storage.

        ``views[l]`` is layer ``l``'s cache with the block as dim 0, as
        ``allocate_kv_cache`` hands it to the attention layers (any dtype,
        any order of the dims inside a page). The page of a block must be one
        dense run of bytes, every view must have the same shape, dtype and
        strides, and consecutive layers must start the same number of bytes
        apart. With kernel block splitting, dim 0 counts kernel blocks; pass
        ``num_blocks`` (manager blocks) to fold them back into manager blocks.
        """
        if not views:
            raise ValueError("KVRegion.from_views needs at least one layer view")
        first = views[0]
        storage = first.untyped_storage()
        for i, view in enumerate(views):
            if view.untyped_storage().data_ptr() != storage.data_ptr():
                raise ValueError(
                    f"layer view {i} does not share the backing storage of view 0"
                )
            if (
                view.shape != first.shape
                or view.stride() != first.stride()
                or view.dtype != first.dtype
            ):
                raise ValueError(
                    f"layer view {i} is not shaped like view 0: shape "
                    f"{tuple(view.shape)} strides {view.stride()} {view.dtype} vs "
                    f"{tuple(first.shape)} {first.stride()} {first.dtype}"
                )
        if first.dim() < 1:
            raise ValueError("layer views need a block dimension (dim 0)")
        itemsize = first.element_size()
        page_elems, dense = _dense_extent(first.shape[1:], first.stride()[1:])
        if not dense:
            raise ValueError(
                "the page of one block is not one contiguous run of bytes (shape "
                f"{tuple(first.shape)}, strides {first.stride()}): only layouts whose "
                "pages are block-compact (LBHNC, LBNHC, BLHNC, BLNHC) can be copied "
                "block by block"
            )
        page_bytes = page_elems * itemsize
        block_stride = first.stride(0) * itemsize
        rows = first.shape[0]
        if num_blocks is not None and rows != num_blocks:
            if num_blocks <= 0 or rows % num_blocks:
                raise ValueError(
                    f"views have {rows} rows in dim 0, which is not a multiple of "
                    f"num_blocks={num_blocks}"
                )
            ratio = rows // num_blocks
            if block_stride != page_bytes:
                raise ValueError(
                    f"views split each block into {ratio} kernel blocks that are not "
                    f"adjacent (kernel block stride {block_stride} != kernel page "
                    f"{page_bytes} bytes)"
                )
            page_bytes *= ratio
            block_stride *= ratio
            rows = num_blocks
        offset = first.data_ptr() - storage.data_ptr()
        layer_stride = page_bytes
        if len(views) > 1:
            layer_stride = views[1].data_ptr() - first.data_ptr()
            if layer_stride <= 0:
                raise ValueError(
                    "layer views must be in increasing address order; view 1 starts "
                    f"{layer_stride} bytes after view 0"
                )
            for i in range(2, len(views)):
                step = views[i].data_ptr() - views[i - 1].data_ptr()
                if step != layer_stride:
                    raise ValueError(
                        f"layer views are not equally strided: view {i} starts {step} "
                        f"bytes after view {i - 1}, expected {layer_stride}"
                    )
        base = torch.empty(0, dtype=torch.uint8, device=first.device)
        base.set_(storage, 0, (storage.nbytes(),), (1,))
        return cls(
            base=base,
            offset=offset,
            num_layers=len(views),
            page_bytes=page_bytes,
            layer_stride=layer_stride,
            block_stride=block_stride,
            num_blocks=rows,
        )

    # -- derived geometry ---------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers of this region (its host share)."""
        return self.num_layers * self.page_bytes

    @property
    def layers_adjacent(self) -> bool:
        """True when the layers of a block form one contiguous byte run."""
        return self.num_layers == 1 or self.layer_stride == self.page_bytes


def _dense_extent(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, bool]:
    """Number of elements of a sub-tensor and whether they are one dense run."""
    dims = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    count = 1
    for stride, size in dims:
        if stride != count:
            return _prod(shape), False
        count *= size
    return count, True


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def host_slot_bytes(regions: Sequence[KVRegion]) -> int:
    """Bytes of one host slot: every layer of one block over all regions."""
    return sum(r.block_bytes for r in regions)


@dataclass(frozen=True)
class PageGeometry:
    """A ``KVCacheTensor``'s byte geometry without its tensor (the engine core
    sizes the host tier from the KV cache configs before any worker has
    allocated), with :class:`KVRegion`'s field names."""

    offset: int
    num_layers: int
    page_bytes: int
    layer_stride: int
    block_stride: int

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.page_bytes


def _page_starts(region: Any) -> set[int]:
    """Where block 0's page of each layer of ``region`` starts."""
    return {region.offset + i * region.layer_stride for i in range(region.num_layers)}


def _covers(outer: Any, inner: Any) -> bool:
    """Every page of ``inner`` is one of ``outer``'s, for every block."""
    return (
        inner.page_bytes == outer.page_bytes
        and inner.block_stride == outer.block_stride
        and _page_starts(inner) <= _page_starts(outer)
    )


def distinct_regions(regions: Sequence[Any]) -> list[Any]:
    """The regions that hold one block's bytes, each byte once.

    vLLM's hybrid KV cache manager overlays its KV cache groups: each group's
    ``KVCacheTensor`` starts at byte 0 of the same allocation (``Groups alias
    from byte 0``, ``get_kv_cache_config_from_groups``), which is sound because
    a block id belongs to one group at a time. A block's bytes are therefore
    the union of the groups' pages for that block id: a region whose pages are
    all another region's (an overlaid group with as many or fewer layers) is
    dropped, so a copy moves each byte once and a host slot holds the block
    whichever group owns it. Works on :class:`KVRegion` and
    :class:`PageGeometry` alike, keeping their order. Raises ``ValueError``
    when what is left still overlaps (a partial overlay no block copy can
    follow).
    """
    order = sorted(range(len(regions)), key=lambda i: -regions[i].num_layers)
    kept: list[int] = []
    for i in order:
        if not any(_covers(regions[k], regions[i]) for k in kept):
            kept.append(i)
    out = [regions[i] for i in sorted(kept)]
    # Pages of blocks 0 and 1 of different regions must not share a byte.
    spans = []
    for n, region in enumerate(out):
        for block in (0, 1):
            for start in _page_starts(region):
                begin = start + block * region.block_stride
                spans.append((begin, begin + region.page_bytes, n))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end and a != b:
            raise ValueError(
                "KV cache tensors overlap only in part (neither holds all of the "
                "other's pages), so a block cannot be copied region by region"
            )
    return out


def layer_page_bytes(kv_cache_config: Any) -> dict[str, int]:
    """Each layer's page size in a vLLM ``KVCacheConfig``, as its KV cache
    group holds it (one spec for the group, or one per layer in a
    ``UniformTypeKVCacheSpecs``); read by attribute, so vLLM is not imported."""
    out: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            out[name] = int((per_layer[name] if per_layer else spec).page_size_bytes)
    return out


def page_geometries(kv_cache_config: Any) -> list[PageGeometry]:
    """The byte geometry of every ``KVCacheTensor`` of a ``KVCacheConfig``."""
    pages = layer_page_bytes(kv_cache_config)
    return [
        PageGeometry(
            offset=int(t.offset),
            num_layers=len(t.layers),
            page_bytes=pages[t.layers[0]],
            layer_stride=int(t.layer_stride),
            block_stride=int(t.block_stride),
        )
        for t in kv_cache_config.kv_cache_tensors
    ]


def config_slot_bytes(kv_cache_config: Any) -> int:
    """Host bytes of one block on a worker: every layer's page of it, each
    byte once (hybrid models overlay their KV cache groups, see
    :func:`distinct_regions`)."""
    return sum(
        r.block_bytes for r in distinct_regions(page_geometries(kv_cache_config))
    )
