"""Tests of the packing plan (``tensorhub.core.layout.plan_of``), of packing and unpacking real
tensors through a shard's transfer byte space (``tensorhub.transports.buffers.ShardBuffers``), and of the
per-unit checksums (``tensorhub.runtime.checksum``).

What must hold, whatever the layout:

- the regions (packs, then large tensors) are contiguous and cover ``[0, total_bytes)``; every
  non-empty tensor lies whole inside exactly one of them, at ``tensor_offset``;
- the checksum units keep layout order, tile each tensor in ``chunk_bytes`` pieces (one empty
  unit for an empty tensor), number ``layout.checksum_count()``, and stay inside their region;
- ``reads(read_bytes)`` cover the space in order, whole units each, none longer than
  ``max(read_bytes, largest unit)``;
- packing moves bytes, not meaning: after ``pack()`` a tensor's transfer bytes are its bytes, a
  reader that receives the space and unpacks it holds identical tensors, and checksums do
  not depend on whether a tensor was packed.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import random

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.layout import PACK_MAX, Layout, Plan, TensorSpec, plan_of
from tensorhub.runtime.checksum import compute, digest, first_mismatch
from tensorhub.transports.buffers import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PACK_THRESHOLD,
    ShardBuffers,
    layout_of,
)
from tensorhub.transports.memory import _copy_views

pytestmark = pytest.mark.timeout(60)

KiB = 1 << 10
MiB = 1 << 20


def sized(name: str, nbytes: int) -> TensorSpec:
    return TensorSpec(name, "uint8", (nbytes,), nbytes)


def layout_of_sizes(sizes: list[int], pack_threshold: int, chunk_bytes: int = 4096) -> Layout:
    return Layout(tuple(sized(f"t{i}", n) for i, n in enumerate(sizes)), "xxh3-64", chunk_bytes, pack_threshold)


def as_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, whatever its dtype or shape (0-dim and empty included)."""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def transfer_bytes(b: ShardBuffers, offset: int, length: int) -> bytes:
    return b"".join(bytes(v) for v in b.views(offset, length))


def check_plan(lay: Layout, plan: Plan) -> None:
    """Every invariant of a packing plan that does not depend on a read size."""
    tensors = lay.tensors
    total = plan.total_bytes
    assert total == lay.total_bytes
    # Regions: packs first, then large tensors; contiguous from 0 to total.
    pos = 0
    for r in plan.regions:
        assert r.offset == pos, f"region {r} does not start where the last one ended ({pos})"
        pos += r.nbytes
    assert pos == total
    kinds = [r.tensor is None for r in plan.regions]
    assert kinds == sorted(kinds, reverse=True), "a pack after a large tensor"
    tiny = [i for i, t in enumerate(tensors) if t.nbytes < lay.pack_threshold]
    large = [i for i, t in enumerate(tensors) if t.nbytes >= lay.pack_threshold and t.nbytes]
    assert [r.tensor for r in plan.regions if r.tensor is not None] == large  # layout order
    members = [m for r in plan.regions if r.tensor is None for m in r.members]
    # Layout order, across packs; tiny tensors that are all empty make no pack at all.
    assert [i for i, _ in members] == (tiny if any(tensors[i].nbytes for i in tiny) else [])
    for r in plan.regions:
        if r.tensor is not None:
            assert r.members == () and r.nbytes == tensors[r.tensor].nbytes
            assert r.offset == plan.tensor_offset[r.tensor]
        else:
            fill = 0
            for i, off in r.members:  # members tile their pack, end to end
                assert off == fill and plan.tensor_offset[i] == r.offset + off
                fill += tensors[i].nbytes
            assert fill == r.nbytes
            assert r.nbytes <= PACK_MAX or len(r.members) == 1, "a pack over PACK_MAX with more than one tensor"
    # Each non-empty tensor lies whole inside exactly one region; together they tile the space.
    spans = []
    for i, t in enumerate(tensors):
        off = plan.tensor_offset[i]
        assert 0 <= off <= total
        if not t.nbytes:
            continue
        spans.append((off, t.nbytes))
        overlapping = [r for r in plan.regions if r.offset < off + t.nbytes and off < r.offset + r.nbytes]
        assert len(overlapping) == 1, f"tensor {i} overlaps {len(overlapping)} regions"
        r = overlapping[0]
        assert r.offset <= off and off + t.nbytes <= r.offset + r.nbytes
        assert r.tensor == i or i in {m for m, _ in r.members}
    pos = 0
    for off, n in sorted(spans):
        assert off == pos, "tensors overlap or leave a gap"
        pos += n
    assert pos == total
    # Units: layout order, index == position, tiling each tensor in chunk_bytes pieces.
    assert len(plan.units) == lay.checksum_count()
    assert [u.index for u in plan.units] == list(range(len(plan.units)))
    by_tensor: dict[int, list] = {}
    for u in plan.units:
        by_tensor.setdefault(u.tensor, []).append(u)
    assert [u.tensor for u in plan.units] == sorted(u.tensor for u in plan.units)
    assert sorted(by_tensor) == list(range(len(tensors)))
    for i, t in enumerate(tensors):
        us = by_tensor[i]
        if not t.nbytes:
            assert [(u.start, u.length) for u in us] == [(0, 0)], "an empty tensor has exactly one empty unit"
        else:
            expect = [(s, min(lay.chunk_bytes, t.nbytes - s)) for s in range(0, t.nbytes, lay.chunk_bytes)]
            assert [(u.start, u.length) for u in us] == expect
        for u in us:
            assert u.offset == plan.tensor_offset[i] + u.start
            if u.length:
                r = plan.regions[u.region]
                assert r.offset <= u.offset and u.offset + u.length <= r.offset + r.nbytes, f"unit {u} outside region {r}"
                assert r.tensor == i or i in {m for m, _ in r.members}
            elif u.region != -1:  # an empty unit: no region, or a region whose span reaches its offset
                r = plan.regions[u.region]
                assert r.offset <= u.offset <= r.offset + r.nbytes, f"empty unit {u} outside region {r}"


