"""The client actor: one ZeroMQ DEALER per process and server list, requests, routing,
heartbeats, and failover to the next server.

Theory of operation
-------------------
:class:`ClientActor` owns the connection to the reference server for every shard handle of the
process that names the same ordered list of server addresses (``server="tcp://a:5557,tcp://b:5557"``).
It talks to one of them at a time. A handle's request goes out with a fresh ``req`` number and
waits on a future; the server's reply with that ``req`` resolves it (``Failed`` raises its typed
error). Messages the server sends unasked (grants, revokes, offload requests, removals) carry a
session id and go to the :class:`~tensorhub.runtime.engine.EngineActor`.

Session ids. Each server numbers its sessions its own way, so the handles and the engine know a
shard by a *local* id, unique in the process, that this actor gives it when its first
``OpenShard`` is answered (the first server's id, unless the process already uses that one);
the actor maps it to the current server's id on every message out (and back on every message
in). After a failover the mapping changes; the handles, the engine's
slots and the user's tensors do not.

Connection identity. The actor's socket carries one random routing id (:attr:`ClientActor.identity`)
on every connection, kept across reconnects and moves: the server binds each session to the
connection that opened it, so only this actor can act for its sessions, and a reconnect (the
server takes the id over from a connection it has not yet seen close) keeps them.

Heartbeats go out every ``heartbeat_interval`` (the server's figure, from ``Opened``) for all
open sessions in one message. When nothing at all has come from the server for
``heartbeat_timeout``, the server is taken as gone (``lost``):

1. every request waiting for an answer fails with :class:`~tensorhub.errors.ServerUnavailable`
   (none is re-sent by this actor: a handle gives the call number back, so that a call made
   again after the move gets the answer its sibling shards were given), and the engine suspends
   its pulls (their grants are void; what they verified stays); the registered tensors and
   complete holdings are untouched and stay servable to peers that were already granted them;
2. the actor looks for a server: the next addresses of the list in order, wrapping around, so
   that the lost one is tried last; each probe is bounded by ``attempt_timeout``; after a full
   round with no answer it backs off (doubling, at most ``_MAX_BACKOFF`` s), and gives up after
   ``failover_timeout``;
3. on the server found it re-opens every session (same incarnation, location, spot and retention
   declaration), re-registers its layout and announces what it holds (``Announce``: complete and
   offload copies with their checksums, and its last model-parallel answers), through the owning
   handle's ``restore``; if that server fails meanwhile, it goes on with the next;
4. then requests flow again. Meanwhile new requests fail at once with ``ServerUnavailable``
   (the handle turns ``update()`` into "no newer version": False).

If it gives up, the sessions are removed (the engine stops serving them) and every later
request fails with ``ServerUnavailable``; a new handle gets a new client.

No split brain (:class:`tensorhub.core.table.reign.Reign`). With a primary and a backup, a
server decides only while it holds the backup's lease or a majority of votes, and a client's
heartbeats are its vote: each echoes the latest stamp of the current server's
``HeartbeatAck`` (forgotten on every move, so a vote never follows the client elsewhere). A
``StepDown`` from the server (it stopped deciding) is a loss, acted on at once: the client
moves to the next address. A server that answers ``reigning=False`` refuses calls (they fail
with ``ServerUnavailable``); a client parked there probes the other addresses (those before it
first) every ``_LOOK_BACK_EVERY`` s and moves to the first that answers that it decides (the
primary, once it is reachable again; or the primary when the list names its backup first). A
handle's ``update()`` refused there asks for that look at once (:meth:`ClientActor.seek_reign`)
and is made again on the server found.

A pull under way at the loss survives it: its handle waits for the move (within the call's
timeout), re-announces the pull as a partial holding with what it verified (``partial`` of
``Announce``), and makes the same call again (same number); the next server decides it for the
announced version while that is still available, grants a source, and the pull resumes from its
verified ranges. A handle that cannot wait (no server within its timeout) aborts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import zmq
import zmq.asyncio

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    ContractViolation,
    InvalidArgument,
    ServerUnavailable,
    TensorHubError,
    Timeout,
    UnknownSession,
    error_from_wire,
)
from tensorhub.core.wire import MAX_FRAME_BYTES, decode, encode

from .actor import Actor
from .engine import ServerTerm, SuspendPull
from .security import ClientKeys, apply_client, client_keys

if TYPE_CHECKING:
    from .engine import EngineActor

__all__ = ["Call", "ClientActor", "Send", "SessionOwner"]

_REPLIES = (m.Ack, m.Failed, m.Opened, m.Replicated, m.Updated, m.Listing, m.HeartbeatAck)
_TO_ENGINE = (
    m.Grant, m.Convert, m.Revoke, m.ChecksumsReady, m.ChecksumsPartReady, m.OffloadRequest, m.FreeOffload, m.VerifyRequest,
    m.Quarantined, m.Removed,
)  # fmt: skip

#: Local session ids in use in this process (the engine's slots are keyed by them). A session's
#: local id is the id its first server gave it, unless another session of the process has it.
_LOCAL_IN_USE: dict[int, None] = {}
_SPARE_IDS = itertools.count(1 << 48)


def _take_local_id(remote: int) -> int:
    local = remote if remote not in _LOCAL_IN_USE else next(_SPARE_IDS)
    _LOCAL_IN_USE[local] = None
    return local

_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
_LOOK_BACK_EVERY = 2.0  # seconds between probes of the earlier servers while parked on one that does not decide
#: the longest a move back to a server that decides waits for the calls in flight to be answered
#: (moving fails them with ServerUnavailable: a ``register`` sent just before the move was lost so)
_HOLD_MOVE_S = 10.0
#: A report (a completion, a source failure, declared checksums...) that the server refused
#: because it does not decide now (a primary holding its state until its backup answers) is sent
#: again this often, this many times at most (two default leases: a hold lasts no longer), while
#: the client stays on that server: the fact it states stays true, and lost, its grant would hang
#: until revoked and a version's checksums would never be declared.
_REPORT_RETRY_S = 0.25
_REPORT_RETRIES = 40

#: ``send(build)`` as a handle's ``restore`` gets it: one request to the new server, bounded in time.
Exchange = Callable[[Callable[[int], Any]], Awaitable[Any]]


class SessionOwner(Protocol):
    """What the client needs from a shard handle to re-open its session on another server."""

    def open_message(self, req: int) -> m.OpenShard:
        """The handle's ``OpenShard`` (same incarnation every time)."""

    async def restore(self, send: Exchange) -> None:
        """Re-register and announce what the shard holds, through ``send``."""


