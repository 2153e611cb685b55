"""References for the resharding tests, written from torch's and vLLM's own rules rather than from
tensorhub's: what a shard holds (DTensor's ``_compute_local_shape_and_global_offset``; vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` loaders for packed tensors), DeepGEMM's
``per_block_cast_to_fp8``, and "gather the full tensor, transform, slice"."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tensorhub.core.placement import REPLICATE, ReplicaLayout, TensorPlacement
from tensorhub.reshard import convert_in_process, torch_dtype
from tensorhub.scheduling.mapping import COPY, FP8_SCALES, Derivation, resolve
from tensorhub.scheduling.reshard import ReshardPlan


def torch_placements(dims) -> list:
    return [TReplicate() if d == REPLICATE else TShard(d) for d in dims]


def dtensor_local(t: TensorPlacement, coord, full: torch.Tensor, dims=None) -> torch.Tensor:
    """What DTensor puts on the rank at ``coord`` (placements ``dims``, default the tensor's)."""
    dims = t.dims if dims is None else dims
    if not t.mesh:
        return full.clone()
    shape, offset = _compute_local_shape_and_global_offset(t.shape, t.mesh, list(coord), torch_placements(dims))
    if any(n == 0 for n in shape):
        return full.new_empty(shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()


def vllm_packed(t: TensorPlacement, coord, full: torch.Tensor) -> torch.Tensor:
    """What vLLM's packed-layer loaders put on rank ``coord``: per part, the rank's chunk (its
    ``tp_rank * shard_size``), or, with fewer units than ranks, unit ``rank // replicas``."""
    m = t.dims.index(t.parts_dim)
    n, r = t.mesh[m], coord[m]
    other = tuple(REPLICATE if i == m else d for i, d in enumerate(t.dims))
    full = dtensor_local(t, coord, full, other)  # the other mesh dimensions, as DTensor does
    out, off = [], 0
    for size in t.parts:
        part = full.narrow(t.parts_dim, off, size)
        off += size
        units = size // t.unit
        if units >= n:
            if units % n == 0:  # vLLM's case
                rows = size // n
                out.append(part.narrow(t.parts_dim, r * rows, rows))
            else:  # uneven: torch.chunk over units
                chunks = torch.arange(units).chunk(n)
                if r < len(chunks):
                    idx = chunks[r]
                    out.append(part.narrow(t.parts_dim, int(idx[0]) * t.unit, len(idx) * t.unit))
        else:
            u = r // (n // units)
            out.append(part.narrow(t.parts_dim, u * t.unit, t.unit))
    if not out:
        shape = list(full.shape)
        shape[t.parts_dim] = 0
        return full.new_empty(shape)
    return torch.cat(out, t.parts_dim).clone()


def local_of(t: TensorPlacement, coord, full: torch.Tensor) -> torch.Tensor:
    return vllm_packed(t, coord, full) if t.packed else dtensor_local(t, coord, full)


def shard_all(layout: ReplicaLayout, full: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every shard's local tensors, cut from the full tensors."""
    return [{pt.name: local_of(pt.placement, pt.coord, full[pt.name]) for pt in tensors} for tensors in layout.shards]


def reference_quant(x: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``per_block_cast_to_fp8`` (the block a parameter): pad, per-block amax, scale."""
    m, n = x.shape
    br, bc = block
    x_padded = torch.zeros((-(-m // br) * br, -(-n // bc) * bc), dtype=x.dtype)
    x_padded[:m, :n] = x
    x_view = x_padded.view(-1, br, x_padded.size(1) // bc, bc)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    x_scaled = (x_view * (448.0 / x_amax)).to(torch.float8_e4m3fn)
    return x_scaled.view_as(x_padded)[:m, :n].contiguous(), (x_amax / 448.0).view(x_view.size(0), x_view.size(2))


def derive_full(d: Derivation, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole destination tensor: its parts transformed, then concatenated."""
    parts = [full[p.source] for p in d.parts]
    if d.kind == COPY:
        out = parts[0] if len(parts) == 1 else torch.cat(parts, d.dim)
        return out.to(torch_dtype(d.dtype))
    quantized = [reference_quant(p, d.block) for p in parts]
    return torch.cat([s if d.kind == FP8_SCALES else q for q, s in quantized], d.dim)


def expected(
    source: ReplicaLayout, dest: ReplicaLayout, mapping, full: dict[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    derivations = resolve(mapping, source.tensors(), dest.tensors())
    whole = {name: derive_full(d, full) for name, d in derivations.items()}
    return shard_all(dest, whole)


def random_full(layout: ReplicaLayout, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in layout.tensors().items():
        dtype = torch_dtype(t.dtype)
        if dtype.is_floating_point:
            out[name] = (torch.randn(t.shape, generator=gen) * 3).to(dtype)
        else:
            out[name] = torch.randint(0, 100, t.shape, generator=gen).to(dtype)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def convert_poisoned(
    plan: ReshardPlan, source: ReplicaLayout, full: dict[str, torch.Tensor], device=None
) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` through the real converter from the source shards cut from ``full``, into
    destination buffers poisoned with a byte the data path never writes by chance, on ``device``."""
    sources = [{k: v.to(device) for k, v in shard.items()} for shard in shard_all(source, full)]
    poisoned = {}
    for sp in plan.shards:
        bufs = {}
        for spec in sp.tensors:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device)
            t.reshape(-1).view(torch.uint8).fill_(0xA5)
            bufs[spec.name] = t
        poisoned[sp.shard] = bufs
    got = convert_in_process(plan, sources, poisoned, device)
    assert sorted(got) == [sp.shard for sp in plan.shards]
    return got


def run_and_compare(
    plan: ReshardPlan, source: ReplicaLayout, dest: ReplicaLayout, mapping, full, device=None
) -> dict[int, dict[str, torch.Tensor]]:
    """Simulate the data path (cut the plan's byte segments from the source shards' bytes,
    land them, transform, write into poisoned destination buffers, all on ``device``) and check
    every destination byte against the reference, computed on the CPU."""
    want = expected(source, dest, mapping, full)
    got = convert_poisoned(plan, source, full, device)
    for j, g in got.items():
        w = want[j]
        assert g.keys() == w.keys(), j
        for name in w:
            assert same_bytes(g[name].cpu(), w[name]), f"destination shard {j}, tensor {name!r}: bytes differ"
    return got
