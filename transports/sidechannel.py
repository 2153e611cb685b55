"""The side channel: small msgpack requests from readers to a holder's transport, over ZeroMQ.

Theory of operation
-------------------
One-sided transports still need a word with the holder now and then: ``nixl`` and ``local``
ask it once per pull to *describe* a ``(region, version)`` (where its regions and progress
words are, plus the memory keys a NIC needs); ``rdma_copy`` asks it to *stage* a slice into a
registered staging slot and to *release* the slot after the bulk READ. None of it carries bulk
bytes.

:class:`SideServer` is the holder's half: a ZeroMQ ROUTER bound to ``host:port`` (port 0: any
free port; ``host`` and the ``advertise``d address as :func:`tensorhub.transports.nic.choose_address`
says for the transports that cross hosts) and one thread that owns it. Each request is one frame, a msgpack map
``{"op": str, "id": int, ...fields}``; the thread decodes it (size-limited, no extension types,
never pickle), finds the handler for ``op`` and runs it either inline (cheap lookups) or on a
small worker pool (handlers that wait, such as staging behind a partial holder's progress).
The server adds ``"_from"``: the peer's address as ZeroMQ saw it (for the holder's log of a
refused request; whatever the peer sent under that name is replaced). The
reply ``{"id": ..., "ok": True, ...result}`` or ``{"id": ..., "ok": False, "code": ..., "error":
...}`` goes back through the owning thread (workers hand replies over an inproc PUSH/PULL pair,
because ZeroMQ sockets belong to one thread). A handler signals a refusal with
:class:`SideError`; anything else it raises is answered as ``internal``.

:class:`SideClient` is the reader's half: one DEALER per (thread, holder address), created on
first use and kept, so a request costs one round trip. A call waits in slices (so that a closed
client notices), up to its timeout; replies to earlier calls that timed out are recognised by
their id and dropped. A call to an address that never accepted the connection (refused, or
nothing answered within the timeout) raises :class:`~tensorhub.transports.base.PeerUnreachable`
naming the address and the setting that chooses it on the holder.

Grant tokens are the handlers' business: a request that needs one carries it as the field
``token`` (bytes), and the handler asks ``Transport.admit`` before it looks anything up.

What it must never do: unpickle or eval anything from the socket, block the holder's ROUTER
thread on a slow handler, or wait without a bound.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import zmq
import zmq.utils.monitor

from tensorhub.core.errors import TransportError

from .base import UNREACHABLE_HINT, PeerUnreachable

__all__ = ["SideClient", "SideError", "SideServer", "decode", "encode"]

MAX_REQUEST = 64 << 10  #: a request is a handful of integers and names
MAX_REPLY = 16 << 20  #: a describe reply carries memory keys of every region of a shard
_SLICE_MS = 50
MAX_PEERS_PER_THREAD = 64  #: sockets a thread keeps open (least recently used closed first)

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideError(Exception):
    """A handler's refusal: ``code`` (a short word the reader maps to an error) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def encode(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def decode(frame: bytes, limit: int) -> dict[str, Any]:
    """A msgpack map from ``frame``, or :class:`SideError` ``malformed`` saying why not."""
    if len(frame) > limit:
        raise SideError("malformed", f"message of {len(frame)} bytes, over the limit of {limit}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except Exception as err:  # noqa: BLE001 - any decoding failure is the sender's
        raise SideError("malformed", f"not msgpack: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict):
        raise SideError("malformed", f"expected a map, got {type(obj).__name__}")
    return obj


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], minimum: int | None = None) -> Any:
    """``msg[name]`` checked to be of ``kind`` (bool is never an int) and >= ``minimum``."""
    value = msg.get(name)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) not in kinds or (minimum is not None and value is not None and value < minimum):
        want = " or ".join(k.__name__ for k in kinds) + (f" >= {minimum}" if minimum is not None else "")
        raise SideError("malformed", f"field {name!r} must be {want}, got {value!r}")
    return value


