"""``memory``: an in-process transport, for tests and the simulator.

Theory of operation
-------------------
Every started :class:`MemoryTransport` is entered, under an id unique in this process, in a
module-level registry that holds it by weak reference; its endpoint is
``{"id": <that id>, "pid": <this process>}`` (plain msgpack data, like every endpoint). A reader
looks the peer up there and does, in one of its own threads, what a one-sided NIC does: the
holder's CPU takes no part beyond the resolver call that stands in for its registration table.

A read of ``[offset, offset + length)`` of ``(region, version)``:

1. finds the peer: unknown, in another process, or closed -> :class:`TransportError`;
2. resolves ``(region, version)`` through the peer's resolver; the buffers must be exposed on
   the peer (a one-sided transport reads only registered memory), and the range must lie inside
   them -> :class:`TransportError` otherwise;
3. waits, for at most the smaller of the reader's and the holder's ``wait_timeout``, until the
   holder's progress covers the range for that version. It waits in short slices, so that a
   close on either side ends the wait. Not covered in time -> :class:`RangeNotReady`; the
   generation moved, or the holder held the version and stopped -> :class:`TransportError`;
4. copies in pieces of ``piece_bytes``, checking between pieces (and after the last) that
   neither side closed and the buffers are still exposed. CPU memory is copied view to view;
   CUDA memory goes through :meth:`~tensorhub.transports.buffers.ShardBuffers.copy_out` /
   :meth:`~tensorhub.transports.buffers.ShardBuffers.copy_in` (``cuda`` is False: it stages);
5. applies the seqlock: the generation read before the copy (step 3) must equal the one read
   after it, the holder must still hold the version, and if the caller passed a generation it
   must be that one -> :class:`TransportError` otherwise.

Invariants: a read returns normally only when every byte of its range was written, from buffers
that held ``version`` under one generation with the range covered. Every error names the peer,
region, version and range.

What it must never do: block the event loop (all of a read runs in the transport's threads),
keep a peer alive (the registry is weak; a closed peer leaves it), or wait without a bound.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tensorhub.core.errors import InvalidArgument, TransportError

from .base import Probe, RangeNotReady, ReadCall, Transport
from .buffers import ShardBuffers

__all__ = ["MemoryTransport"]

_PEERS: weakref.WeakValueDictionary[str, MemoryTransport] = weakref.WeakValueDictionary()
_PEERS_LOCK = threading.Lock()
_IDS = itertools.count(1)
_WAIT_SLICE = 0.02  # seconds between looks at "did either side close?" while waiting

_OPTIONS = {
    # name: (default, minimum, integer)
    "wait_timeout": (5.0, 0.0, False),
    "piece_bytes": (1 << 20, 1, True),
    "threads": (8, 1, True),
}


def _option(options: dict[str, Any], name: str) -> Any:
    default, minimum, integer = _OPTIONS[name]
    value = options.get(name, default)
    ok = type(value) is int if integer else type(value) in (int, float)
    if not ok or not math.isfinite(value) or value < minimum:
        want = "an integer" if integer else "a finite number"
        raise InvalidArgument(f"memory transport option {name!r} must be {want} >= {minimum}, got {value!r}")
    return value


class MemoryTransport(Transport):
    """In-process transport. Options: ``wait_timeout`` (seconds a read waits for a partial
    holder's progress to cover its range, default 5), ``piece_bytes`` (bytes copied between two
    checks for a close, default 1 MiB), ``threads`` (reads running at once, default 8).

    Only buffers exposed on the holder are served (it is one-sided, like registered memory);
    they are kept until withdrawn or the transport closes. A reader needs no ``start()``.

    Raises:
        InvalidArgument: an unknown option, or a bad value.
    """

    name = "memory"
    one_sided = True
    cuda = False
    cross_host = False
    gathers = True

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, False, "started only when named: it serves only readers in its own process (tests, simulation)")

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(str(k) for k in self.options if k not in _OPTIONS)
        if unknown:
            raise InvalidArgument(f"unknown memory transport options {unknown}; known: {sorted(_OPTIONS)}")
        self.wait_timeout = float(_option(self.options, "wait_timeout"))
        self.piece_bytes = int(_option(self.options, "piece_bytes"))
        self.threads = int(_option(self.options, "threads"))
        self.id = f"memory-{os.getpid()}-{next(_IDS)}"
        self._lock = threading.Lock()
        self._exposed: dict[int, ShardBuffers] = {}
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="memory-read")
        self._closed = False

    # ---- both sides ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Enter this transport in the process's registry: peers can read from it from now on.

        Raises:
            TransportError: it was closed.
        """
        if self._closed:
            raise TransportError(f"memory transport {self.id} is closed; it cannot start again")
        with _PEERS_LOCK:
            _PEERS[self.id] = self

    def endpoint(self) -> dict[str, Any]:
        return {"id": self.id, "pid": os.getpid()}

    def reaches(self, peer: dict[str, Any]) -> bool:
        """Whether ``peer`` (an endpoint) is in this process: the only peers it can read."""
        return isinstance(peer, dict) and peer.get("pid") == os.getpid()

    def expose(self, buffers: ShardBuffers) -> None:
        with self._lock:
            self._exposed[id(buffers)] = buffers

    def withdraw(self, buffers: ShardBuffers) -> None:
        with self._lock:
            if self._exposed.get(id(buffers)) is buffers:
                del self._exposed[id(buffers)]

    def _is_exposed(self, buffers: ShardBuffers) -> bool:
        with self._lock:
            return self._exposed.get(id(buffers)) is buffers

    async def close(self) -> None:
        """Leave the registry, forget exposed buffers, and fail reads in flight on both sides
        (they notice between two pieces or wait slices). A second call does nothing."""
        with _PEERS_LOCK:
            if _PEERS.get(self.id) is self:
                del _PEERS[self.id]
        with self._lock:
            self._closed = True
            self._exposed.clear()
        # Reads queued behind the running ones start, see the transport closed, and fail.
        self._executor.shutdown(wait=False)

    # ---- reader side ---------------------------------------------------------------------------

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        name = peer.get("id") if isinstance(peer, dict) else peer
        return f"memory peer {name} region {region} version {version} bytes [{offset}, {offset + length})"

    def check_read(self, peer: Any, where: str, offset: int, length: int, token: bytes | None) -> str:
        if not isinstance(peer, dict) or type(peer.get("id")) is not str:
            raise TransportError(f"memory endpoint {peer!r} has no id (reading {where})")
        if peer.get("pid") != os.getpid():
            raise TransportError(
                f"read of {where}: the peer is in process {peer.get('pid')!r}, this is {os.getpid()}; "
                "the memory transport reaches only its own process"
            )
        return str(peer["id"])

    def read_blocking(self, call: ReadCall) -> int:
        """Copy the range from the peer's buffers (see the module docstring for the steps).

        Raises:
            RangeNotReady: the holder's progress did not cover the range within the wait.
            TransportError: anything else that kept the read from completing.
            InvalidArgument: ``into`` is smaller than the range.
        """
        return self._read_blocking(call.peer, call.where, call.region, call.version, call.offset, call.length, call.into,
                                   call.generation)  # fmt: skip

    def _read_blocking(
        self,
        peer_id: str,
        where: str,
        region: int,
        version: int,
        offset: int,
        length: int,
        into: ShardBuffers,
        generation: int | None,
    ) -> int:
        holder = _PEERS.get(peer_id)
        if holder is None:
            raise TransportError(f"read of {where}: no such peer in this process (never started, closed, or gone)")
        self._check_open(holder, where)
        try:
            src = holder.resolve(region, version)
        except Exception as err:  # a peer's failure is this read's TransportError
            raise TransportError(f"read of {where}: the peer's resolver raised {type(err).__name__}: {err}") from err
        if src is None:
            raise TransportError(f"read of {where}: the peer does not hold that version under that region")
        if not holder._is_exposed(src):
            raise TransportError(f"read of {where}: the peer's buffers for it are not exposed")
        if offset < 0 or length < 0 or offset + length > src.total_bytes:
            raise TransportError(f"read of {where}: the range is outside the shard's {src.total_bytes} bytes")
        if offset + length > into.total_bytes:
            raise InvalidArgument(f"read of {where}: the destination has only {into.total_bytes} bytes")
        gen = self._wait(holder, src, version, offset + length, generation, where)
        self._copy(holder, src, into, offset, length, where)
        self._seqlock(src, version, gen, generation, where)
        return gen

    def _check_open(self, holder: MemoryTransport, where: str) -> None:
        if self._closed:
            raise TransportError(f"memory transport {self.id} closed during the read of {where}")
        if holder._closed:
            raise TransportError(f"read of {where}: the peer closed")

    def _wait(
        self, holder: MemoryTransport, src: ShardBuffers, version: int, end: int, generation: int | None, where: str
    ) -> int:
        """The generation under which ``src`` holds ``version`` with ``[0, end)`` covered."""
        progress = src.progress
        deadline = time.monotonic() + min(self.wait_timeout, holder.wait_timeout)
        g0, v0, _ = progress.snapshot()
        seen = v0 == version
        while True:
            left = deadline - time.monotonic()
            gen, covered = progress.wait_covered(version, end, generation, min(_WAIT_SLICE, max(left, 0.0)))
            if covered:
                return gen
            g, v, verified = progress.snapshot()
            if generation is not None and g != generation:
                raise TransportError(f"read of {where}: the peer's holding changed (generation {g}, the pull began at {generation})")
            if v == version:
                seen = True
            elif seen or (g != g0 and v0 == version):
                raise TransportError(f"read of {where}: the peer's holding changed (it no longer holds the version)")
            self._check_open(holder, where)
            if left <= 0:
                state = f"{verified} bytes verified" if v == version else "it does not hold the version yet"
                raise RangeNotReady(f"read of {where}: the peer's progress did not cover the range in time ({state})")

    def _copy(self, holder: MemoryTransport, src: ShardBuffers, into: ShardBuffers, offset: int, length: int, where: str) -> None:
        pos, end = offset, offset + length
        while True:
            self._check_open(holder, where)
            if not holder._is_exposed(src):
                raise TransportError(f"read of {where}: the peer withdrew the buffers during the read")
            if pos >= end:
                return
            n = min(self.piece_bytes, end - pos)
            _copy_piece(src, into, pos, n)
            pos += n

    def _seqlock(self, src: ShardBuffers, version: int, gen: int, generation: int | None, where: str) -> None:
        after, held, _ = src.progress.snapshot()
        if after != gen or held != version:
            raise TransportError(f"read of {where}: the peer's holding changed during the read (generation {gen} -> {after})")
        if generation is not None and gen != generation:
            raise TransportError(f"read of {where}: holder generation {gen}, the pull began at {generation}")


def _copy_piece(src: ShardBuffers, into: ShardBuffers, offset: int, n: int) -> None:
    """Copy transfer bytes ``[offset, offset + n)`` of ``src`` into the same range of ``into``."""
    if not src.on_cuda and not into.on_cuda:
        _copy_views(src.views(offset, n), into.views(offset, n))
    elif not src.on_cuda:
        pos = offset
        for view in src.views(offset, n):
            into.copy_in(pos, view)
            pos += len(view)
    elif not into.on_cuda:
        pos = offset
        for view in into.views(offset, n):
            src.copy_out(pos, view)
            pos += len(view)
    else:
        staged = memoryview(bytearray(n))
        src.copy_out(offset, staged)
        into.copy_in(offset, staged)


def _copy_views(src: list[memoryview], dst: list[memoryview]) -> None:
    """Copy a run of byte views into another of the same total length (cut differently)."""
    si = di = so = do = 0
    while si < len(src) and di < len(dst):
        s, d = src[si], dst[di]
        n = min(len(s) - so, len(d) - do)
        d[do : do + n] = s[so : so + n]
        so += n
        do += n
        if so == len(s):
            si, so = si + 1, 0
        if do == len(d):
            di, do = di + 1, 0
