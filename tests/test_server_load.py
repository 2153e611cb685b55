"""The server load generator (``benchmarks/server_load.py``), small and bounded: a real server
process, 128 sessions (each on its own connection) from one generator process, two
bursts with churn. What it checks is behaviour, not speed: every live replica's update is
answered with the new version, every request gets a grant, no session that did not crash is
told it was removed, and the figures the benchmark prints are there and sane. The full run
(1,024 to 8,192 sessions, with and without a backup) is the benchmark's own.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import time

import pytest
import zmq

from benchmarks.harness import BenchmarkError
from benchmarks.server_load import SHARDS, Zmtp, enable_rx_timestamps, open_stamped, recv_stamped, run_once, verdict

pytestmark = pytest.mark.integration


def _args(seed: int, **kw) -> argparse.Namespace:
    base = dict(versions=2, procs=1, pull=0.75, churn=0.1, warmup=0.2, gap=0.2, timeout=30.0, seed=seed % 1000,
                profile=None, progress="engine", nice=5)  # fmt: skip  # a 0.75 s pull: 3 Progress each, as the engine sends them
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("backup", [False, True], ids=["one server", "primary and backup"])
def test_a_hundred_sessions_burst_and_churn_without_false_removals(seed, backup):
    r = run_once(128, backup, _args(seed), "test")
    assert r["sessions"] == 128
    assert r["false_removals"] == 0, r["false_examples"]
    for b in r["bursts"]:
        assert b["failed"] == 0 and b["timed_out"] == 0, b
        live = b["requests"] // SHARDS  # replicas asked (the crashed ones are not)
        assert b["answered"] == live * SHARDS
        assert b["grants"] >= b["requests"]  # each shard granted once at least (again after a failed source)
        assert 0 <= b["last_request_s"] <= b["last_first_grant_s"] <= b["last_complete_s"]
    assert sum(b["crashed"] for b in r["bursts"]) >= 1  # the churn happened
    assert r["hb_count"] > 0 and 0 < r["hb_p50_ms"] <= r["hb_p99_ms"]
    # the wire's round trip beside it: every ack stamped by the kernel, never later than read
    assert r["hb_wire_count"] == r["hb_count"] and 0 < r["hb_wire_p50_ms"] <= r["hb_wire_p99_ms"]
    assert r["hb_wire_p50_ms"] <= r["hb_p50_ms"] + 1.0 and r["ack_unread_p99_ms"] >= 0
    assert r["server_cores"] > 0 and r["server_rss_mib"] > 0 and not math.isnan(r["server_cpu_wait"])
    assert r["server_ms"]["progress"][2] > 0  # the readers' progress reports reached the server
    assert (r["backup_cores"] is not None) == backup
    assert set(verdict(r)) >= {"0 false removals", "every update answered"}
    # the server's collector, paced (the default): its passes counted, long-lived objects frozen
    assert r["gc_mode"] == "paced" and r["gc"]["frozen"] > 0 and r["gc"]["0"][0] >= 0
    assert all(b["rss_mib"] > 0 for b in r["bursts"])


def _loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server, _ = listener.accept()
    return client, server


def test_recv_stamped_gives_the_kernel_s_receive_time_on_loopback_tcp():
    """The kernel's receive timestamp (SO_TIMESTAMPNS) on a TCP socket: the time the bytes
    arrived, on the wall clock the sender's ``time.time()`` reads, not when they were read."""
    client, server = _loopback_pair()
    try:
        enable_rx_timestamps(client)
        sent = time.time()
        server.sendall(b"ping")
        time.sleep(0.3)  # the reader is late, as a busy load generator's loop is
        asked = time.time()
        data, stamp = recv_stamped(client, 100)
        assert data == b"ping" and stamp is not None
        assert sent - 0.001 <= stamp < asked, (sent, stamp, asked)  # stamped on arrival, not when read
        server.sendall(b"x" * 3000)
        server.sendall(b"y" * 10)
        time.sleep(0.05)
        got, stamps = b"", []
        while len(got) < 3010:  # bounded: 3010 bytes, each read at least one
            data, stamp = recv_stamped(client, 1 << 16)
            assert data, "the connection closed"
            got, stamps = got + data, stamps + [stamp]
        assert got == b"x" * 3000 + b"y" * 10 and all(t is not None and t >= sent for t in stamps)
    finally:
        client.close()
        server.close()


def test_recv_stamped_without_timestamps_enabled_gives_none_and_a_closed_socket_is_refused():
    client, server = _loopback_pair()
    try:
        server.sendall(b"pong")
        assert recv_stamped(client, 100) == (b"pong", None)
    finally:
        server.close()
        client.close()
    with pytest.raises(BenchmarkError, match="SO_TIMESTAMPNS refused"):
        enable_rx_timestamps(client)


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped connection", "asyncio transport"])
def test_the_generator_s_own_dealer_speaks_zmtp_to_a_zeromq_router(stamped):
    """The generator's connection (no pyzmq: :class:`Zmtp`) is a DEALER as ZeroMQ sees it: a
    ROUTER gets its routing id and its frames, short and long, and what the ROUTER sends back
    arrives whole, in order; the handshake is over (``ready``) before anything is sent. Over the
    generator's own connection (:func:`open_stamped`) each frame comes with the kernel's receive
    time, after the ``send()`` call ``write`` reported."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    ident = b"\x07generator-1"
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def recv() -> list[bytes]:
            assert router.poll(5000), "the ROUTER got nothing in 5 s"
            return router.recv_multipart()

        async def main() -> None:
            got: list[bytes] = []
            stamps: list[float | None] = []
            conn = Zmtp(ident, lambda frame, stamp: (got.append(frame), stamps.append(stamp)))
            if stamped:
                await open_stamped(conn, "127.0.0.1", port)
            else:
                await asyncio.get_running_loop().create_connection(lambda: conn, "127.0.0.1", port)
            await asyncio.wait_for(conn.ready, 10)
            sent = conn.write(b"a" * 10)
            conn.write(b"b" * 1000)  # a long frame (8-byte size)
            assert [recv(), recv()] == [[ident, b"a" * 10], [ident, b"b" * 1000]]
            router.send_multipart([ident, b"c" * 300])
            router.send_multipart([ident, b"d"])
            for _ in range(500):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.01)
            assert got == [b"c" * 300, b"d"]
            if stamped:
                assert all(t is not None and sent <= t <= time.time() for t in stamps), (sent, stamps)
            else:
                assert stamps == [None, None]
            assert conn.transport is not None
            conn.transport.abort()
            if stamped:
                assert conn.transport is None  # connection_lost was called (asyncio calls it soon after)

        asyncio.run(main())
    finally:
        router.close(0)
        ctx.term()
