"""The reference server: a ZeroMQ ROUTER around the sans-IO :class:`ReferenceTable`.

Theory of operation
-------------------
:class:`ServerActor` owns one ROUTER socket and one table. A reader task receives frames and
puts them in the actor's mailbox; the actor decodes each (a malformed frame, a wrong wire
version, an unknown kind or an oversize frame gets a typed ``Failed`` reply to its sender and
changes nothing), hands it to the table with the sender's routing id as the peer, and sends the
table's replies. A timer wakes the table at its next deadline (heartbeat expiry, drain and call
timeouts). The clock is ``time.monotonic``; the random source is seeded once per start.

The server never dies of a client's message: anything unexpected raised while handling one is
logged with the message kind and answered as a protocol error.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from . import messages as m
from .actor import Actor
from .errors import InvalidArgument, MalformedMessage, ProtocolError, TensorHubError
from .table import ReferenceTable, TableConfig
from .wire import MAX_FRAME_BYTES, decode, encode

__all__ = ["ServerActor", "ServerConfig", "serve"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything a server start needs.

    Attributes:
        bind: ZeroMQ address to bind (loopback by default).
        table: the table's timing parameters.
        seed: the random source's seed (None: from the OS).
        term: this start's term (None: from the clock, so a restart has a higher one).
        idle_exit: stop after this many seconds with no session open (None: never). The
            embedded default server uses it so that it does not outlive its jobs.
    """

    bind: str = "tcp://127.0.0.1:5557"
    table: TableConfig = TableConfig()
    seed: int | None = None
    term: int | None = None
    idle_exit: float | None = None


@dataclass(frozen=True, slots=True)
class _Frames:
    peer: bytes
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class _Tick:
    pass


class ServerActor(Actor):
    """The reference server's actor. ``await start()`` binds; ``await stop()`` unbinds."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None) -> None:
        super().__init__("server")
        self.config = config
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
        term = config.term if config.term is not None else int(time.time() * 1000)
        self.table = ReferenceTable(time.monotonic, random.Random(seed), config.table, term=term)
        self.sock: zmq.asyncio.Socket | None = None
        self.address = config.bind
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._idle_since = time.monotonic()
        self.frames_in = 0
        self.bad_frames = 0
        self.done = asyncio.Event()

    async def on_start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        try:
            sock.bind(self.config.bind)
        except zmq.ZMQError as err:
            sock.close(0)
            raise InvalidArgument(f"server cannot bind {self.config.bind}: {err}") from err
        self.sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.spawn(self._reader(), "server-reader")
        self.every(min(1.0, self.config.table.heartbeat_interval), _Tick)
        self.log.info("server listening", address=self.address, term=self.table.term)

    async def on_stop(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()
        self.done.set()
        self.log.info("server stopped", address=self.address)

    async def _reader(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            self.tell(_Frames(frames[0], frames[1:]))

    # ---- messages ----------------------------------------------------------------------------

    def on__Frames(self, msg: _Frames) -> None:
        self.frames_in += 1
        try:
            if len(msg.frames) != 1:
                raise MalformedMessage(f"expected one frame per message, got {len(msg.frames)}")
            request = decode(msg.frames[0])
            out = self.table.handle(msg.peer, request)
        except ProtocolError as err:
            self.bad_frames += 1
            out = [(msg.peer, m.Failed.of(_salvage_req(msg.frames), err))]
        except TensorHubError as err:  # pragma: no cover - the table answers these itself
            out = [(msg.peer, m.Failed.of(0, err))]
        except Exception as err:
            self.bad_frames += 1
            self.log.exception("internal error handling a message", peer=msg.peer.hex())
            out = [(msg.peer, m.Failed.of(_salvage_req(msg.frames), ProtocolError(f"internal server error: {err!r}")))]
        self._send(out)
        self._schedule()

    def on__Tick(self, _: _Tick) -> None:
        self._send(self.table.tick())
        self._schedule()
        if self.config.idle_exit is not None:
            now = time.monotonic()
            if self.table.sessions:
                self._idle_since = now
            elif now - self._idle_since >= self.config.idle_exit:
                self.log.info("no sessions; idle exit", idle_s=round(now - self._idle_since, 1))
                self.spawn(self.stop(), "server-idle-exit")

    def _send(self, out: list[tuple[Any, Any]]) -> None:
        sock = self.sock
        assert sock is not None
        for peer, reply in out:
            try:
                sock.send_multipart([peer, encode(reply)], flags=zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("client not keeping up; reply dropped", peer=peer.hex(), kind=type(reply).__name__)

    def _schedule(self) -> None:
        """Wake the table at its next deadline (the periodic tick covers the rest)."""
        when = self.table.next_deadline()
        if when is None or (self._wake_at is not None and self._wake_at <= when):
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = when
        assert self.loop is not None
        delay = max(0.0, when - time.monotonic())

        def fire() -> None:
            self._wake = self._wake_at = None
            self.tell(_Tick())

        self._wake = self.loop.call_later(delay, fire)


def _salvage_req(frames: list[bytes]) -> int:
    """The ``req`` of a frame that failed to decode, if it can be read at all (for the reply)."""
    try:
        obj = msgpack.unpackb(frames[0], raw=False, max_bin_len=1 << 20, max_str_len=1 << 20,
                              max_array_len=16, max_map_len=4096, max_ext_len=0)  # fmt: skip
        req = obj[2]["req"]
        return req if type(req) is int and 0 <= req < 1 << 63 else 0
    except Exception:  # noqa: BLE001 - garbage stays garbage
        return 0


async def serve(config: ServerConfig, ready: Any = None) -> None:
    """Run a server until SIGINT/SIGTERM (or idle exit). ``ready(address)`` is called once bound."""
    server = ServerActor(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    if ready is not None:
        ready(server.address)
    await server.done.wait()
