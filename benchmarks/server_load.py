"""The real reference server process under thousands of sessions: heartbeats, bursts and churn.

Workload: thousands of sessions (``--sessions``) of emulated workers speaking the real protocol
to a real server: heartbeats, bursts of updates with churn, ``--versions`` versions.
Baseline: none as a ratio: absolute bounds, the generator's own CPU printed beside.
Goal: at 4,096 sessions, 0 false removals, heartbeat p99 <= 100 ms, <= 1 server core.

A load generator that speaks the real wire protocol (the client's own message classes and
:mod:`tensorhub.core.wire` encoding) to a real ``tensorhub server`` process on 127.0.0.1, and
optionally a primary with its backup. It emulates every worker of an RL job as the server sees
it, without tensors: each shard of each replica is one session on its own ZeroMQ connection
(as one GPU worker process has; the generator speaks ZMTP itself, a DEALER's bytes without a
ZeroMQ context, so that thousands of sessions cost it little: :class:`Zmtp`), opening, registering a layout (a 1 GiB shard of 16 tensors,
256 checksums) and a grant key, heartbeating at the server's interval (1 s by default, echoing
the stamps as real clients do, so that with a backup they are votes), and, for several
versions in a row, the paper's burst:

1. the trainer replica unpublishes the version before (retention ``latest``) and publishes the
   next one; its checksums follow in a ``DeclareChecksums``, as the handle sends them;
2. every rollout replica calls ``update("latest")`` at once (one ``Update`` per shard, the
   model-parallel call numbered per replica);
3. each granted shard "pulls" for ``--pull`` seconds: no bytes move (the data plane is not what
   is measured here), but it sends the ``Progress`` reports a real reader sends (the schedule is
   the client's own: :func:`progress_schedule` runs a real :class:`~tensorhub.core.shard.ShardCore`
   over a pull of 8 MiB reads landing evenly, as the engine drives it; ``--progress eager``: as
   the engine did before it kept a pull's first interval quiet), then ``Complete``; a revoked
   grant waits for its next grant; the server answers the replica's ``Updated`` once every shard
   holds the version;
4. churn: ``--churn`` of the rollout replicas crash during each burst (their connections close,
   nothing is said) and come back as new incarnations after 1 to 12 s (a quick one fences its
   old incarnation; a slow one finds it expired), then take part in the next burst.

It prints, per session count: the server's CPU (cores, from ``/proc`` of its pid, over the
measured window), its resident memory (peak), heartbeat round-trip p50/p99 twice: as the
generator's loop saw it (send to ack read, so the generator's own latency is in it), and on the
wire (from the heartbeat's ``send()`` call to the kernel's receive timestamp of its ack,
``SO_TIMESTAMPNS`` on each TCP connection: :class:`StampedConnection`; without the time the ack
then waited for the generator's loop, which is printed too), the time from the publish to
the last grant and to the last completion of each burst (worst burst), the last grant after
the last request, and false removals (a session that did not crash told it was removed, or
unknown in a heartbeat ack; each session counted once). With ``--backup`` (the default runs both), the same with a backup
server attached (the primary holds its lease; heartbeats are votes), and the backup's CPU and
memory. The generator's own CPU is printed beside: on a small shared machine it competes with
the server for the same cores, so its processes run ``--nice`` (5) nicer than the server.

The server's garbage collector: every pass per generation (count, milliseconds, the longest),
from the server's own ``gc.callbacks`` (``tensorhub_gc_*`` metrics). ``--gc paced,watched`` runs
each session count with the server's collector paced (the default: long-lived records frozen
out of the passes, :mod:`tensorhub.runtime.collector`) and then as CPython runs it, one right
after the other: the A/B in the same machine's load.

Usage: python benchmarks/server_load.py [--sessions 1024,4096,8192] [--quick] [--backup both|no|only]
       [--versions N] [--procs P] [--pull S] [--progress engine|eager] [--churn F] [--profile DIR]
       [--json FILE] [--gc paced,watched] [--nice N]

``--profile DIR`` runs the server under cProfile (``TENSORHUB_SERVER_PROFILE``) and writes one
profile per run there, and one per load generator process beside it (``RUN-load-I.prof``). Goals at 4,096 sessions: 0 false removals, heartbeat p99 <= 100 ms, <= 1
server core on average, the burst's last grant within 1 s of its last request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import socket
import struct
import sys
import time
import traceback
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import BenchmarkError, Child, free_port, start_server, stop_process, write_json  # noqa: E402
from tensorhub.core import messages as m  # noqa: E402
from tensorhub.core.layout import Layout, TensorSpec  # noqa: E402
from tensorhub.core.topology import Location  # noqa: E402
from tensorhub.core.wire import decode, encode  # noqa: E402
from tensorhub.runtime.collector import PAUSE_BUCKETS  # noqa: E402
from tensorhub.runtime.metrics import LATENCY_BUCKETS, parse_text, scrape  # noqa: E402

MODEL = "actor"
SHARDS = 8  #: shards per replica (one per GPU of an 8-GPU node)
READ_BYTES = 8 << 20  #: the engine's read size (its default chunk)
GOALS = {"hb_p99_ms": 100.0, "cores": 1.0, "grant_after_request_s": 1.0}
DEAD_SOURCE_S = 0.2  #: how long a reader takes to find its source's holder gone (a refused connection)
BEAT_SLOTS = 100  #: heartbeats go out in this many slots per interval (each session in its own, at random)
_TICKS = os.sysconf("SC_CLK_TCK")


def layout() -> Layout:
    """A 1 GiB shard: 16 bfloat16 tensors of 64 MiB (256 checksums of 4 MiB chunks)."""
    return Layout(tuple(TensorSpec(f"layer{i}.weight", "bfloat16", (8192, 4096), 64 << 20) for i in range(16)),
                  "xxh3-64", 4 << 20, 2 << 20)  # fmt: skip


def progress_schedule(total: int, pull_s: float, eager: bool = False) -> list[tuple[float, int]]:
    """When a real reader reports progress during a pull of ``total`` bytes that takes
    ``pull_s`` seconds: ``(seconds after the grant, verified)`` per report. The client's own
    code decides: a :class:`~tensorhub.core.shard.ShardCore` as the engine drives it (``report
    _progress`` after each verified read and when its timer is due), its reads of
    :data:`READ_BYTES` landing evenly. ``eager``: as the engine did before it kept a pull's
    first interval quiet (reports from the first verified bytes)."""
    from tensorhub.core import shard as sh
    from tensorhub.core.session import ReplicationSession

    core = sh.ShardCore(lambda v: ReplicationSession(v, total, READ_BYTES, max_inflight=1, verify=True), timed_progress=not eager)
    src = m.SourceInfo(1, "trainer", 0, m.KIND_NORMAL, True, Location("dc0", "h", ""), {})
    out = core.on_grant(m.Grant(0, 2, 1, 1, 1, 0, src, None, None))
    reads = max(1, -(-total // READ_BYTES))
    made: list[tuple[float, int]] = []
    due: float | None = None  # the engine's timer
    for k in range(1, reads + 1):
        t = pull_s * k / reads
        if due is not None and due < t:  # the timer fires between two landings
            made += [(due, a.verified) for a in core.report_progress(due) if isinstance(a, sh.ReportProgress)]
            due = None
        (read,) = [a for a in out if isinstance(a, sh.IssueRead)]
        out = core.on_read_done(read.pull, read.grant, read.offset)
        for v in [a for a in out if isinstance(a, sh.VerifyRead)]:
            out += core.on_verified(v.pull, v.grant, v.offset, None)
        out += core.report_progress(t)
        made += [(t, a.verified) for a in out if isinstance(a, sh.ReportProgress)]
        if any(isinstance(a, sh.ReportComplete) for a in out):
            break
        if due is None and core.progress_unreported and core.reported_at is not None:
            due = core.reported_at + sh.PROGRESS_INTERVAL
    return made


# ---- /proc ------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_wait_seconds(pid: int) -> float:
    """Seconds the process's main thread (the server's event loop) was runnable but waiting for
    a CPU (``/proc/PID/schedstat``): on a busy machine, latency that no code change can remove."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of a process."""
    rss = hwm = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return rss, hwm


