"""The server never waits on a client and never loses track of a reply it could not send.

It sends with plain non-blocking sends on its ROUTER socket: a reply to a client that is gone,
or whose queue is full, fails at once. Each such reply must be counted
(``tensorhub_replies_dropped_total``) and logged once per client and reason, and nothing may be
left behind (no "Future exception was never retrieved" when objects are collected).
"""

from __future__ import annotations

import contextlib

import gc
import logging
import time

import pytest
import zmq

from tensorhub.core import messages as m

from .procs import InprocServer

pytestmark = pytest.mark.integration


@pytest.fixture
def srv():
    s = InprocServer()
    yield s
    s.close()


def _dropped(srv: InprocServer, reason: str) -> float:
    async def get() -> float:
        return srv.actor.m_dropped.value(reason)

    return srv.loop.run(get())


def _send(srv: InprocServer, out: list) -> None:
    async def go() -> None:
        srv.actor._send(out)

    srv.loop.run(go())


def test_a_reply_to_a_client_that_is_gone_is_counted_and_logged_once(srv, caplog):
    caplog.set_level(logging.WARNING)
    gone = b"\x00no-such-client"
    _send(srv, [(gone, m.Ack(1)), (gone, m.Ack(2))])
    assert _dropped(srv, "peer gone") == 2
    gc.collect()
    text = caplog.text
    assert "Future exception was never retrieved" not in text
    assert text.count("client gone; reply dropped") <= 1  # once per client and reason


def test_a_client_that_does_not_read_gets_its_replies_dropped_not_awaited(srv, caplog):
    caplog.set_level(logging.WARNING)

    # A queue of one reply and small kernel buffers for this client. libzmq copies a socket's
    # options into a listener when it binds, so they hold on an endpoint bound after setting
    # them (set on the server's own endpoint they did nothing: its queue of 100,000 replies
    # plus the kernel's autotuned buffers took seconds, on a loaded machine more than 10 s).
    async def small_queue() -> str:
        sock = srv.actor.sock
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.SNDBUF, 4096)
        sock.bind("tcp://127.0.0.1:*")
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    address = srv.loop.run(small_queue())
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"slow-client")
    try:
        dealer.connect(address)
        dealer.send(b"not a frame")  # the server learns the routing id (and answers an error)
        deadline = time.monotonic() + 60  # a hang's bound; it takes well under a second
        while time.monotonic() < deadline and _dropped(srv, "queue full") == 0:
            _send(srv, [(b"slow-client", m.Ack(i)) for i in range(2000)])
        assert _dropped(srv, "queue full") > 0
        assert _dropped(srv, "error") == 0
    finally:
        dealer.close(0)
        ctx.term()
    gc.collect()
    assert "Future exception was never retrieved" not in caplog.text


def test_a_heartbeat_is_answered_ahead_of_the_frames_read_before_it(srv):
    """Frames queued while the server stood still are read together; the heartbeat among them
    is answered before the requests sent ahead of it (each of those still gets its answer)."""
    import asyncio
    import threading

    from tensorhub.core.topology import Location
    from tensorhub.core.wire import decode, encode

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(srv.address)
        dealer.send(encode(m.OpenShard(1, "actor", "r0", 1, 0, "inc-r0", Location.default(), False, None)))
        assert dealer.poll(10_000), "no answer to the open"
        opened = decode(dealer.recv())
        assert isinstance(opened, m.Opened)
        held = threading.Event()

        async def stand_still() -> None:  # the server's loop blocks while the frames queue up
            held.set()
            time.sleep(0.5)

        stalled = asyncio.run_coroutine_threadsafe(stand_still(), srv.loop.loop)
        assert held.wait(10)
        n = 100
        for req in range(2, 2 + n):
            dealer.send(encode(m.ListVersions(req, opened.session, None)))
        dealer.send(encode(m.Heartbeat(1000, (opened.session,))))
        stalled.result(10)
        replies = []
        deadline = time.monotonic() + 20
        while len(replies) < n + 1 and time.monotonic() < deadline:
            if dealer.poll(1000):
                replies.append(decode(dealer.recv()))
        assert len(replies) == n + 1, f"{len(replies)} of {n + 1} replies"
        assert isinstance(replies[0], m.HeartbeatAck) and replies[0].req == 1000 and replies[0].unknown == ()
        assert sorted(r.req for r in replies[1:]) == list(range(2, 2 + n))
        assert srv.loop.run(_beats_ahead(srv)) >= 1
        counted = srv.loop.run(_counted(srv))
        assert counted == (1.0, 1.0), counted  # the batched path counts it as _handle would
    finally:
        dealer.close(0)
        ctx.term()


