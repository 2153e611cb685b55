"""Properties of the resharding planner (``tensorhub.scheduling.reshard``) over random shapes,
placements (1-D and 2-D meshes, ``Shard``/``Replicate``, uneven splits, packed parts) and mappings
(renames by identity, fusions along any dimension, casts, FP8 with small blocks):

- every destination byte is fed exactly once, by outputs that lie inside their task's result;
- a task's reads tile its region; every read lies inside one piece its source shard holds, never
  on an excluded shard;
- every segment lies inside its source shard's local tensor; segments cover the read's bytes, no
  hole inside a segment exceeds ``max_gap`` and every hole between two segments does (so no plan
  under that rule has fewer); the read's strides find each element in the landed segments;
- the loads are the reads' bytes, and no read on the most loaded source shard could move to
  another holder of its piece and end below that load (without costing more bytes);
- the plan runs, byte for byte, to the reference (gather, transform, slice); it is plain data,
  and the same inputs give the same plan.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tensorhub.core import wire
from tensorhub.core.errors import InvalidPlacement
from tensorhub.core.layout import DTYPE_SIZES
from tensorhub.core.placement import REPLICATE, ReplicaLayout, TensorPlacement
from tensorhub.scheduling.mapping import FP8_SCALES, Cast, Fuse, Mapping, Quantize, resolve
from tensorhub.scheduling.reshard import SCALES, VALUES, ReshardPlan, plan, segments_of

from .reshard_ref import random_full, run_and_compare

pytestmark = [pytest.mark.property, pytest.mark.timeout(240)]

FLOATS = ["float32", "bfloat16", "float16"]


def divisors(n: int) -> list[int]:
    return [a for a in range(1, n + 1) if n % a == 0]


@st.composite
def placed(
    draw, name: str, dtype: str, shape: tuple[int, ...], shards: int, parts: tuple[int, ...] = (), parts_dim: int = 0
):
    """A placement of ``shape`` over ``shards`` shards (whole, a 1-D or a 2-D mesh), packed when
    ``parts`` are given and the mesh shards ``parts_dim`` (and the parts allow it)."""
    nd = len(shape)
    how = draw(st.sampled_from(["whole", "1d", "2d"]))
    if how == "whole":
        return TensorPlacement(name, dtype, shape)
    if how == "1d" or shards == 1:
        mesh = (shards,)
    else:
        a = draw(st.sampled_from(divisors(shards)))
        mesh = (a, shards // a)
    dims = tuple(draw(st.integers(REPLICATE, nd - 1)) if nd else REPLICATE for _ in mesh)
    if parts and dims.count(parts_dim) == 1 and draw(st.booleans()):
        unit = draw(st.sampled_from(divisors(math.gcd(*parts))))
        try:
            return TensorPlacement(name, dtype, shape, mesh, dims, parts, parts_dim, unit)
        except InvalidPlacement:
            pass  # these parts cannot be spread over this mesh: unpacked then
    return TensorPlacement(name, dtype, shape, mesh, dims)


@st.composite
def problems(draw):
    src_shards, dst_shards = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    src: list[TensorPlacement] = []
    dst: list[TensorPlacement] = []
    fusions, quantize, casts = [], [], []
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["plain", "fuse", "fp8", "fp8_fuse"]))
        dtype = draw(st.sampled_from(FLOATS))
        fp8 = kind.startswith("fp8")
        if kind == "plain":
            nd = draw(st.integers(0, 3))
            shape = tuple(draw(st.lists(st.integers(0, 7), min_size=nd, max_size=nd)))
            out = draw(st.sampled_from([dtype, *FLOATS]))
            src.append(draw(placed(f"t{i}", dtype, shape, src_shards)))
            dst.append(draw(placed(f"t{i}", out, shape, dst_shards)))
            if out != dtype:
                casts.append(Cast(f"t{i}", out))
            continue
        nd = 2 if fp8 else draw(st.integers(1, 3))
        dim = draw(st.integers(0, nd - 1))
        base = list(draw(st.lists(st.integers(1, 7), min_size=nd, max_size=nd)))
        k = 1 if kind == "fp8" else draw(st.integers(2, 3))
        sizes = tuple(draw(st.lists(st.integers(1, 9), min_size=k, max_size=k)))
        names = [f"f{i}.p{j}" for j in range(k)] if k > 1 else [f"f{i}.w"]
        for name, size in zip(names, sizes):
            src.append(draw(placed(name, dtype, tuple(base[:dim] + [size] + base[dim + 1 :]), src_shards)))
        shape = tuple(base[:dim] + [sum(sizes)] + base[dim + 1 :])
        target = f"f{i}"
        if k > 1:
            fusions.append(Fuse(target, tuple(names), dim))
        else:
            fusions.append(Fuse(target, tuple(names)))  # a one-part fusion: a rename
        if fp8:
            block = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
            quantize.append(Quantize(target, target + ".scale", block=block))
            dst.append(draw(placed(target, "float8_e4m3fn", shape, dst_shards, sizes if k > 1 else (), dim)))
            bparts = tuple(-(-s // block[dim]) for s in sizes)
            sshape = tuple(-(-n // b) for n, b in zip(shape, block))
            sshape = sshape[:dim] + (sum(bparts),) + sshape[dim + 1 :]
            dst.append(draw(placed(target + ".scale", "float32", sshape, dst_shards, bparts if k > 1 else (), dim)))
        else:
            out = draw(st.sampled_from([dtype, *FLOATS]))
            if out != dtype:
                casts.append(Cast(target, out))
            dst.append(draw(placed(target, out, shape, dst_shards, sizes, dim)))
    mapping = Mapping(fusions=tuple(fusions), quantize=tuple(quantize), casts=tuple(casts))
    source = ReplicaLayout.spmd(src, src_shards)
    dest = ReplicaLayout.spmd(dst, dst_shards)
    exclude = frozenset(draw(st.sets(st.integers(0, src_shards - 1), max_size=src_shards - 1)))
    max_gap = draw(st.sampled_from([0, 1, 4, 16, 64, 1 << 20]))
    max_task_bytes = draw(st.one_of(st.none(), st.integers(1, 256)))
    return source, dest, mapping, exclude, max_gap, max_task_bytes


def held_without(source: ReplicaLayout, exclude: frozenset[int]) -> bool:
    """Whether the shards not excluded hold every element (by brute force)."""
    tensors = source.tensors()
    for name, t in tensors.items():
        seen = np.zeros(t.shape, dtype=bool)
        for i, s in enumerate(source.shards):
            if i in exclude:
                continue
            for pt in s:
                if pt.name == name:
                    for p in pt.pieces():
                        seen[tuple(slice(a, b) for a, b in zip(p.box.start, p.box.stop))] = True
        if not seen.all():
            return False
    return True


def box_bytes(box_start, box_shape, local_shape, itemsize) -> np.ndarray:
    """Byte offsets of a box's elements in a row-major local tensor, in the box's index order."""
    strides = [itemsize * math.prod(local_shape[d + 1 :]) for d in range(len(local_shape))]
    idx = np.indices(box_shape).reshape(len(box_shape), -1) if box_shape else np.zeros((0, 1), dtype=np.int64)
    first = (
        sum((a + idx[d]) * strides[d] for d, a in enumerate(box_start)) if box_shape else np.zeros(1, dtype=np.int64)
    )
    return np.asarray(first, dtype=np.int64)


def check_properties(p: ReshardPlan, source: ReplicaLayout, dest: ReplicaLayout, mapping, exclude, max_gap) -> None:
    derivations = resolve(mapping, source.tensors(), dest.tensors())
    # every destination byte fed exactly once
    for sp, tensors in zip(p.shards, dest.shards):
        assert [s.name for s in sp.tensors] == [pt.name for pt in tensors]
        fed = {s.name: np.zeros(s.shape, dtype=np.int64) for s in sp.tensors}
        for task in p.shards[sp.shard].tasks:
            result = task.region.shape
            for o in task.outputs:
                want_kind = SCALES if derivations[o.tensor].kind == FP8_SCALES else VALUES
                assert o.kind == want_kind
                bound = result if o.kind == VALUES else tuple(-(-n // b) for n, b in zip(result, task.block))
                assert all(0 <= a <= b <= n for a, b, n in zip(o.take.start, o.take.stop, bound)), (o, bound)
                fed[o.tensor][tuple(slice(a, a + n) for a, n in zip(o.at, o.take.shape))] += 1
        for name, count in fed.items():
            assert (count == 1).all(), f"destination shard {sp.shard}, {name!r}: fed {np.unique(count)} times"
    # reads tile regions; segments
    holders: dict[tuple[str, object], list[tuple[int, object, tuple[int, ...]]]] = {}
    for i, s in enumerate(source.shards):
        for pt in s:
            for piece in pt.pieces():
                holders.setdefault((pt.name, piece.box), []).append((i, piece, pt.local_shape()))
    loads = [0] * source.num_shards
    reads = []
    for sp in p.shards:
        for task in sp.tasks:
            tiled = np.zeros(task.region.shape, dtype=np.int64)
            for r in task.reads:
                assert r.shard not in exclude and r.tensor == task.source
                assert task.region.contains(r.box)
                tiled[tuple(slice(a - o, b - o) for a, b, o in zip(r.box.start, r.box.stop, task.region.start))] += 1
                mine = [(k, piece, local) for (name, box), hs in holders.items() if name == r.tensor and box.contains(r.box)
                        for k, piece, local in hs if k == r.shard]  # fmt: skip
                assert len(mine) == 1, "a read lies inside exactly one piece of its shard"
                _, piece, local = mine[0]
                itemsize = DTYPE_SIZES[task.dtype]
                segs = list(r.segments())
                nbytes = math.prod(local) * itemsize
                assert all(0 <= off and off + n <= nbytes for off, n in segs)
                assert all(a[0] + a[1] + max_gap < b[0] for a, b in zip(segs, segs[1:])), (
                    "a hole <= max_gap between segments"
                )
                start = tuple(a - b + c for a, b, c in zip(r.box.start, piece.box.start, piece.at))
                elem = box_bytes(start, r.box.shape, local, itemsize)
                starts = np.array([off for off, _ in segs], dtype=np.int64)
                k = np.searchsorted(starts, elem, side="right") - 1
                assert (k >= 0).all() and (elem + itemsize <= starts[k] + r.length).all(), "segments cover the box"
                landed = k * r.length + (elem - starts[k])
                idx = (
                    np.indices(r.box.shape).reshape(len(r.box.shape), -1)
                    if r.box.shape
                    else np.zeros((0, 1), dtype=np.int64)
                )
                by_strides = (
                    sum(idx[d] * r.strides[d] for d in range(len(r.strides))) * itemsize if r.box.shape else np.zeros(1)
                )
                assert (landed == by_strides).all(), "strides find the elements in the landed segments"
                covered = np.zeros(r.nbytes, dtype=bool)
                for e in landed:
                    covered[e : e + itemsize] = True
                assert covered.reshape(r.num_segments, r.length)[:, [0, -1]].all(), "segments start and end on the box"
                change = np.flatnonzero(np.diff(covered.astype(np.int8)))  # covered[i] != covered[i + 1]
                hole_starts, hole_ends = change[covered[change]] + 1, change[~covered[change]] + 1
                assert (hole_ends - hole_starts <= max_gap).all(), "a hole > max_gap inside a segment"
                loads[r.shard] += r.nbytes
                reads.append((r, task.dtype, piece, local))
            assert (tiled == 1).all(), "reads tile the task's region"
    assert list(p.loads) == loads
    top = max(loads) if loads else 0
    for r, dtype, piece, local in reads:
        if loads[r.shard] != top:
            continue
        for k, other, olocal in holders[(r.tensor, piece.box)]:
            if k == r.shard or k in exclude:
                continue
            shift = tuple(a - b for a, b in zip(other.at, other.box.start))
            g = segments_of(r.box.shift(shift), olocal, DTYPE_SIZES[dtype], max_gap)
            theirs = g[1] * math.prod(g[2])
            assert theirs > r.nbytes or loads[k] + theirs >= top, (
                f"read of {r.tensor!r} could move from shard {r.shard} to {k}"
            )


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(problem=problems(), data_seed=st.integers(0, 1 << 30))
def test_plans_feed_every_byte_once_from_minimal_balanced_reads(problem, data_seed):
    source, dest, mapping, exclude, max_gap, max_task_bytes = problem
    if not held_without(source, exclude):
        with pytest.raises(InvalidPlacement):
            plan(source, dest, mapping, exclude=exclude)
        assume(False)
    p = plan(source, dest, mapping, max_gap=max_gap, max_task_bytes=max_task_bytes, exclude=exclude)
    check_properties(p, source, dest, mapping, exclude, max_gap)
    if max_task_bytes is not None:
        assert all(
            t.nbytes <= max_task_bytes or not t.region.start or t.region.shape[0] <= (t.block[0] if t.block else 1)
            for s in p.shards
            for t in s.tasks
        )
    run_and_compare(p, source, dest, mapping, random_full(source, torch.Generator().manual_seed(data_seed)))
    assert wire.from_plain(ReshardPlan, wire.to_plain(p)) == p
    assert plan(source, dest, mapping, max_gap=max_gap, max_task_bytes=max_task_bytes, exclude=exclude) == p