def check_reads(plan: Plan, read_bytes: int) -> None:
    reads = plan.reads(read_bytes)
    assert plan.reads(read_bytes) is reads  # cached per read size
    units = plan.units
    if not units:
        assert reads == ()
        return
    largest = max(u.length for u in units)
    pos = 0
    seen: list[int] = []
    for r in reads:
        assert r.offset == pos, f"read {r} leaves a gap or overlaps (expected offset {pos})"
        assert r.length <= max(read_bytes, largest), f"read {r} longer than max({read_bytes}, {largest})"
        at = r.offset
        for k in r.units:  # whole units, back to back, in transfer order
            u = units[k]
            assert u.offset == at, f"unit {u} is not where read {r} reaches ({at})"
            at += u.length
        assert at == r.offset + r.length
        seen += r.units
        pos += r.length
    assert pos == plan.total_bytes
    assert sorted(seen) == list(range(len(units))), "every unit in exactly one read"


# --- model-like layouts (specs only: no memory) ------------------------------------------------------

N_LAYERS = 50


def model_layout(pack_threshold: int = DEFAULT_PACK_THRESHOLD, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Layout:
    """A transformer-ish shard: per layer five large matrices (6 or 8 MiB of bfloat16) and five
    tiny tensors (layer norms, biases, a 0-dim scale); one empty tensor at the end. 250 large,
    250 tiny non-empty, about 1.9 GiB, built as specs only."""
    specs = []
    for k in range(N_LAYERS):
        p = f"layers.{k}."
        specs += [
            TensorSpec(p + "ln1.weight", "bfloat16", (1024,), 2 * KiB),
            TensorSpec(p + "attn.qkv.weight", "bfloat16", (3072, 1024), 6 * MiB),
            TensorSpec(p + "attn.qkv.bias", "float32", (3072,), 12 * KiB),
            TensorSpec(p + "attn.o.weight", "bfloat16", (1024, 4096), 8 * MiB),
            TensorSpec(p + "attn.o.bias", "float32", (1024,), 4 * KiB),
            TensorSpec(p + "ln2.weight", "bfloat16", (1024,), 2 * KiB),
            TensorSpec(p + "mlp.up.weight", "bfloat16", (4096, 1024), 8 * MiB),
            TensorSpec(p + "mlp.gate.weight", "bfloat16", (4096, 1024), 8 * MiB),
            TensorSpec(p + "mlp.down.weight", "bfloat16", (1024, 4096), 8 * MiB),
            TensorSpec(p + "mlp.scale", "float32", (), 4),
        ]
    specs.append(TensorSpec("lm_head.bias", "float32", (0,), 0))
    return Layout(tuple(specs), "xxh3-64", chunk_bytes, pack_threshold)


def test_model_like_layout_packs_its_tiny_tensors_into_one_region() -> None:
    lay = model_layout()
    plan = plan_of(lay)
    n_large = sum(t.nbytes >= lay.pack_threshold for t in lay.tensors)
    n_tiny = sum(0 < t.nbytes < lay.pack_threshold for t in lay.tensors)
    assert (n_large, n_tiny) == (250, 250)
    assert len(plan.regions) == n_large + 1  # every large tensor, plus one pack
    pack = plan.regions[0]
    assert pack.tensor is None and pack.offset == 0
    assert len(pack.members) == n_tiny + 1  # the empty tensor rides in the pack, taking no bytes
    assert pack.nbytes == sum(t.nbytes for t in lay.tensors if t.nbytes < lay.pack_threshold)
    assert len(plan.units) == lay.checksum_count() == 2 * n_large + n_tiny + 1
    check_plan(lay, plan)
    # Reads of 8 MiB: about one per large tensor (the pack rides with the first of them).
    reads = plan.reads(8 * MiB)
    check_reads(plan, 8 * MiB)
    assert n_large <= len(reads) <= n_large + 1, len(reads)
    for r in plan.regions[1:]:  # no large tensor is split over more than two reads
        assert sum(1 for x in reads if x.offset < r.offset + r.nbytes and r.offset < x.offset + x.length) <= 2


def test_model_like_layout_without_packing_is_one_region_per_non_empty_tensor() -> None:
    lay = model_layout(pack_threshold=0)
    plan = plan_of(lay)
    assert all(r.tensor is not None for r in plan.regions)
    assert [r.tensor for r in plan.regions] == [i for i, t in enumerate(lay.tensors) if t.nbytes]
    assert len(plan.regions) == 500
    check_plan(lay, plan)
    check_reads(plan, 8 * MiB)
    # Same bytes, same units (tensor, start, length), whatever the packing.
    packed = plan_of(model_layout())
    assert [(u.tensor, u.start, u.length) for u in plan.units] == [(u.tensor, u.start, u.length) for u in packed.units]
    assert plan.total_bytes == packed.total_bytes


def test_packs_split_at_pack_max() -> None:
    # Tiny by a huge threshold: five 100 MiB tensors fill packs of two, two and one; a 300 MiB
    # tiny tensor cannot be split, so it is a pack of its own.
    sizes = [100 * MiB] * 5 + [300 * MiB, 8, 100 * MiB]
    lay = layout_of_sizes(sizes, pack_threshold=1 << 30, chunk_bytes=1 << 30)
    plan = plan_of(lay)
    check_plan(lay, plan)
    assert [[i for i, _ in r.members] for r in plan.regions] == [[0, 1], [2, 3], [4], [5], [6, 7]]
    assert all(r.tensor is None for r in plan.regions)


def test_equal_layouts_share_one_plan() -> None:
    a = model_layout()
    specs = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in a.tensors)
    b = Layout(specs, a.checksum, a.chunk_bytes, a.pack_threshold)
    assert a == b and a is not b
    assert plan_of(a) is plan_of(b)
    assert plan_of(a) is not plan_of(model_layout(pack_threshold=0))


