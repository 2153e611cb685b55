"""Placements: which part of a tensor's global shape each shard of a replica holds.

Theory of operation
-------------------
A :class:`~tensorhub.core.layout.Layout` lists a shard's *local* tensors. When two sides of a job
shard the same model differently (FSDP on the trainer, tensor parallelism on the inference side),
each local tensor must also say what it is a part of. That is a :class:`TensorPlacement`, the
same on every shard that holds the tensor (DTensor's SPMD view): the tensor's name, dtype and
**global** shape, and its placement over a mesh of shards, one entry per mesh dimension:
:class:`Shard` ``(dim)`` or :class:`Replicate` ``()``. A :class:`PlacedTensor` is that placement
at one mesh coordinate: what one shard holds. A :class:`ReplicaLayout` is every shard's placed
tensors, in each shard's layout order: what a planner needs from one side.

The chunk rule (``torch.chunk`` and DTensor's ``Shard`` agree on it, and this module follows it):
splitting ``size`` elements into ``n`` chunks gives chunks of ``ceil(size / n)`` elements, the
last ones shorter or empty. ``torch.chunk`` drops the empty trailing chunks (so it may return
fewer than ``n``); DTensor keeps exactly ``n`` shards, the trailing ones empty. Here there are
always ``n`` shards, as in DTensor: ``size=5, n=4`` gives ``[0,2) [2,4) [4,5) [5,5)``. Several
mesh dimensions sharding the same tensor dimension nest left to right, each splitting what the
previous one left (DTensor's ``compute_local_shape_and_global_offset``).

Packed tensors (vLLM's fused ``qkv_proj`` and ``gate_up_proj``) are not a plain chunk of their
global tensor: each tensor-parallel rank holds its chunk of ``q``, then its chunk of ``k``, then
of ``v``. A placement says so with ``parts`` (the parts' sizes along ``parts_dim``) and ``unit``
(the granule a part is split in: a head's rows). Each part is chunked on its own; a part with
fewer units than ranks (grouped-query attention with fewer KV heads than ranks) is replicated:
rank ``r`` of ``n`` holds unit ``r // (n // units)``, as vLLM's ``QKVParallelLinear`` does. A
shard then holds several **pieces** of the global tensor, laid end to end along ``parts_dim`` in
its local tensor. An unpacked tensor is one piece.

Invariants:

- all holders of a tensor in a replica declare the same :class:`TensorPlacement`, so two shards'
  pieces of one tensor are either the same box or disjoint (never a partial overlap);
- a piece's box lies inside the global shape, and the pieces of one shard tile its local tensor;
- nothing here imports torch: ``tensorhub.reshard.dtensor`` builds placements from DTensors.

All classes are frozen, slotted wire structs (msgpack-able through :mod:`tensorhub.core.wire`),
validated when built; a bad one raises :class:`~tensorhub.errors.InvalidPlacement` naming the
tensor.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import InvalidPlacement
from .layout import DTYPE_SIZES, MAX_DIMS, Layout, TensorSpec
from .wire import struct

__all__ = [
    "REPLICATE",
    "Box",
    "Piece",
    "Placement",
    "PlacedTensor",
    "Replicate",
    "ReplicaLayout",
    "Shard",
    "TensorPlacement",
    "chunk_range",
]

#: The ``dims`` entry of a mesh dimension that replicates the tensor.
REPLICATE = -1
#: The most mesh dimensions a placement may name (DTensor meshes rarely have more than three).
MAX_MESH_DIMS = 8


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split along tensor dimension ``dim`` over one mesh dimension (chunk rule)."""

    dim: int

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 0:
            raise InvalidPlacement(f"Shard(dim) needs a dimension >= 0, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every coordinate along one mesh dimension holds the whole extent."""

    def __repr__(self) -> str:
        return "Replicate()"


Placement = Shard | Replicate


def chunk_range(size: int, chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` elements are split into ``chunks``.

    The ``torch.chunk`` / DTensor ``Shard`` rule: chunks of ``ceil(size / chunks)`` elements,
    the trailing ones shorter or empty (an empty chunk starts and stops at ``size``).
    """
    full = -(-size // chunks)
    start = min(full * index, size)
    return start, min(start + full, size)


@struct
class Box:
    """A box of a tensor's index space: ``[start[d], stop[d])`` along each dimension ``d``."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.stop) or not all(0 <= a <= b for a, b in zip(self.start, self.stop)):
            raise ValueError(f"bad box {self.start!r}..{self.stop!r}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.stop, self.start))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when it is empty."""
        start = tuple(map(max, self.start, other.start))
        stop = tuple(map(min, self.stop, other.stop))
        for a, b in zip(start, stop):
            if a >= b:
                return None
        return _box(start, stop)

    def contains(self, other: Box) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def shift(self, by: Sequence[int]) -> Box:
        """This box moved by ``by`` (negative entries move it towards the origin; it must stay
        at indices >= 0)."""
        return Box(tuple(a + s for a, s in zip(self.start, by)), tuple(b + s for b, s in zip(self.stop, by)))

    def with_dim(self, dim: int, start: int, stop: int) -> Box:
        """This box with dimension ``dim`` replaced by ``[start, stop)``."""
        return Box(
            self.start[:dim] + (start,) + self.start[dim + 1 :], self.stop[:dim] + (stop,) + self.stop[dim + 1 :]
        )


def _box(start: tuple[int, ...], stop: tuple[int, ...]) -> Box:
    """A box known to be valid, built without validating it (planners build many)."""
    b = object.__new__(Box)
    object.__setattr__(b, "start", start)
    object.__setattr__(b, "stop", stop)
    return b


@struct
class Piece:
    """A box of the global tensor that one shard holds, starting at index ``at`` of its local
    tensor (all zeros but along ``parts_dim`` for packed tensors)."""

    box: Box
    at: tuple[int, ...]


@struct
class TensorPlacement:
    """A tensor as every shard that holds part of it describes it (the SPMD view).

    Attributes:
        name: the tensor's name in its side's naming scheme.
        dtype: its dtype (torch's name without ``torch.``).
        shape: its **global** shape.
        mesh: the sizes of the mesh dimensions it is placed over; ``()`` for a tensor every
            holder holds whole.
        dims: per mesh dimension, the tensor dimension it shards, or :data:`REPLICATE`.
        parts: for a packed tensor, its parts' sizes along ``parts_dim`` (they add up to
            ``shape[parts_dim]``); each part is chunked on its own. ``()`` for a plain tensor.
        parts_dim: the dimension the parts are concatenated along.
        unit: the granule parts are chunked in (e.g. the rows of one attention head).

    Build it with :meth:`of` from :class:`Shard` / :class:`Replicate` placements.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    mesh: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()
    parts: tuple[int, ...] = ()
    parts_dim: int = 0
    unit: int = 1

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not 1 <= len(name) <= 1024:
            raise InvalidPlacement(
                f"a tensor name must have 1 to 1024 characters, got {name!r:.80}", tensors=(str(name)[:1024],)
            )

        def bad(why: str) -> InvalidPlacement:
            return InvalidPlacement(f"tensor {name!r}: {why}", tensors=(name,))

        if self.dtype not in DTYPE_SIZES:
            raise bad(f"unknown dtype {self.dtype!r}")
        nd = len(self.shape)
        if nd > MAX_DIMS or any(type(d) is not int or d < 0 for d in self.shape):
            raise bad(f"bad global shape {self.shape!r}")
        if len(self.mesh) > MAX_MESH_DIMS or any(type(n) is not int or n < 1 for n in self.mesh):
            raise bad(f"bad mesh {self.mesh!r}: sizes must be >= 1, at most {MAX_MESH_DIMS} dimensions")
        if len(self.dims) != len(self.mesh):
            raise bad(f"{len(self.dims)} placements for a mesh of {len(self.mesh)} dimensions")
        for d in self.dims:
            if type(d) is not int or not REPLICATE <= d < nd:
                raise bad(f"Shard({d}) of a tensor with {nd} dimensions")
        if type(self.unit) is not int or self.unit < 1:
            raise bad(f"unit must be >= 1, got {self.unit!r}")
        if not self.parts:
            if self.unit != 1 or self.parts_dim != 0:
                raise bad("unit and parts_dim only apply to a packed tensor (parts)")
            return
        if not 0 <= self.parts_dim < nd:
            raise bad(f"parts_dim {self.parts_dim} of a tensor with {nd} dimensions")
        if any(type(p) is not int or p < 1 for p in self.parts) or sum(self.parts) != self.shape[self.parts_dim]:
            raise bad(
                f"parts {self.parts!r} do not add up to {self.shape[self.parts_dim]} along dimension {self.parts_dim}"
            )
        if any(p % self.unit for p in self.parts):
            raise bad(f"parts {self.parts!r} are not whole units of {self.unit}")
        packing = [m for m, d in enumerate(self.dims) if d == self.parts_dim]
        if len(packing) > 1:
            raise bad(
                f"a packed tensor's parts_dim {self.parts_dim} may be sharded by one mesh dimension, not {len(packing)}"
            )
        if packing:
            n = self.mesh[packing[0]]
            for p in self.parts:
                units = p // self.unit
                if units < n and n % units:
                    raise bad(f"a part of {units} units cannot be replicated evenly over {n} shards")

    @classmethod
    def of(
        cls,
        name: str,
        dtype: str,
        shape: Sequence[int],
        placements: Placement | Sequence[Placement] = (),
        mesh: int | Sequence[int] = (),
        *,
        parts: Sequence[int] = (),
        parts_dim: int = 0,
        unit: int = 1,
    ) -> TensorPlacement:
        """Build a placement from :class:`Shard` / :class:`Replicate` objects.

        Args:
            name, dtype, shape: the tensor and its global shape.
            placements: one per mesh dimension (a single one for a 1-D mesh).
            mesh: the mesh's sizes (an int for a 1-D mesh).
            parts, parts_dim, unit: see the class; for packed tensors only.

        Raises:
            InvalidPlacement: the placement cannot be, naming the tensor.
        """
        if isinstance(placements, (Shard, Replicate)):
            placements = (placements,)
        mesh_t = (mesh,) if isinstance(mesh, int) else tuple(mesh)
        dims = []
        for p in placements:
            if isinstance(p, Shard):
                dims.append(p.dim)
            elif isinstance(p, Replicate):
                dims.append(REPLICATE)
            else:
                raise InvalidPlacement(f"tensor {name!r}: unsupported placement {p!r}", tensors=(name,))
        return cls(name, dtype, tuple(shape), mesh_t, tuple(dims), tuple(parts), parts_dim, unit)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(Replicate() if d == REPLICATE else Shard(d) for d in self.dims)

    @property
    def nbytes(self) -> int:
        """Size of the whole (global) tensor."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def packed(self) -> bool:
        """Whether its parts are chunked on their own (a packed tensor sharded along parts_dim)."""
        return bool(self.parts) and self.parts_dim in self.dims

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every mesh coordinate, in row-major order (the order of DTensor's ranks in the mesh)."""
        for flat in range(math.prod(self.mesh)):
            yield self.coord_of(flat)

    def coord_of(self, flat: int) -> tuple[int, ...]:
        """The coordinate of the ``flat``-th position of the mesh, row-major."""
        coord = []
        for n in reversed(self.mesh):
            flat, r = divmod(flat, n)
            coord.append(r)
        return tuple(reversed(coord))

    def check_coord(self, coord: Sequence[int]) -> None:
        if len(coord) != len(self.mesh) or any(type(c) is not int or not 0 <= c < n for c, n in zip(coord, self.mesh)):
            raise InvalidPlacement(
                f"tensor {self.name!r}: coordinate {tuple(coord)!r} outside the mesh {self.mesh!r}",
                tensors=(self.name,),
            )

    def pieces(self, coord: Sequence[int]) -> tuple[Piece, ...]:
        """The non-empty boxes of the global tensor the shard at ``coord`` holds, in local order."""
        return _pieces(self, tuple(coord))

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        """The shape of the local tensor the shard at ``coord`` holds."""
        return _local_shape(self, tuple(coord))

    def spec(self, coord: Sequence[int]) -> TensorSpec:
        """The local tensor at ``coord`` as a layout lists it."""
        shape = self.local_shape(coord)
        return TensorSpec(self.name, self.dtype, shape, math.prod(shape) * DTYPE_SIZES[self.dtype])


def _outer_box(t: TensorPlacement, coord: tuple[int, ...]) -> tuple[list[int], list[int], int | None]:
    """The nested chunk box over every sharded dimension but a packed parts_dim, and the mesh
    dimension that shards the parts (None when none does)."""
    t.check_coord(coord)
    lo = [0] * len(t.shape)
    hi = list(t.shape)
    packing = None
    for m, d in enumerate(t.dims):
        if d == REPLICATE:
            continue
        if t.parts and d == t.parts_dim:
            packing = m
            continue
        a, b = chunk_range(hi[d] - lo[d], t.mesh[m], coord[m])
        lo[d], hi[d] = lo[d] + a, lo[d] + b
    return lo, hi, packing


def _part_ranges(t: TensorPlacement, coord: tuple[int, ...], packing: int) -> list[tuple[int, int]]:
    """Per part, the global ``[start, stop)`` along parts_dim the shard at ``coord`` holds."""
    n, r = t.mesh[packing], coord[packing]
    out = []
    off = 0
    for size in t.parts:
        units = size // t.unit
        if units >= n:
            a, b = chunk_range(units, n, r)
        else:  # fewer units than shards: each unit replicated on n // units consecutive shards
            a = r // (n // units)
            b = a + 1
        out.append((off + a * t.unit, off + b * t.unit))
        off += size
    return out


@functools.lru_cache(maxsize=4096)
def _pieces(t: TensorPlacement, coord: tuple[int, ...]) -> tuple[Piece, ...]:
    lo, hi, packing = _outer_box(t, coord)
    if any(a >= b for a, b in zip(lo, hi)):
        return ()
    if packing is None:
        return (Piece(Box(tuple(lo), tuple(hi)), (0,) * len(lo)),)
    out = []
    d = t.parts_dim
    at = 0
    for a, b in _part_ranges(t, coord, packing):
        if a < b:
            box = Box(tuple(lo[:d] + [a] + lo[d + 1 :]), tuple(hi[:d] + [b] + hi[d + 1 :]))
            out.append(Piece(box, tuple(at if i == d else 0 for i in range(len(lo)))))
            at += b - a
    return tuple(out)


def _local_shape(t: TensorPlacement, coord: tuple[int, ...]) -> tuple[int, ...]:
    lo, hi, packing = _outer_box(t, coord)
    shape = [b - a for a, b in zip(lo, hi)]
    if packing is not None:
        shape[t.parts_dim] = sum(b - a for a, b in _part_ranges(t, coord, packing))
    return tuple(shape)


@struct
class PlacedTensor:
    """What one shard holds of a tensor: its placement, at the shard's mesh coordinate."""

    placement: TensorPlacement
    coord: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.placement.check_coord(self.coord)

    @property
    def name(self) -> str:
        return self.placement.name

    def pieces(self) -> tuple[Piece, ...]:
        return self.placement.pieces(self.coord)

    def local_shape(self) -> tuple[int, ...]:
        return self.placement.local_shape(self.coord)

    def spec(self) -> TensorSpec:
        return self.placement.spec(self.coord)


@struct
class ReplicaLayout:
    """Every shard's placed tensors, shard by shard, each in its shard's layout order.

    Validated when built: names unique within a shard, and every holder of a tensor declaring
    the same :class:`TensorPlacement` (so any two holders' pieces are equal or disjoint).
    Whether every element of every tensor is held is :meth:`check_complete`'s question (a
    source must be complete; a destination need not be).
    """

    shards: tuple[tuple[PlacedTensor, ...], ...]

    def __post_init__(self) -> None:
        if not self.shards:
            raise InvalidPlacement("a replica layout needs at least one shard")
        seen: dict[str, TensorPlacement] = {}
        for i, tensors in enumerate(self.shards):
            names = set()
            for pt in tensors:
                t = pt.placement
                if t.name in names:
                    raise InvalidPlacement(f"shard {i} lists tensor {t.name!r} twice", tensors=(t.name,), shard=i)
                names.add(t.name)
                known = seen.setdefault(t.name, t)
                if known != t:
                    raise InvalidPlacement(
                        f"shards disagree on tensor {t.name!r}: {_describe(known)} vs {_describe(t)} (shard {i})",
                        tensors=(t.name,),
                        shard=i,
                    )

    @classmethod
    def spmd(cls, tensors: Sequence[TensorPlacement], shards: int) -> ReplicaLayout:
        """The layout of ``shards`` shards that all hold every tensor, shard ``i`` at the
        ``i``-th coordinate (row-major) of each tensor's mesh; a tensor with mesh ``()`` is
        whole on every shard.

        Raises:
            InvalidPlacement: a tensor's mesh does not have ``shards`` positions.
        """
        for t in tensors:
            if t.mesh and math.prod(t.mesh) != shards:
                raise InvalidPlacement(
                    f"tensor {t.name!r}: a mesh of {t.mesh!r} does not span {shards} shards", tensors=(t.name,)
                )
        return cls(
            tuple(tuple(PlacedTensor(t, t.coord_of(i) if t.mesh else ()) for t in tensors) for i in range(shards))
        )

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def tensors(self) -> dict[str, TensorPlacement]:
        """Every tensor's placement, by name, in order of first appearance."""
        out: dict[str, TensorPlacement] = {}
        for tensors in self.shards:
            for pt in tensors:
                out.setdefault(pt.name, pt.placement)
        return out

    def holders(self) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
        """Per tensor, ``(shard, coordinate)`` of every shard that holds part of it."""
        out: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        for i, tensors in enumerate(self.shards):
            for pt in tensors:
                out.setdefault(pt.name, []).append((i, pt.coord))
        return out

    def check_complete(self, exclude: frozenset[int] = frozenset()) -> None:
        """Check that every element of every tensor is held by some shard not in ``exclude``.

        Raises:
            InvalidPlacement: naming the first tensor that is not wholly held.
        """
        tensors = self.tensors()
        for name, holders in self.holders().items():
            t = tensors[name]
            boxes = {p.box for i, coord in holders if i not in exclude for p in t.pieces(coord)}
            held = sum(b.volume for b in boxes)  # equal-or-disjoint pieces: the volumes add up
            if held != math.prod(t.shape):
                raise InvalidPlacement(
                    f"tensor {name!r}: the shards hold {held} of its {math.prod(t.shape)} elements",
                    tensors=(name,),
                )

    def layout(
        self, shard: int, *, checksum: str = "xxh3-64", chunk_bytes: int = 8 << 20, pack_threshold: int = 1 << 16
    ) -> Layout:
        """Shard ``shard``'s :class:`~tensorhub.core.layout.Layout` (its local tensors)."""
        return Layout(tuple(pt.spec() for pt in self.shards[shard]), checksum, chunk_bytes, pack_threshold)


def _describe(t: TensorPlacement) -> str:
    text = f"{t.dtype}{list(t.shape)} {list(t.placements)} over {list(t.mesh)}"
    if t.parts:
        text += f" parts {list(t.parts)} along {t.parts_dim} in units of {t.unit}"
    return text
