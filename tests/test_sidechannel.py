"""The transports' side channel: msgpack requests over ZeroMQ, refusals, bounds, a holder that
goes away."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from tensorhub.core.errors import TransportError
from tensorhub.transports import sidechannel
from tensorhub.transports.base import PeerUnreachable
from tensorhub.transports.sidechannel import SideClient, SideError, SideServer, field


def _echo(msg):
    return {"x": field(msg, "x", int, 0)}


def _slow(msg):
    time.sleep(msg.get("s", 1.0))
    return {"slow": True}


def _refuse(msg):
    raise SideError("nope", "refused on purpose")


def _bug(msg):
    raise KeyError("oops")


@pytest.fixture
def pair():
    server = SideServer("t", {"echo": (_echo, True), "slow": (_slow, False), "refuse": (_refuse, True), "bug": (_bug, False)}, "127.0.0.1")
    client = SideClient("c")
    yield server, client
    client.close()
    server.close()


def test_a_call_gets_its_reply_and_concurrent_calls_do_not_mix(pair):
    server, client = pair
    assert client.call(server.address, "echo", {"x": 5}, 5)["x"] == 5
    got: dict[int, int] = {}

    def many(k):
        for i in range(50):
            got[k * 1000 + i] = client.call(server.address, "echo", {"x": k * 1000 + i}, 5)["x"]

    threads = [threading.Thread(target=many, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {k: k for k in got} and len(got) == 200


def test_refusals_carry_their_code(pair):
    server, client = pair
    with pytest.raises(SideError) as err:
        client.call(server.address, "refuse", {}, 5)
    assert err.value.code == "nope" and "on purpose" in str(err.value)
    with pytest.raises(SideError) as err:
        client.call(server.address, "bug", {}, 5)
    assert err.value.code == "internal" and "KeyError" in str(err.value)
    with pytest.raises(SideError) as err:
        client.call(server.address, "nosuch", {}, 5)
    assert err.value.code == "malformed" and "unknown op 'nosuch'" in str(err.value)
    with pytest.raises(SideError, match="field 'x' must be int >= 0, got -1"):
        client.call(server.address, "echo", {"x": -1}, 5)
    with pytest.raises(SideError, match="field 'x' must be int"):
        client.call(server.address, "echo", {"x": True}, 5)


@pytest.mark.parametrize(
    "frame",
    [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": "echo"}), msgpack.packb({1: 2}), msgpack.ExtType(5, b"x") and msgpack.packb(msgpack.ExtType(5, b"x"))],
    ids=["not-msgpack", "not-a-map", "no-id", "int-keys", "extension"],
)
def test_malformed_requests_are_refused_and_the_server_lives(pair, frame):
    server, client = pair
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        raw.send(frame)
        assert raw.poll(5000)
        reply = msgpack.unpackb(raw.recv())
        assert reply["ok"] is False and reply["code"] == "malformed"
    finally:
        raw.close()
        ctx.term()
    assert client.call(server.address, "echo", {"x": 1}, 5)["x"] == 1


def test_a_call_is_bounded_and_a_late_reply_is_not_taken_for_the_next(pair):
    server, client = pair
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="no reply to 'slow'"):
        client.call(server.address, "slow", {"s": 0.5}, 0.1)
    assert time.monotonic() - t0 < 2
    time.sleep(0.6)
    assert client.call(server.address, "echo", {"x": 7}, 5)["x"] == 7


def test_a_holder_that_closes_fails_the_call_at_once():
    server = SideServer("t", {"slow": (_slow, False)}, "127.0.0.1")
    client = SideClient("c")
    try:
        threading.Timer(0.2, server.close).start()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="went away"):
            client.call(server.address, "slow", {"s": 10.0}, 30)
        assert time.monotonic() - t0 < 8  # about 0.2 s: it did not wait for the handler's 10 s
        with pytest.raises(PeerUnreachable, match=f"cannot connect to the side channel at {server.address}.*ADVERTISE_HOST"):
            client.call(server.address, "slow", {}, 2)  # nothing listens there now
    finally:
        client.close()
        server.close()


def test_a_call_ends_when_the_caller_says_closed(pair):
    server, client = pair
    flag = threading.Event()
    threading.Timer(0.2, flag.set).start()
    with pytest.raises(TransportError, match="closed while waiting"):
        client.call(server.address, "slow", {"s": 2.0}, 30, closed=flag.is_set)


def test_a_thread_keeps_a_bounded_number_of_sockets(monkeypatch):
    monkeypatch.setattr(sidechannel, "MAX_PEERS_PER_THREAD", 3)
    servers = [SideServer(f"s{k}", {"echo": (_echo, True)}, "127.0.0.1") for k in range(5)]
    client = SideClient("c")
    try:
        for s in servers * 2:
            assert client.call(s.address, "echo", {"x": 1}, 5)["x"] == 1
        assert len(client._local.socks) == 3
    finally:
        client.close()
        for s in servers:
            s.close()


def test_a_busy_port_is_a_transport_error(pair):
    server, _ = pair
    port = int(server.address.rsplit(":", 1)[1])
    with pytest.raises(TransportError, match="cannot bind the side channel"):
        SideServer("dup", {}, "127.0.0.1", port)