def server_latency(port: int) -> dict[str, list[int]]:
    """The server's ``tensorhub_request_seconds`` histogram (from reading a frame to sending its
    replies) by message kind: cumulative counts per bucket of :data:`LATENCY_BUCKETS`, then +Inf;
    and under ``"paused"``, how often its mailbox was full (it stopped reading the socket)."""
    parsed = parse_text(scrape("127.0.0.1", port, timeout=120.0))
    samples = parsed.get("tensorhub_request_seconds_bucket", {})
    paused = int(sum(parsed.get("tensorhub_reads_paused_total", {}).values()))
    out: dict[str, dict[float, int]] = {}
    for labels, value in samples.items():
        d = dict(labels)
        out.setdefault(d["kind"], {})[float(d["le"])] = int(value)  # float("+Inf") is inf
    hist = {kind: [by.get(float(b), 0) for b in LATENCY_BUCKETS] + [by.get(float("inf"), 0)] for kind, by in out.items()}
    return {**hist, "paused": [paused]}


def server_gc(port: int) -> dict[str, Any]:
    """The server process's collector passes so far (``tensorhub_gc_*``): per generation,
    cumulative counts per bucket of :data:`~tensorhub.runtime.collector.PAUSE_BUCKETS` then +Inf,
    and the summed seconds; the objects frozen out of the passes; the full passes run on purpose."""
    parsed = parse_text(scrape("127.0.0.1", port, timeout=120.0))
    gens: dict[str, dict[float, int]] = {}
    for labels, value in parsed.get("tensorhub_gc_pause_seconds_bucket", {}).items():
        d = dict(labels)
        gens.setdefault(d["generation"], {})[float(d["le"])] = int(value)
    seconds = {dict(labels)["generation"]: float(v) for labels, v in parsed.get("tensorhub_gc_pause_seconds_sum", {}).items()}
    cpu = {dict(labels)["generation"]: float(v) for labels, v in parsed.get("tensorhub_gc_cpu_seconds_total", {}).items()}
    return {
        "cpu": cpu,
        "buckets": {g: [by.get(float(b), 0) for b in PAUSE_BUCKETS] + [by.get(float("inf"), 0)] for g, by in gens.items()},
        "seconds": seconds,
        "frozen": int(sum(parsed.get("tensorhub_gc_frozen_objects", {}).values())),
        "full": int(sum(parsed.get("tensorhub_gc_full_passes_total", {}).values())),
    }


def gc_window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The collector's passes between two :func:`server_gc` scrapes: per generation, passes,
    wall milliseconds in all, the bound of the longest pass's bucket (ms, wall; inf: past the
    last), and CPU milliseconds in all."""
    out: dict[str, Any] = {"frozen": after["frozen"], "full": after["full"] - before["full"]}
    for g, cum in sorted(after["buckets"].items()):
        cum0 = before["buckets"].get(g, [0] * len(cum))
        per = [c - c0 for c, c0 in zip(cum, cum0)]
        passes = per[-1]
        longest = 0.0
        prev = 0
        for bound, c in zip(list(PAUSE_BUCKETS) + [float("inf")], per):
            if c > prev:
                longest = bound * 1000
            prev = c
        ms = (after["seconds"].get(g, 0.0) - before["seconds"].get(g, 0.0)) * 1000
        cpu_ms = (after["cpu"].get(g, 0.0) - before["cpu"].get(g, 0.0)) * 1000
        out[g] = (passes, ms, longest, cpu_ms)
    return out


def bucket_pct(cumulative: list[int], q: float) -> float:
    """The upper bound (ms) of the bucket holding quantile ``q`` of a cumulative histogram
    (inf: past the last bucket; nan: empty)."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return float("nan")
    for bound, n in zip(LATENCY_BUCKETS, cumulative):
        if n >= q * total:
            return bound * 1000
    return float("inf")


# ---- the generator (one process holds many sessions) -------------------------------------------


#: ZMTP 3.0 greeting of a client (NULL mechanism, not as-server): what a ZeroMQ DEALER sends first
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _frame(body: bytes, command: bool = False) -> bytes:
    """One ZMTP 3 frame (the last of its message): flags, size, body."""
    flags = 0x04 if command else 0x00
    if len(body) < 256:
        return bytes((flags, len(body))) + body
    return bytes((flags | 0x02,)) + len(body).to_bytes(8, "big") + body


def _ready(identity: bytes) -> bytes:
    """The NULL mechanism's READY command of a DEALER with routing id ``identity``."""
    props = b"".join(bytes((len(k),)) + k + len(v).to_bytes(4, "big") + v
                     for k, v in ((b"Socket-Type", b"DEALER"), (b"Identity", identity)))  # fmt: skip
    return _frame(b"\x05READY" + props, command=True)


# ---- kernel receive timestamps: the heartbeat's round trip as the wire sees it -----------------

#: Linux's SO_TIMESTAMPNS (the control message it adds is SCM_TIMESTAMPNS, the same number)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@ll")  # struct timespec: tv_sec, tv_nsec (native longs)
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)


