"""The client actor: one ZeroMQ DEALER per process and server, requests, routing, heartbeats.

Theory of operation
-------------------
:class:`ClientActor` owns the connection to one reference server for every shard handle of the
process that uses that server. A handle's request goes out with a fresh ``req`` number and
waits on a future; the server's reply with that ``req`` resolves it (``Failed`` raises its typed
error). Messages the server sends unasked (grants, revokes, offload requests, removals) carry a
session id and go to the :class:`~tensorhub.engine.EngineActor`.

Heartbeats go out every ``heartbeat_interval`` (the server's figure, from ``Opened``) for all
open sessions in one message. When nothing at all has come from the server for
``heartbeat_timeout``, the server is taken as gone: every waiting request fails with
:class:`~tensorhub.errors.ServerUnavailable` and the engine aborts its pulls.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from . import messages as m
from .actor import Actor
from .errors import ServerUnavailable, TensorHubError, error_from_wire
from .wire import MAX_FRAME_BYTES, decode, encode

if TYPE_CHECKING:
    from .engine import EngineActor

__all__ = ["Call", "ClientActor", "Send"]

_REPLIES = (m.Ack, m.Failed, m.Opened, m.Replicated, m.Updated, m.Listing, m.HeartbeatAck)
_TO_ENGINE = (
    m.Grant, m.Revoke, m.ChecksumsReady, m.OffloadRequest, m.FreeOffload, m.VerifyRequest, m.Quarantined, m.Removed,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Call:
    """Send ``build(req)`` and answer with the server's reply. ``session`` (if any) lets a
    removal of that session fail the call at once."""

    build: Callable[[int], Any]
    session: int | None = None


@dataclass(frozen=True, slots=True)
class Send:
    """Send a message whose answer only matters if it is an error (then it is logged).
    ``unanswered``: the server sends no reply on success (progress reports)."""

    build: Callable[[int], Any]
    unanswered: bool = False


@dataclass(frozen=True, slots=True)
class _Incoming:
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class _Beat:
    pass


class ClientActor(Actor):
    def __init__(self, address: str, ctx: zmq.asyncio.Context, engine: EngineActor) -> None:
        super().__init__(f"client:{address}")
        self.address = address
        self.ctx = ctx
        self.engine = engine
        self.sock: zmq.asyncio.Socket | None = None
        self._req = itertools.count(1)
        self.pending: dict[int, tuple[asyncio.Future, int | None]] = {}
        self.sessions: dict[int, None] = {}
        self.heartbeat_interval = 1.0
        self.heartbeat_timeout = 10.0
        self.last_heard = time.monotonic()
        self.lost: ServerUnavailable | None = None
        self._next_beat = 0.0  # when the next heartbeat is due (monotonic)

    async def on_start(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.connect(self.address)
        self.sock = sock
        self.spawn(self._reader(), "client-reader")
        self.every(0.2, _Beat)

    async def on_stop(self) -> None:
        self._fail_all(ServerUnavailable(f"client for {self.address} closed"))
        if self.sock is not None:
            self.sock.close(0)

    async def _reader(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            self.tell(_Incoming(frames))

    # ---- outgoing ----------------------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        assert self.sock is not None
        try:
            self.sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again as err:
            raise ServerUnavailable(f"cannot send to {self.address}: the queue to the server is full") from err

    def on_Call(self, call: Call) -> asyncio.Future:
        if self.lost is not None:
            raise self.lost
        req = next(self._req)
        msg = call.build(req)
        self._send(msg)
        fut = asyncio.get_running_loop().create_future()
        self.pending[req] = (fut, call.session)
        return fut

    def on_Send(self, send: Send) -> None:
        if self.lost is not None:
            return
        if send.unanswered:  # req 0: the server answers only an error, which is logged on arrival
            self._send(send.build(0))
            return
        req = next(self._req)
        msg = send.build(req)
        self._send(msg)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_log_failure(self, msg))
        self.pending[req] = (fut, getattr(msg, "session", None))

    def add_session(self, sid: int, interval: float, timeout: float) -> None:
        self.sessions[sid] = None
        self.heartbeat_interval = min(self.heartbeat_interval, interval) if len(self.sessions) > 1 else interval
        self.heartbeat_timeout = timeout
        self._next_beat = 0.0

    def drop_session(self, sid: int) -> None:
        self.sessions.pop(sid, None)

    def on__Beat(self, _: _Beat) -> None:
        now = time.monotonic()
        waiting = bool(self.pending) or bool(self.sessions)
        if self.lost is None and waiting and now - self.last_heard > self.heartbeat_timeout:
            self.lost = ServerUnavailable(f"no word from the server at {self.address} for {self.heartbeat_timeout:g} s")
            self.log.error("server lost", address=self.address)
            self._fail_all(self.lost)
            for sid in list(self.sessions):
                self.engine.tell(m.Removed(sid, ServerUnavailable.code, str(self.lost)))
            return
        if self.sessions and now >= self._next_beat and self.lost is None:
            self._next_beat = now + self.heartbeat_interval
            self.on_Send(Send(lambda req: m.Heartbeat(req, tuple(self.sessions))))

    # ---- incoming ----------------------------------------------------------------------------

    def on__Incoming(self, msg: _Incoming) -> None:
        self.last_heard = time.monotonic()
        if len(msg.frames) != 1:
            self.log.warning("server sent a multi-part message; dropped", parts=len(msg.frames))
            return
        try:
            reply = decode(msg.frames[0])
        except TensorHubError as err:
            self.log.warning("undecodable message from the server; dropped", error=str(err))
            return
        if isinstance(reply, _TO_ENGINE):
            if isinstance(reply, m.Removed):
                self._fail_session(reply.session, error_from_wire(reply.code, reply.reason))
            self.engine.tell(reply)
            return
        if isinstance(reply, m.HeartbeatAck) and reply.unknown:
            for sid in reply.unknown:
                if sid in self.sessions:
                    self.engine.tell(m.Removed(sid, "replica_removed", "the server no longer knows this session"))
                    self._fail_session(sid, error_from_wire("replica_removed", "the server no longer knows this session"))
        if isinstance(reply, _REPLIES):
            entry = self.pending.pop(reply.req, None)
            if entry is None:
                if isinstance(reply, m.Failed):
                    self.log.warning("server reported an error", code=reply.code, error=reply.message)
                return
            fut, _ = entry
            if fut.done():
                return
            if isinstance(reply, m.Failed):
                fut.set_exception(reply.error())
            else:
                fut.set_result(reply)

    def _fail_session(self, sid: int, err: TensorHubError) -> None:
        for req, (fut, s) in list(self.pending.items()):
            if s == sid:
                del self.pending[req]
                if not fut.done():
                    fut.set_exception(err)

    def _fail_all(self, err: TensorHubError) -> None:
        pending, self.pending = self.pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(err)


def _log_failure(client: ClientActor, msg: Any) -> Callable[[asyncio.Future], None]:
    def done(fut: asyncio.Future) -> None:
        err = None if fut.cancelled() else fut.exception()
        if err is not None and not isinstance(err, ServerUnavailable):  # a lost server is logged once
            client.log.warning("server refused a message", kind=type(msg).__name__, error=str(fut.exception()))

    return done
