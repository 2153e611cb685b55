"""Placements (``tensorhub.core.placement``) against torch's own rules: the chunk rule of
``torch.chunk`` and DTensor, nested sharding as DTensor computes it, packed tensors as vLLM's
loaders shard them; validation with errors naming the tensor; the wire form; and the DTensor
adapter (``tensorhub.reshard.dtensor``) on a fake process group."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tensorhub.core import wire
from tensorhub.core.errors import InvalidPlacement, MalformedMessage
from tensorhub.core.layout import Layout
from tensorhub.core.placement import (
    REPLICATE,
    Box,
    PlacedTensor,
    ReplicaLayout,
    Replicate,
    Shard,
    TensorPlacement,
    chunk_range,
)

from .reshard_ref import torch_placements, vllm_packed

# --- the chunk rule ----------------------------------------------------------------------------


@given(size=st.integers(0, 80), n=st.integers(1, 12))
def test_chunk_rule_is_torch_chunk_and_dtensor(size, n):
    ranges = [chunk_range(size, n, r) for r in range(n)]
    # DTensor: exactly n shards, the same sizes and offsets (an empty one may start anywhere)
    for r, (a, b) in enumerate(ranges):
        length, offset = TShard.local_shard_size_and_offset(size, n, r)
        assert b - a == length
        if length:
            assert a == offset
    # torch.chunk: the non-empty chunks, which may be fewer than n
    chunks = torch.arange(size).chunk(n) if size else ()
    nonempty = [(a, b) for a, b in ranges if b > a]
    assert [(int(c[0]), int(c[-1]) + 1) for c in chunks] == nonempty
    # they tile [0, size) in order
    assert (
        ranges[0][0] == 0
        and ranges[-1][1] == size
        and all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1) if ranges[i + 1][1] > ranges[i + 1][0])
    )


def test_the_uneven_rule_keeps_empty_trailing_shards():
    assert [chunk_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert len(torch.arange(5).chunk(4)) == 3  # torch.chunk drops the empty one; a DTensor shard is empty


@st.composite
def placements(draw, max_dims=3, max_mesh_dims=3):
    nd = draw(st.integers(1, max_dims))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_mesh_dims)))
    dims = tuple(draw(st.lists(st.integers(REPLICATE, nd - 1), min_size=len(mesh), max_size=len(mesh))))
    return TensorPlacement("t", "float32", shape, mesh, dims)


@given(t=placements())
def test_nested_sharding_is_dtensors(t):
    for coord in t.coords():
        shape, offset = _compute_local_shape_and_global_offset(t.shape, t.mesh, list(coord), torch_placements(t.dims))
        assert t.local_shape(coord) == tuple(shape)
        pieces = t.pieces(coord)
        if math.prod(shape):
            (p,) = pieces
            assert p.box == Box(tuple(offset), tuple(o + n for o, n in zip(offset, shape)))
            assert p.at == (0,) * len(shape)
        else:
            assert pieces == ()


@given(t=placements())
def test_pieces_of_a_replica_are_equal_or_disjoint_and_cover(t):
    boxes = {p.box for c in t.coords() for p in t.pieces(c)}
    assert sum(b.volume for b in boxes) == math.prod(t.shape)
    for a in boxes:
        for b in boxes:
            assert a == b or a.intersect(b) is None


# --- packed tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_packed_qkv_is_what_vllm_ranks_hold(tp, seed):
    # grouped-query attention: 8 query heads, 2 KV heads of 4 rows: KV replicated when tp > 2
    head, q, kv, hidden = 4, 8 * 4, 2 * 4, 6
    t = TensorPlacement.of("qkv", "float32", (q + 2 * kv, hidden), Shard(0), tp, parts=(q, kv, kv), unit=head)
    full = torch.randn(q + 2 * kv, hidden, generator=torch.Generator().manual_seed(seed))
    for r in range(tp):
        (coord,) = [(r,)]
        pieces = t.pieces(coord)
        mine = torch.cat([full[p.box.start[0] : p.box.stop[0]] for p in pieces])
        assert torch.equal(mine, vllm_packed(t, coord, full))
        assert t.local_shape(coord) == (q // tp + 2 * max(kv // tp, head), hidden)
        kv_head = r // (tp // 2) if tp > 2 else None
        if kv_head is not None:  # the rank's K piece is KV head r // (tp / kv_heads)
            assert pieces[1].box.start[0] == q + kv_head * head


def test_packed_parts_along_columns_and_a_second_mesh_dim():
    t = TensorPlacement.of("w", "bfloat16", (6, 12), (Shard(0), Shard(1)), (2, 2), parts=(8, 4), parts_dim=1)
    assert t.packed
    assert [p.box for p in t.pieces((1, 1))] == [Box((3, 4), (6, 8)), Box((3, 10), (6, 12))]
    assert [p.at for p in t.pieces((1, 1))] == [(0, 0), (0, 4)]
    assert t.local_shape((1, 1)) == (3, 6)


def test_unsharded_parts_are_one_piece():
    t = TensorPlacement.of("w", "float32", (6, 4), Replicate(), 2, parts=(4, 2))
    assert not t.packed
    assert t.pieces((1,)) == t.pieces((0,)) and len(t.pieces((0,))) == 1


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(shape=(4, 4), mesh=(2,), dims=(2,)), "Shard(2)"),
        (dict(shape=(4, 4), mesh=(2,), dims=(0, 1)), "2 placements"),
        (dict(shape=(4, 4), mesh=(0,), dims=(0,)), "bad mesh"),
        (dict(shape=(4, -1)), "shape"),
        (dict(shape=(4, 4), dtype="float128"), "dtype"),
        (dict(shape=(6, 4), mesh=(2,), dims=(0,), parts=(4, 3)), "add up"),
        (dict(shape=(6, 4), mesh=(2,), dims=(0,), parts=(3, 3), unit=2), "whole units"),
        (dict(shape=(12, 4), mesh=(3,), dims=(0,), parts=(8, 4), unit=2), "replicated evenly"),
        (dict(shape=(8, 4), mesh=(2, 2), dims=(0, 0), parts=(4, 4)), "one mesh dimension"),
        (dict(shape=(8, 4), unit=2), "packed"),
    ],
)
def test_bad_placements_name_the_tensor(kwargs, words):
    kwargs = {"dtype": "float32", **kwargs}
    with pytest.raises(InvalidPlacement, match=re.escape(words)) as info:
        TensorPlacement("layers.3.w", **kwargs)
    assert info.value.tensors == ("layers.3.w",)
    assert "'layers.3.w'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_coordinates_outside_the_mesh_are_refused():
    t = TensorPlacement.of("w", "float32", (4,), Shard(0), 2)
    with pytest.raises(InvalidPlacement, match="outside the mesh"):
        PlacedTensor(t, (2,))
    with pytest.raises(InvalidPlacement, match="outside the mesh"):
        t.pieces((0, 0))


def test_shards_that_disagree_or_repeat_a_tensor_are_refused():
    a = TensorPlacement.of("w", "float32", (4, 4), Shard(0), 2)
    b = TensorPlacement.of("w", "float32", (4, 4), Shard(1), 2)
    with pytest.raises(InvalidPlacement, match="disagree on tensor 'w'") as info:
        ReplicaLayout(((PlacedTensor(a, (0,)),), (PlacedTensor(b, (1,)),)))
    assert info.value.tensors == ("w",) and info.value.shard == 1
    with pytest.raises(InvalidPlacement, match="twice"):
        ReplicaLayout(((PlacedTensor(a, (0,)), PlacedTensor(a, (1,))),))


def test_an_incomplete_replica_is_found():
    t = TensorPlacement.of("w", "float32", (4, 4), Shard(0), 4)
    layout = ReplicaLayout(((PlacedTensor(t, (0,)),), (PlacedTensor(t, (1,)),), (PlacedTensor(t, (3,)),)))
    with pytest.raises(InvalidPlacement, match="12 of its 16") as info:
        layout.check_complete()
    assert info.value.tensors == ("w",)
    ReplicaLayout.spmd([t], 4).check_complete()
    with pytest.raises(InvalidPlacement, match="does not span"):
        ReplicaLayout.spmd([t], 3)


def test_layouts_and_wire_form():
    t = TensorPlacement.of("w", "bfloat16", (10, 4), (Replicate(), Shard(0)), (2, 3))
    layout = ReplicaLayout.spmd([t, TensorPlacement("n", "float32", (4,))], 6)
    assert layout.shards[5][0].coord == (1, 2)
    shard5 = layout.layout(5, chunk_bytes=1 << 20)
    assert isinstance(shard5, Layout)
    assert [(s.name, s.shape, s.nbytes) for s in shard5.tensors] == [("w", (2, 4), 16), ("n", (4,), 16)]
    assert wire.from_plain(ReplicaLayout, wire.to_plain(layout)) == layout
    assert t.placements == (Replicate(), Shard(0)) and repr(t.placements) == "(Replicate(), Shard(0))"
    bad = wire.to_plain(t)
    bad["dims"] = [0, 5]
    with pytest.raises(MalformedMessage, match="Shard"):
        wire.from_plain(TensorPlacement, bad)


# --- DTensors ----------------------------------------------------------------------------------


@pytest.fixture
def fake_world():
    """This process as rank 5 of 8 of torch's fake process group (no communication)."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("no torch.distributed, or a process group is already set up")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_placements_from_dtensors(fake_world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import _StridedShard

    from tensorhub.reshard.dtensor import placed_tensors, placement_of, replica_layout

    mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"))
    assert tuple(mesh.get_coordinate()) == (1, 1)
    dt = DTensor.from_local(
        torch.zeros(5, 3), mesh, [TShard(0), TShard(1)], run_check=False, shape=torch.Size([10, 10]), stride=(10, 1)
    )
    t, coord = placement_of("w", dt)
    assert (t.shape, t.mesh, t.dims, coord, t.dtype) == ((10, 10), (2, 4), (0, 1), (1, 1), "float32")
    assert t.local_shape(coord) == tuple(dt.to_local().shape) == (5, 3)
    rep = DTensor.from_local(
        torch.zeros(4), mesh, [TReplicate(), TShard(-1)], run_check=False, shape=torch.Size([16]), stride=(1,)
    )
    assert placement_of("b", rep)[0].dims == (REPLICATE, 0)
    plain = torch.zeros(3, dtype=torch.bfloat16)
    assert placement_of("n", plain) == (TensorPlacement("n", "bfloat16", (3,)), ())
    assert [p.coord for p in placed_tensors([("w", dt), ("n", plain)])] == [(1, 1), ()]
    layout = replica_layout([("w", dt), ("n", plain)], 8)
    assert layout.num_shards == 8 and layout.shards[5][0].coord == (1, 1)
    layout.check_complete()
    for bad in (Partial(), _StridedShard(0, split_factor=2)):
        odd = DTensor.from_local(
            torch.zeros(5, 10), mesh, [bad, TReplicate()], run_check=False, shape=torch.Size([10, 10]), stride=(10, 1)
        )
        with pytest.raises(InvalidPlacement, match="not supported") as info:
            placement_of("layers.0.w", odd)
        assert info.value.tensors == ("layers.0.w",)
