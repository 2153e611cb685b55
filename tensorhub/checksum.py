"""End-to-end checksums of a shard's checksum units (DESIGN §4, §5.2).

Theory of operation
-------------------
A layout names its checksum algorithm; the only one today is ``xxh3-64`` (XXH3, 64-bit, seed
0), about 20 GB/s on one core, which is what lets a reader verify every byte it receives while
the next bytes are still on the wire. One 64-bit value per checksum unit (a whole tiny tensor,
or one ``chunk_bytes`` piece of a large one: :class:`~tensorhub.layout.Unit`), in the layout's
order.

The value depends only on the bytes: CPU memory is hashed in place (no copy; the hash releases
the GIL, so a worker thread hashes while the event loop and the transports' threads go on).
CUDA memory is staged through a pinned buffer in pieces and hashed by the same code, so a unit
has the same checksum on CPU and GPU by construction.

Bad input gets a typed error: an unknown algorithm is :class:`~tensorhub.errors.InvalidArgument`,
a wrong number of expected values too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch
import xxhash

from .buffers import ShardBuffers, memory_of
from .errors import InvalidArgument
from .layout import Unit

__all__ = ["ALGORITHMS", "compute", "digest", "first_mismatch"]

ALGORITHMS = ("xxh3-64",)
_STAGE = 8 << 20  # CUDA units are hashed through pinned staging in pieces of this size


class _Staging(threading.local):
    tensor: torch.Tensor | None = None

    def get(self, n: int) -> memoryview:
        if self.tensor is None or self.tensor.numel() < n:
            self.tensor = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return memory_of(self.tensor)[:n]


_staging = _Staging()


def digest(data: memoryview | bytes) -> int:
    """The ``xxh3-64`` checksum of ``data``."""
    return xxhash.xxh3_64_intdigest(data)


def _check_algorithm(buffers: ShardBuffers) -> None:
    if buffers.layout.checksum not in ALGORITHMS:
        raise InvalidArgument(f"checksum algorithm {buffers.layout.checksum!r} is not supported (known: {', '.join(ALGORITHMS)})")


def _unit_checksum(buffers: ShardBuffers, u: Unit) -> int:
    if u.length == 0:
        return digest(b"")
    if not buffers.on_cuda:
        (view,) = buffers.views(u.offset, u.length)
        return digest(view)
    h = xxhash.xxh3_64()
    pos = 0
    while pos < u.length:
        n = min(_STAGE, u.length - pos)
        staged = _staging.get(n)
        buffers.copy_out(u.offset + pos, staged)
        h.update(staged)
        pos += n
    return h.intdigest()


def compute(buffers: ShardBuffers, units: Iterable[int] | None = None) -> list[int]:
    """The checksums of ``units`` (indices into the plan's units; all of them by default), in
    that order. Blocking: run it in a worker thread."""
    _check_algorithm(buffers)
    all_units = buffers.plan.units
    picked = all_units if units is None else [all_units[i] for i in units]
    return [_unit_checksum(buffers, u) for u in picked]


def first_mismatch(buffers: ShardBuffers, units: Iterable[int], expected: Sequence[int]) -> int | None:
    """The index of the first of ``units`` whose bytes do not match ``expected`` (the layout's
    declared checksums, all of them), or None if all match. Blocking: run it in a worker thread.

    Raises:
        InvalidArgument: ``expected`` does not have one value per checksum unit.
    """
    _check_algorithm(buffers)
    all_units = buffers.plan.units
    if len(expected) != len(all_units):
        raise InvalidArgument(f"{len(expected)} checksums for a layout of {len(all_units)} checksum units")
    for i in units:
        if _unit_checksum(buffers, all_units[i]) != expected[i]:
            return i
    return None