def test_a_pack_of_only_empty_tensors_is_not_a_zero_byte_region() -> None:
    """Zero-byte tensors have no region (``Plan.regions``): a layout whose only tiny tensors are
    empty must not get a pack of zero bytes (a region one-sided transports would register)."""
    lay = layout_of_sizes([0, 5000, 0], pack_threshold=64)
    plan = plan_of(lay)
    assert [r.nbytes for r in plan.regions] == [5000], plan.regions
    check_plan(lay, plan)


def test_an_empty_tensor_at_offset_zero_rides_with_the_first_read() -> None:
    """"Zero-length units ride with the read that reaches their offset" (``Plan.reads``): an
    empty tensor at the very start must not become a zero-length read of its own when the first
    unit after it is longer than ``read_bytes``."""
    lay = layout_of_sizes([0, 5000], pack_threshold=0)
    plan = plan_of(lay)
    check_reads(plan, 100)
    reads = plan.reads(100)
    assert all(r.length > 0 for r in reads), reads
    assert [(r.offset, r.length) for r in reads] == [(0, 4096), (4096, 904)]
    assert reads[0].units == (0, 1)


# --- the plan's invariants, as a property --------------------------------------------------------------


@st.composite
def plan_layouts(draw) -> tuple[Layout, int]:
    chunk = draw(st.integers(4096, 3 * 4096), label="chunk_bytes")
    threshold = draw(st.one_of(st.just(0), st.integers(1, 64), st.integers(0, 3 * chunk)), label="pack_threshold")

    def near(x: int) -> st.SearchStrategy[int]:
        return st.integers(max(0, x - 2), x + 2)

    size = st.one_of(
        st.just(0), st.integers(1, 64), near(threshold), near(chunk), near(2 * chunk), st.integers(0, 3 * chunk)
    )
    sizes = draw(st.lists(size, max_size=12), label="sizes")
    read_bytes = draw(st.one_of(st.integers(1, 64), st.integers(1, 4 * chunk), near(chunk), near(2 * chunk)), label="read_bytes")
    return layout_of_sizes(sizes, threshold, chunk), read_bytes


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(plan_layouts())
def test_plan_invariants_property(case: tuple[Layout, int]) -> None:
    lay, read_bytes = case
    plan = plan_of(lay)
    check_plan(lay, plan)
    check_reads(plan, read_bytes)
    check_reads(plan, lay.chunk_bytes)
    specs = tuple(TensorSpec(t.name, t.dtype, t.shape, t.nbytes) for t in lay.tensors)
    again = Layout(specs, lay.checksum, lay.chunk_bytes, lay.pack_threshold)
    assert plan_of(again) is plan


