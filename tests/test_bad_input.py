"""Bad input against the real server process: each gets a typed error, changes nothing, and the
server goes on serving the other clients."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

import tensorhub
from tensorhub.core import errors as e
from tensorhub.core import messages as m
from tensorhub.core.layout import Layout, TensorSpec
from tensorhub.core.topology import Location
from tensorhub.core.wire import encode

from .procs import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.alive(), f"the server died: {s.stderr()}"
    assert s.stop() == 0


class Raw:
    """A bare DEALER socket speaking (or not) the protocol."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send_frames(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def reply(self, timeout: float = 5.0):
        assert self.sock.poll(int(timeout * 1000)), "the server did not answer"
        from tensorhub.core.wire import decode

        return decode(self.sock.recv())

    def error(self, timeout: float = 5.0) -> e.TensorHubError:
        r = self.reply(timeout)
        assert isinstance(r, m.Failed), r
        return r.error()

    def open(self, replica: str, shard_idx: int = 0, num_shards: int = 1) -> int:
        self.send(m.OpenShard(1, "bad", replica, num_shards, shard_idx, "inc-" + replica, Location.default(), False, None))
        r = self.reply()
        assert isinstance(r, m.Opened), r
        return r.session

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw(server):
    r = Raw(server.address)
    yield r
    r.close()


LAYOUT = Layout((TensorSpec("w", "float32", (4,), 16),), "xxh3-64", 1 << 20, 2 << 20)


def assert_server_serves(server) -> None:
    """A well-behaved client still gets full service."""
    with tensorhub.open("healthy", "trainer", server=server.address) as t, tensorhub.open(
        "healthy", "rollout", server=server.address
    ) as r:
        src = {"w": torch.arange(8, dtype=torch.float32)}
        dst = {"w": torch.zeros(8)}
        t.register(src)
        r.register(dst)
        t.publish(1)
        assert r.replicate(1, timeout=10) == 1
        assert torch.equal(src["w"], dst["w"])
        r.close()
        t.unpublish()


@pytest.mark.parametrize(
    "frames, error",
    [
        ([b"\xc1garbage"], e.MalformedMessage),
        ([b""], e.MalformedMessage),
        ([msgpack.packb([1, "open"])], e.MalformedMessage),
        ([msgpack.packb([2, "open", {"req": 5}])], e.WireVersionMismatch),
        ([msgpack.packb([1, "no_such_kind", {"req": 5}])], e.UnknownMessageKind),
        ([msgpack.packb([1, "open", {"req": 5, "model": 3}])], e.MalformedMessage),
        ([encode(m.Heartbeat(1, ())), b"extra"], e.MalformedMessage),
        ([encode(m.Ack(3))], e.ProtocolError),  # a reply kind sent as a request
    ],
)
def test_garbage_frames_get_typed_errors(server, raw, frames, error):
    raw.send_frames(*frames)
    err = raw.error()
    assert isinstance(err, error), f"{type(err).__name__}: {err}"
    assert server.alive()


def test_the_req_of_a_bad_message_is_echoed_when_readable(raw):
    raw.send_frames(msgpack.packb([1, "open", {"req": 77, "model": 3}]))
    r = raw.reply()
    assert isinstance(r, m.Failed) and r.req == 77


def test_calls_out_of_order(server, raw):
    sid = raw.open("r0")
    raw.send(m.Publish(2, sid, 1, 1, None))  # publish before register
    assert isinstance(raw.error(), e.NotRegistered)
    raw.send(m.Unregister(3, sid))  # unregister with nothing registered
    assert isinstance(raw.error(), e.NotRegistered)
    raw.send(m.Register(4, sid, LAYOUT, {"region": 1}))
    assert isinstance(raw.reply(), m.Ack)
    raw.send(m.Publish(5, sid, 2, 1, None))
    assert isinstance(raw.reply(), m.Ack)
    raw.send(m.Unregister(6, sid))  # unregister while published
    err = raw.error()
    assert isinstance(err, e.ContractViolation) and "unpublish first" in str(err)
    raw.send(m.Progress(7, sid, 12345, 1, 0))  # progress on a grant that does not exist
    assert isinstance(raw.error(), (e.UnknownGrant, e.StaleGrant))
    raw.send(m.Publish(8, 999_999, 3, 1, None))  # a session that does not exist
    assert isinstance(raw.error(), e.UnknownSession)
    raw.send(m.CloseShard(9, sid))
    assert isinstance(raw.reply(), m.Ack)
    assert_server_serves(server)


def test_layout_mismatch(server):
    with tensorhub.open("mismatch", "a", server=server.address) as a, tensorhub.open("mismatch", "b", server=server.address) as b:
        a.register({"w": torch.zeros(4)})
        with pytest.raises(e.LayoutMismatch) as info:
            b.register({"w": torch.zeros(5)})
        assert "mismatch" in str(info.value) and "b" in str(info.value)
        b.register({"w": torch.zeros(4)})  # nothing was left half-registered