async def _beats_ahead(srv: InprocServer) -> int:
    return srv.actor.beats_ahead


async def _counted(srv: InprocServer) -> tuple[float, float]:
    a = srv.actor
    return a.m_requests.value("heartbeat"), a.m_clients.value("anonymous") - a.m_requests.value("open") - a.m_requests.value("list")


def test_a_frame_that_only_begins_like_a_heartbeat_gets_its_typed_error(srv):
    """The read path sorts frames by their first bytes; one that begins as a heartbeat does but
    is not one is answered by the whole path with the error that names what was wrong."""
    import msgpack

    from tensorhub.core.wire import WIRE_VERSION, decode, kind_prefix

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(srv.address)
        bad_body = msgpack.packb([WIRE_VERSION, "heartbeat", {"req": 5, "sessions": ["x"], "stamp": 0.0, "stamp_term": 0}])
        assert bad_body.startswith(kind_prefix(m.Heartbeat))
        for frame, code in ((kind_prefix(m.Heartbeat) + b"\xc1", "malformed"), (bad_body, "malformed")):
            dealer.send(frame)
            assert dealer.poll(10_000), "no answer"
            reply = decode(dealer.recv())
            assert isinstance(reply, m.Failed) and reply.code == code, reply
        assert "sessions" in reply.message and reply.req == 5
    finally:
        dealer.close(0)
        ctx.term()



class StandInSocket:
    """The server's raw socket, in memory: ``waiting`` frames to read (then ``zmq.Again``),
    what was sent, and how many reads were tried."""

    def __init__(self, waiting: list[list[bytes]]) -> None:
        self.waiting = waiting
        self.sent: list[bytes] = []
        self.reads: list[int] = []

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[bytes]:
        self.reads.append(1)
        if not self.waiting:
            raise zmq.Again()
        return self.waiting.pop(0)

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(data)

    def getsockopt(self, option: int) -> int:
        return 0


@contextlib.contextmanager
def serving_on(sock: StandInSocket):
    """A server actor that never started, reading ``sock``, with an event loop of its own."""
    import asyncio

    from tensorhub.runtime.server import ServerActor, ServerConfig

    server = ServerActor(ServerConfig(bind="tcp://127.0.0.1:0"))
    loop = asyncio.new_event_loop()
    try:
        server.loop = loop
        server._raw = sock  # type: ignore[assignment]
        yield server, loop
    finally:
        loop.close()
        server.ctx.term()  # the actor made its context; it never started, so nothing else to stop

