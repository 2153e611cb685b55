"""What ``register()`` checks and derives before anything is registered: DTensors become their
local tensors with the placements they carry (:func:`local_tensors`), and the placements given
are checked against the layout and the replica's shard count, each resolved to this shard's mesh
coordinate (:func:`placed_tensors`). Refusals are typed
(:class:`~tensorhub.errors.InvalidPlacement`, :class:`~tensorhub.errors.InvalidArgument`) and
name the tensor."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from tensorhub.core.errors import InvalidArgument, InvalidPlacement
from tensorhub.core.layout import Layout
from tensorhub.core.placement import PlacedTensor, TensorPlacement

__all__ = ["local_tensors", "placed_tensors"]


def local_tensors(
    tensors: dict[str, torch.Tensor], placements: dict[str, Any] | None, ctx: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """DTensors become their local tensors, and their placements those they carry (unless given)."""
    # A DTensor exists only once its module is imported: importing it here would cost the first
    # register about a second of the loop (it pulls in sympy), long enough to miss heartbeats.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if not isinstance(tensors, dict) or dtensor_module is None:
        return tensors, placements
    DTensor = dtensor_module.DTensor

    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return tensors, placements
    from tensorhub.reshard.dtensor import placed_tensors as carried

    if placements is None:
        placements = {pt.name: pt for pt in carried(tensors.items())}
    return {k: t.to_local() if isinstance(t, DTensor) else t for k, t in tensors.items()}, placements


def placed_tensors(
    layout: Layout, placements: dict[str, TensorPlacement | PlacedTensor], shard_idx: int, ctx: dict[str, Any],
    num_shards: int | None = None,
) -> tuple[PlacedTensor, ...]:
    """Every registered tensor's placement, in layout order, checked against its local tensor
    and (``num_shards``) against the replica: a mesh is laid over its shards, as many as they."""
    if not isinstance(placements, dict):
        raise InvalidArgument(f"placements must be a dict of tensor name -> placement, got {type(placements).__name__}", **ctx)
    extra = sorted(set(placements) - {t.name for t in layout.tensors})
    if extra:
        raise InvalidPlacement(f"placements name tensors that are not registered: {extra[:5]}", tensors=tuple(extra[:16]), **ctx)
    out: list[PlacedTensor] = []
    for spec in layout.tensors:
        p = placements.get(spec.name)
        if p is None:
            raise InvalidPlacement(f"tensor {spec.name!r} has no placement", tensors=(spec.name,), **ctx)
        if isinstance(p, TensorPlacement):
            if p.mesh and not 0 <= shard_idx < math.prod(p.mesh):
                raise InvalidPlacement(f"tensor {spec.name!r}: shard {shard_idx} is outside its mesh {list(p.mesh)}", tensors=(spec.name,), **ctx)
            p = PlacedTensor(p, p.coord_of(shard_idx) if p.mesh else ())
        elif not isinstance(p, PlacedTensor):
            raise InvalidPlacement(f"tensor {spec.name!r}: a placement must be a TensorPlacement or PlacedTensor, got {type(p).__name__}", tensors=(spec.name,), **ctx)
        if p.name != spec.name:
            raise InvalidPlacement(f"tensor {spec.name!r}: its placement is named {p.name!r}", tensors=(spec.name,), **ctx)
        mesh = p.placement.mesh
        if num_shards is not None and mesh and math.prod(mesh) != num_shards:
            raise InvalidPlacement(
                f"tensor {spec.name!r}: its mesh {list(mesh)} has {math.prod(mesh)} positions, but the replica has "
                f"num_shards={num_shards} shards (a mesh is laid over the replica's shards, one position each)",
                tensors=(spec.name,), **ctx,
            )  # fmt: skip
        if p.spec() != spec:
            raise InvalidPlacement(
                f"tensor {spec.name!r} is {spec.dtype}{list(spec.shape)}; its placement gives {p.spec().dtype}{list(p.spec().shape)} here",
                tensors=(spec.name,), **ctx,
            )  # fmt: skip
        out.append(p)
    return tuple(out)