def test_api_misuse_is_typed(server):
    with tensorhub.open("misuse", "a", server=server.address) as h:
        with pytest.raises(e.NotRegistered):
            h.publish(1)
        with pytest.raises(e.NotRegistered):
            h.replicate("latest")
        with pytest.raises(e.InvalidArgument):
            h.register({"w": torch.zeros(4, 4).t()})  # not contiguous
        with pytest.raises(e.InvalidArgument):
            h.register([torch.zeros(4)])
        h.register({"w": torch.zeros(4)})
        with pytest.raises(e.AlreadyRegistered):
            h.register({"w": torch.zeros(4)})
        with pytest.raises(e.InvalidName):
            h.publish(-1)
        with pytest.raises(e.InvalidName):
            h.replicate("newest")
        h.publish(1)
        with pytest.raises(e.ContractViolation):
            h.publish(2)
        with pytest.raises(e.ContractViolation):
            h.unregister()
    with pytest.raises(e.InvalidName):
        tensorhub.open("misuse", "a", num_shards=2, shard_idx=2, server=server.address)
    with pytest.raises(e.InvalidArgument):
        tensorhub.open("misuse", "a", server="http://nowhere")


def test_concurrent_second_call_is_refused(server):
    import asyncio

    async def main() -> None:
        async with tensorhub.aio.open("concurrent", "r", server=server.address) as h:
            await h.register({"w": torch.zeros(4)})
            pending = asyncio.ensure_future(h.replicate(1, timeout=5))
            await asyncio.sleep(0.1)
            with pytest.raises(e.CallInFlight):
                await h.list()
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert await h.list() == {}  # the cancelled pull left nothing behind

    asyncio.run(main())


def test_oversize_frame_does_not_hurt_the_server(server, raw):
    raw.send_frames(b"\x00" * (17 << 20))  # over the frame limit: the server drops it
    assert_server_serves(server)


def test_unreachable_server_is_a_typed_error():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # a port that answers nothing
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(e.ServerUnavailable):
            tensorhub.open("x", "y", server=f"tcp://127.0.0.1:{port}", connect_timeout=0.5)
    finally:
        sock.close(0)
        ctx.term()


# ---- issue 36: the hard edges a new user found -------------------------------------------------


def test_republishing_a_version_with_other_bytes_is_refused(server):
    """Issue 36 (1): ``publish(1); unpublish(); <change>; publish(1)`` is refused with
    VersionConflict naming model, version and replica; readers get v1's bytes, and a reader
    without a timeout does not wait forever. Publishing it again unchanged still works."""
    w = {"x": torch.arange(64, dtype=torch.float32)}
    v1 = w["x"].clone()
    with tensorhub.open("republish", "trainer", server=server.address) as h, tensorhub.open(
        "republish", "rollout", server=server.address
    ) as r:
        h.register(w)
        h.publish(1)
        h.unpublish()
        h.publish(1)  # the same bytes again: accepted, and served (its packs are filled again)
        h.unpublish()
        w["x"].fill_(7)
        with pytest.raises(e.VersionConflict) as info:
            h.publish(1)
        err = info.value
        assert (err.model, err.version, err.replica) == ("republish", 1, "trainer")
        assert h.version is None
        dst = {"x": torch.zeros(64)}
        r.register(dst)
        assert r.replicate(1) == 1  # no timeout: the version completes from what holds it
        assert torch.equal(dst["x"], v1)
        h.publish(2)  # a new number for the new bytes
        h.unpublish()


def test_a_second_replica_publishing_a_version_with_other_bytes_is_refused(server):
    """Issue 36 (5): another replica publishing a known version with other bytes gets
    VersionConflict from publish(), not a quarantine with only a log line."""
    with tensorhub.open("second", "a", server=server.address) as a, tensorhub.open(
        "second", "b", server=server.address
    ) as b, tensorhub.open("second", "c", server=server.address) as c:
        a.register({"x": torch.ones(16)})
        a.publish(4)
        a.wait(lambda v: 4 in v, timeout=10)
        b.register({"x": torch.full((16,), 2.0)})
        for _ in range(100):  # a's checksums are declared in the background, shortly after publish
            try:
                b.publish(4)
            except e.VersionConflict as err:
                assert (err.model, err.version, err.replica) == ("second", 4, "b")
                break
            b.unpublish()
        else:
            pytest.fail("b's publish of other bytes under version 4 was never refused")
        assert set(b.list()[4]) == {"a"}
        c.register({"x": torch.ones(16)})
        c.publish(4)  # the same bytes: a second holder
        assert set(c.list()[4]) == {"a", "c"}
        c.unpublish()
        a.unpublish()


def test_a_shadow_set_sharing_storage_with_the_active_set_is_refused(server):
    """Issue 36 (2): register_shadow() given the active tensors themselves, or views sharing
    their storage, is refused with InvalidArgument naming the tensor; nothing is registered, and
    a shadow set of its own still works."""
    w = {"x": torch.arange(32, dtype=torch.float32), "y": torch.ones(8)}
    with tensorhub.open("shadowed", "trainer", server=server.address) as t, tensorhub.open(
        "shadowed", "rollout", server=server.address
    ) as r:
        t.register({k: v.clone() for k, v in w.items()})
        t.publish(1)
        active = {k: torch.zeros_like(v) for k, v in w.items()}
        r.register(active)
        assert r.replicate(1, timeout=10) == 1
        for bad in (dict(active), {"x": torch.empty(32), "y": active["x"][:8]}, {"x": active["x"].view(4, 8).view(32), "y": torch.empty(8)}):
            with pytest.raises(e.InvalidArgument) as info:
                r.register_shadow(bad)
            assert "shares storage" in str(info.value) and "rollout" in str(info.value)
        assert set(r.list()[1]) == {"trainer", "rollout"}  # no shadow replica was registered
        assert r.register_shadow({k: torch.empty_like(v) for k, v in w.items()}) > 0
        assert torch.equal(active["x"], w["x"])
        t.unpublish()