# --- pack / unpack with real tensors -------------------------------------------------------------------


def filled(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random bytes (0 or 1 for bool), any shape, 0-dim and empty included."""
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (n * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).clone()


#: Odd sizes and every awkward dtype: tiny and large depending on the threshold, some chunked.
ODD_TENSORS: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
    ("embed", torch.float32, (37, 129)),  # 19092 bytes: five units of 4096
    ("ln.weight", torch.bfloat16, (129,)),
    ("q8", torch.float8_e4m3fn, (1000,)),
    ("e5", torch.float8_e5m2, (333,)),
    ("mask", torch.bool, (17,)),
    ("step", torch.int64, ()),
    ("phase", torch.complex64, (7,)),
    ("empty", torch.float16, (0, 3)),
    ("proj", torch.bfloat16, (3001,)),  # 6002 bytes: a unit boundary inside
    ("blob", torch.uint8, (9000,)),  # tiny below a 10000 threshold, yet three units
    ("small.int", torch.int16, (5,)),
    ("double", torch.float64, (3, 3)),
    ("empty2", torch.complex64, (0,)),
]


def odd_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: filled(shape, dtype, gen) for name, dtype, shape in ODD_TENSORS}


def receive(dst: ShardBuffers, src: ShardBuffers, read_bytes: int = 8192) -> None:
    """What a transport does: move the transfer space, read by read, into ``dst``'s memory."""
    for r in src.plan.reads(read_bytes):
        _copy_views(src.views(r.offset, r.length), dst.views(r.offset, r.length))  # the two may cut differently


def check_round_trip(
    tensors: dict[str, torch.Tensor], pack_threshold: int, chunk_bytes: int = 4096, src_in_place: bool = False, dst_in_place: bool = False
) -> None:
    """A holder's buffers to a reader's, read by read, each side with copied or in-place packs."""
    lay = layout_of(tensors, chunk_bytes=chunk_bytes, pack_threshold=pack_threshold)
    src = ShardBuffers(tensors, lay, packs_in_place=src_in_place)
    has_tiny = any(0 < t.nbytes < pack_threshold for t in lay.tensors)  # empty ones need no pack
    assert (src.packed, src.packs_in_place) == (has_tiny and not src_in_place, has_tiny and src_in_place)
    src.pack()
    names = list(tensors)
    for i, name in enumerate(names):  # each tensor's transfer bytes are its bytes
        off, n = src.plan.tensor_offset[i], lay.tensors[i].nbytes
        assert transfer_bytes(src, off, n) == as_bytes(tensors[name]), name
    whole = transfer_bytes(src, 0, src.total_bytes)
    check_spans(src, whole)
    clone = src.clone_cpu()  # an offload copy: always copied packs, the same space
    assert not clone.packs_in_place and transfer_bytes(clone, 0, clone.total_bytes) == whole
    zeros = {name: torch.zeros_like(t) for name, t in tensors.items()}
    dst = ShardBuffers(zeros, layout_of(zeros, chunk_bytes=chunk_bytes, pack_threshold=pack_threshold), packs_in_place=dst_in_place)
    assert dst.layout == lay and dst.plan is src.plan
    receive(dst, src)
    assert transfer_bytes(dst, 0, dst.total_bytes) == whole
    for i, name in enumerate(names):  # large tensors (and in place, tiny ones) are received in place
        if lay.tensors[i].nbytes >= pack_threshold or dst_in_place:
            assert as_bytes(zeros[name]) == as_bytes(tensors[name]), name
        else:
            assert not any(as_bytes(zeros[name])), f"{name} changed before unpack"
    dst.unpack()
    for name in names:
        got, want = zeros[name], tensors[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert as_bytes(got) == as_bytes(want), name
    # copy_in / copy_out cut ranges the same way (what staging transports use).
    for z in zeros.values():
        z.zero_()
    rng = random.Random(len(whole))
    cuts = sorted({0, dst.total_bytes, *(rng.randrange(dst.total_bytes + 1) for _ in range(5))})
    for a, b in itertools.pairwise(cuts):
        dst.copy_in(a, memoryview(whole)[a:b])
        out = bytearray(b - a)
        dst.copy_out(a, memoryview(out))
        assert bytes(out) == whole[a:b]
    assert transfer_bytes(dst, 0, dst.total_bytes) == whole


def check_spans(b: ShardBuffers, whole: bytes) -> None:
    """``spans`` give the addresses of exactly the bytes ``views`` give, for any range."""
    rng = random.Random(len(whole))
    for _ in range(8):
        a = rng.randrange(len(whole) + 1)
        n = rng.randrange(len(whole) - a + 1)
        spans = b.spans(a, n)
        assert sum(k for _, k in spans) == n and all(k > 0 for _, k in spans)
        assert b"".join(ctypes.string_at(addr, k) for addr, k in spans) == whole[a : a + n]


@pytest.mark.parametrize("in_place", ["neither", "holder", "reader", "both"])
@pytest.mark.parametrize("pack_threshold", [0, 1, 64, 4096, 10000, DEFAULT_PACK_THRESHOLD])
def test_pack_unpack_round_trip_of_odd_dtypes_and_sizes(seed: int, pack_threshold: int, in_place: str) -> None:
    check_round_trip(odd_tensors(seed), pack_threshold, src_in_place=in_place in ("holder", "both"),
                     dst_in_place=in_place in ("reader", "both"))  # fmt: skip


def test_in_place_packs_alias_the_tensors_and_name_what_is_wrong(seed: int) -> None:
    """An in-place pack is the tiny tensors' own memory: a change shows at once, publish copies
    nothing; regions holds None for it; CUDA-only calls and out-of-range spans say why not."""
    tensors = odd_tensors(seed)
    b = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=4096), packs_in_place=True)
    assert b.packs_in_place and not b.packed
    k = next(i for i, r in enumerate(b.plan.regions) if r.tensor is None)
    assert b.regions[k] is None
    parts = b.parts(k)
    assert parts is not None and sum(n for _, n in parts) == b.plan.regions[k].nbytes
    assert b.parts(k + 1) is None
    i = list(tensors).index("ln.weight")
    off, n = b.plan.tensor_offset[i], b.layout.tensors[i].nbytes
    tensors["ln.weight"].view(torch.uint8)[:] ^= 0xFF  # no pack() needed: it aliases
    assert transfer_bytes(b, off, n) == as_bytes(tensors["ln.weight"])
    with pytest.raises(InvalidArgument, match=r"byte range \[0, \d+\) is outside the shard"):
        b.spans(0, b.total_bytes + 1)
    assert b.spans(3, 0) == []


