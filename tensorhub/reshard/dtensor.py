"""Placements from torch: DTensors (and their DeviceMesh) and plain tensors as
:class:`~tensorhub.core.placement.TensorPlacement` s.

A DTensor carries all a placement needs: its global shape and dtype, its mesh's shape, its
placements per mesh dimension, and this rank's coordinate. ``Shard(d)`` and ``Replicate()`` map
one to one; ``Partial`` (a pending reduction) and ``_StridedShard`` (FSDP2 over tensor
parallelism on the same dimension) are refused with
:class:`~tensorhub.errors.InvalidPlacement`, as nothing holds their bytes in plain chunks. A
plain tensor is one every holder holds whole (mesh ``()``).

torch.distributed is imported only when a DTensor is seen, and only if this torch has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tensorhub.core.errors import InvalidPlacement
from tensorhub.core.placement import REPLICATE, PlacedTensor, ReplicaLayout, TensorPlacement

__all__ = ["dtype_name", "placed_tensors", "placement_of", "placements_of", "replica_layout"]


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as layouts name it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _dtensor_types() -> tuple[Any, Any, Any, Any] | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return DTensor, Shard, Replicate, _StridedShard


def _is_dtensor(t: Any) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def placements_of(name: str, shape: Sequence[int], placements: Sequence[Any]) -> tuple[int, ...]:
    """torch ``Placement`` objects as :class:`TensorPlacement`'s ``dims``.

    Raises:
        InvalidPlacement: a placement other than ``Shard`` and ``Replicate``, naming the tensor.
    """
    types = _dtensor_types()
    if types is None:
        raise InvalidPlacement(f"tensor {name!r}: this torch has no torch.distributed", tensors=(name,))
    _, shard, replicate, strided = types
    dims = []
    for p in placements:
        if isinstance(p, strided) or (isinstance(p, shard) and type(p) is not shard):
            raise InvalidPlacement(f"tensor {name!r}: {p!r} (strided sharding) is not supported", tensors=(name,))
        if isinstance(p, shard):
            dims.append(p.dim % len(shape) if shape else p.dim)
        elif isinstance(p, replicate):
            dims.append(REPLICATE)
        else:
            raise InvalidPlacement(
                f"tensor {name!r}: placement {p!r} is not supported (only Shard and Replicate)", tensors=(name,)
            )
    return tuple(dims)


def placement_of(
    name: str, tensor: torch.Tensor, *, parts: Sequence[int] = (), parts_dim: int = 0, unit: int = 1
) -> tuple[TensorPlacement, tuple[int, ...]]:
    """A tensor's placement and this rank's coordinate in its mesh.

    Args:
        name: the tensor's name.
        tensor: a DTensor, or a plain tensor (held whole: mesh ``()``, coordinate ``()``).
        parts, parts_dim, unit: for a packed tensor (see :class:`TensorPlacement`).

    Raises:
        InvalidPlacement: an unsupported placement, or this rank is not in the tensor's mesh.
    """
    if not _is_dtensor(tensor):
        return TensorPlacement(
            name, dtype_name(tensor.dtype), tuple(tensor.shape), parts=tuple(parts), parts_dim=parts_dim, unit=unit
        ), ()
    # a DTensor (checked above), typed as a plain Tensor: its mesh and placements are unknown to mypy
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    shape = tuple(tensor.shape)
    dims = placements_of(name, shape, tensor.placements)  # type: ignore[attr-defined]
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidPlacement(f"tensor {name!r}: this rank is not in its device mesh", tensors=(name,))
    t = TensorPlacement(name, dtype_name(tensor.dtype), shape, tuple(mesh.shape), dims, tuple(parts), parts_dim, unit)
    return t, tuple(coord)


def placed_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[PlacedTensor, ...]:
    """What this rank holds, as placed tensors, in the given order (its layout order)."""
    out = []
    for name, tensor in named:
        t, coord = placement_of(name, tensor)
        out.append(PlacedTensor(t, coord))
    return tuple(out)


def replica_layout(named: Iterable[tuple[str, torch.Tensor]], shards: int) -> ReplicaLayout:
    """Every rank's layout from one rank's tensors, DTensors being SPMD: shard ``i`` is the
    ``i``-th coordinate (row-major) of each tensor's mesh, and a plain tensor is whole on every
    shard. For meshes that differ per tensor, gather each rank's :func:`placed_tensors` instead.

    Raises:
        InvalidPlacement: a mesh that does not span ``shards`` shards, or an unsupported placement.
    """
    return ReplicaLayout.spmd([placement_of(name, t)[0] for name, t in named], shards)
