"""Aborting reads in flight (``Transport.abort_reads``; issue 23's stragglers): when the server
revokes a grant, the reader ends the grant's reads instead of waiting a whole read for a slow
source.

- ``tcp``: a read held up by a slow holder (mid-payload), by a partial holder (waiting for the
  header), or by ``max_rate`` ends promptly with a TransportError; its connection is closed and
  never pooled; reads into other buffers go on; reads afterwards are byte-exact; aborts racing
  reads that complete never let a shut-down connection back into the pool.
- the engine: a grant revoked while a read from a slow holder is in flight ends that read, and
  the pull finishes from the next grant's source with the right bytes, far sooner than the slow
  read would have taken; the verified prefix and checksums are untouched (the aborted range is
  read again under the new grant).

Every transport and actor a test starts is closed before it ends; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from tensorhub.core import messages as m
from tensorhub.core.errors import TransportError
from tensorhub.core.topology import Location
from tensorhub.runtime import checksum
from tensorhub.runtime.actor import run
from tensorhub.runtime.engine import AddSlot, EngineActor
from tensorhub.transports.base import Transport
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.tcp import TcpTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

REGION, VERSION = 5, 3
MiB = 1 << 20


class _Trickle:
    """Stands in for a served connection: sends in pieces of ``piece`` bytes, ``pause`` s apart."""

    def __init__(self, conn: socket.socket, piece: int, pause: float) -> None:
        self.conn, self.piece, self.pause = conn, piece, pause

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        for pos in range(0, len(view), self.piece):
            self.conn.sendall(view[pos : pos + self.piece])
            if len(view) > self.piece:
                time.sleep(self.pause)


class SlowHolder(TcpTransport):
    """Holder side: serves payloads at about ``piece / pause`` bytes per second (a relay whose
    link slowed), while the connection stays healthy. ``pause`` may change while it serves."""

    def __init__(self, pause: float, piece: int = 64 << 10) -> None:
        super().__init__({})
        self.pause, self.piece = pause, piece  # pause 0.05 s: about 1.3 MB/s

    def _serve_one(
        self, conn: socket.socket, region: int, version: int, offset: int, length: int, generation: int, wait_ms: int
    ) -> None:
        trickle = _Trickle(conn, self.piece, self.pause)
        super()._serve_one(trickle, region, version, offset, length, generation, wait_ms)  # type: ignore[arg-type]


def shard(seed: int, nbytes: int = 4 * MiB, complete: bool = True) -> tuple[ShardBuffers, ShardBuffers]:
    """A holder's buffers (random content) and an empty reader's buffers with the same layout."""
    gen = torch.Generator().manual_seed(seed)
    src = {"a": torch.randn(nbytes // 8, generator=gen), "b": torch.randn(nbytes // 8, generator=gen)}
    lay = layout_of(src, chunk_bytes=MiB, pack_threshold=0)
    held = ShardBuffers(src, lay)
    held.progress.reset(VERSION, held.total_bytes if complete else 0)
    return held, ShardBuffers({k: torch.zeros_like(t) for k, t in src.items()}, lay)


def raw(b: ShardBuffers, offset: int = 0, length: int | None = None) -> bytes:
    n = b.total_bytes - offset if length is None else length
    return b"".join(bytes(v) for v in b.views(offset, n))


@contextlib.asynccontextmanager
async def started(*transports: Transport) -> AsyncIterator[None]:
    done: list[Transport] = []
    try:
        for t in transports:
            await t.start()
            done.append(t)
        yield
    finally:
        for t in reversed(done):
            await t.close()


def served(holder: TcpTransport, held: ShardBuffers) -> dict:
    holder.serve(lambda region, version: held if (region, version) == (REGION, VERSION) else None)
    return holder.endpoint()


def pooled(reader: TcpTransport) -> list[socket.socket]:
    with reader._lock:
        return [s for socks in reader._pool.values() for s in socks]


async def running_socks(reader: TcpTransport, into: ShardBuffers, n: int, timeout: float = 5.0) -> list[socket.socket]:
    """The connections of ``n`` reads into ``into`` once they all have one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with reader._lock:
            socks = [r.sock for r in reader._reads if r.into is into and r.sock is not None]
        if len(socks) >= n:
            return socks
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} reads into the buffers never got a connection")


# --- tcp --------------------------------------------------------------------------------------


