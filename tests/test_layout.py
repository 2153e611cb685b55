"""Unit and property tests of layouts (``tensorhub.core.layout``): validation of tensor specs and
layouts, equality, the wire form, and the number of checksum units."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core import messages as m
from tensorhub.core import wire
from tensorhub.core.errors import MalformedMessage
from tensorhub.core.layout import DTYPE_SIZES, MAX_DIMS, MAX_TENSORS, Layout, TensorSpec

MiB = 1 << 20


def spec(name: str = "w", dtype: str = "float32", shape: tuple[int, ...] = (4, 4)) -> TensorSpec:
    return TensorSpec(name, dtype, shape, math.prod(shape) * DTYPE_SIZES[dtype])


def layout(*tensors: TensorSpec, checksum: str = "xxh3-64", chunk_bytes: int = MiB, pack_threshold: int = 0) -> Layout:
    return Layout(tuple(tensors), checksum, chunk_bytes, pack_threshold)


def sized(name: str, nbytes: int) -> TensorSpec:
    return TensorSpec(name, "uint8", (nbytes,), nbytes)


# --- TensorSpec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_every_dtype(dtype):
    t = spec(dtype=dtype, shape=(3, 5))
    assert t.nbytes == 15 * DTYPE_SIZES[dtype]


def test_dtype_sizes():
    assert DTYPE_SIZES["bfloat16"] == 2 and DTYPE_SIZES["float8_e4m3fn"] == 1
    assert DTYPE_SIZES["complex128"] == 16 and DTYPE_SIZES["bool"] == 1
    assert all(isinstance(v, int) and v in (1, 2, 4, 8, 16) for v in DTYPE_SIZES.values())


@pytest.mark.parametrize(
    "shape, nbytes",
    [((), 4), ((0,), 0), ((5, 0, 3), 0), ((1,) * MAX_DIMS, 4), ((1024, 1024), 4 * MiB)],
)
def test_valid_shapes(shape, nbytes):
    assert TensorSpec("t", "float32", shape, nbytes).nbytes == nbytes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": ""}, "name"),
        ({"name": "n" * 1025}, "name"),
        ({"dtype": "float128"}, "dtype"),
        ({"dtype": "torch.float32"}, "dtype"),
        ({"dtype": "Float32"}, "dtype"),
        ({"dtype": ""}, "dtype"),
        ({"shape": (-1, 4), "nbytes": -16}, "shape"),
        ({"shape": (True, 4), "nbytes": 16}, "shape"),
        ({"shape": (2.0, 4), "nbytes": 32}, "shape"),
        ({"shape": (1,) * (MAX_DIMS + 1), "nbytes": 4}, "shape"),
        ({"nbytes": 63}, "nbytes"),
        ({"nbytes": 65}, "nbytes"),
        ({"nbytes": 0}, "nbytes"),
        ({"nbytes": -64}, "nbytes"),
    ],
    ids=repr,
)
def test_invalid_tensor_specs(kwargs, match):
    args = {"name": "w", "dtype": "float32", "shape": (4, 4), "nbytes": 64} | kwargs
    with pytest.raises(ValueError, match=match):
        TensorSpec(**args)


def test_long_name_at_limit():
    assert spec(name="n" * 1024).name == "n" * 1024


def test_tensor_spec_is_frozen_and_slotted():
    t = spec()
    assert not hasattr(t, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.nbytes = 1  # type: ignore[misc]


# --- Layout --------------------------------------------------------------------------------------


def test_valid_layout():
    lay = layout(spec("a"), spec("b", "bfloat16", (8,)), pack_threshold=4096)
    assert lay.total_bytes == 64 + 16
    assert [t.name for t in lay.tensors] == ["a", "b"]


def test_empty_layout():
    lay = layout()
    assert lay.total_bytes == 0 and lay.checksum_count() == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensors": (spec("a"), spec("a", "int8"))}, "unique"),
        ({"checksum": ""}, "checksum"),
        ({"checksum": "c" * 33}, "checksum"),
        ({"chunk_bytes": 4095}, "chunk_bytes"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": -MiB}, "chunk_bytes"),
        ({"pack_threshold": -1}, "pack_threshold"),
    ],
    ids=repr,
)
def test_invalid_layouts(kwargs, match):
    args = {"tensors": (spec("a"),), "checksum": "xxh3-64", "chunk_bytes": MiB, "pack_threshold": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        Layout(**args)


def test_limits_are_inclusive():
    assert layout(spec(), checksum="c" * 32, chunk_bytes=4096).chunk_bytes == 4096
    assert layout(spec(), checksum="c").checksum == "c"


def test_too_many_tensors():
    t = spec()
    with pytest.raises(ValueError, match=str(MAX_TENSORS)):
        Layout((t,) * (MAX_TENSORS + 1), "xxh3-64", MiB, 0)


def test_order_matters_for_equality():
    a, b = spec("a"), spec("b")
    assert layout(a, b) == layout(a, b)
    assert hash(layout(a, b)) == hash(layout(a, b))
    assert layout(a, b) != layout(b, a)
    assert layout(a, b) != layout(a, b, pack_threshold=1)
    assert layout(a, b) != layout(a, b, chunk_bytes=2 * MiB)
    assert layout(a, b) != layout(a, b, checksum="crc64")
    assert layout(a) != layout(spec("a", shape=(16,)))  # same bytes, other shape


# --- checksum units ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, chunk, expect",
    [
        ((), MiB, 0),
        ((0,), MiB, 1),  # an empty tensor still has one checksum
        ((1,), MiB, 1),
        ((MiB,), MiB, 1),
        ((MiB + 1,), MiB, 2),
        ((2 * MiB,), MiB, 2),
        ((2 * MiB + 1,), MiB, 3),
        ((10, 20, 30), MiB, 3),
        ((0, MiB + 1, 5), MiB, 4),
        ((4096 * 3,), 4096, 3),
        ((4096 * 3 - 1,), 4096, 3),
    ],
)
def test_checksum_count(sizes, chunk, expect):
    lay = layout(*(sized(f"t{i}", n) for i, n in enumerate(sizes)), chunk_bytes=chunk)
    assert lay.checksum_count() == expect
    assert lay.total_bytes == sum(sizes)


@st.composite
def layouts(draw) -> Layout:
    names = draw(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=6))
    tensors = []
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=3000), max_size=3)))
        tensors.append(TensorSpec(name, dtype, shape, math.prod(shape) * DTYPE_SIZES[dtype]))
    return Layout(
        tuple(tensors),
        draw(st.text(min_size=1, max_size=32)),
        draw(st.integers(min_value=4096, max_value=1 << 40)),
        draw(st.integers(min_value=0, max_value=1 << 40)),
    )


@pytest.mark.property
@settings(max_examples=150, deadline=None)
@given(layouts())
def test_checksum_count_property(lay):
    expect = sum(max(1, math.ceil(t.nbytes / lay.chunk_bytes)) for t in lay.tensors)
    assert lay.checksum_count() == expect
    assert len(lay.tensors) <= lay.checksum_count()
    # every checksum unit but the last of each tensor covers a full chunk
    assert lay.checksum_count() <= len(lay.tensors) + lay.total_bytes // lay.chunk_bytes


@pytest.mark.property
@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_round_trips_on_the_wire(lay):
    assert wire.from_plain(Layout, wire.to_plain(lay)) == lay
    msg = m.Register(req=1, session=2, layout=lay, endpoint=None)
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.property
@settings(max_examples=100, deadline=None)
@given(layouts())
def test_equal_declarations_give_equal_layouts(lay):
    again = Layout(tuple(TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in lay.tensors), lay.checksum,
                   lay.chunk_bytes, lay.pack_threshold)
    assert again == lay and hash(again) == hash(lay)
    assert again.checksum_count() == lay.checksum_count()


def test_layout_plain_form():
    lay = layout(spec("a", "bfloat16", (2, 3)))
    assert wire.to_plain(lay) == {
        "tensors": [{"name": "a", "dtype": "bfloat16", "shape": [2, 3], "nbytes": 12}],
        "checksum": "xxh3-64",
        "chunk_bytes": MiB,
        "pack_threshold": 0,
    }


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p["tensors"][0].update(nbytes=13),
        lambda p: p["tensors"][0].update(dtype="float128"),
        lambda p: p["tensors"].append(dict(p["tensors"][0])),
        lambda p: p.update(chunk_bytes=4095),
        lambda p: p.update(checksum=""),
        lambda p: p["tensors"][0].update(shape=[2, "3"]),
        lambda p: p["tensors"][0].update(shape=[2, True]),
        lambda p: p["tensors"][0].update(extra=1),
        lambda p: p.pop("pack_threshold"),
    ],
)
def test_invalid_plain_layouts_are_malformed(mutate):
    plain = wire.to_plain(layout(spec("a", "bfloat16", (2, 3))))
    mutate(plain)
    with pytest.raises(MalformedMessage):
        wire.from_plain(Layout, plain)
