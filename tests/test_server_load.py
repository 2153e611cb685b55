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

import pytest
import zmq

from benchmarks.server_load import SHARDS, Zmtp, run_once, verdict

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
    assert r["server_cores"] > 0 and r["server_rss_mib"] > 0 and not math.isnan(r["server_cpu_wait"])
    assert r["server_ms"]["progress"][2] > 0  # the readers' progress reports reached the server
    assert (r["backup_cores"] is not None) == backup
    assert set(verdict(r)) >= {"0 false removals", "every update answered"}
    # the server's collector, paced (the default): its passes counted, long-lived objects frozen
    assert r["gc_mode"] == "paced" and r["gc"]["frozen"] > 0 and r["gc"]["0"][0] >= 0
    assert all(b["rss_mib"] > 0 for b in r["bursts"])


def test_the_generator_s_own_dealer_speaks_zmtp_to_a_zeromq_router():
    """The generator's connection (no pyzmq: :class:`Zmtp`) is a DEALER as ZeroMQ sees it: a
    ROUTER gets its routing id and its frames, short and long, and what the ROUTER sends back
    arrives whole, in order; the handshake is over (``ready``) before anything is sent."""
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
            conn = Zmtp(ident, got.append)
            await asyncio.get_running_loop().create_connection(lambda: conn, "127.0.0.1", port)
            await asyncio.wait_for(conn.ready, 10)
            conn.write(b"a" * 10)
            conn.write(b"b" * 1000)  # a long frame (8-byte size)
            assert [recv(), recv()] == [[ident, b"a" * 10], [ident, b"b" * 1000]]
            router.send_multipart([ident, b"c" * 300])
            router.send_multipart([ident, b"d"])
            for _ in range(500):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.01)
            assert got == [b"c" * 300, b"d"]
            assert conn.transport is not None
            conn.transport.abort()

        asyncio.run(main())
    finally:
        router.close(0)
        ctx.term()