def test_a_read_from_a_slow_holder_ends_promptly_and_its_connection_is_never_reused(seed: int) -> None:
    async def main() -> None:
        held, into = shard(seed)
        holder, reader = SlowHolder(pause=1.0), TcpTransport({"streams": 2})  # 1 MiB stripes of about 16 s
        async with started(holder, reader):
            ep = served(holder, held)
            # one read first, so that the slow one may take a pooled connection
            await reader.read(ep, REGION, VERSION, 0, 64 << 10, into, None)
            read = asyncio.ensure_future(reader.read(ep, REGION, VERSION, MiB, 2 * MiB, into, None))  # 2 stripes
            socks = await running_socks(reader, into, 2)
            await asyncio.sleep(0.2)  # mid-payload
            t0 = time.monotonic()
            assert reader.abort_reads(into) == 2
            with pytest.raises(TransportError, match="aborted"):
                await asyncio.wait_for(read, 5.0)
            assert time.monotonic() - t0 < 8.0  # it had about 15 s left (a bound only a hang exceeds)
            assert all(s.fileno() == -1 for s in socks)  # closed, not pooled
            assert not set(socks) & set(pooled(reader)) and not reader._in_use and not reader._reads
            assert reader.abort_reads(into) == 0  # nothing is left to end
            # reads afterwards work (the slow holder is only slow) and are byte-exact
            holder.pause = 0.0
            gen = await reader.read(ep, REGION, VERSION, 0, into.total_bytes, into, None)
            assert gen == held.progress.snapshot()[0]
            assert raw(into) == raw(held)
            assert pooled(reader) and all(s.fileno() != -1 for s in pooled(reader))

    run(main())


def test_a_read_waiting_for_a_partial_holder_or_for_max_rate_ends_promptly(seed: int) -> None:
    async def main() -> None:
        held, into = shard(seed, complete=False)  # covers nothing: the holder waits wait_timeout
        holder = TcpTransport({"wait_timeout": 60.0})
        waiting = TcpTransport({"wait_timeout": 60.0})
        capped = TcpTransport({"max_rate": 2.5e5})  # about 17 s for 4 MiB
        async with started(holder, waiting, capped):
            ep = served(holder, held)
            read = asyncio.ensure_future(waiting.read(ep, REGION, VERSION, 0, 64 << 10, into, None))
            await running_socks(waiting, into, 1)
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            assert waiting.abort_reads(into) == 1
            with pytest.raises(TransportError, match="aborted"):
                await asyncio.wait_for(read, 5.0)
            assert time.monotonic() - t0 < 20.0 and not pooled(waiting)  # it would have waited 60 s

            held.progress.reset(VERSION, held.total_bytes)
            read = asyncio.ensure_future(capped.read(ep, REGION, VERSION, 0, into.total_bytes, into, None))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            assert capped.abort_reads(into) == 4  # 4 stripes, none connected yet
            with pytest.raises(TransportError, match="max_rate"):
                await asyncio.wait_for(read, 5.0)
            assert time.monotonic() - t0 < 8.0 and not pooled(capped)  # it would have waited about 17 s
            # the aborted read gave its share of the rate back: the next one waits for its own only
            t0 = time.monotonic()
            await capped.read(ep, REGION, VERSION, 0, 256 << 10, into, None)
            assert time.monotonic() - t0 < 8.0  # its own share about 1 s; the aborted one's as well, about 17 s more
            assert raw(into, 0, 256 << 10) == raw(held, 0, 256 << 10)

    run(main())


def test_reads_into_other_buffers_go_on(seed: int) -> None:
    async def main() -> None:
        held, into = shard(seed)
        _, other = shard(seed)
        holder, reader = SlowHolder(pause=0.01), TcpTransport({"streams": 1})
        async with started(holder, reader):
            ep = served(holder, held)
            mine = asyncio.ensure_future(reader.read(ep, REGION, VERSION, 0, MiB, into, None))
            theirs = asyncio.ensure_future(reader.read(ep, REGION, VERSION, 0, MiB, other, None))
            await running_socks(reader, into, 1)
            await running_socks(reader, other, 1)
            assert reader.abort_reads(into) == 1
            with pytest.raises(TransportError, match="aborted"):
                await asyncio.wait_for(mine, 5.0)
            await asyncio.wait_for(theirs, 10.0)
            assert raw(other, 0, MiB) == raw(held, 0, MiB)

    run(main())


