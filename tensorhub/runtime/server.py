"""The reference server: a ZeroMQ ROUTER around the sans-IO :class:`ReferenceTable`.

Theory of operation
-------------------
:class:`ServerActor` owns one ROUTER socket and one table. A reader task receives frames and
puts them in the actor's mailbox; the actor decodes each (a malformed frame, a wrong wire
version, an unknown kind or an oversize frame gets a typed ``Failed`` reply to its sender and
changes nothing), hands it to the table with the sender's routing id as the peer, and sends the
table's replies. A timer wakes the table at its next deadline (heartbeat expiry, drain and call
timeouts). The clock is ``time.monotonic``; the random source is seeded once per start.

The socket is read without pyzmq's asyncio layer: the event loop watches the ROUTER's
notification descriptor, and a callback takes every frame waiting (up to ``_BATCH``) in one go
and hands them to the mailbox as one batch; replies go out with plain non-blocking sends. A
descriptor that signals only changes (ZeroMQ's is edge-like) is handled by checking the socket
for more input after every batch and every send, so no frame waits for a signal that already
came. At thousands of sessions this is most of the server's cost: one future, two enum flag
operations and a wakeup of the mailbox task per frame, against one of each per batch.

Heartbeats are answered as they are read, ahead of the frames read before them (they keep
sessions alive and change nothing the others depend on), and a batch looks at the socket every
``_POLL_EVERY`` frames: otherwise a heartbeat sent during a burst waits unread behind every
connection's update (ZeroMQ reads one frame per connection per round), then behind the batch
it was read in. The other frames read during a batch reach the mailbox once the loop has run,
so that the loop still runs its timers, the backup's lease replies and the socket watch, and a
batch looks only while fewer than ``_EAGER_QUEUED`` frames wait: past that the server is behind,
and the backlog stays in ZeroMQ's per-connection queues (read in turn) rather than growing one
FIFO up to ``max_queued``, where heartbeats would wait again, behind all of it.

The server never dies of a client's message: anything unexpected raised while handling one is
logged with the message kind and answered as a protocol error. Every frame is counted by its
outcome (``ok`` or the error code it was answered with); a frame over the socket's size limit
is dropped by ZeroMQ with its connection, which the socket monitor counts.

The mailbox is bounded: past ``max_queued`` frames waiting, the reader stops taking more, so
ZeroMQ's per-connection queues (fair-queued across clients) push back on a flooding client
instead of growing the server's memory or delaying everyone's heartbeats behind it.

Security (:mod:`tensorhub.runtime.security`). With ``keys``, the socket runs CURVE and a ZAP handler
admits only the allowed client keys; each message carries its connection's key, and the server
binds a session to the key that opened it: another key's messages naming that session (a
``Register`` with transport endpoints, an ``Announce``, a heartbeat, a call) are refused with
``UnknownSession``, and another key cannot open a new incarnation of a shard that a live
session of another key holds (``ContractViolation``). A bind that is not loopback needs keys,
or ``insecure``.

Operations. Besides the table's requests, the server answers ``GetCluster`` (the cluster's
state, :mod:`tensorhub.tools.status`) and ``GetTrace`` (a version's transfer spans and grants,
:mod:`tensorhub.tools.trace`), and keeps the ``TransferSpan`` reports of readers (bounded: the latest
``HISTORY_VERSIONS`` versions, ``SPANS_PER_VERSION`` each). With ``metrics_port`` it serves
Prometheus metrics (:mod:`tensorhub.runtime.metrics`).

Size: the server actor is the table's IO shell: its socket loop, lease and failover, and the
operations requests share the actor's state; the operations answers would split off first.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import zmq
import zmq.asyncio

from tensorhub.core import messages as m
from tensorhub.core.errors import (
    ContractViolation,
    InvalidArgument,
    MalformedMessage,
    PermissionDenied,
    ProtocolError,
    TensorHubError,
    UnknownSession,
)
from tensorhub.core.lifecycle import HolderState
from tensorhub.core.table import HISTORY_VERSIONS, ReferenceTable, TableConfig, random_first_id
from tensorhub.core.table.reign import ROLES, Reign
from tensorhub.core.wire import MAX_FRAME_BYTES, decode, encode, kind_prefix
from tensorhub.scheduling.selection import SourceIndex

from .actor import Actor
from .collector import PAUSE_BUCKETS, CollectorPacing
from .metrics import DURATION_BUCKETS, Counter, Gauge, Histogram, MetricsServer, Registry
from .security import KeyAuthenticator, ModelPolicy, ServerKeys, check_bind, user_id

__all__ = ["ServerActor", "ServerConfig", "serve"]

SPANS_PER_VERSION = 4096  #: transfer spans kept per version
RATE_WINDOW_S = 10.0  #: the window of the recent transfer rate in the cluster state
_LOG_EVERY_S = 10.0  # refused frames are summed up in one log line at most this often


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
        keys: CURVE keys (the server's and the allowed clients'); None: no authentication.
        insecure: allow a non-loopback bind without keys.
        metrics_port: serve Prometheus metrics on this port (0: any free one; None: no).
        metrics_host: the address the metrics endpoint binds (loopback by default).
        max_queued: frames waiting in the mailbox before the reader stops taking more.
        role: ``solo`` (a server alone: always decides), ``primary`` (decides while it holds
            its backup's lease or a majority of votes; needs ``peer``) or ``backup`` (decides
            only without a lease promised to the primary, with a majority of votes): the
            no-split-brain rule of :class:`tensorhub.core.table.reign.Reign`.
        peer: the backup's address (the primary asks it for the lease).
        lease: the lease and vote lifetime in seconds (None: half the heartbeat timeout).
        policy: which client keys may publish and read which models (CURVE only; None: every
            admitted key may do everything).
    """

    bind: str = "tcp://127.0.0.1:5557"
    table: TableConfig = TableConfig()
    seed: int | None = None
    term: int | None = None
    idle_exit: float | None = None
    keys: ServerKeys | None = None
    insecure: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_queued: int = 10_000
    role: str = "solo"
    peer: str | None = None
    lease: float | None = None
    policy: ModelPolicy | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.keys is None:
            raise InvalidArgument("a model policy needs CURVE keys: without them the server cannot tell clients apart")
        if self.role not in ROLES:
            raise InvalidArgument(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role == "primary" and not self.peer:
            raise InvalidArgument("a primary server needs its backup's address (peer)")
        if self.lease is not None and not 0 < self.lease < self.table.heartbeat_timeout:
            raise InvalidArgument(f"lease must be in (0, heartbeat_timeout={self.table.heartbeat_timeout:g}) seconds")


@dataclass(slots=True)  # not frozen: one is made per frame read, and a frozen one builds slowly
class _Frames:
    peer: bytes
    frames: list[bytes]
    user: str | None = None  # the CURVE key of the connection (None without authentication)
    at: float = 0.0  # when the reader took it (monotonic)


@dataclass(frozen=True, slots=True)
class _Batch:
    frames: list[_Frames]


@dataclass(frozen=True, slots=True)
class _Tick:
    pass


@dataclass(frozen=True, slots=True)
class _LeaseTick:
    pass


@dataclass(frozen=True, slots=True)
class _PeerFrames:
    frames: list[bytes]


_PEER = b"\0peer"  # the table's peer name for the backup (never a ZeroMQ routing id: those start with 0 and 4 bytes)


_KINDS_LOCAL = (m.TransferSpan, m.GetTrace, m.GetCluster)
_MIN_STALL_S = 0.25  # a tick later than this (and than one tick interval) is a stall: see _credit_stall
_BATCH = 256  # frames taken from the socket per reader callback (then the mailbox handles them)
_POLL_EVERY = 16  # frames of a batch handled between two looks at the socket for heartbeats
#: frames waiting (read, not yet handled) above which a batch no longer looks at the socket: a
#: longer backlog waits in ZeroMQ's queues, which serve connections in turn, not in one FIFO
#: that a burst's progress reports would fill ahead of the heartbeats read after them
_EAGER_QUEUED = 2048
_BEAT_PREFIX = kind_prefix(m.Heartbeat)  # how a heartbeat's frame begins (see _drain)
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's enum flags cost more than the call itself
_POLLIN = int(zmq.POLLIN)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = int(zmq.EVENTS)

#: the right on the session's model each request needs under a model policy (others need none
#: of their own: they follow from a publish or a pull the policy already let through)
_RIGHT_NEEDED: dict[type, str] = {
    m.OpenShard: "read", m.Replicate: "read", m.Update: "read", m.ListVersions: "read", m.Wait: "read",
    m.Publish: "publish", m.Converted: "publish", m.BucketStored: "publish", m.Announce: "publish",
}  # fmt: skip


class ServerActor(Actor):
    """The reference server's actor. ``await start()`` binds; ``await stop()`` unbinds.

    ``collector``: the process's collector pacing (:mod:`tensorhub.runtime.collector`), started
    with the server and paced by its tick; only a server that has its process to itself takes one."""

    def __init__(self, config: ServerConfig, ctx: zmq.asyncio.Context | None = None,
                 collector: CollectorPacing | None = None) -> None:  # fmt: skip
        super().__init__("server")
        self.config = config
        self.collector = collector
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
        term = config.term if config.term is not None else int(time.time() * 1000)
        lease = config.lease if config.lease is not None else config.table.heartbeat_timeout / 2
        self.reign = Reign(config.role, lease)
        # ids start at random, never at a stale client's old session id (see ReferenceTable)
        first_id = random_first_id(random.Random(os.urandom(16)))
        self.table = ReferenceTable(time.monotonic, random.Random(seed), config.table, term=term, sources=SourceIndex,
                                    reign=self.reign, first_id=first_id)  # fmt: skip
        self._peer_sock: zmq.asyncio.Socket | None = None
        self._lease_req = 0
        self._lease_timer: asyncio.TimerHandle | None = None  # an eager lease request due (see _lease_soon)
        self._lease_at: float | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self._raw: zmq.Socket | None = None  # the same socket without the asyncio layer: reads and sends
        self._fd: int | None = None
        self._drain_soon = False
        self.address = config.bind
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._idle_since = time.monotonic()
        self._ticked_at = time.monotonic()  # when on__Tick last ran (see _credit_stall)
        self._tick_every = 1.0
        self.frames_in = 0
        self.bad_frames = 0
        self.beats_ahead = 0  # heartbeats answered as they were read, ahead of the mailbox (see _drain)
        self._backlog: list[_Frames] = []  # frames read during a batch, for the mailbox once the loop ran
        self._in_batch = False
        self._flush_soon = False
        self.done = asyncio.Event()
        self.auth: KeyAuthenticator | None = None
        self.metrics_server: MetricsServer | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._owner: dict[int, str] = {}  # session id -> the CURVE key that opened it
        self._queued = 0
        self._paused = False  # the mailbox is full: the socket is not read until it has room
        #: (model, version) -> reported transfer spans, oldest first
        self.spans: collections.OrderedDict[tuple[str, int], list[m.SpanEntry]] = collections.OrderedDict()
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=100_000)  # (received, bytes)
        self._refused_since_log: dict[str, int] = {}
        self._last_refusal_log = time.monotonic()
        self._build_metrics()

    # ---- metrics -----------------------------------------------------------------------------

    def _build_metrics(self) -> None:
        r = self.registry = Registry()
        self.m_frames = r.counter("tensorhub_frames_total", "Frames received, by outcome: ok, or the error code answered", ["outcome"])
        self.m_requests = r.counter("tensorhub_requests_total", "Requests decoded, by message kind", ["kind"])
        self.m_clients = r.counter("tensorhub_client_frames_total",
                                   "Frames received per client key (the first 12 characters of its CURVE key; 'anonymous' without keys)",
                                   ["client"])  # fmt: skip
        self.m_latency = r.histogram("tensorhub_request_seconds", "Time from receiving a request to sending its replies", ["kind"])
        self.m_paused = r.counter("tensorhub_reads_paused_total",
                                  "Times the server stopped reading its socket because its mailbox was full (max_queued)")
        self.m_dropped = r.counter("tensorhub_replies_dropped_total",
                                   "Replies not sent: the client's queue was full, or its connection is gone", ["reason"])  # fmt: skip
        self._drop_logged: collections.OrderedDict[tuple[bytes, str], None] = collections.OrderedDict()
        self.m_conn = r.counter("tensorhub_connections_total", "Connection events on the server socket (monitor)", ["event"])
        self.m_xfer = r.histogram("tensorhub_transfer_seconds", "Transfer durations reported by readers (one per grant)",
                                  ["transport", "outcome"], DURATION_BUCKETS)  # fmt: skip
        self.m_xfer_bytes = r.counter("tensorhub_transfer_bytes_total", "Bytes moved, as reported by readers", ["transport", "outcome"])
        self.m_policy = r.counter("tensorhub_policy_refusals_total",
                                  "Requests the model policy refused, by the right they needed and client key", ["right", "client"])  # fmt: skip
        self.m_failures = r.counter("tensorhub_transfer_failures_total", "Failures readers reported to the server", ["reason"])
        self.registry.collectors.append(self._collect)

    def _collect(self) -> list[Any]:
        t = self.table
        out: list[Any] = []

        def counter(name: str, help: str, value: float) -> None:
            c = Counter(name, help)
            c.set(value=value)
            out.append(c)

        def gauge(name: str, help: str, labels: tuple[str, ...] = (), values: dict | None = None, value: float = 0) -> Gauge:
            g = Gauge(name, help, labels)
            if values is None:
                g.set(value=value)
            else:
                for k, v in values.items():
                    g.set(*k, value=v)
            out.append(g)
            return g

        st = t.stats
        counter("tensorhub_grants_total", "Grants made", st["grants"])
        counter("tensorhub_grants_ended_total", "Grants ended (completed, failed, revoked or cancelled)", st["grants_ended"])
        counter("tensorhub_revocations_total", "Grants revoked (drain timeout, source removed)", st["revoked"])
        counter("tensorhub_expiries_total", "Replicas removed because a shard missed its heartbeats", st["expired"])
        counter("tensorhub_quarantines_total", "Holders quarantined after failed verification", st["quarantined"])
        counter("tensorhub_offloads_total", "Offload copies requested (last copy of a retained version unpublished)", st["offloads"])
        counter("tensorhub_updates_skipped_total", "update() calls answered 'not yet' by smart skipping", st["updates_skipped"])
        counter("tensorhub_offload_seeds_total", "Offload seeding started", st["offload_seeds"])
        bytes_by = Counter("tensorhub_bytes_granted_total", "Bytes moved under ended grants, by link class", ("link",))
        for link, n in t.bytes_by_link.items():
            bytes_by.set(link, value=n)
        out.append(bytes_by)
        holders: dict[tuple[str, str], int] = {}
        grants: dict[tuple[str], int] = {}
        available: dict[tuple[str], int] = {}
        latest: dict[tuple[str], int] = {}
        for name, mo in t.models.items():
            available[(name,)] = len(mo.available)
            if mo.available:
                latest[(name,)] = mo.available[-1]
            for st_ in HolderState:
                holders[(name, st_.value)] = 0
            grants[(name,)] = 0
        for h in t.holders():
            if h.state is not None:
                key = (h.session.model.name, h.state.value)
                holders[key] = holders.get(key, 0) + 1
        for g in t.grants.values():
            key1 = (g.reader.session.model.name,)
            grants[key1] = grants.get(key1, 0) + 1
        gauge("tensorhub_holders", "Holders, by model and state", ("model", "state"), holders)
        gauge("tensorhub_grants_active", "Active grants, by model", ("model",), grants)
        gauge("tensorhub_versions_available", "Available versions, by model", ("model",), available)
        gauge("tensorhub_latest_version", "The highest available version, by model", ("model",), latest)
        counts = t.counts()
        gauge("tensorhub_sessions", "Open shard sessions", value=counts["sessions"])
        gauge("tensorhub_models", "Models", value=counts["models"])
        gauge("tensorhub_transactions", "Model-parallel calls in progress", value=counts["transactions"])
        gauge("tensorhub_server_term", "This server start's term", value=t.term)
        gauge("tensorhub_server_reigning", "1 while this server decides (holds the lease or a majority of votes)",
              value=float(self.reign.reigning))  # fmt: skip
        gauge("tensorhub_mailbox_depth", "Frames waiting to be handled", value=self._queued)
        if self.collector is not None:
            self._collect_gc(self.collector, out)
        auth = Counter("tensorhub_auth_total", "CURVE authentication decisions", ("result",))
        if self.auth is not None:
            auth.set("accepted", value=self.auth.accepted)
            for reason, n in self.auth.denied.items():
                auth.set(f"denied: {reason}", value=n)
        out.append(auth)
        return out

    @staticmethod
    def _collect_gc(pacing: CollectorPacing, out: list[Any]) -> None:
        gens = pacing.watch.generations
        pauses = Histogram("tensorhub_gc_pause_seconds", "Cyclic garbage collector passes of the server process, by generation "
                           "(0, 1, 2: CPython's own; 'full on purpose': the pacing's full passes over frozen objects too)",
                           ("generation",), PAUSE_BUCKETS)  # fmt: skip
        longest = Gauge("tensorhub_gc_longest_pause_seconds", "The longest collector pass, by generation", ("generation",))
        cpu = Counter("tensorhub_gc_cpu_seconds_total", "CPU time of the collector's passes, by generation", ("generation",))
        for label, g in [(str(i), g) for i, g in enumerate(gens)] + [("full on purpose", pacing.watch.on_purpose)]:
            pauses.series[(label,)] = [list(g.buckets[:-1]), g.seconds, g.passes]
            longest.set(label, value=g.longest)
            cpu.set(label, value=g.cpu_seconds)
        out += [pauses, longest, cpu]
        frozen = Gauge("tensorhub_gc_frozen_objects", "Objects the collector's passes skip (frozen long-lived objects)")
        frozen.set(value=gc.get_freeze_count())
        full = Counter("tensorhub_gc_full_passes_total", "Full passes over every object, frozen included, run on purpose")
        full.set(value=pacing.full_passes)
        out += [frozen, full]

    # ---- lifecycle ---------------------------------------------------------------------------

    async def on_start(self) -> None:
        keys = self.config.keys
        check_bind(self.config.bind, keys, self.config.insecure)
        if keys is not None:
            self.auth = KeyAuthenticator(self.ctx, keys.allowed)
            try:
                self.auth.start()
            except zmq.ZMQError as err:
                self.auth = None
                raise InvalidArgument(f"cannot start CURVE authentication (one authenticated server per context): {err}") from err
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a connection that is gone raises (and is counted)
        # A client reconnects under the same (secret, random) routing id, which its sessions are
        # bound to: the new connection takes the id over from one the server has not seen close.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if keys is not None:
            keys.apply(sock)
        try:
            sock.bind(self.config.bind)
        except zmq.ZMQError as err:
            sock.close(0)
            await self._stop_auth()
            raise InvalidArgument(f"server cannot bind {self.config.bind}: {err}") from err
        self.sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        events = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # fmt: skip
        self._monitor = sock.get_monitor_socket(events)
        self.spawn(self._watch(self._monitor), "server-monitor")
        if self.config.metrics_port is not None:
            ms = MetricsServer(self.registry, self.config.metrics_host, self.config.metrics_port)
            try:
                await ms.start()
            except OSError as err:
                raise InvalidArgument(f"metrics endpoint cannot bind {self.config.metrics_host}:{self.config.metrics_port}: {err}") from err
            self.metrics_server = ms
        self._raw = zmq.Socket.shadow(sock.underlying)
        fd = self._raw.getsockopt(zmq.FD)
        assert isinstance(fd, int) and self.loop is not None
        self._fd = fd
        self.loop.add_reader(fd, self._drain)
        self._drain_later()  # frames that came before the descriptor was watched
        self._tick_every = min(1.0, self.config.table.heartbeat_interval)
        self._ticked_at = time.monotonic()
        self.every(self._tick_every, _Tick)
        if self.config.role == "primary" and self.config.peer:
            peer = self.ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.setsockopt(zmq.IMMEDIATE, 1)  # no queue for a peer that is not connected
            peer.setsockopt(zmq.SNDHWM, 4)
            peer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
            peer.connect(self.config.peer)
            self._peer_sock = peer
            self.spawn(self._peer_reader(peer), "server-peer-reader")
            self.spawn(self._lease_ticks(self.reign.lease / 5), "server-lease")
            self._lease_soon()  # the first at once (retried until the backup is connected), not a fifth of a lease on
        if self.collector is not None:
            self.collector.start()
        self.log.info("server listening", address=self.address, term=self.table.term, curve=keys is not None,
                      metrics_port=self.metrics_server.port if self.metrics_server else None)  # fmt: skip

    async def _stop_auth(self) -> None:
        if self.auth is not None:
            await self.auth.stop()

    async def on_stop(self) -> None:
        if self.collector is not None:
            self.collector.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self._fd is not None and self.loop is not None:
            self.loop.remove_reader(self._fd)
            self._fd = None
        self._raw = None
        if self.sock is not None:
            if self._monitor is not None:
                try:
                    self.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                self._monitor.close(0)
            self.sock.close(0)
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = self._lease_at = None
        if self._peer_sock is not None:  # a primary's socket to its backup (else term() waits for it forever)
            self._peer_sock.close(0)
            self._peer_sock = None
        await self._stop_auth()
        if self._own_ctx:
            self.ctx.term()
        self.done.set()
        self.log.info("server stopped", address=self.address)

    def _drain(self) -> None:
        """Take the frames waiting on the socket (up to ``_BATCH``, and while the mailbox has
        room): answer the heartbeats among them now, and hand the rest to the mailbox as one
        batch. A heartbeat never waits behind grants and progress reports read before it (it is
        what tells the server, and with a backup the reign, that a session is alive; it changes
        nothing that those frames depend on). Called from the loop's watch of the socket, and
        between the frames of a batch (:meth:`on__Batch`)."""
        self._drain_soon = False
        sock = self._raw
        if sock is None or self.stopped:
            return
        room = self.config.max_queued - self._queued
        if room <= 0:
            if not self._paused:
                self.m_paused.inc()
            self._paused = True
            return
        authenticated = self.config.keys is not None
        batch: list[_Frames] = []
        beats: list[_Frames] = []
        beat = _BEAT_PREFIX
        now = time.monotonic()
        n = 0
        try:
            for n in range(min(_BATCH, room)):
                if authenticated:
                    parts = sock.recv_multipart(_NOBLOCK, copy=False)
                    user = user_id(parts[-1])
                    frames = [p.bytes for p in parts]
                else:
                    frames = sock.recv_multipart(_NOBLOCK)
                    user = None
                f = _Frames(frames[0], frames[1:], user, now)
                if len(frames) == 2 and frames[1].startswith(beat):
                    beats.append(f)
                else:
                    batch.append(f)
            n += 1
        except zmq.Again:
            pass
        except zmq.ZMQError as err:  # the socket is closing
            self.log.debug("server socket read ended", error=str(err))
            return
        if beats:
            self.beats_ahead += len(beats)
            self._answer_beats(beats)
            self._schedule()
        if batch:
            self._queued += len(batch)
            self._backlog.extend(batch)
            if not self._in_batch:
                self._flush_backlog()
            elif not self._flush_soon and self.loop is not None:
                # Read between a batch's frames: to the mailbox once the loop has run, not now.
                # A mailbox that never empties never lets its task wait, and then the loop runs
                # nothing else: no timers, no lease replies from the backup, no socket watch.
                self._flush_soon = True
                self.loop.call_soon(self._flush_backlog)
        if n == _BATCH or n == room:
            self._drain_later()  # more may wait; the descriptor will not say so again
        elif beats:
            self._input_waits()  # the replies' sends may have taken the descriptor's signal

    def _answer_beats(self, beats: list[_Frames]) -> None:
        """Answer heartbeats read together, each through the table's
        :meth:`~ReferenceTable.heartbeat`, and count them in the metrics once for all of them (a
        heartbeat is most of what thousands of sessions send: the per-frame bookkeeping of
        :meth:`_handle` was half its cost). A primary's or backup's heartbeats (votes) take this
        path too. With keys (each frame's key is checked), and for a frame that does not decode
        to a heartbeat, each goes through :meth:`_handle`."""
        table = self.table
        if self.config.keys is not None:
            for f in beats:
                self._handle(f)
            return
        sock = self._raw
        ok = 0
        for f in beats:
            try:
                request = decode(f.frames[0])
            except Exception:  # noqa: BLE001 - _handle decodes it again and answers what it is
                request = None
            if type(request) is not m.Heartbeat:
                self._handle(f)  # answered with its error (or as what it is) by the whole path
                continue
            out = table.heartbeat(f.peer, request)
            ok += 1
            if len(out) != 1 or out[0][0] != f.peer:
                self._send(out)  # the reign began or ended just now, or a step-down dropped a session
            elif sock is not None:
                try:
                    sock.send(f.peer, _SNDMORE_NOBLOCK)
                    sock.send(encode(out[0][1]), _NOBLOCK)
                except zmq.ZMQError as err:
                    self._dropped(err, f.peer, "HeartbeatAck")
            self.m_latency.observe(time.monotonic() - f.at, "heartbeat")
        if ok:
            self.frames_in += ok
            self.m_clients.inc(client_label(None), by=ok)
            self.m_requests.inc("heartbeat", by=ok)
            self.m_frames.inc("ok", by=ok)

    def _flush_backlog(self) -> None:
        """Hand the frames read so far (oldest first) to the mailbox as one batch."""
        self._flush_soon = False
        if self._backlog:
            frames, self._backlog = self._backlog, []
            self.tell(_Batch(frames))

    def _drain_later(self) -> None:
        if not self._drain_soon and self.loop is not None:
            self._drain_soon = True
            self.loop.call_soon(self._drain)

    def _input_waits(self) -> None:
        """After sends (which may consume the descriptor's signal): read what is waiting."""
        sock = self._raw
        if sock is not None and not self._paused and int(sock.getsockopt(_EVENTS)) & _POLLIN:
            self._drain_later()

    async def _watch(self, mon: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(await mon.recv_multipart())
                name = (zmq.Event(event["event"]).name or str(event["event"])).lower()  # a combination has no name
            except (RuntimeError, ValueError, zmq.ZMQError) as err:  # counting is not worth dying for
                self.log.warning("socket monitor stopped", error=str(err))
                return
            self.m_conn.inc(name)
            if event["event"] & (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self.log.debug("handshake refused", what=name)

    # ---- the lease (a primary asks its backup) ------------------------------------------------

    # The lease is handled ahead of the mailbox (from the loop's own callbacks, on the actor's
    # thread, between two handlers as a mailbox message would be): a backlog of client frames
    # must not delay the primary's requests or its backup's answers until the lease runs out,
    # which would make it step down under load and send every client to the backup.

    async def _peer_reader(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if not self.stopped:
                self.on__PeerFrames(_PeerFrames(frames))

    async def _lease_ticks(self, interval: float) -> None:
        while not self.stopped:
            await asyncio.sleep(interval)
            if not self.stopped:
                self.on__LeaseTick(_LeaseTick())

    def on__LeaseTick(self, _: _LeaseTick) -> None:
        self._send_lease()
        self._schedule()

    def _send_lease(self) -> None:
        sock = self._peer_sock
        if sock is None:
            return
        self._lease_req += 1
        request = self.table.lease_request(self._lease_req)
        # The asyncio socket's send (not the plain one under it: that would take the descriptor's
        # edge from its reader, leaving a lease reply unread): with NOBLOCK its future is done at
        # once, holding zmq.Again when the backup is not connected (read here, so it counts as
        # not sent and is not reported as never retrieved).
        sent = cast("asyncio.Future[Any]", sock.send(encode(request), flags=_NOBLOCK))
        if not sent.done():  # pragma: no cover - a NOBLOCK send resolves at once
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
        elif not sent.cancelled() and isinstance(sent.exception(), zmq.ZMQError):
            self.reign.unsent(self._lease_req)  # the backup is not connected: no lease this time

    def _lease_soon(self) -> None:
        """Send a lease request now, or arm a timer for it, when the table wants one ahead of the
        periodic ones (its sessions' slots changed, or it has yet to hear the backup: see
        :meth:`~tensorhub.core.table.ReferenceTable.lease_due`). Checked after every batch, tick
        and lease reply: a few comparisons when nothing changed."""
        if self._peer_sock is None or self.stopped:
            return
        when = self.table.lease_due()
        if when is None:
            return
        now = time.monotonic()
        if when <= now:
            self._send_lease()
            when = self.table.lease_due()  # one not sent (the backup is not connected) is retried after the gap
            if when is None:
                return
            now = time.monotonic()
            when = max(when, now + 0.001)
        if self._lease_at is not None and self._lease_at <= when:
            return
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        self._lease_at = when
        assert self.loop is not None

        def fire() -> None:
            self._lease_timer = self._lease_at = None
            self._lease_soon()

        self._lease_timer = self.loop.call_later(when - now, fire)

    def on__PeerFrames(self, msg: _PeerFrames) -> None:
        try:
            if len(msg.frames) != 1:
                raise MalformedMessage(f"expected one frame per message, got {len(msg.frames)}")
            reply = decode(msg.frames[0])
            if not isinstance(reply, m.LeaseReply):
                raise ProtocolError(f"the backup sent {type(reply).__name__}, not a lease reply")
        except TensorHubError as err:
            self.log.warning("bad message from the backup; dropped", error=str(err))
            return
        self._send(self.table.handle(_PEER, reply))
        self._schedule()
        self._input_waits()

    # ---- messages ----------------------------------------------------------------------------

    def on__Batch(self, batch: _Batch) -> None:
        self._in_batch = True
        try:
            for i, msg in enumerate(batch.frames):
                if i and not i % _POLL_EVERY and self._queued < _EAGER_QUEUED:
                    self._drain()  # heartbeats that came meanwhile are answered now, not after the batch
                self._handle(msg)
        finally:
            self._in_batch = False
        self._schedule()
        self._queued -= len(batch.frames)
        if self._paused and self._queued <= self.config.max_queued // 2:
            self._paused = False
            self._drain_later()
        self._input_waits()

    def on__Frames(self, msg: _Frames) -> None:
        """One frame handed to the actor directly (tests; the socket hands batches)."""
        self._queued += 1
        self.on__Batch(_Batch([msg]))

    def _handle(self, msg: _Frames) -> None:
        self.frames_in += 1
        self.m_clients.inc(client_label(msg.user))
        kind = "undecodable"
        req = 0
        try:
            if len(msg.frames) != 1:
                raise MalformedMessage(f"expected one frame per message, got {len(msg.frames)}")
            request = decode(msg.frames[0])
            kind = request.KIND
            req = getattr(request, "req", 0)
            self.m_requests.inc(kind)
            if msg.user is not None:
                self._guard(request, msg.user)
                request = self._authorize(request, msg.user)
            if isinstance(request, _KINDS_LOCAL):
                out = self._handle_local(msg.peer, request)
            else:
                out = self.table.handle(msg.peer, request)
                if msg.user is not None and isinstance(request, m.OpenShard):
                    self._bind_owner(msg.peer, request, msg.user, out)
            outcome = "ok"
            for peer, reply in out:
                if peer == msg.peer and isinstance(reply, m.Failed) and reply.req == req:
                    outcome = reply.code
                    self._note_refusal(kind, reply)
                    break
            if outcome == "ok" and isinstance(request, (m.SourceFailed, m.ChecksumFailed)):
                self.m_failures.inc(kind)  # the request's KIND (read when it was decoded)
        except ProtocolError as err:
            self.bad_frames += 1
            outcome = err.code
            reply = m.Failed.of(req or _salvage_req(msg.frames), err)
            self._note_refusal(kind, reply)
            out = [(msg.peer, reply)]
        except TensorHubError as err:  # a refusal of the server's own (e.g. a slot held by another key)
            outcome = err.code
            reply = m.Failed.of(req, err)
            self._note_refusal(kind, reply)
            out = [(msg.peer, reply)]
        except Exception as err:
            self.bad_frames += 1
            outcome = "internal"
            self.log.exception("internal error handling a message", peer=msg.peer.hex(), kind=kind)
            out = [(msg.peer, m.Failed.of(req or _salvage_req(msg.frames), ProtocolError(f"internal server error: {err!r}")))]
        self.m_frames.inc(outcome)
        self._send(out)
        if msg.at:
            self.m_latency.observe(time.monotonic() - msg.at, kind)

    def _note_refusal(self, kind: str, reply: m.Failed) -> None:
        """Refusals are logged at debug one by one, with what they concern, and summed up in one
        warning at most every ``_LOG_EVERY_S`` (a flood of bad frames must not flood the log)."""
        concerns = {k: v for k, v in (("model", reply.model), ("version", reply.version), ("replica", reply.replica),
                                      ("shard", reply.shard)) if v is not None}  # fmt: skip
        self.log.debug("request refused", kind=kind, code=reply.code, error=reply.message[:200], **concerns)
        self._refused_since_log[reply.code] = self._refused_since_log.get(reply.code, 0) + 1
        now = time.monotonic()
        if now - self._last_refusal_log >= _LOG_EVERY_S:
            self.log.warning("requests refused", window_s=round(now - self._last_refusal_log, 1), **self._refused_since_log)
            self._refused_since_log = {}
            self._last_refusal_log = now

    def _guard(self, request: Any, user: str) -> None:
        """Refuse a message that names a session another authenticated key opened, or that
        would open a new incarnation of a shard another key's live session holds."""
        if isinstance(request, m.OpenShard):
            s = self.table.by_slot.get((request.model, request.replica, request.shard_idx))
            if s is not None and self._owner.get(s.id, user) != user:
                raise ContractViolation(
                    "this shard is open under another authenticated client's key; it cannot be re-opened with this one",
                    model=request.model, replica=request.replica, shard=request.shard_idx,
                )  # fmt: skip
            return
        sessions: tuple[int, ...] = ()
        if isinstance(request, m.Heartbeat):
            sessions = request.sessions
        else:
            sid = getattr(request, "session", None)
            if type(sid) is int:
                sessions = (sid,)
        for sid in sessions:
            owner = self._owner.get(sid)
            if owner is not None and owner != user:
                raise UnknownSession(f"session {sid} was opened by another authenticated client; this key cannot use it")

    def _authorize(self, request: Any, user: str) -> Any:
        """The model policy (``config.policy``): refuse a request that needs a right on a model
        the key lacks (:class:`PermissionDenied`, counted), and return the request to handle. An
        ``Announce`` from a key that may only read keeps its partial pull and answers but not its
        holdings (a reader's copies are not the model's versions until it pulls them again)."""
        policy = self.config.policy
        right = _RIGHT_NEEDED.get(type(request))
        if policy is None or right is None:
            return request
        ctx: dict[str, Any] = {}
        if isinstance(request, m.OpenShard):
            model = request.model
            ctx = {"replica": request.replica, "shard": request.shard_idx}
        else:
            s = self.table.sessions.get(request.session)
            if s is None:
                return request  # the table answers that the session is unknown
            model = s.model.name
            ctx = {"replica": s.replica.name, "shard": s.shard_idx}
        if isinstance(request, m.Announce):
            if not request.holdings:
                right = "read"
            elif not policy.allows(user, model, "publish") and policy.allows(user, model, "read"):
                return dataclasses.replace(request, holdings=())
        if policy.allows(user, model, right):
            return request
        self.m_policy.inc(right, client_label(user))
        raise PermissionDenied(
            f"the model policy does not let this client key ({client_label(user)}...) {right} model {model!r}",
            model=model, **ctx,
        )  # fmt: skip

    def _bind_owner(self, peer: bytes, request: m.OpenShard, user: str, out: list[tuple[Any, Any]]) -> None:
        for p, reply in out:
            if p == peer and isinstance(reply, m.Opened) and reply.req == request.req:
                self._owner[reply.session] = user
        if len(self._owner) > 2 * len(self.table.sessions) + 1024:
            self._owner = {sid: k for sid, k in self._owner.items() if sid in self.table.sessions}

    def _handle_local(self, peer: bytes, request: Any) -> list[tuple[Any, Any]]:
        if isinstance(request, m.TransferSpan):
            return self._on_span(peer, request)
        if isinstance(request, m.GetTrace):
            edges = tuple(m.DagEdge(*e) for e in self.table.history.get((request.model, request.version), ()))
            spans = tuple(self.spans.get((request.model, request.version), ()))
            offset = time.time() - time.monotonic()
            return [(peer, m.Trace(request.req, request.model, request.version, spans, edges, offset))]
        now = time.monotonic()
        moved = sum(n for at, n in self._recent if at >= now - RATE_WINDOW_S)
        return [(peer, cluster_state(self.table, request.req, moved / RATE_WINDOW_S, RATE_WINDOW_S))]

    def _on_span(self, peer: bytes, span: m.TransferSpan) -> list[tuple[Any, Any]]:
        s = self.table.sessions.get(span.session)
        if s is None or s.peer != peer:  # bound to the connection that opened it, as in the table
            raise UnknownSession(f"session {span.session} is not known to this connection (term {self.table.term})")
        model = s.model.name
        entry = m.SpanEntry(
            s.replica.name, s.shard_idx, s.location.datacenter, s.location.host, span.grant, span.source_replica,
            span.source_shard, span.transport, span.bytes, span.reads, span.start, span.end, span.outcome,
        )  # fmt: skip
        key = (model, span.version)
        kept = self.spans.get(key)
        if kept is None:
            kept = self.spans[key] = []
            while len(self.spans) > HISTORY_VERSIONS:
                self.spans.popitem(last=False)
        if len(kept) < SPANS_PER_VERSION:
            kept.append(entry)
        self.m_xfer.observe(span.end - span.start, span.transport, span.outcome)
        self.m_xfer_bytes.inc(span.transport, span.outcome, by=span.bytes)
        self._recent.append((time.monotonic(), span.bytes))
        self.log.debug("transfer reported", model=model, version=span.version, replica=s.replica.name, shard=s.shard_idx,
                       source=span.source_replica, bytes=span.bytes, seconds=round(span.end - span.start, 4),
                       outcome=span.outcome)  # fmt: skip
        return [(peer, m.Ack(span.req))] if span.req else []

    def on__Tick(self, _: _Tick) -> None:
        was = self.reign.reigning
        self._credit_stall()
        self._send(self.table.tick())
        self._input_waits()
        if self.collector is not None:
            self.collector.tick()
        if was != self.reign.reigning:
            what = "reigns" if self.reign.reigning else "holds" if self.reign.held_since is not None else "stepped down"
            self.log.warning(what, role=self.config.role, term=self.table.term,
                             why=None if self.reign.reigning else self.reign.why_not())  # fmt: skip
        self._schedule()
        if self.config.idle_exit is not None:
            now = time.monotonic()
            if self.table.sessions:
                self._idle_since = now
            elif now - self._idle_since >= self.config.idle_exit:
                self.log.info("no sessions; idle exit", idle_s=round(now - self._idle_since, 1))
                self.spawn(self.stop(), "server-idle-exit")

    def _credit_stall(self) -> None:
        """Ticks come at least every tick interval (``every`` below, plus the table's deadlines).
        A longer gap means this server stood still: its process was not scheduled (a machine
        whose cores are all busy), or its loop was held up. Clients' heartbeats sent meanwhile
        may still sit unread, so the gap past one interval is not held against the sessions
        (:meth:`Table.credit_stall`): without this, a server that stalls longer than the
        heartbeat timeout would remove every replica on waking, before reading a single beat."""
        now = time.monotonic()
        stalled = now - self._ticked_at - self._tick_every
        self._ticked_at = now
        if stalled > max(self._tick_every, _MIN_STALL_S):
            self.table.credit_stall(stalled)
            self.log.warning("server stood still; heartbeat clocks credited", seconds=round(stalled, 2))

    def _send(self, out: list[tuple[Any, Any]]) -> None:
        """Send replies without ever waiting: a reply to a client whose queue is full, or whose
        connection is gone, is dropped, counted and logged (once per client and reason)."""
        sock = self._raw
        if sock is None:
            return  # stopping
        send = sock.send
        for peer, reply in out:
            frame = encode(reply)
            try:
                send(peer, _SNDMORE_NOBLOCK)  # ROUTER: fails here (whole) if the peer is gone or full
                send(frame, _NOBLOCK)
            except zmq.ZMQError as err:
                self._dropped(err, peer, type(reply).__name__)

    def _dropped(self, err: zmq.ZMQError, peer: bytes, kind: str) -> None:
        if isinstance(err, zmq.Again):
            reason, what = "queue full", "client not keeping up; reply dropped"
        elif isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH:
            reason, what = "peer gone", "client gone; reply dropped"  # it reconnected under another routing id, or left
        else:
            reason, what = "error", f"reply not sent: {type(err).__name__}: {err}"
        self.m_dropped.inc(reason)
        key = (peer, reason)
        if key not in self._drop_logged:  # once per client and reason (bounded memory)
            self._drop_logged[key] = None
            while len(self._drop_logged) > 1024:
                self._drop_logged.popitem(last=False)
            self.log.warning(what, peer=peer.hex(), kind=kind, reason=reason)

    def _schedule(self) -> None:
        """Wake the table at its next deadline (the periodic tick covers the rest); send the
        backup a lease request now if the membership changed (a primary's)."""
        if self._peer_sock is not None:
            self._lease_soon()
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


def client_label(user: str | None) -> str:
    """The metrics label of a client key: its first 12 characters (keys are allowed by the
    operator, so the labels are bounded), or ``anonymous``."""
    return user[:12] if user else "anonymous"


def _salvage_req(frames: list[bytes]) -> int:
    """The ``req`` of a frame that failed to decode, if it can be read at all (for the reply)."""
    try:
        obj = msgpack.unpackb(frames[0], raw=False, max_bin_len=1 << 20, max_str_len=1 << 20,
                              max_array_len=16, max_map_len=4096, max_ext_len=0)  # fmt: skip
        req = obj[2]["req"]
        return req if type(req) is int and 0 <= req < 1 << 63 else 0
    except Exception:  # noqa: BLE001 - garbage stays garbage
        return 0


GC_MODES = ("paced", "watched")


async def serve(config: ServerConfig, ready: Any = None, metrics_ready: Any = None, gc_mode: str = "paced") -> None:
    """Run a server until SIGINT/SIGTERM (or idle exit). ``ready(address)`` is called once bound;
    ``metrics_ready(port)`` once the metrics endpoint listens (if it is configured).

    This is the server's own process, so it paces the process's garbage collector
    (:class:`~tensorhub.runtime.collector.CollectorPacing`: long-lived records frozen out of the
    collector's passes); ``gc_mode="watched"`` leaves CPython's collector as it is and only
    counts its passes (the baseline). Either way the passes are in the metrics
    (``tensorhub_gc_pause_seconds``).

    Raises:
        InvalidArgument: ``gc_mode`` is not one of :data:`GC_MODES`.

    With ``$TENSORHUB_SERVER_PROFILE`` set to a file name, the server runs under cProfile and
    writes its profile there when it stops (``python -m pstats FILE``): how
    ``benchmarks/server_load.py --profile`` looks inside the real process. The profile counts the
    event loop thread's CPU time, not wall time: on a busy machine a wall-time profile charges
    whatever call the thread was descheduled in (a socket send that woke ZeroMQ's I/O thread)."""
    if gc_mode not in GC_MODES:
        raise InvalidArgument(f"gc_mode must be one of {', '.join(GC_MODES)}, got {gc_mode!r}")
    profile_to = os.environ.get("TENSORHUB_SERVER_PROFILE")
    if profile_to:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        try:
            await _serve(config, ready, metrics_ready, gc_mode)
        finally:
            profiler.disable()
            profiler.dump_stats(profile_to)
        return
    await _serve(config, ready, metrics_ready, gc_mode)


async def _serve(config: ServerConfig, ready: Any, metrics_ready: Any, gc_mode: str) -> None:
    server = ServerActor(config, collector=CollectorPacing(pace=gc_mode == "paced"))
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
            pass
    if ready is not None:
        ready(server.address)
    if metrics_ready is not None and server.metrics_server is not None:
        metrics_ready(server.metrics_server.port)
    await server.done.wait()


_C, _O, _P = HolderState.COMPLETE, HolderState.OFFLOAD, HolderState.PARTIAL


def cluster_state(table: Any, req: int, recent_bytes_per_s: float, window_s: float) -> m.ClusterState:
    """The table's models, versions, replicas and active grants (read-only)."""
    now = table.clock()
    models = []
    for name in sorted(table.models):
        mo = table.models[name]
        back = mo.retain_back()
        versions = []
        for v in sorted(mo.versions):
            ver = mo.versions[v]
            serving = partial = offloaded = 0
            for hs in ver.holders:
                for h in hs.values():
                    if h.state in (_C, _O):
                        serving += 1
                        offloaded += h.state is _O
                    elif h.state is _P:
                        partial += 1
            if not (serving or partial):
                continue
            versions.append(m.VersionState(
                v, ver.available, mo.retained(v), serving, partial, offloaded, tuple(sorted(ver.full)),
            ))  # fmt: skip
        replicas = []
        for rname in sorted(mo.replicas):
            r = mo.replicas[rname]
            shards = []
            for idx in sorted(r.shards):
                s = r.shards[idx]
                h = s.holder
                total = s.layout.total_bytes if s.layout is not None else 0
                verified = total if h is not None and h.state is not _P else (h.verified if h is not None else 0)
                shards.append(m.ShardState(
                    idx, s.id, s.location.datacenter, s.location.host,
                    h.version if h is not None else None, h.state.value if h is not None and h.state else "",
                    verified, total, tuple(sorted(o.version for o in s.offloads.values())),
                    round(max(0.0, now - s.last_seen), 3),
                ))  # fmt: skip
            replicas.append(m.ReplicaState(rname, r.num_shards, r.spot, tuple(shards)))
        models.append(m.ModelState(name, mo.num_shards, mo.highest_published, back, tuple(versions), tuple(replicas)))
    grants = []
    for gid in sorted(table.grants):
        g = table.grants[gid]
        r, src = g.reader, g.source
        layout = r.session.layout
        total = layout.total_bytes if layout is not None else 0
        age = max(0.0, now - g.created)
        moved = max(0, r.verified - g.start)
        grants.append(m.GrantState(
            gid, r.session.model.name, r.version, r.shard_idx, r.replica.name, src.replica.name, src.kind,
            src.state is not _P, r.verified, total, round(age, 3), round(moved / age, 1) if age > 0 else 0.0,
        ))  # fmt: skip
    reign = table.reign
    reigns = tuple(m.ReignSpan(*span) for span in reign.spans)
    solo = reign.role == "solo"
    return m.ClusterState(req, table.term, time.time(), tuple(models), tuple(grants), window_s, round(recent_bytes_per_s, 1),
                          reigns, None if solo else reign.epoch, None if solo else len(reign.voters))  # fmt: skip
