"""Unit and property tests of a shard's buffers (``tensorhub.transports.buffers``): ``layout_of``, the
byte space of :class:`ShardBuffers` (segments and views on tensor boundaries), and the
:class:`ProgressCounter` words a reader checks (waits, generation bumps, timeouts)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument, InvalidName
from tensorhub.transports.buffers import ProgressCounter, Segment, ShardBuffers, layout_of, memory_of

pytestmark = pytest.mark.timeout(30)


def make(sizes: list[int], dtype: torch.dtype = torch.uint8) -> ShardBuffers:
    """Buffers of uint8 tensors with the given byte sizes; tensor i holds bytes (i*37 + k) % 251."""
    tensors = {f"t{i}": (torch.arange(n, dtype=torch.int64) + i * 37).remainder(251).to(dtype) for i, n in enumerate(sizes)}
    return ShardBuffers(tensors, layout_of(tensors, pack_threshold=0))  # unpacked: one region per tensor


def shard_bytes(b: ShardBuffers) -> bytes:
    """The transfer byte space."""
    return b"".join(bytes(v) for v in b.views(0, b.total_bytes))


def reference_segments(sizes: list[int], offset: int, length: int) -> list[Segment]:
    """Byte-by-byte reference: runs of consecutive bytes that fall in the same region (the
    non-empty tensors of an unpacked layout, numbered in order)."""
    owner = []
    for i, n in enumerate(n for n in sizes if n):
        owner += [(i, k) for k in range(n)]
    out: list[Segment] = []
    for pos in range(offset, offset + length):
        i, k = owner[pos]
        if out and out[-1].index == i:
            last = out[-1]
            out[-1] = Segment(i, last.start, last.offset, last.length + 1)
        else:
            out.append(Segment(i, k, pos, 1))
    return out


# --- layout_of -------------------------------------------------------------------------------------


def test_layout_of_keeps_dict_order_dtypes_and_sizes() -> None:
    tensors = {
        "w": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b": torch.zeros(5, dtype=torch.float32),
        "step": torch.zeros((), dtype=torch.int64),
        "mask": torch.zeros(7, dtype=torch.bool),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    lay = layout_of(tensors, chunk_bytes=8192, pack_threshold=1024)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in lay.tensors] == [
        ("w", "bfloat16", (3, 5), 30),
        ("b", "float32", (5,), 20),
        ("step", "int64", (), 8),
        ("mask", "bool", (7,), 7),
        ("empty", "float16", (0, 4), 0),
    ]
    assert (lay.chunk_bytes, lay.pack_threshold, lay.total_bytes) == (8192, 1024, 65)


@pytest.mark.parametrize(
    "tensors, error, match",
    [
        ({}, InvalidArgument, "non-empty dict"),
        ([torch.zeros(2)], InvalidArgument, "non-empty dict"),
        ({"a": [1, 2]}, InvalidArgument, "is a list, not a torch.Tensor"),
        ({"a": torch.zeros(4, 4).t()}, InvalidArgument, "not contiguous"),
        ({"a": torch.empty(2, dtype=torch.float8_e8m0fnu)}, InvalidArgument, "dtype float8_e8m0fnu"),
        ({"": torch.zeros(2)}, InvalidName, "1 to 1024 characters"),
        ({3: torch.zeros(2)}, InvalidName, "1 to 1024 characters"),
        ({"x" * 1025: torch.zeros(2)}, InvalidName, "1 to 1024 characters"),
    ],
)
def test_layout_of_refuses_bad_input(tensors, error, match) -> None:
    with pytest.raises(error, match=match):
        layout_of(tensors)


def test_layout_of_errors_carry_context() -> None:
    with pytest.raises(InvalidArgument) as info:
        layout_of({"a": torch.zeros(4, 4).t()}, ctx={"model": "m", "shard": 2})
    assert (info.value.model, info.value.shard) == ("m", 2)


# --- ShardBuffers: byte space ------------------------------------------------------------------------


def test_starts_and_total_bytes() -> None:
    b = make([4, 0, 10, 3])
    assert b.starts == [0, 4, 14]  # the empty tensor has no region
    assert b.total_bytes == 17 == b.layout.total_bytes
    assert not b.on_cuda


@pytest.mark.parametrize(
    "offset, length, expect",
    [
        (0, 17, [Segment(0, 0, 0, 4), Segment(1, 0, 4, 10), Segment(2, 0, 14, 3)]),
        (0, 4, [Segment(0, 0, 0, 4)]),  # ends exactly on a boundary (zero-size tensor 1 follows)
        (4, 10, [Segment(1, 0, 4, 10)]),  # starts on a boundary shared with an empty tensor
        (3, 2, [Segment(0, 3, 3, 1), Segment(1, 0, 4, 1)]),  # spans the empty tensor
        (13, 2, [Segment(1, 9, 13, 1), Segment(2, 0, 14, 1)]),
        (16, 1, [Segment(2, 2, 16, 1)]),  # the last byte
        (5, 0, []),
        (17, 0, []),  # an empty range at the very end
        (0, 0, []),
    ],
)
def test_segments_on_boundaries(offset: int, length: int, expect: list[Segment]) -> None:
    b = make([4, 0, 10, 3])
    assert b.segments(offset, length) == expect
    assert b.segments(offset, length) == reference_segments([4, 0, 10, 3], offset, length)


def test_segments_skip_leading_and_trailing_empty_tensors() -> None:
    b = make([0, 0, 5, 0])
    assert b.starts == [0]
    assert b.segments(0, 5) == [Segment(0, 0, 0, 5)]
    assert b.segments(2, 3) == [Segment(0, 2, 2, 3)]


@pytest.mark.parametrize("offset, length", [(-1, 1), (0, -1), (0, 18), (17, 1), (10, 8), (100, 0)])
def test_segments_outside_the_shard_are_refused(offset: int, length: int) -> None:
    b = make([4, 0, 10, 3])
    with pytest.raises(InvalidArgument, match="outside the shard's 17 bytes"):
        b.segments(offset, length)
    with pytest.raises(InvalidArgument):
        b.views(offset, length)


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8), data=st.data())
def test_segments_match_a_byte_by_byte_reference_property(sizes: list[int], data: st.DataObject) -> None:
    b = make(sizes)
    total = sum(sizes)
    offset = data.draw(st.integers(0, total), label="offset")
    length = data.draw(st.integers(0, total - offset), label="length")
    segs = b.segments(offset, length)
    assert segs == reference_segments(sizes, offset, length)
    assert all(s.length > 0 for s in segs)
    views = b.views(offset, length)
    assert [len(v) for v in views] == [s.length for s in segs]
    assert b"".join(bytes(v) for v in views) == shard_bytes(b)[offset : offset + length]


def test_views_alias_the_tensors_across_dtypes() -> None:
    tensors = {
        "a": torch.arange(6, dtype=torch.float32),
        "b": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int16),
    }
    b = ShardBuffers(tensors, layout_of(tensors, pack_threshold=0))
    assert b.total_bytes == 24 + 6 + 10
    whole = b"".join(bytes(v) for v in b.views(0, b.total_bytes))
    assert whole == shard_bytes(b)
    # Writing through a view that spans the float32 / bfloat16 boundary changes the tensors.
    views = b.views(20, 8)
    assert [len(v) for v in views] == [4, 4]
    views[0][:] = torch.tensor([42.0], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    views[1][:] = torch.tensor([7.0, -1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert tensors["a"][5].item() == 42.0
    assert tensors["b"].tolist() == [7.0, -1.0, 3.0]


def test_copy_out_and_copy_in_round_trip() -> None:
    src = make([5, 0, 9, 2])
    dst = make([5, 0, 9, 2])
    for t in dst.tensors:
        t.zero_()
    staging = memoryview(bytearray(7))
    src.copy_out(3, staging)
    assert bytes(staging) == shard_bytes(src)[3:10]
    dst.copy_in(3, staging)
    assert shard_bytes(dst)[3:10] == shard_bytes(src)[3:10]
    assert shard_bytes(dst)[:3] == b"\x00" * 3 and shard_bytes(dst)[10:] == b"\x00" * 6
    with pytest.raises(InvalidArgument):
        src.copy_out(10, memoryview(bytearray(7)))


def test_clone_cpu_copies() -> None:
    tensors = {"a": torch.arange(4, dtype=torch.int32), "b": torch.ones(3, dtype=torch.bfloat16)}
    b = ShardBuffers(tensors, layout_of(tensors, pack_threshold=0))
    c = b.clone_cpu()
    assert c.layout == b.layout and shard_bytes(c) == shard_bytes(b)
    tensors["a"][0] = 99
    assert shard_bytes(c) != shard_bytes(b)  # a copy, not an alias
    assert c.progress is not b.progress


def test_memory_of_is_a_writable_alias() -> None:
    t = torch.zeros(3, dtype=torch.int16)
    m = memory_of(t)
    assert len(m) == 6 and not m.readonly
    m[2:4] = b"\x05\x00"
    assert t.tolist() == [0, 5, 0]
    assert len(memory_of(torch.zeros(0))) == 0


# --- ProgressCounter -------------------------------------------------------------------------------


def test_counter_starts_empty() -> None:
    p = ProgressCounter()
    assert p.snapshot() == (1, None, 0)


def test_reset_bumps_the_generation_and_sets_the_holding() -> None:
    p = ProgressCounter()
    assert p.reset(7, 100) == 2
    assert p.snapshot() == (2, 7, 100)
    assert p.reset(None) == 3
    assert p.snapshot() == (3, None, 0)
    assert p.reset(8) == 4 and p.snapshot() == (4, 8, 0)  # verified may go down with a new generation


def test_advance_never_lowers() -> None:
    p = ProgressCounter()
    p.reset(1)
    p.advance(10)
    p.advance(5)
    p.advance(10)
    assert p.snapshot() == (2, 1, 10)
    p.advance(11)
    assert p.verified == 11
    assert p.generation == 2  # advancing is not a change of holding


def test_wait_covered_when_already_covered_returns_at_once() -> None:
    p = ProgressCounter()
    g = p.reset(3, 50)
    t0 = time.monotonic()
    assert p.wait_covered(3, 50, None, 30.0) == (g, True)
    assert p.wait_covered(3, 0, g, 30.0) == (g, True)
    assert p.wait_covered(3, 50, g, 0.0) == (g, True)
    assert time.monotonic() - t0 < 10.0  # at once, not after the 30 s timeout


def test_wait_covered_times_out_when_not_covered() -> None:
    p = ProgressCounter()
    g = p.reset(3, 50)
    t0 = time.monotonic()
    assert p.wait_covered(3, 51, None, 0.1) == (g, False)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.09  # the timeout was honoured
    assert p.wait_covered(3, 51, None, 0.0) == (g, False)


def test_wait_covered_refuses_another_generation_at_once() -> None:
    p = ProgressCounter()
    g = p.reset(3, 50)
    t0 = time.monotonic()
    assert p.wait_covered(3, 10, g - 1, 30.0) == (g, False)
    assert p.wait_covered(4, 10, g - 1, 30.0) == (g, False)
    assert time.monotonic() - t0 < 10.0  # at once, not after the 30 s timeout


def test_wait_covered_waits_for_a_version_not_held_yet() -> None:
    p = ProgressCounter()
    g = p.reset(3, 50)
    t0 = time.monotonic()
    assert p.wait_covered(4, 10, None, 0.1) == (g, False)  # never came: times out
    assert time.monotonic() - t0 >= 0.09
    timer = threading.Timer(0.05, lambda: (p.reset(4, 0), p.advance(20)))
    timer.start()
    try:  # a partial holder whose own grant arrives during the wait serves as it fills
        gen, covered = p.wait_covered(4, 10, None, 30.0)
        assert covered and gen == g + 1
    finally:
        timer.join(5.0)


def test_wait_covered_ends_when_the_version_held_goes_away() -> None:
    p = ProgressCounter()
    p.reset(3, 10)
    timer = threading.Timer(0.05, lambda: p.reset(None))
    t0 = time.monotonic()
    timer.start()
    try:
        assert p.wait_covered(3, 50, None, 30.0)[1] is False
        assert time.monotonic() - t0 < 10.0  # early, not after the 30 s timeout
    finally:
        timer.join(5.0)


def test_wait_covered_wakes_when_advanced_from_another_thread() -> None:
    p = ProgressCounter()
    g = p.reset(3, 0)
    steps = []

    def advance() -> None:
        for v in range(10, 101, 10):
            time.sleep(0.005)
            steps.append(v)
            p.advance(v)

    t = threading.Thread(target=advance)
    t0 = time.monotonic()
    t.start()
    try:
        assert p.wait_covered(3, 60, g, 30.0) == (g, True)
        assert time.monotonic() - t0 < 10.0  # early, not after the 30 s timeout
        assert p.verified >= 60
    finally:
        t.join(5.0)
    assert steps[-1] == 100


def test_wait_covered_ends_early_when_the_holding_changes() -> None:
    p = ProgressCounter()
    g = p.reset(3, 0)
    timer = threading.Timer(0.05, lambda: p.reset(3, 100))
    t0 = time.monotonic()
    timer.start()
    try:
        # The new generation covers the range, but the waiter asked for generation g.
        assert p.wait_covered(3, 60, g, 30.0) == (g + 1, False)
        assert time.monotonic() - t0 < 10.0  # early, not after the 30 s timeout
    finally:
        timer.join(5.0)


def test_wait_covered_without_a_generation_follows_a_reset_of_the_same_version() -> None:
    p = ProgressCounter()
    p.reset(3, 0)
    timer = threading.Timer(0.05, lambda: p.reset(3, 100))
    timer.start()
    try:
        assert p.wait_covered(3, 60, None, 30.0) == (3, True)
    finally:
        timer.join(5.0)


def test_wait_covered_ends_early_when_the_version_goes() -> None:
    p = ProgressCounter()
    p.reset(3, 0)
    timer = threading.Timer(0.05, lambda: p.reset(None))
    t0 = time.monotonic()
    timer.start()
    try:
        assert p.wait_covered(3, 60, None, 30.0) == (3, False)
        assert time.monotonic() - t0 < 10.0  # early, not after the 30 s timeout
    finally:
        timer.join(5.0)


def test_a_counter_dying_while_another_takes_its_words_does_not_deadlock() -> None:
    """A counter's finalizer gives its words back whenever the garbage collector runs, which
    can be inside the arena's ``take`` on the same thread (a lock there would deadlock)."""
    import gc

    from tensorhub.transports.buffers import WordsArena

    arena = WordsArena(chunk_slots=4)
    addr, _ = arena.take()
    arena._lock.acquire()  # as if take() were running when the finalizer fires
    try:
        t = threading.Thread(target=arena.give, args=(addr,), daemon=True)
        t.start()
        t.join(5.0)
        assert not t.is_alive(), "give() waited for the arena's lock"
    finally:
        arena._lock.release()
    assert arena.take()[0] == addr  # given back, and taken again
    gc.collect()
    counters = [ProgressCounter() for _ in range(5000)]
    del counters
    gc.collect()
    assert ProgressCounter().tag != 0