class SideServer:
    """The holder's side channel. ``handlers`` maps an op name to ``(handler, inline)``.

    Args:
        name: for thread names and errors.
        handlers: what each op does; a handler takes the request map and returns the reply's
            fields, or raises :class:`SideError`.
        host: the interface to bind (an address peers can reach, or ``0.0.0.0``).
        port: the port (0: any free one).
        workers: threads for handlers that are not inline.
        advertise: the address peers dial (default ``host``): :attr:`address` names it.
    """

    def __init__(
        self, name: str, handlers: dict[str, tuple[Handler, bool]], host: str, port: int = 0, workers: int = 4,
        advertise: str | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.handlers = handlers
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as err:
            self._ctx.destroy(linger=0)
            raise TransportError(f"{name}: cannot bind the side channel on {host}:{port}: {err}") from err
        self.address = f"tcp://{advertise or host}:{port}"
        self._inproc = f"inproc://{name}-replies-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._pushers = threading.local()
        self._push_lock = threading.Lock()
        self._pushes: list[zmq.Socket] = []
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-side")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-router", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering (requests in flight get no reply; their callers time out or see the
        close of the holder by other means). A second call does nothing."""
        if self._closed.is_set():
            return
        self._closed.set()
        if threading.current_thread().name.startswith(f"{self.name}-side"):
            # A handler closes its own server (a holder closing while it serves): it cannot wait
            # for itself; the rest of the close runs beside it.
            threading.Thread(target=self._finish_close, name=f"{self.name}-closing", daemon=True).start()
            return
        self._finish_close()

    def _finish_close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._thread.join(timeout=5.0)
        with self._push_lock:
            for s in self._pushes:
                s.close(linger=0)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            ready = dict(poller.poll(_SLICE_MS))
            if self._pull in ready:
                for _ in range(1024):
                    try:
                        ident, reply = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._send(ident, reply)
            if self._router in ready:
                for _ in range(1024):
                    try:
                        parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        peer = parts[-1].get("Peer-Address")
                    except (zmq.ZMQError, AttributeError):
                        peer = ""
                    self._dispatch([p.bytes for p in parts], f"from {peer}" if peer else "")
        self._router.close(linger=0)
        self._pull.close(linger=0)

    def _send(self, ident: bytes, reply: bytes) -> None:
        try:
            self._router.send_multipart([ident, reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer went away; it will time out or has closed

    def _dispatch(self, frames: list[bytes], who: str = "") -> None:
        if len(frames) != 2:
            return  # not a DEALER of ours: nothing to answer to
        ident, frame = frames
        try:
            msg = decode(frame, MAX_REQUEST)
        except SideError as err:
            self._send(ident, encode({"id": None, "ok": False, "code": err.code, "error": str(err)}))
            return
        msg["_from"] = who
        rid = msg.get("id")
        op = msg.get("op")
        entry = self.handlers.get(op) if isinstance(op, str) else None
        if type(rid) is not int or entry is None:
            why = f"unknown op {op!r}; known: {sorted(self.handlers)}" if type(rid) is int else "the request has no integer id"
            self._send(ident, encode({"id": rid if type(rid) is int else None, "ok": False, "code": "malformed", "error": why}))
            return
        handler, inline = entry
        if inline:
            self._send(ident, self._answer(handler, msg, rid))
            return
        try:
            self._pool.submit(self._worker, handler, msg, rid, ident)
        except RuntimeError:
            pass  # closing

    def _answer(self, handler: Handler, msg: dict[str, Any], rid: int) -> bytes:
        try:
            result = handler(msg)
            return encode({**result, "id": rid, "ok": True})
        except SideError as err:
            return encode({"id": rid, "ok": False, "code": err.code, "error": str(err)})
        except Exception as err:  # noqa: BLE001 - a handler's bug is this request's error, not the server's death
            return encode({"id": rid, "ok": False, "code": "internal", "error": f"{type(err).__name__}: {err}"})

    def _worker(self, handler: Handler, msg: dict[str, Any], rid: int, ident: bytes) -> None:
        reply = self._answer(handler, msg, rid)
        push = getattr(self._pushers, "sock", None)
        if push is None:
            with self._push_lock:
                if self._closed.is_set():
                    return
                push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(self._inproc)
                self._pushes.append(push)
            self._pushers.sock = push
        try:
            push.send_multipart([ident, reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # closing (the router thread stopped taking replies)


class SideClient:
    """The reader's side channel: ``call(address, op, fields, timeout)`` from any thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ctx: zmq.Context | None = None  # made with the first socket: an unused client owns nothing
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: list[zmq.Socket] = []
        self._monitors: dict[int, zmq.Socket] = {}
        self._connected: set[int] = set()  # sockets whose connection was made once
        self._ids = itertools.count(1)
        self._closed = False

    def call(self, address: str, op: str, fields: dict[str, Any], timeout: float, closed: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send a request and return the reply's fields.

        Raises:
            SideError: the holder refused (its code and message), or the reply was malformed.
            PeerUnreachable: the connection to ``address`` was refused or not made in time.
            TransportError: no reply within ``timeout``, or this client (or ``closed()``) closed.
        """
        sock = self._socket(address)
        rid = next(self._ids)
        try:
            sock.send(encode({**fields, "op": op, "id": rid}), zmq.NOBLOCK)
        except zmq.ZMQError as err:
            self._drop(address)
            raise TransportError(f"{self.name}: side channel to {address} refused {op!r}: {err}") from err
        deadline = time.monotonic() + timeout
        monitor = self._monitors[id(sock)]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        for _ in range(1 << 30):  # bounded by the deadline
            if self._closed or (closed is not None and closed()):
                raise TransportError(f"{self.name}: closed while waiting for {op!r} from {address}")
            left = deadline - time.monotonic()
            if left <= 0:
                never = id(sock) not in self._connected
                self._drop(address)  # a late reply must not be taken for the next call's
                if never:
                    raise PeerUnreachable(f"{self.name}: cannot connect to the side channel at {address} within "
                                          f"{timeout:g} s ({op!r}); {UNREACHABLE_HINT}")  # fmt: skip
                raise TransportError(f"{self.name}: no reply to {op!r} from {address} within {timeout:g} s")
            ready = dict(poller.poll(min(_SLICE_MS, max(1, int(left * 1000)))))
            if monitor in ready and self._lost(monitor, sock):
                never = id(sock) not in self._connected
                self._drop(address)
                if never:
                    raise PeerUnreachable(f"{self.name}: cannot connect to the side channel at {address} (refused or "
                                          f"unreachable; {op!r}); {UNREACHABLE_HINT}")  # fmt: skip
                raise TransportError(f"{self.name}: the holder at {address} went away while answering {op!r}")
            if sock not in ready:
                continue
            reply = decode(sock.recv(), MAX_REPLY)
            if reply.get("id") is not None and reply.get("id") != rid:
                continue  # the answer to an earlier call that gave up
            # (id nil: the holder could not read the request at all; that is this call's answer)
            if reply.get("ok") is True:
                return reply
            code, error = reply.get("code"), reply.get("error")
            raise SideError(code if isinstance(code, str) else "malformed", str(error)[:2000])
        raise AssertionError("unreachable")  # pragma: no cover

    def notify(self, address: str, op: str, fields: dict[str, Any]) -> None:
        """Send a request without waiting for its reply (a later call drops the reply)."""
        try:
            self._socket(address).send(encode({**fields, "op": op, "id": next(self._ids)}), zmq.NOBLOCK)
        except zmq.ZMQError:
            self._drop(address)

    def _lost(self, monitor: zmq.Socket, sock: zmq.Socket) -> bool:
        """Whether the monitor reports the connection dropped (the holder closed or died) or
        could not be made (nothing listens there: with reconnection off, the socket closes).
        Notes a connection made (see ``_connected``)."""
        lost = False
        for _ in range(64):
            try:
                event = zmq.utils.monitor.recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return lost
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected.add(id(sock))
            lost = lost or event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED)
        return lost

    def _socket(self, address: str) -> zmq.Socket:
        if self._closed:
            raise TransportError(f"{self.name}: the side channel client is closed")
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.pop(address, None)
        if sock is not None:
            socks[address] = sock  # most recently used last
        else:
            while len(socks) >= MAX_PEERS_PER_THREAD:  # a long job meets many holders: bound the sockets
                self._drop(next(iter(socks)))
            with self._lock:
                if self._closed:
                    raise TransportError(f"{self.name}: the side channel client is closed")
                if self._ctx is None:
                    self._ctx = zmq.Context()
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
                # A holder that goes away must fail the call now, not at its timeout: watch
                # for the connection dropping, and do not reconnect behind our back.
                sock.setsockopt(zmq.RECONNECT_IVL, -1)
                self._monitors[id(sock)] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECTED)
                sock.connect(address)
                self._sockets.append(sock)
            socks[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        socks = getattr(self._local, "socks", {})
        sock = socks.pop(address, None)
        if sock is not None:
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
                monitor = self._monitors.pop(id(sock), None)
                self._connected.discard(id(sock))
            try:
                sock.disable_monitor()
                if monitor is not None:
                    monitor.close(linger=0)
                sock.close(linger=0)
            except zmq.ZMQError:
                pass  # the client closed (its context is gone with the sockets)

    def close(self) -> None:
        """Close every socket. Call it after the threads that use the client have stopped (or
        are about to notice ``closed``): a call in flight fails with :class:`TransportError`."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)