def test_frames_read_between_a_batchs_frames_reach_the_mailbox_after_the_loop_ran():
    """During a batch the server looks at its socket: heartbeats are answered at once, the
    other frames wait for the loop to run once (a mailbox that never empties would keep the
    loop from its timers and the backup's lease replies), then go to the mailbox in order."""
    import asyncio

    from tensorhub.core.wire import decode, encode
    from tensorhub.runtime.server import _BATCH, _POLL_EVERY, _Batch, _Frames

    sock = StandInSocket([[b"peer-a", encode(m.ListVersions(i, 1, None))] for i in range(1, 41)])
    sock.waiting.append([b"peer-b", encode(m.Heartbeat(99, (12345,)))])
    sent = sock.sent
    with serving_on(sock) as (server, loop):
        told: list[_Batch] = []
        server.tell = told.append  # type: ignore[method-assign]
        assert 2 * _POLL_EVERY <= 41 < _BATCH
        first = [_Frames(b"peer-c", [encode(m.ListVersions(100 + i, 1, None))], None, 0.0) for i in range(2 * _POLL_EVERY)]
        server._queued = len(first)
        server.on__Batch(_Batch(first))
        replies = [decode(x) for x in sent[1::2]]  # (routing id, frame) pairs
        acks = [r for r in replies if isinstance(r, m.HeartbeatAck)]
        assert [(a.req, a.unknown) for a in acks] == [(99, (12345,))]
        assert len(replies) == len(first) + 1  # the batch's own answers, and the heartbeat's
        assert told == [] and server._queued == 40
        loop.run_until_complete(asyncio.sleep(0))
        assert len(told) == 1
        assert [decode(f.frames[0]).req for f in told[0].frames] == list(range(1, 41))


def test_a_batch_behind_a_long_backlog_leaves_the_socket_to_its_queues():
    """Past ``_EAGER_QUEUED`` frames waiting the server is behind: a batch does not read more
    (the backlog waits in ZeroMQ's per-connection queues, not in one FIFO)."""
    from tensorhub.core.wire import encode
    from tensorhub.runtime.server import _EAGER_QUEUED, _POLL_EVERY, _Batch, _Frames

    sock = StandInSocket([])
    reads = sock.reads
    with serving_on(sock) as (server, _):
        frames = [_Frames(b"p", [encode(m.ListVersions(i, 1, None))], None, 0.0) for i in range(1, 2 * _POLL_EVERY + 1)]
        server._queued = _EAGER_QUEUED + len(frames)
        server.on__Batch(_Batch(frames))
        assert reads == []
        server._queued = len(frames)
        server.on__Batch(_Batch(frames))
        assert len(reads) >= 1


def test_a_primarys_heartbeats_are_answered_as_read_and_count_as_votes():
    """With a backup, heartbeats are votes: they take the read path a server alone's take (not
    the whole per-frame path), the vote is recorded (an arrival first, then refreshed by the
    echoed stamp) and the ack carries the stamp, the lease and the reign."""
    import asyncio

    from tensorhub.core.topology import Location
    from tensorhub.core.wire import decode, encode
    from tensorhub.runtime.server import ServerActor, ServerConfig

    server = ServerActor(ServerConfig(bind="tcp://127.0.0.1:0", role="primary", peer="tcp://127.0.0.1:9"))
    loop = asyncio.new_event_loop()
    try:
        server.loop = loop
        table, reign = server.table, server.table.reign
        reign.lease_until = time.monotonic() + 60  # the backup's lease, held
        table.tick()
        assert reign.reigning
        opened = table.handle(b"peer-a", m.OpenShard(1, "actor", "r0", 1, 0, "i1", Location.default(), False, None))
        sid = opened[0][1].session
        whole_path: list = []
        server._handle = whole_path.append  # type: ignore[method-assign]
        sock = StandInSocket([[b"peer-a", encode(m.Heartbeat(2, (sid,)))]])
        server._raw = sock  # type: ignore[assignment]
        server._drain()
        first = decode(sock.sent[1])
        assert isinstance(first, m.HeartbeatAck) and first.term == table.term and first.reigning
        assert first.stamp > 0 and first.lease == reign.lease
        slot, counts_from, until = reign.votes[sid]
        assert until == float("-inf") and counts_from > first.stamp  # an arrival counts from a lease on
        sock.waiting.append([b"peer-a", encode(m.Heartbeat(3, (sid,), first.stamp, table.term))])
        server._drain()
        second = decode(sock.sent[3])
        assert isinstance(second, m.HeartbeatAck) and second.req == 3 and second.unknown == ()
        assert reign.votes[sid][2] == first.stamp + reign.lease  # the echoed stamp refreshed the vote
        assert whole_path == []
        assert server.m_requests.value("heartbeat") == 2 and server.m_frames.value("ok") == 2
    finally:
        loop.close()
        server.ctx.term()
