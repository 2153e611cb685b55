"""Layouts: the ordered list of a shard's tensors, as every holder of a shard index declares it.

A :class:`Layout` is what the reference table compares (all holders of one (model, shard_idx)
must declare equal layouts, else :class:`~tensorhub.errors.LayoutMismatch`) and what fixes the
checksum units: one 64-bit checksum per tensor, or one per ``chunk_bytes`` chunk for tensors
larger than a chunk.

The packing plan
----------------
:func:`plan_of` derives, from the layout alone, how the shard's bytes are laid out for transfer
(so two equal layouts always pack identically, whatever devices their tensors live on):

- Tensors smaller than ``pack_threshold`` are *tiny*. They are laid end to end, in layout order,
  into packs of at most :data:`PACK_MAX` bytes. Every other tensor is *large* and is a region of
  its own, used in place. (Whether a pack is a buffer the tiny tensors are copied into, or stays
  a list of the tensors themselves, is each process's choice: :class:`tensorhub.transports.buffers.ShardBuffers`.
  The transfer space is the same either way.)
- The **transfer byte space** is the packs, then the large tensors in layout order. Transports
  move ranges of this space; only its regions are registered with one-sided transports, so
  registrations and transfer operations stay near the number of large tensors (a 36B model's
  ~500 tensors, half of them tiny, become ~250 regions plus one pack).
- **Checksum units** keep their layout order (the order of the declared checksums: tensor by
  tensor, chunk by chunk); :attr:`Plan.units` says where each lies in the transfer space. A unit
  never straddles two regions.
- :meth:`Plan.reads` groups consecutive units into reads of about ``read_bytes``: a read is
  whole units, so the reader verifies a read as soon as it lands.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from .wire import struct

__all__ = ["DTYPE_SIZES", "MAX_TENSORS", "PACK_MAX", "Layout", "Plan", "Read", "Region", "TensorSpec", "Unit", "plan_of"]

MAX_TENSORS = 1 << 16
MAX_DIMS = 16
#: The largest pack buffer; the tiny tensors of one shard rarely fill one.
PACK_MAX = 256 << 20

#: Element sizes of the dtypes a layout may name (torch's names without the ``torch.`` prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


@struct
class TensorSpec:
    """One tensor of a shard: its name, dtype, shape and size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 1024:
            raise ValueError(f"tensor name must have 1 to 1024 characters, got {len(self.name)}")
        size = DTYPE_SIZES.get(self.dtype)
        if size is None:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        if len(self.shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {self.shape!r}")
        expect = math.prod(self.shape) * size
        if self.nbytes != expect:
            raise ValueError(f"tensor {self.name!r}: nbytes {self.nbytes} != {expect} for {self.dtype}{list(self.shape)}")


@struct
class Layout:
    """A shard's tensors in transfer order, plus the parameters that fix packing and checksums.

    Attributes:
        tensors: the tensors, in layout (transfer) order; names unique.
        checksum: the checksum algorithm's name (e.g. ``"xxh3-64"``).
        chunk_bytes: checksum unit for large tensors (one checksum per chunk).
        pack_threshold: tensors smaller than this are packed together.
    """

    tensors: tuple[TensorSpec, ...]
    checksum: str
    chunk_bytes: int
    pack_threshold: int

    def __post_init__(self) -> None:
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"a layout holds at most {MAX_TENSORS} tensors, got {len(self.tensors)}")
        names = {t.name for t in self.tensors}
        if len(names) != len(self.tensors):
            raise ValueError("tensor names in a layout must be unique")
        if not 1 <= len(self.checksum) <= 32:
            raise ValueError(f"bad checksum algorithm name {self.checksum!r}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if self.pack_threshold < 0:
            raise ValueError(f"pack_threshold must be >= 0, got {self.pack_threshold}")

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def checksum_count(self) -> int:
        """How many 64-bit checksums a holder of this layout declares."""
        return sum(max(1, -(-t.nbytes // self.chunk_bytes)) for t in self.tensors)


@dataclass(frozen=True, slots=True)
class Region:
    """One registered, transferred buffer: a pack of tiny tensors, or one large tensor.

    Attributes:
        offset: where it starts in the transfer byte space.
        nbytes: its size.
        tensor: the layout index of the large tensor it is, or None for a pack.
        members: for a pack, ``(tensor index, byte offset in the pack)`` of each tiny tensor.
    """

    offset: int
    nbytes: int
    tensor: int | None
    members: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Unit:
    """One checksum unit: ``length`` bytes of tensor ``tensor`` from its byte ``start``, at
    ``offset`` in the transfer space, inside region ``region``. ``index`` is its position in the
    declared checksums."""

    index: int
    tensor: int
    start: int
    offset: int
    length: int
    region: int


@dataclass(frozen=True, slots=True)
class Read:
    """Transfer bytes ``[offset, offset + length)``: checksum units ``units`` (in transfer order)."""

    offset: int
    length: int
    units: tuple[int, ...]


class Plan:
    """How one layout's bytes are packed and moved. Build it with :func:`plan_of` (cached).

    Attributes:
        regions: the packs, then the large tensors, in transfer order (zero-byte tensors
            have no region).
        units: the checksum units, in layout (declared-checksum) order.
        tensor_offset: each tensor's offset in the transfer space, by layout index.
        total_bytes: size of the transfer space (the sum of the tensors' sizes).
    """

    __slots__ = ("_reads", "layout", "regions", "tensor_offset", "total_bytes", "units")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        tiny = [i for i, t in enumerate(layout.tensors) if t.nbytes < layout.pack_threshold]
        large = [i for i, t in enumerate(layout.tensors) if t.nbytes >= layout.pack_threshold]
        regions: list[Region] = []
        offsets = [0] * len(layout.tensors)
        pos = 0
        members: list[tuple[int, int]] = []
        fill = 0
        for i in tiny:
            n = layout.tensors[i].nbytes
            if fill + n > PACK_MAX and fill:
                regions.append(Region(pos, fill, None, tuple(members)))
                pos += fill
                members, fill = [], 0
            members.append((i, fill))
            offsets[i] = pos + fill
            fill += n
        if fill:  # a pack of nothing but empty tensors is no region
            regions.append(Region(pos, fill, None, tuple(members)))
            pos += fill
        for i in large:
            n = layout.tensors[i].nbytes
            offsets[i] = pos
            if n:
                regions.append(Region(pos, n, i))
            pos += n
        self.regions = tuple(regions)
        self.tensor_offset = tuple(offsets)
        self.total_bytes = pos
        starts = [r.offset for r in regions]
        units: list[Unit] = []
        chunk = layout.chunk_bytes
        for i, t in enumerate(layout.tensors):
            base = offsets[i]
            region = _region_at(starts, regions, base, t.nbytes)
            for start in range(0, max(t.nbytes, 1), chunk):
                units.append(Unit(len(units), i, start, base + start, min(chunk, t.nbytes - start), region))
        self.units = tuple(units)
        self._reads: dict[int, tuple[Read, ...]] = {}

    def units_in_transfer_order(self) -> list[Unit]:
        return sorted(self.units, key=lambda u: (u.offset, u.length, u.index))

    def reads(self, read_bytes: int) -> tuple[Read, ...]:
        """Consecutive whole units grouped into reads of at most ``read_bytes`` (a unit larger
        than that is a read of its own), covering the transfer space in order. Zero-length
        units ride with the read that reaches their offset."""
        got = self._reads.get(read_bytes)
        if got is not None:
            return got
        out: list[Read] = []
        cur: list[int] = []
        start = length = 0
        for u in self.units_in_transfer_order():
            if length and length + u.length > read_bytes:
                out.append(Read(start, length, tuple(cur)))
                cur, start, length = [], u.offset, 0
            if not cur:
                start = u.offset
            cur.append(u.index)
            length += u.length
        if cur:
            out.append(Read(start, length, tuple(cur)))
        got = self._reads[read_bytes] = tuple(out)
        return got


def _region_at(starts: list[int], regions: list[Region], offset: int, nbytes: int) -> int:
    """Index of the region holding ``nbytes`` at ``offset`` (-1 for zero bytes outside all)."""
    k = bisect.bisect_right(starts, offset) - 1
    if k < 0:
        return -1
    end = regions[k].offset + regions[k].nbytes
    inside = regions[k].offset <= offset and offset + nbytes <= end
    return k if inside and (nbytes or offset < end) else -1


@functools.lru_cache(maxsize=256)
def plan_of(layout: Layout) -> Plan:
    """The packing plan of ``layout`` (equal layouts share one)."""
    return Plan(layout)