def test_aborts_racing_reads_that_complete_never_pool_a_dead_connection(seed: int) -> None:
    """Each read either lands byte-exact or fails with TransportError; after each round every
    pooled connection is open and serves the next read."""

    async def main() -> None:
        rng = random.Random(seed)
        held, _ = shard(seed, nbytes=MiB)
        holder, reader = TcpTransport(), TcpTransport({"streams": 2})
        async with started(holder, reader):
            ep = served(holder, held)
            outcomes = {"landed": 0, "aborted": 0}
            for _ in range(40):
                _, into = shard(seed, nbytes=MiB)
                reads = [asyncio.ensure_future(reader.read(ep, REGION, VERSION, o, 256 << 10, into, None))
                         for o in (0, 256 << 10, 512 << 10)]  # fmt: skip
                await asyncio.sleep(rng.uniform(0, 0.003))
                reader.abort_reads(into)
                for o, r in zip((0, 256 << 10, 512 << 10), await asyncio.gather(*reads, return_exceptions=True)):
                    if isinstance(r, BaseException):
                        assert isinstance(r, TransportError), r
                        outcomes["aborted"] += 1
                    else:
                        assert raw(into, o, 256 << 10) == raw(held, o, 256 << 10)
                        outcomes["landed"] += 1
                assert all(s.fileno() != -1 for s in pooled(reader)) and not reader._in_use and not reader._reads
                _, check = shard(seed, nbytes=MiB)
                await reader.read(ep, REGION, VERSION, 0, held.total_bytes, check, None)
                assert raw(check) == raw(held)
            assert outcomes["aborted"] > 0

    run(main())


def test_the_base_transport_aborts_nothing() -> None:
    _, into = shard(1, nbytes=MiB)
    assert Transport().abort_reads(into) == 0


# --- the engine ---------------------------------------------------------------------------------

HERE = Location("dc1", "h1", "")


def grant(n: int, replica: str, ep: dict, sums: tuple[int, ...]) -> m.Grant:
    """Grant ``n`` (term 1) of session 9 to pull ``VERSION`` from ``replica`` at tcp endpoint ``ep``."""
    src = m.SourceInfo(session=1, replica=replica, shard_idx=0, kind="live", complete=True, location=HERE,
                       endpoint={"region": REGION, "tcp": ep})  # fmt: skip
    return m.Grant(0, 9, n, 1, VERSION, 0, src, sums, None)


def test_a_revoked_grant_with_a_slow_read_in_flight_resumes_from_the_next_source_at_once(seed: int) -> None:
    """Grant 1 is a slow holder (a 2 MiB read, in 2 stripes, takes about 25 s); it is revoked while its read is
    in flight; grant 2, a fast holder, finishes the pull with the right bytes well before the
    slow read would have ended."""

    async def main() -> None:
        held, into = shard(seed)  # 8 MiB: 4 reads of 2 MiB
        sums = tuple(checksum.compute(held))
        slow, fast = SlowHolder(pause=1.5), TcpTransport()  # about 44 kB/s: each 1 MiB stripe about 24 s
        reader = TcpTransport()
        engine = EngineActor({"tcp": reader}, chunk_bytes=2 * MiB)
        reports: list[Any] = []
        async with started(slow, fast):
            await reader.start()
            await engine.start()
            try:
                slow_ep, fast_ep = served(slow, held), served(fast, held)
                await engine.ask(AddSlot(9, into, lambda build, unanswered: reports.append(build(0)), {}, HERE))

                engine.tell(grant(1, "slow", slow_ep, sums))
                await running_socks(reader, into, 1)
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                engine.tell(m.Revoke(9, 1, 1, "straggler"))
                engine.tell(grant(2, "fast", fast_ep, sums))
                deadline = time.monotonic() + 20.0
                while not any(isinstance(r, m.Complete) for r in reports) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                took = time.monotonic() - t0
                assert any(isinstance(r, m.Complete) and r.grant == 2 for r in reports), reports
                assert not any(isinstance(r, m.SourceFailed) for r in reports), reports  # nobody is blamed
                assert took < 10.0, took  # the slow read alone had over 20 s left (a bound only a hang exceeds)
                assert raw(into) == raw(held)
                stats = engine.pull_stats(9)
                assert stats is not None and stats.sources == ["slow/0", "fast/0"]
                assert into.progress.snapshot()[1:] == (VERSION, into.total_bytes)
            finally:
                await engine.stop()  # closes the reader's transport

    run(main())