@dataclass(frozen=True, slots=True)
class Call:
    """Send ``build(req)`` and answer with the server's reply. ``session`` (if any) lets a
    removal of that session fail the call at once. ``adopt``: the call is an ``OpenShard`` of
    this owner; its answer is ``(local session id, Opened)``."""

    build: Callable[[int], Any]
    session: int | None = None
    adopt: SessionOwner | None = None


@dataclass(frozen=True, slots=True)
class Send:
    """Send a message whose answer only matters if it is an error (then it is logged).
    ``unanswered``: the server sends no reply on success (progress reports)."""

    build: Callable[[int], Any]
    unanswered: bool = False
    refused: int = 0  #: how many times the server refused it so far (``ServerUnavailable``)


@dataclass(frozen=True, slots=True)
class _Incoming:
    sock: Any
    frames: list[bytes]


@dataclass(frozen=True, slots=True)
class _Beat:
    pass


_BEAT_S = 0.2  # the client's clock: heartbeats due, servers lost, looks back at the primary
_MIN_STALL_S = 0.3  # a beat later than this is a stall of this process (see on__Beat)


@dataclass(frozen=True, slots=True)
class _Raw:
    """A request of the failover task: sent even while ``lost`` (to the server being moved to)."""

    build: Callable[[int], Any]


