"""Fault injection around any transport: slow and wedged peers, peers dying mid-read, corrupted
bytes. For users testing their integration, and for TensorHub's own tests.

Theory of operation
-------------------
:class:`FaultyTransport` wraps one started-or-not transport instance and stands in for it: its
``name`` and capability flags are the inner transport's, and ``start``, ``endpoint``, ``serve``,
``expose``, ``withdraw`` and ``close`` (and any other attribute) go straight to it. Faults act
on the reader side only, in :meth:`FaultyTransport.read`, in stages; a fault is looked at only
by the reads that reach its stage:

1. ``delay``: every delay that fires sleeps its ``seconds`` (they add up); the read goes on.
2. ``stall``: the first stall that fires sleeps its ``seconds``, then the read fails with
   :class:`TransportError`, as against a wedged peer.
3. ``fail``: the first fail that fires, among those whose byte ``at`` the read's range covers,
   reads the bytes before ``at`` through the inner transport and then fails with
   :class:`TransportError`, as against a peer dying mid-read.
4. The inner transport's read.
5. ``corrupt``: every corrupt that fires, among those whose byte ``at`` the range covers,
   flips that byte of the destination (XOR 0xFF) after the read landed: what a checksum must
   catch. The read returns normally.

A fault *matches* a read that reaches its stage when the read is of its ``version`` (if it names
one) and, for ``fail`` and ``corrupt``, covers its byte. It *fires* on a matching read once the
first ``after`` matching reads have gone by, until it has fired ``times`` times (0: no limit).
Every firing is logged in :attr:`FaultyTransport.fired`, in order; a fault counts as fired once
its stage acts on the read, even if the inner transport then fails that read on its own.

Faults are plain msgpack-able dicts, validated when the wrapper is built: a bad one is refused
with :class:`~tensorhub.errors.InvalidArgument` naming the fault and the field. Every sleep is
finite (at most :data:`MAX_SECONDS`) and ends early when the wrapper closes; the read then fails
with :class:`TransportError`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorhub.core.errors import InvalidArgument, TransportError

from .base import Guard, Landed, ReadCall, Resolver, Transport
from .buffers import ShardBuffers

__all__ = ["MAX_SECONDS", "FaultyTransport", "FiredFault", "wrap"]

#: The longest ``delay`` or ``stall`` a fault may ask for.
MAX_SECONDS = 3600.0

_OPS = {
    # op: its required field
    "delay": "seconds",
    "stall": "seconds",
    "fail": "at",
    "corrupt": "at",
}
_COMMON = ("times", "version", "after")


@dataclass(frozen=True, slots=True)
class FiredFault:
    """One firing of fault number ``fault`` (its index in the list), on the read of
    ``[offset, offset + length)`` of ``(region, version)``."""

    fault: int
    op: str
    region: int
    version: int
    offset: int
    length: int


def _validate(index: int, fault: Any) -> dict[str, Any]:
    if not isinstance(fault, dict):
        raise InvalidArgument(f"fault {index} must be a dict with an 'op', got {type(fault).__name__}")
    op = fault.get("op")
    if op not in _OPS:
        raise InvalidArgument(f"fault {index}: field 'op' must be one of {sorted(_OPS)}, got {op!r}")
    required = _OPS[op]
    unknown = sorted(repr(k) for k in fault if k not in ("op", required, *_COMMON))
    if unknown:
        raise InvalidArgument(f"fault {index} ({op}): unknown fields {', '.join(unknown)}; allowed: op, {required}, {', '.join(_COMMON)}")
    if required not in fault:
        raise InvalidArgument(f"fault {index} ({op}): field {required!r} is required")
    if required == "seconds":
        s = fault["seconds"]
        if type(s) not in (int, float) or not math.isfinite(s) or not 0 <= s <= MAX_SECONDS:
            raise InvalidArgument(f"fault {index} ({op}): field 'seconds' must be a finite number in [0, {MAX_SECONDS:g}], got {s!r}")
    for key in ("at", *_COMMON):  # "at" is there only for the ops that require it
        if key in fault:
            v = fault[key]
            if type(v) is not int or v < 0:
                raise InvalidArgument(f"fault {index} ({op}): field {key!r} must be an integer >= 0, got {v!r}")
    return dict(fault)


class FaultyTransport(Transport):
    """``inner`` with ``faults`` injected into its reads (see the module docstring).

    Args:
        inner: the transport to wrap (an instance; the wrapper neither starts nor copies it).
        faults: a list of fault dicts.

    Attributes:
        inner: the wrapped transport.
        faults: the validated faults, in order.
        fired: a :class:`FiredFault` per firing, in order.

    Raises:
        InvalidArgument: ``inner`` is not a Transport, or a fault is malformed.
    """

    def __init__(self, inner: Transport, faults: list[dict[str, Any]]) -> None:
        if not isinstance(inner, Transport):
            raise InvalidArgument(f"FaultyTransport wraps a Transport instance, got {type(inner).__name__}")
        if not isinstance(faults, (list, tuple)):
            raise InvalidArgument(f"faults must be a list of dicts, got {type(faults).__name__}")
        super().__init__(inner.options)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # it stands in for the inner transport
        self.one_sided = inner.one_sided  # type: ignore[misc]  # as above
        self.cuda = inner.cuda  # type: ignore[misc]  # as above
        self.cross_host = inner.cross_host  # type: ignore[misc]  # as above
        self.reports_landing = inner.reports_landing  # type: ignore[misc]  # as above
        self.gathers = inner.gathers  # type: ignore[misc]  # as above
        self.checks_grants = inner.checks_grants  # type: ignore[misc]  # as above
        self.faults = tuple(_validate(i, f) for i, f in enumerate(faults))
        self.fired: list[FiredFault] = []
        self._matched = [0] * len(self.faults)
        self._fire_count = [0] * len(self.faults)
        self._closing = asyncio.Event()
        self.servers = inner.servers

    def set_servers(self, servers: Sequence[str]) -> None:
        super().set_servers(servers)
        self.inner.set_servers(servers)  # the inner transport is the one that starts and advertises

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks (``port``, ``streams``...).
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    # ---- forwarded -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.inner.start()

    def endpoint(self) -> dict[str, Any]:
        return self.inner.endpoint()

    def serve(self, resolver: Resolver) -> None:
        super().serve(resolver)
        self.inner.serve(resolver)

    def guard(self, check: Guard) -> None:
        super().guard(check)
        self.inner.guard(check)

    def resolve(self, region: int, version: int) -> ShardBuffers | None:
        return self.inner.resolve(region, version)

    def expose(self, buffers: ShardBuffers) -> None:
        self.inner.expose(buffers)

    def withdraw(self, buffers: ShardBuffers) -> None:
        self.inner.withdraw(buffers)

    def abort_reads(self, into: ShardBuffers) -> int:
        return self.inner.abort_reads(into)

    async def close(self) -> None:
        self._closing.set()
        await self.inner.close()

    # ---- the reader side, with faults --------------------------------------------------------

    def _fires_on(self, i: int, version: int, offset: int, length: int) -> bool:
        """Whether fault ``i`` fires on this read (counting it as a matching read)."""
        f = self.faults[i]
        if "version" in f and f["version"] != version:
            return False
        if "at" in f and not offset <= f["at"] < offset + length:
            return False
        self._matched[i] += 1
        if self._matched[i] <= f.get("after", 0):
            return False
        times = f.get("times", 1)
        if times and self._fire_count[i] >= times:
            return False
        self._fire_count[i] += 1
        return True

    def _firing(self, op: str, region: int, version: int, offset: int, length: int, first: bool) -> list[int]:
        out = []
        for i, f in enumerate(self.faults):
            if f["op"] == op and self._fires_on(i, version, offset, length):
                self.fired.append(FiredFault(i, op, region, version, offset, length))
                out.append(i)
                if first:
                    break
        return out

    async def _sleep(self, seconds: float, what: str) -> None:
        """Sleep ``seconds``; a close of the wrapper ends it with TransportError."""
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except TimeoutError:
            return
        raise TransportError(f"{self.name} transport closed during an injected {what}")

    def describe_read(self, peer: Any, region: int, version: int, offset: int, length: int) -> str:
        return f"region {region} version {version} bytes [{offset}, {offset + length}) from {peer!r}"

    def read_closed(self) -> bool:
        return False  # the inner read says so, with its own words

    async def read_range(self, call: ReadCall) -> int:
        """The inner transport's read, with the faults that fire on it. With ``landed`` (an
        inner transport that reports landing), a corruption is flipped into the piece that holds
        its byte before the piece is reported, as a corruption on the wire would land. ``token``
        goes to the inner read (when it checks grants).

        Raises:
            TransportError: an injected stall or failure, or the inner read's own errors.
        """
        peer, region, version, offset, length = call.peer, call.region, call.version, call.offset, call.length
        into, generation, landed, token, where = call.into, call.generation, call.landed, call.token, call.where
        kw: dict[str, Any] = {"token": token} if self.checks_grants else {}
        delays = self._firing("delay", region, version, offset, length, first=False)
        if delays:
            await self._sleep(sum(self.faults[i]["seconds"] for i in delays), f"delay of the read of {where}")
        for i in self._firing("stall", region, version, offset, length, first=True):
            seconds = self.faults[i]["seconds"]
            await self._sleep(seconds, f"stall of the read of {where}")
            raise TransportError(f"injected fault {i}: the peer wedged for {seconds:g} s during the read of {where}")
        for i in self._firing("fail", region, version, offset, length, first=True):
            at = self.faults[i]["at"]
            if at > offset:
                await self.inner.read(peer, region, version, offset, at - offset, into, generation, **_landing(landed), **kw)
            raise TransportError(f"injected fault {i}: the peer died at shard byte {at} during the read of {where}")
        if landed is None or into.on_cuda:
            # GPU destinations: flipped after the read, and the read hashed after it landed (a
            # copy that hashes what it lands would hash the bytes before the flip)
            gen = await self.inner.read(peer, region, version, offset, length, into, generation, **kw)
            for i in self._firing("corrupt", region, version, offset, length, first=False):
                _flip(into, self.faults[i]["at"])
            return gen
        flips = [self.faults[i]["at"] for i in self._firing("corrupt", region, version, offset, length, first=False)]

        def land(pos: int, n: int) -> None:
            for at in flips:
                if pos <= at < pos + n:
                    _flip(into, at)
            landed(pos, n)

        return await self.inner.read(peer, region, version, offset, length, into, generation, landed=land, **kw)


def _landing(landed: Landed | None) -> dict[str, Any]:
    return {} if landed is None else {"landed": landed}


def _flip(into: ShardBuffers, at: int) -> None:
    """Invert byte ``at`` of ``into``'s transfer space."""
    if not into.on_cuda:
        view = into.views(at, 1)[0]
        view[0] ^= 0xFF
        return
    byte = memoryview(bytearray(1))
    into.copy_out(at, byte)
    byte[0] ^= 0xFF
    into.copy_in(at, byte)


def wrap(transport: Transport, faults: list[dict[str, Any]]) -> FaultyTransport:
    """``transport`` with ``faults`` injected into its reads (see :class:`FaultyTransport`).

    Raises:
        InvalidArgument: a fault is malformed.
    """
    return FaultyTransport(transport, faults)