def enable_rx_timestamps(sock: socket.socket) -> None:
    """Ask the kernel to stamp what ``sock`` receives with the wall-clock time it arrived
    (software receive timestamps, ``CLOCK_REALTIME``, ns); :func:`recv_stamped` reads them.

    Raises:
        BenchmarkError: the kernel refused the option (no receive timestamps on this system)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError as err:
        raise BenchmarkError(f"SO_TIMESTAMPNS refused on a {sock.type.name} socket ({err}): "
                             "no kernel receive timestamps here") from err


def recv_stamped(sock: socket.socket, size: int) -> tuple[bytes, float | None]:
    """One ``recvmsg`` of at most ``size`` bytes, with the kernel's receive time (wall-clock
    seconds, as ``time.time()``), or None where the kernel gave none (timestamps not enabled).
    On TCP a read may take several packets: the time is the last one's (Linux stamps the read
    with its newest segment), so for every message the read completes it is an upper bound."""
    data, ancillary, _, _ = sock.recvmsg(size, _ANCILLARY)
    stamp = None
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= _TIMESPEC.size:
            sec, ns = _TIMESPEC.unpack_from(raw)
            stamp = sec + ns * 1e-9
    return data, stamp


class StampedConnection:
    """A non-blocking TCP connection driven from the event loop (``add_reader``), read with
    :func:`recv_stamped`, that hands its protocol each read's bytes with the kernel's receive
    time (``protocol.data_received(data, stamp)``) and tells, for each write, the wall time of
    its ``send()`` call. The two ends of a round trip as the wire sees them, without the
    generator's own loop lateness (a ready ack unread while the loop runs other sessions' work:
    on a machine shared with the server, that is most of a heartbeat's RTT). What asyncio's
    transports offer the protocol here: ``write`` and ``abort``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: "Zmtp") -> None:
        self.loop = loop
        self.sock: socket.socket | None = sock
        self.protocol = protocol
        self.out = bytearray()  # what the kernel did not take yet
        loop.add_reader(sock.fileno(), self._readable)
        protocol.connection_made(self)  # type: ignore[arg-type]  # write and abort: what Zmtp uses

    def write(self, data: bytes) -> float:
        """Send ``data`` (what the kernel does not take now goes when it can); returns the wall
        time just before the ``send()`` call (or, behind earlier bytes, when it was queued)."""
        now = time.time()
        sock = self.sock
        if sock is None:
            raise ConnectionError("the connection is closed")
        if self.out:
            self.out += data
            return now
        try:
            n = sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as err:
            self._lost(err)
            return now
        if n < len(data):
            self.out += data[n:]
            self.loop.add_writer(sock.fileno(), self._writable)
        return now

    def _writable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            n = sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._lost(err)
            return
        del self.out[:n]
        if not self.out:
            self.loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            data, stamp = recv_stamped(sock, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._lost(err)
            return
        if not data:  # the server closed it
            self._lost(None)
            return
        try:
            self.protocol.data_received(data, stamp)
        except Exception as err:  # noqa: BLE001 - as asyncio does: the connection is closed, the reason kept
            self._lost(err)

    def abort(self) -> None:
        self._lost(None)

    def _lost(self, exc: Exception | None) -> None:
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self.loop.remove_reader(sock.fileno())
        if self.out:
            self.loop.remove_writer(sock.fileno())
        sock.close()
        self.protocol.connection_lost(exc)


async def open_stamped(protocol: "Zmtp", host: str, port: int) -> StampedConnection:
    """Connect ``protocol`` to ``host:port`` over a :class:`StampedConnection` (receive
    timestamps on, Nagle off as asyncio's transports have it)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        enable_rx_timestamps(sock)
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return StampedConnection(loop, sock, protocol)


class Zmtp(asyncio.Protocol):
    """One emulated worker's connection to the server, speaking ZMTP 3.0 (what a ZeroMQ DEALER
    speaks: the greeting, the NULL mechanism's READY with the routing id, then frames) straight
    from the event loop. A pyzmq DEALER per session costs each send a wake of ZeroMQ's I/O thread
    and each receive two more descriptors to watch: thousands of them in a generator took the
    cores the server was to be measured on. The server sees the same bytes either way.

    Over a :class:`StampedConnection` (:func:`open_stamped`, what the generator uses) each
    frame is handed on with the kernel's receive time of the read that completed it, and
    :meth:`write` returns the wall time of its ``send()`` call; over an asyncio transport
    (``create_connection``) the stamp is None."""

    def __init__(self, identity: bytes, on_frame: Any) -> None:
        self.identity = identity
        self.on_frame = on_frame  # called with each message frame's body and its kernel receive time (or None)
        self.transport: asyncio.Transport | StampedConnection | None = None
        self.buf = bytearray()
        self.greeted = False  # the server's greeting was read
        #: the server's READY was read: the handshake is over. Nothing may be sent before (libzmq
        #: would read it as a handshake command, and drop the connection), as a DEALER queues
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        transport.write(_GREETING + _ready(self.identity))  # both at once: libzmq reads them in turn

    def data_received(self, data: bytes, stamp: float | None = None) -> None:  # the stamp: see the class
        buf = self.buf
        buf += data
        pos = 0
        if not self.greeted:
            if len(buf) < 64:
                return
            if buf[0] != 0xFF or buf[9] != 0x7F or buf[10] < 3:
                raise BenchmarkError(f"the server's greeting is not ZMTP 3: {bytes(buf[:12])!r}")  # closes it
            self.greeted, pos = True, 64
        n = len(buf)
        while pos + 2 <= n:
            flags = buf[pos]
            if flags & 0x02:
                if pos + 9 > n:
                    break
                size, head = int.from_bytes(buf[pos + 1 : pos + 9], "big"), 9
            else:
                size, head = buf[pos + 1], 2
            end = pos + head + size
            if end > n:
                break
            if not flags & 0x04:  # a message frame (the DEALER's messages are one frame each)
                self.on_frame(bytes(buf[pos + head : end]), stamp)
            elif buf[pos + head : pos + head + 6] == b"\x05READY":
                if not self.ready.done():
                    self.ready.set_result(None)
            elif buf[pos + head : pos + head + 6] == b"\x05ERROR" and not self.ready.done():
                self.ready.set_exception(BenchmarkError(f"the server refused the handshake: {bytes(buf[pos + head : end])!r}"))
            pos = end
        del buf[:pos]

    def write(self, body: bytes) -> float:
        """Send one frame; returns the wall time of the ``send()`` call (:class:`StampedConnection`),
        else of this call."""
        assert self.transport is not None
        sent = self.transport.write(_frame(body))
        return sent if sent is not None else time.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"the server closed the connection during the handshake ({exc})"))


@dataclass
class _Pull:
    grant: int
    term: int
    start: float
    handles: list[asyncio.TimerHandle] = field(default_factory=list)


class Shard:
    """One emulated worker: a session on its own connection (:class:`Zmtp`: a ZeroMQ DEALER's
    protocol, without pyzmq: thousands of sessions in one process must cost the machine as
    little as possible)."""

    def __init__(self, gen: "Generator", replica: str, idx: int, retain: int | None) -> None:
        self.gen = gen
        self.replica = replica
        self.idx = idx
        self.retain = retain
        self.incarnation = os.urandom(8).hex()
        self.conn: Zmtp | None = None
        self.slot = random.randrange(BEAT_SLOTS)
        self.sid = 0
        self.term = 0
        self.stamp = (0, 0.0)
        self.req = itertools.count(1)
        self.call = itertools.count(1)
        #: req -> (kind, sent (monotonic), its send() call (wall clock), the answer's future)
        self.pending: dict[int, tuple[str, float, float, asyncio.Future | None]] = {}
        #: req -> (its builder, kind, times refused so far) of each report awaiting its answer
        self.reports: dict[int, tuple[Any, str, int]] = {}
        self.pulls: dict[int, _Pull] = {}
        self.alive = False
        self.reigning = True
        self.acked = False  # a heartbeat of this session was answered
        self.asked = 0.0  # when this shard's update of the current burst went out (0: granted since)

    # -- plumbing

    def send(self, build: Any, kind: str, want: bool = True, refused: int = 0) -> asyncio.Future | None:
        req = next(self.req)
        msg = build(req)
        fut = asyncio.get_running_loop().create_future() if want else None
        sent = time.monotonic()
        self.pending[req] = (kind, sent, self.tell(msg), fut)
        if not want and kind != "heartbeat":  # a report: sent again if the server does not decide now
            self.reports[req] = (build, kind, refused)
        return fut

    def _report_refused(self, req: int, code: str) -> None:
        """As the client does (``tensorhub.runtime.client._REPORT_RETRIES``): a report the server
        refused because it does not decide now goes again in 0.25 s, 40 times at most."""
        from tensorhub.runtime.client import _REPORT_RETRIES, _REPORT_RETRY_S

        build, kind, refused = self.reports.pop(req)
        if code == "server_unavailable" and refused < _REPORT_RETRIES:
            self.gen.count(f"{kind} sent again")
            asyncio.get_running_loop().call_later(_REPORT_RETRY_S, self._resend, build, kind, refused + 1)

    def _resend(self, build: Any, kind: str, refused: int) -> None:
        if self.alive:
            self.send(build, kind, want=False, refused=refused)

    def tell(self, msg: Any) -> float:
        """Send ``msg``; returns the wall time of the ``send()`` call."""
        conn = self.conn
        if conn is None or conn.transport is None:
            raise ConnectionError(f"{self.replica}/{self.idx}: not connected")
        return conn.write(encode(msg))

    async def start(self, address: str) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        identity = bytes((1 + random.randrange(255),)) + os.urandom(11)  # a routing id never starts with 0
        conn = Zmtp(identity, self._frame)
        await open_stamped(conn, host, int(port))
        await asyncio.wait_for(conn.ready, 300)  # as long as an open may take
        self.conn = conn
        self.alive = True
        self.req = itertools.count(1)
        self.call = itertools.count(1)
        inc = self.incarnation
        opened = await asyncio.wait_for(self.send(lambda r: m.OpenShard(
            r, MODEL, self.replica, SHARDS, self.idx, inc, self.gen.location(self.replica), False, self.retain), "open"), 300)
        self.sid, self.term = opened.session, opened.term
        self.stamp = (opened.term, 0.0)
        self.gen.interval = opened.heartbeat_interval
        await asyncio.wait_for(self.send(lambda r: m.Register(
            r, self.sid, self.gen.layout, {"tcp": {"host": "127.0.0.1", "port": 1}}, os.urandom(32)), "register"), 300)
        self.gen.slots[self.slot].append(self)

    def crash(self) -> None:
        """Die without a word: the connection closes, the heartbeats stop."""
        self.alive = False
        if self in self.gen.slots[self.slot]:
            self.gen.slots[self.slot].remove(self)
        for p in self.pulls.values():
            for h in p.handles:
                h.cancel()
        self.pulls.clear()
        for _, _, _, fut in self.pending.values():
            if fut is not None and not fut.done():
                fut.cancel()
        self.pending.clear()
        self.reports.clear()
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.abort()  # as the kernel closes a dead process's connection
        self.conn = None
        self.incarnation = os.urandom(8).hex()  # the restarted process is a new incarnation

    # -- heartbeats

    def beat(self) -> None:
        term, stamp = self.stamp
        self.send(lambda r: m.Heartbeat(r, (self.sid,), stamp, term), "heartbeat", want=False)

    # -- replies and pushed messages

    def _frame(self, frame: bytes, stamp: float | None) -> None:
        if not self.alive:
            return
        now = time.monotonic()
        try:
            msg = decode(frame)
        except Exception as err:  # noqa: BLE001 - count it, go on
            self.gen.count(f"undecodable: {err}")
            return
        self.on(msg, now, stamp)

    def on(self, msg: Any, now: float, stamp: float | None = None) -> None:
        """``now``: when the generator read it (monotonic); ``stamp``: when the kernel received
        it (wall clock, None where unknown)."""
        gen = self.gen
        t = type(msg)
        req = getattr(msg, "req", None)
        if req is not None and t is not m.Grant:
            kind, sent, sent_wall, fut = self.pending.pop(req, ("?", now, 0.0, None))
            if t is m.HeartbeatAck:
                if gen.measuring:
                    gen.rtt.append((now - sent) * 1000)
                    if stamp is None or not sent_wall:
                        gen.count("heartbeat ack without a kernel receive timestamp")
                    else:  # the wire's round trip, and how long the ack then waited for this loop
                        gen.wire_rtt.append((stamp - sent_wall) * 1000)
                        gen.unread.append(max(0.0, time.time() - stamp) * 1000)
                self.stamp = (msg.term, msg.stamp)
                self.reigning = msg.reigning
                self.acked = True
                if self.sid in msg.unknown:
                    gen.false_removal(self, "unknown in a heartbeat ack")
                return
            if t is m.Failed:
                gen.count(f"{kind} failed: {msg.code}")
            if req in self.reports:
                if t is m.Failed:
                    self._report_refused(req, msg.code)
                else:
                    del self.reports[req]
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        if t is m.Grant:
            self._pulled(msg, now)
        elif t is m.Revoke:
            p = self.pulls.pop(msg.grant, None)
            if p is not None:
                for h in p.handles:
                    h.cancel()
            gen.count("revoked")
        elif t is m.OffloadRequest:  # the last copy of a retained version: "copy it to CPU first"
            self.send(lambda r: m.PublishOffload(r, self.sid, msg.version, True), "offloaded", want=False)
        elif t in (m.Removed, m.StepDown):
            gen.false_removal(self, f"{t.__name__}: {getattr(msg, 'reason', '')[:80]}")
        elif t in (m.ChecksumsReady, m.FreeOffload):
            pass
        else:
            gen.count(f"unexpected {t.__name__}")

    def _pulled(self, g: m.Grant, now: float) -> None:
        """A grant: emulate the pull (no bytes): the client's progress reports, then complete."""
        gen = self.gen
        gen.burst.grants += 1
        gen.burst.last_grant = max(gen.burst.last_grant, now)
        if self.asked:
            gen.burst.waits.append(now - self.asked)
            gen.burst.last_first_grant = max(gen.burst.last_first_grant, now)
            self.asked = 0.0
        loop = asyncio.get_running_loop()
        p = self.pulls[g.grant] = _Pull(g.grant, g.term, now)
        if g.source.replica in gen.dead:  # its holder is gone: the connection is refused
            p.handles.append(loop.call_later(DEAD_SOURCE_S, self._source_failed, g.grant, g.term))
            return
        for at, verified in gen.schedule:
            p.handles.append(loop.call_later(at, self._progress, g.grant, g.term, verified))
        p.handles.append(loop.call_later(gen.pull_s, self._complete, g.grant, g.term))

    def _progress(self, grant: int, term: int, verified: int) -> None:
        if self.alive and grant in self.pulls:
            self.tell(m.Progress(next(self.req), self.sid, grant, term, verified))

    def _source_failed(self, grant: int, term: int) -> None:
        if not self.alive or self.pulls.pop(grant, None) is None:
            return
        self.gen.count("source failed (crashed holder)")
        reason = "connection refused (emulated: the holder crashed)"
        self.send(lambda r: m.SourceFailed(r, self.sid, grant, term, 0, reason), "source_failed", want=False)

    def _complete(self, grant: int, term: int) -> None:
        if not self.alive or self.pulls.pop(grant, None) is None:
            return
        self.gen.burst.last_complete = max(self.gen.burst.last_complete, time.monotonic())
        self.send(lambda r: m.Complete(r, self.sid, grant, term), "complete", want=False)


@dataclass
class BurstStats:
    requests: int = 0
    last_request: float = 0.0
    grants: int = 0
    last_grant: float = 0.0
    last_first_grant: float = 0.0  # the last shard's first grant (later ones replace a failed or revoked source)
    last_complete: float = 0.0
    answered: int = 0
    last_answer: float = 0.0
    failed: int = 0
    timed_out: int = 0
    waits: list[float] = field(default_factory=list)  # each shard's update -> its first grant


class Generator:
    """The sessions of one load process, driven by the parent over a pipe."""

    def __init__(self, address: str, replicas: list[str], pull_s: float, seed: int, eager: bool = False) -> None:
        self.address = address
        self.layout = layout()
        self.checksums = tuple(range(1, self.layout.checksum_count() + 1))
        self.pull_s = pull_s
        self.schedule = progress_schedule(self.layout.total_bytes, pull_s, eager)  # every pull's reports
        self.rng = random.Random(seed)
        self.shards: dict[str, list[Shard]] = {
            r: [Shard(self, r, i, 0 if r == "trainer" else None) for i in range(SHARDS)] for r in replicas
        }
        self.measuring = False
        self.rtt = array("d")  # ms from a heartbeat's send to its ack read by this loop
        self.wire_rtt = array("d")  # ms from its send() call to the kernel's receive time of its ack
        self.unread = array("d")  # ms an ack waited in the kernel before this loop read it
        self.late = array("d")  # ms each heartbeat slot fired after its time: this process's own loop lag
        self.counts: dict[str, int] = {}
        self.false: list[str] = []  # the first few, for the report
        self.false_count = 0
        self.falsely_removed: set[tuple[str, int, str]] = set()
        self.crashed: set[str] = set()
        self.burst = BurstStats()
        self.trainer_call = itertools.count(1)
        self.published: int | None = None
        self.dead: set[str] = set()
        self.slots: list[list[Shard]] = [[] for _ in range(BEAT_SLOTS)]
        self.interval = 1.0

    async def heartbeats(self) -> None:
        """Every session heartbeats once per interval, in its own slot of it."""
        k = 0
        t0 = time.monotonic()
        while True:
            for s in list(self.slots[k % BEAT_SLOTS]):
                if s.alive and s.sid:
                    try:
                        s.beat()
                    except ConnectionError:
                        self.count("heartbeat not sent")
            k += 1
            due = t0 + k * self.interval / BEAT_SLOTS
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self.measuring:  # how late the loop woke: its acks waited as long to be read
                self.late.append(max(0.0, time.monotonic() - due) * 1000)

    def location(self, replica: str) -> Location:
        n = int(replica.rsplit("-", 1)[1]) if "-" in replica else 0
        return Location("dc0", f"host-{n}", "")

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def false_removal(self, shard: Shard, why: str) -> None:
        key = (shard.replica, shard.idx, shard.incarnation)
        if shard.alive and shard.replica not in self.crashed and key not in self.falsely_removed:
            self.falsely_removed.add(key)  # once per session, however many messages say so
            self.false_count += 1
            if len(self.false) < 20:
                self.false.append(f"{shard.replica}/{shard.idx}: {why}")

    async def open_all(self, concurrency: int = 64) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one(s: Shard) -> None:
            async with sem:
                await s.start(self.address)

        await asyncio.gather(*(one(s) for shards in self.shards.values() for s in shards))

    async def reigning(self) -> bool:
        return all(s.reigning and s.acked for shards in self.shards.values() for s in shards if s.alive)

    async def publish(self, version: int) -> float:
        """The trainer: unpublish the last version, publish this one, declare its checksums."""
        shards = self.shards["trainer"]
        if self.published is not None:
            n = next(self.trainer_call)
            answers = await asyncio.gather(*(asyncio.wait_for(s.send(lambda r, s=s: m.Unpublish(r, s.sid, n), "unpublish"), 60)
                                             for s in shards))  # fmt: skip
            self._check(answers, "unpublish")
        n = next(self.trainer_call)
        answers = await asyncio.gather(*(asyncio.wait_for(s.send(lambda r, s=s: m.Publish(r, s.sid, n, version, None), "publish"), 60)
                                         for s in shards))  # fmt: skip
        self._check(answers, "publish")
        at = time.monotonic()
        for s in shards:
            s.send(lambda r, s=s: m.DeclareChecksums(r, s.sid, version, self.checksums), "checksums", want=False)
        self.published = version
        return at

    def _check(self, answers: list[Any], what: str) -> None:
        bad = [a for a in answers if isinstance(a, m.Failed)]
        if bad:
            raise BenchmarkError(f"trainer {what} refused: {bad[0].code}: {bad[0].message}")

    async def update(self, version: int, dead: list[str], timeout: float) -> dict:
        """Every live rollout replica updates to "latest" at once. A pull granted from a replica
        in ``dead`` (crashed, and not yet expired or fenced by the server) fails as a real one
        would: the connection is refused, and the reader reports ``SourceFailed``."""
        self.burst = b = BurstStats()
        self.dead = set(dead)
        calls: list[tuple[Shard, asyncio.Future]] = []
        for name, shards in self.shards.items():
            if name == "trainer" or not all(s.alive for s in shards):
                continue
            for s in shards:
                n = next(s.call)
                fut = s.send(lambda r, s=s, n=n: m.Update(r, s.sid, n, "latest", timeout), "update")
                s.asked = time.monotonic()
                assert fut is not None
                calls.append((s, fut))
                b.requests += 1
        b.last_request = time.monotonic()
        answered_at: dict[int, float] = {}  # id(future) -> when its answer came
        for _, fut in calls:
            fut.add_done_callback(lambda f: answered_at.setdefault(id(f), time.monotonic()))
        # One wait for them all: an update still unanswered at the deadline is counted at once
        # (waiting a moment for each in turn, thousands of them outlasted the parent's patience).
        if calls:
            await asyncio.wait([fut for _, fut in calls], timeout=timeout + 5)
        for s, fut in calls:
            if fut.cancelled():
                continue  # it crashed
            if not fut.done():
                if s.alive:
                    b.timed_out += 1
                continue
            ans = fut.result()
            if isinstance(ans, m.Updated) and ans.moved and ans.version == version:
                b.answered += 1
                b.last_answer = max(b.last_answer, answered_at.get(id(fut), time.monotonic()))
            elif s.alive:
                b.failed += 1
        return dict(b.__dict__)

    def crash(self, names: list[str]) -> None:
        for name in names:
            self.crashed.add(name)
            for s in self.shards[name]:
                s.crash()

    async def rejoin(self, names: list[str]) -> None:
        """Crashed replicas come back as new incarnations (the first shard to open fences the
        old incarnation, unless the server expired it already)."""
        await asyncio.gather(*(s.start(self.address) for name in names for s in self.shards[name]))
        for name in names:
            self.crashed.discard(name)
            self.count("rejoined")

    async def close(self) -> None:
        self.slots = [[] for _ in range(BEAT_SLOTS)]  # no more heartbeats
        await asyncio.sleep(0.3)
        for shards in self.shards.values():
            for s in shards:
                if s.alive:
                    try:
                        s.tell(m.CloseShard(next(s.req), s.sid))
                    except ConnectionError:
                        pass
        await asyncio.sleep(0.5)
        for shards in self.shards.values():
            for s in shards:
                s.crash()


def _generator_main(
    conn: Any, address: str, replicas: list[str], pull_s: float, seed: int, eager: bool, profile: str | None = None,
    nice: int = 0,
) -> None:
    if nice:  # the server first: on a machine short of cores the generator waits, not the server
        os.nice(nice)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    prof = None
    if profile is not None:  # --profile: the generator's own cost, beside the server's
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        loop.run_until_complete(_generator(conn, address, replicas, pull_s, seed, eager))
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
    except BaseException:  # noqa: BLE001 - the parent wants to know
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass


async def _generator(conn: Any, address: str, replicas: list[str], pull_s: float, seed: int, eager: bool) -> None:
    gen = Generator(address, replicas, pull_s, seed, eager)
    loop = asyncio.get_running_loop()
    beats = asyncio.ensure_future(gen.heartbeats())
    inbox: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
    # the event loop made the pipe non-blocking: a large answer (the heartbeat samples of
    # thousands of sessions) would then be cut short by a full pipe buffer
    os.set_blocking(conn.fileno(), True)
    while True:
        cmd, *args = await inbox.get()
        if cmd == "quit":
            beats.cancel()
            break
        if cmd == "open":
            await gen.open_all()
            conn.send(("opened",))
        elif cmd == "reigning":
            conn.send(("reigning", await gen.reigning()))
        elif cmd == "measure":
            gen.measuring = bool(args[0])
            if gen.measuring:
                gen.rtt, gen.wire_rtt, gen.unread, gen.late = array("d"), array("d"), array("d"), array("d")
            conn.send(("measure",))
        elif cmd == "publish":
            try:
                conn.send(("published", await gen.publish(args[0]), None))
            except BenchmarkError as err:  # e.g. the primary stepped down: the run ends there, reported
                conn.send(("published", None, str(err)))
            except TimeoutError:
                conn.send(("published", None, "the trainer's unpublish or publish was not answered in 60 s"))
        elif cmd == "update":
            conn.send(("updated", await gen.update(*args)))
        elif cmd == "crash":
            gen.crash(args[0])
            conn.send(("crashed",))
        elif cmd == "rejoin":
            await gen.rejoin(args[0])
            conn.send(("rejoined",))
        elif cmd == "stats":
            conn.send(("stats", gen.rtt.tobytes(), gen.false, gen.false_count, gen.counts, gen.late.tobytes(),
                       gen.wire_rtt.tobytes(), gen.unread.tobytes()))  # fmt: skip
        elif cmd == "close":
            await gen.close()
            conn.send(("closed",))
    loop.remove_reader(conn.fileno())


# ---- the parent -------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_once(sessions: int, backup: bool, args: argparse.Namespace, run_id: str, gc_mode: str = "paced") -> dict:
    """One server (and backup), ``sessions`` sessions; returns the figures."""
    replicas = ["trainer"] + [f"rollout-{i}" for i in range(1, sessions // SHARDS)]
    rollouts = replicas[1:]
    env_profile = gen_profile = None
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        env_profile = str(args.profile / f"{run_id}.prof")
        gen_profile = str(args.profile / run_id)
    servers: list[Any] = []
    children: list[Child] = []
    rng = random.Random(args.seed * 1_000_003 + sessions)
    try:
        metrics_port = free_port()
        extra = ["--seed", str(args.seed), "--gc", gc_mode]
        env = {"TENSORHUB_SERVER_PROFILE": env_profile} if env_profile else None
        if backup:
            bproc, baddr = start_server(30, "--role", "backup", *extra, echo_all=False)
            servers.append(bproc)
            proc, address = start_server(30, "--role", "primary", "--peer", baddr, *extra, "--metrics-port", str(metrics_port),
                                         echo_all=False, env=env)  # fmt: skip
        else:
            proc, address = start_server(30, *extra, "--metrics-port", str(metrics_port), echo_all=False, env=env)
        servers.insert(0, proc)
        procs = max(1, min(args.procs, len(replicas)))
        parts = [replicas[i::procs] for i in range(procs)]
        for i, part in enumerate(parts):
            children.append(Child(f"load-{i}", _generator_main, (address, part, args.pull, args.seed + i, args.progress == "eager",
                                                                  gen_profile and f"{gen_profile}-load-{i}.prof", args.nice),
                                  timeout=120))
        trainer = next(c for c, part in zip(children, parts) if "trainer" in part)
        t0 = time.monotonic()
        for c in children:
            c.send("open")
        for c in children:
            c.expect("opened", 300)
        open_s = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while True:  # heartbeats acked (with a backup: the primary reigns and stamps them)
            time.sleep(0.25)
            for c in children:
                c.send("reigning")
            if all([c.expect("reigning")[1] for c in children]):
                break
            if time.monotonic() > deadline:
                raise BenchmarkError("the server did not answer every session's heartbeat (or, with a backup, reign) within 30 s")
        time.sleep(args.warmup)
        for c in children:
            c.send("measure", True)
        for c in children:
            c.expect("measure")
        handled0 = server_latency(metrics_port)
        gc0 = server_gc(metrics_port)
        gen_cpu0 = sum(cpu_seconds(c.proc.pid) for c in children)
        cpu0 = [cpu_seconds(p.pid) for p in servers]
        wait0 = cpu_wait_seconds(servers[0].pid)
        load0 = os.getloadavg()[0]
        w0 = time.monotonic()
        bursts = []
        aborted = None
        children_of = {r: c for c, part in zip(children, parts) for r in part}
        down: dict[str, int] = {}  # crashed replica -> the burst after which it comes back
        ever: set[str] = set()
        k = int(round(args.churn * len(rollouts)))

        def tell_each(cmd: str, names: list[str]) -> None:
            for c in children:
                mine = [r for r in names if children_of[r] is c]
                if mine:
                    c.send(cmd, mine)
                    c.expect(cmd.replace("crash", "crashed").replace("rejoin", "rejoined"), 120)

        for v in range(1, args.versions + 1):
            trainer.send("publish", v)
            _, published, refused = trainer.expect("published", 120)
            if published is None:
                aborted = f"burst {v}: {refused}"
                break
            for c in children:
                c.send("update", v, sorted(down), args.timeout)
            per = [c.expect("updated", args.timeout + 60)[1] for c in children]
            b = {key: sum(p[key] for p in per) for key in ("requests", "grants", "answered", "failed", "timed_out")}
            b["last_request_s"] = max(p["last_request"] for p in per) - published
            b["last_grant_s"] = max(p["last_grant"] for p in per) - published if b["grants"] else float("nan")
            b["last_complete_s"] = max(p["last_complete"] for p in per) - published if b["grants"] else float("nan")
            b["last_first_grant_s"] = max(p["last_first_grant"] for p in per) - published if b["grants"] else float("nan")
            b["grant_after_request_s"] = b["last_first_grant_s"] - b["last_request_s"]
            # churn between bursts: some rollouts crash (no word to the server) and come back as
            # new incarnations one burst later (the new one fences the old) or three (expired by then)
            back = sorted(r for r, at in down.items() if at <= v)
            tell_each("rejoin", back)
            for r in back:
                del down[r]
            crash = [r for r in rng.sample(rollouts, k) if r not in ever] if v < args.versions else []
            tell_each("crash", crash)
            for r in crash:
                ever.add(r)
                down[r] = v + rng.choice((1, 3))
            b["crashed"], b["rejoined"] = len(crash), len(back)
            b["rss_mib"] = memory_mib(servers[0].pid)[0]  # after each burst: does it level off?
            waits = [w for p in per for w in p["waits"]]
            b["wait_p50_s"], b["wait_p99_s"] = pct(waits, 0.5), pct(waits, 0.99)
            bursts.append(b)
            time.sleep(args.gap)
        window = time.monotonic() - w0
        handled = {kind: [n - n0 for n, n0 in zip(counts1, handled0.get(kind, [0] * len(counts1)))]
                   for kind, counts1 in server_latency(metrics_port).items()}  # fmt: skip
        gc_passes = gc_window(gc0, server_gc(metrics_port))
        cpu1 = [cpu_seconds(p.pid) for p in servers]
        waited = cpu_wait_seconds(servers[0].pid) - wait0
        load = (load0 + os.getloadavg()[0]) / 2
        gen_cpu = sum(cpu_seconds(c.proc.pid) for c in children) - gen_cpu0
        mem = [memory_mib(p.pid) for p in servers]
        rtt: list[float] = []
        wire_rtt: list[float] = []
        unread: list[float] = []
        late: list[float] = []
        false: list[str] = []
        false_count = 0
        counts: dict[str, int] = {}
        for c in children:
            c.send("stats")
            try:
                _, raw, f, nf, cnt, late_raw, wire_raw, unread_raw = c.expect("stats")
            except OSError as err:
                c.proc.join(5)
                raise BenchmarkError(f"generator {c.name} died (exit code {c.proc.exitcode}): {err}") from err
            for into, got in ((rtt, raw), (late, late_raw), (wire_rtt, wire_raw), (unread, unread_raw)):
                a = array("d")
                a.frombytes(got)
                into.extend(a)
            false.extend(f)
            false_count += nf
            for key, n in cnt.items():
                counts[key] = counts.get(key, 0) + n
        for c in children:
            c.send("close")
        for c in children:
            try:
                c.expect("closed", 30)
            except BenchmarkError:
                pass
        return {
            "sessions": len(replicas) * SHARDS, "backup": backup, "gc_mode": gc_mode, "gc": gc_passes, "open_s": round(open_s, 2), "window_s": round(window, 2),
            "server_cores": (cpu1[0] - cpu0[0]) / window, "server_rss_mib": mem[0][0], "server_peak_mib": mem[0][1],
            "backup_cores": (cpu1[1] - cpu0[1]) / window if backup else None,
            "backup_rss_mib": mem[1][0] if backup else None,
            "generator_cores": gen_cpu / window, "server_cpu_wait": waited / window, "loadavg": load, "generator_procs": len(children),
            "hb_count": len(rtt), "hb_p50_ms": pct(rtt, 0.5), "hb_p99_ms": pct(rtt, 0.99), "hb_max_ms": max(rtt, default=float("nan")),
            "hb_wire_count": len(wire_rtt), "hb_wire_p50_ms": pct(wire_rtt, 0.5), "hb_wire_p99_ms": pct(wire_rtt, 0.99),
            "hb_wire_max_ms": max(wire_rtt, default=float("nan")),
            "ack_unread_p50_ms": pct(unread, 0.5), "ack_unread_p99_ms": pct(unread, 0.99),
            "gen_late_p50_ms": pct(late, 0.5), "gen_late_p99_ms": pct(late, 0.99),
            "server_ms": {kind: (bucket_pct(h, 0.5), bucket_pct(h, 0.99), h[-1]) for kind, h in handled.items() if kind != "paused"},
            "server_paused": handled.get("paused", [0])[0],
            "bursts": bursts, "aborted": aborted, "false_removals": false_count, "false_examples": false[:5], "counts": counts,
        }  # fmt: skip
    finally:
        for c in children:
            c.stop()
        for p in servers:
            stop_process(p)


def verdict(r: dict) -> dict[str, bool]:
    worst = max((b["grant_after_request_s"] for b in r["bursts"]), default=float("inf"))
    return {
        "0 false removals": r["false_removals"] == 0,
        f"heartbeat p99 <= {GOALS['hb_p99_ms']:g} ms (as the generator's loop saw it)": r["hb_p99_ms"] <= GOALS["hb_p99_ms"],
        f"heartbeat p99 <= {GOALS['hb_p99_ms']:g} ms (on the wire)": r["hb_wire_p99_ms"] <= GOALS["hb_p99_ms"],
        f"<= {GOALS['cores']:g} server core": r["server_cores"] <= GOALS["cores"],
        f"last (first) grant <= {GOALS['grant_after_request_s']:g} s after last request": worst <= GOALS["grant_after_request_s"],
        "every update answered": r["aborted"] is None and all(b["failed"] == 0 and b["timed_out"] == 0 for b in r["bursts"]),
    }


def report(r: dict) -> None:
    bursts = r["bursts"]
    if r["aborted"]:
        print(f"\n{r['sessions']:,} sessions, {'primary + backup' if r['backup'] else 'one server'}: the run ended early at "
              f"{r['aborted']}")  # fmt: skip
    if not bursts:
        print(f"  false removals {r['false_removals']}; server {r['server_cores']:.2f} cores; no burst completed")
        return
    worst = max(bursts, key=lambda b: b["last_complete_s"])
    setup = ("primary + backup" if r["backup"] else "one server") + f", --gc {r['gc_mode']}"
    print(f"\n{r['sessions']:,} sessions ({r['sessions'] // SHARDS} replicas of {SHARDS} shards), {setup}; "
          f"{len(bursts)} bursts over {r['window_s']:.0f} s; opened in {r['open_s']:.1f} s")  # fmt: skip
    line = f"  server   {r['server_cores']:.2f} cores, RSS {r['server_rss_mib']:.0f} MiB (peak {r['server_peak_mib']:.0f})"
    if r["backup"]:
        line += f"; backup {r['backup_cores']:.2f} cores, RSS {r['backup_rss_mib']:.0f} MiB"
    print(line)
    g = r["gc"]
    print(f"  server's garbage collector ({r['gc_mode']}): " + "; ".join(
        f"{'generation ' + k if k.isdigit() else k}: {g[k][0]:,} passes, {g[k][1]:.0f} ms ({g[k][3]:.0f} ms CPU), longest <= {g[k][2]:g} ms"
        for k in ("0", "1", "2", "full on purpose") if k in g) + f"; {g['frozen']:,} objects frozen")  # fmt: skip
    print("  server RSS after each burst: " + ", ".join(f"{b.get('rss_mib', float('nan')):.0f}" for b in bursts) + " MiB")
    print(f"  server's event loop runnable but waiting for a CPU {r['server_cpu_wait']:.0%} of the time "
          f"(machine load average {r['loadavg']:.1f} on {os.cpu_count()} CPUs)")
    print(f"  generator {r['generator_cores']:.2f} cores in {r['generator_procs']} processes (on the same machine)")
    print(f"  heartbeat RTT as the generator's loop saw it (sent -> ack read): p50 {r['hb_p50_ms']:.1f} ms, "
          f"p99 {r['hb_p99_ms']:.1f} ms, max {r['hb_max_ms']:.0f} ms ({r['hb_count']:,} acks)")  # fmt: skip
    if r["hb_wire_count"]:
        print(f"  heartbeat RTT on the wire (its send() call -> the kernel's receive timestamp of the ack, SO_TIMESTAMPNS; "
              f"an upper bound): p50 {r['hb_wire_p50_ms']:.1f} ms, p99 {r['hb_wire_p99_ms']:.1f} ms, max {r['hb_wire_max_ms']:.0f} ms "
              f"({r['hb_wire_count']:,} acks); each ack then waited unread for the generator's loop p50 "
              f"{r['ack_unread_p50_ms']:.1f} ms, p99 {r['ack_unread_p99_ms']:.1f} ms")  # fmt: skip
    else:
        print("  heartbeat RTT on the wire: no ack carried a kernel receive timestamp")
    served = r["server_ms"]
    hb = served.get("heartbeat")
    if hb is not None:
        print(f"    of which in the server, from reading the frame to sending the ack: p50 <= {hb[0]:g} ms, p99 <= {hb[1]:g} ms "
              f"(histogram bounds); the generator's own loop woke late p50 {r['gen_late_p50_ms']:.1f} ms, "
              f"p99 {r['gen_late_p99_ms']:.1f} ms (its acks wait as long to be read); the rest: unread in the server's "
              f"socket, and the two processes waiting for a CPU")  # fmt: skip
    if r["server_paused"]:
        print(f"    the server's mailbox was full {r['server_paused']} times (it stopped reading its socket: heartbeats wait there)")
    n = len(bursts)
    read = {k: c for k, (_, _, c) in served.items() if k != "heartbeat" and c}
    if read:
        print(f"  messages the server read per burst (all but heartbeats, over {n} bursts): {sum(read.values()) / n:,.0f}: "
              + ", ".join(f"{k} {c / n:,.0f}" for k, c in sorted(read.items(), key=lambda kv: -kv[1])))  # fmt: skip
    kinds = [k for k in ("update", "progress", "complete") if k in served]
    if kinds:
        print("    server, read -> replies sent (p50 / p99 bounds, count): " + ", ".join(
            f"{k} {served[k][0]:g} / {served[k][1]:g} ms ({served[k][2]:,})" for k in kinds))  # fmt: skip
    print(f"  burst (worst of {len(bursts)}): {worst['requests']:,} requests, {worst['grants']:,} grants; from the publish: "
          f"last request {worst['last_request_s']:.2f} s, last first grant {worst['last_first_grant_s']:.2f} s, "
          f"last grant {worst['last_grant_s']:.2f} s, "
          f"last completion {worst['last_complete_s']:.2f} s (pull {worst['last_complete_s'] - worst['last_grant_s']:.1f} s emulated)")  # fmt: skip
    print(f"  each shard's update -> its grant: p50 {worst['wait_p50_s'] * 1000:.0f} ms, p99 {worst['wait_p99_s'] * 1000:.0f} ms")
    print(f"  each shard's first grant, the last of them, after the last request: worst {max(b['grant_after_request_s'] for b in bursts):.3f} s; "
          f"updates answered {sum(b['answered'] for b in bursts):,}, failed {sum(b['failed'] for b in bursts)}, "
          f"timed out {sum(b['timed_out'] for b in bursts)}; crashed {sum(b['crashed'] for b in bursts)} replicas, {sum(b['rejoined'] for b in bursts)} came back")  # fmt: skip
    print(f"  false removals {r['false_removals']}" + (f" (e.g. {r['false_examples'][0]})" if r["false_examples"] else ""))
    if r["counts"]:
        print("  events: " + ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())))
    v = verdict(r)
    print("  goals: " + "; ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in v.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1024,4096,8192", help="comma-separated session counts")
    ap.add_argument("--quick", action="store_true", help="256 sessions, 2 short bursts (a smoke run)")
    ap.add_argument("--backup", choices=("both", "no", "only"), default="both")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--procs", type=int, default=4, help="load generator processes")
    ap.add_argument("--pull", type=float, default=2.0, help="emulated seconds each pull takes")
    ap.add_argument("--progress", choices=("engine", "eager"), default="engine",
                    help="readers report progress as the engine does, or as it did before its quiet first interval")
    ap.add_argument("--churn", type=float, default=0.02, help="fraction of rollout replicas crashing per burst")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between bursts")
    ap.add_argument("--timeout", type=float, default=60.0, help="each update's timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path, default=None, help="write a cProfile of the server per run here")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--gc", default="paced",
                    help="the server's collector, comma-separated to run each in turn: paced (the default), watched (CPython's as it is)")
    ap.add_argument("--nice", type=int, default=5, help="the load generator runs this much nicer than the server (0: as nice)")
    args = ap.parse_args(argv)
    gc_modes = args.gc.split(",")
    if not gc_modes or any(g not in ("paced", "watched") for g in gc_modes):
        ap.error(f"--gc: paced and/or watched, got {args.gc!r}")
    if not 0 <= args.nice <= 19:
        ap.error(f"--nice: 0 to 19, got {args.nice}")
    if args.quick:
        args.sessions, args.versions, args.procs, args.pull, args.warmup, args.gap = "256", 2, 2, 1.0, 1.0, 0.5
    counts = [int(x) for x in args.sessions.split(",")]
    if any(n < 2 * SHARDS for n in counts):
        raise SystemExit(f"--sessions: at least {2 * SHARDS} (a trainer and one rollout of {SHARDS} shards)")
    modes = {"both": (False, True), "no": (False,), "only": (True,)}[args.backup]
    sched = progress_schedule(layout().total_bytes, args.pull, args.progress == "eager")
    print(f"server load: real server process(es) on 127.0.0.1, {os.cpu_count()} CPUs here (shared); heartbeat interval 1 s; "
          f"{args.versions} bursts, pull {args.pull:g} s emulated ({len(sched)} progress reports each, as the "
          f"{'engine did before its quiet first interval' if args.progress == 'eager' else 'engine sends them'}), "
          f"churn {args.churn:.0%} per burst")  # fmt: skip
    results = []
    for n in counts:
        for backup in modes:
            for gc_mode in gc_modes:  # in turn, one right after the other: the same machine's load
                r = run_once(n, backup, args, f"s{n}{'-backup' if backup else ''}-{gc_mode}", gc_mode)
                report(r)
                results.append(r)
    if args.json:
        write_json(args.json, results, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
