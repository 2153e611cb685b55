"""The actors a handle runs on: one :class:`Runtime` per event loop, holding the process's
transfer engine (:class:`~tensorhub.runtime.engine.EngineActor`, with its transports) and one
:class:`~tensorhub.runtime.client.ClientActor` per list of server addresses.

A handle acquires the runtime of its loop when it opens (resolving its server list: the embedded
server is started here if none is named) and releases it when it closes. The server list goes
from here to what needs it: the client that talks to those servers, and, when this handle starts
the engine, its transports (which advertise the address of the interface that reaches them).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Sequence

import zmq.asyncio

from tensorhub.core.errors import InvalidArgument
from tensorhub.core.log import get_logger
from tensorhub.handles.defaults import default_transports, failover_timeout
from tensorhub.runtime.client import ClientActor
from tensorhub.runtime.embedded import resolve_servers
from tensorhub.runtime.engine import EngineActor
from tensorhub.scheduling.edges import parse_preference
from tensorhub.transports.base import Transport

__all__ = ["Runtime"]


class Runtime:
    """The actors of one event loop: an engine and a client per list of server addresses.

    The engine starts with the first handle acquired on the loop, with that handle's transports
    (None: :func:`~tensorhub.handles.defaults.default_transports`), each told the server
    addresses that handle resolved (:meth:`~tensorhub.transports.base.Transport.set_servers`:
    they choose the address they advertise by them). Later handles share it; one asking for
    other transports is refused. Everything stops when the last handle is released."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Runtime] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.ctx: zmq.asyncio.Context | None = None
        self.engine: EngineActor | None = None
        self.transports: dict[str, dict] | None = None  # what the first handle asked for (None: defaults)
        self.clients: dict[str, ClientActor] = {}
        self.handles = 0
        self._lock = asyncio.Lock()

    @classmethod
    def current(cls) -> Runtime:
        loop = asyncio.get_running_loop()
        rt = cls._by_loop.get(loop)
        if rt is None:
            rt = cls._by_loop[loop] = cls()
        return rt

    async def acquire(
        self, server: str | Sequence[str] | None, transports: dict[str, dict] | None
    ) -> tuple[ClientActor, EngineActor]:
        async with self._lock:
            self.handles += 1
            try:
                if self.ctx is None:
                    self.ctx = zmq.asyncio.Context()
                addresses = await resolve_servers(self.ctx, server)
                timeout = failover_timeout()
                if self.engine is None:
                    self.engine = await self._start_engine(transports, addresses)
                    self.transports = {n: dict(o or {}) for n, o in (transports or {}).items()} if transports else None
                elif transports is not None and self._differs(transports):
                    raise InvalidArgument(
                        f"this process's transfer engine already runs transports {sorted(self.engine.transports)} "
                        f"(started by its first handle{' with ' + repr(self.transports) if self.transports else ''}); "
                        f"a handle asking for {transports!r} must ask for the same ones, or pass transports=None to "
                        "use the process's (one engine per process; close every handle to start another set)"
                    )
                key = ",".join(addresses)
                client = self.clients.get(key)
                if client is None or client.stopped or client.gave_up is not None:
                    if client is not None:
                        await client.stop()
                    client = self.clients[key] = ClientActor(addresses, self.ctx, self.engine, timeout)
                    await client.start()
                return client, self.engine
            except BaseException:
                self.handles -= 1
                await self._maybe_stop()
                raise

    def _differs(self, transports: dict[str, dict]) -> bool:
        """Whether ``transports`` (a handle's explicit request) is not what the engine runs."""
        assert self.engine is not None
        want = {n: dict(o or {}) for n, o in transports.items()} if isinstance(transports, dict) else transports
        if self.transports is not None:
            return want != self.transports
        return not isinstance(want, dict) or set(want) != set(self.engine.transports) or any(want.values())

    async def _start_engine(self, transports: dict[str, dict] | None, servers: tuple[str, ...]) -> EngineActor:
        """The process's engine, with ``transports`` started (None: the defaults that can run
        here), each told ``servers`` before it starts."""
        from tensorhub.transports.registry import get_transport

        defaults = transports is None
        if transports is None:
            transports = default_transports()
        started: dict[str, Transport] = {}
        try:
            for name, options in transports.items():
                if defaults and not (probe := get_transport(name).probe()).usable:
                    get_logger().info("transport unavailable here; not started", transport=name, why=probe.reason)
                    continue
                options = dict(options or {})
                faults = options.pop("faults", None)  # wrap it in fault injection (testing integrations)
                t = get_transport(name)(options)
                t.set_servers(servers)
                if faults is not None:
                    from tensorhub.transports.faults import wrap

                    t = wrap(t, faults)
                await t.start()
                started[name] = t
        except BaseException:
            for t in started.values():
                await t.close()
            raise
        chunk = os.environ.get("TENSORHUB_CHUNK_BYTES")
        if chunk is not None and (not chunk.isdigit() or int(chunk) < 4096):
            raise InvalidArgument(f"$TENSORHUB_CHUNK_BYTES must be an integer >= 4096, got {chunk!r}")
        try:
            preference = parse_preference(os.environ.get("TENSORHUB_TRANSPORT_PREFERENCE", ""))
        except InvalidArgument as err:
            raise InvalidArgument(f"$TENSORHUB_TRANSPORT_PREFERENCE: {err}") from None
        engine = EngineActor(started, chunk_bytes=int(chunk) if chunk else None, preference=preference)
        await engine.start()
        return engine

    async def release(self) -> None:
        async with self._lock:
            self.handles -= 1
            await self._maybe_stop()

    async def _maybe_stop(self) -> None:
        if self.handles > 0:
            return
        for c in self.clients.values():
            await c.stop()
        self.clients.clear()
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
            self.transports = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
