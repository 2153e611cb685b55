"""A transport plugin skeleton: register it, and run the conformance suite on it.

A transport moves byte ranges of a shard from a holder's memory into a reader's memory; the
engine does everything else (registration, layouts, progress, checksums, retries, the server).
The plugin author's manual is the docstring of :mod:`tensorhub.transports.base`; this file is
the smallest plugin that follows it and passes :func:`tensorhub.testing.check_transport`.

``HandoffTransport`` reaches only its own process: where a real transport sends a request over
its network (or posts an RDMA read), this one looks the holder up in a process-wide table and
calls the holder side directly. Everything around that is what every transport must do: check
the request on the holder side (grant token, region and version, range), wait for a partial
holder's progress (bounded), copy in pieces so that a close on either side stops a read, and
apply the seqlock (the holder's generation before and after the copy must match, and match the
``generation`` the caller passed).

To ship a plugin, put the class in a package and declare it in the entry-point group
``tensorhub.transports`` (``handoff = "mypkg.handoff:HandoffTransport"``); handles then start it
when named: ``tensorhub.open(..., transports={"handoff": {}})``. At run time,
``tensorhub.register_transport(name, cls)`` does the same in one process (as below).

    python examples/custom_transport.py
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
import weakref
from typing import Any

import tensorhub
from tensorhub.errors import InvalidArgument, TransportError
from tensorhub.testing import check_transport
from tensorhub.transports.base import Landed, RangeNotReady, Transport, Unauthorized
from tensorhub.transports.buffers import ShardBuffers

_PEERS: weakref.WeakValueDictionary[str, HandoffTransport] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
PIECE = 1 << 20  # bytes copied between two looks at "did either side close?"
SLICE = 0.02  # seconds between those looks while waiting for a partial holder's progress


class HandoffTransport(Transport):
    """In-process transport. Option: ``wait_timeout`` (seconds a read waits for a partial
    holder's progress to cover its range; default 5)."""

    name = "handoff"
    cross_host = False  # it reaches its own process only (``reaches`` below)
    checks_grants = True  # ``read`` takes ``token``; the holder side calls ``admit``

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(set(self.options) - {"wait_timeout"})
        if unknown:
            raise InvalidArgument(f"unknown handoff transport options {unknown}")
        self.wait_timeout = float(self.options.get("wait_timeout", 5.0))
        self.id = f"handoff-{os.getpid()}-{next(_IDS)}"
        self.closed = False

    # ---- both sides ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.closed:
            raise TransportError(f"{self.id} is closed; it cannot start again")
        _PEERS[self.id] = self  # a real transport binds its listener here

    def endpoint(self) -> dict[str, Any]:
        return {"id": self.id, "pid": os.getpid()}  # plain msgpack data: the server hands it to readers

    def reaches(self, peer: dict[str, Any]) -> bool:
        return isinstance(peer, dict) and peer.get("pid") == os.getpid()

    async def close(self) -> None:
        self.closed = True  # reads in flight on either side see it between two pieces and fail
        _PEERS.pop(self.id, None)

    # ---- holder side: what a real transport runs when a request arrives -------------------------

    def open_range(self, region: int, version: int, offset: int, length: int, token: bytes | None, who: str,
                   where: str) -> ShardBuffers:  # fmt: skip
        """The buffers to serve ``[offset, offset + length)`` of ``(region, version)`` from."""
        if self.closed:
            raise TransportError(f"read of {where}: the peer closed")
        refused = self.admit(region, version, token, who)  # before anything is served
        if refused is not None:
            raise Unauthorized(f"read of {where}: {refused}")
        src = self.resolve(region, version)
        if src is None:
            raise TransportError(f"read of {where}: the peer does not hold that version under that region")
        if offset < 0 or length < 0 or offset + length > src.total_bytes:
            raise TransportError(f"read of {where}: the range is outside the shard's {src.total_bytes} bytes")
        return src

    # ---- reader side ---------------------------------------------------------------------------

    async def read(self, peer: dict[str, Any], region: int, version: int, offset: int, length: int,
                   into: ShardBuffers, generation: int | None, landed: Landed | None = None,
                   token: bytes | None = None) -> int:  # fmt: skip
        """Copy ``[offset, offset + length)`` of ``version`` from ``peer`` into ``into``.
        ``landed`` is never passed (``reports_landing`` is False); ``token`` is the reader's grant.

        Returns:
            The holder's generation the bytes were read under.

        Raises:
            RangeNotReady: a partial holder's progress did not cover the range in time.
            Unauthorized: the holder refused the grant token.
            TransportError: anything else that kept the read from completing.
        """
        if not isinstance(peer, dict):
            raise TransportError(f"handoff endpoint {peer!r} is not a dict (region {region} version {version})")
        where = f"handoff peer {peer.get('id')!r} region {region} version {version} bytes [{offset}, {offset + length})"
        if self.closed:
            raise TransportError(f"{self.id} is closed; read of {where} not started")
        # The bulk work runs off the event loop, so that heartbeats are never starved.
        args = (peer, region, version, offset, length, into, generation, token, where)
        return await asyncio.to_thread(self._read_blocking, *args)

    def _read_blocking(self, peer: dict[str, Any], region: int, version: int, offset: int, length: int,
                       into: ShardBuffers, generation: int | None, token: bytes | None, where: str) -> int:  # fmt: skip
        peer_id = peer.get("id")
        holder = _PEERS.get(peer_id) if isinstance(peer_id, str) and peer.get("pid") == os.getpid() else None
        if holder is None:
            raise TransportError(f"read of {where}: no such peer in this process (never started, closed, or gone)")
        src = holder.open_range(region, version, offset, length, token, f"reader {self.id}", where)
        if offset + length > into.total_bytes:
            raise InvalidArgument(f"read of {where}: the destination has only {into.total_bytes} bytes")
        gen = self._wait(holder, src, version, offset + length, generation, where)
        pos, end = offset, offset + length
        while pos < end:
            n = min(PIECE, end - pos)
            staged = memoryview(bytearray(n))  # a real transport lands the bytes in into.views() directly
            src.copy_out(pos, staged)
            self._check_open(holder, where)
            into.copy_in(pos, staged)
            pos += n
        after, held, _ = src.progress.snapshot()  # the seqlock: nothing changed during the copy
        if after != gen or held != version:
            raise TransportError(f"read of {where}: the peer's holding changed during the read")
        return gen

    def _wait(self, holder: HandoffTransport, src: ShardBuffers, version: int, end: int, generation: int | None,
              where: str) -> int:  # fmt: skip
        """The generation under which ``src`` holds ``version`` with ``[0, end)`` covered."""
        deadline = time.monotonic() + min(self.wait_timeout, holder.wait_timeout)
        g0, v0, _ = src.progress.snapshot()
        seen = v0 == version
        while True:
            left = deadline - time.monotonic()
            gen, covered = src.progress.wait_covered(version, end, generation, min(SLICE, max(left, 0.0)))
            if covered:
                return gen
            g, v, _ = src.progress.snapshot()
            if generation is not None and g != generation:
                raise TransportError(f"read of {where}: the peer's holding changed since the pull began")
            seen = seen or v == version
            if v != version and (seen or (g != g0 and v0 == version)):
                raise TransportError(f"read of {where}: the peer no longer holds the version")
            self._check_open(holder, where)
            if left <= 0:
                raise RangeNotReady(f"read of {where}: the peer's progress did not cover the range in time")

    def _check_open(self, holder: HandoffTransport, where: str) -> None:
        if self.closed:
            raise TransportError(f"{self.id} closed during the read of {where}")
        if holder.closed:
            raise TransportError(f"read of {where}: the peer closed")


def main() -> int:
    tensorhub.register_transport("handoff", HandoffTransport)
    outcome = check_transport("handoff", large_bytes=8 << 20)
    for check, result in outcome.items():
        print(f"  {check:20s} {result}")
    failed = [c for c, r in outcome.items() if r != "passed" and r != "skipped: no CUDA device"]
    print(f"handoff: {len(outcome) - len(failed)} of {len(outcome)} conformance checks passed or skipped"
          + (f"; not passed: {failed}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
