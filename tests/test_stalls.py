"""A process that stood still does not blame the others for its own silence (issue 33).

On a machine whose cores are all busy, a server or a client may not run for seconds. The
heartbeats sent meanwhile sit unread in its socket; when it wakes, its clock says "silent for
longer than the timeout" before it has read them. The server then removed every replica, and a
client failed over from a healthy primary, both seen in test runs beside busy loops. Each now
measures its own stall (a periodic tick that came late) and does not count it.
"""

from __future__ import annotations

import threading
import time

import zmq

from tensorhub.core import messages as m
from tensorhub.core.topology import Location
from tensorhub.core.wire import decode, encode
from tensorhub.runtime.client import _BEAT_S, ClientActor

from .procs import InprocServer
from .table_driver import Driver


def test_the_table_credits_a_stall_to_every_session_in_order():
    d = Driver()
    d.advance(11)
    a = d.shard("a")
    d.advance(0.5)
    b = d.shard("b")
    timeout = d.table.config.heartbeat_timeout
    d.advance(timeout - 0.6)  # a silent for timeout - 0.1 s, b for timeout - 0.6 s
    d.table.credit_stall(3.0)
    d.advance(2.5)
    assert d.table.tick() == [] and {a.session, b.session} <= set(d.table.sessions)
    assert list(d.table.expiry) == [a.session, b.session]  # still oldest first
    assert d.table.stats["stalls_credited"] == 1
    d.advance(0.8)  # past the credit: a session that really went silent still goes
    d.table.tick()
    assert a.session not in d.table.sessions and b.session in d.table.sessions
    d.table.credit_stall(0.0)  # nothing to credit: nothing counted
    assert d.table.stats["stalls_credited"] == 1


def _beat(sock: zmq.Socket, req: int, session: int) -> m.HeartbeatAck:
    sock.send(encode(m.Heartbeat(req, (session,))))
    assert sock.poll(10_000), "no heartbeat answer"
    reply = decode(sock.recv())
    assert isinstance(reply, m.HeartbeatAck), reply
    return reply


def test_a_server_that_stood_still_keeps_the_sessions_that_beat_when_it_woke():
    """The server's loop is held for twice the heartbeat timeout, as is the client (it does
    not beat meanwhile: the whole machine stood still); it beats half a second after the server
    runs again. Before the fix the server's first tick after the stall removed it."""
    srv = InprocServer(heartbeat_interval=0.2, heartbeat_timeout=2.0)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(srv.address)
        sock.send(encode(m.OpenShard(1, "stall", "r", 1, 0, "i0", Location.default(), False, None)))
        assert sock.poll(10_000)
        opened = decode(sock.recv())
        assert isinstance(opened, m.Opened), opened
        assert _beat(sock, 2, opened.session).unknown == ()
        woke = threading.Event()

        def stand_still() -> None:
            time.sleep(4.0)  # holds the server's loop: nothing is read, no tick runs
            woke.set()

        srv.loop.loop.call_soon_threadsafe(stand_still)
        assert woke.wait(20)
        time.sleep(0.5)  # the client wakes a little later than the server
        assert _beat(sock, 3, opened.session).unknown == ()  # still known: not removed on waking
        assert srv.stats()["stalls_credited"] >= 1
        # a session that really is silent is still removed, one timeout after the stall
        deadline = time.monotonic() + 20
        while opened.session in srv._look(lambda t: set(t.sessions)):
            assert time.monotonic() < deadline, "a silent session was never removed"
            time.sleep(0.1)
    finally:
        sock.close(0)
        srv.close()


def test_a_client_that_stood_still_does_not_take_its_server_for_lost():
    """The client's beat measures how long its loop stood still and moves its 'last heard'
    forward by that much, so that answers still unread do not count as the server's silence."""
    client = ClientActor.__new__(ClientActor)  # only the clock fields on__Beat reads
    now = time.monotonic()
    client.last_heard = now - 2.5
    client._beat_at = now - 2.0 - _BEAT_S  # the last beat ran 2 s later than due
    client.lost = None  # connected, with a session waiting on the server: a failover candidate
    client.pending, client.sessions = {}, {1: None}
    client.heartbeat_timeout = 1.0
    lost = []
    client._lose = lost.append  # type: ignore[method-assign]
    client.reigning, client.addresses, client._next_beat = True, ("a",), float("inf")
    client.address = "tcp://127.0.0.1:1"
    client.on__Beat(None)  # type: ignore[arg-type]
    assert lost == [], lost  # without the credit: "no word from the server ... for 1 s"
    assert client.last_heard >= now - 0.5 - 0.05  # credited about 2 s of the 2.5 s silence