def test_pack_copies_and_is_repeatable(seed: int) -> None:
    tensors = odd_tensors(seed)
    b = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=4096))
    b.pack()
    before = transfer_bytes(b, 0, b.total_bytes)
    i = list(tensors).index("ln.weight")
    off, n = b.plan.tensor_offset[i], b.layout.tensors[i].nbytes
    tensors["ln.weight"].view(torch.uint8)[:] ^= 0xFF  # the pack holds a copy, not an alias
    assert transfer_bytes(b, 0, b.total_bytes) == before
    b.pack()
    after = transfer_bytes(b, 0, b.total_bytes)
    assert after[off : off + n] == as_bytes(tensors["ln.weight"]) != before[off : off + n]
    assert after[:off] + after[off + n :] == before[:off] + before[off + n :]
    b.pack()
    assert transfer_bytes(b, 0, b.total_bytes) == after


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool,
          torch.int64, torch.complex64, torch.uint8, torch.int16, torch.float64]


@pytest.mark.property
@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), max_size=3)), min_size=1, max_size=8
    ),
    pack_threshold=st.sampled_from([0, 1, 16, 100, 4096, 1 << 20]),
    gen_seed=st.integers(0, 1 << 30),
    src_in_place=st.booleans(),
    dst_in_place=st.booleans(),
)
def test_pack_unpack_round_trip_property(specs, pack_threshold: int, gen_seed: int, src_in_place: bool, dst_in_place: bool) -> None:
    gen = torch.Generator().manual_seed(gen_seed)
    tensors = {f"t{i}": filled(tuple(shape), dtype, gen) for i, (dtype, shape) in enumerate(specs)}
    check_round_trip(tensors, pack_threshold, src_in_place=src_in_place, dst_in_place=dst_in_place)