@dataclass(frozen=True, slots=True)
class _Switch:
    index: int


@dataclass(frozen=True, slots=True)
class _Reopened:
    local: int
    opened: m.Opened


@dataclass(frozen=True, slots=True)
class _Dead:
    local: int
    error: TensorHubError


@dataclass(frozen=True, slots=True)
class _Moved:
    pass


@dataclass(frozen=True, slots=True)
class _MoveBack:
    index: int


@dataclass(frozen=True, slots=True)
class _GaveUp:
    error: ServerUnavailable


class _Shard:
    __slots__ = ("owner", "remote")

    def __init__(self, owner: SessionOwner | None, remote: int | None) -> None:
        self.owner = owner
        self.remote = remote  # the current server's id for it (None: not open there)


class ClientActor(Actor):
    """Args:
    addresses: the servers, in order of preference (one address: a list of one).
    ctx: the process's ZeroMQ context.
    engine: the process's engine (told of grants, removals, aborts).
    failover_timeout: how long to look for a server (at the start, or after a loss) before
        giving up.
    attempt_timeout: the bound of one probe, and of each request re-opening a session.
    keys: CURVE keys for every server of the list (default: from ``$TENSORHUB_CURVE_SERVER_KEY``
        and ``$TENSORHUB_CURVE_SECRET``, see :func:`tensorhub.runtime.security.client_keys`; None when
        those are not set: plain connections).

    Raises:
        InvalidArgument: the CURVE environment is half set or names unreadable keys; ``keys`` is
            none of those.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        ctx: zmq.asyncio.Context,
        engine: EngineActor,
        failover_timeout: float = 120.0,
        attempt_timeout: float = 2.0,
        keys: ClientKeys | None | Literal["env"] = "env",
    ) -> None:
        if keys == "env":
            keys = client_keys()
        elif keys is not None and not isinstance(keys, ClientKeys):
            raise InvalidArgument(f"keys must be ClientKeys, None or 'env', got {keys!r}")
        self.keys: ClientKeys | None = keys
        self.addresses = (addresses,) if isinstance(addresses, str) else tuple(addresses)
        super().__init__(f"client:{','.join(self.addresses)}")
        self.index = 0
        self.address = self.addresses[0]
        #: this process's connection identity on every server (its ZeroMQ routing id): the
        #: server binds the sessions opened through it to it, so it is random, kept across
        #: reconnects and never shown (a leading zero byte is reserved by ZeroMQ)
        self.identity = bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(15)
        self.ctx = ctx
        self.engine = engine
        self.failover_timeout = failover_timeout
        self.attempt_timeout = attempt_timeout
        self.sock: zmq.asyncio.Socket | None = None
        self._reader_task: asyncio.Task | None = None
        self._req = itertools.count(1)
        self.pending: dict[int, tuple[asyncio.Future, int | None, SessionOwner | None]] = {}
        self._calls: set[int] = set()  # the pending requests that are a handle's calls (not reports or heartbeats)
        #: a move back held until the calls in flight are answered: (the server's index, held since)
        self._held_move: tuple[int, float] | None = None
        self.sessions: dict[int, _Shard] = {}  # local id -> shard
        self._remote: dict[int, int] = {}  # the current server's session id -> local id
        self._dead: dict[int, TensorHubError] = {}  # local sessions that could not be restored, or that the server removed
        self.heartbeat_interval = 1.0
        self.heartbeat_timeout = 10.0
        self.last_heard = time.monotonic()
        self._beat_at = self.last_heard  # when on__Beat last ran
        #: Set while no server is connected (before the first, during a failover, after giving up).
        self.lost: ServerUnavailable | None = ServerUnavailable(f"not connected yet to {self._names()}")
        #: Set once the actor gave up looking for a server: nothing will work any more.
        self.gave_up: ServerUnavailable | None = None
        self.failovers = 0  # moves to another server after a loss
        self._ever_connected = False
        self._connected = asyncio.Event()
        self._next_beat = 0.0  # when the next heartbeat is due (monotonic)
        #: the latest (term, stamp) of the current server's heartbeat answers, echoed in every
        #: heartbeat (the client's vote, :class:`tensorhub.core.table.reign.Reign`); forgotten
        #: on every move, so that a vote never follows the client to another server
        self._stamp: tuple[int, float] = (0, 0.0)
        #: whether the current server said it decides (False: calls are refused there)
        self.reigning = True
        self._next_look_back = 0.0  # when a client parked on a server that does not reign next probes the earlier ones
        self._looking_back = False

    def failing_over(self, local: int | None) -> bool:
        """No server is connected now, but one is being looked for, and session ``local`` will
        be restored there (it is not dead)."""
        return self.lost is not None and self.gave_up is None and not self.stopped and local not in self._dead

    def _names(self) -> str:
        return ", ".join(self.addresses)

    async def on_start(self) -> None:
        self.spawn(self._find_and_move(0, first=True), "client-connect")
        self._beat_at = time.monotonic()
        self.every(_BEAT_S, _Beat)

    async def on_stop(self) -> None:
        self._fail_all(ServerUnavailable(f"client for {self._names()} closed"))
        for local in self.sessions:
            _LOCAL_IN_USE.pop(local, None)
        self._connected.set()
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    async def ready(self, timeout: float) -> None:
        """Wait until a server is connected.

        Raises:
            ServerUnavailable: none within ``timeout`` seconds, or the actor gave up.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.gave_up is not None:
                raise self.gave_up
            if self.stopped:
                raise ServerUnavailable(f"client for {self._names()} closed")
            if self.lost is None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerUnavailable(f"no answer from the server at {self._names()} in {timeout:g} s")
            try:
                await asyncio.wait_for(self._connected.wait(), left)
            except TimeoutError:
                pass

    async def _reader(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.tell(_Incoming(sock, frames))

    # ---- outgoing ----------------------------------------------------------------------------

    def _outgoing(self, msg: Any) -> Any:
        """``msg`` with the current server's session ids in place of the local ones."""
        if isinstance(msg, m.Heartbeat):  # not for sessions the server removed: they stay removed
            remote = tuple(s.remote for local, s in self.sessions.items() if s.remote is not None and local not in self._dead)
            return dataclasses.replace(msg, sessions=remote)
        local = getattr(msg, "session", None)
        if local is None:
            return msg
        dead = self._dead.get(local)
        if dead is not None:
            raise dead
        shard = self.sessions.get(local)
        if shard is None or shard.remote is None:
            raise ServerUnavailable(f"session {local} is not open on the server at {self.address}")
        return dataclasses.replace(msg, session=shard.remote)

    def _send(self, msg: Any) -> None:
        if self.sock is None:
            raise ServerUnavailable(f"not connected to {self._names()}")
        try:
            self.sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again as err:
            raise ServerUnavailable(f"cannot send to {self.address}: the queue to the server is full") from err

    def _request(self, build: Callable[[int], Any], session: int | None, adopt: SessionOwner | None = None) -> asyncio.Future:
        req = next(self._req)
        msg = self._outgoing(build(req))
        self._send(msg)
        fut = asyncio.get_running_loop().create_future()
        self.pending[req] = (fut, session, adopt)
        self._calls.add(req)
        return fut

    def on_Call(self, call: Call) -> asyncio.Future:
        if call.session is not None and call.session in self._dead:
            raise self._dead[call.session]
        if self.lost is not None:
            raise self.lost
        return self._request(call.build, call.session, call.adopt)

    def on__Raw(self, raw: _Raw) -> asyncio.Future:
        return self._request(raw.build, None)

    def report(self, build: Callable[[int], Any], unanswered: bool = False) -> None:
        """Send ``build(req)`` to the server from any coroutine of this loop; an error in the
        answer is logged (an engine slot's ``report``)."""
        self.tell(Send(build, unanswered))

    def on_Send(self, send: Send) -> None:
        if self.lost is not None:
            return
        try:
            if send.unanswered:  # req 0: the server answers only an error, which is logged on arrival
                self._send(self._outgoing(send.build(0)))
                return
            req = next(self._req)
            built = send.build(req)
            msg = self._outgoing(built)
        except TensorHubError as err:
            self.log.debug("message not sent", error=str(err))
            return
        self._send(msg)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_log_failure(self, msg, send, self.address))
        self.pending[req] = (fut, getattr(built, "session", None), None)

    def drop_session(self, local: int) -> None:
        """The handle closed. (If it could not tell the server, because none is connected,
        the session is closed on the server being moved to, if it was re-opened there.)"""
        shard = self.sessions.pop(local, None)
        self._dead.pop(local, None)
        _LOCAL_IN_USE.pop(local, None)
        if shard is None or shard.remote is None:
            return
        self._remote.pop(shard.remote, None)
        if self.lost is not None and self.sock is not None and self.gave_up is None:
            remote = shard.remote
            try:
                self._send(m.CloseShard(0, remote))
            except ServerUnavailable:
                pass

    def _adopt(self, owner: SessionOwner, opened: m.Opened) -> int:
        local = _take_local_id(opened.session)
        self.sessions[local] = _Shard(owner, opened.session)
        self._remote[opened.session] = local
        self._learn_timing(opened)
        self.engine.tell(ServerTerm(local, opened.term))
        return local

    def _learn_timing(self, opened: m.Opened) -> None:
        first = sum(1 for s in self.sessions.values() if s.remote is not None) <= 1
        interval = opened.heartbeat_interval
        self.heartbeat_interval = interval if first else min(self.heartbeat_interval, interval)
        self.heartbeat_timeout = opened.heartbeat_timeout
        self._next_beat = 0.0
        if not self._stamp[0]:
            # The term is known from the first answer, not only from the first heartbeat ack: a
            # server restarted before that ack came would otherwise be taken at its word that
            # our sessions are unknown (a removal) instead of being moved to.
            self._stamp = (opened.term, 0.0)

    def on__Beat(self, _: _Beat) -> None:
        now = time.monotonic()
        # Beats come every _BEAT_S. A longer gap means this process stood still (not scheduled
        # on a machine whose cores are busy, or its loop held up): the server's answers sent
        # meanwhile may still sit unread, so the gap is not held against the server.
        stalled = now - self._beat_at - _BEAT_S
        self._beat_at = now
        if stalled > _MIN_STALL_S:
            self.last_heard = min(self.last_heard + stalled, now)
        if self.lost is None:
            waiting = bool(self.pending) or bool(self.sessions)
            if waiting and now - self.last_heard > self.heartbeat_timeout:
                self._lose(ServerUnavailable(f"no word from the server at {self.address} for {self.heartbeat_timeout:g} s"))
                return
            if not self.reigning and len(self.addresses) > 1 and not self._looking_back and now >= self._next_look_back:
                self._next_look_back = now + _LOOK_BACK_EVERY
                self._looking_back = True
                self.spawn(self._look_back(), "client-look-back")
        elif self.sock is None or self.gave_up is not None:
            return
        # Also while sessions are being restored on a new server: those already re-opened
        # there must not expire before the last one is done.
        if self.sessions and now >= self._next_beat:
            self._next_beat = now + self.heartbeat_interval
            req = next(self._req)
            msg = self._outgoing(m.Heartbeat(req, (), self._stamp[1], self._stamp[0]))
            if not msg.sessions:
                return
            try:
                self._send(msg)
            except ServerUnavailable as err:
                self.log.warning("heartbeat not sent", error=str(err))
                return
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_log_failure(self, msg))
            self.pending[req] = (fut, None, None)

    async def _look_back(self) -> None:
        """Parked on a server that does not decide: move to another one of the list that says
        it decides (the earlier ones first: the primary)."""
        from .embedded import probe

        try:
            order = [*range(self.index), *range(self.index + 1, len(self.addresses))]
            for idx in order:
                if await probe(self.ctx, self.addresses[idx], self.attempt_timeout, self.keys, reigning=True):
                    self.tell(_MoveBack(idx))
                    return
        finally:
            self._looking_back = False

    async def seek_reign(self, timeout: float) -> bool:
        """Parked on a server that does not decide: look for one that does now (not at the next
        periodic look) and wait, within ``timeout`` seconds, until the client is connected to a
        server that decides. Returns whether it is."""
        self._next_look_back = 0.0
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.stopped and self.gave_up is None:
            if self.lost is None and self.reigning and self._stamp[1] > 0:
                return True  # connected, and the server's latest answer said it decides
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return False

    def on__MoveBack(self, msg: _MoveBack) -> None:
        if self.lost is not None or self.reigning or msg.index == self.index:
            self._held_move = None
            return
        # A handle's call in flight would fail with ServerUnavailable: the move waits for its
        # answer (a server that does not decide answers at once), for _HOLD_MOVE_S at most.
        now = time.monotonic()
        since = self._held_move[1] if self._held_move is not None else now
        if self._calls and now - since < _HOLD_MOVE_S:
            self._held_move = (msg.index, since)
            return
        self._lose(ServerUnavailable(f"the server at {self.address} does not decide; moving back to "
                                     f"{self.addresses[msg.index]}"), start=msg.index)  # fmt: skip

    def _lose(self, err: ServerUnavailable, start: int | None = None) -> None:
        self.lost = err
        self._held_move = None
        self._connected.clear()
        self.log.error("server lost; failing over", address=self.address, others=len(self.addresses) - 1, reason=str(err))
        for local in self.sessions:
            # Before the calls fail: a pull keeps what it verified and waits for the next
            # server's grant (its handle re-announces it); a handle that gives up aborts it.
            self.engine.tell(SuspendPull(local))
        self._fail_all(err)
        self.spawn(self._find_and_move(self.index + 1 if start is None else start), "client-failover")

    # ---- failover ----------------------------------------------------------------------------

    async def _probe(self, address: str) -> bool:
        from .embedded import probe

        return await probe(self.ctx, address, self.attempt_timeout, self.keys)

    async def _find_and_move(self, start: int, first: bool = False) -> None:
        """Find a server from ``start`` on (wrapping around), move there and restore every
        session; give up after ``failover_timeout``."""
        n = len(self.addresses)
        deadline = time.monotonic() + self.failover_timeout
        backoff = _FIRST_BACKOFF
        tried = 0
        while time.monotonic() < deadline:
            idx = (start + tried) % n
            tried += 1
            if await self._probe(self.addresses[idx]):
                await self.ask(_Switch(idx))
                try:
                    await self._restore_all()
                except (ServerUnavailable, Timeout) as err:
                    self.log.warning("server failed while sessions were restored", address=self.addresses[idx], error=str(err))
                    await self.ask(_Switch(-1))
                else:
                    await self.ask(_Moved())
                    if not first:
                        self.log.warning("moved to another server", address=self.addresses[idx], sessions=len(self.sessions))
                    return
            if tried % n == 0:  # a whole round without a server
                await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, _MAX_BACKOFF)
        self.tell(_GaveUp(ServerUnavailable(f"no server of {self._names()} answered within {self.failover_timeout:g} s")))

    async def _restore_all(self) -> None:
        async def send(build: Callable[[int], Any]) -> Any:
            try:
                return await self.ask(_Raw(build), timeout=self.attempt_timeout)
            except Timeout:
                raise ServerUnavailable(f"no answer from the server at {self.address} in {self.attempt_timeout:g} s") from None

        for local in list(self.sessions):
            shard = self.sessions.get(local)
            if shard is None or shard.owner is None or local in self._dead:
                continue  # closed meanwhile
            opened = await send(shard.owner.open_message)
            if not await self.ask(_Reopened(local, opened)):
                continue
            try:
                await shard.owner.restore(send)
            except ServerUnavailable:
                raise
            except ContractViolation as err:
                # The server still has this session (the same one came back within its timeout):
                # it knows what it holds; nothing to announce.
                self.log.info("server still knew the session; nothing re-announced", session=local, error=str(err))
            except TensorHubError as err:
                self.log.error("session could not be restored on the new server", session=local, error=str(err))
                await self.ask(_Dead(local, err))

    def on__Switch(self, msg: _Switch) -> None:
        """Connect to ``addresses[index]`` (-1: just drop the current connection)."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._reader_task = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self._remote.clear()
        self._stamp = (0, 0.0)  # a vote never follows the client to another server
        self.reigning = True
        for shard in self.sessions.values():
            shard.remote = None
        self._fail_all(ServerUnavailable(f"left the server at {self.address}"))  # nothing sent there will be answered
        if msg.index < 0:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)  # the sessions opened through it are bound to it
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        apply_client(sock, self.keys)
        sock.connect(self.addresses[msg.index])
        self.sock = sock
        self.index = msg.index
        self.address = self.addresses[msg.index]
        self.last_heard = time.monotonic()
        self._reader_task = self.spawn(self._reader(sock), "client-reader")

    def on__Reopened(self, msg: _Reopened) -> bool:
        shard = self.sessions.get(msg.local)
        if shard is None:  # closed while it was re-opened: close it there too
            try:
                self._send(m.CloseShard(0, msg.opened.session))
            except ServerUnavailable:
                pass
            return False
        shard.remote = msg.opened.session
        self._remote[msg.opened.session] = msg.local
        self._learn_timing(msg.opened)
        self.engine.tell(ServerTerm(msg.local, msg.opened.term))
        return True

    def on__Dead(self, msg: _Dead) -> None:
        if msg.local in self.sessions:
            self._dead[msg.local] = msg.error
            self.engine.tell(m.Removed(msg.local, type(msg.error).code, str(msg.error)))

    def on__Moved(self, _: _Moved) -> None:
        if self._ever_connected:
            self.failovers += 1
        self._ever_connected = True
        self.lost = None
        self.last_heard = time.monotonic()
        self._next_beat = 0.0
        self._connected.set()

    def on__GaveUp(self, msg: _GaveUp) -> None:
        self.log.error("no server answered; giving up", addresses=self._names(), error=str(msg.error))
        self.gave_up = self.lost = msg.error
        for local in self.sessions:
            if local not in self._dead:
                self._dead[local] = msg.error
                self.engine.tell(m.Removed(local, ServerUnavailable.code, str(msg.error)))
        self._fail_all(msg.error)
        self._connected.set()

    # ---- incoming ----------------------------------------------------------------------------

    def on__Incoming(self, msg: _Incoming) -> None:
        if msg.sock is not self.sock:
            return  # from a server this actor has left
        self.last_heard = time.monotonic()
        if len(msg.frames) != 1:
            self.log.warning("server sent a multi-part message; dropped", parts=len(msg.frames))
            return
        try:
            reply = decode(msg.frames[0])
        except TensorHubError as err:
            self.log.warning("undecodable message from the server; dropped", error=str(err))
            return
        if isinstance(reply, m.StepDown):
            if self.lost is None:  # move at once (the server that stepped down is tried last)
                self._lose(ServerUnavailable(f"the server at {self.address} stepped down: {reply.reason}"))
            return
        if isinstance(reply, _TO_ENGINE):
            local = self._remote.get(reply.session)
            if local is None:
                self.log.debug("message for a session this client does not have; dropped", kind=type(reply).__name__)
                return
            reply = dataclasses.replace(reply, session=local)
            if isinstance(reply, m.Removed):
                if local in self._dead:
                    return  # said once already
                removed = error_from_wire(reply.code, reply.reason)
                self._dead[local] = removed  # its calls raise this, and it is heartbeated no more
                self._fail_session(local, removed)
            self.engine.tell(reply)
            return
        if isinstance(reply, m.HeartbeatAck) and reply.term:
            known = self._stamp[0]
            if known and reply.term != known:
                # The server restarted at the same address faster than the silence that would
                # have said so: its new start knows none of our sessions. Move (to it again) and
                # re-announce, as after any loss, rather than taking "unknown" as a removal; and
                # until moved, a new term's word on our sessions (a later ack) means nothing.
                if self.lost is None:
                    self._lose(ServerUnavailable(f"the server at {self.address} restarted (term {known} -> {reply.term})"))
                return
            self._stamp = (reply.term, reply.stamp)
            self.reigning = reply.reigning
        if isinstance(reply, m.HeartbeatAck) and reply.unknown:
            for remote in reply.unknown:
                local = self._remote.get(remote)
                if local is not None and local in self.sessions and local not in self._dead:
                    gone = error_from_wire("replica_removed", "the server no longer knows this session")
                    self._dead[local] = gone  # told once; no more heartbeats for it
                    self.engine.tell(m.Removed(local, gone.code, gone.message))
                    self._fail_session(local, gone)
        if isinstance(reply, m.Failed) and reply.code == UnknownSession.code and self.lost is None and self.sessions:
            entry = self.pending.get(reply.req)
            named = entry[1] if entry is not None else None
            if named is None or named in self.sessions:
                # A server that never knew our sessions (those it removed or fenced it says so)
                # is a new start at this address: move to it and re-announce, as after any loss;
                # the call fails with ServerUnavailable and is made again once moved.
                self._lose(ServerUnavailable(f"the server at {self.address} does not know this client's sessions: it restarted"))
                return
            # A message for a session this client closed meanwhile (an engine's late report):
            # only that message failed; the server did not forget the sessions still open.
        if isinstance(reply, _REPLIES):
            entry = self.pending.pop(reply.req, None)
            self._calls.discard(reply.req)
            if not self._calls and self._held_move is not None:
                self.tell(_MoveBack(self._held_move[0]))
            if entry is None:
                if isinstance(reply, m.Failed):
                    self.log.warning("server reported an error", code=reply.code, error=reply.message)
                return
            fut, _, adopt = entry
            if fut.done():
                return
            if isinstance(reply, m.Failed):
                fut.set_exception(reply.error())
            elif adopt is not None and isinstance(reply, m.Opened):
                fut.set_result((self._adopt(adopt, reply), reply))
            else:
                fut.set_result(reply)

    def _fail_session(self, local: int, err: TensorHubError) -> None:
        for req, (fut, s, _) in list(self.pending.items()):
            if s == local:
                del self.pending[req]
                self._calls.discard(req)
                if not fut.done():
                    fut.set_exception(err)

    def _fail_all(self, err: TensorHubError) -> None:
        pending, self.pending = self.pending, {}
        self._calls.clear()
        for fut, _, _ in pending.values():
            if not fut.done():
                fut.set_exception(err)


def _log_failure(client: ClientActor, msg: Any, send: Send | None = None, address: str = "") -> Callable[[asyncio.Future], None]:
    def done(fut: asyncio.Future) -> None:
        err = None if fut.cancelled() else fut.exception()
        if err is None:
            return
        if not isinstance(err, ServerUnavailable):
            client.log.warning("server refused a message", kind=type(msg).__name__, error=str(err))
            return
        # A lost server is logged once (and what was sent there is moot). The server itself said
        # it does not decide now, still connected to it: send the report again shortly.
        if send is not None and client.lost is None and client.address == address and not client.stopped:
            if send.refused < _REPORT_RETRIES:
                client.after(_REPORT_RETRY_S, dataclasses.replace(send, refused=send.refused + 1))
            else:
                client.log.warning("server refused a report every time; given up", kind=type(msg).__name__,
                                   tries=send.refused + 1, error=str(err))  # fmt: skip

    return done
