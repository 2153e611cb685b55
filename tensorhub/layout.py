"""Layouts: the ordered list of a shard's tensors, as every holder of a shard index declares it.

A :class:`Layout` is what the reference table compares (all holders of one (model, shard_idx)
must declare equal layouts, else :class:`~tensorhub.errors.LayoutMismatch`) and what fixes the
checksum units: one 64-bit checksum per tensor, or one per ``chunk_bytes`` chunk for tensors
larger than a chunk. The packing plan (issue: data plane) is derived from the tensor list and
``pack_threshold``, so two equal layouts always pack identically.
"""

from __future__ import annotations

import math

from .wire import struct

__all__ = ["DTYPE_SIZES", "TensorSpec", "Layout", "MAX_TENSORS"]

MAX_TENSORS = 1 << 16
MAX_DIMS = 16

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
