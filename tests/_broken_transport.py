"""Deliberately broken ``tcp`` transports for the conformance suite run across processes.

They live in a module of their own so that the suite's holder process can import them by path
(``"tests._broken_transport:ServesOneByteEarly"``). A holder-side break shows that the holder
really runs in the child: the readers in the test process are sound.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from tensorhub.core.errors import TransportError
from tensorhub.transports.base import Resolver
from tensorhub.transports.tcp import (
    _RESP,
    _TRAILER,
    BAD_RANGE,
    CHANGED,
    NO_HOLDING,
    NOT_READY,
    OK,
    TcpTransport,
)


class ServesOneByteEarly(TcpTransport):
    """Holder side: serves the bytes of a range one byte before it (the reader is sound)."""

    def _serve_one(self, conn: socket.socket, region: int, version: int, offset: int, length: int, generation: int, wait_ms: int) -> None:
        super()._serve_one(conn, region, version, max(offset - 1, 0), length, generation, wait_ms)


class IgnoresGeneration(TcpTransport):
    """Reader side: never passes the generation the caller gave (the holder is sound)."""

    async def read(self, peer: dict[str, Any], region: int, version: int, offset: int, length: int, into: Any, generation: int | None) -> int:
        return await super().read(peer, region, version, offset, length, into, None)


class NoSeqlock(TcpTransport):
    """Holder side: reports every read as consistent, even when the holding changed while its
    bytes were sent (the trailer always says OK)."""

    def _serve_one(self, conn: socket.socket, region: int, version: int, offset: int, length: int, generation: int, wait_ms: int) -> None:
        buffers = self.resolve(region, version)
        if buffers is None:
            conn.sendall(_RESP.pack(NO_HOLDING, 0, 0))
            return
        if offset + length > buffers.total_bytes:
            conn.sendall(_RESP.pack(BAD_RANGE, 0, 0))
            return
        gen, covered = buffers.progress.wait_covered(version, offset + length, generation or None, wait_ms / 1000.0)
        if not covered:
            conn.sendall(_RESP.pack(CHANGED if generation and gen != generation else NOT_READY, gen, 0))
            return
        conn.sendall(_RESP.pack(OK, gen, length))
        for view in buffers.views(offset, length):
            conn.sendall(view)
        conn.sendall(_TRAILER.pack(OK, gen))


class DiesWhenServing(TcpTransport):
    """The holder's process exits as soon as it is asked to serve."""

    def serve(self, resolver: Resolver) -> None:
        os._exit(3)


class HangsWhenHolding(TcpTransport):
    """The holder's ``expose`` never returns (a reader's does: only the holder serves)."""

    def expose(self, buffers: Any) -> None:
        if self._resolver is not None:
            time.sleep(3600)


class OnlyAcrossProcesses(TcpTransport):
    """Sound, but refuses to read from a peer in its own process: it passes only when the
    holder really is in another process."""

    def endpoint(self) -> dict[str, Any]:
        return {**super().endpoint(), "pid": os.getpid()}

    async def read(self, peer: dict[str, Any], region: int, version: int, offset: int, length: int, into: Any, generation: int | None) -> int:
        if peer.get("pid") == os.getpid():
            raise TransportError(f"read of region {region} version {version} bytes [{offset}, {offset + length}) from {peer}: the peer is in this process")
        return await super().read(peer, region, version, offset, length, into, generation)
