"""Checksums computed as a read's bytes land (``tensorhub.runtime.checksum.LandingHasher``).

A transport that reports landing calls the hasher from its copy threads with pieces of a read,
in any order and from several threads at once. Whatever the cut and the order, the digests must
be exactly the checksums a second pass over the landed bytes computes (``checksum.compute``),
each unit must get its digest only once every byte of it landed, and bytes changed before they
land (a corruption on the way) must show in the digest of their unit.
"""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.core.errors import InvalidArgument
from tensorhub.runtime.checksum import LandingHasher, compute
from tensorhub.transports.buffers import ShardBuffers, layout_of

pytestmark = pytest.mark.timeout(60)


def shard(
    sizes: list[int], seed: int, chunk_bytes: int = 4096, pack_threshold: int = 2048
) -> ShardBuffers:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for i, n in enumerate(sizes)
    }
    b = ShardBuffers(
        tensors,
        layout_of(tensors, chunk_bytes=chunk_bytes, pack_threshold=pack_threshold),
    )
    b.pack()
    return b


def cuts(
    rng: random.Random, offset: int, length: int, pieces: int
) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` cut at ``pieces - 1`` random points, as (offset, length)."""
    points = sorted(
        {
            offset,
            offset + length,
            *(rng.randrange(offset, offset + length + 1) for _ in range(pieces - 1)),
        }
    )
    return [(a, b - a) for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20000), min_size=1, max_size=12),
    read_bytes=st.sampled_from([4096, 16384, 1 << 20]),
    pieces=st.integers(1, 12),
    threads=st.integers(1, 4),
    order_seed=st.integers(0, 2**32 - 1),
)
def test_digests_equal_a_second_pass_whatever_the_cut_order_and_threads(
    sizes, read_bytes, pieces, threads, order_seed
) -> None:
    b = shard(sizes, order_seed)
    expected = compute(b)
    units = b.plan.units
    rng = random.Random(order_seed)
    for read in b.plan.reads(read_bytes):
        h = LandingHasher(b, [units[u] for u in read.units])
        parts = cuts(rng, read.offset, read.length, pieces) if read.length else []
        rng.shuffle(parts)
        if threads == 1:
            for p in parts:
                h.landed(*p)
        else:
            barrier = threading.Barrier(threads)

            def land(
                hasher: LandingHasher,
                start: threading.Barrier,
                mine: list[tuple[int, int]],
            ) -> None:
                start.wait(5)
                for p in mine:
                    hasher.landed(*p)

            workers = [
                threading.Thread(target=land, args=(h, barrier, parts[k::threads]))
                for k in range(threads)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join(10)
            assert not any(w.is_alive() for w in workers)
        assert h.complete, (
            f"read {read}: not every unit got a digest ({len(h.digests)} of {len(read.units)})"
        )
        assert h.digests == {u: expected[u] for u in read.units}


def test_a_unit_has_no_digest_until_its_last_byte_landed() -> None:
    b = shard(
        [10000], 1, chunk_bytes=4096, pack_threshold=0
    )  # units of 4096, 4096, 1808 bytes
    units = b.plan.units
    h = LandingHasher(b, list(units))
    expected = compute(b)
    h.landed(
        4000, 4192
    )  # the end of the first unit (ahead of its start: it waits) and the whole second
    assert h.digests == {1: expected[1]} and not h.complete
    h.landed(0, 1000)
    assert h.digests == {1: expected[1]}
    h.landed(
        1000, 3000
    )  # reaches the waiting piece: the first unit is hashed to its end
    assert h.digests == {0: expected[0], 1: expected[1]} and not h.complete
    h.landed(8192, 1808)
    assert h.complete and h.digests == dict(enumerate(expected))


def test_a_byte_changed_before_it_landed_shows_in_its_units_digest_only() -> None:
    b = shard([5000, 9000, 300], 2, chunk_bytes=4096)
    units = b.plan.units
    expected = compute(b)
    (read,) = b.plan.reads(1 << 20)
    at = units[2].offset + 7  # inside the third unit
    (view,) = b.views(at, 1)
    view[0] ^= 0xFF
    h = LandingHasher(b, [units[u] for u in read.units])
    h.landed(read.offset, read.length)
    wrong = [u for u in read.units if h.digests[u] != expected[u]]
    assert wrong == [2]


def test_cuda_buffers_are_refused_with_a_typed_error() -> None:
    class FakeCuda:
        on_cuda = True

    with pytest.raises(InvalidArgument, match="CPU buffers"):
        LandingHasher(FakeCuda(), [])  # type: ignore[arg-type]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.lists(st.integers(1, 60), min_size=1, max_size=8),
       st.integers(0, 2**31 - 1))  # fmt: skip
def test_units_are_placed_in_the_segments_that_hold_them_whole(unit_sizes, seg_sizes, salt):
    """place_units (the GPU landing's vectorized bookkeeping): a unit lies wholly inside one
    segment exactly when it is placed, at that segment's addresses plus its offset in it; the
    segments that placed units do not cover entirely are the ones returned to copy whole."""
    import numpy as np

    from tensorhub.runtime.checksum import place_units

    rng = random.Random(salt)
    u_off = np.cumsum([0, *unit_sizes[:-1]]).astype(np.int64)
    u_len = np.array(unit_sizes, dtype=np.int64)
    total = int(u_off[-1] + u_len[-1])
    cuts = sorted({0, *(rng.randrange(total) for _ in seg_sizes)})  # segments tile [0, total)
    s_off = np.array(cuts, dtype=np.int64)
    s_len = np.diff([*cuts, total]).astype(np.int64)
    src = np.array([10**9 + 10**6 * k for k in range(len(cuts))], dtype=np.int64)
    dst = src + 5 * 10**8
    units, u_src, u_dst, lengths, rest = place_units(u_off, u_len, s_off, s_len, src, dst)
    covered = np.zeros(len(cuts), dtype=np.int64)
    for k in range(len(u_off)):
        seg = [j for j in range(len(cuts)) if s_off[j] <= u_off[k] and u_off[k] + u_len[k] <= s_off[j] + s_len[j]]
        if not seg:
            assert k not in units
            continue
        j = seg[0]
        at = int(np.flatnonzero(units == k)[0])
        rel = u_off[k] - s_off[j]
        assert (u_src[at], u_dst[at], lengths[at]) == (src[j] + rel, dst[j] + rel, u_len[k])
        covered[j] += u_len[k]
    assert rest.tolist() == [j for j in range(len(cuts)) if covered[j] < s_len[j]]


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_large_hash_split_over_threads_gives_the_serial_checksums_in_order(
    threads: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorhub.runtime import checksum

    rng = random.Random(seed)
    b = shard([rng.randrange(0, 40000) for _ in range(9)], seed)
    serial = [checksum.digest(v) for u in b.plan.units for v in (b.views(u.offset, u.length) or [b""])]
    monkeypatch.setenv("TENSORHUB_HASH_THREADS", str(threads))
    monkeypatch.setattr(checksum, "_PARALLEL_BYTES", 1)
    monkeypatch.setattr(checksum, "_GROUP_MIN", 4096)
    split = []
    real = checksum._unit_checksum

    def seen(buffers: ShardBuffers, u: object) -> int:
        split.append(threading.current_thread().name)
        return real(buffers, u)  # type: ignore[arg-type]

    monkeypatch.setattr(checksum, "_unit_checksum", seen)
    assert compute(b) == serial
    assert any(name.startswith("tensorhub-hash") for name in split), "nothing was hashed on another thread"
    # A byte flipped in the last unit shows in that unit's checksum only.
    last = b.plan.units[-1]
    (view,) = b.views(last.offset + last.length - 1, 1)
    view[0] ^= 0xFF
    got = compute(b)
    assert got[:-1] == serial[:-1] and got[-1] != serial[-1]


def test_a_bad_hash_thread_count_is_refused_with_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorhub.runtime import checksum

    b = shard([5000, 7000], 0)
    monkeypatch.setattr(checksum, "_PARALLEL_BYTES", 1)
    for bad in ("two", "0", "1000"):
        monkeypatch.setenv("TENSORHUB_HASH_THREADS", bad)
        with pytest.raises(InvalidArgument, match="TENSORHUB_HASH_THREADS"):
            compute(b)


def test_a_large_buffer_is_hashed_through_a_stream_that_releases_the_gil(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """python-xxhash's one-shot ``xxh3_64_intdigest`` holds the GIL in some versions (3.5.0),
    its ``update`` never: ``digest`` takes the stream for large buffers (the publisher's hash
    threads and the copy workers must hash at once), with the same values either way."""
    import xxhash

    from tensorhub.runtime import checksum

    data = torch.randint(0, 256, (checksum._RELEASE_BYTES * 3 + 5,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().data  # fmt: skip
    sizes = [0, 1, checksum._RELEASE_BYTES - 1, checksum._RELEASE_BYTES, len(data)]
    want = {n: xxhash.xxh3_64_intdigest(data[:n]) for n in sizes}
    one_shot = xxhash.xxh3_64_intdigest

    def small_only(buf: memoryview | bytes) -> int:
        n = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        assert n < checksum._RELEASE_BYTES, f"{n} bytes hashed by the one-shot function (it may hold the GIL)"
        return one_shot(buf)

    monkeypatch.setattr(checksum.xxhash, "xxh3_64_intdigest", small_only)
    assert {n: checksum.digest(data[:n]) for n in sizes} == want
    assert {n: checksum.digest(bytes(data[:n])) for n in sizes} == want
    # A whole unit landed in one piece goes through digest() too: the same guard holds there.
    b = shard([len(data)], seed, chunk_bytes=len(data))
    (view,) = b.views(0, len(data))
    view[:] = data
    h = LandingHasher(b, b.plan.units)
    h.landed(0, len(data))
    assert h.complete and h.digests == {0: want[len(data)]}


def test_a_whole_unit_reported_through_its_stream_gets_the_second_pass_checksum(seed: int) -> None:
    """``unit_stream``: one whole unit's pieces hashed in order give its checksum; a range that is
    not exactly one unit, or a unit already reported, gets no stream; a piece out of order is a
    typed error; a byte changed before its piece is hashed shows in that unit's digest only."""
    rng = random.Random(seed)
    b = shard([3 * 4096 + 100, 9000], seed)
    want = compute(b)
    big = [u for u in b.plan.units if u.length == 4096]
    u, other = big[0], big[1]
    h = LandingHasher(b, b.plan.units)
    assert h.unit_stream(u.offset, u.length - 1) is None and h.unit_stream(u.offset + 1, u.length - 1) is None
    sink = h.unit_stream(u.offset, u.length)
    assert sink is not None
    assert h.unit_stream(u.offset, u.length) is None, "a unit claimed by a stream got a second one"
    cut = sorted({u.offset, u.offset + u.length, *(u.offset + rng.randrange(1, u.length) for _ in range(3))})
    with pytest.raises(InvalidArgument, match="reported"):
        sink(cut[1], cut[2])  # not the next piece
    for a, z in itertools.pairwise(cut):
        assert u.index not in h.digests
        sink(a, z)
    assert h.digests[u.index] == want[u.index]
    for w in b.plan.units:  # the rest reported the usual way
        if w.index not in h.digests:
            h.landed(w.offset, w.length)
    assert h.complete and [h.digests[w.index] for w in b.plan.units] == want
    # A byte flipped before its piece is hashed (a corruption on the way) shows in its unit only.
    h2 = LandingHasher(b, b.plan.units)
    sink2 = h2.unit_stream(other.offset, other.length)
    assert sink2 is not None
    (view,) = b.views(other.offset + 4000, 1)
    view[0] ^= 0xFF
    sink2(other.offset, other.offset + other.length)
    for w in b.plan.units:
        if w.index != other.index:
            h2.landed(w.offset, w.length)
    got = [h2.digests[w.index] for w in b.plan.units]
    assert [i for i, (x, y) in enumerate(zip(got, want)) if x != y] == [other.index]
