"""Tests of the ``tcp`` transport (``tensorhub.transports.tcp``) on 127.0.0.1, with real sockets and real
:class:`~tensorhub.transports.buffers.ShardBuffers`: byte-exact reads, partial holders, the generation
seqlock, hostile bytes on the listening port, closing, and ranges outside the shard.

Every transport and raw socket a test opens is closed before it ends; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.runtime.actor import run
from tensorhub.transports import tcp
from tensorhub.transports.buffers import ShardBuffers, layout_of
from tensorhub.transports.tcp import RangeNotReady, TcpTransport

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

REGION, VERSION = 3, 11


def make_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "emb": torch.randn(300, 7, generator=gen),  # float32, 8400 bytes
        "ln": torch.randn(333, generator=gen).to(torch.bfloat16),  # 666 bytes
        "ids": torch.randint(-(2**40), 2**40, (41,), generator=gen, dtype=torch.int64),
        "q": torch.randint(-128, 127, (77,), generator=gen, dtype=torch.int8),
        "mask": torch.rand(10, generator=gen) < 0.5,
        "empty": torch.zeros(0, dtype=torch.float16),
        "big": torch.randn(256 * 1024, generator=gen),  # 1 MiB of float32
        "h": torch.randn(5, 3, generator=gen).to(torch.float16),
        "tail": torch.randn(1000, generator=gen, dtype=torch.float64),
    }


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(t) for k, t in tensors.items()}


def raw(b: ShardBuffers) -> bytes:
    """The transfer byte space (packs, then large tensors): what a transport moves."""
    return b"".join(bytes(v) for v in b.views(0, b.total_bytes))


def shard(seed: int, complete: bool = True) -> tuple[ShardBuffers, ShardBuffers]:
    """A holder's buffers (random content) and an empty reader's buffers with the same layout."""
    gen = torch.Generator().manual_seed(seed)
    src = make_tensors(gen)
    lay = layout_of(src, pack_threshold=0)  # unpacked: the transfer space is the tensors in order
    held = ShardBuffers(src, lay)
    held.progress.reset(VERSION, held.total_bytes if complete else 0)
    return held, ShardBuffers(zeros_like(src), lay)


@contextlib.asynccontextmanager
async def transports(
    holdings: Callable[[int, int], ShardBuffers | None] | dict,
    holder_opts: dict | None = None,
    reader_opts: dict | None = None,
) -> AsyncIterator[tuple[TcpTransport, TcpTransport]]:
    holder = TcpTransport(holder_opts)
    reader = TcpTransport(reader_opts)
    await holder.start()
    try:
        await reader.start()
        try:
            if isinstance(holdings, dict):
                table = holdings
                holder.serve(lambda region, version: table.get((region, version)))
            else:
                holder.serve(holdings)
            yield holder, reader
        finally:
            await reader.close()
    finally:
        await holder.close()


def recv_all(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """Everything until EOF (or ``limit`` bytes); the socket has a timeout set."""
    out = b""
    while len(out) < limit:
        try:
            k = sock.recv(limit - len(out))
        except ConnectionResetError:
            break
        if not k:
            break
        out += k
    return out


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer if the peer hangs up (a socket with a timeout is non-blocking
    underneath, so ``MSG_WAITALL`` alone does not wait)."""
    out = b""
    while len(out) < n:
        k = sock.recv(n - len(out))
        if not k:
            break
        out += k
    return out


def request(region: int, version: int, offset: int, length: int, generation: int = 0, wait_ms: int = 0, magic: int = tcp._MAGIC,
            token: bytes = b"") -> bytes:  # fmt: skip
    return tcp._REQ.pack(magic, region, version, offset, length, generation, wait_ms, len(token)) + token


# --- options and endpoint ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [{"streams": 0}, {"io_timeout": 0}, {"wait_timeout": -1}, {"staging_bytes": 100}, {"max_rate": -5}],
)
def test_bad_options_are_refused(opts: dict) -> None:
    with pytest.raises(InvalidArgument, match="bad tcp transport options"):
        TcpTransport(opts)