# --- checksums -------------------------------------------------------------------------------------------


def reference_checksums(tensors: dict[str, torch.Tensor], plan: Plan) -> list[int]:
    """xxh3-64 of each unit's bytes, taken from the tensors themselves, not the transfer space."""
    data = [as_bytes(t) for t in tensors.values()]
    return [xxhash.xxh3_64_intdigest(data[u.tensor][u.start : u.start + u.length]) for u in plan.units]


def test_checksums_depend_on_tensor_bytes_not_on_packing(seed: int) -> None:
    tensors = odd_tensors(seed)
    packed = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096))  # default threshold: all tiny
    unpacked = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=0))
    assert packed.packed and not unpacked.packed
    packed.pack()
    want = reference_checksums(tensors, unpacked.plan)
    assert compute(unpacked) == want
    assert compute(packed) == want
    assert len(want) == packed.layout.checksum_count() == unpacked.layout.checksum_count()
    assert digest(b"") in want  # the empty tensors' units
    assert digest(b"tensorhub") == xxhash.xxh3_64_intdigest(b"tensorhub")
    # A subset, in the order asked for.
    pick = [len(want) - 1, 0, 3]
    assert compute(packed, pick) == [want[k] for k in pick]


@pytest.mark.parametrize("pack_threshold", [0, 4096, 10000])
def test_a_flipped_byte_is_found_in_its_unit_and_only_there(seed: int, pack_threshold: int) -> None:
    tensors = odd_tensors(seed)
    src = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=pack_threshold))
    src.pack()
    expected = compute(src)
    zeros = {name: torch.zeros_like(t) for name, t in tensors.items()}
    dst = ShardBuffers(zeros, src.layout)
    assert first_mismatch(dst, range(len(expected)), expected) is not None  # nothing received yet
    receive(dst, src)
    plan = dst.plan
    units = plan.units
    reads = plan.reads(8192)
    everything = [k for r in reads for k in r.units]
    assert first_mismatch(dst, everything, expected) is None
    rng = random.Random(seed)
    total = dst.total_bytes
    positions = {0, total - 1, 4095, 4096, plan.tensor_offset[list(tensors).index("mask")]}
    positions |= {rng.randrange(total) for _ in range(4)}
    for p in sorted(positions):
        (holder,) = [u for u in units if u.offset <= p < u.offset + u.length]
        (view,) = dst.views(p, 1)
        view[0] ^= 0x5A
        try:
            assert first_mismatch(dst, everything, expected) == holder.index, p
            for u in units:
                assert first_mismatch(dst, [u.index], expected) == (u.index if u is holder else None), (p, u)
            for r in reads:
                assert first_mismatch(dst, r.units, expected) == (holder.index if holder.index in r.units else None)
            got = compute(dst)
            assert [k for k in range(len(got)) if got[k] != expected[k]] == [holder.index]
        finally:
            view[0] ^= 0x5A
    assert first_mismatch(dst, everything, expected) is None


