"""``tcp``: raw TCP sockets, for hosts without RDMA and for cross-datacenter links.

Two-sided. The holder's engine runs a listener; each connection is served by one thread that
answers read requests straight from the registered memory (``sendall`` on views of the tensors:
no copy on the holder for CPU memory). The reader keeps a small pool of connections per peer
and runs several reads of one pull at once, one per connection, each receiving straight into
the destination tensors (``recv_into``). CUDA memory goes through two pinned staging buffers
per thread, in pieces of at most ``staging_bytes``, the device copy of one piece overlapped with
the socket moving the other (:class:`~tensorhub.transports.buffers.Staging`).

Wire format of one read (all integers big-endian)::

    request  = magic:u32 region:u64 version:u64 offset:u64 length:u64 generation:u64 wait_ms:u32
               token_len:u16 [token_len bytes: the grant token]
    response = status:u8 generation:u64 length:u64  [length bytes]  trailer
    trailer  = status:u8 generation:u64              (only after the bytes)

**Grant tokens** (``checks_grants``). Every request carries the reader's grant token (61 bytes,
:mod:`tensorhub.core.tokens`), so authentication costs no round trip: the holder checks it
(:meth:`~tensorhub.transports.base.Transport.admit`: an HMAC-SHA256 the first time a pull shows
its token, a lookup after that; about a microsecond against milliseconds of payload) before it
resolves the region. A request that is
refused gets ``UNAUTHORIZED`` with no payload, and the connection is closed. The bytes
themselves are not encrypted: run the data network on a trusted fabric or under IPsec/WireGuard
where that matters (see the README's "Security").

**Addresses.** The listener binds and advertises what
:func:`tensorhub.transports.nic.choose_address` says: the ``host``/``advertise`` options, else
``$TENSORHUB_ADVERTISE_HOST``, else loopback when the server is on loopback (a one-host job),
else the address of the interface that routes to the server. A reader that cannot connect
raises :class:`~tensorhub.transports.base.PeerUnreachable` naming the address and that setting.

Throughput choices
------------------
- **Read size.** The engine asks for whole checksum units grouped into reads of about
  ``max(engine chunk, layout chunk)`` (8 MiB by default; ``$TENSORHUB_CHUNK_BYTES``). One read
  costs one request/response round trip (tens of microseconds on a LAN) against milliseconds of
  payload, so the per-read overhead stays under 1 %; reads stay small enough that a partial
  holder can serve each one as soon as it is verified (pipeline replication) and that the
  streams of a pull stay busy to the last byte.
- **Streams.** One read is split into up to ``streams`` stripes of at least 1 MiB (default 4),
  and into more where a stripe would exceed ``MAX_READ`` (256 MiB: what one request may ask;
  reads into GPU memory are 1 GiB), each on its own connection and thread: one TCP stream rarely fills a fast link alone (window
  growth, one core's copy rate). Striping one read, rather than running ``streams`` reads at
  once, makes each read land at the link's full rate, in order: a partial holder downstream
  can serve it that much sooner (concurrent reads share the link and land together, so a
  pipeline hop would lag by all of them). The engine keeps ``reads_in_flight`` (2) reads of a
  pull going, so the next read's round trip hides behind the current one. Stripes never share
  a connection, so a slow one never blocks another.
- **No intermediate copies.** The holder ``sendall``s views of its registered memory; the
  reader ``recv_into``s straight into the destination. Tiny tensors arrive in their pack (one
  contiguous buffer per read instead of hundreds of small receives) and are unpacked by the
  engine after the pull, unless the reader keeps its packs in place (its transports all gather,
  as this one does: ``Transport.gathers``); then each tiny tensor is received into directly, one
  ``recv_into`` per tensor, and the holder sends from its tiny tensors just as directly. Only
  CUDA memory is staged, once on each side, through a pinned buffer.
- **Verification** is not the transport's: the engine hashes each read in a worker thread as
  it lands, overlapped with the next reads.

**Aborting reads** (:meth:`TcpTransport.abort_reads`). Each read (each stripe) is registered,
under the transport's lock, from the moment ``read_range`` is called until its thread has
written its last byte. Aborting a shard's reads marks them and shuts down the connection each
one is on (under the same lock, so a connection is never shut down after its read let it go):
the blocked receive returns at once, the read raises :class:`TransportError`, and its
connection is closed, never pooled. A read aborted before it connected (queued, or waiting for
``max_rate``) fails without connecting and gives back the rate it had reserved.

``generation`` 0 in a request means "whatever it is now". The holder waits up to ``wait_ms``
for its progress to cover the range (a partial holder), then answers ``NOT_READY``. The trailer
says whether the generation moved while the bytes were sent; if it did the reader discards them.
Nothing on this wire is ever unpickled or executed; every field is range-checked.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tensorhub.core.errors import InvalidArgument, TransportError
from tensorhub.core.log import get_logger

from .base import UNREACHABLE_HINT, PeerUnreachable, Probe, RangeNotReady, ReadCall, Transport, Unauthorized
from .buffers import ShardBuffers, Staging
from .nic import choose_address

__all__ = ["RangeNotReady", "TcpTransport"]

_MAGIC = 0x54485232  # "THR2": requests carry a grant token
_REQ = struct.Struct("!IQQQQQIH")
_RESP = struct.Struct("!BQQ")
_TRAILER = struct.Struct("!BQ")
MAX_TOKEN = 1024  # a request's token is at most this long

OK, NO_HOLDING, BAD_RANGE, NOT_READY, CHANGED, BAD_REQUEST, UNAUTHORIZED = range(7)
_STATUS_TEXT = {
    NO_HOLDING: "the peer does not hold that version under that region",
    BAD_RANGE: "the range is outside the shard",
    NOT_READY: "the peer's progress did not cover the range in time",
    CHANGED: "the peer's holding changed during the read",
    BAD_REQUEST: "the peer refused a malformed request",
    UNAUTHORIZED: "the peer refused the request: no valid grant token for that version of that region "
    "(missing, made for another holder or version, or expired)",
}
MAX_READ = 256 << 20  # one request moves at most this many bytes
_MIN_STRIPE = 1 << 20  # a read is striped over connections in pieces of at least this


class _Read:
    """One read (one stripe) running into a shard's buffers, as :meth:`TcpTransport.abort_reads`
    finds it. Its fields change only under the transport's lock."""

    __slots__ = ("aborted", "into", "sock", "started", "wake")

    def __init__(self, into: ShardBuffers) -> None:
        self.into = into
        self.sock: socket.socket | None = None  # the connection it is on, while it has one
        self.started = False  # its thread took it up
        self.aborted = False
        self.wake = threading.Event()  # ends its wait for ``max_rate`` when it is aborted


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None on a clean EOF before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