def test_endpoint_names_the_listening_port() -> None:
    async def main() -> None:
        t = TcpTransport({"advertise": "10.1.2.3"})
        await t.start()
        try:
            ep = t.endpoint()
            assert ep["host"] == "10.1.2.3" and ep["port"] == t.port > 0
            with socket.create_connection(("127.0.0.1", t.port), timeout=2.0):
                pass
        finally:
            await t.close()

    run(main())


def test_start_on_a_taken_port_is_a_transport_error() -> None:
    async def main() -> None:
        a = TcpTransport()
        await a.start()
        try:
            b = TcpTransport({"port": a.port})
            with pytest.raises(TransportError, match=f"cannot listen on 127.0.0.1:{a.port}"):
                await b.start()
            await b.close()
        finally:
            await a.close()

    run(main())


# --- byte-exact reads ----------------------------------------------------------------------------


def test_round_trip_is_byte_exact_with_concurrent_reads(seed: int) -> None:
    held, into = shard(seed)
    total = held.total_bytes
    rng = random.Random(seed)
    # Uneven ranges that start and end inside tensors and span several boundaries.
    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(30)), *held.starts[1:5]})
    ranges = list(zip(cuts, cuts[1:]))

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            gen = held.progress.generation
            results = await asyncio.gather(
                *(reader.read(holder.endpoint(), REGION, VERSION, a, b - a, into, None) for a, b in ranges)
            )
            assert results == [gen] * len(ranges)
            # Reads that pass the generation they expect are accepted too.
            assert await reader.read(holder.endpoint(), REGION, VERSION, 0, total, into, gen) == gen

    run(main())
    assert raw(into) == raw(held)
    for got, want in zip(into.tensors, held.tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_reads_land_only_in_their_range(seed: int) -> None:
    held, into = shard(seed)
    for t in into.tensors:
        t.reshape(-1).view(torch.uint8).fill_(0xAB)
    a, b = held.starts[1] - 3, held.starts[3] + 5  # emb's tail .. into ids

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            await reader.read(holder.endpoint(), REGION, VERSION, a, b - a, into, None)

    run(main())
    got, want = raw(into), raw(held)
    assert got[a:b] == want[a:b]
    assert got[:a] == b"\xab" * a and got[b:] == b"\xab" * (len(got) - b)


def test_zero_length_read_at_the_end_is_fine(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            gen = await reader.read(holder.endpoint(), REGION, VERSION, held.total_bytes, 0, into, None)
            assert gen == held.progress.generation

    run(main())


def test_max_rate_spaces_reads_out(seed: int) -> None:
    held, into = shard(seed)
    rate = 4e6  # bytes per second
    n = 100_000  # each read reserves 25 ms of the rate

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, reader_opts={"max_rate": rate}) as (holder, reader):
            t0 = time.monotonic()
            await asyncio.gather(*(reader.read(holder.endpoint(), REGION, VERSION, k * n, n, into, None) for k in range(8)))
            elapsed = time.monotonic() - t0
            # The 8th read may start only after the first 7 reads' share: 7 * 25 ms.
            assert elapsed >= 7 * n / rate * 0.9

    run(main())
    assert raw(into)[: 8 * n] == raw(held)[: 8 * n]


# --- what the holder does not have ---------------------------------------------------------------


def test_reading_a_version_the_holder_does_not_hold_fails(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            for region, version in ((REGION, VERSION + 1), (REGION + 1, VERSION)):
                with pytest.raises(TransportError, match="does not hold that version") as info:
                    await reader.read(ep, region, version, 0, 100, into, None)
                assert not isinstance(info.value, RangeNotReady)
                assert f"region {region} version {version}" in str(info.value)
            # The connection is still good for a read of what it holds.
            await reader.read(ep, REGION, VERSION, 0, 100, into, None)

    run(main())
    assert raw(into)[:100] == raw(held)[:100]


def test_reading_past_the_end_fails(seed: int) -> None:
    held, into = shard(seed)
    total = held.total_bytes

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            for offset, length in ((total - 10, 11), (total, 1), (total + 100, 5), (0, total + 1)):
                with pytest.raises(TransportError, match="outside the shard"):
                    await reader.read(ep, REGION, VERSION, offset, length, into, None)
            await reader.read(ep, REGION, VERSION, total - 10, 10, into, None)  # still serving

    run(main())


def test_a_read_larger_than_one_request_is_split_into_requests(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read may be larger than one request moves (``MAX_READ``; GPU pulls read 1 GiB at once):
    it goes as several requests, each within the bound the holder enforces, and lands whole."""
    monkeypatch.setattr(tcp, "MAX_READ", 1 << 16)
    held, into = shard(seed)
    total = held.total_bytes
    assert total > 4 * tcp.MAX_READ

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, reader_opts={"streams": 1}) as (holder, reader):
            await reader.read(holder.endpoint(), REGION, VERSION, 0, total, into, None)

    run(main())
    assert raw(into) == raw(held)


def test_bad_or_unreachable_peer_is_a_transport_error(seed: int) -> None:
    held, into = shard(seed)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    async def main() -> None:
        async with transports({}) as (_, reader):
            for peer in ({}, {"host": "127.0.0.1"}, {"host": "127.0.0.1", "port": "x"}, None):
                with pytest.raises(TransportError, match="has no host and port"):
                    await reader.read(peer, REGION, VERSION, 0, 10, into, None)  # type: ignore[arg-type]
            with pytest.raises(TransportError, match="cannot connect"):
                await reader.read({"host": "127.0.0.1", "port": dead_port}, REGION, VERSION, 0, 10, into, None)

    run(main())


# --- partial holders -----------------------------------------------------------------------------


def test_partial_holder_serves_a_range_as_soon_as_it_is_covered(seed: int) -> None:
    held, into = shard(seed, complete=False)
    a, b = 1000, 9000

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 30.0},
                              reader_opts={"wait_timeout": 30.0}) as (holder, reader):  # fmt: skip
            task = asyncio.ensure_future(reader.read(holder.endpoint(), REGION, VERSION, a, b - a, into, None))
            await asyncio.sleep(0.1)
            assert not task.done()
            held.progress.advance(b - 1)  # one byte short
            await asyncio.sleep(0.1)
            assert not task.done()
            t0 = time.monotonic()
            held.progress.advance(b)
            gen = await asyncio.wait_for(task, 20.0)
            assert time.monotonic() - t0 < 10.0  # long before the 30 s wait
            assert gen == held.progress.generation
            assert held.progress.verified == b < held.total_bytes  # served before the whole shard

    run(main())
    assert raw(into)[a:b] == raw(held)[a:b]


def test_partial_holder_fed_from_another_thread_serves_every_range(seed: int) -> None:
    held, into = shard(seed, complete=False)
    total = held.total_bytes
    step = 64 << 10
    stop = threading.Event()

    def feed() -> None:
        for v in range(step, total + step, step):
            if stop.wait(0.005):
                return
            held.progress.advance(min(v, total))

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 30.0}, reader_opts={"streams": 4}) as (holder, reader):
            feeder = threading.Thread(target=feed)
            feeder.start()
            try:
                ranges = [(o, min(step // 2, total - o)) for o in range(0, total, step // 2)]
                await asyncio.wait_for(
                    asyncio.gather(*(reader.read(holder.endpoint(), REGION, VERSION, o, n, into, None) for o, n in ranges)),
                    10.0,
                )
            finally:
                stop.set()
                feeder.join(5.0)

    run(main())
    assert raw(into) == raw(held)


def test_not_covered_within_wait_timeout_is_range_not_ready(seed: int) -> None:
    held, into = shard(seed, complete=False)
    held.progress.advance(100)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 0.15}) as (holder, reader):
            ep = holder.endpoint()
            t0 = time.monotonic()
            with pytest.raises(RangeNotReady, match="did not cover the range in time"):
                await reader.read(ep, REGION, VERSION, 50, 100, into, None)
            elapsed = time.monotonic() - t0
            assert elapsed >= 0.1  # the holder waited its wait_timeout first
            # The covered prefix is served at once, on the same (pooled) connection.
            await reader.read(ep, REGION, VERSION, 0, 100, into, None)

    run(main())
    assert raw(into)[:100] == raw(held)[:100]


def test_the_readers_wait_timeout_also_bounds_the_wait(seed: int) -> None:
    held, into = shard(seed, complete=False)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 30.0}, reader_opts={"wait_timeout": 0.05}) as (holder, reader):
            t0 = time.monotonic()
            with pytest.raises(RangeNotReady):
                await reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None)
            assert time.monotonic() - t0 < 10.0  # long before the 30 s wait

    run(main())


# --- the generation seqlock ----------------------------------------------------------------------


def test_a_read_across_a_generation_it_did_not_begin_with_fails(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            g1 = await reader.read(ep, REGION, VERSION, 0, 10, into, None)
            g2 = held.progress.reset(VERSION, held.total_bytes)  # e.g. unpublished and pulled again
            assert g2 != g1
            with pytest.raises(TransportError, match="changed") as info:
                await reader.read(ep, REGION, VERSION, 0, 10, into, g1)
            assert not isinstance(info.value, RangeNotReady)
            assert await reader.read(ep, REGION, VERSION, 0, 10, into, g2) == g2

    run(main())


def test_a_holder_that_holds_another_version_is_not_ready_unless_the_pull_began_there(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        # The counter says another version: this may be a partial holder whose own grant has not
        # reached it yet, so a first read waits and answers "not ready"; a read of a pull that
        # began on an earlier generation of these buffers answers "changed".
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 0.1}) as (holder, reader):
            gen = await reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None)
            held.progress.reset(VERSION + 1, held.total_bytes)
            with pytest.raises(RangeNotReady):
                await reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None)
            with pytest.raises(TransportError, match="changed") as info:
                await reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, gen)
            assert not isinstance(info.value, RangeNotReady)

    run(main())


class ResetWhileServing(ShardBuffers):
    """Holder buffers whose holding changes while the bytes are being sent (deterministically:
    the serving thread takes the views, then the change happens)."""

    armed = False

    def views(self, offset: int, length: int) -> list[memoryview]:
        out = super().views(offset, length)
        if self.armed:
            self.armed = False
            self.progress.reset(self.progress.version, self.total_bytes)
        return out


def test_a_generation_change_during_a_read_discards_the_bytes(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    src = make_tensors(gen)
    held = ResetWhileServing(src, layout_of(src))
    held.progress.reset(VERSION, held.total_bytes)
    into = ShardBuffers(zeros_like(src), held.layout)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            before = held.progress.generation
            held.armed = True
            with pytest.raises(TransportError, match="changed during the read"):
                await reader.read(ep, REGION, VERSION, 0, held.total_bytes, into, None)
            assert held.progress.generation == before + 1
            # With the holding stable again, the same read is accepted under the new generation.
            assert await reader.read(ep, REGION, VERSION, 0, held.total_bytes, into, None) == before + 1

    run(main())
    assert raw(into) == raw(held)


def test_concurrent_resets_never_let_a_torn_read_through(seed: int) -> None:
    """A holder that keeps replacing its bytes (bump generation, rewrite, advance) while readers
    read: every read that returns normally holds one whole version of the bytes."""
    sizes = {"a": torch.zeros(96 << 10, dtype=torch.uint8), "b": torch.zeros(160 << 10, dtype=torch.uint8)}
    held = ShardBuffers(sizes, layout_of(sizes, pack_threshold=0))
    total = held.total_bytes
    held.progress.reset(VERSION, 0)
    stop = threading.Event()
    rounds = []

    def rewrite() -> None:
        for k in range(1, 2001):
            if stop.is_set():
                return
            held.progress.reset(VERSION, 0)
            for t in held.tensors:
                t.fill_(k % 255 + 1)
            held.progress.advance(total)
            rounds.append(k)
            time.sleep(0.0005)

    outcomes = {"ok": 0, "changed": 0}

    async def read_loop(reader: TcpTransport, ep: dict, into: ShardBuffers) -> None:
        for _ in range(60):
            try:
                await reader.read(ep, REGION, VERSION, 0, total, into, None)
            except TransportError:
                outcomes["changed"] += 1
                continue
            got = torch.cat([t.view(-1) for t in into.tensors])
            assert int(got.min()) == int(got.max()) != 0, "a torn read was accepted"
            outcomes["ok"] += 1

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 1.0}) as (holder, reader):
            writer = threading.Thread(target=rewrite)
            writer.start()
            try:
                intos = [ShardBuffers(zeros_like(sizes), held.layout) for _ in range(3)]
                await asyncio.wait_for(asyncio.gather(*(read_loop(reader, holder.endpoint(), i) for i in intos)), 15.0)
            finally:
                stop.set()
                writer.join(5.0)

    run(main())
    assert outcomes["ok"] > 0 and rounds


# --- hostile bytes on the port -------------------------------------------------------------------


def test_garbage_on_the_port_does_not_break_the_transport(seed: int) -> None:
    held, into = shard(seed)
    rng = random.Random(seed)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            addr = ("127.0.0.1", holder.port)
            bad_request = tcp._RESP.pack(tcp.BAD_REQUEST, 0, 0)

            def hostile() -> None:
                # A full header with the wrong magic: refused, then the stream is closed.
                with socket.create_connection(addr, timeout=2.0) as s:
                    s.sendall(request(REGION, VERSION, 0, 10, magic=0xDEADBEEF))
                    assert recv_all(s) == bad_request
                # Random bytes: refused and closed (or reset) without an answer we could misread.
                with socket.create_connection(addr, timeout=2.0) as s:
                    s.sendall(bytes(rng.randrange(256) for _ in range(4096)))
                    assert recv_all(s) in (bad_request, b"")
                # The right magic but an absurd length.
                with socket.create_connection(addr, timeout=2.0) as s:
                    s.sendall(request(REGION, VERSION, 0, tcp.MAX_READ + 1))
                    assert recv_all(s) == bad_request
                # A range outside the shard, then a good request on the same stream.
                with socket.create_connection(addr, timeout=2.0) as s:
                    s.sendall(request(REGION, VERSION, 2**63, 2**20))
                    status, _, n = tcp._RESP.unpack(recv_exact(s, tcp._RESP.size))
                    assert (status, n) == (tcp.BAD_RANGE, 0)
                    s.sendall(request(REGION, VERSION, 0, 8))
                    status, g, n = tcp._RESP.unpack(recv_exact(s, tcp._RESP.size))
                    assert (status, g, n) == (tcp.OK, held.progress.generation, 8)
                    body = recv_exact(s, 8 + tcp._TRAILER.size)
                    assert body[:8] == raw(held)[:8]
                    assert tcp._TRAILER.unpack(body[8:]) == (tcp.OK, g)
                # Half a header, then a hang-up.
                with socket.create_connection(addr, timeout=2.0) as s:
                    s.sendall(b"\x54\x48\x52")

            await asyncio.to_thread(hostile)
            # A peer that sends half a header and then stays silent holds only its own
            # connection: other readers are served meanwhile.
            with socket.create_connection(addr, timeout=2.0) as silent:
                silent.sendall(request(REGION, VERSION, 0, 10)[:20])
                results = await asyncio.wait_for(
                    asyncio.gather(*(reader.read(ep, REGION, VERSION, o, 4096, into, None) for o in range(0, 8 * 4096, 4096))),
                    5.0,
                )
                assert set(results) == {held.progress.generation}

    run(main())
    assert raw(into)[: 8 * 4096] == raw(held)[: 8 * 4096]


def test_a_bad_answer_from_the_peer_is_a_transport_error(seed: int) -> None:
    """A "holder" that answers with junk: every read fails cleanly with TransportError."""
    held, into = shard(seed)
    answers = iter(
        [
            # connection A: announces the wrong length; the reader must drop the stream
            (tcp._RESP.pack(tcp.OK, 5, 999), False),
            # connection B: the bytes, then a trailer saying the holding changed (stream in sync)
            (tcp._RESP.pack(tcp.OK, 5, 10) + b"0123456789" + tcp._TRAILER.pack(tcp.CHANGED, 6), False),
            (tcp._RESP.pack(tcp.OK, 5, 10) + b"0123456789" + tcp._TRAILER.pack(tcp.OK, 6), False),  # moved generation
            (tcp._RESP.pack(77, 0, 0), True),  # an unknown status: the reader drops the stream
            # connection C
            (tcp._RESP.pack(tcp.OK, 5, 10) + b"01234", True),  # hangs up mid-body
        ]
    )
    served = []

    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)
        lst.settimeout(5.0)
        port = lst.getsockname()[1]

        def fake_holder() -> None:
            for _ in range(3):
                conn, _ = lst.accept()
                with conn:
                    conn.settimeout(5.0)
                    while True:
                        req = recv_exact(conn, tcp._REQ.size)
                        if len(req) < tcp._REQ.size:
                            break
                        answer, hang_up = next(answers)
                        served.append(tcp._REQ.unpack(req))
                        conn.sendall(answer)
                        if hang_up:
                            break

        async def main() -> None:
            async with transports({}) as (_, reader):
                peer = {"host": "127.0.0.1", "port": port}
                server = threading.Thread(target=fake_holder)
                server.start()
                try:
                    for match in (
                        "announced 999 bytes",
                        "changed during the read",
                        "changed during the read",
                        "unknown status 77",
                        "peer closed after 5 of 10 bytes",
                    ):
                        with pytest.raises(TransportError, match=match):
                            await reader.read(peer, REGION, VERSION, 0, 10, into, None)
                finally:
                    server.join(5.0)
                assert not server.is_alive()

        run(main())
    assert len(served) == 5
    assert served[0] == (tcp._MAGIC, REGION, VERSION, 0, 10, 0, 5000, 0)  # generation 0: "any"; no token


# --- closing -------------------------------------------------------------------------------------


def test_reads_from_a_closed_holder_fail(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        holder = TcpTransport()
        await holder.start()
        holder.serve(lambda r, v: held)
        async with transports({}) as (_, reader):
            ep = holder.endpoint()
            await reader.read(ep, REGION, VERSION, 0, 10, into, None)  # leaves a pooled connection
            await holder.close()
            with pytest.raises(TransportError):
                await reader.read(ep, REGION, VERSION, 0, 10, into, None)  # the pooled connection
            with pytest.raises(TransportError):
                await reader.read(ep, REGION, VERSION, 0, 10, into, None)  # a fresh connection

    run(main())


def test_closing_the_holder_fails_a_waiting_read_promptly(seed: int) -> None:
    held, into = shard(seed, complete=False)

    async def main() -> None:
        holder = TcpTransport({"wait_timeout": 30.0})
        await holder.start()
        holder.serve(lambda r, v: held)
        try:
            async with transports({}, reader_opts={"wait_timeout": 30.0}) as (_, reader):
                task = asyncio.ensure_future(reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None))
                await asyncio.sleep(0.1)
                assert not task.done()
                t0 = time.monotonic()
                await holder.close()
                with pytest.raises(TransportError):
                    await asyncio.wait_for(task, 20.0)
                assert time.monotonic() - t0 < 10.0  # long before the 30 s wait
        finally:
            held.progress.reset(None)  # wake the holder's serving thread
            await holder.close()

    run(main())


def test_a_read_after_close_is_a_transport_error(seed: int) -> None:
    held, into = shard(seed)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}) as (holder, reader):
            ep = holder.endpoint()
            await reader.read(ep, REGION, VERSION, 0, 10, into, None)
            await reader.close()
            with pytest.raises(TransportError, match="closed"):
                await reader.read(ep, REGION, VERSION, 0, 10, into, None)

    run(main())


def test_a_read_in_flight_at_close_fails(seed: int) -> None:
    held, into = shard(seed, complete=False)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 2.0}) as (holder, reader):
            task = asyncio.ensure_future(reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None))
            await asyncio.sleep(0.1)
            await reader.close()
            held.progress.advance(held.total_bytes)  # the holder answers after the reader closed
            with pytest.raises(TransportError):
                await asyncio.wait_for(task, 3.0)

    run(main())


def test_reads_queued_at_close_fail_with_transport_error(seed: int) -> None:
    held, into = shard(seed, complete=False)

    async def main() -> None:
        async with transports({(REGION, VERSION): held}, holder_opts={"wait_timeout": 0.3}, reader_opts={"streams": 1}) as (holder, reader):
            workers = reader._executor._max_workers
            tasks = [
                asyncio.ensure_future(reader.read(holder.endpoint(), REGION, VERSION, 0, 10, into, None))
                for _ in range(workers + 2)
            ]
            await asyncio.sleep(0.05)
            await reader.close()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
            assert all(isinstance(r, TransportError) for r in results), sorted({type(r).__name__ for r in results})

    run(main())
