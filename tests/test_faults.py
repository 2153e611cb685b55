"""Tests of the fault-injecting transport wrapper (``tensorhub.transports.faults``): each fault op fires at
the right byte and at the right reads (``times``, ``after``, ``version``), the wrapper stands in
for the transport it wraps, and malformed fault specs are refused naming the field.

The reads go through real transports (``memory``, and ``tcp`` on 127.0.0.1); every transport a
test starts is closed before it ends, and every sleep is short and bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.runtime.actor import run
from tensorhub.transports.base import RangeNotReady, Transport
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.faults import MAX_SECONDS, FaultyTransport, FiredFault, wrap
from tensorhub.transports.memory import MemoryTransport
from tensorhub.transports.registry import get_transport

pytestmark = [pytest.mark.timeout(60)]

REGION, VERSION = 5, 40
SENTINEL = 0xAB


def tensors() -> dict[str, torch.Tensor]:
    return {
        "small": torch.zeros(300, dtype=torch.bfloat16),
        "odd": torch.zeros(1001, dtype=torch.int8),
        "large": torch.zeros(3 << 20, dtype=torch.uint8),
    }


def fill(buf: ShardBuffers, data: bytes) -> None:
    pos = 0
    for v in buf.views(0, buf.total_bytes):
        v[:] = data[pos : pos + len(v)]
        pos += len(v)


def raw(buf: ShardBuffers) -> bytes:
    return b"".join(bytes(v) for v in buf.views(0, buf.total_bytes))


class Setup:
    """A holder serving one shard of seeded bytes (as VERSION and VERSION + 1), and a reader
    wrapped in faults."""

    def __init__(self, holder: Transport, reader: FaultyTransport, held: ShardBuffers, data: bytes) -> None:
        self.holder, self.reader, self.held, self.data = holder, reader, held, data

    def into(self) -> ShardBuffers:
        t = tensors()
        buf = ShardBuffers(t, layout_of(t))
        fill(buf, bytes([SENTINEL]) * buf.total_bytes)
        self.reader.expose(buf)
        return buf

    async def read(self, into: ShardBuffers, offset: int, length: int, version: int = VERSION) -> int:
        return await asyncio.wait_for(
            self.reader.read(self.holder.endpoint(), REGION, version, offset, length, into, None), 10.0
        )


@contextlib.asynccontextmanager
async def setup(seed: int, faults: list[dict], inner: str = "memory") -> AsyncIterator[Setup]:
    cls = get_transport(inner)
    holder = cls({"wait_timeout": 1.0})
    reader = wrap(cls({"wait_timeout": 1.0}), faults)
    t = tensors()
    held = ShardBuffers(t, layout_of(t))
    data = random.Random(seed).randbytes(held.total_bytes)
    fill(held, data)
    # The same bytes stand for two versions (two holdings of one region), to test "version".
    other = ShardBuffers(tensors(), held.layout)
    fill(other, data)
    holdings = {(REGION, VERSION): held, (REGION, VERSION + 1): other}
    await holder.start()
    try:
        await reader.start()
        try:
            holder.serve(lambda region, version: holdings.get((region, version)))
            for version, buf in ((VERSION, held), (VERSION + 1, other)):
                holder.expose(buf)
                buf.progress.reset(version, buf.total_bytes)
            yield Setup(holder, reader, held, data)
        finally:
            await reader.close()
    finally:
        await holder.close()


# --- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        ("delay", r"fault 0 must be a dict"),
        ({}, r"fault 0: field 'op' must be one of"),
        ({"op": "explode"}, r"field 'op' must be one of \['corrupt', 'delay', 'fail', 'stall'\], got 'explode'"),
        ({"op": "delay"}, r"fault 0 \(delay\): field 'seconds' is required"),
        ({"op": "delay", "seconds": -1}, r"field 'seconds' must be a finite number"),
        ({"op": "stall", "seconds": math.inf}, r"field 'seconds' must be a finite number"),
        ({"op": "stall", "seconds": math.nan}, r"field 'seconds' must be a finite number"),
        ({"op": "delay", "seconds": MAX_SECONDS + 1}, r"field 'seconds' must be a finite number"),
        ({"op": "delay", "seconds": True}, r"field 'seconds' must be a finite number"),
        ({"op": "delay", "seconds": "1"}, r"field 'seconds' must be a finite number"),
        ({"op": "fail"}, r"fault 0 \(fail\): field 'at' is required"),
        ({"op": "fail", "at": -1}, r"field 'at' must be an integer >= 0, got -1"),
        ({"op": "corrupt", "at": 1.5}, r"field 'at' must be an integer >= 0, got 1.5"),
        ({"op": "corrupt", "at": False}, r"field 'at' must be an integer >= 0, got False"),
        ({"op": "fail", "at": 3, "times": -1}, r"field 'times' must be an integer >= 0"),
        ({"op": "fail", "at": 3, "version": "7"}, r"field 'version' must be an integer >= 0"),
        ({"op": "fail", "at": 3, "after": None}, r"field 'after' must be an integer >= 0"),
        ({"op": "delay", "seconds": 1, "at": 3}, r"fault 0 \(delay\): unknown fields 'at'"),
        ({"op": "corrupt", "at": 3, "seconds": 1}, r"unknown fields 'seconds'"),
        ({"op": "fail", "at": 3, "bogus": 1}, r"unknown fields 'bogus'"),
    ],
)
def test_malformed_faults_are_refused_naming_the_field(fault: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        FaultyTransport(MemoryTransport(), [fault])  # type: ignore[list-item]


def test_the_bad_fault_is_named_by_its_index() -> None:
    with pytest.raises(InvalidArgument, match=r"fault 2 \(stall\): field 'seconds'"):
        wrap(MemoryTransport(), [{"op": "delay", "seconds": 0}, {"op": "fail", "at": 0}, {"op": "stall", "seconds": -2}])


def test_faults_must_be_a_list_and_the_inner_a_transport() -> None:
    with pytest.raises(InvalidArgument, match="faults must be a list of dicts, got dict"):
        FaultyTransport(MemoryTransport(), {"op": "fail", "at": 0})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="wraps a Transport instance, got type"):
        FaultyTransport(MemoryTransport, [])  # type: ignore[arg-type]


def test_valid_faults_are_plain_msgpack_data_kept_as_given() -> None:
    faults = [
        {"op": "delay", "seconds": 0.5},
        {"op": "stall", "seconds": 2, "times": 0},
        {"op": "fail", "at": 10, "version": 3, "after": 1},
        {"op": "corrupt", "at": 0, "times": 2},
    ]
    t = wrap(MemoryTransport(), faults)
    assert list(t.faults) == faults
    assert msgpack.unpackb(msgpack.packb(list(t.faults), strict_types=True)) == faults
    faults[0]["seconds"] = 99  # the wrapper keeps its own copies
    assert t.faults[0]["seconds"] == 0.5


# --- standing in for the inner transport -----------------------------------------------------------


def test_the_wrapper_stands_in_for_its_inner_transport() -> None:
    async def main() -> None:
        inner = get_transport("tcp")()
        t = wrap(inner, [])
        assert (t.name, t.one_sided, t.cuda, t.cross_host) == ("tcp", False, False, True)
        assert t.streams == inner.streams  # other attributes are the inner's
        await t.start()
        try:
            assert t.endpoint() == inner.endpoint() == {"host": "127.0.0.1", "port": inner.port}
            marker = object()
            t.serve(lambda region, version: marker)  # type: ignore[arg-type,return-value]
            assert inner.resolve(1, 2) is marker and t.resolve(1, 2) is marker
        finally:
            await t.close()
        assert inner._closed

        mem = MemoryTransport()
        w = wrap(mem, [])
        assert (w.name, w.one_sided, w.cross_host) == ("memory", True, False)
        buf = ShardBuffers(tensors(), layout_of(tensors()))
        w.expose(buf)
        assert mem._is_exposed(buf)
        w.withdraw(buf)
        assert not mem._is_exposed(buf)
        with pytest.raises(AttributeError):
            _ = w.no_such_attribute
        await w.close()

    run(main())


# --- the ops ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["memory", "tcp"])
def test_fail_writes_the_bytes_before_its_byte_then_raises(seed: int, inner: str) -> None:
    at = 70_001

    async def main() -> None:
        async with setup(seed, [{"op": "fail", "at": at}], inner) as s:
            into = s.into()
            a, b = 1000, 200_000
            with pytest.raises(TransportError, match=f"injected fault 0: the peer died at shard byte {at}") as info:
                await s.read(into, a, b - a)
            assert not isinstance(info.value, RangeNotReady)
            got = raw(into)
            assert got[a:at] == s.data[a:at]  # what landed before the peer "died"
            assert got[at:] == bytes([SENTINEL]) * (len(got) - at) and got[:a] == bytes([SENTINEL]) * a
            assert s.reader.fired == [FiredFault(0, "fail", REGION, VERSION, a, b - a)]
            # It fired once (times defaults to 1): the same read now succeeds.
            assert await s.read(into, a, b - a) == s.held.progress.generation
            assert raw(into)[a:b] == s.data[a:b]
            assert len(s.reader.fired) == 1

    run(main())


def test_fail_at_the_first_byte_writes_nothing_and_reads_not_covering_it_are_untouched(seed: int) -> None:
    async def main() -> None:
        async with setup(seed, [{"op": "fail", "at": 500, "times": 2}]) as s:
            into = s.into()
            await s.read(into, 0, 500)  # ends just before the byte: not matched
            await s.read(into, 501, 100)  # starts just after it
            assert s.reader.fired == []
            for _ in range(2):
                with pytest.raises(TransportError, match="died at shard byte 500"):
                    await s.read(into, 500, 1)
            assert raw(into)[500] == SENTINEL
            await s.read(into, 500, 1)  # times=2: spent
            assert raw(into)[: 601] == s.data[:601]
            assert [f.offset for f in s.reader.fired] == [500, 500]

    run(main())


def test_corrupt_flips_exactly_its_byte_after_the_read_lands(seed: int) -> None:
    at = 123_457

    async def main() -> None:
        async with setup(seed, [{"op": "corrupt", "at": at}]) as s:
            into = s.into()
            total = s.held.total_bytes
            gen = await s.read(into, 0, total)
            assert gen == s.held.progress.generation  # the read "succeeds": a checksum must catch it
            got = raw(into)
            assert got[at] == s.data[at] ^ 0xFF
            assert got[:at] == s.data[:at] and got[at + 1 :] == s.data[at + 1 :]
            assert s.reader.fired == [FiredFault(0, "corrupt", REGION, VERSION, 0, total)]
            await s.read(into, 0, total)
            assert raw(into) == s.data

    run(main())


def test_delay_sleeps_before_the_read_and_adds_up(seed: int) -> None:
    async def main() -> None:
        faults = [{"op": "delay", "seconds": 0.1}, {"op": "delay", "seconds": 0.15, "times": 2}]
        async with setup(seed, faults) as s:
            into = s.into()
            t0 = time.monotonic()
            await s.read(into, 0, 1000)
            assert time.monotonic() - t0 >= 0.25 * 0.9  # both fired
            t0 = time.monotonic()
            await s.read(into, 0, 1000)
            second = time.monotonic() - t0
            assert second >= 0.15 * 0.9
            assert raw(into)[:1000] == s.data[:1000]
            assert [f.fault for f in s.reader.fired] == [0, 1, 1]
            await s.read(into, 0, 1000)  # both spent
            assert len(s.reader.fired) == 3

    run(main())


def test_stall_hangs_then_fails_and_a_close_ends_it_early(seed: int) -> None:
    async def main() -> None:
        async with setup(seed, [{"op": "stall", "seconds": 0.2}]) as s:
            into = s.into()
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="injected fault 0: the peer wedged for 0.2 s"):
                await s.read(into, 0, 1000)
            assert time.monotonic() - t0 >= 0.2 * 0.9
            assert raw(into)[:1000] == bytes([SENTINEL]) * 1000  # nothing was read
            await s.read(into, 0, 1000)
            assert raw(into)[:1000] == s.data[:1000]

        async with setup(seed, [{"op": "stall", "seconds": 60}]) as s:
            task = asyncio.ensure_future(s.read(s.into(), 0, 1000))
            await asyncio.sleep(0.05)
            assert not task.done()
            t0 = time.monotonic()
            await s.reader.close()
            with pytest.raises(TransportError, match="closed during an injected stall"):
                await asyncio.wait_for(task, 5.0)
            assert time.monotonic() - t0 < 5.0

    run(main())


def test_after_skips_the_first_matching_reads_only(seed: int) -> None:
    async def main() -> None:
        async with setup(seed, [{"op": "fail", "at": 2000, "after": 2}]) as s:
            into = s.into()
            for _ in range(3):
                await s.read(into, 5000, 100)  # does not cover byte 2000: not counted
            await s.read(into, 0, 4000)
            await s.read(into, 1999, 2)
            assert s.reader.fired == []
            with pytest.raises(TransportError, match="died at shard byte 2000"):
                await s.read(into, 2000, 10)  # the third matching read
            await s.read(into, 2000, 10)  # times=1: spent
            assert s.reader.fired == [FiredFault(0, "fail", REGION, VERSION, 2000, 10)]

    run(main())


def test_version_restricts_a_fault_to_reads_of_that_version(seed: int) -> None:
    async def main() -> None:
        async with setup(seed, [{"op": "corrupt", "at": 10, "version": VERSION + 1, "times": 0}]) as s:
            into = s.into()
            for _ in range(3):
                await s.read(into, 0, 100)
                assert raw(into)[:100] == s.data[:100]
            for _ in range(3):  # times=0: every read of that version
                await s.read(into, 0, 100, version=VERSION + 1)
                assert raw(into)[10] == s.data[10] ^ 0xFF
            assert [(f.version, f.fault) for f in s.reader.fired] == [(VERSION + 1, 0)] * 3

    run(main())


def test_a_read_that_ends_at_an_earlier_stage_is_not_seen_by_later_faults(seed: int) -> None:
    """A stall that fires ends the read: a fail fault on the same byte does not count it."""

    async def main() -> None:
        faults = [{"op": "fail", "at": 0}, {"op": "stall", "seconds": 0.01}, {"op": "corrupt", "at": 0}]
        async with setup(seed, faults) as s:
            into = s.into()
            with pytest.raises(TransportError, match="wedged"):
                await s.read(into, 0, 10)
            with pytest.raises(TransportError, match="died at shard byte 0"):
                await s.read(into, 0, 10)
            await s.read(into, 0, 10)
            assert raw(into)[0] == s.data[0] ^ 0xFF
            assert [(f.fault, f.op) for f in s.reader.fired] == [(1, "stall"), (0, "fail"), (2, "corrupt")]

    run(main())


def test_inner_errors_pass_through_unchanged(seed: int) -> None:
    async def main() -> None:
        async with setup(seed, [{"op": "delay", "seconds": 0}]) as s:
            into = s.into()
            with pytest.raises(TransportError, match="does not hold that version"):
                await s.reader.read(s.holder.endpoint(), REGION, VERSION + 7, 0, 10, into, None)
            assert len(s.reader.fired) == 1

    run(main())