class TcpTransport(Transport):
    """Raw-socket transport. Options: ``host`` (address to listen on; default: by
    :func:`~tensorhub.transports.nic.choose_address`), ``port`` (0: any), ``advertise`` (address
    peers should dial, default ``host``, else by the same rule),
    ``streams`` (connections one read is striped over, default 4), ``io_timeout`` (seconds, default 30),
    ``wait_timeout`` (how long a holder waits for its progress to cover a range, default 5),
    ``staging_bytes`` (CUDA staging piece, default 8 MiB), ``max_connections`` (default 512),
    ``idle_timeout`` (a holder closes a connection silent this long, default 300 s),
    ``max_rate`` (bytes per second this process reads at most, all reads together; default
    unlimited: a cap keeps a cross-datacenter pull from filling a shared link)."""

    name = "tcp"
    one_sided = False
    cuda = False
    cross_host = True
    gathers = True
    checks_grants = True

    @classmethod
    def probe(cls) -> Probe:
        """Always usable, and the fallback of every edge."""
        return Probe(True, True, "raw sockets; serves every edge no faster transport serves",
                     (("address", "host/advertise options, else $TENSORHUB_ADVERTISE_HOST, else loopback for a server on "
                       "loopback, else the interface that routes to the server"),))  # fmt: skip

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.host: str | None = o.get("host") or None  # None: chosen at start()
        self.port = int(o.get("port", 0))
        self.advertise: str | None = o.get("advertise") or None
        self.address_rule = ""
        self.streams = int(o.get("streams", 4))
        self.reads_in_flight = 2  # reads of one pull the engine keeps going (each striped)
        self.io_timeout = float(o.get("io_timeout", 30.0))
        self.wait_timeout = float(o.get("wait_timeout", 5.0))
        self.staging_bytes = int(o.get("staging_bytes", 8 << 20))
        self.max_connections = int(o.get("max_connections", 512))
        self.idle_timeout = float(o.get("idle_timeout", 300.0))
        self.max_rate = float(o["max_rate"]) if o.get("max_rate") else None
        self._rate_next = 0.0  # when the rate limit lets the next read start (monotonic)
        if (self.streams < 1 or self.io_timeout <= 0 or self.wait_timeout < 0 or self.staging_bytes < 4096
                or (self.max_rate is not None and self.max_rate <= 0)):
            raise InvalidArgument(f"bad tcp transport options: {o!r}")
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._served: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._pool: dict[tuple[str, int], list[socket.socket]] = {}
        self._in_use: set[socket.socket] = set()  # reader connections with a read running
        self._reads: set[_Read] = set()  # reads registered and not finished (see abort_reads)
        self._executor = ThreadPoolExecutor(max_workers=max(8, 4 * self.streams), thread_name_prefix="tcp-read")
        self._staging = Staging()
        self._closed = False

    # ---- holder side ---------------------------------------------------------------------------

    async def start(self) -> None:
        where = choose_address(self.host, self.advertise, self.servers)
        self.host, self.advertise, self.address_rule = where.bind, where.advertise, where.rule
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lst.bind((self.host, self.port))
        except OSError as err:
            lst.close()
            raise TransportError(f"tcp transport cannot listen on {self.host}:{self.port} ({where.rule}): {err}") from err
        lst.listen(128)
        self._listener = lst
        self.port = lst.getsockname()[1]
        self._accepting = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self.port}", daemon=True)
        self._accepting.start()
        get_logger(transport=self.name).info("tcp transport listening", bind=f"{self.host}:{self.port}",
                                             advertise=self.advertise, rule=where.rule)  # fmt: skip

    def endpoint(self) -> dict[str, Any]:
        return {"host": self.advertise, "port": self.port}

    def _accept_loop(self) -> None:
        lst = self._listener
        assert lst is not None
        while not self._closed:
            try:
                conn, addr = lst.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._served) >= self.max_connections:
                    conn.close()
                    continue
                self._served.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            who = f"from {addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else ""
            threading.Thread(target=self._serve_conn, args=(conn, who), name="tcp-serve", daemon=True).start()

    def _serve_conn(self, conn: socket.socket, who: str = "") -> None:
        try:
            # An idle pooled connection may wait long for its next request; not forever.
            conn.settimeout(self.idle_timeout)
            while not self._closed:
                hdr = _recv_exact(conn, _REQ.size)
                if hdr is None:
                    return
                magic, region, version, offset, length, generation, wait_ms, token_len = _REQ.unpack(hdr)
                if magic != _MAGIC or length > MAX_READ or token_len > MAX_TOKEN:
                    conn.sendall(_RESP.pack(BAD_REQUEST, 0, 0))
                    return  # the stream is not ours to parse any further
                token = _recv_exact(conn, token_len) if token_len else None
                if token_len and token is None:
                    return
                if self.admit(region, version, token, who) is not None:
                    # Nothing of the region is served, not even whether it exists; the
                    # connection goes (a prober pays a connection per try).
                    conn.sendall(_RESP.pack(UNAUTHORIZED, 0, 0))
                    return
                self._serve_one(conn, region, version, offset, length, generation, wait_ms)
        except OSError:
            return  # the reader went away; nothing of ours is left inconsistent
        finally:
            with self._lock:
                self._served.discard(conn)
            conn.close()

    def _serve_one(
        self, conn: socket.socket, region: int, version: int, offset: int, length: int, generation: int, wait_ms: int
    ) -> None:
        buffers = self.resolve(region, version)
        if buffers is None:
            conn.sendall(_RESP.pack(NO_HOLDING, 0, 0))
            return
        if offset + length > buffers.total_bytes:
            conn.sendall(_RESP.pack(BAD_RANGE, 0, 0))
            return
        wait = min(wait_ms / 1000.0, self.wait_timeout)
        g0, v0, _ = buffers.progress.snapshot()
        gen, covered = buffers.progress.wait_covered(version, offset + length, generation or None, wait)
        if not covered:
            g, v, _ = buffers.progress.snapshot()
            # Changed: not the generation the reader began with, or it held the version and
            # stopped. Otherwise not ready: a partial holder behind, or one not yet started.
            changed = bool(generation and g != generation) or (g != g0 and (v0 == version or v == version))
            conn.sendall(_RESP.pack(CHANGED if changed else NOT_READY, g, 0))
            return
        conn.sendall(_RESP.pack(OK, gen, length))
        if buffers.on_cuda:
            self._staging.out_of(buffers, offset, length, self.staging_bytes, conn.sendall)
        else:
            for view in buffers.views(offset, length):
                conn.sendall(view)
        after, v, _ = buffers.progress.snapshot()
        conn.sendall(_TRAILER.pack(OK if after == gen and v == version else CHANGED, after))

    # ---- reader side -------------------------------------------------------------------------

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        host, port = (peer.get("host"), peer.get("port")) if isinstance(peer, dict) else (None, None)
        return f"tcp peer {host}:{port} region {region} version {version} bytes [{offset}, {offset + length})"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> tuple[str, int]:
        try:
            key = (str(peer["host"]), int(peer["port"]))
        except (KeyError, TypeError, ValueError) as err:
            raise TransportError(f"tcp endpoint {peer!r} has no host and port") from err
        if token is not None and len(token) > MAX_TOKEN:
            raise InvalidArgument(f"a grant token is bytes of at most {MAX_TOKEN}, got {len(token)}")
        return key

    async def read_range(self, call: ReadCall) -> int:
        """Copy ``[offset, offset + length)`` of ``version`` from the peer into ``into``, showing
        the grant's token with every request, in up to ``streams`` stripes on pooled connections.
        Returns the holder's generation.

        Raises:
            RangeNotReady: the holder's progress did not cover the range in time.
            Unauthorized: the holder refused the token.
            PeerUnreachable: the peer's address could not be connected to.
            TransportError: anything else that kept the read from completing.
        """
        key, region, version, offset, length = call.peer, call.region, call.version, call.offset, call.length
        into, generation, token = call.into, call.generation, call.token
        loop = asyncio.get_running_loop()
        k = max(1, min(self.streams, length // _MIN_STRIPE), -(-length // MAX_READ))  # a request moves <= MAX_READ
        parts = [(offset, length)]
        if k > 1:
            step = -(-length // k)
            parts = [(o, min(step, offset + length - o)) for o in range(offset, offset + length, step)]
        reads = [_Read(into) for _ in parts]
        with self._lock:  # from now on abort_reads sees them, queued or running
            self._reads.update(reads)
        try:
            futs = []
            for (o, n), r in zip(parts, reads):
                try:
                    futs.append(loop.run_in_executor(self._executor, self._read_blocking, key, region, version, o, n,
                                                     into, generation, token, r))  # fmt: skip
                except RuntimeError as err:  # the pool shut down: closed meanwhile
                    if futs:  # the stripes already running fail with the close; wait them out
                        await asyncio.gather(*futs, return_exceptions=True)
                    raise TransportError(f"tcp transport closed; read of {call.where} not started") from err
            if k == 1:
                return await futs[0]
            results = await asyncio.gather(*futs, return_exceptions=True)
        finally:
            # A read whose thread never took it up (cancelled, or the pool shut down) never will:
            # it fails at once if it does. Running ones unregister themselves when they end.
            with self._lock:
                for r in reads:
                    if not r.started:
                        r.aborted = True
                        self._reads.discard(r)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # every stripe has returned: nothing still writes into ``into``
            hard = [e for e in errors if not isinstance(e, RangeNotReady)]
            raise (hard or errors)[0]
        generations = [r for r in results if not isinstance(r, BaseException)]  # all of them: none failed
        if len(set(generations)) != 1:
            raise TransportError(
                f"read of {key[0]}:{key[1]} region {region} version {version} bytes [{offset}, {offset + length}): "
                f"the holder's generation changed between stripes ({sorted(set(generations))})"
            )
        return generations[0]

    def abort_reads(self, into: ShardBuffers) -> int:
        """End every read of this process running into ``into`` now (see the module docstring):
        each fails with :class:`TransportError`, writes nothing more once it returned, and its
        connection is closed, never pooled. Reads that end meanwhile on their own are not counted.
        Never blocks on the network; safe from any thread.

        Returns:
            How many reads it ended (stripes count one each).
        """
        with self._lock:
            ended = [r for r in self._reads if r.into is into]
            for r in ended:
                r.aborted = True
                r.wake.set()
                self._reads.discard(r)
                if r.sock is not None:
                    # Under the lock: the read's thread takes ``sock`` off ``r`` under it before
                    # it closes or pools the connection, so this never touches a reused one.
                    try:
                        r.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        if ended:
            get_logger(transport=self.name).debug("tcp reads aborted", reads=len(ended))
        return len(ended)

    def _connect(self, key: tuple[str, int], read: _Read, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection to ``key`` for ``read`` (pooled if one is idle, unless ``fresh``), and
        whether it was pooled. It is counted as in use, and is ``read.sock``, until released or
        discarded.

        Raises:
            TransportError: ``read`` was aborted (no connection is taken up for it then).
            OSError: connecting failed.
        """
        with self._lock:
            if read.aborted:
                raise TransportError("aborted before it connected")
            idle = self._pool.get(key)
            if idle and not fresh:
                sock = idle.pop()
                self._in_use.add(sock)
                read.sock = sock
                return sock, True
        sock = socket.create_connection(key, timeout=self.io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if not read.aborted:
                self._in_use.add(sock)
                read.sock = sock
                return sock, False
        sock.close()  # aborted while it connected: never used
        raise TransportError("aborted while it connected")

    def _release(self, key: tuple[str, int], sock: socket.socket, read: _Read) -> bool:
        """``read`` is done with ``sock``: pool it, unless the read was aborted (abort_reads shut
        it down then: it is closed). Returns whether the read was aborted."""
        with self._lock:
            read.sock = None
            self._in_use.discard(sock)
            aborted = read.aborted
            if not aborted and not self._closed:
                self._pool.setdefault(key, []).append(sock)
                return False
        sock.close()
        return aborted

    def _discard(self, sock: socket.socket, read: _Read) -> None:
        with self._lock:
            read.sock = None
            self._in_use.discard(sock)
        sock.close()

    def _read_blocking(
        self,
        key: tuple[str, int],
        region: int,
        version: int,
        offset: int,
        length: int,
        into: ShardBuffers,
        generation: int | None,
        token: bytes | None,
        read: _Read,
    ) -> int:
        where = f"{key[0]}:{key[1]} region {region} version {version} bytes [{offset}, {offset + length})"
        aborted = f"read of {where} aborted (abort_reads: the grant it read under ended)"
        with self._lock:
            read.started = True
            if read.aborted:
                raise TransportError(f"{aborted}; not started")
        try:
            return self._read_one(key, region, version, offset, length, into, generation, token, read, where, aborted)
        finally:
            with self._lock:  # its last byte is written: abort_reads has nothing to end any more
                self._reads.discard(read)

    def _read_one(
        self,
        key: tuple[str, int],
        region: int,
        version: int,
        offset: int,
        length: int,
        into: ShardBuffers,
        generation: int | None,
        token: bytes | None,
        read: _Read,
        where: str,
        aborted: str,
    ) -> int:
        if self._closed:
            raise TransportError(f"tcp transport closed; read of {where} not started")
        if self.max_rate is not None:
            with self._lock:  # reserve this read's share of the rate; it ends no sooner
                now = time.monotonic()
                end = max(now, self._rate_next) + length / self.max_rate
                self._rate_next = end
            if read.wake.wait(min(end - now, 3600.0)):
                with self._lock:  # aborted before it moved a byte: give its share back
                    self._rate_next = max(time.monotonic(), self._rate_next - length / self.max_rate)
                raise TransportError(f"{aborted} while it waited for max_rate")
        request = _REQ.pack(_MAGIC, region, version, offset, length, generation or 0, int(self.wait_timeout * 1000),
                            len(token or b"")) + (token or b"")  # fmt: skip
        sock: socket.socket | None = None
        try:
            for attempt in range(2):
                try:
                    sock, pooled = self._connect(key, read, fresh=attempt > 0)
                except TransportError as err:
                    raise TransportError(f"{aborted}: {err}") from None
                except OSError as err:
                    raise PeerUnreachable(f"cannot connect to {key[0]}:{key[1]} for the read of {where} ({err}); "
                                          f"{UNREACHABLE_HINT}") from err  # fmt: skip
                try:
                    sock.sendall(request)
                    hdr = _recv_exact(sock, _RESP.size)
                except OSError:
                    hdr = None
                if hdr is not None:
                    break
                self._discard(sock, read)
                sock = None
                if not pooled:
                    raise ConnectionError("peer closed the connection")
                # An idle pooled connection the holder had closed: try once on a fresh one (an
                # aborted read does not: _connect refuses it).
            else:  # pragma: no cover - the loop breaks or raises
                raise ConnectionError("peer closed the connection")
            status, gen, n = _RESP.unpack(hdr)
            if status != OK:
                if status in _STATUS_TEXT and status not in (BAD_REQUEST, UNAUTHORIZED):  # known, payload-free answers
                    s, sock = sock, None
                    if self._release(key, s, read):
                        raise TransportError(aborted)
                cls = RangeNotReady if status == NOT_READY else Unauthorized if status == UNAUTHORIZED else TransportError
                raise cls(f"read of {where}: {_STATUS_TEXT.get(status, f'unknown status {status}')}")
            if n != length:
                raise ConnectionError(f"peer announced {n} bytes")
            if into.on_cuda:
                self._staging.into(into, offset, length, self.staging_bytes, functools.partial(_recv_into, sock))
            else:
                for view in into.views(offset, length):
                    _recv_into(sock, view)
            trailer = _recv_exact(sock, _TRAILER.size)
            if trailer is None:
                raise ConnectionError("peer closed before the trailer")
            status, after = _TRAILER.unpack(trailer)
            s, sock = sock, None
            if self._release(key, s, read):
                raise TransportError(aborted)  # every byte landed, but it was aborted first: it failed
            if self._closed:
                raise TransportError(f"tcp transport closed during the read of {where}")
            if status != OK or after != gen:
                raise TransportError(f"read of {where}: {_STATUS_TEXT[CHANGED]}")
            if generation is not None and gen != generation:
                raise TransportError(f"read of {where}: holder generation {gen}, the pull began at {generation}")
            return gen
        except OSError as err:
            with self._lock:
                was_aborted = read.aborted  # its connection was shut down under it
            if was_aborted:
                raise TransportError(aborted) from err
            if self._closed:
                raise TransportError(f"tcp transport closed during the read of {where}") from err
            raise TransportError(f"read of {where} failed: {err}") from err
        finally:
            if sock is not None:
                self._discard(sock, read)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            served = list(self._served)
            pooled = [s for socks in self._pool.values() for s in socks] + list(self._in_use)
            self._pool.clear()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for s in served + pooled:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._accepting is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._accepting.join, 5.0)
        # Reads still queued start, see the transport closed, and fail with TransportError.
        self._executor.shutdown(wait=False)