def test_expected_checksums_of_the_wrong_length_are_refused(seed: int) -> None:
    tensors = odd_tensors(seed)
    b = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=4096))
    b.pack()
    expected = compute(b)
    for wrong in (expected[:-1], expected + [0], []):
        with pytest.raises(InvalidArgument, match=f"{len(wrong)} checksums for a layout of {len(expected)}"):
            first_mismatch(b, [0], wrong)


def test_an_unknown_checksum_algorithm_is_refused_by_name(seed: int) -> None:
    tensors = odd_tensors(seed)
    good = layout_of(tensors, chunk_bytes=4096, pack_threshold=4096)
    lay = Layout(good.tensors, "crc32c-nope", good.chunk_bytes, good.pack_threshold)
    b = ShardBuffers(tensors, lay)
    with pytest.raises(InvalidArgument, match="crc32c-nope"):
        compute(b)
    with pytest.raises(InvalidArgument, match="crc32c-nope"):
        first_mismatch(b, [0], [0] * len(b.plan.units))


# --- clone_cpu ---------------------------------------------------------------------------------------------


def test_clone_cpu_of_a_packed_shard(seed: int) -> None:
    tensors = odd_tensors(seed)
    src = ShardBuffers(tensors, layout_of(tensors, chunk_bytes=4096, pack_threshold=4096))
    assert src.packed
    src.pack()
    before = transfer_bytes(src, 0, src.total_bytes)
    clone = src.clone_cpu()
    assert clone.layout == src.layout and clone.plan is src.plan
    assert clone.tensors == [] and clone.packed
    assert transfer_bytes(clone, 0, clone.total_bytes) == before
    assert compute(clone) == compute(src)
    assert clone.progress is not src.progress
    # Independent memory: no region of the clone shares storage with the original's.
    src_ptrs = {t.untyped_storage().data_ptr() for t in src.regions}
    assert not src_ptrs & {t.untyped_storage().data_ptr() for t in clone.regions}
    for t in tensors.values():  # change every source tensor and repack: the clone keeps its bytes
        t.reshape(-1).view(torch.uint8)[:] ^= 1
    src.pack()
    assert transfer_bytes(src, 0, src.total_bytes) != before
    assert transfer_bytes(clone, 0, clone.total_bytes) == before
    # No user tensors: unpack and pack do nothing (and touch nothing of the original).
    theirs = {name: as_bytes(t) for name, t in tensors.items()}
    for v in clone.views(0, clone.total_bytes):
        v[:] = b"\x07" * len(v)
    clone.unpack()
    clone.pack()
    assert transfer_bytes(clone, 0, clone.total_bytes) == b"\x07" * clone.total_bytes
    assert {name: as_bytes(t) for name, t in tensors.items()} == theirs
